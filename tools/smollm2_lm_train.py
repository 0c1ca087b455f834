"""Dodo as a language model on SmolLM2-135M, before and after a short LoRA training (issue 43,
step 3; dodo.md §5): held-out continuations given a real history, every setting reading the
same number of attended states.

  nice -n 5 python -m tools.smollm2_lm_train --settings window-64 nuggets-10 compressive-10 \
    random-10 --seeds 0 1 2 --out docs/results/smollm2_lm_trained_cpu.md

(about 6 minutes per run of 120 steps on 2 CPU cores; runs already in --work are skipped, so
an interrupted sweep resumes, and --table-only writes the table from what is done.)

Each row is a `networks.dodo_lm.DodoLM` on the imported GGUF decoder (`interop.gguf`) with
LoRA (rank --lora-rank on query, key, value and out; nugget tokens run the compressing
adapter ϕ, the others the decoding adapter θ), trained through the library's
`models.DecoderOnlyModel` loss (cross entropy + z-loss); the 134.5M base stays frozen. With
τ = --window recent tokens and a budget of 2 τ states:

  full           every earlier token (the ceiling; trained the same way)
  window-2τ      every token reads its last 2 τ tokens only: the control at equal cache,
                 with the same LoRA training (does the training alone explain a gain?)
  nuggets-r      the last τ tokens + the nuggets of the τ r tokens before them, chosen by the
                 learned scorer (DodoLM's causal prefix-rank rule: about 1 in r)
  random-r       the same with the scorer frozen at its random initialisation (the learned
                 choice's control)
  compressive-r  the last τ tokens + the means of the r-token segments of the τ r before

Data: the shared folder's C4 and WikiText-2 documents ($DECAL_DATA_DIR, default
../shared/data) split by `real_text.split_of`, tokenized with SmolLM2's tokenizer and cut
into non-overlapping (τ (r + 1) + T)-token sequences (`smollm2_autoencode.segments`). Training
reads the train documents' sequences (every position's next token is a target); the score
is the NLL of the last T tokens of each held-out document's first sequence, given the
τ (r + 1) before (so the compressed rows cover the whole history), before training (step 0,
the same model as `smollm2_lm`'s random-scorer rows) and every --eval-every steps.

The paper starts the LM's scorer from the trained compressor's (its footnote 2): with
--scorer-from the nuggets rows do that, from the .npz a `smollm2_autoencode` run saved at the
same r (only the scorer is taken: the LM's adapters start fresh); they are reported as
'nuggets-r from AE' beside the rows whose scorer starts at random, e.g.

  python -m tools.smollm2_autoencode --ratios 10 --selections nuggets --seeds 0 1 2 \
    --work runs/smollm2_autoencode_saved
  python -m tools.smollm2_lm_train --settings nuggets-10 --seeds 0 1 2 --scorer-from \
    'runs/smollm2_autoencode_saved/n64_steps200_b4_lr0.002_w20_rank8_scorer1/r{r}_nuggets_seed{seed}.npz'
"""
import argparse
import dataclasses
import pathlib
import sys
import time
from typing import Dict, List

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax.networks import dodo_lm
from tools import benchmarking, results_files, smollm2_runs
from tools import smollm2_autoencode as ae
from tools.smollm2_lm import delimiter_ids, load_smollm2, nll_function, paired

KINDS = ("full", "window", "nuggets", "random", "compressive")


# ----------------------------------------------------------------------------- settings
def parse_setting(name: str, window: int):
  """(kind, r) of a setting name: 'full', f'window-{2 τ}', 'nuggets-r', 'random-r',
  'compressive-r'."""
  kind, _, number = name.partition("-")
  if kind not in KINDS or (kind == "full") != (number == "") or (number and not number.isdigit()):
    raise ValueError(f"unknown setting {name!r}: use full, window-{2 * window}, nuggets-R, "
                     "random-R or compressive-R (R an integer ratio)")
  if kind == "window" and int(number) != 2 * window:
    raise ValueError(f"{name}: the window row must read 2 τ = {2 * window} states (--window "
                     f"{window}), the budget of the compressed rows")
  return kind, int(number or 0)


def lm_config(decoder, name: str, window: int, length: int, lora_rank: int, sink: int = 0):
  """The DodoLMConfig of a setting on `decoder` for sequences of `length` inputs (`sink`:
  the first tokens every token reads in full, DodoLMConfig.sink)."""
  kind, r = parse_setting(name, window)
  decoder = dataclasses.replace(decoder, lora_rank=lora_rank)
  common = dict(decoder=decoder, scorer_layer=min(3, decoder.num_layers), sink=sink)
  if kind in ("full", "window"):
    return dodo_lm.DodoLMConfig(selection="window",
                                  window=length if kind == "full" else r, **common)
  return dodo_lm.DodoLMConfig(selection="compressive" if kind == "compressive" else "nuggets",
                                compression_ratio=r, window=window, history=window * r,
                                **common)


def build(decoder, name: str, window: int, length: int, lora_rank: int, eos: int,
          sink: int = 0):
  """The library's DecoderOnlyModel around the setting's DodoLM."""
  from decal_jax import models
  cfg = lm_config(decoder, name, window, length, lora_rank, sink)
  vocabulary = type("Ids", (), {"eos_id": eos, "vocab_size": decoder.vocab_size})()
  return models.DecoderOnlyModel(dodo_lm.DodoLM(cfg), vocabulary)


def lm_batch(sequences: np.ndarray) -> Dict[str, jnp.ndarray]:
  """Teacher forcing on sequences `[b, n]`: read tokens 0..n-2, predict 1..n-1."""
  return {"decoder_input_tokens": jnp.asarray(sequences[:, :-1]),
          "decoder_target_tokens": jnp.asarray(sequences[:, 1:])}


# ----------------------------------------------------------------------------- one run
def continuation_nll(nll_fn, params, held_out: np.ndarray, batch: int) -> List[float]:
  """Per held-out document, the mean NLL (nats / token) of its scored continuation."""
  out = []
  for i in range(0, len(held_out), batch):
    out += np.asarray(nll_fn(params, jnp.asarray(held_out[i:i + batch]))).mean(1).tolist()
  return [float(x) for x in out]


def kept_tokens(module, params, held_out: np.ndarray, first: int) -> np.ndarray:
  """The ids the scorer keeps among the history tokens that the continuation reads
  compressed (positions before `first` - τ)."""
  is_nugget = np.asarray(jax.jit(lambda p, x: module.apply(
      {"params": p}, x, method=dodo_lm.DodoLM.nuggets))(params, jnp.asarray(held_out[:, :-1])))
  history = np.arange(held_out.shape[1] - 1) < first - module.config.window  # [n - 1]
  return held_out[:, :-1][is_nugget & history[None]]


def train_run(args, config, imported, tokenizer, data, eos: int, name: str, seed: int,
              delimiters=()) -> dict:
  kind, _ = parse_setting(name, args.window)
  model = build(config, name, args.window, args.length - 1, args.lora_rank, eos, args.sink)
  trainable, frozen = ae.initial_params(model, imported, seed, args.length - 2)
  start_from = scorer_source(args, name, seed)
  if start_from:
    trainable = scorer_from(start_from, trainable)
  opt = ae.optimizer(args, trainable, train_scorer=kind == "nuggets")
  state = ae.optimizer_state(opt, trainable)

  step = ae.train_step(model, opt)

  first = args.length - args.continuation
  nll_fn = nll_function(model.module, first)
  held_out = np.stack(data["validation"][:args.eval_documents])  # [m, n]
  train = np.stack(data["train"])
  order = np.random.default_rng(seed).permutation(len(train))
  curve, losses, start = [], [], time.time()
  for t in range(args.steps + 1):
    if t % args.eval_every == 0 or t == args.steps:
      docs = continuation_nll(nll_fn, ae.params_of(trainable, frozen), held_out, args.eval_batch)
      curve.append({"step": t, "nll": float(np.mean(docs)), "doc_nll": docs,
                    "train_loss": float(np.mean(losses[-args.eval_every:])) if losses else None})
      print(f"  {name} seed {seed} step {t}: continuation NLL {curve[-1]['nll']:.3f} "
            f"({time.time() - start:.0f} s)", flush=True)
    if t == args.steps:
      break
    rows = order[(t * args.batch + np.arange(args.batch)) % len(order)]
    trainable, state, loss = step(trainable, state, frozen, lm_batch(train[rows]))
    losses.append(float(loss))
  kept = None
  if kind in ("nuggets", "random"):
    ids = kept_tokens(model.module, ae.params_of(trainable, frozen), held_out, first)
    kept = ae.kept_summary(ids, held_out[:, :first - args.window], delimiters, tokenizer.decode)
  return {"setting": name, "seed": seed, "steps": args.steps, "curve": curve, "kept": kept,
          "seconds": round(time.time() - start, 1), "scorer_from": start_from}


def scorer_source(args, name: str, seed: int):
  """The .npz a nuggets row's scorer starts from (--scorer-from with '{r}' and '{seed}' filled
  in), or None (a fresh scorer: every other row, and nuggets rows without the flag)."""
  kind, r = parse_setting(name, args.window)
  if not args.scorer_from or kind != "nuggets":
    return None
  return args.scorer_from.replace("{r}", str(r)).replace("{seed}", str(seed))


def scorer_from(path: str, trainable: dict) -> dict:
  """`trainable` with its scorer replaced by the one a smollm2_autoencode run trained and
  saved in `path`: the paper starts the LM's scorer from the compressor's (dodo.md)."""
  keys = [k for k in trainable if k[0] == "scorer"]
  with np.load(path) as saved:
    for k in keys:
      name = "/".join(k)
      if name not in saved or saved[name].shape != trainable[k].shape:
        raise ValueError(f"{path} has no scorer leaf {name} of shape {trainable[k].shape}: "
                         "give a .npz that smollm2_autoencode saved for this model")
    return {**trainable, **{k: jnp.asarray(saved["/".join(k)]) for k in keys}}


# ----------------------------------------------------------------------------- report
def label(run) -> str:
  """A run's row: its setting, marked when its scorer started from a trained compressor."""
  return run["setting"] + (" from AE" if run.get("scorer_from") else "")


def _key(run) -> tuple:
  return label(run), run["seed"]


def by_setting(runs: List[dict]) -> Dict[str, List[dict]]:
  groups: Dict[str, List[dict]] = {}
  for run in sorted(runs, key=_key):
    groups.setdefault(label(run), []).append(run)
  return groups


def paired_rows(runs: List[dict], reference: str) -> List[list]:
  """`reference` minus every other setting, after training, paired by seed (each seed's
  mean over documents) and by document (seeds averaged)."""
  groups = by_setting(runs)
  out = []
  for name, group in groups.items():
    if name == reference or reference not in groups:
      continue
    mine = {x["seed"]: x["curve"][-1] for x in groups[reference]}
    other = {x["seed"]: x["curve"][-1] for x in group}
    seeds = sorted(set(mine) & set(other))
    if not seeds:
      continue
    per_seed = [mine[s]["nll"] - other[s]["nll"] for s in seeds]
    docs_a = np.mean([mine[s]["doc_nll"] for s in seeds], axis=0)
    docs_b = np.mean([other[s]["doc_nll"] for s in seeds], axis=0)
    d, se = paired(docs_a, docs_b)
    out.append([f"{reference} - {name}", len(seeds), benchmarking.mean_se_text(per_seed, 3),
                f"{d:+.3f} ± {se:.3f}", ", ".join(f"{x:+.3f}" for x in per_seed)])
  return out


def saved_compressors(runs: List[dict]) -> Dict[str, List[str]]:
  """The .npz files the 'from AE' runs started from, by folder."""
  out: Dict[str, List[str]] = {}
  for path in sorted({x["scorer_from"] for x in runs if x.get("scorer_from")}):
    out.setdefault(str(pathlib.Path(path).parent), []).append(pathlib.Path(path).name)
  return out


def markdown(args, runs: List[dict], config, data) -> str:
  lines = benchmarking.header(
      "Dodo as a language model on SmolLM2-135M, before and after LoRA training",
      benchmarking.command("tools.smollm2_lm_train", args.argv),
      smollm2_runs.model_line(config, args.layers),
      f"training: LoRA rank {args.lora_rank} (q, k, v, out; compress + decode adapters), "
      f"scorer x {args.scorer_lr_scale} (nuggets rows); Adam lr {args.lr} (warm-up "
      f"{args.warmup}, cosine to a tenth), batch {args.batch} x {args.length - 1} tokens, "
      f"{args.steps} steps",
      f"data: {args.length}-token sequences of C4 + WikiText-2 ({len(data['train'])} train); "
      f"score: NLL of the last {args.continuation} tokens of {args.eval_documents} held-out "
      f"documents given the {args.length - args.continuation} before; τ = {args.window}, "
      f"every row but full reads about {2 * args.window} states"
      + (f" + the first {args.sink} tokens (sink)" if args.sink else ""),
      "mean ± s.e. over seeds of each seed's mean NLL over documents; perplexity = exp of it",
      *[f"'from AE' rows: the scorer starts as a trained compressor's ({folder}/: "
        f"{', '.join(names)})" for folder, names in saved_compressors(runs).items()])
  head = ["setting", "seeds", "NLL before training", "NLL after", "perplexity after",
          "minutes / run"]
  rows = [[name, len(g), benchmarking.mean_se_text([x["curve"][0]["nll"] for x in g], 3),
           benchmarking.mean_se_text([x["curve"][-1]["nll"] for x in g], 3),
           f"{np.exp(np.mean([x['curve'][-1]['nll'] for x in g])):.2f}",
           f"{np.mean([x['seconds'] for x in g]) / 60:.1f}"] for name, g in by_setting(runs).items()]
  lines += ["", "## Held-out continuation", "", *benchmarking.table(head, rows)]
  for reference in [n for n in by_setting(runs) if n.startswith("nuggets")]:
    lines += ["", f"## {reference} against the others, after training (negative: {reference} "
              "is better)", "", *benchmarking.table(
                  ["comparison", "seeds", "by seed: mean ± s.e.", "by document (seeds "
                   "averaged)", "each seed"], paired_rows(runs, reference))]
  kept = [x for x in sorted(runs, key=_key) if x.get("kept")]
  if kept:
    lines += ["", "## Which history tokens the selection keeps (held-out documents)", "",
              *benchmarking.table(
                  ["setting", "seed", "kept", "10 most kept types: share", "the types",
                   "delimiters among kept", "delimiters in the text"],
                  [[label(x), x["seed"], x["kept"]["kept"], f"{x['kept']['top_share']:.2f}",
                    " ".join(repr(t) for t in x["kept"]["top_types"]).replace("|", "/"),
                    f"{x['kept']['delimiter_share']:.3f}",
                    f"{x['kept']['delimiter_share_of_text']:.3f}"] for x in kept])]
  if args.out:
    lines += ["", f"![held-out continuation NLL against step]({pathlib.Path(args.out).stem}.png)"]
  return "\n".join(lines) + "\n"


def plot(runs: List[dict], path: str) -> None:
  """The held-out curves twice: every evaluation, and from the first after step 0 (untrained
  segment means start nats above the rest and would flatten every difference that matters)."""
  plt = results_files.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
  for ax, first in zip(axes, (0, 1)):
    for i, (name, group) in enumerate(by_setting(runs).items()):
      for j, run in enumerate(group):
        curve = run["curve"][first:]
        ax.plot([p["step"] for p in curve], [p["nll"] for p in curve],
                color=f"C{i}", alpha=0.8, label=name if j == 0 else None)
    ax.set_xlabel("training step")
  axes[0].set_ylabel("held-out continuation NLL (nats / token)")
  axes[0].set_title("every evaluation", fontsize=10)
  axes[1].set_title("after step 0 (zoomed)", fontsize=10)
  axes[1].legend(fontsize=8)
  fig.suptitle("SmolLM2-135M + LoRA reading compressed history (equal cache)")
  results_files.save_figure(fig, path)


# ----------------------------------------------------------------------------- main
def parse(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--settings", nargs="+",
                 default=["window-64", "nuggets-10", "compressive-10", "random-10"])
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--window", type=int, default=32, help="τ recent tokens")
  p.add_argument("--continuation", type=int, default=64, help="T scored tokens")
  p.add_argument("--steps", type=int, default=120)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--lora-rank", type=int, default=8)
  p.add_argument("--scorer-lr-scale", type=float, default=1.0)
  p.add_argument("--sink", type=int, default=0,
                 help="every row (window and compressed) also reads the first N tokens in "
                      "full at every layer (DodoLMConfig.sink; 0: the paper's)")
  p.add_argument("--scorer-from", default=None, metavar="NPZ",
                 help="start the nuggets rows' scorer from a trained compressor's, as the paper "
                      "does: a .npz that smollm2_autoencode saved ('{r}' and '{seed}' in the "
                      "path: the row's ratio and seed); those rows are marked 'from AE'")
  p.add_argument("--eval-documents", type=int, default=17)
  smollm2_runs.add_arguments(p, work="docs/results/runs/smollm2_lm_train", lr=1e-3,
                             warmup=12, eval_every=30, eval_batch=4)
  args = p.parse_args(argv)
  smollm2_runs.check_arguments(p, args, argv, min_layers=3)
  args.settings = list(dict.fromkeys(args.settings))  # a name given twice runs once
  if min(args.steps, args.batch, args.window, args.continuation) < 1:
    p.error("--steps, --batch, --window and --continuation must be at least 1")
  try:
    kinds = [parse_setting(name, args.window) for name in args.settings]
  except ValueError as e:
    p.error(str(e))
  if args.scorer_from:
    if not any(kind == "nuggets" for kind, _ in kinds):
      p.error("--scorer-from starts a nuggets row's scorer: add a nuggets-R setting")
    sources = [scorer_source(args, name, s) for name in args.settings for s in args.seeds]
    absent = [path for path in sources if path and not pathlib.Path(path).is_file()]
    if absent:
      p.error(f"--scorer-from: no file {absent[0]}; smollm2_autoencode writes one per run "
              "beside its --work file (<work>/<setting>/r<r>_nuggets_seed<s>.npz)")
  # Every compressed row covers its whole history: τ recent + τ r compressed before them.
  ratio = max([r for kind, r in kinds if kind not in ("full", "window")] + [1])
  args.length = args.window * (ratio + 1) + args.continuation + 1
  return args


def run_name(args) -> str:
  """The --work file of one training setting: runs under other settings are never mixed."""
  return (f"n{args.length}_t{args.continuation}_w{args.window}_steps{args.steps}"
          f"_b{args.batch}_lr{args.lr:g}_wu{args.warmup}_rank{args.lora_rank}"
          f"_scorer{args.scorer_lr_scale:g}{f'_sink{args.sink}' if args.sink else ''}"
          f"{f'_layers{args.layers}' if args.layers else ''}")


def write(args, log, runs, config, data) -> None:
  smollm2_runs.report(markdown(args, runs, config, data), args.out,
                      log, len(runs))
  if args.out and runs:
    plot(runs, str(pathlib.Path(args.out).with_suffix(".png")))


def main(argv=None):
  args = parse(sys.argv[1:] if argv is None else argv)
  log, runs = smollm2_runs.open_records(args.work, run_name(args), args.out)
  config, imported, tokenizer = load_smollm2(layers=args.layers)
  eos = tokenizer.token_to_id("<|im_end|>")
  data = ae.segments(tokenizer, args.length)
  if len(data["validation"]) < args.eval_documents:
    sys.exit(f"only {len(data['validation'])} held-out sequences of {args.length} tokens; "
             "lower --eval-documents, --window or the ratios")
  done = {_key(x) for x in runs}
  todo = [] if args.table_only else [
      (name, s) for s in args.seeds for name in args.settings
      if (label({"setting": name, "scorer_from": scorer_source(args, name, s)}), s) not in done]
  delimiters = delimiter_ids(tokenizer) if todo else ()
  smollm2_runs.sweep(todo, log, runs, lambda key: train_run(
      args, config, imported, tokenizer, data, eos, *key, delimiters),
      lambda: write(args, log, runs, config, data))
  if not todo:
    write(args, log, runs, config, data)


if __name__ == "__main__":
  main()
