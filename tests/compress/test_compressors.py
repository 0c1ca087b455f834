"""AttnPool and CCProxy (memory tokens) against the numpy reference, plus the properties
their masks must have."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_t5 as ref
import tolerances
from decal_jax.compress import attn_pool
from decal_jax.networks.t5 import T5Config, Transformer

TINY = T5Config(vocab_size=61, emb_dim=32, num_heads=2, head_dim=8, mlp_dim=48,
                num_encoder_layers=2, num_decoder_layers=2, relative_attention_num_buckets=8,
                relative_attention_max_distance=20, max_memory_tokens=16)
CONFIGS = [dict(compressor="attn_pool", compression_ratio=2),
           dict(compressor="attn_pool", compression_ratio=3),
           dict(compressor="memory_tokens", compression_ratio=2),
           dict(compressor="memory_tokens", compression_ratio=4)]


def _tokens(seed, batch, length, pad_from=None):
  toks = np.random.RandomState(seed).randint(2, 61, (batch, length)).astype(np.int32)
  for b, start in enumerate(pad_from or []):
    toks[b, start:] = 0
  return jnp.asarray(toks)


@functools.lru_cache(maxsize=None)
def _init(cfg, seed=0):
  model = Transformer(cfg)
  ones = jnp.ones((1, 8), jnp.int32)
  params = jax.jit(lambda rng: model.init(rng, ones, ones[:, :4], ones[:, :4],
                                          enable_dropout=False)["params"])(
      jax.random.PRNGKey(seed))
  return model, params


def _encode(model, params, tokens):
  return jax.jit(functools.partial(model.apply, enable_dropout=False, method=model.encode))(
      {"params": params}, tokens)


def _shift_right(targets):
  return jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_encoder_matches_numpy(kwargs):
  cfg = dataclasses.replace(TINY, **kwargs)
  model, params = _init(cfg)
  tokens = _tokens(1, 3, 11, pad_from=[11, 6, 1])
  encoded = _encode(model, params, tokens)
  p = ref.to_numpy(params)
  for b in range(3):
    want, valid = ref.encoder(p, np.asarray(tokens[b]), cfg)
    assert encoded.shape[1] == len(want) == math.ceil(11 / cfg.compression_ratio)
    assert valid.sum() == math.ceil(int((tokens[b] > 0).sum()) / cfg.compression_ratio)
    np.testing.assert_allclose(np.asarray(encoded[b])[valid], want[valid], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("kwargs", CONFIGS[::2])
def test_full_model_logits_match_numpy(kwargs):
  cfg = dataclasses.replace(TINY, **kwargs)
  model, params = _init(cfg)
  enc, targets = _tokens(2, 2, 9, pad_from=[9, 4]), _tokens(3, 2, 5)
  logits = jax.jit(functools.partial(model.apply, enable_dropout=False))(
      {"params": params}, enc, _shift_right(targets), targets)
  p = ref.to_numpy(params)
  for b in range(2):
    encoded, valid = ref.encoder(p, np.asarray(enc[b]), cfg)
    want = ref.decoder_logits(p, encoded, valid, np.asarray(_shift_right(targets)[b]), cfg)
    np.testing.assert_allclose(np.asarray(logits[b]), want, rtol=1e-3, atol=1e-4)


def test_attn_pool_mask_hand_worked():
  """Two packed segments [1 1 1 2 2 0] at C = 2: windows restart at each segment, {0,1} {2}
  {3,4}; each window's query reads the tokens of its own segment only."""
  from decal_jax.compress.latents import LatentConfig, latent_layout
  tokens = jnp.array([[5, 6, 7, 8, 9, 0]])
  segments = jnp.array([[1, 1, 1, 2, 2, 0]])
  layout = latent_layout(LatentConfig(2), tokens, jnp.array([[0, 1, 2, 0, 1, 2]]), segments)
  np.testing.assert_array_equal(np.asarray(layout.assignment), [[0, 0, 1, 2, 2, -1]])
  mask = attn_pool.pooling_mask(layout.valid, layout.segment_ids, tokens > 0, segments)
  np.testing.assert_array_equal(np.asarray(mask[0, 0]), [[1, 1, 1, 0, 0, 0],
                                                         [1, 1, 1, 0, 0, 0],
                                                         [0, 0, 0, 1, 1, 0]])


def test_memory_tokens_are_causal():
  """Memory token j reads the whole text and memory 0..j; no text token reads any memory."""
  cfg = dataclasses.replace(TINY, compressor="memory_tokens", compression_ratio=2)
  model, params = _init(cfg)
  tokens = _tokens(4, 1, 8)  # 4 memory tokens
  base = jax.tree_util.tree_map(np.array, params)

  def run(p):
    out, state = jax.jit(functools.partial(
        model.apply, enable_dropout=False, method=model.encode,
        capture_intermediates=lambda mdl, fn: mdl.name == "layers_1" and fn == "__call__"))({"params": p}, tokens)
    (hidden,) = state["intermediates"]["encoder"]["layers_1"]["__call__"]
    return np.asarray(out[0]), np.asarray(hidden[0])  # [4, e], [8 + 4, e]

  out, hidden = run(base)
  for k in range(4):  # change memory row k: memory j < k and all text states must not move
    p = jax.tree_util.tree_map(np.array, base)
    p["encoder"]["memory"]["memory_embeddings"][k] += 1.0
    out_k, hidden_k = run(p)
    # Exactly equal: a masked key's weight is exp(-1e10 - max) = 0, whatever its value.
    np.testing.assert_array_equal(hidden_k[:8], hidden[:8])
    np.testing.assert_array_equal(out_k[:k], out[:k])
    assert all(not np.allclose(out_k[j], out[j], atol=1e-4) for j in range(k, 4))
  changed = np.asarray(tokens).copy()
  changed[0, 7] = 3 if changed[0, 7] != 3 else 4  # the last text token: every memory reads it
  out_t = _encode(model, params, jnp.asarray(changed))[0]
  assert all(not np.allclose(np.asarray(out_t[j]), out[j], atol=1e-4) for j in range(4))


@pytest.mark.parametrize("kwargs", CONFIGS[::2])
def test_cached_decoding_equals_full_forward(kwargs):
  cfg = dataclasses.replace(TINY, **kwargs)
  model, params = _init(cfg)
  enc, targets = _tokens(5, 2, 10, pad_from=[10, 3]), _tokens(6, 2, 6)
  dec_in = _shift_right(targets)
  full = jax.jit(functools.partial(model.apply, enable_dropout=False))(
      {"params": params}, enc, dec_in, targets)
  _, variables = model.apply({"params": params}, jnp.ones_like(enc), jnp.ones_like(targets),
                             jnp.ones_like(targets), decode=True, enable_dropout=False,
                             mutable=["cache"])
  cache, encoded = variables["cache"], _encode(model, params, enc)
  step = jax.jit(functools.partial(model.apply, decode=True, enable_dropout=False,
                                   mutable=["cache"], method=model.decode))
  steps = []
  for t in range(targets.shape[1]):
    logits, variables = step({"params": params, "cache": cache}, encoded, enc,
                             dec_in[:, t:t + 1], dec_in[:, t:t + 1])
    cache = variables["cache"]
    steps.append(logits)
  # One step at a time sums the same terms as the full pass, in another order.
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full),
                             atol=tolerances.network_atol(full, tolerances.stack_reductions(
                                 cfg, 10, cfg.num_encoder_layers + cfg.num_decoder_layers)))


def test_attn_pool_packed_segments_equal_separate_examples():
  cfg = dataclasses.replace(TINY, compressor="attn_pool", compression_ratio=2)
  model, params = _init(cfg)
  a, b = _tokens(7, 1, 6), _tokens(8, 1, 4)
  packed = jax.jit(functools.partial(model.apply, enable_dropout=False, method=model.encode))(
      {"params": params}, jnp.concatenate([a, b], axis=1), jnp.array([[1] * 6 + [2] * 4]),
      jnp.array([list(range(6)) + list(range(4))]))
  # Packing adds masked keys (exact zeros) and reblocks the sums: float32 reordering.
  for got, alone in ((packed[:, :3], _encode(model, params, a)),
                     (packed[:, 3:], _encode(model, params, b))):
    np.testing.assert_allclose(np.asarray(got), np.asarray(alone), atol=tolerances.network_atol(
        alone, tolerances.stack_reductions(cfg, keys=10, layers=cfg.num_encoder_layers)))


def test_bad_compressor_settings_are_clear_errors():
  with pytest.raises(ValueError, match="Unknown T5Config.compressor 'pool'.*latents"):
    T5Config(compressor="pool")
  with pytest.raises(ValueError, match="use_pooling is a DeCAL latents option"):
    T5Config(compressor="attn_pool", use_pooling=False)
  cfg = dataclasses.replace(TINY, compressor="memory_tokens", compression_ratio=2)
  model, params = _init(cfg)
  with pytest.raises(ValueError, match="need 20 memory tokens .*max_memory_tokens >= 20"):
    _encode(model, params, _tokens(9, 1, 40))
  with pytest.raises(ValueError, match="unpacked.*pack = False"):
    model.apply({"params": params}, _tokens(9, 1, 8), jnp.ones((1, 8), jnp.int32),
                method=model.encode)
