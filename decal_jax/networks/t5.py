"""T5.1.1 encoder-decoder with an optional compressive encoder.

With `compression_ratio = 1` the encoder is the plain T5.1.1 encoder. With C > 1 it outputs
m = ceil(n / C) vectors for n tokens, made by the compressor `T5Config.compressor` names (a
key of `compress/registry.REGISTRY`; `T5Config.compression` is its typed config, which the
encoder asks, `compress/base.py`):

- 'latents' (DeCAL, `compress/latents.py`): m latents are prepended to the input, the
  encoder runs unchanged over [latents; tokens], only the latent states leave it.
- 'attn_pool' (AttnPool, `compress/attn_pool.py`): the encoder runs uncompressed, then one
  attention-pooling layer with stride-C mean-pooled queries reduces its output.
- 'memory_tokens' (CCProxy, `compress/memory.py`): m learned memory tokens are appended,
  the encoder attends causally, only the memory states leave it.

A new compressor is one file in compress/ plus its registration; nothing here names one.

The decoder cross-attends to the m vectors with the window padding mask.

The module follows the call signatures that `t5x.models.EncoderDecoderModel` uses
(`__call__`, `encode`, `decode`), so it can be dropped into a T5X gin config.

Performance options (`T5Config.scan_layers`, `remat_policy`, `dtype`, `fused_qkv`,
`attention_kernel`; docs/performance.md) change how the same function is computed, never
what it computes: `tests/networks/test_performance_options.py` holds each to the plain path.
"""
import dataclasses
from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import partitioning as nn_partitioning

from decal_jax.compress import registry
from decal_jax.compress.base import Compressor, check_ratio
from decal_jax.compress.latents import LatentConfig
from decal_jax.layers import attention as attn
from decal_jax.layers import blockwise_attention
from decal_jax.layers.caches import StepCounter
from decal_jax.layers.core import (Array, DenseGeneral, Embed, MlpBlock, RMSNorm,
                                   with_sharding_constraint)
from decal_jax.networks.signatures import EncoderDecoderNetwork, check_tokens

# nn.remat policies by name (T5Config.remat_policy): what each layer keeps for the backward
# pass; everything else is recomputed. 'none' = no remat (keep everything).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Architecture of a T5.1.1-style encoder-decoder (defaults: T5.1.1 small)."""
  vocab_size: int = 32128
  emb_dim: int = 512
  num_heads: int = 6
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  head_dim: int = 64
  mlp_dim: int = 1024
  mlp_activations: Sequence[str] = ("gelu", "linear")
  dropout_rate: float = 0.0
  logits_via_embedding: bool = False
  dtype: Any = jnp.float32
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  # Compression: C and the compressor, a name in compress/registry.REGISTRY ('latents' =
  # DeCAL, 'attn_pool', 'memory_tokens' = CCProxy), resolved to `self.compression`.
  compression_ratio: int = 1
  compressor: str = "latents"
  max_memory_tokens: int = 512  # 'memory_tokens': rows of the memory table (>= ceil(n / C))
  # DeCAL latents only (see LatentConfig for what each knob does).
  use_pooling: bool = True
  separate_latent_params: bool = False
  latent_boundary_token_ids: Sequence[int] = ()
  latent_max_window: Optional[int] = None
  # Performance options (docs/performance.md); `dtype` above is the activation dtype
  # ('float32' / 'bfloat16' / 'float16'; params stay float32, logits and loss float32).
  scan_layers: bool = False         # nn.scan over layers: params stacked on a 'layers' axis
  remat_policy: str = "none"        # nn.remat of each layer: a key of REMAT_POLICIES
  fused_qkv: bool = False           # one q/k/v (self) or k/v (cross) kernel: other layout
  attention_kernel: str = "einsum"  # 'einsum' or jax.nn.dot_product_attention 'xla' / 'cudnn'
  #                                   / 'auto', or 'blockwise' (layers/blockwise_attention.py)
  attention_block_size: int = 512   # keys per block of attention_kernel 'blockwise'

  def __post_init__(self):
    check_ratio(self.compression_ratio)  # early, with a clear message
    registry.resolve(self)  # the compressor's name and options: checked now, clearly
    self._check_performance_options()
    for name in ("vocab_size", "emb_dim", "num_heads", "head_dim", "mlp_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"T5Config.{name} must be positive, got {getattr(self, name)}.")

  def _check_performance_options(self) -> None:
    try:
      dtype = jnp.dtype(self.dtype)
    except TypeError as e:
      raise ValueError(f"T5Config.dtype {self.dtype!r} is not a dtype; use one of "
                       f"{ACTIVATION_DTYPES}.") from e
    if dtype.name not in ACTIVATION_DTYPES:
      raise ValueError(f"T5Config.dtype (activations) must be one of {ACTIVATION_DTYPES}, got "
                       f"{dtype.name}.")
    object.__setattr__(self, "dtype", dtype)  # 'bfloat16' from gin -> the dtype itself
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"Unknown T5Config.remat_policy {self.remat_policy!r}; choose one of "
                       f"{sorted(REMAT_POLICIES)}.")
    attn.check_attention_kernel(self.attention_kernel, dtype)
    if self.attention_kernel != "einsum" and self.dropout_rate > 0:
      raise ValueError(f"attention_kernel {self.attention_kernel!r} "
                       "has no attention dropout but "
                       f"dropout_rate is {self.dropout_rate}: set DROPOUT_RATE = 0 or "
                       "ATTENTION_KERNEL = 'einsum'.")

  def latent_config(self) -> LatentConfig:
    """The DeCAL latent settings of this config (whatever its compressor)."""
    return LatentConfig(ratio=self.compression_ratio, use_pooling=self.use_pooling,
                        boundary_token_ids=tuple(self.latent_boundary_token_ids),
                        max_window=self.latent_max_window)

  @property
  def compression(self) -> Compressor:
    """The compressor config (`compress/base.Compressor`) built from the fields:
    `NoCompressor` when C = 1. Derived, not stored: equality, hashing, `vars()` and gin see
    the name and the options only."""
    return registry.resolve(self)

  @property
  def compressed(self) -> bool:
    return self.compression.compresses


def _positions_or_default(tokens: Array, positions: Optional[Array]) -> Array:
  if positions is not None:
    return positions.astype(jnp.int32)
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def _segment_mask(query_segments: Optional[Array], key_segments: Optional[Array]):
  if query_segments is None:
    return None
  return attn.make_attention_mask(query_segments, key_segments, jnp.equal)


def layer_stack(layer_cls, cfg: T5Config, num_layers: int, carry: Array, *args,
                remat: bool = True, **attributes) -> Array:
  """Runs `num_layers` layers `layer_cls(cfg, **attributes)` over `carry` (the residual
  stream `[batch, length, embed]`); `args` (biases, masks, the encoding) go to every layer.

  Unrolled: submodules `layers_0 .. layers_{L-1}`. `cfg.scan_layers`: one `nn.scan`ned
  submodule `layers` whose params carry a leading `layers` axis (logical name 'layers') and
  whose decoding cache a `layers` axis in position 1, after the batch (so beam search's batch
  expansion still sees the batch first). `cfg.remat_policy` wraps each layer in `nn.remat`
  unless `remat=False` (decoding: there is no backward pass to save memory for). Call from
  inside a parent module's compact method.
  """
  policy = REMAT_POLICIES[cfg.remat_policy]
  if policy is not None and remat:
    layer_cls = nn.remat(layer_cls, policy=policy, prevent_cse=not cfg.scan_layers)
  if not cfg.scan_layers:
    for i in range(num_layers):
      carry = layer_cls(cfg, **attributes, name=f"layers_{i}")(carry, *args)
    return carry
  scanned = nn_partitioning.scan_with_axes(
      layer_cls, variable_axes={"params": 0, "cache": 1},
      split_rngs={"params": True, "dropout": True}, in_axes=(nn.broadcast,) * len(args),
      length=num_layers, axis_name="layers")
  carry, _ = scanned(cfg, **attributes, scanned=True, name="layers")(carry, *args)
  return carry


def _layer_output(x: Array, scanned: bool):
  """A layer's output `[batch, length, embed]`, sharded as the residual stream; under
  `nn.scan` the (carry, per-layer output) pair `(x, None)`."""
  x = with_sharding_constraint(x, ("batch", "length", "embed"))
  return (x, None) if scanned else x


# ------------------------------------------------------------------------------ encoder
class EncoderLayer(nn.Module):
  """Pre-norm self-attention + gated MLP. The first `num_latents` positions (a compressor's
  `EncoderStream.separate_prefix`: DeCAL latents with `separate_latent_params`) use their
  own norms, projections and MLP, while attention still runs jointly over them and the
  tokens. `scanned`: called by `nn.scan`, so it returns (x, None)."""
  config: T5Config
  num_latents: int = 0
  deterministic: bool = True
  scanned: bool = False

  def _params(self, prefix: str):
    cfg = self.config
    return dict(
        pre_attention_norm=RMSNorm(dtype=cfg.dtype, name=f"{prefix}pre_attention_layer_norm"),
        qkv=attn.QKVProjection(cfg.num_heads, cfg.head_dim, cfg.dtype, cfg.fused_qkv,
                               name=f"{prefix}attention_qkv"),
        out=attn.output_projection(cfg.emb_dim, cfg.dtype, f"{prefix}attention_out"),
        pre_mlp_norm=RMSNorm(dtype=cfg.dtype, name=f"{prefix}pre_mlp_layer_norm"),
        mlp=MlpBlock(cfg.mlp_dim, cfg.mlp_activations, cfg.dropout_rate, cfg.dtype,
                     name=f"{prefix}mlp"))

  @nn.compact
  def __call__(self, x: Array, bias: Optional[Array], mask: Optional[Array]):
    """x `[batch, length, embed]`; bias `[batch, heads, length, length]` and mask `[batch, 1,
    length, length]` as `attn.split_bias_and_mask` gives them for the attention kernel."""
    cfg, deterministic = self.config, self.deterministic
    split = self.num_latents
    groups = [self._params("")] if split == 0 else [self._params("latent_"), self._params("")]
    parts = [x] if split == 0 else [x[:, :split], x[:, split:]]
    dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))

    normed = [g["pre_attention_norm"](p) for g, p in zip(groups, parts)]
    qkvs = [g["qkv"](h, h) for g, h in zip(groups, normed)]
    q, k, v = (jnp.concatenate([t[i] for t in qkvs], axis=1) for i in range(3))
    dropout_rng = None if deterministic or cfg.dropout_rate == 0 else self.make_rng("dropout")
    y = attn.dot_product_attention(q, k, v, bias, dropout_rng, cfg.dropout_rate, deterministic,
                                   cfg.dtype, mask=mask, kernel=cfg.attention_kernel,
                                   block_size=cfg.attention_block_size)  # [b, L, heads, kv]
    y_parts = [y] if split == 0 else [y[:, :split], y[:, split:]]
    parts = [p + dropout(g["out"](yp), deterministic)
             for g, p, yp in zip(groups, parts, y_parts)]
    parts = [p + dropout(g["mlp"](g["pre_mlp_norm"](p), deterministic), deterministic)
             for g, p in zip(groups, parts)]
    x = parts[0] if split == 0 else jnp.concatenate(parts, axis=1)
    return _layer_output(x, self.scanned)


def _encoder_mask(stream, blocks: bool):
  """The encoder's self-attention mask (valid tokens, same segment, causal when the stream
  says so): `[batch, 1, L, L]`, or for the blockwise kernel a `BlockMask` that makes each
  key block's part when it is needed."""
  causal = stream.positions if stream.causal else None
  if blocks:
    return blockwise_attention.block_mask(stream.valid, stream.valid, stream.segment_ids,
                                          stream.segment_ids, causal, causal)
  return attn.combine_masks(
      attn.make_attention_mask(stream.valid, stream.valid),
      _segment_mask(stream.segment_ids, stream.segment_ids),
      attn.make_causal_mask(stream.positions) if stream.causal else None)


class Encoder(nn.Module):
  """T5.1.1 encoder; with C > 1 it outputs the m vectors of `config.compression`."""
  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, tokens: Array, segment_ids: Optional[Array] = None,
               positions: Optional[Array] = None, deterministic: bool = True,
               compression_ratio: Optional[int] = None):
    """tokens `[batch, n]` -> (encoded `[batch, m, embed]`, encoded_valid `[batch, m]`).

    `compression_ratio` overrides the config's C with the same weights (no parameter
    depends on C): the dual encoder reads queries and passages at different ratios."""
    cfg = self.config
    if compression_ratio is not None:
      cfg = dataclasses.replace(cfg, compression_ratio=compression_ratio)
    positions = _positions_or_default(tokens, positions)
    x = self.shared_embedding(tokens.astype(jnp.int32))  # [batch, n, embed]
    x = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic)
    # The compressor builds its modules here, in this scope (encoder/latents, ...).
    stream = cfg.compression.encoder_inputs(cfg, x, tokens, positions, segment_ids)
    x = with_sharding_constraint(stream.x, ("batch", "length", "embed"))  # [batch, L, embed]

    blocks = cfg.attention_kernel == "blockwise"  # bias and mask made per key block
    mask = _encoder_mask(stream, blocks)
    relpos = attn.RelativePositionBiases(cfg.relative_attention_num_buckets,
                                         cfg.relative_attention_max_distance, cfg.num_heads,
                                         cfg.dtype, name="relpos_bias")
    bias, mask = attn.split_bias_and_mask(
        relpos(stream.positions, stream.positions, bidirectional=True, blocks=blocks), mask,
        cfg.attention_kernel, cfg.dtype)
    x = layer_stack(EncoderLayer, cfg, cfg.num_encoder_layers, x, bias, mask,
                    num_latents=stream.separate_prefix, deterministic=deterministic)
    x = RMSNorm(dtype=cfg.dtype, name="encoder_norm")(x)
    x = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic)
    return cfg.compression.encoder_outputs(cfg, x, stream, tokens, positions, segment_ids)


def encoded_validity(config: T5Config, encoder_input_tokens: Array,
                     encoder_segment_ids: Optional[Array] = None):
  """Which encoded positions are real, from the raw encoder tokens alone.

  Returns (valid `[batch, m]`, segment ids `[batch, m]` or None). The decoder needs this
  because T5X hands `decode` the raw encoder tokens, not the encoder's own mask.
  """
  return config.compression.encoded_validity(encoder_input_tokens, encoder_segment_ids)


# ------------------------------------------------------------------------------ decoder
class DecoderLayer(nn.Module):
  """Pre-norm causal self-attention, cross-attention to the encoding, gated MLP.
  `scanned`: called by `nn.scan`, so it returns (y, None)."""
  config: T5Config
  deterministic: bool = True
  decode: bool = False
  scanned: bool = False

  def _attention(self, name: str) -> attn.MultiHeadAttention:
    cfg = self.config
    return attn.MultiHeadAttention(cfg.num_heads, cfg.head_dim, cfg.dropout_rate, cfg.dtype,
                                   cfg.attention_kernel, cfg.fused_qkv,
                                   block_size=cfg.attention_block_size, name=name)

  @nn.compact
  def __call__(self, y: Array, encoded: Array, self_attention: Tuple[Any, Any],
               cross_attention: Tuple[Any, Any], cache_index: Optional[Array]):
    """y `[batch, t, embed]`, encoded `[batch, m, embed]`; `self_attention` /
    `cross_attention` are (bias, mask) pairs from `attn.split_bias_and_mask`; `cache_index`
    the decoding step written to the KV cache (None unless decoding)."""
    cfg, deterministic = self.config, self.deterministic
    dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    h = RMSNorm(dtype=cfg.dtype, name="pre_self_attention_layer_norm")(y)
    h = self._attention("self_attention")(
        h, h, self_attention[0], mask=self_attention[1], decode=self.decode,
        deterministic=deterministic, cache_index=cache_index)
    y = y + dropout(h, deterministic)
    h = RMSNorm(dtype=cfg.dtype, name="pre_cross_attention_layer_norm")(y)
    h = self._attention("encoder_decoder_attention")(
        h, encoded, cross_attention[0], mask=cross_attention[1], deterministic=deterministic)
    y = y + dropout(h, deterministic)
    h = RMSNorm(dtype=cfg.dtype, name="pre_mlp_layer_norm")(y)
    h = MlpBlock(cfg.mlp_dim, cfg.mlp_activations, cfg.dropout_rate, cfg.dtype, name="mlp")(
        h, deterministic)
    y = y + dropout(h, deterministic)
    return _layer_output(y, self.scanned)


class Decoder(nn.Module):
  """T5.1.1 decoder with causal self-attention (KV-cached when `decode=True`)."""
  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, encoded: Array, encoded_valid: Array, tokens: Array,
               encoded_segment_ids: Optional[Array] = None,
               segment_ids: Optional[Array] = None, positions: Optional[Array] = None,
               deterministic: bool = True, decode: bool = False) -> Array:
    """encoded `[batch, m, embed]`, tokens `[batch, t]` -> logits `[batch, t, vocab]`."""
    cfg = self.config
    query_pos, key_pos, self_mask, write_index = self._self_attention_layout(
        tokens, segment_ids, positions, decode)
    relpos = attn.RelativePositionBiases(cfg.relative_attention_num_buckets,
                                         cfg.relative_attention_max_distance, cfg.num_heads,
                                         cfg.dtype, name="relpos_bias")
    self_attention = attn.split_bias_and_mask(relpos(query_pos, key_pos, bidirectional=False),
                                              self_mask, cfg.attention_kernel, cfg.dtype)
    query_valid = jnp.ones(tokens.shape, bool)  # as T5X: every decoder row may attend
    cross_mask = attn.combine_masks(attn.make_attention_mask(query_valid, encoded_valid),
                                    _segment_mask(segment_ids, encoded_segment_ids))
    cross_attention = attn.split_bias_and_mask(None, cross_mask, cfg.attention_kernel, cfg.dtype)

    y = self.shared_embedding(tokens.astype(jnp.int32))  # [batch, t, embed]
    y = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic)
    y = layer_stack(DecoderLayer, cfg, cfg.num_decoder_layers, y, encoded, self_attention,
                    cross_attention, write_index, remat=not decode,
                    deterministic=deterministic, decode=decode)
    y = RMSNorm(dtype=cfg.dtype, name="decoder_norm")(y)
    y = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic)
    if cfg.logits_via_embedding:
      logits = self.shared_embedding.attend(y) / jnp.sqrt(y.shape[-1])
    else:
      logits = DenseGeneral(cfg.vocab_size, kernel_axes=("embed", "vocab"), dtype=jnp.float32,
                            name="logits_dense")(y)
    return with_sharding_constraint(logits, ("batch", "length", "vocab"))

  def _self_attention_layout(self, tokens, segment_ids, positions, decode):
    """(query positions, key positions, causal (+segment) mask, KV-cache write index) for
    decoder self-attention.

    In cached decoding the query is the single token at the decoder's step counter and
    the keys are every cache slot; the attention layers write at the counter (the layers
    keep no counter of their own) and mask the slots not yet written. Not decoding, the
    write index is None.
    """
    batch, length = tokens.shape
    write_index = None
    if decode:
      # `key_positions` `[batch, max_length]` keeps the cache length static.
      is_initialized = self.has_variable("cache", "step_counter")
      key_positions = self.variable("cache", "key_positions", lambda: jnp.broadcast_to(
          jnp.arange(length, dtype=jnp.int32), (batch, length)))
      query_pos, write_index = StepCounter(name="step_counter")(
          batch, advance=1 if is_initialized else 0)
      if is_initialized:
        return query_pos, key_positions.value, None, write_index
    pos = _positions_or_default(tokens, positions)
    mask = attn.combine_masks(attn.make_causal_mask(pos), _segment_mask(segment_ids, segment_ids))
    return pos, pos, mask, write_index


# ---------------------------------------------------------------------------- the model
class Transformer(EncoderDecoderNetwork):
  """T5.1.1 encoder-decoder with optional DeCAL compression (T5X-compatible signatures)."""
  config: T5Config

  def setup(self):
    cfg = self.config
    self.shared_embedding = Embed(cfg.vocab_size, cfg.emb_dim, cfg.dtype, name="token_embedder")
    self.encoder = Encoder(cfg, self.shared_embedding)
    self.decoder = Decoder(cfg, self.shared_embedding)

  def encode(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None, *,
             enable_dropout: bool = True) -> Array:
    """`[batch, n]` tokens -> `[batch, m, embed]` encoding (m = ceil(n / C))."""
    check_tokens(encoder_input_tokens, "encoder_input_tokens")
    encoded, _ = self.encoder(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                              deterministic=not enable_dropout)
    return encoded

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens,
             encoder_segment_ids=None, decoder_segment_ids=None, decoder_positions=None, *,
             enable_dropout: bool = True, decode: bool = False,
             max_decode_length: Optional[int] = None) -> Array:
    """Decoder logits `[batch, t, vocab]` given the encoding from `encode`."""
    del decoder_target_tokens, max_decode_length  # T5X passes them; the causal mask suffices
    encoded_valid, encoded_segments = encoded_validity(self.config, encoder_input_tokens,
                                                       encoder_segment_ids)
    if encoded_valid.shape[1] != encoded.shape[1]:
      raise ValueError(f"`encoded` has {encoded.shape[1]} positions but encoder_input_tokens "
                       f"of length {encoder_input_tokens.shape[1]} give "
                       f"{encoded_valid.shape[1]} at compression ratio "
                       f"{self.config.compression_ratio}; pass the same tokens to encode.")
    return self.decoder(encoded, encoded_valid, decoder_input_tokens, encoded_segments,
                        decoder_segment_ids if not decode else None,
                        decoder_positions if not decode else None,
                        deterministic=not enable_dropout, decode=decode)
