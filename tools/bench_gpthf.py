"""GPTHF (cached) against an equally sized GPT without and with a KV cache: FLOPs and time.

  python -m tools.bench_gpthf --out docs/results/gpthf_efficiency_cpu.md \
      --plot docs/results/gpthf_efficiency_cpu.png
  python -m tools.bench_gpthf --preset paper --out docs/results/gpthf_efficiency_gpu.md \
      --plot docs/results/gpthf_efficiency_gpu.png  # GPTHF-16-8 vs Baseline-24: a GPU

For every prompt length n, generation length k and batch size, on one set of random weights
(GPTHF has exactly the parameters of the GPT built from the same DecoderConfig, so one
parameter tree serves both networks):
  * GPTHF: `DecoderOnlyModel.generate` on `Gpthf`: the prompt fed one token at a time
    through its sentence and body caches, then k cached steps;
  * GPT, no cache (the paper's baseline, its Tables 2-3): `generate_uncached` on `Decoder`,
    k steps, each rerunning the whole network over the n + k token buffer;
  * GPT, cache (the like-for-like one): `generate` on `Decoder`, the prompt fed one token at
    a time through the KV cache exactly as GPTHF's is, then k cached steps;
  * GPT, cache + prefill (how GPT serving reads a prompt): the prompt written into the KV
    cache by one causal pass, then the same k cached steps (GPTHF has no prefill).
Every side is one jitted program timed end to end (median of --repeats runs after
compilation and --warmup untimed runs; the sides' order reversed every repeat). FLOPs are
analytical (`decal_jax.networks.flops`, matmuls, per example): "as computed" counts dense attention
over every slot a side scores (GPTHF: max_sentence_length sentence slots and n + k body
slots; GPT: its n + k cache slots, or the whole buffer), "causal" only the keys each token
may see.

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
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from decal_jax import decoding, models
from decal_jax.networks import flops
from tools import benchmarking, results_files
from tools.benchmarking import (DoesNotFit, NoEos, Run, Side, available_bytes, check_fits,
                                    decoder_line, gflop, load_average, needed_bytes, timed)
from decal_jax.data import vocabularies
from decal_jax.data.sentences import builtin_text_rows as text_rows
from decal_jax.data.sentences import sentence_end_id
from decal_jax.networks import gpthf
from decal_jax.networks.decoder import Decoder, DecoderConfig

SIDES = ("GPTHF", "GPT no cache", "GPT cache", "GPT cache + prefill")
PAPER = {"n": 500, "k": 20, "flop_ratio": 9.73, "speedup": 2.99, "speedup_batch": 32}


# ----------------------------------------------------------------------------- presets
class Preset(NamedTuple):
  decoder: DecoderConfig       # the GPT's shape; max_length is set per row to n + k
  encoder_layers: int          # GPTHF's word-level blocks (the rest are sentence-level)
  max_sentence_length: int
  dtype: str
  init_std: float              # random weights ~ N(0, init_std); norm scales 1
  max_batch_work: Optional[int]  # batches > 1 only where batch * k * (n + k) <= this
  source: str


def _cpu_preset() -> Preset:
  """GPTHF-16-8's 2 : 1 split shrunk (4 word-level + 2 sentence-level blocks, mlp 4x emb),
  tied embeddings over the built-in vocabulary (4,224 ids as in gin/models/*_tiny.gin)."""
  return Preset(DecoderConfig(vocab_size=4224, emb_dim=128, num_heads=4, head_dim=32,
                              mlp_dim=512, num_layers=6, tie_embeddings=True),
                4, 64, "float32", 0.02, 200_000, "the `cpu` preset (tools/bench_gpthf.py)")


def _paper_preset() -> Preset:
  """GPTHF-16-8 and Baseline-24: 24 blocks of d 1024, 16 heads x 64, SwiGLU 4096, tied."""
  return Preset(DecoderConfig(vocab_size=50304, emb_dim=1024, num_heads=16, head_dim=64,
                              mlp_dim=4096, num_layers=24, tie_embeddings=True),
                16, 64, "bfloat16", 0.02, None,
                "the `paper` preset: GPTHF-16-8 / Baseline-24 shapes (tools/bench_gpthf.py)")


def _tiny_preset() -> Preset:
  return Preset(DecoderConfig(vocab_size=4224, emb_dim=16, num_heads=2, num_kv_heads=1,
                              head_dim=8, mlp_dim=32, num_layers=2, tie_embeddings=True),
                1, 8, "float32", 0.5, None, "the `tiny` preset (tests)")


PRESETS: Dict[str, Callable[[], Preset]] = {"cpu": _cpu_preset, "paper": _paper_preset,
                                            "tiny": _tiny_preset}


def row_configs(args, prompt_length: int, new_tokens: int
                ) -> Tuple[DecoderConfig, gpthf.GpthfConfig]:
  """The GPT's and GPTHF's configs for one row: max_length = n + k (the fewest positions
  `generate` accepts, which also sizes GPTHF's body cache); same weights for every row."""
  preset = args.preset_value
  decoder = dataclasses.replace(preset.decoder, max_length=prompt_length + new_tokens,
                                dtype=jnp.dtype(args.dtype or preset.dtype), dropout_rate=0.0)
  return decoder, gpthf.GpthfConfig(decoder=decoder, encoder_layers=preset.encoder_layers,
                                    sentence_end_id=args.end_id,
                                    max_sentence_length=preset.max_sentence_length)


# ----------------------------------------------------------------------------- weights
def _param_shapes(cfg: DecoderConfig):
  tokens = jnp.ones((1, 1), jnp.int32)
  return jax.eval_shape(lambda: Decoder(cfg).init(jax.random.PRNGKey(0), tokens,
                                                  enable_dropout=False))["params"]


def param_count(cfg: DecoderConfig) -> int:
  return benchmarking.param_count(_param_shapes(cfg))


def random_params(cfg: DecoderConfig, seed: int = 0, std: float = 0.02) -> dict:
  """Random weights of `Decoder`'s tree (also `Gpthf`'s), after checking that they fit."""
  need = param_count(cfg) * jnp.dtype(cfg.dtype).itemsize
  benchmarking.check_weights_fit(need, available_bytes())
  return benchmarking.random_params(_param_shapes(cfg), cfg.dtype, seed, std)


class SentenceCounts(NamedTuple):
  """Sentences GPTHF's layout closes, summed over the batch rows."""
  prompt_end: int    # in the prompt, by the end id
  prompt_bound: int  # in the prompt, by max_sentence_length
  new_end: int       # in the k new tokens, by the end id
  new_bound: int


def sentence_stats(config: gpthf.GpthfConfig, prompt: np.ndarray, new: np.ndarray
                   ) -> Tuple[SentenceCounts, List[List[int]]]:
  """Counts of closed sentences, and per row the sentence lengths of the n + k fed tokens
  (BOS, prompt, new tokens but the last) by the network's own rule (`sentence_layout`)."""
  text = np.concatenate([np.zeros((prompt.shape[0], 1), np.int32), prompt, new], axis=1)
  layout = gpthf.sentence_layout(jnp.asarray(text), config.sentence_end_id,
                                 config.max_sentence_length)
  closes = np.asarray(layout.closes)  # [b, 1 + n + k]
  by_end = closes & (text == config.sentence_end_id)
  n = prompt.shape[1]
  counts = SentenceCounts(int(by_end[:, 1:n + 1].sum()), int((closes & ~by_end)[:, 1:n + 1].sum()),
                          int(by_end[:, n + 1:].sum()), int((closes & ~by_end)[:, n + 1:].sum()))
  fed = text.shape[1] - 1
  lengths = []
  for row in closes[:, :fed]:
    ends = (np.flatnonzero(row) + 1).tolist()  # exclusive ends of the closed sentences
    if not ends or ends[-1] < fed:
      ends.append(fed)  # the sentence still open after the last fed token
    lengths.append(np.diff([0] + ends).tolist())
  return counts, lengths


# ----------------------------------------------------------------------------- generation
def uncached_continuation(model: models.DecoderOnlyModel, params, prompt, continuation):
  """`DecoderOnlyModel.generate_uncached` step for step, except that step i writes the
  text's token continuation[:, i] into the buffer; its argmax is recorded. `[b, k]`."""
  batch, length = prompt.shape
  new_tokens = continuation.shape[1]
  tokens = jnp.zeros((batch, length + new_tokens), jnp.int32).at[:, :length].set(prompt)

  def step(i, carry):
    tokens, predicted = carry
    inputs = jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]  # BOS + everything so far
    logits = model.module.apply({"params": params}, inputs, enable_dropout=False)
    best = jnp.argmax(logits[:, length + i], axis=-1).astype(jnp.int32)  # [b]
    tokens = tokens.at[:, length + i].set(continuation[:, i])
    return tokens, predicted.at[:, i].set(best)

  init = (tokens, jnp.zeros((batch, new_tokens), jnp.int32))
  return jax.lax.fori_loop(0, new_tokens, step, init)[1]


def side_functions(decoder: DecoderConfig, config: gpthf.GpthfConfig, new_tokens: int,
                   continuation: str) -> Dict[str, Callable]:
  """{side: fn(params, prompt [b, n], text continuation [b, k]) -> tokens [b, k]}."""
  decode_fn = decoding.forced_decode if continuation == "real" else decoding.temperature_sample
  ours = models.DecoderOnlyModel(gpthf.Gpthf(config), NoEos(), decode_fn=decode_fn)
  gpt = models.DecoderOnlyModel(Decoder(decoder), NoEos(), decode_fn=decode_fn)
  k = new_tokens
  if continuation == "real":
    return {
        "GPTHF": lambda p, prompt, text: ours.generate(p, prompt, k, forced=text),
        "GPT no cache": lambda p, prompt, text: uncached_continuation(gpt, p, prompt, text),
        "GPT cache": lambda p, prompt, text: gpt.generate(p, prompt, k, forced=text),
        "GPT cache + prefill": lambda p, prompt, text: gpt.generate(p, prompt, k, prefill=True,
                                                                    forced=text)}
  return {"GPTHF": lambda p, prompt, text: ours.generate(p, prompt, k),
          "GPT no cache": lambda p, prompt, text: gpt.generate_uncached(p, prompt, k),
          "GPT cache": lambda p, prompt, text: gpt.generate(p, prompt, k),
          "GPT cache + prefill": lambda p, prompt, text: gpt.generate(p, prompt, k, prefill=True)}


def compile_side(name: str, fn: Callable, params, prompt, text, what: str) -> Side:
  compiled = jax.jit(fn).lower(params, prompt, text).compile()
  check_fits(compiled, f"{name} at {what}")

  def run() -> Run:
    tokens, seconds = timed(compiled, params, prompt, text)
    return Run(seconds, np.asarray(tokens))
  return Side(name, run, needed_bytes(compiled))


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Row:
  prompt: int
  new: int
  batch: int
  sides: Dict[str, Side] = dataclasses.field(default_factory=dict)
  flops: Dict[str, float] = dataclasses.field(default_factory=dict)         # as computed
  causal_flops: Dict[str, float] = dataclasses.field(default_factory=dict)  # visible keys
  counts: Optional[SentenceCounts] = None
  text: Optional[np.ndarray] = None  # [batch, n + k] the prompts and their continuations
  configs: Optional[Tuple[DecoderConfig, gpthf.GpthfConfig]] = None
  note: str = ""

  @property
  def done(self) -> bool:
    return not self.note


def _gpt_flops(decoder: DecoderConfig, n: int, k: int, causal: bool) -> Dict[str, float]:
  return {"GPT no cache": flops.gpt_generation_flops(decoder, n, k, False, causal=causal).total,
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
  functions = side_functions(decoder, config, k, args.continuation)
  for name in tqdm.tqdm(SIDES, desc=f"compile {what}", leave=False, dynamic_ncols=True):
    row.sides[name] = compile_side(name, functions[name], params, prompt, continuation, what)
  benchmarking.measure_sides(list(row.sides.values()), args.warmup, args.repeats, what)
  new = row.text[:, n:] if args.continuation == "real" else row.sides["GPTHF"].tokens
  row.counts, lengths = sentence_stats(config, row.text[:, :n], new)
  row.flops = {"GPTHF": flops.gpthf_generation_flops(config, n, k).total,
               **_gpt_flops(decoder, n, k, causal=False)}
  row.causal_flops = {"GPTHF": statistics.mean(
      flops.gpthf_generation_flops(config, n, k, lengths_b, causal=True).total
      for lengths_b in lengths), **_gpt_flops(decoder, n, k, causal=True)}


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
def speedup(row: Row, baseline: str) -> float:
  """Measured: the baseline's median time / GPTHF's."""
  return row.sides[baseline].median() / row.sides["GPTHF"].median()


def flop_ratio(row: Row, baseline: str, causal: bool = False) -> float:
  table = row.causal_flops if causal else row.flops
  return table[baseline] / table["GPTHF"]


def _summary(row: Row) -> str:
  return f"n={row.prompt} k={row.new} batch={row.batch}: " + (row.note or ", ".join(
      f"{name} {row.sides[name].median() * 1e3:.1f} ms" for name in SIDES))


def time_table(rows: Sequence[Row]) -> List[str]:
  lines = ["| n | k | batch | GPTHF ms (min-max) | GPT no cache ms | GPT cache ms "
           "| GPT cache + prefill ms | speedup vs no cache (paper) | speedup vs cache (fair) "
           "| speedup vs cache + prefill |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    head = f"| {row.prompt} | {row.new} | {row.batch} |"
    if not row.done:
      lines.append(f"{head} {row.note} |" + " |" * 6)
      continue
    lines.append(f"{head} {' | '.join(row.sides[name].ms_range() for name in SIDES)} | "
                 + " | ".join(f"{speedup(row, name):.2f}" for name in SIDES[1:]) + " |")
  return lines


def flop_table(rows: Sequence[Row]) -> List[str]:
  lines = ["| n | k | batch | GFLOP as computed: GPTHF / no cache / cache / cache + prefill "
           "| FLOP ratio as computed: no cache / cache / cache + prefill "
           "| FLOP ratio causal: no cache / cache / cache + prefill "
           "| GPTHF sentences closed in prompt: end id / bound "
           "| in the k new tokens: end id / bound |",
           "|---|---|---|---|---|---|---|---|"]
  for row in rows:
    if not row.done:
      continue
    counts = row.counts
    lines.append(
        f"| {row.prompt} | {row.new} | {row.batch} | "
        f"{' / '.join(gflop(row.flops[name]) for name in SIDES)} | "
        f"{' / '.join(f'{flop_ratio(row, name):.2f}' for name in SIDES[1:])} | "
        f"{' / '.join(f'{flop_ratio(row, name, True):.2f}' for name in SIDES[1:])} | "
        f"{counts.prompt_end} / {counts.prompt_bound} | {counts.new_end} / {counts.new_bound} |")
  return lines


def token_agreement(rows: Sequence[Row]) -> Tuple[int, int]:
  """(tokens where both cached GPT sides equal the uncached one, tokens compared)."""
  same = total = 0
  for row in rows:
    if row.done:
      reference = row.sides["GPT no cache"].tokens
      for name in ("GPT cache", "GPT cache + prefill"):
        same += int((row.sides[name].tokens == reference).sum())
        total += reference.size
  return same, total


def markdown(args, rows: Sequence[Row]) -> str:
  preset = args.preset_value
  decoder, config = row_configs(args, 1, 1)
  skipped = [row for row in rows if row.note.startswith("skipped")]
  done = [row for row in rows if row.done]
  closed = sum(r.counts.prompt_end + r.counts.prompt_bound for r in done)
  prompt_tokens = sum(r.prompt * r.batch for r in done)
  same, compared = token_agreement(done)
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
      f"cached GPT sides equal to the uncached GPT's tokens: {same} of {compared}.",
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
  baseline, line style = k, marker = batch; the paper's point as a star."""
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
  flop_ax.plot([], [], "kx", linestyle="none", label="causal counting (same colours)")
  time_ax.plot([PAPER["n"]], [PAPER["speedup"]], "k*", markersize=12,
               label=f"paper vs no cache (k={PAPER['k']}, batch {PAPER['speedup_batch']})")
  flop_ax.plot([PAPER["n"]], [PAPER["flop_ratio"]], "k*", markersize=12,
               label=f"paper vs no cache (k={PAPER['k']})")
  for ax, title in ((time_ax, "measured speedup of GPTHF (baseline time / GPTHF's)"),
                    (flop_ax, "FLOP ratio as computed (baseline / GPTHF)")):
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
  benchmarking.add_side_by_side_args(parser)
  args = parser.parse_args(argv)
  args.prompts = benchmarking.int_list(parser, args.prompts, "--prompts")
  args.new_tokens = benchmarking.int_list(parser, args.new_tokens, "--new_tokens")
  args.batches = benchmarking.int_list(parser, args.batches, "--batches")
  if args.repeats < 1 or args.warmup < 0:
    parser.error(f"need --repeats >= 1 and --warmup >= 0, got {args.repeats}, {args.warmup}.")
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
