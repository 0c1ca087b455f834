"""DeCAL latents: the compressed sequence that is prepended to the T5 encoder input.

For input embeddings x `[batch, n, embed]` and compression ratio C, DeCAL builds
m = ceil(n / C) latents

    l = Norm(v + Pool_C(x))

where v is one learned vector broadcast to every latent and Pool_C is a masked mean over
the tokens assigned to each latent (fixed windows of C tokens, or variable windows that
end at boundary tokens such as sentence punctuation). The encoder then runs unchanged over
[l; x] and only the m latent states leave it. Latent j sits at the integer mean of its
tokens' positions, which is what the T5 relative position bias sees.

`DecalCompressor` is the method's compressor config for the T5 encoder ('latents' in
`compress/registry.py`; `compress/base.py` says what a compressor answers).
"""
import dataclasses
import math
from typing import ClassVar, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from decal_jax.compress.base import (Compressor, CostPart, EncoderStream, InputsPart,
                                     check_ratio, fixed_window_validity)
from decal_jax.layers.core import Array, DType, RMSNorm, param_with_axes


@dataclasses.dataclass(frozen=True)
class LatentConfig:
  """How DeCAL forms its latent sequence.

  Attributes:
    ratio: compression ratio C (an integer >= 1); m = ceil(n / C) latents for n tokens.
    use_pooling: add the pooled token embeddings to v (False = v only, the paper's ablation).
    boundary_token_ids: if non-empty, variable-length windows: a window closes after any of
      these token ids (e.g. '.', '?', '!') or once it holds `max_window` tokens. Up to
      ceil(n / C) latents are kept; a text with fewer windows leaves the rest masked out.
    max_window: the longest variable window (defaults to 2 * ratio).
  """
  ratio: int = 1
  use_pooling: bool = True
  boundary_token_ids: Sequence[int] = ()
  max_window: Optional[int] = None

  def __post_init__(self):
    check_ratio(self.ratio)
    if self.max_window is not None and self.max_window < 1:
      raise ValueError(f"max_window must be >= 1, got {self.max_window}.")

  def num_latents(self, num_tokens: int) -> int:
    return math.ceil(num_tokens / self.ratio)


class Latents(NamedTuple):
  embeddings: Array   # [batch, m, embed]
  valid: Array        # [batch, m] bool: the latent has at least one token
  positions: Array    # [batch, m] int32: integer mean of its tokens' positions
  segment_ids: Array  # [batch, m] int32: the packed segment it belongs to (0 = padding)
  assignment: Array   # [batch, n] int32: latent index of every token (-1 = none)


def fixed_assignment(token_valid: Array, segment_ids: Array, ratio: int,
                     num_latents: int) -> Array:
  """Windows of C tokens counted from the start of each segment: a packed example gets
  ceil(n_i / C) windows aligned to its own first token, numbered after the previous
  example's. Token -> window index; pads, segment 0 and windows past `num_latents` -> -1.
  Unpacked (one segment per row, segment ids all 1) this is token i -> latent i // C,
  whatever pads the row holds. `[batch, n]` -> `[batch, n]`."""
  n = token_valid.shape[1]
  index = jnp.arange(n, dtype=jnp.int32)  # [n]
  prev_segment = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]  # [batch, n]
  starts = (segment_ids != prev_segment) & (segment_ids > 0)  # [batch, n] segment starts
  start_index = jax.lax.cummax(jnp.where(starts, index[None, :], 0), axis=1)  # [batch, n]
  opens = (segment_ids > 0) & ((index[None, :] - start_index) % ratio == 0)  # [batch, n]
  window = jnp.cumsum(opens.astype(jnp.int32), axis=1) - 1  # [batch, n]
  keep = token_valid & (segment_ids > 0) & (window < num_latents)
  return jnp.where(keep, window, -1).astype(jnp.int32)


def boundary_assignment(tokens: Array, token_valid: Array, segment_ids: Array,
                        boundary_ids: Sequence[int], max_window: int,
                        num_latents: int) -> Array:
  """Variable windows: close a window after a boundary token, after `max_window` tokens,
  or at a segment change. Windows past `num_latents` are dropped (-1). `[batch, n]`."""
  is_boundary = jnp.isin(tokens, jnp.asarray(list(boundary_ids), tokens.dtype))  # [batch, n]
  prev_segment = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]  # [batch, n]
  prev_boundary = jnp.pad(is_boundary, ((0, 0), (1, 0)))[:, :-1]
  starts_new = (segment_ids != prev_segment) | prev_boundary  # [batch, n]

  def step(carry, inputs):
    window, filled = carry  # [batch] current window index and its size so far
    new, valid = inputs
    open_new = (new | (filled >= max_window)) & (filled > 0)
    window = window + open_new.astype(jnp.int32)
    filled = jnp.where(open_new, 0, filled) + valid.astype(jnp.int32)
    return (window, filled), window

  batch = tokens.shape[0]
  init = (jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32))
  _, windows = jax.lax.scan(step, init, (starts_new.T, token_valid.T))  # [n, batch]
  windows = windows.T  # [batch, n]
  keep = token_valid & (windows < num_latents)
  return jnp.where(keep, windows, -1).astype(jnp.int32)


class LatentLayout(NamedTuple):
  """Where the latents sit, computed from token ids alone (no embeddings needed)."""
  assignment: Array   # [batch, n] int32: latent index of every token (-1 = none)
  onehot: Array       # [batch, n, m] float32: the same, one-hot
  count: Array        # [batch, m] float32: tokens per latent
  valid: Array        # [batch, m] bool: the latent has at least one token
  positions: Array    # [batch, m] int32: integer mean of its tokens' positions
  segment_ids: Array  # [batch, m] int32: the packed segment it belongs to (0 = padding)


def latent_layout(config: LatentConfig, tokens: Array, positions: Array,
                  segment_ids: Optional[Array] = None) -> LatentLayout:
  """Assigns tokens `[batch, n]` to m = ceil(n / C) latents; see `LatentLayout`. Packed
  (`segment_ids` given), windows restart at each example's first token; if a row's examples
  need more than m windows in all, the last one's final windows are dropped (never when
  the row keeps (examples) x (C - 1) positions of padding)."""
  token_valid = tokens > 0  # [batch, n]
  if segment_ids is None:  # one example per row: token i -> i // C, pads anywhere or not
    segment_ids = jnp.ones_like(tokens, dtype=jnp.int32)
  m = config.num_latents(tokens.shape[1])
  if config.boundary_token_ids:
    assignment = boundary_assignment(tokens, token_valid, segment_ids, config.boundary_token_ids,
                                     config.max_window or 2 * config.ratio, m)
  else:
    assignment = fixed_assignment(token_valid, segment_ids, config.ratio, m)
  onehot = jax.nn.one_hot(assignment, m, dtype=jnp.float32)  # [batch, n, m] (-1 -> all 0)
  count = jnp.sum(onehot, axis=1)  # [batch, m]
  valid = count > 0
  pos_sum = jnp.einsum("bnm,bn->bm", onehot, positions.astype(jnp.float32))
  # Integer mean = floor(sum / count); the sums of int positions are exact in float32.
  mean_pos = jnp.floor(pos_sum / jnp.maximum(count, 1.0) + 1e-6).astype(jnp.int32)
  seg = jnp.max(onehot * segment_ids[:, :, None].astype(jnp.float32), axis=1)  # [batch, m]
  return LatentLayout(assignment, onehot, count, valid, jnp.where(valid, mean_pos, 0),
                      jnp.where(valid, seg, 0).astype(jnp.int32))


def window_validity(config: LatentConfig, tokens: Array, segment_ids: Optional[Array] = None
                    ) -> Tuple[Array, Optional[Array]]:
  """(valid `[batch, m]`, segment ids `[batch, m]` or None) of the windows from the raw tokens
  `[batch, n]`: the cheap fixed-window path for unpacked inputs without boundary tokens,
  else the full layout. The one latent mask: the encoder's self-attention and the decoder's
  cross-attention both read it, so a pad inside a row cannot make them disagree."""
  if segment_ids is None and not config.boundary_token_ids:
    return fixed_window_validity(tokens, config.ratio), None
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  layout = latent_layout(config, tokens, positions, segment_ids)
  return layout.valid, (layout.segment_ids if segment_ids is not None else None)


def masked_mean_pool(x: Array, layout: LatentLayout) -> Array:
  """Mean of the token embeddings `[batch, n, embed]` of each latent -> `[batch, m, embed]`."""
  summed = jnp.einsum("bnm,bne->bme", layout.onehot, x.astype(jnp.float32))
  return (summed / jnp.maximum(layout.count, 1.0)[..., None]).astype(x.dtype)


class DecalLatents(nn.Module):
  """Builds the DeCAL latent sequence from the encoder's input embeddings."""
  config: LatentConfig
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, x: Array, tokens: Array, positions: Array,
               segment_ids: Optional[Array] = None) -> Latents:
    """x `[batch, n, embed]`; tokens/positions/segment_ids `[batch, n]` -> `Latents`."""
    layout = latent_layout(self.config, tokens, positions, segment_ids)
    pooled = masked_mean_pool(x, layout)  # [batch, m, embed]
    v = param_with_axes("latent_vector", nn.initializers.normal(stddev=1.0), (x.shape[-1],),
                        jnp.float32, axes=("embed",))
    seed = jnp.broadcast_to(jnp.asarray(v, self.dtype), pooled.shape)  # [batch, m, embed]
    if self.config.use_pooling:
      seed = seed + pooled
    latents = RMSNorm(dtype=self.dtype, name="latent_norm")(seed)  # [batch, m, embed]
    return Latents(latents, layout.valid, layout.positions, layout.segment_ids,
                   layout.assignment)


@dataclasses.dataclass(frozen=True)
class DecalCompressor(Compressor):
  """DeCAL (`T5Config.compressor = 'latents'`): m = ceil(n / C) latents prepended, the
  encoder runs over [latents; tokens] and only the latent states leave it.

  Attributes (`T5Config` fields in brackets): use_pooling [use_pooling], separate_params
  [separate_latent_params]: the latents get their own layer parameters (attention still
  joint), boundary_token_ids [latent_boundary_token_ids], max_window [latent_max_window]:
  see `LatentConfig`.
  """
  use_pooling: bool = True
  separate_params: bool = False
  boundary_token_ids: Tuple[int, ...] = ()
  max_window: Optional[int] = None
  label: ClassVar[str] = "DeCAL latents"
  exclusive_options: ClassVar[Tuple[str, ...]] = ("use_pooling", "separate_latent_params",
                                                  "latent_boundary_token_ids")

  def __post_init__(self):
    object.__setattr__(self, "boundary_token_ids", tuple(self.boundary_token_ids))
    self.latent_config()  # validates, with LatentConfig's messages

  @classmethod
  def from_t5(cls, cfg) -> "DecalCompressor":
    return cls(ratio=cfg.compression_ratio, use_pooling=cfg.use_pooling,
               separate_params=cfg.separate_latent_params,
               boundary_token_ids=tuple(cfg.latent_boundary_token_ids),
               max_window=cfg.latent_max_window)

  def latent_config(self) -> LatentConfig:
    return LatentConfig(ratio=self.ratio, use_pooling=self.use_pooling,
                        boundary_token_ids=self.boundary_token_ids, max_window=self.max_window)

  @property
  def compresses(self) -> bool:
    return self.ratio > 1 or bool(self.boundary_token_ids)

  def module(self, cfg) -> DecalLatents:
    return DecalLatents(self.latent_config(), cfg.dtype, name="latents")

  def encoder_length(self, n: int) -> int:
    return self.output_length(n) + n

  def encoder_inputs(self, cfg, x, tokens, positions, segment_ids) -> EncoderStream:
    """[latents; tokens]: x `[batch, m + n, embed]` and its valid / positions / segments."""
    lat = self.module(cfg)(x, tokens, positions, segment_ids)
    m = lat.embeddings.shape[1]
    # The latents' mask is the decoder's (`encoded_validity`): one function for both sides.
    latent_valid, _ = self.encoded_validity(tokens, segment_ids)  # [batch, m]
    seg = None
    if segment_ids is not None:
      seg = jnp.concatenate([lat.segment_ids, segment_ids], axis=1)  # [batch, m + n]
    return EncoderStream(jnp.concatenate([lat.embeddings, x], axis=1),  # [batch, m + n, embed]
                         jnp.concatenate([latent_valid, tokens > 0], axis=1),
                         jnp.concatenate([lat.positions, positions], axis=1), seg,
                         separate_prefix=m if self.separate_params else 0)

  def encoder_outputs(self, cfg, states, stream, tokens, positions, segment_ids):
    m = states.shape[1] - tokens.shape[1]
    return states[:, :m], stream.valid[:, :m]  # only the latents leave the encoder

  def encoded_validity(self, tokens, segment_ids=None):
    return window_validity(self.latent_config(), tokens, segment_ids)

  def own_flops(self, n: int, count) -> float:
    m = self.output_length(n)
    return count.mean_pool(n, m) + 2 * n * m  # + the latent positions, [n] x [n, m]

  def cost_parts(self, cfg, embeddings, tokens, positions):
    return [CostPart("DeCAL pooling + concat", 1, InputsPart(self, cfg),
                     (embeddings, tokens, positions))]
