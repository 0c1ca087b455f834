"""IR metrics against pytrec_eval and a hand computation; the on-disk index and its exact
MaxSim search against a numpy brute force."""
import json
import os

import numpy as np
import pytest
import pytrec_eval

from decal_jax.retrieval import index as index_lib
from decal_jax.retrieval import ir_metrics


# ------------------------------------------------------------------------------- metrics
def _random_run_and_qrels(seed: int, num_queries: int = 30, num_docs: int = 200):
  """Graded qrels (0-3, every query with a relevant doc) and a run with many tied scores,
  some queries retrieving fewer than 10 docs and some relevant docs never retrieved."""
  rng = np.random.default_rng(seed)
  docs = [f"d{i:03d}" for i in range(num_docs)]
  qrels, run = {}, {}
  for q in range(num_queries):
    qid = f"q{q}"
    judged = rng.choice(docs[:60], size=rng.integers(1, 25), replace=False)
    grades = {d: int(rng.integers(0, 4)) for d in judged}
    grades[str(judged[0])] = int(rng.integers(1, 4))  # at least one relevant
    qrels[qid] = grades
    depth = int(rng.choice([3, 7, 40, 150])) if q % 3 else int(rng.integers(1, 10))
    retrieved = rng.choice(docs, size=depth, replace=False)
    # scores on a coarse grid -> many ties, which trec_eval breaks by doc id descending
    run[qid] = {str(d): float(rng.integers(0, 6)) / 2 for d in retrieved}
  return run, qrels


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ndcg_and_recall_equal_pytrec_eval(seed):
  run, qrels = _random_run_and_qrels(seed)
  reference = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100"}).evaluate(run)
  ndcg, ndcg_per_query = ir_metrics.ndcg_at_k(run, qrels, 10)
  recall, recall_per_query = ir_metrics.recall_at_k(run, qrels, 100)
  assert set(ndcg_per_query) == set(reference) == set(recall_per_query)
  for qid, values in reference.items():
    assert ndcg_per_query[qid] == pytest.approx(values["ndcg_cut_10"], abs=1e-12), qid
    assert recall_per_query[qid] == pytest.approx(values["recall_100"], abs=1e-12), qid
  assert ndcg == pytest.approx(np.mean([v["ndcg_cut_10"] for v in reference.values()]))
  assert recall == pytest.approx(np.mean([v["recall_100"] for v in reference.values()]))
  # the depth of a cut changes the answer, so a run deeper than 100 must be cut there
  assert any(len(scores) > 100 for scores in run.values())
  assert ir_metrics.evaluate(run, qrels) == {"ndcg@10": pytest.approx(ndcg),
                                             "recall@100": pytest.approx(recall),
                                             "num_queries": len(qrels)}


@pytest.mark.parametrize("seed", [0, 1])
def test_beir_measures_equal_pytrec_eval_per_query(seed):
  run, qrels = _random_run_and_qrels(seed)
  qrels["q0"]["q0"] = 3  # a doc named as its query: dropped by ignore_identical_ids
  run["q0"]["q0"] = 9.0
  run["unjudged"] = {"d001": 1.0}
  cuts = "1,3,5,10,100,1000"
  measures = {f"ndcg_cut.{cuts}", f"map_cut.{cuts}", f"recall.{cuts}", f"P.{cuts}"}
  for ignore in (True, False):
    kept = {q: {d: v for d, v in docs.items() if not (ignore and d == q)}
            for q, docs in run.items()}
    reference = pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(kept)
    top10 = {q: dict(sorted(docs.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)[:10])
             for q, docs in kept.items()}
    mrr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
    for backend in ("own", "pytrec_eval"):
      per_query = ir_metrics.beir_per_query(run, qrels, ignore_identical_ids=ignore,
                                            backend=backend)
      assert set(per_query) == set(reference)
      for qid, values in reference.items():
        for k in (1, 3, 5, 10, 100, 1000):
          for ours, theirs in (("NDCG", "ndcg_cut"), ("MAP", "map_cut"),
                               ("Recall", "recall"), ("P", "P")):
            assert per_query[qid][f"{ours}@{k}"] == pytest.approx(
                values[f"{theirs}_{k}"], abs=1e-12), (backend, qid, ours, k)
        assert per_query[qid]["MRR@10"] == pytest.approx(mrr[qid]["recip_rank"], abs=1e-12)
    means = ir_metrics.beir_measures(run, qrels, ignore_identical_ids=ignore)
    assert means["NDCG@10"] == pytest.approx(
        np.mean([v["ndcg_cut_10"] for v in reference.values()]))
    assert len(means) == 4 * 6 + 1
  # the identical id is what changes the answer for q0
  with_self = ir_metrics.beir_per_query(run, qrels, ignore_identical_ids=False)["q0"]
  without = ir_metrics.beir_per_query(run, qrels)["q0"]
  assert with_self["MRR@10"] == with_self["P@1"] == 1.0  # q0 ranks first
  assert with_self["Recall@1000"] > without["Recall@1000"]  # and it is a relevant doc


def test_precision_map_and_mrr_hand_worked():
  grades = {"a": 1, "b": 0, "c": 2, "e": 1}
  ranking = ["x", "a", "b", "c", "d"]
  # relevant at ranks 2 and 4: P@5 = 2/5; AP@5 = (1/2 + 2/4) / 3 relevant; RR = 1/2
  assert ir_metrics.query_precision(ranking, grades, 5) == pytest.approx(0.4)
  assert ir_metrics.query_precision(ranking, grades, 10) == pytest.approx(0.2)
  assert ir_metrics.query_average_precision(ranking, grades, 5) == pytest.approx(1 / 3)
  assert ir_metrics.query_average_precision(ranking, grades, 3) == pytest.approx(1 / 6)
  assert ir_metrics.query_reciprocal_rank(ranking, grades, 10) == 0.5
  assert ir_metrics.query_reciprocal_rank(ranking, grades, 1) == 0.0


def test_ndcg_hand_worked_example():
  qrels = {"q": {"a": 2, "b": 1, "c": 0, "e": 3}}
  run = {"q": {"a": 0.9, "b": 0.5, "c": 0.5, "d": 0.7}}
  # Ranking: a (0.9), d (0.7), then the tie at 0.5 by doc id descending: c, b.
  # DCG@10  = 2/log2(2) + 0/log2(3) + 0/log2(4) + 1/log2(5) = 2 + 0.4306766 = 2.4306766
  # IDCG@10 = 3/log2(2) + 2/log2(3) + 1/log2(4)             = 3 + 1.2618595 + 0.5 = 4.7618595
  # NDCG@10 = 2.4306766 / 4.7618595 = 0.5104469
  ndcg, per_query = ir_metrics.ndcg_at_k(run, qrels, 10)
  assert ndcg == pytest.approx(0.5104469, abs=1e-7) and per_query == {"q": ndcg}
  assert ir_metrics.rank(run["q"]) == ["a", "d", "c", "b"]
  # Recall: a and b of the relevant {a, b, e} are retrieved; in the top 2 only a.
  assert ir_metrics.recall_at_k(run, qrels, 100)[0] == pytest.approx(2 / 3)
  assert ir_metrics.recall_at_k(run, qrels, 2)[0] == pytest.approx(1 / 3)
  assert ir_metrics.ndcg_at_k(run, qrels, 1)[0] == pytest.approx(2 / 3)  # 2/1 over 3/1


def test_query_conventions_missing_and_unjudged_queries():
  qrels = {"q1": {"a": 1, "b": 2}, "q2": {"x": 1}, "q3": {"y": 0}}
  run = {"q1": {"a": 1.0, "c": 2.0}, "q3": {"y": 1.0}, "q9": {"a": 1.0}}
  reference = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100"}).evaluate(run)
  # pytrec_eval: only queries in both files, and q3 (no relevant doc) counts as 0.
  assert set(reference) == {"q1", "q3"}
  ndcg, per_query = ir_metrics.ndcg_at_k(run, qrels)
  # ours: queries with a relevant doc (q1, q2); q2, missing from the run, scores 0.
  assert set(per_query) == {"q1", "q2"} and per_query["q2"] == 0.0
  assert per_query["q1"] == pytest.approx(reference["q1"]["ndcg_cut_10"])
  assert ndcg == pytest.approx(reference["q1"]["ndcg_cut_10"] / 2)
  recall, _ = ir_metrics.recall_at_k(run, qrels)
  assert recall == pytest.approx(0.5 / 2)  # q1 finds a of {a, b}; q2 nothing
  assert ir_metrics.evaluate(run, qrels)["num_queries"] == 2


def test_trec_run_round_trip(tmp_path):
  run = {"q2": {"d1": 0.25, "d2": 1.5, "d3": 0.25, "d4": -3.0},
         "q1": {"x": 1 / 3, "y": 2 / 3}}
  path = str(tmp_path / "runs" / "run.trec")
  ir_metrics.write_trec_run(path, run, tag="decal", depth=3)
  lines = [line.split() for line in open(path).read().splitlines()]
  assert [(l[0], l[2], l[3]) for l in lines] == [
      ("q1", "y", "1"), ("q1", "x", "2"),
      ("q2", "d2", "1"), ("q2", "d3", "2"), ("q2", "d1", "3")]  # tie 0.25: d3 before d1
  assert all(l[1] == "Q0" and l[5] == "decal" for l in lines)
  back = ir_metrics.read_trec_run(path)
  assert back == {"q1": run["q1"], "q2": {"d2": 1.5, "d3": 0.25, "d1": 0.25}}  # exact floats
  assert not [f for f in os.listdir(tmp_path / "runs") if "tmp" in f]
  with open(tmp_path / "bad.trec", "w") as f:
    f.write("q1 Q0 a 1 0.5 t\nq1 Q0 b 2 t\n")
  with pytest.raises(ValueError, match=r"bad.trec:2: expected 6 columns"):
    ir_metrics.read_trec_run(str(tmp_path / "bad.trec"))


# ------------------------------------------------------------------------------- index
DIM = 8
CONFIG = {"passage_ratio": 8, "dim": DIM, "encoder": {"layers": 2, "name": "decal"}}


def _ragged_corpus(seed: int = 0, num_docs: int = 23):
  """Per-document float32 vectors with 0..9 rows (document 5 has none)."""
  rng = np.random.default_rng(seed)
  counts = rng.integers(1, 10, size=num_docs)
  counts[5] = 0
  return [rng.standard_normal((c, DIM)).astype(np.float32) for c in counts]


def _fake_encoder(corpus, fail_at_batch=None):
  """encode_fn whose token rows carry the document number in column 0; valid vectors are
  scattered between junk padding rows (which must not be stored)."""
  calls = []

  def encode_fn(tokens):
    calls.append(len(tokens))
    if fail_at_batch is not None and len(calls) == fail_at_batch + 1:
      raise RuntimeError("encoder crashed")
    m = 2 * max(len(corpus[t]) for t in tokens[:, 0]) + 1
    vectors = np.full((len(tokens), m, DIM), 1e4, np.float32)  # [b, m, d] junk
    valid = np.zeros((len(tokens), m), bool)
    for row, doc in enumerate(tokens[:, 0]):
      slots = np.arange(len(corpus[doc])) * 2 + 1  # odd slots hold the valid vectors
      vectors[row, slots] = corpus[doc]
      valid[row, slots] = True
    return vectors, valid
  return encode_fn


def _token_batches(num_docs, sizes=(4, 7, 1, 5, 6)):
  start, i = 0, 0
  while start < num_docs:
    size = sizes[i % len(sizes)]
    rows = np.arange(start, min(start + size, num_docs), dtype=np.int32)
    yield np.stack([rows, np.ones_like(rows)], axis=1)  # [b, 2]
    start, i = start + size, i + 1


def _build(path, corpus, dtype="float32", config=CONFIG, **kwargs):
  doc_ids = [f"doc-{i}" for i in range(len(corpus))]
  return index_lib.build_index(str(path), doc_ids, _token_batches(len(corpus)),
                               _fake_encoder(corpus), config, dtype=dtype, progress=False,
                               **kwargs)


def _numpy_maxsim(query, query_valid, doc):
  """Independent reference: loops over valid query vectors and document vectors."""
  total = 0.0
  for a in range(len(query)):
    if not query_valid[a] or len(doc) == 0:
      continue
    total += max(float(np.dot(query[a].astype(np.float64), b.astype(np.float64)))
                 for b in doc)
  return total


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_index_round_trip(tmp_path, dtype):
  corpus = _ragged_corpus()
  _build(tmp_path / "index", corpus, dtype=dtype)
  index = index_lib.Index.open(str(tmp_path / "index"), expected_config=CONFIG)
  counts = [len(v) for v in corpus]
  assert index.offsets.tolist() == [0] + np.cumsum(counts).tolist()
  assert isinstance(index.vectors, np.memmap) and index.vectors.dtype == np.dtype(dtype)
  flat = np.concatenate(corpus)
  if dtype == "float32":
    np.testing.assert_array_equal(index.vectors, flat)
  else:
    np.testing.assert_allclose(index.vectors, flat, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(index.vectors, flat.astype(np.float16))
  assert index.doc_vectors(5).shape == (0, DIM)
  assert index.doc_ids == [f"doc-{i}" for i in range(len(corpus))]
  assert index.num_docs == len(corpus) and index.num_vectors == sum(counts)
  assert index.nbytes == sum(counts) * DIM * np.dtype(dtype).itemsize
  meta = json.load(open(tmp_path / "index" / "meta.json"))
  assert meta["config"] == CONFIG and meta["num_vectors"] == sum(counts)
  assert meta["bytes"] == index.nbytes and meta["dtype"] == dtype
  assert sorted(os.listdir(tmp_path)) == ["index"]  # no temp directory left behind


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_search_equals_numpy_brute_force(tmp_path, dtype):
  corpus = _ragged_corpus(seed=1)
  index = _build(tmp_path / "index", corpus, dtype=dtype)
  stored = [index.doc_vectors(i).astype(np.float32) for i in range(len(corpus))]
  rng = np.random.default_rng(2)
  queries = rng.standard_normal((7, 5, DIM)).astype(np.float32)  # [q, mq, d]
  query_valid = rng.random((7, 5)) < 0.7
  query_valid[:, 0] = True
  query_valid[3] = [True, False, False, False, False]
  queries[~query_valid] = 50.0  # padding rows must not count
  query_valid[6] = False  # an empty query: every document scores 0
  reference = np.array([[_numpy_maxsim(q, v, doc) for doc in stored]
                        for q, v in zip(queries, query_valid)])  # [q, docs]
  for top_k, doc_batch, query_batch in [(len(corpus), 7, 3), (5, 1024, 32), (100, 4, 7)]:
    scores, ids = index.search(queries, query_valid, top_k=top_k, doc_batch_size=doc_batch,
                               query_batch_size=query_batch)
    k = min(top_k, len(corpus))
    assert scores.shape == ids.shape == (7, k) and scores.dtype == np.float32
    expected_ids = np.argsort(-reference, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_allclose(scores, np.take_along_axis(reference, expected_ids, 1),
                               rtol=1e-5, atol=1e-5)
  assert scores[np.arange(7), np.argmax(ids == 5, axis=1)].tolist() == [0.0] * 7  # empty doc
  assert ids[6].tolist() == list(range(len(corpus))) and not scores[6].any()  # ties: by index
  run = index.search_run([f"q{i}" for i in range(7)], queries, query_valid, top_k=3)
  assert list(run["q0"]) == [f"doc-{i}" for i in expected_ids[0, :3]]
  assert run["q0"][f"doc-{expected_ids[0, 0]}"] == pytest.approx(reference[0].max(), rel=1e-5)


@pytest.mark.parametrize("cache_mib, pads_per_search", [("1024", 0), ("0", 4)])
def test_searches_after_the_first_reuse_the_padded_chunks_within_the_budget(
    tmp_path, monkeypatch, cache_mib, pads_per_search):
  """The chunks padded for one search are kept for the next (none padded again) when the
  budget holds them all; with DECAL_INDEX_CACHE_MIB=0 every search pads every chunk. The
  scores are the numpy brute force's either way, and after another chunk size too."""
  monkeypatch.setenv("DECAL_INDEX_CACHE_MIB", cache_mib)
  corpus = _ragged_corpus(seed=3)  # 23 docs: 4 chunks of 7
  _build(tmp_path / "index", corpus)
  index = index_lib.Index.open(str(tmp_path / "index"))
  padded = []
  chunk = index._chunk
  monkeypatch.setattr(index, "_chunk", lambda start, size: padded.append(start) or
                      chunk(start, size))
  queries = np.random.default_rng(4).standard_normal((3, 4, DIM)).astype(np.float32)
  valid = np.ones((3, 4), bool)
  reference = np.array([[_numpy_maxsim(q, v, doc) for doc in corpus]
                        for q, v in zip(queries, valid)])
  for doc_batch, pads in [(7, 4), (7, pads_per_search), (7, pads_per_search), (5, 5)]:
    padded.clear()
    scores, ids = index.search(queries, valid, top_k=23, doc_batch_size=doc_batch)
    assert len(padded) == pads
    np.testing.assert_allclose(scores, np.take_along_axis(reference, ids, 1), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(ids, np.argsort(-reference, axis=1, kind="stable"))


def test_config_mismatch_names_the_keys(tmp_path):
  _build(tmp_path / "index", _ragged_corpus())
  other = {"passage_ratio": 4, "dim": DIM, "encoder": {"layers": 3, "name": "decal"}}
  with pytest.raises(index_lib.IndexConfigMismatchError) as error:
    index_lib.Index.open(str(tmp_path / "index"), expected_config=other)
  message = str(error.value)
  assert "passage_ratio: built=8, expected=4" in message
  assert "encoder.layers: built=2, expected=3" in message
  assert "encoder.name" not in message and "dim:" not in message  # equal keys not listed
  assert "Rebuild the index with this config" in message
  assert isinstance(error.value, ValueError)
  # key order and tuples vs lists do not change the fingerprint
  same = {"encoder": {"name": "decal", "layers": 2}, "dim": DIM, "passage_ratio": 8}
  index_lib.Index.open(str(tmp_path / "index"), expected_config=same)


def test_interrupted_build_leaves_nothing_and_retry_succeeds(tmp_path):
  corpus = _ragged_corpus()
  path = str(tmp_path / "index")
  doc_ids = [f"doc-{i}" for i in range(len(corpus))]
  with pytest.raises(RuntimeError, match="encoder crashed"):
    index_lib.build_index(path, doc_ids, _token_batches(len(corpus)),
                          _fake_encoder(corpus, fail_at_batch=2), CONFIG, progress=False)
  assert os.listdir(tmp_path) == []
  with pytest.raises(FileNotFoundError, match="No index at"):
    index_lib.Index.open(path)
  index = index_lib.build_index(path, doc_ids, _token_batches(len(corpus)),
                                _fake_encoder(corpus), CONFIG, progress=False)
  assert index.num_docs == len(corpus)


def test_overwrite_and_bad_inputs(tmp_path):
  corpus = _ragged_corpus()
  _build(tmp_path / "index", corpus)
  with pytest.raises(FileExistsError, match="overwrite=True"):
    _build(tmp_path / "index", corpus)
  smaller = _ragged_corpus(seed=3, num_docs=9)
  index = _build(tmp_path / "index", smaller, overwrite=True)
  assert index.num_docs == 9 and sorted(os.listdir(tmp_path)) == ["index"]
  with pytest.raises(ValueError, match="more rows than the 22 doc_ids"):
    index_lib.build_index(str(tmp_path / "other"), [f"d{i}" for i in range(22)],
                          _token_batches(23), _fake_encoder(corpus), CONFIG, progress=False)
  with pytest.raises(ValueError, match="held 23 documents but doc_ids 24"):
    index_lib.build_index(str(tmp_path / "other"), [f"d{i}" for i in range(24)],
                          _token_batches(23), _fake_encoder(corpus), CONFIG, progress=False)
  with pytest.raises(ValueError, match="'d1' appears more than once"):
    index_lib.build_index(str(tmp_path / "other"), ["d0", "d1", "d1"], _token_batches(3),
                          _fake_encoder(corpus), CONFIG, progress=False)
  os.makedirs(tmp_path / "not_an_index")
  open(tmp_path / "not_an_index" / "notes.txt", "w").close()
  with pytest.raises(FileExistsError, match="is not an index"):
    _build(tmp_path / "not_an_index", corpus, overwrite=True)
  assert os.listdir(tmp_path / "not_an_index") == ["notes.txt"]
  os.remove(tmp_path / "index" / "offsets.npy")
  with pytest.raises(FileNotFoundError, match=r"missing: offsets.npy"):
    index_lib.Index.open(str(tmp_path / "index"))
  assert not [p for p in os.listdir(tmp_path) if "tmp" in p]


def test_corpus_of_empty_documents(tmp_path):
  corpus = [np.zeros((0, DIM), np.float32)] * 3
  index = _build(tmp_path / "index", corpus)
  assert index.num_vectors == 0 and index.nbytes == 0 and index.offsets.tolist() == [0] * 4
  queries = np.ones((2, 3, DIM), np.float32)
  scores, ids = index.search(queries, np.ones((2, 3), bool), top_k=10)
  assert scores.tolist() == [[0.0] * 3] * 2 and ids.tolist() == [[0, 1, 2]] * 2
