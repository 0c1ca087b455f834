"""Multi-head dot-product attention, T5 relative position bias, masks and the KV cache.

Conventions: queries/keys/values are `[batch, length, heads, head_dim]`; masks and biases
broadcast to `[batch, heads, q_length, kv_length]`; a mask is 1 where attention is allowed.
As in T5, the 1/sqrt(head_dim) scale is folded into the query projection's initialiser.
"""
import math
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from decal_jax.layers.core import (Array, DenseGeneral, DType, default_kernel_init,
                                   param_with_axes, with_sharding_constraint)

NEG_INF = -1e10


# ----------------------------------------------------------------------------- masks
def make_attention_mask(query_valid: Array, key_valid: Array, pairwise_fn=jnp.logical_and,
                        dtype: DType = jnp.float32) -> Array:
  """`[batch, q]`, `[batch, k]` -> `[batch, 1, q, k]` mask from a pairwise predicate."""
  mask = pairwise_fn(query_valid[:, :, None], key_valid[:, None, :])  # [batch, q, k]
  return mask[:, None].astype(dtype)


def make_causal_mask(positions: Array, dtype: DType = jnp.float32) -> Array:
  """`[batch, length]` positions -> `[batch, 1, length, length]`: key position <= query's."""
  return make_attention_mask(positions, positions, jnp.greater_equal, dtype)


def combine_masks(*masks: Optional[Array], dtype: DType = jnp.float32) -> Optional[Array]:
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  out = masks[0].astype(bool)
  for m in masks[1:]:
    out = jnp.logical_and(out, m.astype(bool))
  return out.astype(dtype)


def mask_to_bias(mask: Optional[Array], dtype: DType = jnp.float32) -> Optional[Array]:
  if mask is None:
    return None
  return jnp.where(mask > 0, 0.0, NEG_INF).astype(dtype)


def combine_biases(*biases: Optional[Array]) -> Optional[Array]:
  biases = [b for b in biases if b is not None]
  if not biases:
    return None
  out = biases[0]
  for b in biases[1:]:
    out = out + b
  return out


# ----------------------------------------------------------------- relative position bias
def relative_position_bucket(relative_position: Array, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> Array:
  """Maps `key_pos - query_pos` to T5's log-spaced buckets.

  Half the buckets (or all, if unidirectional) hold exact small distances, the rest grow
  logarithmically up to `max_distance`, beyond which everything shares the last bucket.
  With `bidirectional`, keys after the query use the upper half of the buckets.
  """
  distance = -relative_position  # > 0 when the key lies before the query
  bucket = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (distance < 0).astype(jnp.int32) * num_buckets
    distance = jnp.abs(distance)
  else:
    distance = jnp.maximum(distance, 0)
  max_exact = num_buckets // 2
  is_exact = distance < max_exact
  # log-spaced bucket for distances >= max_exact (the max() only guards log(0)).
  log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact)
  scaled = log_ratio / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  large = jnp.minimum(max_exact + scaled.astype(jnp.int32), num_buckets - 1)
  return bucket + jnp.where(is_exact, distance, large)


class RelativePositionBiases(nn.Module):
  """T5 relative position bias, computed from explicit position ids.

  Taking positions (not `arange`) is what lets DeCAL latents sit at the integer mean of
  their window's positions, and packed segments restart their positions at 0.
  """
  num_buckets: int
  max_distance: int
  num_heads: int
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, query_positions: Array, key_positions: Array, bidirectional: bool) -> Array:
    """`[batch, q]`, `[batch, k]` int positions -> bias `[batch, heads, q, k]`."""
    relative = key_positions[:, None, :] - query_positions[:, :, None]  # [batch, q, k]
    buckets = relative_position_bucket(relative.astype(jnp.int32), bidirectional,
                                       self.num_buckets, self.max_distance)
    table = param_with_axes("rel_embedding", nn.initializers.variance_scaling(
        1.0, "fan_avg", "uniform"), (self.num_heads, self.num_buckets), jnp.float32,
                            axes=("heads", "relpos_buckets"))
    bias = jnp.asarray(table, self.dtype)[:, buckets]  # [heads, batch, q, k]
    return jnp.transpose(bias, (1, 0, 2, 3))  # [batch, heads, q, k]


# -------------------------------------------------------------------------- attention
def dot_product_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                          dropout_rng=None, dropout_rate: float = 0.0,
                          deterministic: bool = True, dtype: DType = jnp.float32) -> Array:
  """softmax(q k^T + bias) v, per head; q `[b, q, h, d]`, k/v `[b, k, h, d]` -> `[b, q, h, d]`."""
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key)  # [batch, heads, q, k]
  if bias is not None:
    logits = logits + bias.astype(logits.dtype)
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(dtype)
  if not deterministic and dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
    weights = weights * keep.astype(dtype) / (1.0 - dropout_rate)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, value)  # [batch, q, heads, head_dim]


class QKVProjection(nn.Module):
  """Projects `[batch, length, embed]` to query, key and value `[batch, length, heads, head_dim]`."""
  num_heads: int
  head_dim: int
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array) -> Tuple[Array, Array, Array]:
    features = (self.num_heads, self.head_dim)
    axes = ("embed", "heads", "kv")
    # T5 folds 1/sqrt(head_dim) into the query initialiser instead of scaling logits.
    query_init = nn.initializers.variance_scaling(1.0 / self.head_dim, "fan_in",
                                                  "truncated_normal")
    q = DenseGeneral(features, kernel_axes=axes, dtype=self.dtype, kernel_init=query_init,
                     name="query")(inputs_q)
    k = DenseGeneral(features, kernel_axes=axes, dtype=self.dtype, name="key")(inputs_kv)
    v = DenseGeneral(features, kernel_axes=axes, dtype=self.dtype, name="value")(inputs_kv)
    q = with_sharding_constraint(q, ("batch", "length", "heads", "kv"))
    k = with_sharding_constraint(k, ("batch", "length", "heads", "kv"))
    v = with_sharding_constraint(v, ("batch", "length", "heads", "kv"))
    return q, k, v


def output_projection(features: int, dtype: DType, name: str) -> DenseGeneral:
  """The map `[batch, length, heads, head_dim]` -> `[batch, length, embed]`."""
  return DenseGeneral(features, axis=(-2, -1), kernel_axes=("heads", "kv", "embed"),
                      dtype=dtype, name=name)


class MultiHeadAttention(nn.Module):
  """Multi-head attention with an optional autoregressive KV cache.

  With `decode=True` the module keeps `cached_key`/`cached_value` `[batch, max_length,
  heads, head_dim]` and a scalar `cache_index` in the `cache` collection. The first call
  (when the cache does not exist yet) only creates it, from full-length inputs, as T5X's
  decoding does; every later call takes one new token, writes it at `cache_index` and
  attends over the cached prefix. `bias` must then be the bias row of that position.
  """
  num_heads: int
  head_dim: int
  dropout_rate: float = 0.0
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, bias: Optional[Array] = None, *,
               decode: bool = False, deterministic: bool = True) -> Array:
    q, k, v = QKVProjection(self.num_heads, self.head_dim, self.dtype, name="qkv")(
        inputs_q, inputs_kv)
    if decode:
      k, v, bias = self._update_cache(k, v, bias)
    dropout_rng = None if deterministic or self.dropout_rate == 0 else self.make_rng("dropout")
    out = dot_product_attention(q, k, v, bias, dropout_rng, self.dropout_rate, deterministic,
                                self.dtype)  # [batch, q, heads, head_dim]
    return output_projection(inputs_q.shape[-1], self.dtype, "out")(out)

  def _update_cache(self, key: Array, value: Array, bias: Optional[Array]):
    is_initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not is_initialized:
      return key, value, bias  # cache creation pass: plain attention over the dummy inputs
    batch, max_length, heads, head_dim = cached_key.value.shape
    if key.shape != (batch, 1, heads, head_dim):
      raise ValueError(f"Cached decoding takes one token per step: expected key shape "
                       f"{(batch, 1, heads, head_dim)}, got {key.shape}.")
    index = cache_index.value
    cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, key, (0, index, 0, 0))
    cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, value,
                                                      (0, index, 0, 0))
    cache_index.value = index + 1
    # Only the filled prefix (positions <= index) may be attended to.
    filled = (jnp.arange(max_length) <= index)[None, None, None, :]  # [1, 1, 1, max_length]
    step_bias = mask_to_bias(filled.astype(jnp.float32), self.dtype)
    return cached_key.value, cached_value.value, combine_biases(bias, step_bias)


# ------------------------------------------------------------------ rotary embeddings
def apply_rope(x: Array, positions: Array, theta: float = 10000.0) -> Array:
  """Rotary position embedding (LLaMA / Hugging Face "rotate half" layout).

  x `[batch, length, heads, head_dim]`, positions `[batch, length]` -> same shape as x.
  Channel i and i + head_dim/2 form a pair rotated by `position * theta^(-2i / head_dim)`.
  """
  half = x.shape[-1] // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
  angles = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [batch, length, half]
  cos = jnp.cos(angles)[:, :, None, :]  # [batch, length, 1, half]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
