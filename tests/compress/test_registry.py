"""The compressor registry: a compressor defined here (a strided mean of the final states),
registered by name, flows through the T5 network, its FLOP count and the step breakdown with
no edit to a library file; unknown names and misplaced options are clear errors."""
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax.compress import registry
from decal_jax.compress.attn_pool import AttnPoolCompressor
from decal_jax.compress.base import Compressor, NoCompressor
from decal_jax.compress.latents import DecalCompressor
from decal_jax.compress.memory import MemoryCompressor
from decal_jax.networks import flops
from decal_jax.networks.t5 import T5Config, Transformer

TINY = T5Config(vocab_size=61, emb_dim=32, num_heads=2, head_dim=8, mlp_dim=48,
                num_encoder_layers=2, num_decoder_layers=2, relative_attention_num_buckets=8,
                relative_attention_max_distance=20)


@dataclasses.dataclass(frozen=True)
class StridedMean(Compressor):
  """Toy: the encoder runs over the n tokens; output j is the mean of the real final states
  of window j (tokens jC .. jC + C - 1). No parameters."""
  label: ClassVar[str] = "strided mean"

  def encoder_outputs(self, cfg, states, stream, tokens, positions, segment_ids):
    batch, n, embed = states.shape
    m = self.output_length(n)
    valid = jnp.pad(stream.valid, ((0, 0), (0, m * self.ratio - n)))  # [batch, m * C]
    x = jnp.pad(states, ((0, 0), (0, m * self.ratio - n), (0, 0))) * valid[..., None]
    total = x.reshape(batch, m, self.ratio, embed).sum(axis=2)  # [batch, m, embed]
    count = valid.reshape(batch, m, self.ratio).sum(axis=2)  # [batch, m]
    return total / jnp.maximum(count, 1)[..., None], count > 0

  def own_flops(self, n, count):
    return n * count.cfg.emb_dim  # one add per state element


@pytest.fixture
def strided_mean():
  registry.register("strided_mean", StridedMean)
  yield StridedMean
  registry.unregister("strided_mean")


def _tokens(seed, batch, length, pad_from):
  toks = np.random.RandomState(seed).randint(2, 61, (batch, length)).astype(np.int32)
  for b, start in enumerate(pad_from):
    toks[b, start:] = 0
  return jnp.asarray(toks)


def test_builtin_names_resolve_to_their_configs():
  want = {"latents": DecalCompressor, "attn_pool": AttnPoolCompressor,
          "memory_tokens": MemoryCompressor}
  assert registry.names() == tuple(want)
  for name, cls in want.items():
    cfg = dataclasses.replace(TINY, compressor=name, compression_ratio=2)
    assert type(cfg.compression) is cls and cfg.compression.ratio == 2 and cfg.compressed
    assert cfg.compressor == name  # the field stays the name gin binds
    assert dataclasses.replace(cfg, compression_ratio=1).compression == NoCompressor()
  boundaries = dataclasses.replace(TINY, latent_boundary_token_ids=(5,))  # C = 1, windows
  assert boundaries.compression.boundary_token_ids == (5,) and boundaries.compressed
  memory = dataclasses.replace(TINY, compressor="memory_tokens", compression_ratio=4,
                               max_memory_tokens=7)
  assert memory.compression == MemoryCompressor(ratio=4, max_tokens=7)


def test_configs_compare_and_hash_by_their_fields():
  a = dataclasses.replace(TINY, compressor="attn_pool", compression_ratio=2)
  b = dataclasses.replace(TINY, compressor="attn_pool", compression_ratio=2)
  assert a == b and hash(a) == hash(b) and a.compression == b.compression
  assert a != dataclasses.replace(a, compressor="latents")


def test_a_registered_compressor_flows_through_t5(strided_mean):
  cfg = dataclasses.replace(TINY, compressor="strided_mean", compression_ratio=3)
  assert isinstance(cfg.compression, strided_mean) and cfg.compressed
  model, plain = Transformer(cfg), Transformer(dataclasses.replace(cfg, compression_ratio=1))
  ones = jnp.ones((1, 8), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), ones, ones[:, :4], ones[:, :4],
                      enable_dropout=False)["params"]
  tokens = _tokens(1, 2, 11, pad_from=[11, 4])
  encoded = model.apply({"params": params}, tokens, enable_dropout=False, method=model.encode)
  assert encoded.shape == (2, cfg.compression.output_length(11), cfg.emb_dim) == (2, 4, 32)
  states = np.asarray(plain.apply({"params": params}, tokens, enable_dropout=False,
                                  method=plain.encode))  # [2, 11, 32], the same weights
  np.testing.assert_allclose(np.asarray(encoded[0, 3]), states[0, 9:11].mean(0), atol=1e-5)
  np.testing.assert_allclose(np.asarray(encoded[1, 1]), states[1, 3:4].mean(0), atol=1e-5)
  targets = _tokens(2, 2, 5, pad_from=[])
  logits = model.apply({"params": params}, tokens, targets, targets, enable_dropout=False)
  assert logits.shape == (2, 5, cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()


def test_flops_count_a_registered_compressor_by_hand(strided_mean):
  cfg = dataclasses.replace(TINY, compressor="strided_mean", compression_ratio=4)
  n, t, m = 64, 8, 16
  d, inner, layers = cfg.emb_dim, cfg.num_heads * cfg.head_dim, cfg.num_encoder_layers
  layer = 2 * n * d * inner * 4 + 2 * 2 * n * n * inner + 2 * n * d * cfg.mlp_dim * 3
  assert flops.encoder_flops(cfg, n) == layers * layer + n * d
  cross = 2 * t * d * inner * 2 + 2 * m * d * inner * 2 + 2 * 2 * t * m * inner
  assert flops.forward_flops(cfg, n, t).cross_attention == cfg.num_decoder_layers * cross
  assert cfg.compression.cost_parts(cfg, None, None, None) == ()  # none of its own to time


def test_unknown_names_list_the_registered_ones(strided_mean):
  with pytest.raises(ValueError, match=r"Unknown T5Config.compressor 'pool'; choose one of "
                     r"\('latents', 'attn_pool', 'memory_tokens', 'strided_mean'\)"):
    T5Config(compressor="pool")
  registry.unregister("strided_mean")
  with pytest.raises(ValueError, match=r"'strided_mean'; choose one of \('latents', "
                     r"'attn_pool', 'memory_tokens'\)"):
    T5Config(compressor="strided_mean")


def test_registration_and_options_are_checked(strided_mean):
  with pytest.raises(ValueError, match="'latents' is taken by DecalCompressor"):
    registry.register("latents", strided_mean)
  with pytest.raises(TypeError, match="Compressor subclass"):
    registry.register("mean", dict)
  registry.register("strided_mean", strided_mean)  # the same class again: a no-op
  with pytest.raises(ValueError, match="use_pooling is a DeCAL latents option but "
                     "compressor is 'strided_mean'"):
    T5Config(compressor="strided_mean", compression_ratio=2, use_pooling=False)
  with pytest.raises(ValueError, match="compression ratio C must be an integer >= 1"):
    T5Config(compressor="strided_mean", compression_ratio=0)
