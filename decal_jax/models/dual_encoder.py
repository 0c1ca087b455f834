"""T5X-Retrieval-style dual-encoder model: feature converter, in-batch softmax loss, scoring.

Task features (T5X Retrieval's names) -> model features:

    inputs            -> left_encoder_input_tokens            (the query)
    targets           -> right_encoder_input_tokens           (a relevant passage)
    negative_targets  -> right_negative_encoder_input_tokens  (optional: hard negatives,
                         one per query [batch, length] or several [batch, n_neg, length])

The loss is T5X Retrieval's (its `DualEncoderModel` and `InBatchCrossEntropyLoss`): the
logits are `logit_scale` x MaxSim (100 by default, T5X Retrieval's default; optionally a
learnt parameter), every query's positive competes with every other passage of the
(global) batch plus the hard negatives (query -> passage), and, when `bidirectional`,
every positive's query competes with the batch's other queries (passage -> query, no hard
negatives); the two cross entropies are averaged. The feature converter (seqio) is in
`dual_encoder_features.py`.
"""
import math
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import partitioning as nn_partitioning

from decal_jax.models import base
from decal_jax.retrieval import maxsim

if TYPE_CHECKING:
  import seqio

Array = jax.Array
Batch = Mapping[str, Array]

FEATURE_NAMES = {"inputs": "left_encoder_input_tokens",
                 "targets": "right_encoder_input_tokens",
                 "negative_targets": "right_negative_encoder_input_tokens"}
DEFAULT_LOGIT_SCALE = 100.0    # t5x_retrieval.models.DualEncoderModel(logit_scale=100)
LOGIT_SCALE_PARAM = "logit_scale"  # params[...] = log(scale) when learnable_logit_scale


class DualEncoderModel(base.BaseModel):
  """Loss / eval / scoring / encoding around `networks.dual_encoder.DualEncoder`. It
  encodes, it does not decode text (retrieval is `decal_jax.retrieve`).

  The in-batch softmax reads `logit_scale` x MaxSim (T5X Retrieval's 100 by default; with
  `learnable_logit_scale` a parameter `logit_scale` = log(scale) that training moves), over
  both directions when `bidirectional` (see `in_batch_loss`). `temperature`, the older
  spelling, is 1 / logit_scale: give one or the other."""

  # dual_encoder_features.DualEncoderFeatureConverter (seqio, TF), imported when called, so
  # the model builds and encodes without them (bench_retrieval on a GPU image).
  FEATURE_CONVERTER_CLS = base.SeqioConverter("DualEncoderFeatureConverter",
                                              "decal_jax.models.dual_encoder_features")
  PREDICTS_TEXT = False

  def __init__(self, module, input_vocabulary: "seqio.Vocabulary",
               output_vocabulary: Optional["seqio.Vocabulary"] = None,
               logit_scale: Optional[float] = None, learnable_logit_scale: bool = False,
               bidirectional: bool = True, temperature: Optional[float] = None):
    super().__init__(module, input_vocabulary, output_vocabulary or input_vocabulary)
    self.logit_scale = _resolve_logit_scale(logit_scale, temperature)
    self.learnable_logit_scale = learnable_logit_scale
    self.bidirectional = bidirectional

  @property
  def temperature(self) -> float:
    """1 / logit_scale (the initial value when learnable)."""
    return 1.0 / self.logit_scale

  def scale(self, params) -> Array:
    """The logit scale the loss uses: exp(params['logit_scale']) when learnable, else the
    fixed `logit_scale` (a float32 scalar)."""
    if not self.learnable_logit_scale:
      return jnp.float32(self.logit_scale)
    if LOGIT_SCALE_PARAM not in params:
      raise ValueError(f"DualEncoderModel.learnable_logit_scale is True but the params have "
                       f"no {LOGIT_SCALE_PARAM!r}: initialise them with this model's "
                       "get_initial_variables (a checkpoint trained with a fixed scale lacks "
                       "it).")
    return jnp.exp(params[LOGIT_SCALE_PARAM].astype(jnp.float32))

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
    variables = self.module.init(rng, left, right, enable_dropout=False)
    if self.learnable_logit_scale:
      variables = _with_logit_scale_param(variables, self.logit_scale)
    return variables

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
    """(mean in-batch softmax loss, sums: loss_sum, correct, num_queries); see
    `in_batch_loss`."""
    return in_batch_loss(self.logits(params, batch, dropout_rng),
                         maxsim.has_tokens(batch["left_encoder_input_tokens"]),
                         bidirectional=self.bidirectional)

  def logits(self, params, batch: Batch, dropout_rng: Optional[Array] = None) -> Array:
    """`[b, c]`: scale x MaxSim of every query with every candidate (the b positives, then
    the hard negatives); padding candidates at -1e9."""
    queries, passages, passage_valid, candidates = self.encode_candidates(
        params, batch, dropout_rng)
    scores = maxsim.maxsim(queries.vectors, queries.valid, passages, passage_valid)  # [b, c]
    return jnp.where(candidates[None, :], scores * self.scale(params), _MASKED)

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


_MASKED = -1e9  # the logit of a padding candidate: never chosen, exp() is 0


def in_batch_loss(logits: Array, query_weights: Array, bidirectional: bool = True
                  ) -> Tuple[Array, Dict[str, Array]]:
  """T5X Retrieval's in-batch cross entropy over scaled MaxSim logits.

  logits `[b, c]` (c >= b: the first b candidates are the positives in query order, then
  any hard negatives; padding candidates at -1e9); query_weights `[b]` (0: a padding pair).
  Query -> passage: each query's positive among the c candidates. Passage -> query (when
  `bidirectional`): each positive's query among the b queries of the batch, read off the
  `[b, b]` block transposed (hard negatives have no query of their own). The two are
  averaged per pair. Returns (the mean over weighted pairs, sums: loss_sum, correct (query
  -> passage top-1), num_queries)."""
  b = logits.shape[0]
  w = query_weights.astype(jnp.float32)  # [b]
  nll = _nll_of_diagonal(logits)  # [b]
  if bidirectional:
    to_queries = jnp.where(w[None, :] > 0, logits[:, :b].T, _MASKED)  # [b passages, b queries]
    nll = (nll + _nll_of_diagonal(to_queries)) / 2
  correct = (jnp.argmax(logits, axis=-1) == jnp.arange(b)).astype(jnp.float32)  # [b]
  count = jnp.sum(w)
  sums = {"loss_sum": jnp.sum(nll * w), "correct": jnp.sum(correct * w), "num_queries": count}
  return sums["loss_sum"] / jnp.maximum(count, 1.0), sums


def _nll_of_diagonal(logits: Array) -> Array:
  """`[r, k]` (k >= r) -> `[r]`: -log softmax(row i)[i], row i's label being column i."""
  rows = jnp.arange(logits.shape[0])
  return -jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)[rows, rows]


def _resolve_logit_scale(logit_scale: Optional[float], temperature: Optional[float]) -> float:
  """The logit scale from `logit_scale` or the older `temperature` (= 1 / logit_scale)."""
  if temperature is not None:
    if temperature <= 0:
      raise ValueError(f"DualEncoderModel.temperature must be positive, got {temperature}.")
    if logit_scale is not None and not math.isclose(logit_scale, 1.0 / temperature):
      raise ValueError(f"DualEncoderModel got logit_scale={logit_scale} and temperature="
                       f"{temperature}, which disagree (temperature = 1 / logit_scale): give "
                       "one of them.")
    logit_scale = 1.0 / temperature
  logit_scale = DEFAULT_LOGIT_SCALE if logit_scale is None else float(logit_scale)
  if logit_scale <= 0:
    raise ValueError(f"DualEncoderModel.logit_scale must be positive, got {logit_scale}.")
  return logit_scale


def _with_logit_scale_param(variables, logit_scale: float):
  """The variables plus a scalar parameter `logit_scale` = log(logit_scale), with its
  (empty) logical axes so that the partitioner and Adafactor know it."""
  variables = flax.core.unfreeze(variables)
  variables["params"][LOGIT_SCALE_PARAM] = jnp.log(jnp.float32(logit_scale))  # []
  variables.setdefault("params_axes", {})[LOGIT_SCALE_PARAM + "_axes"] = \
      nn_partitioning.AxisMetadata(names=())
  return variables


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
