"""tools/retrieval_table.py without training (that is the end-to-end retrieval test's job):
its per-query spread of NDCG@10 against pytrec_eval's per-query values and numpy, its random
floor against the expectation worked out by hand, the refusals of bad arguments and changed
settings, and the person-written reading surviving a rewrite of the results file; with
--seeds, the mean +- s.e. over seeds and paired-by-seed differences worked by hand, and the
per-seed folders, resume and reuse of finished seeds with training and search faked; with
several --init checkpoints, every (checkpoint, seed) pair a run, paired and averaged as one."""
import argparse
import importlib
import json
import math
import pathlib

import numpy as np
import pytest
import pytrec_eval

from decal_jax.retrieval import beir, bm25, ir_metrics

import paths

REPO = paths.REPO
table = importlib.import_module("tools.retrieval_table")


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
  a = argparse.Namespace(folder=folder, eval_split="test", task="decal_beir_x", steps=5,
                         inits=["/runs/pretrained"])
  rows, values = [], {}
  for seed, (pooling, ratio) in enumerate([("multi", 4), ("multi", 1), ("mean", 1)]):
    rng = np.random.default_rng(seed)
    run = {q: {f"d{i}": float(s) for i, s in enumerate(rng.normal(size=30))} for q in qrels}
    row = {"pooling": pooling, "ratio": ratio, "seed": 0}
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


def _seeded_row(label, ratio, seed, ndcg, recall, accuracy, index_mib, vs_base):
  return {"label": label, "ratio": ratio, "pooling": "multi", "seed": seed, "ndcg@10": ndcg,
          "ndcg_stderr": 0.02, "ndcg_vs_base": vs_base, "recall@100": recall,
          "heldout_accuracy": accuracy, "vectors_per_doc": 56.0 / ratio,
          "index_bytes": index_mib * 2 ** 20, "train_minutes": 1.0 + seed, "eval_minutes": 0.5}


def test_table_over_seeds_gives_mean_se_and_paired_by_seed_differences():
  c1, c4 = "multi-vector, C = 1", "multi-vector, C = 4"
  rows = [_seeded_row(c4, 4, s, n, 0.4, None, 0.5, [n - b, 0.005])
          for s, n, b in ((0, 0.25, 0.30), (1, 0.35, 0.36), (2, 0.27, 0.33))]
  rows += [_seeded_row(c1, 1, s, n, r, acc, 2.0, [0.0, 0.0])
           for s, n, r, acc in ((0, 0.30, 0.5, 0.2), (1, 0.36, 0.6, 0.3), (2, 0.33, 0.7, 0.4))]
  text = table.table(rows)
  summary, per_seed = text.split("\n\n")
  # C = 4: NDCG 0.25, 0.35, 0.27: mean 0.29, squared deviations .0016 + .0036 + .0004 = .0056,
  #   s.d. sqrt(.0028) = .05292, s.e. .03055. Minus the same seed's C = 1 (0.30, 0.36, 0.33):
  #   -0.05, -0.01, -0.06: mean -0.04, deviations .0001 + .0009 + .0004 = .0014, s.d.
  #   sqrt(.0007) = .02646, s.e. .01528 (the two means' s.e. would add to ~.035). Recall 0.4
  #   three times: s.e. 0. Minutes 1, 2, 3 per seed: mean 2.
  # C = 1: NDCG 0.30, 0.36, 0.33: mean 0.33, s.d. 0.03, s.e. .01732; recall 0.5, 0.6, 0.7:
  #   s.e. 0.1 / sqrt 3 = .05774; accuracy 0.2, 0.3, 0.4: 0.300 +- .058.
  assert _cells(summary)[1:] == [
      [c4, "0.2900 ± 0.0306", "-0.0400 ± 0.0153", "0.4000 ± 0.0000", "-", "14.00", "0.50",
       "0.250", "2.0", "0.5", "0, 1, 2"],
      [c1, "0.3300 ± 0.0173", "-", "0.6000 ± 0.0577", "0.300 ± 0.058", "56.00", "2.00",
       "1.000", "2.0", "0.5", "0, 1, 2"]]
  assert _cells(summary)[0][-1] == "seeds"
  # One line per row and seed, with that run's per-query s.e. and paired difference.
  assert _cells(per_seed)[1:] == [
      [c4, "0", "0.2500 ± 0.0200", "-0.0500 ± 0.0050", "0.4000", "-"],
      [c4, "1", "0.3500 ± 0.0200", "-0.0100 ± 0.0050", "0.4000", "-"],
      [c4, "2", "0.2700 ± 0.0200", "-0.0600 ± 0.0050", "0.4000", "-"],
      [c1, "0", "0.3000 ± 0.0200", "-", "0.5000", "0.200"],
      [c1, "1", "0.3600 ± 0.0200", "-", "0.6000", "0.300"],
      [c1, "2", "0.3300 ± 0.0200", "-", "0.7000", "0.400"]]


def _cells(text):
  return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
          if line.startswith("|") and "---" not in line]


def _fake_runs(monkeypatch, tmp_path):
  """Replaces the fine-tune and the search by fakes that write what the real ones would
  (a held-out report in the log; metrics and a TREC run whose scores depend on the row and
  seed); returns the list of (module, {gin macro: value}) calls."""
  folder, qrels = _folder(tmp_path / "data", num_docs=30, num_queries=12)
  calls = []

  def fake_run(module, args, log):
    gin = dict(a[len("--gin."):].split("=", 1) for a in args if a.startswith("--gin."))
    calls.append((module, gin))
    if module == "train":
      with open(log, "a") as f:
        f.write("Held-out (validation) at step 3: accuracy 0.5 loss 1.0 num_queries 12\n")
      return 60.0
    ratio = int(gin["PASSAGE_COMPRESSION_RATIO"])
    out = pathlib.Path(gin["MODEL_DIR"].strip("'")) / "retrieval"
    out.mkdir(parents=True)
    rng = np.random.default_rng(10 * ratio + len(calls))
    run = {q: {f"d{i}": float(s) for i, s in enumerate(rng.normal(size=30))} for q in qrels}
    ir_metrics.write_trec_run(str(out / "decal_beir_x.test.step3.trec"), run, depth=30)
    (out / "decal_beir_x.test.step3.metrics.json").write_text(json.dumps(dict(
        ir_metrics.evaluate(run, qrels), vectors_per_doc=8.0 / ratio, index_bytes=1000 // ratio,
        num_queries=12, num_docs=30)))
    return 30.0

  def fake_splits(a):
    a.folder, a.validation_split = folder, a.validation_split or "test"

  monkeypatch.setattr(table, "run", fake_run)
  monkeypatch.setattr(table, "resolve_splits", fake_splits)
  return calls


def test_each_row_is_fine_tuned_once_per_seed_and_reruns_reuse_finished_seeds(
    monkeypatch, tmp_path, capsys):
  calls = _fake_runs(monkeypatch, tmp_path)
  (tmp_path / "init" / "checkpoint_8").mkdir(parents=True)
  work = tmp_path / "work"
  argv = ["--init", str(tmp_path / "init"), "--task", "decal_beir_x", "--ratios", "1", "4",
          "--steps", "3", "--work", str(work)]
  table.main(argv + ["--seeds", "3", "5"])
  trains = [(g["PASSAGE_COMPRESSION_RATIO"], g["SEED"], g["MODEL_DIR"])
            for m, g in calls if m == "train"]
  # every row for seed 3, then every row for seed 5, each in its own folder
  assert trains == [("1", "3", f"'{work}/multi_c1_s3'"), ("4", "3", f"'{work}/multi_c4_s3'"),
                    ("1", "5", f"'{work}/multi_c1_s5'"), ("4", "5", f"'{work}/multi_c4_s5'")]
  searches = [g["MODEL_DIR"] for m, g in calls if m == "retrieve"]
  assert searches == [t[2] for t in trains]
  assert sorted(p.name for p in work.glob("*.row.json")) == [
      "multi_c1_s3.row.json", "multi_c1_s5.row.json", "multi_c4_s3.row.json",
      "multi_c4_s5.row.json"]
  first = capsys.readouterr().out

  # The same command: nothing is trained or searched again, the same table comes out.
  calls.clear()
  table.main(argv + ["--seeds", "3", "5"])
  assert calls == []
  assert capsys.readouterr().out.split("\n\n", 1)[1] == first.split("\n\n", 1)[1]

  # One more seed: only its rows run; the table has three seeds per row, paired by seed.
  out = tmp_path / "table.md"
  table.main(argv + ["--seeds", "3", "5", "7", "--out", str(out)])
  assert [(m, g["MODEL_DIR"]) for m, g in calls] == [
      ("train", f"'{work}/multi_c1_s7'"), ("retrieve", f"'{work}/multi_c1_s7'"),
      ("train", f"'{work}/multi_c4_s7'"), ("retrieve", f"'{work}/multi_c4_s7'")]
  rows = [json.loads((work / f"multi_c{c}_s{s}.row.json").read_text())
          for c in (1, 4) for s in (3, 5, 7)]
  ndcg = np.array([r["ndcg@10"] for r in rows]).reshape(2, 3)
  d = ndcg[1] - ndcg[0]
  text = out.read_text()
  c4_line = next(line for line in text.splitlines() if line.startswith("| multi-vector, C = 4 |"))
  cells = [c.strip() for c in c4_line.strip("|").split("|")]
  assert cells[1] == f"{ndcg[1].mean():.4f} ± {ndcg[1].std(ddof=1) / math.sqrt(3):.4f}"
  assert cells[2] == f"{d.mean():+.4f} ± {d.std(ddof=1) / math.sqrt(3):.4f}"
  assert cells[-1] == "3, 5, 7"
  assert "every row fine-tuned once per seed (gin SEED 3, 5, 7)" in text


def test_a_repeated_seed_is_refused(tmp_path, capsys):
  (tmp_path / "pretrained" / "checkpoint_800").mkdir(parents=True)
  with pytest.raises(SystemExit):
    table.parse_args(["--init", str(tmp_path / "pretrained"), "--seeds", "0", "1", "0"])
  assert "--seeds repeats a seed ([0, 1, 0])" in capsys.readouterr().err


def test_several_checkpoints_make_each_checkpoint_and_seed_a_run(monkeypatch, tmp_path):
  calls = _fake_runs(monkeypatch, tmp_path)
  inits = [tmp_path / "pre" / name for name in ("main_s0", "main_s1")]
  for init in inits:
    (init / "checkpoint_800").mkdir(parents=True)
  work, out = tmp_path / "work", tmp_path / "table.md"
  argv = ["--init", *map(str, inits), "--task", "decal_beir_x", "--ratios", "1", "4",
          "--steps", "3", "--work", str(work), "--seeds", "3", "5", "--out", str(out)]
  table.main(argv)
  trains = [(g["INITIAL_CHECKPOINT_PATH"], g["SEED"], g["MODEL_DIR"])
            for m, g in calls if m == "train"]
  # every row from each checkpoint with each seed, in a folder named after the checkpoint
  assert trains == [(f"'{init}'", seed, f"'{work}/{init.name}/multi_c{c}_s{seed}'")
                    for init in inits for seed in ("3", "5") for c in (1, 4)]
  rows = {(init.name, s, c): json.loads((work / init.name / f"multi_c{c}_s{s}.row.json")
                                        .read_text())
          for init in inits for s in (3, 5) for c in (1, 4)}
  assert all(row["init"] == key[0] for key, row in rows.items())
  runs = [(i.name, s) for i in inits for s in (3, 5)]
  ndcg = np.array([[rows[(*run, c)]["ndcg@10"] for run in runs] for c in (1, 4)])  # [2, 4]
  d = ndcg[1] - ndcg[0]  # paired within each (checkpoint, seed) run
  text = out.read_text()
  c4 = _cells(next(line for line in text.splitlines()
                   if line.startswith("| multi-vector, C = 4 |")))[0]
  assert c4[1] == f"{ndcg[1].mean():.4f} ± {ndcg[1].std(ddof=1) / 2:.4f}"  # sqrt(4 runs)
  assert c4[2] == f"{d.mean():+.4f} ± {d.std(ddof=1) / 2:.4f}"
  assert c4[-1] == "main_s0 s3, main_s0 s5, main_s1 s3, main_s1 s5"
  assert "from each of 2 pretrained checkpoints (main_s0, main_s1)" in text
  assert "| multi-vector, C = 4 | main_s1 s5 |" in text  # the per-run table

  # The same command again trains nothing.
  calls.clear()
  table.main(argv)
  assert calls == []


def test_checkpoints_with_the_same_folder_name_are_refused(tmp_path, capsys):
  for parent in ("a", "b"):
    (tmp_path / parent / "decal_tiny" / "checkpoint_800").mkdir(parents=True)
  with pytest.raises(SystemExit):
    table.parse_args(["--init", str(tmp_path / "a" / "decal_tiny"),
                      str(tmp_path / "b" / "decal_tiny")])
  assert "the folder names must differ" in capsys.readouterr().err


def test_a_checkpoint_per_ratio_and_the_asymmetric_rows(monkeypatch, tmp_path):
  """`{C}` in --init: each row starts from its own ratio's checkpoint, a ratio without one
  is skipped and named in the results; --asymmetric adds queries at C = 1 for C > 1, in
  folders of their own, paired with the C = 1 row of the same run."""
  calls = _fake_runs(monkeypatch, tmp_path)
  for c, s in ((1, 0), (4, 0), (1, 1), (4, 1), (8, 0)):
    (tmp_path / "pre" / f"pre_c{c}_s{s}" / "checkpoint_800").mkdir(parents=True)
  work, out = tmp_path / "work", tmp_path / "table.md"
  template = str(tmp_path / "pre" / "pre_c{C}_s{S}")
  table.main(["--init", template.replace("{S}", "0"), template.replace("{S}", "1"),
              "--task", "decal_beir_x", "--ratios", "1", "4", "8", "--asymmetric",
              "--steps", "3", "--work", str(work), "--seeds", "3", "--out", str(out)])
  trains = [(g["INITIAL_CHECKPOINT_PATH"], g["MODEL_DIR"], g.get("QUERY_COMPRESSION_RATIO"))
            for m, g in calls if m == "train"]
  pre = tmp_path / "pre"
  assert trains == [
      (f"'{pre}/pre_c1_s0'", f"'{work}/pre_cC_s0/multi_c1_s3'", None),
      (f"'{pre}/pre_c4_s0'", f"'{work}/pre_cC_s0/multi_c4_s3'", None),
      (f"'{pre}/pre_c8_s0'", f"'{work}/pre_cC_s0/multi_c8_s3'", None),
      (f"'{pre}/pre_c4_s0'", f"'{work}/pre_cC_s0/multi_c4_q1_s3'", "1"),
      (f"'{pre}/pre_c8_s0'", f"'{work}/pre_cC_s0/multi_c8_q1_s3'", "1"),
      (f"'{pre}/pre_c1_s1'", f"'{work}/pre_cC_s1/multi_c1_s3'", None),
      (f"'{pre}/pre_c4_s1'", f"'{work}/pre_cC_s1/multi_c4_s3'", None),
      (f"'{pre}/pre_c4_s1'", f"'{work}/pre_cC_s1/multi_c4_q1_s3'", "1")]
  searches = [(g["MODEL_DIR"], g.get("QUERY_COMPRESSION_RATIO")) for m, g in calls
              if m == "retrieve"]
  assert searches == [(t[1], t[2]) for t in trains]
  text = out.read_text()
  assert "not run (no checkpoint): multi-vector, C = 8, seed 3, from " in text
  assert text.count("pre_c8_s1") == 2  # the symmetric and the asymmetric C = 8 rows
  rows = {p.name: json.loads(p.read_text()) for p in work.glob("*/*.row.json")}
  c1, c4q1 = rows["multi_c1_s3.row.json"], rows["multi_c4_q1_s3.row.json"]
  assert (c4q1["ratio"], c4q1["query_ratio"], c1["query_ratio"]) == (4, 1, 1)
  runs = [json.loads((work / f"pre_cC_s{s}" / f"multi_c{c}_s3.row.json").read_text())
          ["ndcg@10"] for c in (1, 4) for s in (0, 1)]
  d = np.array(runs[2:]) - np.array(runs[:2])  # C = 4 minus C = 1, paired per pretraining seed
  c4 = _cells(next(line for line in text.splitlines()
                   if line.startswith("| multi-vector, C = 4 |")))[0]
  assert c4[2] == f"{d.mean():+.4f} ± {d.std(ddof=1) / math.sqrt(2):.4f}"
  assert any(line.startswith("| multi-vector, C = 8, queries C = 1 |") for line in
             text.splitlines())
  assert "otherwise) fine-tuned 3 steps with in-batch softmax" in text
