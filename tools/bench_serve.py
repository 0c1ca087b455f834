"""The HTTP search server's latency and throughput against offline batched search, and a soak.

  python -m tools.bench_serve --out docs/results/serve_cpu.md
  python -m tools.bench_serve --soak_minutes 10 --out /tmp/soak.md \
      --plot docs/results/serve_soak_cpu.png
  python -m tools.bench_serve --model_dir runs/decal_tiny_retrieval --query_length 16 \
      --gin_file models/decal_tiny.gin --gin_file models/dual_encoder.gin
  python -m tools.bench_serve --search approximate --concurrency 1 8 32 128
  python -m tools.bench_serve --beir_folder ../shared/data/beir/scifact --search approximate

Without --model_dir a tiny dual encoder (models/decal_tiny.gin + dual_encoder.gin, DeCAL 4x
passages) is fine-tuned for --train_steps steps on the built-in retrieval task from random
weights (speed does not depend on the values) in a temporary folder. The corpus (the
built-in BEIR corpus, or --beir_folder, e.g. SciFact) is indexed by
`retrieval_eval.evaluate_retrieval` with runs/retrieve.gin (--search exact, or approximate:
the residual copy, RESIDUAL_BITS = 2), or its index reused; the server (--index_dir,
--corpus, --nprobe, --query_cells, --candidates, --search_backend) and the offline
`Searcher` are given that one index and the same settings (`serve_clients.IndexChoice`).

The server is the user's command, `python -m decal_jax.serve`, in its own process
(--server thread: `search_server.running` inside this process instead, clients and server
then share one interpreter lock). The clients are threads of this process, each holding one
persistent HTTP/1.1 connection, as a real client library does (--connections new: a new
TCP connection per request, as urllib makes). Both processes share the machine's cores.
  * latency (the default): for each concurrency in --concurrency, --rounds rounds of
    offline batched search in this process (`Searcher.search` of --offline_queries
    queries, the built-in test queries repeated, batched as the server batches:
    --max_batch; median of --repeats) then that many clients sending GET
    /search?q=...&k=10 until --requests are answered. -> p50 / p95 / p99 latency over the
    row's requests, the median queries/s (answers / wall time) of each side, the median
    of the rounds' served / offline ratios (alternating, so that both sides see the same
    load on a shared machine), and the micro-batch sizes the server formed (GET /stats
    before and after).
  * soak (--soak_minutes M): --soak_clients clients for M minutes, mixing good requests
    (GET and POST, 1-3 queries), bad ones (each of the server's 4xx cases, a wrong token
    included) and clients that disconnect mid-request; every --sample_s seconds the server
    process's RSS (psutil, else /proc/PID/status) and the queries answered. An error is
    any 5xx, a connection failure, or a status other than the one expected. -> a summary,
    queries/s and RSS per minute, and with --plot a figure of RSS and queries/s over time.
"""
import argparse
import concurrent.futures
import http.client
import itertools
import json
import pathlib
import random
import statistics
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from tools import benchmarking, results_files, serve_clients

COMMON, BUILTIN_BINDINGS = serve_clients.COMMON, serve_clients.BUILTIN_BINDINGS


def _tiny_model_dir(root: pathlib.Path, train_steps: int) -> pathlib.Path:
  """A tiny dual encoder fine-tuned `train_steps` steps on the built-in task from random
  weights. -> MODEL_DIR."""
  import gin
  import jax
  import jax.numpy as jnp
  from decal_jax.networks import t5
  from decal_jax.runtime import checkpoints, gin_utils, trainer
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
  gin.clear_config()
  return model_dir


def served(url: str, queries: List[str], k: int, clients: int, requests: int,
           keepalive: bool) -> Tuple[List[float], float, int]:
  """(latencies s, queries/s, errors) of `requests` GET /search from `clients` threads,
  each with its own `Connection`."""
  counter, lock = itertools.count(), threading.Lock()

  def client(_) -> Tuple[List[float], int]:
    conn, latencies, errors = serve_clients.Connection(url, keepalive), [], 0
    while True:
      with lock:
        i = next(counter)
      if i >= requests:
        conn.close()
        return latencies, errors
      start = time.perf_counter()
      try:
        status, _ = conn.request("GET", serve_clients.search_path(queries[i % len(queries)], k))
      except (OSError, http.client.HTTPException):
        status = 0
      latencies.append(time.perf_counter() - start)
      errors += status != 200

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = list(pool.map(client, range(clients)))
  wall = time.perf_counter() - start
  return ([x for lat, _ in results for x in lat], requests / wall,
          sum(e for _, e in results))


def mean_batch(before: Optional[Dict], after: Optional[Dict]) -> Tuple[float, Dict[int, int]]:
  """(mean queries per micro-batch, {batch size: batches}) between two /stats answers."""
  if not before or not after:
    return float("nan"), {}
  sizes = {int(s): n - before["batch_sizes"].get(s, 0)
           for s, n in after["batch_sizes"].items()}
  sizes = {s: n for s, n in sorted(sizes.items()) if n}
  batches = sum(sizes.values())
  return (sum(s * n for s, n in sizes.items()) / batches if batches else float("nan")), sizes


# ----------------------------------------------------------------------------- latency
def offline_qps(searcher, queries: List[str], k: int, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    searcher.search(queries, k)
    times.append(time.perf_counter() - start)
  return len(queries) / statistics.median(times)


def open_searcher(model_dir: str, args):
  from decal_jax.runtime import searcher as searcher_lib
  return searcher_lib.Searcher.open(model_dir, gin_files=args.gin_file or COMMON,
                                    bindings=args.binding or BUILTIN_BINDINGS,
                                    query_length=args.query_length, batch_size=args.max_batch,
                                    **serve_clients.IndexChoice.from_args(args)
                                    .searcher_kwargs(model_dir))


def test_queries(count: int, corpus: Optional[str] = None) -> List[str]:
  """The test queries of the BEIR folder `corpus` (None: the built-in), repeated to
  `count`."""
  from decal_jax.retrieval import beir
  data = beir.load_beir(corpus or beir.builtin_beir_folder(), "test")
  queries = [q for q in data.queries.values() if q.strip()]
  return [queries[i % len(queries)] for i in range(count)]


def latency_rows(url: str, searcher, queries: List[str], args) -> List[Dict]:
  keepalive = args.connections == "keepalive"
  top = max(args.concurrency)
  served(url, queries, args.k, top, 4 * top, keepalive)  # warm-up: every height compiled
  searcher.search(queries, args.k)  # compiles the offline shapes
  rows = []
  for clients in args.concurrency:
    before, rounds = serve_clients.server_stats(url), []
    for _ in range(args.rounds):  # offline and served alternate: the load drifts
      offline = offline_qps(searcher, queries, args.k, args.repeats)
      rounds.append((offline, *served(url, queries, args.k, clients, args.requests,
                                      keepalive)))
    rows.append(latency_row(clients, rounds, args))
    rows[-1]["mean_batch"], rows[-1]["batch_sizes"] = mean_batch(
        before, serve_clients.server_stats(url))
    print(rows[-1], flush=True)
  return rows


def latency_row(clients: int, rounds: List[Tuple], args) -> Dict:
  """Medians over the rounds (offline q/s, latencies, served q/s, errors) of one
  concurrency; latency percentiles over all its requests."""
  latencies = np.asarray([x for _, lat, _, _ in rounds for x in lat])
  return {"clients": clients, "requests": args.requests * args.rounds,
          "offline": statistics.median(r[0] for r in rounds),
          "qps": statistics.median(r[2] for r in rounds),
          "ratio": statistics.median(r[2] / r[0] for r in rounds),
          "ratios": [r[2] / r[0] for r in rounds], "errors": sum(r[3] for r in rounds),
          **{f"p{q}": 1000 * float(np.percentile(latencies, q)) for q in (50, 95, 99)}}


def run_latency(model_dir: str, args) -> str:
  from decal_jax.runtime import search_server
  searcher = open_searcher(model_dir, args)
  queries = test_queries(args.offline_queries,
                         serve_clients.IndexChoice.from_args(args).corpus())
  if args.server == "thread":
    searcher.warm_up(args.k)
    limits = search_server.Limits(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms)
    with search_server.running(search_server.create_app(searcher, limits)) as url:
      rows = latency_rows(url, searcher, queries, args)
  else:
    server = serve_clients.ServerProcess(serve_clients.server_command(model_dir, args))
    try:
      rows = latency_rows(server.url(), searcher, queries, args)
    finally:
      server.stop()
  return latency_table(rows, args, searcher.info())


def latency_table(rows: List[Dict], args, info: Dict) -> str:
  where = ("in its own process (`python -m decal_jax.serve`)" if args.server == "process"
           else "on a thread of the clients' process")
  connections = ("one persistent HTTP/1.1 connection each" if args.connections == "keepalive"
                 else "a new connection per request")
  lines = benchmarking.header(
      "The HTTP search server on CPU: latency and throughput",
      benchmarking.command("tools.bench_serve", None),
      f"load average at the end (1/5/15 min): {benchmarking.load_average()}",
      f"server {where}; clients: threads of the benchmark process, {connections}",
      f"index: {info['index_kind']} ({serve_clients.IndexChoice.from_args(args)}), "
      f"{info['num_docs']} passages at C = "
      f"{info['passage_compression_ratio']}; queries at C = {info['query_compression_ratio']}, "
      f"{info['query_length']} tokens; k = {args.k}; search: {info['search']}, backend "
      f"{info['search_backend']}",
      f"micro-batches of at most {args.max_batch} queries, {args.max_wait_ms} ms max wait; "
      f"offline: `Searcher.search` of {args.offline_queries} queries in batches of "
      f"{args.max_batch}, median of {args.repeats}; each row: {args.rounds} rounds of "
      f"offline then {args.requests} served requests, alternating (the medians, and the "
      "median of the rounds' ratios; latency percentiles over all the row's requests)")
  head = ["concurrent clients", "requests", "p50 ms", "p95 ms", "p99 ms", "queries/s",
          "offline queries/s", "vs offline (rounds)", "mean batch", "errors"]
  lines += [""] + benchmarking.table(head, [
      [r["clients"], r["requests"], f"{r['p50']:.1f}", f"{r['p95']:.1f}", f"{r['p99']:.1f}",
       f"{r['qps']:.1f}", f"{r['offline']:.1f}",
       f"{r['ratio']:.2f} ({', '.join(f'{x:.2f}' for x in r['ratios'])})",
       f"{r['mean_batch']:.1f}", r["errors"]] for r in rows])
  lines += ["", "Micro-batch sizes formed (queries per batch: batches):", ""]
  lines += [f"- {r['clients']} clients: " + (", ".join(f"{s}: {n}" for s, n in
                                                       r["batch_sizes"].items()) or "n/a")
            for r in rows]
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- soak
class Tally:
  """Counts shared by the soak's clients (under a lock), and the first error messages."""

  def __init__(self):
    self.lock, self.counts, self.messages = threading.Lock(), {}, []

  def add(self, what: str, n: int = 1, message: str = "") -> None:
    with self.lock:
      self.counts[what] = self.counts.get(what, 0) + n
      if message and len(self.messages) < 10:
        self.messages.append(message)

  def snapshot(self) -> Dict[str, int]:
    with self.lock:
      return dict(self.counts)


def soak_once(conn: serve_clients.Connection, url: str, rng: random.Random, queries: List[str],
              bad: List, tally: Tally) -> None:
  """One request of the mix: 75% good, 20% bad, 5% a client that leaves."""
  draw = rng.random()
  if draw < 0.05:
    serve_clients.drop_mid_request(url, rng)
    return tally.add("dropped")
  if draw < 0.25:
    method, path, body, token, expected = rng.choice(bad)
    status, _ = conn.request(method, path, body, token)
    if status == expected:
      return tally.add("bad")
    return tally.add("error: 5xx" if status >= 500 else "error: unexpected status",
                     message=f"{method} {path[:40]}: {status}, expected {expected}")
  asked = rng.sample(queries, rng.randint(1, 3)) if draw < 0.4 else [rng.choice(queries)]
  if len(asked) > 1:
    status, data = conn.request("POST", "/search", json.dumps({"queries": asked}).encode())
  else:
    status, data = conn.request("GET", serve_clients.search_path(asked[0], 10))
  if status == 200 and len(json.loads(data)["results"]) == len(asked):
    tally.add("good")
    return tally.add("queries", len(asked))
  tally.add("error: 5xx" if status >= 500 else "error: unexpected status",
            message=f"good request: {status} {data[:80]!r}")


def soak_client(url: str, seed: int, queries: List[str], deadline: float,
                tally: Tally) -> None:
  rng, bad = random.Random(seed), serve_clients.bad_requests()
  conn = serve_clients.Connection(url, keepalive=True, token=serve_clients.TOKEN)
  while time.monotonic() < deadline:
    try:
      soak_once(conn, url, rng, queries, bad, tally)
    except (OSError, http.client.HTTPException) as e:
      tally.add("error: connection", message=f"{type(e).__name__}: {e}")
  conn.close()


def soak_loop(url: str, pid: int, args) -> Tuple[List[Dict], Tally]:
  """Runs the clients for --soak_minutes, sampling every --sample_s seconds until then. ->
  (the samples, the tally once the clients' last requests are answered)."""
  corpus = serve_clients.IndexChoice.from_args(args).corpus()
  queries, tally = test_queries(20, corpus), Tally()
  start = time.monotonic()
  deadline = start + 60 * args.soak_minutes
  threads = [threading.Thread(target=soak_client, args=(url, i, queries, deadline, tally),
                              daemon=True) for i in range(args.soak_clients)]
  for t in threads:
    t.start()
  samples = []
  while True:
    samples.append({"t": time.monotonic() - start, "rss": serve_clients.rss_bytes(pid),
                    **tally.snapshot()})
    if samples[-1]["t"] >= 60 * args.soak_minutes:
      break
    time.sleep(min(args.sample_s, max(deadline - time.monotonic(), 0.05)))
  for t in threads:
    t.join(timeout=180)
  return samples, tally


def run_soak(model_dir: str, args, tmp: str) -> str:
  """Serves, soaks, stops (SIGTERM: the exit status is part of the result)."""
  token_file = pathlib.Path(tmp) / "token"
  token_file.write_text(serve_clients.TOKEN)
  server = serve_clients.ServerProcess(
      serve_clients.server_command(model_dir, args, str(token_file)))
  try:
    url = server.url()
    samples, tally = soak_loop(url, server.process.pid, args)
    stats = serve_clients.server_stats(url, serve_clients.TOKEN)
  finally:
    code = server.stop()
  if args.plot:
    soak_plot(samples, args)
  return soak_summary(samples, tally, stats, code, args)


def per_minute(samples: List[Dict]) -> List[Tuple[int, float, float]]:
  """(minute, queries/s over it, RSS MiB at its end) from the cumulative samples."""
  rows, last = [], samples[0]
  count = max(1, round(samples[-1]["t"] / 60))
  for minute in range(1, count + 1):
    end = ([s for s in samples if s["t"] <= 60 * minute] or samples)[-1]
    end = samples[-1] if minute == count else end
    if end["t"] > last["t"]:
      qps = (end.get("queries", 0) - last.get("queries", 0)) / (end["t"] - last["t"])
      rows.append((minute, qps, (end["rss"] or 0) / 2**20))
      last = end
  return rows


def soak_summary(samples: List[Dict], tally: Tally, stats: Optional[Dict], code: int,
                 args) -> str:
  lines = benchmarking.header(
      "The HTTP search server on CPU: soak",
      benchmarking.command("tools.bench_serve", None),
      f"load average at the end (1/5/15 min): {benchmarking.load_average()}",
      f"{args.soak_clients} clients, each one persistent connection, for "
      f"{samples[-1]['t'] / 60:.1f} min: 75% good requests (GET, or POST of 1-3 queries), "
      f"20% bad ones ({len(serve_clients.bad_requests())} kinds of 4xx, wrong tokens "
      "included), 5% clients that leave mid-request; the server process's RSS every "
      f"{args.sample_s:g} s")
  lines += ["", *soak_facts(samples, tally, stats, code), ""]
  lines += benchmarking.table(["minute", "queries/s", "RSS MiB at its end"], [
      [m, f"{q:.1f}", f"{r:.1f}"] for m, q, r in per_minute(samples)])
  return "\n".join(lines) + "\n"


def soak_facts(samples: List[Dict], tally: Tally, stats: Optional[Dict], code: int
               ) -> List[str]:
  """The soak's errors, answers, RSS, batches and exit status, one bullet each."""
  counts = tally.snapshot()
  errors = {k[len("error: "):]: v for k, v in counts.items() if k.startswith("error")}
  rss = np.asarray([s["rss"] / 2**20 for s in samples if s["rss"]])
  later = np.asarray([s["rss"] / 2**20 for s in samples if s["t"] >= 60 and s["rss"]])
  later = later if len(later) else rss[-1:]
  queries = samples[-1].get("queries", 0)
  batches = (f"{stats['batches']} (mean {stats['queries'] / max(stats['batches'], 1):.1f} "
             "queries)" if stats else "n/a")
  return [f"- errors: **{sum(errors.values())}** "
          f"({', '.join(f'{k}: {v}' for k, v in errors.items()) or 'none'})",
          f"- answered: {counts.get('good', 0)} good requests ({counts.get('queries', 0)} "
          f"queries; {queries / samples[-1]['t']:.1f} queries/s), {counts.get('bad', 0)} "
          f"bad ones with their 4xx, {counts.get('dropped', 0)} clients left mid-request",
          f"- server RSS: {rss[0]:.1f} MiB at the start, {later[0]:.1f} MiB after 1 min, "
          f"{rss[-1]:.1f} MiB at the end; growth {rss[-1] - rss[0]:+.1f} MiB from the "
          f"start, {rss[-1] - later[0]:+.1f} MiB after the first minute, within "
          f"{later.min():.1f}..{later.max():.1f} MiB after it",
          f"- micro-batches: {batches}", f"- exit status after SIGTERM: {code}",
          *(f"- an error: {m}" for m in tally.messages[:3])]


def soak_plot(samples: List[Dict], args) -> None:
  """RSS and queries/s (between samples) against minutes, one above the other."""
  plt = results_files.pyplot()
  minutes = np.asarray([s["t"] / 60 for s in samples])
  queries = np.asarray([s.get("queries", 0) for s in samples], float)
  qps = np.diff(queries) / np.maximum(np.diff(minutes) * 60, 1e-9)
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
  top.plot(minutes, [(s["rss"] or 0) / 2**20 for s in samples], color="tab:blue")
  top.set_ylabel("server RSS (MiB)")
  bottom.plot(minutes[1:], qps, color="tab:green")
  bottom.set_ylabel("queries/s")
  bottom.set_ylim(bottom=0)
  bottom.set_xlabel("minutes")
  top.set_title(f"decal_jax.serve soak: {args.soak_clients} clients, good + bad requests "
                "+ disconnects", fontsize=10)
  for ax in (top, bottom):
    ax.grid(True, alpha=0.3)
  results_files.save_figure(fig, args.plot)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model_dir")
  p.add_argument("--gin_file", action="append", default=None)
  p.add_argument("--binding", action="append", default=None,
                 help="a gin binding of the model (default: the built-in run's C = 4)")
  p.add_argument("--query_length", type=int, default=16)
  p.add_argument("--passage_length", type=int, default=128, help="tokens, when indexing")
  p.add_argument("--search", choices=("exact", "approximate"), default="exact")
  p.add_argument("--beir_folder", help="the corpus (default: the built-in one), e.g. "
                 "../shared/data/beir/scifact")
  p.add_argument("--nprobe", type=int, default=16)
  p.add_argument("--query_cells", type=int, default=32)
  p.add_argument("--candidates", type=int, default=None)
  p.add_argument("--search_backend", choices=("numpy", "compiled"), default="numpy")
  p.add_argument("--train_steps", type=int, default=2)
  p.add_argument("--server", choices=("process", "thread"), default="process")
  p.add_argument("--connections", choices=("keepalive", "new"), default="keepalive")
  p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
  p.add_argument("--requests", type=int, default=256, help="per round")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--offline_queries", type=int, default=256)
  p.add_argument("--k", type=int, default=10)
  p.add_argument("--max_batch", type=int, default=32)
  p.add_argument("--max_wait_ms", type=float, default=2.0)
  p.add_argument("--soak_minutes", type=float, default=0.0,
                 help="> 0: the soak instead of the latency table")
  p.add_argument("--soak_clients", type=int, default=16)
  p.add_argument("--sample_s", type=float, default=5.0)
  p.add_argument("--plot", help="the soak's figure (a .png path)")
  p.add_argument("--out")
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  serve_clients.IndexChoice.from_args(args)  # a missing --beir_folder fails before training
  with tempfile.TemporaryDirectory() as tmp:
    model_dir = args.model_dir or str(_tiny_model_dir(pathlib.Path(tmp), args.train_steps))
    serve_clients.build_index(model_dir, args)
    if args.soak_minutes > 0:
      text = run_soak(model_dir, args, tmp)
    else:
      text = run_latency(model_dir, args)
  results_files.report(text, args.out)


if __name__ == "__main__":
  main()
