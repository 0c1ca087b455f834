"""The compressed multi-vector dual encoder as a T5X model class, with T5X Retrieval's names.

Importable only where T5X is (`import t5x`; docs/t5x.md installs it). It wraps
`networks.dual_encoder.DualEncoder` for `t5x.train` / `t5x.eval` / `t5x.infer`, reusing
`models.dual_encoder.DualEncoderModel` (ours) for the encoding, the loss and the scores:

    left_encoder_input_tokens            [batch, length]         queries
    right_encoder_input_tokens           [batch, length]         their relevant passages
    right_negative_encoder_input_tokens  [batch, n_neg, length]  hard negatives (or
                                         [batch, length]: one), read when use_negatives

Relevance is MaxSim; `logit_scale` (T5X Retrieval's default, 100) multiplies it before
the in-batch softmax, a learnt parameter initialised at log(logit_scale) when
`learnable_logit_scale`; the loss is T5X Retrieval's two-way one when `bidirectional`
(`models.dual_encoder.in_batch_loss`, ours, computes it). `inference_mode` picks what
`predict_batch` returns: 'encode' / 'encode_left' the queries' vectors, 'encode_right'
the passages' vectors (`[batch, m, d]`, with `valid` `[batch, m]` in the aux),
'similarity' the MaxSim of each query with its own passage (`[batch]`, unscaled; the aux
holds both sides' encodings, which `t5x.eval`'s retrieval metrics rank:
`retrieval.seqio_metric`). gin: gin/t5x/de_decal_t5_1_1_*.gin; eval:
gin/t5x/runs/eval_dual_encoder.gin.
"""
from typing import Any, Mapping, Optional, Tuple

import jax
import seqio
from clu import metrics as clu_metrics
from t5x import metrics as metrics_lib
from t5x import models as t5x_models

from decal_jax.models import dual_encoder, dual_encoder_features

Array = jax.Array
Batch = Mapping[str, Array]
INFERENCE_MODES = ("encode", "encode_left", "encode_right", "similarity")
NEGATIVES = "right_negative_encoder_input_tokens"


class DualEncoderModel(t5x_models.BaseTransformerModel):
  """T5X's model interface (loss / eval / predict / score / init) around our dual encoder."""

  FEATURE_CONVERTER_CLS = dual_encoder_features.DualEncoderFeatureConverter

  def __init__(self, module, input_vocabulary: seqio.Vocabulary,
               output_vocabulary: Optional[seqio.Vocabulary] = None, optimizer_def=None,
               inference_mode: str = "encode", use_negatives: bool = False,
               logit_scale: float = dual_encoder.DEFAULT_LOGIT_SCALE,
               learnable_logit_scale: bool = False, bidirectional: bool = True):
    if inference_mode not in INFERENCE_MODES:
      raise ValueError(f"DualEncoderModel.inference_mode must be one of {INFERENCE_MODES}, "
                       f"got {inference_mode!r}.")
    output_vocabulary = output_vocabulary or input_vocabulary
    super().__init__(module=module, input_vocabulary=input_vocabulary,
                     output_vocabulary=output_vocabulary, optimizer_def=optimizer_def)
    self.inference_mode = inference_mode
    self.use_negatives = use_negatives
    self.ours = dual_encoder.DualEncoderModel(
        module, input_vocabulary, output_vocabulary, logit_scale=logit_scale,
        learnable_logit_scale=learnable_logit_scale, bidirectional=bidirectional)
    self.logit_scale = self.ours.logit_scale  # validated there

  @property
  def learnable_logit_scale(self) -> bool:
    return self.ours.learnable_logit_scale

  @property
  def bidirectional(self) -> bool:
    return self.ours.bidirectional

  def _with_negatives(self, batch: Batch) -> Batch:
    """The batch the loss reads: hard negatives only when use_negatives (then required)."""
    if not self.use_negatives:
      return {k: v for k, v in batch.items() if k != NEGATIVES}
    if NEGATIVES not in batch:
      raise ValueError(f"DualEncoderModel.use_negatives is True but the batch has no "
                       f"{NEGATIVES!r}: give the task hard negatives ('negative_targets', "
                       f"e.g. decal_msmarco_retrieval_negatives) or set use_negatives=False.")
    return batch

  def get_initial_variables(self, rng: Array, input_shapes: Mapping[str, Tuple[int, ...]],
                            input_types: Optional[Mapping[str, Any]] = None):
    return self.ours.get_initial_variables(rng, input_shapes, input_types)

  def _compute_logits(self, params, batch: Batch, dropout_rng: Optional[Array] = None):
    """`[b, c]`: logit_scale * MaxSim of every query with every candidate (the b positives,
    then the hard negatives); padding candidates at -1e9."""
    return self.ours.logits(params, self._with_negatives(batch), dropout_rng)

  def loss_fn(self, params, batch: Batch, dropout_rng: Optional[Array]):
    """(mean in-batch softmax cross entropy (ours), T5X metrics: loss, accuracy, steps/s)."""
    loss, sums = self.ours.loss_fn(params, self._with_negatives(batch), dropout_rng)
    metrics = {"loss": metrics_lib.AveragePerStep(total=loss),
               "accuracy": clu_metrics.Average(total=sums["correct"],
                                               count=sums["num_queries"]),
               "timing/steps_per_second": metrics_lib.StepsPerTime.from_model_output()}
    return loss, metrics

  def score_batch(self, params, batch: Batch, return_intermediates: bool = False):
    """MaxSim of each query with its own passage, `[batch]`."""
    if return_intermediates:
      raise ValueError("DualEncoderModel.score_batch has no intermediates to return.")
    return self.ours.score_batch(params, batch)

  def predict_batch_with_aux(self, params, batch: Batch, rng: Optional[Array] = None):
    """What `inference_mode` names (see the module docstring), and an aux dict."""
    del rng
    if self.inference_mode == "similarity":
      queries, passages = self.ours.encode_pairs(params, batch)
      return dual_encoder.pair_maxsim(queries, passages), {
          "query_vectors": queries.vectors, "query_valid": queries.valid,
          "passage_vectors": passages.vectors, "passage_valid": passages.valid}
    side, key = (("passage", "right_encoder_input_tokens")
                 if self.inference_mode == "encode_right" else
                 ("query", "left_encoder_input_tokens"))
    encoded = self.ours.encode(params, batch[key], side)
    return encoded.vectors, {"valid": encoded.valid}  # [batch, m, d], [batch, m]
