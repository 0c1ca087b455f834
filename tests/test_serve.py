"""The HTTP search server (runtime/search_server.py, `python -m decal_jax.serve`), live.

A tiny dual encoder and its index (tests/retrieval/test_searcher.py's `build_model_dir`)
are served on 127.0.0.1, an ephemeral port, by a server thread the tests stop; a real HTTP
client (urllib) asks it: results equal the Searcher's, every bad request gets its 4xx naming
the field, the token guards /search, /info and /stats, 16 concurrent clients are answered
right (and /stats counts the micro-batches they formed), a client that leaves mid-request
hurts no one, and (the command, as a subprocess) SIGTERM drains the requests in flight.
A micro-batch padded to its height (1, 2, 4, ... rows) answers each query as the encoder
padded to the full batch and a brute-force numpy MaxSim do for it alone, and each height
compiles once, all of them in `Searcher.warm_up` (traces counted).
"""
import concurrent.futures
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest

import paths

pytest.importorskip("starlette", reason="the serve extra: pip install 'decal_jax[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra: pip install 'decal_jax[serve]'")

from decal_jax.retrieval import maxsim
from decal_jax.runtime import retrieval_eval, search_server, searcher as searcher_lib

TOKEN = "t0ken-for-tests"
LIMITS = search_server.Limits(max_k=50, max_queries=8, max_query_chars=200,
                              max_body_bytes=4096, max_batch=16, max_wait_ms=20)


def _searcher_tests():
  path = paths.REPO / "tests" / "retrieval" / "test_searcher.py"
  spec = importlib.util.spec_from_file_location("_serve_searcher_helpers", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  helpers = _searcher_tests()
  built = helpers.build_model_dir(tmp_path_factory.mktemp("serve"))
  searcher = helpers.open_searcher(built, corpus=str(built.folder),
                                   batch_size=LIMITS.max_batch)
  app = search_server.create_app(searcher, LIMITS, TOKEN)
  with search_server.running(app) as url:
    yield url, searcher, built, app, helpers


def call(url, path, body=None, token=TOKEN, method=None, raw=None, headers=None):
  """(status, JSON) of one request; a 4xx / 5xx is returned, not raised."""
  data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
  request = urllib.request.Request(url + path, data=data, method=method,
                                   headers=dict(headers or {}))
  if data is not None:
    request.add_header("Content-Type", "application/json")
  if token:
    request.add_header("Authorization", f"Bearer {token}")
  try:
    with urllib.request.urlopen(request, timeout=60) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def _expected(searcher, queries, k, texts=False):
  return [r.as_dict() for r in searcher.search(queries, k, texts=texts)]


def _same(got, expected):
  """Hits equal: the same ids in order, scores equal to float32 rounding."""
  assert [r["query"] for r in got] == [r["query"] for r in expected]
  for g, e in zip(got, expected):
    assert [h["id"] for h in g["hits"]] == [h["id"] for h in e["hits"]]
    assert [h["score"] for h in g["hits"]] == pytest.approx(
        [h["score"] for h in e["hits"]], rel=1e-5, abs=1e-6)
    assert [h.get("text") for h in g["hits"]] == [h.get("text") for h in e["hits"]]


def test_results_equal_the_searchers(served):
  url, searcher, built, _, _ = served
  queries = list(built.queries.values())[:5]
  status, body = call(url, "/search?" + urllib.parse.urlencode({"q": queries[0], "k": 7}))
  assert status == 200 and body["k"] == 7
  _same(body["results"], _expected(searcher, queries[:1], 7))
  status, body = call(url, "/search", {"queries": queries, "k": 5, "texts": True})
  assert status == 200
  _same(body["results"], _expected(searcher, queries, 5, texts=True))
  assert body["results"][0]["hits"][0]["text"]
  status, body = call(url, "/search", {"query": queries[1]})  # k: 10 by default
  assert status == 200 and len(body["results"][0]["hits"]) == 10


BAD = [  # (method, path or body, status, field)
    ("GET", "/search?k=3", 400, "q"),
    ("GET", "/search?q=", 400, "q"),
    ("GET", "/search?q=%20%20", 400, "q"),
    ("GET", "/search?q=%FF%FE", 400, "q"),
    ("GET", "/search?q=a&k=0", 400, "k"),
    ("GET", "/search?q=a&k=-3", 400, "k"),
    ("GET", "/search?q=a&k=100000000000", 400, "k"),
    ("GET", "/search?q=a&k=ten", 400, "k"),
    ("GET", "/search?q=a&path=/etc/passwd", 400, "path"),
    ("GET", "/search?q=a&q=b", 400, "q"),
    ("GET", "/search?q=a&texts=maybe", 400, "texts"),
    ("GET", "/search?q=" + "a" * 201, 413, "q"),
    ("POST", {"query": ""}, 400, "query"),
    ("POST", {"query": 3}, 400, "query"),
    ("POST", {"query": None}, 400, "query"),
    ("POST", {"query": "\ud800"}, 400, "query"),
    ("POST", {"query": "a" * 201}, 413, "query"),
    ("POST", {"queries": "a"}, 400, "queries"),
    ("POST", {"queries": []}, 400, "queries"),
    ("POST", {"queries": ["a"] * 9}, 413, "queries"),
    ("POST", {"queries": ["a", 2]}, 400, "queries[1]"),
    ("POST", {"queries": ["a", " "]}, 400, "queries[1]"),
    ("POST", {"query": "a", "queries": ["b"]}, 400, "query"),
    ("POST", {}, 400, "query"),
    ("POST", {"query": "a", "k": 0}, 400, "k"),
    ("POST", {"query": "a", "k": 51}, 400, "k"),
    ("POST", {"query": "a", "k": 2.5}, 400, "k"),
    ("POST", {"query": "a", "k": True}, 400, "k"),
    ("POST", {"query": "a", "k": "5x"}, 400, "k"),
    ("POST", {"query": "a", "texts": "yes"}, 400, "texts"),
    ("POST", {"query": "a", "index_dir": "/tmp"}, 400, "index_dir"),
    ("POST", ["a"], 400, "body"),
    ("POST", b"{not json", 400, "body"),
    ("POST", b'{"query": "\xff"}', 400, "body"),
    ("POST", json.dumps({"query": "a" * 5000}).encode(), 413, "body"),
    ("GET", "/nowhere", 404, "path"),
    ("DELETE", "/search", 405, "method"),
]


@pytest.mark.parametrize("method, what, status, field", BAD,
                         ids=[f"{i}-{b[2]}-{b[3]}" for i, b in enumerate(BAD)])
def test_a_bad_request_gets_its_4xx_naming_the_field(served, method, what, status, field):
  url = served[0]
  if method == "GET":
    got = call(url, what)
  elif method == "DELETE":
    got = call(url, what, method="DELETE")
  else:
    got = call(url, "/search", raw=what if isinstance(what, bytes) else json.dumps(what).encode())
  assert got[0] == status and got[1]["field"] == field, got
  assert got[1]["error"]
  assert call(url, "/health", token=None) == (200, {"status": "ok"})  # still serving


def test_the_token_guards_search_and_info(served):
  url, searcher, _, _, _ = served
  for token in (None, "wrong", TOKEN + "x"):
    status, body = call(url, "/search?q=apple", token=token)
    assert (status, body["field"]) == (401, "authorization")
    assert call(url, "/info", token=token)[0] == 401
    assert call(url, "/stats", token=token)[0] == 401
  assert call(url, "/health", token=None) == (200, {"status": "ok"})
  status, info = call(url, "/info")
  assert status == 200 and info["token_required"] is True
  assert info["index_kind"] == "exact" and info["search_backend"] == "jax"
  assert info["corpus_fingerprint"] == searcher.index.meta["corpus"]
  assert info["passage_compression_ratio"] == 4 and info["query_compression_ratio"] >= 1
  assert info["limits"]["max_k"] == LIMITS.max_k and "model" in info


def test_exposure_and_the_missing_extra_are_refused_before_any_work(monkeypatch, capsys):
  for host in ("127.0.0.1", "::1", "localhost"):
    search_server.check_exposure(host, None, False)
  search_server.check_exposure("0.0.0.0", "token", False)
  search_server.check_exposure("0.0.0.0", None, True)
  with pytest.raises(SystemExit, match="--insecure"):
    search_server.check_exposure("0.0.0.0", None, False)
  monkeypatch.setattr(search_server, "_importable", lambda name: name != "uvicorn")
  with pytest.raises(SystemExit, match=r"uvicorn: pip install 'decal_jax\[serve\]'"):
    search_server.main(["--model_dir", "/nonexistent"])  # no model is loaded first


def test_concurrent_clients_are_micro_batched_and_answered_right(served):
  url, searcher, built, app, _ = served
  queries = list(built.queries.values())
  expected = {q: _expected(searcher, [q], 4)[0] for q in queries}
  before = app.state.batcher.batches
  stats_before = call(url, "/stats")[1]

  def client(i):
    answers = []
    for j in range(3):
      q = queries[(i + j) % len(queries)]
      status, body = call(url, "/search", {"query": q, "k": 4})
      answers.append((q, status, body))
    return answers

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    answers = [a for batch in pool.map(client, range(16)) for a in batch]
  assert len(answers) == 48
  for q, status, body in answers:
    assert status == 200
    _same(body["results"], [expected[q]])
  assert app.state.batcher.batches - before < 48  # several requests shared an encoder call
  status, stats = call(url, "/stats")
  assert status == 200 and stats["requests"] - stats_before["requests"] == 48
  assert stats["queries"] - stats_before["queries"] == 48  # one query per request
  assert stats["batches"] - stats_before["batches"] == app.state.batcher.batches - before
  sizes = {int(size): n for size, n in stats["batch_sizes"].items()}
  assert sum(sizes.values()) == stats["batches"] and max(sizes) <= LIMITS.max_batch
  assert sum(size * n for size, n in sizes.items()) == stats["queries"]


def _params(searcher, built, helpers):
  params, _ = retrieval_eval.restore_encoder(searcher.model, str(built.model_dir),
                                             helpers.QUERY_LENGTH, helpers.QUERY_LENGTH)
  return params, helpers.QUERY_LENGTH


def _numpy_top_k(corpus_index, vectors, valid, k):
  """Brute-force MaxSim of one query (vectors `[m, d]`, valid `[m]`) against every stored
  document, in float64 -> (scores, doc indices), best first, ties to the lower index."""
  query = vectors[valid].astype(np.float64)  # [a, d]
  sims = query @ np.asarray(corpus_index.vectors, np.float64).T  # [a, all doc vectors]
  bounds = zip(corpus_index.offsets[:-1], corpus_index.offsets[1:])
  scores = np.array([sims[:, s:e].max(axis=1).sum() if e > s else 0.0 for s, e in bounds])
  order = np.argsort(-scores, kind="stable")[:k]
  return scores[order], order


def test_a_micro_batch_padded_to_its_height_equals_each_query_searched_alone(served):
  _, searcher, built, _, helpers = served
  params, length = _params(searcher, built, helpers)
  full = retrieval_eval.TextEncoder(searcher.model, params, "query", length,
                                    LIMITS.max_batch)  # every batch padded to 16 rows
  queries = list(built.queries.values())
  for count in (1, 3, 5, LIMITS.max_batch):  # heights 1, 4, 8, 16
    asked = [queries[i % len(queries)] for i in range(count)]
    ks = [3 + 4 * (i % 2) for i in range(count)]  # two k in one micro-batch
    answers = searcher.search_together([([q], k, False) for q, k in zip(asked, ks)])
    vectors, _ = searcher.encode(asked)  # [count, m, d]
    for i, (query, k, answer) in enumerate(zip(asked, ks, answers)):
      alone, alone_valid = full([query])  # [1, m, d]: this query alone, 16-row padding
      np.testing.assert_allclose(vectors[i], alone[0], rtol=1e-5, atol=1e-6)
      scores, ids = _numpy_top_k(searcher.index, alone[0], alone_valid[0], k)
      assert answer[0].doc_ids == [searcher.index.doc_ids[j] for j in ids]
      assert answer[0].scores == pytest.approx(scores, rel=1e-5, abs=1e-5)


class _CountingModel:
  """A model whose `encode` records the token shape of each call: under jit, one call per
  trace (a compile)."""

  def __init__(self, model):
    self.model, self.input_vocabulary, self.traces = model, model.input_vocabulary, []

  def encode(self, params, tokens, side):
    self.traces.append(tuple(tokens.shape))
    return self.model.encode(params, tokens, side)


def test_each_batch_height_compiles_once_all_in_warm_up(served, monkeypatch):
  _, searcher, built, _, helpers = served
  params, length = _params(searcher, built, helpers)
  counting = _CountingModel(searcher.model)
  encoder = retrieval_eval.TextEncoder(counting, params, "query", length, LIMITS.max_batch,
                                       bucket_rows=True)
  warm = searcher_lib.Searcher(searcher.model, encoder, searcher.index, searcher.step,
                               str(built.model_dir))
  searched, real = [], maxsim.maxsim

  def counting_maxsim(queries, *args, **kwargs):  # called when the search is traced
    searched.append(tuple(queries.shape))
    return real(queries, *args, **kwargs)

  monkeypatch.setattr(maxsim, "maxsim", counting_maxsim)
  warm.warm_up(k=4)
  assert encoder.shapes() == [(h, length) for h in (1, 2, 4, 8, 16)]
  assert sorted(counting.traces) == sorted(encoder.shapes())  # each height once
  counting.traces.clear()
  searched.clear()
  queries = list(built.queries.values())
  expected = {q: _expected(searcher, [q], 4)[0] for q in queries}
  for count in range(1, LIMITS.max_batch + 1):
    asked = [queries[i % len(queries)] for i in range(count)]
    answers = warm.search_together([(asked, 4, False)])[0]
    _same([a.as_dict() for a in answers], [expected[q] for q in asked])
  assert counting.traces == [] and searched == []  # no request waited for a compile


def test_a_client_that_leaves_mid_request_hurts_no_one(served):
  url, searcher, built, _, _ = served
  host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
  body = json.dumps({"query": "apple orchard", "k": 3}).encode()
  head = (f"POST /search HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
  for sent in (head + body[:5], head + body):  # half a body; a whole request, unread
    with socket.create_connection((host, port), timeout=10) as sock:
      sock.sendall(sent)
  time.sleep(0.2)
  status, got = call(url, "/search", {"query": "apple orchard", "k": 3})
  assert status == 200
  _same(got["results"], _expected(searcher, ["apple orchard"], 3))


def test_sigterm_drains_the_requests_in_flight(served, tmp_path):
  _, searcher, built, _, helpers = served
  token_file = tmp_path / "token"
  token_file.write_text(TOKEN + "\n")
  command = [sys.executable, "-m", "decal_jax.serve", f"--model_dir={built.model_dir}",
             "--port=0", f"--token_file={token_file}", "--max_wait_ms=1500",
             "--max_batch=16"] + [f"--gin_file={f}" for f in helpers.COMMON] + [
                 "--gin_file=runs/retrieve.gin", "--gin.PROJECTION_DIM=32",
                 f"--gin.QUERY_LENGTH={helpers.QUERY_LENGTH}"]  # QUERY_LENGTH read from gin
  process = subprocess.Popen(command, cwd=paths.REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
  try:
    output = _Output(process)
    url = output.url(deadline=time.monotonic() + 240)
    answer = {}
    asker = threading.Thread(target=lambda: answer.update(
        got=call(url, "/search", {"query": "volcano lava", "k": 3})))
    asker.start()
    time.sleep(0.5)  # the request waits in the batcher (max_wait_ms = 1500)
    process.send_signal(signal.SIGTERM)
    asker.join(timeout=60)
    status, body = answer["got"]
    assert status == 200
    _same(body["results"], _expected(searcher, ["volcano lava"], 3))
    assert process.wait(timeout=60) == 0, output.text()
    assert "Stopped: the requests in flight were answered." in output.text()
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()


class _Output:
  """A subprocess's output, read on a thread (a server that hangs silently fails the test
  at a deadline instead of blocking it)."""

  def __init__(self, process):
    self.lines: list = []
    self.reader = threading.Thread(target=self._read, args=(process,), daemon=True)
    self.reader.start()

  def _read(self, process):
    for line in iter(process.stdout.readline, ""):
      self.lines.append(line)

  def url(self, deadline: float) -> str:
    """The URL the server prints once it listens."""
    while time.monotonic() < deadline:
      for line in list(self.lines):
        if line.startswith("Serving on "):
          return line.split()[2]
      if not self.reader.is_alive():
        break
      time.sleep(0.1)
    raise AssertionError("the server did not start:\n" + "".join(self.lines[-30:]))

  def text(self) -> str:
    self.reader.join(timeout=30)
    return "".join(self.lines)
