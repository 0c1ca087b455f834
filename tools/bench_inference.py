"""End-to-end batched generation from long inputs, where compression should pay: encode n
tokens, greedily generate 128, for DeCAL's T5 at C = 1 / 2 / 4 / 8, Dodo at r = 5 / 10 / 20
and Squid at ρ = 4 / 16, as ratios to the uncompressed model measured side by side.

  python -m tools.bench_inference --out docs/results/inference_throughput_cpu.md \
      --plot docs/results/inference_throughput_cpu.png   # 2 CPU cores, reduced shapes
  python -m tools.bench_inference --gpu --out docs/results/inference_throughput_gpu.md \
      --plot docs/results/inference_throughput_gpu.png   # one GPU: T5.1.1-small, n = 4096

What runs is the library's own decode path, the program `python -m decal_jax.infer` jits:
`jax.jit(partial(model.predict_batch, num_decodes=k))` of an `EncoderDecoderModel` around
`Transformer` (DeCAL), `Dodo` or `Squid`, with `decoding.temperature_sample` at top-k 1
(greedy) or, in the beam rows, `decoding.beam_search`. Dodo's and Squid's reference is
the plain `Decoder` holding the same weights (Dodo's stack, which is also Squid's large
decoder) reading the whole context, `DecoderOnlyModel.generate(prefill=True)`. EOS is an id
no token has, so every row generates exactly --new_tokens tokens. Weights are random.

Per configuration: seconds per batch (the median of --repeats end-to-end runs after
--warmup; every configuration of one length is compiled first, then run in turn, the order
reversed every repeat), sequences/s, generated tokens/s (the returned sequence's tokens),
XLA's memory need of the compiled program (`memory_analysis()`: arguments + outputs +
temporaries - aliased bytes) and the largest batch within --memory_budget_gib: the needs at
two batch sizes (--fit_batches) give a line, fixed bytes + bytes per sequence x batch, whose
batch at the budget is the first guess; each guess is compiled and its own need read, the
next from the line through the needs nearest the budget, until a batch that fits sits next
to one that does not (`largest_batch`; ">= B" when the search stopped before that).
Ratios are to the reference at the same n, measured in the same interleaving. The
break-even scan times ratio --breakeven_ratio against the reference at --breakeven_lengths
too. `--batch auto` (--gpu's default) runs each configuration at its own largest batch.
--out and --plot are rewritten after every group, marked partial until the run completes.
"""
import argparse
import dataclasses
import functools
import math
import os
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from decal_jax import decoding, models
from decal_jax.networks.decoder import Decoder, DecoderConfig
from decal_jax.networks.dodo import Dodo, DodoConfig
from decal_jax.networks.squid import Squid, SquidConfig
from decal_jax.layers.attention import ATTENTION_KERNELS
from decal_jax.networks.t5 import T5Config, Transformer
from tools import benchmarking, results_files
from tools.benchmarking import (DoesNotFit, NoEos, Run, Side, check_fits, load_average, ms,
                                needed_bytes, timed)

REFERENCE = "decoder"  # Dodo's and Squid's uncompressed reference
GIB = 2**30


# ----------------------------------------------------------------------------- presets
class Preset(NamedTuple):
  t5: T5Config            # compression_ratio is set per row
  decoder: DecoderConfig  # Dodo's decoder = Squid's large decoder = the reference
  squid_small: DecoderConfig
  source: str
  defaults: Dict[str, Any]  # the command-line defaults of this preset


def _t5(dtype: str, **sizes) -> T5Config:
  """decal.gin's T5 (relative buckets 128, distance 512) at these sizes."""
  return T5Config(dropout_rate=0.0, relative_attention_num_buckets=128,
                  relative_attention_max_distance=512, dtype=dtype, **sizes)


def _decoder(dtype: str, vocab: int, emb: int, heads: int, mlp: int, layers: int,
             head_dim: int = 64) -> DecoderConfig:
  return DecoderConfig(vocab_size=vocab, emb_dim=emb, num_heads=heads, head_dim=head_dim,
                       mlp_dim=mlp, num_layers=layers, dtype=jnp.dtype(dtype))


def cpu_preset(dtype: str = "float32") -> Preset:
  """Half docs/performance.md's "reduced small" T5 (width 128, 2 + 2 layers), so that the
  whole CPU run takes under 20 minutes on 2 shared cores."""
  return Preset(
      _t5(dtype, vocab_size=4224, emb_dim=128, num_heads=2, head_dim=64, mlp_dim=512,
          num_encoder_layers=2, num_decoder_layers=2),
      _decoder(dtype, 4224, 128, 2, 512, 2), _decoder(dtype, 4224, 64, 1, 256, 1),
      "the `cpu` preset (tools/bench_inference.py)",
      dict(lengths="1024,4096", breakeven_lengths="128,256,512,2048", batch="2",
           methods="decal,dodo,squid", memory_budget_gib=8.0))


def gpu_preset(dtype: str = "bfloat16") -> Preset:
  """T5.1.1-small's published shapes (models/t5_1_1_small.gin) at n = 4096, bf16
  activations; the LLaMA-style family at a matching width when --methods asks for it."""
  return Preset(
      _t5(dtype), _decoder(dtype, 32128, 512, 8, 1408, 8),
      _decoder(dtype, 32128, 256, 4, 704, 4),
      "T5.1.1-small (gin/models/t5_1_1_small.gin + decal.gin), the `gpu` preset",
      dict(lengths="4096", breakeven_lengths="", batch="auto", methods="decal",
           memory_budget_gib=None, beams=0, search_tries=1))


def tiny_preset(dtype: str = "float32") -> Preset:
  return Preset(
      _t5(dtype, vocab_size=61, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
          num_encoder_layers=1, num_decoder_layers=1),
      _decoder(dtype, 61, 16, 2, 32, 2, head_dim=8), _decoder(dtype, 61, 16, 1, 32, 1, 8),
      "the `tiny` preset (tests)",
      dict(lengths="32", breakeven_lengths="16", batch="2", methods="decal,dodo,squid",
           memory_budget_gib=0.01))


PRESETS: Dict[str, Callable[..., Preset]] = {"cpu": cpu_preset, "gpu": gpu_preset,
                                             "tiny": tiny_preset}


# ----------------------------------------------------------------------------- configurations
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


class Program(NamedTuple):
  predict: Callable  # (params, batch) -> generated tokens [batch, new_tokens]
  params: Any
  vocab: int


class Zoo:
  """Every network of a run and its random weights, made once. Dodo's stack is also the
  reference decoder's and Squid's large decoder (one set of weights for the family)."""

  def __init__(self, preset: Preset, longest: int, new_tokens: int,
               squid_ratios: Sequence[int], seed: int):
    self.preset, self.new_tokens, self.seed = preset, new_tokens, seed
    self.decoder = dataclasses.replace(preset.decoder, max_length=longest + new_tokens)
    memory = -(-longest // min(squid_ratios)) if squid_ratios else 1  # N = ceil(n / ρ)
    small = dataclasses.replace(preset.squid_small, max_length=longest + memory)
    self.squid = SquidConfig(small=small, large=self.decoder, memory_tokens=memory)
    self._params: Dict[Tuple[str, int], Any] = {}

  def network(self, cfg: Config):
    if cfg.method == "decal":
      return Transformer(dataclasses.replace(self.preset.t5, compression_ratio=cfg.ratio))
    if cfg.method == "dodo":
      return Dodo(DodoConfig(decoder=self.decoder, compression_ratio=float(cfg.ratio),
                             scorer_layer=min(3, self.decoder.num_layers)))
    if cfg.method == "squid":
      return Squid(dataclasses.replace(self.squid, memory_ratio=cfg.ratio))
    return Decoder(self.decoder)

  def params(self, cfg: Config):
    """Random weights; DeCAL's per C, the LLaMA-style family's shared."""
    key = (cfg.method, cfg.ratio if cfg.method == "decal" else 0)
    if key not in self._params:
      self._params[key] = self._make(cfg)
    return self._params[key]

  def _make(self, cfg: Config):
    if cfg.method == REFERENCE:
      return {"stack": self.params(Config("dodo", 1))["stack"]}
    tokens = jnp.ones((1, 4), jnp.int32)
    network = self.network(cfg)
    shapes = jax.eval_shape(lambda: network.init(
        jax.random.PRNGKey(0), tokens, tokens, tokens, enable_dropout=False))["params"]
    params = benchmarking.random_params(shapes, jnp.float32, self.seed)
    if cfg.method == "squid":  # the large decoder is Dodo's stack (same shapes)
      params = {**params, "large_decoder": share(self.params(Config("dodo", 1))["stack"],
                                                 params["large_decoder"])}
    return params

  def program(self, cfg: Config) -> Program:
    """The library's decode of this configuration, ready to jit."""
    network, vocab = self.network(cfg), self.decoder.vocab_size
    if cfg.method == "decal":
      vocab = self.preset.t5.vocab_size
    if cfg.method == REFERENCE:
      model = models.DecoderOnlyModel(network, NoEos(), decode_fn=decoding.temperature_sample)
      predict = lambda params, batch: model.generate(
          params, batch["encoder_input_tokens"], self.new_tokens, prefill=True)
      return Program(predict, self.params(cfg), vocab)
    decode_fn = decoding.temperature_sample if cfg.beams == 1 else decoding.beam_search
    model = models.EncoderDecoderModel(network, NoEos(), NoEos(), decode_fn=decode_fn)
    return Program(functools.partial(model.predict_batch, num_decodes=cfg.beams),
                   self.params(cfg), vocab)


def share(ours, theirs):
  """`ours` in place of `theirs` (a tree of the same names and shapes)."""
  shapes = lambda tree: {k: v.shape for k, v in flax.traverse_util.flatten_dict(tree).items()}
  if shapes(ours) != shapes(theirs):
    raise ValueError("Squid's large decoder and Dodo's stack differ: build both from one "
                     "DecoderConfig.")
  return ours


def make_batch(program: Program, batch: int, n: int, new_tokens: int, seed: int = 0):
  """Random context tokens [batch, n] (ids 2.., no padding) and the decoder's buffer."""
  rng = np.random.RandomState(seed + n)
  tokens = rng.randint(2, program.vocab, (batch, n))  # [batch, n]
  return {"encoder_input_tokens": jnp.asarray(tokens, jnp.int32),
          "decoder_input_tokens": jnp.zeros((batch, new_tokens), jnp.int32)}  # [batch, t]


# ----------------------------------------------------------------------------- memory
@dataclasses.dataclass(frozen=True)
class MemoryFit:
  """XLA's memory need at two batch sizes, and the line through them."""
  batches: Tuple[int, int]
  needed: Tuple[int, int]  # bytes

  @property
  def per_sequence(self) -> float:
    return (self.needed[1] - self.needed[0]) / (self.batches[1] - self.batches[0])

  @property
  def fixed(self) -> float:  # weights, mostly
    return self.needed[0] - self.per_sequence * self.batches[0]

  def largest_batch(self, budget: float) -> int:
    """The largest batch whose need on the line is within `budget` bytes (0: none)."""
    if self.per_sequence <= 0:
      raise ValueError(f"The memory need does not grow with the batch ({self.needed} bytes "
                       f"at batches {self.batches}); no batch limit follows.")
    return max(0, math.floor((budget - self.fixed) / self.per_sequence))


class Compiler:
  """One configuration's program at length n, compiled once per batch size asked for."""

  def __init__(self, program: Program, n: int, new_tokens: int):
    self.program, self.n, self.new_tokens = program, n, new_tokens
    self._done: Dict[int, Tuple[Any, tuple]] = {}

  def __call__(self, batch: int) -> Tuple[Any, tuple]:
    """(the compiled program, its arguments) at this batch size."""
    if batch not in self._done:
      args = (self.program.params, make_batch(self.program, batch, self.n, self.new_tokens))
      self._done[batch] = jax.jit(self.program.predict).lower(*args).compile(), args
    return self._done[batch]

  def need(self, batch: int) -> int:
    """XLA's memory need (bytes) of the program at this batch size."""
    return needed_bytes(self(batch)[0])


class Largest(NamedTuple):
  """The largest batch within a budget, by XLA's own need at it: `batch` fits; when `exact`,
  batch + 1 was compiled too and does not."""
  batch: int
  exact: bool

  def __str__(self) -> str:
    return f"{self.batch}" if self.exact else f">= {self.batch}"


def largest_batch(need: Callable[[int], int], batches: Tuple[int, int], budget: float,
                  tries: int = 4) -> Tuple[MemoryFit, Largest]:
  """(the line through the needs at `batches`, the largest batch within `budget`). XLA's
  buffer assignment does not grow exactly linearly, so the line only gives the first
  guess: each guess is compiled and its need read, and the next one comes from the line
  through the two known needs around the budget, until a batch that fits sits next to one
  that does not (at most `tries` compiles past the fit)."""
  fit = MemoryFit(batches, tuple(need(b) for b in batches))
  known = dict(zip(batches, fit.needed))
  for attempt in range(tries + 1):
    fits = max((b for b, m in known.items() if m <= budget), default=0)
    over = min((b for b, m in known.items() if m > budget), default=None)
    if over == fits + 1:
      return fit, Largest(fits, True)
    if attempt < tries:
      guess = max(fits + 1, _next_guess(known, budget, fits, over))
      guess = guess if over is None else min(guess, over - 1)
      known[guess] = need(guess)
  return fit, Largest(fits, False)


def _next_guess(known: Dict[int, int], budget: float, fits: int, over: Optional[int]) -> int:
  """The budget's batch on the line through the known needs just under and over it (or,
  lacking one side, the two nearest the side known)."""
  order = sorted(known)
  pair = (fits, over) if fits and over else tuple(order[:2] if over else order[-2:])
  try:
    return MemoryFit(pair, (known[pair[0]], known[pair[1]])).largest_batch(budget)
  except ValueError:  # equal needs at both: no slope, step on
    return fits + 1


# ----------------------------------------------------------------------------- rows
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


def prepare(args, zoo: Zoo, n: int, cfg: Config, group: str, fit: bool) -> Row:
  """Compiles one configuration at length n (and its memory fit); a Row with its Side."""
  compiler, row = Compiler(zoo.program(cfg), n, args.new_tokens), Row(n, cfg, group,
                                                                     args.new_tokens)
  try:
    if fit:
      row.fit, row.largest = largest_batch(compiler.need, fit_batches(args), args.budget,
                                           args.search_tries)
    row.batch = run_batch(args, row)
    exe, inputs = compiler(row.batch)
    check_fits(exe, f"{cfg.name} at n = {n}, batch {row.batch}")
    row.needed = needed_bytes(exe)
    row.side = Side(cfg.name, runner(exe, inputs), row.needed)
  except DoesNotFit as e:
    row.note = f"did not fit: {e}"
  except ValueError as e:  # a need that does not grow with the batch (MemoryFit)
    row.note = f"no memory fit: {e}"
  return row


def fit_batches(args) -> Tuple[int, int]:
  if args.fit_batches:
    return tuple(args.fit_batches)
  return (16, 64) if args.batch == "auto" else (int(args.batch), 8 * int(args.batch))


def run_batch(args, row: Row) -> int:
  if args.batch != "auto":
    return int(args.batch)
  if not row.largest or not row.largest.batch:
    raise DoesNotFit(f"not even batch {fit_batches(args)[0]} fits the "
                     f"{args.budget / GIB:.2f} GiB budget")
  return min(row.largest.batch, args.max_batch)


def runner(exe, inputs) -> Callable[[], Run]:
  """One end-to-end run: wall seconds and this process's CPU seconds (all its threads: on a
  shared machine, the work done rather than the time the scheduler gave it)."""
  def run() -> Run:
    start = time.process_time()
    tokens, seconds = timed(exe, *inputs)
    return Run({"wall": seconds, "cpu": time.process_time() - start}, np.asarray(tokens))
  return run


def measure_group(args, zoo: Zoo, n: int, configs: Sequence[Config], group: str,
                  fit: bool) -> List[Row]:
  """Compiles every configuration, then runs them side by side (benchmarking.measure_sides)."""
  rows = [prepare(args, zoo, n, cfg, group, fit) for cfg in configs]
  benchmarking.measure_sides([r.side for r in rows if r.side], args.warmup, args.repeats,
                             f"{group} n={n}")
  for row in rows:
    print(summary_line(args, row, rows), flush=True)
  return rows


# ----------------------------------------------------------------------------- the run
def table_configs(args) -> List[Config]:
  """Every method at its ratios and at the break-even ratio; the decoder reference before
  Dodo and Squid."""
  configs = []
  for method in args.methods:
    if method != "decal" and Config(REFERENCE, 1) not in configs:
      configs.append(Config(REFERENCE, 1))
    ratios = {*args.ratios[method], args.breakeven_ratio} | ({1} if method == "decal" else set())
    configs += [Config(method, r) for r in sorted(ratios)]
  return configs


def groups(args) -> List[Tuple[int, List[Config], str, bool]]:
  """(n, configurations, group, memory fit?) in the order they run."""
  out = [(n, table_configs(args), "table", True) for n in args.lengths]
  if args.beams > 1 and "decal" in args.methods:
    out.append((args.beam_length, [Config("decal", 1, args.beams),
                                   Config("decal", args.breakeven_ratio, args.beams)],
                "beam", True))
  pairs = [c for m in args.methods for c in (Config(m, args.breakeven_ratio),
                                            Config(m, args.breakeven_ratio).reference)]
  order = {"decal": 0, REFERENCE: 1, "dodo": 2, "squid": 3}
  pairs = sorted(set(pairs), key=lambda c: (order[c.method], c.ratio))
  out += [(n, pairs, "scan", args.batch == "auto") for n in args.breakeven_lengths
          if n not in args.lengths]
  return out


def run(args) -> List[Row]:
  args.load_before = load_average()
  longest = max(n for n, *_ in groups(args))
  zoo = Zoo(args.preset_value, longest, args.new_tokens,
            args.ratios["squid"] + [args.breakeven_ratio] if "squid" in args.methods else [],
            args.seed)
  rows, todo = [], groups(args)
  for i, (n, configs, group, fit) in enumerate(todo):
    rows += measure_group(args, zoo, n, configs, group, fit)
    results_files.write_partial(args, rows, i + 1, len(todo),
                                lambda done: markdown(args, done), plot, unit="groups")
  args.load_after = load_average()
  return rows


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


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  parser.add_argument("--gpu", action="store_true", help="--preset gpu: T5.1.1-small, "
                      "n = 4096, bf16, each configuration at the batch that fills memory")
  parser.add_argument("--methods", default=None, help="comma-separated: decal, dodo, squid")
  parser.add_argument("--decal_ratios", default="1,2,4,8", help="DeCAL's C")
  parser.add_argument("--dodo_ratios", default="5,10,20", help="Dodo's r")
  parser.add_argument("--squid_ratios", default="4,16", help="Squid's ρ")
  parser.add_argument("--lengths", default=None, help="input lengths n of the table")
  parser.add_argument("--breakeven_lengths", default=None, help="more lengths for the "
                      "break-even scan ('' for none)")
  parser.add_argument("--breakeven_ratio", type=int, default=4)
  parser.add_argument("--new_tokens", type=int, default=128, help="generated per sequence")
  parser.add_argument("--batch", default=None, help="sequences per batch, or 'auto'")
  parser.add_argument("--fit_batches", default=None, help="the two batch sizes of the "
                      "memory fit (default: --batch and 8 x --batch; --batch auto: 16,64)")
  parser.add_argument("--max_batch", type=int, default=2048, help="--batch auto's cap")
  parser.add_argument("--search_tries", type=int, default=None, help="compiles past the "
                      "fit in the search for the largest batch (default 4; --gpu 1)")
  parser.add_argument("--beams", type=int, default=None, help="the beam rows' width (0: none)")
  parser.add_argument("--beam_length", type=int, default=None, help="their n (default: "
                      "the first of --lengths)")
  parser.add_argument("--memory_budget_gib", type=float, default=None)
  parser.add_argument("--attention_kernel", default="einsum", choices=ATTENTION_KERNELS,
                      help="DeCAL's T5 attention (T5Config.attention_kernel)")
  benchmarking.add_side_by_side_args(parser)
  args = parser.parse_args(argv)
  _apply_preset(parser, args, "gpu" if args.gpu else args.preset)
  _check(parser, args)
  args.command = benchmarking.command("tools.bench_inference", argv)
  return args


def _apply_preset(parser, args, name: str) -> None:
  preset = PRESETS[name]() if args.dtype is None else PRESETS[name](args.dtype)
  try:
    preset = preset._replace(t5=dataclasses.replace(preset.t5,
                                                    attention_kernel=args.attention_kernel))
  except ValueError as e:  # e.g. cuDNN with float32
    parser.error(str(e))
  args.preset, args.preset_value = name, preset
  for key, value in preset.defaults.items():
    if getattr(args, key, None) is None:
      setattr(args, key, value)
  args.beams = 4 if args.beams is None else args.beams
  args.search_tries = 4 if args.search_tries is None else args.search_tries
  lists = lambda text, flag: benchmarking.int_list(parser, text, flag) if text else []
  args.lengths = lists(args.lengths, "--lengths")
  args.breakeven_lengths = lists(args.breakeven_lengths, "--breakeven_lengths")
  args.ratios = {m: lists(getattr(args, f"{m}_ratios"), f"--{m}_ratios")
                 for m in ("decal", "dodo", "squid")}
  args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  args.fit_batches = lists(args.fit_batches, "--fit_batches")
  args.beam_length = args.beam_length or (args.lengths[0] if args.lengths else 0)
  if args.memory_budget_gib:
    args.budget, args.budget_source = args.memory_budget_gib * GIB, "--memory_budget_gib"
  else:
    args.budget, args.budget_source = default_budget()


def default_budget() -> Tuple[float, str]:
  """90 % of the device's memory limit (an accelerator), else half the free host memory."""
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return 0.9 * stats["bytes_limit"], "90 % of the device's bytes_limit"
  have = benchmarking.available_bytes()
  return (0.5 * have, "half the free host memory") if have else (8 * GIB, "8 GiB")


def _check(parser, args) -> None:
  unknown = set(args.methods) - {"decal", "dodo", "squid"}
  if unknown or not args.methods:
    parser.error(f"--methods takes decal, dodo, squid; got {sorted(unknown) or 'none'}.")
  if not args.lengths:
    parser.error("--lengths needs at least one input length.")
  if args.batch != "auto" and not str(args.batch).isdigit() or args.batch == "0":
    parser.error(f"--batch must be a positive integer or 'auto', got {args.batch!r}.")
  if args.fit_batches and (len(args.fit_batches) != 2
                           or args.fit_batches[0] >= args.fit_batches[1]):
    parser.error("--fit_batches needs two increasing batch sizes, e.g. 8,16.")
  for name in ("new_tokens", "repeats", "breakeven_ratio", "max_batch"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}.")
  if min(args.warmup, args.beams, args.search_tries) < 0:
    parser.error("--warmup, --beams and --search_tries must be >= 0.")


def main(argv=None) -> List[Row]:
  return benchmarking.run_and_report(parse_args(argv), run, markdown, plot)


if __name__ == "__main__":
  main()
