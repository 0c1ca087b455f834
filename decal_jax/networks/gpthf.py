"""GPTHF (gpthf_summary.md): a hierarchical LM that reads finished sentences as one vector each.

One LLaMA-style stack of `encoder_layers + body_layers` blocks (so it has exactly the
parameters of the equally sized GPT, `networks.decoder.Decoder`), run with two masks:

  word-level encoder (blocks [0, encoder_layers)): block-causal, a token sees the earlier
    tokens of its own sentence only; RoPE position = the token's place in its sentence.
    The encoder state at a sentence's last token is that sentence's embedding e_j.
  sentence-level body (the other blocks): the row of token t in sentence j reads
    [e_0 .. e_{j-1}, h_t] causally; RoPE position = j. The LM head predicts token t + 1.

Training runs every position at once: body row t attends to itself and to every earlier
row that closes a sentence (those rows *are* e_0 .. e_{j-1}: a closing token's own body row
reads [e_0 .. e_{j-1}, e_j]). Sentences end at `sentence_end_id`; a sentence that reaches
`max_sentence_length` tokens without one is closed there (the same rule in training, cached
and uncached generation), which bounds the encoder's work per generated token.

Cached generation (`decode=True`, one token per call) keeps, per row: the current sentence's
encoder keys/values (at most max_sentence_length slots, reused from slot 0 when a sentence
closes), the body keys/values of every finished sentence, and the sentence counters; only the
current token passes through the encoder.
"""
import dataclasses
from typing import ClassVar, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from decal_jax.layers import attention as attn
from decal_jax.layers.caches import AppendCache, SentenceCache
from decal_jax.layers.core import Array
from decal_jax.networks.decoder import DecoderConfig, DecoderStack, check_positions
from decal_jax.networks.signatures import DecoderOnlyNetwork


@dataclasses.dataclass(frozen=True)
class GpthfConfig:
  """GPTHF on a decoder whose `num_layers` = encoder + body layers (GPTHF-16-8: 24, 16)."""
  decoder: DecoderConfig = DecoderConfig()
  encoder_layers: int = 16
  sentence_end_id: int = 32099  # the top extra id of a T5-style vocabulary
  max_sentence_length: int = 64  # tokens per sentence, its end token included

  def __post_init__(self):
    if not 1 <= self.encoder_layers < self.decoder.num_layers:
      raise ValueError(f"encoder_layers = {self.encoder_layers} must leave at least one body "
                       f"layer of the decoder's {self.decoder.num_layers}.")
    if not 0 < self.sentence_end_id < self.decoder.vocab_size:
      raise ValueError(f"sentence_end_id = {self.sentence_end_id} is not an id of the "
                       f"decoder's {self.decoder.vocab_size}-token vocabulary (0 is padding).")
    if self.max_sentence_length < 2:
      raise ValueError(f"max_sentence_length must be >= 2, got {self.max_sentence_length}.")

  compression_ratio: ClassVar[int] = 1  # every word-level token is kept (models/base.py)

  @property
  def vocab_size(self) -> int:
    return self.decoder.vocab_size

  @property
  def max_length(self) -> int:
    return self.decoder.max_length


class SentenceLayout(NamedTuple):
  """Where every token sits: `[batch, n]` each."""
  place: Array     # position inside its sentence (the encoder's RoPE position)
  sentence: Array  # sentence index (the body's RoPE position)
  closes: Array    # bool: this token ends its sentence (end id, or the length bound)


def sentence_layout(tokens: Array, end_id: int, max_length: int) -> SentenceLayout:
  """Token ids `[batch, n]` -> their `SentenceLayout`. After the last end token before t,
  places run 0, 1, .. and wrap at `max_length` (a bound-closed sentence restarts at 0)."""
  batch, n = tokens.shape
  index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
  is_end = tokens == end_id  # [b, n]
  last_end = jax.lax.cummax(jnp.where(is_end, index, -1), axis=1)  # [b, n] (inclusive)
  before = jnp.pad(last_end, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]  # exclusive
  place = (index - before - 1) % max_length
  closes = is_end | (place == max_length - 1)
  sentence = jnp.cumsum(closes, axis=1, dtype=jnp.int32) - closes.astype(jnp.int32)
  return SentenceLayout(place, sentence, closes)


def encoder_mask(layout: SentenceLayout) -> Array:
  """`[batch, 1, n, n]`: key i visible to query t iff same sentence and i <= t."""
  n = layout.sentence.shape[1]
  same = layout.sentence[:, :, None] == layout.sentence[:, None, :]  # [b, t, i]
  causal = jnp.tril(jnp.ones((n, n), bool))
  return (same & causal)[:, None]


def body_mask(layout: SentenceLayout) -> Array:
  """`[batch, 1, n, n]`: row t reads itself and every earlier row that closes a sentence."""
  n = layout.closes.shape[1]
  earlier = jnp.tril(jnp.ones((n, n), bool), k=-1)  # i < t
  finished = earlier[None] & layout.closes[:, None, :]  # [b, t, i]
  return (finished | jnp.eye(n, dtype=bool)[None])[:, None]


class SentencePosition(nn.Module):
  """Per row `[batch]`: the next token's place in its sentence and its sentence index."""

  @nn.compact
  def __call__(self, batch: int, closes: Optional[Array] = None):
    """-> (place, sentence) before this token; with `closes` `[b]`, advances past it."""
    zeros = lambda: jnp.zeros((batch,), jnp.int32)
    place, sentence = self.variable("cache", "place", zeros), self.variable(
        "cache", "sentence", zeros)
    current = place.value, sentence.value
    if closes is not None:
      place.value = jnp.where(closes, 0, current[0] + 1)
      sentence.value = current[1] + closes.astype(jnp.int32)
    return current


class Gpthf(DecoderOnlyNetwork):
  """GPTHF with T5X `DecoderOnlyModel`'s call signature (`models.DecoderOnlyModel` trains it)."""
  config: GpthfConfig

  def setup(self):
    cfg, dec = self.config, self.config.decoder
    self.stack = DecoderStack(dec)
    enc, body = cfg.encoder_layers, dec.num_layers - cfg.encoder_layers
    self.sentence_caches = [SentenceCache(cfg.max_sentence_length, dec.kv_heads, dec.head_dim,
                                          dec.dtype, name=f"sentence_cache_{i}")
                            for i in range(enc)]
    self.position = SentencePosition()
    self.body_caches = [AppendCache(dec.max_length, dec.kv_heads, dec.head_dim, dec.dtype,
                                    name=f"body_cache_{i}") for i in range(body)]

  def forward(self, tokens: Array, targets: Optional[Array], segment_ids, positions, *,
              deterministic: bool, decode: bool) -> Array:
    """Next-token logits `[batch, n, vocab]` (decode=True after cache creation: one step)."""
    del targets, segment_ids, positions  # positions: the sentence layout's
    if decode and self.has_variable("cache", "position"):
      return self._step(tokens)
    check_positions(self.config.decoder, tokens.shape[1], "decoder_input_tokens")
    if decode:  # cache creation: sizes come from the config
      self._create_caches(tokens.shape[0])
    return self._parallel(tokens, deterministic)

  def word_states(self, tokens: Array, deterministic: bool = True):
    """The word-level encoder's output `[batch, n, embed]` and the `SentenceLayout`; a
    sentence's embedding is the row of the token that closes it."""
    cfg = self.config
    layout = sentence_layout(tokens, cfg.sentence_end_id, cfg.max_sentence_length)
    bias = attn.mask_to_bias(encoder_mask(layout), cfg.decoder.dtype)
    h = self.stack(self.stack.embed(tokens), layout.place, bias, upto=cfg.encoder_layers,
                   deterministic=deterministic)  # [b, n, embed]
    return h, layout

  def _parallel(self, tokens: Array, deterministic: bool) -> Array:
    h, layout = self.word_states(tokens, deterministic)
    dtype = self.config.decoder.dtype
    y = self.stack(h, layout.sentence, attn.mask_to_bias(body_mask(layout), dtype),
                   start=self.config.encoder_layers, deterministic=deterministic)
    return self.stack.logits(y)

  # ---------------------------------------------------------------- cached decoding
  def _create_caches(self, batch: int) -> None:
    self.position(batch)
    for cache in list(self.sentence_caches) + list(self.body_caches):
      cache(batch)

  def _step(self, tokens: Array) -> Array:
    cfg = self.config
    batch, length = tokens.shape
    if length != 1:
      raise ValueError(f"Cached decoding takes one token per step, got {length}.")
    place, sentence = self.position(batch)  # [b] each
    closes = (tokens[:, 0] == cfg.sentence_end_id) | (place == cfg.max_sentence_length - 1)
    no_bias = jnp.zeros((batch, 1, 1, 1), cfg.decoder.dtype)

    def to_bias(valid):
      return attn.mask_to_bias(valid[:, None, None, :].astype(jnp.float32))

    def sentence_hook(cache):
      def hook(keys, values, bias):
        k, v, valid = cache(batch, keys, values, place)
        return k, v, to_bias(valid)
      return hook

    def body_hook(cache):
      def hook(keys, values, bias):  # earlier sentences' rows, then this token's own row
        k, v, valid = cache(batch, keys, values, sentence[:, None], sentence[:, None], closes)
        own = jnp.ones((batch, 1), bool)
        return (jnp.concatenate([k, keys], 1), jnp.concatenate([v, values], 1),
                to_bias(jnp.concatenate([valid, own], 1)))
      return hook

    hooks = ([sentence_hook(c) for c in self.sentence_caches] +
             [body_hook(c) for c in self.body_caches])
    x = self.stack.embed(tokens)
    h = self.stack(x, place[:, None], no_bias, upto=cfg.encoder_layers, kv_hooks=hooks)
    y = self.stack(h, sentence[:, None], no_bias, start=cfg.encoder_layers, kv_hooks=hooks)
    self.position(batch, closes)
    return self.stack.logits(y)

