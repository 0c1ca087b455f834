"""Autoencoding + text continuation tasks and their 1:1 mixtures (CCProxy's training recipe,
DeCAL's "autoencode" ablation and Dodo's autoencoding), on the built-in corpus, on C4 and
on your own text.

| name | source | vocabulary |
|---|---|---|
| decal_builtin_autoencode, decal_builtin_continuation | built-in corpus (no download) | built-in |
| decal_builtin_autoencode_continuation | the two above with task markers, 1:1 | built-in |
| decal_c4_autoencode, decal_c4_continuation | TFDS c4/en:3.1.0 | the model's |
| decal_c4_autoencode_continuation | the two above with task markers, 1:1 | the model's |
| decal_text_autoencode | `<local dir>/text_autoencode/<split>.jsonl`, field "text" | the model's |
| decal_public_text_autoencode | C4 / WikiText-2 / TinyStories samples in `../shared/data/text` (`data/public_text.py`) | built-in |

"The model's" vocabulary is `vocabularies.task_vocabulary()`: the VOCABULARY of the model
gin (T5's for T5.1.1 files, LLaMA's for an imported LLaMA), else the T5 vocabulary. The local
directory is `downstream_tasks.local_data.directory` (gin) or `$DECAL_LOCAL_DATA_DIR`; splits
are train / validation / test. From Python, `register_text_autoencode_task(name, files)`
makes a task of any JSONL files.

Autoencoding tasks report BLEU of the reconstruction (`text_metrics.bleu`) when evaluated.
Their targets are the whole input, so they want TASK_FEATURE_LENGTHS with 'targets' >=
'inputs' (the trainer refuses shorter targets). Documents are read back to back and cut into
chunks of inputs_length - 1 tokens (see decal_jax/data/autoencoding.py).

The 1:1 mixtures read `<prefix>_autoencode_marked` and `<prefix>_continuation_marked`: the
same objectives with each target opened by a task marker ('reconstruct:' / 'continue:',
`autoencoding.marked_*`), so that the decoder is told which of the two it is doing. The
plain tasks (`<prefix>_autoencode`, `decal_text_autoencode`, `decal_public_text_autoencode`)
have no marker: their targets are the input itself.
"""
import functools
from typing import Dict, Mapping, Optional, Tuple

import seqio

from decal_jax import text_metrics
from decal_jax.data import autoencoding, corpus, local_files, public_text, vocabularies
from decal_jax.tasks import downstream_tasks
from decal_jax.tasks.span_corruption_tasks import C4_TFDS_NAME, PreparedTfdsSource

OBJECTIVES = {"autoencode": autoencoding.autoencode, "continuation": autoencoding.continuation}
MARKED_OBJECTIVES = {"autoencode_marked": autoencoding.marked_autoencode,
                     "continuation_marked": autoencoding.marked_continuation}
TEXT_AUTOENCODE_TASK = "decal_text_autoencode"
TEXT_AUTOENCODE_FOLDER = "text_autoencode"
PUBLIC_TEXT_AUTOENCODE_TASK = "decal_public_text_autoencode"


def _register(name: str, source: seqio.DataSource, vocabulary: seqio.Vocabulary,
              objective) -> seqio.Task:
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  features = {k: seqio.Feature(vocabulary, add_eos=True, required=True)
              for k in ("inputs", "targets")}
  metric_fns = [text_metrics.bleu] if objective is autoencoding.autoencode else []
  return seqio.TaskRegistry.add(
      name, source=source, output_features=features, metric_fns=metric_fns,
      preprocessors=[functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
                     seqio.preprocessors.tokenize, objective, autoencoding.add_pretokenized,
                     seqio.preprocessors.append_eos_after_trim])


def register_mixture(prefix: str, source_fn, vocabulary: seqio.Vocabulary) -> seqio.Mixture:
  """`<prefix>_autoencode`, `<prefix>_continuation`, their marked forms
  `<prefix>_{autoencode,continuation}_marked` and the 1:1 mixture of the marked ones,
  `<prefix>_autoencode_continuation`."""
  objectives = {**OBJECTIVES, **MARKED_OBJECTIVES}
  for name, objective in objectives.items():
    _register(f"{prefix}_{name}", source_fn(), vocabulary, objective)
  names = [f"{prefix}_{name}" for name in MARKED_OBJECTIVES]
  mixture = f"{prefix}_autoencode_continuation"
  if mixture in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.remove(mixture)
  return seqio.MixtureRegistry.add(mixture, [(n, 1.0) for n in names])


# ------------------------------------------------------------------------------ your own text
def _text_source(split_files: Mapping[str, str], field: str, bad_lines: str):
  return local_files.JsonlSource(split_files, local_files.Schema({"text": "text"}),
                                 {"text": field}, bad_lines=bad_lines)


def register_text_autoencode_task(name: str, split_files: Mapping[str, str],
                                  field: str = "text", bad_lines: str = "fail",
                                  vocabulary: Optional[seqio.Vocabulary] = None) -> seqio.Task:
  """Autoencoding of your own text: {split: JSONL path or glob}, each line an object whose
  `field` holds the text (a string, or a list of strings joined with newlines). Tokenized
  with `vocabulary`, default the model's (`vocabularies.task_vocabulary()` when read)."""
  source = _text_source(split_files, field, bad_lines)
  return _register(name, source, vocabulary or vocabularies.deferred_vocabulary(),
                   autoencoding.autoencode)


class LocalTextSource(local_files.DeferredSource):
  """`<local dir>/<folder>/<split>.jsonl` with a "text" field, looked up each time data is
  read (so the directory may be bound in gin after the task is registered)."""

  def __init__(self, folder: str, task_name: str = TEXT_AUTOENCODE_TASK):
    self.folder, self.task_name = folder, task_name
    self._sources: Dict[Tuple[str, str], local_files.JsonlSource] = {}
    super().__init__(splits=downstream_tasks.SPLITS)

  def _source(self) -> local_files.JsonlSource:
    folder, files = downstream_tasks.local_split_files(self.folder, ".jsonl")
    if not files:
      raise FileNotFoundError(
          f"{self.task_name} reads train.jsonl / validation.jsonl (one JSON object per "
          f"line with a \"text\" field) from <dir>/{self.folder}/, but "
          f"{folder or '<dir>'} has none: set DECAL_LOCAL_DATA_DIR=<dir> (or gin "
          "downstream_tasks.local_data.directory) and put the files there.")
    key = (str(folder), downstream_tasks.local_data()[1])
    if key not in self._sources:
      self._sources[key] = _text_source(files, "text", key[1])
    return self._sources[key]



register_mixture("decal_builtin", corpus.data_source, vocabularies.builtin_vocabulary())
register_mixture("decal_c4", lambda: PreparedTfdsSource(C4_TFDS_NAME),
                 vocabularies.deferred_vocabulary())
_register(TEXT_AUTOENCODE_TASK, LocalTextSource(TEXT_AUTOENCODE_FOLDER),
          vocabularies.deferred_vocabulary(), autoencoding.autoencode)
_register(PUBLIC_TEXT_AUTOENCODE_TASK, public_text.data_source(),
          vocabularies.builtin_vocabulary(), autoencoding.autoencode)
