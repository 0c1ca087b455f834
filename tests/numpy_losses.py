"""Cross entropy with label smoothing and z-loss written out in float64 numpy: the
reference for `decal_jax.losses` and for tools/bench_loss.py's one-hot form."""
import numpy as np


def cross_entropy_value_and_grad(logits, targets, weights, smoothing, z):
  """Summed weighted loss and d loss / d logits by hand: per token, the smoothed target
  distribution q gives -(q . log softmax(x)) - H(q) + z log(Z)^2, whose gradient is
  (softmax - q) + 2 z log(Z) softmax."""
  x = np.asarray(logits, np.float64)
  vocab = x.shape[-1]
  q = np.full(x.shape, smoothing / (vocab - 1))
  np.put_along_axis(q, np.asarray(targets)[..., None], 1.0 - smoothing, axis=-1)
  log_z = np.log(np.exp(x).sum(-1, keepdims=True))
  p = np.exp(x - log_z)
  entropy = -(q * np.log(q, where=q > 0, out=np.zeros_like(q))).sum(-1)
  w = np.asarray(weights, np.float64)
  value = (((-(q * (x - log_z)).sum(-1) - entropy) + z * log_z[..., 0] ** 2) * w).sum()
  grad = ((p - q) + 2 * z * log_z * p) * w[..., None]
  return value, grad
