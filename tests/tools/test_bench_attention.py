"""tools/bench_attention.py at tiny shapes: its rows against the bytes of the einsum path's
score matrix worked out by hand, and the results file's header and tables."""
import importlib

bench = importlib.import_module("tools.bench_attention")

ARGV = ["--lengths", "64,256", "--batch", "2", "--heads", "2", "--head_dim", "8", "--block",
        "16", "--repeats", "1", "--warmup", "0", "--search_max", "1024", "--budget_gib",
        "0.004"]


def test_rows_against_the_score_matrix_bytes_by_hand(tmp_path):
  out = tmp_path / "attention.md"
  results = bench.main(ARGV + ["--out", str(out)])
  rows = {(r["length"], r["kernel"]): r for r in results["rows"]}
  assert sorted(rows) == [(64, "blockwise"), (64, "einsum"), (256, "blockwise"),
                          (256, "einsum")]
  # One float32 score matrix: batch 2 x heads 2 x 256 queries x 256 keys x 4 bytes.
  score_256 = 2 * 2 * 256 * 256 * 4
  assert rows[256, "einsum"]["score_bytes"] == rows[256, "blockwise"]["score_bytes"] == score_256
  assert rows[64, "einsum"]["score_bytes"] == 2 * 2 * 64 * 64 * 4
  # The einsum path holds its scores (and more) whole; blockwise a few [2, 2, 256, 16]
  # blocks (each 1/16 of the matrix) and [2, 256, 2, 8] accumulators: under half of one
  # 256 x 256 score matrix, and under a quarter of the einsum program's temporaries.
  assert rows[256, "einsum"]["temp_bytes"] >= score_256
  assert rows[256, "blockwise"]["temp_bytes"] < score_256 / 2
  assert rows[256, "blockwise"]["temp_bytes"] < rows[256, "einsum"]["temp_bytes"] / 4
  assert all(r["seconds"] > 0 for r in rows.values())  # all within the budget: all ran

  # The budget search doubles from 64 until the einsum program needs more than 4 MiB.
  budget = results["budget"]
  assert [r["length"] for r in budget] == [64 * 2 ** i for i in range(len(budget))]
  assert budget[-1]["einsum"] > 0.004 * 2**30 >= budget[-2]["einsum"]
  assert all(r["blockwise"] < r["einsum"] for r in budget[1:])

  text = out.read_text()
  assert text.startswith("# Attention: einsum vs blockwise")
  assert "- command: `python -m tools.bench_attention --lengths 64,256" in text
  assert "- date: " in text and "- machine: " in text
  assert "| 256 | einsum |" in text and "| 256 | blockwise |" in text
  assert f"| {budget[-1]['length']} |" in text and "| no |" in text


def test_programs_over_the_budget_are_not_run():
  results = bench.main(ARGV[:-1] + ["0.0005", "--search_max", "0", "--lengths", "256"])
  einsum = next(r for r in results["rows"] if r["kernel"] == "einsum")
  assert einsum["seconds"] is None and results["budget"] == []
