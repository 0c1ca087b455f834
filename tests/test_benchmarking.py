"""decal_jax.benchmarking and results_files: random weights re-derived with numpy, XLA's FLOP count of a matmul
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

from decal_jax import benchmarking, results_files


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
  lines = benchmarking.header("Title", "-m decal_jax.tools.t --n 1", "setting one", "", None)
  assert lines[:3] == ["# Title", "", "- command: `python -m decal_jax.tools.t --n 1`"]
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
  assert "No module named decal_jax.tools.no_such_tool" in str(e.value)
  assert "SIGKILL" not in str(e.value)

  def killed(argv, stdout, **kwargs):
    stdout.write("step 1 of 7\n")
    return benchmarking.subprocess.CompletedProcess(argv, -9)
  monkeypatch.setattr(benchmarking.subprocess, "run", killed)
  with pytest.raises(SystemExit) as e:
    benchmarking.run_entry_point("tools.bench_train", [], str(log))
  assert "(exit -9) (killed by SIGKILL: on Linux usually the out-of-memory killer" in str(e.value)
  assert str(e.value).endswith("step 1 of 7\n")


def _trace(*planes):
  """A stand-in for jax.profiler.ProfileData: planes of lines of events, each event a
  (name, duration ns, stats) triple."""
  event = lambda name, ns, stats: argparse.Namespace(name=name, duration_ns=ns,
                                                     stats=list(stats.items()))
  return argparse.Namespace(planes=[argparse.Namespace(name=plane, lines=[
      argparse.Namespace(name=line, events=[event(*e) for e in events])
      for line, events in lines.items()]) for plane, lines in planes])


def test_op_events_read_each_kind_of_trace():
  """XProf's derived "XLA Ops" line when present; a GPU's raw CUPTI trace (kernels on stream
  lines, an `hlo_op` stat naming the HLO op) otherwise; kernel names when no stat names one;
  the host's HLO-op events on the CPU."""
  derived = _trace(("/device:TPU:0", {"XLA Ops": [("fusion.1", 30, {})],
                                      "XLA Modules": [("jit_step", 99, {})]}))
  assert list(benchmarking._op_events(derived)) == [("fusion.1", 30)]
  cupti = _trace(("/host:CPU", {"python": [("step", 500, {})]}),
                 ("/device:GPU:0", {"Stream #13(compute)": [
                     ("loop_fusion_kernel", 7, {"hlo_op": "fusion.2", "hlo_module": "m"}),
                     ("cutlass_gemm_bf16", 40, {"hlo_op": "custom-call.3"})],
                     "Stream #14(memcpy)": [("memcpy", 2, {})]}))
  assert list(benchmarking._op_events(cupti)) == [("fusion.2", 7), ("custom-call.3", 40)]
  bare = _trace(("/device:GPU:0", {"Stream #13": [("sm90_xmma_gemm", 40, {})],
                                   "Launch Stats": [("launch", 1, {})]}))
  assert list(benchmarking._op_events(bare)) == [("sm90_xmma_gemm", 40)]
  cpu = _trace(("/host:CPU", {"XLA pool": [("dot.4", 12, {"hlo_op": "dot.4"}),
                                           ("schedule", 3, {})]}))
  assert list(benchmarking._op_events(cpu)) == [("dot.4", 12)]


def _instruction(name: str, call: str, op_name: str = "") -> str:
  meta = f', metadata={{op_name="jit(step_fn)/{op_name}"}}' if op_name else ""
  return f"  %{name} = f32[4]{{0}} {call}{meta}"


ENCODER = "jvp(Transformer)/Transformer.encode/encoder"
HLO = "\n".join(["HloModule jit_step_fn", "ENTRY %main {", *(_instruction(*i) for i in [
    ("custom-call.1", 'custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"',
     f"{ENCODER}/layers_0/self_attention/query/dot_general"),
    ("loop_convert_fusion", "fusion(%c), kind=kLoop, calls=%fused_convert",
     f"transpose({ENCODER})/relpos_bias/jit(_one_hot)/convert_element_type"),
    ("input_reduce_fusion.7", "fusion(%d), kind=kInput, calls=%fused_reduce",
     f"{ENCODER}/layers_0/pre_attention_layer_norm/reduce_sum"),
    ("dot.3", "dot(%e, %f), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
     "transpose(jvp(Transformer))/Transformer.decode/decoder/layers_1/mlp/wo/dot_general"),
    ("input_reduce_fusion.9", "fusion(%g), kind=kInput, calls=%fused_reduce.2", "reduce_sum"),
    ("loop_multiply_fusion", "fusion(%h), kind=kLoop, calls=%fused_multiply",
     "transpose(jvp())/mul"),
    ("copy.5", "copy(%i)"),
    ("ynn_fusion.2", "fusion(%j, %k), kind=kCustom, calls=%fused_dot")]), "}", "",
    "%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4] {",  # its metadata inside (CPU)
    _instruction("dot.9", "dot(%p0, %p1), lhs_contracting_dims={1}",
                 f"{ENCODER}/layers_0/mlp/wi_0/dot_general"), "}"])


def test_hlo_ops_name_each_instruction_s_jax_operation_and_its_matmuls():
  ops = benchmarking.hlo_ops(HLO)
  assert ops["custom-call.1"] == (
      f"jit(step_fn)/{ENCODER}/layers_0/self_attention/query/dot_general", True)
  assert ops["dot.3"][1] and not ops["loop_convert_fusion"][1]
  assert not ops["input_reduce_fusion.7"][1] and ops["copy.5"] == ("", False)
  assert ops["ynn_fusion.2"] == (  # a fusion whose computation holds a dot (the CPU's)
      f"jit(step_fn)/{ENCODER}/layers_0/mlp/wi_0/dot_general", True)


def test_op_time_by_part_of_the_step_hand_worked():
  """The norm is named for attention too (`pre_attention_layer_norm`) and counts as a norm; a
  reduction outside the forward and backward is the optimizer's; the loss's `mul` sits under
  the step's own jvp; an op without metadata, or not in the program, is unattributed.
  Total 20 ms: attention 5 (all matmul), relative bias 4, MLP 3 (matmul), optimizer 3,
  norms 2, loss 1, unattributed 1 + 1."""
  ms = {"custom-call.1": 5.0, "loop_convert_fusion": 4.0, "dot.3": 3.0,
        "input_reduce_fusion.9": 3.0, "input_reduce_fusion.7": 2.0,
        "loop_multiply_fusion": 1.0, "copy.5": 1.0, "sm90_gemm_kernel": 1.0}
  parts = {p["part"]: p for p in benchmarking.op_parts(ms, HLO)}
  assert [p["part"] for p in benchmarking.op_parts(ms, HLO)][:2] == [
      "attention", "relative position bias"]
  want = {"attention": (5, 5, 1), "relative position bias": (4, 0, 1), "MLP": (3, 3, 1),
          "optimizer": (3, 0, 1), "layer norms": (2, 0, 1), "loss": (1, 0, 1),
          "unattributed": (2, 0, 2)}
  assert {k: (p["ms_per_step"], p["matmul_ms_per_step"], p["ops"])
          for k, p in parts.items()} == want
  assert parts["attention"]["share"] == 5 / 20 and parts["unattributed"]["share"] == 2 / 20
  top = benchmarking.top_ops(ms, HLO, count=2)
  assert [(o["op"], o["ms_per_step"], o["share"]) for o in top] == [
      ("custom-call.1", 5.0, 0.25), ("loop_convert_fusion", 4.0, 0.2)]
  assert top[1]["jax_op"].endswith("relpos_bias/jit(_one_hot)/convert_element_type")
