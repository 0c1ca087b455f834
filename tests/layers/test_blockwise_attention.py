"""Kernel 'blockwise' (layers/blockwise_attention.py) computes the einsum path's attention.

Values and gradients (query, key, value and the bias, or the relative-position table when
the bias is given per key block) against `attention.dot_product_attention(kernel='einsum')`
at the same inputs: key lengths that are and are not multiples of the block, one block,
padding / causal / DeCAL latent masks, biases with and without a batch axis, fully masked
rows, bf16. Then the point of the path: the compiled forward + backward program's
temporary memory grows linearly with the length, the einsum path's quadratically.

Tolerance: both sides are float32 sums of the same terms in other orders. A result's path
holds at most PATH_SUMS sums (scores over d, the softmax denominator and P V over k; in the
backward pass dP over d, D over d, dQ / dK over k or q), each no longer than the longest
axis; `tolerances.reorder_atol` bounds their rounding relative to the result's size. The
scores' rounding is relative to the scores, and moves the probabilities by that much times
|score|, so the magnitude is the result's times max(1, max |score|). Measured on a 2-core
AVX-512 AMD EPYC, the largest gap is 1/100 of that bound; a dropped mask or a wrong
rescaling is off by order 1.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax.layers import attention as attn
from decal_jax.layers import blockwise_attention as bw
from tolerances import reorder_atol

PATH_SUMS = 6
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# ----------------------------------------------------------------------------- helpers
def _qkv(b, q, k, h=3, d=8, seed=0, dtype=jnp.float32):
  """Random q `[b, q, h, d]`, k / v `[b, k, h, d]` (scores of order 1) and a cotangent w."""
  rng = np.random.RandomState(seed)
  query, key = (rng.randn(b, n, h, d) / d ** 0.25 for n in (q, k))
  value, w = rng.randn(b, k, h, d), rng.randn(b, q, h, d)
  return tuple(jnp.asarray(x, dtype) for x in (query, key, value, w))


def _value_and_grads(fn, query, key, value, bias, w):
  """(fn's output, d(sum(out * w)) / d(query, key, value, bias)), compiled."""
  def both(query, key, value, bias):
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w)
    return fn(query, key, value, bias), jax.grad(loss, argnums=(0, 1, 2, 3))(
        query, key, value, bias)
  return jax.jit(both).lower(query, key, value, bias).compile(FAST_COMPILE)(
      query, key, value, bias)


def _einsum(mask):
  def fn(query, key, value, bias):
    bias_, mask_ = attn.split_bias_and_mask(bias, mask, "einsum")
    return attn.dot_product_attention(query, key, value, bias_, mask=mask_)
  return fn


def _blockwise(mask, block_size):
  def fn(query, key, value, bias):
    bias_, mask_ = attn.split_bias_and_mask(bias, mask, "blockwise")
    return attn.dot_product_attention(query, key, value, bias_, mask=mask_, kernel="blockwise",
                                      block_size=block_size)
  return fn


def _score_scale(query, key, bias):
  s = np.einsum("bqhd,bkhd->bhqk", np.asarray(query, np.float64), np.asarray(key, np.float64))
  return max(1.0, float(np.max(np.abs(s + np.asarray(bias, np.float64)))))


def _assert_close(actual, desired, terms, scale, what):
  actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
  atol = reorder_atol(terms, scale * float(np.max(np.abs(desired))))
  np.testing.assert_allclose(actual, desired, rtol=0, atol=atol, err_msg=what)


def _assert_same(query, key, value, bias, w, mask, block_size):
  """Blockwise == einsum at these inputs: output and the four gradients."""
  ref = _value_and_grads(_einsum(mask), query, key, value, bias, w)
  got = _value_and_grads(_blockwise(mask, block_size), query, key, value, bias, w)
  terms = PATH_SUMS * max(query.shape[1], key.shape[1], query.shape[3])
  scale = _score_scale(query, key, bias)
  _assert_close(got[0], ref[0], terms, scale, "output")
  for name, g, r in zip(("d query", "d key", "d value", "d bias"), got[1], ref[1]):
    assert g.shape == r.shape, name
    _assert_close(g, r, terms, scale, name)


def _padding_mask(b, q, k, seed=1):
  """Keys (and queries) padded from a random length on in each example (at least one)."""
  rng = np.random.RandomState(seed)
  k_valid = np.arange(k)[None] < rng.randint(1, k + 1, (b, 1))
  q_valid = np.arange(q)[None] < rng.randint(1, q + 1, (b, 1))
  return attn.make_attention_mask(jnp.asarray(q_valid), jnp.asarray(k_valid))  # [b, 1, q, k]


# ----------------------------------------------------------------------------- values and grads
@pytest.mark.parametrize("k,block", [(32, 8), (29, 8), (13, 64), (40, 16)])
def test_padding_mask_and_batched_bias_at_any_length(k, block):
  query, key, value, w = _qkv(2, 11, k)
  bias = jnp.asarray(np.random.RandomState(2).randn(2, 3, 11, k), jnp.float32)
  _assert_same(query, key, value, bias, w, _padding_mask(2, 11, k), block)


@pytest.mark.parametrize("bias_shape", [(3, 19, 19), (1, 3, 19, 19), (2, 1, 19, 19)])
def test_causal_mask_and_biases_without_a_batch_axis(bias_shape):
  query, key, value, w = _qkv(2, 19, 19, seed=3)
  bias = jnp.asarray(np.random.RandomState(4).randn(*bias_shape), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(19), (2, 19))
  _assert_same(query, key, value, bias, w, attn.make_causal_mask(positions), 8)


def test_no_mask_no_bias_and_a_mask_broadcast_over_queries():
  query, key, value, w = _qkv(2, 7, 21, seed=5)
  zero = jnp.zeros((3, 7, 21), jnp.float32)
  _assert_same(query, key, value, zero, w, None, 5)
  key_mask = jnp.asarray(np.arange(21)[None, None, None] < np.array([21, 9])[:, None, None,
                                                                            None])
  _assert_same(query, key, value, zero, w, key_mask, 5)  # [b, 1, 1, k]


def test_fully_masked_rows_behave_as_the_einsum_path():
  """A query with no key to attend (padding query, or an example with no valid key) gets
  the mean of all values in both paths (the -1e10 bias swamps the logits), and the same
  gradients."""
  b, q, k = 3, 6, 20
  query, key, value, w = _qkv(b, q, k, seed=6)
  bias = jnp.asarray(np.random.RandomState(7).randn(b, 3, q, k), jnp.float32)
  q_valid = np.ones((b, q), bool)
  q_valid[0, 4:] = False
  k_valid = np.ones((b, k), bool)
  k_valid[1] = False  # example 1: no key at all
  k_valid[2, 15:] = False
  mask = attn.make_attention_mask(jnp.asarray(q_valid), jnp.asarray(k_valid))
  _assert_same(query, key, value, bias, w, mask, 8)
  out = _blockwise(mask, 8)(query, key, value, bias)
  np.testing.assert_allclose(np.asarray(out[1]), np.broadcast_to(
      np.asarray(value[1]).mean(0), (q, 3, 8)), atol=1e-5)


# ----------------------------------------------------------------------------- T5 / DeCAL layouts
def _stream(ratio, n=18, b=2):
  """Encoder stream positions and validity as compress/latents.py lays them out: with C > 1,
  m = ceil(n / C) latents first, at the integer mean of their window's positions, valid when
  the window holds a token; example 1 padded from 7 tokens on."""
  positions = np.broadcast_to(np.arange(n), (b, n))
  valid = np.ones((b, n), bool)
  valid[1, 7:] = False
  if ratio == 1:
    return jnp.asarray(positions, jnp.int32), jnp.asarray(valid)
  m = -(-n // ratio)
  lat_pos = np.zeros((b, m), np.int64)
  lat_valid = np.zeros((b, m), bool)
  for i in range(b):
    for j in range(m):
      idx = [t for t in range(j * ratio, min((j + 1) * ratio, n)) if valid[i, t]]
      lat_valid[i, j] = bool(idx)
      lat_pos[i, j] = sum(idx) // len(idx) if idx else 0
  return (jnp.asarray(np.concatenate([lat_pos, positions], 1), jnp.int32),
          jnp.asarray(np.concatenate([lat_valid, valid], 1)))


@pytest.mark.parametrize("ratio", [1, 4])
def test_t5_encoder_layouts_with_relative_bias_built_per_block(ratio):
  """C = 1 and DeCAL C = 4 (latents attend to and from every valid token): the relative
  bias and the mask per key block (`RelativePositionBiases(blocks=True)`, `block_mask`)
  give the einsum path's output and gradients, the table's included."""
  positions, valid = _stream(ratio)
  length = positions.shape[1]
  query, key, value, w = _qkv(2, length, length, seed=8)
  relpos = attn.RelativePositionBiases(8, 20, 3)
  table = relpos.init(jax.random.PRNGKey(0), positions, positions, True)
  mask = attn.make_attention_mask(valid, valid)

  def einsum(query, key, value, table):
    bias = relpos.apply(table, positions, positions, True)  # [b, h, L, L]
    return _einsum(mask)(query, key, value, bias)

  def blockwise(query, key, value, table):
    bias = relpos.apply(table, positions, positions, True, blocks=True)
    return attn.dot_product_attention(query, key, value, bias, mask=bw.block_mask(
        valid, valid), kernel="blockwise", block_size=8)

  ref = _value_and_grads(einsum, query, key, value, table, w)
  got = _value_and_grads(blockwise, query, key, value, table, w)
  scale = _score_scale(query, key, relpos.apply(table, positions, positions, True))
  terms = PATH_SUMS * length * 2  # the table's gradient sums over batch, q and k
  _assert_close(got[0], ref[0], terms, scale, "output")
  for name, g, r in zip(("d query", "d key", "d value"), got[1][:3], ref[1][:3]):
    _assert_close(g, r, terms, scale, name)
  g_table, r_table = (jax.tree.leaves(x[1][3])[0] for x in (got, ref))
  _assert_close(g_table, r_table, terms * length, scale, "d table")


def test_block_mask_matches_the_combined_masks():
  """`block_mask` (padding, segments, causal positions) equals the einsum path's masks."""
  positions, valid = _stream(4)
  segments = jnp.asarray(np.where(np.arange(positions.shape[1]) < 9, 1, 2)[None]
                         .repeat(2, 0), jnp.int32)
  full = attn.combine_masks(attn.make_attention_mask(valid, valid),
                            attn.make_attention_mask(segments, segments, jnp.equal),
                            attn.make_causal_mask(positions)) > 0
  blocks = bw.block_mask(valid, valid, segments, segments, positions, positions)
  index = jnp.arange(positions.shape[1])
  np.testing.assert_array_equal(np.asarray(blocks.fn(blocks.aux, index)), np.asarray(full))
  query, key, value, w = _qkv(2, positions.shape[1], positions.shape[1], seed=9)
  zero = jnp.zeros((1, 3) + full.shape[2:], jnp.float32)
  ref = _value_and_grads(_einsum(full), query, key, value, zero, w)
  got = _value_and_grads(functools.partial(bw.blockwise_attention, mask=blocks, block_size=7),
                         query, key, value, zero, w)
  terms = PATH_SUMS * positions.shape[1]
  _assert_close(got[0], ref[0], terms, _score_scale(query, key, zero), "output")
  for g, r in zip(got[1], ref[1]):
    _assert_close(g, r, terms, _score_scale(query, key, zero), "gradient")


def test_multi_head_attention_module_with_kernel_blockwise():
  rng = np.random.RandomState(10)
  x = jnp.asarray(rng.randn(2, 15, 16), jnp.float32)
  mask = _padding_mask(2, 15, 15)
  ref_layer = attn.MultiHeadAttention(2, 8)
  params = ref_layer.init(jax.random.PRNGKey(0), x, x, mask=mask)
  ref = ref_layer.apply(params, x, x, mask=mask)
  got = attn.MultiHeadAttention(2, 8, kernel="blockwise", block_size=4).apply(
      params, x, x, mask=mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0,
                             atol=reorder_atol(PATH_SUMS * 16, float(np.max(np.abs(ref)))))


def test_bfloat16_inputs_accumulate_in_float32():
  """bf16 q / k / v: output in bf16, within bf16 rounding of the float32 einsum result."""
  query, key, value, w = _qkv(2, 9, 33, seed=11, dtype=jnp.bfloat16)
  mask = _padding_mask(2, 9, 33)
  bias = jnp.zeros((1, 3, 9, 33), jnp.bfloat16)
  blockwise = lambda q, k, v, b: bw.blockwise_attention(q, k, v, b, mask, 8)  # dtype: q's
  got = blockwise(query, key, value, bias)
  assert got.dtype == jnp.bfloat16
  up = [x.astype(jnp.float32) for x in (query, key, value, bias)]
  ref = _einsum(mask)(*up)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), rtol=0,
                             atol=4 * 2.0 ** -8 * float(np.max(np.abs(ref))))
  grads = _value_and_grads(blockwise, query, key, value, bias, w)[1]
  assert [g.dtype for g in grads] == [jnp.bfloat16] * 4


# ----------------------------------------------------------------------------- refusals
def test_dropout_bad_shapes_and_block_inputs_elsewhere_are_refused():
  query, key, value, _ = _qkv(1, 4, 6)
  with pytest.raises(ValueError, match="'blockwise' has no attention dropout"):
    attn.dot_product_attention(query, key, value, dropout_rng=jax.random.PRNGKey(0),
                               dropout_rate=0.1, deterministic=False, kernel="blockwise")
  with pytest.raises(ValueError, match="does not broadcast"):
    bw.blockwise_attention(query, key, value, jnp.zeros((1, 3, 4, 5)))
  with pytest.raises(ValueError, match="block_size must be positive"):
    bw.blockwise_attention(query, key, value, block_size=0)
  with pytest.raises(ValueError, match="needs attention kernel 'blockwise'"):
    attn.split_bias_and_mask(None, bw.block_mask(jnp.ones((1, 4), bool), jnp.ones((1, 6), bool)),
                             "einsum")
  assert bw.NEG_INF == attn.NEG_INF  # the two paths mask alike


# ----------------------------------------------------------------------------- memory
def _temp_bytes(kernel, length, block=128):
  """Temporary bytes XLA plans for value-and-gradient of T5-style self-attention over
  `length` positions (relative bias and padding mask per block for 'blockwise')."""
  b, h, d = 1, 2, 16
  shape = jax.ShapeDtypeStruct((b, length, h, d), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
  valid = jnp.ones((b, length), bool)
  relpos = attn.RelativePositionBiases(32, 128, h)
  table = jax.ShapeDtypeStruct((h, 32), jnp.float32)

  def loss(query, key, value, table):
    params = {"params": {"rel_embedding": table}}
    if kernel == "blockwise":
      bias = relpos.apply(params, positions, positions, True, blocks=True)
      mask = bw.block_mask(valid, valid)
    else:
      bias = relpos.apply(params, positions, positions, True)
      mask = attn.make_attention_mask(valid, valid)
    bias, mask = attn.split_bias_and_mask(bias, mask, kernel)
    out = attn.dot_product_attention(query, key, value, bias, mask=mask, kernel=kernel,
                                     block_size=block)
    return jnp.sum(out ** 2)

  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  compiled = jax.jit(grad).lower(shape, shape, shape, table).compile(FAST_COMPILE)
  return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_einsum_quadratically():
  """4x the length: the blockwise program's temporaries grow ~4x (at most 6x allowed), the
  einsum path's ~16x (at least 10x: the test can tell the two apart)."""
  small, large = 1024, 4096
  blockwise = _temp_bytes("blockwise", large) / _temp_bytes("blockwise", small)
  einsum = _temp_bytes("einsum", large) / _temp_bytes("einsum", small)
  assert blockwise < 6.0, blockwise
  assert einsum > 10.0, einsum
