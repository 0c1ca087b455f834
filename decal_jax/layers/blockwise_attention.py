"""Blockwise (online-softmax) dot-product attention: never builds the `[b, h, q, k]` scores.

The einsum path (`attention.dot_product_attention`, kernel 'einsum') writes the score and
probability matrices whole; on a GPU they were 61 % of a training step's memory traffic
(issue 45). This path runs everywhere, CPU included, in plain JAX: a loop over blocks of
`block_size` keys keeps, per query, the running maximum `m` of the scores, the running
denominator `l = sum exp(s - m)` and the running weighted sum `acc = sum exp(s - m) v`;
each new block rescales the old sums by `exp(m_old - m_new)`. The output is `acc / l`.

The gradient is a `jax.custom_vjp` that recomputes each block's probabilities from the
saved `m` and `l` instead of storing them, so the backward pass also holds O(q * block) per
head, not O(q * k). (Not from `m + log l`: in a fully masked row m = -1e10, and float32
would round log l away.) With `P = exp(S - m) / l`, `O = P V` and `dO`:
  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D)  where  D = rowsum(dO * O),
  dQ = dS K,  dK = dS^T Q,  d(bias) = dS (summed over the bias's broadcast axes).

Bias and mask come as arrays (`[b | 1, h | 1, q | 1, k]`; a bias may also be `[h, q, k]`)
or, so that the full matrix is never built either, as functions of a key block:
`BlockBias` (a differentiable parameter tree, e.g. T5's relative-position table, plus
non-differentiable arrays such as positions) and `BlockMask` (`block_mask` builds one from
padding, segment ids and causal positions).

Numerics follow the einsum path: scores, softmax statistics and sums in float32 (also for
bf16 inputs; the probabilities are rounded to the value dtype before `P V`, as the einsum
path rounds its weights), a masked score gets `NEG_INF` = -1e10 added. A row with every
key masked therefore attends uniformly to all its keys, exactly as the einsum path does
(-1e10 swamps the logits in float32), and its gradients are the einsum path's too.
Attention-weight dropout is not supported (there are no weights to drop): callers refuse
it (`attention.dot_product_attention`).

The last block, when `block_size` does not divide k, is the last `block_size` keys; the
keys it shares with the block before are left out of it (score -inf), so no array is
padded.
"""
import functools
from typing import Any, Callable, NamedTuple, Optional, Union

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array
NEG_INF = -1e10  # the einsum path's mask bias (attention.NEG_INF)


# ------------------------------------------------------------------- blockwise inputs
@flax.struct.dataclass
class BlockBias:
  """A bias given block by block: `fn(params, aux, key_index)` -> the bias of the keys
  `key_index` (`[block]` int32), `[b | 1, h | 1, q | 1, block]`. `params` is differentiated
  (its gradient is accumulated block by block); `aux` is not (positions, ids)."""
  params: Any
  aux: Any
  fn: Callable = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class BlockMask:
  """A mask given block by block: `fn(aux, key_index)` -> bool `[b | 1, h | 1, q | 1,
  block]`, True where attention is allowed."""
  aux: Any
  fn: Callable = flax.struct.field(pytree_node=False)


def _structured_mask(aux, key_index: Array) -> Array:
  """The `block_mask` function: padding, segments and causality of one key block."""
  q_valid, k_valid, q_seg, k_seg, q_pos, k_pos = aux
  allowed = jnp.ones((), bool)
  if q_valid is not None:
    allowed = allowed & (q_valid[:, :, None] & k_valid[:, None, key_index])  # [b, q, block]
  if q_seg is not None:
    allowed = allowed & (q_seg[:, :, None] == k_seg[:, None, key_index])
  if q_pos is not None:
    allowed = allowed & (k_pos[:, None, key_index] <= q_pos[:, :, None])
  return allowed[:, None]  # [b, 1, q, block]


def block_mask(query_valid: Optional[Array] = None, key_valid: Optional[Array] = None,
               query_segments: Optional[Array] = None, key_segments: Optional[Array] = None,
               query_positions: Optional[Array] = None,
               key_positions: Optional[Array] = None) -> BlockMask:
  """The mask `attention.combine_masks(make_attention_mask(valid), segment mask, causal
  mask)` as a `BlockMask`, from `[batch, q]` / `[batch, k]` arrays (each pair optional):
  valid flags, segment ids (equal ids attend), positions (a key attends when its position
  is <= the query's)."""
  aux = (query_valid, key_valid, query_segments, key_segments, query_positions,
         key_positions)
  for a, b in zip(aux[::2], aux[1::2]):
    if (a is None) != (b is None):
      raise ValueError("block_mask takes each query array together with its key array.")
  return BlockMask(aux, _structured_mask)


# ----------------------------------------------------------------------- public entry
def blockwise_attention(query: Array, key: Array, value: Array,
                        bias: Union[None, Array, BlockBias] = None,
                        mask: Union[None, Array, BlockMask] = None, block_size: int = 512,
                        dtype: Optional[Any] = None) -> Array:
  """softmax(q k^T + bias, where mask) v without the `[b, h, q, k]` matrices.

  q `[b, q, h, d]`, k / v `[b, k, h, d]`; bias an array `[b | 1, h | 1, q | 1, k]` or `[h,
  q, k]`, or a `BlockBias`; mask an array `[b | 1, h | 1, q | 1, k]` (nonzero = attend) or a
  `BlockMask`. Returns `[b, q, h, d]` in `dtype` (default: the query's)."""
  if block_size < 1:
    raise ValueError(f"block_size must be positive, got {block_size}.")
  k_len = key.shape[1]
  spec = _Spec(min(block_size, k_len), jnp.dtype(dtype or query.dtype),
               None if not isinstance(bias, BlockBias) else bias.fn,
               None if not isinstance(mask, BlockMask) else mask.fn,
               None if bias is None or isinstance(bias, BlockBias) else bias.ndim)
  bias_array = _check_array(bias, query, k_len, "bias") if spec.bias_ndim else None
  if spec.bias_ndim == 3:
    bias_array = bias_array[None]  # [1, h, q, k]
  mask_array = None
  if mask is not None and not isinstance(mask, BlockMask):
    mask_array = _check_array(mask, query, k_len, "mask") > 0  # [b | 1, h | 1, q | 1, k]
  bias_params, bias_aux = (bias.params, bias.aux) if spec.bias_fn else (None, None)
  mask_aux = mask.aux if spec.mask_fn else None
  return _attention(spec, query, key, value, bias_array, bias_params, bias_aux,
                    mask_array, mask_aux)


class _Spec(NamedTuple):
  """The static part of a call (hashable: `jax.custom_vjp`'s nondiff argument)."""
  block: int                   # keys per block (<= k)
  out_dtype: Any               # the output's dtype
  bias_fn: Optional[Callable]  # BlockBias.fn, or None
  mask_fn: Optional[Callable]  # BlockMask.fn, or None
  bias_ndim: Optional[int]     # 3 or 4 for a bias array, else None


def _check_array(x: Array, query: Array, k_len: int, name: str) -> Array:
  """A bias / mask array's shape against q `[b, q, h, d]` and k keys (clear errors)."""
  b, q, h, _ = query.shape
  full = (h, q, k_len) if x.ndim == 3 else (b, h, q, k_len)
  if x.ndim not in (3, 4) or (x.ndim == 3 and name == "mask") or any(
      s not in (1, f) for s, f in zip(x.shape[:-1], full[:-1])) or x.shape[-1] != k_len:
    raise ValueError(f"blockwise attention: {name} of shape {x.shape} does not broadcast to "
                     f"[batch, heads, q, k] = {(b, h, q, k_len)} with k whole.")
  return x


# ------------------------------------------------------------------------ the blocks
def _blocks(k_len: int, block: int):
  """(number of blocks, fn i -> (start, key_index `[block]`, fresh `[block]` bool)): block
  i covers keys [i * block, ...); the last one is moved back to end at k, and `fresh`
  marks the keys no earlier block covered."""
  count = -(-k_len // block)

  def locate(i):
    start = jnp.minimum(i * block, k_len - block)
    key_index = start + jnp.arange(block, dtype=jnp.int32)  # [block]
    return start, key_index, key_index >= i * block
  return count, locate


def _block_scores(query, k_blk, bias_blk, mask_blk, fresh) -> Array:
  """float32 scores of one key block `[b, h, q, block]`: q k^T + bias, NEG_INF added where
  masked, -inf on keys an earlier block covered."""
  s = jnp.einsum("bqhd,bkhd->bhqk", query, k_blk,
                 preferred_element_type=jnp.float32)  # [b, h, q, block]
  if bias_blk is not None:
    s = s + bias_blk.astype(jnp.float32)
  if mask_blk is not None:
    s = s + jnp.where(mask_blk, 0.0, NEG_INF)
  return jnp.where(fresh, s, -jnp.inf)  # [b, h, q, block]


def _block_inputs(spec: _Spec, i, key, value, bias_array, bias_params, bias_aux,
                  mask_array, mask_aux):
  """(start, fresh, k block, v block, bias block, mask block) of key block i."""
  _, locate = _blocks(key.shape[1], spec.block)
  start, key_index, fresh = locate(i)
  k_blk = jax.lax.dynamic_slice_in_dim(key, start, spec.block, axis=1)  # [b, block, h, d]
  v_blk = jax.lax.dynamic_slice_in_dim(value, start, spec.block, axis=1)
  bias_blk = None
  if bias_array is not None:
    bias_blk = jax.lax.dynamic_slice_in_dim(bias_array, start, spec.block, axis=3)
  elif spec.bias_fn is not None:
    bias_blk = spec.bias_fn(bias_params, bias_aux, key_index)  # [b|1, h|1, q|1, block]
  mask_blk = None
  if mask_array is not None:
    mask_blk = jax.lax.dynamic_slice_in_dim(mask_array, start, spec.block, axis=3)
  elif spec.mask_fn is not None:
    mask_blk = spec.mask_fn(mask_aux, key_index)
  return start, fresh, k_blk, v_blk, bias_blk, mask_blk


# ------------------------------------------------------------------ forward / backward
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec, query, key, value, bias_array, bias_params, bias_aux, mask_array,
               mask_aux):
  out, _ = _forward(spec, query, key, value, bias_array, bias_params, bias_aux, mask_array,
                    mask_aux)
  return out


def _forward(spec, query, key, value, *extra):
  """(out `[b, q, h, d]` in spec.out_dtype, (m, l) `[b, h, q]` float32: the row maxima
  and softmax denominators)."""
  b, q, h, d = query.shape
  count, _ = _blocks(key.shape[1], spec.block)

  def step(i, carry):
    m, l, acc = carry  # [b, h, q], [b, h, q], [b, h, q, d]
    _, fresh, k_blk, v_blk, bias_blk, mask_blk = _block_inputs(spec, i, key, value, *extra)
    s = _block_scores(query, k_blk, bias_blk, mask_blk, fresh)  # [b, h, q, block]
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # [b, h, q]
    rescale = jnp.exp(m - m_new)  # [b, h, q]
    p = jnp.exp(s - m_new[..., None])  # [b, h, q, block]
    l = rescale * l + jnp.sum(p, axis=-1)  # [b, h, q]
    pv = jnp.einsum("bhqk,bkhd->bhqd", p.astype(value.dtype), v_blk,
                    preferred_element_type=jnp.float32)  # [b, h, q, d]
    return m_new, l, rescale[..., None] * acc + pv

  init = (jnp.full((b, h, q), -jnp.inf, jnp.float32), jnp.zeros((b, h, q), jnp.float32),
          jnp.zeros((b, h, q, d), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, count, step, init)
  out = jnp.transpose(acc / l[..., None], (0, 2, 1, 3))  # [b, q, h, d]
  return out.astype(spec.out_dtype), (m, l)


def _attention_fwd(spec, query, key, value, *extra):
  out, stats = _forward(spec, query, key, value, *extra)
  return out, (query, key, value, extra, out, stats)


def _add_block(acc: Array, grad: Array, start, axis: int) -> Array:
  """acc with `grad` added into its slice [start, start + block) along `axis` (in place)."""
  old = jax.lax.dynamic_slice_in_dim(acc, start, grad.shape[axis], axis=axis)
  return jax.lax.dynamic_update_slice_in_dim(acc, old + grad.astype(acc.dtype), start, axis)


def _reduce_to(grad: Array, shape) -> Array:
  """`grad` summed over the axes where `shape` broadcasts (size 1), keeping them."""
  axes = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1)
  return jnp.sum(grad, axis=axes, keepdims=True) if axes else grad


def _attention_bwd(spec, residuals, d_out):
  query, key, value, extra, out, (m, l) = residuals
  bias_array, bias_params, bias_aux, mask_array, mask_aux = extra
  count, _ = _blocks(key.shape[1], spec.block)
  d_out = d_out.astype(jnp.float32)  # [b, q, h, d]
  delta = jnp.einsum("bqhd,bqhd->bhq", d_out, out.astype(jnp.float32))  # [b, h, q]
  d_out_v = d_out.astype(value.dtype)

  def step(i, carry):
    dq, dk, dv, d_bias, d_params = carry
    start, fresh, k_blk, v_blk, bias_blk, mask_blk = _block_inputs(spec, i, key, value,
                                                                   *extra)
    s = _block_scores(query, k_blk, bias_blk, mask_blk, fresh)  # [b, h, q, block]
    p = jnp.exp(s - m[..., None]) / l[..., None]  # [b, h, q, block]
    dv_blk = jnp.einsum("bhqk,bqhd->bkhd", p.astype(value.dtype), d_out_v,
                        preferred_element_type=jnp.float32)  # [b, block, h, d]
    dp = jnp.einsum("bqhd,bkhd->bhqk", d_out_v, v_blk,
                    preferred_element_type=jnp.float32)  # [b, h, q, block]
    ds = p * (dp - delta[..., None])  # [b, h, q, block]
    dq = dq + jnp.einsum("bhqk,bkhd->bqhd", ds.astype(key.dtype), k_blk,
                         preferred_element_type=jnp.float32)  # [b, q, h, d]
    dk_blk = jnp.einsum("bhqk,bqhd->bkhd", ds.astype(query.dtype), query,
                        preferred_element_type=jnp.float32)  # [b, block, h, d]
    dk, dv = _add_block(dk, dk_blk, start, 1), _add_block(dv, dv_blk, start, 1)
    if bias_array is not None:
      d_bias = _add_block(d_bias, _reduce_to(ds, bias_array.shape), start, 3)
    if spec.bias_fn is not None:
      d_params = _bias_fn_grad(spec, bias_params, bias_aux, i, key.shape[1], ds, d_params)
    return dq, dk, dv, d_bias, d_params

  f32_zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  init = (f32_zeros(query), f32_zeros(key), f32_zeros(value),
          None if bias_array is None else jnp.zeros_like(bias_array),
          None if spec.bias_fn is None else jax.tree.map(f32_zeros, bias_params))
  dq, dk, dv, d_bias, d_params = jax.lax.fori_loop(0, count, step, init)
  if d_params is not None:
    d_params = jax.tree.map(lambda g, p: g.astype(p.dtype), d_params, bias_params)
  return (dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), d_bias,
          d_params, None, None, None)  # positions, ids and masks: no gradient


def _bias_fn_grad(spec, bias_params, bias_aux, i, k_len, ds, d_params):
  """d_params + the gradient of `spec.bias_fn`'s block i with respect to its params."""
  _, locate = _blocks(k_len, spec.block)
  _, key_index, _ = locate(i)
  bias_blk, vjp = jax.vjp(lambda p: spec.bias_fn(p, bias_aux, key_index), bias_params)
  (grad,) = vjp(_reduce_to(ds, bias_blk.shape).astype(bias_blk.dtype))
  return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), d_params, grad)


_attention.defvjp(_attention_fwd, _attention_bwd)
