"""Compressed multi-vector retrieval at passage ratios C: index bytes, corpus encoding time
and query scoring time, as ratios to C = 1, measured side by side in one process.

  python -m tools.bench_retrieval --beir_folder ../shared/data/beir/scifact \
      --ratios 1 2 4 8 --encode_repeats 3 --out docs/results/retrieval_bench_cpu.md
  python -m tools.bench_retrieval --max_docs 500 --ratios 1 4  # the built-in BEIR folder

One dual encoder (`models/t5_1_1_<size>.gin` + `decal.gin` + `dual_encoder.gin`), one set
of weights: random (the cost does not depend on the values) or, with --model_dir, the
latest checkpoint there. Queries are read at C = 1 (the cost of passage compression alone)
or, with --queries_compressed, at each row's C as the paper reads them (MaxSim work then
falls as 1/C²); for every ratio C the same weights read the passages
(`DualEncoderConfig.passage_compression_ratio = C`):
  * index: the corpus is tokenized once (`pipeline.tokenize`), grouped into padded widths
    (`pipeline.batches_by_length`) and written by `index.build_index` to a temporary
    directory, as `pipeline.build_or_open_index` does; reported: `Index.nbytes` and the
    stored vectors per passage, next to the expectation sum_i ceil(n_i / C) * d * bytes;
  * encoding: one warm-up batch per width runs twice first (compile time = first call -
    second call, reported apart); then the timed build, in which the time inside the
    encoder calls (each returns host arrays, so it waits for the device) is one encoding
    time and the whole `build_index` call (encode + write) the build time; then
    --encode_repeats - 1 more encoder passes over the corpus (no write), the ratios
    alternating; reported: the median. Next to it, the encoder's analytical FLOPs
    (`decal_jax.networks.flops.encoder_flops` over the padded batches: DeCAL reads m + n
    positions, so C > 1 costs more than C = 1, less the larger C is);
  * scoring: the split's queries are encoded once (outside the timing); `Index.search` of
    all of them over the whole index runs once untimed (compilation), then --repeats
    times per C, the ratios alternating within each repeat in an order reversed every
    repeat (so load on a shared machine hits every C alike); reported: the median. Next
    to it, the MaxSim work: valid query vectors x stored passage vectors (about 1/C of
    C = 1), and the pairs `Index.search` computes with its padding (query batches, doc
    chunks padded to a power-of-two vector count).
The rows, their ratios to C = 1, the tables and the plot are `tools.retrieval_cost_report`.
--out and --plot are rewritten after every index build, encoding repeat and scoring repeat,
marked partial until the run completes, so a run stopped midway keeps what it measured.
"""
import argparse
import dataclasses
import math
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF is only seqio's input pipeline

import jax
import numpy as np

from decal_jax.networks import flops
from decal_jax.runtime import gin_utils
from tools import benchmarking, results_files
from tools.benchmarking import alternating, load_average
from decal_jax.retrieval import beir, index
from decal_jax.runtime import retrieval_eval as pipeline
from tools.retrieval_cost_report import Row, json_rows, plot, tables

SIZES = ("tiny", "small", "base")


# ----------------------------------------------------------------------------- model
def load_model(args) -> Tuple[Any, dict, str]:
  """(model, params, where they come from): the dual encoder that the size's gin files (plus
  --gin_bindings) configure, its passages at the largest ratio so that the weights include
  DeCAL's latent parameters; the latest checkpoint in --model_dir, else random weights."""
  import gin
  files = [f"models/t5_1_1_{args.size}.gin", "models/decal.gin", "models/dual_encoder.gin"]
  bindings = [f"COMPRESSION_RATIO = {max(args.ratios)}", "QUERY_COMPRESSION_RATIO = 1",
              f"PROJECTION_DIM = {args.projection_dim}", *args.gin_bindings]
  lengths = {"inputs": args.query_length, "targets": args.passage_length}
  try:
    model, params, step, _ = gin_utils.load_model(files, args.model_dir, bindings=bindings,
                                                  feature_lengths=lengths, register_tasks=False)
  finally:
    gin.clear_config()
  if args.model_dir:
    return model, params, f"checkpoint {os.path.abspath(args.model_dir)}, step {step}"
  shapes = model.input_shapes({"inputs": 8, "targets": 8})
  variables = jax.jit(lambda rng: model.get_initial_variables(rng, shapes))(
      jax.random.PRNGKey(args.seed))
  return model, variables["params"], (f"random initialisation (seed {args.seed}): the cost "
                                      "does not depend on the weight values")


def with_passage_ratio(model, ratio: int, query_ratio: int = 1):
  """The same model class and vocabulary with passages read at `ratio` (same params) and
  queries at `query_ratio`: 1 measures the cost of passage compression alone (the dual
  encoder's default reads queries at the passages' C: --queries_compressed)."""
  config = dataclasses.replace(model.module.config, passage_compression_ratio=ratio,
                               query_compression_ratio=query_ratio)
  return type(model)(type(model.module)(config), model.input_vocabulary,
                     logit_scale=model.logit_scale, bidirectional=model.bidirectional)


# ----------------------------------------------------------------------------- corpus
@dataclasses.dataclass
class Corpus:
  name: str
  doc_ids: List[str]            # in corpus file order (the first --max_docs)
  token_ids: List[List[int]]    # per doc, EOS included (`pipeline.tokenize`)
  batches: list                 # (rows, tokens [batch_size, width]) from batches_by_length
  query_ids: List[str]
  query_texts: List[str]

  @property
  def lengths(self) -> np.ndarray:
    return np.array([len(ids) for ids in self.token_ids], np.int64)  # [docs]

  @property
  def ordered_ids(self) -> List[str]:
    """Doc ids in the order the batches hold them (the index order)."""
    return [self.doc_ids[i] for rows, _ in self.batches for i in rows]

  def token_batches(self):
    return (tokens[:len(rows)] for rows, tokens in self.batches)  # real rows only


def load_corpus(args, vocabulary) -> Corpus:
  folder = args.beir_folder or beir.builtin_beir_folder()
  data = beir.load_beir(folder, args.split)
  doc_ids = list(data.corpus)[:args.max_docs]
  if not doc_ids:
    raise SystemExit(f"error: {folder} has no passages in corpus.jsonl; the benchmark needs "
                     "at least one (check --beir_folder and --max_docs).")
  if not data.queries:
    raise SystemExit(f"error: {folder} has no queries judged in qrels/{args.split}.tsv; "
                     "choose a --split with qrels.")
  token_ids = pipeline.tokenize([data.corpus[d].full_text for d in doc_ids], vocabulary,
                                args.passage_length)
  batches = list(pipeline.batches_by_length(token_ids, args.batch_size, args.passage_length))
  query_ids = list(data.queries)
  return Corpus(pathlib.Path(folder).name, doc_ids, token_ids, batches, query_ids,
                [data.queries[q] for q in query_ids])


# ----------------------------------------------------------------------------- measure
def _first_call_per_width(encode, batches) -> float:
  """Runs one batch of every width twice; returns the compile time (first - second)."""
  compile_s, seen = 0.0, set()
  for rows, tokens in batches:
    if tokens.shape[1] in seen:
      continue
    seen.add(tokens.shape[1])
    real = tokens[:len(rows)]
    first = _seconds(encode, real)
    compile_s += max(first - _seconds(encode, real), 0.0)
  return compile_s


def _seconds(fn, *args) -> float:
  return benchmarking.timed(fn, *args)[1]


def encoder_flops(model, ratio: int, corpus: Corpus, batch_size: int) -> float:
  """Analytical FLOPs of encoding every padded batch (rows and widths as computed), plus
  the projection of the m output vectors."""
  module = model.module.config
  cfg = dataclasses.replace(module.encoder, compression_ratio=ratio)
  total = 0.0
  for _, tokens in corpus.batches:
    width = tokens.shape[1]
    m = math.ceil(width / ratio)
    projection = 2 * m * cfg.emb_dim * module.projection_dim if module.projection_dim else 0
    total += batch_size * (flops.encoder_flops(cfg, width) + projection)
  return total


def build(model, params, ratio: int, corpus: Corpus, directory: str,
          args) -> Tuple[Row, index.Index, Callable]:
  """Encodes the corpus at passage ratio `ratio` into an index at `directory`; returns
  what it measured, the opened index and the (compiled) encoder."""
  model_c = with_passage_ratio(model, ratio)
  encode = pipeline._padded_to(
      args.batch_size, pipeline.encoder_fn(model_c, params, "passage"))
  compile_s = _first_call_per_width(encode, corpus.batches)
  inside = []

  def timed_encode(tokens: np.ndarray):
    start = time.perf_counter()
    out = encode(tokens)  # host arrays: waits for the device
    inside.append(time.perf_counter() - start)
    return out

  config = pipeline.index_config(model_c, args.passage_length, args.model_dir or "random-init",
                                 0)
  start = time.perf_counter()
  built = index.build_index(directory, corpus.ordered_ids, corpus.token_batches(),
                            timed_encode, config, dtype=args.index_dtype, progress=False)
  build_s = time.perf_counter() - start
  expected = int(np.sum(-(-corpus.lengths // ratio)))
  itemsize = np.dtype(args.index_dtype).itemsize
  row = Row(ratio, built.num_docs, built.num_vectors, expected, built.dim, built.nbytes,
            expected * built.dim * itemsize, compile_s, [sum(inside)], build_s,
            encoder_flops(model, ratio, corpus, args.batch_size))
  return row, built, encode


def encode_again(encoders: Dict[int, Callable], rows: Dict[int, Row], corpus: Corpus,
                 args, repeated: Callable[[], None] = lambda: None) -> None:
  """--encode_repeats - 1 more encoder passes over the corpus (no index write), the
  ratios alternating within each repeat, each pass's time appended to its row;
  `repeated()` after each repeat."""
  for repeat in range(1, args.encode_repeats):
    for ratio in alternating(args.ratios, repeat):
      start = time.perf_counter()
      for tokens in corpus.token_batches():
        encoders[ratio](tokens)  # host arrays: waits for the device
      rows[ratio].encode_s.append(time.perf_counter() - start)
    _log(f"encoding repeat {repeat + 1}/{args.encode_repeats}: " + ", ".join(
        f"C={r} {rows[r].encode_s[-1]:.2f} s" for r in args.ratios))
    repeated()


def computed_pairs(opened: index.Index, num_queries: int, query_width: int,
                   doc_batch_size: int, query_batch_size: int) -> int:
  """Query x passage vector pairs that `Index.search` scores: queries padded to whole
  batches of `query_batch_size` x the padded query width, against every doc chunk of
  `doc_batch_size` rows padded to a power-of-two vector count (`index._bucket`)."""
  query_batch = min(query_batch_size, num_queries)
  query_rows = -(-num_queries // query_batch) * query_batch
  chunk = min(doc_batch_size, opened.num_docs)
  counts = np.diff(opened.offsets)  # [docs] stored vectors per doc
  bucket = index._bucket  # the padding rule search uses
  doc_slots = sum(chunk * bucket(counts[start:start + chunk].max())
                  for start in range(0, opened.num_docs, chunk))
  return query_rows * query_width * doc_slots


def score(indexes: Dict[int, index.Index], rows: Dict[int, Row], queries: dict, args,
          repeated: Callable[[], None] = lambda: None) -> None:
  """Times `Index.search` of all queries per ratio (first call apart, then the repeats),
  `queries[ratio]` = (vectors, valid) as that row reads them; `repeated()` after each
  repeat."""
  def search(ratio: int):
    vectors, valid = queries[ratio]
    return indexes[ratio].search(vectors, valid, top_k=args.top_k,
                                 doc_batch_size=args.doc_batch_size,
                                 query_batch_size=args.query_batch_size,
                                 precision=args.precision)

  for ratio in args.ratios:
    vectors, valid = queries[ratio]
    rows[ratio].scoring_first_s = _seconds(search, ratio)
    rows[ratio].valid_pairs = int(valid.sum()) * indexes[ratio].num_vectors
    rows[ratio].computed_pairs = computed_pairs(indexes[ratio], len(vectors),
                                                vectors.shape[1], args.doc_batch_size,
                                                args.query_batch_size)
  for repeat in range(args.repeats):
    for ratio in alternating(args.ratios, repeat):
      rows[ratio].scoring_s.append(_seconds(search, ratio))
    _log(f"scoring repeat {repeat + 1}/{args.repeats}: " + ", ".join(
        f"C={r} {rows[r].scoring_s[-1]:.2f} s" for r in args.ratios))
    repeated()


def _log(text: str) -> None:
  print(text, file=sys.stderr, flush=True)


def run(args) -> Tuple[List[Row], dict]:
  """Every ratio's row, and what describes the run (for the Markdown). After each index
  build, encoding repeat and scoring repeat, the rows so far are written as partial results
  (`save_partial`), so a run stopped midway keeps them."""
  args.load_before = load_average()
  model, params, source = load_model(args)
  corpus = load_corpus(args, model.input_vocabulary)
  encoded = {q: pipeline.encode_texts(  # (vectors, valid), once per query ratio
      corpus.query_texts, with_passage_ratio(model, q, q), params, "query", args.query_length,
      args.batch_size) for q in {query_ratio(args, ratio) for ratio in args.ratios}}
  queries = {ratio: encoded[query_ratio(args, ratio)] for ratio in args.ratios}
  query_lengths = [len(q) for q in pipeline.tokenize(corpus.query_texts,
                                                     model.input_vocabulary,
                                                     args.query_length)]
  _log(f"{corpus.name}: {len(corpus.doc_ids)} passages, {len(corpus.query_ids)} queries "
       f"({args.split}); ratios {args.ratios}")
  about = {"source": source, "model": model, "corpus": corpus, "query_lengths": query_lengths,
           "query_width": int(queries[1][0].shape[1])}
  rows: Dict[int, Row] = {}

  def save() -> None:
    save_partial(args, [rows[r] for r in args.ratios if r in rows], about)

  with tempfile.TemporaryDirectory(prefix="bench_retrieval_") as tmp:
    indexes, encoders = {}, {}
    for ratio in args.ratios:
      rows[ratio], indexes[ratio], encoders[ratio] = build(
          model, params, ratio, corpus, os.path.join(tmp, f"c{ratio}"), args)
      row = rows[ratio]
      _log(f"C={ratio}: {row.vectors_per_passage:.1f} vectors / passage, "
           f"{row.index_bytes / 2**20:.1f} MiB, encode {row.encode_s[0]:.2f} s "
           f"(build {row.build_s:.2f} s, compile {row.compile_s:.2f} s)")
      save()
    encode_again(encoders, rows, corpus, args, save)
    score(indexes, rows, queries, args, save)
    del indexes  # the memory maps, before the directory goes
  args.load_after = load_average()
  return [rows[r] for r in args.ratios], about


def save_partial(args, rows: Sequence[Row], about: dict) -> None:
  """The rows built so far as partial results: one step per index build, encoding repeat
  after the build's and scoring repeat; the line under the title names where each stands."""
  passes = min(len(row.encode_s) for row in rows)
  scored = min(len(row.scoring_s) for row in rows)
  done = len(rows) + passes - 1 + scored
  total = len(args.ratios) + args.encode_repeats - 1 + args.repeats
  detail = (f"index builds {len(rows)} of {len(args.ratios)}, encoding passes {passes} of "
            f"{args.encode_repeats}, scoring repeats {scored} of {args.repeats}")
  results_files.write_partial(args, rows, done, total,
                              lambda done_rows: markdown(args, done_rows, about), plot,
                              unit="steps", detail=detail)


def query_ratio(args, ratio: int) -> int:
  """The ratio the queries of row `ratio` are read at."""
  return ratio if args.queries_compressed else 1


# ----------------------------------------------------------------------------- report
def _model_line(model, args) -> str:
  cfg = model.module.config
  enc = cfg.encoder
  return (f"T5.1.1 encoder: {enc.num_encoder_layers} layers, emb {enc.emb_dim}, "
          f"{enc.num_heads} heads x {enc.head_dim}, mlp {enc.mlp_dim}, vocab {enc.vocab_size}, "
          f"{np.dtype(enc.dtype).name}; output d = {cfg.output_dim}"
          f"{' (projection)' if cfg.projection_dim else ''}, "
          f"{'L2-normalised' if cfg.normalize else 'not normalised'}, pooling {cfg.pooling}; "
          + ("queries at each row's C (--queries_compressed)" if args.queries_compressed
             else "queries at C = 1"))


def markdown(args, rows: Sequence[Row], about: dict) -> str:
  corpus: Corpus = about["corpus"]
  lengths = corpus.lengths
  clipped = int(np.sum(lengths >= args.passage_length))
  q_lengths = about["query_lengths"]
  lines = benchmarking.header(
      "Compressed multi-vector retrieval: index bytes, encoding and scoring time vs the "
      "passage ratio C", args.command,
      f"model: `--size {args.size}` ({_model_line(about['model'], args)}); weights: "
      f"{about['source']}.",
      f"corpus: {corpus.name} ({args.beir_folder or 'the built-in BEIR folder'}), "
      f"{len(corpus.doc_ids)} passages, {lengths.mean():.1f} tokens on average (EOS "
      f"included; {clipped} cut to --passage_length {args.passage_length}); "
      f"{len(corpus.query_ids)} {args.split} queries, {np.mean(q_lengths):.1f} tokens on "
      f"average (--query_length {args.query_length}, padded width {about['query_width']} "
      "at C = 1).",
      f"settings: batch {args.batch_size} passages (padded widths "
      f"{sorted({t.shape[1] for _, t in corpus.batches})}); index {args.index_dtype}; search "
      f"top {args.top_k}, doc chunks of {args.doc_batch_size}, query batches of "
      f"{args.query_batch_size}, precision {args.precision}.",
      "encode s: time inside the encoder calls, after a warm-up batch per width (compile "
      "s = first call - second call of that batch, summed over widths): the index build's, "
      f"then {args.encode_repeats - 1} more pass(es) over the corpus, the ratios alternating "
      "within each repeat; median. build s: the one `index.build_index` call (encode + float "
      "conversion + write). "
      f"scoring s: `Index.search` of all queries over the whole index, median of "
      f"{args.repeats} after one untimed call, the ratios alternating within each repeat. "
      "Every ratio is to the C = 1 row of this run; 'expected' columns are analytical.",
      f"host load average (1/5/15 min) before / after: {args.load_before} / "
      f"{getattr(args, 'load_after', 'n/a')}.", args.note and f"note: {args.note}")
  lines += ["", *tables(rows)]
  if args.plot:
    lines += ["", f"![ratios to C = 1]({os.path.basename(args.plot)})"]
  lines += ["", "## Rows (JSON lines)", "", "```jsonl", *json_rows(rows), "```"]
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", choices=SIZES, default="tiny",
                      help="T5.1.1 size (gin/models/t5_1_1_<size>.gin)")
  parser.add_argument("--projection_dim", type=int, default=None,
                      help="project the vectors to this dimension (default: the encoder's)")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="an extra gin binding for the model, e.g. "
                           "'t5.T5Config.num_encoder_layers = 2' (repeatable)")
  parser.add_argument("--model_dir", default=None,
                      help="restore the latest checkpoint here instead of random weights")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--beir_folder", default=None,
                      help="a BEIR-format folder (default: the built-in one)")
  parser.add_argument("--split", default="test", help="whose queries are scored")
  parser.add_argument("--max_docs", type=int, default=None,
                      help="only the first N passages of corpus.jsonl")
  parser.add_argument("--passage_length", type=int, default=256)
  parser.add_argument("--query_length", type=int, default=32)
  parser.add_argument("--ratios", type=int, nargs="+", default=[1, 2, 4, 8],
                      help="passage compression ratios; must include 1 (the reference)")
  parser.add_argument("--queries_compressed", action="store_true",
                      help="read the queries at each row's C too (the paper's protocol: "
                      "MaxSim work 1/C²); default: at C = 1 (passage compression alone)")
  parser.add_argument("--batch_size", type=int, default=64, help="passages per encoder call")
  parser.add_argument("--index_dtype", choices=index.DTYPES, default="float16")
  parser.add_argument("--top_k", type=int, default=100)
  parser.add_argument("--doc_batch_size", type=int, default=1024,
                      help="Index.search's doc chunk")
  parser.add_argument("--query_batch_size", type=int, default=32)
  parser.add_argument("--precision", default="highest", choices=["highest", "default"])
  parser.add_argument("--repeats", type=int, default=3, help="timed searches per ratio")
  parser.add_argument("--encode_repeats", type=int, default=1,
                      help="timed encoder passes over the corpus per ratio (the first is "
                           "the index build's)")
  benchmarking.add_output_args(parser)
  args = parser.parse_args(argv)
  if 1 not in args.ratios:
    parser.error(f"--ratios must include 1 (every ratio is reported relative to C = 1), got "
                 f"{args.ratios}.")
  if min(args.ratios) < 1 or len(set(args.ratios)) != len(args.ratios):
    parser.error(f"--ratios must be distinct integers >= 1, got {args.ratios}.")
  args.ratios = sorted(args.ratios)
  for name in ("passage_length", "query_length"):
    if getattr(args, name) < 2:
      parser.error(f"--{name} must be >= 2 (one token and EOS), got {getattr(args, name)}.")
  for name in ("batch_size", "top_k", "doc_batch_size", "query_batch_size", "repeats",
               "encode_repeats", "max_docs", "projection_dim"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}.")
  args.command = benchmarking.command("tools.bench_retrieval", argv)
  return args


def main(argv=None) -> List[Row]:
  args = parse_args(argv)
  rows, about = run(args)
  if args.plot:
    plot(rows, args.plot)
  results_files.report(markdown(args, rows, about), args.out)
  return rows


if __name__ == "__main__":
  main()
