"""A residual-compressed multi-vector index and approximate search on it; the codec (k-means
centroids, b-bit residual buckets) is codec.py's.

Layout of a residual index directory (built whole in `<directory>.tmp-<random>`, then renamed):

    centroids.npy  [num_centroids, d] float32
    cutoffs.npy    [d, 2^b - 1] float32   and  weights.npy [d, 2^b] float32 (b given)
    codes.npy      [num_vectors] uint16 (uint32 past 65,536 centroids): each vector's centroid
    residuals.npy  [num_vectors, d * b / 8] uint8 packed buckets; with b = None the vectors
                   [num_vectors, d] themselves (memory-mapped, as is codes.npy)
    offsets.npy    [num_docs + 1] int64, doc_ids.json: as in the exact index
    ivf.npy        the inverted lists: doc indices grouped by centroid (each doc once per
                   centroid it has a vector in); ivf_offsets.npy [num_centroids + 1] int64
    meta.json      the exact index's encoder config, fingerprint and corpus fingerprint (so
                   the same config and corpus checks apply), the codec settings, sizes

Approximate search (PLAID's stages, `ResidualIndex.search`), for a batch of queries at once:
  1. probe: each valid query vector probes the `nprobe` cells (centroids) L2-nearest to its
     direction, i.e. the cells a document vector equal to the unit query vector would be
     stored in (largest q.c / |q| - |c|^2 / 2), and every query vector also probes the
     query's `query_cells` cells of largest summed similarity (sum over its valid vectors of
     max(q.c, 0)): a pooled DeCAL vector (C >= 2) stands for several tokens, so the cell of
     a passage's best match can be far from each query vector alone yet close to several
     at once (on the 1M synthetic corpus at C = 4, 32 such cells raised the share of
     queries whose relevant passage lies in a probed cell from 0.96 to 1.00 at nprobe 8);
     the centroid scores q.c of the batch are one matmul;
  2. candidates and cell interaction, from the inverted lists alone (built at index time):
     the candidates are the documents in the cells probed by any of the query's vectors;
     each query vector scores a candidate by the best q.c among those cells that hold one of
     its vectors (floored at 0), and a candidate's score is the sum over the query vectors
     (PLAID's centroid interaction restricted to the probed cells); the best
     `cell_keep(candidates)` are kept (16 x, at most 16,384 but at least 4 x);
  3. centroid interaction: MaxSim with each of those documents' vectors standing for its
     centroid (q.c); the best 4 x `candidates` are kept;
  4. the same, refined: a vector in a cell the query vector probed scores exactly against
     its decompressed value (only those vectors are decompressed); the best `candidates`
     (default `default_candidates`) are kept;
  5. rerank: exact MaxSim over their decompressed vectors, top k.
Ties go to the lower document index at every cut. With nprobe = every centroid,
candidates >= the corpus and b = None it ranks as the exact index does (documents with no
vector are in no inverted list, so they are never returned).
Stages 2-5 run as compiled loops (kernels.py, numba: the `[ann]` extra) when numba is
installed, keeping more (`stage_widths`: stage 2 skipped, every candidate to stage 3, which
keeps 8,192); else as vectorised numpy (per query for stages 2 and 5 and the exact part of
4, over the batch otherwise), the reference the compiled loops are tested against. On the 1M
synthetic corpus (C = 4, 2 cores), 200 candidates kept Recall@100 0.995 of exact at 27.5 x
its speed compiled, 0.965 in numpy (docs/results/retrieval_scale_1m_cpu.md).
"""
import datetime
import functools
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tqdm

from decal_jax import fileio
from decal_jax.retrieval import codec as codec_lib
from decal_jax.retrieval import index as exact
from decal_jax.retrieval import kernels
from decal_jax.retrieval.codec import Codec, check_bits, train_codec

FORMAT_VERSION = 1
DEFAULT_NPROBE = 16
DEFAULT_QUERY_CELLS = 32
COMPILED_CENTROID_KEEP = 8192
_FILES = ("centroids.npy", "codes.npy", "residuals.npy", "offsets.npy", "doc_ids.json",
          "ivf.npy", "ivf_offsets.npy", "meta.json")


# ------------------------------------------------------------------------------- defaults
def cell_keep(candidates: int) -> int:
  """Documents the numpy stage 2 (cell interaction) keeps for the plain centroid interaction:
  16 x candidates (1M synthetic corpus: Recall@100 0.95 at nprobe 16 x 200 where 4 x kept
  0.91), at most 16,384 (more was 2.3 x slower there, for no recall), at least 4 x."""
  return max(4 * candidates, min(16 * candidates, 16384))


def stage_widths(candidates: int, num_docs: int, compiled: bool) -> Tuple[int, int]:
  """Documents the cell interaction (stage 2) and the plain centroid interaction (stage 3)
  keep. numpy: `cell_keep`, 4 x candidates. Compiled: every one (stage 2 is skipped: at
  16,384 it lost the relevant passage of 1 % of the 1M synthetic queries, ranked past
  40,000, where the plain one ranked all within 8,122), then COMPILED_CENTROID_KEEP."""
  if not compiled:
    return cell_keep(candidates), 4 * candidates
  return max(num_docs, 1), max(4 * candidates, COMPILED_CENTROID_KEEP)


def default_candidates(top_k: int, num_docs: int) -> int:
  """Documents decompressed and reranked exactly per query when the caller gives none:
  4 x top_k at least (PLAID's ratio for k = 100), up to 4,096 as the corpus grows (the
  centroid interaction ranks 4 x as many). Quality first: on SciFact with the benchmark's
  stand-in encoder, whose vectors do not cluster, 4 x top_k lost 0.01-0.24 NDCG@10 against
  exact (uncompressed codes, C = 1-8) where 4,096 (most of the corpus) lost 0-0.024; on
  clustered vectors 2 x top_k kept exact's recall at 8.5 x its speed
  (docs/results/retrieval_scale_cpu.md, retrieval_scale_synthetic_cpu.md)."""
  return max(4 * top_k, min(num_docs, 4096))


# ------------------------------------------------------------------------------- build
def build_residual_index(directory: str, source: exact.Index, bits: Optional[int] = 2,
                         num_centroids: Optional[int] = None, sample_vectors: int = 1 << 16,
                         kmeans_iterations: int = 10, seed: int = 0,
                         kmeans_backend: str = "auto", overwrite: bool = False,
                         chunk_vectors: int = 1 << 16, progress: bool = False,
                         centroids: Optional[np.ndarray] = None,
                         codec: Optional[Codec] = None,
                         codec_settings: Optional[Mapping[str, Any]] = None,
                         codes: Optional[np.ndarray] = None,
                         quantizer: str = codec_lib.DEFAULT_QUANTIZER,
                         centroid_probe: int = 0) -> "ResidualIndex":
  """Compresses the exact index `source` into a residual index at `directory`; returns it
  opened. num_centroids: default `default_num_centroids`, at most the sample's size;
  sample_vectors: how many of the corpus's vectors (drawn without replacement with `seed`)
  train k-means and the bucket quantiles; centroids: reuse these (e.g. those of another
  bit width's index of the same corpus) instead of running k-means; codes: with them, each
  source vector's nearest centroid (that index's codes), skipping the assignment; codec
  (with the settings it was trained with, `codec_settings`): use it as it is, training
  nothing (the shards of a sharded index share one, sharded.py); quantizer: one of
  codec.QUANTIZERS; centroid_probe > 0: k-means's and encoding's centroid search is
  two-level on CPU cores with faiss (codec.nearest_centroids), for large centroid counts."""
  directory = os.path.abspath(directory)
  if source.num_vectors == 0:
    raise ValueError(f"The index in {source.directory} holds no vector: nothing to cluster. "
                     "Search it exactly.")
  if os.path.exists(directory):
    if not overwrite:
      raise FileExistsError(f"{directory} already exists. Pass overwrite=True to replace it.")
    if os.listdir(directory) and not os.path.exists(os.path.join(directory, "meta.json")):
      raise FileExistsError(f"{directory} exists and is not an index (no meta.json); "
                            "overwrite=True only replaces an index. Choose another directory.")
  if codes is not None and (centroids is None or len(codes) != source.num_vectors):
    raise ValueError(f"codes ({len(codes)}) must come with their centroids and hold one id "
                     f"per source vector ({source.num_vectors}). Pass another index of this "
                     "corpus's codec.centroids and codes together, or neither.")
  if codec is None:
    codec, settings = train_codec(source, bits, num_centroids, sample_vectors, kmeans_iterations,
                                  seed, kmeans_backend, centroids, quantizer, centroid_probe)
  else:
    check_bits(codec.bits, source.dim)
    settings = dict(codec_settings or {"bits": codec.bits, "num_centroids": len(codec.centroids),
                                       "normalize": codec.normalize,
                                       "quantizer": codec.quantizer})
  backend = settings.pop("kmeans_backend", "given")
  bits, k = codec.bits, len(codec.centroids)
  with fileio.atomic_directory(directory) as folder:
    tmp = str(folder)
    codes = _write_codes(tmp, source, codec, chunk_vectors, progress, codes)
    _write_inverted_lists(tmp, codes, source.offsets, k)
    np.save(os.path.join(tmp, "centroids.npy"), codec.centroids)
    codec_lib.save_tables(tmp, codec)
    np.save(os.path.join(tmp, "offsets.npy"), source.offsets)
    exact.write_json(os.path.join(tmp, "doc_ids.json"), source.doc_ids)
    per_vector = codec.bytes_per_vector(source.dtype.itemsize)
    meta = {key: source.meta[key] for key in ("config", "fingerprint", "corpus", "dim",
                                               "num_docs", "num_vectors") if key in source.meta}
    meta.update(codec=settings, kmeans_backend=backend, source_dtype=source.dtype.name,
                format_version=FORMAT_VERSION, bytes_per_vector=per_vector,
                bytes=per_vector * source.num_vectors,
                centroid_bytes=int(codec.centroids.nbytes),
                created=datetime.datetime.now(datetime.timezone.utc).isoformat())
    exact.write_json(os.path.join(tmp, "meta.json"), meta)  # last: marks completion
  return ResidualIndex.open(directory)


def _write_codes(tmp: str, source: exact.Index, codec: Codec, chunk: int, progress: bool,
                 known: Optional[np.ndarray] = None) -> np.ndarray:
  """Writes codes.npy and residuals.npy chunk by chunk (known: the codes, if given); returns
  the codes (memory-mapped)."""
  n, d = source.num_vectors, source.dim
  codes = np.lib.format.open_memmap(os.path.join(tmp, "codes.npy"), "w+",
                                    codec.code_dtype, (n,))
  shape, dtype = ((n, d), source.dtype) if codec.bits is None else (
      (n, d * codec.bits // 8), np.uint8)
  payload = np.lib.format.open_memmap(os.path.join(tmp, "residuals.npy"), "w+", dtype, shape)
  for start in tqdm.trange(0, n, chunk, desc="compress", unit="chunk", disable=not progress):
    codes[start:start + chunk], payload[start:start + chunk] = codec.encode(
        np.asarray(source.vectors[start:start + chunk]),
        None if known is None else known[start:start + chunk])
  payload.flush()
  codes.flush()
  del payload
  return codes


def _write_inverted_lists(tmp: str, codes: np.ndarray, offsets: np.ndarray, k: int) -> None:
  """ivf.npy: for each centroid in turn, the (sorted, distinct) docs with a vector in it."""
  num_docs = len(offsets) - 1
  owners = np.repeat(np.arange(num_docs, dtype=np.int64), np.diff(offsets))  # [vectors]
  pairs = np.unique(np.asarray(codes, np.int64) * num_docs + owners)  # centroid-major
  cells, docs = np.divmod(pairs, num_docs)
  np.save(os.path.join(tmp, "ivf.npy"), docs.astype(np.int32))
  np.save(os.path.join(tmp, "ivf_offsets.npy"),
          np.searchsorted(cells, np.arange(k + 1)).astype(np.int64))


def _ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
  """The concatenation of arange(start, stop) for each pair (vectorised)."""
  lengths = stops - starts
  total = int(lengths.sum())
  before = np.cumsum(lengths) - lengths  # [pairs] where each range starts in the output
  return np.repeat(starts - before, lengths) + np.arange(total)


# ------------------------------------------------------------------------------- open
class ResidualIndex(exact.StoredIndex):
  """An opened residual index: the codec, memory-mapped codes and residuals, the inverted
  lists, and approximate search (module doc)."""

  def __init__(self, directory: str, codec: Codec, arrays: Dict[str, np.ndarray],
               doc_ids: Sequence[str], meta: Dict[str, Any]):
    self.directory = directory
    self.codec = codec
    self.codes = arrays["codes"]  # [num_vectors]
    self.residuals = arrays["residuals"]  # [num_vectors, d * b / 8] or [num_vectors, d]
    self.offsets = arrays["offsets"]  # [num_docs + 1]
    self.ivf = arrays["ivf"]  # doc indices, grouped by centroid
    self.ivf_offsets = arrays["ivf_offsets"]  # [num_centroids + 1]
    self.doc_ids = list(doc_ids)
    self.meta = meta

  @classmethod
  def open(cls, directory: str, expected_config: Optional[Mapping[str, Any]] = None
           ) -> "ResidualIndex":
    """Opens the residual index in `directory`; with `expected_config`, refuses one built
    with a different encoder config (IndexConfigMismatchError)."""
    directory, meta, doc_ids = exact.read_meta(directory, _FILES)

    def load(name: str, mmap: bool = False) -> np.ndarray:
      return np.load(os.path.join(directory, name), mmap_mode="r" if mmap else None)
    codec = codec_lib.load_tables(directory, load("centroids.npy"), meta["codec"])
    arrays = {"codes": load("codes.npy", True), "residuals": load("residuals.npy", True),
              "offsets": load("offsets.npy"), "ivf": load("ivf.npy"),
              "ivf_offsets": load("ivf_offsets.npy")}
    if (len(arrays["codes"]) != meta["num_vectors"] or len(doc_ids) != meta["num_docs"]
        or int(arrays["offsets"][-1]) != meta["num_vectors"]):
      raise ValueError(f"The residual index in {directory} is inconsistent with its "
                       "meta.json: its files were changed after the build; rebuild it.")
    return cls(directory, codec, arrays, doc_ids, meta).checked(expected_config)

  def settings_change(self, settings: Mapping[str, Any]) -> str:
    """'' when the codec was built with these settings (keys of meta['codec'] given);
    else the differing keys, in words."""
    built = self.meta["codec"]
    return ", ".join(f"{key} {built.get(key)!r} -> {value!r}" for key, value in
                     sorted(settings.items()) if built.get(key) != value)

  # ----------------------------------------------------------------------------- sizes
  @property
  def dim(self) -> int:
    return self.codec.dim

  @property
  def num_vectors(self) -> int:
    return int(len(self.codes))

  @property
  def num_centroids(self) -> int:
    return int(len(self.codec.centroids))

  @property
  def nbytes(self) -> int:
    """Bytes of the codes and residuals (what scales with the corpus)."""
    return int(self.codes.nbytes + self.residuals.nbytes)

  def vectors(self, rows: np.ndarray) -> np.ndarray:
    """The decompressed vectors of the given rows: `[len(rows), d]` float32."""
    return self.codec.decode(self.codes[rows], self.residuals[rows])

  def scoring_vectors(self, rows: np.ndarray) -> np.ndarray:
    """`vectors(rows)` in the codec's rotated coordinates (`codec.rotate`): what search
    scores against queries rotated alike, without turning every vector back."""
    return self.codec.decode_rotated(self.codes[rows], self.residuals[rows])

  def doc_vectors(self, i: int) -> np.ndarray:
    """Document i's decompressed vectors `[count, d]` (possibly 0 rows)."""
    return self.vectors(np.arange(self.offsets[i], self.offsets[i + 1]))

  # ----------------------------------------------------------------------------- search
  def search(self, query_vectors: np.ndarray, query_valid: np.ndarray, top_k: int = 100,
             nprobe: int = DEFAULT_NPROBE, candidates: Optional[int] = None,
             query_batch_size: int = 64, query_cells: int = DEFAULT_QUERY_CELLS,
             compiled: Optional[bool] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Approximate MaxSim top-k (module doc): (scores float32 `[q, k]`, doc indices int32
    `[q, k]`), best first, ties by doc index, k = min(top_k, num_docs); a query with fewer
    than k candidates is padded with index -1 and score -inf. candidates: the documents
    decompressed and reranked exactly per query (None: `default_candidates`; the stages
    before keep `stage_widths`). query_batch_size: queries searched together (fewer when
    their centroid scores, queries x query vectors x centroids, would pass 2^25 entries, or
    the numpy centroid interaction's 2^23: larger batches ran slower at 1M passages).
    query_cells: cells probed for the whole query (stage 1), 0 for none. compiled: stages
    2-5 in kernels.py's loops (None: when numba is installed); False: in numpy."""
    query_vectors, query_valid = exact.check_queries(query_vectors, query_valid, self.dim)
    compiled = kernels.AVAILABLE if compiled is None else compiled
    if compiled and not kernels.AVAILABLE:
      raise ImportError("compiled=True needs numba: pip install 'decal_jax[ann]', or pass "
                        "compiled=False (the numpy stages).")
    if candidates is None:
      candidates = default_candidates(top_k, self.num_docs)
    if min(top_k, nprobe, candidates, query_batch_size) < 1 or query_cells < 0:
      raise ValueError(f"top_k, nprobe, candidates and query_batch_size must be >= 1 and "
                       f"query_cells >= 0, got {top_k}, {nprobe}, {candidates}, "
                       f"{query_batch_size}, {query_cells}.")
    k = min(top_k, self.num_docs)
    scores = np.full((len(query_vectors), k), -np.inf, np.float32)
    ids = np.full((len(query_vectors), k), -1, np.int32)
    mq = query_vectors.shape[1]
    widths = stage_widths(candidates, self.num_docs, compiled)
    kept_vectors = (0 if compiled else widths[0]) * self.num_vectors / max(self.num_docs, 1)
    step = max(1, min(query_batch_size, (1 << 25) // max(mq * self.num_centroids, 1),
                      int((1 << 23) // max(mq * kept_vectors, 1))))
    for start in range(0, len(query_vectors), step):
      batch = np.asarray(query_vectors[start:start + step], np.float32)  # [b, mq, d]
      valid = query_valid[start:start + step]  # [b, mq]
      found = self._search_batch(batch, valid, k, min(nprobe, self.num_centroids), candidates,
                                 min(query_cells, self.num_centroids), widths, compiled)
      for i, (found_scores, found_ids) in enumerate(found):
        scores[start + i, :len(found_ids)], ids[start + i, :len(found_ids)] = (found_scores,
                                                                               found_ids)
    return scores, ids

  def _search_batch(self, q: np.ndarray, valid: np.ndarray, k: int, nprobe: int,
                    candidates: int, query_cells: int, widths: Tuple[int, int],
                    compiled: bool) -> List[Tuple[np.ndarray, np.ndarray]]:
    """The five stages for a batch of queries `[b, mq, d]`, valid `[b, mq]` -> per query
    (scores, doc indices) of at most k docs, best first. Compiled: all five per query, the
    queries spread over the CPU cores (kernels.search_queries)."""
    if compiled:
      keep = widths[1]  # compiled: stage 2 keeps every candidate
      return kernels.search_queries(self, q, valid, k, nprobe, query_cells, candidates, keep)
    flat = q.reshape(-1, q.shape[2]) @ self.codec.centroids.T  # [b * mq, K], one matmul
    centroid_scores = np.where(valid[..., None], flat.reshape(*q.shape[:2], -1), 0)  # [b, mq, K]
    probed = self.probe(q, centroid_scores, nprobe, query_cells)  # [b, mq, nprobe + cells]
    groups = []
    for scores, cells, query_valid in zip(centroid_scores, probed, valid):
      docs, rough = self.cell_interaction(scores, cells[query_valid])  # [c], [c]
      groups.append(docs[_best(docs, rough, widths[0])])
    q = self.codec.rotate(q)  # [b, mq, d]: scored against the rotated decoded vectors
    if max(map(len, groups)) > widths[1]:
      plain, _ = self.centroid_interaction(q, centroid_scores, probed, groups, refine=False)
      groups = [docs[_best(docs, s, widths[1])] for docs, s in zip(groups, plain)]
    full, decoded = self.centroid_interaction(q, centroid_scores, probed, groups)  # per query
    groups = [np.sort(docs[_best(docs, s, candidates)]) for docs, s in zip(groups, full)]
    out = []
    for query, query_valid, docs, (rows, sims) in zip(q, valid, groups, decoded):
      s = self.rerank(query[query_valid], docs, (rows, sims[:, query_valid]),
                      rotated=True)  # [docs]
      best = _best(docs, s, k, ordered=True)
      out.append((s[best].astype(np.float32), docs[best].astype(np.int32)))
    return out

  def probe(self, q: np.ndarray, centroid_scores: np.ndarray, nprobe: int,
            query_cells: int) -> np.ndarray:
    """The cells each query vector probes (module doc, stage 1): its nprobe centroids
    L2-nearest to its direction, then the query's query_cells centroids of largest sum over
    its vectors of max(q.c, 0), the same for each of its vectors. `[..., mq, d]`,
    `[..., mq, K]` (0 for invalid query vectors) -> `[..., mq, nprobe + query_cells]`, a
    cell possibly twice."""
    nearest = self.nearest_cells(q, centroid_scores, nprobe)  # [..., mq, nprobe]
    if query_cells == 0:
      return nearest
    summed = np.maximum(centroid_scores, 0).sum(axis=-2)  # [..., K]
    cells = np.argpartition(-summed, query_cells - 1, axis=-1)[..., :query_cells]  # [..., m]
    cells = np.broadcast_to(cells[..., None, :], (*nearest.shape[:-1], query_cells))
    return np.concatenate([nearest, cells], axis=-1)

  def nearest_cells(self, q: np.ndarray, centroid_scores: np.ndarray, nprobe: int
                    ) -> np.ndarray:
    """Each query vector's nprobe centroids L2-nearest to its direction (the cells a document
    vector equal to the unit query vector would be stored in; the largest q.c / |q| -
    |c|^2 / 2), from stage 1's centroid scores (`top_columns`; 5 x faster than faiss's
    search of the same products): `[..., mq, d]`, `[..., mq, K]` -> `[..., mq, nprobe]`."""
    norms = np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), 1e-12)  # [..., mq, 1]
    closeness = centroid_scores / norms - 0.5 * self.squared_norms  # [..., mq, K]
    flat = closeness.reshape(-1, closeness.shape[-1])  # [n, K]
    return top_columns(flat, nprobe).reshape(*closeness.shape[:-1], nprobe)

  @functools.cached_property
  def squared_norms(self) -> np.ndarray:
    """|c|^2 of every centroid, `[K]`."""
    return np.sum(self.codec.centroids.astype(np.float32) ** 2, axis=1)

  def cell_interaction(self, centroid_scores: np.ndarray, probed: np.ndarray
                       ) -> Tuple[np.ndarray, np.ndarray]:
    """One query's candidates and their first score, from the inverted lists alone: the
    documents in the cells its vectors probed; per query vector, a document scores the best
    q.c among those cells that hold one of its vectors, floored at 0, summed over the query
    vectors. centroid_scores `[mq, K]` (0 for invalid query vectors), probed `[p, cells]`
    (the valid vectors' cells) -> (docs sorted, distinct int64 `[c]`, scores float32 `[c]`)."""
    cells = np.unique(probed)  # [u]
    starts, stops = self.ivf_offsets[cells], self.ivf_offsets[cells + 1]
    docs = np.asarray(self.ivf[_ranges(starts, stops)], np.int64)  # [h]
    if len(docs) == 0:
      return docs, np.zeros(0, np.float32)
    cell_of = np.repeat(cells, stops - starts)  # [h]
    order = np.argsort(docs, kind="stable")
    docs, cell_of = docs[order], cell_of[order]
    first = np.flatnonzero(np.concatenate([[True], docs[1:] != docs[:-1]]))  # [c]
    sims = np.maximum(centroid_scores[:, cell_of], 0)  # [mq, h]
    return docs[first], np.maximum.reduceat(sims, first, axis=1).sum(axis=0)

  def centroid_interaction(self, q: np.ndarray, centroid_scores: np.ndarray,
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
    counts = self.offsets[docs + 1] - self.offsets[docs]  # [g], each >= 1
    rows = _ranges(self.offsets[docs], self.offsets[docs + 1])  # [r]
    row_query = np.repeat(np.repeat(np.arange(b), sizes), counts)  # [r], ascending
    codes = np.asarray(self.codes[rows], np.int64)  # [r]
    sims = centroid_scores[row_query, :, codes]  # [r, mq]
    if not refine:
      return np.split(_segment_max(sims, counts).sum(axis=1), np.cumsum(sizes)[:-1]), []
    in_probe = np.zeros((b, mq, k), bool)
    np.put_along_axis(in_probe, probed, True, axis=2)
    in_probe &= np.any(centroid_scores != 0, axis=2, keepdims=True)  # not invalid vectors
    mask = in_probe[row_query, :, codes]  # [r, mq]
    hit = np.flatnonzero(mask.any(axis=1))  # rows in a cell some query vector probed
    vectors = self.scoring_vectors(rows[hit])  # [h, d], grouped by query
    bounds = np.searchsorted(row_query[hit], np.arange(b + 1))  # [b + 1]
    exact_sims = np.concatenate([np.einsum("hd,md->hm", vectors[start:stop], q[j]) for j, (
        start, stop) in enumerate(zip(bounds[:-1], bounds[1:]))])  # [h, mq]
    sims[hit] = np.where(mask[hit], exact_sims, sims[hit])
    scores = _segment_max(sims, counts).sum(axis=1)  # [g]
    decoded = [(rows[hit[start:stop]], exact_sims[start:stop])
               for start, stop in zip(bounds[:-1], bounds[1:])]
    return np.split(scores, np.cumsum(sizes)[:-1]), decoded

  def rerank(self, q: np.ndarray, docs: np.ndarray,
             decoded: Optional[Tuple[np.ndarray, np.ndarray]] = None,
             rotated: bool = False) -> np.ndarray:
    """Exact MaxSim of one query's valid vectors `[mq, d]` over the decompressed vectors of
    sorted docs `[c]` -> `[c]`. decoded: rows already scored (ascending `[h]`) and their
    similarities `[h, mq]`, reused instead of decompressing them again. rotated: q is
    already in the codec's rotated coordinates (`codec.rotate`)."""
    if len(docs) == 0:
      return np.zeros(0, np.float32)
    counts = self.offsets[docs + 1] - self.offsets[docs]  # [c]
    rows = _ranges(self.offsets[docs], self.offsets[docs + 1])  # [r]
    q = q if rotated else self.codec.rotate(q)  # [mq, d]
    sims = np.empty((len(rows), len(q)), np.float32)  # [r, mq]
    missing = np.ones(len(rows), bool)
    if decoded is not None and len(decoded[0]):
      known_rows, known_sims = decoded
      at = np.minimum(np.searchsorted(known_rows, rows), len(known_rows) - 1)  # [r]
      missing = known_rows[at] != rows
      sims[~missing] = known_sims[at[~missing]]
    sims[missing] = np.einsum("rd,md->rm", self.scoring_vectors(rows[missing]), q)
    return _segment_max(sims, counts).sum(axis=1)  # [c]


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
  best = np.argpartition(-maxima, k - 1, axis=-1)[:, :k]  # [n, k]
  columns = (best[..., None] * block + np.arange(block)).reshape(n, -1)  # [n, k * block]
  tail = np.broadcast_to(np.arange(blocks * block, width), (n, width - blocks * block))
  columns = np.concatenate([columns, tail], axis=-1)  # [n, k * block + K mod block]
  values = np.take_along_axis(x, columns, axis=-1)
  return np.take_along_axis(columns, np.argpartition(-values, k - 1, axis=-1)[:, :k], -1)


def _segment_max(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
  """The max over consecutive row segments of the given (>= 1) lengths: `[r, m]` -> `[s, m]`."""
  if len(counts) == 0:
    return np.zeros((0, values.shape[1]), values.dtype)
  return np.maximum.reduceat(values, np.cumsum(counts) - counts, axis=0)


def _best(docs: np.ndarray, scores: np.ndarray, n: int, ordered: bool = False) -> np.ndarray:
  """Positions of the n best (score, then lower doc index) of docs `[c]` with scores `[c]`:
  in position order, or best first when `ordered`."""
  if len(docs) > n:  # the n-th best score: all above it, and the lowest docs tied at it
    threshold = np.partition(scores, len(docs) - n)[len(docs) - n]
    above = np.flatnonzero(scores > threshold)
    tied = np.flatnonzero(scores == threshold)
    tied = tied[np.argsort(docs[tied], kind="stable")[:n - len(above)]]
    kept = np.concatenate([above, tied])
  else:
    kept = np.arange(len(docs))
  return kept[np.lexsort((docs[kept], -scores[kept]))] if ordered else np.sort(kept)
