"""Decoding against plain numpy: a greedy loop and brute-force beam search enumeration."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax import decoding

VOCAB, LENGTH, EOS = 5, 4, 1


def _table(seed=0):
  # logits[position, previous token, next token]: a position-dependent Markov chain.
  return np.random.RandomState(seed).randn(LENGTH, VOCAB, VOCAB).astype(np.float32) * 2.0


def _tokens_to_logits(table):
  table = jnp.asarray(table)

  def fn(state):
    logits = table[state.cur_index, state.cur_token[:, 0]]  # [batch, vocab]
    # The cache counts steps per row, so gathering/expanding it is exercised too.
    return logits, {"steps": state.cache["steps"] + 1, "cache_index": state.cache["cache_index"]}

  return fn


def _cache(batch):
  return {"steps": jnp.zeros((batch,), jnp.int32), "cache_index": jnp.array(0, jnp.int32)}


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _numpy_greedy(table):
  prev, out, lp = 0, [], 0.0
  for i in range(LENGTH):
    logp = _log_softmax(table[i, prev].astype(np.float64))
    tok = int(np.argmax(logp))
    out.append(tok)
    lp += logp[tok]
    prev = tok
    if tok == EOS:
      break
  return out + [0] * (LENGTH - len(out)), lp


def test_greedy_matches_numpy_loop():
  for seed in range(4):
    table = _table(seed)
    seqs, lps = decoding.temperature_sample(jnp.zeros((2, LENGTH), jnp.int32), _cache(2),
                                            _tokens_to_logits(table), EOS, topk=1)
    want, want_lp = _numpy_greedy(table)
    for b in range(2):
      assert list(np.asarray(seqs[b, -1])) == want
      np.testing.assert_allclose(float(lps[b, -1]), want_lp, rtol=1e-5)


def test_sampling_log_probs_match_numpy_and_rows_stop_at_eos():
  table = _table(7)
  seqs, lps = decoding.temperature_sample(jnp.zeros((3, LENGTH), jnp.int32), _cache(3),
                                          _tokens_to_logits(table), EOS,
                                          decode_rng=jax.random.PRNGKey(3), num_decodes=4,
                                          temperature=1.0, topk=0)
  seqs, lps = np.asarray(seqs), np.asarray(lps)
  assert np.all(np.diff(lps, axis=1) >= 0)  # sorted ascending, best last
  for b, d in itertools.product(range(3), range(4)):
    prev, lp = 0, 0.0
    for i, tok in enumerate(seqs[b, d]):
      if prev == EOS:
        assert tok == 0  # nothing after EOS
        continue
      lp += _log_softmax(table[i, prev].astype(np.float64))[tok]
      prev = tok
    np.testing.assert_allclose(lps[b, d], lp, rtol=1e-4)


def _brute_force_best(table, alpha):
  best, best_score = None, -np.inf
  for n in range(1, LENGTH + 1):
    for seq in itertools.product(range(VOCAB), repeat=n):
      if seq[-1] != EOS or EOS in seq[:-1]:
        continue  # beam search returns finished hypotheses whenever one exists
      prev, lp = 0, 0.0
      for i, tok in enumerate(seq):
        lp += _log_softmax(table[i, prev].astype(np.float64))[tok]
        prev = tok
      score = lp / ((5.0 + n) / 6.0) ** alpha
      if score > best_score:
        best, best_score = list(seq) + [0] * (LENGTH - n), score
  return best, best_score


def test_wide_beam_search_finds_the_brute_force_optimum():
  for seed in range(3):
    table = _table(10 + seed)
    # Beam width >= every possible prefix, so beam search is exhaustive.
    seqs, scores = decoding.beam_search(jnp.zeros((1, LENGTH), jnp.int32), _cache(1),
                                        _tokens_to_logits(table), EOS,
                                        num_decodes=VOCAB ** LENGTH, alpha=0.6)
    best, best_score = _brute_force_best(table, 0.6)
    finished_best = list(np.asarray(seqs[0, -1]))
    assert finished_best == best, (finished_best, best)
    np.testing.assert_allclose(float(scores[0, -1]), best_score, rtol=1e-4)


def test_cache_is_expanded_per_beam_and_index_left_alone():
  seen = {}

  def fn(state):
    seen["shape"] = state.cache["steps"].shape
    seen["index_shape"] = state.cache["cache_index"].shape
    return jnp.zeros((state.cur_token.shape[0], VOCAB)), state.cache

  decoding.beam_search(jnp.zeros((2, LENGTH), jnp.int32), _cache(2), fn, EOS, num_decodes=3)
  assert seen == {"shape": (6,), "index_shape": ()}


def test_forced_decode_feeds_the_given_tokens_and_records_each_argmax():
  table = _table(5)
  forced = np.array([[2, 3, 4], [4, 4, 0]], np.int32)  # [batch, LENGTH - 1]
  seqs, scores = decoding.forced_decode(jnp.zeros((2, LENGTH), jnp.int32), _cache(2),
                                        _tokens_to_logits(table), EOS, forced=jnp.asarray(forced))
  for b in range(2):
    fed = [0] + list(forced[b])  # step 0 reads the start slot, step i forced[:, i - 1]
    want = [int(np.argmax(table[i, fed[i]])) for i in range(LENGTH)]  # no stop at EOS
    assert list(np.asarray(seqs[b, 0])) == want
  assert seqs.shape == (2, 1, LENGTH) and not np.asarray(scores).any()
