"""tools/bench_train.py without compiling anything: the peak table's device matching, the
step's jitted program exposed by trainer.make_train_step, the summary arithmetic
(median, throughput, analytical FLOPs, MFU) on hand-made timings, and the model built where
TensorFlow, seqio, clu and t5 cannot be imported (the GPU image)."""
import importlib
import os
import subprocess
import sys
import textwrap
import types

import jax
import pytest

from decal_jax import models, partitioning
from decal_jax.networks import flops
from decal_jax.runtime import optimizers, trainer
from decal_jax.networks.t5 import T5Config, Transformer

import paths

REPO = paths.REPO
bench = importlib.import_module("tools.bench_train")

CFG = T5Config(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
               num_encoder_layers=1, num_decoder_layers=1, compression_ratio=4)


def _device(platform, kind):
  return types.SimpleNamespace(platform=platform, device_kind=kind)


@pytest.mark.parametrize("kind,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("TPU v4", 275.0), ("TPU v5 lite", 197.0),
    ("TPU v5", 459.0), ("TPU v5p", 459.0)])
def test_device_peaks_match_device_kinds(kind, tflops):
  platform = "tpu" if kind.startswith("TPU") else "gpu"
  assert bench.device_peak(_device(platform, kind))["tflops"] == tflops


def test_cpu_and_unknown_devices_have_no_peak():
  assert bench.device_peak(_device("cpu", "cpu")) is None
  assert bench.device_peak(_device("gpu", "NVIDIA GeForce GTX 1080")) is None


def _setup(batch=4, n=32, t=8):
  model = models.EncoderDecoderModel(Transformer(CFG), None, None)
  return bench.Setup("A", [], [], model, optimizers.adafactor(), partitioning.Partitioner(),
                     batch, {"inputs": n, "targets": t})


def test_the_trainers_jitted_step_is_found():
  """The tool compiles the trainer's own step ahead of time; if make_train_step changes
  shape, this says so (the tool would fall back to timing the first call)."""
  setup = _setup()
  step = trainer.make_train_step(setup.model, setup.optimizer, setup.partitioner, None)
  assert hasattr(step.jitted, "lower")


def test_summary_arithmetic_on_hand_made_timings(monkeypatch):
  setup = _setup()
  runner = types.SimpleNamespace(setup=setup, times=[0.5, 0.1, 0.3, 0.2, 0.4],
                                 info={"compile_s": 7.0}, last_loss=1.0)
  monkeypatch.setattr(jax, "device_count", lambda: 2)
  row = bench.summarize(runner, _device("gpu", "NVIDIA A100-SXM4-40GB"))
  assert row["step_s_median"] == 0.3 and row["steps_timed"] == 5
  assert row["sequences_per_s"] == pytest.approx(4 / 0.3)
  assert row["tokens_per_s"] == pytest.approx(4 * (32 + 8) / 0.3)
  forward = flops.forward_flops(CFG, 32, 8).total  # backward = 2 x forward
  assert row["model_flops_per_step"] == pytest.approx(3 * forward * 4)
  assert row["mfu"] == pytest.approx(3 * forward * 4 / 0.3 / (2 * 312e12))
  assert row["config"]["compression_ratio"] == 4
  ratios = bench.compare(row, dict(row, step_s_median=0.6, sequences_per_s=row[
      "sequences_per_s"] / 2))
  assert ratios["step_s_median"] == pytest.approx(2.0)
  assert ratios["sequences_per_s"] == pytest.approx(0.5)


def test_it_builds_the_gpu_suites_model_with_tensorflow_seqio_clu_and_t5_refused(tmp_path):
  """A fresh interpreter whose sitecustomize refuses every gpu_suite.DEVICE_IMAGE_LACKS
  import (what the workplace's GPU image lacks) imports the tool and builds the model of
  the suite's train parts (T5.1.1-small DeCAL-4x, bf16) from their exact arguments, with no
  vocabulary; none of the refused packages is loaded. The dry-run suite runs the step."""
  gpu_suite = importlib.import_module("tools.gpu_suite")
  lacks = set(gpu_suite.DEVICE_IMAGE_LACKS)
  assert {"tensorflow", "seqio", "clu"} <= lacks
  (tmp_path / "sitecustomize.py").write_text(gpu_suite.REFUSE_IMPORTS.format(lacks=lacks))
  code = textwrap.dedent(f"""
      import sys
      try:
        import tensorflow
      except ImportError as e:
        print("refused:", e)
      from tools import bench_train
      args, (files, paths, bindings) = bench_train.parse_args(sys.argv[1:])
      setup = bench_train.build("A", files, paths, bindings, args)
      cfg = setup.model.module.config
      print("built:", cfg.emb_dim, cfg.num_encoder_layers, cfg.compression_ratio, cfg.dtype,
            setup.batch_size, setup.lengths, setup.model.input_vocabulary)
      print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in {lacks!r}))
  """)
  argv = gpu_suite.bench_train_argv(gpu_suite.gpu_scale(None), ["COMPRESSION_RATIO=4"], 20,
                                    "A", tmp_path / "out.jsonl")
  assert argv[:2] == ["-m", "tools.bench_train"]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]),
             JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-c", code, *argv[2:]], env=env, cwd=REPO,
                       capture_output=True, text=True, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  lines = run.stdout.splitlines()
  assert lines[0].startswith("refused: tensorflow is not on the GPU image")
  assert lines[1] == ("built: 512 8 4 bfloat16 128 {'inputs': 512, 'targets': 128} None")
  assert lines[2] == "loaded: []"



def test_decal_breakeven_measures_the_networks_its_flop_column_counts(monkeypatch, tmp_path):
  """`decal_breakeven --measure` runs bench_train on two configurations (C = 1, then its
  --compare C = 4) whose gin-built T5 configs have the FLOP ratio the tool prints for that
  length (the measured column times the networks the FLOP column counts), and reads the
  ratio from the rows bench_train writes."""
  import json
  from decal_jax.runtime import gin_utils
  breakeven = importlib.import_module("tools.decal_breakeven")
  seen = []

  def fake_run(module, argv, log):  # what bench_train would append to its --out
    seen.append((module, argv))
    out = next(a.split("=", 1)[1] for a in argv if a.startswith("--out="))
    with open(out, "a") as f:
      f.write(json.dumps({"label": "C=1"}) + "\n")
      f.write(json.dumps({"label": "C=4", "ratio_to_a": {"step_s_median": 1.25}}) + "\n")
    return 1.0
  monkeypatch.setattr(breakeven.benchmarking, "run_entry_point", fake_run)
  out = tmp_path / "rows.jsonl"
  rows = breakeven.main(["--lengths", "512", "--measure", "--batch_size", "4", "--out", str(out)])
  assert rows[0]["measured_n/4"] == 1.25 and len(seen) == 1 and "measured_n" not in rows[0]
  assert seen[0][0] == "tools.bench_train" and len(out.read_text().splitlines()) == 2
  args, (files, paths_, bindings) = bench.parse_args(seen[0][1])
  assert (args.batch_size, args.inputs_length, args.targets_length) == (4, 512, 128)
  configs = [gin_utils.load_model(files, search_paths=paths_,
                                  bindings=bench.overridden(bindings, extra)
                                  ).model.module.config for extra in ([], args.compare)]
  assert [c.compression_ratio for c in configs] == [1, 4]
  assert (configs[0].emb_dim, configs[0].num_encoder_layers, configs[0].vocab_size) == (
      256, 4, 4224)
  built = [flops.forward_flops(c, 512, 128).total for c in configs]
  assert built[1] / built[0] == pytest.approx(rows[0]["targets_n/4"], rel=1e-9)


def test_decal_breakeven_measures_autoencoding_at_targets_equal_to_inputs(monkeypatch, tmp_path):
  """`--measure_targets n` times the steps at t = n (where the FLOP column crosses 1 first),
  and both kinds together time each length twice, each at its own target length."""
  import json
  breakeven = importlib.import_module("tools.decal_breakeven")
  seen = []

  def fake_run(module, argv, log):
    args, _ = bench.parse_args(argv)
    seen.append((args.inputs_length, args.targets_length))
    with open(args.out, "a") as f:
      f.write(json.dumps({"ratio_to_a": {"step_s_median": args.targets_length / 1000}}) + "\n")
  monkeypatch.setattr(breakeven.benchmarking, "run_entry_point", fake_run)
  rows = breakeven.main(["--lengths", "256", "2048", "--measure", "--measure_targets", "n"])
  assert seen == [(256, 256), (2048, 2048)]
  assert [r["measured_n"] for r in rows] == [0.256, 2.048] and "measured_n/4" not in rows[0]
  assert rows[1]["targets_n"] < rows[1]["targets_n/4"]  # autoencoding is where DeCAL gains
  seen.clear()
  breakeven.main(["--lengths", "256", "--measure", "--measure_targets", "n/4", "n"])
  assert seen == [(256, 64), (256, 256)]


def test_a_time_budget_cuts_the_warm_up_and_the_timing_but_keeps_a_median(monkeypatch):
  """Hand-worked on a fake clock, steps of 10 s, deadline at 55 s, one profile step to keep:
  warm-up 1 ends at 10 s; warm-up 2 would need 10 + (1 + 1 + 3) x 10 = 60 > 55: cut. Timed
  steps end at 20, 30, 40 s; a fourth would need 40 + 2 x 10 = 60 > 55: 3 of 20 timed."""
  clock = [0.0]
  monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
  monkeypatch.setattr(bench, "progress", lambda message: None)

  class Slow:
    times, last_s, last_loss, calls = [], 0.0, 1.0, 0

    def step(self, timed):
      clock[0] += 10.0
      self.last_s, self.calls = 10.0, self.calls + 1
      if timed:
        self.times = self.times + [10.0]

  runner = Slow()
  bench.time_steps([runner], warmup=3, steps=20, deadline=55.0, reserve=1)
  assert (runner.calls, len(runner.times), clock[0]) == (4, 3, 40.0)
  unbounded = Slow()
  bench.time_steps([unbounded], warmup=3, steps=20)
  assert (unbounded.calls, len(unbounded.times)) == (23, 20)


def test_compare_bindings_replace_the_same_names():
  """--compare rebinds a macro of A's command line for B: B gets one binding per name (gin
  refuses a macro bound twice), the others kept in order."""
  a = ["COMPRESSION_RATIO = 4", "BATCH_SIZE = 8", "ACTIVATION_DTYPE = 'bfloat16'"]
  assert bench.overridden(a, ["COMPRESSION_RATIO = 1"]) == [
      "BATCH_SIZE = 8", "ACTIVATION_DTYPE = 'bfloat16'", "COMPRESSION_RATIO = 1"]
  assert bench.overridden(a, []) == a
