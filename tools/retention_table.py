"""Information retained vs compression ratio: DeCAL (and its ablations), AttnPool, CCProxy
and Dodo's compressor trained under one budget to rebuild their input from its compressed
encoding, at each ratio and seed; a Markdown table of mean +- standard error over seeds, a
per-run table and a plot. Two kinds of content:

- `--content known` (the default): n symbols drawn from k one-token words
  (`decal_known_uniform_k16_n15` by default, `--task` for another; tasks/known_content_tasks.py),
  so each example carries exactly n log2 k bits; trained to convergence (C = 1 must rebuild
  >= 99 % of held-out sequences exactly), C in 1 2 4 8 16:

    nice -n 5 python -m tools.retention_table --record docs/results/retention_known.json \
      --out docs/results/retention_known.md

- `--content real`: 63-token chunks of real text (C4 / WikiText-2 / TinyStories,
  `decal_public_text_autoencode`), C in 2 4 8:

    DECAL_DATA_DIR=../shared/data nice -n 5 python -m tools.retention_table --content real \
      --steps 80 --work runs/retention80 --record docs/results/retention_cpu.json \
      --out docs/results/retention_cpu.md

(The records hold the runs of those tables, so these commands only redraw them; a new
--record trains them again.)

The budgets are gin/experiments/known/run.gin and gin/experiments/retention/run.gin (steps,
batch, AdamW schedule, held-out examples); the models are the {t5,dodo}.gin beside them.
Metrics, all on the same first held-out examples: teacher-forced token accuracy, the same
with every example decoding another's encoding (the swapped control: what the decoder's prior
alone gets right), BLEU of the greedy reconstruction and its token accuracy (both texts
tokenized, compared position by position); for known content also the exact rebuilds and the
symbol accuracy of the greedy reconstructions, the bits each latent must carry, and the step
from which the held-out curve stayed within FLAT_POINTS of its last value.

Options: --methods (default: all six for known content, the first four for real text),
--ratios, --seeds (0 1 2), --steps (the run file's), --work (runs/retention_<content>: one
MODEL_DIR per run), --record (a JSON of every finished run's result: read first, so a rerun or
another machine only runs what is missing, and rewritten after each run), --report_only
(redraw from the record, training nothing), --dry_run (2 steps, 4 held-out examples: checks
the machinery, numbers meaningless). SIGTERM stops after saving;
the same command resumes.
"""
import argparse
import dataclasses
import json
import math
import os
import pathlib
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(  # seeds 1, 2 reuse seed 0's
    os.path.expanduser("~"), ".cache", "decal_jax", "xla_retention_cache"))

from decal_jax import fileio
from tools import benchmarking, results_files

FLAT_POINTS = 0.01  # a curve has flattened once every later point is this close to its last


@dataclasses.dataclass(frozen=True)
class Content:
  title: str
  folder: str          # gin/<folder>/{run,t5,dodo}.gin
  task: Optional[str]  # None: the known task given by --task
  ratios: Tuple[int, ...]
  methods: Tuple[str, ...]
  curve_points: int    # held-out evaluations per run (the learning curve)


CONTENTS = {
    "known": Content("known content", "experiments/known", None, (1, 2, 4, 8, 16),
                     ("decal", "decal_no_pooling", "decal_separate", "attn_pool", "ccproxy",
                      "dodo"), 10),
    "real": Content("real text", "experiments/retention", "decal_public_text_autoencode",
                    (2, 4, 8), ("decal", "attn_pool", "ccproxy", "dodo"), 4),
}
TASK = CONTENTS["real"].task
DEFAULT_KNOWN_TASK = "decal_known_uniform_k16_n15"
METHODS = {  # name: (label, model file in the content's folder, bindings)
    "decal": ("DeCAL", "t5.gin", ["COMPRESSOR = 'latents'"]),
    "decal_no_pooling": ("DeCAL, no pooling", "t5.gin",
                         ["COMPRESSOR = 'latents'", "USE_POOLING = False"]),
    "decal_separate": ("DeCAL, separate params", "t5.gin",
                       ["COMPRESSOR = 'latents'", "SEPARATE_LATENT_PARAMS = True"]),
    "attn_pool": ("AttnPool", "t5.gin", ["COMPRESSOR = 'attn_pool'"]),
    "ccproxy": ("CCProxy", "t5.gin", ["COMPRESSOR = 'memory_tokens'"]),
    "dodo": ("Dodo", "dodo.gin", []),
}
METRICS = (("teacher_forced_accuracy", "teacher-forced token acc (%)", 100),
           ("encoding_gain", "gain from own encoding (points)", 100),
           ("greedy_accuracy", "greedy token acc (%)", 100), ("bleu", "BLEU", 1))
KNOWN_METRICS = (("exact", "exact rebuilds (%)", 1),
                 ("symbol_accuracy", "greedy symbol acc (%)", 1),
                 ("teacher_forced_accuracy", "teacher-forced token acc (%)", 100),
                 ("swapped_accuracy", "swapped control (%)", 100),
                 ("flat_step", "flat from step", 1))


def metric(result: Mapping, key: str) -> float:
  """A run's value of a METRICS key; 'encoding_gain' is its teacher-forced accuracy minus
  the same with the encodings swapped (per run, so seeds pair them); 'flat_step' is where
  its learning curve flattened."""
  if key == "encoding_gain":
    return result["teacher_forced_accuracy"] - result["swapped_accuracy"]
  if key == "flat_step":
    return flat_step(result["curve"])
  return result[key]


def flat_step(curve: Sequence[Sequence[float]], tolerance: float = FLAT_POINTS) -> float:
  """The first evaluated step from which every later held-out accuracy lies within
  `tolerance` of the last one (the curve's plateau); nan for an empty curve."""
  if not curve:
    return float("nan")
  last = curve[-1][1]
  for i, (step, _) in enumerate(curve):
    if all(abs(acc - last) <= tolerance for _, acc in curve[i:]):
      return step
  return curve[-1][0]


def bits_per_latent(task: str, ratio: int, inputs_length: int) -> float:
  """The information of one example of a known-content task divided by the ceil(L / C)
  vectors its encoding has at ratio C."""
  from decal_jax.tasks import known_content_tasks as known
  _, kind, k, n = task.rsplit("_", 3)
  bits = known.information_bits(kind, int(k[1:]), int(n[1:]))
  return bits / math.ceil(inputs_length / ratio)


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
def task_of(a) -> str:
  return CONTENTS[a.content].task or a.task


def run_config(method: str, ratio: int, seed: int, a, model_dir: pathlib.Path):
  """(gin files, bindings) of one run."""
  content = CONTENTS[a.content]
  _, model_gin, extra = METHODS[method]
  bindings = [f"MODEL_DIR = {str(model_dir)!r}", f"COMPRESSION_RATIO = {ratio}",
              f"SEED = {seed}", *extra]
  if content.task is None:
    bindings += [f"KNOWN_TASK = {a.task!r}",
                 f"TASK_FEATURE_LENGTHS = {{'inputs': {a.length}, 'targets': {a.length}}}"]
  if a.steps:
    bindings += [f"TRAIN_STEPS = {a.steps}", f"CHECKPOINT_PERIOD = {a.steps}",
                 f"EVAL_PERIOD = {max(1, a.steps // content.curve_points)}",
                 f"WARMUP_STEPS = {max(1, a.steps // 10)}"]
  if a.dry_run:
    bindings += ["EVAL_BATCHES = 1", "BATCH_SIZE = 4", "MAX_PREDICT_EXAMPLES = 4",
                 "LOG_PERIOD = 1"]
  return [f"{content.folder}/{model_gin}", f"{content.folder}/run.gin"], bindings


def learning_curve(model_dir: pathlib.Path, task: str) -> List[List[float]]:
  """[[step, held-out teacher-forced accuracy], ...] from the run's TensorBoard events."""
  import tensorflow as tf
  points = {}
  for path in sorted((model_dir / "training_eval" / task).glob("events.out.tfevents.*")):
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
  import seqio
  import decal_jax.tasks  # noqa: F401  (registers the task)
  task = task_of(a)
  model_dir = run_dir(a, method, ratio, seed)
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
  rows = inference_eval.read_inferences(str(model_dir), task, steps)
  vocab = seqio.get_mixture_or_task(task).output_features["targets"].vocabulary  # the log
  # holds texts, not ids
  greedy = greedy_token_accuracy([vocab.encode(r["prediction"]) for r in rows],
                                 [vocab.encode(r["target"]) for r in rows])
  swapped = swapped_accuracy(files, bindings, model_dir)
  result = {"method": method, "ratio": ratio, "seed": seed, "steps": steps,
            "teacher_forced_accuracy": float(metrics["accuracy"]), "swapped_accuracy": swapped,
            "bleu": float(metrics[f"{task}/bleu"]), "greedy_accuracy": greedy,
            "eval_tokens": int(metrics["target_tokens"]), "decoded_chunks": len(rows),
            "curve": learning_curve(model_dir, task), "train_seconds": round(train_seconds, 1),
            "seconds": round(time.time() - start, 1),
            "load_average": benchmarking.load_average()}
  if CONTENTS[a.content].task is None:
    result.update(task=task, exact=float(metrics[f"{task}/exact"]),
                  symbol_accuracy=float(metrics[f"{task}/symbol_accuracy"]),
                  bits_per_latent=bits_per_latent(task, ratio, a.length))
  return result


def run_dir(a, method: str, ratio: int, seed: int) -> pathlib.Path:
  """One run's MODEL_DIR: <work>/<method>_r<C>_s<seed> (under the task's name for known
  content, so that two tasks never share a folder)."""
  folder = a.work if CONTENTS[a.content].task else a.work / task_of(a)
  return folder / f"{method}_r{ratio}_s{seed}"


# ------------------------------------------------------------------------------ reporting
def metrics_of(results: Sequence[Mapping]) -> Tuple[Tuple[str, str, float], ...]:
  """The table's columns: KNOWN_METRICS for known-content runs, else METRICS."""
  return KNOWN_METRICS if results and "exact" in results[0] else METRICS


def summarize(results: Sequence[Mapping], metrics=None) -> List[Dict]:
  """One row per (method, ratio): each metric's mean and s.e. over its seeds."""
  metrics = metrics or metrics_of(results)
  rows = []
  for method in METHODS:
    for ratio in sorted({r["ratio"] for r in results}):
      mine = [r for r in results if r["method"] == method and r["ratio"] == ratio]
      if mine:
        row = {"method": method, "ratio": ratio, "seeds": sorted(r["seed"] for r in mine)}
        if "bits_per_latent" in mine[0]:
          row["bits_per_latent"] = mine[0]["bits_per_latent"]
        for key, _, scale in metrics:
          values = [metric(r, key) for r in mine]
          row[key] = tuple(scale * v for v in benchmarking.mean_stderr(values))
        rows.append(row)
  return rows


def table(rows: Sequence[Mapping], metrics=METRICS) -> str:
  bits = bool(rows) and "bits_per_latent" in rows[0]
  head = ["method", "C (r)", *(["bits / latent"] if bits else []), "seeds"]
  head += [name for _, name, _ in metrics]
  body = [[METHODS[r["method"]][0], r["ratio"],
           *([f"{r['bits_per_latent']:.1f}"] if bits else []), len(r["seeds"])] +
          [_mean_se(r[k], len(r["seeds"])) if k != "flat_step" else f"{r[k][0]:.0f}"
           for k, _, _ in metrics] for r in rows]
  return "\n".join(benchmarking.table(head, body))


def _mean_se(mean_se: Tuple[float, float], seeds: int) -> str:
  """'mean ± s.e.'; one seed has no error bar, so its value is written alone."""
  return f"{mean_se[0]:.2f}" if seeds < 2 else f"{mean_se[0]:.2f} ± {mean_se[1]:.2f}"


def _curves(ax, results: Sequence[Mapping]) -> None:
  """Held-out teacher-forced accuracy vs step, mean over seeds, a line per method and C."""
  styles = {1: "-", 2: "--", 4: "-.", 8: ":", 16: (0, (5, 1, 1, 1, 1, 1))}
  for i, method in enumerate(METHODS):
    for ratio in sorted({r["ratio"] for r in results}):
      curves = [r["curve"] for r in results if r["method"] == method and r["ratio"] == ratio]
      steps = sorted(set.intersection(*[{p[0] for p in c} for c in curves])) if curves else []
      if steps:  # the steps every seed has (a resumed run may lack an early point)
        acc = np.mean([[100 * dict(c)[s] for s in steps] for c in curves], axis=0)
        ax.plot(steps, acc, linestyle=styles.get(ratio, "-"), color=f"C{i}",
                label=f"{METHODS[method][0]} C={ratio}")
  ax.set_xlabel("training step")
  ax.set_ylabel("held-out teacher-forced accuracy (%)")
  ax.legend(fontsize=5, ncol=2)


def _per_method(ax, rows: Sequence[Mapping], x_key: str, y_key: str) -> None:
  for method in METHODS:
    mine = [r for r in rows if r["method"] == method]
    if mine:
      ax.errorbar([r[x_key] for r in mine], [r[y_key][0] for r in mine],
                  yerr=[np.nan_to_num(r[y_key][1]) for r in mine], marker="o",
                  capsize=3, label=METHODS[method][0])
  ax.set_xscale("log", base=2)
  ax.legend(fontsize=7)


def plot(rows: Sequence[Mapping], results: Sequence[Mapping], path: pathlib.Path) -> None:
  """Real text: the gain from the own encoding vs C, a line per method (error bars: s.e.), and
  the learning curves. Known content: exact rebuilds vs C, symbol accuracy vs the bits each
  latent must carry, and the learning curves."""
  plt = results_files.pyplot()
  if "exact" not in results[0]:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    _per_method(left, rows, "ratio", "encoding_gain")
    left.axhline(0, color="gray", linewidth=0.5)
    left.set_ylabel("accuracy gain from the own encoding (points)")
  else:
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    _per_method(left, rows, "ratio", "exact")
    left.set_ylabel("held-out sequences rebuilt exactly (%)")
    _per_method(middle, rows, "bits_per_latent", "symbol_accuracy")
    middle.set_xlabel("bits of content per latent vector")
    middle.set_ylabel("greedy symbol accuracy (%)")
    middle.axhline(100 / int(results[0]["task"].rsplit("_k", 1)[1].split("_")[0]),
                   color="gray", linewidth=0.5)  # chance: 1 / k
  left.set_xlabel("compression ratio C (r)")
  _curves(right, results)
  results_files.save_figure(fig, str(path))


def report(a, rows, results, planned: int) -> str:
  runs = sorted(results, key=lambda r: (list(METHODS).index(r["method"]), r["ratio"], r["seed"]))
  minutes = sum(r["seconds"] for r in results) / 60
  loads = sorted({r["load_average"] for r in results})
  content = CONTENTS[a.content]
  title = (f"Information retained vs compression ratio ({content.title}"
           f"{': ' + task_of(a) if content.task is None else ''})")
  lines = benchmarking.header(
      title, benchmarking.command("tools.retention_table", a.argv),
      f"wall time: {minutes:.1f} min for the {len(results)} runs (training + evaluation, "
      f"process start-up not included); load average (1/5/15 min) at the end of each run: "
      f"{', '.join(loads[:3])}{' ...' if len(loads) > 3 else ''}",
      f"budget: gin/{content.folder}/run.gin, {results[0]['steps'] if results else '?'} "
      "steps per run; mean ± standard error over seeds")
  lines += ["", table(rows, metrics_of(results)), ""]
  if len(results) < planned:
    lines.append(f"{len(results)} of {planned} runs done so far; the same command continues.")
  known = "exact" in results[0]
  head = ["method", "C", "seed", *(["exact %", "symbol acc %"] if known else []),
          "teacher-forced acc", "swapped acc", "greedy acc", "BLEU", "flat from step",
          "train s", "total s"]
  lines += ["", "Per run:", "", *benchmarking.table(head, [
      [METHODS[r["method"]][0], r["ratio"], r["seed"],
       *([f"{r['exact']:.1f}", f"{r['symbol_accuracy']:.1f}"] if known else []),
       f"{r['teacher_forced_accuracy']:.4f}", f"{r.get('swapped_accuracy', float('nan')):.4f}",
       f"{r['greedy_accuracy']:.4f}", f"{r['bleu']:.2f}", f"{flat_step(r['curve']):.0f}",
       r["train_seconds"], r["seconds"]] for r in runs])]
  return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ main
def load_record(path) -> Dict[str, Mapping]:
  return json.loads(path.read_text()) if path and path.exists() else {}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--content", choices=list(CONTENTS), default="known")
  p.add_argument("--task", default=DEFAULT_KNOWN_TASK,
                 help="known content: a decal_known_<kind>_k<k>_n<n> task")
  p.add_argument("--methods", nargs="+", choices=list(METHODS),
                 help="default: the content's (all six for known, four for real text)")
  p.add_argument("--ratios", nargs="+", type=int, help="default: 1 2 4 8 16 (known), 2 4 8")
  p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=None, help="default: the run file's TRAIN_STEPS")
  p.add_argument("--work", type=pathlib.Path, help="default: runs/retention_<content>")
  results_files.add_record_args(p, "2 steps, 4 examples: a check only")
  a = p.parse_args(argv)
  a.argv = argv
  content = CONTENTS[a.content]
  a.methods = a.methods or list(content.methods)
  a.ratios = a.ratios or list(content.ratios)
  a.work = a.work or pathlib.Path("runs", "retention" if a.content == "real" else
                                  f"retention_{a.content}")
  if content.task is None:
    try:
      n = int(a.task.rsplit("_n", 1)[1])
      a.length = n + 1  # the symbols + EOS
    except (IndexError, ValueError):
      p.error(f"--task {a.task!r} is not a known-content task (decal_known_<kind>_k<k>_n<n>).")
  else:
    a.length = 64
  if any(r < 1 or a.length % r for r in a.ratios):
    p.error(f"every ratio must divide the {a.length}-token inputs; got {a.ratios}.")
  if a.dry_run:
    a.steps = a.steps or 2
  return a


def record_key(a, method: str, ratio: int, seed: int) -> str:
  key = f"{method}_r{ratio}_s{seed}_steps{a.steps or 'default'}"
  return key if CONTENTS[a.content].task else f"{a.task}/{key}"


def main(argv=None):
  a = parse_args(argv)
  plan = [(m, r, s) for s in a.seeds for m in a.methods for r in a.ratios]  # whole seeds first
  done = load_record(a.record)
  results = []
  for method, ratio, seed in plan:
    key = record_key(a, method, ratio, seed)
    if key not in done and a.report_only:
      continue
    if key not in done:
      result = run_one(method, ratio, seed, a, a.work)
      if result is None:
        print("stopped (preempted); the same command continues where this one stopped.")
        break
      done[key] = result
      if a.record:
        fileio.write_text_atomic(a.record, json.dumps(done, indent=1))
    results.append(done[key])
    write(a, results, len(plan))
  return results


def write(a, results, planned: int) -> None:
  rows = summarize(results)
  print("\n" + table(rows, metrics_of(results)), flush=True)
  if not a.out:
    return
  a.out.parent.mkdir(parents=True, exist_ok=True)
  text = report(a, rows, results, planned)
  if not a.no_plot:
    png = a.out.with_suffix(".png")
    plot(rows, results, png)
    text += f"\n![retention vs C, and learning curves]({png.name})\n"
  fileio.write_text_atomic(a.out, results_files.keep_reading(a.out, text))


if __name__ == "__main__":
  main()
