"""Dodo as a context compressor (dodo.md §2.3): a decoder-only LM that reads its context
through a learned subset of that context's token states — nuggets — at every layer.

compress: the context runs causally through the decoder (compressing adapter ϕ); a scorer on
  layer-ι features (base model, adapters off) picks k = ceil(n / r) tokens (the last always);
  their hidden states at every layer, projected by the decoding adapter's keys/values, are
  the whole compressed context: `Nuggets` holds `[batch, layers, k, kv_heads, head_dim]`
  keys and values, which is also the KV cache generation starts from.
decode_nuggets: target tokens (decoding adapter θ) attend at every layer to [that layer's
  nuggets; earlier targets]; logits toward nugget i get `s_i - stop_gradient(s_i)` (§2.4).

read_query (QA, dodo.md §6 and Appendix D.2): only the document goes through the
  compressor; the question is the decoder's prompt. The decoding side (θ) reads the
  right-padded question after the nuggets, uncompressed, and its per-layer keys/values
  join the nuggets' as extra slots, so answer tokens attend to [nuggets; question; earlier
  answer tokens] (`__call__(..., query_tokens=...)`, `decode_memory`).

`selection='compressive'` swaps the scorer for the Compressive Transformer baseline: the
mean of every r-token segment's states, at the same ratio.

T5X's signatures (`encode`, `decode`, `__call__`) let `models.EncoderDecoderModel` and
`t5x.models.EncoderDecoderModel` train, score and decode it like the T5 networks. T5X
beam-expands `encode`'s output as one array, so `encode` returns the nuggets' keys and
values stacked, and `decode` rebuilds each row's valid slots from its context length (row b
fills its first ceil(n_b / r) slots under both selections). The straight-through term is
zero in value, so decoding from `encode` equals decoding from the full `Nuggets`; training
(`__call__`) keeps the scores for its gradient.
"""
import dataclasses
from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from decal_jax.compress import nuggets as nug
from decal_jax.layers import attention as attn
from decal_jax.layers.caches import StepCounter
from decal_jax.layers.core import Array, param_with_axes
from decal_jax.networks.decoder import (DecoderConfig, DecoderStack, MemoryKV, causal_bias,
                                        check_positions, target_steps)
from decal_jax.networks.signatures import EncoderDecoderNetwork, check_tokens

ADAPTERS = ("compress", "decode")


def with_adapters(decoder: DecoderConfig) -> DecoderConfig:
  """The decoder with Dodo's two adapters when LoRA is on (rank > 0)."""
  return dataclasses.replace(decoder, lora_adapters=ADAPTERS if decoder.lora_rank > 0 else ())


@dataclasses.dataclass(frozen=True)
class DodoConfig:
  """Dodo on top of a decoder. Defaults follow the paper: ι = 3, r = 10, LoRA on a frozen base."""
  decoder: DecoderConfig = DecoderConfig()
  compression_ratio: float = 10.0
  selection: str = "nuggets"        # or 'compressive' (mean-pooled segments baseline)
  scorer_layer: int = 3             # ι: the scorer reads the states after this many layers
  scorer_hidden_dim: Optional[int] = None  # None = emb_dim (the paper's 2-layer FFN)
  soft_prompt: bool = True          # a learned vector in place of BOS (autoencoding signal)

  def __post_init__(self):
    nug.check_ratio(self.compression_ratio)
    if self.selection not in ("nuggets", "compressive"):
      raise ValueError(f"DodoConfig.selection must be 'nuggets' or 'compressive', got "
                       f"{self.selection!r}.")
    if not 1 <= self.scorer_layer <= self.decoder.num_layers:
      raise ValueError(f"scorer_layer (ι) = {self.scorer_layer} must lie in [1, "
                       f"{self.decoder.num_layers}] (the decoder's layers).")

  @property
  def network_config(self) -> DecoderConfig:
    return with_adapters(self.decoder)

  @property
  def vocab_size(self) -> int:
    return self.decoder.vocab_size


class Nuggets(NamedTuple):
  """A compressed context: per-layer nugget keys/values and where they came from."""
  keys: Array       # [batch, layers, k, kv_heads, head_dim] (batch first, like every leaf)
  values: Array     # [batch, layers, k, kv_heads, head_dim]
  valid: Array      # [batch, k] bool
  positions: Array  # [batch, k] int32 token positions (RoPE)
  scores: Array     # [batch, k] float32 scorer output of each kept token (0: compressive)
  indices: Array    # [batch, k] int32 kept token indices (segment end: compressive)


class Dodo(EncoderDecoderNetwork):
  config: DodoConfig

  def setup(self):
    cfg = self.config
    self.stack = DecoderStack(cfg.network_config)
    self.step_counter = StepCounter()
    self.scorer = nug.Scorer(cfg.scorer_hidden_dim or cfg.decoder.emb_dim)
    if cfg.soft_prompt:
      self.soft_prompt = param_with_axes("soft_prompt", nn.initializers.normal(0.02),
                                         (cfg.decoder.emb_dim,), jnp.float32, axes=("embed",))

  def _adapter(self, name: str) -> Optional[str]:
    return name if self.config.network_config.lora_adapters else None

  # ------------------------------------------------------------------------- encode
  def score(self, tokens: Array) -> Array:
    """Scorer output `[batch, n]` for right-padded tokens (base features: adapters off)."""
    positions, bias = self._context_layout(tokens)
    x = self.stack(self.stack.embed(tokens), positions, bias, upto=self.config.scorer_layer)
    return self.scorer(jax.lax.stop_gradient(x))

  def _context_layout(self, tokens: Array):
    batch, n = tokens.shape
    check_positions(self.config.decoder, n, "encoder_input_tokens")
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    return positions, causal_bias(positions, None, self.config.decoder.dtype)

  def compress(self, encoder_input_tokens: Array, encoder_segment_ids=None,
               encoder_positions=None, *, enable_dropout: bool = True) -> Nuggets:
    """Right-padded context `[batch, n]` -> `Nuggets` (k = ceil(n / r) slots)."""
    del encoder_positions  # contexts are unpacked; positions are 0..n-1
    tokens = check_tokens(encoder_input_tokens, "encoder_input_tokens")
    if encoder_segment_ids is not None:
      raise ValueError("Dodo compresses one context per row: packed inputs "
                       "(encoder_segment_ids) are not supported; use pack=False.")
    cfg = self.config
    positions, bias = self._context_layout(tokens)
    final, states = self.stack(self.stack.embed(tokens), positions, bias,
                           adapter=self._adapter("compress"),
                           deterministic=not enable_dropout,
                           return_layer_inputs=True)  # [layers, b, n, embed]
    if cfg.selection == "compressive":
      kept, kept_positions, valid = nug.segment_means(states, tokens, cfg.compression_ratio)
      scores = jnp.zeros(valid.shape, jnp.float32)
      indices = kept_positions
    else:
      if cfg.network_config.lora_adapters:
        all_scores = self.score(tokens)  # [batch, n]
      else:  # full fine-tuning: no adapter-free model, read the compressing pass
        features = (states[cfg.scorer_layer] if cfg.scorer_layer < len(states) else final)
        all_scores = self.scorer(jax.lax.stop_gradient(features))
      selection = nug.select_topk(all_scores, tokens, cfg.compression_ratio)
      kept = nug.gather(states, selection.indices)  # [layers, b, k, embed]
      kept_positions, valid, indices = selection.indices, selection.valid, selection.indices
      scores = jnp.take_along_axis(all_scores, selection.indices, axis=1)
    keys, values = [], []
    for layer, z in zip(self.stack.layers, kept):
      k, v = layer.memory_kv(z, kept_positions, self._adapter("decode"))
      keys.append(k)
      values.append(v)
    return Nuggets(jnp.stack(keys, axis=1), jnp.stack(values, axis=1), valid, kept_positions,
                   scores, indices)

  def encode(self, encoder_input_tokens: Array, encoder_segment_ids=None,
             encoder_positions=None, *, enable_dropout: bool = True) -> Array:
    """Right-padded context `[batch, n]` -> the nuggets' keys and values as one array
    `[batch, 2, layers, k, kv_heads, head_dim]` (T5X's encoder output; `decode` reads it)."""
    nuggets = self.compress(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                            enable_dropout=enable_dropout)
    return jnp.stack([nuggets.keys, nuggets.values], axis=1)

  def read_query(self, nuggets: Nuggets, encoder_input_tokens: Array, query_tokens: Array,
                 *, enable_dropout: bool = True) -> Nuggets:
    """[nuggets; question]: the right-padded question `[batch, q]` runs on the decoding
    side after the context's positions, attending to the nuggets (straight-through term
    included) and causally to itself; -> `Nuggets` with k + q slots (question slots: score
    0, index -1, valid where the question has a real token)."""
    cfg = self.config
    query = check_tokens(query_tokens, "query_tokens")
    real = query > 0  # [batch, q]
    positions = (_context_length(encoder_input_tokens)[:, None]
                 + jnp.arange(query.shape[1], dtype=jnp.int32)[None, :])  # [batch, q]
    self_bias = attn.combine_biases(
        causal_bias(positions, None, cfg.decoder.dtype),
        attn.mask_to_bias(real[:, None, None, :], cfg.decoder.dtype))  # [batch, 1, q, q]
    memory_bias = self._memory_bias(nuggets)[:, None, None, :]  # [batch, 1, 1, k]
    memories = [MemoryKV(nuggets.keys[:, i], nuggets.values[:, i], memory_bias)
                for i in range(nuggets.keys.shape[1])]
    _, states = self.stack(self.stack.embed(query), positions, self_bias, memories,
                           self._adapter("decode"), deterministic=not enable_dropout,
                           return_layer_inputs=True)  # [layers, batch, q, embed]
    keys, values = zip(*[layer.memory_kv(x, positions, self._adapter("decode"))
                         for layer, x in zip(self.stack.layers, states)])
    def join(a, b, axis=1):
      return jnp.concatenate([a, b.astype(a.dtype)], axis)
    return Nuggets(join(nuggets.keys, jnp.stack(keys, axis=1), 2),  # [b, layers, k + q, ...]
                   join(nuggets.values, jnp.stack(values, axis=1), 2),
                   join(nuggets.valid, real), join(nuggets.positions, positions),
                   join(nuggets.scores, jnp.zeros(real.shape, jnp.float32)),
                   join(nuggets.indices, jnp.full(real.shape, -1, jnp.int32)))

  # ------------------------------------------------------------------------- decode
  def __call__(self, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens=None,
               encoder_segment_ids=None, decoder_segment_ids=None, encoder_positions=None,
               decoder_positions=None, *, enable_dropout: bool = True, decode: bool = False,
               max_decode_length: Optional[int] = None,
               query_tokens: Optional[Array] = None) -> Array:
    """Teacher-forced logits `[batch, t, vocab]`, the nuggets' scores in the graph (§2.4).
    `query_tokens` `[batch, q]`: a question the decoder reads after the nuggets (QA)."""
    del decoder_target_tokens, decoder_positions, max_decode_length
    nuggets = self.compress(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                            enable_dropout=enable_dropout)
    if query_tokens is None:
      return self.decode_nuggets(nuggets, encoder_input_tokens, decoder_input_tokens,
                                 decoder_segment_ids, enable_dropout=enable_dropout,
                                 decode=decode)
    memory = self.read_query(nuggets, encoder_input_tokens, query_tokens,
                             enable_dropout=enable_dropout)
    return self.decode_memory(memory, self.prefix_length(encoder_input_tokens, query_tokens),
                              decoder_input_tokens, decoder_segment_ids,
                              enable_dropout=enable_dropout, decode=decode,
                              prefix_width=encoder_input_tokens.shape[1] + query_tokens.shape[1])

  def compress_query(self, encoder_input_tokens: Array, query_tokens: Array, *,
                     enable_dropout: bool = False):
    """(the document's nuggets with the question read after them, the prefix length
    `[batch]`): what `decode_memory` answers from (`models.dodo.DodoQAModel`)."""
    nuggets = self.compress(encoder_input_tokens, enable_dropout=enable_dropout)
    memory = self.read_query(nuggets, encoder_input_tokens, query_tokens,
                             enable_dropout=enable_dropout)
    return memory, self.prefix_length(encoder_input_tokens, query_tokens)

  @staticmethod
  def prefix_length(encoder_input_tokens: Array, query_tokens: Optional[Array]) -> Array:
    """`[batch]` positions before the first target: the context's, plus the question's."""
    length = _context_length(encoder_input_tokens)
    if query_tokens is None:
      return length
    return length + jnp.sum(query_tokens > 0, axis=1, dtype=jnp.int32)

  def decode_memory(self, memory: Nuggets, prefix_length: Array, decoder_input_tokens,
                    decoder_segment_ids=None, *, enable_dropout: bool = True,
                    decode: bool = False, prefix_width: Optional[int] = None) -> Array:
    """Logits `[batch, t, vocab]` of targets that follow `prefix_length` `[batch]`
    positions (at most `prefix_width`, checked against max_length) and attend to
    `memory`'s slots (nuggets, and a question from `read_query`)."""
    return self._decode_memory(memory.keys, memory.values, self._memory_bias(memory),
                               prefix_length, decoder_input_tokens, decoder_segment_ids,
                               enable_dropout=enable_dropout, decode=decode,
                               prefix_width=prefix_width)

  def _memory_bias(self, nuggets: Nuggets) -> Array:
    """`[batch, k]`: 0 / NEG_INF by validity, plus the straight-through term (§2.4)."""
    return (attn.mask_to_bias(nuggets.valid.astype(jnp.float32), self.config.decoder.dtype)
            + nug.straight_through(nuggets.scores))

  def decode(self, encoded: Array, encoder_input_tokens, decoder_input_tokens,
             decoder_target_tokens=None, encoder_segment_ids=None, decoder_segment_ids=None,
             decoder_positions=None, *, enable_dropout: bool = True, decode: bool = False,
             max_decode_length: Optional[int] = None) -> Array:
    """Logits `[batch, t, vocab]` of the targets given `encode`'s output `[batch, 2, layers,
    k, kv_heads, head_dim]`; row b's first ceil(n_b / r) slots are its nuggets."""
    del decoder_target_tokens, encoder_segment_ids, decoder_positions, max_decode_length
    k = encoded.shape[3]
    valid = nug.filled_slots(encoder_input_tokens, self.config.compression_ratio, k)  # [b, k]
    memory_bias = attn.mask_to_bias(valid.astype(jnp.float32), self.config.decoder.dtype
                                    ).astype(jnp.float32)  # as decode_nuggets' (+ scores)
    return self._decode_memory(encoded[:, 0], encoded[:, 1], memory_bias,
                               _context_length(encoder_input_tokens), decoder_input_tokens,
                               decoder_segment_ids, enable_dropout=enable_dropout,
                               decode=decode, prefix_width=encoder_input_tokens.shape[1])

  def decode_nuggets(self, nuggets: Nuggets, encoder_input_tokens, decoder_input_tokens,
                     decoder_segment_ids=None, *, enable_dropout: bool = True,
                     decode: bool = False) -> Array:
    """Logits `[batch, t, vocab]` of the targets given `compress`'s nuggets (scores and all)."""
    return self.decode_memory(nuggets, _context_length(encoder_input_tokens),
                              decoder_input_tokens, decoder_segment_ids,
                              enable_dropout=enable_dropout, decode=decode,
                              prefix_width=encoder_input_tokens.shape[1])

  def _decode_memory(self, keys: Array, values: Array, memory_bias: Array,
                     prefix_length: Array, decoder_input_tokens, decoder_segment_ids, *,
                     enable_dropout: bool, decode: bool,
                     prefix_width: Optional[int] = None) -> Array:
    """keys / values `[batch, layers, k, kv_heads, head_dim]`, memory_bias `[batch, k]`;
    targets start at position `prefix_length` `[batch]` (at most `prefix_width`)."""
    if decoder_segment_ids is not None and not decode:
      raise ValueError("Packed targets (decoder_segment_ids) are not supported; pack=False.")
    cfg = self.config
    tokens = decoder_input_tokens
    batch, length = tokens.shape
    y = self.stack.embed(tokens)  # [batch, t, embed]
    stepping = decode and self.has_variable("cache", "step_counter")
    if not stepping and prefix_width is not None:
      check_positions(cfg.decoder, prefix_width + length, "context (+ question) + targets")
    offsets, self_bias, index = target_steps(self.step_counter, stepping, decode, batch,
                                             length, cfg.decoder.dtype)  # offsets [b, t]
    if cfg.soft_prompt:  # the first target slot (BOS) carries the learned prompt
      first = (offsets == 0)[..., None]  # [batch, t, 1]
      y = jnp.where(first, jnp.asarray(self.soft_prompt, y.dtype), y)
    bias = memory_bias[:, None, None, :]  # [batch, 1, 1, k]
    memories = [MemoryKV(keys[:, i], values[:, i], bias) for i in range(keys.shape[1])]
    positions = prefix_length[:, None] + offsets  # targets follow the context (+ question)
    y = self.stack(y, positions, self_bias, memories, self._adapter("decode"), decode=decode,
                   cache_index=index, deterministic=not enable_dropout)
    return self.stack.logits(y)


def _context_length(encoder_input_tokens: Array) -> Array:
  """`[batch]` real tokens of a right-padded context."""
  return jnp.sum(encoder_input_tokens > 0, axis=1, dtype=jnp.int32)
