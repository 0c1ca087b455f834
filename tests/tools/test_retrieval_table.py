"""decal_jax/tools/retrieval_table.py without training (that is the end-to-end retrieval test's job):
its per-query spread of NDCG@10 against pytrec_eval's per-query values and numpy, its random
floor against the expectation worked out by hand, the refusals of bad arguments and changed
settings, and the person-written reading surviving a rewrite of the results file."""
import argparse
import importlib
import json
import math

import numpy as np
import pytest
import pytrec_eval

from decal_jax.retrieval import beir, bm25, ir_metrics

import paths

REPO = paths.REPO
table = importlib.import_module("decal_jax.tools.retrieval_table")


def _folder(tmp_path, num_docs=400, num_queries=60):
  """num_docs passages; query j judges doc j relevant (grade 1) in qrels/test.tsv, and
  doc j + 1 with grade 0 (judged, not relevant)."""
  corpus = {f"d{i}": f"passage {i}" for i in range(num_docs)}
  queries = {f"q{j}": f"query {j}" for j in range(num_queries)}
  qrels = {"test": {f"q{j}": {f"d{j}": 1, f"d{j + 1}": 0} for j in range(num_queries)}}
  return beir.write_beir(tmp_path / "beir", corpus, queries, qrels), qrels["test"]


def test_ndcg_stderr_is_the_spread_of_pytrec_evals_per_query_ndcg(tmp_path):
  folder, qrels = _folder(tmp_path, num_docs=30, num_queries=12)
  rng = np.random.default_rng(0)
  run = {q: {f"d{i}": float(s) for i, s in enumerate(rng.normal(size=30))} for q in qrels}
  run_file = tmp_path / "run.trec"
  ir_metrics.write_trec_run(str(run_file), run, depth=30)
  per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(run)
  values = np.array([r["ndcg_cut_10"] for r in per_query.values()])
  a = argparse.Namespace(folder=folder, eval_split="test")
  assert table.ndcg_stderr(run_file, a) == pytest.approx(
      values.std(ddof=1) / math.sqrt(len(values)), rel=1e-9)


def test_random_floor_matches_the_expectation_of_a_random_ranking(tmp_path):
  # One relevant doc among N: it is in a random top 100 with probability 100 / N, and at
  # rank r (1..10) with probability 1 / N, where it adds 1 / log2(r + 1) (the ideal DCG is 1).
  n, queries, repeats = 400, 60, 20
  folder, _ = _folder(tmp_path, n, queries)
  got = table.random_floor(argparse.Namespace(folder=folder, eval_split="test"), repeats)
  recall = 100 / n
  ndcg = sum(1 / math.log2(r + 1) for r in range(1, 11)) / n
  draws = queries * repeats  # independent random rankings averaged
  assert got["recall@100"] == pytest.approx(recall, abs=4 * math.sqrt(recall / draws))
  ndcg_sd = math.sqrt(sum(1 / math.log2(r + 1) ** 2 for r in range(1, 11)) / n - ndcg ** 2)
  assert got["ndcg@10"] == pytest.approx(ndcg, abs=4 * ndcg_sd / math.sqrt(draws))


def test_bad_arguments_are_refused_with_the_fix(tmp_path, capsys):
  (tmp_path / "pretrained" / "checkpoint_800").mkdir(parents=True)
  good = ["--init", str(tmp_path / "pretrained")]
  assert table.parse_args(good).init == str((tmp_path / "pretrained").absolute())
  for argv, message in [
      (["--init", str(tmp_path)], "holds no checkpoint_<step> folder"),
      (good + ["--ratios", "1", "4", "4"], "repeats a ratio"),
      (good + ["--ratios", "0"], "ratios must be integers >= 1"),
      (good + ["--task", "decal_builtin_qa"], "give a BEIR task"),
      (good + ["--passage_length", "1"], "--passage_length >= 2")]:
    with pytest.raises(SystemExit):
      table.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_rerun_with_other_settings_is_refused(tmp_path):
  a = argparse.Namespace(**{k: 1 for k in table.SETTINGS})
  table.check_settings(a, tmp_path)
  table.check_settings(a, tmp_path)  # the same settings: resumes
  assert json.loads((tmp_path / "settings.json").read_text())["steps"] == 1
  a.steps = 2
  with pytest.raises(SystemExit, match="steps: 1 then, 2 now"):
    table.check_settings(a, tmp_path)


def test_rewriting_the_results_keeps_the_written_reading(tmp_path):
  out = tmp_path / "results.md"
  new = "# title\n\n| table v2 |\n\n## Rows (JSON lines)\n\n```jsonl\n{}\n```\n"
  assert table.keep_reading(out, new) == new  # no file yet
  out.write_text("# title\n\n| table v1 |\n\n## Reading\n\n- C = 4 is best.\n\n"
                 "## Rows (JSON lines)\n\n```jsonl\n{}\n```\n")
  assert table.keep_reading(out, new) == (
      "# title\n\n| table v2 |\n\n## Reading\n\n- C = 4 is best.\n\n"
      "## Rows (JSON lines)\n\n```jsonl\n{}\n```\n")


def test_bm25_reference_equals_scores_worked_by_hand():
  # N = 3 docs of 3, 2, 1 words (avgdl 2), k1 = 0.9, b = 0.4, query "Apple cherry":
  #   idf(apple) = ln(1 + 2.5 / 1.5) = ln(8 / 3)  (df 1);  idf(cherry) = ln(1 + 1.5 / 2.5) = ln 1.6
  #   d1: apple tf 2, K = 0.9 (0.6 + 0.4 * 3 / 2) = 1.08 -> ln(8/3) * 2 * 1.9 / (2 + 1.08)
  #   d2: cherry tf 1, K = 0.9 (0.6 + 0.4 * 2 / 2) = 0.90 -> ln 1.6 * 1.9 / 1.9
  #   d3: cherry tf 1, K = 0.9 (0.6 + 0.4 * 1 / 2) = 0.72 -> ln 1.6 * 1.9 / 1.72
  corpus = {"d1": "apple banana apple", "d2": "Banana, cherry!", "d3": "cherry"}
  run = bm25.run(corpus, {"q": "Apple cherry"}, top_k=2)
  d1 = math.log(8 / 3) * 3.8 / 3.08
  d3 = math.log(1.6) * 1.9 / 1.72
  assert run["q"] == pytest.approx({"d1": d1, "d3": d3})  # d2 (ln 1.6 = 0.47) cut by top_k


def test_paired_difference_is_the_mean_and_spread_of_per_query_differences(tmp_path):
  folder, qrels = _folder(tmp_path, num_docs=30, num_queries=12)
  a = argparse.Namespace(folder=folder, eval_split="test", task="decal_beir_x", steps=5)
  rows, values = [], {}
  for seed, (pooling, ratio) in enumerate([("multi", 4), ("multi", 1), ("mean", 1)]):
    rng = np.random.default_rng(seed)
    run = {q: {f"d{i}": float(s) for i, s in enumerate(rng.normal(size=30))} for q in qrels}
    row = {"pooling": pooling, "ratio": ratio}
    ir_metrics.write_trec_run(str(table.run_file_of(row, a, tmp_path)), run, depth=30)
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(run)
    values[(pooling, ratio)] = np.array([per_query[q]["ndcg_cut_10"] for q in sorted(qrels)])
    rows.append(row)
  table.paired_to_base(rows, a, tmp_path)
  for row in rows:  # the base is multi-vector C = 1 (the second row here)
    d = values[(row["pooling"], row["ratio"])] - values[("multi", 1)]
    assert row["ndcg_vs_base"] == pytest.approx([d.mean(), d.std(ddof=1) / math.sqrt(len(d))])
  assert rows[1]["ndcg_vs_base"] == [0.0, 0.0]
  # The rendered table: NDCG cells are numpy's mean +- s.e. of pytrec_eval's per-query values.
  for i, row in enumerate(rows):
    row.update({"label": f"v{i}", "ndcg@10": float(values[(row["pooling"], row["ratio"])].mean()),
                "ndcg_stderr": table.ndcg_stderr(table.run_file_of(row, a, tmp_path), a),
                "recall@100": 0.5, "heldout_accuracy": None, "vectors_per_doc": 4.0 / (i + 1),
                "index_bytes": 2 ** 20 * (i + 1), "train_minutes": 1.0, "eval_minutes": 2.0})
  lines = table.table(rows).splitlines()[2:]
  for i, (row, line) in enumerate(zip(rows, lines)):
    cells = [c.strip() for c in line.strip("|").split("|")]
    v = values[(row["pooling"], row["ratio"])]
    d = v - values[("multi", 1)]
    assert cells[1] == f"{v.mean():.4f} ± {v.std(ddof=1) / math.sqrt(len(v)):.4f}"
    assert cells[2] == ("-" if i == 1 else
                        f"{d.mean():+.4f} ± {d.std(ddof=1) / math.sqrt(len(d)):.4f}")
    assert cells[6:8] == [f"{i + 1:.2f}", f"{(i + 1) / 2:.3f}"]  # MiB; to the base's 2 MiB
