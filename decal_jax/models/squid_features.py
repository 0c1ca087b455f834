"""Squid's seqio feature converters (seqio, TensorFlow): `SquidFeatureConverter` for
`models.SquidModel` / `QueryModel` (named there by `base.SeqioConverter`, so the model imports
without seqio), `SquidT5XFeatureConverter` for T5X's own EncoderDecoderModel (gin/t5x/squid.gin)."""
from typing import Mapping

import seqio
import tensorflow as tf


class SquidFeatureConverter(seqio.EncDecFeatureConverter):
  """Squid's task features -> model features. Tasks give 'inputs' (the context the small
  decoder compresses), 'query' (what the large decoder reads after the compressed context,
  possibly empty) and 'targets' (what it must produce):

    encoder_input_tokens  <- inputs              query_tokens <- query
    decoder_target_tokens <- targets             decoder_input_tokens <- targets shifted right
    decoder_loss_weights  <- 1 on real target tokens

  Each example compresses its own context, so packing is refused.
  """

  TASK_FEATURES = dict(seqio.EncDecFeatureConverter.TASK_FEATURES,
                       query=seqio.FeatureConverter.FeatureSpec(dtype=tf.int32))
  MODEL_FEATURES = dict(seqio.EncDecFeatureConverter.MODEL_FEATURES,
                        query_tokens=seqio.FeatureConverter.FeatureSpec(dtype=tf.int32))

  def __init__(self, pack: bool = False, **kwargs):
    if pack:
      raise ValueError("Squid compresses one context per example; packed examples are not "
                       "supported. Set the dataset's pack=False (the default in our gin runs).")
    super().__init__(pack=False, **kwargs)

  def _convert_example(self, features):
    return dict(super()._convert_example(features), query_tokens=features["query"])

  def get_model_feature_lengths(self, task_feature_lengths):
    return dict(super().get_model_feature_lengths(task_feature_lengths),
                query_tokens=task_feature_lengths["query"])


class SquidT5XFeatureConverter(SquidFeatureConverter):
  """Squid's task features for `t5x.models.EncoderDecoderModel` around `squid.SquidT5X`,
  which T5X feeds no query feature: the query joins the context in the encoder input,

    encoder_input_tokens <- [inputs padded to n; query padded to q]   ([n + q])

  (targets as `SquidFeatureConverter`). `query_length` (gin: QUERY_LENGTH, also the
  network's) must equal TASK_FEATURE_LENGTHS['query'], where the network splits the two.
  """

  MODEL_FEATURES = seqio.EncDecFeatureConverter.MODEL_FEATURES

  def __init__(self, pack: bool = False, query_length: int = 16, **kwargs):
    self.query_length = query_length
    super().__init__(pack=pack, **kwargs)

  def _check_query_length(self, task_feature_lengths: Mapping[str, int]) -> None:
    if task_feature_lengths.get("query") != self.query_length:
      raise ValueError(
          f"TASK_FEATURE_LENGTHS['query'] = {task_feature_lengths.get('query')} but the "
          f"network reads the query from the last QUERY_LENGTH = {self.query_length} encoder "
          f"columns: set --gin.QUERY_LENGTH={task_feature_lengths.get('query')} (or the "
          "'query' length to QUERY_LENGTH).")

  def _convert_features(self, ds, task_feature_lengths):
    self._check_query_length(task_feature_lengths)
    return super()._convert_features(ds, task_feature_lengths)

  def _convert_example(self, features):
    converted = super()._convert_example(features)
    query = converted.pop("query_tokens")  # [q]
    converted["encoder_input_tokens"] = tf.concat([converted["encoder_input_tokens"], query],
                                                  axis=0)  # [n + q]
    return converted

  def get_model_feature_lengths(self, task_feature_lengths):
    self._check_query_length(task_feature_lengths)
    lengths = super().get_model_feature_lengths(task_feature_lengths)
    query = lengths.pop("query_tokens")
    return dict(lengths, encoder_input_tokens=lengths["encoder_input_tokens"] + query)
