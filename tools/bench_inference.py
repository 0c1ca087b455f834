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
import time
from typing import Any, Callable, Dict, List, NamedTuple, Sequence, Tuple

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
from tools.benchmarking import (DoesNotFit, NoEos, Run, Side, check_fits, largest_batch,
                                load_average, needed_bytes, timed)
from tools.inference_report import (GIB, REFERENCE, Config, Row, fit_batches, markdown, plot,
                                    summary_line)


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


# ----------------------------------------------------------------------------- rows
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
