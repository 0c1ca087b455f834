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
`max_sentence_length` tokens without one is closed there (the same rule in training, cached,
uncached and the paper's generation), which bounds the encoder's work per generated token
and the fixed-size sentence caches (docs/methods/gpthf.md says why it stays).

Cached generation (`decode=True`, one token per call) keeps, per row: the current sentence's
encoder keys/values (at most max_sentence_length slots, reused from slot 0 when a sentence
closes), the body keys/values of every finished sentence, and the sentence counters; only the
current token passes through the encoder.

The paper's inference (`paper_generate`, gpthf_summary.md) keeps no keys / values at all:
only the finished sentences' embeddings and the current sentence's tokens. Every step reruns
the word-level blocks over the current sentence so far (`sentence_state`) and the
sentence-level blocks over [e_0 .. e_{j-1}, h_t] (`sentence_logits`); the prompt's sentence
embeddings come from one parallel word-level pass (`word_states`).
"""
import dataclasses
from typing import ClassVar, List, NamedTuple, Optional

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

  # ---------------------------------------------------------------- the paper's inference
  def sentence_state(self, sentence: Array, place: Array) -> Array:
    """The word-level blocks rerun over the current sentence `[batch, s]` (its tokens so far
    in slots 0 .. place; later slots are padding, which causality hides) -> the state of the
    token at `place` `[batch]`: `[batch, embed]` (its sentence's embedding if it closes it)."""
    batch, s = sentence.shape
    causal = attn.mask_to_bias(jnp.tril(jnp.ones((s, s), bool))[None, None],
                               self.config.decoder.dtype)  # [1, 1, s, s]
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (batch, s))  # places
    h = self.stack(self.stack.embed(sentence), positions, causal,
                   upto=self.config.encoder_layers)  # [b, s, embed]
    return jnp.take_along_axis(h, place[:, None, None], axis=1)[:, 0]  # [b, embed]

  def sentence_logits(self, state: Array, embeddings: Array, count: Array) -> Array:
    """The sentence-level blocks rerun over [e_0 .. e_{count-1}, state] -> next-token logits
    `[batch, vocab]`. state `[batch, embed]`; embeddings `[batch, m, embed]`, of which the
    first `count` `[batch]` (<= m) are the row's finished sentences (the rest are not read)."""
    m = embeddings.shape[1]
    rows = jnp.concatenate([embeddings.astype(state.dtype), state[:, None]], 1)  # [b, m+1, e]
    index = jnp.arange(m + 1)
    positions = jnp.where(index < m, index, count[:, None]).astype(jnp.int32)  # [b, m + 1]
    causal = index[:, None] >= index[None, :]  # [m + 1, m + 1]: rows e_i read e_0 .. e_i
    own = (index[None] < count[:, None]) | (index == m)[None]  # [b, m + 1]: the token's row
    visible = jnp.where((index == m)[None, :, None], own[:, None, :], causal[None])  # [b, q, k]
    y = self.stack(rows, positions, attn.mask_to_bias(visible[:, None], self.config.decoder.dtype),
                   start=self.config.encoder_layers)  # [b, m + 1, embed]
    return self.stack.logits(y[:, -1:])[:, 0]  # [b, vocab]


def bucket_sizes(limit: int, smallest: int = 8) -> List[int]:
  """The compiled lengths of `paper_generate`: smallest, 2 x smallest, .. up to `limit`."""
  sizes = [min(smallest, limit)]
  while sizes[-1] < limit:
    sizes.append(min(2 * sizes[-1], limit))
  return sizes


def _bucketed(sizes: List[int], need: Array, run) -> Array:
  """run(size) for the smallest size >= need (a scalar): one compiled branch per size."""
  index = jnp.searchsorted(jnp.asarray(sizes), need)  # first size >= need
  return jax.lax.switch(jnp.minimum(index, len(sizes) - 1), [lambda s=s: run(s) for s in sizes])


def paper_generate(module: Gpthf, params, prompt: Array, max_new_tokens: int,
                   forced: Optional[Array] = None, return_logits: bool = False) -> Array:
  """GPTHF generation as the paper runs it (no keys / values kept): `[batch, P]` -> the
  argmax of each of `max_new_tokens` steps `[batch, K]` (greedy; with `forced` `[batch, K]`,
  step i feeds forced[:, i] next instead, teacher forcing), or with `return_logits` the
  steps' logits `[batch, K, vocab]`. No EOS stop.

  The prompt's fed tokens (BOS + prompt[:-1]) go through the word-level blocks in one
  parallel pass: the closed sentences' embeddings and the open sentence's tokens are kept.
  Each step then feeds one token (prompt[-1] first): `sentence_state` over the current
  sentence, `sentence_logits` over the finished sentences plus it; a closing token's state
  joins the embeddings. Under jit the reruns take the smallest of `bucket_sizes` lengths that
  holds every row (sentence slots up to max_sentence_length, embedding slots up to P + K)."""
  cfg = module.config
  prompt = jnp.asarray(prompt, jnp.int32)
  forced = None if forced is None else jnp.asarray(forced, jnp.int32)  # [b, K]
  batch, length = prompt.shape
  s, slots = cfg.max_sentence_length, length + max_new_tokens  # a fed token closes <= 1
  rows = jnp.arange(batch)
  apply = lambda method, *args: module.apply({"params": params}, *args, method=method)
  place = count = jnp.zeros((batch,), jnp.int32)
  sentence = jnp.zeros((batch, s), jnp.int32)  # the open sentence's tokens
  embeddings = jnp.zeros((batch, slots, cfg.decoder.emb_dim), cfg.decoder.dtype)
  if length:
    feed = jnp.pad(prompt, ((0, 0), (1, 0)))[:, :length]  # [b, P]: BOS + prompt[:-1]
    h, layout = apply(Gpthf.word_states, feed)  # [b, P, embed]
    at = jnp.where(layout.closes, layout.sentence, slots)  # [b, P]: closed -> its slot
    embeddings = embeddings.at[rows[:, None], at].set(h.astype(embeddings.dtype), mode="drop")
    count = layout.sentence[:, -1] + layout.closes[:, -1]  # [b] sentences finished
    place = jnp.where(layout.closes[:, -1], 0, layout.place[:, -1] + 1)  # [b] next place
    open_slot = jnp.where(layout.sentence == count[:, None], layout.place, s)  # [b, P]
    sentence = sentence.at[rows[:, None], open_slot].set(feed, mode="drop")
  first = prompt[:, -1] if length else jnp.zeros((batch,), jnp.int32)  # BOS when empty
  sizes, embedding_sizes = bucket_sizes(s), bucket_sizes(slots)

  def step(i, carry):
    token, place, count, sentence, embeddings, best = carry  # token [b]: fed now
    sentence = sentence.at[rows, place].set(token)
    state = _bucketed(sizes, jnp.max(place) + 1, lambda n: apply(
        Gpthf.sentence_state, sentence[:, :n], place))  # [b, embed]
    logits = _bucketed(embedding_sizes, jnp.max(count), lambda m: apply(
        Gpthf.sentence_logits, state, embeddings[:, :m], count))  # [b, vocab]
    closes = (token == cfg.sentence_end_id) | (place == s - 1)  # [b]
    embeddings = embeddings.at[rows, jnp.where(closes, count, slots)].set(
        state.astype(embeddings.dtype), mode="drop")
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [b]
    token = argmax if forced is None else forced[:, i]
    return (token, jnp.where(closes, 0, place + 1), count + closes, sentence, embeddings,
            best.at[:, i].set(logits if return_logits else argmax))

  out = ((batch, max_new_tokens, cfg.vocab_size), jnp.float32) if return_logits else (
      (batch, max_new_tokens), jnp.int32)
  carry = (first, place, count, sentence, embeddings, jnp.zeros(*out))
  return jax.lax.fori_loop(0, max_new_tokens, step, carry)[-1]
