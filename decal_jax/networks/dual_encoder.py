"""A multi-vector dual encoder on one shared (DeCAL) T5 encoder, for retrieval.

Queries and passages go through the same encoder weights, each at its own compression
ratio, by default the same C (decal.txt §4.3 compresses both sides; queries at a lower C,
e.g. 1, is the asymmetric variant it leaves for later): a text of n tokens leaves the
encoder as m = ceil(n / C) vectors (the DeCAL latents; n token states at C = 1). An
optional linear projection maps them to `projection_dim`, and they are L2-normalised.
Relevance is MaxSim (Chamfer similarity, `decal_jax.retrieval.maxsim`): every query
vector takes its best match among the passage's vectors and the matches are summed.
`pooling='mean'` instead averages a text's vectors into one: the single-vector dual
encoder, the reference point.

The parameter names are those of `t5.Transformer` (`token_embedder`, `encoder/...`), so a
DeCAL pretraining checkpoint initialises the dual encoder directly; its decoder is unused.
"""
import dataclasses
from typing import NamedTuple, Optional

import flax.linen as nn
import jax.numpy as jnp

from decal_jax.layers.core import Array, DenseGeneral, Embed, with_sharding_constraint
from decal_jax.networks.signatures import check_tokens
from decal_jax.networks.t5 import Encoder, T5Config

POOLINGS = ("multi", "mean")


@dataclasses.dataclass(frozen=True)
class DualEncoderConfig:
  """One shared T5 encoder read at two compression ratios, plus the output head.

  Queries are read at `query_compression_ratio` and passages at `passage_compression_ratio`
  (1 = one vector per token), by default both at 4 (the paper reads both sides at C);
  `encoder.compression_ratio` must stay 1 (it would be ignored, so another value is
  refused)."""
  encoder: T5Config = T5Config()
  query_compression_ratio: int = 4      # as passages (a lower value: asymmetric encoder)
  passage_compression_ratio: int = 4
  projection_dim: Optional[int] = None  # None: keep the encoder's emb_dim
  normalize: bool = True                # L2-normalise every output vector
  pooling: str = "multi"                # 'multi' (MaxSim) or 'mean' (one vector per text)

  def __post_init__(self):
    if self.encoder.compression_ratio != 1:
      raise ValueError(
          f"DualEncoderConfig.encoder.compression_ratio is {self.encoder.compression_ratio}, "
          "but the dual encoder reads each side at its own ratio: leave it at 1 and set "
          "DualEncoderConfig.query_compression_ratio / passage_compression_ratio instead "
          "(gin: QUERY_COMPRESSION_RATIO / PASSAGE_COMPRESSION_RATIO).")
    for name in ("query_compression_ratio", "passage_compression_ratio"):
      if getattr(self, name) < 1:
        raise ValueError(f"DualEncoderConfig.{name} must be >= 1, got {getattr(self, name)}.")
    if self.pooling not in POOLINGS:
      raise ValueError(f"DualEncoderConfig.pooling must be one of {POOLINGS}, got "
                       f"{self.pooling!r}.")
    if self.projection_dim is not None and self.projection_dim < 1:
      raise ValueError("DualEncoderConfig.projection_dim must be positive or None, got "
                       f"{self.projection_dim}.")

  @property
  def output_dim(self) -> int:
    return self.projection_dim or self.encoder.emb_dim

  def ratio(self, side: str) -> int:
    if side not in ("query", "passage"):
      raise ValueError(f"side must be 'query' or 'passage', got {side!r}.")
    return self.query_compression_ratio if side == "query" else self.passage_compression_ratio


class Encoded(NamedTuple):
  """A batch of texts as vectors: vectors `[batch, m, d]`, valid `[batch, m]` (padding
  vectors are zero)."""
  vectors: Array
  valid: Array


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
  """x / |x| over the last axis (float32 norm; a zero vector stays zero)."""
  norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True))
  return (x / jnp.maximum(norm, eps)).astype(x.dtype)


def mean_pool(vectors: Array, valid: Array) -> Encoded:
  """The mean of each text's valid vectors: `[batch, m, d]` -> `[batch, 1, d]`."""
  w = valid.astype(jnp.float32)[..., None]  # [batch, m, 1]
  total = jnp.sum(vectors.astype(jnp.float32) * w, axis=1, keepdims=True)  # [batch, 1, d]
  mean = total / jnp.maximum(jnp.sum(w, axis=1, keepdims=True), 1.0)
  return Encoded(mean.astype(vectors.dtype), jnp.any(valid, axis=1, keepdims=True))


class DualEncoder(nn.Module):
  """`encode(tokens, side)` -> `Encoded`; `__call__` encodes queries, positives and optional
  negatives (T5X Retrieval's left / right / right-negative inputs)."""
  config: DualEncoderConfig

  def setup(self):
    cfg = self.config.encoder
    self.shared_embedding = Embed(cfg.vocab_size, cfg.emb_dim, cfg.dtype, name="token_embedder")
    self.encoder = Encoder(cfg, self.shared_embedding)
    if self.config.projection_dim is not None:
      self.projection = DenseGeneral(self.config.projection_dim, kernel_axes=("embed", "mlp"),
                                     dtype=cfg.dtype)

  def encode(self, tokens: Array, side: str = "passage", *,
             enable_dropout: bool = False) -> Encoded:
    """tokens `[batch, n]` -> Encoded(vectors `[batch, m, d]`, valid `[batch, m]`)."""
    check_tokens(tokens, f"{side} tokens")
    x, valid = self.encoder(tokens, deterministic=not enable_dropout,
                            compression_ratio=self.config.ratio(side))  # [batch, m, embed]
    if self.config.projection_dim is not None:
      x = self.projection(x)  # [batch, m, d]
    x = with_sharding_constraint(x, ("batch", "length", "embed"))
    if self.config.pooling == "mean":
      x, valid = mean_pool(x, valid)  # [batch, 1, d]
    if self.config.normalize:
      x = l2_normalize(x)
    x = x * valid[..., None].astype(x.dtype)  # padding vectors are exactly zero
    return Encoded(x, valid)

  def __call__(self, left_encoder_input_tokens: Array, right_encoder_input_tokens: Array,
               right_negative_encoder_input_tokens: Optional[Array] = None, *,
               enable_dropout: bool = True):
    """(queries, positives, negatives or None), each an `Encoded`."""
    queries = self.encode(left_encoder_input_tokens, "query", enable_dropout=enable_dropout)
    positives = self.encode(right_encoder_input_tokens, "passage",
                            enable_dropout=enable_dropout)
    negatives = None
    if right_negative_encoder_input_tokens is not None:
      negatives = self.encode(right_negative_encoder_input_tokens, "passage",
                              enable_dropout=enable_dropout)
    return queries, positives, negatives
