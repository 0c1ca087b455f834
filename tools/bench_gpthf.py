"""GPTHF (cached, and as the paper runs it) against an equally sized GPT without and with a
KV cache: FLOPs and time.

  python -m tools.bench_gpthf --out docs/results/gpthf_efficiency_cpu.md \
      --plot docs/results/gpthf_efficiency_cpu.png
  python -m tools.bench_gpthf --preset paper --out docs/results/gpthf_efficiency_gpu.md \
      --plot docs/results/gpthf_efficiency_gpu.png  # GPTHF-16-8 vs Baseline-24: a GPU

For every prompt length n, generation length k and batch size, on one set of random weights
(GPTHF has exactly the parameters of the GPT built from the same DecoderConfig, so one
parameter tree serves both networks; the sides are in tools/bench_gpthf_sides.py):
  * GPTHF: `DecoderOnlyModel.generate` on `Gpthf`: the prompt fed one token at a time
    through its sentence and body caches (keys / values in both parts), then k cached steps;
  * GPTHF, paper inference: `gpthf.paper_generate`, no keys / values kept: the prompt's
    sentence embeddings from one word-level pass, then k steps that each rerun the word-level
    blocks over the current sentence and the sentence-level blocks over the finished
    sentences' embeddings (compiled at lengths 8, 16, 32, .. `gpthf.bucket_sizes`);
  * GPT, no cache (the paper's baseline, its Tables 2-3): `generate_uncached` on `Decoder`,
    k steps, each rerunning the whole network over the tokens so far: the buffer grows in
    groups of --bucket steps (the group ending at step e runs over n + e + 1 positions);
  * GPT, cache (the like-for-like one): `generate` on `Decoder`, the prompt fed one token at
    a time through the KV cache exactly as GPTHF's is, then k cached steps;
  * GPT, cache + prefill (how GPT serving reads a prompt): the prompt written into the KV
    cache by one causal pass, then the same k cached steps (GPTHF has no prefill).
Every side is one jitted program timed end to end (median of --repeats runs after
compilation and --warmup untimed runs; the sides' order reversed every repeat). FLOPs are
analytical (`decal_jax.networks.flops`, matmuls, per example): "as computed" counts dense
attention over every slot a side scores (GPTHF: max_sentence_length sentence slots and n + k
body slots; paper inference: its compiled lengths; GPT: its n + k cache slots, or its
buffer), "causal" only the keys each token may see, and "the paper's count" both networks
without keys / values, each pass over just the positions it needs (`flops` explains).

Prompts are real text (`data.sentences.builtin_text_rows`: built-in corpus paragraphs, the
end-of-sentence id after each sentence, as GPTHF's training data; each batch row a window
starting at a paragraph start). Random weights almost never emit the end id, so
`--continuation real` (default) feeds the text's own next k tokens through the very same
steps (real sentence ends) and records each step's argmax; `--continuation greedy` feeds
each side's own argmax. Every side runs all k steps (no EOS stop).

Presets: `cpu` (default; a 6-layer model, 4 word-level + 2 sentence-level, for 2 CPU
cores; batches above 1 only where batch * k * (n + k) <= --max_batch_work), `paper`
(GPTHF-16-8 vs Baseline-24 shapes, bfloat16: for a GPU), `tiny` (tests). Before any
program runs, the weights' and each compiled program's memory need is compared with what
the machine has; a row that does not fit is reported as such. --out and --plot are
rewritten after every row, marked partial until the run completes, so a run stopped midway
keeps its rows.
"""
import argparse
import dataclasses
import os
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

import jax.numpy as jnp
import numpy as np
import tqdm

from decal_jax.data import vocabularies
from decal_jax.data.sentences import builtin_text_rows as text_rows
from decal_jax.data.sentences import sentence_end_id
from decal_jax.networks import flops, gpthf
from decal_jax.networks.decoder import DecoderConfig
from tools import benchmarking, results_files
from tools.bench_gpthf_sides import (  # noqa: F401  (OURS, NoEos, PRESETS: the tests' names)
    BASELINES, OURS, PRESETS, SIDES, NoEos, SentenceCounts, compile_side, paper_computed_steps,
    param_count, random_params, row_configs, sentence_stats, side_functions)
from tools.benchmarking import DoesNotFit, Side, decoder_line, gflop, load_average

PAPER = {"n": 500, "k": 20, "flop_ratio": 9.73, "speedup": 2.99, "speedup_batch": 32}
PAPER_SIDE = "GPTHF, paper inference"


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Row:
  prompt: int
  new: int
  batch: int
  sides: Dict[str, Side] = dataclasses.field(default_factory=dict)
  flops: Dict[str, float] = dataclasses.field(default_factory=dict)         # as computed
  causal_flops: Dict[str, float] = dataclasses.field(default_factory=dict)  # visible keys
  paper_flops: Dict[str, float] = dataclasses.field(default_factory=dict)   # paper's count
  counts: Optional[SentenceCounts] = None
  text: Optional[np.ndarray] = None  # [batch, n + k] the prompts and their continuations
  configs: Optional[Tuple[DecoderConfig, gpthf.GpthfConfig]] = None
  note: str = ""

  @property
  def done(self) -> bool:
    return not self.note


def _gpt_flops(decoder: DecoderConfig, n: int, k: int, causal: bool,
               bucket: Optional[int]) -> Dict[str, float]:
  return {"GPT no cache": flops.gpt_generation_flops(decoder, n, k, False, causal=causal,
                                                     bucket=bucket).total,
          "GPT cache": flops.gpt_generation_flops(decoder, n, k, True, causal=causal).total,
          "GPT cache + prefill": flops.gpt_generation_flops(decoder, n, k, True, prefill=True,
                                                            causal=causal).total}


def grid(args) -> List[Row]:
  rows = []
  for n in args.prompts:
    for k in args.new_tokens:
      for batch in args.batches:
        row, work, limit = Row(n, k, batch), batch * k * (n + k), args.max_batch_work
        if batch > 1 and limit is not None and work > limit:
          row.note = f"skipped: batch x k x (n + k) = {work:,} > --max_batch_work {limit:,}"
        rows.append(row)
  return rows


def run_row(row: Row, args, params) -> None:
  n, k, batch = row.prompt, row.new, row.batch
  decoder, config = row.configs = row_configs(args, n, k)
  row.text = text_rows(batch, n + k, config.max_sentence_length)
  prompt, continuation = jnp.asarray(row.text[:, :n]), jnp.asarray(row.text[:, n:])
  what = f"n={n}, k={k}, batch={batch}"
  functions = side_functions(decoder, config, k, args.continuation, args.bucket or None)
  for name in tqdm.tqdm(SIDES, desc=f"compile {what}", leave=False, dynamic_ncols=True):
    row.sides[name] = compile_side(name, functions[name], params, prompt, continuation, what)
  benchmarking.measure_sides(list(row.sides.values()), args.warmup, args.repeats, what)
  new = row.text[:, n:] if args.continuation == "real" else row.sides["GPTHF"].tokens
  row.counts, lengths = sentence_stats(config, row.text[:, :n], new)
  fed = np.concatenate([np.zeros((batch, 1), np.int32), row.text[:, :n], new], 1)[:, :n + k]
  row.flops = {"GPTHF": flops.gpthf_generation_flops(config, n, k).total,
               PAPER_SIDE: flops.gpthf_paper_flops(
                   config, n, paper_computed_steps(config, fed, n)).total,
               **_gpt_flops(decoder, n, k, False, args.bucket or None)}
  row.causal_flops = {"GPTHF": statistics.mean(
      flops.gpthf_generation_flops(config, n, k, lengths_b, causal=True).total
      for lengths_b in lengths), **_gpt_flops(decoder, n, k, True, args.bucket or None)}
  row.paper_flops = {PAPER_SIDE: statistics.mean(
      flops.gpthf_paper_generation_flops(config, n, k, lengths_b).total for lengths_b in lengths),
      "GPT no cache": flops.gpt_paper_generation_flops(decoder, n, k).total}


def run(args) -> List[Row]:
  """Every grid row; after each row run, the finished rows (skipped ones included) are
  written as partial results (`results_files.write_partial`), so a run stopped midway keeps
  them."""
  args.load_before = load_average()
  rows = grid(args)
  decoder, _ = row_configs(args, 1, 1)
  params = random_params(decoder, args.seed, args.init_std)
  pending = {id(row) for row in rows if row.done}  # not run yet (skipped rows are finished)
  for row in tqdm.tqdm([r for r in rows if r.done], desc="rows", dynamic_ncols=True):
    try:
      run_row(row, args, params)
    except DoesNotFit as e:
      row.sides, row.note = {}, f"did not fit: {e}"
    tqdm.tqdm.write(_summary(row))
    pending.discard(id(row))
    finished = [r for r in rows if id(r) not in pending]
    results_files.write_partial(args, finished, len(finished), len(rows),
                                lambda done: markdown(args, done), plot)
  args.load_after = load_average()
  return rows


# ----------------------------------------------------------------------------- report
def speedup(row: Row, baseline: str, ours: str = "GPTHF") -> float:
  """Measured: the baseline's median time / GPTHF's (or `ours`, e.g. the paper inference)."""
  return row.sides[baseline].median() / row.sides[ours].median()


def flop_ratio(row: Row, baseline: str, causal: bool = False) -> float:
  table = row.causal_flops if causal else row.flops
  return table[baseline] / table["GPTHF"]


def paper_ratio(row: Row) -> float:
  """The paper's count: GPT without a cache / GPTHF as the paper runs it."""
  return row.paper_flops["GPT no cache"] / row.paper_flops[PAPER_SIDE]


def _summary(row: Row) -> str:
  return f"n={row.prompt} k={row.new} batch={row.batch}: " + (row.note or ", ".join(
      f"{name} {row.sides[name].median() * 1e3:.1f} ms" for name in SIDES))


def time_table(rows: Sequence[Row]) -> List[str]:
  lines = ["| n | k | batch | GPTHF ms (min-max) | GPTHF paper inference ms | GPT no cache ms "
           "| GPT cache ms | GPT cache + prefill ms | GPTHF speedup vs no cache "
           "| vs cache (fair) | vs cache + prefill | paper inference vs no cache (paper) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    head = f"| {row.prompt} | {row.new} | {row.batch} |"
    if not row.done:
      lines.append(f"{head} {row.note} |" + " |" * 8)
      continue
    lines.append(f"{head} {' | '.join(row.sides[name].ms_range() for name in SIDES)} | "
                 + " | ".join(f"{speedup(row, name):.2f}" for name in BASELINES)
                 + f" | {speedup(row, 'GPT no cache', PAPER_SIDE):.2f} |")
  return lines


def flop_table(rows: Sequence[Row]) -> List[str]:
  lines = ["| n | k | batch | GFLOP as computed: GPTHF / paper inference / no cache / cache "
           "/ cache + prefill | GPTHF's FLOP ratio as computed: no cache / cache / cache + "
           "prefill | causal: no cache / cache / cache + prefill | the paper's count, GFLOP: "
           "paper inference / no cache (ratio) | GPTHF sentences closed in prompt: end id / "
           "bound | in the k new tokens: end id / bound |",
           "|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    if not row.done:
      continue
    counts = row.counts
    lines.append(
        f"| {row.prompt} | {row.new} | {row.batch} | "
        f"{' / '.join(gflop(row.flops[name]) for name in SIDES)} | "
        f"{' / '.join(f'{flop_ratio(row, name):.2f}' for name in BASELINES)} | "
        f"{' / '.join(f'{flop_ratio(row, name, True):.2f}' for name in BASELINES)} | "
        f"{gflop(row.paper_flops[PAPER_SIDE])} / {gflop(row.paper_flops['GPT no cache'])} "
        f"({paper_ratio(row):.2f}) | {counts.prompt_end} / {counts.prompt_bound} | {counts.new_end} / {counts.new_bound} |")
  return lines


def token_agreement(rows: Sequence[Row], reference: str,
                    others: Sequence[str]) -> Tuple[int, int]:
  """(tokens where every side of `others` equals `reference`'s, tokens compared)."""
  same = total = 0
  for row in rows:
    if row.done:
      for name in others:
        same += int((row.sides[name].tokens == row.sides[reference].tokens).sum())
        total += row.sides[reference].tokens.size
  return same, total


def _group_stops(args, k: int) -> List[int]:
  """The uncached GPT's compiled lengths past n: each group's last step + 1."""
  group = args.bucket or k
  return [min(stop, k) for stop in range(group, k + group, group)]


def markdown(args, rows: Sequence[Row]) -> str:
  preset = args.preset_value
  decoder, config = row_configs(args, 1, 1)
  skipped = [row for row in rows if row.note.startswith("skipped")]
  done = [row for row in rows if row.done]
  closed = sum(r.counts.prompt_end + r.counts.prompt_bound for r in done)
  prompt_tokens = sum(r.prompt * r.batch for r in done)
  same, compared = token_agreement(done, "GPT no cache", BASELINES[1:])
  ours_same, ours_compared = token_agreement(done, "GPTHF", (PAPER_SIDE,))
  lengths = "; ".join(f"k = {k}: " + ", ".join(f"n + {stop}" for stop in _group_stops(args, k))
                      for k in args.new_tokens)
  lines = benchmarking.header(
      "GPTHF vs an equally sized GPT without and with a KV cache: FLOPs and wall clock",
      args.command,
      f"shapes: {preset.source}; {jnp.dtype(decoder.dtype).name}; random weights "
      f"(N(0, {preset.init_std}), seed {args.seed}). GPT: {decoder_line(decoder)} "
      f"({param_count(decoder) / 1e6:.2f} M parameters); GPTHF: the same blocks and weights, "
      f"{config.encoder_layers} word-level + {decoder.num_layers - config.encoder_layers} "
      f"sentence-level, sentences of at most {config.max_sentence_length} tokens; "
      "max_length = n + k in every row.",
      "sides, prompts and FLOP counting (as computed / causal): as in the tool's docstring; "
      f"end id {args.end_id}; continuation `{args.continuation}`; every side runs all k steps.",
      f"times: median of {args.repeats} runs per side after compilation and {args.warmup} "
      "warm-up run(s), the sides' order reversed every repeat. Speedup and FLOP ratio = the "
      "baseline's / GPTHF's.",
      f"prompt sentences closed: {closed} in {prompt_tokens:,} prompt tokens over all rows."
      if closed else "",
      f"GPT no cache: the buffer grows in groups of --bucket {args.bucket or 'k'} steps, each "
      f"compiled at its last step's length (BOS, prompt, new tokens): {lengths} positions. "
      "GPTHF, paper inference: compiled sentence lengths "
      f"{gpthf.bucket_sizes(config.max_sentence_length)}, finished-sentence slots 8, 16, 32, "
      ".. up to n + k; each step takes the smallest that holds every row.",
      f"cached GPT sides equal to the uncached GPT's tokens: {same} of {compared}; GPTHF's "
      f"paper inference equal to cached GPTHF's: {ours_same} of {ours_compared}.",
      f"{len(skipped)} row(s) with batch > 1 skipped: batch x k x (n + k) > "
      f"{args.max_batch_work:,}." if skipped else "",
      f"host load average (1/5/15 min) before / after: "
      f"{getattr(args, 'load_before', 'n/a')} / {getattr(args, 'load_after', 'n/a')}.",
      args.note and f"note: {args.note}")
  lines += ["", "## Wall clock", "", *time_table(rows), "", "## FLOPs", "", *flop_table(rows)]
  if args.plot:
    lines += ["", f"![speedups and FLOP ratios vs n]({os.path.basename(args.plot)})"]
  return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], path: str) -> None:
  """Measured speedups (left) and FLOP ratios (right) of GPTHF vs prompt length n: colour =
  baseline (purple: GPTHF's paper inference vs GPT without a cache, FLOPs by the paper's
  count), line style = k, marker = batch; the paper's point as a star."""
  plt = results_files.pyplot()
  done = [row for row in rows if row.done]
  colours = {"GPT no cache": "tab:red", "GPT cache": "tab:blue",
             "GPT cache + prefill": "tab:green"}
  styles = dict(zip(sorted({r.new for r in done}), ["-", "--", ":", "-."] * 4))
  markers = dict(zip(sorted({r.batch for r in done}), "osD^v" * 4))
  fig, (time_ax, flop_ax) = plt.subplots(1, 2, figsize=(12, 5.2))
  for (k, batch) in sorted({(r.new, r.batch) for r in done}):
    at = sorted((r for r in done if (r.new, r.batch) == (k, batch)), key=lambda r: r.prompt)
    xs = [r.prompt for r in at]
    for name, colour in colours.items():
      style = dict(color=colour, linestyle=styles[k], marker=markers[batch])
      time_ax.plot(xs, [speedup(r, name) for r in at], **style,
                   label=f"vs {name}, k={k}, batch {batch}")
      if batch == min(markers):  # FLOPs per example do not depend on the batch
        flop_ax.plot(xs, [flop_ratio(r, name) for r in at], **style,
                     label=f"vs {name}, k={k}")
        flop_ax.plot(xs, [flop_ratio(r, name, True) for r in at], color=colour,
                     linestyle="none", marker="x")
    style = dict(color="tab:purple", linestyle=styles[k], marker=markers[batch])
    time_ax.plot(xs, [speedup(r, "GPT no cache", PAPER_SIDE) for r in at], **style,
                 label=f"paper inference vs GPT no cache, k={k}, batch {batch}")
    if batch == min(markers):
      flop_ax.plot(xs, [paper_ratio(r) for r in at], **style,
                   label=f"paper inference vs GPT no cache, the paper's count, k={k}")
  flop_ax.plot([], [], "kx", linestyle="none", label="causal counting (same colours)")
  time_ax.plot([PAPER["n"]], [PAPER["speedup"]], "k*", markersize=12,
               label=f"paper vs no cache (k={PAPER['k']}, batch {PAPER['speedup_batch']})")
  flop_ax.plot([PAPER["n"]], [PAPER["flop_ratio"]], "k*", markersize=12,
               label=f"paper vs no cache (k={PAPER['k']})")
  for ax, title in ((time_ax, "measured speedup of GPTHF (baseline time / GPTHF's)"),
                    (flop_ax, "FLOP ratio (baseline / GPTHF): as computed; purple: paper's")):
    ax.axhline(1.0, color="grey", linewidth=0.8)
    results_files.log_log_axes(ax, "prompt length n (tokens)", title, fontsize=6.5,
                               loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
  fig.tight_layout()
  results_files.save_figure(fig, path, bbox_inches="tight")


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
  parser.add_argument("--prompts", default="100,250,500,1000", help="prompt lengths n")
  parser.add_argument("--new_tokens", default="20,100", help="generation lengths k")
  parser.add_argument("--batches", default="1,32", help="batch sizes")
  parser.add_argument("--max_batch_work", type=int, default=-1,
                      help="run batches > 1 only where batch * k * (n + k) <= this (default: "
                           "the preset's; 0: no limit)")
  parser.add_argument("--continuation", default="real", choices=["real", "greedy"])
  parser.add_argument("--bucket", type=int, default=16,
                      help="steps per compiled buffer length of the uncached GPT (0: one "
                           "length, the whole n + k buffer)")
  benchmarking.add_side_by_side_args(parser)
  args = parser.parse_args(argv)
  args.prompts = benchmarking.int_list(parser, args.prompts, "--prompts")
  args.new_tokens = benchmarking.int_list(parser, args.new_tokens, "--new_tokens")
  args.batches = benchmarking.int_list(parser, args.batches, "--batches")
  if args.repeats < 1 or args.warmup < 0 or args.bucket < 0:
    parser.error(f"need --repeats >= 1, --warmup >= 0 and --bucket >= 0, got {args.repeats}, "
                 f"{args.warmup}, {args.bucket}.")
  args.preset_value = PRESETS[args.preset]()
  args.init_std = args.preset_value.init_std
  if args.max_batch_work < 0:
    args.max_batch_work = args.preset_value.max_batch_work
  elif args.max_batch_work == 0:
    args.max_batch_work = None
  args.end_id = sentence_end_id(vocabularies.builtin_plain_vocabulary())
  if args.end_id >= args.preset_value.decoder.vocab_size:
    parser.error(f"the built-in vocabulary's end id {args.end_id} is outside the preset's "
                 f"{args.preset_value.decoder.vocab_size}-id vocabulary.")
  args.command = benchmarking.command("tools.bench_gpthf", argv)
  return args


def main(argv=None) -> List[Row]:
  return benchmarking.run_and_report(parse_args(argv), run, markdown, plot)


if __name__ == "__main__":
  main()
