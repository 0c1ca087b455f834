"""Compiled loops of the residual index's approximate search (residual_search.py's stages
2-4, its 'compiled' backend), with numba (in the `[ann]` extra). They run the plan the numpy
stages run, with the same widths and the same cuts (topk.best); the numpy stages are the
reference they are tested against. The kernels read arrays only (`Arrays`, built by
`ResidualIndex.kernel_arrays`), never an index object.

Why compiled: each stage walks a different, data-dependent set of documents per query (tens
of thousands of candidates at 1M passages), and numpy pays for that set in gathers of whole
intermediate arrays ([rows, query vectors] of centroid scores, [rows, d] of decoded
vectors). A loop over one document's vectors at a time keeps those in registers and cache.
On the 1M synthetic corpus (C = 4, one core) the plain centroid interaction over all
~60,000 candidates of a query takes about 10 ms and the refined one over the best 8,192
about 9 ms, where numpy's refined interaction over 68,000 took 540 ms.

Per query (`search_query`, the queries of a batch spread over one thread per core):
`candidates_of` (the probed cells' documents, deduplicated through a bitmap), then `maxsim`
in its three modes. It takes the query's centroid scores transposed, `scores_t [K, mq]`,
and a decoder for the refined and exact modes: `decode_packed` (b-bit residual codes through
the codec's byte table, plus the rotated centroid, scaled to unit norm when the codec
normalises), `decode_raw` or `decode_half` (b = None: the stored float32 or float16 vector).
Sums run in float32 in another order than numpy's: scores agree with the numpy stages to
float32 rounding (about 1e-6), not bitwise.
"""
import concurrent.futures
import math
import os
import queue
from typing import List, NamedTuple, Optional, Tuple

import numpy as np

from decal_jax.retrieval import topk

try:
  import numba
except ImportError:  # backend='compiled' is refused (residual_search.check_backend)
  numba = None

AVAILABLE = numba is not None
PLAIN, REFINED, EXACT = 0, 1, 2  # `maxsim` modes
_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _jit(inline: str = "never"):
  """numba's njit (cached on disk, fastmath for vectorised sums, the GIL released so that
  queries run in parallel threads; inline 'always': into its callers), or None without
  numba."""
  if numba is None:
    return lambda function: None
  return numba.njit(cache=True, fastmath=True, nogil=True, inline=inline)


@_jit()
def decode_packed(payload, row, code, table, centroids, normalize, out):
  """Row `row` of the packed residual codes `[n, d * b / 8]` into out `[d]` (rotated
  coordinates): centroids[code] + the byte table's values (`codec.byte_table`,
  `[d * b / 8, 256, 8 / b]`); returns the factor that scales it to unit norm (1 if not
  normalize)."""
  per_byte = table.shape[2]
  for j in range(table.shape[0]):
    byte = payload[row, j]
    for t in range(per_byte):
      out[j * per_byte + t] = centroids[code, j * per_byte + t] + table[j, byte, t]
  if not normalize:
    return np.float32(1)
  squares = np.float32(0)
  for k in range(out.shape[0]):
    squares += out[k] * out[k]
  return np.float32(1) / max(np.float32(np.sqrt(squares)), np.float32(1e-12))


@_jit()
def decode_raw(payload, row, code, table, centroids, normalize, out):
  """Row `row` of uncompressed float32 vectors `[n, d]` (b = None) into out `[d]`; factor 1."""
  for k in range(out.shape[0]):
    out[k] = payload[row, k]
  return np.float32(1)


@_jit()
def decode_half(payload, row, code, table, centroids, normalize, out):
  """`decode_raw` for float16 vectors, given as their bits (`payload.view(np.uint16)`:
  numba has no float16); each value converted exactly."""
  for k in range(out.shape[0]):
    bits = payload[row, k]
    exponent, fraction = (bits >> 10) & 31, bits & 1023
    if exponent == 31:
      value = np.inf if fraction == 0 else np.nan
    elif exponent == 0:  # subnormal: fraction x 2^-24
      value = math.ldexp(fraction, -24)
    else:
      value = math.ldexp(1024 + fraction, exponent - 25)
    out[k] = -value if bits >> 15 else value
  return np.float32(1)


@_jit()
def maxsim(docs, offsets, codes, scores_t, in_probe, queries, mode, decode, payload, table,
           centroids, normalize):
  """MaxSim of one query over docs `[n]` (any order) -> float32 `[n]`; a document's vectors
  are rows offsets[doc]:offsets[doc + 1] (>= 1 of them). Per query vector m, a row scores:
    PLAIN: q_m.c of its centroid (scores_t[code, m]);
    REFINED: its exact similarity q_m.x when in_probe[code, m] (a cell m probed), else q_m.c;
    EXACT: q_m.x.
  queries `[mq, d]` rotated as the decoder's vectors (`codec.rotate`); scores_t and in_probe
  `[K, w]`, w = mq rounded up to a multiple of 8 (`padded`), zero / False past mq: the max
  over a document's rows runs 8 query vectors at a time, in registers."""
  n = docs.shape[0]
  mq, d = queries.shape
  if scores_t.shape[1] % 8 or in_probe.shape != scores_t.shape or scores_t.shape[1] < mq:
    raise ValueError("maxsim takes scores_t and in_probe padded to 8 columns (`padded`).")
  most = 0  # the most vectors of one document
  for i in range(n):
    most = max(most, offsets[docs[i] + 1] - offsets[docs[i]])
  exact = np.zeros((most, scores_t.shape[1]), np.float32)  # a document's exact similarities
  vector = np.empty(d, np.float32)
  probed = np.zeros(len(in_probe), np.bool_)  # [K] cells some query vector probed (REFINED)
  for cell in range(len(in_probe) if mode == REFINED else 0):
    for m in range(mq):
      probed[cell] = probed[cell] or in_probe[cell, m]
  out = np.empty(n, np.float32)
  for i in range(n):
    start, stop = offsets[docs[i]], offsets[docs[i] + 1]
    for row in range(start, stop if mode != PLAIN else start):  # the decoded vectors' dots
      code = codes[row]
      if mode == EXACT or probed[code]:
        scale = decode(payload, row, code, table, centroids, normalize, vector)
        for m in range(mq):
          if mode == EXACT or in_probe[code, m]:
            dot = np.float32(0)
            for k in range(d):
              dot += vector[k] * queries[m, k]
            exact[row - start, m] = dot * scale
    out[i] = _best_sum(mode, codes, scores_t, in_probe, probed, exact, start, stop)
  return out


@_jit(inline="always")
def _best_sum(mode, codes, scores_t, in_probe, probed, exact, start, stop):
  """Rows start:stop's MaxSim, summed over the query vectors: 8 at a time, each's running
  max in a register (1.4-2 x faster than one at a time at 1M passages); a row's score for m
  is exact[row - start, m] (EXACT; REFINED where m probed its cell), else scores_t[code, m].
  Zero columns past mq add 0."""
  total = np.float32(0)
  for m in range(0, scores_t.shape[1], 8):
    top0 = top1 = top2 = top3 = top4 = top5 = top6 = top7 = np.float32(-np.inf)
    for row in range(start, stop):
      code, at = codes[row], row - start
      a0, a1, a2, a3 = scores_t[code, m], scores_t[code, m + 1], scores_t[code, m + 2], \
          scores_t[code, m + 3]
      a4, a5, a6, a7 = scores_t[code, m + 4], scores_t[code, m + 5], scores_t[code, m + 6], \
          scores_t[code, m + 7]
      if mode == EXACT or (mode == REFINED and probed[code]):
        every, probe = mode == EXACT, in_probe[code]
        a0 = exact[at, m] if every or probe[m] else a0
        a1 = exact[at, m + 1] if every or probe[m + 1] else a1
        a2 = exact[at, m + 2] if every or probe[m + 2] else a2
        a3 = exact[at, m + 3] if every or probe[m + 3] else a3
        a4 = exact[at, m + 4] if every or probe[m + 4] else a4
        a5 = exact[at, m + 5] if every or probe[m + 5] else a5
        a6 = exact[at, m + 6] if every or probe[m + 6] else a6
        a7 = exact[at, m + 7] if every or probe[m + 7] else a7
      top0, top1, top2, top3 = max(top0, a0), max(top1, a1), max(top2, a2), max(top3, a3)
      top4, top5, top6, top7 = max(top4, a4), max(top5, a5), max(top6, a6), max(top7, a7)
    total += ((top0 + top1) + (top2 + top3)) + ((top4 + top5) + (top6 + top7))
  return total


def padded(array: np.ndarray) -> np.ndarray:
  """`[K, mq]` -> `[K, w]`: w = mq rounded up to a multiple of 8, zero (False) past mq."""
  out = np.zeros((array.shape[0], -(-array.shape[1] // 8) * 8), array.dtype)
  out[:, :array.shape[1]] = array
  return out


@_jit()
def candidates_of(cells, ivf_offsets, ivf, seen):
  """The documents in the inverted lists of `cells`, each once (unordered): seen is a
  `[ceil(num_docs / 64)]` uint64 bitmap, all zero (left so), 1 bit per document (128 KB at
  1M documents: it stays in cache where a per-document array would not)."""
  entries = 0
  for cell in cells:
    entries += ivf_offsets[cell + 1] - ivf_offsets[cell]
  docs = np.empty(entries, np.int64)
  count = 0
  for cell in cells:
    for entry in range(ivf_offsets[cell], ivf_offsets[cell + 1]):
      word, bit = ivf[entry] >> 6, np.uint64(1) << np.uint64(ivf[entry] & 63)
      if not seen[word] & bit:
        seen[word] |= bit
        docs[count] = ivf[entry]
        count += 1
  for i in range(count):
    seen[docs[i] >> 6] = 0
  return docs[:count]


class Arrays(NamedTuple):
  """What the compiled search reads of a residual index, as arrays (and the decoder)."""
  offsets: np.ndarray  # [num_docs + 1] int64: document i's vectors are its rows
  codes: np.ndarray  # [num_vectors]: each vector's centroid
  ivf: np.ndarray  # doc indices, grouped by centroid
  ivf_offsets: np.ndarray  # [num_centroids + 1] int64
  coding: tuple  # `decoding(...)`: maxsim's decoder arguments


def decoding(payload: np.ndarray, table: Optional[np.ndarray], centroids: np.ndarray,
             normalize: bool) -> tuple:
  """`maxsim`'s decoder arguments (decode, payload, table, centroids, normalize), the decoder
  chosen by the payload: packed b-bit codes `[n, d * b / 8]` uint8 with the codec's byte
  table (`codec.byte_table`), or (table None, b = None) float32 or float16 vectors `[n, d]`;
  centroids: the codec's, rotated (`codec.rotated_centroids`)."""
  decode = decode_packed
  if table is None:
    decode = decode_half if payload.dtype == np.float16 else decode_raw
    payload = payload.view(np.uint16) if payload.dtype == np.float16 else payload
    table = np.zeros((1, 1, 1), np.float32)
  return decode, payload, table, centroids, bool(normalize)


def search_query(arrays: Arrays, q: np.ndarray, scores: np.ndarray, cells: np.ndarray,
                 k: int, candidates: int, keep: int, seen: np.ndarray
                 ) -> Tuple[np.ndarray, np.ndarray]:
  """Stages 2-4 (residual_search.py) for one query's valid vectors q `[mq, d]` (rotated,
  `codec.rotate`), their centroid scores `[mq, K]` and probed cells `[mq, p]`: the plain
  interaction over every candidate keeps `keep`, the refined one `candidates`, the exact
  rerank k; seen: `candidates_of`'s bitmap -> (scores, doc indices) of at most k docs,
  best first."""
  scores_t = padded(scores.T)  # [K, w]
  docs = np.sort(candidates_of(np.unique(cells), arrays.ivf_offsets, arrays.ivf, seen))  # [c]
  in_probe = np.zeros(scores_t.shape, bool)  # [K, w]
  in_probe[cells.T, np.arange(len(q))] = True
  arguments = (arrays.offsets, arrays.codes, scores_t, in_probe, q)
  for mode, width in ((PLAIN, keep), (REFINED, candidates)):
    if len(docs) > width:
      docs = docs[topk.best(docs, maxsim(docs, *arguments, mode, *arrays.coding), width)]
  exact = maxsim(docs, *arguments, EXACT, *arrays.coding)  # [c]
  best = topk.best(docs, exact, k, ordered=True)
  return exact[best], docs[best].astype(np.int32)


def search_queries(arrays: Arrays, q: np.ndarray, valid: np.ndarray, scores: np.ndarray,
                   cells: np.ndarray, k: int, candidates: int, keep: int
                   ) -> List[Tuple[np.ndarray, np.ndarray]]:
  """`search_query` for a batch: rotated queries `[b, mq, d]`, valid `[b, mq]`, centroid
  scores `[b, mq, K]`, probed cells `[b, mq, p]`; the queries spread over one thread per
  CPU core (the kernels release the GIL) -> per query (scores, doc indices)."""
  bitmaps = queue.SimpleQueue()  # one candidates_of bitmap per thread
  for _ in range(_THREADS):
    bitmaps.put(np.zeros(-(-(len(arrays.offsets) - 1) // 64), np.uint64))

  def one(i: int):
    seen = bitmaps.get()
    try:
      ok = valid[i]
      return search_query(arrays, q[i][ok], scores[i][ok], cells[i][ok], k, candidates,
                          keep, seen)
    finally:
      bitmaps.put(seen)
  with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
    return list(pool.map(one, range(len(q))))
