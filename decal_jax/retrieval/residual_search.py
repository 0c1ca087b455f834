"""Approximate search in a residual index (residual.py): one stage plan, run by either of
two backends that keep the same documents at every stage.

The stages, for a batch of queries at once:
  1. probe: each valid query vector probes the `nprobe` cells (centroids) L2-nearest to its
     direction, i.e. the cells a document vector equal to the unit query vector would be
     stored in (largest q.c / |q| - |c|^2 / 2), and every query vector also probes the
     query's `query_cells` cells of largest summed similarity (sum over its valid vectors of
     max(q.c, 0)): a pooled DeCAL vector (C >= 2) stands for several tokens, so the cell of
     a passage's best match can be far from each query vector alone yet close to several
     at once (on the 1M synthetic corpus at C = 4, 32 such cells raised the share of
     queries whose relevant passage lies in a probed cell from 0.96 to 1.00 at nprobe 8);
     the centroid scores q.c of the batch are one matmul;
  2. candidates and plain centroid interaction (PLAID's): the candidates are the documents
     in the inverted lists of the cells probed by any of the query's vectors; each scores
     MaxSim with every one of its vectors standing for its centroid (q.c); the best
     `refined_keep(candidates)` are kept (REFINED_KEEP = 8,192, at least 4 x candidates);
  3. the same, refined: a vector in a cell the query vector probed scores exactly against
     its decompressed value (only those vectors are decompressed); the best `candidates`
     (default `default_candidates`) are kept;
  4. rerank: exact MaxSim over their decompressed vectors, top k.
Ties go to the lower document index at every cut (topk.best). With nprobe = every centroid,
candidates >= the corpus and b = None it ranks as the exact index does (documents with no
vector are in no inverted list, so they are never returned).

Why this plan: an earlier numpy plan first cut the candidates by a cell interaction from
the inverted lists alone (16 x candidates) and kept 4 x candidates after stage 2; on the
1M synthetic corpus (C = 4) the cell cut lost the relevant passage of 1 % of the queries
(ranked past 40,000, where the plain interaction ranked all within 8,122): Recall@100 0.965
of exact against 0.995 with this plan (docs/results/retrieval_scale_1m_cpu.md).

Backends (`BACKENDS`), an explicit choice recorded with the results, never a silent switch:
  * 'numpy' (DEFAULT_BACKEND): vectorised numpy, per query for the candidates and the exact
    part of stage 3 and 4, over the batch otherwise; the readable reference, and needs no
    optional dependency, so every machine writes the same numbers by default;
  * 'compiled': stages 2-4 as kernels.py's loops (numba, the `[ann]` extra), the queries
    spread over one thread per core; the same stages and widths, faster at scale (1M
    passages: 27.5 x the exact scan's speed at 200 candidates on 2 cores).
Their scores agree to float32 rounding (sums in another order), not bitwise.
"""
from typing import List, Optional, Sequence, Tuple

import numpy as np

from decal_jax.retrieval import index as exact
from decal_jax.retrieval import kernels, topk

DEFAULT_NPROBE = 16
DEFAULT_QUERY_CELLS = 32
REFINED_KEEP = 8192  # documents the refined interaction scores (at least 4 x candidates):
# on the 1M synthetic corpus the plain interaction ranked every relevant passage within
# 8,122, and the refined one over 8,192 took about 9 ms per query compiled
BACKENDS = ("numpy", "compiled")
DEFAULT_BACKEND = "numpy"
# Batch limits (queries searched together are fewer when a batch would pass either):
CENTROID_SCORE_ENTRIES = 1 << 25  # queries x query vectors x centroids of one batch's
# centroid scores and probe: 128 MiB of float32; larger batches ran slower at 1M passages
INTERACTION_ENTRIES = 1 << 23  # numpy: candidate vectors x query vectors the plain
# interaction gathers for one batch (32 MiB of float32), bounded by the corpus's vectors
# (every document may be a candidate): past it the gathers leave the cache, and at 1M
# passages the batch is one query

Result = Tuple[np.ndarray, np.ndarray]  # (scores float32 [n], doc indices int32 [n])


# ------------------------------------------------------------------------------- plan
def default_candidates(top_k: int, num_docs: int) -> int:
  """Documents decompressed and reranked exactly per query when the caller gives none:
  4 x top_k at least (PLAID's ratio for k = 100), up to 4,096 as the corpus grows. Quality
  first: on SciFact with the benchmark's stand-in encoder, whose vectors do not cluster,
  4 x top_k lost 0.01-0.24 NDCG@10 against exact (uncompressed codes, C = 1-8) where 4,096
  (most of the corpus) lost 0-0.024; on clustered vectors 2 x top_k kept exact's recall at
  8.5 x its speed (docs/results/retrieval_scale_cpu.md, retrieval_scale_synthetic_cpu.md)."""
  return max(4 * top_k, min(num_docs, 4096))


def refined_keep(candidates: int) -> int:
  """Documents the plain interaction (stage 2) keeps for the refined one (stage 3):
  REFINED_KEEP, never below 4 x candidates (PLAID's ratio)."""
  return max(4 * candidates, REFINED_KEEP)


def check_count(name: str, value, least: int, also: str = "") -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
    raise ValueError(f"{name} = {value!r}: must be a whole number >= {least}{also}.")


def check_settings(top_k, nprobe, query_cells, candidates, names: Optional[dict] = None
                   ) -> None:
  """Refuses a search setting out of range before any work (top_k, nprobe >= 1,
  query_cells >= 0, candidates >= 1 or None), each named as `names` gives it (the gin
  macros of a run) or by its argument name."""
  names = names or {}
  check_count(names.get("top_k", "top_k"), top_k, 1)
  check_count(names.get("nprobe", "nprobe"), nprobe, 1)
  check_count(names.get("query_cells", "query_cells"), query_cells, 0)
  if candidates is not None:
    check_count(names.get("candidates", "candidates"), candidates, 1,
           " or None (max(4 x top_k, min(documents, 4096)))")


def check_backend(backend: str) -> None:
  """Refuses an unknown backend, and 'compiled' without numba (naming the extra)."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
  if backend == "compiled" and not kernels.AVAILABLE:
    raise ImportError("backend='compiled' needs numba: pip install 'decal_jax[ann]', or "
                      "pass backend='numpy' (the same stages in numpy).")


def batch_size(index, mq: int, query_batch_size: int, backend: str) -> int:
  """Queries searched together: query_batch_size, fewer where a batch would pass
  CENTROID_SCORE_ENTRIES or (numpy) INTERACTION_ENTRIES."""
  gathered = mq * index.num_vectors if backend == "numpy" else 0  # per query, at most
  return max(1, min(query_batch_size, CENTROID_SCORE_ENTRIES // max(mq * index.num_centroids, 1),
                    INTERACTION_ENTRIES // max(gathered, 1)))


# ------------------------------------------------------------------------------- search
def search(index, query_vectors: np.ndarray, query_valid: np.ndarray, top_k: int,
           nprobe: int, candidates: Optional[int], query_batch_size: int, query_cells: int,
           backend: str) -> Result:
  """`ResidualIndex.search` (its doc): the batches of queries, each through the stages."""
  query_vectors, query_valid = exact.check_queries(query_vectors, query_valid, index.dim)
  check_backend(backend)
  try:
    check_settings(top_k, nprobe, query_cells, candidates)
  except ValueError as e:
    raise ValueError(f"{str(e)[:-1]} (ResidualIndex.search: top_k, nprobe and candidates >= 1, "
                     "query_cells >= 0).") from None
  if candidates is None:
    candidates = default_candidates(top_k, index.num_docs)
  if min(top_k, nprobe, candidates, query_batch_size) < 1 or query_cells < 0:
    raise ValueError(f"top_k, nprobe, candidates and query_batch_size must be >= 1 and "
                     f"query_cells >= 0, got {top_k}, {nprobe}, {candidates}, "
                     f"{query_batch_size}, {query_cells}.")
  k = min(top_k, index.num_docs)
  scores = np.full((len(query_vectors), k), -np.inf, np.float32)
  ids = np.full((len(query_vectors), k), -1, np.int32)
  step = batch_size(index, query_vectors.shape[1], query_batch_size, backend)
  probes = min(nprobe, index.num_centroids), min(query_cells, index.num_centroids)
  for start in range(0, len(query_vectors), step):
    batch = np.asarray(query_vectors[start:start + step], np.float32)  # [b, mq, d]
    valid = query_valid[start:start + step]  # [b, mq]
    found = search_batch(index, batch, valid, k, *probes, candidates, backend)
    for i, (found_scores, found_ids) in enumerate(found):
      scores[start + i, :len(found_ids)] = found_scores
      ids[start + i, :len(found_ids)] = found_ids
  return scores, ids


def search_batch(index, q: np.ndarray, valid: np.ndarray, k: int, nprobe: int,
                 query_cells: int, candidates: int, backend: str) -> List[Result]:
  """The stages for a batch of queries `[b, mq, d]`, valid `[b, mq]` -> per query (scores,
  doc indices) of at most k docs, best first. Stage 1 is numpy's for both backends."""
  flat = q.reshape(-1, q.shape[2]) @ index.codec.centroids.T  # [b * mq, K], one matmul
  centroid_scores = np.where(valid[..., None], flat.reshape(*q.shape[:2], -1), 0)  # [b, mq, K]
  probed = probe(index, q, centroid_scores, nprobe, query_cells)  # [b, mq, nprobe + cells]
  rotated = index.codec.rotate(q)  # [b, mq, d]: scored against rotated decoded vectors
  if backend == "compiled":
    return kernels.search_queries(index.kernel_arrays, rotated, valid, centroid_scores,
                                  probed, k, candidates, refined_keep(candidates))
  return numpy_stages(index, rotated, valid, centroid_scores, probed, k, candidates)


def numpy_stages(index, q: np.ndarray, valid: np.ndarray, centroid_scores: np.ndarray,
                 probed: np.ndarray, k: int, candidates: int) -> List[Result]:
  """Stages 2-4 in numpy: rotated queries q `[b, mq, d]`, valid `[b, mq]`, centroid_scores
  `[b, mq, K]` (0 for invalid query vectors), probed `[b, mq, cells]` -> per query (scores,
  doc indices) of at most k docs, best first."""
  groups = [candidates_of(index, cells[ok]) for cells, ok in zip(probed, valid)]  # sorted
  keep = refined_keep(candidates)
  if max(map(len, groups)) > keep:
    plain, _ = centroid_interaction(index, q, centroid_scores, probed, groups, refine=False)
    groups = [docs[topk.best(docs, s, keep)] for docs, s in zip(groups, plain)]
  full, decoded = centroid_interaction(index, q, centroid_scores, probed, groups)
  groups = [docs[topk.best(docs, s, candidates)] for docs, s in zip(groups, full)]  # sorted
  out = []
  for query, ok, docs, (rows, sims) in zip(q, valid, groups, decoded):
    s = rerank(index, query[ok], docs, (rows, sims[:, ok]), rotated=True)  # [docs]
    best = topk.best(docs, s, k, ordered=True)
    out.append((s[best].astype(np.float32), docs[best].astype(np.int32)))
  return out


# ------------------------------------------------------------------------------- stages
def probe(index, q: np.ndarray, centroid_scores: np.ndarray, nprobe: int,
          query_cells: int) -> np.ndarray:
  """The cells each query vector probes (stage 1): its nprobe centroids L2-nearest to its
  direction, then the query's query_cells centroids of largest sum over its vectors of
  max(q.c, 0), the same for each of its vectors. `[..., mq, d]`, `[..., mq, K]` (0 for
  invalid query vectors) -> `[..., mq, nprobe + query_cells]`, a cell possibly twice."""
  nearest = nearest_cells(index, q, centroid_scores, nprobe)  # [..., mq, nprobe]
  if query_cells == 0:
    return nearest
  summed = np.maximum(centroid_scores, 0).sum(axis=-2)  # [..., K]
  cells = np.argpartition(-summed, query_cells - 1, axis=-1)[..., :query_cells]  # [..., m]
  cells = np.broadcast_to(cells[..., None, :], (*nearest.shape[:-1], query_cells))
  return np.concatenate([nearest, cells], axis=-1)


def nearest_cells(index, q: np.ndarray, centroid_scores: np.ndarray, nprobe: int
                  ) -> np.ndarray:
  """Each query vector's nprobe centroids L2-nearest to its direction (the cells a document
  vector equal to the unit query vector would be stored in; the largest q.c / |q| -
  |c|^2 / 2), from stage 1's centroid scores (`topk.top_columns`; 5 x faster than faiss's
  search of the same products): `[..., mq, d]`, `[..., mq, K]` -> `[..., mq, nprobe]`."""
  norms = np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), 1e-12)  # [..., mq, 1]
  closeness = centroid_scores / norms - 0.5 * index.squared_norms  # [..., mq, K]
  flat = closeness.reshape(-1, closeness.shape[-1])  # [n, K]
  return topk.top_columns(flat, nprobe).reshape(*closeness.shape[:-1], nprobe)


def candidates_of(index, probed: np.ndarray) -> np.ndarray:
  """One query's candidates: the documents in the inverted lists of the cells its valid
  vectors probed, `[p, cells]` -> sorted, distinct int64 `[c]`."""
  cells = np.unique(probed)  # [u]
  entries = ranges(index.ivf_offsets[cells], index.ivf_offsets[cells + 1])  # [h]
  return np.unique(np.asarray(index.ivf[entries], np.int64))


def centroid_interaction(index, q: np.ndarray, centroid_scores: np.ndarray,
                         probed: np.ndarray, groups: Sequence[np.ndarray],
                         refine: bool = True
                         ) -> Tuple[List[np.ndarray], List[Tuple[np.ndarray, np.ndarray]]]:
  """Centroid interaction (PLAID's): MaxSim with every vector of a document standing for
  its centroid (score q.c); `refine`: except that a vector in a cell the query vector
  probed scores exactly against its decompressed value (only those are decompressed).
  q `[b, mq, d]` in the codec's rotated coordinates (`codec.rotate`), centroid_scores
  `[b, mq, K]` (0 for invalid query vectors), probed `[b, mq, cells]` (of valid vectors
  only, or ignored there), per query its sorted docs -> (per query `[docs]`, per query the
  rows it decompressed (ascending) and their exact similarities to every query vector
  `[h, mq]`, for the rerank to reuse; none without `refine`)."""
  b, mq, k = centroid_scores.shape
  sizes = [len(g) for g in groups]
  docs = np.concatenate(groups)  # [g]
  counts = index.offsets[docs + 1] - index.offsets[docs]  # [g], each >= 1
  rows = ranges(index.offsets[docs], index.offsets[docs + 1])  # [r]
  row_query = np.repeat(np.repeat(np.arange(b), sizes), counts)  # [r], ascending
  codes = np.asarray(index.codes[rows], np.int64)  # [r]
  sims = centroid_scores[row_query, :, codes]  # [r, mq]
  if not refine:
    return np.split(segment_max(sims, counts).sum(axis=1), np.cumsum(sizes)[:-1]), []
  in_probe = np.zeros((b, mq, k), bool)
  np.put_along_axis(in_probe, probed, True, axis=2)
  in_probe &= np.any(centroid_scores != 0, axis=2, keepdims=True)  # not invalid vectors
  mask = in_probe[row_query, :, codes]  # [r, mq]
  hit = np.flatnonzero(mask.any(axis=1))  # rows in a cell some query vector probed
  vectors = index.scoring_vectors(rows[hit])  # [h, d], grouped by query
  bounds = np.searchsorted(row_query[hit], np.arange(b + 1))  # [b + 1]
  exact_sims = np.concatenate([np.einsum("hd,md->hm", vectors[start:stop], q[j]) for j, (
      start, stop) in enumerate(zip(bounds[:-1], bounds[1:]))])  # [h, mq]
  sims[hit] = np.where(mask[hit], exact_sims, sims[hit])
  scores = segment_max(sims, counts).sum(axis=1)  # [g]
  decoded = [(rows[hit[start:stop]], exact_sims[start:stop])
             for start, stop in zip(bounds[:-1], bounds[1:])]
  return np.split(scores, np.cumsum(sizes)[:-1]), decoded


def rerank(index, q: np.ndarray, docs: np.ndarray,
           decoded: Optional[Tuple[np.ndarray, np.ndarray]] = None,
           rotated: bool = False) -> np.ndarray:
  """Exact MaxSim of one query's valid vectors `[mq, d]` over the decompressed vectors of
  sorted docs `[c]` -> `[c]`. decoded: rows already scored (ascending `[h]`) and their
  similarities `[h, mq]`, reused instead of decompressing them again. rotated: q is
  already in the codec's rotated coordinates (`codec.rotate`)."""
  if len(docs) == 0:
    return np.zeros(0, np.float32)
  counts = index.offsets[docs + 1] - index.offsets[docs]  # [c]
  rows = ranges(index.offsets[docs], index.offsets[docs + 1])  # [r]
  q = q if rotated else index.codec.rotate(q)  # [mq, d]
  sims = np.empty((len(rows), len(q)), np.float32)  # [r, mq]
  missing = np.ones(len(rows), bool)
  if decoded is not None and len(decoded[0]):
    known_rows, known_sims = decoded
    at = np.minimum(np.searchsorted(known_rows, rows), len(known_rows) - 1)  # [r]
    missing = known_rows[at] != rows
    sims[~missing] = known_sims[at[~missing]]
  sims[missing] = np.einsum("rd,md->rm", index.scoring_vectors(rows[missing]), q)
  return segment_max(sims, counts).sum(axis=1)  # [c]


# ------------------------------------------------------------------------------- helpers
def ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
  """The concatenation of arange(start, stop) for each pair (vectorised)."""
  lengths = stops - starts
  total = int(lengths.sum())
  before = np.cumsum(lengths) - lengths  # [pairs] where each range starts in the output
  return np.repeat(starts - before, lengths) + np.arange(total)


def segment_max(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
  """The max over consecutive row segments of the given (>= 1) lengths: `[r, m]` -> `[s, m]`."""
  if len(counts) == 0:
    return np.zeros((0, values.shape[1]), values.dtype)
  return np.maximum.reduceat(values, np.cumsum(counts) - counts, axis=0)
