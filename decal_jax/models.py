"""T5X-style model wrapper: owns the loss, prediction and scoring around a network module.

`EncoderDecoderModel` calls its module exactly the way `t5x.models.EncoderDecoderModel`
does (the same argument names, the same cache-initialisation and per-step decode calls),
so a network that works here works in T5X and vice versa.
"""
import functools
from typing import Any, Callable, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import seqio
import tensorflow as tf

from decal_jax import decoding, losses

Array = jax.Array
Batch = Mapping[str, Array]


class _TokenLoss:
  """Loss / eval / score over `decoder_target_tokens`, shared by both model kinds; the
  subclass provides `_compute_logits(params, batch, dropout_rng)`."""

  def __init__(self, module, input_vocabulary, output_vocabulary, z_loss, label_smoothing,
               loss_normalizing_factor, decode_fn):
    self.module = module
    self.input_vocabulary = input_vocabulary
    self.output_vocabulary = output_vocabulary
    self.z_loss = z_loss
    self.label_smoothing = label_smoothing
    self.loss_normalizing_factor = loss_normalizing_factor
    self._decode_fn = decode_fn

  def loss_fn(self, params, batch: Batch, dropout_rng: Optional[Array]):
    """(optimised loss, aux sums) — see docs/CONTRACTS.md for the aux keys."""
    logits = self._compute_logits(params, batch, dropout_rng)  # [batch, t, vocab]
    targets = batch["decoder_target_tokens"]
    weights = batch.get("decoder_loss_weights")
    if weights is None:
      weights = (targets > 0).astype(jnp.float32)
    loss, z_loss, weight_sum = losses.compute_weighted_cross_entropy(
        logits, targets, weights, self.label_smoothing, self.z_loss,
        self.loss_normalizing_factor)
    correct, _ = losses.compute_weighted_accuracy(logits, targets, weights)
    if self.loss_normalizing_factor is None:  # T5X default: mean over target tokens
      loss, z_loss = loss / jnp.maximum(weight_sum, 1.0), z_loss / jnp.maximum(weight_sum, 1.0)
    scale = weight_sum if self.loss_normalizing_factor is None else self.loss_normalizing_factor
    aux = {"cross_ent_sum": (loss - z_loss) * scale, "z_loss_sum": z_loss * scale,
           "correct_tokens": correct, "target_tokens": weight_sum}
    return loss, aux

  def eval_fn(self, params, batch: Batch):
    return self.loss_fn(params, batch, dropout_rng=None)

  def score_batch(self, params, batch: Batch) -> Array:
    """Log-likelihood of each target sequence, `[batch]`."""
    logits = self._compute_logits(params, batch)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    targets = batch["decoder_target_tokens"]
    token_lp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    weights = batch.get("decoder_loss_weights", (targets > 0).astype(jnp.float32))
    return jnp.sum(token_lp * weights, axis=-1)


class EncoderDecoderModel(_TokenLoss):
  """Loss / predict / score for an encoder-decoder network such as `networks.t5.Transformer`."""

  FEATURE_CONVERTER_CLS = seqio.EncDecFeatureConverter

  def __init__(self, module: nn.Module, input_vocabulary: seqio.Vocabulary,
               output_vocabulary: seqio.Vocabulary, z_loss: float = 1e-4,
               label_smoothing: float = 0.0, loss_normalizing_factor: Optional[float] = None,
               decode_fn: Callable[..., Tuple[Array, Array]] = decoding.beam_search):
    super().__init__(module, input_vocabulary, output_vocabulary, z_loss, label_smoothing,
                     loss_normalizing_factor, decode_fn)

  # ------------------------------------------------------------------------- init
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
    inputs = batch["encoder_input_tokens"]
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


class DecoderOnlyModel(_TokenLoss):
  """Loss / generation for a decoder-only network (`networks.decoder.Decoder`,
  `networks.dodo_lm.DodoLM`), called the way `t5x.models.DecoderOnlyModel` calls it."""

  FEATURE_CONVERTER_CLS = seqio.DecoderFeatureConverter
  DECODER_ONLY = True

  def __init__(self, module: nn.Module, vocabulary: seqio.Vocabulary, z_loss: float = 1e-4,
               label_smoothing: float = 0.0, loss_normalizing_factor: Optional[float] = None,
               decode_fn: Callable[..., Tuple[Array, Array]] = decoding.temperature_sample):
    super().__init__(module, vocabulary, vocabulary, z_loss, label_smoothing,
                     loss_normalizing_factor, decode_fn)

  def get_initial_variables(self, rng: Array, input_shapes: Mapping[str, Tuple[int, ...]],
                            input_types: Optional[Mapping[str, Any]] = None):
    dtype = (input_types or {}).get("decoder_input_tokens", jnp.int32)
    tokens = jnp.ones(input_shapes["decoder_input_tokens"], dtype)
    return self.module.init(rng, tokens, tokens, enable_dropout=False)

  def _compute_logits(self, params, batch: Batch, dropout_rng: Optional[Array] = None) -> Array:
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
    return self.module.apply(
        {"params": params}, batch["decoder_input_tokens"], batch["decoder_target_tokens"],
        decoder_segment_ids=batch.get("decoder_segment_ids"),
        decoder_positions=batch.get("decoder_positions"), enable_dropout=rngs is not None,
        rngs=rngs)

  # ------------------------------------------------------------------------- generation
  def generate(self, params, prompt: Array, max_new_tokens: int, rng: Optional[Array] = None,
               **decoder_kwargs) -> Array:
    """Continues equal-length prompts `[batch, P]` (P may be 0: start from BOS = id 0) by
    `max_new_tokens` tokens -> `[batch, max_new_tokens]` (0 after EOS).

    The prompt goes through the KV cache one token at a time (BOS, then all but its last
    token); the decode function's first step then feeds the prompt's last token."""
    prompt = jnp.asarray(prompt, jnp.int32)
    batch, length = prompt.shape
    total = length + max_new_tokens
    max_length = getattr(getattr(self.module.config, "decoder", self.module.config),
                         "max_length", None)
    if max_length is not None and total > max_length:
      raise ValueError(f"A prompt of {length} tokens plus {max_new_tokens} new ones needs "
                       f"{total} positions but the model accepts {max_length}: shorten the "
                       "prompt or generate fewer tokens.")
    _, variables = self.module.apply({"params": params}, jnp.ones((batch, total), jnp.int32),
                                     decode=True, enable_dropout=False, mutable=["cache"])
    cache = variables["cache"]
    feed = jnp.pad(prompt, ((0, 0), (1, 0)))[:, :length]  # [b, P]: BOS + prompt[:-1]

    def prefeed(cache, token):
      _, new = self.module.apply({"params": params, "cache": cache}, token[:, None],
                                 decode=True, enable_dropout=False, mutable=["cache"])
      return new["cache"], None
    cache, _ = jax.lax.scan(prefeed, cache, feed.T)
    last = prompt[:, -1:] if length else None

    def tokens_to_logits(state: decoding.DecodingState):
      token = state.cur_token
      if last is not None:
        first = jnp.repeat(last, token.shape[0] // batch, axis=0)
        token = jnp.where(state.cur_index == 0, first, token)
      logits, new = self.module.apply({"params": params, "cache": state.cache}, token,
                                      decode=True, enable_dropout=False, mutable=["cache"])
      return logits[:, 0, :], new["cache"]

    if rng is not None:
      decoder_kwargs.setdefault("decode_rng", rng)
    seqs, _ = self._decode_fn(inputs=jnp.zeros((batch, max_new_tokens), jnp.int32),
                              cache=cache, tokens_to_logits=tokens_to_logits,
                              eos_id=self.output_vocabulary.eos_id, **decoder_kwargs)
    return seqs[:, -1, :]

  def generate_uncached(self, params, prompt: Array, max_new_tokens: int) -> Array:
    """Greedy continuation that reruns the whole network over everything so far at every
    step (no cache): the reference cached `generate` must match, and the paper-style
    "GPT without a KV cache" baseline. `[batch, P]` -> `[batch, max_new_tokens]`."""
    prompt = jnp.asarray(prompt, jnp.int32)
    batch, length = prompt.shape
    eos = self.output_vocabulary.eos_id
    tokens = jnp.zeros((batch, length + max_new_tokens), jnp.int32).at[:, :length].set(prompt)

    def step(i, carry):
      tokens, ended = carry
      inputs = jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]  # BOS + everything so far
      logits = self.module.apply({"params": params}, inputs, enable_dropout=False)
      next_logits = logits[:, length + i]  # predicts tokens[length + i]
      token = jnp.where(ended, 0, jnp.argmax(next_logits, axis=-1))
      tokens = tokens.at[:, length + i].set(token.astype(jnp.int32))
      return tokens, ended | (token == eos)

    init = (tokens, jnp.zeros((batch,), bool))
    return jax.lax.fori_loop(0, max_new_tokens, step, init)[0][:, length:]

  def predict_batch(self, params, batch: Batch, rng: Optional[Array] = None,
                    **kwargs) -> Array:
    """Unconditional samples as long as `decoder_input_tokens` (LM tasks have no inputs)."""
    return self.generate(params, jnp.zeros((batch["decoder_input_tokens"].shape[0], 0),
                                           jnp.int32),
                         batch["decoder_input_tokens"].shape[1], rng, **kwargs)



class SquidFeatureConverter(seqio.EncDecFeatureConverter):
  """Squid's task features -> model features. Tasks give 'inputs' (the context the small
  decoder compresses), 'query' (what the large decoder reads after the compressed context,
  possibly empty) and 'targets' (what it must produce):

    encoder_input_tokens  <- inputs              query_tokens <- query
    decoder_target_tokens <- targets             decoder_input_tokens <- targets shifted right
    decoder_loss_weights  <- 1 on real target tokens

  Each example compresses its own context, so packing is refused.
  """

  TASK_FEATURES = dict(seqio.EncDecFeatureConverter.TASK_FEATURES,
                       query=seqio.FeatureConverter.FeatureSpec(dtype=tf.int32))
  MODEL_FEATURES = dict(seqio.EncDecFeatureConverter.MODEL_FEATURES,
                        query_tokens=seqio.FeatureConverter.FeatureSpec(dtype=tf.int32))

  def __init__(self, pack: bool = False, **kwargs):
    if pack:
      raise ValueError("Squid compresses one context per example; packed examples are not "
                       "supported. Set the dataset's pack=False (the default in our gin runs).")
    super().__init__(pack=False, **kwargs)

  def _convert_example(self, features):
    return dict(super()._convert_example(features), query_tokens=features["query"])

  def get_model_feature_lengths(self, task_feature_lengths):
    return dict(super().get_model_feature_lengths(task_feature_lengths),
                query_tokens=task_feature_lengths["query"])

class SquidModel(EncoderDecoderModel):
  """`EncoderDecoderModel` for `networks.squid.Squid`: batches carry `query_tokens` (what the
  large decoder reads after the compressed context), and inference can compress a context
  once and answer many queries against the kept `Compressed` vectors:

    compressed = model.compress(params, context)          # [b, n] -> N vectors per row
    answers = model.answer(params, compressed, queries, 32)  # no recompression
  """

  FEATURE_CONVERTER_CLS = SquidFeatureConverter

  def get_initial_variables(self, rng: Array, input_shapes: Mapping[str, Tuple[int, ...]],
                            input_types: Optional[Mapping[str, Any]] = None):
    enc = jnp.ones(input_shapes["encoder_input_tokens"], jnp.int32)
    dec = jnp.ones(input_shapes["decoder_input_tokens"], jnp.int32)
    query = jnp.ones(input_shapes.get("query_tokens", (enc.shape[0], 1)), jnp.int32)
    return self.module.init(rng, enc, dec, dec, query_tokens=query, enable_dropout=False)

  def _compute_logits(self, params, batch: Batch, dropout_rng: Optional[Array] = None) -> Array:
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
    return self.module.apply(
        {"params": params}, batch["encoder_input_tokens"], batch["decoder_input_tokens"],
        batch["decoder_target_tokens"], query_tokens=batch.get("query_tokens"),
        enable_dropout=rngs is not None, rngs=rngs)

  def check_batch(self, batch: Batch) -> None:
    """Host-side check of a numpy batch (the trainer calls it before each step): with a
    fixed N, every real context must hold at least N tokens."""
    cfg = self.module.config
    if cfg.memory_ratio is not None:
      return
    lengths = np.sum(np.asarray(batch["encoder_input_tokens"]) > 0, axis=1)  # [batch]
    short = (lengths > 0) & (lengths < cfg.memory_tokens)
    if np.any(short):
      raise ValueError(
          f"{int(np.sum(short))} context(s) in this batch are shorter than the "
          f"{cfg.memory_tokens} memory tokens (shortest: {int(lengths[short].min())} tokens): "
          "compressing them would expand them. Drop contexts shorter than N from the task, "
          "lower SquidConfig.memory_tokens, or set memory_ratio (N = ceil(length / ρ)).")

  def compress(self, params, context: Array):
    """Context tokens `[batch, n]` (right-padded) -> `squid.Compressed`, to keep and reuse."""
    if not isinstance(context, jax.core.Tracer):
      self.check_batch({"encoder_input_tokens": context})
    return self.module.apply({"params": params}, jnp.asarray(context, jnp.int32),
                             method=self.module.compress)

  def answer(self, params, compressed, query_tokens: Optional[Array], max_answer_length: int,
             rng: Optional[Array] = None, *, num_decodes: int = 1,
             return_all_decodes: bool = False, **decoder_kwargs):
    """Decodes `[batch, max_answer_length]` answers to `query_tokens` `[batch, q]` (None or
    width 0: no query) from a kept `Compressed`; a `Compressed` of batch 1 serves a batch of
    queries. Returns (tokens, {'scores'}) like `predict_batch_with_aux`."""
    batch = compressed.embeddings.shape[0]
    if query_tokens is not None:
      query_tokens = jnp.asarray(query_tokens, jnp.int32)
      if batch == 1 and query_tokens.shape[0] > 1:
        compressed = jax.tree_util.tree_map(
            lambda leaf: jnp.repeat(leaf, query_tokens.shape[0], axis=0), compressed)
        batch = query_tokens.shape[0]
      if query_tokens.shape[0] != batch:
        raise ValueError(f"{query_tokens.shape[0]} queries for {batch} compressed contexts: "
                         "give one query per context, or compress a single context.")
    prefix = self.module.apply({"params": params}, compressed, query_tokens,
                               method=self.module.read)
    targets_shape = (batch, max_answer_length)
    dummy = jnp.ones(targets_shape, jnp.int32)
    _, init_vars = self.module.apply({"params": params}, prefix, None, dummy, decode=True,
                                     enable_dropout=False, mutable=["cache"],
                                     method=self.module.decode)
    return self._decode_from(params, prefix, jnp.zeros((batch, 1), jnp.int32),
                             init_vars["cache"], targets_shape, rng, num_decodes,
                             return_all_decodes, **decoder_kwargs)

  def predict_batch_with_aux(self, params, batch: Batch, rng: Optional[Array] = None, *,
                             num_decodes: int = 1, return_all_decodes: bool = False,
                             **decoder_kwargs):
    """Compresses each row's context and answers its query (one batch, no reuse)."""
    compressed = self.compress(params, batch["encoder_input_tokens"])
    return self.answer(params, compressed, batch.get("query_tokens"),
                       batch["decoder_input_tokens"].shape[1], rng, num_decodes=num_decodes,
                       return_all_decodes=return_all_decodes, **decoder_kwargs)



# The dual encoder (retrieval) lives with the rest of retrieval; gin names it models.*.
from decal_jax.retrieval.model import (DualEncoderFeatureConverter,  # noqa: E402,F401
                                       DualEncoderModel)
