"""Dodo's nuggets (dodo.md §2): score every token, keep a subset of its hidden states.

* `Scorer`: a 2-layer FFN on the layer-ι hidden states -> one score per token.
* `select_topk` (compressor mode, §2.3): k_b = ceil(n_b / r) of each row's n_b real tokens,
  the highest scores first, the last real token always kept, padding never; ties go to the
  earlier token. The kept indices come back in text order.
* `calibrate_threshold` / `select_threshold` (autoregressive mode, §2.2): a token is a nugget
  when its score exceeds Λ, set on sample text so that 1/r of its scores exceed it.
* `select_prefix_rank`: the causal rule used before Λ exists — token i is kept when its
  score ranks within the top ceil((i + 1) / r) of its row's first i + 1 scores.
* `straight_through`: `s - stop_gradient(s)`, zero in the forward pass, added to every
  attention logit toward a nugget so the scorer learns from the LM loss alone (§2.4).
* `segment_means`: the Compressive Transformer baseline — the mean of each fixed segment
  of r tokens (at every layer), at the same ratio.
"""
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from decal_jax.layers.core import Array, DenseGeneral, DType


class Selection(NamedTuple):
  indices: Array  # [batch, k] int32 token indices, ascending among the valid ones
  valid: Array    # [batch, k] bool: slot j < k_b


def nugget_count(n: int, ratio: float) -> int:
  """k = ceil(n / r) (at least 1 for a non-empty text)."""
  check_ratio(ratio)
  return max(1, int(np.ceil(n / ratio))) if n > 0 else 0


def filled_slots(tokens: Array, ratio: float, k: int) -> Array:
  """`[batch, k]` bool: slot j of row b holds a nugget, j < ceil(n_b / r) for the n_b real
  tokens of right-padded `tokens` `[batch, n]` — under top-k selection (the kept slots
  first) and compressive segments (segment j has a real token) alike."""
  length = jnp.sum(tokens > 0, axis=1)  # [batch]
  k_b = jnp.ceil(length / ratio).astype(jnp.int32)  # [batch]
  return jnp.arange(k)[None, :] < k_b[:, None]


def check_ratio(ratio: float) -> None:
  if not ratio >= 1:
    raise ValueError(f"The compression ratio r must be >= 1 (r tokens per nugget), got "
                     f"{ratio}.")


class Scorer(nn.Module):
  """`[batch, n, embed]` -> `[batch, n]` scores: Dense(embed) -> ReLU -> Dense(1)."""
  hidden_dim: int
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    h = nn.relu(DenseGeneral(self.hidden_dim, kernel_axes=("embed", "mlp"), dtype=self.dtype,
                             name="hidden")(x))  # [batch, n, hidden]
    s = DenseGeneral(1, kernel_axes=("mlp", "embed_out"), dtype=jnp.float32,
                     name="score")(h)  # [batch, n, 1]
    return s[..., 0].astype(jnp.float32)


def select_topk(scores: Array, tokens: Array, ratio: float) -> Selection:
  """Compressor-mode selection for right-padded `tokens` `[batch, n]` (0 = padding)."""
  batch, n = tokens.shape
  k = nugget_count(n, ratio)
  real = tokens > 0  # [batch, n]
  length = jnp.sum(real, axis=1)  # [batch]
  is_last = jnp.arange(n)[None, :] == (length - 1)[:, None]  # [batch, n]
  ranked = jnp.where(real, scores, -jnp.inf)
  ranked = jnp.where(is_last, jnp.inf, ranked)  # the last real token is always a nugget
  _, top = jax.lax.top_k(jax.lax.stop_gradient(ranked), k)  # [batch, k]; ties: lower index
  valid = filled_slots(tokens, ratio, k)  # [batch, k]
  # Text order for the kept slots; dropped slots sort after them.
  order_key = jnp.where(valid, top, n + jnp.arange(k)[None, :])
  order = jnp.argsort(order_key, axis=1)
  indices = jnp.take_along_axis(top, order, axis=1).astype(jnp.int32)
  return Selection(indices, jnp.take_along_axis(valid, order, axis=1))


def calibrate_threshold(scores: np.ndarray, valid: np.ndarray, ratio: float) -> float:
  """Λ such that k = round(count / r) of the valid scores exceed it (at least one).

  Λ lies halfway between the k-th and the (k+1)-th largest score, as far as it can be from
  every sample score. A quantile can land on a sample score itself, and a token scored
  there would be a nugget or not by float rounding alone: the cached and the parallel pass
  sum in other orders and would disagree about it.
  """
  check_ratio(ratio)
  values = np.asarray(scores, np.float64)[np.asarray(valid, bool)]
  if values.size == 0:
    raise ValueError("No valid token scores to calibrate the threshold on: pass sample text "
                     "with real (non-padding) tokens.")
  descending = np.sort(values)[::-1]
  k = int(np.clip(round(values.size / ratio), 1, values.size))
  if k == values.size:  # every token a nugget (r close to 1)
    return float(descending[-1] - 1.0)
  return float((descending[k - 1] + descending[k]) / 2)


def select_threshold(scores: Array, valid: Array, threshold: float) -> Array:
  """Autoregressive-mode selection: `[batch, n]` bool, score > Λ on real tokens only."""
  return jnp.logical_and(valid, scores > threshold)


def select_prefix_rank(scores: Array, valid: Array, ratio: float) -> Array:
  """Causal selection without a threshold: `[batch, n]` bool, token i kept when its score
  is among the ceil((i + 1) / r) highest of its own row's s_0 .. s_i (ties: the earlier
  token ranks higher), real tokens only. About 1 / r of a row's tokens pass, and whether i
  passes never depends on later tokens or on other rows."""
  check_ratio(ratio)
  n = scores.shape[1]
  i = jnp.arange(n)
  earlier = i[None, :] < i[:, None]  # [n (i), n (j)]: j < i
  prefix = i[None, :] <= i[:, None]  # j <= i
  s_i, s_j = scores[:, :, None], scores[:, None, :]  # [b, n, 1], [b, 1, n]
  above = (s_j > s_i) | ((s_j == s_i) & earlier[None])  # [b, n, n]: j ranks above i
  rank = jnp.sum(above & prefix[None], axis=-1)  # [b, n]
  quota = jnp.ceil((i + 1) / ratio).astype(rank.dtype)  # [n]
  return jnp.logical_and(valid, rank < quota[None, :])


def straight_through(scores: Array) -> Array:
  """Zero in value, identity in gradient: `s - stop_gradient(s)`."""
  return scores - jax.lax.stop_gradient(scores)


def gather(states: Array, indices: Array) -> Array:
  """states `[layers, batch, n, embed]`, indices `[batch, k]` -> `[layers, batch, k, embed]`."""
  return jnp.take_along_axis(states, indices[None, :, :, None], axis=2)


def segment_means(states: Array, tokens: Array, ratio: int):
  """Compressive Transformer: mean of each r-token segment's real states, at every layer.

  states `[layers, batch, n, embed]` -> (`[layers, batch, k, embed]`, positions `[batch, k]`
  = the segment's last real token, valid `[batch, k]`), k = ceil(n / r).
  """
  if int(ratio) != ratio:
    raise ValueError(f"Compressive pooling needs an integer ratio, got {ratio}.")
  ratio = int(ratio)
  layers, batch, n, embed = states.shape
  k = nugget_count(n, ratio)
  pad = k * ratio - n
  real = jnp.pad(tokens > 0, ((0, 0), (0, pad))).reshape(batch, k, ratio)  # [b, k, r]
  padded = jnp.pad(states, ((0, 0), (0, 0), (0, pad), (0, 0)))
  windows = padded.reshape(layers, batch, k, ratio, embed)
  weights = real.astype(states.dtype)[None, ..., None]  # [1, b, k, r, 1]
  count = jnp.maximum(jnp.sum(real, axis=-1), 1)  # [b, k]
  means = jnp.sum(windows * weights, axis=3) / count[None, :, :, None].astype(states.dtype)
  index = jnp.arange(k * ratio).reshape(k, ratio)[None]  # [1, k, r]
  last = jnp.max(jnp.where(real, index, -1), axis=-1)  # [b, k]
  valid = last >= 0
  return means, jnp.maximum(last, 0).astype(jnp.int32), valid
