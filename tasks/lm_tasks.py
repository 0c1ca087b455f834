"""Language-modelling tasks (targets only; the decoder-only models' data): documents are
tokenized, read back to back and cut into chunks of TASK_FEATURE_LENGTHS['targets'] tokens.
Evaluation reports perplexity per subword (teacher-forced; `metrics.summarize`).

| name | source | vocabulary |
|---|---|---|
| decal_builtin_lm | the built-in corpus (no download) | built-in |
| decal_c4_lm | TFDS c4/en:3.1.0 | the model's |
| decal_text_lm | plain-text files `<local dir>/text_lm/<split>.txt` | the model's |

`register_text_lm_task(name, {split: path or glob})` makes a task of any plain-text files
(one line per record, e.g. WikiText's raw files; blank lines are skipped). A line that is
not UTF-8 stops the run with its file and line, or is left out with bad_lines='skip'
($DECAL_BAD_LINES=skip for decal_text_lm). A file whose first lines are JSON objects is
read as text all the same, with a WARNING naming it (`local_files.TextLineSource`).
"""
import functools
from typing import Dict, Mapping, Optional, Tuple

import seqio
import tensorflow as tf

from decal_jax.data import corpus, language_modelling, local_files, vocabularies
from decal_jax.tasks import downstream_tasks
from decal_jax.tasks.span_corruption_tasks import C4_TFDS_NAME, PreparedTfdsSource

TEXT_LM_TASK = "decal_text_lm"
TEXT_LM_FOLDER = "text_lm"


def text_lines(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """seqio preprocessor: raw lines (scalar strings) -> {'text': line}, blank lines dropped
  (and Windows line ends stripped)."""
  lines = dataset.map(lambda line: {"text": tf.strings.strip(line)})
  return lines.filter(lambda ex: tf.strings.length(ex["text"]) > 0)


def register_targets_task(name: str, source: seqio.DataSource, vocabulary: seqio.Vocabulary,
                          preprocessors, lines: bool = False) -> seqio.Task:
  """A targets-only task (registered anew if the name exists): `text_lines` first when the
  source yields raw lines, then `preprocessors`."""
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name, source=source,
      output_features={"targets": seqio.Feature(vocabulary, add_eos=False, required=True)},
      preprocessors=([text_lines] if lines else []) + list(preprocessors),
      metric_fns=[])


def _register(name: str, source: seqio.DataSource, vocabulary: seqio.Vocabulary,
              lines: bool = False) -> seqio.Task:
  return register_targets_task(name, source, vocabulary, [
      functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
      seqio.preprocessors.tokenize,
      language_modelling.lm_chunks], lines)


def _text_source(split_files: Mapping[str, str], bad_lines: str) -> seqio.DataSource:
  for split, pattern in split_files.items():
    if not tf.io.gfile.glob(pattern):
      raise FileNotFoundError(f"No text file matches {pattern!r} (split {split!r}).")
  return local_files.TextLineSource(split_files, bad_lines)


def register_text_lm_task(name: str, split_files: Mapping[str, str],
                          vocabulary: Optional[seqio.Vocabulary] = None,
                          bad_lines: str = "fail") -> seqio.Task:
  """LM task over your plain-text files, {split: path or glob}; tokenized with
  `vocabulary`, default the model's (`vocabularies.task_vocabulary()` when read)."""
  return _register(name, _text_source(split_files, bad_lines),
                   vocabulary or vocabularies.deferred_vocabulary(), lines=True)


class _LocalTextLines(local_files.DeferredSource):
  """`<local dir>/text_lm/<split>.txt`, looked up when read (the directory may be bound in
  gin or $DECAL_LOCAL_DATA_DIR after import)."""

  def __init__(self):
    self._sources: Dict[Tuple[str, str], local_files.TextLineSource] = {}
    super().__init__(splits=downstream_tasks.SPLITS)

  def _source(self) -> local_files.TextLineSource:
    folder, files = downstream_tasks.local_split_files(TEXT_LM_FOLDER, ".txt")
    if not files:
      raise FileNotFoundError(
          f"{TEXT_LM_TASK} reads train.txt / validation.txt from <dir>/{TEXT_LM_FOLDER}/, but "
          f"{folder or '<dir>'} has none: set DECAL_LOCAL_DATA_DIR=<dir> (or gin "
          "downstream_tasks.local_data.directory) and put the files there.")
    key = (str(folder), downstream_tasks.local_data()[1])
    if key not in self._sources:  # checked once per folder and policy
      self._sources[key] = local_files.TextLineSource(files, key[1])
    return self._sources[key]



_register("decal_builtin_lm", corpus.data_source(), vocabularies.builtin_vocabulary())
_register("decal_c4_lm", PreparedTfdsSource(C4_TFDS_NAME), vocabularies.deferred_vocabulary())
_register(TEXT_LM_TASK, _LocalTextLines(), vocabularies.deferred_vocabulary(), lines=True)
