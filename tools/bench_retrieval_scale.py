"""Exact vs approximate multi-vector search at passage ratios C and residual bit widths:
index bytes per passage, NDCG@10 and Recall@100 against exact, the share of the exact
top-100 found, queries/s. (`tools/bench_retrieval.py` measures the encoder and exact
scan; this one the index and search that scale past one small corpus, issue 24.)

  python -m tools.bench_retrieval_scale --passage_length 128 --max_queries 100 \
      --ratios 1 2 4 8 --bits 1 2 4 none --num_centroids 0.25 --synthetic_passages 0 \
      --out docs/results/retrieval_scale_cpu.md --plot docs/results/retrieval_scale_cpu.png
  python -m tools.bench_retrieval_scale --beir_folder '' --msmarco_folder '' \
      --synthetic_passages 100000 --ratios 4 --bits 2 none --num_centroids 0.25 \
      --nprobe 2 4 16 --candidates 100 200 400 \
      --out docs/results/retrieval_scale_synthetic_cpu.md
  python -m tools.bench_retrieval_scale --beir_folder '' --msmarco_folder '' \
      --synthetic_passages 1000000 --synthetic_topics 20000 --ratios 4 --bits 2 \
      --num_centroids 0.125 --nprobe 4 16 --candidates 100 200 \
      --backend compiled --out docs/results/retrieval_scale_1m_cpu.md  # 1M passages

Three corpora, each searched by the library's `index.Index.search` (exact, the reference) and
`residual.ResidualIndex.search` (approximate: `--nprobe` centroids per query vector and
`--query_cells` per query, `--candidates` documents reranked with exact MaxSim over
decompressed vectors; `--backend` numpy and / or compiled, residual_search.py: the same
stages, one row each):
  * a BEIR folder (default ../shared/data's SciFact) and an MS MARCO passage folder
    (default ../shared/data's TREC-DL 2019 judged passages; DECAL_DATA_DIR overrides
    ../shared/data), real text and qrels, read by a training-free stand-in encoder, so that
    no checkpoint is needed and the quality is real: every word (lower-cased, `bm25.words`)
    gets a fixed random unit vector; a query is its words' vectors scaled by their idf, a
    passage the unit-normalised means of C consecutive word vectors (ceil(n / C) vectors,
    as DeCAL stores). MaxSim is then an idf-weighted soft word match. It is not DeCAL's
    learned compression: what is measured is what the index and search lose, against exact;
  * a synthetic clustered corpus: each passage draws a topic, its vectors are noisy copies
    (noise of norm about 0.3) of 16 word centres of that topic (pooled by C as above); each
    query is 8 of one passage's C = 1 vectors with a little more noise (norm about 0.1), and
    that passage is its one relevant passage.
k-means runs once per corpus and C (the first bit width's build) and its centroids are
shared by the other bit widths; `--num_centroids` scales ColBERTv2's default. --out and
--plot are rewritten after every row, marked partial until the run completes, so a run
stopped midway keeps its rows.
"""
import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from tools import benchmarking, results_files
# F401: tables and wall_line are re-exported (tests and readers use them as
# bench_retrieval_scale.*); main uses markdown and plot.
from tools.retrieval_scale_report import (  # noqa: F401  (re-exports: see above)
    markdown, plot, tables, wall_line)
from decal_jax.retrieval import beir, bm25, index, ir_metrics, msmarco, residual
from decal_jax.retrieval import residual_search
from decal_jax import settings
from decal_jax.retrieval import codec as codec_lib

DATA = settings.get("DECAL_DATA_DIR")  # ../shared/data from a checkout


@dataclasses.dataclass
class Corpus:
  name: str
  doc_ids: List[str]
  encode: Callable[[np.ndarray, int], tuple]  # (doc rows, C) -> (vectors [b, m, d], valid)
  queries: np.ndarray  # [q, mq, d]
  query_valid: np.ndarray  # [q, mq]
  qids: List[str]
  qrels: Dict[str, Dict[str, int]]


def _unit(x: np.ndarray) -> np.ndarray:
  return (x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)).astype(np.float32)


def pool(vectors: List[np.ndarray], ratio: int, dim: int):
  """Each passage's `[n, d]` vectors -> the unit means of C consecutive ones, padded to a
  batch: (vectors `[b, max ceil(n / C), d]`, valid `[b, m]`)."""
  lengths = {len(v) for v in vectors}
  if len(lengths) == 1 and min(lengths) % ratio == 0 and min(lengths) > 0:  # one reshape
    n = min(lengths)
    sums = np.stack(vectors).reshape(len(vectors), n // ratio, ratio, dim).sum(axis=2)
    return _unit(sums), np.ones((len(vectors), n // ratio), bool)
  m = max(max(-(-len(v) // ratio) for v in vectors), 1)
  out, valid = np.zeros((len(vectors), m, dim), np.float32), np.zeros((len(vectors), m), bool)
  for row, v in enumerate(vectors):
    count = -(-len(v) // ratio)
    padded = np.zeros((count * ratio, dim), np.float32)
    padded[:len(v)] = v
    sums = padded.reshape(count, ratio, dim).sum(axis=1)  # padding rows add nothing
    out[row, :count], valid[row, :count] = _unit(sums), True
  return out, valid


def lexical_corpus(name: str, texts: Dict[str, str], queries: Dict[str, str],
                   qrels: Dict[str, Dict[str, int]], args) -> Corpus:
  """Passages {id: text}, queries {qid: text} and qrels read by the stand-in encoder (module
  doc); only judged queries are kept."""
  doc_ids = list(texts)[:args.max_docs]
  docs = [bm25.words(texts[d])[:args.passage_length] for d in doc_ids]
  qids = [q for q in queries if q in qrels][:args.max_queries]
  words = [bm25.words(queries[q])[:args.query_length] or ["<empty>"] for q in qids]
  vocab = {w: i for i, w in enumerate(sorted({w for t in docs + words for w in t}))}
  table = _unit(np.random.default_rng(args.seed).standard_normal((len(vocab), args.dim)))
  df = np.zeros(len(vocab))
  for text in docs:
    df[[vocab[w] for w in set(text)]] += 1
  idf = np.log(1 + (len(docs) - df + 0.5) / (df + 0.5)).astype(np.float32)  # [vocab]
  mq = max(len(w) for w in words)
  vectors, valid = np.zeros((len(qids), mq, args.dim), np.float32), np.zeros((len(qids), mq), bool)
  for row, text in enumerate(words):
    ids = [vocab[w] for w in text]
    vectors[row, :len(ids)], valid[row, :len(ids)] = table[ids] * idf[ids, None], True
  kept = set(doc_ids)
  judged = {q: {d: g for d, g in qrels[q].items() if d in kept} for q in qids}

  def encode(rows, ratio):
    return pool([table[[vocab[w] for w in docs[r]]] for r in rows], ratio, args.dim)
  return Corpus(name, doc_ids, encode, vectors, valid, qids, judged)


def beir_corpus(folder: str, args) -> Corpus:
  """A BEIR folder (title + text per passage)."""
  data = beir.load_beir(folder, args.split)
  return lexical_corpus(os.path.basename(os.path.normpath(folder)),
                        {d: p.full_text for d, p in data.corpus.items()}, data.queries,
                        data.qrels, args)


def msmarco_corpus(folder: str, args) -> Corpus:
  """An MS MARCO passage folder (collection.tsv, queries.tsv, qrels.txt), e.g. the
  TREC-DL 2019 judged passages."""
  texts = msmarco.read_tsv_texts(msmarco.find_file(folder, "collection", "test"))
  queries = msmarco.read_tsv_texts(msmarco.find_file(folder, "queries", "test"))
  qrels = msmarco.read_trec_qrels(msmarco.find_file(folder, "qrels", "test"), texts, queries)
  return lexical_corpus(os.path.basename(os.path.normpath(folder)), texts, queries, qrels,
                        args)


def synthetic_corpus(args) -> Corpus:
  """Clustered vectors (module doc), generated per block of passages from (seed, block)."""
  rng = np.random.default_rng(args.seed)
  topics = args.synthetic_topics
  centres = _unit(rng.standard_normal((topics, 16, args.dim)))  # 16 word centres per topic
  block = 1024

  @functools.lru_cache(maxsize=2)
  def block_vectors(b: int) -> np.ndarray:  # [block, length, d] at C = 1
    r = np.random.default_rng([args.seed, b])
    topic = r.integers(0, topics, block)
    slots = r.integers(0, 16, (block, args.synthetic_length))
    noise = 0.3 / np.sqrt(args.dim) * r.standard_normal((block, args.synthetic_length, args.dim))
    return _unit(centres[topic[:, None], slots] + noise)

  def encode(rows, ratio):
    vectors = {}
    for b in np.unique(rows // block):
      vectors[b] = block_vectors(b)
    return pool([vectors[r // block][r % block] for r in rows], ratio, args.dim)
  n = args.synthetic_passages
  picked = np.sort(rng.choice(n, size=min(args.synthetic_queries, n), replace=False))
  queries = np.stack([encode(np.array([p]), 1)[0][0, rng.choice(args.synthetic_length, 8,
                                                                 replace=False)]
                      for p in picked])  # [q, 8, d]
  queries = _unit(queries + 0.1 / np.sqrt(args.dim) * rng.standard_normal(queries.shape))
  qids = [f"q{i}" for i in range(len(picked))]
  return Corpus(f"synthetic {n} passages", [f"p{i}" for i in range(n)], encode, queries,
                np.ones(queries.shape[:2], bool), qids,
                {q: {f"p{p}": 1} for q, p in zip(qids, picked)})


# ----------------------------------------------------------------------------- measure
def _timed(fn, *args, **kwargs):
  start = time.perf_counter()
  out = fn(*args, **kwargs)
  return out, time.perf_counter() - start


def _row(corpus, ratio, searcher, run, seconds, build_s, exact_top, **fields) -> dict:
  ids = searcher.search_ids
  overlap = [len(set(a[a >= 0]) & set(b[b >= 0])) / max((b >= 0).sum(), 1)
             for a, b in zip(ids, exact_top)]
  measures = ir_metrics.evaluate(run, corpus.qrels)
  return {"corpus": corpus.name, "ratio": ratio, "num_docs": len(corpus.doc_ids),
          "num_queries": len(run),
          "ndcg@10": measures["ndcg@10"], "recall@100": measures["recall@100"],
          "recall_vs_exact": float(np.mean(overlap)), "queries_per_s": len(run) / seconds,
          "bytes_per_passage": searcher.nbytes / len(corpus.doc_ids), "build_s": build_s,
          **fields}


class _Searched:
  """Runs a search once, keeping the doc indices for the recall against exact."""

  def __init__(self, opened, corpus, top_k, **kwargs):
    self.nbytes = opened.nbytes
    scores, self.search_ids = opened.search(corpus.queries, corpus.query_valid, top_k, **kwargs)
    self.run = {q: {opened.doc_ids[i]: float(s) for s, i in zip(ss, ii) if i >= 0}
                for q, ss, ii in zip(corpus.qids, scores, self.search_ids)}


def measure(corpus: Corpus, args, tmp: str,
            finished: Optional[Callable[[dict], None]] = None) -> List[dict]:
  """The corpus's rows, per C the exact one, then one per bit width (and quantizer), nprobe,
  query cells and candidates; `finished(row)` after each (default: logged to stderr)."""
  finished = finished or _log
  rows = []
  for ratio in args.ratios:
    batches = (np.arange(s, min(s + 256, len(corpus.doc_ids)))[:, None]
               for s in range(0, len(corpus.doc_ids), 256))
    exact, build_s = _timed(index.build_index, os.path.join(tmp, f"c{ratio}"), corpus.doc_ids,
                            batches, lambda rows, c=ratio: corpus.encode(rows[:, 0], c),
                            {"ratio": ratio}, progress=False, overwrite=True)
    searched, seconds = _timed(_Searched, exact, corpus, args.top_k)
    exact_top = searched.search_ids
    rows.append(_row(corpus, ratio, searched, searched.run, seconds, build_s, exact_top,
                     search="exact", bits="float16", vectors_per_passage=exact.num_vectors /
                     exact.num_docs))
    exact_ndcg, exact_recall = rows[-1]["ndcg@10"], rows[-1]["recall@100"]
    exact_speed = rows[-1]["queries_per_s"]
    finished(rows[-1])
    centroids = codes = None
    k = max(int(args.num_centroids * codec_lib.default_num_centroids(exact.num_vectors)), 1)
    for bits, quantizer in bit_widths(args):
      config = residual.ResidualConfig(bits=bits, num_centroids=k, seed=args.seed,
                                       sample_vectors=args.sample_vectors, quantizer=quantizer,
                                       centroid_probe=args.centroid_probe)
      approx, build_s = _timed(residual.build_residual_index,
                               os.path.join(tmp, f"c{ratio}-b{bits}-{quantizer}"), exact, config,
                               reuse=residual.Reuse(centroids=centroids, codes=codes),
                               overwrite=True)
      centroids, codes = approx.codec.centroids, np.asarray(approx.codes)
      label = "none" if bits is None else bits if len(args.quantizers) == 1 else (
          f"{bits} ({quantizer})")
      if "compiled" in args.backend:  # numba compiles its loops at first use: untimed
        approx.search(corpus.queries[:1], corpus.query_valid[:1], args.top_k,
                      backend="compiled")
      for backend, nprobe, cells, candidates in itertools.product(
          args.backend, args.nprobe, args.query_cells, args.candidates):
        searched, seconds = _timed(_Searched, approx, corpus, args.top_k, nprobe=nprobe,
                                   query_cells=cells, candidates=candidates, backend=backend)
        rows.append(_row(corpus, ratio, searched, searched.run, seconds, build_s, exact_top,
                         search="approximate", bits=label, quantizer=approx.codec.quantizer,
                         backend=backend, nprobe=nprobe, query_cells=cells,
                         candidates=candidates or residual_search.default_candidates(
                             args.top_k, exact.num_docs),
                         num_centroids=approx.num_centroids, centroid_bytes_per_passage=approx.
                         meta["centroid_bytes"] / exact.num_docs,
                         kmeans=approx.meta["kmeans_backend"]))
        rows[-1]["ndcg_loss"] = exact_ndcg - rows[-1]["ndcg@10"]
        rows[-1]["recall@100_vs_exact"] = rows[-1]["recall@100"] / max(exact_recall, 1e-12)
        rows[-1]["speed_vs_exact"] = rows[-1]["queries_per_s"] / exact_speed
        finished(rows[-1])
      del approx
    del exact
  return rows


def bit_widths(args) -> List[tuple]:
  """(bits, quantizer) of the residual indexes built per C: every quantizer for b bits,
  the default one for uncompressed residuals (bits None)."""
  return [(b, q) for b in args.bits
          for q in (args.quantizers if b is not None else [codec_lib.DEFAULT_QUANTIZER])]


def row_count(args, corpora: List[Corpus]) -> int:
  """The rows a run measures: per corpus and C, the exact one and the approximate sweep."""
  sweep = (len(bit_widths(args)) * len(args.backend) * len(args.nprobe)
           * len(args.query_cells) * len(args.candidates))
  return len(corpora) * len(args.ratios) * (1 + sweep)


def _log(row: dict) -> None:
  print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
        file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- main
def _candidates(text: str):
  return None if text == "default" else int(text)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--beir_folder", default=os.path.join(DATA, "beir", "scifact"),
                      help="a BEIR folder ('' to skip); default ../shared/data's SciFact")
  parser.add_argument("--msmarco_folder", default=os.path.join(DATA, "msmarco_trecdl2019"),
                      help="an MS MARCO passage folder ('' to skip); default ../shared/data's "
                      "TREC-DL 2019 judged passages")
  parser.add_argument("--split", default="test")
  parser.add_argument("--max_docs", type=int, default=None)
  parser.add_argument("--max_queries", type=int, default=None)
  parser.add_argument("--passage_length", type=int, default=256, help="words per passage")
  parser.add_argument("--query_length", type=int, default=32, help="words per query")
  parser.add_argument("--synthetic_passages", type=int, default=20000, help="0 to skip")
  parser.add_argument("--synthetic_length", type=int, default=64, help="vectors at C = 1")
  parser.add_argument("--synthetic_topics", type=int, default=2000)
  parser.add_argument("--synthetic_queries", type=int, default=200)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--ratios", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--bits", nargs="+", default=["1", "2", "4", "none"],
                      help="residual bits: 1 2 4 8 or none")
  parser.add_argument("--quantizers", nargs="+", choices=codec_lib.QUANTIZERS,
                      default=[codec_lib.DEFAULT_QUANTIZER],
                      help="residual quantizers (codec.py) of the b-bit rows, side by side")
  parser.add_argument("--nprobe", type=int, nargs="+", default=[residual_search.DEFAULT_NPROBE],
                      help="cells probed per query vector (several: a sweep, one row each)")
  parser.add_argument("--backend", nargs="+", choices=residual_search.BACKENDS,
                      default=[residual_search.DEFAULT_BACKEND],
                      help="who runs the approximate search's stages (residual_search.py): "
                      "numpy, compiled (kernels.py, needs numba: the [ann] extra) or both, "
                      "side by side (one row each)")
  parser.add_argument("--query_cells", type=int, nargs="+",
                      default=[residual_search.DEFAULT_QUERY_CELLS],
                      help="cells probed per query, by summed similarity (several: a sweep)")
  parser.add_argument("--candidates", type=_candidates, nargs="+", default=[None],
                      help="docs reranked per query ('default': "
                      "residual_search.default_candidates; "
                      "several: a sweep)")
  parser.add_argument("--num_centroids", type=float, default=1.0,
                      help="centroids as a multiple of ColBERTv2's default")
  parser.add_argument("--sample_vectors", type=int, default=1 << 16,
                      help="corpus vectors k-means and the residual buckets are trained on")
  parser.add_argument("--centroid_probe", type=int, default=0, help="> 0: k-means's and "
                      "encoding's nearest-centroid search is two-level, the nearest of the "
                      "centroids in this many of sqrt(k) coarse cells (CPU, faiss: "
                      "codec.nearest_centroids); 0: exhaustive")
  parser.add_argument("--top_k", type=int, default=100)
  parser.add_argument("--seed", type=int, default=0)
  benchmarking.add_output_args(parser)
  args = parser.parse_args(argv)
  try:
    args.bits = [None if b == "none" else int(b) for b in args.bits]
    for b in args.bits:
      codec_lib.check_bits(b, args.dim)
  except ValueError as e:
    parser.error(f"--bits: {e}")
  if min(args.ratios) < 1:
    parser.error(f"--ratios must be >= 1, got {args.ratios}.")
  try:  # 'compiled' without numba: refused before any corpus is read
    for backend in args.backend:
      residual_search.check_backend(backend)
  except ImportError as e:
    parser.error(f"--backend: {e}")
  args.command = benchmarking.command("tools.bench_retrieval_scale", argv)
  return args


def main(argv=None) -> List[dict]:
  args = parse_args(argv)
  start = time.perf_counter()
  args.load_before = benchmarking.load_average()
  corpora = read_corpora(args)
  rows: List[dict] = []
  total = row_count(args, corpora)

  def finished(row: dict) -> None:  # each row as it finishes: logged, then partial results
    _log(row)
    rows.append(row)
    _timing(args, start)
    results_files.write_partial(args, rows, len(rows), total,
                                lambda done: markdown(args, done, corpora), plot)

  with tempfile.TemporaryDirectory(prefix="bench_retrieval_scale_") as tmp:
    for corpus in corpora:
      measure(corpus, args, tmp, finished)
  _timing(args, start)
  if args.plot:
    plot(rows, args.plot)
  results_files.report(markdown(args, rows, corpora), args.out)
  return rows


def read_corpora(args) -> List[Corpus]:
  """The BEIR and MS MARCO folders asked for (an error if one is missing), then the
  synthetic corpus."""
  corpora: List[Corpus] = []
  for folder, flag, read in ((args.beir_folder, "beir_folder", beir_corpus),
                             (args.msmarco_folder, "msmarco_folder", msmarco_corpus)):
    if folder:
      if not os.path.isdir(folder):
        sys.exit(f"error: no folder at {folder} (pass --{flag} '' to skip, or set "
                 "DECAL_DATA_DIR to the shared data folder).")
      corpora.append(read(folder, args))
  if args.synthetic_passages:
    corpora.append(synthetic_corpus(args))
  return corpora


def _timing(args, start: float) -> None:
  """The load average and wall time up to now (the results' 'after' and wall time)."""
  args.load_after = benchmarking.load_average()
  args.wall_s = time.perf_counter() - start


if __name__ == "__main__":
  main()
