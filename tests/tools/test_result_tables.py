"""The results tables of tools/downstream_table.py, lm_table.py and gpthf_table.py,
rendered from hand-made rows: each cell is the number given, formatted as the header says."""
import importlib
import types

import paths

REPO = paths.REPO


def _tool(name):
  return importlib.import_module(f"tools.{name}")


def _cells(text):
  """Rows of the first Markdown table in `text` (header first), cells stripped."""
  rows = [line for line in text.splitlines() if line.startswith("|")]
  return [[c.strip() for c in line.strip("|").split("|")] for line in rows if "---" not in line]


def test_downstream_table_shows_each_ratios_metrics():
  rows = [{"em": 40.0, "f1": 52.346, "step": 200, "compression_ratio": 1, "num_examples": 100,
           "ratio": 1, "minutes": 12.34},
          {"em": 31.25, "f1": 44.999, "step": 200, "compression_ratio": 4, "num_examples": 100,
           "ratio": 4, "minutes": 7.06}]
  assert _cells(_tool("downstream_table").table(rows, "decal_builtin_qa")) == [
      ["C", "em", "f1", "seeds", "examples", "wall minutes"],
      ["1", "40.00", "52.35", "0", "100", "12.3"],
      ["4", "31.25", "45.00", "0", "100", "7.1"]]


def test_downstream_table_gives_mean_and_standard_error_over_seeds():
  rows = [{"em": em, "f1": f1, "step": 150, "compression_ratio": c, "num_examples": 104,
           "ratio": c, "seed": s, "minutes": 5.0}
          for c, s, em, f1 in ((1, 0, 40.0, 50.0), (1, 1, 30.0, 44.0), (1, 2, 35.0, 47.0),
                               (4, 0, 20.0, 25.0), (4, 1, 24.0, 25.0))]
  cells = _cells(_tool("downstream_table").table(rows, "decal_builtin_qa"))
  # C=1 em 40, 30, 35: mean 35, sample s.d. 5, s.e. 5 / sqrt(3) = 2.887; f1 50, 44, 47: mean
  # 47, s.d. 3, s.e. 1.732. C=4 em 20, 24: mean 22, s.d. 2.828, s.e. 2; f1 equal: s.e. 0.
  assert cells[:3] == [["C", "em", "f1", "seeds", "examples", "wall minutes"],
                       ["1", "35.00 ± 2.89", "47.00 ± 1.73", "0, 1, 2", "104", "15.0"],
                       ["4", "22.00 ± 2.00", "25.00 ± 0.00", "0, 1", "104", "10.0"]]
  assert cells[3] == ["C", "seed", "em", "f1", "wall minutes"]
  assert cells[4:] == [[str(r["ratio"]), str(r["seed"]), f"{r['em']:.2f}", f"{r['f1']:.2f}",
                        "5.0"] for r in rows]


def test_downstream_table_runs_each_ratio_once_per_seed(monkeypatch, tmp_path):
  tool = _tool("downstream_table")
  calls = []
  def fake_run(module, args, log):
    calls.append((module, args))
    return 60.0
  fake_eval = types.SimpleNamespace(
      read_metrics=lambda model_dir, task, step: {"step": step, "em": float(len(model_dir)),
                                                  "f1": 1.0},
      read_inferences=lambda model_dir, task, step: [{}] * 7)
  monkeypatch.setattr(tool, "run", fake_run)
  monkeypatch.setattr(tool, "inference_eval", fake_eval)
  tool.main(["--ratios", "1", "4", "--seeds", "3", "5", "--pretrain-steps", "2",
             "--finetune-steps", "1", "--work", str(tmp_path)])
  trains = [dict(a.split("=", 1) for a in args if a.startswith("--gin."))
            for module, args in calls if module == "train"]
  # (ratio, seed) in run order: every ratio for seed 3, then for seed 5; pretrain then fine-tune
  assert [(t["--gin.COMPRESSION_RATIO"], t["--gin.SEED"], t["--gin.MODEL_DIR"]) for t in trains] == [
      ("1", "3", f"'{tmp_path}/pretrain_c1_s3'"), ("1", "3", f"'{tmp_path}/finetune_c1_s3'"),
      ("4", "3", f"'{tmp_path}/pretrain_c4_s3'"), ("4", "3", f"'{tmp_path}/finetune_c4_s3'"),
      ("1", "5", f"'{tmp_path}/pretrain_c1_s5'"), ("1", "5", f"'{tmp_path}/finetune_c1_s5'"),
      ("4", "5", f"'{tmp_path}/pretrain_c4_s5'"), ("4", "5", f"'{tmp_path}/finetune_c4_s5'")]
  assert [t["--gin.INITIAL_CHECKPOINT_PATH"] for t in trains[1::2]] == [
      t["--gin.MODEL_DIR"] for t in trains[0::2]]  # each fine-tune starts from its own seed's


def test_downstream_table_refuses_a_repeated_seed(capsys):
  import pytest
  with pytest.raises(SystemExit):
    _tool("downstream_table").main(["--seeds", "0", "0"])
  assert "repeats a seed" in capsys.readouterr().err


def test_lm_table_shows_perplexity_accuracy_and_notes():
  results = [{"name": "full attention", "states": "256", "perplexity": 51.234,
              "accuracy": 0.31234, "seconds": 99.6},
             {"name": "Dodo", "states": "32 + 22", "perplexity": 60.006, "accuracy": 0.2876,
              "seconds": 80.4, "note": "threshold calibrated on 4 batches"}]
  text = _tool("lm_table").table(results)
  assert _cells(text) == [
      ["model", "states read by the last token", "validation perplexity", "per seed",
       "token accuracy", "train wall per run (s)"],
      ["full attention", "256", "51.23", "51.23", "31.2 %", "100"],
      ["Dodo", "32 + 22", "60.01", "60.01", "28.8 %", "80"]]
  assert text.endswith("\n- Dodo (seed 0): threshold calibrated on 4 batches")


def test_lm_table_gives_mean_and_standard_error_over_seeds():
  results = [{"name": "dodo", "seed": s, "states": "32 + ~22", "perplexity": p, "accuracy": a,
              "seconds": t} for s, p, a, t in ((0, 100.0, 0.20, 90.0), (1, 104.0, 0.23, 110.0),
                                               (2, 108.0, 0.26, 100.0))]
  rows = _cells(_tool("lm_table").table(results))
  # 100, 104, 108: mean 104, sample s.d. 4, s.e. 4 / sqrt(3) = 2.31; accuracy 23 +- 1.73 %.
  assert rows[1] == ["dodo", "32 + ~22", "104.00 ± 2.31", "100.00, 104.00, 108.00",
                     "23.0 ± 1.7 %", "100"]


def test_lm_table_runs_every_variant_once_per_seed_in_its_own_folder(tmp_path, monkeypatch):
  tool = _tool("lm_table")
  calls = []
  monkeypatch.setattr(tool, "run", lambda name, seed, args, work: calls.append(
      (name, seed, tool.gin_setup(name, seed, args, work / f"{name}_s{seed}" / "model")[1]))
      or {"name": name, "seed": seed, "states": "1", "perplexity": 1.0, "accuracy": 0.5,
          "seconds": 1.0})
  tool.main(["--seeds", "4", "7", "--variants", "full,dodo", "--work", str(tmp_path)])
  assert [(n, s) for n, s, _ in calls] == [("full", 4), ("dodo", 4), ("full", 7), ("dodo", 7)]
  for name, seed, bindings in calls:
    assert f"SEED = {seed}" in bindings
    assert f"MODEL_DIR = '{tmp_path}/steps300_batch8_len256/{name}_s{seed}/model'" in bindings


def test_lm_table_refuses_a_repeated_seed(capsys):
  import pytest
  with pytest.raises(SystemExit):
    _tool("lm_table").main(["--seeds", "1", "1"])
  assert "repeats a seed" in capsys.readouterr().err


def _places(scale):
  """Hand-made bucket sums: [summed loss, tokens] with a per-token loss of log(scale)."""
  import math
  return {k: [n * math.log(scale), n] for k, n in
          (("1st", 10), ("2nd-4th", 30), ("5th-16th", 40), ("17th+", 15), ("end", 5))}


def test_gpthf_table_gives_mean_and_standard_error_over_seeds():
  results = [{"name": "gpthf", "seed": s, "perplexity": p, "accuracy": a, "train_seconds": 100.0,
              "places": _places(p)} for s, p, a in ((0, 100.0, 0.20), (1, 110.0, 0.22),
                                                    (2, 120.0, 0.24))]
  results.append({"name": "gpt-6", "seed": 0, "perplexity": 90.0, "accuracy": 0.25,
                  "train_seconds": 80.0, "places": _places(90.0)})
  rows = _cells("\n".join(_tool("gpthf_table").table(results)))
  # 100, 110, 120: mean 110, sample s.d. 10, s.e. 10 / sqrt(3) = 5.77; accuracy 22 +- 1.15.
  assert rows[1] == ["gpthf", "**110.0 ± 5.8**", "100.0, 110.0, 120.0", "22.0 ± 1.2 %",
                     "110.0 ± 5.8", "110.0 ± 5.8", "110.0 ± 5.8", "110.0 ± 5.8", "110.0 ± 5.8",
                     "100"]
  assert rows[2] == ["gpt-6", "**90.0**", "90.0", "25.0 %"] + ["90.0"] * 5 + ["80"]


def test_gpthf_table_buckets_tokens_by_their_place_in_the_sentence():
  import numpy as np
  end = 9
  targets = np.array([[5, 6, end, 7, 8, 7, 6, 5, end, 0]])  # places 0 1 2 | 0 1 2 3 4 5 | pad
  got = {k: np.flatnonzero(v[0]).tolist()
         for k, v in _tool("gpthf_table").place_buckets(targets, end, 64).items()}
  assert got == {"1st": [0, 3], "2nd-4th": [1, 4, 5, 6], "5th-16th": [7], "17th+": [],
                 "end": [2, 8]}
  long_sentence = np.array([[4] * 18 + [end, 3]])  # 18 words: places 0..17, then a new one
  got = {k: np.flatnonzero(v[0]).tolist()
         for k, v in _tool("gpthf_table").place_buckets(long_sentence, end, 64).items()}
  assert got == {"1st": [0, 19], "2nd-4th": [1, 2, 3], "5th-16th": list(range(4, 16)),
                 "17th+": [16, 17], "end": [18]}
