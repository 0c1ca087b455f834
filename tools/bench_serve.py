"""The HTTP search server's latency and throughput against offline batched search.

  python -m tools.bench_serve --out docs/results/serve_cpu.md
  python -m tools.bench_serve --model_dir runs/decal_tiny_retrieval --query_length 16 \
      --gin_file models/decal_tiny.gin --gin_file models/dual_encoder.gin

Without --model_dir a tiny dual encoder (models/decal_tiny.gin + dual_encoder.gin, DeCAL 4x
passages) is fine-tuned for --train_steps steps on the built-in retrieval task from random
weights (speed does not depend on the values) in a temporary folder, and the built-in BEIR
corpus is indexed by `retrieval_eval.evaluate_retrieval` (exact index). Then, in one
process, against that index and the built-in test queries:
  * offline: `Searcher.search` of all the queries at once (batched as the server batches:
    --max_batch), once untimed (compilation), then --repeats times: queries/s (median);
  * served: `search_server.create_app` on 127.0.0.1 (an ephemeral port, micro-batching with
    --max_batch and --max_wait_ms), warmed up, then for each concurrency in
    --concurrency, that many client threads (urllib, one connection per request) send GET
    /search?q=...&k=10 until --requests requests are answered: p50 / p95 / p99 latency
    and queries/s (answered requests / wall time). Clients and server share the machine's
    cores, as they would on one host.
"""
import argparse
import concurrent.futures
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Dict, List, Sequence

import numpy as np

COMMON = ["models/decal_tiny.gin", "models/dual_encoder.gin"]
BUILTIN_BINDINGS = ["PASSAGE_COMPRESSION_RATIO = 4"]  # runs/retrieve_builtin.gin's


def _tiny_model_dir(root: pathlib.Path, train_steps: int) -> pathlib.Path:
  """A tiny dual encoder fine-tuned `train_steps` steps on the built-in task from random
  weights; its built-in corpus indexed. -> MODEL_DIR."""
  import gin
  import jax
  import jax.numpy as jnp
  from decal_jax.networks import t5
  from decal_jax.runtime import checkpoints, gin_utils, retrieval_eval, trainer
  gin_utils.parse(["models/decal_tiny.gin"], [], [])
  config = gin.query_parameter("%MODEL").scoped_configurable_fn().module.config
  gin.clear_config()
  ones = jnp.ones((1, 16), jnp.int32)
  params = t5.Transformer(config).init(jax.random.PRNGKey(0), ones, ones, ones,
                                       enable_dropout=False)["params"]
  ckpt = checkpoints.Checkpointer(str(root / "pretrained"))
  ckpt.save(1, {"params": params, "step": jnp.int32(1)}, {"batches_consumed": 1}, force=True)
  ckpt.close()
  model_dir = root / "dual"
  gin_utils.parse(["runs/retrieval_builtin.gin"], [], [
      f"MODEL_DIR = '{model_dir}'", f"INITIAL_CHECKPOINT_PATH = '{root / 'pretrained'}'",
      f"TRAIN_STEPS = {train_steps}", f"CHECKPOINT_PERIOD = {train_steps}",
      f"EVAL_PERIOD = {train_steps}", "EVAL_BATCHES = 1", "BATCH_SIZE = 8"])
  gin.get_configurable(trainer.train)()
  gin_utils.parse(["runs/retrieve_builtin.gin"], [], [f"MODEL_DIR = '{model_dir}'"])
  gin.get_configurable(retrieval_eval.evaluate_retrieval)()
  gin.clear_config()
  return model_dir


def _percentile(values: Sequence[float], q: float) -> float:
  return float(np.percentile(np.asarray(values), q))


def offline_qps(searcher, queries: List[str], k: int, repeats: int) -> float:
  searcher.search(queries, k)  # compiles
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    searcher.search(queries, k)
    times.append(time.perf_counter() - start)
  return len(queries) / statistics.median(times)


def _get(url: str, query: str, k: int) -> float:
  start = time.perf_counter()
  with urllib.request.urlopen(f"{url}/search?{urllib.parse.urlencode({'q': query, 'k': k})}",
                              timeout=120) as response:
    response.read()
    if response.status != 200:
      raise RuntimeError(f"status {response.status}")
  return time.perf_counter() - start


def served(url: str, queries: List[str], k: int, clients: int, requests: int) -> Dict:
  """p50 / p95 / p99 latency (ms) and queries/s of `requests` GETs from `clients` threads."""
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    latencies = list(pool.map(lambda i: _get(url, queries[i % len(queries)], k),
                              range(requests)))
  wall = time.perf_counter() - start
  return {"clients": clients, "requests": requests, "qps": requests / wall,
          **{f"p{q}": 1000 * _percentile(latencies, q) for q in (50, 95, 99)}}


def table(rows: List[Dict], offline: float, args, info: Dict, num_queries: int) -> str:
  lines = [
      "# The HTTP search server on CPU: latency and throughput",
      "",
      f"`python -m tools.bench_serve {' '.join(sys.argv[1:])}`".replace("` ", "`"),
      "",
      f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores; server and clients "
      f"in one process on the same cores. Index: {info['index_kind']}, {info['num_docs']} "
      f"passages (the built-in BEIR corpus unless --model_dir), passages at C = "
      f"{info['passage_compression_ratio']}, queries at C = {info['query_compression_ratio']}"
      f"; k = {args.k}; micro-batches of at most {args.max_batch} queries, "
      f"{args.max_wait_ms} ms max wait.",
      "",
      f"Offline batched search (`Searcher.search` of {num_queries} queries at once, "
      f"median of {args.repeats}): **{offline:.1f} queries/s**.",
      "",
      "| concurrent clients | requests | p50 ms | p95 ms | p99 ms | queries/s | vs offline |",
      "|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(f"| {r['clients']} | {r['requests']} | {r['p50']:.1f} | {r['p95']:.1f} | "
                 f"{r['p99']:.1f} | {r['qps']:.1f} | {r['qps'] / offline:.2f} |")
  lines += ["", "One query per request (GET /search); a request's latency includes the HTTP "
            "round trip, the wait for its micro-batch, encoding and exact MaxSim search."]
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model_dir")
  p.add_argument("--gin_file", action="append", default=None)
  p.add_argument("--binding", action="append", default=None,
                 help="a gin binding of the model (default: the built-in run's C = 4)")
  p.add_argument("--query_length", type=int, default=16)
  p.add_argument("--train_steps", type=int, default=2)
  p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
  p.add_argument("--requests", type=int, default=256)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--offline_queries", type=int, default=247)
  p.add_argument("--k", type=int, default=10)
  p.add_argument("--max_batch", type=int, default=32)
  p.add_argument("--max_wait_ms", type=float, default=2.0)
  p.add_argument("--out")
  args = p.parse_args(argv)
  from decal_jax.retrieval import beir
  from decal_jax.runtime import search_server, searcher as searcher_lib
  with tempfile.TemporaryDirectory() as tmp:
    model_dir = args.model_dir or str(_tiny_model_dir(pathlib.Path(tmp), args.train_steps))
    opened = searcher_lib.Searcher.open(model_dir, gin_files=args.gin_file or COMMON,
                                        bindings=args.binding or BUILTIN_BINDINGS,
                                        query_length=args.query_length,
                                        batch_size=args.max_batch)
    data = beir.load_beir(beir.builtin_beir_folder(), "test")
    queries = [q for q in data.queries.values() if q.strip()][:args.offline_queries]
    offline = offline_qps(opened, queries, args.k, args.repeats)
    limits = search_server.Limits(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms)
    rows = []
    with search_server.running(search_server.create_app(opened, limits)) as url:
      served(url, queries, args.k, 4, 64)  # warm-up: every width compiled
      for clients in args.concurrency:
        rows.append(served(url, queries, args.k, clients, args.requests))
        print(rows[-1], flush=True)
    text = table(rows, offline, args, opened.info(), len(queries))
  print(text)
  if args.out:
    pathlib.Path(args.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
  main()
