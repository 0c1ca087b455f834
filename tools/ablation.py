"""The ablation harness behind `tools/ablate.py`: every variant trained under one budget.

A *variant* (`gin/experiments/variants/<name>.gin`) says what differs: the compressor and
ratio, extra model bindings, and how it is pretrained (span corruption, autoencoding +
continuation, or not at all), optionally starting from another variant's pretrained
checkpoint, and which pretrained checkpoint it fine-tunes from. A *budget*
(`gin/experiments/budgets/<name>.gin`) fixes everything that must be the same for all of
them: model size, steps, batch, lengths, learning rates, seed, the downstream task.

Per variant, under WORK/<variant>/: `pretrain/` (runs/pretrain.gin), `finetune/`
(runs/finetune.gin, from a pretrained checkpoint), an evaluation of the fine-tuned model
(runs/eval.gin; predictions and metrics in finetune/inference_eval/), and `result.json`.
Every stage is the same gin configuration the command-line entry points build, run in this
process. A variant with a `result.json` is done; an interrupted one resumes its stages from
their checkpoints.
"""
import dataclasses
import json
import math
import pathlib
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import gin

from decal_jax import fileio
from decal_jax.networks import flops
from decal_jax.runtime import gin_utils
from tools import benchmarking
from decal_jax.data import span_corruption

EXPERIMENTS_DIR = gin_utils.GIN_DIR / "experiments"
OBJECTIVES = ("span_corruption", "autoencode", None)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Variant:
  """One row of the table.

  Attributes:
    label: its name in the table and plot.
    family: groups points into lines in the plot ('baseline', 'DeCAL', 'AttnPool', ...).
    ratio, compressor: the compression (ratio 1 = the uncompressed baseline).
    bindings: extra gin bindings for every stage, e.g. ('USE_POOLING = False',).
    pretrain_objective: 'span_corruption', 'autoencode' (the 1:1 autoencoding +
      continuation mixture) or None (no pretraining of its own; set `finetune_from`).
    start_from: pretraining starts from this variant's pretrained checkpoint (CCProxy).
    finetune_from: fine-tune from this variant's pretrained checkpoint instead of one's own.
  """
  label: str = gin.REQUIRED
  family: str = gin.REQUIRED
  ratio: int = 1
  compressor: str = "latents"
  bindings: Sequence[str] = ()
  pretrain_objective: Optional[str] = "span_corruption"
  start_from: Optional[str] = None
  finetune_from: Optional[str] = None
  name: str = ""  # the file name; set by `load_variants`


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Budget:
  """What every variant shares. Lengths are {'inputs': n, 'targets': t}."""
  variants: Sequence[str] = gin.REQUIRED
  model_gin: str = gin.REQUIRED
  pretrain_steps: int = gin.REQUIRED
  finetune_steps: int = gin.REQUIRED
  batch_size: int = gin.REQUIRED
  span_corruption_task: str = "decal_builtin_span_corruption"
  autoencode_task: str = "decal_builtin_autoencode_continuation"
  pretrain_lengths: Mapping[str, int] = gin.REQUIRED
  autoencode_lengths: Mapping[str, int] = gin.REQUIRED
  finetune_task: str = "decal_builtin_qa"
  finetune_lengths: Mapping[str, int] = gin.REQUIRED
  finetune_metric: str = "f1"
  pretrain_learning_rate: float = 0.5
  warmup_steps: int = 100
  finetune_learning_rate: float = 0.003
  seed: int = 0
  eval_batches: int = 10
  max_predict_examples: Optional[int] = None
  name: str = ""  # the file name; set by `load_budget`


# ------------------------------------------------------------------------------ loading
def known(kind: str) -> List[str]:
  """Names of the gin files under gin/experiments/<kind>/ ('variants' or 'budgets')."""
  return sorted(p.stem for p in (EXPERIMENTS_DIR / kind).glob("*.gin"))


def _load(kind: str, name: str, cls):
  """Loads gin/experiments/<kind>/<name>.gin (or `name` itself if it is a .gin file path)."""
  path = EXPERIMENTS_DIR / kind / f"{name}.gin"
  if name.endswith(".gin") and pathlib.Path(name).exists():
    path, name = pathlib.Path(name), pathlib.Path(name).stem
  if not path.exists():
    raise ValueError(f"Unknown {kind[:-1]} {name!r}; known: {', '.join(known(kind))} "
                     f"(files in {path.parent}).")
  gin.clear_config()
  gin.add_config_file_search_path(str(gin_utils.GIN_DIR))  # for `include` lines
  gin.parse_config_file(str(path))
  try:
    return dataclasses.replace(gin.get_configurable(cls)(), name=name)
  finally:
    gin.clear_config()


def load_budget(name: str) -> Budget:
  return _load("budgets", name, Budget)


def load_variants(names: Sequence[str]) -> List[Variant]:
  """The variants, with every variant they depend on, ordered so dependencies come first."""
  loaded: Dict[str, Variant] = {}
  todo = list(names)
  while todo:
    name = todo.pop(0)
    if name not in loaded:
      loaded[name] = _load("variants", name, Variant)
      todo += [d for d in (loaded[name].start_from, loaded[name].finetune_from) if d]
  order: List[Variant] = []
  while len(order) < len(loaded):
    ready = [v for v in loaded.values() if v not in order and
             all(d in [o.name for o in order] for d in (v.start_from, v.finetune_from) if d)]
    if not ready:
      raise ValueError(f"Variants depend on each other in a cycle: "
                       f"{sorted(set(loaded) - {o.name for o in order})}.")
    order += sorted(ready, key=lambda v: list(loaded).index(v.name))
  return order


def check(budget: Budget, variants: Sequence[Variant]) -> None:
  """Refuses, before any training, a budget that cannot fit one of its variants."""
  for v in variants:
    where = f"variant {v.name!r} (ratio {v.ratio}) under budget {budget.name!r}"
    if v.pretrain_objective not in OBJECTIVES:
      raise ValueError(f"{where}: pretrain_objective must be one of {OBJECTIVES}.")
    if v.pretrain_objective is None and not v.finetune_from:
      raise ValueError(f"{where} has no pretraining of its own: set finetune_from.")
    stages = [("finetune_lengths", budget.finetune_lengths)]
    if v.pretrain_objective == "span_corruption":
      stages.append(("pretrain_lengths", budget.pretrain_lengths))
    elif v.pretrain_objective == "autoencode":
      stages.append(("autoencode_lengths", budget.autoencode_lengths))
    for field, lengths in stages:
      n = lengths["inputs"]
      if v.ratio > n:
        raise ValueError(f"{where}: the ratio exceeds {field}['inputs'] = {n}; nothing would "
                         "be left to compress. Use longer inputs or a smaller ratio.")
      if n % v.ratio:
        raise ValueError(f"{where}: {field}['inputs'] = {n} is not divisible by {v.ratio}; "
                         "every variant must see whole windows. Use a multiple of "
                         f"{math.lcm(*[w.ratio for w in variants])}.")
    if v.pretrain_objective == "span_corruption":
      need = span_corruption.target_length(budget.pretrain_lengths["inputs"])
      if budget.pretrain_lengths["targets"] < need:
        raise ValueError(f"Budget {budget.name!r}: span corruption of "
                         f"{budget.pretrain_lengths['inputs']} tokens needs "
                         f"pretrain_lengths['targets'] >= {need}.")
    if (v.pretrain_objective == "autoencode" and
        budget.autoencode_lengths["targets"] < budget.autoencode_lengths["inputs"]):
      raise ValueError(f"Budget {budget.name!r}: autoencoding needs autoencode_lengths "
                       "['targets'] >= ['inputs'] (the target is the whole input).")


# ------------------------------------------------------------------------------ stages
def _model_bindings(v: Variant) -> List[str]:
  return [f"COMPRESSION_RATIO = {v.ratio}", f"COMPRESSOR = {v.compressor!r}", *v.bindings]


def _run_bindings(budget: Budget, model_dir: pathlib.Path, steps: int, task: str,
                  lengths: Mapping[str, int]) -> List[str]:
  return [f"MODEL_DIR = {str(model_dir)!r}", f"TRAIN_STEPS = {steps}",
          f"MIXTURE_OR_TASK_NAME = {task!r}", f"TASK_FEATURE_LENGTHS = {dict(lengths)!r}",
          f"BATCH_SIZE = {budget.batch_size}", f"SEED = {budget.seed}",
          f"EVAL_PERIOD = {steps}", f"CHECKPOINT_PERIOD = {steps}", "KEEP_CHECKPOINTS = 1",
          f"EVAL_BATCHES = {budget.eval_batches}", "LOG_PERIOD = 10",
          "trainer.train.show_example = False"]


def stage_configs(budget: Budget, v: Variant, work: pathlib.Path
                  ) -> List[Tuple[str, List[str], List[str]]]:
  """(stage, gin files, gin bindings) for each stage of a variant, in order."""
  out = []
  pretrained = work / (v.finetune_from or v.name) / "pretrain"
  if v.pretrain_objective:
    task, lengths = ((budget.span_corruption_task, budget.pretrain_lengths)
                     if v.pretrain_objective == "span_corruption"
                     else (budget.autoencode_task, budget.autoencode_lengths))
    bindings = _run_bindings(budget, work / v.name / "pretrain", budget.pretrain_steps, task,
                             lengths)
    bindings += [f"LEARNING_RATE = {budget.pretrain_learning_rate}",
                 f"WARMUP_STEPS = {budget.warmup_steps}"]
    if v.start_from:
      bindings.append(f"trainer.train.initial_checkpoint_path = "
                      f"{str(work / v.start_from / 'pretrain')!r}")
    out.append(("pretrain", [budget.model_gin, "runs/pretrain.gin"],
                _model_bindings(v) + bindings))
  finetune_dir = work / v.name / "finetune"
  bindings = _run_bindings(budget, finetune_dir, budget.finetune_steps, budget.finetune_task,
                           budget.finetune_lengths)
  bindings += [f"LEARNING_RATE = {budget.finetune_learning_rate}",
               f"INITIAL_CHECKPOINT_PATH = {str(pretrained)!r}"]
  out.append(("finetune", [budget.model_gin, "runs/finetune.gin"], _model_bindings(v) + bindings))
  out.append(("eval", [budget.model_gin, "runs/eval.gin"], _model_bindings(v) + [
      f"MODEL_DIR = {str(finetune_dir)!r}", f"MIXTURE_OR_TASK_NAME = {budget.finetune_task!r}",
      f"TASK_FEATURE_LENGTHS = {dict(budget.finetune_lengths)!r}",
      f"BATCH_SIZE = {budget.batch_size}", f"EVAL_BATCHES = {budget.eval_batches}",
      f"MAX_PREDICT_EXAMPLES = {budget.max_predict_examples!r}"]))
  return out


def command_line(stage: str, files: Sequence[str], bindings: Sequence[str]) -> str:
  """The equivalent `python -m decal_jax.<entry point>` command of a stage."""
  module = "eval" if stage == "eval" else "train"
  args = [f"--gin_file={f}" for f in files] + [f'--gin_bindings="{b}"' for b in bindings]
  return f"python -m decal_jax.{module} " + " ".join(args)


def _run_stage(stage: str, files: Sequence[str], bindings: Sequence[str]):
  from decal_jax.runtime import evaluation, trainer  # heavy imports only when training
  from decal_jax.networks import t5
  gin_utils.parse(files, [], bindings)
  config = gin.get_configurable(t5.T5Config)()
  if stage == "eval":
    return gin.get_configurable(evaluation.evaluate)(), config
  return gin.get_configurable(trainer.train)(gin_config_text=gin.config_str()), config


def claim(work: pathlib.Path, budget: Budget) -> None:
  """Records the budget in WORK/budget.json, or refuses a WORK made under another budget
  (its finished variants would be reused as if they had been trained under this one)."""
  record = work / "budget.json"
  mine = json.loads(json.dumps(dataclasses.asdict(dataclasses.replace(budget, variants=()))))
  if record.exists():
    theirs = json.loads(record.read_text())
    changed = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if changed:
      raise ValueError(f"{work} holds runs made under another budget (differs in: "
                       f"{', '.join(changed)}). Use another --work folder, or delete {work} "
                       "to start over.")
    return
  fileio.write_text_atomic(record, json.dumps(mine, indent=1))


def restore_record(record: pathlib.Path, work: pathlib.Path,
                   variants: Sequence[Variant]) -> List[str]:
  """Puts the finished variants kept in `record` (`save_record`, on this or another machine)
  into WORK, with the budget they ran under (`claim` then refuses another budget), so
  `run_variant` skips them. A variant still to run that starts or fine-tunes from a
  restored one needs that one's pretrained checkpoint: where it is not in WORK, that one is
  left to run again. Returns the names restored."""
  if not record.exists():
    return []
  kept = json.loads(record.read_text())
  if not (work / "budget.json").exists():
    fileio.write_text_atomic(work / "budget.json", json.dumps(kept["budget"], indent=1))
  needed = {d for v in variants if v.name not in kept["results"]
            for d in (v.start_from, v.finetune_from) if d}
  restored = []
  for name, result in kept["results"].items():
    done = work / name / "result.json"
    if not done.exists() and (name not in needed or (work / name / "pretrain").exists()):
      fileio.write_text_atomic(done, json.dumps(result, indent=1))
      restored.append(name)
  return restored


def save_record(record: pathlib.Path, work: pathlib.Path) -> int:
  """Keeps WORK's budget and every finished variant's result.json in one JSON file (small:
  no checkpoints) that `restore_record` reads back. Returns the number of variants kept."""
  kept = json.loads(record.read_text()) if record.exists() else {"results": {}}
  kept["budget"] = json.loads((work / "budget.json").read_text())
  for done in sorted(work.glob("*/result.json")):
    kept["results"][done.parent.name] = json.loads(done.read_text())
  fileio.write_text_atomic(record, json.dumps(kept, indent=1))
  return len(kept["results"])


def run_variant(budget: Budget, v: Variant, work: pathlib.Path,
                log=print) -> Optional[Dict[str, object]]:
  """Runs (or resumes) one variant's stages; returns and writes WORK/<name>/result.json.
  None when a stage was preempted (SIGTERM: it saved a checkpoint; a rerun resumes it).
  Call `claim(work, budget)` first."""
  done = work / v.name / "result.json"
  if done.exists():
    log(f"{v.label}: done before ({done}); skipping.")
    return json.loads(done.read_text())
  result: Dict[str, object] = {"name": v.name, "label": v.label, "family": v.family,
                               "ratio": v.ratio, "pretrain_objective": v.pretrain_objective,
                               "finetune_from": v.finetune_from, "seconds": {}}
  for stage, files, bindings in stage_configs(budget, v, work):
    log(f"{v.label}: {stage} ...\n  = {command_line(stage, files, bindings)}")
    start = time.time()
    metrics, config = _run_stage(stage, files, bindings)
    if "preempted_at_step" in metrics:
      log(f"{v.label}: {stage} stopped at step {int(metrics['preempted_at_step'])} (saved).")
      return None
    result["seconds"][stage] = round(time.time() - start, 1)
    if stage == "pretrain":
      result["pretrain_accuracy"] = float(metrics["accuracy"])
    elif stage == "eval":
      key = f"{budget.finetune_task}/{budget.finetune_metric}"
      result["metric"] = float(metrics[key])
      result["metrics"] = {k.split("/", 1)[1]: float(x) for k, x in metrics.items()
                           if k.startswith(f"{budget.finetune_task}/")}
      f = flops.forward_flops(config, budget.finetune_lengths["inputs"],
                              budget.finetune_lengths["targets"])
      result["flops"] = dataclasses.asdict(f)
  fileio.write_text_atomic(done, json.dumps(result, indent=1))
  return result


# ------------------------------------------------------------------------------ reporting
def by_variant(results: Sequence[Mapping[str, object]]) -> List[List[Mapping[str, object]]]:
  """The results grouped by variant (one entry per seed), in the order first seen."""
  groups: Dict[str, List[Mapping[str, object]]] = {}
  for r in results:
    groups.setdefault(r["name"], []).append(r)
  return list(groups.values())


def _cell(values: Sequence[float], fmt: str) -> str:
  """'mean ± standard error' over seeds; the value alone for one seed."""
  mean, se = benchmarking.mean_stderr(values)
  return f"{mean:{fmt}}" if len(values) == 1 else f"{mean:{fmt}} ± {se:{fmt}}"


def table(budget: Budget, results: Sequence[Mapping[str, object]]) -> str:
  """Markdown: one row per variant (mean ± s.e. where it ran with several seeds; wall: the
  mean per seed); FLOPs relative to the uncompressed baseline row."""
  groups = by_variant(results)
  base = next((g[0] for g in groups if g[0]["ratio"] == 1 and g[0]["family"] == "baseline"),
              None)
  lines = [f"| variant | pretraining | pretrain acc | {budget.finetune_task} EM | "
           f"{budget.finetune_task} F1 | encoder FLOPs | cross-attn FLOPs | wall (s) |",
           "|---|---|---|---|---|---|---|---|"]
  for group in groups:
    r = group[0]
    acc = [g["pretrain_accuracy"] for g in group if g.get("pretrain_accuracy") is not None]
    pre = {"span_corruption": "span corruption", "autoencode": "autoencode + continuation",
           None: f"none (uses {r.get('finetune_from')}'s)"}[r["pretrain_objective"]]
    rel = lambda k: (f"{r['flops'][k] / base['flops'][k]:.2f}x" if base else
                     f"{r['flops'][k]:.3g}")
    metric = lambda k: _cell([g["metrics"].get(k, float("nan")) for g in group],
                             ".1f")
    wall = sum(sum(g["seconds"].values()) for g in group) / len(group)
    lines.append(f"| {r['label']} | {pre} | {_cell(acc, '.3f') if acc else '-'} | "
                 f"{metric('em')} | {metric('f1')} | "
                 f"{rel('encoder')} | {rel('cross_attention')} | {wall:.0f} |")
  return "\n".join(lines)


def plot(budget: Budget, results: Sequence[Mapping[str, object]], path: pathlib.Path) -> None:
  """Fine-tune metric against compression ratio, a line per family (PNG)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  means = []  # one point per variant: the mean over its seeds, and its standard error
  for group in by_variant(results):
    mean, se = benchmarking.mean_stderr([g["metric"] for g in group])
    means.append(dict(group[0], metric=mean, metric_se=se))
  base = [r for r in means if r["family"] == "baseline"]
  if base:
    ax.axhline(base[0]["metric"], color="gray", linestyle="--", label=base[0]["label"])
  families = [f for f in dict.fromkeys(r["family"] for r in means) if f != "baseline"]
  for family in families:
    rows = sorted((r for r in means if r["family"] == family), key=lambda r: r["ratio"])
    as_line = len({r["ratio"] for r in rows}) == len(rows) > 1  # one point per ratio
    points = ax.plot([r["ratio"] for r in rows], [r["metric"] for r in rows],
                     "o-" if as_line else "s", label=family)
    if any(r["metric_se"] == r["metric_se"] for r in rows):  # several seeds: error bars
      ax.errorbar([r["ratio"] for r in rows], [r["metric"] for r in rows],
                  yerr=[r["metric_se"] for r in rows], fmt="none",
                  ecolor=points[0].get_color())
    if not as_line:
      for r in rows:
        ax.annotate(r["label"], (r["ratio"], r["metric"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points", color=points[0].get_color())
  ax.set_xscale("log", base=2)
  ax.set_xlabel("compression ratio C")
  ax.set_ylabel(f"{budget.finetune_task} {budget.finetune_metric.upper()}")
  ax.set_title(f"Ablations, budget '{budget.name}'")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
