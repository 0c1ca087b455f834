"""T5X-style decoder-only model: loss, generation and scoring around a causal LM module
(`networks.decoder.Decoder`, `networks.dodo_lm.DodoLM`, `networks.gpthf.Gpthf`)."""
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


class DecoderOnlyModel(base.TokenModel):
  """Loss / generation for a decoder-only network (`networks.decoder.Decoder`,
  `networks.dodo_lm.DodoLM`), called the way `t5x.models.DecoderOnlyModel` calls it."""

  FEATURE_CONVERTER_CLS = base.SeqioConverter("DecoderFeatureConverter")
  DECODER_ONLY = True

  def __init__(self, module: nn.Module, vocabulary: Optional["seqio.Vocabulary"],
               z_loss: float = 1e-4,
               label_smoothing: float = 0.0, loss_normalizing_factor: Optional[float] = None,
               decode_fn: Callable[..., Tuple[Array, Array]] = decoding.temperature_sample):
    super().__init__(module, vocabulary, vocabulary, z_loss, label_smoothing,
                     loss_normalizing_factor, decode_fn)

  def input_shapes(self, task_feature_lengths: Mapping[str, int]) -> base.Shapes:
    return {"decoder_input_tokens": (1, task_feature_lengths["targets"])}

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
               *, prefill: bool = False, **decoder_kwargs) -> Array:
    """Continues equal-length prompts `[batch, P]` (P may be 0: start from BOS = id 0) by
    `max_new_tokens` tokens -> `[batch, max_new_tokens]` (0 after EOS).

    The fed prompt (BOS + all but its last token) goes into the KV cache one token at a
    time or, with `prefill`, through the network's `prefill_cache` (one causal pass for
    `networks.decoder.Decoder`); the decode function's first step then feeds the prompt's
    last token. Both fill the same cache, so both give the same tokens."""
    prompt = jnp.asarray(prompt, jnp.int32)
    batch, length = prompt.shape
    cache = self._prompt_cache(params, prompt, length + max_new_tokens, prefill)
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

  def _prompt_cache(self, params, prompt: Array, total: int, prefill: bool):
    """The decoding cache for `total` positions holding BOS + prompt[:-1]."""
    batch, length = prompt.shape
    max_length = self.module.config.max_length  # every decoder-only config declares it
    if total > max_length:
      raise ValueError(f"A prompt of {length} tokens plus {total - length} new ones needs "
                       f"{total} positions but the model accepts {max_length}: shorten the "
                       "prompt or generate fewer tokens.")
    _, variables = self.module.apply({"params": params}, jnp.ones((batch, total), jnp.int32),
                                     decode=True, enable_dropout=False, mutable=["cache"])
    cache = variables["cache"]
    feed = jnp.pad(prompt, ((0, 0), (1, 0)))[:, :length]  # [b, P]: BOS + prompt[:-1]
    if prefill and length:  # its logits are unused, so XLA drops them
      _, variables = self.module.apply({"params": params, "cache": cache}, feed, decode=True,
                                       prefill=True, enable_dropout=False, mutable=["cache"])
      return variables["cache"]

    def prefeed(cache, token):  # token [b]
      _, new = self.module.apply({"params": params, "cache": cache}, token[:, None],
                                 decode=True, enable_dropout=False, mutable=["cache"])
      return new["cache"], None
    return jax.lax.scan(prefeed, cache, feed.T)[0]

  def generate_uncached(self, params, prompt: Array, max_new_tokens: int, *,
                        bucket: Optional[int] = None, forced: Optional[Array] = None) -> Array:
    """Greedy continuation that reruns the whole network over everything so far at every
    step (no cache): the reference cached `generate` must match, and the paper-style
    "GPT without a KV cache" baseline. `[batch, P]` -> `[batch, max_new_tokens]`.

    Step i needs BOS + the prompt + i new tokens, P + i + 1 positions. `bucket=None`: every
    step runs over the whole P + K buffer (the positions past P + i are computed, and
    causality hides them). `bucket=b`: the steps go in groups of b, and the group that ends
    at step e runs over P + e + 1 positions (ceil(K / b) compiled lengths; b = 1: every step
    exactly its own). `forced` `[batch, K]`: step i appends forced[:, i] instead of its
    argmax (teacher forcing); the argmaxes are returned, and EOS does not stop a row."""
    prompt = jnp.asarray(prompt, jnp.int32)
    batch, length = prompt.shape
    k = max_new_tokens
    if bucket is not None and bucket < 1:
      raise ValueError(f"bucket must be >= 1 (steps per compiled length), got {bucket}.")
    eos = self.output_vocabulary.eos_id
    tokens = jnp.zeros((batch, length + k), jnp.int32).at[:, :length].set(prompt)
    forced = None if forced is None else jnp.asarray(forced, jnp.int32)  # [b, K]

    def step(width, i, carry):  # width: this group's positions, static
      tokens, best, ended = carry
      inputs = jnp.pad(tokens[:, :width - 1], ((0, 0), (1, 0)))  # [b, width]: BOS + so far
      logits = self.module.apply({"params": params}, inputs, enable_dropout=False)
      argmax = jnp.argmax(logits[:, length + i], axis=-1).astype(jnp.int32)  # [b]
      if forced is None:  # greedy: 0 after EOS
        argmax = jnp.where(ended, 0, argmax)
        token, ended = argmax, ended | (argmax == eos)
      else:
        token = forced[:, i]
      return tokens.at[:, length + i].set(token), best.at[:, i].set(argmax), ended

    carry = (tokens, jnp.zeros((batch, k), jnp.int32), jnp.zeros((batch,), bool))
    group = max(k, 1) if bucket is None else bucket
    for start in range(0, k, group):  # each group one compiled buffer length
      stop = min(start + group, k)
      carry = jax.lax.fori_loop(start, stop, functools.partial(step, length + stop), carry)
    return carry[1]

  def predict_batch(self, params, batch: Batch, rng: Optional[Array] = None,
                    **kwargs) -> Array:
    """Unconditional samples as long as `decoder_input_tokens` (LM tasks have no inputs)."""
    return self.generate(params, jnp.zeros((batch["decoder_input_tokens"].shape[0], 0),
                                           jnp.int32),
                         batch["decoder_input_tokens"].shape[1], rng, **kwargs)
