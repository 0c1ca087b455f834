"""Multi-head dot-product attention, T5 relative position bias, masks and RoPE.

Why two attention modules. `MultiHeadAttention` here is T5's; `networks.decoder.Attention`
is the LLaMA-style decoder's (plain decoder, Dodo, GPTHF, Squid). The arithmetic is one:
both call `dot_product_attention` below with masks folded into a bias, and both cache
through `layers.caches.KVCache`. What differs is what their parameters and callers need:
T5's keeps T5X's parameter paths (`qkv/{query,key,value}` or the fused `qkv_fused` /
`kv_fused` layouts, `out`), attends across to an encoding as well, takes the relative
position bias from its caller and runs the fused `jax.nn.dot_product_attention` kernels;
the decoder's keeps Hugging Face's LLaMA / Qwen2 paths (`query`, `key`, `value`, `out` with
optional q/k/v biases, which `hf_import` maps tensor by tensor), groups query heads over
fewer key/value heads, rotates queries and keys (RoPE), switches LoRA adapters per token,
and prepends memory keys/values (Dodo's nuggets, Squid's prefix) or a caller-owned cache.
One module would carry both parameter layouts behind flags; two short ones read better.

Conventions: queries/keys/values are `[batch, length, heads, head_dim]`; masks and biases
broadcast to `[batch, heads, q_length, kv_length]`; a mask is 1 where attention is allowed.
As in T5, the 1/sqrt(head_dim) scale is folded into the query projection's initialiser.

Attention kernels (`kernel=` below, `T5Config.attention_kernel` in the T5 network):
'einsum' is the reference path (two einsums, fp32 softmax, masks folded into the bias);
'xla', 'cudnn' and 'auto' call `jax.nn.dot_product_attention` with that implementation
('auto' = implementation None, JAX's own choice), the relative-position bias as `bias` and
the masks as a boolean `mask`. cuDNN needs an NVIDIA GPU and bf16 / fp16 activations, and
none of the fused kernels has attention-weight dropout: each refuses with a clear error.
'blockwise' (`layers/blockwise_attention.py`, any device and dtype, no dropout either) loops
over blocks of `block_size` keys with an online softmax and never builds the `[b, h, q, k]`
scores, in the forward or the backward pass; its bias and mask may also be given per key
block (`RelativePositionBiases(..., blocks=True)`, `blockwise_attention.block_mask`), so
that neither is built whole.
"""
import dataclasses
import functools
import math
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from decal_jax.layers.blockwise_attention import BlockBias, BlockMask, blockwise_attention
from decal_jax.layers.caches import KVCache
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
  def __call__(self, query_positions: Array, key_positions: Array, bidirectional: bool,
               blocks: bool = False):
    """`[batch, q]`, `[batch, k]` int positions -> bias `[batch, heads, q, k]`; with
    `blocks`, the same bias as a `BlockBias` for kernel 'blockwise' (built per key block)."""
    table = param_with_axes("rel_embedding", nn.initializers.variance_scaling(
        1.0, "fan_avg", "uniform"), (self.num_heads, self.num_buckets), jnp.float32,
                            axes=("heads", "relpos_buckets"))
    of_keys = RelativeBiasOfKeys(bidirectional, self.num_buckets, self.max_distance,
                                 jnp.dtype(self.dtype))
    positions = (query_positions.astype(jnp.int32), key_positions.astype(jnp.int32))
    if blocks:
      return BlockBias(table, positions, of_keys)
    return of_keys(table, positions, None)  # [batch, heads, q, k]


@dataclasses.dataclass(frozen=True)
class RelativeBiasOfKeys:
  """T5's relative position bias of some keys (a `BlockBias` function; hashable, so
  equal settings trace alike): (table `[heads, num_buckets]`, (query positions `[batch,
  q]`, key positions `[batch, k]`), key_index `[block]` or None for all keys) -> bias
  `[batch, heads, q, block or k]`."""
  bidirectional: bool
  num_buckets: int
  max_distance: int
  dtype: jnp.dtype

  def __call__(self, table: Array, positions, key_index: Optional[Array]) -> Array:
    query_positions, key_positions = positions
    if key_index is not None:
      key_positions = key_positions[:, key_index]  # [batch, block]
    relative = key_positions[:, None, :] - query_positions[:, :, None]  # [batch, q, keys]
    buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets,
                                       self.max_distance)
    return bucket_bias(table, buckets, self.dtype)  # [batch, heads, q, keys]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def bucket_bias(table: Array, buckets: Array, dtype: jnp.dtype) -> Array:
  """`table[:, buckets]` as a bias: `[heads, num_buckets]` float32, `[batch, q, k]` int ->
  `[batch, heads, q, k]` in `dtype`.

  The gather's own gradient is a scatter-add of batch * q * k values per head into a few
  dozen buckets. In bf16 that sum loses most of its terms, and on a GPU the colliding
  atomic adds serialise (XLA emits a compare-and-swap loop for bf16, and for f32 in jaxlib
  0.10.2-0.11.0): a T5.1.1-small DeCAL-4x step at batch 128 took 16 s on an H200. This
  gradient sums in float32, and off the CPU by a matmul (`bucket_sums`).
  """
  return jnp.transpose(table[:, buckets], (1, 0, 2, 3)).astype(dtype)


def _bucket_bias_fwd(table, buckets, dtype):
  return bucket_bias(table, buckets, dtype), (table, buckets)


def _bucket_bias_bwd(dtype, residuals, grad):
  table, buckets = residuals
  return bucket_sums(grad, buckets, table.shape[1]), None


bucket_bias.defvjp(_bucket_bias_fwd, _bucket_bias_bwd)


def bucket_sums(grad: Array, buckets: Array, num_buckets: int, method: str = "auto",
                max_onehot: int = 2**28) -> Array:
  """Sum of `grad` `[batch, heads, q, k]` over the positions of each bucket -> float32
  `[heads, num_buckets]`.

  'scatter' adds into the buckets one value at a time (the CPU's fast path, in float32).
  'onehot' contracts with a one-hot of the buckets in `grad`'s dtype, accumulating in
  float32: no atomics, for GPUs and TPUs (T5X builds its bias this way). It loops over
  chunks of query rows, so the one-hot stays under `max_onehot` entries; not over the
  batch, which a data-parallel mesh shards (a loop slicing a sharded axis would gather the
  whole cotangent onto every device). 'auto' picks by the platform the program is
  compiled for.
  """
  if method == "scatter":
    cotangent = jnp.transpose(grad, (1, 0, 2, 3)).astype(jnp.float32)  # [heads, batch, q, k]
    return jnp.zeros((grad.shape[1], num_buckets), jnp.float32).at[:, buckets].add(cotangent)
  if method == "onehot":
    batch, _, q, k = grad.shape
    rows = max(1, min(q, max_onehot // (batch * k * num_buckets)))  # query rows per chunk
    chunks = -(-q // rows)
    pad = chunks * rows - q  # padded rows: zero gradient, bucket -1 (an all-zero one-hot)
    g = jnp.pad(jnp.moveaxis(grad, 2, 0), ((0, pad), (0, 0), (0, 0), (0, 0)))
    g = g.reshape(chunks, rows, *g.shape[1:])  # [chunks, rows, batch, heads, k]
    b = jnp.pad(jnp.moveaxis(buckets, 1, 0), ((0, pad), (0, 0), (0, 0)), constant_values=-1)
    b = b.reshape(chunks, rows, *b.shape[1:])  # [chunks, rows, batch, k]

    def sums(args):  # one chunk -> [heads, num_buckets]
      g, b = args
      return jnp.einsum("rbhk,rbkn->hn", g, jax.nn.one_hot(b, num_buckets, dtype=g.dtype),
                        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    return jnp.sum(jax.lax.map(sums, (g, b)), axis=0)
  if method == "auto":
    return jax.lax.platform_dependent(
        grad, buckets, cpu=lambda g, b: bucket_sums(g, b, num_buckets, "scatter"),
        default=lambda g, b: bucket_sums(g, b, num_buckets, "onehot"))
  raise ValueError(f"Unknown method {method!r}; choose 'auto', 'scatter' or 'onehot'.")


# -------------------------------------------------------------------------- attention
ATTENTION_KERNELS = ("einsum", "xla", "cudnn", "auto", "blockwise")
DEFAULT_BLOCK_SIZE = 512  # keys per block of kernel 'blockwise'


def check_attention_kernel(kernel: str, dtype: DType = jnp.float32) -> None:
  """Clear errors for a kernel name or a dtype the kernel cannot run."""
  if kernel not in ATTENTION_KERNELS:
    raise ValueError(f"Unknown attention kernel {kernel!r}; choose one of {ATTENTION_KERNELS}.")
  if kernel == "cudnn" and jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16),
                                                    jnp.dtype(jnp.float16)):
    raise ValueError(f"attention kernel 'cudnn' runs bf16 / fp16 only, but the activations are "
                     f"{jnp.dtype(dtype).name}: set the activation dtype to 'bfloat16' or use "
                     "kernel 'xla'.")


def split_bias_and_mask(bias: Optional[Array], mask: Optional[Array], kernel: str,
                        dtype: DType = jnp.float32):
  """(bias, mask) as `kernel` takes them: the einsum path folds the mask into the bias once
  (the reference numerics); the fused kernels get the bias alone and a boolean mask, and
  'blockwise' also takes a `BlockBias` / `BlockMask` as they are."""
  blocks = isinstance(bias, BlockBias) or isinstance(mask, BlockMask)
  if blocks and kernel != "blockwise":
    raise ValueError(f"a BlockBias / BlockMask needs attention kernel 'blockwise', not "
                     f"{kernel!r}.")
  if kernel == "einsum":
    return combine_biases(bias, mask_to_bias(mask, dtype)), None
  if mask is None or isinstance(mask, BlockMask):
    return bias, mask
  return bias, mask > 0


def dot_product_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                          dropout_rng=None, dropout_rate: float = 0.0,
                          deterministic: bool = True, dtype: DType = jnp.float32,
                          mask: Optional[Array] = None, kernel: str = "einsum",
                          block_size: int = DEFAULT_BLOCK_SIZE) -> Array:
  """softmax(q k^T + bias, where mask) v, per head; q `[b, q, h, d]`, k/v `[b, k, h, d]`,
  bias `[b | 1, h | 1, q, k]`, mask `[b | 1, 1, q, k]` (1 = attend) -> `[b, q, h, d]`.
  `block_size`: keys per block of kernel 'blockwise' (which also takes a `BlockBias` /
  `BlockMask`)."""
  if kernel == "blockwise":
    if not deterministic and dropout_rate > 0.0:
      raise ValueError(f"attention kernel 'blockwise' has no attention dropout, but dropout "
                       f"is {dropout_rate}: set DROPOUT_RATE = 0 or use attention kernel "
                       "'einsum'.")
    return blockwise_attention(query, key, value, bias, mask, block_size, dtype)
  if kernel != "einsum":
    return _fused_attention(query, key, value, bias, mask, kernel,
                            dropout_rate if not deterministic else 0.0).astype(dtype)
  bias = combine_biases(bias, mask_to_bias(mask, dtype))
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key)  # [batch, heads, q, k]
  if bias is not None:
    logits = logits + bias.astype(logits.dtype)
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(dtype)
  if not deterministic and dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
    weights = weights * keep.astype(dtype) / (1.0 - dropout_rate)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, value)  # [batch, q, heads, head_dim]


def _fused_attention(query, key, value, bias, mask, kernel: str, dropout_rate: float):
  """`jax.nn.dot_product_attention` with T5's conventions: no 1/sqrt(d) (it is in the
  query initialiser), bias and boolean mask passed through."""
  check_attention_kernel(kernel, query.dtype)
  if dropout_rate > 0.0:
    raise ValueError(f"attention kernel {kernel!r} (jax.nn.dot_product_attention) has no "
                     f"attention dropout, but dropout is {dropout_rate}: set DROPOUT_RATE = 0 "
                     "or use attention kernel 'einsum'.")
  if kernel == "cudnn" and jax.default_backend() != "gpu":
    raise ValueError(f"attention kernel 'cudnn' needs an NVIDIA GPU; this process runs on "
                     f"{jax.default_backend()}. Use 'xla' (or 'auto') here.")
  if mask is not None:
    mask = mask.astype(bool)
  if bias is not None:
    bias = bias.astype(query.dtype)
  return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask, scale=1.0,
                                      implementation=None if kernel == "auto" else kernel)


class QKVProjection(nn.Module):
  """Projects `[batch, length, embed]` to query, key and value `[batch, length, heads, head_dim]`.

  `fused=False` (default): three kernels `query`, `key`, `value` `[embed, heads, head_dim]`.
  `fused=True`: one matmul. Self-attention (`inputs_kv is inputs_q`) reads one kernel
  `qkv_fused` `[embed, 3, heads, head_dim]` (q, k, v along the `stack` axis); attention to
  other inputs reads `query` and one `kv_fused` `[embed, 2, heads, head_dim]`. Same values
  as unfused with the kernels stacked, but a different checkpoint layout
  (`networks/param_layout.py` converts between the two).
  """
  num_heads: int
  head_dim: int
  dtype: DType = jnp.float32
  fused: bool = False

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array) -> Tuple[Array, Array, Array]:
    features = (self.num_heads, self.head_dim)
    axes = ("embed", "heads", "kv")
    # T5 folds 1/sqrt(head_dim) into the query initialiser instead of scaling logits.
    query_init = nn.initializers.variance_scaling(1.0 / self.head_dim, "fan_in",
                                                  "truncated_normal")
    if self.fused and inputs_kv is inputs_q:
      qkv = DenseGeneral((3,) + features, kernel_axes=("embed", "stack") + axes[1:],
                         dtype=self.dtype, name="qkv_fused",
                         kernel_init=_stacked_init((query_init, default_kernel_init,
                                                    default_kernel_init)))(inputs_q)
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [batch, length, 3, heads, kv] -> 3x
    elif self.fused:
      q = DenseGeneral(features, kernel_axes=axes, dtype=self.dtype, kernel_init=query_init,
                       name="query")(inputs_q)
      kv = DenseGeneral((2,) + features, kernel_axes=("embed", "stack") + axes[1:],
                        dtype=self.dtype, name="kv_fused",
                        kernel_init=_stacked_init((default_kernel_init,) * 2))(inputs_kv)
      k, v = kv[:, :, 0], kv[:, :, 1]  # [batch, length, 2, heads, kv] -> 2x
    else:
      q = DenseGeneral(features, kernel_axes=axes, dtype=self.dtype, kernel_init=query_init,
                       name="query")(inputs_q)
      k = DenseGeneral(features, kernel_axes=axes, dtype=self.dtype, name="key")(inputs_kv)
      v = DenseGeneral(features, kernel_axes=axes, dtype=self.dtype, name="value")(inputs_kv)
    q = with_sharding_constraint(q, ("batch", "length", "heads", "kv"))
    k = with_sharding_constraint(k, ("batch", "length", "heads", "kv"))
    v = with_sharding_constraint(v, ("batch", "length", "heads", "kv"))
    return q, k, v


def _stacked_init(inits):
  """Initialiser of a fused `[fan_in, parts * fan_out]` matrix: each part drawn by its own
  initialiser (so the fused query keeps T5's scaled init), concatenated along the columns,
  which DenseGeneral reshapes to `[embed, parts, heads, head_dim]`."""
  def init(key, shape, dtype=jnp.float32):
    fan_in, fan_out = shape
    part = fan_out // len(inits)
    keys = jax.random.split(key, len(inits))
    return jnp.concatenate([f(k, (fan_in, part), dtype) for f, k in zip(inits, keys)], axis=1)
  return init


def output_projection(features: int, dtype: DType, name: str) -> DenseGeneral:
  """The map `[batch, length, heads, head_dim]` -> `[batch, length, embed]`."""
  return DenseGeneral(features, axis=(-2, -1), kernel_axes=("heads", "kv", "embed"),
                      dtype=dtype, name=name)


class MultiHeadAttention(nn.Module):
  """Multi-head attention with an optional autoregressive KV cache.

  With `decode=True` the submodule `cache` (`layers.caches.KVCache`) keeps `cached_key` /
  `cached_value` `[batch, max_length, heads, head_dim]`, written at `cache_index`, the
  decoder's step counter (so scanned layers' caches hold no per-layer scalar). The first
  call (when the cache does not exist yet) only creates it, from full-length inputs, as
  T5X's decoding does; every later call takes one new token, writes it at the index and
  attends over the cached prefix. `bias` / `mask` must then be the rows of that position.
  `kernel` picks the attention implementation (see `dot_product_attention`; `block_size`
  is kernel 'blockwise''s), `fused_qkv` the projection layout (see `QKVProjection`).
  """
  num_heads: int
  head_dim: int
  dropout_rate: float = 0.0
  dtype: DType = jnp.float32
  kernel: str = "einsum"
  fused_qkv: bool = False
  block_size: int = DEFAULT_BLOCK_SIZE

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array, bias: Optional[Array] = None, *,
               mask: Optional[Array] = None, decode: bool = False,
               deterministic: bool = True, cache_index: Optional[Array] = None) -> Array:
    q, k, v = QKVProjection(self.num_heads, self.head_dim, self.dtype, self.fused_qkv,
                            name="qkv")(inputs_q, inputs_kv)
    if decode:
      k, v, filled = KVCache(name="cache")(k, v, cache_index)
      mask = mask if filled is None else combine_masks(mask, filled)  # written slots only
    dropout_rng = None if deterministic or self.dropout_rate == 0 else self.make_rng("dropout")
    bias, mask = split_bias_and_mask(bias, mask, self.kernel, self.dtype)
    out = dot_product_attention(q, k, v, bias, dropout_rng, self.dropout_rate, deterministic,
                                self.dtype, mask=mask, kernel=self.kernel,
                                block_size=self.block_size)  # [b, q, h, d]
    return output_projection(inputs_q.shape[-1], self.dtype, "out")(out)


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
