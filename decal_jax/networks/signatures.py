"""T5X's network call signatures, written once for the networks that share them.

`t5x.models.EncoderDecoderModel` calls a network's `__call__`, `encode` and `decode`;
`t5x.models.DecoderOnlyModel` calls `__call__` with the arguments of
`DecoderOnlyNetwork.__call__`. A network subclasses one of the two classes here and
implements the rest (`encode` / `decode`, or `forward`).
"""
from typing import Optional

import flax.linen as nn

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
               max_decode_length: Optional[int] = None, prefill: bool = False,
               prefill_lengths: Optional[Array] = None) -> Array:
    """Teacher-forced logits `[batch, t, vocab]`."""
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                          enable_dropout=enable_dropout)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       decoder_target_tokens, encoder_segment_ids, decoder_segment_ids,
                       decoder_positions, enable_dropout=enable_dropout, decode=decode,
                       max_decode_length=max_decode_length, prefill=prefill,
                       prefill_lengths=prefill_lengths)


class DecoderOnlyNetwork(nn.Module):
  """T5X `DecoderOnlyModel`'s `__call__`, its inputs checked once, over `forward`.

  Subclasses implement `forward(tokens, targets, segment_ids, positions, *, deterministic,
  decode, prefill)` -> logits `[batch, t, vocab]`, and say whether they take packed rows
  (`takes_packed_inputs`: segment ids are read; otherwise refused, and positions are the
  network's own) and prefill (`takes_prefill`: a prompt written to the cache in one call).
  Every one is a causal LM, so prefix-LM inputs (`decoder_causal_attention`) and per-row
  `prefill_lengths` are refused here.
  """
  takes_packed_inputs = False
  takes_prefill = False

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
    if prefill_lengths is not None:
      raise ValueError(f"{name} does not take prefill_lengths: prefill equal-length prompts "
                       "(left-pad) with prefill=True where the network supports prefill.")
    if prefill and not self.takes_prefill:
      raise ValueError(f"{name} feeds prompts one token at a time through its cache; "
                       "prefill is not supported.")
    if decoder_segment_ids is not None and not self.takes_packed_inputs:
      raise ValueError(f"{name} reads one unpacked text per row: use pack=False (no "
                       "decoder_segment_ids).")
    return self.forward(decoder_input_tokens, decoder_target_tokens, decoder_segment_ids,
                        decoder_positions, deterministic=not enable_dropout, decode=decode,
                        prefill=prefill)
