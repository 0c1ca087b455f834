"""T5X-style encoder-decoder model: loss, prediction and scoring around a network module.

`EncoderDecoderModel` calls its module exactly the way `t5x.models.EncoderDecoderModel`
does (the same argument names, the same cache-initialisation and per-step decode calls),
so a network that works here works in T5X and vice versa.
"""
import functools
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from decal_jax import decoding
from decal_jax.models import base

if TYPE_CHECKING:
  import seqio

Array = jax.Array
Batch = base.Batch


class EncoderDecoderModel(base.TokenModel):
  """Loss / predict / score for an encoder-decoder network such as `networks.t5.Transformer`."""

  FEATURE_CONVERTER_CLS = base.SeqioConverter("EncDecFeatureConverter")

  def __init__(self, module: nn.Module, input_vocabulary: Optional["seqio.Vocabulary"],
               output_vocabulary: Optional["seqio.Vocabulary"], z_loss: float = 1e-4,
               label_smoothing: float = 0.0, loss_normalizing_factor: Optional[float] = None,
               decode_fn: Callable[..., Tuple[Array, Array]] = decoding.beam_search):
    super().__init__(module, input_vocabulary, output_vocabulary, z_loss, label_smoothing,
                     loss_normalizing_factor, decode_fn)

  # ------------------------------------------------------------------------- init
  def input_shapes(self, task_feature_lengths: Mapping[str, int]) -> base.Shapes:
    return {"encoder_input_tokens": (1, task_feature_lengths["inputs"]),
            "decoder_input_tokens": (1, task_feature_lengths["targets"])}

  def get_initial_variables(self, rng: Array, input_shapes: Mapping[str, Tuple[int, ...]],
                            input_types: Optional[Mapping[str, Any]] = None):
    """Variables (`params`, `params_axes`) from dummy inputs of the given shapes."""
    input_types = input_types or {}
    enc_type = input_types.get("encoder_input_tokens", jnp.int32)
    dec_type = input_types.get("decoder_input_tokens", jnp.int32)
    enc = jnp.ones(input_shapes["encoder_input_tokens"], enc_type)
    dec = jnp.ones(input_shapes["decoder_input_tokens"], dec_type)
    return self.module.init(rng, encoder_input_tokens=enc, decoder_input_tokens=dec,
                            decoder_target_tokens=dec, decode=False, enable_dropout=False)

  # ------------------------------------------------------------------------- loss
  def _compute_logits(self, params, batch: Batch, dropout_rng: Optional[Array] = None) -> Array:
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
    return self.module.apply(
        {"params": params}, batch["encoder_input_tokens"], batch["decoder_input_tokens"],
        batch["decoder_target_tokens"], encoder_segment_ids=batch.get("encoder_segment_ids"),
        decoder_segment_ids=batch.get("decoder_segment_ids"),
        encoder_positions=batch.get("encoder_positions"),
        decoder_positions=batch.get("decoder_positions"), decode=False,
        enable_dropout=rngs is not None, rngs=rngs)

  # ------------------------------------------------------------------------- predict
  def _compute_logits_from_slice(self, state: decoding.DecodingState, params, encoded: Array,
                                 raw_inputs: Array, max_decode_length: int):
    """One cached decoder step, the way T5X's EncoderDecoderModel makes it."""
    logits, new_vars = self.module.apply(
        {"params": params, "cache": state.cache}, encoded, raw_inputs, state.cur_token,
        state.cur_token, enable_dropout=False, decode=True,
        max_decode_length=max_decode_length, mutable=["cache"], method=self.module.decode)
    return logits[:, 0, :], new_vars["cache"]  # [batch * beams, vocab]

  def predict_batch_with_aux(self, params, batch: Batch, rng: Optional[Array] = None, *,
                             num_decodes: int = 1, return_all_decodes: bool = False,
                             **decoder_kwargs):
    """Decodes `[batch, max_target_len]` tokens; aux holds the decoder's scores."""
    inputs = batch["encoder_input_tokens"]
    targets_shape = batch["decoder_input_tokens"].shape
    _, init_vars = self.module.apply(
        {"params": params}, jnp.ones_like(inputs), jnp.ones(targets_shape, jnp.int32),
        jnp.ones(targets_shape, jnp.int32), decode=True, enable_dropout=False,
        mutable=["cache"])
    encoded = self.module.apply({"params": params}, inputs, enable_dropout=False,
                                method=self.module.encode)
    return self._decode_from(params, encoded, inputs, init_vars["cache"], targets_shape, rng,
                             num_decodes, return_all_decodes, **decoder_kwargs)

  def _decode_from(self, params, encoded, inputs: Array, cache, targets_shape, rng,
                   num_decodes: int, return_all_decodes: bool, **decoder_kwargs):
    """Decodes from an encoder output (beam-expanded here) and an initial decoder cache."""
    encoded = decoding.flat_batch_beam_expand(encoded, num_decodes)
    raw_inputs = decoding.flat_batch_beam_expand(inputs, num_decodes)
    tokens_to_logits = functools.partial(self._compute_logits_from_slice, params=params,
                                         encoded=encoded, raw_inputs=raw_inputs,
                                         max_decode_length=targets_shape[1])
    decoder_prompt = jnp.zeros(targets_shape, jnp.int32)
    if rng is not None:
      decoder_kwargs.setdefault("decode_rng", rng)
    seqs, scores = self._decode_fn(
        inputs=decoder_prompt, cache=cache, tokens_to_logits=tokens_to_logits,
        eos_id=self.output_vocabulary.eos_id, num_decodes=num_decodes, **decoder_kwargs)
    if return_all_decodes:
      return seqs, {"scores": scores}
    return seqs[:, -1, :], {"scores": scores[:, -1]}  # best is last

  def predict_batch(self, params, batch: Batch, rng: Optional[Array] = None, **kwargs) -> Array:
    return self.predict_batch_with_aux(params, batch, rng, **kwargs)[0]

  def predict_batch_uncached(self, params, batch: Batch) -> Array:
    """Greedy decoding that reruns the whole decoder each step (no cache): the reference
    that cached decoding must match token for token."""
    batch_size, length = batch["decoder_input_tokens"].shape
    eos = self.output_vocabulary.eos_id

    def step(i, carry):
      outputs, ended = carry
      dec_in = jnp.pad(outputs, ((0, 0), (1, 0)))[:, :-1]  # shift right, BOS = 0
      logits = self._compute_logits(params, dict(batch, decoder_input_tokens=dec_in,
                                                 decoder_target_tokens=outputs))
      token = jnp.where(ended, 0, jnp.argmax(logits[:, i], axis=-1)).astype(jnp.int32)
      outputs = outputs.at[:, i].set(token)
      return outputs, ended | (token == eos)

    init = (jnp.zeros((batch_size, length), jnp.int32), jnp.zeros((batch_size,), bool))
    return jax.lax.fori_loop(0, length, step, init)[0]
