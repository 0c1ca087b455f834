"""Autoregressive decoding over a KV cache: temperature / top-k sampling, beam search, and
`forced_decode` (the given tokens fed through the same cached steps).

The function signatures follow T5X's `t5x.decoding` so a `decode_fn` can be swapped:
`tokens_to_logits(DecodingState) -> (logits [batch * num_decodes, vocab], new_cache)`.
Sequences are decoded into `[batch, length]` buffers that start as `inputs` (all zeros for
an encoder-decoder); the token fed at step i is the previous output (0 = BOS at step 0).
Cache leaves named `cache_index` are step counters shared by the whole batch and are
neither expanded nor gathered.
"""
from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

Array = jax.Array
NEG_INF = -1.0e7


class DecodingState(NamedTuple):
  cur_index: Array   # scalar int32: the step being decoded
  sequences: Array   # [batch * num_decodes, length] tokens decoded so far
  cur_token: Array   # [batch * num_decodes, 1] the token fed at this step
  cache: Any         # the model's cache pytree


TokensToLogits = Callable[[DecodingState], Tuple[Array, Any]]


def _is_index(path) -> bool:
  last = path[-1]
  return getattr(last, "key", getattr(last, "name", None)) == "cache_index"


def cache_map(fn: Callable[[Array], Array], cache: Any) -> Any:
  """Applies `fn` to every cache leaf except the `cache_index` counters."""
  return jax.tree_util.tree_map_with_path(lambda p, x: x if _is_index(p) else fn(x), cache)


def flat_batch_beam_expand(x: Any, beam_size: int) -> Any:
  """`[batch, ...]` -> `[batch * beam_size, ...]`, each example repeated beam_size times.
  `x` may be a pytree whose leaves all lead with the batch axis (Dodo's nuggets)."""
  return jax.tree_util.tree_map(lambda leaf: jnp.repeat(leaf, beam_size, axis=0), x)


def _shift_in(sequences: Array) -> Array:
  """The token fed at every position: `[b, L]` -> `[b, L + 1]` with a leading BOS (0)."""
  return jnp.pad(sequences, ((0, 0), (1, 0)))


# --------------------------------------------------------------------------- sampling
def temperature_sample(inputs: Array, cache: Any, tokens_to_logits: TokensToLogits,
                       eos_id: int, decode_rng: Optional[Array] = None, num_decodes: int = 1,
                       temperature: float = 1.0, topk: int = 1,
                       max_decode_steps: Optional[int] = None) -> Tuple[Array, Array]:
  """Samples `num_decodes` continuations per example (greedy when topk == 1 or T == 0).

  Returns (sequences `[batch, num_decodes, length]`, log_probs `[batch, num_decodes]`),
  sorted by log probability ascending (the best is last, as in T5X). Positions after EOS
  are 0.
  """
  batch, length = inputs.shape
  steps = length if max_decode_steps is None else min(length, max_decode_steps)
  greedy = topk == 1 or temperature == 0.0
  rng = jax.random.PRNGKey(0) if decode_rng is None else decode_rng
  seqs = flat_batch_beam_expand(inputs, num_decodes)  # [b * n, L]
  cache = cache_map(lambda x: flat_batch_beam_expand(x, num_decodes), cache)
  flat = batch * num_decodes

  def cond(state):
    i, _, _, ended, _, _ = state
    return (i < steps) & ~jnp.all(ended)

  def body(state):
    i, seqs, cache, ended, log_prob, rng = state
    cur = jax.lax.dynamic_slice(_shift_in(seqs), (0, i), (flat, 1))  # [b * n, 1]
    logits, cache = tokens_to_logits(DecodingState(i, seqs, cur, cache))
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [b * n, vocab]
    rng, step_rng = jax.random.split(rng)
    if greedy:
      token = jnp.argmax(log_probs, axis=-1)
    else:
      scaled = log_probs / temperature
      if topk > 0:
        kth = jax.lax.top_k(scaled, topk)[0][:, -1:]  # [b * n, 1]
        scaled = jnp.where(scaled < kth, NEG_INF, scaled)
      token = jax.random.categorical(step_rng, scaled, axis=-1)
    token = jnp.where(ended, 0, token).astype(seqs.dtype)  # [b * n]
    token_lp = jnp.take_along_axis(log_probs, token[:, None].astype(jnp.int32), axis=-1)[:, 0]
    log_prob = log_prob + jnp.where(ended, 0.0, token_lp)
    seqs = jax.lax.dynamic_update_slice(seqs, token[:, None], (0, i))
    ended = ended | (token == eos_id)
    return i + 1, seqs, cache, ended, log_prob, rng

  init = (jnp.array(0, jnp.int32), seqs, cache, jnp.zeros((flat,), bool),
          jnp.zeros((flat,), jnp.float32), rng)
  _, seqs, _, _, log_prob, _ = jax.lax.while_loop(cond, body, init)
  seqs = seqs.reshape(batch, num_decodes, length)
  log_prob = log_prob.reshape(batch, num_decodes)
  order = jnp.argsort(log_prob, axis=-1)  # ascending: best last
  return (jnp.take_along_axis(seqs, order[:, :, None], axis=1),
          jnp.take_along_axis(log_prob, order, axis=1))


# ------------------------------------------------------------------------ beam search
def brevity_penalty(alpha: float, length: Array) -> Array:
  """T5X / GNMT length normalisation ((5 + length) / 6) ** alpha."""
  return jnp.power((5.0 + length.astype(jnp.float32)) / 6.0, alpha)


class _Beams(NamedTuple):
  index: Array            # scalar step
  alive_seqs: Array       # [b, k, L]
  alive_log_probs: Array  # [b, k]
  finished_seqs: Array    # [b, k, L]
  finished_scores: Array  # [b, k] length-normalised; NEG_INF = empty slot
  finished_flags: Array   # [b, k]
  cache: Any              # leaves [b * k, ...]


def _gather_beams(x: Array, beam_idx: Array, batch: int, beams: int) -> Array:
  """Picks beams `beam_idx [b, k']` out of `x [b * k, ...]` (flat) -> `[b * k', ...]`."""
  rows = (jnp.arange(batch)[:, None] * beams + beam_idx).reshape(-1)  # [b * k']
  return x[rows]


def beam_search(inputs: Array, cache: Any, tokens_to_logits: TokensToLogits, eos_id: int,
                num_decodes: int = 4, alpha: float = 0.6,
                max_decode_len: Optional[int] = None) -> Tuple[Array, Array]:
  """Length-normalised beam search.

  Returns (sequences `[batch, num_decodes, length]`, scores `[batch, num_decodes]`) sorted
  ascending, so `[:, -1]` is the best, as in T5X. Scores are log probability divided by
  `brevity_penalty(alpha, length)`. Rows with no finished hypothesis return their alive
  beams (scored the same way at full length).
  """
  batch, length = inputs.shape
  steps = length if max_decode_len is None else min(length, max_decode_len)
  k = num_decodes
  seqs = jnp.broadcast_to(inputs[:, None, :], (batch, k, length))
  cache = cache_map(lambda x: flat_batch_beam_expand(x, k), cache)
  # Only beam 0 is live at the start, so the first step does not pick k copies of a token.
  alive_lp = jnp.tile(jnp.array([[0.0] + [NEG_INF] * (k - 1)]), (batch, 1))
  state = _Beams(jnp.array(0, jnp.int32), seqs, alive_lp, jnp.zeros_like(seqs),
                 jnp.full((batch, k), NEG_INF), jnp.zeros((batch, k), bool), cache)

  def cond(s: _Beams):
    # Stop when no alive beam, even at the best possible length penalty, can beat the
    # worst finished beam (log probs only fall as sequences grow).
    best_alive = s.alive_log_probs[:, 0] / brevity_penalty(alpha, jnp.array(steps))
    worst_finished = jnp.where(s.finished_flags, s.finished_scores, NEG_INF).min(axis=1)
    done = jnp.all(s.finished_flags, axis=1) & (worst_finished > best_alive)
    return (s.index < steps) & ~jnp.all(done)

  def body(s: _Beams):
    i = s.index
    flat_seqs = s.alive_seqs.reshape(batch * k, length)
    cur = jax.lax.dynamic_slice(_shift_in(flat_seqs), (0, i), (batch * k, 1))
    logits, new_cache = tokens_to_logits(DecodingState(i, flat_seqs, cur, s.cache))
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [b * k, V]
    candidates = (s.alive_log_probs[:, :, None] +
                  log_probs.reshape(batch, k, vocab)).reshape(batch, k * vocab)
    top_lp, top_idx = jax.lax.top_k(candidates, 2 * k)  # [b, 2k]
    beam_idx, token = top_idx // vocab, top_idx % vocab
    top_seqs = jnp.take_along_axis(s.alive_seqs, beam_idx[:, :, None], axis=1)  # [b, 2k, L]
    top_seqs = jax.lax.dynamic_update_slice(
        top_seqs, token[:, :, None].astype(top_seqs.dtype), (0, 0, i))
    is_eos = (token == eos_id) & (top_lp > NEG_INF / 2)  # ignore the padding beams' EOS

    # Alive: the best k candidates that did not just end.
    alive_score = jnp.where(is_eos, NEG_INF, top_lp)
    alive_lp, alive_pick = jax.lax.top_k(alive_score, k)  # [b, k]
    alive_seqs = jnp.take_along_axis(top_seqs, alive_pick[:, :, None], axis=1)
    alive_beams = jnp.take_along_axis(beam_idx, alive_pick, axis=1)
    cache = cache_map(lambda x: _gather_beams(x, alive_beams, batch, k), new_cache)

    # Finished: merge the candidates that just emitted EOS with the old finished set.
    new_scores = jnp.where(is_eos, top_lp / brevity_penalty(alpha, i + 1), NEG_INF)
    all_seqs = jnp.concatenate([s.finished_seqs, top_seqs], axis=1)  # [b, 3k, L]
    all_scores = jnp.concatenate([s.finished_scores, new_scores], axis=1)
    all_flags = jnp.concatenate([s.finished_flags, is_eos], axis=1)
    fin_scores, fin_pick = jax.lax.top_k(jnp.where(all_flags, all_scores, 2 * NEG_INF), k)
    fin_seqs = jnp.take_along_axis(all_seqs, fin_pick[:, :, None], axis=1)
    fin_flags = jnp.take_along_axis(all_flags, fin_pick, axis=1)
    return _Beams(i + 1, alive_seqs, alive_lp, fin_seqs, jnp.where(fin_flags, fin_scores, NEG_INF),
                  fin_flags, cache)

  s = jax.lax.while_loop(cond, body, state)
  # Rows where nothing finished fall back to their alive beams.
  none_finished = ~jnp.any(s.finished_flags, axis=1)  # [b]
  alive_scores = s.alive_log_probs / brevity_penalty(alpha, jnp.array(steps))
  seqs = jnp.where(none_finished[:, None, None], s.alive_seqs, s.finished_seqs)
  scores = jnp.where(none_finished[:, None], alive_scores, s.finished_scores)
  order = jnp.argsort(scores, axis=-1)  # ascending: best last
  return (jnp.take_along_axis(seqs, order[:, :, None], axis=1),
          jnp.take_along_axis(scores, order, axis=1))


def forced_decode(inputs, cache, tokens_to_logits, eos_id, forced=None, **unused):
  """A `decode_fn` (`temperature_sample`'s signature) that feeds the given tokens instead
  of sampling (teacher forcing through the cached steps, e.g. to time generation on real text):
  step i feeds forced[:, i - 1] (step 0: the prompt's last token, which `generate`
  substitutes) and records the argmax of its logits. -> (predictions `[b, 1, k]`, zeros)."""
  del eos_id, unused
  batch, length = inputs.shape
  feed = jnp.pad(forced, ((0, 0), (1, 0)))  # [b, k + 1]: a start slot, then the text

  def step(i, carry):
    predicted, cache = carry
    token = jax.lax.dynamic_slice(feed, (0, i), (batch, 1))  # [b, 1]
    logits, cache = tokens_to_logits(DecodingState(i, predicted, token, cache))
    best = jnp.argmax(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
    predicted = jax.lax.dynamic_update_slice(predicted, best[:, None].astype(jnp.int32), (0, i))
    return predicted, cache

  predicted, _ = jax.lax.fori_loop(0, length, step, (inputs, cache))
  return predicted[:, None, :], jnp.zeros((batch, 1), jnp.float32)
