"""What `tools/retrieval_table.py` reports from its finished rows: the table of
each row's NDCG@10, Recall@100 and held-out accuracy with mean +- s.e. over its runs (a run:
one fine-tune seed from one pretrained checkpoint), differences paired with the base row
(multi-vector C = 1) within each run, the per-run table, and what the +- means. A row is
the JSON the tool keeps per (row, run); this module reads rows only.
"""
import math
import pathlib

from tools import benchmarking


def run_of(row):
  """The run a row belongs to: its checkpoint folder name (absent in rows written before
  several --init existed) and fine-tune seed. Rows of one run are paired."""
  return row.get("init"), row["seed"]


def run_name(row, several_inits: bool) -> str:
  return f"{row['init']} s{row['seed']}" if several_inits else str(row["seed"])


def several_inits(rows) -> bool:
  return len({r.get("init") for r in rows}) > 1


def grouped(rows, key) -> dict:
  """{key(row): the rows with it, in table order} (key `run_of`, or the label)."""
  groups = {}
  for r in rows:
    groups.setdefault(key(r), []).append(r)
  return groups


def by_label(row) -> str:
  return row["label"]


def base_row(rows):
  return next((r for r in rows if r["ratio"] == 1 and r["pooling"] == "multi"), rows[0])


def signed(mean: float, se: float) -> str:
  """'+0.0123 ± 0.0045' (a nan s.e., from a single value: the mean alone)."""
  return f"{mean:+.4f}" if math.isnan(se) else f"{mean:+.4f} ± {se:.4f}"


def seed_differences(rows) -> dict:
  """{label: [its NDCG@10 minus the base row's of the same run, per run]}."""
  base_of = {run: base_row(group)["ndcg@10"] for run, group in grouped(rows, run_of).items()}
  return {label: [r["ndcg@10"] - base_of[run_of(r)] for r in runs]
          for label, runs in grouped(rows, by_label).items()}


def quality_cells(runs, differences, over_seeds: bool):
  """NDCG@10, its difference to the base row and Recall@100 of one row: over the seeds
  (mean ± s.e. of the runs' values and of their per-seed `differences`) or, for a single
  run, over its queries."""
  if over_seeds:
    return (benchmarking.mean_se_text([r["ndcg@10"] for r in runs], 4),
            signed(*benchmarking.mean_stderr(differences)),
            benchmarking.mean_se_text([r["recall@100"] for r in runs], 4))
  (r,) = runs
  return (f"{r['ndcg@10']:.4f} ± {r['ndcg_stderr']:.4f}",
          signed(*r["ndcg_vs_base"]) if "ndcg_vs_base" in r else "-", f"{r['recall@100']:.4f}")


def mean_of(runs, key: str) -> float:
  return sum(r[key] for r in runs) / len(runs)


def table(rows) -> str:
  """One line per row. With one seed: NDCG@10 ± its s.e. over the queries and the paired
  difference to the base row over the queries; with several: the mean ± s.e. over the
  seeds of NDCG@10, of its per-seed difference to the base row and of Recall@100, then
  one line per row and seed (`seed_table`)."""
  groups, base = grouped(rows, by_label), base_row(rows)
  over_seeds, several = len(groups) < len(rows), several_inits(rows)
  differences = seed_differences(rows)
  seeds_head = ((" runs (checkpoint, seed) |" if several else " seeds |", "---|") if over_seeds
                else ("", ""))
  lines = [f"| passages | NDCG@10 ± s.e. | NDCG@10 - {base['label']}, paired ± s.e. | "
           "Recall@100 | held-out in-batch acc. | vectors / passage | index MiB | index / "
           f"{base['label']} | fine-tune min | index + search min |" + seeds_head[0],
           "|---|---|---|---|---|---|---|---|---|---|" + seeds_head[1]]
  for label, runs in groups.items():
    ndcg, diff, recall = quality_cells(runs, differences[label], over_seeds)
    accuracies = [r["heldout_accuracy"] for r in runs if r.get("heldout_accuracy") is not None]
    acc = benchmarking.mean_se_text(accuracies, 3) if accuracies else "-"
    seeds = f" {', '.join(run_name(r, several) for r in runs)} |" if over_seeds else ""
    lines.append(f"| {label} | {ndcg} | {'-' if label == base['label'] else diff} | {recall} | "
                 f"{acc} | {mean_of(runs, 'vectors_per_doc'):.2f} | "
                 f"{mean_of(runs, 'index_bytes') / 2**20:.2f} | "
                 f"{mean_of(runs, 'index_bytes') / base['index_bytes']:.3f} | "
                 f"{mean_of(runs, 'train_minutes'):.1f} | {mean_of(runs, 'eval_minutes'):.1f} |"
                 + seeds)
  return "\n".join(lines + (["", seed_table(rows)] if over_seeds else []))


def seed_table(rows) -> str:
  """One line per row and run: NDCG@10 +- s.e. over the queries, the paired difference
  to the same run's base row over the queries, Recall@100 and held-out accuracy."""
  base, several = base_row(rows)["label"], several_inits(rows)
  lines = [f"| passages | {'run' if several else 'seed'} | NDCG@10 ± s.e. (queries) | "
           f"NDCG@10 - {base}, paired ± s.e. (queries) | Recall@100 | held-out in-batch acc. |",
           "|---|---|---|---|---|---|"]
  for runs in grouped(rows, by_label).values():
    for r in runs:
      acc = "-" if r.get("heldout_accuracy") is None else f"{r['heldout_accuracy']:.3f}"
      diff = "-" if r["label"] == base or "ndcg_vs_base" not in r else signed(*r["ndcg_vs_base"])
      lines.append(f"| {r['label']} | {run_name(r, several)} | {r['ndcg@10']:.4f} ± "
                   f"{r['ndcg_stderr']:.4f} | {diff} | {r['recall@100']:.4f} | {acc} |")
  return "\n".join(lines)


def spread_note(seeds, inits=("",)) -> str:
  """What the table's ± means, for one run or several (seeds x checkpoints)."""
  if len(inits) > 1:
    names = ", ".join(pathlib.Path(i).name for i in inits)
    return (f"every row fine-tuned once from each of {len(inits)} pretrained checkpoints "
            f"({names}) with each seed (gin SEED {', '.join(map(str, seeds))}): "
            f"{len(inits) * len(seeds)} runs; ± = standard error of the mean over the runs "
            "(sample standard deviation / sqrt(runs)), so it includes the pretraining "
            "run's spread; paired = per run, a row's NDCG@10 minus the base row's of the "
            "same run, then mean ± s.e. over the runs; minutes are means per run; the "
            "second table has each run's row, its ± over the queries")
  if len(seeds) == 1:
    return ("s.e. = standard error of the mean NDCG@10 over the queries; paired = mean over "
            "queries of a row's NDCG@10 minus the base row's on the same query; one "
            f"fine-tune per row (gin SEED {seeds[0]}): the spread across seeds is in neither")
  return (f"every row fine-tuned once per seed (gin SEED {', '.join(map(str, seeds))}); "
          "± = standard error of the mean over the seeds (sample standard deviation / "
          "sqrt(seeds)); paired = per seed, a row's NDCG@10 minus the base row's of the same "
          "seed, then mean ± s.e. of those differences over the seeds; fine-tune and index + "
          "search minutes are means per seed; the second table has each seed's row, its ± "
          "over the queries")
