"""Dodo's nugget operators (decal_jax/compress/nuggets.py) against numpy: top-k selection,
Compressive-Transformer segment means, and the threshold calibration of autoregressive mode."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax.compress import nuggets as nug

import numpy_llama


def test_topk_selection_matches_numpy_reference_with_ties_padding_and_last_token():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 50, (6, 23)).astype(np.int32)
  lengths = [23, 20, 9, 1, 4, 15]
  for row, length in enumerate(lengths):
    tokens[row, length:] = 0
  scores = rng.integers(0, 4, tokens.shape).astype(np.float32)  # many ties
  scores[tokens == 0] = 100.0  # padding must never win, however high its score
  for ratio in (1, 2.5, 4, 10):
    sel = nug.select_topk(jnp.asarray(scores), jnp.asarray(tokens), ratio)
    for row, length in enumerate(lengths):
      expect = numpy_llama.topk_nuggets(list(scores[row, :length]), ratio)
      got = np.asarray(sel.indices[row])[np.asarray(sel.valid[row])]
      assert got.tolist() == expect, (ratio, row)
      assert len(got) == math.ceil(length / ratio)


def test_segment_means_match_numpy():
  rng = np.random.default_rng(1)
  states = rng.normal(size=(2, 2, 10, 3)).astype(np.float32)
  tokens = np.ones((2, 10), np.int32)
  tokens[1, 7:] = 0
  means, positions, valid = nug.segment_means(jnp.asarray(states), jnp.asarray(tokens), 4)
  for row, length in enumerate([10, 7]):
    for j in range(3):
      segment = list(range(4 * j, min(length, 4 * j + 4)))
      assert bool(valid[row, j]) == bool(segment)
      if segment:
        np.testing.assert_allclose(means[:, row, j], states[:, row, segment].mean(1), rtol=1e-5)
        assert int(positions[row, j]) == segment[-1]


def test_calibrated_threshold_leaves_k_scores_above_it_halfway_to_the_next():
  # 10 real scores (one padded out), r = 4: k = round(10 / 4) = 2 scores above Λ, and Λ
  # halfway between the 2nd (0.9) and 3rd (0.5) largest: 0.7, at distance 0.2 from both.
  scores = np.array([0.1, 0.9, -0.3, 0.5, 2.0, 0.2, 0.0, 0.4, -1.0, 0.3, 5.0])
  valid = np.array([True] * 10 + [False])
  threshold = nug.calibrate_threshold(scores, valid, 4)
  assert threshold == pytest.approx(0.7)
  assert int((scores[valid] > threshold).sum()) == 2
  # r = 1: every real score above Λ; r above the count: still the single best one.
  assert (scores[valid] > nug.calibrate_threshold(scores, valid, 1)).all()
  assert nug.calibrate_threshold(scores, valid, 100) == pytest.approx((2.0 + 0.9) / 2)
  with pytest.raises(ValueError, match="ratio r must be >= 1"):
    nug.calibrate_threshold(np.ones(3), np.ones(3, bool), 0.9)
  with pytest.raises(ValueError, match="No valid token scores"):
    nug.calibrate_threshold(np.ones(3), np.zeros(3, bool), 2)
