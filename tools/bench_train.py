"""Training-step speed of a gin-configured model: compile time, step time, throughput, MFU.

  python -m tools.bench_train --gin_file=models/t5_1_1_small.gin --gin_file=models/decal.gin \
      --batch_size=8 --inputs_length=512 --targets_length=128 --compare="COMPRESSION_RATIO = 1"

The model, optimizer and partitioner come from the gin files and bindings a train run uses
(`--gin_file`, `--gin.NAME=VALUE`, `--gin_bindings`, as `python -m decal_jax.train`; without
a run file: Adafactor and a one-axis data mesh, the trainer's defaults). The step is the
trainer's own (`train_state.init_state` + `train_step.make_train_step`: donated state, the NaN
guard, the optimizer update), compiled ahead of time so compile time is measured apart.

Reported per configuration:
  compile   trace + lower and XLA compile of the train step, in seconds;
  step      median (and 10th / 90th percentile) wall time of --steps steps after --warmup
            steps, each ended by `block_until_ready`;
  seq/s, tok/s   batch / step, batch x (inputs + targets) / step;
  FLOPs     XLA's `compiled.cost_analysis()` count of the whole step (what runs: remat
            recomputation, softmax, optimizer included) and the analytical model count
            (`decal_jax/networks/flops.py`: matmuls of one teacher-forced forward pass x 3, the usual
            convention that the backward pass costs twice the forward; no remat, no
            optimizer) for T5 networks;
  MFU       analytical FLOPs / step time / (bf16 dense peak x devices), for devices in PEAKS
            (not reported on CPU or an unknown device: no peak to divide by);
  memory    XLA's `compiled.memory_analysis()`: temporary (activation) bytes of the step.

Batches are synthetic (random ids, exact shapes, on the mesh before timing: no input
pipeline), so the model is built with `VOCABULARY = None` (a later binding still sets one)
and the gin files are parsed without registering the seqio tasks: the tool imports neither
seqio, TensorFlow nor clu, and runs on a GPU image without them (docs/performance.md; a run
file whose task bindings need `decal_jax.tasks` is refused as unknown: give the model files).

`--compare BINDING` (repeatable; and/or `--compare_gin_file F`) builds a second
configuration (the first plus those), times both in one process, alternating their steps,
and prints B / A. `--breakdown` times the parts of a T5 step on their own; `--profile_steps`
traces steps with jax.profiler and records the top ops and the op time by part
of the step (attention, MLP, norms, optimizer, ...); `--hlo_out` keeps the compiled
step's HLO (which ops XLA fused, which matmuls became library calls); `--init_on_host`
builds the state on the host CPU (a GPU compiles the initializers slowly); `--time_budget_s`
cuts the warm-up and the timing short (at least one step each) so that a run whose steps
are slow still reports instead of being stopped at its limit. Appends a JSON line per
configuration to --out. Progress (each stage's start, compile seconds, warm-up step times)
goes to stderr, so a run stopped at a time limit shows where its time went; XLA_FLAGS, when
set, is recorded in each JSON line (`xla_flags`).
"""
import argparse
import dataclasses
import gzip
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gin
import jax
import numpy as np

from decal_jax import partitioning
from decal_jax.networks import flops
from decal_jax.runtime import gin_utils, optimizers, train_state, train_step
from tools import step_breakdown
from decal_jax.data import batches
from tools.benchmarking import device_peak, machine_record, xla_cost
from tools.profiles import (hlo_ops, op_parts, profile_ops, top_ops,
                                traffic_parts)
from tools.results_files import write_jsonl
from decal_jax.networks.t5 import T5Config

SYNTHETIC = ("synthetic batches: random ids, exact shapes, no padding or packing, on the "
             "mesh before timing (no input-pipeline cost)")


# ----------------------------------------------------------------------------- setup
@dataclasses.dataclass
class Setup:
  """One configuration to time: what gin built, and the batch shape."""
  label: str
  files: List[str]
  bindings: List[str]
  model: Any
  optimizer: Any
  partitioner: Any
  batch_size: int
  lengths: Dict[str, int]


def _bound(name: str):
  """A gin-bound configurable (built), or None where the files do not bind it."""
  try:
    reference = gin.query_parameter(name)
  except ValueError:
    return None
  return reference.scoped_configurable_fn() if hasattr(reference, "scoped_configurable_fn") \
      else reference


def _macro(name: str):
  try:  # a gin macro's value, or None
    return gin.query_parameter(f"%{name}")
  except ValueError:
    return None


NO_VOCABULARY = "VOCABULARY = None"  # synthetic ids: nothing to tokenize or decode


def build(label: str, files: Sequence[str], paths: Sequence[str], bindings: Sequence[str],
          args) -> Setup:
  """Parses the gin config and builds the model, optimizer, partitioner and batch shape."""
  try:
    model = gin_utils.load_model(files, search_paths=paths, bindings=[NO_VOCABULARY, *bindings],
                                 register_tasks=False).model
  except ValueError:
    raise SystemExit("error: the gin files define no MODEL; give a model gin file, e.g. "
                     "--gin_file=models/t5_1_1_small.gin.") from None
  optimizer = _bound("decal_jax.runtime.trainer.train.optimizer") or optimizers.adafactor()
  partitioner = _bound("decal_jax.runtime.trainer.train.partitioner") or partitioning.Partitioner()
  lengths = dict(_macro("TASK_FEATURE_LENGTHS") or {})
  if args.inputs_length:
    lengths["inputs"] = args.inputs_length
  if args.targets_length:
    lengths["targets"] = args.targets_length
  batch_size = args.batch_size or _macro("BATCH_SIZE")
  needed = model.required_lengths()
  if not batch_size or any(not lengths.get(k) for k in needed):
    raise SystemExit(f"error: need a batch size and lengths {needed}: pass --batch_size, "
                     "--inputs_length, --targets_length (or a run gin that sets BATCH_SIZE "
                     "and TASK_FEATURE_LENGTHS).")
  gin.clear_config()
  return Setup(label, list(files), list(bindings), model, optimizer, partitioner,
               int(batch_size), {k: int(lengths[k]) for k in needed})


def synthetic_batch(setup: Setup, seed: int) -> Dict[str, np.ndarray]:
  """Random full-length examples of the configured shape (ids 2 .. vocab - 1)."""
  rng = np.random.RandomState(seed)
  vocab = getattr(getattr(setup.model.module, "config", None), "vocab_size", 1000)
  shape = lambda key: (setup.batch_size, setup.lengths[key])
  targets = rng.randint(2, vocab, shape("targets")).astype(np.int32)
  batch = {"decoder_target_tokens": targets,
           "decoder_input_tokens": np.pad(targets, ((0, 0), (1, 0)))[:, :-1],
           "decoder_loss_weights": np.ones(targets.shape, np.float32)}
  if "inputs" in setup.lengths:
    batch["encoder_input_tokens"] = rng.randint(2, vocab, shape("inputs")).astype(np.int32)
  return batch


def model_flops_per_step(setup: Setup) -> Optional[float]:
  """Analytical train-step FLOPs: 3 x the forward matmul FLOPs (flops.py) x batch."""
  cfg = getattr(setup.model.module, "config", None)
  if not isinstance(cfg, T5Config) or "inputs" not in setup.lengths:
    return None
  forward = flops.forward_flops(cfg, setup.lengths["inputs"], setup.lengths["targets"])
  return 3.0 * forward.total * setup.batch_size


# ----------------------------------------------------------------------------- compile / run
_START = time.perf_counter()


def progress(message: str) -> None:
  """A timestamped stage line on stderr (the seconds since the tool started)."""
  print(f"[bench_train {time.perf_counter() - _START:7.1f} s] {message}", file=sys.stderr,
        flush=True)


class Runner:
  """A compiled train step with its state, batch and measurements."""

  def __init__(self, setup: Setup, seed: int, init_on_host: bool = False):
    self.setup = setup
    progress(f"{setup.label}: initialising the train state")
    cfg = batches.DatasetConfig("synthetic", setup.lengths, batch_size=setup.batch_size)
    self.state, shardings = train_state.init_state(setup.model, setup.optimizer,
                                               setup.partitioner, cfg, seed, init_on_host)
    step = train_step.make_train_step(setup.model, setup.optimizer, setup.partitioner, shardings)
    self.batch = batches.to_global(synthetic_batch(setup, seed), setup.partitioner)
    self.rng = jax.random.PRNGKey(seed)
    self.info: Dict[str, Any] = {}
    self.times: List[float] = []
    self._compile(step)

  def _compile(self, step) -> None:
    """Lowers and compiles the trainer's own jitted step ahead of time."""
    start = time.perf_counter()
    with self.setup.partitioner.activate():
      progress(f"{self.setup.label}: tracing and lowering the train step")
      lowered = step.jitted.lower(self.state, self.batch, self.rng)
      traced = time.perf_counter()
      progress(f"{self.setup.label}: XLA compile ({traced - start:.1f} s to lower; on a GPU "
               "the GEMM autotuning can take minutes, see XLA_FLAGS in docs/performance.md)")
      self.fn = lowered.compile()
    done = time.perf_counter()
    progress(f"{self.setup.label}: compiled in {done - traced:.1f} s")
    self.info.update(trace_lower_s=traced - start, xla_compile_s=done - traced,
                     compile_s=done - start, **_cost(self.fn))

  def step(self, timed: bool) -> None:
    start = time.perf_counter()
    self.state, aux = self.fn(self.state, self.batch, self.rng)
    jax.block_until_ready((self.state, aux))
    elapsed = time.perf_counter() - start
    if timed:
      self.times.append(elapsed)
    self.last_s, self.last_loss = elapsed, float(aux["loss"])


def _cost(compiled) -> Dict[str, Any]:
  out = {"xla_flops_per_step": xla_cost(compiled)}
  memory = compiled.memory_analysis()
  if memory is not None:
    out.update(temp_bytes=int(memory.temp_size_in_bytes),
               argument_bytes=int(memory.argument_size_in_bytes))
  return out


def time_steps(runners: Sequence[Runner], warmup: int, steps: int,
               deadline: Optional[float] = None, reserve: int = 0) -> None:
  """Warm-up then timed steps, alternating configurations step by step (shared drift).
  With a `deadline` (a time.perf_counter() value): after the first warm-up step, the rest of
  the warm-up is cut when 1 + `reserve` + 3 more steps would pass it, and timing stops when
  1 + `reserve` more would (a slow step then still gives a median and a profile)."""
  for timed, count, spare in ((False, warmup, 1 + reserve + 3), (True, steps, 1 + reserve)):
    for i in range(count):
      if i and not _fits(runners, deadline, spare):
        progress(f"{'timing' if timed else 'warm-up'} cut after {i} of {count} steps: "
                 "--time_budget_s")
        break
      for runner in runners:
        runner.step(timed=timed)
      if not timed or i == count - 1:
        progress(f"{'timed' if timed else 'warm-up'} step {i + 1} of {count}: "
                 f"{1e3 * runners[-1].last_s:.1f} ms, loss {runners[-1].last_loss:.3f}")


def _fits(runners: Sequence[Runner], deadline: Optional[float], steps: int) -> bool:
  """Whether `steps` more steps of every runner (at their last step's time) end in time."""
  return deadline is None or (
      time.perf_counter() + steps * sum(r.last_s for r in runners) <= deadline)


def summarize(runner: Runner, device) -> Dict[str, Any]:
  setup, times = runner.setup, sorted(runner.times)
  median = statistics.median(times)
  info = dict(runner.info)
  positions = setup.batch_size * sum(setup.lengths.values())
  model_flops = model_flops_per_step(setup)
  peak = device_peak(device)
  devices = jax.device_count()
  mfu = (model_flops / median / (peak["tflops"] * 1e12 * devices)
         if peak and model_flops else None)
  cfg = getattr(setup.model.module, "config", None)
  return dict(
      label=setup.label, gin_files=setup.files, gin_bindings=setup.bindings,
      batch_size=setup.batch_size, lengths=setup.lengths,
      config=_config_summary(cfg), step_s_median=median,
      step_s_p10=times[int(0.1 * (len(times) - 1))], step_s_p90=times[int(0.9 * (len(times) - 1))],
      steps_timed=len(times), sequences_per_s=setup.batch_size / median,
      tokens_per_s=positions / median, model_flops_per_step=model_flops,
      mfu=mfu, peak_tflops_per_device=peak and peak["tflops"], peak_source=peak and peak["source"],
      devices=devices, final_loss=runner.last_loss, **info)


def _config_summary(cfg) -> Optional[Dict[str, Any]]:
  if not dataclasses.is_dataclass(cfg):
    return None
  keep = ("emb_dim", "num_heads", "head_dim", "mlp_dim", "num_encoder_layers",
          "num_decoder_layers", "vocab_size", "compression_ratio", "compressor", "dtype",
          "scan_layers", "remat_policy", "fused_qkv", "attention_kernel", "dropout_rate")
  return {k: str(getattr(cfg, k)) if k == "dtype" else getattr(cfg, k) for k in keep
          if hasattr(cfg, k)}


# ----------------------------------------------------------------------------- report
def print_table(rows: Sequence[Dict[str, Any]]) -> None:
  print(f"{'config':<28}{'compile s':>10}{'step ms':>10}{'p10-p90 ms':>15}{'seq/s':>9}"
        f"{'tok/s':>10}{'XLA GF':>9}{'model GF':>9}{'MFU':>7}{'temp MB':>9}")
  for r in rows:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    model = f"{r['model_flops_per_step'] / 1e9:.1f}" if r["model_flops_per_step"] else "n/a"
    print(f"{r['label'][:27]:<28}{r['compile_s']:>10.1f}{1e3 * r['step_s_median']:>10.1f}"
          f"{1e3 * r['step_s_p10']:>7.0f}-{1e3 * r['step_s_p90']:<7.0f}"
          f"{r['sequences_per_s']:>9.2f}{r['tokens_per_s']:>10.0f}"
          f"{r.get('xla_flops_per_step', float('nan')) / 1e9:>9.1f}{model:>9}{mfu:>7}"
          f"{r.get('temp_bytes', 0) / 2**20:>9.0f}")


def compare(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, float]:
  keys = ("step_s_median", "sequences_per_s", "compile_s", "xla_flops_per_step",
          "model_flops_per_step", "temp_bytes")
  ratios = {k: b[k] / a[k] for k in keys if a.get(k) and b.get(k)}
  print(f"\nB / A  ({b['label']}  vs  {a['label']}):  " +
        ", ".join(f"{k} x{v:.3f}" for k, v in ratios.items()))
  return ratios


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch_size", type=int, default=None)
  parser.add_argument("--inputs_length", type=int, default=None)
  parser.add_argument("--targets_length", type=int, default=None)
  parser.add_argument("--steps", type=int, default=20, help="timed steps (protocol: >= 20)")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--time_budget_s", type=float, default=None, help="the whole run's "
                      "seconds: warm-up and timing stop early (at least one step each) so the "
                      "profile and the results still fit (a run stopped at a limit reports "
                      "nothing)")
  parser.add_argument("--init_on_host", action="store_true", help="initialise the train "
                      "state on the host CPU, then place it on the mesh (a GPU compiles the "
                      "initializers slowly: 75 s of an H200 lease for T5.1.1-small)")
  parser.add_argument("--label", default=None, help="name of configuration A")
  parser.add_argument("--compare", action="append", default=[], metavar="BINDING",
                      help="configuration B = A plus this gin binding (repeatable)")
  parser.add_argument("--compare_gin_file", action="append", default=[])
  parser.add_argument("--compare_label", default=None)
  parser.add_argument("--breakdown", action="store_true", help="time a T5 step's parts alone")
  parser.add_argument("--profile_steps", type=int, default=0, help="then trace this many "
                      "steps of the last configuration into --profile_dir; record the top "
                      "ops and the op time by part of the step")
  parser.add_argument("--profile_dir", default="/tmp/bench_train_trace")
  parser.add_argument("--hlo_out", default=None, help="write the compiled step's HLO text "
                      "(of the last configuration) to this .gz file")
  parser.add_argument("--out", default=None, help="JSONL file to append to (default "
                      "docs/results/bench_train_<platform>.jsonl)")
  args, gin_argv = parser.parse_known_args(argv)
  if args.steps < 1 or args.warmup < 1:
    parser.error("--steps and --warmup must be >= 1 (the first step may still compile).")
  return args, gin_utils.split_args(gin_argv)


def overridden(bindings: Sequence[str], overrides: Sequence[str]) -> List[str]:
  """`bindings` with each of `overrides` in place of an earlier binding of the same name
  (gin refuses a macro bound twice on one command line)."""
  name = lambda binding: binding.split("=", 1)[0].strip()
  replaced = {name(b) for b in overrides}
  return [b for b in bindings if name(b) not in replaced] + list(overrides)


def main(argv=None):
  args, (files, paths, bindings) = parse_args(sys.argv[1:] if argv is None else argv)
  setups = [build(args.label or _describe(files, bindings), files, paths, bindings, args)]
  if args.compare or args.compare_gin_file:
    files_b, bindings_b = files + args.compare_gin_file, overridden(bindings, args.compare)
    setups.append(build(args.compare_label or _describe(args.compare_gin_file, args.compare),
                        files_b, paths, bindings_b, args))
  runners = [Runner(setup, args.seed, args.init_on_host) for setup in setups]
  deadline = _START + args.time_budget_s - 10 if args.time_budget_s else None  # 10 s to report
  time_steps(runners, args.warmup, args.steps, deadline, args.profile_steps)
  device = jax.devices()[0]
  rows = [dict(machine_record(), note=SYNTHETIC, **summarize(r, device)) for r in runners]
  if len(rows) == 2:
    rows[1]["ratio_to_a"] = compare(rows[0], rows[1])
  print_table(rows)
  if rows[-1]["steps_timed"] < 20:
    print(f"note: {rows[-1]['steps_timed']} timed steps; the issue's protocol is a median "
          "over >= 20.")
  if device_peak(device) is None:
    print(f"note: no bf16 peak known for {device.platform} ({device.device_kind}): MFU not "
          "reported.")
  if args.breakdown:
    for row, setup in zip(rows, setups):
      row["breakdown"] = step_breakdown.breakdown(setup, row["step_s_median"], args.seed)
  hlo_text = runners[-1].fn.as_text() if args.profile_steps or args.hlo_out else None
  if args.profile_steps:
    profiled = args.profile_steps if deadline is None else max(1, min(args.profile_steps, int(
        (deadline - time.perf_counter()) / runners[-1].last_s)))
    ms = profile_ops(lambda: runners[-1].step(timed=False), profiled, args.profile_dir)
    ops = hlo_ops(hlo_text)  # the compiled step's instructions, read once
    rows[-1]["profile_top_ops"] = top = top_ops(ms, ops)
    rows[-1]["profile_parts"] = parts = op_parts(ms, ops)
    rows[-1]["profile_op_ms_per_step"] = sum(ms.values())
    rows[-1]["hlo_traffic_parts"] = traffic = {r["part"]: r for r in traffic_parts(hlo_text, ops)}
    print(f"\nops taking the most time ({profiled} steps, {args.profile_dir}):")
    if not top:
      print(f"  none found: the trace in {args.profile_dir} has no op events that "
            "profiles._op_events reads (open it in TensorBoard / XProf)")
    for op in top:
      print(f"  {100 * op['share']:5.1f}% {op['ms_per_step']:9.3f} ms/step  {op['op']}: "
            f"{op['jax_op'][-90:]}")
    print(f"\nop time by part of the step ({sum(ms.values()):.3f} ms of ops per step, "
          f"{1e3 * rows[-1]['step_s_median']:.3f} ms per step):")
    for part in parts:
      gb = traffic.get(part["part"], {}).get("gb", 0.0)
      print(f"  {100 * part['share']:5.1f}% {part['ms_per_step']:9.3f} ms/step "
            f"({part['matmul_ms_per_step']:.3f} in matmuls) {part['ops']:5d} ops "
            f"{gb:8.2f} GB moved (HLO estimate)  {part['part']}")
  if args.hlo_out:  # the step as XLA compiled it for this device: its fusions, its GEMM calls
    with gzip.open(args.hlo_out, "wt") as f:
      f.write(hlo_text)
    print(f"wrote {args.hlo_out}")
  write_jsonl(args.out or f"docs/results/bench_train_{device.platform}.jsonl", rows)


def _describe(files: Sequence[str], bindings: Sequence[str]) -> str:
  names = [os.path.basename(f).replace(".gin", "") for f in files]
  return "+".join(names + [b.replace(" ", "") for b in bindings]) or "A"


if __name__ == "__main__":
  main()
