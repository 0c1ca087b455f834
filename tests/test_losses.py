"""decal_jax.losses against a float64 numpy derivation: value and gradient of the smoothed
cross entropy with z-loss, the normalising factor, and weighted accuracy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax import losses

import numpy_losses
import tolerances


def _inputs(batch=2, length=5, vocab=37, seed=1):
  rng = np.random.RandomState(seed)
  logits = jnp.asarray(3 * rng.randn(batch, length, vocab), jnp.float32)  # [b, t, vocab]
  targets = jnp.asarray(rng.randint(0, vocab, (batch, length)), jnp.int32)  # [b, t]
  weights = jnp.asarray(rng.rand(batch, length) > 0.1, jnp.float32)  # [b, t]
  return logits, targets, weights


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_value_and_gradient_match_numpy(smoothing):
  logits, targets, weights = _inputs()
  loss = lambda x: losses.compute_weighted_cross_entropy(x, targets, weights, smoothing,
                                                         1e-3)[0]
  value, grad = jax.jit(jax.value_and_grad(loss))(logits)
  want_value, want_grad = numpy_losses.cross_entropy_value_and_grad(
      logits, targets, weights, smoothing, 1e-3)
  np.testing.assert_allclose(float(value), want_value, rtol=1e-5)
  # float32 against float64: the gradient is p * (...) with p = exp(x - log Z), so its error
  # is that of log Z, a float32 sum of 37 shifted exponentials (each at most 1).
  np.testing.assert_allclose(np.asarray(grad), want_grad, atol=tolerances.reorder_atol(37, 1.0))


def test_normalising_factor_divides_both_totals_and_weights_default_to_one():
  logits, targets, _ = _inputs(seed=2)
  total, z_total, weight_sum = losses.compute_weighted_cross_entropy(
      logits, targets, None, 0.0, 1e-2)
  want, _ = numpy_losses.cross_entropy_value_and_grad(logits, targets, np.ones(targets.shape),
                                                      0.0, 1e-2)
  log_z = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
  assert float(weight_sum) == targets.size
  np.testing.assert_allclose(float(total), want, rtol=1e-5)
  np.testing.assert_allclose(float(z_total), 1e-2 * (log_z ** 2).sum(), rtol=1e-5)
  scaled = losses.compute_weighted_cross_entropy(logits, targets, None, 0.0, 1e-2, 4.0)
  np.testing.assert_allclose(float(scaled[0]), float(total) / 4, rtol=1e-6)
  np.testing.assert_allclose(float(scaled[1]), float(z_total) / 4, rtol=1e-6)


def test_weighted_accuracy_counts_argmax_hits_on_weighted_positions():
  logits = jnp.asarray([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])  # [1, 3, 3]
  targets = jnp.asarray([[1, 1, 2]])  # hit, miss, hit
  correct, total = losses.compute_weighted_accuracy(logits, targets, jnp.asarray([[1, 1, 0]]))
  assert (float(correct), float(total)) == (1.0, 2.0)  # the third hit has weight 0


def test_logits_and_targets_of_mismatched_rank_are_refused():
  with pytest.raises(ValueError, match="one more axis than targets"):
    losses.compute_weighted_cross_entropy(jnp.zeros((2, 3)), jnp.zeros((2, 3), jnp.int32))
