"""The analytical FLOPs model against XLA's own count (`compiled.cost_analysis()`)."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import pytest

from decal_jax.networks import flops
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
  kv_and_scores = lambda keys: 2 * keys * d * inner * 2 + 4 * T * keys * inner
  assert (base.cross_attention - decal.cross_attention ==
          CFG.num_decoder_layers * (kv_and_scores(N) - kv_and_scores(N // 2)))
  assert decal.decoder == base.decoder
  assert decal.encoder > 1.5 * base.encoder  # 1.5 n positions, attention grows faster


# ----------------------------------------------------------------------------- decoder-only
from decal_jax.networks.decoder import Decoder, DecoderConfig  # noqa: E402  (imported by section)
from decal_jax.networks.squid import Compressed, Prefix, Squid, SquidConfig  # noqa: E402  (imported by section)

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
  forward = lambda p, t: model.apply({"params": p}, t, enable_dropout=False)
  prefill = lambda p, c, t: model.apply({"params": p, "cache": c}, t, decode=True,
                                        prefill=True, enable_dropout=False, mutable=["cache"])
  step = lambda p, c, t: model.apply({"params": p, "cache": c}, t, decode=True,
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
  compress = lambda p, t: model.apply({"params": p}, t, method=Squid.compress)
  read = lambda p, c, q: model.apply({"params": p}, c, q, method=Squid.read)
  step = lambda p, c, pre, t: model.apply(
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


# ----------------------------------------------------------------------------- GPTHF
from decal_jax.networks.gpthf import Gpthf, GpthfConfig  # noqa: E402  (imported by section)

# 2 word-level + 1 sentence-level block of DEC's sizes; a body cache of SLOTS slots.
GPTHF = GpthfConfig(decoder=dataclasses.replace(DEC, num_layers=3, max_length=SLOTS),
                    encoder_layers=2, sentence_end_id=500, max_sentence_length=64)


def test_gpthf_flops_match_xla_for_cached_steps_and_a_parallel_pass():
  model = Gpthf(GPTHF)
  tokens = jnp.ones((BATCH, PROMPT), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens[:, :8],
                                             enable_dropout=False))["params"]
  cache = jax.eval_shape(lambda p: model.apply(
      {"params": p}, tokens[:, :8], decode=True, enable_dropout=False,
      mutable=["cache"])[1]["cache"], params)
  forward = lambda p, t: model.apply({"params": p}, t, enable_dropout=False)
  step = lambda p, c, t: model.apply({"params": p, "cache": c}, t, decode=True,
                                     enable_dropout=False, mutable=["cache"])
  prompt_step = lambda p, c, t: step(p, c, t)[1]
  # One step scores all 64 sentence slots and all SLOTS body slots + its own row, densely.
  assert flops.gpthf_step_flops(GPTHF) == pytest.approx(
      _xla_flops(step, params, cache, tokens[:, :1]) / BATCH, rel=0.10)
  assert flops.gpthf_step_flops(GPTHF, logits=False) == pytest.approx(
      _xla_flops(prompt_step, params, cache, tokens[:, :1]) / BATCH, rel=0.10)
  assert flops.gpthf_forward_flops(GPTHF, PROMPT) == pytest.approx(
      _xla_flops(forward, params, tokens) / BATCH, rel=0.10)


def test_gpt_generation_steps_match_xla_as_generate_and_generate_uncached_run_them():
  """A prompt step whose logits nobody reads, a generation step, and one uncached step
  (the whole buffer, one position's logits read): what `gpt_generation_flops` sums."""
  model, params, cache = _decoder_variables(DEC, SLOTS)
  tokens = jnp.ones((BATCH, SLOTS), jnp.int32)
  step = lambda p, c, t: model.apply({"params": p, "cache": c}, t, decode=True,
                                     enable_dropout=False, mutable=["cache"])
  prompt_step = lambda p, c, t: step(p, c, t)[1]
  prompt, new = SLOTS - 20, 20
  want = flops.gpt_generation_flops(DEC, prompt, new, cached=True)
  assert want.prompt / prompt == pytest.approx(
      _xla_flops(prompt_step, params, cache, tokens[:, :1]) / BATCH, rel=0.10)
  assert want.generation / new == pytest.approx(
      _xla_flops(step, params, cache, tokens[:, :1]) / BATCH, rel=0.10)
  # The LM head runs at every buffer position though one is read: with a vocabulary this
  # large, counting only that one would fall a third short.
  wide = dataclasses.replace(DEC, vocab_size=4096)
  wide_model, params, _ = _decoder_variables(wide, SLOTS)
  uncached_step = lambda p, t, i: jnp.argmax(
      wide_model.apply({"params": p}, t, enable_dropout=False)[:, i], axis=-1)
  uncached = flops.gpt_generation_flops(wide, prompt, new, cached=False)
  assert uncached.prompt == 0
  assert uncached.generation / new == pytest.approx(
      _xla_flops(uncached_step, params, tokens, jnp.int32(prompt)) / BATCH, rel=0.10)


# 1 word-level + 1 sentence-level block: emb 4, 2 query heads / 1 kv head of 2, mlp 8,
# vocab 10, 8 body slots, sentences of at most 3 tokens. Per block and position: q + out
# 2*4*(4 + 4) = 64, k + v 2*4*(2 + 2) = 32, SwiGLU 3 * 2*4*8 = 192 (288 in all), plus
# 2*2*4 = 16 per scored key; LM head 2*4*10 = 80; a keys / values-only block 32.
HAND = GpthfConfig(decoder=DecoderConfig(vocab_size=10, emb_dim=4, num_heads=2,
                                         num_kv_heads=1, head_dim=2, mlp_dim=8, num_layers=2,
                                         max_length=8),
                   encoder_layers=1, sentence_end_id=9, max_sentence_length=3)


def test_sentence_places_hand_worked():
  assert flops.sentence_places(5, [2, 3], 3) == ([0, 1, 0, 1, 2], [0, 0, 1, 1, 1])
  # A 5-token sentence is cut at the 3-token bound, as `gpthf.sentence_layout` cuts it.
  assert flops.sentence_places(5, [5], 3) == ([0, 1, 2, 0, 1], [0, 0, 0, 1, 1])
  assert flops.sentence_places(5, None, 3) == ([0, 1, 2, 0, 1], [0, 0, 0, 1, 1])
  assert flops.sentence_places(5, 2.0, 3) == ([0, 1, 0, 1, 0], [0, 0, 1, 1, 2])
  with pytest.raises(ValueError, match="do not cover"):
    flops.sentence_places(5, [2, 2], 3)
  with pytest.raises(ValueError, match=">= 1"):
    flops.sentence_places(5, [2, 0, 3], 3)


def test_gpthf_generation_flops_hand_worked():
  """2 prompt steps, then 3 generation steps. Dense: the word-level block scores 3 slots
  (288 + 48 = 336), the sentence-level block 8 + 1 (288 + 144 = 432); a prompt step has no
  head and its last block writes keys / values only: 336 + 32 = 368; a generation step
  336 + 432 + 80 = 848. Causal, sentences [2, 3]: (place, sentence) = (0, 0) (1, 0) (0, 1)
  (1, 1) (2, 1), keys place + 1 and sentence + 1."""
  dense = flops.gpthf_generation_flops(HAND, 2, 3)
  assert (dense.prompt, dense.generation) == (2 * 368, 3 * 848)
  # Dense counting ignores the sentence structure: every step scores every slot.
  assert flops.gpthf_generation_flops(HAND, 2, 3, [1, 1, 1, 1, 1]) == dense
  causal = flops.gpthf_generation_flops(HAND, 2, 3, [2, 3], causal=True)
  assert causal.prompt == (288 + 16 + 32) + (288 + 32 + 32)
  assert causal.generation == ((288 + 16) + (288 + 32) + 80 + (288 + 32) + (288 + 32) + 80
                               + (288 + 48) + (288 + 32) + 80)
  # One parallel pass over the 5 tokens: dense 25 pairs per block; causal, the word-level
  # block 1 + 2 + 1 + 2 + 3 = 9 pairs, the sentence-level one 1 + 1 + 2 + 2 + 2 = 8.
  assert flops.gpthf_forward_flops(HAND, 5) == 2 * (5 * 288 + 16 * 25) + 5 * 80
  assert flops.gpthf_forward_flops(HAND, 5, [2, 3], causal=True) == (
      5 * 288 + 16 * 9 + 5 * 288 + 16 * 8 + 5 * 80)


def test_gpt_generation_flops_add_up_as_derived():
  """Cached: P prompt steps (keys / values only at the last block, no head) and K steps,
  all over P + K slots; prefill: the prompt in one causal pass; no cache: K whole passes
  over the P + K buffer."""
  cfg, prompt, new = DEC, 100, 20
  slots = prompt + new
  cached = flops.gpt_generation_flops(cfg, prompt, new, cached=True)
  assert cached.prompt == prompt * flops.decoder_flops(cfg, 1, slots - 1, logits_positions=0,
                                                       keys_values_only=True)
  assert cached.generation == new * flops.decoder_flops(cfg, 1, slots - 1)
  prefill = flops.gpt_generation_flops(cfg, prompt, new, cached=True, prefill=True)
  assert prefill.prompt == flops.decoder_flops(cfg, prompt, logits_positions=0,
                                               keys_values_only=True)
  assert prefill.generation == cached.generation
  assert flops.gpt_generation_flops(cfg, prompt, new, cached=False).total == (
      new * flops.decoder_flops(cfg, slots))
  causal = flops.gpt_generation_flops(cfg, prompt, new, cached=True, causal=True)
  assert causal.generation == sum(flops.decoder_flops(cfg, 1, i, causal=True)
                                  for i in range(prompt, slots))
  with pytest.raises(ValueError, match="prefill"):
    flops.gpt_generation_flops(cfg, prompt, new, cached=False, prefill=True)


def test_paper_count_hand_worked():
  """The paper's count on HAND, P = 2, K = 3, sentences [2, 3]: the fed tokens' (place,
  sentence) are (0, 0) (1, 0) | (0, 1) (1, 1) (2, 1), so the steps rerun (1, 2), (2, 2), (3, 2)
  (word-level tokens, sentence-level rows). Dense pairs: 16 per pair, 288 per position and
  block, head 80. Prompt: the word-level block over 2 tokens, 2 * 288 + 4 * 16 = 640. Steps:
  word-level 1 * 288 + 16 = 304, 2 * 288 + 64 = 640, 3 * 288 + 144 = 1008; sentence-level
  2 * 288 + 64 = 640 each; + 80 each."""
  assert flops.paper_steps(HAND, 2, 3, [2, 3]) == [(1, 2), (2, 2), (3, 2)]
  ours = flops.gpthf_paper_generation_flops(HAND, 2, 3, [2, 3])
  assert (ours.prompt, ours.generation) == (640, (304 + 640 + 80) + (640 + 640 + 80)
                                            + (1008 + 640 + 80))
  # GPT (both blocks) reruns 3, 4, 5 positions: 2 * (L * 288 + 16 * L^2) + 80.
  gpt = flops.gpt_paper_generation_flops(HAND.decoder, 2, 3)
  assert (gpt.prompt, gpt.generation) == (0, (2 * (864 + 144) + 80) + (2 * (1152 + 256) + 80)
                                          + (2 * (1440 + 400) + 80))


def test_growing_uncached_buffer_flops_hand_worked():
  """generate_uncached(bucket=2), P = 2, K = 3: steps 0-1 run over 4 positions, step 2 over
  5, logits everywhere: 2 blocks x (L * 288 + 16 * L^2) + L * 80."""
  four, five = 2 * (4 * 288 + 16 * 16) + 4 * 80, 2 * (5 * 288 + 16 * 25) + 5 * 80
  grown = flops.gpt_generation_flops(HAND.decoder, 2, 3, cached=False, bucket=2)
  assert grown.generation == 2 * four + five
  assert flops.gpt_generation_flops(HAND.decoder, 2, 3, cached=False).generation == 3 * five
  assert flops.gpt_generation_flops(HAND.decoder, 2, 3, cached=False, bucket=1).generation == (
      2 * (3 * 288 + 16 * 9) + 3 * 80 + four + five)
