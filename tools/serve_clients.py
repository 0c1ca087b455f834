"""What tools/bench_serve.py drives the HTTP search server with: the server command as a
subprocess (`ServerProcess`), clients over persistent or one-shot HTTP/1.1 connections
(`Connection`), the server's 4xx cases (`bad_requests`), a client that leaves mid-request,
the resident memory of a process (`rss_bytes`), and the index both sides search
(`IndexChoice`: exact or approximate, built-in corpus or a BEIR folder; `build_index`).
"""
import dataclasses
import http.client
import json
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Dict, List, Optional, Tuple

from tools import benchmarking

COMMON = ["models/decal_tiny.gin", "models/dual_encoder.gin"]
BUILTIN_BINDINGS = ["PASSAGE_COMPRESSION_RATIO = 4"]  # runs/retrieve_builtin.gin's
TOKEN = "soak-token"
BUILTIN_TASK = "decal_beir_builtin"
RESIDUAL_SUFFIX = ".residual-b2"  # retrieve.gin's RESIDUAL_BITS = 2, default quantizer


@dataclasses.dataclass(frozen=True)
class IndexChoice:
  """The index the server and the offline Searcher both search, and how: `search` 'exact'
  or 'approximate' (the residual copy), over the built-in corpus (`beir_folder` None) or a
  BEIR folder; the approximate settings are decal_jax.serve's flags of the same names."""
  search: str = "exact"
  beir_folder: Optional[str] = None
  nprobe: int = 16
  query_cells: int = 32
  candidates: Optional[int] = None
  search_backend: str = "numpy"

  @classmethod
  def from_args(cls, args) -> "IndexChoice":
    if args.beir_folder and not (pathlib.Path(args.beir_folder) / "corpus.jsonl").is_file():
      raise SystemExit(f"--beir_folder {args.beir_folder}: no corpus.jsonl there. SciFact is "
                       "at ../shared/data/beir/scifact (shared/data/README.md), which a bare "
                       "clone lacks; leave --beir_folder out for the built-in corpus.")
    return cls(args.search, args.beir_folder, args.nprobe, args.query_cells, args.candidates,
               args.search_backend)

  @property
  def name(self) -> str:
    """The corpus's name in MODEL_DIR/index/<name>.step<N> (retrieval_eval's)."""
    return pathlib.Path(self.beir_folder).name if self.beir_folder else BUILTIN_TASK

  def corpus(self) -> str:
    from decal_jax.retrieval import beir
    return self.beir_folder or beir.builtin_beir_folder()

  def index_dir(self, model_dir: str) -> str:
    """The newest checkpoint's index of this corpus and kind under MODEL_DIR/index/."""
    pattern = re.compile(rf"{re.escape(self.name)}\.step(\d+)"
                         + re.escape(RESIDUAL_SUFFIX if self.search == "approximate" else "")
                         + "$")
    found = [(int(m.group(1)), p) for p in (pathlib.Path(model_dir) / "index").glob("*")
             if (m := pattern.match(p.name)) and (p / "meta.json").is_file()]
    if not found:
      raise SystemExit(f"no {self.search} index of {self.name} under {model_dir}/index/")
    return str(max(found)[1])

  def searcher_kwargs(self, model_dir: str) -> Dict:
    """`Searcher.open`'s keyword arguments for this choice."""
    kwargs = {"index_dir": self.index_dir(model_dir), "corpus": self.corpus()}
    if self.search == "approximate":
      kwargs.update(nprobe=self.nprobe, query_cells=self.query_cells,
                    candidates=self.candidates, backend=self.search_backend)
    return kwargs

  def server_flags(self, model_dir: str) -> List[str]:
    """The same, as `python -m decal_jax.serve` flags."""
    flags = {"backend": "search_backend"}
    return [f"--{flags.get(k, k)}={v}" for k, v in self.searcher_kwargs(model_dir).items()
            if v is not None]

  def gin_bindings(self) -> List[str]:
    """runs/retrieve.gin's bindings that build (or reuse) this index."""
    corpus = (f"BEIR_FOLDER = {self.beir_folder!r}" if self.beir_folder
              else f"BEIR_TASK = {BUILTIN_TASK!r}")
    return [corpus, f"SEARCH = {self.search!r}", f"NPROBE = {self.nprobe}",
            f"QUERY_CELLS = {self.query_cells}", f"CANDIDATES = {self.candidates}",
            f"SEARCH_BACKEND = {self.search_backend!r}"]


def build_index(model_dir: str, args) -> None:
  """`retrieval_eval.evaluate_retrieval` of MODEL_DIR on the chosen corpus and search:
  builds the index (and its residual copy) unless there, and scores the test split."""
  import gin
  from decal_jax.runtime import gin_utils, retrieval_eval
  gin_utils.parse([*(args.gin_file or COMMON), "runs/retrieve.gin"], [], [
      *(args.binding or BUILTIN_BINDINGS), f"MODEL_DIR = {str(model_dir)!r}",
      f"QUERY_LENGTH = {args.query_length}", f"PASSAGE_LENGTH = {args.passage_length}",
      *IndexChoice.from_args(args).gin_bindings()])
  try:
    gin.get_configurable(retrieval_eval.evaluate_retrieval)()
  finally:
    gin.clear_config()


def server_command(model_dir: str, args, token_file: Optional[str] = None) -> List[str]:
  """`python -m decal_jax.serve` on an ephemeral port with the benchmark's settings."""
  command = [sys.executable, "-m", "decal_jax.serve", f"--model_dir={model_dir}", "--port=0",
             f"--query_length={args.query_length}", f"--max_batch={args.max_batch}",
             f"--max_wait_ms={args.max_wait_ms}"]
  command += [f"--gin_file={f}" for f in args.gin_file or COMMON]
  command += [f"--gin_bindings={b}" for b in args.binding or BUILTIN_BINDINGS]
  command += IndexChoice.from_args(args).server_flags(model_dir)
  return command + ([f"--token_file={token_file}"] if token_file else [])


class ServerProcess:
  """The server command as a subprocess: `start` waits for its 'Serving on URL' line;
  `stop` sends SIGTERM and waits for the drain."""

  def __init__(self, command: List[str]):
    self.process = subprocess.Popen(command, cwd=benchmarking.REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
    self.lines: List[str] = []
    self.reader = threading.Thread(target=self._read, daemon=True)
    self.reader.start()

  def _read(self) -> None:
    for line in iter(self.process.stdout.readline, ""):
      self.lines.append(line)

  def url(self, timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and self.process.poll() is None:
      for line in list(self.lines):
        if line.startswith("Serving on "):
          return line.split()[2]
      time.sleep(0.2)
    self.stop()
    raise SystemExit("the server did not start:\n" + "".join(self.lines[-30:]))

  def stop(self) -> int:
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
    return self.process.wait(timeout=120)


class Connection:
  """Requests to one server: over one persistent HTTP/1.1 connection (keep-alive, reopened
  when the server closes it), or a new connection per request."""

  def __init__(self, url: str, keepalive: bool = True, token: Optional[str] = None):
    parts = urllib.parse.urlsplit(url)
    self.host, self.port, self.keepalive = parts.hostname, parts.port, keepalive
    self.token, self.conn = token, None

  def request(self, method: str, path: str, body: Optional[bytes] = None,
              token: Optional[str] = None) -> Tuple[int, bytes]:
    """(status, body) of one request; a connection failure raises OSError or
    http.client.HTTPException."""
    if self.conn is None:
      self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
    headers = {"Connection": "keep-alive" if self.keepalive else "close"}
    if token or self.token:
      headers["Authorization"] = f"Bearer {token or self.token}"
    if body is not None:
      headers["Content-Type"] = "application/json"
    try:
      self.conn.request(method, path, body=body, headers=headers)
      response = self.conn.getresponse()
      data = response.read()
    except BaseException:
      self.close()
      raise
    if not self.keepalive or response.will_close:
      self.close()
    return response.status, data

  def close(self) -> None:
    if self.conn is not None:
      self.conn.close()
      self.conn = None


def search_path(query: str, k: int) -> str:
  return "/search?" + urllib.parse.urlencode({"q": query, "k": k})


def server_stats(url: str, token: Optional[str] = None) -> Optional[Dict]:
  """GET /stats (None from a server without it)."""
  status, body = Connection(url, keepalive=False, token=token).request("GET", "/stats")
  return json.loads(body) if status == 200 else None


def bad_requests() -> List[Tuple[str, str, Optional[bytes], Optional[str], int]]:
  """(method, path, body, token, expected 4xx) for each kind of request the server's
  default limits refuse."""
  from decal_jax.runtime import search_server
  limits, wrong = search_server.Limits(), "not-the-token"
  too_many = json.dumps({"queries": ["a"] * (limits.max_queries + 1)}).encode()
  return [("GET", "/search?k=3", None, None, 400), ("GET", "/search?q=", None, None, 400),
          ("GET", "/search?q=a&k=0", None, None, 400),
          ("GET", "/search?q=a&k=ten", None, None, 400),
          ("GET", "/search?q=a&path=/etc/passwd", None, None, 400),
          ("GET", "/search?q=" + "a" * (limits.max_query_chars + 1), None, None, 413),
          ("POST", "/search", b"{not json", None, 400),
          ("POST", "/search", b'{"queries": []}', None, 400),
          ("POST", "/search", too_many, None, 413),
          ("POST", "/search", b'{"query": "a", "index_dir": "/tmp"}', None, 400),
          ("POST", "/search", b'{"query": "\xff"}', None, 400),
          ("GET", "/nowhere", None, None, 404), ("DELETE", "/search", None, None, 405),
          ("GET", "/search?q=apple", None, wrong, 401), ("GET", "/info", None, wrong, 401)]


def drop_mid_request(url: str, rng: random.Random) -> None:
  """A client that leaves: half a POST body, or a whole request closed unread."""
  parts = urllib.parse.urlsplit(url)
  body = json.dumps({"query": "apple orchard", "k": 5}).encode()
  head = (f"POST /search HTTP/1.1\r\nHost: {parts.hostname}\r\nAuthorization: Bearer "
          f"{TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
          "\r\n\r\n").encode()
  with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
    sock.sendall(head + (body[:len(body) // 2] if rng.random() < 0.5 else body))


def rss_bytes(pid: int) -> Optional[int]:
  """The resident set size of process `pid` (psutil, else /proc/PID/status), or None."""
  try:
    import psutil
    return psutil.Process(pid).memory_info().rss
  except ImportError:
    pass
  try:
    with open(f"/proc/{pid}/status") as f:
      return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
  except (OSError, StopIteration):
    return None
