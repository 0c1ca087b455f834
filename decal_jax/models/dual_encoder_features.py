"""The dual encoder's seqio feature converter: (query, passage[, hard negatives]) task
features -> `dual_encoder.FEATURE_NAMES`' padded model features. Apart from the model so that
`dual_encoder.DualEncoderModel` builds and encodes without seqio or TensorFlow."""
from typing import Mapping

import seqio
import tensorflow as tf

from decal_jax.models.dual_encoder import FEATURE_NAMES


def _spec():
  return seqio.FeatureConverter.FeatureSpec(dtype=tf.int32)


class _PairConverter(seqio.FeatureConverter):
  TASK_FEATURES = {"inputs": _spec(), "targets": _spec()}
  MODEL_FEATURES = {FEATURE_NAMES[k]: _spec() for k in TASK_FEATURES}
  PACKING_FEATURE_DTYPES = None

  def _convert_features(self, ds: tf.data.Dataset, task_feature_lengths):
    ds = self._pack_or_pad(ds, task_feature_lengths)
    return ds.map(lambda ex: {FEATURE_NAMES[k]: ex[k] for k in self.TASK_FEATURES},
                  num_parallel_calls=tf.data.AUTOTUNE)

  def get_model_feature_lengths(self, task_feature_lengths):
    return {FEATURE_NAMES[k]: task_feature_lengths[k] for k in self.TASK_FEATURES}


class _TripleConverter(_PairConverter):
  TASK_FEATURES = {"inputs": _spec(), "targets": _spec(), "negative_targets": _spec()}
  MODEL_FEATURES = {FEATURE_NAMES[k]: _spec() for k in TASK_FEATURES}


class DualEncoderFeatureConverter(seqio.FeatureConverter):
  """(query, passage[, negative]) task features -> the dual encoder's padded model features.
  With 'negative_targets' in the feature lengths the task must provide hard negatives.
  Every text is encoded alone, so packing is refused."""

  TASK_FEATURES = _PairConverter.TASK_FEATURES
  MODEL_FEATURES = _PairConverter.MODEL_FEATURES
  PACKING_FEATURE_DTYPES = None

  def __init__(self, pack: bool = False, **kwargs):
    if pack:
      raise ValueError("A dual encoder encodes every query and passage alone; packed examples "
                       "are not supported. Set the dataset's pack=False.")
    super().__init__(pack=False, **kwargs)
    self._pairs = _PairConverter(pack=False, **kwargs)
    self._triples = _TripleConverter(pack=False, **kwargs)

  def _inner(self, task_feature_lengths):
    return self._triples if "negative_targets" in task_feature_lengths else self._pairs

  def __call__(self, ds: tf.data.Dataset, task_feature_lengths: Mapping[str, int]):
    return self._inner(task_feature_lengths)(ds, task_feature_lengths)

  def _convert_features(self, ds, task_feature_lengths):
    return self._inner(task_feature_lengths)._convert_features(ds, task_feature_lengths)

  def get_model_feature_lengths(self, task_feature_lengths):
    return self._inner(task_feature_lengths).get_model_feature_lengths(task_feature_lengths)
