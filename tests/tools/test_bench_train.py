"""decal_jax/tools/bench_train.py without compiling anything: the peak table's device matching, the
step's jitted program exposed by trainer.make_train_step, and the summary arithmetic
(median, throughput, analytical FLOPs, MFU) on hand-made timings."""
import importlib
import types

import jax
import pytest

from decal_jax import flops, models, optimizers, partitioning, trainer
from decal_jax.networks.t5 import T5Config, Transformer

import paths

REPO = paths.REPO
bench = importlib.import_module("decal_jax.tools.bench_train")

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
