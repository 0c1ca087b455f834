"""Is DeCAL pretraining at C = 16 unstable (paper Table 1 and §4.2.2: "unstable", no
number)? The same small T5 pretrained with span corruption at C = 4 (the control, stable in
the paper) and C = 16, each with the library's stabilisers off and on, over seeds; per run
the loss and gradient-norm curves (every step), the largest loss spike, non-finite steps and
a verdict by the rule below; a Markdown table (mean ± s.e. over seeds and per-run rows) and
a plot of the curves:

    nice -n 10 python -m tools.stability_16x --steps 150 \
      --record docs/results/stability_16x_cpu.json --out docs/results/stability_16x_cpu.md

Every run is `python -m decal_jax.train` in a subprocess with gin/experiments/models/mini.gin
(T5.1.1 made small: 2 + 2 layers of width 64, the built-in 4,224-id vocabulary; decal.gin's
latents and 4x relative-position buckets) and gin/runs/pretrain.gin, plus these bindings:

- the paper's recipe (§4.1): span corruption at 15 % noise, mean span 3; T5.1.1; a linear
  warm-up. The optimizer is not named in the paper; it trained T5.1.1 with T5X, whose
  default is Adafactor (decay 0.8, parameter scale) with the inverse-square-root schedule,
  LEARNING_RATE 1.0 (runs/pretrain.gin's). Our choices: the warm-up is --warmup steps
  (default 10 % of --steps, since the paper's 10k would be all of a CPU run; base 1.0 over a
  short warm-up peaks at 1 / sqrt(warmup), above the paper's 0.01: a harsher test), batch
  --batch_size, inputs --inputs_length tokens (512: 32 latents at C = 16, 128 at C = 4),
  targets as long as span corruption makes them (`chunk_and_target_lengths`), float32.
- stabilisers (SETTINGS): 'on' = z-loss 1e-4 on log Z (Z_LOSS, T5X's default), Adafactor's
  update clipping at RMS 1.0 (optimizers.adafactor.clipping_threshold, T5X's default) and
  NONFINITE_POLICY = 'skip' (a NaN / Inf step changes nothing and training goes on); 'off'
  = Z_LOSS 0, no update clipping, NONFINITE_POLICY = 'raise' (the first NaN / Inf step ends
  the run). 'on' is what the paper most likely ran (T5X's defaults). Not switched: the
  warm-up (the paper's recipe; without it the rsqrt schedule's first rate is 0 / 0), the
  latents' RMSNorm (part of the method: compress/latents.py has no switch), dropout (0 in
  both, T5.1.1 pretraining's), global-norm gradient clipping (only AdamW has it).

The rule (VERDICT): a run with a non-finite loss or gradient at any step "diverged"; so did one
whose final loss (mean of its last FINAL_STEPS logged steps) stays above SPIKE_FACTOR times its
minimum; a run "spiked and recovered" when some step's loss exceeds SPIKE_FACTOR times the
lowest loss of the steps before it (its running minimum) but it ends within the factor; any
other run is "smooth". The largest spike is reported as that ratio (and its step) whatever it
is, so the margin to the factor shows.

Options: --ratios (4 16), --settings (off on), --seeds (0 1 2), --steps, --task (default
decal_builtin_span_corruption; decal_c4_span_corruption needs TFDS c4/en:3.1.0, a T5
vocabulary and --model_gin), --work (runs/stability_16x: one MODEL_DIR per run), --record (a
JSON of every finished run: read first, so a rerun only trains what is missing; rewritten
after each run), --report_only, --dry_run (2 steps, batch 2: checks the machinery). A run
interrupted midway is trained again from its start by the next call.
"""
import argparse
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Sequence

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(  # the runs' subprocesses
    os.path.expanduser("~"), ".cache", "decal_jax", "xla_stability_cache"))  # share compiles

from decal_jax import fileio
from tools import benchmarking, results_files

SPIKE_FACTOR = 1.5  # a step's loss above this times its running minimum is a spike
FINAL_STEPS = 10    # the final loss: mean of this many last logged steps
VERDICTS = ("smooth", "spiked and recovered", "diverged")
SETTINGS = {  # name: bindings (added after the run's own)
    "off": ["Z_LOSS = 0.0", "optimizers.adafactor.clipping_threshold = None",
            "NONFINITE_POLICY = 'raise'"],
    "on": ["Z_LOSS = 0.0001", "optimizers.adafactor.clipping_threshold = 1.0",
           "NONFINITE_POLICY = 'skip'"],
}
LABELS = {"off": "stabilisers off", "on": "stabilisers on"}
# the trainer's words for a non-finite step: NONFINITE_POLICY 'skip' notes them and goes on,
# 'raise' stops with resilience.NonFiniteError
SKIPPED = re.compile(r"step\(s\) \[([0-9, ]+)\]: the loss or a gradient was NaN / Inf")
RAISED = re.compile(r"non-finite steps seen: \[([0-9, ]+)\]")


# ------------------------------------------------------------------------------ the rule
def run_stats(curve: Sequence[Sequence[float]], total_steps: int) -> Dict:
  """Statistics of one run's curve [[step, loss, grad_norm], ...] (nan: a non-finite step)."""
  steps = np.array([p[0] for p in curve], np.int64)
  loss = np.array([p[1] for p in curve], np.float64)
  grad = np.array([p[2] for p in curve], np.float64)
  finite = np.isfinite(loss) & np.isfinite(grad)
  out = {"nonfinite_steps": [int(s) for s in steps[~finite]],
         "last_step": int(steps[-1]) if steps.size else 0, "total_steps": total_steps}
  ok_steps, ok_loss, ok_grad = steps[finite], loss[finite], grad[finite]
  nan = float("nan")
  if not ok_loss.size:
    return dict(out, final_loss=nan, min_loss=nan, min_step=0, spike=nan, spike_step=0,
                grad_max=nan, grad_max_step=0, grad_median=nan, verdict="diverged")
  best = np.minimum.accumulate(ok_loss)  # running minimum, step by step
  ratios = ok_loss[1:] / best[:-1]       # each step against the minimum before it
  i = int(np.argmax(ratios)) + 1 if ratios.size else 0
  out.update(final_loss=float(ok_loss[-FINAL_STEPS:].mean()), min_loss=float(best[-1]),
             min_step=int(ok_steps[np.argmin(ok_loss)]),
             spike=float(ratios[i - 1]) if ratios.size else nan,
             spike_step=int(ok_steps[i]) if ratios.size else 0,
             grad_max=float(ok_grad.max()), grad_max_step=int(ok_steps[np.argmax(ok_grad)]),
             grad_median=float(np.median(ok_grad)))
  out["verdict"] = verdict(out)
  return out


def verdict(stats: Mapping) -> str:
  """The rule in the module docstring, from `run_stats`' fields."""
  if stats["nonfinite_steps"] or stats["final_loss"] > SPIKE_FACTOR * stats["min_loss"]:
    return "diverged"
  if stats["spike"] > SPIKE_FACTOR:
    return "spiked and recovered"
  return "smooth"


# ------------------------------------------------------------------------------ one run
def lengths(a) -> Dict[str, int]:
  """Task feature lengths: --inputs_length and the targets span corruption makes of it."""
  from decal_jax.data import span_corruption
  _, targets = span_corruption.chunk_and_target_lengths(a.inputs_length)
  return {"inputs": a.inputs_length, "targets": targets}


def run_config(ratio: int, setting: str, seed: int, a, model_dir: pathlib.Path):
  """(gin files, bindings) of one run."""
  warmup = a.warmup or max(1, a.steps // 10)
  bindings = [f"MODEL_DIR = {str(model_dir)!r}", f"MIXTURE_OR_TASK_NAME = {a.task!r}",
              f"TASK_FEATURE_LENGTHS = {lengths(a)!r}", f"COMPRESSION_RATIO = {ratio}",
              f"SEED = {seed}", f"TRAIN_STEPS = {a.steps}", f"BATCH_SIZE = {a.batch_size}",
              f"LEARNING_RATE = {a.learning_rate}", f"WARMUP_STEPS = {warmup}",
              "LOG_PERIOD = 1", f"EVAL_PERIOD = {a.steps}", "EVAL_BATCHES = 1",
              f"CHECKPOINT_PERIOD = {a.steps}", "KEEP_CHECKPOINTS = 1",
              "trainer.train.show_example = False", *SETTINGS[setting]]
  return [a.model_gin, "runs/pretrain.gin"], bindings


def command(files: Sequence[str], bindings: Sequence[str]) -> List[str]:
  return [sys.executable, "-m", "decal_jax.train", *[f"--gin_file={f}" for f in files],
          *[f"--gin_bindings={b}" for b in bindings]]


def read_scalars(model_dir: pathlib.Path, tag: str) -> Dict[int, float]:
  """{step: value} of `tag` in MODEL_DIR/train's TensorBoard events."""
  import tensorflow as tf
  points = {}
  for path in sorted((model_dir / "train").glob("events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      for value in event.summary.value:
        if value.tag == tag:
          points[int(event.step)] = float(tf.make_ndarray(value.tensor) if value.HasField(
              "tensor") else value.simple_value)
  return points


def nonfinite_steps(log_text: str) -> List[int]:
  """The steps the trainer's output names as NaN / Inf (skipped, or the one that stopped it)."""
  found = set()
  for pattern in (SKIPPED, RAISED):
    for match in pattern.finditer(log_text):
      found.update(int(s) for s in match.group(1).split(","))
  return sorted(found)


def curve_of(model_dir: pathlib.Path, bad: Sequence[int]) -> List[List[float]]:
  """[[step, loss, grad_norm], ...] from the events, with nan at the non-finite steps `bad`
  (the trainer logs a skipped step's zeroed values, and stops before logging a raised one)."""
  loss, grad = read_scalars(model_dir, "loss"), read_scalars(model_dir, "grad_norm")
  rows = {s: [s, loss[s], grad.get(s, float("nan"))] for s in loss}
  rows.update({s: [s, float("nan"), float("nan")] for s in bad})
  return [rows[s] for s in sorted(rows)]


def run_one(ratio: int, setting: str, seed: int, a) -> Dict:
  """Trains one run from scratch in its own MODEL_DIR; its record."""
  model_dir = a.work / f"{setting}_r{ratio}_s{seed}_steps{a.steps}"  # a budget's own folder
  shutil.rmtree(model_dir, ignore_errors=True)  # a half-finished earlier try starts over
  model_dir.mkdir(parents=True)
  cmd = command(*run_config(ratio, setting, seed, a, model_dir))
  print(f"\n=== C = {ratio}, {LABELS[setting]}, seed {seed}: " +
        " ".join(cmd[1:3] + [f'"{c}"' if " " in c else c for c in cmd[3:]]), flush=True)
  start = time.time()
  log = model_dir / "log.txt"
  with open(log, "w") as f:
    proc = subprocess.run(cmd, cwd=benchmarking.REPO, stdout=f, stderr=subprocess.STDOUT,
                          check=False)
  seconds = time.time() - start
  text = log.read_text(errors="replace")
  bad = nonfinite_steps(text)
  if proc.returncode and not RAISED.search(text):  # a failure other than a stopped divergence
    sys.exit(f"run failed (exit {proc.returncode}): {' '.join(cmd)}\n{text[-3000:]}")
  curve = curve_of(model_dir, bad)
  stats = run_stats(curve, a.steps)
  print(f"    {stats['verdict']}: final loss {stats['final_loss']:.3f}, min "
        f"{stats['min_loss']:.3f}, largest spike x{stats['spike']:.2f} at step "
        f"{stats['spike_step']}, grad-norm max {stats['grad_max']:.3g} at step "
        f"{stats['grad_max_step']}, non-finite steps {bad or 'none'} ({seconds:.0f} s)",
        flush=True)
  return {"ratio": ratio, "setting": setting, "seed": seed, "steps": a.steps,
          "curve": curve, "stopped": bool(proc.returncode), "seconds": round(seconds, 1),
          "load_average": benchmarking.load_average()}


# ------------------------------------------------------------------------------ reporting
def summarize(results: Sequence[Mapping]) -> List[Dict]:
  """One row per (C, setting): verdict counts, and mean and s.e. over seeds of the stats."""
  rows = []
  for ratio in sorted({r["ratio"] for r in results}):
    for setting in SETTINGS:
      mine = [r for r in results if r["ratio"] == ratio and r["setting"] == setting]
      if not mine:
        continue
      stats = [run_stats(r["curve"], r["steps"]) for r in mine]
      row = {"ratio": ratio, "setting": setting, "seeds": sorted(r["seed"] for r in mine),
             "verdicts": {v: sum(s["verdict"] == v for s in stats) for v in VERDICTS},
             "nonfinite": sum(len(s["nonfinite_steps"]) for s in stats)}
      for key in ("final_loss", "min_loss", "spike", "grad_max"):
        row[key] = benchmarking.mean_stderr([s[key] for s in stats])
      rows.append(row)
  return rows


def _cell(pair, digits: int = 3) -> str:
  mean, se = pair
  return f"{mean:.{digits}f}" if math.isnan(se) else f"{mean:.{digits}f} ± {se:.{digits}f}"


def table(rows: Sequence[Mapping]) -> str:
  head = ["C", "stabilisers", "seeds", "verdicts", "final loss", "min loss",
          "largest spike (x running min)", "grad-norm max", "NaN / Inf steps"]
  body = [[r["ratio"], r["setting"], len(r["seeds"]),
           ", ".join(f"{n} {v}" for v, n in r["verdicts"].items() if n), _cell(r["final_loss"]),
           _cell(r["min_loss"]), _cell(r["spike"], 2), _cell(r["grad_max"], 2),
           r["nonfinite"]] for r in rows]
  return "\n".join(benchmarking.table(head, body))


def per_run(results: Sequence[Mapping]) -> List[str]:
  head = ["C", "stabilisers", "seed", "verdict", "final loss", "min loss (step)",
          "largest spike (step)", "grad-norm max (step)", "grad-norm median",
          "NaN / Inf steps", "last step", "s"]
  body = []
  for r in sorted(results, key=lambda r: (r["ratio"], list(SETTINGS).index(r["setting"]),
                                          r["seed"])):
    s = run_stats(r["curve"], r["steps"])
    bad = s["nonfinite_steps"]
    body.append([r["ratio"], r["setting"], r["seed"], s["verdict"], f"{s['final_loss']:.3f}",
                 f"{s['min_loss']:.3f} ({s['min_step']})",
                 f"x{s['spike']:.2f} ({s['spike_step']})",
                 f"{s['grad_max']:.3g} ({s['grad_max_step']})", f"{s['grad_median']:.3g}",
                 f"{len(bad)}" + (f" (first {bad[0]})" if bad else ""),
                 f"{s['last_step']} / {r['steps']}", r["seconds"]])
  return benchmarking.table(head, body)


def plot(results: Sequence[Mapping], path: pathlib.Path) -> None:
  """Loss (top) and gradient norm (bottom, log scale) per step, a column per C; a colour per
  setting, a line per seed; a cross where a step was NaN / Inf."""
  plt = results_files.pyplot()
  ratios = sorted({r["ratio"] for r in results})
  fig, axes = plt.subplots(2, len(ratios), figsize=(5.5 * len(ratios), 7), squeeze=False,
                           sharex=True)
  for col, ratio in enumerate(ratios):
    for i, setting in enumerate(SETTINGS):
      for r in (r for r in results if r["ratio"] == ratio and r["setting"] == setting):
        c = np.array(r["curve"], np.float64).reshape(-1, 3)
        label = LABELS[setting] if r["seed"] == min(x["seed"] for x in results) else None
        for row, k in ((0, 1), (1, 2)):
          axes[row, col].plot(c[:, 0], c[:, k], color=f"C{i}", linewidth=0.8, alpha=0.8,
                              label=label)
          bad = c[~np.isfinite(c[:, k]), 0]
          top = np.nanmax(c[:, k]) if np.isfinite(c[:, k]).any() else 1.0
          axes[row, col].plot(bad, np.full(bad.shape, top), "x", color=f"C{i}")
    axes[0, col].set_title(f"DeCAL C = {ratio}", fontsize=10)
    axes[0, col].set_ylabel("train loss (per target token)")
    axes[1, col].set_ylabel("gradient global norm")
    axes[1, col].set_yscale("log")
    axes[1, col].set_xlabel("step")
    axes[0, col].legend(fontsize=8)
    for ax in axes[:, col]:
      ax.grid(True, alpha=0.3)
  fig.tight_layout()
  results_files.save_figure(fig, str(path))


def report(a, results: Sequence[Mapping], planned: int) -> str:
  minutes = sum(r["seconds"] for r in results) / 60
  loads = sorted({r["load_average"] for r in results})
  n = lengths(a)
  lines = benchmarking.header(
      "DeCAL pretraining stability: C = 4 vs C = 16, stabilisers off / on",
      benchmarking.command("tools.stability_16x", [  # the command that trained the runs
          x for x in (sys.argv[1:] if a.argv is None else a.argv) if x != "--report_only"]),
      f"wall time: {minutes:.1f} min for the {len(results)} runs (each a `python -m "
      "decal_jax.train` process, start-up included); load average (1/5/15 min) at the end "
      f"of each run: {', '.join(loads[:3])}{' ...' if len(loads) > 3 else ''}",
      f"runs: {a.model_gin} + runs/pretrain.gin, task {a.task}, inputs {n['inputs']} / "
      f"targets {n['targets']} tokens ({n['inputs'] // 16} latents at C = 16, "
      f"{n['inputs'] // 4} at C = 4), batch {a.batch_size}, {a.steps} steps, Adafactor, "
      f"rsqrt schedule with base {a.learning_rate} and {a.warmup or max(1, a.steps // 10)} "
      "warm-up steps, float32; loss and gradient norm logged every step",
      "stabilisers off: " + "; ".join(SETTINGS["off"]) + ". on: " + "; ".join(SETTINGS["on"]),
      f"verdict rule: diverged = a NaN / Inf step, or final loss (mean of the last "
      f"{FINAL_STEPS} steps) > {SPIKE_FACTOR} x min loss; spiked and recovered = some step's "
      f"loss > {SPIKE_FACTOR} x the running minimum before it; else smooth. Mean ± standard "
      "error over seeds")
  lines += ["", table(summarize(results)), "", "Per run:", "", *per_run(results)]
  text = "\n".join(lines) + "\n"
  if len(results) < planned:
    text = results_files.mark_partial(text, results_files.partial_line(
        len(results), planned, "runs", "the same command continues"))
  return text


def write(a, results: Sequence[Mapping], planned: int) -> None:
  if not results:
    return
  print("\n" + table(summarize(results)), flush=True)
  if not a.out:
    return
  a.out.parent.mkdir(parents=True, exist_ok=True)
  text = report(a, results, planned)
  if not a.no_plot:
    png = a.out.with_suffix(".png")
    plot(results, png)
    text += f"\n![loss and gradient-norm curves, C = 4 vs 16, stabilisers off / on]({png.name})\n"
  fileio.write_text_atomic(a.out, results_files.keep_reading(a.out, text))


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--ratios", nargs="+", type=int, default=[4, 16])
  p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
  p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=150)
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--inputs_length", type=int, default=512)
  p.add_argument("--learning_rate", type=float, default=1.0, help="the rsqrt schedule's base")
  p.add_argument("--warmup", type=int, default=None, help="default: 10 %% of --steps")
  p.add_argument("--task", default="decal_builtin_span_corruption")
  p.add_argument("--model_gin", default="experiments/models/mini.gin")
  p.add_argument("--work", type=pathlib.Path, default=pathlib.Path("runs", "stability_16x"))
  results_files.add_record_args(p, "2 steps, batch 2: a check only")
  a = p.parse_args(argv)
  a.argv = argv
  if a.dry_run:
    a.steps, a.batch_size = 2, 2
  if any(r < 1 or a.inputs_length % r for r in a.ratios):
    p.error(f"every ratio must divide --inputs_length {a.inputs_length}; got {a.ratios}.")
  a.work = a.work.resolve()
  return a


def record_key(a, ratio: int, setting: str, seed: int) -> str:
  return (f"{a.task}/{pathlib.Path(a.model_gin).stem}/in{a.inputs_length}_b{a.batch_size}"
          f"_lr{a.learning_rate}_w{a.warmup or 'auto'}/{setting}_r{ratio}_s{seed}"
          f"_steps{a.steps}")


def main(argv=None):
  a = parse_args(argv)
  plan = [(r, st, s) for s in a.seeds for r in a.ratios for st in a.settings]  # seeds first
  done = json.loads(a.record.read_text()) if a.record and a.record.exists() else {}
  results = []
  for ratio, setting, seed in plan:
    key = record_key(a, ratio, setting, seed)
    if key not in done and a.report_only:
      continue
    if key not in done:
      done[key] = run_one(ratio, setting, seed, a)
      if a.record:
        fileio.write_text_atomic(a.record, json.dumps(done, indent=1))
    results.append(done[key])
    write(a, results, len(plan))
  return results


if __name__ == "__main__":
  main()
