"""MaxSim (Chamfer) relevance between multi-vector texts, and the in-batch softmax loss.

MaxSim(q, p) = sum over the valid query vectors a of max over the valid passage vectors b
of <q_a, p_b>. A passage with no valid vector contributes 0 for every query vector (the
index and the loss use the same convention), so it never outranks a real match of
positive similarity.
"""
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

Array = jax.Array


def maxsim(queries: Array, query_valid: Array, passages: Array, passage_valid: Array,
           precision=None) -> Array:
  """All-pairs MaxSim: queries `[q, mq, d]`, passages `[p, mp, d]` -> scores `[q, p]`
  (`precision`: of the dot products, e.g. 'highest' for exact float32 on GPU / TPU)."""
  sims = jnp.einsum("qad,pbd->qpab", queries.astype(jnp.float32),
                    passages.astype(jnp.float32), precision=precision)  # [q, p, mq, mp]
  sims = jnp.where(passage_valid[None, :, None, :], sims, -jnp.inf)
  best = jnp.max(sims, axis=-1)  # [q, p, mq]
  best = jnp.where(jnp.isfinite(best), best, 0.0)  # passage without vectors: 0
  return jnp.sum(best * query_valid[:, None, :].astype(jnp.float32), axis=-1)  # [q, p]


def in_batch_softmax_loss(queries: Array, query_valid: Array, passages: Array,
                          passage_valid: Array, query_weights: Array,
                          candidate_mask: Array, temperature: float = 1.0
                          ) -> Tuple[Array, Dict[str, Array]]:
  """Cross entropy of each query's positive among all candidates of the batch.

  queries `[b, mq, d]`; passages `[c, mp, d]` with c >= b, whose first b rows are the
  positives in query order (then any negatives); query_weights `[b]` (0 = a padding row);
  candidate_mask `[c]` (False = a padding row, never a candidate).
  Returns (the mean loss over weighted queries, sums for logging: loss_sum, correct,
  num_queries)."""
  b = queries.shape[0]
  scores = maxsim(queries, query_valid, passages, passage_valid) / temperature  # [b, c]
  scores = jnp.where(candidate_mask[None, :], scores, -1e9)
  log_probs = jax.nn.log_softmax(scores, axis=-1)  # [b, c]
  labels = jnp.arange(b)
  nll = -log_probs[labels, labels]  # [b]
  w = query_weights.astype(jnp.float32)
  correct = (jnp.argmax(scores, axis=-1) == labels).astype(jnp.float32)  # [b]
  count = jnp.sum(w)
  sums = {"loss_sum": jnp.sum(nll * w), "correct": jnp.sum(correct * w), "num_queries": count}
  return sums["loss_sum"] / jnp.maximum(count, 1.0), sums


def summarize(sums: Dict[str, float]) -> Dict[str, float]:
  """Per-query averages of the summed loss aux: loss and in-batch top-1 accuracy."""
  n = max(float(sums.get("num_queries", 0.0)), 1.0)
  return {"loss": float(sums["loss_sum"]) / n, "accuracy": float(sums["correct"]) / n,
          "num_queries": float(sums.get("num_queries", 0.0))}


def has_tokens(tokens: Optional[Array]) -> Optional[Array]:
  """`[batch, n]` -> `[batch]`: whether a row holds any token (all-zero rows are padding)."""
  return None if tokens is None else jnp.any(tokens > 0, axis=-1)
