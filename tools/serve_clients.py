"""What tools/bench_serve.py drives the HTTP search server with: the server command as a
subprocess (`ServerProcess`), clients over persistent or one-shot HTTP/1.1 connections
(`Connection`), the server's 4xx cases (`bad_requests`), a client that leaves mid-request,
and the resident memory of a process (`rss_bytes`).
"""
import http.client
import json
import random
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


def server_command(model_dir: str, args, token_file: Optional[str] = None) -> List[str]:
  """`python -m decal_jax.serve` on an ephemeral port with the benchmark's settings."""
  command = [sys.executable, "-m", "decal_jax.serve", f"--model_dir={model_dir}", "--port=0",
             f"--query_length={args.query_length}", f"--max_batch={args.max_batch}",
             f"--max_wait_ms={args.max_wait_ms}"]
  command += [f"--gin_file={f}" for f in args.gin_file or COMMON]
  command += [f"--gin_bindings={b}" for b in args.binding or BUILTIN_BINDINGS]
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
