"""Task x compression-ratio results table: for each ratio C, pretrain a tiny model on the
built-in corpus (span corruption), fine-tune it on the task, and evaluate it with
`python -m decal_jax.eval` (which writes seqio's MODEL_DIR/inference_eval/<task>-metrics.jsonl
and <task>-<step:06>.jsonl); the table is built from those files. Every run uses the same budget
and data; with --seeds, each ratio is pretrained and fine-tuned once per seed (gin SEED: the
parameters, dropout and the order of the training data) and the table gives mean +- s.e.

  python -m tools.downstream_table --ratios 1 2 4 --pretrain-steps 300 --finetune-steps 150 \
      --seeds 0 1 2 --out docs/results/downstream_builtin_qa.md

Runs live under --work (default runs/downstream/<task>); rerunning the command resumes
unfinished runs and re-evaluates finished ones, so the table can always be regenerated.
Other tasks: --task decal_squad etc. with their data available (DECAL_LOCAL_DATA_DIR).
"""
import argparse
import pathlib

from decal_jax.runtime import inference_eval
from tools import benchmarking, results_files
from tools.benchmarking import run_entry_point as run  # python -m decal_jax.<module>



def one_ratio(ratio: int, seed: int, a, work: pathlib.Path) -> dict:
  """Pretrains, fine-tunes and evaluates C = `ratio` with gin SEED = `seed`; one table row."""
  lengths = f"--gin.TASK_FEATURE_LENGTHS={{'inputs': {a.inputs}, 'targets': {a.targets}}}"
  common = [f"--gin.COMPRESSION_RATIO={ratio}"]
  seeded = [*common, f"--gin.SEED={seed}"]
  pre, ft = work / f"pretrain_c{ratio}_s{seed}", work / f"finetune_c{ratio}_s{seed}"
  log = work / f"c{ratio}_s{seed}.log"
  print(f"C={ratio} seed {seed}: pretraining {a.pretrain_steps} steps ...", flush=True)
  t_pre = run("train", ["--gin_file=runs/pretrain_builtin.gin", f"--gin.MODEL_DIR='{pre}'",
                        f"--gin.TRAIN_STEPS={a.pretrain_steps}", *seeded], log)
  print(f"C={ratio} seed {seed}: fine-tuning on {a.task} {a.finetune_steps} steps ...", flush=True)
  t_ft = run("train", ["--gin_file=runs/finetune_builtin.gin", f"--gin.MODEL_DIR='{ft}'",
                       f"--gin.INITIAL_CHECKPOINT_PATH='{pre}'", f"--gin.TRAIN_STEPS={a.finetune_steps}",
                       f"--gin.MIXTURE_OR_TASK_NAME='{a.task}'", lengths, *seeded], log)
  print(f"C={ratio} seed {seed}: evaluating ...", flush=True)
  t_eval = run("eval", ["--gin_file=models/decal_tiny.gin", "--gin_file=runs/eval.gin",
                        f"--gin.MODEL_DIR='{ft}'", f"--gin.MIXTURE_OR_TASK_NAME='{a.task}'",
                        f"--gin.EVAL_SPLIT='{a.split}'", lengths, *common], log)
  metrics = inference_eval.read_metrics(str(ft), a.task, a.finetune_steps)
  examples = len(inference_eval.read_inferences(str(ft), a.task, a.finetune_steps))
  return dict(metrics, num_examples=examples, ratio=ratio, seed=seed,
              minutes=(t_pre + t_ft + t_eval) / 60)


_NOT_METRICS = ("ratio", "seed", "minutes", "step", "compression_ratio", "num_examples")


def table(rows, task: str) -> str:
  """One line per ratio: each metric's mean +- s.e. over the rows' seeds (a single seed: its
  value), the seeds, the examples scored and the wall minutes summed over the seeds; then,
  with several seeds, one line per (ratio, seed)."""
  keys = [k for k in rows[0] if k not in _NOT_METRICS]
  by_ratio = {}
  for r in rows:
    by_ratio.setdefault(r["ratio"], []).append(r)
  lines = ["| C | " + " | ".join(keys) + " | seeds | examples | wall minutes |",
           "|" + "---|" * (len(keys) + 4)]
  for ratio, group in by_ratio.items():
    seeds = ", ".join(str(r.get("seed", 0)) for r in group)
    lines.append(f"| {ratio} | " + " | ".join(benchmarking.mean_se_text([r[k] for r in group]) for k in keys) +
                 f" | {seeds} | {group[0]['num_examples']} | "
                 f"{sum(r['minutes'] for r in group):.1f} |")
  if len(rows) > len(by_ratio):
    lines += ["", "| C | seed | " + " | ".join(keys) + " | wall minutes |",
              "|" + "---|" * (len(keys) + 3)]
    lines += [f"| {r['ratio']} | {r['seed']} | " + " | ".join(f"{r[k]:.2f}" for k in keys) +
              f" | {r['minutes']:.1f} |" for r in rows]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--task", default="decal_builtin_qa")
  parser.add_argument("--split", default="validation")
  parser.add_argument("--ratios", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--pretrain-steps", type=int, default=400)
  parser.add_argument("--finetune-steps", type=int, default=200)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                      help="gin SEED of each run; every ratio runs once per seed")
  parser.add_argument("--inputs", type=int, default=256)
  parser.add_argument("--targets", type=int, default=16)
  parser.add_argument("--work", default=None, help="runs folder (default runs/downstream/<task>)")
  parser.add_argument("--out", default=None, help="write the Markdown table here")
  a = parser.parse_args(argv)
  if any(r < 1 for r in a.ratios):
    parser.error("ratios must be integers >= 1")
  if len(set(a.seeds)) != len(a.seeds):
    parser.error(f"--seeds repeats a seed ({a.seeds}); give each seed once")
  work = pathlib.Path(a.work or pathlib.Path("runs", "downstream", a.task)).absolute()
  work.mkdir(parents=True, exist_ok=True)
  rows = [one_ratio(r, s, a, work) for s in a.seeds for r in a.ratios]
  rows.sort(key=lambda r: r["ratio"])  # stable: each ratio's seeds stay in --seeds order
  command = benchmarking.command("tools.downstream_table", argv)
  text = "\n".join(benchmarking.header(
      f"{a.task} ({a.split}) by compression ratio", command,
      f"model: tiny T5.1.1 (models/decal_tiny.gin with COMPRESSION_RATIO=C), "
      f"{a.pretrain_steps} span-corruption steps on the built-in corpus, then "
      f"{a.finetune_steps} fine-tuning steps (runs/finetune_builtin.gin); inputs {a.inputs} / "
      f"targets {a.targets} tokens; greedy decoding",
      f"seeds (gin SEED) {', '.join(map(str, a.seeds))}; mean ± s.e. over seeds (s.e. = sample "
      f"standard deviation / sqrt(seeds))" if len(a.seeds) > 1 else "")) + \
      f"\n\n{table(rows, a.task)}\n"
  print("\n" + text)
  if a.out:
    results_files.write_text(a.out, text)


if __name__ == "__main__":
  main()
