"""Search an index with text queries: a retrieval MODEL_DIR's dual encoder and its index.

    searcher = Searcher.open("runs/decal_tiny_retrieval", gin_files=[
        "models/decal_tiny.gin", "models/dual_encoder.gin"], query_length=16)
    for hit in searcher.search(["what is a list comprehension"], k=5):
      print(hit.doc_ids, hit.scores)

`Searcher.open` restores the latest checkpoint of MODEL_DIR with the model the gin files
configure (default: MODEL_DIR/config.gin, which a run of `python -m decal_jax.train`
writes), opens its index read-only and memory-mapped (default: the one index under
MODEL_DIR/index/ of that checkpoint; an exact, residual or sharded index, whichever the
folder holds), and refuses an index built by another encoder config or checkpoint
(`index_files.IndexConfigMismatchError`, as `python -m decal_jax.retrieve` does) or, when a
corpus is given, from another corpus (`CorpusMismatchError`). Queries are encoded
as the offline run encodes them (`retrieval_eval.TextEncoder`: the run's vocabulary, cut to
`query_length` tokens, the query-side compression ratio) and searched with exact MaxSim, or
approximately through a residual index (`nprobe`, `query_cells`, `candidates`, `backend`).
A batch of queries is padded only to the next of a few fixed heights (1, 2, 4, ...,
`batch_size`: `retrieval_eval.row_buckets`), each compiled once; `warm_up` compiles them
all before a server takes requests. The offline run pads every batch to `batch_size`, and
XLA sums in another order at another height, so scores equal the offline run's to float32
rounding (the same documents, in the same order, on the tests' fixtures).
"""
import dataclasses
import json
import os
import pathlib
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from decal_jax.retrieval import beir, index, residual, residual_search, sharded
from decal_jax.runtime import retrieval_eval

DEFAULT_QUERY_LENGTH = 64  # runs/retrieve.gin's QUERY_LENGTH
DEFAULT_BATCH_SIZE = 64    # runs/retrieve.gin's BATCH_SIZE: queries encoded together
SEARCH_BATCH = 32          # queries searched together; a batch is padded to a power of two


class CorpusMismatchError(ValueError):
  """The index was built from another corpus than the one given (both fingerprints named)."""


@dataclasses.dataclass
class SearchResult:
  """One query's top documents, best first (texts: with a corpus and `texts=True`)."""
  query: str
  doc_ids: List[str]
  scores: List[float]
  texts: Optional[List[str]] = None

  def as_dict(self) -> Dict[str, Any]:
    hits = [{"id": d, "score": s} for d, s in zip(self.doc_ids, self.scores)]
    for hit, text in zip(hits, self.texts or ()):
      hit["text"] = text
    return {"query": self.query, "hits": hits}


def index_kind(directory: str) -> str:
  """'exact', 'residual', 'sharded-exact' or 'sharded-residual': what the folder holds."""
  folder = pathlib.Path(directory)
  if (folder / sharded.MANIFEST).is_file():
    return "sharded-" + json.loads((folder / sharded.MANIFEST).read_text("utf-8"))["kind"]
  if not (folder / "meta.json").is_file():
    raise FileNotFoundError(f"{directory} holds no index (no meta.json or {sharded.MANIFEST}): "
                            "give the folder `python -m decal_jax.retrieve` built.")
  meta = json.loads((folder / "meta.json").read_text("utf-8"))
  return "residual" if "codec" in meta else "exact"


def open_index(directory: str, expected_config=None) -> index.StoredIndex:
  """The index in `directory`, of whichever kind it is (`index_kind`), checked against
  `expected_config` when given."""
  kind = index_kind(directory)
  opener = {"exact": index.Index.open, "residual": residual.ResidualIndex.open}.get(
      kind, sharded.ShardedIndex.open)
  return opener(directory, expected_config=expected_config)


def find_index(model_dir: str, step: int) -> str:
  """The one index folder under MODEL_DIR/index/ built from checkpoint `step`."""
  root = pathlib.Path(model_dir) / "index"
  found = sorted(str(p) for p in root.glob(f"*.step{step}*") if p.is_dir()
                 and ".tmp-" not in p.name and re.search(rf"\.step{step}(\.|$)", p.name)
                 and ((p / "meta.json").is_file() or (p / sharded.MANIFEST).is_file()))
  if len(found) == 1:
    return found[0]
  if not found:
    raise FileNotFoundError(
        f"No index of checkpoint {step} under {root}: build one with `python -m "
        f"decal_jax.retrieve --gin.MODEL_DIR=... ...`, or give index_dir.")
  raise ValueError(f"{len(found)} indexes of checkpoint {step} under {root} "
                   f"({', '.join(pathlib.Path(f).name for f in found)}): give index_dir "
                   "to choose one.")


def read_corpus_texts(corpus: str) -> tuple:
  """({doc id: full text}, fingerprint) of a BEIR folder or its corpus.jsonl."""
  path = pathlib.Path(corpus)
  if path.is_dir():
    path = path / beir.CORPUS_FILE
  digest = beir.CorpusDigest()
  passages = beir.read_corpus(path, digest)
  return {d: p.full_text for d, p in passages.items()}, digest.fingerprint()


def _model(gin_files: Optional[Sequence[str]], model_dir: str, bindings: Sequence[str],
           search_paths: Sequence[str]):
  """(the gin-configured MODEL, the gin QUERY_LENGTH or None); gin cleared afterwards."""
  import gin
  from decal_jax.runtime import gin_utils
  if not gin_files:
    saved = pathlib.Path(model_dir) / "config.gin"
    if not saved.is_file():
      raise FileNotFoundError(
          f"{model_dir} has no config.gin: give the gin files the dual encoder was trained "
          "with (e.g. models/decal_tiny.gin and models/dual_encoder.gin).")
    gin_files = [str(saved)]
  if "MODEL_DIR" in gin_utils.required_macros(gin_files, search_paths, bindings):
    bindings = [*bindings, f"MODEL_DIR = {str(model_dir)!r}"]  # a run file's (retrieve.gin)
  try:
    model = gin_utils.load_model(gin_files, search_paths=search_paths, bindings=bindings).model
    try:
      query_length = gin.query_parameter("%QUERY_LENGTH")
    except ValueError:
      query_length = None
    return model, query_length
  finally:
    gin.clear_config()


class Searcher:
  """Text queries -> top documents (module doc). Thread-compatible: one search at a time
  (the server calls it from one worker)."""

  def __init__(self, model, encoder: retrieval_eval.TextEncoder, corpus_index,
               step: int, model_dir: str, texts: Optional[Dict[str, str]] = None,
               search_kwargs: Optional[Dict[str, Any]] = None):
    self.model, self.encoder, self.index = model, encoder, corpus_index
    self.step, self.model_dir, self.texts = step, model_dir, texts
    self.search_kwargs = dict(search_kwargs or {})
    self.kind = index_kind(corpus_index.directory)

  @classmethod
  def open(cls, model_dir: str, index_dir: Optional[str] = None, *,
           gin_files: Optional[Sequence[str]] = None, bindings: Sequence[str] = (),
           search_paths: Sequence[str] = (), corpus: Optional[str] = None,
           query_length: Optional[int] = None, batch_size: int = DEFAULT_BATCH_SIZE,
           nprobe: int = residual_search.DEFAULT_NPROBE,
           query_cells: int = residual_search.DEFAULT_QUERY_CELLS,
           candidates: Optional[int] = None,
           backend: str = residual_search.DEFAULT_BACKEND) -> "Searcher":
    """Restores MODEL_DIR's latest checkpoint and opens its index (module doc). corpus: a
    BEIR folder or corpus.jsonl: the index must have been built from it, and results can
    carry its texts. query_length: None: the gin QUERY_LENGTH (runs/retrieve*.gin bind it),
    else DEFAULT_QUERY_LENGTH. The approximate settings apply to a residual index only."""
    residual_search.check_count("batch_size", batch_size, 1)
    model, gin_query_length = _model(gin_files, model_dir, bindings, search_paths)
    if query_length is None:
      query_length = gin_query_length or DEFAULT_QUERY_LENGTH
    residual_search.check_count("query_length", query_length, 2)
    params, step = retrieval_eval.restore_encoder(model, model_dir, query_length, query_length)
    directory = index_dir or find_index(model_dir, step)
    passage_length = _built_passage_length(directory)
    config = retrieval_eval.index_config(model, passage_length, model_dir, step)
    corpus_index = open_index(directory, expected_config=config)
    texts = None
    if corpus is not None:
      texts, fingerprint = read_corpus_texts(corpus)
      change = corpus_index.corpus_change(fingerprint)
      if change:
        raise CorpusMismatchError(
            f"The index at {directory} was not built from the corpus {corpus} ({change}). "
            "Give the corpus it was built from, or rebuild it with `python -m "
            "decal_jax.retrieve`.")
    kwargs = {}
    if index_kind(directory).endswith("residual"):
      residual_search.check_backend(backend)
      residual_search.check_settings(1, nprobe, query_cells, candidates)
      kwargs = {"nprobe": nprobe, "query_cells": query_cells, "candidates": candidates,
                "backend": backend}
    encoder = retrieval_eval.TextEncoder(model, params, "query", query_length, batch_size,
                                         bucket_rows=True)
    return cls(model, encoder, corpus_index, step, model_dir, texts, kwargs)

  def info(self) -> Dict[str, Any]:
    """What is served: model, checkpoint, compression ratios, index, corpus, search."""
    config = self.model.module.config
    return {"model": type(self.model).__name__, "model_dir": os.path.abspath(self.model_dir),
            "step": self.step,
            "query_compression_ratio": int(config.query_compression_ratio),
            "passage_compression_ratio": int(config.passage_compression_ratio),
            "index_kind": self.kind, "index_fingerprint": self.index.fingerprint,
            "corpus_fingerprint": self.index.meta.get("corpus"),
            "num_docs": self.index.num_docs, "query_length": self.encoder.max_length,
            "search": "approximate" if self.search_kwargs else "exact",
            "search_backend": self.search_kwargs.get("backend", "jax"),
            "texts": self.texts is not None}

  def encode(self, queries: Sequence[str]):
    """(vectors `[q, m, d]`, valid `[q, m]`) of the queries, as the offline run encodes."""
    return self.encoder(queries)

  def search(self, queries: Sequence[str], k: int = 10, texts: bool = False
             ) -> List[SearchResult]:
    """The top `k` documents of each query, in order (texts: needs a corpus), encoded and
    searched `batch_size` queries at a time."""
    size = self.encoder.batch_size
    return [r for start in range(0, len(queries), size)
            for r in self.search_together([(queries[start:start + size], k, texts)])[0]]

  def search_together(self, requests: Sequence[Tuple[Sequence[str], int, bool]]
                      ) -> List[List[SearchResult]]:
    """Several requests (queries, k, texts) answered with one encoder call over all their
    queries (a server's micro-batch); each k searched once, over the queries that ask
    for it. -> each request's results, in order."""
    for _, k, texts in requests:
      residual_search.check_count("k", k, 1)
      if texts and self.texts is None:
        raise ValueError("texts=True needs the corpus: open the Searcher with corpus=...")
    queries = [q for request in requests for q in request[0]]
    if not queries:
      return [[] for _ in requests]
    vectors, valid = self.encode(queries)
    starts = np.cumsum([0] + [len(r[0]) for r in requests])
    answers: List[List[SearchResult]] = [[] for _ in requests]
    for k in sorted({r[1] for r in requests}):
      mine = [j for j, r in enumerate(requests) if r[1] == k and r[0]]
      if not mine:
        continue
      rows = np.concatenate([np.arange(starts[j], starts[j + 1]) for j in mine])
      scores, ids = self._search_vectors(vectors[rows], valid[rows], k)
      for j in mine:
        at = np.searchsorted(rows, np.arange(starts[j], starts[j + 1]))
        answers[j] = [self._result(q, s, i, requests[j][2])
                      for q, s, i in zip(requests[j][0], scores[at], ids[at])]
    return answers

  def warm_up(self, k: int = 10) -> int:
    """Compiles, before serving, every encoder shape (`TextEncoder.shapes`) and the search
    of every padded query count up to batch_size at `k`, so that no request waits for a
    compile. -> the number of encoder and search shapes run."""
    per_width = self.encoder.warm_up()
    counts = sorted({_padded_count(n) for n in range(1, self.encoder.batch_size + 1)}
                    if self.kind.endswith("exact") else [1])
    dim = int(self.index.dim)
    for m in sorted(set(per_width.values())):
      for n in counts:
        vectors = np.zeros((n, m, dim), np.float32)  # [n, m, d]
        self._search_vectors(vectors, np.ones((n, m), bool), k)
    return len(self.encoder.shapes()) + len(set(per_width.values())) * len(counts)

  def _search_vectors(self, vectors: np.ndarray, valid: np.ndarray, k: int):
    """The index's top k of each query. Exact search is jitted: there the query count is
    padded (with empty queries) to `_padded_count`, so that few shapes compile."""
    n = len(vectors)
    if self.kind.endswith("exact"):
      padded = _padded_count(n)
      vectors = np.pad(vectors, ((0, padded - n), (0, 0), (0, 0)))
      valid = np.pad(valid, ((0, padded - n), (0, 0)))
    scores, ids = self.index.search(vectors, valid, k, **self.search_kwargs)
    return scores[:n], ids[:n]

  def _result(self, query: str, scores: np.ndarray, ids: np.ndarray, texts: bool
              ) -> SearchResult:
    kept = [(self.index.doc_ids[i], float(s)) for s, i in zip(scores, ids) if i >= 0]
    doc_ids = [d for d, _ in kept]
    return SearchResult(query, doc_ids, [s for _, s in kept],
                        [self.texts.get(d, "") for d in doc_ids] if texts else None)


def _padded_count(n: int) -> int:
  """n queries padded to a power of two up to SEARCH_BATCH, then to a multiple of it."""
  step = SEARCH_BATCH if n > SEARCH_BATCH else 1 << (n - 1).bit_length()
  return -(-n // step) * step


def _built_passage_length(directory: str) -> int:
  """The passage length the index's meta.json (or manifest) records in its config."""
  folder = pathlib.Path(directory)
  name = sharded.MANIFEST if (folder / sharded.MANIFEST).is_file() else "meta.json"
  return int(json.loads((folder / name).read_text("utf-8"))["config"]["passage_length"])
