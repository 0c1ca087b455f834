"""Index a corpus with a trained dual encoder, search it, and score the run (NDCG@10,
Recall@100): what `python -m decal_jax.retrieve` runs.

Passages are tokenized with the model's vocabulary, grouped by length into a few padded
widths (so the jitted encoder compiles a handful of shapes, not one per batch), encoded at
the passage ratio and written to an on-disk index (`index.build_index`). The index
remembers the encoder config and checkpoint it was built with, and the corpus fingerprint
(`beir.CorpusDigest`: document count and a hash of ids, titles and texts); a later run
with the same model, checkpoint and corpus reuses it, another model or checkpoint is
refused, and a changed corpus (a BEIR folder edited in place) rebuilds it with a WARNING
naming the folder and the document counts. Queries are encoded at the query ratio and
searched with exact MaxSim (scored: NDCG@10 and Recall@100 as before, plus BEIR's full
set and MRR@10, `ir_metrics.beir_measures`), or with `search='approximate'` through a residual-compressed
copy of the index (`residual.py`: centroid ids + `residual_bits`-bit residual codes, kept
beside the exact index as `<index>.residual-b<bits>` and rebuilt when the corpus or the codec
settings change) whose candidates come from each query vector's `nprobe` nearest centroids
and whose best `candidates` documents are reranked with exact MaxSim (residual_search.py),
by the backend `search_backend` names ('numpy' or 'compiled': the same stages; recorded in
the metrics JSON and the results' file names, so that two backends never share a file).
The run is written in TREC format next to a metrics JSON, under MODEL_DIR/retrieval/; the
metrics record the corpus fingerprint, and the results of another corpus (an index rebuilt
for an edited corpus) are kept as `<stem>.corpus-<sha256[:12]>.*`, never overwritten.
Empty queries are scored (as EOS alone) with a WARNING from `beir.load_beir`, and counted
in the metrics JSON (`empty_queries`).
"""
import contextlib
import dataclasses
import json
import os
import pathlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax import fileio, metrics, partitioning
from decal_jax.runtime import train_state
from decal_jax.data.batches import DatasetConfig
from decal_jax.retrieval import (beir, index, index_files, ir_metrics, residual, residual_search,
                                 sharded)
from decal_jax.retrieval import codec as codec_lib

EOS_ID = 1
SEARCHES = ("exact", "approximate")
# The gin macros of runs/retrieve.gin that bind evaluate_retrieval's search settings.
SEARCH_MACROS = {"top_k": "TOP_K", "nprobe": "NPROBE", "query_cells": "QUERY_CELLS",
                 "candidates": "CANDIDATES", "residual_bits": "RESIDUAL_BITS",
                 "num_centroids": "NUM_CENTROIDS", "quantizer": "QUANTIZER",
                 "centroid_probe": "CENTROID_PROBE", "index_dtype": "INDEX_DTYPE"}


# What runs exact search (retrieval/index.py: batched MaxSim matmuls on JAX's default device,
# float32 'highest' precision), recorded as the metrics' `backend` beside approximate
# search's numpy / compiled.
EXACT_BACKEND = "jax"

def _binding(arg: str) -> str:
  """'NPROBE (retrieval_eval.evaluate_retrieval.nprobe)': how a message names a setting."""
  return f"{SEARCH_MACROS[arg]} (retrieval_eval.evaluate_retrieval.{arg})"


def tokenize(texts: Sequence[str], vocabulary, max_length: int) -> List[List[int]]:
  """Each text -> ids cut to `max_length - 1`, then EOS (an empty text is just EOS)."""
  if max_length < 2:
    raise ValueError(f"max_length must be >= 2 (one token and EOS), got {max_length}.")
  return [list(vocabulary.encode(t))[:max_length - 1] + [EOS_ID] for t in texts]


def length_buckets(max_length: int, smallest: int = 32) -> List[int]:
  """Padded widths: smallest, 2 * smallest, ... , max_length."""
  widths, w = [], smallest
  while w < max_length:
    widths.append(w)
    w *= 2
  return widths + [max_length]


def batches_by_length(ids: Sequence[List[int]], batch_size: int, max_length: int):
  """Yields (row indices, tokens `[batch_size, width]`), rows sorted by length and padded to
  the smallest bucket that holds them; the last batch of a bucket is padded with zero rows
  (only the first len(indices) rows are real)."""
  widths = length_buckets(max_length)
  order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
  groups: Dict[int, List[int]] = {}
  for i in order:
    width = next(w for w in widths if len(ids[i]) <= w)
    groups.setdefault(width, []).append(i)
  for width, rows in groups.items():
    for start in range(0, len(rows), batch_size):
      chunk = rows[start:start + batch_size]
      tokens = np.zeros((batch_size, width), np.int32)
      for r, i in enumerate(chunk):
        tokens[r, :len(ids[i])] = ids[i]
      yield chunk, tokens


def encoder_fn(model, params, side: str) -> Callable[[np.ndarray], Tuple[np.ndarray, np.ndarray]]:
  """tokens `[b, n]` -> (vectors `[b, m, d]` float32, valid `[b, m]`) on the host."""
  encode = jax.jit(lambda p, t: model.encode(p, t, side))

  def run(tokens: np.ndarray):
    out = encode(params, jnp.asarray(tokens, jnp.int32))
    return np.asarray(out.vectors, np.float32), np.asarray(out.valid, bool)
  return run


def row_buckets(batch_size: int) -> List[int]:
  """Padded batch heights: 1, 2, 4, ... below batch_size, then batch_size."""
  return [1 << i for i in range(max(batch_size - 1, 0).bit_length())
          if 1 << i < batch_size] + [batch_size]


class TextEncoder:
  """Texts -> (vectors `[len, m_max, d]` float32, valid `[len, m_max]`), in input order, one
  side ('query' or 'passage': its compression ratio) of a dual encoder: the model's own
  vocabulary, cut to `max_length` tokens (EOS included), batched by length in
  `batch_size`-row batches. One jitted encoder, kept: the offline run and a server
  (`searcher.Searcher`) encode alike, and a long-lived caller compiles each width once.
  bucket_rows: a batch is padded only to the smallest of `row_buckets(batch_size)` that
  holds it, not to batch_size (a server's micro-batch of 3 queries costs a 4-row call);
  each (height, width) compiles once (`warm_up` compiles them all)."""

  def __init__(self, model, params, side: str, max_length: int, batch_size: int,
               bucket_rows: bool = False):
    self.model, self.side = model, side
    self.max_length, self.batch_size = max_length, batch_size
    self.heights = row_buckets(batch_size) if bucket_rows else [batch_size]
    self._run = encoder_fn(model, params, side)

  def shapes(self) -> List[Tuple[int, int]]:
    """Every token shape `[rows, width]` the encoder may be called with."""
    return [(h, w) for w in length_buckets(self.max_length) for h in self.heights]

  def warm_up(self) -> Dict[int, int]:
    """Compiles every shape of `shapes()`. -> {width: vectors per text at that width}."""
    return {w: self._run(np.zeros((h, w), np.int32))[0].shape[1] for h, w in self.shapes()}

  def __call__(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
    ids = tokenize(texts, self.model.input_vocabulary, self.max_length)
    parts: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
    for rows, tokens in batches_by_length(ids, self.batch_size, self.max_length):
      height = next(h for h in self.heights if len(rows) <= h)
      vectors, valid = self._run(tokens[:height])  # [height, m, d], [height, m]
      for r, i in enumerate(rows):
        parts[i] = (vectors[r], valid[r])
    m = max(v.shape[0] for v, _ in parts.values())
    d = next(iter(parts.values()))[0].shape[-1]
    vectors = np.zeros((len(texts), m, d), np.float32)
    valid = np.zeros((len(texts), m), bool)
    for i, (v, ok) in parts.items():
      vectors[i, :v.shape[0]], valid[i, :ok.shape[0]] = v, ok
    return vectors, valid


def encode_texts(texts: Sequence[str], model, params, side: str, max_length: int,
                 batch_size: int):
  """Encodes texts in input order -> (vectors `[len, m_max, d]`, valid `[len, m_max]`)."""
  return TextEncoder(model, params, side, max_length, batch_size)(texts)


def restore_encoder(model, model_dir: str, query_length: int, passage_length: int,
                    task_name: Optional[str] = None, split: str = "test", partitioner=None):
  """(host params, step) of the latest checkpoint in `model_dir` (the run's vocabulary
  checked against the model's: `train_state.restore_params`)."""
  partitioner = partitioner or partitioning.Partitioner()
  lengths = {"inputs": query_length, "targets": passage_length}
  cfg = DatasetConfig(task_name or "decal_beir_builtin", lengths, split=split)
  params, step = train_state.restore_params(model, model_dir, cfg, partitioner)
  return host_params(params), step


def index_config(model, passage_length: int, model_dir: str, step: int) -> Dict:
  """What an index depends on: the network config, passage length, vocabulary, checkpoint."""
  network = json.loads(json.dumps(dataclasses.asdict(model.module.config), default=str))
  return {"network": network, "passage_length": passage_length,
          "vocabulary": str(model.input_vocabulary),
          "checkpoint": f"{model_dir if fileio.is_url(model_dir) else os.path.abspath(model_dir)}"
                        f"@{step}"}


def build_or_open_index(directory: str, data: beir.BeirData, model, params, config: Dict,
                        passage_length: int, batch_size: int, dtype: str = "float16"):
  """The corpus index at `directory`: reused when it exists and was built with `config`
  from this corpus (another config is refused: IndexConfigMismatchError); rebuilt, with a
  WARNING, when the corpus changed since or one of its files is damaged (a truncated
  vectors.npy: `index_files.DamagedIndexError`); else built. A build replaces the old index only
  when complete (`fileio.atomic_directory`)."""
  if (pathlib.Path(directory) / "meta.json").exists():
    existing = _open_unless_damaged(index.Index.open, directory, config)
    if existing is not None:
      change = existing.corpus_change(data.corpus_fingerprint)
      if not change:
        print(f"Reusing the index at {directory}.", flush=True)
        return existing
      del existing  # its memory-mapped vectors: the rebuild replaces the folder
      partitioning.log(f"WARNING: the corpus {pathlib.Path(data.folder) / beir.CORPUS_FILE} "
                       f"changed since the index at {directory} was built ({change}); "
                       "rebuilding the index.")
  doc_ids = list(data.corpus)
  ids = tokenize([data.corpus[d].full_text for d in doc_ids], model.input_vocabulary,
                 passage_length)
  batched = list(batches_by_length(ids, batch_size, passage_length))
  ordered_ids = [doc_ids[i] for rows, _ in batched for i in rows]
  run = encoder_fn(model, params, "passage")
  token_batches = (tokens[:len(rows)] for rows, tokens in batched)  # real rows only
  return index.build_index(directory, ordered_ids, token_batches,
                           _padded_to(batch_size, run), config, dtype=dtype, overwrite=True,
                           corpus_fingerprint=data.corpus_fingerprint)


def _open_unless_damaged(open_fn, directory: str, config: Dict):
  """The index `open_fn` opens at `directory`, or None, with a WARNING naming the damaged
  file, when one of its files does not hold what its meta.json says (a truncated
  vectors.npy): the caller rebuilds it, replacing the folder only once the new one is
  complete. A damaged index of another encoder config is not replaced: its error is
  raised (as an intact one's IndexConfigMismatchError is)."""
  try:
    return open_fn(directory, expected_config=config)
  except index_files.DamagedIndexError as e:
    if _fingerprint_of(directory) not in (None, index_files.config_fingerprint(config)):
      raise
    problem = str(e).split(" The index cannot be searched", 1)[0]
    partitioning.log(f"WARNING: {problem} Rebuilding the index at {directory}.")
    return None


def _fingerprint_of(directory: str) -> Optional[str]:
  """The encoder-config fingerprint an index's meta.json records (None: unreadable)."""
  try:
    return json.loads(fileio.read_utf8(pathlib.Path(directory) / "meta.json")).get("fingerprint")
  except (ValueError, OSError, AttributeError):
    return None


def _codec_settings(config: residual.ResidualConfig) -> Dict:
  """The codec settings an existing residual index must have been built with to be reused
  (an index of another quantizer, e.g. one built before 'rotated-lloyd', is rebuilt; one
  encoded exhaustively serves any centroid_probe, a probed one is rebuilt for another)."""
  settings = {"bits": config.bits, "seed": config.seed,
              "quantizer": codec_lib.quantizer_setting(config.bits, config.quantizer)}
  settings.update(
      {"num_centroids": config.num_centroids} if config.num_centroids is not None else {},
      **({"centroid_probe": config.centroid_probe} if config.centroid_probe else {}))
  return settings


def build_or_open_residual(directory: str, data: beir.BeirData, exact_index: index.Index,
                           config: residual.ResidualConfig) -> residual.ResidualIndex:
  """The residual-compressed copy of `exact_index` at `directory`: reused when built with
  the same encoder config (another is refused), corpus and codec settings (`config`);
  else (re)built from `exact_index`, with a WARNING when the corpus changed."""
  settings = _codec_settings(config)
  if (pathlib.Path(directory) / "meta.json").exists():
    existing = _open_unless_damaged(residual.ResidualIndex.open, directory, exact_index.config)
    if existing is not None:
      corpus, codec = (existing.corpus_change(data.corpus_fingerprint),
                       existing.settings_change(settings))
      if not corpus and not codec:
        print(f"Reusing the residual index at {directory}.", flush=True)
        return existing
      del existing  # its memory maps: the rebuild replaces the folder
      why = (f"WARNING: the corpus changed since the residual index at {directory} was built "
             f"({corpus})") if corpus else f"the codec settings changed ({codec})"
      partitioning.log(f"{why}; rebuilding the residual index.")
  return residual.build_residual_index(directory, exact_index, config, overwrite=True,
                                       progress=True)


def build_sharded(directory: str, data: beir.BeirData, model, params, config: Dict,
                  passage_length: int, batch_size: int, dtype: str = "float16",
                  chunk_docs: int = sharded.DEFAULT_CHUNK_DOCS) -> sharded.ShardedIndex:
  """The corpus index as shards of `chunk_docs` passages at `directory`, this process
  encoding its block of them (`sharded.build_sharded_index`: finished shards of this
  corpus and config are kept, changed ones rebuilt, another config refused)."""
  doc_ids = list(data.corpus)
  texts = [data.corpus[d].full_text for d in doc_ids]

  def batches(chunk_texts):
    ids = tokenize(chunk_texts, model.input_vocabulary, passage_length)
    return batches_by_length(ids, batch_size, passage_length)
  run = _padded_to(batch_size, encoder_fn(model, params, "passage"))
  return sharded.build_sharded_index(directory, doc_ids, texts, batches, run, config,
                                     chunk_docs=chunk_docs, dtype=dtype,
                                     corpus_fingerprint=data.corpus_fingerprint)


def sharded_residual(directory: str, data: beir.BeirData, source: sharded.ShardedIndex,
                     config: residual.ResidualConfig) -> sharded.ShardedIndex:
  """The residual-compressed copy of the sharded index `source` at `directory`: reused when
  built from this corpus with the same encoder config and codec settings, else (re)built."""
  settings = _codec_settings(config)
  if (pathlib.Path(directory) / sharded.MANIFEST).exists():
    existing = sharded.ShardedIndex.open(directory, expected_config=source.config)
    built = existing.meta["codec"]
    if not existing.corpus_change(data.corpus_fingerprint) and all(
        built.get(k) == v for k, v in settings.items()):
      print(f"Reusing the residual index at {directory}.", flush=True)
      return existing
    del existing  # its memory maps: the rebuild replaces the shards
  return sharded.build_sharded_residual(directory, source, config, progress=True)


def host_params(params):
  """The parameters as host arrays on every process (a multi-process run restores them as
  global arrays over every process's devices; each process encodes its own shard alone)."""
  if jax.process_count() == 1:
    return params
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(params, tiled=True)


def _padded_to(batch_size: int, run):
  """Runs `run` on a batch padded to `batch_size` rows (one jit shape per width) and
  returns the real rows only."""
  def encode(tokens: np.ndarray):
    n = tokens.shape[0]
    vectors, valid = run(np.pad(tokens, ((0, batch_size - n), (0, 0))))
    return vectors[:n], valid[:n]
  return encode


def evaluate_retrieval(*, model, model_dir: str, task_name: Optional[str] = None,
                       beir_folder: Optional[str] = None, split: str = "test",
                       query_length: int = 64, passage_length: int = 256,
                       batch_size: int = 64, top_k: int = 100, index_dir: Optional[str] = None,
                       index_dtype: str = "float16", search: str = "exact",
                       nprobe: int = residual_search.DEFAULT_NPROBE,
                       query_cells: int = residual_search.DEFAULT_QUERY_CELLS,
                       candidates: Optional[int] = None,
                       search_backend: str = residual_search.DEFAULT_BACKEND,
                       residual_bits: Optional[int] = 2, num_centroids: Optional[int] = None,
                       quantizer: str = codec_lib.DEFAULT_QUANTIZER,
                       centroid_probe: int = 0,
                       shard_docs: Optional[int] = None,
                       partitioner=None) -> Dict[str, float]:
  """Indexes the corpus of a BEIR folder (or of the BEIR task `task_name`) with the latest
  checkpoint in `model_dir`, searches the `split` queries and scores the run. Writes
  MODEL_DIR/retrieval/<name>.<split>.step<N>.trec and .metrics.json (approximate search:
  <name>.<split>.step<N>.approximate-<backend>-b<bits>-nprobe<n>-query<m>-candidates<c>
  [-<quantizer>].*,
  the quantizer named when it is not the default, a sharded index:
  <name>.<split>.step<N>.shards[.approximate-...].*, so that a run never overwrites another
  search's or another setting's results); returns the metrics.
  search: 'exact' (MaxSim over every document) or 'approximate' (module doc; nprobe,
  query_cells (both residual.ResidualIndex.search's), candidates (None:
  residual_search.default_candidates), search_backend 'numpy' or 'compiled' (numba: the
  same stages, faster; recorded in the metrics and the file names as `backend`),
  residual_bits in 1, 2, 4, 8 or None, num_centroids default
  ColBERTv2's, quantizer one of codec.QUANTIZERS, centroid_probe > 0:
  the build's nearest-centroid search two-level; all four residual.ResidualConfig's).
  shard_docs: index in shards of this many passages (`sharded.py`; resumable), each process
  of a multi-process run encoding its block of them; a multi-process run shards even
  without it (sharded.DEFAULT_CHUNK_DOCS). The sharded index goes to `<index>.shards/`."""
  if search not in SEARCHES:
    raise ValueError(f"search must be one of {SEARCHES}, got {search!r} (gin: SEARCH).")
  residual_search.check_count(_binding("top_k"), top_k, 1)
  if index_dtype not in index.DTYPES:
    raise ValueError(f"{_binding('index_dtype')} = {index_dtype!r}: must be one of "
                     f"{', '.join(map(repr, index.DTYPES))}.")
  if search == "approximate":  # checked before any encoding, not after the build
    residual_search.check_backend(search_backend)
    residual_search.check_settings(top_k, nprobe, query_cells, candidates,
                                   {k: _binding(k) for k in SEARCH_MACROS})
    residual.check_settings(
        dict(bits=residual_bits, num_centroids=num_centroids, quantizer=quantizer,
             centroid_probe=centroid_probe),
        {"bits": _binding("residual_bits"), "num_centroids": _binding("num_centroids"),
         "quantizer": _binding("quantizer"), "centroid_probe": _binding("centroid_probe")})
  from decal_jax.tasks import retrieval_tasks  # registers the tasks; reads their folders
  if (task_name is None) == (beir_folder is None):
    raise ValueError("Give exactly one of task_name (a decal_beir_<name> task) or "
                     "beir_folder (a BEIR-format folder).")
  folder = beir_folder or retrieval_tasks.beir_folder(task_name)
  name = task_name or pathlib.Path(folder).name
  data = beir.load_beir(folder, split)
  params, step = restore_encoder(model, model_dir, query_length, passage_length, task_name,
                                 split, partitioner)
  config = index_config(model, passage_length, model_dir, step)
  if shard_docs is None and jax.process_count() > 1:
    shard_docs = sharded.DEFAULT_CHUNK_DOCS
  stem = f"{name}.step{step}" + ("" if shard_docs is None else ".shards")
  directory = index_dir or fileio.join(model_dir, "index", stem)
  with contextlib.ExitStack() as mirrors:  # a remote index: searched from a local copy
    scores = _index_and_search(mirrors, directory, data, model, params, config, name, split,
                               step, shard_docs, dict(
                                   passage_length=passage_length, batch_size=batch_size,
                                   index_dtype=index_dtype, query_length=query_length,
                                   top_k=top_k, search=search, residual_bits=residual_bits,
                                   quantizer=quantizer, num_centroids=num_centroids,
                                   centroid_probe=centroid_probe, nprobe=nprobe,
                                   query_cells=query_cells, candidates=candidates,
                                   search_backend=search_backend))
  _write_results(model_dir, scores.pop("_results"), name, split, step, scores.pop("_run"),
                 scores, top_k)
  return scores


def _index_and_search(mirrors: contextlib.ExitStack, directory: str, data, model, params,
                      config: Dict, name: str, split: str, step: int, shard_docs, s: Dict):
  """`evaluate_retrieval`'s index build or reuse and search (`s`: its search settings);
  the scores, with the run and the results' stem under '_run' and '_results'. A remote
  index folder (gs://...) is built and searched in its `fileio.local_mirror`, and uploaded
  when built."""
  passage_length, batch_size, index_dtype = (s["passage_length"], s["batch_size"],
                                             s["index_dtype"])
  query_length, top_k, search = s["query_length"], s["top_k"], s["search"]
  residual_bits, quantizer, search_backend = s["residual_bits"], s["quantizer"], s["search_backend"]
  nprobe, query_cells, candidates = s["nprobe"], s["query_cells"], s["candidates"]
  num_centroids, centroid_probe = s["num_centroids"], s["centroid_probe"]
  remote = directory
  directory = mirrors.enter_context(fileio.local_mirror(remote))
  if shard_docs is None:
    corpus_index = build_or_open_index(directory, data, model, params, config,
                                       passage_length, batch_size, index_dtype)
  else:
    corpus_index = build_sharded(directory, data, model, params, config, passage_length,
                                 batch_size, index_dtype, shard_docs)
  qids = list(data.queries)
  q_vectors, q_valid = encode_texts([data.queries[q] for q in qids], model, params, "query",
                                    query_length, batch_size)
  results = f"{name}.{split}.step{step}" + ("" if shard_docs is None else ".shards")
  searcher, search_kwargs = corpus_index, {}
  if search == "approximate":
    recorded = codec_lib.quantizer_setting(residual_bits, quantizer)  # None: uncompressed
    other = "" if recorded in (None, codec_lib.DEFAULT_QUANTIZER) else f"-{recorded}"
    results += (f".approximate-{search_backend}-b{residual_bits or 'none'}-nprobe{nprobe}"
                f"-query{query_cells}-candidates{candidates or 'default'}{other}")
    compress = build_or_open_residual if shard_docs is None else sharded_residual
    build = residual.ResidualConfig(bits=residual_bits, num_centroids=num_centroids,
                                    quantizer=quantizer, centroid_probe=centroid_probe)
    searcher = compress(mirrors.enter_context(fileio.local_mirror(
        f"{remote}.residual-b{residual_bits or 'none'}{other}")), data, corpus_index, build)
    search_kwargs = {"nprobe": nprobe, "query_cells": query_cells, "candidates": candidates,
                     "backend": search_backend}
  run = searcher.search_run(qids, q_vectors, q_valid, top_k=top_k, **search_kwargs)
  scores = ir_metrics.evaluate(run, data.qrels)
  scores.update(ir_metrics.beir_measures(run, data.qrels))  # BEIR's set + MRR@10
  scores.update(step=step, num_docs=corpus_index.num_docs, empty_queries=data.empty_queries,
                corpus_fingerprint=dict(data.corpus_fingerprint),
                vectors_per_doc=corpus_index.num_vectors / max(corpus_index.num_docs, 1),
                index_bytes=searcher.nbytes, search=search,
                metrics_implementation=ir_metrics.implementation(),
                backend=search_backend if search == "approximate" else EXACT_BACKEND,
                **(dict(residual_bits=residual_bits, nprobe=nprobe, query_cells=query_cells,
                        candidates=candidates, quantizer=recorded,
                        num_centroids=searcher.meta["codec"]["num_centroids"])
                   if search == "approximate" else {}))
  return dict(scores, _run=run, _results=results)


def keep_previous_results(stem: pathlib.Path, corpus: Dict) -> None:
  """Renames the results at `stem` (.trec, .metrics.json) to `<stem>.corpus-<sha256[:12]>.*`
  when their metrics record another corpus than `corpus` (its index was rebuilt for an
  edited corpus), with a WARNING: a rerun on the same corpus overwrites them, another
  corpus never does. Results from before the record (no `corpus_fingerprint`) are not
  compared."""
  try:
    previous = json.loads(fileio.read_utf8(f"{stem}.metrics.json")).get("corpus_fingerprint")
  except (OSError, ValueError, AttributeError):
    return
  if not isinstance(previous, dict) or previous.get("sha256") == corpus.get("sha256"):
    return
  kept = f"{stem}.corpus-{str(previous.get('sha256'))[:12]}"
  for ext in ("trec", "metrics.json"):
    if os.path.exists(f"{stem}.{ext}"):
      os.replace(f"{stem}.{ext}", f"{kept}.{ext}")
  partitioning.log(
      f"WARNING: the results {stem}.trec / .metrics.json were computed on another corpus "
      f"({previous.get('num_docs')} documents, sha256 {str(previous.get('sha256'))[:12]}...) "
      f"than this run's ({corpus.get('num_docs')} documents, sha256 "
      f"{str(corpus.get('sha256'))[:12]}...); kept them as {kept}.trec / .metrics.json.")


def _write_results(model_dir, results, name, split, step, run, scores, top_k):
  if jax.process_index() != 0:
    return
  stem = fileio.join(model_dir, "retrieval", results)
  if not fileio.is_url(stem):  # an object store: the results are rewritten in place
    keep_previous_results(pathlib.Path(stem), scores["corpus_fingerprint"])
  ir_metrics.write_trec_run(f"{stem}.trec", run, tag=f"decal_jax-step{step}", depth=top_k)
  fileio.write_text_atomic(f"{stem}.metrics.json", json.dumps(scores, indent=2, sort_keys=True))
  print(f"{name} {split} (step {step}, {scores['num_queries']} queries, "
        f"{scores['num_docs']} passages, {scores['vectors_per_doc']:.1f} vectors / passage, "
        f"index {scores['index_bytes'] / 2**20:.1f} MiB): "
        f"NDCG@10 {scores['ndcg@10']:.4f}, Recall@100 {scores['recall@100']:.4f}\n"
        f"  run:     {stem}.trec\n  metrics: {stem}.metrics.json", flush=True)
  writer = metrics.MetricsWriter(model_dir)
  writer.write("retrieval", step, {f"{name}/{k}": float(v) for k, v in scores.items()
                                   if k in ("ndcg@10", "recall@100")})
  writer.close()

