"""tools/stability_16x.py: the verdict rule on hand-made curves (worked by hand), the curves
read back from events that decal_jax's own MetricsWriter wrote, the non-finite steps read from
the trainer's guard's own messages, the gin bindings that 'off' and 'on' mean (parsed by
gin), the table's mean ± s.e. by hand, and a 2-step run end to end."""
import argparse
import math
import pathlib

import gin
import numpy as np
import pytest

from decal_jax import metrics
from decal_jax.runtime import gin_utils, resilience
from tools import results_files
from tools import stability_16x as st

NAN = float("nan")


def _curve(losses, grads=None):
  grads = grads or [1.0] * len(losses)
  return [[i + 1, loss, g] for i, (loss, g) in enumerate(zip(losses, grads))]


def test_a_smooth_curve_is_smooth():
  stats = st.run_stats(_curve([8, 6, 5, 4.5, 4.2, 4.0], [3, 2, 5, 1, 1, 1]), 6)
  assert stats["verdict"] == "smooth"
  # each loss over the lowest before it: 6/8, 5/6, 4.5/5, 4.2/4.5, 4/4.2; all below 1, the
  # largest the last
  assert stats["spike"] == pytest.approx(4.0 / 4.2) and stats["spike_step"] == 6
  assert stats["final_loss"] == pytest.approx(31.7 / 6)  # fewer than 10 steps: all of them
  assert (stats["min_loss"], stats["min_step"]) == (4.0, 6)
  assert (stats["grad_max"], stats["grad_max_step"]) == (5, 3)
  assert stats["grad_median"] == 1.5  # of 1, 1, 1, 2, 3, 5
  assert stats["nonfinite_steps"] == []


def test_a_spike_that_comes_back_down_is_spiked_and_recovered():
  losses = [8, 4, 3, 6, 3, 2.9, 2.8, 2.8, 2.7, 2.7, 2.6, 2.6]
  stats = st.run_stats(_curve(losses), 12)
  # step 4: 6 against the running minimum 3 before it; the last 10 average 31.1 / 10 = 3.11,
  # under 1.5 x the minimum 2.6 = 3.9
  assert stats["spike"] == pytest.approx(2.0) and stats["spike_step"] == 4
  assert stats["final_loss"] == pytest.approx(3.11)
  assert stats["verdict"] == "spiked and recovered"


def test_a_spike_that_stays_up_diverged():
  stats = st.run_stats(_curve([8, 4, 3, 9, 9, 9, 9]), 7)
  assert stats["spike"] == pytest.approx(3.0) and stats["spike_step"] == 4
  assert stats["final_loss"] == pytest.approx(51 / 7)  # (8 + 4 + 3 + 4 x 9) / 7 > 1.5 x 3
  assert stats["verdict"] == "diverged"


def test_a_nan_or_inf_step_is_divergence_even_when_the_loss_recovers():
  stats = st.run_stats(_curve([8, 5, NAN, 4]), 4)
  assert stats["verdict"] == "diverged" and stats["nonfinite_steps"] == [3]
  assert stats["spike"] == pytest.approx(0.8) and stats["spike_step"] == 4  # 4 / 5; nan left out
  inf_grad = st.run_stats(_curve([8, 5, 4], [1, math.inf, 1]), 3)
  assert inf_grad["verdict"] == "diverged" and inf_grad["nonfinite_steps"] == [2]
  nothing = st.run_stats(_curve([NAN]), 1)
  assert nothing["verdict"] == "diverged" and math.isnan(nothing["final_loss"])


def test_curves_read_back_from_metrics_writer_events(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path))
  for step, loss, grad in [(1, 8.5, 2.0), (2, 0.0, 0.0), (3, 7.25, 1.5)]:  # step 2: skipped
    writer.write("train", step, {"loss": loss, "grad_norm": grad, "accuracy": 0.1})
  writer.close()
  assert st.read_scalars(tmp_path, "loss") == {1: 8.5, 2: 0.0, 3: 7.25}
  assert st.read_scalars(tmp_path, "grad_norm") == {1: 2.0, 2: 0.0, 3: 1.5}
  curve = st.curve_of(tmp_path, bad=[2, 4])  # 4: the step a 'raise' run stopped at, unlogged
  assert [row[0] for row in curve] == [1, 2, 3, 4]
  assert curve[0][1:] == [8.5, 2.0] and curve[2][1:] == [7.25, 1.5]
  assert all(math.isnan(v) for row in (curve[1], curve[3]) for v in row[1:])


def test_nonfinite_steps_read_from_the_guards_own_messages(capsys):
  skip = resilience.NonFiniteGuard("skip")
  for step, flag in [(5, 0), (6, 1), (7, 1)]:
    skip.add(step, np.int32(flag))
  skip.check(None, "/m")
  skip.add(9, np.int32(1))
  skip.check(None, "/m")
  assert st.nonfinite_steps(capsys.readouterr().out) == [6, 7, 9]
  stop = resilience.NonFiniteGuard("raise")
  stop.add(12, np.int32(1))
  with pytest.raises(resilience.NonFiniteError) as error:
    stop.check(10, "/m")
  assert st.nonfinite_steps("log lines before\n" + str(error.value)) == [12]
  assert st.RAISED.search(str(error.value)) and st.nonfinite_steps("loss=3.2 nan") == []


@pytest.mark.parametrize("setting,z_loss,clipping,policy", [
    ("off", 0.0, None, "raise"), ("on", 1e-4, 1.0, "skip")])
def test_the_settings_bind_what_they_say(setting, z_loss, clipping, policy, tmp_path):
  a = st.parse_args(["--steps", "100", "--work", str(tmp_path)])
  files, bindings = st.run_config(16, setting, 2, a, tmp_path / "m")
  cmd = st.command(files, bindings)
  assert cmd[1:3] == ["-m", "decal_jax.train"]
  assert "--gin_file=experiments/models/mini.gin" in cmd and "--gin_file=runs/pretrain.gin" in cmd
  gin_utils.parse(files, [], bindings)
  try:
    assert gin.query_parameter("%Z_LOSS") == z_loss
    assert gin.query_parameter(
        "decal_jax.runtime.optimizers.adafactor.clipping_threshold") == clipping
    assert gin.query_parameter("%NONFINITE_POLICY") == policy
    assert gin.query_parameter("%COMPRESSION_RATIO") == 16
    assert gin.query_parameter("%SEED") == 2
    assert gin.query_parameter("%WARMUP_STEPS") == 10  # 10 % of 100 steps
    assert gin.query_parameter("%LEARNING_RATE") == 1.0
    assert gin.query_parameter("%LOG_PERIOD") == 1  # every step's loss and gradient norm
    # T5's own lengths for 512-token inputs (random_spans_helper: 568 raw tokens -> 114)
    assert gin.query_parameter("%TASK_FEATURE_LENGTHS") == {"inputs": 512, "targets": 114}
  finally:
    gin.clear_config()


def test_ratios_must_divide_the_inputs():
  with pytest.raises(SystemExit):
    st.parse_args(["--ratios", "16", "--inputs_length", "100"])


def _result(ratio, setting, seed, losses, seconds=10.0):
  return {"ratio": ratio, "setting": setting, "seed": seed, "steps": len(losses),
          "curve": _curve(losses), "stopped": False, "seconds": seconds,
          "load_average": "1.0/1.0/1.0"}


def test_table_means_and_the_reading_kept_on_rewrite(tmp_path):
  results = [_result(16, "off", 0, [4, 2]), _result(16, "off", 1, [4, 3]),
             _result(4, "on", 0, [4, NAN])]
  rows = st.summarize(results)
  assert [(r["ratio"], r["setting"]) for r in rows] == [(4, "on"), (16, "off")]
  # final losses 3.0 and 3.5: mean 3.25, s.e. = sample std 0.35355 / sqrt(2) = 0.25
  assert rows[1]["final_loss"] == pytest.approx((3.25, 0.25))
  assert rows[1]["verdicts"] == {"smooth": 2, "spiked and recovered": 0, "diverged": 0}
  assert rows[0]["verdicts"]["diverged"] == 1 and rows[0]["nonfinite"] == 1
  out = tmp_path / "s.md"
  out.write_text("an older table\n" + results_files.READING + "\nMy reading.\n")
  a = argparse.Namespace(out=out, no_plot=False, argv=["--steps", "2"], steps=2,
                         inputs_length=512, task="decal_builtin_span_corruption",
                         model_gin="experiments/models/mini.gin", batch_size=8,
                         learning_rate=1.0, warmup=None)
  st.write(a, results, 12)
  text = out.read_text()
  assert "an older table" not in text and text.endswith(results_files.READING + "\nMy reading.\n")
  assert "| 16 | off | 2 | 2 smooth | 3.250 ± 0.250 | 2.500 ± 0.500 |" in text
  assert "**Partial: stopped after 3 of 12 runs**" in text.split("\n")[2]
  assert out.with_suffix(".png").stat().st_size > 0


def test_a_two_step_run_end_to_end(tmp_path):
  record = tmp_path / "r.json"
  argv = ["--dry_run", "--ratios", "16", "--settings", "off", "--seeds", "0",
          "--inputs_length", "64", "--work", str(tmp_path / "w"), "--record", str(record),
          "--out", str(tmp_path / "s.md"), "--no-plot"]
  [result] = st.main(argv)
  assert result["ratio"] == 16 and not result["stopped"]
  assert [row[0] for row in result["curve"]] == [1, 2]
  assert all(np.isfinite(row[1]) and row[1] > 0 for row in result["curve"])
  assert st.run_stats(result["curve"], 2)["verdict"] in st.VERDICTS
  assert "| 16 | off | 1 |" in (tmp_path / "s.md").read_text()
  assert st.main(argv + ["--report_only"]) == [result]  # from the record, nothing trained
  assert pathlib.Path(record).exists()
