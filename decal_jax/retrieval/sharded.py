"""Sharded indexing across the processes of a `jax.distributed` run, and search over the
shards: each process encodes its part of the corpus into index shards; a manifest joins them.

The corpus, in the order given, is cut into chunks of `chunk_docs` documents; chunk j (the
documents [j * chunk_docs, (j + 1) * chunk_docs)) becomes an ordinary exact index
(`index.build_index`) in `<directory>/shard-<j>/`, whose corpus fingerprint is the chunk's
own (its document count and a sha256 of its ids and texts, `chunk_fingerprint`). Of K
chunks, process p of P builds the contiguous block [p * K // P, (p + 1) * K // P): its
shard of the corpus. A chunk is batched and encoded by the same rule whichever process
builds it, so the shards' files do not depend on the number of processes: a 2-process
build writes the vectors a 1-process build writes, byte for byte.

Resume: a chunk whose folder holds a complete index built with the same encoder config
from the same documents is kept, not re-encoded; one built with another encoder config is
refused (`index_files.IndexConfigMismatchError`); one built from other documents (the corpus
changed there) is rebuilt. A chunk is written whole or not at all (`fileio.atomic_directory`),
so a build stopped at any moment resumes from its last finished chunk (the temporary
folder a hard kill leaves is deleted when that chunk is built again). Encoding shows one
progress bar per process (passages, passages/s, ETA).

When every process has finished its chunks (a barrier, `multihost_utils.sync_global_devices`;
the directory must be on a file system that every process sees), process 0 writes
`manifest.json` and every process opens the result (a second barrier):

    format_version, kind ('exact' or 'residual'), config + fingerprint (the encoder's, as in
    every shard's meta.json), corpus (the whole corpus's fingerprint, when given),
    chunk_docs, num_docs, num_vectors, dim, bytes, created, and
    shards: [{name, start, stop, num_docs, num_vectors, corpus}] in corpus order

A build in progress has no manifest (process 0 deletes the old one when it starts).
`ShardedIndex` reads the manifest, opens every shard (refusing one whose meta.json no longer
matches its manifest entry: `ShardMismatchError`), searches each shard for its top k and
merges the lists by score, then by global document index; so exact search over the shards
ranks as exact search over one index of the same documents in the same order.
`build_sharded_residual` compresses the shards of an exact sharded index (residual.py), each
process its own block, with one codec that process 0 trains on a sample of all the shards.
"""
import datetime
import glob
import hashlib
import json
import os
import shutil
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np
import tqdm

from decal_jax import fileio
from decal_jax.retrieval import codec as codec_lib
from decal_jax.retrieval import index, index_files, residual

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
DEFAULT_CHUNK_DOCS = 4096
KINDS = ("exact", "residual")

# The texts of one chunk -> batches (row numbers into those texts, tokens `[b, n]` whose
# first len(rows) rows are those texts'; rows past them are padding and dropped).
BatchesFn = Callable[[Sequence[str]], Iterable[Tuple[Sequence[int], np.ndarray]]]


class ShardMismatchError(ValueError):
  """A shard's folder no longer holds what manifest.json recorded for it."""


# ------------------------------------------------------------------------------- plan
def chunk_fingerprint(doc_ids: Sequence[str], texts: Sequence[str]) -> Dict[str, Any]:
  """{'num_docs', 'sha256'} of one chunk: a sha256 over one JSON line [id, text] per doc."""
  sha = hashlib.sha256()
  for doc_id, text in zip(doc_ids, texts):
    sha.update((json.dumps([doc_id, text], ensure_ascii=False) + "\n").encode("utf-8"))
  return {"num_docs": len(doc_ids), "sha256": sha.hexdigest()}


def chunk_ranges(num_docs: int, chunk_docs: int) -> List[Tuple[int, int]]:
  """[start, stop) of each chunk of `chunk_docs` documents (the last one may be shorter)."""
  return [(s, min(s + chunk_docs, num_docs)) for s in range(0, num_docs, chunk_docs)]


def process_block(num_chunks: int, process_index: int, process_count: int) -> range:
  """The chunks process `process_index` of `process_count` builds: a contiguous block."""
  return range(process_index * num_chunks // process_count,
               (process_index + 1) * num_chunks // process_count)


def shard_name(j: int) -> str:
  return f"shard-{j:05d}"


def _barrier(name: str) -> None:
  """Waits for every process of a multi-process run (nothing to wait for in one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _processes(process_index: Optional[int], process_count: Optional[int]) -> Tuple[int, int]:
  p = jax.process_index() if process_index is None else int(process_index)
  n = jax.process_count() if process_count is None else int(process_count)
  if not 0 <= p < n:
    raise ValueError(f"process_index {p} must lie in [0, process_count = {n}).")
  return p, n


def _check_corpus(doc_ids: Sequence[str], texts: Sequence[str], chunk_docs: int) -> None:
  if len(doc_ids) != len(texts):
    raise ValueError(f"{len(doc_ids)} doc_ids for {len(texts)} texts. Give one id per text.")
  if not doc_ids:
    raise ValueError("The corpus is empty. Index at least one document.")
  if len(set(doc_ids)) != len(doc_ids):
    raise ValueError("doc_ids hold a duplicate id. Give every document a unique id "
                     "(deduplicate the corpus).")
  if chunk_docs < 1:
    raise ValueError(f"chunk_docs must be >= 1 (documents per shard), got {chunk_docs}.")


# ------------------------------------------------------------------------------- build
def build_sharded_index(directory: str, doc_ids: Sequence[str], texts: Sequence[str],
                        batches: BatchesFn, encode_fn: index.EncodeFn,
                        config: Mapping[str, Any], *, chunk_docs: int = DEFAULT_CHUNK_DOCS,
                        dtype: str = "float16",
                        corpus_fingerprint: Optional[Mapping[str, Any]] = None,
                        progress: bool = True, process_index: Optional[int] = None,
                        process_count: Optional[int] = None) -> "ShardedIndex":
  """Builds (or resumes, or updates) the sharded index in `directory`; returns it opened.
  Every process of the run must call it with the same arguments (module doc).

  doc_ids, texts: the corpus in order (texts are what `batches` tokenizes, and what the
    chunk fingerprints hash). batches: a chunk's texts -> token batches (`BatchesFn`).
  encode_fn, config, dtype: as in `index.build_index`.
  process_index / process_count: default jax.process_index() / jax.process_count().
  """
  doc_ids, texts = [str(d) for d in doc_ids], list(texts)
  _check_corpus(doc_ids, texts, chunk_docs)
  p, n = _processes(process_index, process_count)
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  ranges = chunk_ranges(len(doc_ids), chunk_docs)
  block = [(j, *ranges[j]) for j in process_block(len(ranges), p, n)]
  fingerprints = {j: chunk_fingerprint(doc_ids[a:b], texts[a:b]) for j, a, b in block}
  todo = [(j, a, b) for j, a, b in block
          if not _finished(os.path.join(directory, shard_name(j)), config, fingerprints[j])]
  if p == 0 and os.path.exists(os.path.join(directory, MANIFEST)):
    os.remove(os.path.join(directory, MANIFEST))  # a build in progress has no manifest
  passages = sum(b - a for _, a, b in block)
  first, last = (block[0][0], block[-1][0]) if block else ("-", "-")
  print(f"Index shards in {directory}: process {p} of {n} builds shards {first}..{last} "
        f"({passages} passages); {len(block) - len(todo)} of them already finished, kept.",
        flush=True)
  bar = tqdm.tqdm(total=passages, initial=passages - sum(b - a for _, a, b in todo),
                  desc=f"index, process {p} of {n}", unit="passage", disable=not progress,
                  dynamic_ncols=True)
  with bar:
    for j, a, b in todo:
      _build_chunk(os.path.join(directory, shard_name(j)), doc_ids[a:b], texts[a:b],
                   batches, _counted(encode_fn, bar), config, dtype, fingerprints[j])
  _barrier(f"decal_jax sharded index built: {directory}")
  if p == 0:
    write_manifest(directory, "exact", ranges, config, chunk_docs, corpus_fingerprint)
  _barrier(f"decal_jax sharded index manifest: {directory}")
  return ShardedIndex.open(directory, expected_config=config)


def _finished(folder: str, config: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> bool:
  """True when `folder` holds this chunk's index, built with `config` from these documents
  (another config: IndexConfigMismatchError)."""
  if not os.path.exists(os.path.join(folder, "meta.json")):
    return False
  change = index.Index.open(folder, expected_config=config).corpus_change(fingerprint)
  if change:
    print(f"WARNING: the documents of {folder} changed since it was built ({change}); "
          "rebuilding that shard.", flush=True)
  return not change


def _counted(encode_fn: index.EncodeFn, bar: tqdm.tqdm) -> index.EncodeFn:
  """encode_fn, advancing the progress bar by the rows it encodes."""
  def encode(tokens: np.ndarray):
    out = encode_fn(tokens)
    bar.update(len(tokens))
    return out
  return encode


def _build_chunk(folder: str, doc_ids: List[str], texts: List[str], batches: BatchesFn,
                 encode_fn: index.EncodeFn, config: Mapping[str, Any], dtype: str,
                 fingerprint: Mapping[str, Any]) -> None:
  for leftover in glob.glob(glob.escape(folder) + ".tmp-*"):  # from a hard-killed build
    shutil.rmtree(leftover, ignore_errors=True)
  batched = [(list(rows), tokens) for rows, tokens in batches(texts)]
  ordered = [doc_ids[i] for rows, _ in batched for i in rows]
  index.build_index(folder, ordered, (np.asarray(t)[:len(rows)] for rows, t in batched),
                    encode_fn, config, dtype=dtype, progress=False, overwrite=True,
                    corpus_fingerprint=fingerprint)


def write_manifest(directory: str, kind: str, ranges: Sequence[Tuple[int, int]],
                   config: Mapping[str, Any], chunk_docs: int,
                   corpus_fingerprint: Optional[Mapping[str, Any]],
                   extra: Optional[Mapping[str, Any]] = None) -> None:
  """manifest.json for the shards shard-0 .. shard-(len(ranges) - 1) of `directory` (read
  from their meta.json); deletes shard folders past them (left by a larger corpus)."""
  shards, metas = [], []
  for j, (a, b) in enumerate(ranges):
    _, meta, _ = index_files.read_meta(os.path.join(directory, shard_name(j)), ["meta.json"])
    metas.append(meta)
    shards.append({"name": shard_name(j), "start": a, "stop": b, "num_docs": b - a,
                   "num_vectors": meta["num_vectors"], "corpus": meta.get("corpus")})
  for stale in glob.glob(os.path.join(glob.escape(directory), "shard-*")):
    name = os.path.basename(stale)
    if name.split(".")[0] == name and name not in {s["name"] for s in shards}:
      shutil.rmtree(stale, ignore_errors=True)
  manifest = {"format_version": FORMAT_VERSION, "kind": kind,
              "config": json.loads(index_files.canonical_config(config)),
              "fingerprint": index_files.config_fingerprint(config), "chunk_docs": chunk_docs,
              "num_docs": ranges[-1][1], "num_vectors": sum(s["num_vectors"] for s in shards),
              "dim": metas[0]["dim"], "bytes": sum(m["bytes"] for m in metas),
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "shards": shards, **(extra or {})}
  if corpus_fingerprint is not None:
    manifest["corpus"] = dict(corpus_fingerprint)
  fileio.write_text_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1))


# ------------------------------------------------------------------------------- residual
def build_sharded_residual(directory: str, source: "ShardedIndex",
                           config: residual.ResidualConfig = residual.ResidualConfig(),
                           progress: bool = False) -> "ShardedIndex":
  """Compresses every shard of the exact sharded index `source` into `directory`, with one
  codec for all, trained as `config` says (process 0 trains it on `config.sample_vectors`
  vectors drawn from every shard); each process compresses its own block of shards. Every
  process must call it."""
  if source.kind != "exact":
    raise ValueError(f"{source.directory} is a {source.kind} sharded index; compress an "
                     "exact one.")
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  codec_dir = os.path.join(directory, "codec")
  _barrier(f"decal_jax sharded residual start: {directory}")  # all have read the old manifest
  if jax.process_index() == 0:
    if os.path.exists(os.path.join(directory, MANIFEST)):
      os.remove(os.path.join(directory, MANIFEST))
    if source.num_vectors == 0:
      raise ValueError(f"The index in {source.directory} holds no vector: nothing to "
                       "cluster. Search it exactly.")
    codec, settings = residual.train(_AllVectors(source.shards), config)
    codec_lib.save_codec(codec_dir, codec, settings)
  _barrier(f"decal_jax sharded residual codec: {directory}")
  codec, settings = codec_lib.load_codec(codec_dir)
  block = process_block(len(source.shards), jax.process_index(), jax.process_count())
  for j in tqdm.tqdm(block, desc="compress shards", unit="shard", disable=not progress):
    residual.build_residual_index(os.path.join(directory, shard_name(j)), source.shards[j],
                                  reuse=residual.Reuse(codec=codec, codec_settings=settings),
                                  overwrite=True)
  _barrier(f"decal_jax sharded residual built: {directory}")
  if jax.process_index() == 0:
    ranges = [(s["start"], s["stop"]) for s in source.meta["shards"]]
    write_manifest(directory, "residual", ranges, source.config, source.meta["chunk_docs"],
                   source.meta.get("corpus"), {"codec": settings})
  _barrier(f"decal_jax sharded residual manifest: {directory}")
  return ShardedIndex.open(directory, expected_config=source.config)


class _AllVectors:
  """The vectors of every shard end to end, read as `codec_lib.train_codec` reads an index."""

  def __init__(self, shards: Sequence[index.Index]):
    self.shards = shards
    self.firsts = np.cumsum([0] + [s.num_vectors for s in shards])  # [shards + 1]
    self.num_vectors, self.dim = int(self.firsts[-1]), shards[0].dim

  @property
  def vectors(self) -> "_AllVectors":
    return self

  def __getitem__(self, rows: np.ndarray) -> np.ndarray:
    """Sorted global rows -> their vectors `[len(rows), d]` float32."""
    owner = np.searchsorted(self.firsts, rows, side="right") - 1  # [rows]
    return np.concatenate([np.asarray(shard.vectors[rows[owner == j] - self.firsts[j]],
                                      np.float32) for j, shard in enumerate(self.shards)])


# ------------------------------------------------------------------------------- open
class ShardedIndex(index.StoredIndex):
  """The shards a manifest lists, searched as one index (module doc)."""

  def __init__(self, directory: str, shards: List[index.StoredIndex], meta: Dict[str, Any]):
    self.directory = directory
    self.shards = shards
    self.meta = meta
    self.starts = np.asarray([s["start"] for s in meta["shards"]] + [meta["num_docs"]],
                             np.int64)  # [shards + 1]: the global index of each first doc
    self.doc_ids = [d for shard in shards for d in shard.doc_ids]

  @classmethod
  def open(cls, directory: str, expected_config: Optional[Mapping[str, Any]] = None
           ) -> "ShardedIndex":
    """Opens the sharded index in `directory`; refuses a shard that no longer matches the
    manifest (ShardMismatchError) and, with `expected_config`, an index built with another
    encoder config (IndexConfigMismatchError)."""
    directory = os.path.abspath(directory)
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
      raise FileNotFoundError(
          f"No sharded index at {directory} (no {MANIFEST}). A build that was stopped "
          "leaves its finished shards there without a manifest: run the same build again "
          "to finish it.")
    with open(path, encoding="utf-8") as f:
      meta = json.load(f)
    opener = index.Index.open if meta["kind"] == "exact" else residual.ResidualIndex.open
    shards = []
    for entry in meta["shards"]:
      shard = opener(os.path.join(directory, entry["name"]))
      _check_shard(directory, entry, meta, shard)
      shards.append(shard)
    return cls(directory, shards, meta).checked(expected_config)

  @property
  def kind(self) -> str:
    return self.meta["kind"]

  @property
  def dim(self) -> int:
    return int(self.meta["dim"])

  @property
  def num_vectors(self) -> int:
    return int(self.meta["num_vectors"])

  @property
  def nbytes(self) -> int:
    return sum(int(shard.nbytes) for shard in self.shards)

  def doc_vectors(self, i: int) -> np.ndarray:
    """Document i's vectors `[count, d]` (global index, manifest order)."""
    j = int(np.searchsorted(self.starts, i, side="right")) - 1
    return self.shards[j].doc_vectors(i - int(self.starts[j]))

  def search(self, query_vectors: np.ndarray, query_valid: np.ndarray, top_k: int = 100,
             **search_kwargs) -> Tuple[np.ndarray, np.ndarray]:
    """Each shard's top k (its own `search`, with `search_kwargs`), merged: (scores float32
    `[q, k]`, global doc indices int32 `[q, k]`), best first, ties by the lower index,
    k = min(top_k, num_docs); -1 / -inf past the documents found."""
    query_vectors, query_valid = index.check_queries(query_vectors, query_valid, self.dim)
    scores, ids = [], []
    for shard, start in zip(self.shards, self.starts):
      s, i = shard.search(query_vectors, query_valid, top_k, **search_kwargs)  # [q, k_shard]
      scores.append(s)
      ids.append(np.where(i >= 0, i.astype(np.int64) + start, -1))
    return merge_top_k(np.concatenate(scores, axis=1), np.concatenate(ids, axis=1),
                       min(top_k, self.num_docs))


def _check_shard(directory: str, entry: Mapping[str, Any], manifest: Mapping[str, Any],
                 shard: index.StoredIndex) -> None:
  recorded = {"encoder fingerprint": manifest["fingerprint"], "corpus": entry["corpus"],
              "num_docs": entry["num_docs"], "num_vectors": entry["num_vectors"]}
  found = {"encoder fingerprint": shard.fingerprint, "corpus": shard.meta.get("corpus"),
           "num_docs": shard.num_docs, "num_vectors": shard.num_vectors}
  wrong = [f"{k}: manifest {recorded[k]!r}, shard {found[k]!r}" for k in recorded
           if recorded[k] != found[k]]
  if wrong:
    raise ShardMismatchError(
        f"Shard {entry['name']} of {directory} no longer matches {MANIFEST} "
        f"({'; '.join(wrong)}): it was rebuilt or replaced after the manifest was written. "
        "Run the build again: it rebuilds what changed and writes a new manifest.")


def merge_top_k(scores: np.ndarray, ids: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
  """The best k of each row of (scores `[q, n]`, ids `[q, n]`, -1 = none): by score
  descending, then the lower id; rows with fewer than k ids end in -1 / -inf."""
  missing = ids < 0
  key_ids = np.where(missing, np.iinfo(np.int64).max, ids)
  key_scores = np.where(missing, np.inf, -scores.astype(np.float64))
  order = np.lexsort((key_ids, key_scores), axis=-1)[:, :k]  # [q, k]
  best_ids = np.take_along_axis(ids, order, axis=1)
  best = np.take_along_axis(scores, order, axis=1).astype(np.float32)
  return np.where(best_ids >= 0, best, -np.inf).astype(np.float32), best_ids.astype(np.int32)
