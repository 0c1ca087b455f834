"""Task x compression-ratio results table: for each ratio C, pretrain a tiny model on the
built-in corpus (span corruption), fine-tune it on the task, and evaluate it with
`python -m decal_jax.eval` (which writes seqio's MODEL_DIR/inference_eval/<task>-metrics.jsonl
and <task>-<step:06>.jsonl); the table is built from those files. Every run uses the same budget, seed and data.

  python -m decal_jax.tools.downstream_table --ratios 1 2 4 --pretrain-steps 400 --finetune-steps 200 \
      --out docs/results/downstream_builtin_qa.md

Runs live under --work (default runs/downstream/<task>); rerunning the command resumes
unfinished runs and re-evaluates finished ones, so the table can always be regenerated.
Other tasks: --task decal_squad etc. with their data available (DECAL_LOCAL_DATA_DIR).
"""
import argparse
import pathlib

from decal_jax import benchmarking, inference_eval
from decal_jax.benchmarking import run_entry_point as run  # python -m decal_jax.<module>



def one_ratio(ratio: int, a, work: pathlib.Path) -> dict:
  lengths = f"--gin.TASK_FEATURE_LENGTHS={{'inputs': {a.inputs}, 'targets': {a.targets}}}"
  common = [f"--gin.COMPRESSION_RATIO={ratio}"]
  pre, ft = work / f"pretrain_c{ratio}", work / f"finetune_c{ratio}"
  log = work / f"c{ratio}.log"
  print(f"C={ratio}: pretraining {a.pretrain_steps} steps ...", flush=True)
  t_pre = run("train", ["--gin_file=runs/pretrain_builtin.gin", f"--gin.MODEL_DIR='{pre}'",
                        f"--gin.TRAIN_STEPS={a.pretrain_steps}", *common], log)
  print(f"C={ratio}: fine-tuning on {a.task} {a.finetune_steps} steps ...", flush=True)
  t_ft = run("train", ["--gin_file=runs/finetune_builtin.gin", f"--gin.MODEL_DIR='{ft}'",
                       f"--gin.INITIAL_CHECKPOINT_PATH='{pre}'", f"--gin.TRAIN_STEPS={a.finetune_steps}",
                       f"--gin.MIXTURE_OR_TASK_NAME='{a.task}'", lengths, *common], log)
  print(f"C={ratio}: evaluating ...", flush=True)
  t_eval = run("eval", ["--gin_file=models/decal_tiny.gin", "--gin_file=runs/eval.gin",
                        f"--gin.MODEL_DIR='{ft}'", f"--gin.MIXTURE_OR_TASK_NAME='{a.task}'",
                        f"--gin.EVAL_SPLIT='{a.split}'", lengths, *common], log)
  metrics = inference_eval.read_metrics(str(ft), a.task, a.finetune_steps)
  examples = len(inference_eval.read_inferences(str(ft), a.task, a.finetune_steps))
  return dict(metrics, num_examples=examples, ratio=ratio, minutes=(t_pre + t_ft + t_eval) / 60)


def table(rows, task: str) -> str:
  keys = [k for k in rows[0] if k not in ("ratio", "minutes", "step", "compression_ratio",
                                          "num_examples")]
  head = "| C | " + " | ".join(keys) + " | examples | wall minutes |"
  lines = [head, "|" + "---|" * (len(keys) + 3)]
  for r in rows:
    lines.append(f"| {r['ratio']} | " + " | ".join(f"{r[k]:.2f}" for k in keys) +
                 f" | {r['num_examples']} | {r['minutes']:.1f} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--task", default="decal_builtin_qa")
  parser.add_argument("--split", default="validation")
  parser.add_argument("--ratios", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--pretrain-steps", type=int, default=400)
  parser.add_argument("--finetune-steps", type=int, default=200)
  parser.add_argument("--inputs", type=int, default=256)
  parser.add_argument("--targets", type=int, default=16)
  parser.add_argument("--work", default=None, help="runs folder (default runs/downstream/<task>)")
  parser.add_argument("--out", default=None, help="write the Markdown table here")
  a = parser.parse_args(argv)
  if any(r < 1 for r in a.ratios):
    parser.error("ratios must be integers >= 1")
  work = pathlib.Path(a.work or pathlib.Path("runs", "downstream", a.task)).absolute()
  work.mkdir(parents=True, exist_ok=True)
  rows = [one_ratio(r, a, work) for r in a.ratios]
  command = benchmarking.command("decal_jax.tools.downstream_table", argv)
  text = "\n".join(benchmarking.header(
      f"{a.task} ({a.split}) by compression ratio", command,
      f"model: tiny T5.1.1 (models/decal_tiny.gin with COMPRESSION_RATIO=C), "
      f"{a.pretrain_steps} span-corruption steps on the built-in corpus, then "
      f"{a.finetune_steps} fine-tuning steps (runs/finetune_builtin.gin); inputs {a.inputs} / "
      f"targets {a.targets} tokens; greedy decoding")) + f"\n\n{table(rows, a.task)}\n"
  print("\n" + text)
  if a.out:
    benchmarking.write_text(a.out, text)


if __name__ == "__main__":
  main()
