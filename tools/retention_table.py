"""Information retained vs compression ratio: DeCAL, AttnPool, CCProxy and Dodo's compressor
trained under one budget to rebuild 63-token chunks of real text (C4 / WikiText-2 /
TinyStories, `decal_public_text_autoencode`) from their compressed encoding, at each ratio
and seed; a Markdown table of mean +- standard error over seeds (and a plot):

  DECAL_DATA_DIR=../shared/data nice -n 5 python -m tools.retention_table --steps 80 \
    --work runs/retention80 --record docs/results/retention_cpu.json --out docs/results/retention_cpu.md

(The record holds the 36 runs of docs/results/retention_cpu.md, so this command only redraws
the table; a new --record trains them again, about an hour on 2 shared CPU cores.)

The budget is gin/experiments/retention/run.gin (steps, batch, AdamW schedule, held-out
chunks); the models are gin/experiments/retention/{t5,dodo}.gin. Metrics, all on the same
first held-out chunks: teacher-forced token accuracy, BLEU of the greedy reconstruction,
and the greedy reconstruction's token accuracy (both texts tokenized, compared position by
position).
The learning curve is the teacher-forced accuracy every EVAL_PERIOD steps.

Options: --methods (decal attn_pool ccproxy dodo), --ratios (2 4 8), --seeds (0 1 2),
--steps (the run file's), --work (runs/retention: one MODEL_DIR per run), --record (a JSON
of every finished run's result: read first, so a rerun or another machine only runs what
is missing, and rewritten after each run), --dry_run (2 steps, 4 held-out chunks: checks
the machinery, numbers meaningless). SIGTERM stops after saving; the same command resumes.
"""
import argparse
import json
import os
import pathlib
import sys
import time
from typing import Dict, List, Mapping, Sequence

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(  # seeds 1, 2 reuse seed 0's
    os.path.expanduser("~"), ".cache", "decal_jax", "xla_retention_cache"))

from decal_jax import fileio
from tools import benchmarking, results_files

TASK = "decal_public_text_autoencode"
READING = "<!-- reading: written by hand; kept when the tool rewrites the table above -->"
FOLDER = "experiments/retention"
METHODS = {  # name: (label, model gin, bindings)
    "decal": ("DeCAL", f"{FOLDER}/t5.gin", ["COMPRESSOR = 'latents'"]),
    "attn_pool": ("AttnPool", f"{FOLDER}/t5.gin", ["COMPRESSOR = 'attn_pool'"]),
    "ccproxy": ("CCProxy", f"{FOLDER}/t5.gin", ["COMPRESSOR = 'memory_tokens'"]),
    "dodo": ("Dodo", f"{FOLDER}/dodo.gin", []),
}
METRICS = (("teacher_forced_accuracy", "teacher-forced token acc (%)", 100),
           ("encoding_gain", "gain from own encoding (points)", 100),
           ("greedy_accuracy", "greedy token acc (%)", 100), ("bleu", "BLEU", 1))


def metric(result: Mapping, key: str) -> float:
  """A run's value of a METRICS key; 'encoding_gain' is its teacher-forced accuracy minus
  the same with the encodings swapped (per run, so seeds pair them)."""
  if key == "encoding_gain":
    return result["teacher_forced_accuracy"] - result["swapped_accuracy"]
  return result[key]


# ------------------------------------------------------------------------------ statistics
def greedy_token_accuracy(predictions: Sequence[Sequence[int]],
                          references: Sequence[Sequence[int]]) -> float:
  """Fraction of the references' tokens that the predictions have at the same position,
  over all chunks (a prediction shorter than its reference misses the rest; extra
  predicted tokens are not counted)."""
  hits = total = 0
  for pred, ref in zip(predictions, references, strict=True):
    hits += sum(p == r for p, r in zip(pred, ref))
    total += len(ref)
  return hits / total


# ------------------------------------------------------------------------------ one run
def run_config(method: str, ratio: int, seed: int, a, model_dir: pathlib.Path):
  """(gin files, bindings) of one run."""
  _, model_gin, extra = METHODS[method]
  bindings = [f"MODEL_DIR = {str(model_dir)!r}", f"COMPRESSION_RATIO = {ratio}",
              f"SEED = {seed}", *extra]
  if a.steps:
    bindings += [f"TRAIN_STEPS = {a.steps}", f"CHECKPOINT_PERIOD = {a.steps}",
                 f"EVAL_PERIOD = {max(1, a.steps // 4)}", f"WARMUP_STEPS = {max(1, a.steps // 10)}"]
  if a.dry_run:
    bindings += ["EVAL_BATCHES = 1", "BATCH_SIZE = 4", "MAX_PREDICT_EXAMPLES = 4",
                 "LOG_PERIOD = 1"]
  return [model_gin, f"{FOLDER}/run.gin"], bindings


def learning_curve(model_dir: pathlib.Path) -> List[List[float]]:
  """[[step, held-out teacher-forced accuracy], ...] from the run's TensorBoard events."""
  import tensorflow as tf
  points = {}
  for path in sorted((model_dir / "training_eval" / TASK).glob("events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      for value in event.summary.value:
        if value.tag == "accuracy":
          points[int(event.step)] = float(tf.make_ndarray(value.tensor))
  return [[s, points[s]] for s in sorted(points)]


def swap_encodings(batch: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
  """The batch with every row's encoder features taken from the row before it (rolled by
  one): each chunk's decoder then reads another chunk's encoding."""
  return {k: np.roll(v, 1, axis=0) if k.startswith("encoder_") else v for k, v in batch.items()}


def swapped_accuracy(files: Sequence[str], bindings: Sequence[str],
                     model_dir: pathlib.Path) -> float:
  """Held-out teacher-forced accuracy of the trained run with the encodings swapped
  (`swap_encodings`), on the same EVAL_BATCHES batches: what the decoder gets right without
  its chunk's own encoding. The accuracy minus this is what the encoding carried."""
  import gin
  import jax
  from decal_jax import partitioning
  from decal_jax.runtime import evaluation, gin_utils
  from decal_jax.data import pipeline
  partitioner = partitioning.Partitioner()
  model, params, _, _ = gin_utils.load_model(files, str(model_dir), bindings=bindings,
                                             partitioner=partitioner)
  cfg = gin.get_configurable("validation/pipeline.DatasetConfig")()
  step = evaluation.make_eval_step(model, partitioner)
  ds = pipeline.get_dataset(cfg, model, 1, partitioner)
  sums: Dict[str, float] = {}
  for batch in pipeline.lockstep_batches(ds, cfg.batch_size,
                                         gin.query_parameter("%EVAL_BATCHES")):
    aux = jax.device_get(step(params, pipeline.to_global(swap_encodings(batch), partitioner)))
    for k, v in aux.items():
      sums[k] = sums.get(k, 0.0) + float(v)
  return float(model.summarize(sums)["accuracy"])


def run_one(method: str, ratio: int, seed: int, a, work: pathlib.Path) -> Mapping:
  """Trains (or resumes) and evaluates one run; its result dict (None when preempted)."""
  import gin
  from decal_jax.runtime import evaluation, gin_utils, inference_eval, trainer
  from decal_jax.data import vocabularies
  import decal_jax.tasks  # noqa: F401  (registers the task)
  model_dir = work / f"{method}_r{ratio}_s{seed}"
  files, bindings = run_config(method, ratio, seed, a, model_dir)
  print(f"\n=== {METHODS[method][0]} r={ratio} seed={seed}: python -m decal_jax.train " +
        " ".join([f"--gin_file={f}" for f in files] + [f'--gin_bindings="{b}"' for b in bindings]),
        flush=True)
  start = time.time()
  gin_utils.parse(files, [], bindings)
  trained = gin.get_configurable(trainer.train)(gin_config_text=gin.config_str())
  if "preempted_at_step" in trained:
    return None
  train_seconds = time.time() - start
  gin_utils.parse(files, [], bindings)
  steps = gin.query_parameter("%TRAIN_STEPS")
  metrics = gin.get_configurable(evaluation.evaluate)()
  rows = inference_eval.read_inferences(str(model_dir), TASK, steps)
  vocab = vocabularies.builtin_vocabulary()  # the task's; its log holds texts, not ids
  greedy = greedy_token_accuracy([vocab.encode(r["prediction"]) for r in rows],
                                 [vocab.encode(r["target"]) for r in rows])
  swapped = swapped_accuracy(files, bindings, model_dir)
  return {"method": method, "ratio": ratio, "seed": seed, "steps": steps,
          "teacher_forced_accuracy": float(metrics["accuracy"]), "swapped_accuracy": swapped,
          "bleu": float(metrics[f"{TASK}/bleu"]), "greedy_accuracy": greedy,
          "eval_tokens": int(metrics["target_tokens"]), "decoded_chunks": len(rows),
          "curve": learning_curve(model_dir), "train_seconds": round(train_seconds, 1),
          "seconds": round(time.time() - start, 1), "load_average": benchmarking.load_average()}


# ------------------------------------------------------------------------------ reporting
def summarize(results: Sequence[Mapping]) -> List[Dict]:
  """One row per (method, ratio): each metric's mean and s.e. over its seeds."""
  rows = []
  for method in METHODS:
    for ratio in sorted({r["ratio"] for r in results}):
      mine = [r for r in results if r["method"] == method and r["ratio"] == ratio]
      if mine:
        row = {"method": method, "ratio": ratio, "seeds": sorted(r["seed"] for r in mine)}
        for key, _, scale in METRICS:
          values = [metric(r, key) for r in mine]
          row[key] = tuple(scale * v for v in benchmarking.mean_stderr(values))
        rows.append(row)
  return rows


def table(rows: Sequence[Mapping]) -> str:
  head = ["method", "C (r)", "seeds"] + [name for _, name, _ in METRICS]
  body = [[METHODS[r["method"]][0], r["ratio"], len(r["seeds"])] +
          [f"{r[k][0]:.2f} ± {r[k][1]:.2f}" for k, _, _ in METRICS] for r in rows]
  return "\n".join(benchmarking.table(head, body))


def plot(rows: Sequence[Mapping], results: Sequence[Mapping], path: pathlib.Path) -> None:
  """Left: the gain from the own encoding vs C, a line per method (error bars: s.e.); right: the
  learning curves (held-out teacher-forced accuracy), mean over seeds, at each method's C."""
  plt = results_files.pyplot()
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  for method in METHODS:
    mine = [r for r in rows if r["method"] == method]
    if mine:
      left.errorbar([r["ratio"] for r in mine], [r["encoding_gain"][0] for r in mine],
                    yerr=[np.nan_to_num(r["encoding_gain"][1]) for r in mine], marker="o",
                    capsize=3, label=METHODS[method][0])
  left.set_xscale("log", base=2)
  left.set_xlabel("compression ratio C (r)")
  left.axhline(0, color="gray", linewidth=0.5)
  left.set_ylabel("accuracy gain from the own encoding (points)")
  left.legend(fontsize=8)
  styles = {2: "-", 4: "--", 8: ":"}
  for i, method in enumerate(METHODS):
    for ratio in sorted({r["ratio"] for r in results}):
      curves = [r["curve"] for r in results if r["method"] == method and r["ratio"] == ratio]
      steps = sorted(set.intersection(*[{p[0] for p in c} for c in curves])) if curves else []
      if steps:  # the steps every seed has (a resumed run may lack an early point)
        acc = np.mean([[100 * dict(c)[s] for s in steps] for c in curves], axis=0)
        right.plot(steps, acc, styles.get(ratio, "-"), color=f"C{i}",
                   label=f"{METHODS[method][0]} C={ratio}")
  right.set_xlabel("training step")
  right.set_ylabel("held-out teacher-forced accuracy (%)")
  right.legend(fontsize=6, ncol=2)
  results_files.save_figure(fig, str(path))


def report(a, rows, results, planned: int) -> str:
  runs = sorted(results, key=lambda r: (list(METHODS).index(r["method"]), r["ratio"], r["seed"]))
  minutes = sum(r["seconds"] for r in results) / 60
  loads = sorted({r["load_average"] for r in results})
  lines = benchmarking.header(
      "Information retained vs compression ratio (real text)",
      benchmarking.command("tools.retention_table", a.argv),
      f"wall time: {minutes:.1f} min for the {len(results)} runs (training + evaluation, "
      f"process start-up not included); load average (1/5/15 min) at the end of each run: "
      f"{', '.join(loads[:3])}{' ...' if len(loads) > 3 else ''}",
      f"budget: gin/experiments/retention/run.gin, {results[0]['steps'] if results else '?'} "
      "steps per run; mean ± standard error over seeds")
  lines += ["", table(rows), ""]
  if len(results) < planned:
    lines.append(f"{len(results)} of {planned} runs done so far; the same command continues.")
  lines += ["", "Per run:", "", *benchmarking.table(
      ["method", "C", "seed", "teacher-forced acc", "swapped acc", "greedy acc", "BLEU",
       "train s", "total s"],
      [[METHODS[r["method"]][0], r["ratio"], r["seed"], f"{r['teacher_forced_accuracy']:.4f}",
        f"{r.get('swapped_accuracy', float('nan')):.4f}",
        f"{r['greedy_accuracy']:.4f}", f"{r['bleu']:.2f}", r["train_seconds"], r["seconds"]]
       for r in runs])]
  return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ main
def load_record(path) -> Dict[str, Mapping]:
  return json.loads(path.read_text()) if path and path.exists() else {}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  p.add_argument("--ratios", nargs="+", type=int, default=[2, 4, 8])
  p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=None, help="default: the run file's TRAIN_STEPS")
  p.add_argument("--work", type=pathlib.Path, default=pathlib.Path("runs", "retention"))
  p.add_argument("--record", type=pathlib.Path, help="JSON of finished runs (resumable)")
  p.add_argument("--out", type=pathlib.Path, help="the Markdown report (plot: same name .png)")
  p.add_argument("--no-plot", action="store_true")
  p.add_argument("--dry_run", action="store_true", help="2 steps, 4 chunks: a check only")
  a = p.parse_args(argv)
  a.argv = argv
  if any(r < 1 or 64 % r for r in a.ratios):
    sys.exit(f"error: every ratio must divide the 64-token inputs; got {a.ratios}.")
  if a.dry_run:
    a.steps = a.steps or 2
  plan = [(m, r, s) for s in a.seeds for m in a.methods for r in a.ratios]  # whole seeds first
  done = load_record(a.record)
  results = []
  for method, ratio, seed in plan:
    key = f"{method}_r{ratio}_s{seed}_steps{a.steps or 'default'}"
    if key not in done:
      result = run_one(method, ratio, seed, a, a.work)
      if result is None:
        print("stopped (preempted); the same command continues where this one stopped.")
        break
      done[key] = result
      if a.record:
        fileio.write_text_atomic(a.record, json.dumps(done, indent=1))
    elif "swapped_accuracy" not in done[key]:  # recorded before the swap test existed
      model_dir = a.work / f"{method}_r{ratio}_s{seed}"
      if any(model_dir.glob("checkpoint_*")):
        files, bindings = run_config(method, ratio, seed, a, model_dir)
        done[key] = dict(done[key], swapped_accuracy=swapped_accuracy(files, bindings, model_dir))
        if a.record:
          fileio.write_text_atomic(a.record, json.dumps(done, indent=1))
    results.append(done[key])
    write(a, results, len(plan))
  return results


def write(a, results, planned: int) -> None:
  rows = summarize(results)
  print("\n" + table(rows), flush=True)
  if not a.out:
    return
  a.out.parent.mkdir(parents=True, exist_ok=True)
  text = report(a, rows, results, planned)
  if not a.no_plot:
    png = a.out.with_suffix(".png")
    plot(rows, results, png)
    text += f"\n![gain from the own encoding vs C, and learning curves]({png.name})\n"
  kept = a.out.read_text().split(READING, 1) if a.out.exists() else []
  if len(kept) == 2:  # the hand-written reading below the marker survives a rerun
    text += "\n" + READING + kept[1]
  fileio.write_text_atomic(a.out, text)


if __name__ == "__main__":
  main()
