"""The analytical FLOPs model against XLA's own count (`compiled.cost_analysis()`)."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import pytest

from decal_jax import flops
from decal_jax.networks.t5 import T5Config, Transformer

# Sizes where, as in real models, matrix products dominate the elementwise work.
CFG = T5Config(vocab_size=512, emb_dim=256, num_heads=4, head_dim=64, mlp_dim=1024,
               num_encoder_layers=2, num_decoder_layers=2, max_memory_tokens=256)
N, T, BATCH = 256, 64, 2


def _xla_flops(fn, *args) -> float:
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"])


@pytest.mark.parametrize("kwargs", [dict(), dict(compression_ratio=2),
                                    dict(compression_ratio=4),
                                    dict(compression_ratio=2, compressor="attn_pool"),
                                    dict(compression_ratio=2, compressor="memory_tokens")])
def test_flops_model_is_within_ten_percent_of_xla(kwargs):
  cfg = dataclasses.replace(CFG, **kwargs)
  model = Transformer(cfg)
  tokens = jnp.ones((BATCH, N), jnp.int32)
  targets = jnp.ones((BATCH, T), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, targets, targets,
                                             enable_dropout=False))["params"]
  encode = functools.partial(model.apply, enable_dropout=False, method=model.encode)
  decode = functools.partial(model.apply, enable_dropout=False, method=model.decode)
  m = math.ceil(N / cfg.compression_ratio)
  encoded = jax.ShapeDtypeStruct((BATCH, m, cfg.emb_dim), jnp.float32)
  want = flops.forward_flops(cfg, N, T)
  got_encoder = _xla_flops(encode, {"params": params}, tokens) / BATCH
  got_decoder = _xla_flops(decode, {"params": params}, encoded, tokens, targets, targets) / BATCH
  assert want.encoder == pytest.approx(got_encoder, rel=0.10)
  assert want.cross_attention + want.decoder == pytest.approx(got_decoder, rel=0.10)


def test_compression_scales_the_encoder_and_cross_attention_as_derived():
  """Hand-worked: at C = 2 DeCAL's encoder runs over 1.5 n positions, and cross-attention
  keys / values and scores shrink to n / 2."""
  base = flops.forward_flops(CFG, N, T)
  decal = flops.forward_flops(dataclasses.replace(CFG, compression_ratio=2), N, T)
  inner, d = CFG.num_heads * CFG.head_dim, CFG.emb_dim
  kv_and_scores = lambda keys: 2 * keys * d * inner * 2 + 4 * T * keys * inner  # noqa: E731
  assert (base.cross_attention - decal.cross_attention ==
          CFG.num_decoder_layers * (kv_and_scores(N) - kv_and_scores(N // 2)))
  assert decal.decoder == base.decoder
  assert decal.encoder > 1.5 * base.encoder  # 1.5 n positions, attention grows faster


# ----------------------------------------------------------------------------- decoder-only
from decal_jax.networks.decoder import Decoder, DecoderConfig  # noqa: E402
from decal_jax.networks.squid import Compressed, Prefix, Squid, SquidConfig  # noqa: E402

# Matmul-dominated sizes again; GQA (4 query heads share 2 key/value heads), Qwen2's q/k/v bias.
DEC = DecoderConfig(vocab_size=512, emb_dim=256, num_heads=4, num_kv_heads=2, head_dim=64,
                    mlp_dim=1024, num_layers=2, max_length=1024, qkv_bias=True)
PROMPT, SLOTS = 256, 320  # a prompt, and a preallocated cache of SLOTS positions


def _decoder_variables(cfg, cache_length):
  model = Decoder(cfg)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.ones((BATCH, 8), jnp.int32),
                                             enable_dropout=False))["params"]
  cache = jax.eval_shape(lambda p: model.apply(
      {"params": p}, jnp.ones((BATCH, cache_length), jnp.int32), decode=True,
      enable_dropout=False, mutable=["cache"])[1]["cache"], params)
  return model, params, cache


@pytest.mark.parametrize("cfg", [DEC, dataclasses.replace(DEC, num_kv_heads=None),
                                 dataclasses.replace(DEC, tie_embeddings=True, qkv_bias=False)])
def test_decoder_flops_match_xla_forward_prefill_and_step(cfg):
  model, params, cache = _decoder_variables(cfg, SLOTS)
  prompt = jnp.ones((BATCH, PROMPT), jnp.int32)
  forward = lambda p, t: model.apply({"params": p}, t, enable_dropout=False)  # noqa: E731
  prefill = lambda p, c, t: model.apply({"params": p, "cache": c}, t, decode=True,  # noqa: E731
                                        prefill=True, enable_dropout=False, mutable=["cache"])
  step = lambda p, c, t: model.apply({"params": p, "cache": c}, t, decode=True,  # noqa: E731
                                     enable_dropout=False, mutable=["cache"])
  assert flops.decoder_flops(cfg, PROMPT) == pytest.approx(
      _xla_flops(forward, params, prompt) / BATCH, rel=0.10)
  # The prefill attends within the prompt and, as written, computes every position's logits.
  assert flops.decoder_flops(cfg, PROMPT) == pytest.approx(
      _xla_flops(prefill, params, cache, prompt) / BATCH, rel=0.10)
  # One cached step scores every slot of the preallocated cache (masked, but computed).
  assert flops.decoder_flops(cfg, 1, cached_prefix=SLOTS - 1) == pytest.approx(
      _xla_flops(step, params, cache, prompt[:, :1]) / BATCH, rel=0.10)


SQUID = SquidConfig(small=dataclasses.replace(DEC, emb_dim=128, num_heads=2, num_kv_heads=1,
                                              mlp_dim=512, num_layers=2),
                    large=dataclasses.replace(DEC, num_layers=3, qkv_bias=False),
                    memory_tokens=32)
CONTEXT, QUERY, ANSWER = 256, 16, 8


def test_squid_flops_match_xla_for_compress_read_and_a_decode_step():
  model = Squid(SQUID)
  context = jnp.ones((BATCH, CONTEXT), jnp.int32)
  query = jnp.ones((BATCH, QUERY), jnp.int32)
  answer = jnp.ones((BATCH, ANSWER), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), context[:, :40], answer,
                                             answer, query_tokens=query,
                                             enable_dropout=False))["params"]
  n, large = SQUID.memory_tokens, SQUID.large
  compressed = Compressed(jax.ShapeDtypeStruct((BATCH, n, large.emb_dim), jnp.float32),
                          jax.ShapeDtypeStruct((BATCH, n), jnp.bool_))
  kv = jax.ShapeDtypeStruct((BATCH, large.num_layers, n + QUERY, large.kv_heads,
                             large.head_dim), jnp.float32)
  prefix = Prefix(kv, kv, jax.ShapeDtypeStruct((BATCH, n + QUERY), jnp.bool_),
                  jax.ShapeDtypeStruct((BATCH,), jnp.int32))
  cache = jax.eval_shape(lambda p, pre: model.apply(
      {"params": p}, pre, None, answer, decode=True, enable_dropout=False, mutable=["cache"],
      method=Squid.decode)[1]["cache"], params, prefix)
  compress = lambda p, t: model.apply({"params": p}, t, method=Squid.compress)  # noqa: E731
  read = lambda p, c, q: model.apply({"params": p}, c, q, method=Squid.read)  # noqa: E731
  step = lambda p, c, pre, t: model.apply(  # noqa: E731
      {"params": p, "cache": c}, pre, None, t, decode=True, enable_dropout=False,
      mutable=["cache"], method=Squid.decode)
  want = flops.squid_flops(SQUID, CONTEXT, QUERY, ANSWER)
  assert want.small_decoder + want.projector == pytest.approx(
      _xla_flops(compress, params, context) / BATCH, rel=0.10)
  assert want.large_read == pytest.approx(_xla_flops(read, params, compressed, query) / BATCH,
                                          rel=0.10)
  assert want.large_generation / ANSWER == pytest.approx(
      _xla_flops(step, params, cache, prefix, answer[:, :1]) / BATCH, rel=0.10)


def test_decoder_flops_hand_worked():
  """1 layer, emb 4, 2 query heads / 1 kv head of 2, mlp 8, vocab 10; 3 new positions after
  2 cached ones: q + out 2*3*4*(4 + 4) = 192, k + v 2*3*4*(2 + 2) = 96; dense scores 3 x 5
  pairs, 2*2*15*4 = 240; SwiGLU 3 * 2*3*4*8 = 576; LM head 2*3*4*10 = 240."""
  cfg = DecoderConfig(vocab_size=10, emb_dim=4, num_heads=2, num_kv_heads=1, head_dim=2,
                      mlp_dim=8, num_layers=1)
  assert flops.decoder_flops(cfg, 3, cached_prefix=2) == 192 + 96 + 240 + 576 + 240
  # causal: positions see 3, 4, 5 keys -> 12 pairs instead of 15; logits at 1 position only.
  assert flops.decoder_flops(cfg, 3, cached_prefix=2, logits_positions=1, causal=True) == (
      192 + 96 + 2 * 2 * 12 * 4 + 576 + 2 * 4 * 10)
  with pytest.raises(ValueError, match="logits_positions"):
    flops.decoder_flops(cfg, 3, logits_positions=4)
  # A cache-filling pass with one layer needs only that layer's k / v projections.
  assert flops.decoder_flops(cfg, 3, logits_positions=0, keys_values_only=True) == 96


def test_answer_and_squid_flops_add_up_as_derived():
  """The baseline reads L + q tokens and takes A - 1 steps over a cache of L + q + A slots;
  Squid's large decoder reads N + q and takes A steps over N + q + A keys, N = L / ρ."""
  large, length, query, answer, ratio = SQUID.large, 1024, 32, 8, 8
  base = flops.answer_flops(large, length + query, answer)
  assert base.prompt == flops.decoder_flops(large, length + query, logits_positions=1)
  assert base.generation == (answer - 1) * flops.decoder_flops(large, 1, length + query +
                                                               answer - 1)
  config = dataclasses.replace(SQUID, memory_tokens=length // ratio)
  squid = flops.squid_flops(config, length, query, answer)
  n = length // ratio
  assert squid.small_decoder == flops.decoder_flops(config.small, length + n,
                                                    logits_positions=0)
  assert squid.projector == 2 * n * (128 * 256 + 256 * 256)  # Linear-GELU-Linear, hidden 256
  two_layers = dataclasses.replace(large, num_layers=2)  # the read: 2 whole layers + k / v
  assert squid.large_read == (flops.decoder_flops(two_layers, n + query, logits_positions=0)
                              + 2 * (n + query) * 256 * 2 * 128)
  assert squid.large_generation == answer * flops.decoder_flops(large, 1, n + query + answer - 1)
  assert squid.total == squid.small_decoder + squid.projector + squid.large_decoder
  # The large decoder's saving: per layer it projects L - N fewer positions.
  assert base.total / squid.large_decoder > 0.9 * (length + query) / (n + query)
  # causal counting never exceeds the dense one, and equals it for a single new position
  # that sees everything.
  assert flops.squid_flops(config, length, query, answer, causal=True).total < squid.total
  assert flops.decoder_flops(large, 1, 99, causal=True) == flops.decoder_flops(large, 1, 99)
