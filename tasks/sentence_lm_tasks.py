"""Sentence-segmented language-modelling tasks (GPTHF's data): like lm_tasks, but every
sentence is followed by the end-of-sentence token (`data.sentences.sentences_lm`).

| name | source | vocabulary |
|---|---|---|
| decal_builtin_sentence_lm | the built-in corpus (no download) | built-in |
| decal_c4_sentence_lm | TFDS c4/en:3.1.0 | the model's |
| decal_text_sentence_lm | plain-text files `<local dir>/text_lm/<split>.txt` (decal_text_lm's) | the model's |
| decal_real_text_sentence_lm | C4 / WikiText-2 / TinyStories in ../shared/data (`data.real_text`) | the model's |

`register_text_sentence_lm_task(name, {split: path or glob})` makes a task of any plain-text
files (one paragraph per line; blank lines are skipped; lines that are not UTF-8 are
reported as lm_tasks' are).

Features: 'targets' (add_eos=False; the end id is the vocabulary's top sentinel, see
`sentences.sentence_end_id`) and 'sentence_ids' (each position's sentence index within its
chunk; seqio's DecoderFeatureConverter ignores it; it is there for inspection and tests).
Sentences longer than `sentences_lm.max_sentence_length` (which must equal
GpthfConfig.max_sentence_length) are cut and counted (`sentences.sentence_split_counts()`).
Evaluation reports perplexity from the teacher-forced loss; there is no metric function.
"""
import functools
from typing import Mapping, Optional

import seqio

from decal_jax.data import corpus, real_text, sentences, vocabularies
from decal_jax.tasks import lm_tasks
from decal_jax.tasks.span_corruption_tasks import C4_TFDS_NAME, PreparedTfdsSource

TEXT_SENTENCE_LM_TASK = "decal_text_sentence_lm"


def _register(name: str, source: seqio.DataSource, vocabulary: seqio.Vocabulary,
              lines: bool = False) -> seqio.Task:
  return lm_tasks.register_targets_task(
      name, source, vocabulary, [functools.partial(sentences.sentences_lm, task_name=name)],
      lines)


def register_text_sentence_lm_task(name: str, split_files: Mapping[str, str],
                                   vocabulary: Optional[seqio.Vocabulary] = None,
                                   bad_lines: str = "fail") -> seqio.Task:
  """Sentence LM task over your plain-text files, {split: path or glob}; tokenized with
  `vocabulary`, default the model's (`vocabularies.task_vocabulary()` when read). A line
  that is not UTF-8 stops with its file and line, or is left out with bad_lines='skip'."""
  source = lm_tasks._text_source(split_files, bad_lines)
  return _register(name, source, vocabulary or vocabularies.deferred_vocabulary(), lines=True)


_register("decal_builtin_sentence_lm", corpus.data_source(), vocabularies.builtin_vocabulary())
_register("decal_c4_sentence_lm", PreparedTfdsSource(C4_TFDS_NAME),
          vocabularies.deferred_vocabulary())
_register("decal_real_text_sentence_lm", real_text.data_source(),
          vocabularies.deferred_vocabulary())
_register(TEXT_SENTENCE_LM_TASK, lm_tasks._LocalTextLines(),
          vocabularies.deferred_vocabulary(), lines=True)
