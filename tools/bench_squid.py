"""Squid against its large decoder reading the whole context: latency and FLOPs, side by side.

  python -m tools.bench_squid --contexts 512,2048,8192 --ratios 4,8,16 \
      --out docs/results/squid_latency_cpu.md --plot docs/results/squid_latency_cpu.png
  python -m tools.bench_squid --preset qwen2 --out docs/results/squid_latency_gpu.md  # a GPU

For every context length L and compression ratio ρ (N = L / ρ memory tokens, fixed-N mode),
with one query of --query_length tokens and --answer_length greedy answer tokens:
  * baseline: `Decoder(large)`, holding Squid's own large-decoder weights, prefills
    [context; query] into its KV cache (logits at the last position only: the first answer
    token) and decodes the other answer tokens one jitted step each;
  * Squid: compress (the small decoder over [context; N memory tokens], then the projector),
    read (the large decoder's keys / values of [N projected vectors; query]), then
    --answer_length jitted steps from BOS (`Squid.decode` with its cache).
Each end-to-end run is timed by phase after compilation and one untimed warm-up run; the
baseline and every ρ run once per repeat, in an order that reverses every repeat, so load on
a shared machine hits all sides alike; reported times are medians over --repeats. FLOPs are
analytical (`decal_jax.networks.flops`: dense attention as computed, LM head where logits are read),
with XLA's own count of the compiled programs beside them as a check. Before the largest
programs run, their compiled memory need is compared with the memory available; a size that
does not fit is reported as such. Weights are random: the timing does not depend on them.
Presets: `cpu` (a small / large pair sized for a 2-core CPU), `qwen2` (Qwen2-0.5B -> Qwen2-7B
shapes, bf16: for a GPU), `tiny` (tests). --out and --plot are rewritten after every context
length, marked partial until the run completes, so a run stopped midway keeps its rows.
"""
import argparse
import dataclasses
import os
import pathlib
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from decal_jax.networks import flops
from tools import benchmarking, results_files
from tools.benchmarking import (DoesNotFit, Run, Side, available_bytes, check_fits,
                                    decoder_line, gflop, gib, greedy, greedy_steps,
                                    load_average, ms, needed_bytes, timed, xla_cost,
                                    zeros_like_tree)
from decal_jax.networks.decoder import Decoder, DecoderConfig, causal_bias
from decal_jax.networks.squid import Squid, SquidConfig

QWEN2_GIN = "models/squid_qwen2.gin"  # under the package's gin files (gin_utils.GIN_DIR)


# ----------------------------------------------------------------------------- presets
class Preset(NamedTuple):
  small: DecoderConfig
  large: DecoderConfig
  dtype: str
  source: str  # where the shapes come from (written into the results)


def _cpu_preset() -> Preset:
  """Qwen2's proportions shrunk: GQA, q/k/v bias, tied small / untied large embeddings, mlp
  4-5x emb. Over L = 512 / 2048 / 8192 positions the large decoder does 20.9 / 14.7 / 10.3x
  the small one's FLOPs (Qwen2-7B / 0.5B: 17.4 / 15.6 / 11.5x)."""
  common = dict(vocab_size=4224, qkv_bias=True, rope_theta=1e6, norm_epsilon=1e-6)
  return Preset(
      DecoderConfig(emb_dim=128, num_heads=2, num_kv_heads=1, head_dim=64, mlp_dim=640,
                    num_layers=2, tie_embeddings=True, **common),
      DecoderConfig(emb_dim=512, num_heads=4, num_kv_heads=2, head_dim=128, mlp_dim=2048,
                    num_layers=4, **common),
      "float32", "the `cpu` preset (shapes in tools/bench_squid.py)")


def _tiny_preset() -> Preset:
  common = dict(vocab_size=67, qkv_bias=True, num_heads=2, num_kv_heads=1, head_dim=8)
  return Preset(DecoderConfig(emb_dim=16, mlp_dim=32, num_layers=1, tie_embeddings=True,
                              **common),
                DecoderConfig(emb_dim=32, mlp_dim=64, num_layers=2, **common),
                "float32", "the `tiny` preset (tests)")


def _qwen2_hard_coded() -> Tuple[DecoderConfig, DecoderConfig]:
  """Qwen2-0.5B and Qwen2-7B from their Hugging Face config.json values."""
  common = dict(qkv_bias=True, rope_theta=1e6, norm_epsilon=1e-6)
  return (DecoderConfig(vocab_size=151936, emb_dim=896, num_heads=14, num_kv_heads=2,
                        head_dim=64, mlp_dim=4864, num_layers=24, tie_embeddings=True,
                        **common),
          DecoderConfig(vocab_size=152064, emb_dim=3584, num_heads=28, num_kv_heads=4,
                        head_dim=128, mlp_dim=18944, num_layers=28, **common))


def decoders_from_gin(path: pathlib.Path) -> Tuple[DecoderConfig, DecoderConfig]:
  """(small, large) `DecoderConfig`s that a Squid model gin file binds."""
  import gin  # only this preset needs gin (and the task registry gin_utils imports)
  from decal_jax.runtime import gin_utils
  gin_utils.parse([str(path)], [], [])
  try:
    config = gin.query_parameter("squid.Squid.config").scoped_configurable_fn()
  finally:
    gin.clear_config()
  return config.small, config.large


def _qwen2_preset() -> Preset:
  from decal_jax.runtime import gin_utils
  path = gin_utils.GIN_DIR / QWEN2_GIN
  if path.exists():
    try:
      small, large = decoders_from_gin(path)
      return Preset(small, large, "bfloat16", f"gin/{QWEN2_GIN}")
    except (Exception, SystemExit) as e:
      tqdm.tqdm.write(f"could not read {path} ({e}); using the hard-coded Qwen2 shapes")
  small, large = _qwen2_hard_coded()
  return Preset(small, large, "bfloat16", "Qwen2-0.5B / Qwen2-7B config.json values "
                "(hard-coded in tools/bench_squid.py)")


PRESETS: Dict[str, Callable[[], Preset]] = {"cpu": _cpu_preset, "qwen2": _qwen2_preset,
                                            "tiny": _tiny_preset}


def squid_config(args) -> SquidConfig:
  """The benchmark's SquidConfig with the most memory tokens any row needs; max_length
  covers the longest context (small: L + N; large, for the baseline: L + query + answer)."""
  preset = args.preset_value
  dtype = jnp.dtype(args.dtype or preset.dtype)
  longest = max(args.contexts)
  small = dataclasses.replace(preset.small, max_length=longest + max_memory(args),
                              dtype=dtype, dropout_rate=0.0, lora_rank=0, lora_adapters=())
  large = dataclasses.replace(preset.large, dtype=dtype, dropout_rate=0.0, lora_rank=0,
                              lora_adapters=(),
                              max_length=longest + args.query_length + args.answer_length)
  return SquidConfig(small=small, large=large, memory_tokens=max_memory(args))


def memory_count(context: int, ratio: int) -> int:
  return -(-context // ratio)  # N = ceil(L / ρ)


def max_memory(args) -> int:
  return max(memory_count(c, r) for c in args.contexts for r in args.ratios)


# ----------------------------------------------------------------------------- models
class Models(NamedTuple):
  config: SquidConfig       # memory_tokens = the most any row needs
  squid_params: dict
  decoder: Decoder          # the baseline: Squid's large decoder alone
  decoder_params: dict      # {'stack': squid_params['large_decoder']} (the same arrays)


def _param_shapes(config: SquidConfig):
  tokens = jnp.ones((1, 4), jnp.int32)
  return jax.eval_shape(lambda: Squid(config).init(
      jax.random.PRNGKey(0), tokens, tokens, tokens, query_tokens=tokens,
      enable_dropout=False))["params"]


def param_bytes(config: SquidConfig) -> int:
  """Bytes of the weights in the compute dtype (how the benchmark holds them)."""
  return benchmarking.param_count(_param_shapes(config)) * jnp.dtype(config.large.dtype).itemsize


def build(config: SquidConfig, seed: int = 0) -> Models:
  """Random Squid weights (after checking that they fit) and the baseline sharing them."""
  benchmarking.check_weights_fit(param_bytes(config), available_bytes())
  params = benchmarking.random_params(_param_shapes(config), config.large.dtype, seed)
  return Models(config, params, Decoder(config.large), {"stack": params["large_decoder"]})


def squid_with_memory(models: Models, n: int) -> Tuple[Squid, dict]:
  """Squid with N = n fixed memory tokens: the first n rows of the shared memory table."""
  config = dataclasses.replace(models.config, memory_tokens=n)
  table = models.squid_params["memory_tokens"]["memory_embeddings"]
  params = {**models.squid_params, "memory_tokens": {"memory_embeddings": table[:n]}}
  return Squid(config), params


# ----------------------------------------------------------------------------- sides
def _prefill_last_logits(module: Decoder, tokens):
  """`Decoder`'s prefill, but only the last position's logits (the first answer token): the
  LM head over the whole prompt would charge the baseline for logits nobody reads."""
  batch, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  module.step_counter(batch, advance=length)
  x = module.stack(module.stack.embed(tokens), positions,
                   causal_bias(positions, None, module.config.dtype), decode=True,
                   prefill=True)  # [batch, length, embed]
  return module.stack.logits(x[:, -1:])  # [batch, 1, vocab]


def baseline_side(decoder: Decoder, params, context, query, answer_length: int) -> Side:
  """The large decoder prefills [context; query] (cache of prompt + answer slots), then
  answer_length - 1 greedy steps."""
  prompt = jnp.concatenate([context, query], axis=1)  # [batch, L + q]
  batch, length = prompt.shape
  cache_shapes = jax.eval_shape(lambda p: decoder.apply(
      {"params": p}, jnp.ones((batch, length + answer_length), jnp.int32), decode=True,
      enable_dropout=False, mutable=["cache"])[1]["cache"], params)
  fresh_cache = zeros_like_tree(cache_shapes)

  def prefill(params, cache, tokens):
    logits, new = decoder.apply({"params": params, "cache": cache}, tokens,
                                method=_prefill_last_logits, mutable=["cache"])
    return greedy(logits), new["cache"]

  def step(params, cache, token):
    logits, new = decoder.apply({"params": params, "cache": cache}, token, decode=True,
                                enable_dropout=False, mutable=["cache"])
    return greedy(logits), new["cache"]

  cache = fresh_cache()
  prefill_fn = jax.jit(prefill, donate_argnums=1).lower(params, cache, prompt).compile()
  check_fits(prefill_fn, f"the baseline's prefill of {length} tokens")
  first = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
  step_fn = jax.jit(step, donate_argnums=1).lower(params, cache, first).compile()

  def run() -> Run:
    cache = jax.block_until_ready(fresh_cache())
    (token, cache), prefill_s = timed(prefill_fn, params, cache, prompt)
    tokens = [token]
    steps = greedy_steps(step_fn, params, answer_length - 1, tokens)
    (token, cache), generation_s = timed(steps, cache, token)
    return Run({"prefill": prefill_s, "generation": generation_s},
               np.concatenate([np.asarray(t) for t in tokens], axis=1))

  xla = (xla_cost(prefill_fn) + (answer_length - 1) * xla_cost(step_fn)) / batch
  return Side("baseline", run, needed_bytes(prefill_fn), xla)


def squid_side(squid: Squid, params, context, query, answer_length: int, name: str) -> Side:
  """Compress, read, then answer_length greedy steps from BOS."""
  batch = context.shape[0]
  compress = jax.jit(lambda p, t: squid.apply({"params": p}, t, method=Squid.compress))
  read = jax.jit(lambda p, c, q: squid.apply({"params": p}, c, q, method=Squid.read))
  compress_fn = compress.lower(params, context).compile()
  check_fits(compress_fn, f"{name}'s compress of {context.shape[1]} tokens")
  compressed = jax.eval_shape(compress, params, context)
  read_fn = read.lower(params, compressed, query).compile()
  prefix = jax.eval_shape(read, params, compressed, query)
  answer = jnp.ones((batch, answer_length), jnp.int32)
  cache_shapes = jax.eval_shape(lambda p, pre: squid.apply(
      {"params": p}, pre, None, answer, decode=True, enable_dropout=False, mutable=["cache"],
      method=Squid.decode)[1]["cache"], params, prefix)
  fresh_cache = zeros_like_tree(cache_shapes)

  def step(params, cache, prefix, token):
    logits, new = squid.apply({"params": params, "cache": cache}, prefix, None, token,
                              decode=True, enable_dropout=False, mutable=["cache"],
                              method=Squid.decode)
    return greedy(logits), new["cache"]

  bos = jnp.zeros((batch, 1), jnp.int32)
  step_fn = jax.jit(step, donate_argnums=1).lower(params, fresh_cache(), prefix,
                                                  bos).compile()

  def run() -> Run:
    cache = jax.block_until_ready(fresh_cache())
    compressed, compress_s = timed(compress_fn, params, context)
    prefix, read_s = timed(read_fn, params, compressed, query)
    tokens = []
    steps = greedy_steps(step_fn, params, answer_length, tokens, prefix)
    _, generation_s = timed(steps, cache, bos)
    return Run({"compress": compress_s, "read": read_s, "generation": generation_s},
               np.concatenate([np.asarray(t) for t in tokens], axis=1))

  xla = (xla_cost(compress_fn) + xla_cost(read_fn) + answer_length * xla_cost(step_fn)) / batch
  return Side(name, run, needed_bytes(compress_fn), xla)


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Row:
  context: int
  ratio: int
  memory: int
  baseline: Optional[Side] = None
  squid: Optional[Side] = None
  base_flops: Optional[flops.AnswerFlops] = None
  squid_flops: Optional[flops.SquidFlops] = None
  inputs: Optional[Tuple[np.ndarray, np.ndarray]] = None  # (context, query) token ids
  note: str = ""


def run(args) -> List[Row]:
  """Every (L, ρ) row; after each context length, the rows so far are written as partial
  results (`results_files.write_partial`), so a run stopped midway keeps them."""
  args.load_before = load_average()
  config = squid_config(args)
  models = build(config, args.seed)
  rows, total = [], len(args.contexts) * len(args.ratios)
  for length in tqdm.tqdm(args.contexts, desc="contexts", dynamic_ncols=True):
    rows += measure_length(args, models, length)
    results_files.write_partial(args, rows, len(rows), total,
                                lambda done: markdown(args, done), plot)
  args.load_after = load_average()
  return rows


def measure_length(args, models: Models, length: int) -> List[Row]:
  """The rows of context length `length`, one per ρ: the baseline and every Squid measured
  side by side (a side that does not fit: a note in its row)."""
  config = models.config
  rng = np.random.RandomState(args.seed + length)
  vocab = config.vocab_size
  context = jnp.asarray(rng.randint(2, vocab, (args.batch, length)), jnp.int32)
  query = jnp.asarray(rng.randint(2, vocab, (args.batch, args.query_length)), jnp.int32)
  prompt_length = length + args.query_length
  base_flops = flops.answer_flops(config.large, prompt_length, args.answer_length)
  inputs = (np.asarray(context), np.asarray(query))
  length_rows = [Row(length, r, memory_count(length, r), base_flops=base_flops,
                     inputs=inputs) for r in args.ratios]
  try:
    baseline = baseline_side(models.decoder, models.decoder_params, context, query,
                             args.answer_length)
  except DoesNotFit as e:
    for row in length_rows:
      row.note = f"baseline did not fit: {e}"
    return length_rows
  sides = [baseline]
  for row in length_rows:
    squid, params = squid_with_memory(models, row.memory)
    row.baseline = baseline
    row.squid_flops = flops.squid_flops(squid.config, length, args.query_length,
                                        args.answer_length)
    try:
      row.squid = squid_side(squid, params, context, query, args.answer_length,
                             f"Squid ρ={row.ratio}")
      sides.append(row.squid)
    except DoesNotFit as e:
      row.note = f"Squid did not fit: {e}"
  benchmarking.measure_sides(sides, args.warmup, args.repeats, f"L={length}")
  for row in length_rows:
    tqdm.tqdm.write(_summary(row))
  return length_rows


# ----------------------------------------------------------------------------- report
def latency_ratio(row: Row) -> float:
  return row.baseline.median() / row.squid.median()


def large_flop_ratio(row: Row) -> float:
  return row.base_flops.total / row.squid_flops.large_decoder


def total_flop_ratio(row: Row) -> float:
  return row.base_flops.total / row.squid_flops.total


def _summary(row: Row) -> str:
  return f"L={row.context} ρ={row.ratio} N={row.memory}: " + (row.note or (
      f"baseline {row.baseline.median():.3f} s, Squid {row.squid.median():.3f} s "
      f"({latency_ratio(row):.2f}x); large-decoder FLOP ratio {large_flop_ratio(row):.1f}"))


def table(rows: Sequence[Row]) -> List[str]:
  lines = [
      "| L | ρ | N | baseline ms: prefill / generation | baseline ms end to end (min-max) "
      "| Squid ms: compress / read / generation | Squid ms end to end (min-max) "
      "| latency ratio "
      "| large-decoder GFLOP baseline / Squid | large-decoder FLOP ratio "
      "| total GFLOP baseline / Squid | total FLOP ratio | XLA GFLOP baseline / Squid "
      "| GiB prefill / compress |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    if row.note:
      lines.append(f"| {row.context} | {row.ratio} | {row.memory} | {row.note} |" + " |" * 10)
      continue
    base, squid = row.baseline, row.squid
    lines.append(
        f"| {row.context} | {row.ratio} | {row.memory} | "
        f"{ms(base.median('prefill'))} / {ms(base.median('generation'))} | "
        f"{base.ms_range()} | "
        f"{ms(squid.median('compress'))} / {ms(squid.median('read'))} / "
        f"{ms(squid.median('generation'))} | {squid.ms_range()} | "
        f"{latency_ratio(row):.2f} | "
        f"{gflop(row.base_flops.total)} / "
        f"{gflop(row.squid_flops.large_decoder)} | {large_flop_ratio(row):.1f} | "
        f"{gflop(row.base_flops.total)} / {gflop(row.squid_flops.total)} | "
        f"{total_flop_ratio(row):.1f} | {gflop(base.xla_flops)} / {gflop(squid.xla_flops)} | "
        f"{gib(base.memory_bytes)} / {gib(squid.memory_bytes)} |")
  return lines


def size_ratio(small: DecoderConfig, large: DecoderConfig, length: int) -> float:
  """The large decoder's FLOPs over `length` positions / the small one's (no LM head)."""
  return (flops.decoder_flops(large, length, logits_positions=0)
          / flops.decoder_flops(small, length, logits_positions=0))


def markdown(args, rows: Sequence[Row]) -> str:
  config = squid_config(args)
  qwen_small, qwen_large = _qwen2_hard_coded()
  size_ratios = lambda small, large: " / ".join(
      f"{size_ratio(small, large, n):.1f}" for n in args.contexts)
  lines = benchmarking.header(
      "Squid vs the large decoder reading the whole context: latency and FLOPs", args.command,
      f"shapes: {args.preset_value.source}; {jnp.dtype(config.large.dtype).name}; random "
      "weights.",
      f"small decoder: {decoder_line(config.small)}; large decoder: "
      f"{decoder_line(config.large)}; projector Linear-GELU-Linear. Over L = "
      f"{' / '.join(map(str, args.contexts))} positions the large decoder does "
      f"{size_ratios(config.small, config.large)}x the small one's FLOPs (Qwen2-7B / "
      f"Qwen2-0.5B: {size_ratios(qwen_small, qwen_large)}x).",
      f"batch {args.batch}; query {args.query_length} tokens; answer {args.answer_length} "
      "greedy tokens; N = ceil(L / ρ) memory tokens; sides and phases as in the tool's "
      "docstring.",
      f"times: median of {args.repeats} end-to-end runs per side after compilation and "
      f"{args.warmup} warm-up run(s), the sides' order reversed every repeat.",
      "FLOPs: analytical, per example (`decal_jax.networks.flops.answer_flops` / `squid_flops`); XLA "
      "GFLOP: `cost_analysis()` of the compiled phases; GiB: `memory_analysis()` of the "
      "baseline's prefill / Squid's compress.",
      f"host load average (1/5/15 min) before / after: "
      f"{getattr(args, 'load_before', 'n/a')} / {getattr(args, 'load_after', 'n/a')}.",
      args.note and f"note: {args.note}")
  lines += ["", *table(rows)]
  if args.plot:
    lines += ["", f"![latency and FLOPs vs context length]({os.path.basename(args.plot)})"]
  return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], path: str) -> None:
  """End-to-end latency and large-decoder FLOPs vs L: the baseline and one line per ρ."""
  plt = results_files.pyplot()
  done = [row for row in rows if not row.note]
  fig, (latency_ax, flops_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
  by_length = {row.context: row for row in done}  # the baseline is shared by every ρ
  lengths = sorted(by_length)
  latency_ax.plot(lengths, [by_length[n].baseline.median() for n in lengths], "k-o",
                  label="large decoder, full context")
  flops_ax.plot(lengths, [by_length[n].base_flops.total / 1e9 for n in lengths], "k-o",
                label="large decoder, full context")
  for ratio in sorted({row.ratio for row in done}):
    at = sorted((row for row in done if row.ratio == ratio), key=lambda row: row.context)
    xs = [row.context for row in at]
    latency_ax.plot(xs, [row.squid.median() for row in at], "-s", label=f"Squid ρ={ratio}")
    flops_ax.plot(xs, [row.squid_flops.large_decoder / 1e9 for row in at], "-s",
                  label=f"Squid ρ={ratio} (large decoder)")
  for ax, title, unit in ((latency_ax, "end-to-end latency", "seconds"),
                          (flops_ax, "large-decoder FLOPs", "GFLOP")):
    results_files.log_log_axes(ax, "context length L (tokens)", title, unit, xbase=2)
  fig.tight_layout()
  results_files.save_figure(fig, path)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
  parser.add_argument("--contexts", default="512,2048,8192", help="context lengths L")
  parser.add_argument("--ratios", default="4,8,16", help="compression ratios ρ (N = L / ρ)")
  parser.add_argument("--query_length", type=int, default=32)
  parser.add_argument("--answer_length", type=int, default=32, help="greedy answer tokens")
  parser.add_argument("--batch", type=int, default=1)
  benchmarking.add_side_by_side_args(parser)
  args = parser.parse_args(argv)
  args.contexts = benchmarking.int_list(parser, args.contexts, "--contexts")
  args.ratios = sorted(benchmarking.int_list(parser, args.ratios, "--ratios"))
  for name in ("query_length", "answer_length", "batch", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}.")
  if args.warmup < 0:
    parser.error(f"--warmup must be >= 0, got {args.warmup}.")
  args.preset_value = PRESETS[args.preset]()
  args.command = benchmarking.command("tools.bench_squid", argv)
  return args


def main(argv=None) -> List[Row]:
  return benchmarking.run_and_report(parse_args(argv), run, markdown, plot)


if __name__ == "__main__":
  main()
