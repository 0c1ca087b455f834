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

Approximate search (PLAID's stages, `ResidualIndex.search`), per query:
  1. probe: each valid query vector probes the `nprobe` cells (centroids) L2-nearest to its
     direction, i.e. the cells a document vector equal to the unit query vector would be
     stored in (largest q.c / |q| - |c|^2 / 2);
  2. candidates: the documents in those cells' inverted lists (built at index time);
  3. centroid interaction: each candidate scores the sum over query vectors of its best
     vector, where a vector counts its centroid's score q.c, or its exact score against the
     decompressed vector when it lies in a cell that query vector probed; the best
     `candidates` (default `default_candidates`) are kept;
  4. rerank: exact MaxSim over their decompressed vectors, top k.
With nprobe = every centroid, candidates >= the corpus and b = None it ranks as the exact
index does (documents with no vector are in no inverted list, so they are never returned).
Each step is vectorised numpy over the query's candidates; the centroid scores of a batch
of queries are one matmul.

"""
import datetime
import functools
import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import tqdm

from decal_jax import fileio
from decal_jax.retrieval import index as exact
from decal_jax.retrieval.codec import Codec, check_bits, train_codec

FORMAT_VERSION = 1
DEFAULT_NPROBE = 16
_FILES = ("centroids.npy", "codes.npy", "residuals.npy", "offsets.npy", "doc_ids.json",
          "ivf.npy", "ivf_offsets.npy", "meta.json")


# ------------------------------------------------------------------------------- defaults
def default_candidates(top_k: int, num_docs: int) -> int:
  """Documents reranked exactly per query when the caller gives none: 4 x top_k (PLAID's
  ratio for k = 100) at least, up to 4,096 as the corpus grows; on SciFact with the
  benchmark's stand-in encoder, C >= 2 needed nearly every probed document reranked to stay
  within 0.005 NDCG@10 of exact (docs/results/retrieval_scale_cpu.md)."""
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
                         codes: Optional[np.ndarray] = None) -> "ResidualIndex":
  """Compresses the exact index `source` into a residual index at `directory`; returns it
  opened. num_centroids: default `default_num_centroids`, at most the sample's size;
  sample_vectors: how many of the corpus's vectors (drawn without replacement with `seed`)
  train k-means and the bucket quantiles; centroids: reuse these (e.g. those of another
  bit width's index of the same corpus) instead of running k-means; codes: with them, each
  source vector's nearest centroid (that index's codes), skipping the assignment; codec
  (with the settings it was trained with, `codec_settings`): use it as it is, training
  nothing (the shards of a sharded index share one, sharded.py)."""
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
                                  seed, kmeans_backend, centroids)
  else:
    check_bits(codec.bits, source.dim)
    settings = dict(codec_settings or {"bits": codec.bits, "num_centroids": len(codec.centroids),
                                       "normalize": codec.normalize})
  backend = settings.pop("kmeans_backend", "given")
  bits, k = codec.bits, len(codec.centroids)
  with fileio.atomic_directory(directory) as folder:
    tmp = str(folder)
    codes = _write_codes(tmp, source, codec, chunk_vectors, progress, codes)
    _write_inverted_lists(tmp, codes, source.offsets, k)
    np.save(os.path.join(tmp, "centroids.npy"), codec.centroids)
    if bits is not None:
      np.save(os.path.join(tmp, "cutoffs.npy"), codec.cutoffs)
      np.save(os.path.join(tmp, "weights.npy"), codec.weights)
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
    bits = meta["codec"]["bits"]
    codec = Codec(load("centroids.npy"), bits,
                  None if bits is None else load("cutoffs.npy"),
                  None if bits is None else load("weights.npy"),
                  meta["codec"].get("normalize", False))
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

  def doc_vectors(self, i: int) -> np.ndarray:
    """Document i's decompressed vectors `[count, d]` (possibly 0 rows)."""
    return self.vectors(np.arange(self.offsets[i], self.offsets[i + 1]))

  # ----------------------------------------------------------------------------- search
  def search(self, query_vectors: np.ndarray, query_valid: np.ndarray, top_k: int = 100,
             nprobe: int = DEFAULT_NPROBE, candidates: Optional[int] = None,
             query_batch_size: int = 32) -> Tuple[np.ndarray, np.ndarray]:
    """Approximate MaxSim top-k (module doc): (scores float32 `[q, k]`, doc indices int32
    `[q, k]`), best first, ties by doc index, k = min(top_k, num_docs); a query with fewer
    than k candidates is padded with index -1 and score -inf. candidates: the documents
    reranked exactly per query (None: `default_candidates(top_k, num_docs)`)."""
    query_vectors, query_valid = exact.check_queries(query_vectors, query_valid, self.dim)
    candidates = default_candidates(top_k, self.num_docs) if candidates is None else candidates
    if min(top_k, nprobe, candidates, query_batch_size) < 1:
      raise ValueError(f"top_k, nprobe, candidates and query_batch_size must be >= 1, got "
                       f"{top_k}, {nprobe}, {candidates}, {query_batch_size}.")
    k = min(top_k, self.num_docs)
    scores = np.full((len(query_vectors), k), -np.inf, np.float32)
    ids = np.full((len(query_vectors), k), -1, np.int32)
    for start in range(0, len(query_vectors), query_batch_size):
      batch = np.asarray(query_vectors[start:start + query_batch_size], np.float32)
      centroid_scores = batch @ self.codec.centroids.T  # [b, mq, num_centroids], one matmul
      for i, (q, valid) in enumerate(zip(batch, query_valid[start:start + query_batch_size])):
        found_scores, found = self._search_one(q[valid], centroid_scores[i, valid], k,
                                               min(nprobe, self.num_centroids), candidates)
        scores[start + i, :len(found)], ids[start + i, :len(found)] = found_scores, found
    return scores, ids

  def probe(self, q: np.ndarray, centroid_scores: np.ndarray, nprobe: int) -> np.ndarray:
    """The cells each query vector probes: the nprobe centroids L2-nearest to its direction
    (the cells a document vector equal to the unit query vector would be stored in; the
    largest q.c / |q| - |c|^2 / 2). `[mq, d]`, `[mq, num_centroids]` -> `[mq, nprobe]`."""
    norms = np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)  # [mq, 1]
    closeness = centroid_scores / norms - 0.5 * self.centroid_norms2[None, :]  # [mq, k]
    return np.argpartition(-closeness, nprobe - 1, axis=1)[:, :nprobe]

  @functools.cached_property
  def centroid_norms2(self) -> np.ndarray:
    """|c|^2 of each centroid `[num_centroids]`."""
    return np.sum(self.codec.centroids ** 2, axis=1)

  def candidate_docs(self, cells: np.ndarray) -> np.ndarray:
    """The sorted distinct docs in the inverted lists of the given cells."""
    cells = np.unique(cells)
    return np.unique(self.ivf[_ranges(self.ivf_offsets[cells], self.ivf_offsets[cells + 1])])

  def centroid_interaction(self, q: np.ndarray, centroid_scores: np.ndarray,
                           probed: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Approximate MaxSim (PLAID's centroid interaction, refined): each doc vector stands for
    its centroid (score q.c), except that a vector in a cell the query vector probed gets its
    exact score against the decompressed vector; a doc scores the sum over query vectors of
    its best. q `[mq, d]`, centroid_scores `[mq, k]`, probed `[mq, nprobe]`, sorted docs
    `[c]` -> `[c]`."""
    rows = _ranges(self.offsets[docs], self.offsets[docs + 1])  # [r]
    codes = np.asarray(self.codes[rows], np.int64)  # [r]
    sims = centroid_scores[:, codes]  # [mq, r]
    in_probe = np.zeros(centroid_scores.shape, bool)  # [mq, k]
    np.put_along_axis(in_probe, probed, True, axis=1)
    mask = in_probe[:, codes]  # [mq, r]
    hit = np.flatnonzero(mask.any(axis=0))  # rows in some probed cell
    exact_sims = q @ self.vectors(rows[hit]).T  # [mq, hits]
    sims[:, hit] = np.where(mask[:, hit], exact_sims, sims[:, hit])
    return self._maxsim(sims, docs)

  def _maxsim(self, sims: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """sims `[mq, vectors of docs, end to end]` -> MaxSim per doc `[len(docs)]`."""
    counts = self.offsets[docs + 1] - self.offsets[docs]  # [docs], each >= 1
    starts = np.cumsum(counts) - counts
    return np.maximum.reduceat(sims, starts, axis=1).sum(axis=0)  # [docs]

  def _search_one(self, q: np.ndarray, centroid_scores: np.ndarray, k: int, nprobe: int,
                  candidates: int) -> Tuple[np.ndarray, np.ndarray]:
    """One query's valid vectors `[mq, d]` and their centroid scores `[mq, num_centroids]`
    -> (scores, doc indices) of at most k docs."""
    if len(q) == 0:
      return np.zeros(0, np.float32), np.zeros(0, np.int32)
    probed = self.probe(q, centroid_scores, nprobe)  # [mq, nprobe]
    docs = self.candidate_docs(probed)  # [c]
    if len(docs) == 0:  # only centroids without vectors were probed
      return np.zeros(0, np.float32), np.zeros(0, np.int32)
    if len(docs) > candidates:
      rough = self.centroid_interaction(q, centroid_scores, probed, docs)  # [c]
      docs = np.sort(docs[np.lexsort((docs, -rough))[:candidates]])
    rows = _ranges(self.offsets[docs], self.offsets[docs + 1])
    scores = self._maxsim(q @ self.vectors(rows).T, docs)  # [c]
    best = np.lexsort((docs, -scores))[:k]
    return scores[best].astype(np.float32), docs[best].astype(np.int32)
