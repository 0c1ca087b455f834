"""bench_inference's rows and their report: a configuration (a method at a ratio), one
measured row, its ratios to the reference measured beside it, the break-even lengths, and
the Markdown table, header lines and plot written to docs/results/.

  python -m tools.bench_inference --out docs/results/inference_throughput_cpu.md \
      --plot docs/results/inference_throughput_cpu.png   # (this module has no command)
"""
import dataclasses
import os
from typing import List, NamedTuple, Optional, Sequence, Tuple

import jax.numpy as jnp
import numpy as np

from tools import benchmarking, results_files
from tools.benchmarking import Largest, MemoryFit, Side, ms

REFERENCE = "decoder"  # Dodo's and Squid's uncompressed reference
GIB = 2**30


# ----------------------------------------------------------------------------- rows
@dataclasses.dataclass(frozen=True)
class Config:
  """One way to answer: a method at a ratio (C, r or ρ), with `beams` decodes."""
  method: str  # 'decal', 'dodo', 'squid' or REFERENCE
  ratio: int
  beams: int = 1

  @property
  def reference(self) -> "Config":
    return Config("decal" if self.method == "decal" else REFERENCE, 1, self.beams)

  @property
  def name(self) -> str:
    beam = f", beam {self.beams}" if self.beams > 1 else ""
    if self.method == REFERENCE:
      return f"decoder, full context{beam}"
    symbol = {"decal": "C", "dodo": "r", "squid": "ρ"}[self.method]
    return f"{'DeCAL' if self.method == 'decal' else self.method.title()} {symbol}={self.ratio}{beam}"


@dataclasses.dataclass
class Row:
  n: int
  config: Config
  group: str  # 'table', 'beam' or 'scan'
  new_tokens: int
  batch: int = 0
  side: Optional[Side] = None
  fit: Optional[MemoryFit] = None
  needed: Optional[int] = None  # bytes at `batch`
  largest: Optional[Largest] = None  # within the budget
  note: str = ""

  @property
  def seconds(self) -> float:
    """Median wall seconds per batch."""
    return self.side.median("wall")

  @property
  def cpu_seconds(self) -> float:
    """Median CPU seconds per batch (this process, all threads)."""
    return self.side.median("cpu")

  def wall_range(self) -> str:
    """'median (min-max)' wall milliseconds."""
    walls = [r.seconds["wall"] for r in self.side.runs]
    return f"{ms(self.seconds)} ({ms(min(walls))}-{ms(max(walls))})"

  @property
  def tokens(self) -> np.ndarray:
    return self.side.tokens

  @property
  def throughput(self) -> Tuple[float, float]:
    return throughput(self.batch, self.new_tokens, self.seconds)


def throughput(batch: int, new_tokens: int, seconds: float) -> Tuple[float, float]:
  """(sequences / s, generated tokens / s) of a batch that took `seconds`."""
  return batch / seconds, batch * new_tokens / seconds


def fit_batches(args) -> Tuple[int, int]:
  if args.fit_batches:
    return tuple(args.fit_batches)
  return (16, 64) if args.batch == "auto" else (int(args.batch), 8 * int(args.batch))


# ----------------------------------------------------------------------------- report
class Ratios(NamedTuple):
  """A row over its reference: seq/s, tokens/s, memory need at one batch, largest batch,
  and sequences per CPU second."""
  sequences: float
  tokens: float
  memory: Optional[float]
  largest: Optional[float]
  cpu: float


def reference_row(row: Row, rows: Sequence[Row]) -> Optional[Row]:
  """The measured row of the same group and n holding `row`'s reference."""
  return next((other for other in rows if other.side and other.group == row.group
               and other.n == row.n and other.config == row.config.reference), None)


def ratios(row: Row, ref: Row) -> Ratios:
  seq, tok = row.throughput
  ref_seq, ref_tok = ref.throughput
  if row.fit and ref.fit:  # the need at the same (first fit) batch
    memory = row.fit.needed[0] / ref.fit.needed[0]
  else:
    same = row.batch == ref.batch and row.needed and ref.needed
    memory = row.needed / ref.needed if same else None
  largest = (row.largest.batch / ref.largest.batch if row.largest and ref.largest
             and ref.largest.batch else None)
  cpu = (row.batch / row.cpu_seconds) / (ref.batch / ref.cpu_seconds)
  return Ratios(seq / ref_seq, tok / ref_tok, memory, largest, cpu)


def breakeven(args, rows: Sequence[Row], method: str, key: str = "sequences"
              ) -> Tuple[Optional[int], List[int], List[Tuple[int, float]]]:
  """(the shortest n at which `method` at --breakeven_ratio beats its reference, or None;
  the longer n at which it is not faster again; the (n, ratio) points). `key`: the `Ratios`
  field compared, 'sequences' (per wall second) or 'cpu' (per CPU second)."""
  target = Config(method, args.breakeven_ratio)
  points = sorted((row.n, getattr(ratios(row, ref), key)) for row in rows
                  if row.side and row.config == target
                  for ref in [reference_row(row, rows)] if ref)
  shortest = next((n for n, ratio in points if ratio > 1), None)
  again = [n for n, ratio in points if shortest and n > shortest and ratio <= 1]
  return shortest, again, points


def summary_line(args, row: Row, rows: Sequence[Row]) -> str:
  head = f"{row.group} n={row.n} {row.config.name}"
  if not row.side:
    return f"{head}: {row.note}"
  seq, tok = row.throughput
  ref = reference_row(row, rows)
  versus = (f" ({ratios(row, ref).sequences:.2f}x the reference; "
            f"{ratios(row, ref).cpu:.2f}x per CPU second)" if ref else "")
  return (f"{head}: batch {row.batch}, {row.seconds:.3f} s ({row.cpu_seconds:.3f} CPU s), "
          f"{seq:.2f} seq/s, {tok:.0f} tok/s, need {mib(row.needed)} MiB, largest batch "
          f"{row.largest}{versus}")


def mib(size: Optional[float]) -> str:
  return "n/a" if size is None else f"{size / 2**20:.1f}"


def _ratio(value: Optional[float]) -> str:
  return "n/a" if value is None else f"{value:.2f}"


def table_line(args, row: Row, rows: Sequence[Row]) -> str:
  cells = [row.n, row.config.name]
  if not row.side:
    return "| " + " | ".join(map(str, cells + [row.note])) + " |" + " |" * 12
  seq, tok = row.throughput
  ref = reference_row(row, rows)
  r = ratios(row, ref) if ref and ref is not row else None
  fit = f"{mib(row.fit.fixed)} + {mib(row.fit.per_sequence)}" if row.fit else "n/a"
  cells += [row.batch, row.wall_range(), ms(row.cpu_seconds), f"{seq:.3g}", f"{tok:.4g}",
            mib(row.needed), fit, row.largest or "n/a"]
  cells += ["1 (ref.)"] * 5 if ref is row else [
      _ratio(r and r.sequences), _ratio(r and r.cpu), _ratio(r and r.tokens),
      _ratio(r and r.memory), _ratio(r and r.largest)]
  return "| " + " | ".join(map(str, cells)) + " |"


TABLE_HEAD = ("| n | configuration | batch | wall ms per batch: median (min-max) | CPU ms "
              "per batch | seq/s | generated tok/s | need MiB at batch | fit: fixed MiB + MiB "
              "per sequence | largest batch in budget | seq/s ÷ ref. | seq per CPU-s ÷ ref. "
              "| tok/s ÷ ref. | need ÷ ref. (same batch) | largest batch ÷ ref. |")
TABLE_RULE = "|" + "---|" * 15


def breakeven_lines(args, rows: Sequence[Row]) -> List[str]:
  lines = ["", f"## Break-even: ratio {args.breakeven_ratio} against its reference", "",
           "Break-even n: the shortest n at which the compressed model answers more sequences "
           "per second (per wall second, then per CPU second of this process).", "",
           "| method | n: seq/s ÷ ref. | break-even n | not faster again at | n: seq per "
           "CPU-s ÷ ref. | break-even n by CPU time | not faster again at |",
           "|---|---|---|---|---|---|---|"]
  for method in args.methods:
    cells = [Config(method, args.breakeven_ratio).name]
    for key in ("sequences", "cpu"):
      shortest, again, points = breakeven(args, rows, method, key)
      cells += [", ".join(f"{n}: {r:.2f}" for n, r in points),
                f"{shortest}" if shortest else
                f"not reached up to n = {max((n for n, _ in points), default=0)}",
                ", ".join(map(str, again)) or "-"]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def markdown(args, rows: Sequence[Row]) -> str:
  lines = benchmarking.header(
      "End-to-end generation from long inputs: compressed vs uncompressed, side by side",
      args.command, *shape_lines(args), *measure_lines(args),
      f"host load average (1/5/15 min) before / after: "
      f"{getattr(args, 'load_before', 'n/a')} / {getattr(args, 'load_after', 'n/a')}.",
      args.note and f"note: {args.note}")
  main_rows = [r for r in rows if r.group != "scan"]
  lines += ["", TABLE_HEAD, TABLE_RULE, *[table_line(args, r, rows) for r in main_rows]]
  if any(r.group == "scan" for r in rows):
    lines += ["", "Break-even scan (no memory fit; the table's lengths are its other points):",
              "", TABLE_HEAD, TABLE_RULE,
              *[table_line(args, r, rows) for r in rows if r.group == "scan"]]
  lines += breakeven_lines(args, rows)
  if args.plot:
    lines += ["", f"![ratios to the reference vs n]({os.path.basename(args.plot)})"]
  return "\n".join(lines) + "\n"


def shape_lines(args) -> List[str]:
  """The results header's lines on the networks."""
  preset, decoder = args.preset_value, args.preset_value.decoder
  t5 = preset.t5
  return [
      f"shapes: {preset.source}. DeCAL: T5.1.1 layout, emb {t5.emb_dim}, {t5.num_heads} "
      f"heads x {t5.head_dim}, mlp {t5.mlp_dim}, {t5.num_encoder_layers} + "
      f"{t5.num_decoder_layers} layers, vocab {t5.vocab_size}, relative buckets "
      f"{t5.relative_attention_num_buckets} / distance {t5.relative_attention_max_distance}, "
      f"attention kernel '{t5.attention_kernel}', activations {jnp.dtype(t5.dtype).name}, "
      "weights float32, random.",
      ("Dodo / Squid / reference decoder: " + benchmarking.decoder_line(decoder)
       + f"; Squid's small decoder: {benchmarking.decoder_line(preset.squid_small)}; Dodo "
       "without LoRA (the scorer reads the compressing pass), scorer layer "
       f"{min(3, decoder.num_layers)}." if {"dodo", "squid"} & set(args.methods) else "")]


def measure_lines(args) -> List[str]:
  """The results header's lines on the work, the timing and the memory."""
  return [
      f"work: contexts of n random tokens (no padding), {args.new_tokens} generated tokens "
      "per sequence (EOS off), greedy (`temperature_sample`, top-k 1) unless a beam is named "
      "(`beam_search`); the program is `jax.jit(partial(model.predict_batch, num_decodes))`"
      ", the decoder's `DecoderOnlyModel.generate(prefill=True)`.",
      f"batch: {batch_text(args)}; times: median of {args.repeats} end-to-end runs after "
      f"{args.warmup} warm-up run(s), configurations of one group interleaved, order "
      "reversed every repeat; tok/s counts the returned sequence's tokens; CPU ms: this "
      "process's CPU time per run (`time.process_time`, all threads), the work done whatever "
      "share of the cores other processes take.",
      "need: XLA's `memory_analysis()` of the whole compiled encode + decode program: "
      "arguments (weights, the batch) + outputs (the tokens) + temporaries (XLA's buffer "
      "assignment: the most bytes live at once, e.g. attention scores, the decoding cache, "
      "the encoding's keys / values) - aliased bytes; a static estimate, not an allocator "
      f"reading. Largest batch: the needs at batches {' and '.join(map(str, fit_batches(args)))}"
      " give a line, fixed bytes + bytes per sequence; its batch at the budget is compiled "
      "and its need read, the next guess from the line through the needs nearest the budget, "
      "until a batch that fits sits next to one that does not ('>= B': the search stopped "
      f"first); budget {args.budget / GIB:.2f} GiB ({args.budget_source})."]


def batch_text(args) -> str:
  if args.batch == "auto":
    return (f"each configuration at its own largest batch in the budget (at most "
            f"{args.max_batch})")
  return f"{args.batch} sequences (every configuration)"


def plot(rows: Sequence[Row], path: str) -> None:
  """Per method (columns): sequences/s and the largest batch over the reference against n,
  one line per ratio (beam rows dashed)."""
  plt = results_files.pyplot()
  methods = list(dict.fromkeys(r.config.method for r in rows if r.config.method != REFERENCE))
  fig, axes = plt.subplots(2, max(1, len(methods)), figsize=(4.2 * max(1, len(methods)), 7),
                           squeeze=False)
  for column, method in enumerate(methods):
    for cfg in dict.fromkeys(r.config for r in rows if r.config.method == method
                             and r.side and r.config.reference != r.config):
      _plot_config(axes[:, column], cfg, rows)
    for ax, what in zip(axes[:, column], ("sequences/s (hollow: per CPU second)",
                                          "largest batch in the budget")):
      _ratio_axes(ax, f"{method}: {what} ÷ reference")
  fig.tight_layout()
  results_files.save_figure(fig, path)


def _plot_config(axes, cfg: Config, rows: Sequence[Row]) -> None:
  mine = sorted((r for r in rows if r.config == cfg and r.side), key=lambda r: r.n)
  pairs = [(r, ref) for r in mine for ref in [reference_row(r, rows)] if ref]
  style = "--" if cfg.beams > 1 else "-"
  speed = [(r.n, ratios(r, ref).sequences) for r, ref in pairs]
  if speed:
    (line,) = axes[0].plot(*zip(*speed), style + "o", label=cfg.name)
    axes[0].plot(*zip(*[(r.n, ratios(r, ref).cpu) for r, ref in pairs]), ":", marker="o",
                 mfc="none", color=line.get_color())  # per CPU second: hollow, dotted
  sized = [(r.n, ratios(r, ref).largest) for r, ref in pairs if ratios(r, ref).largest]
  if sized:
    axes[1].plot(*zip(*sized), style + "s", label=cfg.name)


def _ratio_axes(ax, title: str) -> None:
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("input length n (tokens)")
  ax.set_title(title, fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  if len(ax.lines) > 1:
    ax.legend(fontsize=7)
