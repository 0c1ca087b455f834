"""T5X's network call signatures, written once for the networks that share them.

`t5x.models.EncoderDecoderModel` calls a network's `__call__`, `encode` and `decode`;
`t5x.models.DecoderOnlyModel` calls `__call__` with the arguments of
`DecoderOnlyNetwork.__call__`. A network subclasses one of the two classes here and
implements the rest (`encode` / `decode`, or `forward`).
"""
from typing import Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from decal_jax.layers.core import Array


def check_tokens(tokens: Array, name: str) -> Array:
  """Token ids must be `[batch, length]`; returns them."""
  if tokens.ndim != 2:
    raise ValueError(f"{name} must be [batch, length] token ids, got shape {tokens.shape}.")
  return tokens


class EncoderDecoderNetwork(nn.Module):
  """`__call__` is teacher forcing, `decode(encode(...))`; subclasses implement `encode`
  and `decode` with T5X's signatures (T5 with DeCAL, Dodo)."""

  def __call__(self, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens=None,
               encoder_segment_ids=None, decoder_segment_ids=None, encoder_positions=None,
               decoder_positions=None, *, enable_dropout: bool = True, decode: bool = False,
               max_decode_length: Optional[int] = None) -> Array:
    """Teacher-forced logits `[batch, t, vocab]`."""
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                          enable_dropout=enable_dropout)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       decoder_target_tokens, encoder_segment_ids, decoder_segment_ids,
                       decoder_positions, enable_dropout=enable_dropout, decode=decode,
                       max_decode_length=max_decode_length)


class DecoderOnlyNetwork(nn.Module):
  """T5X `DecoderOnlyModel`'s `__call__`, its inputs checked once, over `forward`.

  Subclasses implement `forward(tokens, targets, segment_ids, positions, *, deterministic,
  decode)` -> logits `[batch, t, vocab]`, and say whether they take packed rows
  (`takes_packed_inputs`: segment ids are read; otherwise refused, and positions are the
  network's own). Every one is a causal LM, so prefix-LM inputs (`decoder_causal_attention`)
  are refused here.

  Prompt prefill (`prefill=True`, T5X's `DecoderOnlyModel._compute_kv_cache`): the cache,
  created beforehand, receives each row's first `prefill_lengths[b]` tokens (all of them
  when no lengths are given) and the step index moves to that length, per row, so the next
  cached step feeds token `prefill_lengths[b]`. `prefill_cache` does it; by default one
  cached step per token, each row's cache kept once its prompt is fed.
  """
  takes_packed_inputs = False

  def __call__(self, decoder_input_tokens: Array, decoder_target_tokens: Optional[Array] = None,
               decoder_segment_ids: Optional[Array] = None,
               decoder_positions: Optional[Array] = None,
               decoder_causal_attention: Optional[Array] = None, *,
               enable_dropout: bool = True, decode: bool = False,
               max_decode_length: Optional[int] = None, prefill: bool = False,
               prefill_lengths: Optional[Array] = None) -> Array:
    """Logits `[batch, t, vocab]`; decode=True: cache creation, then one cached step."""
    del max_decode_length
    name = type(self).__name__
    if decoder_causal_attention is not None:  # (a traced array: its values cannot be read)
      raise ValueError(f"{name} is causal; prefix-LM (decoder_causal_attention) inputs are "
                       "not supported. Use the LM feature converter without bidirectional "
                       "inputs.")
    if prefill_lengths is not None and not prefill:
      raise ValueError("prefill_lengths is given only with prefill=True.")
    if prefill:
      return self.prefill_cache(check_tokens(decoder_input_tokens, "decoder_input_tokens"),
                                prefill_lengths)
    if decoder_segment_ids is not None and not self.takes_packed_inputs:
      raise ValueError(f"{name} reads one unpacked text per row: use pack=False (no "
                       "decoder_segment_ids).")
    return self.forward(decoder_input_tokens, decoder_target_tokens, decoder_segment_ids,
                        decoder_positions, deterministic=not enable_dropout, decode=decode)

  def prefill_cache(self, tokens: Array, lengths: Optional[Array]) -> Array:
    """Feeds `tokens[b, :lengths[b]]` `[batch, t]` through cached one-token steps (the rows
    past their length keep their cache) -> each step's logits `[batch, t, vocab]`."""
    if "cache" not in self.variables:
      raise ValueError("Create the decoding cache (a decode=True call) before a prefill.")
    batch, length = tokens.shape
    lengths = jnp.full((batch,), length, jnp.int32) if lengths is None else lengths
    network = self.clone(parent=None)  # applied functionally, one token per step
    params = self.variables["params"]
    # every scalar in a cache is a step index shared by the rows: it becomes one per row
    cache = jax.tree_util.tree_map(
        lambda x: jnp.broadcast_to(x, (batch,)) if jnp.ndim(x) == 0 else x,
        flax.core.unfreeze(self.variables["cache"]))

    def feed(cache, t):
      token = jax.lax.dynamic_slice_in_dim(tokens, t, 1, axis=1)  # [batch, 1]
      logits, new = network.apply({"params": params, "cache": cache}, token, decode=True,
                                  enable_dropout=False, mutable=["cache"])
      keep = t < lengths  # [batch]
      cache = jax.tree_util.tree_map(
          lambda n, o: jnp.where(keep.reshape(keep.shape + (1,) * (n.ndim - 1)), n, o),
          flax.core.unfreeze(new["cache"]), cache)
      return cache, logits[:, 0]

    cache, logits = jax.lax.scan(feed, cache, jnp.arange(length))  # logits [t, b, vocab]
    for name, value in cache.items():
      self.put_variable("cache", name, value)
    return jnp.swapaxes(logits, 0, 1)
