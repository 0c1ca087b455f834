"""A compressed multi-vector index on disk, and exact MaxSim search over it on device.

Layout of an index directory (every file is written before the directory gets its name):

    vectors.npy    [num_vectors, d]  the valid vectors of every document, end to end
                   (float16 or float32; memory-mapped when opened)
    offsets.npy    [num_docs + 1]    int64: document i owns vectors[offsets[i]:offsets[i+1]]
    doc_ids.json   [num_docs]        the document ids, in index order
    meta.json      the encoder config, its fingerprint (sha256 of the canonical config
                   JSON), the corpus fingerprint when given ({'num_docs', 'sha256'}, see
                   `beir.CorpusDigest`), dim, dtype, num_docs, num_vectors, bytes, created (UTC)

`build_index` calls the encoder batch by batch and appends each document's valid vectors
to `vectors.npy` as it goes (the .npy header, whose shape is only known at the end, is
written last into space reserved for it), so the corpus never has to fit in memory. It
builds in `<directory>.tmp-<random>` and renames that into place when complete
(`fileio.atomic_directory`): an interrupted build leaves no directory at `directory`.

`Index.search` scores every document with exact MaxSim (for each valid query vector, the
largest dot product with the document's vectors, summed), jit-compiled and run over the
corpus in chunks of `doc_batch_size` documents padded to a power-of-two vector count (so few
shapes compile), keeping a running top-k with `jax.lax.top_k`. The padded chunks stay on the
device for the next search when all of them fit `DECAL_INDEX_CACHE_MIB` (a served index
answers many small requests: it pads and copies its corpus once, not per request). A document with no vector
scores 0 for every query (as in `maxsim.maxsim`), so it ranks below any document with a
positive match and above those whose best matches are negative.
"""
import abc
import datetime
import functools
import json
import os
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from decal_jax import fileio, settings
from decal_jax.retrieval import maxsim
from decal_jax.retrieval.index_files import (IndexConfigMismatchError, canonical_config,
                                             check_npy, config_differences, config_fingerprint,
                                             npy_header, read_meta, write_json)

EncodeFn = Callable[[np.ndarray], Tuple[np.ndarray, np.ndarray]]
DTYPES = ("float16", "float32")
FORMAT_VERSION = 1
_FILES = ("vectors.npy", "offsets.npy", "doc_ids.json", "meta.json")


# ------------------------------------------------------------------------------- build
def _check_encoded(vectors: np.ndarray, valid: np.ndarray, rows: int, dim: Optional[int],
                   batch_number: int) -> None:
  where = f"encode_fn on token batch {batch_number} ({rows} rows)"
  if vectors.ndim != 3 or vectors.shape[0] != rows:
    raise ValueError(f"{where} returned vectors of shape {vectors.shape}; expected "
                     f"[{rows}, m, d]. encode_fn must return (vectors [b, m, d], valid [b, m]).")
  if valid.shape != vectors.shape[:2]:
    raise ValueError(f"{where} returned valid of shape {valid.shape} for vectors "
                     f"{vectors.shape}; expected {vectors.shape[:2]} (one flag per vector).")
  if dim is not None and vectors.shape[2] != dim:
    raise ValueError(f"{where} returned vectors of dimension {vectors.shape[2]}, earlier "
                     f"batches {dim}. Every batch must use the same encoder.")


def build_index(directory: str, doc_ids: Sequence[str], token_batches: Iterable[np.ndarray],
                encode_fn: EncodeFn, config: Mapping[str, Any], dtype: str = "float16",
                progress: bool = True, overwrite: bool = False,
                corpus_fingerprint: Optional[Mapping[str, Any]] = None) -> "Index":
  """Encodes the corpus and writes the index to `directory`; returns it opened.

  doc_ids: one id per document, in the order the rows of `token_batches` come.
  token_batches: int32 `[b, n]` token arrays, whose rows together are the documents.
  encode_fn: tokens `[b, n]` -> (vectors float `[b, m, d]`, valid bool `[b, m]`); only the
    valid vectors are stored (a document may have none: it is kept, with 0 vectors).
  config: the encoder's config (JSON-serialisable), saved and checked by `Index.open`.
  corpus_fingerprint: the corpus's {'num_docs', 'sha256'} (`beir.CorpusDigest`), saved as
    meta['corpus'] and compared by `Index.corpus_change`.
  """
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}.")
  directory = os.path.abspath(directory)
  doc_ids = [str(d) for d in doc_ids]
  if len(set(doc_ids)) != len(doc_ids):
    seen, twice = set(), None
    for d in doc_ids:
      if d in seen:
        twice = d
        break
      seen.add(d)
    raise ValueError(f"doc id {twice!r} appears more than once in doc_ids. Give every "
                     "document a unique id (deduplicate the corpus).")
  if os.path.exists(directory):
    if not overwrite:
      raise FileExistsError(f"{directory} already exists. Pass overwrite=True to replace "
                            "it, or choose another index directory.")
    if os.listdir(directory) and not os.path.exists(os.path.join(directory, "meta.json")):
      raise FileExistsError(f"{directory} exists and is not an index (no meta.json); "
                            "overwrite=True only replaces an index. Choose another directory.")
  config_json = canonical_config(config)
  with fileio.atomic_directory(directory) as folder:
    tmp = str(folder)
    meta = _write_index_files(tmp, doc_ids, token_batches, encode_fn, np.dtype(dtype),
                              progress)
    meta.update(config=json.loads(config_json), fingerprint=config_fingerprint(config),
                format_version=FORMAT_VERSION,
                created=datetime.datetime.now(datetime.timezone.utc).isoformat())
    if corpus_fingerprint is not None:
      meta["corpus"] = dict(corpus_fingerprint)
    write_json(os.path.join(tmp, "doc_ids.json"), doc_ids)
    write_json(os.path.join(tmp, "meta.json"), meta)  # last: its presence marks completion
  return Index.open(directory, expected_config=config)


def _write_index_files(tmp: str, doc_ids: List[str], token_batches: Iterable[np.ndarray],
                       encode_fn: EncodeFn, dtype: np.dtype, progress: bool) -> Dict[str, Any]:
  """Streams vectors.npy and writes offsets.npy; returns the size fields of meta.json."""
  offsets, total, dim, header_size = [0], 0, None, 0
  path = os.path.join(tmp, "vectors.npy")
  bar = tqdm.tqdm(total=len(doc_ids), desc="index", unit="doc", disable=not progress,
                  dynamic_ncols=True)
  with open(path, "wb") as f, bar:
    for batch_number, tokens in enumerate(token_batches):
      tokens = np.asarray(tokens)
      if len(offsets) - 1 + tokens.shape[0] > len(doc_ids):
        raise ValueError(f"token_batches hold more rows than the {len(doc_ids)} doc_ids "
                         f"(at batch {batch_number}). Give one doc id per document.")
      vectors, valid = encode_fn(tokens)
      vectors, valid = np.asarray(vectors), np.asarray(valid, dtype=bool)
      _check_encoded(vectors, valid, tokens.shape[0], dim, batch_number)
      if dim is None:
        dim = vectors.shape[2]
        header_size = len(npy_header((np.iinfo(np.int64).max, dim), dtype))
        f.write(b"\0" * header_size)  # reserved; the real header is written at the end
      kept = vectors[valid].astype(dtype)  # [valid vectors of the batch, d], row order
      if not np.all(np.isfinite(kept)):
        raise ValueError(f"encode_fn on token batch {batch_number} produced non-finite "
                         f"vectors (as {dtype.name}). Fix the encoder, or build with "
                         "dtype='float32' if float16 overflowed.")
      f.write(np.ascontiguousarray(kept).tobytes())
      for count in valid.sum(axis=1):
        total += int(count)
        offsets.append(total)
      bar.update(tokens.shape[0])
    if len(offsets) - 1 != len(doc_ids):
      raise ValueError(f"token_batches held {len(offsets) - 1} documents but doc_ids "
                       f"{len(doc_ids)}. Give one doc id per document row.")
    if dim is None:
      raise ValueError("The corpus is empty (no token batch). Index at least one document.")
    f.seek(0)
    f.write(npy_header((total, dim), dtype, header_size))
    f.flush()
    os.fsync(f.fileno())
  np.save(os.path.join(tmp, "offsets.npy"), np.asarray(offsets, dtype=np.int64))
  return {"dim": int(dim), "dtype": dtype.name, "num_docs": len(doc_ids),
          "num_vectors": int(total), "bytes": int(total) * int(dim) * dtype.itemsize}


# ------------------------------------------------------------------------------- search
def _bucket(count: int) -> int:
  """The padded vector count of a chunk: the next power of two (at least 1)."""
  return 1 << max(int(count) - 1, 0).bit_length()


@functools.partial(jax.jit, static_argnames=("top_k", "precision"))
def _score_chunk(queries, query_valid, best_scores, best_ids, docs, doc_valid, doc_ids,
                 top_k: int, precision: str):
  """Merges one document chunk into each query batch's running top-k.

  queries [nb, qb, mq, d], query_valid [nb, qb, mq], best_* [nb, qb, k],
  docs [c, mv, d], doc_valid [c, mv] (a padding doc has no valid vector), doc_ids [c]
  (-1 = padding doc: scored -inf).
  """
  docs = docs.astype(jnp.float32)

  def one_batch(carry_free, batch):
    del carry_free
    q, qv, scores_so_far, ids_so_far = batch
    scores = maxsim.maxsim(q, qv, docs, doc_valid, precision)  # [qb, c]
    scores = jnp.where(doc_ids[None, :] >= 0, scores, -jnp.inf)
    merged = jnp.concatenate([scores_so_far, scores], axis=1)  # [qb, k + c]
    merged_ids = jnp.concatenate(
        [ids_so_far, jnp.broadcast_to(doc_ids[None, :], scores.shape)], axis=1)
    top, where = jax.lax.top_k(merged, top_k)  # [qb, k]
    return None, (top, jnp.take_along_axis(merged_ids, where, axis=1))

  _, (scores, ids) = jax.lax.scan(one_batch, None,
                                  (queries, query_valid, best_scores, best_ids))
  return scores, ids


def check_queries(query_vectors: np.ndarray, query_valid: np.ndarray, dim: int
                  ) -> Tuple[np.ndarray, np.ndarray]:
  """(query_vectors `[q, mq, dim]`, query_valid bool `[q, mq]`) as arrays, or a ValueError."""
  query_vectors = np.asarray(query_vectors)
  query_valid = np.asarray(query_valid, dtype=bool)
  if query_vectors.ndim != 3 or query_vectors.shape[2] != dim:
    raise ValueError(f"query_vectors must be [q, mq, {dim}] (the index dimension), "
                     f"got {query_vectors.shape}. Encode queries with the index's encoder.")
  if query_valid.shape != query_vectors.shape[:2]:
    raise ValueError(f"query_valid must have shape {query_vectors.shape[:2]}, got "
                     f"{query_valid.shape}.")
  return query_vectors, query_valid


class StoredIndex(abc.ABC):
  """What every on-disk index shares: its directory, doc ids and meta.json, the encoder
  config and corpus checks, and `search_run` over the subclass's `search`."""
  directory: str
  doc_ids: List[str]
  meta: Dict[str, Any]

  def check_config(self, expected_config: Mapping[str, Any]) -> None:
    """Raises IndexConfigMismatchError naming each key whose value differs."""
    if config_fingerprint(expected_config) == self.meta["fingerprint"]:
      return
    wanted = json.loads(canonical_config(expected_config))
    differences = config_differences(self.meta["config"], wanted) or [
        "(the configs are equal but the stored fingerprint differs: meta.json was edited)"]
    raise IndexConfigMismatchError(
        f"The index in {self.directory} was built with another encoder config:\n  "
        + "\n  ".join(differences)
        + "\nRebuild the index with this config (build_index(..., overwrite=True)), or search "
          "with the config it was built with (meta.json holds it).")

  def corpus_change(self, corpus_fingerprint: Mapping[str, Any]) -> str:
    """'' when the index was built from the corpus of this fingerprint ({'num_docs',
    'sha256'}, `beir.CorpusDigest`); else what changed since, in words."""
    built, now = self.meta.get("corpus"), corpus_fingerprint
    if not built:
      return "the index records no corpus fingerprint, so it may be stale"
    if built["num_docs"] != now["num_docs"]:
      return f"{built['num_docs']} -> {now['num_docs']} documents"
    if built["sha256"] != now["sha256"]:
      return f"the same {now['num_docs']} documents, but their ids, titles or texts differ"
    return ""

  def checked(self, expected_config: Optional[Mapping[str, Any]]) -> "StoredIndex":
    """This index, after `check_config(expected_config)` when one is given."""
    if expected_config is not None:
      self.check_config(expected_config)
    return self

  @property
  def config(self) -> Dict[str, Any]:
    return self.meta["config"]

  @property
  def fingerprint(self) -> str:
    return self.meta["fingerprint"]

  @property
  def num_docs(self) -> int:
    return len(self.doc_ids)

  def __len__(self) -> int:
    return self.num_docs

  @abc.abstractmethod
  def search(self, query_vectors: np.ndarray, query_valid: np.ndarray, top_k: int = 100,
             **search_kwargs) -> Tuple[np.ndarray, np.ndarray]:
    """Top-k documents per query: (scores float32 `[q, k]`, doc indices int32 `[q, k]`)."""

  def search_run(self, qids: Sequence[str], query_vectors: np.ndarray, query_valid: np.ndarray,
                 top_k: int = 100, **search_kwargs) -> Dict[str, Dict[str, float]]:
    """`search` as a run {qid: {doc id: score}} (for `ir_metrics` and TREC run files)."""
    qids = [str(q) for q in qids]
    if len(qids) != len(query_vectors):
      raise ValueError(f"{len(qids)} qids for {len(query_vectors)} query rows. Give one id "
                       "per query.")
    if len(set(qids)) != len(qids):
      raise ValueError("qids hold a duplicate id. Give every query a unique id.")
    scores, ids = self.search(query_vectors, query_valid, top_k, **search_kwargs)
    return {qid: {self.doc_ids[i]: float(s) for s, i in zip(row_scores, row_ids) if i >= 0}
            for qid, row_scores, row_ids in zip(qids, scores, ids)}


class Index(StoredIndex):
  """An opened index: memory-mapped vectors, offsets, doc ids and meta."""

  def __init__(self, directory: str, vectors: np.ndarray, offsets: np.ndarray,
               doc_ids: List[str], meta: Dict[str, Any]):
    self.directory = directory
    self.vectors = vectors  # [num_vectors, d], memory-mapped
    self.offsets = offsets  # [num_docs + 1] int64
    self.doc_ids = doc_ids
    self.meta = meta
    self._kept_chunks: Dict[int, List[Tuple[Any, Any, Any]]] = {}  # chunk size -> on device

  # ----------------------------------------------------------------------------- open
  @classmethod
  def open(cls, directory: str, expected_config: Optional[Mapping[str, Any]] = None
           ) -> "Index":
    """Opens the index in `directory`; with `expected_config`, refuses one built with a
    different encoder config (IndexConfigMismatchError)."""
    directory, meta, doc_ids = read_meta(directory, _FILES)
    check_npy(directory, "vectors.npy", (meta["num_vectors"], meta["dim"]), meta["dtype"])
    check_npy(directory, "offsets.npy", (meta["num_docs"] + 1,), "int64")
    offsets = np.load(os.path.join(directory, "offsets.npy"))
    if meta["num_vectors"] > 0:
      vectors = np.load(os.path.join(directory, "vectors.npy"), mmap_mode="r")
    else:  # a zero-length file region cannot be memory-mapped
      vectors = np.load(os.path.join(directory, "vectors.npy"))
    expected = {"vectors.npy shape": (meta["num_vectors"], meta["dim"]),
                "vectors.npy dtype": meta["dtype"], "offsets.npy length": meta["num_docs"] + 1,
                "doc_ids.json length": meta["num_docs"],
                "last offset": meta["num_vectors"]}
    found = {"vectors.npy shape": tuple(vectors.shape), "vectors.npy dtype": vectors.dtype.name,
             "offsets.npy length": len(offsets), "doc_ids.json length": len(doc_ids),
             "last offset": int(offsets[-1]) if len(offsets) else None}
    wrong = [f"{k}: {found[k]} (meta.json says {v})" for k, v in expected.items()
             if found[k] != v]
    if wrong:
      raise ValueError(f"The index in {directory} is inconsistent ({'; '.join(wrong)}). "
                       "Its files were changed after the build; rebuild the index.")
    return cls(directory, vectors, offsets, doc_ids, meta).checked(expected_config)

  # ----------------------------------------------------------------------------- sizes
  @property
  def num_vectors(self) -> int:
    return int(self.vectors.shape[0])

  @property
  def dim(self) -> int:
    return int(self.meta["dim"])

  @property
  def dtype(self) -> np.dtype:
    return self.vectors.dtype

  @property
  def nbytes(self) -> int:
    """Bytes of the stored vectors (the part that scales with the compression ratio)."""
    return int(self.vectors.nbytes)

  def doc_vectors(self, i: int) -> np.ndarray:
    """Document i's stored vectors `[count, d]` (possibly 0 rows)."""
    return self.vectors[self.offsets[i]:self.offsets[i + 1]]

  # ----------------------------------------------------------------------------- search
  def _chunk(self, start: int, size: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Docs [start, start + size) padded to (docs [size, bucket, d], valid [size, bucket],
    ids [size] with -1 past the corpus)."""
    stop = min(start + size, self.num_docs)
    counts = np.diff(self.offsets[start:stop + 1])  # [docs in chunk]
    bucket = _bucket(counts.max() if len(counts) else 0)
    docs = np.zeros((size, bucket, self.dim), self.dtype)  # [size, bucket, d]
    valid = np.zeros((size, bucket), bool)
    rows = np.repeat(np.arange(stop - start), counts)  # owner of each vector
    first = np.repeat(self.offsets[start:stop] - self.offsets[start], counts)
    cols = np.arange(len(rows)) - first  # place of each vector within its doc
    docs[rows, cols] = self.vectors[self.offsets[start]:self.offsets[stop]]
    valid[rows, cols] = True
    ids = np.full(size, -1, np.int32)
    ids[:stop - start] = np.arange(start, stop)
    return docs, valid, ids

  def _device_chunks(self, size: int) -> Iterable[Tuple[Any, Any, Any]]:
    """Every chunk of `size` docs, padded (`_chunk`) and on the device; kept for the next
    search when all of them fit `DECAL_INDEX_CACHE_MIB` (the last size searched only)."""
    if size in self._kept_chunks:
      yield from self._kept_chunks[size]
      return
    budget, used, kept = settings.get("DECAL_INDEX_CACHE_MIB") * 2**20, 0, []
    for start in range(0, self.num_docs, size):
      chunk = tuple(jnp.asarray(a) for a in self._chunk(start, size))  # docs, valid, ids
      used += sum(a.nbytes for a in chunk)
      if kept is not None and used <= budget:
        kept.append(chunk)
      else:
        kept = None  # over the budget: this search's chunks are not kept
      yield chunk
    self._kept_chunks = {size: kept} if kept else {}

  def search(self, query_vectors: np.ndarray, query_valid: np.ndarray, top_k: int = 100,
             doc_batch_size: int = 1024, query_batch_size: int = 32,
             precision: str = "highest") -> Tuple[np.ndarray, np.ndarray]:
    """Exact MaxSim top-k: query_vectors `[q, mq, d]`, query_valid `[q, mq]` ->
    (scores float32 `[q, k]`, doc indices int32 `[q, k]`), best first, with
    k = min(top_k, num_docs). Ties keep the lower doc index first. Peak device memory is
    about query_batch_size * doc_batch_size * mq * (padded doc vectors) floats.
    `precision` is the matmul precision ('highest' = exact float32 products on every
    backend; 'default' lets GPUs/TPUs use faster reduced-precision products)."""
    query_vectors, query_valid = check_queries(query_vectors, query_valid, self.dim)
    if top_k < 1 or doc_batch_size < 1 or query_batch_size < 1:
      raise ValueError("top_k, doc_batch_size and query_batch_size must be >= 1, got "
                       f"{top_k}, {doc_batch_size}, {query_batch_size}.")
    num_queries = query_vectors.shape[0]
    k = min(top_k, self.num_docs)
    if num_queries == 0:
      return np.zeros((0, k), np.float32), np.zeros((0, k), np.int32)
    qb = min(query_batch_size, num_queries)
    nb = -(-num_queries // qb)
    pad = nb * qb - num_queries
    queries = np.pad(query_vectors.astype(np.float32), ((0, pad), (0, 0), (0, 0)))
    queries = jnp.asarray(queries.reshape(nb, qb, *query_vectors.shape[1:]))  # [nb, qb, mq, d]
    qvalid = jnp.asarray(np.pad(query_valid, ((0, pad), (0, 0))).reshape(nb, qb, -1))
    scores = jnp.full((nb, qb, k), -jnp.inf, jnp.float32)  # running top-k
    ids = jnp.full((nb, qb, k), -1, jnp.int32)
    chunk = min(doc_batch_size, self.num_docs)
    for docs, valid, doc_ids in self._device_chunks(chunk):
      scores, ids = _score_chunk(queries, qvalid, scores, ids, docs, valid, doc_ids,
                                 top_k=k, precision=precision)
    scores = np.asarray(scores).reshape(nb * qb, k)[:num_queries]
    ids = np.asarray(ids).reshape(nb * qb, k)[:num_queries]
    return scores, ids
