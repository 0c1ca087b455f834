"""Squid (squid_summary.md): a small decoder compresses a long context into N memory
vectors that a large decoder reads, through an MLP projector, in front of the query.

compress: the small decoder reads [context; N learned memory tokens] causally (memory j at
  position L + j, right after the context's L real tokens); the final (normed) states of
  the memory tokens go through the projector into the large decoder's embedding space:
  `Compressed(embeddings [batch, N, large emb], valid [batch, N])`. N is fixed
  (`memory_tokens`) or ceil(n / ρ) for ρ = `memory_ratio` (row b keeps ceil(L_b / ρ)).
read: the large decoder runs over [projected memory; query] once; its per-layer keys and
  values are the `Prefix` that every answer token attends to (the KV cache of a prompt).
decode: answer tokens attend at every layer to [prefix; earlier answer tokens].

Positions in the large decoder count real items only (padding of the memory or the query is
skipped), so a batch of mixed lengths gets the positions each row would get alone. The
module has T5X `EncoderDecoderModel`'s method names (`encode` = compress + read, `decode`,
`__call__`); `models.SquidModel` adds the query feature, compress-once / answer-many
inference and generation.

`SquidT5X` is the same network (the same parameters) for `t5x.models.EncoderDecoderModel`,
which feeds a module only `encoder_input_tokens` and beam-expands `encode`'s output as one
array: its encoder input is [context; query], the query in the last `query_length` columns
(`models.squid.SquidT5XFeatureConverter` joins them), and `encode` returns the prefix's keys
and values stacked, `[batch, 2, layers, N + query_length, kv_heads, head_dim]`; `decode`
rebuilds the prefix's validity and length from the joined tokens.
"""
import dataclasses
from typing import NamedTuple, Optional

import flax.linen as nn
import jax.numpy as jnp

from decal_jax.compress.memory import MemoryTokens
from decal_jax.layers import attention as attn
from decal_jax.layers.caches import StepCounter
from decal_jax.layers.core import Array, DenseGeneral, activation, param_with_axes
from decal_jax.networks.decoder import (DecoderConfig, DecoderStack, MemoryKV,
                                        check_positions, target_steps)
from decal_jax.networks.signatures import check_tokens


@dataclasses.dataclass(frozen=True)
class SquidConfig:
  """Two decoders and what joins them. Defaults: the paper's Qwen2-0.5B -> Qwen2-7B shapes
  are in gin/models/squid_qwen2.gin; these defaults only make a valid tiny pair."""
  small: DecoderConfig = DecoderConfig(vocab_size=256, emb_dim=64, num_heads=2, head_dim=32,
                                       mlp_dim=128, num_layers=2, max_length=512)
  large: DecoderConfig = DecoderConfig(vocab_size=256, emb_dim=96, num_heads=3, head_dim=32,
                                       mlp_dim=192, num_layers=2, max_length=512)
  memory_tokens: int = 64           # N when memory_ratio is None
  memory_ratio: Optional[int] = None  # ρ: N = ceil(context length / ρ), up to memory_tokens
  projector_layers: int = 2         # 1 = one linear map; 2 = LLaVA-style Linear-GELU-Linear
  projector_hidden_dim: Optional[int] = None  # None = the large decoder's emb_dim
  projector_activation: str = "gelu"
  # Optional declarations checked against the decoders (catch a projector meant for others).
  projector_input_dim: Optional[int] = None
  projector_output_dim: Optional[int] = None

  def __post_init__(self):
    if self.memory_tokens < 1:
      raise ValueError(f"memory_tokens (N) must be >= 1, got {self.memory_tokens}.")
    if self.memory_ratio is not None and self.memory_ratio < 1:
      raise ValueError(f"memory_ratio (ρ) must be >= 1, got {self.memory_ratio}.")
    if self.projector_layers < 1:
      raise ValueError(f"projector_layers must be >= 1, got {self.projector_layers}.")
    activation(self.projector_activation)  # raises on an unknown name
    for name, declared, actual, which in (
        ("projector_input_dim", self.projector_input_dim, self.small.emb_dim, "small"),
        ("projector_output_dim", self.projector_output_dim, self.large.emb_dim, "large")):
      if declared is not None and declared != actual:
        raise ValueError(f"SquidConfig.{name} = {declared} does not match the {which} "
                         f"decoder's emb_dim = {actual}: the projector maps small.emb_dim -> "
                         f"large.emb_dim. Fix the decoder sizes or drop {name}.")

  @property
  def vocab_size(self) -> int:
    """Ids both decoders accept (the trainer checks the task's vocabulary against it)."""
    return min(self.small.vocab_size, self.large.vocab_size)

  def memory_count(self, context_length: int) -> int:
    """Memory slots for a padded context of `context_length` tokens."""
    if self.memory_ratio is None:
      return self.memory_tokens
    return -(-context_length // self.memory_ratio)


class Compressed(NamedTuple):
  """A compressed context in the large decoder's embedding space (keep it, reuse it)."""
  embeddings: Array  # [batch, N, large emb]
  valid: Array       # [batch, N] bool


class Prefix(NamedTuple):
  """The large decoder's keys/values of [projected memory; query]: what answers attend to."""
  keys: Array    # [batch, layers, P, kv_heads, head_dim] (RoPE applied)
  values: Array  # [batch, layers, P, kv_heads, head_dim]
  valid: Array   # [batch, P] bool
  length: Array  # [batch] int32: real prefix items = the first answer token's position


class Projector(nn.Module):
  """MLP from the small decoder's states to the large decoder's embeddings."""
  hidden_dim: int
  output_dim: int
  num_layers: int = 2
  activation: str = "gelu"
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    widths = [self.hidden_dim] * (self.num_layers - 1) + [self.output_dim]
    last = len(widths) - 1
    for i, width in enumerate(widths):
      axes = ("embed" if i == 0 else "mlp", "embed" if 0 < i == last else "mlp")
      x = DenseGeneral(width, kernel_axes=axes, dtype=self.dtype,
                       name=f"dense_{i}")(x)  # [batch, N, width]
      bias = param_with_axes(f"bias_{i}", nn.initializers.zeros, (width,), jnp.float32,
                             axes=axes[1:])
      x = x + jnp.asarray(bias, self.dtype)
      if i < last:
        x = activation(self.activation)(x)
    return x


def _index_causal_bias(valid: Array, dtype) -> Array:
  """`[batch, t]` validity -> `[batch, 1, t, t]` bias: key index <= query index, real keys."""
  batch, length = valid.shape
  order = jnp.broadcast_to(jnp.arange(length), (batch, length))
  mask = attn.combine_masks(attn.make_causal_mask(order),
                            valid[:, None, None, :].astype(jnp.float32))
  return attn.mask_to_bias(mask, dtype)


class Squid(nn.Module):
  config: SquidConfig

  def setup(self):
    cfg = self.config
    self.small_decoder = DecoderStack(cfg.small)
    self.memory_tokens = MemoryTokens(cfg.memory_ratio, cfg.memory_tokens, cfg.small.dtype,
                                      init_stddev=0.02,
                                      limit_name="SquidConfig.memory_tokens")
    self.projector = Projector(cfg.projector_hidden_dim or cfg.large.emb_dim,
                               cfg.large.emb_dim, cfg.projector_layers,
                               cfg.projector_activation, cfg.large.dtype)
    self.large_decoder = DecoderStack(cfg.large)
    self.step_counter = StepCounter()

  # ------------------------------------------------------------------------- compress
  def compress(self, encoder_input_tokens: Array, *, enable_dropout: bool = False
               ) -> Compressed:
    """Right-padded context `[batch, n]` -> `Compressed` (N projected memory vectors)."""
    tokens = check_tokens(encoder_input_tokens, "encoder_input_tokens")
    batch, n = tokens.shape
    memory = self.memory_tokens(tokens, self.config.small.emb_dim)  # [b, N, small emb]
    m = memory.embeddings.shape[1]
    check_positions(self.config.small, n + m, "context + memory tokens")
    x = jnp.concatenate([self.small_decoder.embed(tokens), memory.embeddings], axis=1)
    positions = jnp.concatenate(
        [jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n)), memory.positions],
        axis=1)  # [b, n + N]: memory j at L + j
    key_valid = jnp.concatenate([tokens > 0, memory.valid], axis=1)  # [b, n + N]
    mask = attn.combine_masks(attn.make_causal_mask(positions),
                              key_valid[:, None, None, :].astype(jnp.float32))
    h = self.small_decoder(x, positions, attn.mask_to_bias(mask, self.config.small.dtype),
                           deterministic=not enable_dropout)  # [b, n + N, small emb]
    states = self.small_decoder.decoder_norm(h[:, n:])  # [b, N, small emb]
    return Compressed(self.projector(states), memory.valid)  # [b, N, large emb]

  # ------------------------------------------------------------------------- read
  def read(self, compressed: Compressed, query_tokens: Optional[Array] = None, *,
           enable_dropout: bool = False) -> Prefix:
    """The large decoder over [projected memory; query] -> its per-layer keys/values."""
    batch = compressed.embeddings.shape[0]
    if query_tokens is None:
      query_tokens = jnp.zeros((batch, 0), jnp.int32)
    query_tokens = check_tokens(query_tokens, "query_tokens")
    check_positions(self.config.large, compressed.valid.shape[1] + query_tokens.shape[1],
                    "memory + query tokens")  # before the large decoder runs over them
    x = jnp.concatenate([compressed.embeddings.astype(self.config.large.dtype),
                         self.large_decoder.embed(query_tokens)], axis=1)  # [b, P, emb]
    valid = jnp.concatenate([compressed.valid, query_tokens > 0], axis=1)  # [b, P]
    positions = jnp.maximum(jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)  # [b, P]
    captured = []

    def capture(keys, values, bias):  # records each layer's keys/values, changes nothing
      captured.append((keys, values))
      return keys, values, bias

    hooks = [capture] * self.config.large.num_layers
    self.large_decoder(x, positions, _index_causal_bias(valid, self.config.large.dtype),
                       deterministic=not enable_dropout, kv_hooks=hooks)
    keys = jnp.stack([k for k, _ in captured], axis=1)  # [b, layers, P, kv, d]
    values = jnp.stack([v for _, v in captured], axis=1)
    return Prefix(keys, values, valid, jnp.sum(valid, axis=1, dtype=jnp.int32))

  def encode(self, encoder_input_tokens: Array, query_tokens: Optional[Array] = None,
             encoder_segment_ids=None, encoder_positions=None, *,
             enable_dropout: bool = True) -> Prefix:
    """compress + read: what T5X calls the encoder output, here the answer's prefix."""
    del encoder_positions
    if encoder_segment_ids is not None:
      raise ValueError("Squid compresses one context per row: packed inputs "
                       "(encoder_segment_ids) are not supported; use pack=False.")
    compressed = self.compress(encoder_input_tokens, enable_dropout=enable_dropout)
    return self.read(compressed, query_tokens, enable_dropout=enable_dropout)

  # ------------------------------------------------------------------------- decode
  def decode(self, encoded: Prefix, encoder_input_tokens, decoder_input_tokens,
             decoder_target_tokens=None, encoder_segment_ids=None, decoder_segment_ids=None,
             decoder_positions=None, *, enable_dropout: bool = True, decode: bool = False,
             max_decode_length: Optional[int] = None) -> Array:
    """Logits `[batch, t, vocab]` of the answer given the prefix from `encode`/`read`."""
    del encoder_input_tokens, decoder_target_tokens, decoder_positions, max_decode_length
    if decoder_segment_ids is not None and not decode:
      raise ValueError("Packed targets (decoder_segment_ids) are not supported; pack=False.")
    cfg = self.config.large
    tokens = check_tokens(decoder_input_tokens, "decoder_input_tokens")
    batch, length = tokens.shape
    stepping = decode and self.has_variable("cache", "step_counter")
    if not stepping:
      check_positions(cfg, encoded.valid.shape[1] + length, "memory + query + answer")
    offsets, self_bias, index = target_steps(self.step_counter, stepping, decode, batch,
                                             length, cfg.dtype)  # offsets [batch, t]
    prefix_bias = attn.mask_to_bias(encoded.valid.astype(jnp.float32),
                                    cfg.dtype)[:, None, None, :]  # [b, 1, 1, P]
    memories = [MemoryKV(encoded.keys[:, i], encoded.values[:, i], prefix_bias)
                for i in range(cfg.num_layers)]
    positions = encoded.length[:, None] + offsets  # [batch, t]: answers follow the prefix
    y = self.large_decoder(self.large_decoder.embed(tokens), positions, self_bias, memories,
                           decode=decode, cache_index=index, deterministic=not enable_dropout)
    return self.large_decoder.logits(y)

  def __call__(self, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens=None,
               encoder_segment_ids=None, decoder_segment_ids=None, encoder_positions=None,
               decoder_positions=None, query_tokens=None, *, enable_dropout: bool = True,
               decode: bool = False, max_decode_length: Optional[int] = None) -> Array:
    """Teacher-forced answer logits `[batch, t, vocab]`."""
    encoded = self.encode(encoder_input_tokens, query_tokens, encoder_segment_ids,
                          encoder_positions, enable_dropout=enable_dropout)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       decoder_target_tokens, encoder_segment_ids, decoder_segment_ids,
                       decoder_positions, enable_dropout=enable_dropout, decode=decode,
                       max_decode_length=max_decode_length)


class SquidT5X(Squid):
  """Squid with T5X's encoder-decoder interface: `encoder_input_tokens` `[batch, n + q]` is
  the context (right-padded to n) followed by the query (right-padded to q =
  `query_length`); `encode` returns the prefix as one array. Parameters are `Squid`'s."""
  query_length: int = 16

  def split(self, encoder_input_tokens: Array):
    """`[batch, n + q]` -> context `[batch, n]`, query `[batch, q]`."""
    tokens = check_tokens(encoder_input_tokens, "encoder_input_tokens")
    q = self.query_length
    if q < 0 or tokens.shape[1] <= q:
      raise ValueError(
          f"encoder_input_tokens has {tokens.shape[1]} columns but SquidT5X.query_length = "
          f"{q}: the encoder input is [context; query] with the query in the last "
          "query_length columns. Bind QUERY_LENGTH to TASK_FEATURE_LENGTHS['query'] "
          "(models.squid.SquidT5XFeatureConverter checks it).")
    return tokens[:, :tokens.shape[1] - q], tokens[:, tokens.shape[1] - q:]

  def prefix_valid(self, encoder_input_tokens: Array) -> Array:
    """Which of the prefix's N + q items are real `[batch, N + q]`: `read`'s validity."""
    context, query = self.split(encoder_input_tokens)
    memory = self.memory_tokens(context, self.config.small.emb_dim)  # valid [b, N]
    return jnp.concatenate([memory.valid, query > 0], axis=1)  # [b, N + q]

  def encode(self, encoder_input_tokens: Array, encoder_segment_ids=None,
             encoder_positions=None, *, enable_dropout: bool = True) -> Array:
    """[context; query] -> the prefix's keys and values `[batch, 2, layers, P, kv, d]`."""
    context, query = self.split(encoder_input_tokens)
    prefix = Squid.encode(self, context, query, encoder_segment_ids, encoder_positions,
                          enable_dropout=enable_dropout)
    return jnp.stack([prefix.keys, prefix.values], axis=1)  # [b, 2, layers, P, kv, d]

  def decode(self, encoded: Array, encoder_input_tokens, decoder_input_tokens,
             decoder_target_tokens=None, encoder_segment_ids=None, decoder_segment_ids=None,
             decoder_positions=None, *, enable_dropout: bool = True, decode: bool = False,
             max_decode_length: Optional[int] = None) -> Array:
    """Answer logits `[batch, t, vocab]` from `encode`'s array and the joined tokens."""
    valid = self.prefix_valid(encoder_input_tokens)  # [b, P]
    prefix = Prefix(encoded[:, 0], encoded[:, 1], valid,
                    jnp.sum(valid, axis=1, dtype=jnp.int32))
    return Squid.decode(self, prefix, encoder_input_tokens, decoder_input_tokens,
                        decoder_target_tokens, encoder_segment_ids, decoder_segment_ids,
                        decoder_positions, enable_dropout=enable_dropout, decode=decode,
                        max_decode_length=max_decode_length)

  def __call__(self, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens=None,
               encoder_segment_ids=None, decoder_segment_ids=None, encoder_positions=None,
               decoder_positions=None, *, enable_dropout: bool = True, decode: bool = False,
               max_decode_length: Optional[int] = None) -> Array:
    """Teacher-forced answer logits `[batch, t, vocab]` (what `Squid` gives with the query
    passed apart)."""
    context, query = self.split(encoder_input_tokens)
    prefix = Squid.encode(self, context, query, encoder_segment_ids, encoder_positions,
                          enable_dropout=enable_dropout)
    return Squid.decode(self, prefix, context, decoder_input_tokens, decoder_target_tokens,
                        encoder_segment_ids, decoder_segment_ids, decoder_positions,
                        enable_dropout=enable_dropout, decode=decode,
                        max_decode_length=max_decode_length)
