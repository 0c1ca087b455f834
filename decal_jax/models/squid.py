"""Squid's model wrapper: an encoder-decoder whose batches also carry the query that the
large decoder reads after the compressed context (`networks.squid.Squid`)."""
from typing import Any, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax.models import base
from decal_jax.models.encoder_decoder import EncoderDecoderModel

Array = jax.Array
Batch = base.Batch


class QueryModel(EncoderDecoderModel):
  """An `EncoderDecoderModel` whose batches carry `query_tokens` beside the context (Squid's
  and Dodo QA's, from `SquidFeatureConverter`): the module is called with
  `query_tokens=self.query(batch)`."""

  FEATURE_CONVERTER_CLS = base.SeqioConverter("SquidFeatureConverter",
                                              "decal_jax.models.squid_features")
  EXAMPLE_FEATURES = (("inputs", "encoder_input_tokens"), ("query", "query_tokens"),
                      ("targets", "decoder_target_tokens"))

  def input_shapes(self, task_feature_lengths: Mapping[str, int]) -> base.Shapes:
    shapes = super().input_shapes(task_feature_lengths)
    if "query" in task_feature_lengths:
      shapes["query_tokens"] = (1, task_feature_lengths["query"])
    return shapes

  def query(self, batch: Batch) -> Optional[Array]:
    """The batch's query tokens `[batch, q]`, None when it has none."""
    return batch.get("query_tokens")

  def get_initial_variables(self, rng: Array, input_shapes: Mapping[str, Tuple[int, ...]],
                            input_types: Optional[Mapping[str, Any]] = None):
    enc = jnp.ones(input_shapes["encoder_input_tokens"], jnp.int32)
    dec = jnp.ones(input_shapes["decoder_input_tokens"], jnp.int32)
    query = jnp.ones(input_shapes.get("query_tokens", (enc.shape[0], 1)), jnp.int32)
    return self.module.init(rng, enc, dec, dec, query_tokens=query, enable_dropout=False)

  def _compute_logits(self, params, batch: Batch, dropout_rng: Optional[Array] = None) -> Array:
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
    return self.module.apply(
        {"params": params}, batch["encoder_input_tokens"], batch["decoder_input_tokens"],
        batch["decoder_target_tokens"], query_tokens=self.query(batch),
        enable_dropout=rngs is not None, rngs=rngs)


class SquidModel(QueryModel):
  """`QueryModel` for `networks.squid.Squid` (the query is what the large decoder reads after
  the compressed context); inference can compress a context once and answer many queries
  against the kept `Compressed` vectors:

    compressed = model.compress(params, context)          # [b, n] -> N vectors per row
    answers = model.answer(params, compressed, queries, 32)  # no recompression
  """

  def compression_ratio(self, task_feature_lengths: Mapping[str, int]) -> float:
    """Context tokens per memory vector: n / N for a context of n = 'inputs' tokens."""
    n = task_feature_lengths["inputs"]
    return n / self.module.config.memory_count(n)

  def check_batch(self, batch: Batch) -> None:
    """Host-side check of a numpy batch (the trainer calls it before each step): with a
    fixed N, every real context must hold at least N tokens."""
    cfg = self.module.config
    if cfg.memory_ratio is not None:
      return
    lengths = np.sum(np.asarray(batch["encoder_input_tokens"]) > 0, axis=1)  # [batch]
    short = (lengths > 0) & (lengths < cfg.memory_tokens)
    if np.any(short):
      raise ValueError(
          f"{int(np.sum(short))} context(s) in this batch are shorter than the "
          f"{cfg.memory_tokens} memory tokens (shortest: {int(lengths[short].min())} tokens): "
          "compressing them would expand them. Drop contexts shorter than N from the task, "
          "lower SquidConfig.memory_tokens, or set memory_ratio (N = ceil(length / ρ)).")

  def compress(self, params, context: Array):
    """Context tokens `[batch, n]` (right-padded) -> `squid.Compressed`, to keep and reuse."""
    if not isinstance(context, jax.core.Tracer):
      self.check_batch({"encoder_input_tokens": context})
    return self.module.apply({"params": params}, jnp.asarray(context, jnp.int32),
                             method=self.module.compress)

  def answer(self, params, compressed, query_tokens: Optional[Array], max_answer_length: int,
             rng: Optional[Array] = None, *, num_decodes: int = 1,
             return_all_decodes: bool = False, **decoder_kwargs):
    """Decodes `[batch, max_answer_length]` answers to `query_tokens` `[batch, q]` (None or
    width 0: no query) from a kept `Compressed`; a `Compressed` of batch 1 serves a batch of
    queries. Returns (tokens, {'scores'}) like `predict_batch_with_aux`."""
    batch = compressed.embeddings.shape[0]
    if query_tokens is not None:
      query_tokens = jnp.asarray(query_tokens, jnp.int32)
      if batch == 1 and query_tokens.shape[0] > 1:
        compressed = jax.tree_util.tree_map(
            lambda leaf: jnp.repeat(leaf, query_tokens.shape[0], axis=0), compressed)
        batch = query_tokens.shape[0]
      if query_tokens.shape[0] != batch:
        raise ValueError(f"{query_tokens.shape[0]} queries for {batch} compressed contexts: "
                         "give one query per context, or compress a single context.")
    prefix = self.module.apply({"params": params}, compressed, query_tokens,
                               method=self.module.read)
    targets_shape = (batch, max_answer_length)
    dummy = jnp.ones(targets_shape, jnp.int32)
    _, init_vars = self.module.apply({"params": params}, prefix, None, dummy, decode=True,
                                     enable_dropout=False, mutable=["cache"],
                                     method=self.module.decode)
    return self._decode_from(params, prefix, jnp.zeros((batch, 1), jnp.int32),
                             init_vars["cache"], targets_shape, rng, num_decodes,
                             return_all_decodes, **decoder_kwargs)

  def predict_batch_with_aux(self, params, batch: Batch, rng: Optional[Array] = None, *,
                             num_decodes: int = 1, return_all_decodes: bool = False,
                             **decoder_kwargs):
    """Compresses each row's context and answers its query (one batch, no reuse)."""
    compressed = self.compress(params, batch["encoder_input_tokens"])
    return self.answer(params, compressed, batch.get("query_tokens"),
                       batch["decoder_input_tokens"].shape[1], rng, num_decodes=num_decodes,
                       return_all_decodes=return_all_decodes, **decoder_kwargs)
