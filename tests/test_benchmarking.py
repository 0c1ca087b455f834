"""tools.benchmarking and results_files: random weights re-derived with numpy, XLA's FLOP count of a matmul
against 2 m n k, the Markdown / JSON lines writers against hand-written text, and the
side-by-side bookkeeping on hand-made timings."""
import argparse
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tools import benchmarking, results_files


def test_random_params_are_stretches_of_one_seeded_block():
  shapes = {"dense": {"kernel": jax.ShapeDtypeStruct((3, 4), jnp.float32),
                      "scale": jax.ShapeDtypeStruct((4,), jnp.float32)},
            "embed": jax.ShapeDtypeStruct((2, 5), jnp.float32)}
  got = benchmarking.random_params(shapes, jnp.float32, seed=7, std=0.5)
  rng = np.random.default_rng(7)  # the same draws, in the order of the leaves' paths
  block = 0.5 * rng.standard_normal(benchmarking.RANDOM_BLOCK, dtype=np.float32)
  start = int(rng.integers(0, benchmarking.RANDOM_BLOCK - 12 + 1))
  np.testing.assert_array_equal(got["dense"]["kernel"], block[start:start + 12].reshape(3, 4))
  np.testing.assert_array_equal(got["dense"]["scale"], np.ones(4, np.float32))
  start = int(rng.integers(0, benchmarking.RANDOM_BLOCK - 10 + 1))
  np.testing.assert_array_equal(got["embed"], block[start:start + 10].reshape(2, 5))
  assert benchmarking.param_count(shapes) == 12 + 4 + 10


def test_xla_counts_two_m_n_k_flops_for_a_matmul():
  m, n, k = 8, 16, 32
  compiled = jax.jit(jnp.matmul).lower(jnp.ones((m, k)), jnp.ones((k, n))).compile()
  assert benchmarking.xla_cost(compiled) == pytest.approx(2 * m * n * k, rel=0.05)


def test_weights_that_exceed_half_the_free_memory_are_refused():
  benchmarking.check_weights_fit(500, 1000)
  benchmarking.check_weights_fit(10**12, None)  # unknown free memory: no check
  with pytest.raises(benchmarking.DoesNotFit, match="the weights need"):
    benchmarking.check_weights_fit(501, 1000)


def test_markdown_table_and_header():
  assert benchmarking.table(["a", "b"], [(1, "x"), (2.5, "y")]) == [
      "| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | y |"]
  lines = benchmarking.header("Title", "-m decal_jax.commands.t --n 1", "setting one", "", None)
  assert lines[:3] == ["# Title", "", "- command: `python -m decal_jax.commands.t --n 1`"]
  assert lines[-1] == "- setting one" and len(lines) == 6  # empty settings are left out
  assert f"jax {jax.__version__}" in lines[4]


def test_jsonl_appends_one_line_per_row(tmp_path):
  path = tmp_path / "sub" / "rows.jsonl"
  results_files.write_jsonl(str(path), [{"a": 1}])
  results_files.write_jsonl(str(path), [{"a": 2}, {"b": [1, 2]}])
  assert [json.loads(line) for line in path.read_text().splitlines()] == [
      {"a": 1}, {"a": 2}, {"b": [1, 2]}]


def _results(rows):
  """A hand-made results text: title, a setting, one table line per row."""
  return "# Title\n\n- setting\n\n" + "".join(f"| {row} |\n" for row in rows)


def test_partial_results_are_marked_under_the_title_until_every_row_is_done(tmp_path):
  args = argparse.Namespace(out=str(tmp_path / "sub" / "r.md"), plot=str(tmp_path / "r.png"))
  plotted = []

  def write(rows, total, **kwargs):
    results_files.write_partial(args, rows, len(rows), total, _results,
                                lambda rows, path: plotted.append((rows, path)), **kwargs)
  write(["a"], 3)
  assert pathlib.Path(args.out).read_text() == (
      "# Title\n\n**Partial: stopped after 1 of 3 rows**\n\n- setting\n\n| a |\n")
  write(["a", "b"], 3, unit="steps", detail="builds 2 of 2")
  assert pathlib.Path(args.out).read_text().splitlines()[2] == (
      "**Partial: stopped after 2 of 3 steps** (builds 2 of 2)")
  assert plotted == [(["a"], args.plot), (["a", "b"], args.plot)]
  write(["a", "b", "c"], 3)  # every row done: the tool's final results follow, not these
  assert "| c |" not in pathlib.Path(args.out).read_text() and len(plotted) == 2
  assert sorted(p.name for p in pathlib.Path(args.out).parent.iterdir()) == ["r.md"]


def test_a_rewritten_results_file_keeps_the_reading_below_its_marker(tmp_path, capsys):
  out = tmp_path / "r.md"
  results_files.report("# New\n\n| 2 |\n", str(out))  # no file yet: the text alone
  assert out.read_text() == "# New\n\n| 2 |\n"
  out.write_text("# Old\n\n| 1 |\n\n" + results_files.READING + "\n\n## Reading\n\nMine.\n")
  results_files.report("# New\n\n| 2 |\n", str(out))
  assert out.read_text() == ("# New\n\n| 2 |\n\n" + results_files.READING +
                             "\n\n## Reading\n\nMine.\n")
  args = argparse.Namespace(out=str(out), plot=None)
  results_files.write_partial(args, ["a"], 1, 2, _results)  # a partial rewrite keeps it too
  text = out.read_text()
  assert text.startswith("# Title\n\n**Partial") and text.endswith("## Reading\n\nMine.\n")
  assert text.count(results_files.READING) == 1


def test_a_partial_write_that_fails_leaves_the_last_file_whole(tmp_path):
  args = argparse.Namespace(out=str(tmp_path / "r.md"), plot=None)
  results_files.write_partial(args, ["a"], 1, 2, _results)
  before = (tmp_path / "r.md").read_text()

  class Stop(Exception):
    pass

  def markdown(rows):
    raise Stop  # as a kill while the new results are put together
  with pytest.raises(Stop):
    results_files.write_partial(args, ["a", "b"], 2, 3, markdown)
  assert (tmp_path / "r.md").read_text() == before
  assert [p.name for p in tmp_path.iterdir()] == ["r.md"]  # no temporary file left


def test_a_saved_figure_is_the_png_matplotlib_writes(tmp_path):
  plt = results_files.pyplot()
  figures = []
  for _ in range(2):
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([1, 2, 3], [3, 1, 2])
    figures.append(fig)
  figures[0].savefig(tmp_path / "direct.png", dpi=120)
  results_files.save_figure(figures[1], str(tmp_path / "sub" / "saved.png"))
  assert (tmp_path / "sub" / "saved.png").read_bytes() == (tmp_path / "direct.png").read_bytes()
  assert [p.name for p in (tmp_path / "sub").iterdir()] == ["saved.png"]


def test_sides_alternate_and_report_medians_of_hand_made_runs():
  assert benchmarking.alternating([1, 2, 3], 0) == [1, 2, 3]
  assert benchmarking.alternating([1, 2, 3], 1) == [3, 2, 1]
  order, times = [], iter([0.3, 0.1, 0.2, 0.5, 0.4, 0.6])

  def side(name):
    def runner():
      order.append(name)
      return benchmarking.Run({"a": next(times), "b": 1.0}, np.zeros((1, 1)))
    return benchmarking.Side(name, runner, None)

  sides = [side("x"), side("y")]
  benchmarking.measure_sides(sides, warmup=1, repeats=2)
  assert order == ["x", "y", "y", "x", "x", "y"]  # reversed every repeat
  x, y = sides  # x ran at 0.3 (warm-up), 0.5, 0.4; y at 0.1 (warm-up), 0.2, 0.6
  assert x.median("a") == pytest.approx(0.45) and y.median() == pytest.approx(1.4)
  assert x.ms_range() == "1450.0 (1400.0-1500.0)"


def test_int_list_rejects_what_is_not_positive_integers():
  parser = argparse.ArgumentParser()
  assert benchmarking.int_list(parser, "4, 8,16", "--x") == [4, 8, 16]
  for bad in ("4,x", "0,2", ""):
    with pytest.raises(SystemExit):
      benchmarking.int_list(parser, bad, "--x")
  assert math.isclose(benchmarking.Run(0.25, None).total, 0.25)


def test_a_failed_entry_point_exits_with_the_end_of_its_log(tmp_path, monkeypatch):
  """The log is often in a temporary folder gone by the time the user reads the message, so
  the message carries its last lines; a SIGKILL (the OOM killer's signal) is named as such."""
  log = tmp_path / "run.log"
  with pytest.raises(SystemExit) as e:
    benchmarking.run_entry_point("tools.no_such_tool", [], str(log))
  assert "tools.no_such_tool failed (exit 1)" in str(e.value)
  assert "No module named tools.no_such_tool" in str(e.value)
  assert "SIGKILL" not in str(e.value)

  def killed(argv, stdout, **kwargs):
    stdout.write("step 1 of 7\n")
    return benchmarking.subprocess.CompletedProcess(argv, -9)
  monkeypatch.setattr(benchmarking.subprocess, "run", killed)
  with pytest.raises(SystemExit) as e:
    benchmarking.run_entry_point("tools.bench_train", [], str(log))
  assert "(exit -9) (killed by SIGKILL: on Linux usually the out-of-memory killer" in str(e.value)
  assert str(e.value).endswith("step 1 of 7\n")
