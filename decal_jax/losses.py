"""Cross entropy with z-loss and label smoothing, normalised the way T5X does."""
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

Array = jax.Array


def cross_entropy_with_logits(logits: Array, targets_onehot: Array,
                              z_loss: float) -> Tuple[Array, Array]:
  """Per-position cross entropy plus the z-loss `z_loss * logsumexp(logits)^2`.

  logits, targets_onehot `[..., vocab]` -> (loss `[...]` including the z term, z term `[...]`).
  The z term keeps the softmax normaliser near 1 (log Z near 0), which stabilises
  training in low precision.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)  # [...]
  log_probs = logits - log_z[..., None]  # [..., vocab]
  cross_ent = -jnp.sum(targets_onehot * log_probs, axis=-1)
  z_term = z_loss * jnp.square(log_z)
  return cross_ent + z_term, z_term


def _smoothed_cross_entropy(logits: Array, targets: Array, confidence: float,
                            low_confidence: float, z_loss: float) -> Tuple[Array, Array]:
  """`cross_entropy_with_logits` against the smoothed one-hot of `targets`, without building
  it: with q = confidence on the label and low_confidence elsewhere (summing to 1),
  -sum_v q_v log p_v = log Z - (confidence - low) * logit[label] - low * sum_v logit_v.
  Only `[b, t]`-sized reductions of the logits are kept, so neither the forward nor the
  backward pass holds a `[batch, length, vocab]` target or log-prob tensor
  (tools/bench_loss.py measures the difference). Returns (loss incl. z term, z term)."""
  logits = logits.astype(jnp.float32)  # [b, t, vocab]
  log_z = jax.nn.logsumexp(logits, axis=-1)  # [b, t]
  label_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [b, t]
  cross_ent = log_z - (confidence - low_confidence) * label_logit
  if low_confidence:
    cross_ent = cross_ent - low_confidence * jnp.sum(logits, axis=-1)
  z_term = z_loss * jnp.square(log_z)
  return cross_ent + z_term, z_term


def compute_weighted_cross_entropy(
    logits: Array, targets: Array, weights: Optional[Array] = None,
    label_smoothing: float = 0.0, z_loss: float = 0.0,
    loss_normalizing_factor: Optional[float] = None) -> Tuple[Array, Array, Array]:
  """Summed (or normalised) token cross entropy.

  logits `[batch, length, vocab]`, targets/weights `[batch, length]` ->
  (total loss, total z-loss, weight sum), all scalars. With label smoothing the target
  distribution puts `1 - label_smoothing` on the label and spreads the rest uniformly over
  the other ids; the entropy of that distribution is subtracted so a perfect prediction
  scores 0. If `loss_normalizing_factor` is given, both totals are divided by it.
  """
  if logits.ndim != targets.ndim + 1:
    raise ValueError(f"logits {logits.shape} must have one more axis than targets "
                     f"{targets.shape}.")
  vocab = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = label_smoothing / (vocab - 1)
  # Entropy of the smoothed target distribution (0 when there is no smoothing).
  normalizing_constant = -(confidence * jnp.log(confidence) +
                           (vocab - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
  loss, z_term = _smoothed_cross_entropy(logits, targets, confidence, low_confidence, z_loss)
  loss = loss - normalizing_constant
  if weights is None:
    weights = jnp.ones(targets.shape, jnp.float32)
  weights = weights.astype(jnp.float32)
  total_loss = jnp.sum(loss * weights)
  total_z = jnp.sum(z_term * weights)
  if loss_normalizing_factor is not None:
    total_loss = total_loss / loss_normalizing_factor
    total_z = total_z / loss_normalizing_factor
  return total_loss, total_z, jnp.sum(weights)


def compute_weighted_accuracy(logits: Array, targets: Array,
                              weights: Optional[Array] = None) -> Tuple[Array, Array]:
  """(number of weighted positions whose argmax is the target, weight sum)."""
  if weights is None:
    weights = jnp.ones(targets.shape, jnp.float32)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  return jnp.sum(correct * weights), jnp.sum(weights)
