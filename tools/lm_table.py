"""Compressed-history language modelling at a fixed state budget (the Dodo paper's Table 1,
at CPU scale): the same tiny decoder trained on the built-in corpus as

  window-32   only the last <= 32 tokens (FULL with its context cut to 32 states)
  window-64   only the last <= 64 tokens (FULL with 64 states)
  compressive the last <= 32 tokens + mean-pooled 10-token segments before them
  dodo        the last <= 32 tokens + nuggets (1 in 10 tokens, by score) before them
              (the scorer's updates at 1/100 of the LM's: runs/lm_builtin.gin)
  dodo-random-scorer  the same with the scorer frozen at initialisation (a diagnostic)
  dodo-scorer-lr-x1   the same with one AdamW for everything (a diagnostic)
  full        all previous tokens (no limit: the upper bound)

and reports validation perplexity per subword, mean +- standard error over seeds:

  python -m tools.lm_table --seeds 0 1 2 --out docs/results/dodo_lm_builtin.md

Options: --steps (300), --batch (8), --length (256 tokens per sequence), --seeds (0; gin SEED:
the parameters and the order of the training data), --work (runs/lm_table: one model dir per
variant and seed; finished runs are reused, so an interrupted table resumes), --variants.
"""
import argparse
import json
import pathlib
import sys
import time

from decal_jax import fileio

RATIO, WINDOW, CHUNK = 10, 32, 16
VARIANTS = {
    "window-32": ["SELECTION = 'window'", f"WINDOW = {WINDOW}"],
    "window-64": ["SELECTION = 'window'", f"WINDOW = {2 * WINDOW}"],
    "compressive": ["SELECTION = 'compressive'", f"WINDOW = {WINDOW}"],
    "dodo": ["SELECTION = 'nuggets'", f"WINDOW = {WINDOW}"],  # scorer lr x 0.01 (the run file)
    # diagnostics: the scorer frozen at initialisation; the scorer at the LM's learning rate
    "dodo-random-scorer": ["SELECTION = 'nuggets'", f"WINDOW = {WINDOW}",
                           "from __gin__ import dynamic_registration",
                           "from decal_jax.runtime import optimizers",
                           "from decal_jax.runtime import trainer",
                           "trainer.train.optimizer = @optimizers.partially_frozen()",
                           "optimizers.partially_frozen.optimizer = @optimizers.adamw()",
                           "optimizers.partially_frozen.trainable = ('stack',)"],
    "dodo-scorer-lr-x1": ["SELECTION = 'nuggets'", f"WINDOW = {WINDOW}",
                          "from __gin__ import dynamic_registration",
                          "from decal_jax.runtime import optimizers",
                          "from decal_jax.runtime import trainer",
                          "trainer.train.optimizer = @optimizers.adamw()"],
    "full": None,  # the plain decoder
}


def states_read(name: str, length: int) -> str:
  """How many states the last token of a sequence attends to (per layer)."""
  if name == "full":
    return str(length)
  if name.startswith("window-"):
    return name.split("-")[1]
  distant = length - WINDOW  # tokens before the last token's split point
  return f"{WINDOW} + ~{distant // RATIO}"


def gin_setup(name: str, seed: int, args, model_dir: pathlib.Path):
  files = ["models/decoder_tiny.gin"] + ([] if VARIANTS[name] is None else
                                         ["models/dodo_lm.gin"]) + ["runs/lm_builtin.gin"]
  bindings = [f"MODEL_DIR = '{model_dir}'", f"TRAIN_STEPS = {args.steps}",
              f"BATCH_SIZE = {args.batch}", f"TASK_FEATURE_LENGTHS = {{'targets': {args.length}}}",
              f"EVAL_PERIOD = {args.steps}", f"CHECKPOINT_PERIOD = {args.steps}",
              f"SEED = {seed}"]
  if VARIANTS[name] is not None:
    bindings += VARIANTS[name] + [f"CHUNK = {CHUNK}", f"COMPRESSION_RATIO = {RATIO}"]
  return files, bindings


def run(name: str, seed: int, args, work: pathlib.Path) -> dict:
  import gin
  from decal_jax.runtime import gin_utils, trainer
  import decal_jax.tasks  # noqa: F401  (registers decal_builtin_lm)
  run_dir = work / f"{name}_s{seed}"
  done = run_dir / "result.json"
  if done.exists():
    print(f"{name} seed {seed}: finished before ({done}); reusing it.")
    return json.loads(done.read_text())
  files, bindings = gin_setup(name, seed, args, run_dir / "model")
  print(f"{name} seed {seed}: python -m decal_jax.train " + " ".join(f"--gin_file={f}" for f in files) +
        " " + " ".join(f'--gin_bindings="{b}"' for b in bindings), flush=True)
  gin_utils.parse(files, [], bindings)
  start = time.time()
  metrics = gin.get_configurable(trainer.train)(gin_config_text=gin.config_str(),
                                                show_example=False)
  seconds = round(time.time() - start, 1)
  note = ""
  if name.startswith("dodo"):  # evaluate with the inference rule: a fixed, calibrated threshold
    metrics, note = _calibrated_eval(files, bindings, run_dir / "model")
  result = {"name": name, "seed": seed, "perplexity": float(metrics["perplexity"]),
            "accuracy": float(metrics["accuracy"]), "loss": float(metrics["loss"]),
            "seconds": seconds, "states": states_read(name, args.length), "note": note}
  done.parent.mkdir(parents=True, exist_ok=True)
  fileio.write_text_atomic(done, json.dumps(result, indent=1))
  return result


def _calibrated_eval(files, bindings, model_dir):
  import gin
  from decal_jax.runtime import calibration, evaluation, gin_utils
  model, params, _, _ = gin_utils.load_model(files, str(model_dir), bindings=bindings)
  train_cfg = gin.get_configurable("train/pipeline.DatasetConfig")()
  eval_cfg = gin.get_configurable("validation/pipeline.DatasetConfig")()
  found = calibration.calibrate(model, params, train_cfg, eval_cfg)
  calibration.write_binding(str(model_dir), found["threshold"])
  calibrated = list(bindings) + [f"NUGGET_THRESHOLD = {found['threshold']!r}"]
  model = gin_utils.load_model(files, bindings=calibrated).model
  metrics = gin.get_configurable(evaluation.evaluate)(model=model, model_dir=str(model_dir))
  note = (f"Λ = {found['threshold']:.4g} calibrated on training text: "
          f"{100 * found['validation_fraction']:.1f} % of validation tokens are nuggets "
          f"(target {100 * found['target_fraction']:.0f} %)")
  return metrics, note


def header(args, argv) -> str:
  from tools import benchmarking
  seeds = ", ".join(map(str, args.seeds))
  return "\n".join(benchmarking.header(
      "Compressed-history language modelling at a fixed state budget (built-in corpus)",
      benchmarking.command("tools.lm_table", argv),
      f"model: models/decoder_tiny.gin (4 layers, emb 128, GQA 4/2 heads), trained from "
      f"scratch for {args.steps} steps of batch {args.batch} x {args.length} tokens "
      f"(runs/lm_builtin.gin: AdamW, cosine 3e-3); Dodo / compressive: r = {RATIO}, "
      f"τ = {WINDOW}, c = {CHUNK}, scorer on layer ι = 3; perplexity per subword on the "
      "validation split (teacher-forced)",
      f"seeds (gin SEED: parameters and data order) {seeds}; mean ± s.e. over seeds (s.e. = "
      "sample standard deviation / sqrt(seeds))") + [""])


def table(results) -> str:
  """One line per variant: perplexity and accuracy as mean +- s.e. over its seeds (one seed:
  its value), each seed's perplexity, and the mean train wall; then each run's note."""
  from tools import benchmarking
  lines = ["| model | states read by the last token | validation perplexity | per seed "
           "| token accuracy | train wall per run (s) |", "|---|---|---|---|---|---|"]
  names = list(dict.fromkeys(r["name"] for r in results))
  for name in names:
    rows = [r for r in results if r["name"] == name]
    lines.append(
        f"| {name} | {rows[0]['states']} | "
        f"{benchmarking.mean_se_text([r['perplexity'] for r in rows])} | "
        + ", ".join(f"{r['perplexity']:.2f}" for r in rows) + " | "
        f"{benchmarking.mean_se_text([100 * r['accuracy'] for r in rows], 1)} % | "
        f"{sum(r['seconds'] for r in rows) / len(rows):.0f} |")
  notes = [f"- {r['name']} (seed {r.get('seed', 0)}): {r['note']}"
           for r in results if r.get("note")]
  return "\n".join(lines + [""] + notes)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                      help="gin SEED of each run; every variant runs once per seed")
  parser.add_argument("--work", default="runs/lm_table")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--out", default=None, help="markdown file for the table")
  args = parser.parse_args(argv)
  names = [n.strip() for n in args.variants.split(",") if n.strip()]
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    sys.exit(f"Unknown variants {unknown}; choose from {list(VARIANTS)}.")
  if len(set(args.seeds)) != len(args.seeds):
    parser.error(f"--seeds repeats a seed ({args.seeds}); give each seed once")
  if args.length <= 2 * WINDOW:
    sys.exit(f"--length must exceed {2 * WINDOW} tokens, or nothing is ever compressed.")
  work = pathlib.Path(args.work).resolve()
  work = work / f"steps{args.steps}_batch{args.batch}_len{args.length}"
  results = [run(name, seed, args, work) for seed in args.seeds for name in names]
  text = header(args, argv) + "\n" + table(results)
  print(text)
  if args.out:
    out = pathlib.Path(args.out).resolve()
    fileio.write_text_atomic(out, text + "\n")
    print(f"table written to {out}")


if __name__ == "__main__":
  main()
