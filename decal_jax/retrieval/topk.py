"""The top-k selections the residual index's search shares between its stages and its two
backends (residual_search.py's numpy stages, kernels.py's compiled loops): one module both
import, so that a cut keeps the same documents whichever backend runs."""
import numpy as np


def best(docs: np.ndarray, scores: np.ndarray, n: int, ordered: bool = False) -> np.ndarray:
  """Positions of the n best (score, then lower doc index) of docs `[c]` with scores `[c]`:
  in position order, or best first when `ordered`. Ties go to the lower document index, so
  a cut depends on the scores and the documents alone, not on their order."""
  if len(docs) > n:  # the n-th best score: all above it, and the lowest docs tied at it
    threshold = np.partition(scores, len(docs) - n)[len(docs) - n]
    above = np.flatnonzero(scores > threshold)
    tied = np.flatnonzero(scores == threshold)
    tied = tied[np.argsort(docs[tied], kind="stable")[:n - len(above)]]
    kept = np.concatenate([above, tied])
  else:
    kept = np.arange(len(docs))
  return kept[np.lexsort((docs[kept], -scores[kept]))] if ordered else np.sort(kept)


def top_columns(x: np.ndarray, k: int, block: int = 64) -> np.ndarray:
  """The columns of the k largest values of each row of x `[n, K]` -> `[n, k]`, unordered
  (the set numpy's argpartition gives, ties aside). With K well above k x block: of the
  whole blocks of `block` columns, only the k with the largest maxima can hold one of them
  (a value outside those is exceeded by the k maxima), so one max per block and a partition
  of those k blocks' columns, plus the K mod block columns after the last whole block,
  replace a partition of all K."""
  n, width = x.shape
  blocks = width // block
  if blocks < 4 * k:
    return np.argpartition(-x, min(k, width) - 1, axis=-1)[:, :k]
  maxima = x[:, :blocks * block].reshape(n, blocks, block).max(axis=-1)  # [n, blocks]
  chosen = np.argpartition(-maxima, k - 1, axis=-1)[:, :k]  # [n, k]
  columns = (chosen[..., None] * block + np.arange(block)).reshape(n, -1)  # [n, k * block]
  tail = np.broadcast_to(np.arange(blocks * block, width), (n, width - blocks * block))
  columns = np.concatenate([columns, tail], axis=-1)  # [n, k * block + K mod block]
  values = np.take_along_axis(x, columns, axis=-1)
  return np.take_along_axis(columns, np.argpartition(-values, k - 1, axis=-1)[:, :k], -1)
