"""tools/bench_retrieval_scale.py on tiny shapes (a BEIR folder written here, a small
synthetic corpus): exact rows are the reference (recall 1, no loss), an uncompressed
residual index probing every centroid and reranking every document equals exact, bytes per
passage are what the codes and vector counts give, and the results file holds every row."""
import importlib
import json
import math

import matplotlib.image
import numpy as np
import pytest

from decal_jax.retrieval import beir, bm25, kernels

import partial_runs

bench = importlib.import_module("tools.bench_retrieval_scale")

WORDS = ("river stone light garden winter engine paper signal forest market copper cloud "
         "harbor violin planet orchard lantern meadow compass thunder").split()
DIM, PASSAGE_WORDS = 16, 24


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("scale")
  rng = np.random.default_rng(0)
  corpus = {f"d{i}": beir.Passage("", " ".join(rng.choice(WORDS, int(rng.integers(1, 40)))))
            for i in range(60)}
  queries = {f"q{j}": " ".join(rng.choice(WORDS, 3)) for j in range(8)}
  qrels = {"test": {q: {f"d{5 * j}": 1} for j, q in enumerate(queries)}}
  beir.write_beir(tmp / "beir", corpus, queries, qrels)
  out = tmp / "scale.md"
  rows = bench.main(["--beir_folder", str(tmp / "beir"), "--msmarco_folder", "",
                     "--passage_length",
                     str(PASSAGE_WORDS), "--synthetic_passages", "300",
                     "--synthetic_length", "8", "--synthetic_topics", "20",
                     "--synthetic_queries", "10", "--dim", str(DIM), "--ratios", "1", "3",
                     "--bits", "2", "none", "--nprobe", "100000", "--candidates", "100000",
                     "--top_k", "20", "--out", str(out)])
  lengths = [min(len(bm25.words(p.text)), PASSAGE_WORDS) for p in corpus.values()]
  return rows, out.read_text(), lengths


def test_exact_rows_are_the_reference_and_none_bits_equal_exact(result):
  rows, _, _ = result
  assert len(rows) == 2 * 2 * 3  # corpora x ratios x (exact, 2 bits, none)
  args = bench.parse_args(["--ratios", "1", "3", "--bits", "2", "none"])
  assert bench.row_count(args, ["beir", "synthetic"]) == len(rows)
  for row in rows:
    if row["search"] == "exact":
      assert row["recall_vs_exact"] == 1.0 and "ndcg_loss" not in row
    elif row["bits"] == "none":  # every centroid probed, every doc reranked, raw vectors
      assert row["recall_vs_exact"] == 1.0 and row["ndcg_loss"] == pytest.approx(0, abs=1e-9)
    assert 0.0 <= row["ndcg@10"] <= 1.0


def test_bytes_per_passage_follow_vector_counts_and_codes(result):
  rows, _, lengths = result
  for ratio in (1, 3):
    vectors = sum(math.ceil(n / ratio) for n in lengths)
    mine = {r["bits"]: r for r in rows if r["corpus"] == "beir" and r["ratio"] == ratio}
    assert mine["float16"]["vectors_per_passage"] == pytest.approx(vectors / len(lengths))
    assert mine["float16"]["bytes_per_passage"] == pytest.approx(vectors * DIM * 2 / 60)
    assert mine[2]["bytes_per_passage"] == pytest.approx(vectors * (2 + DIM // 4) / 60)
    assert mine["none"]["bytes_per_passage"] == pytest.approx(vectors * (2 + DIM * 2) / 60)
  synthetic = [r for r in rows if r["corpus"].startswith("synthetic") and r["ratio"] == 3]
  assert synthetic[0]["vectors_per_passage"] == 3  # ceil(8 / 3)


def test_pool_is_the_unit_mean_of_c_consecutive_vectors():
  rng = np.random.default_rng(1)
  vectors = [rng.standard_normal((n, DIM)).astype(np.float32) for n in (1, 5, 6)]
  pooled, valid = bench.pool(vectors, 3, DIM)
  assert pooled.shape == (3, 2, DIM) and valid.sum(axis=1).tolist() == [1, 2, 2]
  expected = vectors[1][3:].mean(axis=0)
  np.testing.assert_allclose(pooled[1, 1], expected / np.linalg.norm(expected), rtol=1e-5)


def test_pool_of_equal_lengths_matches_the_padded_path():
  rng = np.random.default_rng(2)
  vectors = [rng.standard_normal((6, DIM)).astype(np.float32) for _ in range(4)]
  fast, valid = bench.pool(vectors, 3, DIM)  # one reshape
  padded, _ = bench.pool(vectors + [rng.standard_normal((1, DIM)).astype(np.float32)], 3, DIM)
  assert valid.all() and fast.shape == (4, 2, DIM)
  np.testing.assert_allclose(fast, padded[:4], rtol=1e-6)


def test_msmarco_folder_reads_judged_queries(tmp_path):
  (tmp_path / "collection.tsv").write_text("p1\triver stone\np2\tgarden light\n")
  (tmp_path / "queries.tsv").write_text("q1\triver\nq2\tunjudged words\n")
  (tmp_path / "qrels.txt").write_text("q1 0 p1 1\n")
  args = bench.parse_args(["--beir_folder", "", "--msmarco_folder", str(tmp_path),
                           "--synthetic_passages", "0", "--dim", str(DIM)])
  corpus = bench.msmarco_corpus(str(tmp_path), args)
  assert corpus.doc_ids == ["p1", "p2"] and corpus.qids == ["q1"]
  assert corpus.qrels == {"q1": {"p1": 1}} and corpus.queries.shape == (1, 1, DIM)


def test_results_file_has_command_tables_and_rows(result):
  rows, text, _ = result
  assert text.startswith("# Exact vs approximate") and "- command: `python " in text
  assert "- machine:" in text and "## beir" in text and "## synthetic 300 passages" in text
  assert "Partial" not in text  # a completed run (it wrote partial results on the way)
  assert _records(text) == json.loads(json.dumps(rows))


def _records(text):
  return [json.loads(line) for line in text.split("```jsonl\n")[1].split("```")[0]
          .splitlines()]


def test_a_run_stopped_after_its_first_row_leaves_that_row_marked_partial(tmp_path,
                                                                         monkeypatch):
  finished = partial_runs.stop_after_first_partial(monkeypatch, bench.results_files)
  out, png = tmp_path / "s.md", tmp_path / "s.png"
  with pytest.raises(partial_runs.Stop):
    bench.main(["--beir_folder", "", "--msmarco_folder", "", "--synthetic_passages", "120",
                "--synthetic_length", "8", "--synthetic_topics", "10", "--synthetic_queries",
                "6", "--dim", str(DIM), "--ratios", "2", "4", "--bits", "2", "none",
                "--nprobe", "1", "4", "--top_k", "10", "--out", str(out), "--plot", str(png)])
  (row,) = finished
  assert row["search"] == "exact" and row["ratio"] == 2
  text = out.read_text()
  # per C: exact, then 2 bit widths x 2 nprobe
  assert text.splitlines()[2] == "**Partial: stopped after 1 of 10 rows**"
  assert _records(text) == json.loads(json.dumps([row]))
  table = [line for line in text.split("## synthetic 120 passages\n")[1].splitlines()
           if line.startswith("| 2 ")]
  assert len(table) == 1 and table[0].startswith("| 2 | exact | float16 | - | - | ")
  assert f" | {row['ndcg@10']:.4f} | - | {row['recall@100']:.4f} | " in table[0]
  assert matplotlib.image.imread(png).std() > 0  # the partial plot decodes as a PNG


def test_wall_line_splits_the_run_into_builds_and_searches():
  """Hand-worked: the residual build counts once per bit width (its rows repeat it), each
  row's search is its queries over its queries/s, the rest is what is left of the wall."""
  rows = [{"corpus": "c", "ratio": 4, "bits": "float16", "search": "exact", "build_s": 120.0,
           "num_queries": 200, "queries_per_s": 0.5},
          *({"corpus": "c", "ratio": 4, "bits": 2, "search": "approximate", "build_s": 300.0,
             "num_queries": 200, "queries_per_s": qps} for qps in (10.0, 20.0))]
  line = bench.wall_line(rows, 1200.0)  # 1200 - 120 - 300 - 400 - 30 = 350 s left
  assert line == ("wall time: 20.0 min in all: exact index builds 2.0, residual index builds "
                  "5.0, exact searches 6.7, approximate searches 0.5, the rest (corpus, "
                  "queries, measures) 5.8")


def test_quantizers_run_side_by_side_on_shared_centroids(tmp_path):
  rows = bench.main(["--beir_folder", "", "--msmarco_folder", "", "--synthetic_passages",
                     "120", "--synthetic_length", "8", "--synthetic_topics", "10",
                     "--synthetic_queries", "6", "--dim", str(DIM), "--ratios", "2",
                     "--bits", "2", "none", "--quantizers", "quantile", "rotated-lloyd",
                     "--top_k", "10", "--out", str(tmp_path / "q.md")])
  approximate = {r["bits"]: r for r in rows if r["search"] == "approximate"}
  assert set(approximate) == {"2 (quantile)", "2 (rotated-lloyd)", "none"}
  assert approximate["2 (quantile)"]["quantizer"] == "quantile"
  assert approximate["2 (rotated-lloyd)"]["quantizer"] == "rotated-lloyd"
  assert approximate["none"]["quantizer"] is None
  assert (approximate["2 (quantile)"]["bytes_per_passage"] ==  # same centroids and codes
          approximate["2 (rotated-lloyd)"]["bytes_per_passage"])
  assert "residual quantizer quantile, rotated-lloyd" in (tmp_path / "q.md").read_text()


@pytest.mark.skipif(not kernels.AVAILABLE, reason="numba is not installed (the [ann] extra)")
def test_compiled_and_numpy_backends_run_side_by_side_and_rank_alike(tmp_path):
  out = tmp_path / "loops.md"
  rows = bench.main(["--beir_folder", "", "--msmarco_folder", "", "--synthetic_passages", "300",
                     "--synthetic_length", "8", "--synthetic_topics", "20",
                     "--synthetic_queries", "10", "--dim", str(DIM), "--ratios", "2",
                     "--bits", "2", "none", "--nprobe", "100000", "--candidates", "100000",
                     "--top_k", "20", "--backend", "compiled", "numpy", "--out", str(out)])
  approximate = {(r["bits"], r["backend"]): r for r in rows if r["search"] == "approximate"}
  assert list(approximate) == [(2, "compiled"), (2, "numpy"), ("none", "compiled"),
                               ("none", "numpy")]
  for bits in (2, "none"):  # every cell probed, every document reranked: the same ranking
    compiled, numpy_ = approximate[bits, "compiled"], approximate[bits, "numpy"]
    assert compiled["ndcg@10"] == pytest.approx(numpy_["ndcg@10"], abs=1e-6)
    assert compiled["recall_vs_exact"] == numpy_["recall_vs_exact"]
  assert approximate["none", "compiled"]["recall_vs_exact"] == 1.0
  assert "| approximate (compiled) |" in out.read_text()


def test_the_backend_defaults_to_numpy_and_compiled_needs_numba(monkeypatch, capsys):
  assert bench.parse_args([]).backend == ["numpy"]
  monkeypatch.setattr(kernels, "AVAILABLE", False)
  with pytest.raises(SystemExit):
    bench.parse_args(["--backend", "compiled"])
  assert "pip install 'decal_jax[ann]'" in capsys.readouterr().err
