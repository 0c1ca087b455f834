"""Span corruption: invertibility, sentinels, noise statistics, determinism, exact lengths.

References are independent of the code under test: a plain-python reassembly of inputs +
targets, the exact distribution of a uniformly random composition, and a brute-force
search for the chunk length.
"""
import math

import numpy as np
import pytest
import seqio
import tensorflow as tf

from decal_jax.data import span_corruption

VOCAB_SIZE = 1000
EXTRA_IDS = 100
SENTINEL_FLOOR = VOCAB_SIZE - EXTRA_IDS  # ids >= this are sentinels


class _IdVocabulary(seqio.PassThroughVocabulary):
  """Token ids are themselves; the top EXTRA_IDS ids are sentinels."""

  def __init__(self):
    super().__init__(VOCAB_SIZE, eos_id=1)
    self._extra_ids = EXTRA_IDS


FEATURES = {k: seqio.Feature(_IdVocabulary(), add_eos=True) for k in ("inputs", "targets")}


@tf.function(input_signature=[tf.TensorSpec([None], tf.int32), tf.TensorSpec([2, 2], tf.int32)])
def _corrupt_graph(tokens, seeds):
  return span_corruption.corrupt(tokens, seeds, VOCAB_SIZE, max_sentinels=EXTRA_IDS)


def _corrupt(tokens, seed):
  """numpy `[L]` tokens -> (inputs, targets) numpy arrays, noise seeded by `seed`."""
  out = _corrupt_graph(tf.constant(tokens, tf.int32), tf.constant([[seed, 11], [seed, 12]]))
  return out["inputs"].numpy(), out["targets"].numpy()


def _random_tokens(length, seed):
  """`[length]` ids in [3, SENTINEL_FLOOR), repeats allowed (like real text)."""
  return np.random.default_rng(seed).integers(3, SENTINEL_FLOOR, size=length, dtype=np.int32)


def _reassemble(inputs, targets):
  """Plain-python inverse: each sentinel in `inputs` is replaced by the tokens that follow
  the same sentinel in `targets` (up to the next sentinel)."""
  span_of, current = {}, None
  for tok in map(int, targets):
    if tok >= SENTINEL_FLOOR:
      current = tok
      span_of[current] = []
    else:
      span_of[current].append(tok)
  out = []
  for tok in map(int, inputs):
    out.extend(span_of.pop(tok) if tok >= SENTINEL_FLOOR else [tok])
  assert not span_of, "every target span is used exactly once"
  return out


def _runs(inputs, targets):
  """Noise span lengths, read off the targets (tokens between consecutive sentinels)."""
  lengths = []
  for tok in map(int, targets):
    if tok >= SENTINEL_FLOOR:
      lengths.append(0)
    else:
      lengths[-1] += 1
  return lengths


@pytest.mark.parametrize("length", [2, 3, 10, 57, 141, 568, 1137])
def test_inputs_and_targets_reassemble_the_original(length):
  for seed in range(4):
    tokens = _random_tokens(length, seed)
    inputs, targets = _corrupt(tokens, seed)
    assert _reassemble(inputs, targets) == tokens.tolist()
    assert targets[0] >= SENTINEL_FLOOR  # targets open with a sentinel
    assert all(length >= 1 for length in _runs(inputs, targets))  # no empty spans


def test_sentinels_are_the_top_ids_counting_down():
  inputs, targets = _corrupt(_random_tokens(600, 0), seed=5)
  in_sentinels = [int(t) for t in inputs if t >= SENTINEL_FLOOR]
  out_sentinels = [int(t) for t in targets if t >= SENTINEL_FLOOR]
  expected = list(range(VOCAB_SIZE - 1, VOCAB_SIZE - 1 - len(in_sentinels), -1))
  assert len(in_sentinels) == round(round(600 * 0.15) / 3)  # 90 noise tokens -> 30 spans
  assert in_sentinels == expected and out_sentinels == expected
  # No two sentinels are adjacent in the inputs: spans are separated by clean tokens.
  is_sentinel = inputs >= SENTINEL_FLOOR
  assert not np.any(is_sentinel[1:] & is_sentinel[:-1])


def test_noise_fraction_and_mean_span_length_over_many_examples():
  """Over 300 chunks of random lengths in [20, 600], the corrupted fraction is within
  0.005 of 0.15 and the mean span length within 0.1 of 3 (per-chunk rounding only)."""
  rng = np.random.default_rng(0)
  noise = spans = total = 0
  for seed in range(300):
    length = int(rng.integers(20, 601))
    inputs, targets = _corrupt(_random_tokens(length, seed), seed)
    span_lengths = _runs(inputs, targets)
    noise += sum(span_lengths)
    spans += len(span_lengths)
    total += length
  assert abs(noise / total - 0.15) < 0.005
  assert abs(noise / spans - 3.0) < 0.1


def test_span_lengths_follow_a_uniform_random_composition():
  """L = 100 -> 15 noise tokens in 5 spans. For a composition of N into S parts drawn
  uniformly, P(a given part = j) = C(N - j - 1, S - 2) / C(N - 1, S - 1)."""
  n, s = 15, 5
  observed = np.zeros(n - s + 2)
  for seed in range(400):
    inputs, targets = _corrupt(_random_tokens(100, seed), seed)
    lengths = _runs(inputs, targets)
    assert len(lengths) == s and sum(lengths) == n
    np.add.at(observed, lengths, 1)
  observed /= observed.sum()
  expected = np.array([0.0] + [math.comb(n - j - 1, s - 2) / math.comb(n - 1, s - 1)
                               for j in range(1, n - s + 2)])
  assert abs(expected.sum() - 1) < 1e-12
  assert 0.5 * np.abs(observed - expected).sum() < 0.04  # total variation, 2000 spans
  assert observed[1] > 0.2 and observed[4:].sum() > 0.2  # spans do vary in length (not all 3)


def test_corruption_is_deterministic_given_the_seed():
  tokens = _random_tokens(300, 0)
  a, b, c = _corrupt(tokens, 3), _corrupt(tokens, 3), _corrupt(tokens, 4)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  assert not np.array_equal(a[0], c[0])


def _brute_force_chunk(inputs_length):
  """Largest L whose corrupted input + EOS fits, by trying every L (numpy rounding)."""
  best = None
  for length in range(2, 2 * inputs_length + 2):
    noise = int(min(max(np.round(length * 0.15), 1), length - 1))
    spans = int(max(np.round(noise / 3.0), 1))
    if length - noise + spans + 1 <= inputs_length:
      best = (length, noise + spans + 1)
  return best


# 172 -> 190-token chunks, where 190 * 0.15 = 28.5 sits on a rounding tie: float32 and
# float64 arithmetic round it differently, so the TF graph must round like the helper.
@pytest.mark.parametrize("inputs_length", [8, 33, 64, 172, 512, 1024])
def test_chunk_length_fills_the_inputs_exactly(inputs_length):
  chunk, targets_length = span_corruption.chunk_and_target_lengths(inputs_length)
  assert (chunk, targets_length) == _brute_force_chunk(inputs_length)
  inputs, targets = _corrupt(_random_tokens(chunk, 1), seed=1)
  assert len(inputs) + 1 == inputs_length  # + EOS: exactly full
  assert len(targets) + 1 == targets_length
  inputs, _ = _corrupt(_random_tokens(chunk + 1, 1), seed=1)
  assert len(inputs) + 1 > inputs_length  # one more raw token would not fit
  if inputs_length == 512:  # T5's published setting
    assert (chunk, targets_length) == (568, 114)


def _run_chain(documents, lengths, seed):
  """concatenate_and_split -> span_corruption -> append_eos_after_trim on token docs."""
  ds = tf.data.Dataset.from_generator(
      lambda: ({"targets": d} for d in documents),
      output_signature={"targets": tf.TensorSpec([None], tf.int32)})
  with seqio.map_seed_manager(seed):
    ds = span_corruption.concatenate_and_split(ds, FEATURES, lengths)
    ds = span_corruption.span_corruption(ds, FEATURES)
    ds = seqio.preprocessors.append_eos_after_trim(ds, FEATURES, lengths)
  return list(ds.as_numpy_iterator())


def test_preprocessor_chain_fits_lengths_and_loses_no_token():
  lengths = {"inputs": 64, "targets": 16}
  documents = [_random_tokens(n, i) for i, n in enumerate([5, 300, 41, 1, 220, 90])]
  examples = _run_chain(documents, lengths, seed=7)
  _, targets_length = span_corruption.chunk_and_target_lengths(64)
  for ex in examples[:-1]:  # every chunk but the stream's last is full size
    assert len(ex["inputs"]) == 64 and len(ex["targets"]) == targets_length
  for ex in examples:
    assert ex["inputs"][-1] == 1 and ex["targets"][-1] == 1  # EOS
  stream = [t for ex in examples for t in _reassemble(ex["inputs"][:-1], ex["targets"][:-1])]
  assert stream == np.concatenate(documents).tolist()
  again = _run_chain(documents, lengths, seed=7)
  other = _run_chain(documents, lengths, seed=8)
  assert all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(examples, again))
  assert not all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(examples, other))


def test_too_many_spans_for_the_sentinels_is_a_clear_error():
  # 2048 inputs -> ~2270-token chunks -> ~114 spans > 100 sentinels.
  ds = tf.data.Dataset.from_tensors({"targets": tf.range(3, 50)})
  with pytest.raises(ValueError, match="extra_ids"):
    span_corruption.concatenate_and_split(ds, FEATURES, {"inputs": 2048, "targets": 512})
