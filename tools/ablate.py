"""Trains every variant of gin/experiments/variants/ under one budget
(gin/experiments/budgets/<budget>.gin), evaluates each on the same held-out data and writes
a Markdown table (printed, and saved to --out) plus a plot of the fine-tune metric against the
compression ratio (--out with .png).

  python -m tools.ablate --budget smoke                  # every variant the budget lists
  python -m tools.ablate --budget smoke --variants baseline decal_2x ccproxy_2x
  python -m tools.ablate --budget smoke --seeds 0 1 2   # mean ± s.e. over seeds
  python -m tools.ablate --list                          # known budgets and variants

Runs live under --work (default runs/ablate/<budget>); the table is rewritten after every
variant, and rerunning the command skips finished variants (WORK/<variant>/result.json) and
resumes unfinished ones from their checkpoints (SIGTERM saves one and stops). --seeds runs
the whole budget once per seed (in WORK/seed<s>; the budget's own seed is replaced) and the
table shows mean ± standard error over the seeds. A --work
folder made under a different budget is refused (its results would not be comparable). A new variant is a new gin
file under gin/experiments/variants/, not new code (see tools/ablation.py).
"""
import argparse
import dataclasses
import importlib.util
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from decal_jax import fileio
from tools import ablation, benchmarking



def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--budget", default="smoke")
  p.add_argument("--variants", nargs="+", help="default: the budget's list")
  p.add_argument("--work", type=pathlib.Path, help="default: runs/ablate/<budget>")
  p.add_argument("--out", type=pathlib.Path,
                 help="Markdown table path (default docs/results/ablation_<budget>.md); the "
                      "plot goes next to it as .png")
  p.add_argument("--record", type=pathlib.Path,
                 help="a JSON file keeping the finished variants' results (no checkpoints): "
                      "restored into --work first, updated after every variant, so a run on "
                      "another machine continues where this one stopped")
  p.add_argument("--seeds", type=int, nargs="+",
                 help="run the budget once per seed (WORK/seed<s>; --record gets _seed<s> "
                      "before its suffix); the table shows mean ± s.e. (default: the budget's "
                      "seed, WORK itself)")
  p.add_argument("--list", action="store_true", help="list budgets and variants, then exit")
  p.add_argument("--no-plot", action="store_true", help="write the table only (no matplotlib)")
  a = p.parse_args(argv)
  if a.list:
    print("budgets: " + ", ".join(ablation.known("budgets")))
    print("variants: " + ", ".join(ablation.known("variants")))
    return
  if not a.no_plot and importlib.util.find_spec("matplotlib") is None:
    sys.exit('error: the plot needs matplotlib: pip install -e ".[plot]" (or pass --no-plot). '
             "Checked before training so no run is lost.")
  try:
    budget = ablation.load_budget(a.budget)
    variants = ablation.load_variants(a.variants or budget.variants)
    ablation.check(budget, variants)
    runs = [seed_run(a, budget, s, variants) for s in (a.seeds or [budget.seed])]
  except ValueError as e:
    sys.exit(f"error: {e}")
  out = a.out or pathlib.Path("docs", "results", f"ablation_{budget.name}.md")
  start = time.time()
  results = []
  for seed_budget, work, record in runs:
    for i, v in enumerate(variants, 1):
      print(f"\n=== seed {seed_budget.seed} [{i}/{len(variants)}] {v.label} ({v.name}) ===",
            flush=True)
      result = ablation.run_variant(seed_budget, v, work)
      if result is None:
        print("\nstopped (preempted); the same command continues where this one stopped.")
        return
      results.append(result)
      write_results(a, budget, results, len(variants) * len(runs), out)  # a stop keeps them
      if record:
        ablation.save_record(record, work)
  print(f"({(time.time() - start) / 60:.1f} min this invocation)")


def seed_run(a, budget, seed: int, variants):
  """(the budget with this seed, its WORK folder, its --record file or None), with the
  record restored into WORK and WORK claimed for the budget."""
  budget = dataclasses.replace(budget, seed=seed)
  work = a.work or pathlib.Path("runs", "ablate", budget.name)
  record = a.record
  if a.seeds:
    work = work / f"seed{seed}"
    record = record and record.with_name(f"{record.stem}_seed{seed}{record.suffix}")
  if record:
    print(f"restored from {record}: {ablation.restore_record(record, work, variants)}")
  ablation.claim(work, budget)
  return budget, work, record


def write_results(a, budget, results, planned: int, out: pathlib.Path) -> None:
  """The table (printed) and the Markdown report, with the plot next to it (.png)."""
  table = ablation.table(budget, results)
  print("\n" + table)
  out.parent.mkdir(parents=True, exist_ok=True)
  png = None if a.no_plot else out.with_suffix(".png")
  if png:
    ablation.plot(budget, results, png)
  total = sum(sum(r["seconds"].values()) for r in results) / 60  # every seed's
  text = report(a, budget, table, total, png.name if png else None)
  if len(results) < planned:
    text += (f"\n{len(results)} of {planned} variants done so far: the same command "
             "continues with the rest.\n")
  fileio.write_text_atomic(out, text)
  print(f"wrote {out}" + (f" and {png}" if png else ""))


def report(a, budget, table: str, total_minutes: float, png: str) -> str:
  cmd = "-m tools.ablate --budget " + budget.name + (
      " --variants " + " ".join(a.variants) if a.variants else "") + (
      " --seeds " + " ".join(map(str, a.seeds)) if a.seeds else "")
  seeds = (f"seeds {', '.join(map(str, a.seeds))} (each cell: mean ± standard error over "
           "the seeds; wall: the mean per seed)" if a.seeds else f"seed {budget.seed}")
  lines = benchmarking.header(
      f"Ablations, budget '{budget.name}'", cmd,
      f"the variants' stages took {total_minutes:.1f} min in all (the \"wall\" column; process "
      "start-up not included; variants finished by an earlier invocation keep their wall time)",
      f"budget (gin/experiments/budgets/{budget.name}.gin): model `{budget.model_gin}`, "
      f"pretraining {budget.pretrain_steps} steps ({budget.span_corruption_task} "
      f"{dict(budget.pretrain_lengths)} or {budget.autoencode_task} "
      f"{dict(budget.autoencode_lengths)}), fine-tuning {budget.finetune_steps} steps on "
      f"{budget.finetune_task} {dict(budget.finetune_lengths)}, batch {budget.batch_size}, "
      + seeds,
      "EM / F1: the validation split, greedy decoding; pretrain acc: held-out target-token "
      "accuracy of the variant's own pretraining task; FLOPs: per example at the fine-tuning "
      "lengths, relative to the baseline (decal_jax/networks/flops.py); CCProxy continues from the "
      "baseline's pretrained checkpoint (twice the pretraining steps)")
  lines += ["", table]
  if png:
    lines += ["", f"![metric against compression ratio]({png})"]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
