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
