"""The T5.1.1 / DeCAL network against a numpy re-derivation and properties that must hold."""
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_t5 as ref
import tolerances
from decal_jax.compress import latents as latents_lib
from decal_jax.layers import attention as attn
from decal_jax.networks import t5
from decal_jax.networks.t5 import T5Config, Transformer

TINY = T5Config(vocab_size=61, emb_dim=32, num_heads=2, head_dim=8, mlp_dim=48,
                num_encoder_layers=2, num_decoder_layers=2,
                relative_attention_num_buckets=8, relative_attention_max_distance=20)


def _all_reductions(cfg, keys):
  """The sums on the path through the encoder and decoder (see tests/tolerances.py)."""
  return tolerances.stack_reductions(cfg, keys, cfg.num_encoder_layers + cfg.num_decoder_layers)


def _tokens(seed, batch, length, pad_from=None, vocab=61):
  rng = np.random.RandomState(seed)
  toks = rng.randint(2, vocab, (batch, length)).astype(np.int32)
  if pad_from is not None:
    for b, start in enumerate(pad_from):
      toks[b, start:] = 0
  return jnp.asarray(toks)


@functools.lru_cache(maxsize=None)
def _init_params(cfg, seed):
  # Parameter shapes do not depend on sequence lengths, so one jitted init per config.
  model = Transformer(cfg)
  ones = jnp.ones((1, 8), jnp.int32)
  init = jax.jit(lambda rng: model.init(rng, ones, ones[:, :4], ones[:, :4],
                                        enable_dropout=False)["params"])
  return init(jax.random.PRNGKey(seed))


def _init(cfg, enc_len=None, dec_len=None, seed=0):
  del enc_len, dec_len  # kept so call sites read naturally
  return Transformer(cfg), _init_params(cfg, seed)


def _apply(model, variables, *args, **kwargs):
  """`model.apply` under jit: one compile per call beats op-by-op dispatch at new shapes."""
  return jax.jit(functools.partial(model.apply, **kwargs))(variables, *args)


def _shift_right(targets):
  return jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]


# ------------------------------------------------------------------ layers vs numpy
def test_relative_position_bucket_matches_scalar_reference():
  rel = np.arange(-300, 301)
  for bidirectional in (True, False):
    for num_buckets, max_distance in ((32, 128), (128, 512), (8, 20)):
      got = np.asarray(attn.relative_position_bucket(jnp.asarray(rel), bidirectional,
                                                     num_buckets, max_distance))
      want = [ref.bucket(int(r), bidirectional, num_buckets, max_distance) for r in rel]
      np.testing.assert_array_equal(got, want)


def test_relative_bias_is_computed_from_position_ids():
  module = attn.RelativePositionBiases(num_buckets=16, max_distance=40, num_heads=3)
  q_pos = jnp.array([[0, 5, 9, 33]])
  k_pos = jnp.array([[2, 2, 7, 40, 1]])  # arbitrary, repeated and unordered ids
  bias, variables = module.init_with_output(jax.random.PRNGKey(1), q_pos, k_pos, False)
  table = np.asarray(variables["params"]["rel_embedding"])
  want = ref.relpos_bias(table, q_pos[0], k_pos[0], False, 40)
  np.testing.assert_allclose(np.asarray(bias[0]), want, rtol=1e-6)


def _bucket_sums_float64(grad, buckets, num_buckets):
  """numpy: the sum of `grad` [b, h, q, k] over each bucket's positions, and of |grad|."""
  grad = np.asarray(grad, np.float64)
  onehot = np.asarray(buckets)[..., None] == np.arange(num_buckets)  # [b, q, k, n]
  return (np.einsum("bhqk,bqkn->hn", grad, onehot),
          np.einsum("bhqk,bqkn->hn", np.abs(grad), onehot))


def test_relative_bias_gradient_sums_every_term_in_bf16():
  """The table's gradient sums ~40k terms per bucket here; a bf16 sum (the gradient of a
  gather from the bf16-cast table) was off by ~15 % of their total, this is float32."""
  batch, length, heads, num_buckets = 4, 200, 3, 16
  rng = np.random.default_rng(0)
  pos = jnp.asarray(np.sort(rng.integers(0, 300, (batch, length)), axis=1), jnp.int32)
  cotangent = jnp.asarray(rng.standard_normal((batch, heads, length, length)), jnp.bfloat16)
  module = attn.RelativePositionBiases(num_buckets, 40, heads, dtype=jnp.bfloat16)
  params = module.init(jax.random.PRNGKey(0), pos, pos, True)

  @jax.jit
  def table_grad(params, pos, cotangent):
    _, vjp = jax.vjp(lambda p: module.apply(p, pos, pos, True), params)
    return vjp(cotangent)[0]["params"]["rel_embedding"]

  got = np.asarray(table_grad(params, pos, cotangent), np.float64)
  buckets = attn.relative_position_bucket(pos[:, None, :] - pos[:, :, None], True,
                                          num_buckets, 40)
  want, scale = _bucket_sums_float64(cotangent.astype(jnp.float32), buckets, num_buckets)
  np.testing.assert_array_less(np.abs(got - want), 1e-5 * scale + 1e-6)


@pytest.mark.parametrize("method", ["scatter", "onehot"])
def test_bucket_sums_methods_match_numpy(method):
  """Both ways of summing the gradient (the CPU's scatter, the accelerators' chunked
  one-hot matmul: 63 query rows in chunks of 2 here, the last one padded) give the sums."""
  batch, heads, q, k, num_buckets = 7, 2, 63, 32, 8
  rng = np.random.default_rng(1)
  grad = rng.standard_normal((batch, heads, q, k)).astype(np.float32)
  buckets = rng.integers(0, num_buckets, (batch, q, k)).astype(np.int32)
  got = jax.jit(attn.bucket_sums, static_argnums=(2, 3, 4))(
      grad, buckets, num_buckets, method, 2 * batch * k * num_buckets)
  want, scale = _bucket_sums_float64(grad, buckets, num_buckets)
  np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), 1e-6 * scale)


SHARDED_BUCKET_SUMS = """
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from decal_jax.layers import attention as attn
rng = np.random.default_rng(0)
grad = rng.standard_normal((8, 3, 40, 24)).astype(np.float32)
buckets = rng.integers(0, 16, (8, 40, 24)).astype(np.int32)
batch = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
f = jax.jit(lambda g, b: attn.bucket_sums(g, b, 16, "onehot", 2 * 8 * 24 * 16))
g, b = jax.device_put(grad, batch), jax.device_put(buckets, batch)
print("RESULT" + json.dumps({"all_gathers": len(re.findall("all-gather", f.lower(g, b).compile(
    ).as_text())), "sums": np.asarray(f(g, b)).tolist(), "grad": grad.tolist(),
    "buckets": buckets.tolist()}))
"""


def test_onehot_bucket_sums_keep_a_batch_sharded_cotangent_on_its_devices():
  """With the batch sharded over 2 devices (data parallel), the one-hot sums loop over
  query rows: no all-gather of the cotangent (a loop over batch chunks gathered it whole
  onto every device), and the sums still equal numpy's."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  proc = subprocess.run([sys.executable, "-c", SHARDED_BUCKET_SUMS], env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
  out = json.loads(line[len("RESULT"):])
  assert out["all_gathers"] == 0
  want, scale = _bucket_sums_float64(np.array(out["grad"]), np.array(out["buckets"]), 16)
  np.testing.assert_array_less(np.abs(np.array(out["sums"]) - want), 1e-6 * scale)


def test_relative_bias_gradient_has_no_scatter_off_the_cpu():
  """Compiled for a GPU or TPU, the table's gradient is a matmul, not a scatter-add of
  colliding atomics (which took a 16 s train step on an H200); on the CPU, a scatter."""
  module = attn.RelativePositionBiases(8, 20, 2, dtype=jnp.bfloat16)
  pos = jnp.zeros((2, 16), jnp.int32)
  params = module.init(jax.random.PRNGKey(0), pos, pos, True)
  loss = lambda p, pos: jnp.sum(module.apply(p, pos, pos, True).astype(jnp.float32))
  step = jax.jit(jax.grad(loss)).trace(params, pos)
  for platform, scatters in (("cpu", True), ("cuda", False), ("tpu", False)):
    text = step.lower(lowering_platforms=(platform,)).as_text()
    assert ("scatter" in text) == scatters, platform


def test_embedding_gradient_sums_a_frequent_token_in_float32():
  """One id used 4,096 times in a bf16 model: its row's gradient is their float32 sum."""
  from decal_jax.layers.core import Embed
  embed = Embed(num_embeddings=5, features=8, dtype=jnp.bfloat16)
  tokens = jnp.asarray(np.r_[np.full(4096, 3), np.arange(5)][None], jnp.int32)
  params = embed.init(jax.random.PRNGKey(0), tokens)
  rng = np.random.default_rng(2)
  cotangent = jnp.asarray(rng.standard_normal((1, tokens.shape[1], 8)) + 0.5, jnp.bfloat16)
  _, vjp = jax.vjp(lambda p: embed.apply(p, tokens), params)
  got = np.asarray(jax.jit(vjp)(cotangent)[0]["params"]["embedding"], np.float64)
  want = np.zeros((5, 8))
  np.add.at(want, np.asarray(tokens[0]), np.asarray(cotangent[0].astype(jnp.float32), np.float64))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_multihead_attention_matches_numpy():
  rng = np.random.RandomState(0)
  xq = jnp.asarray(rng.randn(2, 5, 16), jnp.float32)
  xkv = jnp.asarray(rng.randn(2, 7, 16), jnp.float32)
  bias = jnp.asarray(rng.randn(2, 4, 5, 7), jnp.float32)
  module = attn.MultiHeadAttention(num_heads=4, head_dim=6)
  out, variables = module.init_with_output(jax.random.PRNGKey(0), xq, xkv, bias)
  p = ref.to_numpy(variables["params"])
  for b in range(2):
    want = ref.attention(np.asarray(xq[b], np.float64), np.asarray(xkv[b], np.float64),
                         {**p["qkv"], "out": p["out"]}, np.asarray(bias[b], np.float64))
    np.testing.assert_allclose(np.asarray(out[b]), want, rtol=2e-4, atol=2e-5)


# --------------------------------------------------------------- DeCAL latents
@pytest.mark.parametrize("n,ratio", [(12, 1), (12, 4), (13, 4), (7, 2), (9, 8), (5, 8)])
def test_latent_count_is_ceil_n_over_c(n, ratio):
  cfg = dataclasses.replace(TINY, compression_ratio=ratio)
  model, params = _init(cfg, enc_len=n)
  encoded = _apply(model, {"params": params}, _tokens(0, 2, n), enable_dropout=False,
                        method=model.encode)
  assert encoded.shape == (2, math.ceil(n / ratio), cfg.emb_dim)


def test_pooled_latents_and_positions_match_numpy():
  rng = np.random.RandomState(3)
  tokens = _tokens(1, 2, 10, pad_from=[10, 6])
  x = jnp.asarray(rng.randn(2, 10, 16), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(10), (2, 10))
  for use_pooling in (True, False):
    module = latents_lib.DecalLatents(latents_lib.LatentConfig(ratio=4, use_pooling=use_pooling))
    out, variables = module.init_with_output(jax.random.PRNGKey(0), x, tokens, positions)
    p = ref.to_numpy(variables["params"])
    for b in range(2):
      lat, valid, pos = ref.decal_latents(np.asarray(x[b], np.float64), np.asarray(tokens[b]) > 0,
                                          np.arange(10), p["latent_vector"],
                                          p["latent_norm"]["scale"], 4, use_pooling)
      np.testing.assert_allclose(np.asarray(out.embeddings[b]), lat, rtol=1e-4, atol=1e-5)
      np.testing.assert_array_equal(np.asarray(out.valid[b]), valid)
      np.testing.assert_array_equal(np.asarray(out.positions[b]), pos)
  # Hand-worked: windows {0..3}, {4..7}, {8, 9} -> integer means 1, 5, 8; with tokens 6..9
  # padded, the second window holds {4, 5} -> 4 and the third is empty (invalid).
  layout = latents_lib.latent_layout(latents_lib.LatentConfig(ratio=4), tokens, positions)
  np.testing.assert_array_equal(np.asarray(layout.positions), [[1, 5, 8], [1, 4, 0]])
  np.testing.assert_array_equal(np.asarray(layout.valid), [[True] * 3, [True, True, False]])


def test_boundary_windows_hand_worked():
  # Boundary token 7 closes a window; max_window 3 closes long runs; 0 is padding.
  tokens = jnp.array([[5, 7, 5, 5, 5, 5, 7, 5, 0, 0]])
  cfg = latents_lib.LatentConfig(ratio=2, boundary_token_ids=(7,), max_window=3)
  layout = latents_lib.latent_layout(cfg, tokens, jnp.arange(10)[None])
  np.testing.assert_array_equal(np.asarray(layout.assignment),
                                [[0, 0, 1, 1, 1, 2, 2, 3, -1, -1]])
  np.testing.assert_array_equal(np.asarray(layout.positions), [[0, 3, 5, 7, 0]])
  np.testing.assert_array_equal(np.asarray(layout.valid), [[True] * 4 + [False]])


@pytest.mark.parametrize("ratio", [1, 4])
def test_encoder_matches_numpy_and_outputs_only_latents(ratio):
  cfg = dataclasses.replace(TINY, compression_ratio=ratio)
  model, params = _init(cfg, enc_len=11)
  tokens = _tokens(4, 2, 11, pad_from=[11, 6])
  encoded = _apply(model, {"params": params}, tokens, enable_dropout=False, method=model.encode)
  p = ref.to_numpy(params)
  for b in range(2):
    want, valid = ref.encoder(p, np.asarray(tokens[b]), cfg)
    assert encoded.shape[1] == len(want) == math.ceil(11 / ratio)
    np.testing.assert_allclose(np.asarray(encoded[b])[valid], want[valid], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("ratio", [1, 3])
def test_full_model_logits_match_numpy(ratio):
  cfg = dataclasses.replace(TINY, compression_ratio=ratio)
  model, params = _init(cfg, enc_len=9, dec_len=6)
  enc = _tokens(5, 2, 9, pad_from=[9, 4])
  targets = _tokens(6, 2, 6)
  logits = _apply(model, {"params": params}, enc, _shift_right(targets), targets,
                       enable_dropout=False)
  p = ref.to_numpy(params)
  for b in range(2):
    encoded, valid = ref.encoder(p, np.asarray(enc[b]), cfg)
    want = ref.decoder_logits(p, encoded, valid, np.asarray(_shift_right(targets)[b]), cfg)
    np.testing.assert_allclose(np.asarray(logits[b]), want, rtol=1e-3, atol=1e-4)


def test_compression_ratio_one_is_the_plain_t5_encoder():
  """C = 1 builds no latent parameters and the encoder output is one state per token."""
  model, params = _init(dataclasses.replace(TINY, compression_ratio=1))
  assert "latents" not in params["encoder"]
  tokens = _tokens(0, 1, 12)
  encoded = _apply(model, {"params": params}, tokens, enable_dropout=False, method=model.encode)
  want, _ = ref.encoder(ref.to_numpy(params), np.asarray(tokens[0]), TINY)  # plain T5 path
  np.testing.assert_allclose(np.asarray(encoded[0]), want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("ratio", [1, 4])
def test_extra_padding_leaves_outputs_unchanged(ratio):
  cfg = dataclasses.replace(TINY, compression_ratio=ratio)
  model, params = _init(cfg, enc_len=8)
  short = _tokens(7, 2, 8, pad_from=[8, 5])
  padded = jnp.pad(short, ((0, 0), (0, 12)))  # 20 tokens, the last 12 padding
  targets = _tokens(8, 2, 4)
  m = math.ceil(8 / ratio)
  enc_short = _apply(model, {"params": params}, short, enable_dropout=False, method=model.encode)
  enc_padded = _apply(model, {"params": params}, padded, enable_dropout=False, method=model.encode)
  valid = (np.asarray(short[1]) > 0 if ratio == 1 else np.asarray(latents_lib.latent_layout(
      cfg.latent_config(), short, jnp.broadcast_to(jnp.arange(8), (2, 8))).valid[1]))
  # The padded run sums over more keys (masked: exact zeros), blocked otherwise: the float32
  # reordering bound of the encoder's sums.
  tol = tolerances.network_atol(enc_short, tolerances.stack_reductions(
      cfg, keys=20, layers=cfg.num_encoder_layers))
  np.testing.assert_allclose(np.asarray(enc_padded[0, :m]), np.asarray(enc_short[0]), atol=tol)
  np.testing.assert_allclose(np.asarray(enc_padded[1, :m])[valid], np.asarray(enc_short[1])[valid],
                             atol=tol)
  logits_short = _apply(model, {"params": params}, short, _shift_right(targets), targets,
                             enable_dropout=False)
  logits_padded = _apply(model, {"params": params}, padded, _shift_right(targets), targets,
                              enable_dropout=False)
  np.testing.assert_allclose(np.asarray(logits_padded), np.asarray(logits_short),
                             atol=tolerances.network_atol(logits_short, _all_reductions(cfg, 20)))


def test_longer_inputs_scale_the_number_of_latents():
  cfg = dataclasses.replace(TINY, compression_ratio=4)
  model, params = _init(cfg, enc_len=16)  # "pretrained" at 16 tokens
  encoded = _apply(model, {"params": params}, _tokens(0, 1, 64), enable_dropout=False,
                        method=model.encode)
  assert encoded.shape[1] == 16


def test_separate_latent_params_with_copied_weights_equal_shared_params():
  shared_cfg = dataclasses.replace(TINY, compression_ratio=2)
  split_cfg = dataclasses.replace(shared_cfg, separate_latent_params=True)
  model, params = _init(shared_cfg)
  split_model, split_params = _init(split_cfg)
  params = jax.tree_util.tree_map(np.asarray, params)
  split_params = jax.tree_util.tree_map(np.asarray, split_params)
  # Copy the shared weights into both parameter sets of the split model.
  for i in range(split_cfg.num_encoder_layers):
    layer = dict(split_params["encoder"][f"layers_{i}"])
    for name, value in params["encoder"][f"layers_{i}"].items():
      layer[name] = value
      layer[f"latent_{name}"] = value
    split_params["encoder"][f"layers_{i}"] = layer
  for key in ("token_embedder", "decoder"):
    split_params[key] = params[key]
  for key in ("latents", "relpos_bias", "encoder_norm"):
    split_params["encoder"][key] = params["encoder"][key]
  tokens = _tokens(9, 2, 12, pad_from=[12, 7])
  a = _apply(model, {"params": params}, tokens, enable_dropout=False, method=model.encode)
  b = _apply(split_model, {"params": split_params}, tokens, enable_dropout=False,
                        method=split_model.encode)
  # Equal weights in another parameter tree: at most another float32 summation order.
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tolerances.network_atol(
      a, tolerances.stack_reductions(shared_cfg, keys=12, layers=shared_cfg.num_encoder_layers)))
  # And with their own (different) weights the latents do change.
  c = _apply(split_model, {"params": _init(split_cfg, seed=1)[1]}, tokens, enable_dropout=False,
                        method=split_model.encode)
  assert not np.allclose(np.asarray(a), np.asarray(c), atol=1e-3)


@pytest.mark.parametrize("cfg_kwargs", [dict(compression_ratio=1), dict(compression_ratio=4),
                                        dict(compression_ratio=2, separate_latent_params=True)])
def test_cached_decoding_equals_full_forward(cfg_kwargs):
  cfg = dataclasses.replace(TINY, **cfg_kwargs)
  model, params = _init(cfg, enc_len=10, dec_len=7)
  enc = _tokens(10, 2, 10, pad_from=[10, 3])
  targets = _tokens(11, 2, 7)
  dec_in = _shift_right(targets)
  full = _apply(model, {"params": params}, enc, dec_in, targets, enable_dropout=False)
  _, variables = _apply(model, {"params": params}, jnp.ones_like(enc), jnp.ones_like(targets),
                             jnp.ones_like(targets), decode=True, enable_dropout=False,
                             mutable=["cache"])
  cache = variables["cache"]
  encoded = _apply(model, {"params": params}, enc, enable_dropout=False, method=model.encode)
  step = jax.jit(functools.partial(model.apply, decode=True, enable_dropout=False,
                                   max_decode_length=7, mutable=["cache"], method=model.decode))
  steps = []
  for t in range(targets.shape[1]):
    logits, variables = step({"params": params, "cache": cache}, encoded, enc,
                             dec_in[:, t:t + 1], dec_in[:, t:t + 1])
    cache = variables["cache"]
    steps.append(logits)
  # One step at a time sums the same terms as the full pass, in another order.
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full),
                             atol=tolerances.network_atol(full, _all_reductions(cfg, 10)))


@pytest.mark.parametrize("ratio", [1, 2])
def test_packed_segments_equal_separate_examples(ratio):
  cfg = dataclasses.replace(TINY, compression_ratio=ratio)
  model, params = _init(cfg, enc_len=10, dec_len=4)
  a, b = _tokens(12, 1, 6), _tokens(13, 1, 4)  # lengths divisible by C: windows align
  ta, tb = _tokens(14, 1, 3), _tokens(15, 1, 4)
  packed_enc = jnp.concatenate([a, b], axis=1)
  packed_tgt = jnp.concatenate([ta, tb], axis=1)
  packed_in = jnp.concatenate([_shift_right(ta), _shift_right(tb)], axis=1)
  enc_seg = jnp.array([[1] * 6 + [2] * 4])
  dec_seg = jnp.array([[1] * 3 + [2] * 4])
  enc_pos = jnp.array([list(range(6)) + list(range(4))])
  dec_pos = jnp.array([list(range(3)) + list(range(4))])
  packed = _apply(model, {"params": params}, packed_enc, packed_in, packed_tgt, enc_seg, dec_seg,
                       enc_pos, dec_pos, enable_dropout=False)
  alone_a = _apply(model, {"params": params}, a, _shift_right(ta), ta, enable_dropout=False)
  alone_b = _apply(model, {"params": params}, b, _shift_right(tb), tb, enable_dropout=False)
  # Packing adds masked keys (exact zeros) and reblocks the sums: float32 reordering.
  for got, alone in ((packed[:, :3], alone_a), (packed[:, 3:], alone_b)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(alone),
                               atol=tolerances.network_atol(alone, _all_reductions(cfg, 10)))


def _packed_row(lengths, pad, seed=30):
  """One packed row of examples of `lengths` then `pad` padding: (tokens, segment ids,
  positions), each `[1, sum(lengths) + pad]`, as seqio's packing writes them."""
  rng = np.random.RandomState(seed)
  tokens = np.concatenate([rng.randint(2, 61, k) for k in lengths] + [np.zeros(pad, int)])
  segments = np.concatenate([np.full(k, s + 1) for s, k in enumerate(lengths)] + [np.zeros(pad)])
  positions = np.concatenate([np.arange(k) for k in lengths] + [np.zeros(pad)])
  return tuple(jnp.asarray(a[None], jnp.int32) for a in (tokens, segments, positions))


@pytest.mark.parametrize("ratio", [2, 3])
def test_packed_latents_restart_at_each_example(ratio):
  """Examples of 5 and 3 tokens packed into 10: each gets ceil(n_i / C) latents whose
  windows start at its own first token, the masked stride-C means of that example alone."""
  tokens, segments, positions = _packed_row([5, 3], pad=2)
  x = jnp.asarray(np.random.RandomState(31).randn(1, 10, 16), jnp.float32)
  module = latents_lib.DecalLatents(latents_lib.LatentConfig(ratio=ratio))
  out, variables = module.init_with_output(jax.random.PRNGKey(0), x, tokens, positions, segments)
  p = ref.to_numpy(variables["params"])
  first, m = 0, 0
  for seg, (start, length) in enumerate([(0, 5), (5, 3)], start=1):
    want, _, want_pos = ref.decal_latents(np.asarray(x[0, start:start + length], np.float64),
                                          np.ones(length, bool), np.arange(length),
                                          p["latent_vector"], p["latent_norm"]["scale"], ratio)
    k = math.ceil(length / ratio)
    got = slice(first, first + k)
    np.testing.assert_allclose(np.asarray(out.embeddings[0, got]), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.positions[0, got]), want_pos)
    np.testing.assert_array_equal(np.asarray(out.segment_ids[0, got]), [seg] * k)
    first, m = first + k, m + k
  assert np.asarray(out.valid[0]).tolist() == [True] * m + [False] * (math.ceil(10 / ratio) - m)
  valid, seg = latents_lib.window_validity(module.config, tokens, segments)  # the decoder's
  np.testing.assert_array_equal(np.asarray(valid), np.asarray(out.valid))
  np.testing.assert_array_equal(np.asarray(seg), np.asarray(out.segment_ids))


def test_packed_odd_length_examples_equal_separate_examples():
  """Lengths 5 and 3 at C = 2 (windows would straddle the examples if counted from the row's
  start): the packed encoder's latents equal each example encoded alone."""
  cfg = dataclasses.replace(TINY, compression_ratio=2)
  model, params = _init(cfg)
  tokens, segments, positions = _packed_row([5, 3], pad=2)
  packed = _apply(model, {"params": params}, tokens, segments, positions, enable_dropout=False,
                  method=model.encode)  # [1, 5, embed]: 3 + 2 latents, one invalid
  for got, alone in ((packed[:, :3], tokens[:, :5]), (packed[:, 3:5], tokens[:, 5:8])):
    want = _apply(model, {"params": params}, alone, enable_dropout=False, method=model.encode)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tolerances.network_atol(
        want, tolerances.stack_reductions(cfg, keys=10, layers=cfg.num_encoder_layers)))


@pytest.mark.parametrize("ratio", [2, 3])
def test_pad_inside_a_row_encoder_and_decoder_agree(ratio):
  """Pads in the middle of a row (a window may start with a pad, or hold only pads): the
  encoder's latent mask, the decoder's cross-attention mask and the numpy windows agree,
  and the whole model's logits match the numpy re-derivation."""
  cfg = dataclasses.replace(TINY, compression_ratio=ratio)
  model, params = _init(cfg)
  enc = np.array(_tokens(40, 3, 9))
  enc[0, [2, 3, 4]] = 0       # C = 2: window {2, 3} empty; window {4, 5} starts with a pad
  enc[1, [0, 3]] = 0          # the first token and one inside a window
  enc[2, [1, 2, 6, 7, 8]] = 0  # C = 3: window {6, 7, 8} empty
  enc = jnp.asarray(enc)
  targets = _tokens(41, 3, 5)
  encoded, encoder_valid = _apply(model, {"params": params}, enc,
                                  method=lambda mdl, t: mdl.encoder(t))  # deterministic
  decoder_valid, _ = t5.encoded_validity(cfg, enc)
  windows = np.pad(np.asarray(enc) > 0, ((0, 0), (0, -9 % ratio))).reshape(3, -1, ratio)
  np.testing.assert_array_equal(np.asarray(encoder_valid), windows.any(-1))
  np.testing.assert_array_equal(np.asarray(decoder_valid), windows.any(-1))
  logits = _apply(model, {"params": params}, enc, _shift_right(targets), targets,
                  enable_dropout=False)
  p = ref.to_numpy(params)
  for b in range(3):
    want_enc, valid = ref.encoder(p, np.asarray(enc[b]), cfg)
    np.testing.assert_allclose(np.asarray(encoded[b])[valid], want_enc[valid], rtol=1e-3,
                               atol=1e-4)
    want = ref.decoder_logits(p, want_enc, valid, np.asarray(_shift_right(targets)[b]), cfg)
    np.testing.assert_allclose(np.asarray(logits[b]), want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_bad_compression_ratio_is_a_clear_error(bad):
  with pytest.raises(ValueError, match="compression ratio C must be an integer >= 1"):
    T5Config(compression_ratio=bad)


def test_every_parameter_has_logical_axes():
  model, _ = _init(dataclasses.replace(TINY, compression_ratio=2, separate_latent_params=True))
  variables = jax.eval_shape(lambda: model.init(
      jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32), jnp.ones((1, 4), jnp.int32),
      jnp.ones((1, 4), jnp.int32)))
  flat_params = {k: v for k, v in jax.tree_util.tree_flatten_with_path(variables["params"])[0]}
  axes = variables["params_axes"]
  for path, value in flat_params.items():
    keys = [p.key for p in path]
    node = axes
    for k in keys[:-1]:
      node = node[k]
    names = node[keys[-1] + "_axes"].names
    assert len(names) == value.ndim, (keys, names, value.shape)


@pytest.mark.parametrize("n,ratio", [(10, 4), (12, 4), (7, 3), (5, 8)])
def test_fast_window_validity_equals_the_full_layout(n, ratio):
  tokens = _tokens(20, 4, n, pad_from=[n, 0, 1, n - 2])
  layout = latents_lib.latent_layout(latents_lib.LatentConfig(ratio=ratio), tokens,
                                     jnp.broadcast_to(jnp.arange(n), tokens.shape))
  np.testing.assert_array_equal(np.asarray(latents_lib.fixed_window_validity(tokens, ratio)),
                                np.asarray(layout.valid))
