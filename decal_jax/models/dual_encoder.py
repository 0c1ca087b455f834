"""T5X-Retrieval-style dual-encoder model: feature converter, in-batch softmax loss, scoring.

Task features (T5X Retrieval's names) -> model features:

    inputs            -> left_encoder_input_tokens            (the query)
    targets           -> right_encoder_input_tokens           (a relevant passage)
    negative_targets  -> right_negative_encoder_input_tokens  (optional: hard negatives,
                         one per query [batch, length] or several [batch, n_neg, length])

The loss treats every other passage of the (global) batch as a negative for a query, plus
the hard negatives when the task has them: softmax over MaxSim scores / temperature. The
feature converter (seqio) is in `dual_encoder_features.py`.
"""
from typing import TYPE_CHECKING, Any, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax.models import base
from decal_jax.retrieval import maxsim

if TYPE_CHECKING:
  import seqio

Array = jax.Array
Batch = Mapping[str, Array]

FEATURE_NAMES = {"inputs": "left_encoder_input_tokens",
                 "targets": "right_encoder_input_tokens",
                 "negative_targets": "right_negative_encoder_input_tokens"}


class DualEncoderModel(base.BaseModel):
  """Loss / eval / scoring / encoding around `networks.dual_encoder.DualEncoder`. It
  encodes, it does not decode text (retrieval is `decal_jax.retrieve`).

  `temperature` divides the MaxSim scores before the softmax (1.0 suits multi-vector sums
  of cosines; a single normalised vector wants about 0.05)."""

  # dual_encoder_features.DualEncoderFeatureConverter (seqio, TF), imported when called, so
  # the model builds and encodes without them (bench_retrieval on a GPU image).
  FEATURE_CONVERTER_CLS = base.SeqioConverter("DualEncoderFeatureConverter",
                                              "decal_jax.models.dual_encoder_features")
  PREDICTS_TEXT = False

  def __init__(self, module, input_vocabulary: "seqio.Vocabulary",
               output_vocabulary: Optional["seqio.Vocabulary"] = None, temperature: float = 1.0):
    if temperature <= 0:
      raise ValueError(f"DualEncoderModel.temperature must be positive, got {temperature}.")
    super().__init__(module, input_vocabulary, output_vocabulary or input_vocabulary)
    self.temperature = temperature

  # ------------------------------------------------------------------------- init
  @property
  def vocab_size(self) -> int:
    return self.module.config.encoder.vocab_size

  def compression_ratio(self, task_feature_lengths: Mapping[str, int]) -> float:
    """Passage tokens per kept vector: the indexed side's ratio (queries have their own,
    `query_compression_ratio`)."""
    del task_feature_lengths
    return int(self.module.config.passage_compression_ratio)

  def input_shapes(self, task_feature_lengths: Mapping[str, int]) -> base.Shapes:
    return {FEATURE_NAMES[k]: (1, n) for k, n in task_feature_lengths.items()
            if k in FEATURE_NAMES}

  def get_initial_variables(self, rng: Array, input_shapes: Mapping[str, Tuple[int, ...]],
                            input_types: Optional[Mapping[str, Any]] = None):
    """Variables (`params`, `params_axes`); both sides are traced, so both ratios' parts
    (e.g. the latent vector for passages only) are created."""
    del input_types
    left = jnp.ones(input_shapes["left_encoder_input_tokens"], jnp.int32)
    right = jnp.ones(input_shapes["right_encoder_input_tokens"], jnp.int32)
    return self.module.init(rng, left, right, enable_dropout=False)

  # ------------------------------------------------------------------------- loss
  def encode_candidates(self, params, batch: Batch, dropout_rng: Optional[Array] = None):
    """(queries `Encoded`, passages `[c, m, d]`, passage_valid `[c, m]`, candidates `[c]`):
    the c candidates are the b positives in query order, then the hard negatives
    (`[b, n]` one per query, or `[b, n_neg, n]` several, flattened row by row)."""
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
    negatives = batch.get("right_negative_encoder_input_tokens")
    if negatives is not None:
      negatives = negatives.reshape(-1, negatives.shape[-1])  # [b * n_neg, n]
    queries, positives, negs = self.module.apply(
        {"params": params}, batch["left_encoder_input_tokens"],
        batch["right_encoder_input_tokens"], negatives, enable_dropout=rngs is not None,
        rngs=rngs)
    passages, passage_valid = positives.vectors, positives.valid
    candidates = maxsim.has_tokens(batch["right_encoder_input_tokens"])  # [b]
    if negs is not None:
      passages, passage_valid = _stack_ragged(positives, negs)
      candidates = jnp.concatenate([candidates, maxsim.has_tokens(negatives)])  # [c]
    return queries, passages, passage_valid, candidates

  def loss_fn(self, params, batch: Batch, dropout_rng: Optional[Array]):
    """(mean in-batch softmax loss, sums: loss_sum, correct, num_queries)."""
    queries, passages, passage_valid, candidates = self.encode_candidates(
        params, batch, dropout_rng)
    query_weights = maxsim.has_tokens(batch["left_encoder_input_tokens"])
    return maxsim.in_batch_softmax_loss(queries.vectors, queries.valid, passages,
                                        passage_valid, query_weights, candidates,
                                        self.temperature)

  def summarize(self, sums: Mapping[str, float]):
    """Loss and in-batch accuracy over the queries."""
    return maxsim.summarize(sums)

  def num_tokens(self, batch: Mapping[str, np.ndarray]) -> int:
    return int(sum(np.sum(np.asarray(batch[k]) > 0) for k in FEATURE_NAMES.values()
                   if k in batch))

  # ------------------------------------------------------------------------- use
  def encode(self, params, tokens: Array, side: str):
    """`[batch, n]` tokens -> `Encoded(vectors [batch, m, d], valid [batch, m])`."""
    return self.module.apply({"params": params}, jnp.asarray(tokens, jnp.int32), side,
                             method=self.module.encode)

  def encode_pairs(self, params, batch: Batch):
    """(queries `Encoded`, their passages `Encoded`) of a batch of pairs."""
    return (self.encode(params, batch["left_encoder_input_tokens"], "query"),
            self.encode(params, batch["right_encoder_input_tokens"], "passage"))

  def score_batch(self, params, batch: Batch) -> Array:
    """MaxSim of each query with its own passage, `[batch]`."""
    return pair_maxsim(*self.encode_pairs(params, batch))


def pair_maxsim(queries, passages) -> Array:
  """MaxSim of query row i with passage row i (`Encoded` batches) -> `[batch]`."""
  return jax.vmap(lambda qv, qm, pv, pm: maxsim.maxsim(qv[None], qm[None], pv[None],
                                                       pm[None])[0, 0])(
      queries.vectors, queries.valid, passages.vectors, passages.valid)


def _stack_ragged(a, b):
  """Concatenates two `Encoded` batches along the batch axis, padding m to the larger."""
  m = max(a.vectors.shape[1], b.vectors.shape[1])

  def pad(e):
    extra = m - e.vectors.shape[1]
    return (jnp.pad(e.vectors, ((0, 0), (0, extra), (0, 0))),
            jnp.pad(e.valid, ((0, 0), (0, extra))))

  (av, am), (bv, bm) = pad(a), pad(b)
  return jnp.concatenate([av, bv]), jnp.concatenate([am, bm])  # [c, m, d], [c, m]
