"""Retrieval quality against the compression ratio C: for each C, fine-tune a pretrained
DeCAL checkpoint as a multi-vector dual encoder (runs/retrieval_finetune.gin; queries and
passages both read at C, the paper's protocol), then index the corpus and score the split's
queries with `python -m decal_jax.retrieve` (NDCG@10, Recall@100, index size).
`--asymmetric` adds, for each C > 1, the row with passages at C and queries at C = 1. `--mean_pooling_ratio C`
adds the single-vector reference: the same encoder at C, its vectors averaged into one
(cosine similarity, temperature 0.05). Every row uses the same data, steps and batch.
With --seeds, every row is fine-tuned once per seed (gin SEED: the order of the training
pairs and dropout; the weights all come from --init), and the table gives each row's mean
+- s.e. over the seeds and its paired-by-seed difference to C = 1; one seed gives the
standard error over the queries instead. Several --init checkpoints (the main job run with
--gin.SEED=0, 1, 2) make every (checkpoint, seed) pair a run of each row: the spread then
includes the pretraining run's, which on SciFact is larger than the fine-tune seed's.
An --init holding `{C}` is a checkpoint per ratio (the paper pretrains at each C):
`runs/pre_c{C}_s0` fine-tunes the C = 4 row from runs/pre_c4_s0 and the C = 1 row from
runs/pre_c1_s0; a row whose checkpoint is absent is skipped and named in the results file.

Runs live under --work (default runs/retrieval_table/<task>), one folder per row and seed
(<pooling>_c<C>_s<seed>; with several --init, under <work>/<checkpoint folder name>/); a
finished one is kept as <work>/<pooling>_c<C>_s<seed>.row.json,
so rerunning the command skips finished rows and resumes unfinished fine-tunes from their
last checkpoint (an interrupted run loses at most one row's work). Seeds run one after
the other (all rows of the first seed, then the next), and a rerun with more seeds reuses
the finished ones: `--seeds 0 1` after `--seeds 0 1 2` was cut off in seed 2 writes the
table of seeds 0 and 1 without training. The settings of the first run (all but the
ratios and seeds) are kept in <work>/settings.json: a rerun with other settings is refused
(choose another --work). Progress is printed per row; each row's full output goes to
<work>/<pooling>_c<C>_s<seed>.log.

A BEIR folder outside the built-in one becomes a task through DECAL_LOCAL_DATA_DIR
(`<dir>/beir/<name>/` -> `decal_beir_<name>`), e.g. SciFact (train / test qrels; with no
validation qrels the fine-tune's held-out in-batch loss is read on --eval_split):

  DECAL_LOCAL_DATA_DIR=../shared/data python -m tools.retrieval_table \
    --init runs/decal_tiny --task decal_beir_scifact --ratios 1 4 8 --mean_pooling_ratio 1 \
    --steps 150 --learning_rate 0.01 --query_length 32 --passage_length 256 --seeds 0 1 2 \
    --out docs/results/retrieval_scifact.md
  DECAL_LOCAL_DATA_DIR=../shared/data python -m tools.retrieval_table --seeds 0 \
    --init runs/decal_tiny runs/decal_tiny_s1 runs/decal_tiny_s2 \
    --task decal_beir_scifact --ratios 1 4 8 --mean_pooling_ratio 1 --steps 150 \
    --learning_rate 0.01 --query_length 32 --passage_length 256 \
    --work runs/retrieval_table/scifact_pretraining \
    --out docs/results/retrieval_scifact_pretraining.md

The results file gets the table, BM25 and random-ranking references, paired differences to
C = 1 and, with several seeds, one line per row and seed (with its per-query standard error
and paired difference); a '## Reading' section written into it by hand is kept when the
command rewrites the file.
"""
import argparse
import json
import os
import pathlib
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF only reads the task data: quiet it

from decal_jax import fileio
from tools import benchmarking
from tools.benchmarking import run_entry_point as run
from tools.retrieval_quality_report import (
    base_row, grouped, run_of, spread_note, table)


MODEL_GINS = ["--gin_file=models/decal_tiny.gin", "--gin_file=models/dual_encoder.gin"]
SETTINGS = ("init", "task", "validation_split", "eval_split", "steps", "batch_size",
            "learning_rate", "query_length", "passage_length")  # what every row shares
HELD_OUT = re.compile(r"Held-out \(validation\) at step (\d+): (.*)")  # trainer._report
READING = "## Reading"


def variants(a):
  """(label, passage ratio, pooling, query ratio or None: the passages') rows of the table."""
  rows = [(f"multi-vector, C = {c}", c, "multi", None) for c in a.ratios]
  if a.asymmetric:
    rows += [(f"multi-vector, C = {c}, queries C = 1", c, "multi", 1) for c in a.ratios if c > 1]
  if a.mean_pooling_ratio:
    rows.append((f"single vector (mean of C = {a.mean_pooling_ratio})",
                 a.mean_pooling_ratio, "mean", None))
  return rows


def init_path(init: str, ratio: int) -> str:
  """The checkpoint folder of the row at `ratio`: `init` with `{C}` filled in."""
  return init.replace("{C}", str(ratio))


def init_name(init: str) -> str:
  """The folder name a run is known by ('pre_c{C}_s0' -> 'pre_cC_s0')."""
  return pathlib.Path(init).name.replace("{C}", "C")


def has_checkpoint(folder: str) -> bool:
  path = pathlib.Path(folder)
  return path.is_dir() and (re.fullmatch(r"checkpoint_\d+", path.name) is not None
                            or any(path.glob("checkpoint_*")))


def resolve_splits(a) -> None:
  """Checks that --task is a registered BEIR task whose folder has --eval_split, and picks
  the fine-tune's held-out split: 'validation' where the folder has one, else --eval_split."""
  from decal_jax.retrieval import beir
  from decal_jax.tasks import retrieval_tasks  # registers the built-in and local tasks
  try:
    folder = retrieval_tasks.beir_folder(a.task)
  except ValueError as e:
    sys.exit(f"--task: {e}\nA folder <dir>/beir/<name>/ becomes decal_beir_<name> with "
             "DECAL_LOCAL_DATA_DIR=<dir>.")
  splits = {"validation" if s == "dev" else s for s in beir.qrels_splits(folder)}
  if a.eval_split not in splits:
    sys.exit(f"--eval_split {a.eval_split}: {folder} has qrels for {sorted(splits)}; choose "
             "one of them.")
  if "train" not in splits:
    sys.exit(f"{folder} has no qrels/train.tsv to fine-tune on (it has {sorted(splits)}).")
  a.folder = folder
  if a.validation_split is None:
    a.validation_split = "validation" if "validation" in splits else a.eval_split
  elif a.validation_split not in splits:
    sys.exit(f"--validation_split {a.validation_split}: {folder} has qrels for "
             f"{sorted(splits)}.")


def held_out(log: pathlib.Path, step: int) -> dict:
  """{accuracy, loss, ...} of the fine-tune's last held-out report at `step` ({} if none)."""
  found = [m for m in HELD_OUT.finditer(log.read_text(errors="replace"))
           if int(m.group(1)) == step]
  if not found:
    return {}
  return {k: float(v) for k, v in re.findall(r"(\w+) (-?[\d.]+)", found[-1].group(2))}


def fine_tune(name: str, model, init: str, seed: int, a, work: pathlib.Path) -> dict:
  """Fine-tunes one row from checkpoint `init` with gin SEED = `seed` (resuming its
  MODEL_DIR); returns {minutes, heldout}, kept in <work>/<name>.train.json so that a rerun
  after a failed search does not train again."""
  done, log = work / f"{name}.train.json", work / f"{name}.log"
  if done.exists():
    return json.loads(done.read_text())
  minutes = run("train", MODEL_GINS + [
      "--gin_file=runs/retrieval_finetune.gin", *model, f"--gin.MODEL_DIR='{work / name}'",
      f"--gin.INITIAL_CHECKPOINT_PATH='{init}'", f"--gin.MIXTURE_OR_TASK_NAME='{a.task}'",
      f"--gin.TRAIN_STEPS={a.steps}", f"--gin.BATCH_SIZE={a.batch_size}",
      f"--gin.LEARNING_RATE={a.learning_rate}", f"--gin.EVAL_SPLIT='{a.validation_split}'",
      f"--gin.EVAL_PERIOD={a.steps}", f"--gin.CHECKPOINT_PERIOD={a.steps}",
      "--gin.EVAL_BATCHES=10", f"--gin.SEED={seed}",
      f"--gin.TASK_FEATURE_LENGTHS={{'inputs': {a.query_length}, "
      f"'targets': {a.passage_length}}}"], log) / 60
  result = {"minutes": minutes, "heldout": held_out(log, a.steps)}
  done.write_text(json.dumps(result, sort_keys=True))
  return result


def row_name(ratio: int, pooling: str, seed: int, query_ratio=None) -> str:
  """The row's folder (MODEL_DIR) and file names under --work (`_q<ratio>` when the
  queries are read at another ratio than the passages)."""
  asymmetric = query_ratio is not None and query_ratio != ratio
  return f"{pooling}_c{ratio}" + (f"_q{query_ratio}" if asymmetric else "") + f"_s{seed}"


def run_folder(a, work: pathlib.Path, init_name: str) -> pathlib.Path:
  """Where the rows fine-tuned from the checkpoint folder named `init_name` live: --work
  itself with one --init, <work>/<init_name> with several."""
  return work if len(a.inits) == 1 else work / init_name


def one_variant(label: str, ratio: int, pooling: str, query_ratio, init: str, seed: int, a,
                work: pathlib.Path) -> dict:
  """Fine-tunes, indexes and scores one row from checkpoint `init` (`{C}` filled in) with
  one seed (or reads it back when it is finished)."""
  name_of_init, init = init_name(init), init_path(init, ratio)
  work = run_folder(a, work, name_of_init)
  work.mkdir(parents=True, exist_ok=True)
  name = row_name(ratio, pooling, seed, query_ratio)
  label_seed = f"{label}, seed {seed}" + (f", from {name_of_init}" if len(a.inits) > 1 else "")
  log, done = work / f"{name}.log", work / f"{name}.row.json"
  if done.exists():
    print(f"{label_seed}: finished earlier ({done})", flush=True)
    return dict(json.loads(done.read_text()), init=name_of_init)
  model = [f"--gin.PASSAGE_COMPRESSION_RATIO={ratio}", f"--gin.POOLING='{pooling}'"]
  if query_ratio is not None:
    model.append(f"--gin.QUERY_COMPRESSION_RATIO={query_ratio}")
  if pooling == "mean":
    model.append("--gin.LOGIT_SCALE=20.0")  # 1 / 0.05: the single-vector reference's scale
  print(f"{label_seed}: fine-tuning {a.steps} steps on {a.task} (log: {log}) ...", flush=True)
  trained = fine_tune(name, model, init, seed, a, work)
  print(f"{label_seed}: fine-tuned in {trained['minutes']:.1f} min (held-out in-batch accuracy "
        f"{trained['heldout'].get('accuracy')}); indexing the corpus and searching "
        f"{a.eval_split} ...", flush=True)
  t_eval = run("retrieve", MODEL_GINS + ["--gin_file=runs/retrieve.gin", *model,
               f"--gin.MODEL_DIR='{work / name}'", f"--gin.BEIR_TASK='{a.task}'",
               f"--gin.SPLIT='{a.eval_split}'", f"--gin.QUERY_LENGTH={a.query_length}",
               f"--gin.PASSAGE_LENGTH={a.passage_length}"], log)
  metrics = work / name / "retrieval" / f"{a.task}.{a.eval_split}.step{a.steps}.metrics.json"
  if not metrics.exists():
    sys.exit(f"retrieve wrote no {metrics}; see {log}")
  run_file = metrics.with_name(metrics.name.replace(".metrics.json", ".trec"))
  row = dict(json.loads(metrics.read_text()), label=label, ratio=ratio, pooling=pooling,
             query_ratio=ratio if query_ratio is None else query_ratio, seed=seed,
             init=name_of_init, init_path=init, ndcg_stderr=ndcg_stderr(run_file, a),
             train_minutes=trained["minutes"],
             eval_minutes=t_eval / 60,
             heldout_accuracy=trained["heldout"].get("accuracy"),
             heldout_loss=trained["heldout"].get("loss"),
             heldout_queries=trained["heldout"].get("num_queries"))
  print(f"{label_seed}: NDCG@10 {row['ndcg@10']:.4f}, Recall@100 {row['recall@100']:.4f} "
        f"({t_eval / 60:.1f} min)", flush=True)
  done.write_text(json.dumps(row, sort_keys=True))
  return row


def per_query_ndcg(run_file: pathlib.Path, a):
  """{qid: NDCG@10} of a TREC run over the scored split's queries with a relevant doc."""
  from decal_jax.retrieval import beir, ir_metrics
  qrels = beir.load_beir(a.folder, a.eval_split).qrels
  return ir_metrics.ndcg_at_k(ir_metrics.read_trec_run(str(run_file)), qrels, 10)[1]


def ndcg_stderr(run_file: pathlib.Path, a) -> float:
  """Standard error of the mean NDCG@10 over the split's queries (their spread / sqrt n)."""
  return benchmarking.mean_stderr(per_query_ndcg(run_file, a).values())[1]


def run_file_of(row, a, work: pathlib.Path) -> pathlib.Path:
  name = row_name(row["ratio"], row["pooling"], row["seed"], row.get("query_ratio"))
  return (run_folder(a, work, row.get("init")) / name / "retrieval" /
          f"{a.task}.{a.eval_split}.step{a.steps}.trec")


def paired_to_base(rows, a, work: pathlib.Path) -> None:
  """Adds to each row `ndcg_vs_base`: (mean, s.e.) over queries of its NDCG@10 minus the
  base row's (multi-vector C = 1, else the first) of the same run on the same query."""
  for group in grouped(rows, run_of).values():
    reference = per_query_ndcg(run_file_of(base_row(group), a, work), a)
    for row in group:
      mine = per_query_ndcg(run_file_of(row, a, work), a)
      row["ndcg_vs_base"] = list(benchmarking.mean_stderr(mine[q] - reference[q]
                                                          for q in reference))


def random_floor(a, repeats: int = 20, seed: int = 0) -> dict:
  """NDCG@10 and Recall@100 of random rankings of the whole corpus (mean of `repeats`)."""
  import random
  from decal_jax.retrieval import beir, ir_metrics
  data = beir.load_beir(a.folder, a.eval_split)
  docs, rng, totals = list(data.corpus), random.Random(seed), {"ndcg@10": 0.0, "recall@100": 0.0}
  for _ in range(repeats):
    run = {q: dict(zip(rng.sample(docs, min(100, len(docs))), range(100, 0, -1)))
           for q in data.queries}
    for key, value in ir_metrics.evaluate(run, data.qrels).items():
      if key in totals:
        totals[key] += value / repeats
  return totals


def bm25_reference(a) -> dict:
  """NDCG@10 and Recall@100 of BM25 on the scored split (a lexical reference, no training;
  `bm25.reference_run`: bm25s with BEIR's settings when installed), and its name."""
  from decal_jax.retrieval import beir, bm25, ir_metrics
  data = beir.load_beir(a.folder, a.eval_split)
  ranked, name = bm25.reference_run({d: p.full_text for d, p in data.corpus.items()},
                                     data.queries)
  return {**ir_metrics.evaluate(ranked, data.qrels), "name": name}


def check_settings(a, work: pathlib.Path) -> None:
  """Writes <work>/settings.json on the first run; refuses a rerun with other settings."""
  settings = {k: getattr(a, k) for k in SETTINGS}
  path = work / "settings.json"
  if path.exists():
    old = json.loads(path.read_text())
    changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
    if changed:
      sys.exit(f"{work} holds runs made with other settings ("
               + ", ".join(f"{k}: {o!r} then, {n!r} now" for k, (o, n) in changed.items())
               + "). Pass another --work, or delete that folder to start over.")
  else:
    path.write_text(json.dumps(settings, indent=1, sort_keys=True))


def display(path: str) -> str:
  """`path` relative to the working directory when it lies inside it."""
  p, here = pathlib.Path(path).absolute(), pathlib.Path.cwd()
  return str(p.relative_to(here)) if p.is_relative_to(here) else path


def heldout_queries(rows) -> str:
  counts = sorted({int(r["heldout_queries"]) for r in rows if r.get("heldout_queries")})
  return "/".join(map(str, counts)) or "?"


def report(a, rows, command: str) -> str:
  """The Markdown results file: settings, the table, the references and the rows (a
  '## Reading' section is a person's to write; `keep_reading` keeps it)."""
  minutes = sum(r["train_minutes"] + r["eval_minutes"] for r in rows)
  floor, bm25 = random_floor(a), bm25_reference(a)
  lines = benchmarking.header(
      f"{a.task}: retrieval quality and index size by passage compression ratio",
      command,
      f"{minutes:.0f} min of fine-tuning, indexing and search in all; host load average "
      f"(1/5/15 min) {benchmarking.load_average()} when this file was written",
      f"each row: {' / '.join(f'`{display(i)}`' for i in a.inits)} (models/decal_tiny.gin + "
      "models/dual_encoder.gin; queries read at the passages' C unless the row says "
      f"otherwise) fine-tuned {a.steps} steps with in-batch softmax on the task's "
      f"train qrels (batch {a.batch_size}, learning rate {a.learning_rate}, queries "
      f"{a.query_length} / passages {a.passage_length} tokens); held-out in-batch accuracy "
      f"on '{a.validation_split}' ({heldout_queries(rows)} queries in batches of "
      f"{a.batch_size}, at most 10: is the query's own passage the top one among the "
      f"batch's passages?); then the whole corpus indexed (float16) and the "
      f"'{a.eval_split}' queries searched with exact MaxSim, top 100",
      f"{rows[0]['num_queries']} queries, {rows[0]['num_docs']} passages; "
      + spread_note(sorted({r["seed"] for r in rows}), a.inits),
      f"random rankings (mean of 20): NDCG@10 {floor['ndcg@10']:.4f}, Recall@100 "
      f"{floor['recall@100']:.4f}",
      f"{bm25['name']}, no training: NDCG@10 "
      f"{bm25['ndcg@10']:.4f}, Recall@100 {bm25['recall@100']:.4f}",
      *([f"not run (no checkpoint): {'; '.join(a.skipped)}"] if getattr(a, "skipped", None)
        else []))
  return ("\n".join(lines) + f"\n\n{table(rows)}\n\n## Rows (JSON lines)\n\n```jsonl\n"
          + "\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n```\n")


def keep_reading(out: pathlib.Path, text: str) -> str:
  """`text`, followed by the '## Reading' section of the file already at `out`, if any."""
  if not out.exists() or READING not in out.read_text():
    return text
  old = out.read_text()
  reading = old[old.index(READING):].split("\n## Rows", 1)[0].rstrip() + "\n\n"
  head, rows = text.split("## Rows (JSON lines)", 1)
  return head + reading + "## Rows (JSON lines)" + rows


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--init", required=True, nargs="+",
                      help="pretrained DeCAL checkpoint folder (the main job's MODEL_DIR); "
                      "several: every row is fine-tuned from each (e.g. main-job seeds); "
                      "'{C}' in it: one checkpoint per ratio (runs/pre_c{C}_s0)")
  parser.add_argument("--task", default="decal_beir_builtin", help="a decal_beir_<name> task")
  parser.add_argument("--validation_split", default=None,
                      help="split for the fine-tune's held-out in-batch loss (default: "
                      "'validation' where the folder has it, else --eval_split)")
  parser.add_argument("--eval_split", default="test", help="split whose queries are scored")
  parser.add_argument("--ratios", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--asymmetric", action="store_true",
                      help="add, for each C > 1, the row with queries read at C = 1")
  parser.add_argument("--mean_pooling_ratio", type=int, default=None,
                      help="add the single-vector row: mean of the encoder's vectors at C")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--learning_rate", type=float, default=0.001)
  parser.add_argument("--query_length", type=int, default=32)
  parser.add_argument("--passage_length", type=int, default=256)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                      help="gin SEED of the fine-tunes; every row is fine-tuned once per seed")
  parser.add_argument("--work", default=None,
                      help="runs folder (default runs/retrieval_table/<task>)")
  parser.add_argument("--out", default=None, help="write the Markdown table here")
  a = parser.parse_args(argv)
  if any(r < 1 for r in a.ratios) or (a.mean_pooling_ratio is not None
                                      and a.mean_pooling_ratio < 1):
    parser.error("ratios must be integers >= 1")
  if len(set(a.ratios)) != len(a.ratios):
    parser.error(f"--ratios {a.ratios} repeats a ratio")
  if len(set(a.seeds)) != len(a.seeds):
    parser.error(f"--seeds repeats a seed ({a.seeds}); give each seed once")
  if min(a.steps, a.batch_size, a.query_length - 1, a.passage_length - 1) < 1:
    parser.error("--steps and --batch_size must be >= 1, --query_length and "
                 "--passage_length >= 2 (one token and EOS)")
  if not a.task.startswith("decal_beir_"):
    parser.error(f"--task {a.task}: give a BEIR task (decal_beir_<name>); the table indexes "
                 "and searches its corpus")
  row_ratios = sorted({v[1] for v in variants(a)})
  for given in a.init:
    if not any(has_checkpoint(init_path(given, c)) for c in row_ratios):
      where = f" (with {{C}} = {', '.join(map(str, row_ratios))})" if "{C}" in given else ""
      parser.error(f"--init {given}{where} holds no checkpoint_<step> folder; give the "
                   "pretraining run's MODEL_DIR (the README's main job writes runs/decal_tiny)")
  a.inits = [str(pathlib.Path(i).absolute()) for i in a.init]
  names = [init_name(i) for i in a.inits]
  if len(a.inits) > 1 and len(set(names)) < len(names):
    parser.error(f"--init {' '.join(a.init)}: each checkpoint's runs go to a folder named "
                 "after it, so the folder names must differ (give MODEL_DIRs, e.g. "
                 "runs/decal_tiny runs/decal_tiny_s1, not their checkpoint_<step> folders)")
  a.init = a.inits[0] if len(a.inits) == 1 else a.inits  # settings.json: as before for one
  return a


def main(argv=None):
  a = parse_args(argv)
  resolve_splits(a)
  work = pathlib.Path(a.work or pathlib.Path("runs", "retrieval_table", a.task)).absolute()
  work.mkdir(parents=True, exist_ok=True)
  check_settings(a, work)
  rows, a.skipped = [], []
  todo = [(*variant, init, seed) for init in a.inits for seed in a.seeds
          for variant in variants(a)]
  for i, variant in enumerate(todo, start=1):
    label, ratio, init, seed = variant[0], variant[1], variant[4], variant[5]
    if not has_checkpoint(init_path(init, ratio)):
      a.skipped.append(f"{label}, seed {seed}, from {display(init_path(init, ratio))}")
      print(f"[{i}/{len(todo)}] {a.skipped[-1]}: no checkpoint there, skipped", flush=True)
      continue
    print(f"[{i}/{len(todo)}] ", end="", flush=True)
    rows.append(one_variant(*variant, a, work))
  order = {variant[0]: i for i, variant in enumerate(variants(a))}
  rows.sort(key=lambda r: order[r["label"]])  # stable: each row's runs in --init, --seeds order
  command = benchmarking.command("tools.retrieval_table", argv)
  paired_to_base(rows, a, work)
  text = report(a, rows, command)
  print("\n" + table(rows))
  if a.out:
    out = pathlib.Path(a.out)
    fileio.write_text_atomic(out, keep_reading(out, text))
    print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
