"""Memory tokens: the CCProxy baseline of the DeCAL paper (§4.2.5).

CCProxy distils what ICAE, AutoCompressor and COCOM share: m = ceil(n / C) learned memory
embeddings are appended after the input, the encoder attends causally over [x; memory]
(as the decoder-only models those methods start from do), and only the final states of the
memory tokens leave the encoder.

Memory token j of an example with `length` real tokens sits at position `length + j`, right
after its text, so the causal mask "key position <= query position" lets it read the whole
text and memory tokens 0..j, and lets no text token read any memory token. Memory j is real
when j < ceil(length / C) (right-padded inputs), matching DeCAL's window validity.

`MemoryCompressor` is the method's compressor config ('memory_tokens' in
compress/registry.py); `MemoryTokens` also serves Squid (a fixed N, `ratio=None`).
"""
import dataclasses
from typing import ClassVar, NamedTuple, Optional

import flax.linen as nn
import jax.numpy as jnp

from decal_jax.compress.base import (Compressor, CostPart, EncoderStream, InputsPart,
                                     fixed_window_validity)
from decal_jax.compress.latents import LatentConfig, window_validity
from decal_jax.layers.core import Array, DType, param_with_axes


class Memory(NamedTuple):
  embeddings: Array  # [batch, m, embed]
  valid: Array       # [batch, m] bool
  positions: Array   # [batch, m] int32: length + j


class MemoryTokens(nn.Module):
  """m = ceil(n / C) learned memory embeddings (rows of a `max_tokens`-row table); with
  `ratio=None`, all `max_tokens` of them for every input (Squid's fixed N)."""
  ratio: Optional[int]
  max_tokens: int
  dtype: DType = jnp.float32
  init_stddev: float = 1.0
  limit_name: str = "T5Config.max_memory_tokens"  # the setting the error message names

  @nn.compact
  def __call__(self, tokens: Array, embed_dim: int) -> Memory:
    """tokens `[batch, n]` (right-padded) -> `Memory` for m = ceil(n / C) memory tokens."""
    batch, n = tokens.shape
    m = self.max_tokens if self.ratio is None else -(-n // self.ratio)
    if m > self.max_tokens:
      raise ValueError(f"{n} input tokens at compression ratio {self.ratio} need {m} memory "
                       f"tokens but the model has {self.max_tokens}; bind "
                       f"{self.limit_name} >= {m}.")
    # A small embedding table (rows are memory-token ids), named as T5X names its token
    # embedding so that T5X's standard Adafactor factor rules and partitioning rules apply.
    table = param_with_axes("memory_embeddings", nn.initializers.normal(self.init_stddev),
                            (self.max_tokens, embed_dim), jnp.float32, axes=("vocab", "embed"))
    memory = jnp.broadcast_to(jnp.asarray(table[:m], self.dtype), (batch, m, embed_dim))
    length = jnp.sum(tokens > 0, axis=1, dtype=jnp.int32)  # [batch]
    positions = length[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :]  # [batch, m]
    valid = (jnp.ones((batch, m), bool) if self.ratio is None
             else fixed_window_validity(tokens, self.ratio))  # [batch, m]
    return Memory(memory, valid, positions)


@dataclasses.dataclass(frozen=True)
class MemoryCompressor(Compressor):
  """CCProxy (`T5Config.compressor = 'memory_tokens'`): m = ceil(n / C) memory tokens
  appended, the encoder attends causally over [tokens; memory], only the memory states leave
  it. `max_tokens` [T5Config.max_memory_tokens]: rows of the memory table (>= m)."""
  max_tokens: int = 512
  label: ClassVar[str] = "CCProxy memory tokens"

  @classmethod
  def from_t5(cls, cfg) -> "MemoryCompressor":
    return cls(ratio=cfg.compression_ratio, max_tokens=cfg.max_memory_tokens)

  def module(self, cfg) -> MemoryTokens:
    return MemoryTokens(self.ratio, self.max_tokens, cfg.dtype, name="memory")

  def encoder_length(self, n: int) -> int:
    return n + self.output_length(n)

  def encoder_inputs(self, cfg, x, tokens, positions, segment_ids) -> EncoderStream:
    """[tokens; memory]: x `[batch, n + m, embed]`, attended causally."""
    if segment_ids is not None:
      raise ValueError("CCProxy memory tokens need unpacked, right-padded inputs; set "
                       "DatasetConfig.pack = False.")
    mem = self.module(cfg)(tokens, x.shape[-1])
    return EncoderStream(jnp.concatenate([x, mem.embeddings], axis=1),  # [batch, n + m, embed]
                         jnp.concatenate([tokens > 0, mem.valid], axis=1),
                         jnp.concatenate([positions, mem.positions], axis=1), None, causal=True)

  def encoder_outputs(self, cfg, states, stream, tokens, positions, segment_ids):
    n = tokens.shape[1]
    return states[:, n:], stream.valid[:, n:]  # only the memory tokens leave the encoder

  def encoded_validity(self, tokens, segment_ids=None):
    return window_validity(LatentConfig(self.ratio), tokens, segment_ids)

  def cost_parts(self, cfg, embeddings, tokens, positions):
    return [CostPart("CCProxy memory + concat", 1, InputsPart(self, cfg),
                     (embeddings, tokens, positions))]
