"""Span-corruption pretraining tasks (DeCAL pretrains with T5's denoising objective).

Both tasks: text -> tokenize -> concatenate_and_split -> span_corruption -> EOS, with
output features 'inputs' and 'targets' (EOS added, required). Importing this module again
replaces the tasks instead of failing.
"""
import functools
from typing import Optional

import seqio
import tensorflow as tf

from decal_jax import settings
from decal_jax.data import corpus, span_corruption, vocabularies

BUILTIN_TASK = "decal_builtin_span_corruption"
C4_TASK = "decal_c4_span_corruption"
C4_TFDS_NAME = "c4/en:3.1.0"
SPLITS = ("train", "validation")

# What TFDS raises when a dataset has not been prepared in the data dir.
_NOT_PREPARED = (AssertionError, FileNotFoundError, tf.errors.NotFoundError)


class PreparedTfdsSource(seqio.TfdsDataSource):
  """A read-only TFDS source (it never starts a download or a build) whose missing-data
  error says how to prepare the data.

  The data dir is, first to last: seqio's override (T5X's `--tfds_data_dir` flag sets it),
  `$DECAL_TFDS_DATA_DIR` read when the data is first used, TFDS's own default
  (`$TFDS_DATA_DIR` or ~/tensorflow_datasets).
  """

  def __init__(self, tfds_name: str, splits=SPLITS):
    super().__init__(tfds_name, splits=splits, read_only=True)
    self._split_map = {s: s for s in splits}
    self._loaders = {}

  @property
  def tfds_dataset(self) -> seqio.utils.LazyTfdsLoader:
    data_dir = settings.get("DECAL_TFDS_DATA_DIR")
    if data_dir not in self._loaders:
      self._loaders[data_dir] = seqio.utils.LazyTfdsLoader(
          self._tfds_dataset.name, data_dir=data_dir, split_map=self._split_map,
          read_only=True)
    return self._loaders[data_dir]

  def get_dataset(self, split: Optional[str] = None, *args, **kwargs) -> tf.data.Dataset:
    try:
      return super().get_dataset(split, *args, **kwargs)
    except _NOT_PREPARED as e:
      raise FileNotFoundError(self._how_to_prepare(e)) from e

  def list_shards(self, split: str):
    try:  # seqio lists shards first when it shards over several processes
      return super().list_shards(split)
    except (KeyError, *_NOT_PREPARED) as e:
      raise FileNotFoundError(self._how_to_prepare(e)) from e

  def _how_to_prepare(self, error: Exception) -> str:
    name = self.tfds_dataset.name
    return (
        f"TFDS dataset {name!r} is not prepared in data dir {self.tfds_dataset.data_dir!r} "
        f"({type(error).__name__}: {error}). Prepare it with `tfds build "
        f"{name.split(':')[0]} --data_dir=DIR` and then set DECAL_TFDS_DATA_DIR=DIR (or pass "
        "--tfds_data_dir=DIR to T5X). Or train on the built-in corpus: the task "
        f"'{BUILTIN_TASK}' needs no download (MIXTURE_OR_TASK_NAME='{BUILTIN_TASK}').")

  def num_input_examples(self, split: str) -> Optional[int]:
    try:
      return super().num_input_examples(split)
    except (KeyError, *_NOT_PREPARED):  # sizes unknown (not prepared, or mock data)
      return None


def _preprocessors():
  return [
      functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
      seqio.preprocessors.tokenize,
      span_corruption.concatenate_and_split,
      span_corruption.span_corruption,
      seqio.preprocessors.append_eos_after_trim,
  ]


def _features(vocabulary: seqio.Vocabulary):
  return {"inputs": seqio.Feature(vocabulary, add_eos=True, required=True),
          "targets": seqio.Feature(vocabulary, add_eos=True, required=True)}


def register(name: str, source: seqio.DataSource, vocabulary: seqio.Vocabulary) -> seqio.Task:
  """Registers (or re-registers) a span-corruption task over `source`'s 'text' feature."""
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(name, source=source, preprocessors=_preprocessors(),
                                output_features=_features(vocabulary), metric_fns=[])


def register_builtin(vocab_size: int = vocabularies.BUILTIN_VOCAB_SIZE) -> seqio.Task:
  """`decal_builtin_span_corruption`: the built-in corpus and its own vocabulary."""
  return register(BUILTIN_TASK, corpus.data_source(),
                  vocabularies.builtin_vocabulary(vocab_size))


def register_c4(vocab_path: Optional[str] = None) -> seqio.Task:
  """`decal_c4_span_corruption`: TFDS c4/en:3.1.0 'text' with the T5 vocabulary (path as
  in `vocabularies.t5_vocabulary`; a missing local file is reported on first use)."""
  return register(C4_TASK, PreparedTfdsSource(C4_TFDS_NAME),
                  vocabularies.t5_vocabulary(vocab_path, check=False))


register_builtin()
register_c4()
