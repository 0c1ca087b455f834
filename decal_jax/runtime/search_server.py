"""An HTTP search server over a `searcher.Searcher`: what `python -m decal_jax.serve` runs.

Endpoints (JSON in and out; errors are {"error": what is wrong, "field": the field}):

    GET  /search?q=TEXT&k=10[&texts=1]
    POST /search  {"query": "TEXT"} or {"queries": ["TEXT", ...]}, optional "k", "texts"
         -> {"results": [{"query", "hits": [{"id", "score"[, "text"]}, ...]}, ...], "k"}
    GET  /health  -> {"status": "ok"}  (no token needed: for load balancers)
    GET  /info    -> the model, checkpoint, compression ratios, index kind, corpus
                     fingerprint, search backend and the request limits
    GET  /stats   -> {"requests", "batches", "queries", "batch_sizes": {queries: batches}}:
                     how the micro-batcher has grouped the answered requests so far

The model and index are loaded once (the index memory-mapped, read-only). Concurrent
requests are micro-batched (`MicroBatcher`): the first request waits at most
`max_wait_ms` for others, up to `max_batch` queries in all, and the lot is encoded in
one encoder call and searched on one worker thread, so the event loop keeps answering.
A batch is padded only to the next of a few fixed heights (1, 2, 4, ..., max_batch), all
compiled before the server listens (`Searcher.warm_up`): a lone query costs a one-row
encoder call, and no request waits for a compile.
Every request is bounded (body bytes, queries per request, characters per query, k);
anything else (an empty or non-UTF-8 query, a wrong JSON type, an unknown field) gets a 4xx
naming the field, never a crash. A client that disconnects mid-request only loses its own
answer. SIGTERM (or Ctrl-C) stops accepting connections and drains the requests in flight
before the process exits (status 0).

Safe by default: it binds 127.0.0.1; a bearer token (`--token`, or `--token_file` so that
it does not show in the process list) guards /search, /info and /stats; it refuses to
listen beyond the loopback without a token unless `--insecure` is given. No request names a file or
path: the model, index and corpus are fixed when the server starts.

Needs the `serve` extra (starlette, uvicorn): `pip install 'decal_jax[serve]'`.
"""
import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hmac
import ipaddress
import json
import signal
import socket
import sys
import threading
import urllib.parse
from typing import Any, Dict, List, Optional, Sequence

EXTRA = "pip install 'decal_jax[serve]'"
LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may ask for, and how requests are batched."""
  max_k: int = 1000
  max_queries: int = 64          # per request
  max_query_chars: int = 2048    # per query
  max_body_bytes: int = 1 << 20  # a POST body
  max_batch: int = 64            # queries encoded together
  max_wait_ms: float = 5.0       # the longest a request waits for others to join it

  def as_dict(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)


class BadRequest(Exception):
  """A request the server refuses: status, message and the field at fault."""

  def __init__(self, status: int, field: str, message: str):
    super().__init__(message)
    self.status, self.field, self.message = status, field, message


def require_extra() -> None:
  """Exits naming the install command when starlette or uvicorn is missing."""
  missing = [name for name in ("starlette", "uvicorn") if not _importable(name)]
  if missing:
    raise SystemExit(f"error: decal_jax.serve needs {' and '.join(missing)}: {EXTRA}")


def _importable(name: str) -> bool:
  import importlib.util
  return importlib.util.find_spec(name) is not None


def is_loopback(host: str) -> bool:
  """True for 127.0.0.0/8, ::1 and 'localhost'."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def check_exposure(host: str, token: Optional[str], insecure: bool) -> None:
  """Refuses to listen beyond the loopback without a token, unless `insecure`."""
  if not is_loopback(host) and not token and not insecure:
    raise SystemExit(f"error: --host {host} listens beyond this machine, and no token guards "
                     "it: give --token_file (or --token), or --insecure to serve anyone "
                     "who can reach the port.")


# ------------------------------------------------------------------------ request parsing
def _count(field: str, raw: Any, low: int, high: int) -> int:
  if isinstance(raw, str):
    try:
      raw = int(raw)
    except ValueError:
      raise BadRequest(400, field, f"{field} must be a whole number, got {raw!r}.") from None
  if isinstance(raw, bool) or not isinstance(raw, int):
    raise BadRequest(400, field, f"{field} must be a whole number, got {type(raw).__name__}.")
  if not low <= raw <= high:
    raise BadRequest(400, field, f"{field} must be in {low}..{high}, got {raw}.")
  return raw


def _flag(field: str, raw: Any) -> bool:
  if isinstance(raw, bool):
    return raw
  if raw in ("1", "true", "0", "false"):
    return raw in ("1", "true")
  raise BadRequest(400, field, f"{field} must be true or false (1 or 0), got {raw!r}.")


def _query(field: str, raw: Any, limits: Limits) -> str:
  if not isinstance(raw, str):
    raise BadRequest(400, field, f"{field} must be a string, got {type(raw).__name__}.")
  try:
    raw.encode("utf-8")
  except UnicodeEncodeError:
    raise BadRequest(400, field, f"{field} is not valid UTF-8 text.") from None
  if not raw.strip():
    raise BadRequest(400, field, f"{field} is empty: give the text to search for.")
  if len(raw) > limits.max_query_chars:
    raise BadRequest(413, field, f"{field} has {len(raw)} characters; at most "
                                 f"{limits.max_query_chars} are allowed.")
  return raw


def parse_get(query_string: bytes, limits: Limits) -> Dict[str, Any]:
  """GET /search's query string -> {'queries', 'k', 'texts'}."""
  try:
    pairs = urllib.parse.parse_qsl(query_string.decode("latin-1"), keep_blank_values=True,
                                   strict_parsing=False, encoding="utf-8", errors="strict")
  except UnicodeDecodeError:
    raise BadRequest(400, "q", "the query string is not valid UTF-8.") from None
  fields: Dict[str, str] = {}
  for name, value in pairs:
    if name not in ("q", "k", "texts"):
      raise BadRequest(400, name, f"unknown parameter {name!r}: GET /search takes q, k, texts.")
    if name in fields:
      raise BadRequest(400, name, f"{name} is given twice.")
    fields[name] = value
  if "q" not in fields:
    raise BadRequest(400, "q", "q is missing: GET /search?q=TEXT&k=10.")
  return _request(fields.get("q"), None, fields.get("k", 10), fields.get("texts", False),
                  limits, "q")


def parse_post(body: bytes, limits: Limits) -> Dict[str, Any]:
  """POST /search's JSON body -> {'queries', 'k', 'texts'}."""
  try:
    value = json.loads(body.decode("utf-8"))
  except UnicodeDecodeError:
    raise BadRequest(400, "body", "the body is not valid UTF-8.") from None
  except ValueError as e:
    raise BadRequest(400, "body", f"the body is not JSON ({e}).") from None
  if not isinstance(value, dict):
    raise BadRequest(400, "body", "the body must be a JSON object: {\"query\": TEXT, \"k\": 10}.")
  unknown = sorted(set(value) - {"query", "queries", "k", "texts"})
  if unknown:
    raise BadRequest(400, unknown[0], f"unknown field {unknown[0]!r}: POST /search takes "
                                      "query or queries, k, texts.")
  if ("query" in value) == ("queries" in value):
    raise BadRequest(400, "query", "give exactly one of query (a string) or queries (a list).")
  return _request(value.get("query"), value.get("queries"), value.get("k", 10),
                  value.get("texts", False), limits, "query")


def _request(query, queries, k, texts, limits: Limits, name: str) -> Dict[str, Any]:
  if queries is None:
    queries = [_query(name, query, limits)]
  else:
    if not isinstance(queries, list):
      raise BadRequest(400, "queries", f"queries must be a list of strings, got "
                                       f"{type(queries).__name__}.")
    if not 1 <= len(queries) <= limits.max_queries:
      raise BadRequest(400 if not queries else 413, "queries",
                       f"queries must hold 1..{limits.max_queries} strings, got {len(queries)}.")
    queries = [_query(f"queries[{i}]", q, limits) for i, q in enumerate(queries)]
  return {"queries": queries, "k": _count("k", k, 1, limits.max_k),
          "texts": _flag("texts", texts)}


# ------------------------------------------------------------------------ micro-batching
@dataclasses.dataclass
class _Pending:
  queries: List[str]
  k: int
  texts: bool
  future: "asyncio.Future"


class MicroBatcher:
  """Gathers concurrent requests into batches of at most `max_batch` queries (the first
  waits at most `max_wait_ms` for more) and answers each batch with one
  `search_together` call on a single worker thread."""

  def __init__(self, search_together, limits: Limits):
    self.search_together, self.limits = search_together, limits
    self._pending: collections.deque = collections.deque()
    self._arrived: Optional[asyncio.Event] = None
    self._worker: Optional[asyncio.Task] = None
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="search")
    self.batches = 0
    self.sizes: collections.Counter = collections.Counter()  # queries in a batch -> batches
    self.requests = 0

  def stats(self) -> Dict[str, Any]:
    """Answered requests, batches and queries, and the batch-size histogram."""
    return {"requests": self.requests, "batches": self.batches,
            "queries": sum(size * n for size, n in self.sizes.items()),
            "batch_sizes": {str(size): self.sizes[size] for size in sorted(self.sizes)}}

  def start(self) -> None:
    self._arrived = asyncio.Event()
    self._worker = asyncio.get_running_loop().create_task(self._run())

  async def stop(self) -> None:
    if self._worker is not None:
      self._worker.cancel()
      with contextlib.suppress(asyncio.CancelledError):
        await self._worker
    self._pool.shutdown(wait=True)

  async def submit(self, queries: List[str], k: int, texts: bool):
    future = asyncio.get_running_loop().create_future()
    self._pending.append(_Pending(queries, k, texts, future))
    self._arrived.set()
    return await future

  def _queued(self) -> int:
    return sum(len(p.queries) for p in self._pending)

  def _take(self) -> List[_Pending]:
    batch, size = [], 0
    while self._pending and (not batch or size + len(self._pending[0].queries)
                             <= self.limits.max_batch):
      batch.append(self._pending.popleft())
      size += len(batch[-1].queries)
    return [p for p in batch if not p.future.done()]  # a cancelled request: its client left

  async def _run(self) -> None:
    loop = asyncio.get_running_loop()
    while True:
      while not self._pending:
        self._arrived.clear()
        await self._arrived.wait()
      deadline = loop.time() + self.limits.max_wait_ms / 1000
      while self._queued() < self.limits.max_batch and deadline > loop.time():
        self._arrived.clear()
        with contextlib.suppress(asyncio.TimeoutError):
          await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
      batch = self._take()
      if batch:
        await self._answer(loop, batch)

  async def _answer(self, loop, batch: List[_Pending]) -> None:
    requests = [(p.queries, p.k, p.texts) for p in batch]
    try:
      answers = await loop.run_in_executor(self._pool, self.search_together, requests)
      self.batches += 1
      self.requests += len(batch)
      self.sizes[sum(len(p.queries) for p in batch)] += 1
    except Exception as e:
      for p in batch:
        if not p.future.done():
          p.future.set_exception(e)
      return
    for p, answer in zip(batch, answers):
      if not p.future.done():
        p.future.set_result(answer)


# ------------------------------------------------------------------------ the app
def create_app(searcher, limits: Limits = Limits(), token: Optional[str] = None):
  """The Starlette app serving `searcher` (module doc)."""
  from starlette.applications import Starlette
  from starlette.responses import JSONResponse
  from starlette.routing import Route
  batcher = MicroBatcher(searcher.search_together, limits)
  info = dict(searcher.info(), limits=limits.as_dict(), token_required=bool(token))

  def error(status: int, field: str, message: str):
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": message, "field": field}, status, headers=headers)

  def authorised(request) -> bool:
    if not token:
      return True
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode("utf-8", "replace"),
                               f"Bearer {token}".encode("utf-8"))

  async def search(request):
    if not authorised(request):
      return error(401, "authorization", "a bearer token is needed: "
                                         "Authorization: Bearer TOKEN.")
    try:
      if request.method == "GET":
        asked = parse_get(request.scope.get("query_string", b""), limits)
      else:
        asked = parse_post(await _body(request, limits), limits)
    except BadRequest as e:
      return error(e.status, e.field, e.message)
    if asked["texts"] and not info["texts"]:
      return error(400, "texts", "this server was started without --corpus: no texts.")
    try:
      results = await batcher.submit(asked["queries"], asked["k"], asked["texts"])
    except Exception as e:
      return error(500, "", f"the search failed: {type(e).__name__}: {e}")
    return JSONResponse({"results": [r.as_dict() for r in results], "k": asked["k"]})

  async def health(request):
    del request
    return JSONResponse({"status": "ok"})

  async def about(request):
    if not authorised(request):
      return error(401, "authorization", "a bearer token is needed.")
    return JSONResponse(info)

  async def stats(request):
    if not authorised(request):
      return error(401, "authorization", "a bearer token is needed.")
    return JSONResponse(batcher.stats())

  @contextlib.asynccontextmanager
  async def lifespan(app):
    del app
    batcher.start()
    try:
      yield
    finally:
      await batcher.stop()

  async def not_found(request, exc):
    del exc
    return error(404, "path", f"no such endpoint {request.url.path!r}: /search, /health, "
                              "/info, /stats.")

  async def wrong_method(request, exc):
    del exc
    return error(405, "method", f"{request.method} is not allowed here.")

  app = Starlette(routes=[Route("/search", search, methods=["GET", "POST"]),
                          Route("/health", health), Route("/info", about),
                          Route("/stats", stats)],
                  exception_handlers={404: not_found, 405: wrong_method}, lifespan=lifespan)
  app.state.batcher = batcher
  return app


async def _body(request, limits: Limits) -> bytes:
  """The request body, refused (413, field 'body') past `limits.max_body_bytes`."""
  declared = request.headers.get("content-length")
  if declared is not None and (not declared.isdigit() or
                               int(declared) > limits.max_body_bytes):
    raise BadRequest(413, "body", f"the body is larger than {limits.max_body_bytes} bytes.")
  chunks, size = [], 0
  async for chunk in request.stream():
    size += len(chunk)
    if size > limits.max_body_bytes:
      raise BadRequest(413, "body", f"the body is larger than {limits.max_body_bytes} bytes.")
    chunks.append(chunk)
  return b"".join(chunks)


# ------------------------------------------------------------------------ serving
def bind(host: str, port: int) -> socket.socket:
  """A listening socket on host:port (port 0: an ephemeral one)."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  sock.listen(128)
  return sock


def make_server(app, sock: socket.socket, graceful_s: Optional[float] = None):
  """A uvicorn server for `app` on the bound socket `sock`."""
  import uvicorn
  config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                          timeout_graceful_shutdown=graceful_s, limit_concurrency=1024)
  return uvicorn.Server(config)


@contextlib.contextmanager
def running(app, host: str = LOOPBACK, port: int = 0):
  """Serves `app` on a thread; yields its base URL and stops it on exit (tests, tools)."""
  sock = bind(host, port)
  server = make_server(app, sock)
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  try:
    while not server.started and thread.is_alive():
      threading.Event().wait(0.01)
    yield f"http://{host}:{sock.getsockname()[1]}"
  finally:
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="decal_jax.serve", description="Serve a retrieval MODEL_DIR's index over HTTP "
      "(GET/POST /search, /health, /info, /stats). Gin files and --gin.NAME=VALUE bindings "
      "configure the model as for decal_jax.retrieve (default: MODEL_DIR/config.gin).")
  p.add_argument("--model_dir", required=True, help="the trained dual encoder's MODEL_DIR")
  p.add_argument("--index_dir", help="the index (default: the one of the latest checkpoint "
                                     "under MODEL_DIR/index/)")
  p.add_argument("--corpus", help="the BEIR folder (or corpus.jsonl) the index was built "
                                  "from: checked against it, and hits can carry texts")
  p.add_argument("--query_length", type=int, default=None,
                 help="tokens per query (default: the gin QUERY_LENGTH, else 64)")
  p.add_argument("--host", default=LOOPBACK)
  p.add_argument("--port", type=int, default=8000, help="0: an ephemeral port")
  p.add_argument("--token", help="bearer token (prefer --token_file: argv is visible)")
  p.add_argument("--token_file", help="a file holding the bearer token")
  p.add_argument("--insecure", action="store_true",
                 help="allow a non-loopback --host without a token")
  p.add_argument("--nprobe", type=int, default=16)
  p.add_argument("--query_cells", type=int, default=32)
  p.add_argument("--candidates", type=int, default=None)
  p.add_argument("--search_backend", default="numpy", choices=("numpy", "compiled"))
  p.add_argument("--graceful_timeout_s", type=float, default=30.0,
                 help="on SIGTERM, how long in-flight requests may take to finish")
  for field in dataclasses.fields(Limits):
    p.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
  return p


def _token(args) -> Optional[str]:
  if args.token and args.token_file:
    raise SystemExit("error: give --token or --token_file, not both.")
  if args.token_file:
    with open(args.token_file, encoding="utf-8") as f:
      return f.read().strip() or None
  return args.token


def main(argv: Optional[Sequence[str]] = None) -> None:
  """Parses the command line, checks the extra and the exposure, loads, serves."""
  args, rest = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
  require_extra()  # before any work
  token = _token(args)
  check_exposure(args.host, token, args.insecure)
  limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
  from decal_jax.runtime import console
  console.import_tensorflow_quietly()  # the input pipeline's TF: its C++ start-up lines hidden
  from decal_jax.runtime import gin_utils, searcher
  files, paths, bindings = gin_utils.split_args(rest)
  opened = searcher.Searcher.open(
      args.model_dir, args.index_dir, gin_files=files, bindings=bindings, search_paths=paths,
      corpus=args.corpus, query_length=args.query_length, batch_size=limits.max_batch,
      nprobe=args.nprobe, query_cells=args.query_cells, candidates=args.candidates,
      backend=args.search_backend)
  opened.warm_up(k=10)  # compiles every batch height of the encoder and search first
  serve(create_app(opened, limits, token), args.host, args.port, args.graceful_timeout_s)


def serve(app, host: str, port: int, graceful_s: Optional[float]) -> None:
  """Serves until SIGTERM or SIGINT, then drains the requests in flight and returns."""
  sock = bind(host, port)
  stopped = []
  for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal once drained
    signal.signal(sig, lambda number, frame: stopped.append(number))
  print(f"Serving on http://{host}:{sock.getsockname()[1]} (GET/POST /search, /health, "
        "/info, /stats)", flush=True)
  make_server(app, sock, graceful_s).run(sockets=[sock])
  print("Stopped: the requests in flight were answered.", flush=True)
