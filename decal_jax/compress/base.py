"""What a compressor is: the typed config the T5 encoder, the FLOP counts and the step
breakdown ask, instead of branching on a name.

A compressor is a frozen dataclass holding its method's parameters (at least the ratio C),
registered by name in `compress/registry.py`; `T5Config.compressor` (a string, what gin
binds) names it and `T5Config.compression` is the object, built from the T5Config's fields
(`Compressor.from_t5`). The encoder calls it
twice, inside its own compact scope (so the flax modules it builds sit directly under
`encoder/`, under the names saved checkpoints hold):

    stream = compression.encoder_inputs(cfg, x, tokens, positions, segment_ids)
    ... the encoder layers and final norm run over stream.x ...
    encoded, valid = compression.encoder_outputs(cfg, states, stream, tokens, positions,
                                                 segment_ids)

A new compressor is one file in compress/ with a `Compressor` subclass, plus one line in
`registry.REGISTRY` (or a `registry.register` call from the code that uses it).
`NoCompressor` is the plain T5 encoder (C = 1), which every name resolves to when it does not
compress.
"""
import dataclasses
from typing import Any, ClassVar, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
import jax.numpy as jnp

from decal_jax.layers.core import Array


def check_ratio(ratio: Any) -> None:
  """C must be an integer >= 1 (1 = the uncompressed T5 encoder)."""
  if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
    raise ValueError(
        f"The compression ratio C must be an integer >= 1, got {ratio!r}. Set e.g. "
        "`T5Config.compression_ratio = 4` (C = 1 is the uncompressed T5 encoder).")


def fixed_window_validity(tokens: Array, ratio: int) -> Array:
  """Which of the ceil(n / C) fixed windows hold a real token: `[batch, n]` -> `[batch, m]`.
  The cheap path for unpacked inputs (what the decoder needs at every decoding step)."""
  batch, n = tokens.shape
  m = -(-n // ratio)
  padded = jnp.pad(tokens > 0, ((0, 0), (0, m * ratio - n)))  # [batch, m * C]
  return jnp.any(padded.reshape(batch, m, ratio), axis=-1)  # [batch, m]


class EncoderStream(NamedTuple):
  """The sequence the encoder layers run over, as a compressor's `encoder_inputs` makes it."""
  x: Array                      # [batch, L, embed]
  valid: Array                  # [batch, L] bool
  positions: Array              # [batch, L] int32: what the relative position bias sees
  segment_ids: Optional[Array]  # [batch, L] int32, or None (unpacked)
  separate_prefix: int = 0      # leading positions with their own layer parameters
  causal: bool = False          # attend to keys at positions <= the query's only


class CostPart(NamedTuple):
  """One part of a train step that `tools/step_breakdown.py` times alone."""
  name: str
  calls: int            # per train step
  module: nn.Module
  inputs: Tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Compressor:
  """Base of every compressor config; `ratio` is C (m = ceil(n / C) outputs by default).

  Class attributes: `label`, the method's readable name (messages, the step breakdown);
  `exclusive_options`, the `T5Config` fields only this method reads (another compressor
  must leave them at their defaults: `registry.resolve` checks).
  """
  ratio: int = 1
  label: ClassVar[str] = "compressor"
  exclusive_options: ClassVar[Tuple[str, ...]] = ()

  def __post_init__(self):
    check_ratio(self.ratio)

  @classmethod
  def from_t5(cls, cfg) -> "Compressor":
    """This method's config from a `T5Config` (its ratio and the options it reads)."""
    return cls(ratio=cfg.compression_ratio)

  @property
  def compresses(self) -> bool:
    """False: the plain encoder runs instead (`registry.resolve` gives `NoCompressor`)."""
    return self.ratio > 1

  # ---------------------------------------------------------------------------- shapes
  def output_length(self, n: int) -> int:
    """m, the vectors that leave the encoder for n input positions."""
    return -(-n // self.ratio)

  def encoder_length(self, n: int) -> int:
    """L, the positions the encoder layers run over for n input positions."""
    return n

  # ---------------------------------------------------------------------------- network
  def encoder_inputs(self, cfg, x: Array, tokens: Array, positions: Array,
                     segment_ids: Optional[Array]) -> EncoderStream:
    """The token embeddings x `[batch, n, embed]` -> what the encoder layers run over.
    Called inside the encoder's compact scope: modules built here are the encoder's."""
    del cfg
    return EncoderStream(x, tokens > 0, positions, segment_ids)

  def encoder_outputs(self, cfg, states: Array, stream: EncoderStream, tokens: Array,
                      positions: Array, segment_ids: Optional[Array]) -> Tuple[Array, Array]:
    """Final (normed) encoder states `[batch, L, embed]` -> (encoded `[batch, m, embed]`,
    valid `[batch, m]`); tokens / positions / segment_ids are the inputs' `[batch, n]`."""
    raise NotImplementedError(f"{type(self).__name__} must say what leaves the encoder.")

  def encoded_validity(self, tokens: Array, segment_ids: Optional[Array] = None
                       ) -> Tuple[Array, Optional[Array]]:
    """(valid `[batch, m]`, segment ids `[batch, m]` or None) from the raw encoder tokens
    alone: what the decoder masks with. Default: the fixed windows of C tokens."""
    if segment_ids is not None:
      raise ValueError(f"{type(self).__name__} has no layout for packed inputs; set "
                       "DatasetConfig.pack = False or define its encoded_validity.")
    return fixed_window_validity(tokens, self.ratio), None

  # ---------------------------------------------------------------------------- costs
  def own_flops(self, n: int, count) -> float:
    """Forward matmul FLOPs of the method's own work for one example of n tokens, beyond
    the encoder layers (`count`: `networks.flops.EncoderCounts`, the T5 pieces)."""
    del n, count
    return 0.0

  def encoder_flops(self, n: int, count) -> float:
    """Forward matmul FLOPs of the whole encoder for one example of n tokens."""
    return count.layers(self.encoder_length(n)) + self.own_flops(n, count)

  def cost_parts(self, cfg, embeddings: Array, tokens: Array,
                 positions: Array) -> Sequence[CostPart]:
    """The method's own parts of a train step, for `tools/step_breakdown.py`; embeddings
    `[batch, n, embed]` (token embeddings or final states, as a part needs), tokens and
    positions `[batch, n]`."""
    del cfg, embeddings, tokens, positions
    return ()


@dataclasses.dataclass(frozen=True)
class NoCompressor(Compressor):
  """The plain T5.1.1 encoder: n token states leave it, unmasked beyond the padding."""
  label: ClassVar[str] = "no compression"

  @property
  def compresses(self) -> bool:
    return False

  def output_length(self, n: int) -> int:
    return n

  def encoder_outputs(self, cfg, states, stream, tokens, positions, segment_ids):
    return states, stream.valid

  def encoded_validity(self, tokens, segment_ids=None):
    return tokens > 0, segment_ids


class InputsPart(nn.Module):
  """A compressor's `encoder_inputs` alone (its module and the concatenation): `[batch, n,
  embed]` embeddings -> `[batch, L, embed]`."""
  compressor: Compressor
  config: Any  # the T5Config

  @nn.compact
  def __call__(self, embeddings: Array, tokens: Array, positions: Array) -> Array:
    return self.compressor.encoder_inputs(self.config, embeddings, tokens, positions, None).x


class OutputsPart(nn.Module):
  """A compressor's `encoder_outputs` alone on final states `[batch, n, embed]` (for a
  method whose encoder runs over the n tokens only) -> `[batch, m, embed]`."""
  compressor: Compressor
  config: Any  # the T5Config

  @nn.compact
  def __call__(self, states: Array, tokens: Array, positions: Array) -> Array:
    stream = EncoderStream(states, tokens > 0, positions, None)
    encoded, _ = self.compressor.encoder_outputs(self.config, states, stream, tokens,
                                                 positions, None)
    return encoded
