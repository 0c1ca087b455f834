"""Span-corruption pretraining tasks (DeCAL pretrains with T5's denoising objective)."""
import functools
import os

import seqio

from decal_jax.data import corpus, span_corruption, vocabularies

C4_TFDS_NAME = "c4/en:3.1.0"


class TfdsSourceWithHelp(seqio.TfdsDataSource):
  """A TFDS source whose missing-data error says how to prepare the data."""

  def get_dataset(self, *args, **kwargs):
    try:
      return super().get_dataset(*args, **kwargs)
    except Exception as e:  # tfds raises several types for "not prepared"
      raise FileNotFoundError(
          f"TFDS dataset {self.tfds_dataset.name!r} is not prepared in data dir "
          f"{self.tfds_dataset.data_dir!r} ({type(e).__name__}: {e}). Prepare it with "
          f"`tfds build {self.tfds_dataset.name.split(':')[0]} --data_dir=DIR` and set "
          "DECAL_TFDS_DATA_DIR=DIR, or train on the built-in corpus instead with "
          "MIXTURE_OR_TASK_NAME='decal_builtin_span_corruption' (no download needed).") from e

  def num_input_examples(self, split):
    try:
      return super().num_input_examples(split)
    except KeyError:  # split sizes unknown (e.g. tfds.testing.mock_data): no in-memory cache
      return None


def _preprocessors():
  return [
      functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
      seqio.preprocessors.tokenize,
      span_corruption.concatenate_and_split,
      span_corruption.span_corruption,
      seqio.preprocessors.append_eos_after_trim,
  ]


def _features(vocabulary):
  return {"inputs": seqio.Feature(vocabulary, add_eos=True, required=True),
          "targets": seqio.Feature(vocabulary, add_eos=True, required=True)}


def _register(name, source, vocabulary):
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)  # re-import (e.g. in a notebook) replaces the task
  seqio.TaskRegistry.add(name, source=source, preprocessors=_preprocessors(),
                         output_features=_features(vocabulary),
                         metric_fns=[])


_register("decal_builtin_span_corruption", corpus.data_source(),
          vocabularies.builtin_vocabulary())
_register("decal_c4_span_corruption",
          TfdsSourceWithHelp(C4_TFDS_NAME, splits=("train", "validation"),
                             tfds_data_dir=os.environ.get("DECAL_TFDS_DATA_DIR")),
          vocabularies.t5_vocabulary(check=False))
