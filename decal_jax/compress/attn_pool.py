"""AttnPool: the DeCAL paper's attention-pooling baseline (§4.2.5).

The encoder runs uncompressed over all n tokens. One multi-head attention layer then pools
its final states `h` `[batch, n, embed]` down to m = ceil(n / C) vectors:

    q   = Pool_C(h)                        stride-C masked mean of the final states
    out = Norm(q + Attention(Norm(q), h))  queries from q, keys / values from every h

Pooled query j attends to every real token of its own packed segment, not only to its own
window. Windows are the same fixed windows DeCAL uses (`latents.latent_layout`), so the
decoder's mask over the m outputs is DeCAL's.

`AttnPoolCompressor` is the method's compressor config ('attn_pool' in compress/registry.py).
"""
import dataclasses
from typing import ClassVar, NamedTuple, Optional

import flax.linen as nn
import jax.numpy as jnp

from decal_jax.compress.base import Compressor, CostPart, OutputsPart
from decal_jax.compress.latents import (LatentConfig, latent_layout, masked_mean_pool,
                                        window_validity)
from decal_jax.layers import attention as attn
from decal_jax.layers.core import Array, DType, RMSNorm


class Pooled(NamedTuple):
  embeddings: Array  # [batch, m, embed]
  valid: Array       # [batch, m] bool: the window holds at least one token


def pooling_mask(window_valid: Array, window_segments: Array, token_valid: Array,
                 token_segments: Array) -> Array:
  """`[batch, 1, m, n]`: window j may read token i when both are real and share a segment."""
  same_segment = window_segments[:, :, None] == token_segments[:, None, :]  # [batch, m, n]
  both_real = window_valid[:, :, None] & token_valid[:, None, :]
  return (same_segment & both_real)[:, None].astype(jnp.float32)


class AttnPool(nn.Module):
  """Pools final encoder states `[batch, n, embed]` to `[batch, ceil(n / C), embed]`."""
  ratio: int
  num_heads: int
  head_dim: int
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, encoded: Array, tokens: Array, positions: Array,
               segment_ids: Optional[Array] = None) -> Pooled:
    token_valid = tokens > 0  # [batch, n]
    token_segments = token_valid.astype(jnp.int32) if segment_ids is None else segment_ids
    layout = latent_layout(LatentConfig(self.ratio), tokens, positions, segment_ids)
    queries = masked_mean_pool(encoded, layout)  # [batch, m, embed]
    mask = pooling_mask(layout.valid, layout.segment_ids, token_valid, token_segments)
    h = RMSNorm(dtype=self.dtype, name="pre_pool_norm")(queries)
    h = attn.MultiHeadAttention(self.num_heads, self.head_dim, dtype=self.dtype,
                                name="pool_attention")(h, encoded, attn.mask_to_bias(mask))
    pooled = RMSNorm(dtype=self.dtype, name="pool_norm")(queries + h)  # [batch, m, embed]
    return Pooled(pooled, layout.valid)


@dataclasses.dataclass(frozen=True)
class AttnPoolCompressor(Compressor):
  """AttnPool (`T5Config.compressor = 'attn_pool'`): the encoder runs uncompressed over the
  n tokens, then one `AttnPool` layer reduces its final states to m = ceil(n / C)."""
  label: ClassVar[str] = "AttnPool"

  def module(self, cfg) -> AttnPool:
    return AttnPool(self.ratio, cfg.num_heads, cfg.head_dim, cfg.dtype, name="attn_pool")

  def encoder_outputs(self, cfg, states, stream, tokens, positions, segment_ids):
    pooled = self.module(cfg)(states, tokens, positions, segment_ids)
    return pooled.embeddings, pooled.valid  # [batch, m, embed], [batch, m]

  def encoded_validity(self, tokens, segment_ids=None):
    return window_validity(LatentConfig(self.ratio), tokens, segment_ids)

  def own_flops(self, n: int, count) -> float:
    m = self.output_length(n)
    return count.mean_pool(n, m) + count.attention(m, n)  # the queries, then the layer

  def cost_parts(self, cfg, embeddings, tokens, positions):
    return [CostPart("AttnPool layer", 1, OutputsPart(self, cfg),
                     (embeddings, tokens, positions))]
