"""Dodo's compressed KV cache vs a plain decoder's full cache: bytes, decode step, context cost.

  python -m tools.bench_nuggets --contexts 1024,4096,16384 \
      --out docs/results/nuggets_cache_cpu.md

For every context length n, in one process and one run, with one fixed model:
  * full cache: a plain LLaMA-style `Decoder` prefills the n context tokens into a KV cache
    sized n + new_tokens, then greedily decodes one token per jitted step;
  * nugget cache: `Dodo` encodes the same context into k = ceil(n / r) nuggets per layer
    (their keys and values, `[batch, 2, layers, k, kv_heads, head_dim]`) and decodes one
    token per jitted step from the nuggets plus a cache of its own generated tokens.
Both networks share the decoder weights (Dodo's params['stack'] is the Decoder's
params['stack']; Dodo's scorer and soft prompt are random), so the comparison is about the
cache only. Reported: cache bytes (keys + values of every layer), the per-token decode time
(median over the steps after --warmup; each step is compiled before the first one, and the
two paths' steps alternate so that load on a shared machine hits both alike), XLA's FLOP
and bytes-accessed counts of one step, and the one-off context cost (prefill for the full
model, encode for Dodo: one run after compilation). Before each prefill / encode runs, its
compiled memory need is compared with the memory available; a context that does not fit
is reported as such instead of taking the machine down. Runs unchanged on CPU and GPU.
"""
import argparse
import dataclasses
import functools
import math
import statistics
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from tools import benchmarking, results_files
from tools.benchmarking import (DoesNotFit, check_fits, gib, greedy, load_average,
                                    needed_bytes, timed, xla_cost)
from decal_jax.networks.decoder import Decoder, DecoderConfig
from decal_jax.networks.dodo import Dodo, DodoConfig

CACHE_LEAVES = ("cached_key", "cached_value")


class Models(NamedTuple):
  decoder: Decoder
  dodo: Dodo
  decoder_params: dict
  dodo_params: dict


class Generation(NamedTuple):
  """What one greedy generation measured."""
  tokens: np.ndarray          # [batch, generated] greedy tokens
  cache_bytes: int            # keys + values held while decoding (all layers)
  context_seconds: float      # prefill (full) or encode (Dodo), one run after compiling
  step_seconds: List[float]   # wall time of every decode step, in order
  step_flops: float           # XLA's FLOP count of one compiled decode step
  step_bytes_accessed: float  # XLA's estimate of the bytes one decode step reads + writes
  context_memory: Optional[int]  # XLA's memory need of the prefill / encode program


# ----------------------------------------------------------------------------- models
def build(cfg: DecoderConfig, ratio: float, seed: int = 0) -> Models:
  """A `Decoder` and a `Dodo` (r = ratio, full fine-tuning layout) sharing one stack."""
  if cfg.lora_rank:
    raise ValueError("The benchmark shares the Decoder's stack with Dodo, which needs "
                     "lora_rank = 0 (no adapter leaves); pass a config without LoRA.")
  decoder = Decoder(cfg)
  dodo = Dodo(DodoConfig(decoder=cfg, compression_ratio=ratio,
                         scorer_layer=min(3, cfg.num_layers)))
  decoder_key, dodo_key = jax.random.split(jax.random.PRNGKey(seed))
  tokens = jnp.ones((1, 8), jnp.int32)
  decoder_params = jax.jit(lambda key: decoder.init(
      key, tokens, enable_dropout=False)["params"])(decoder_key)
  dodo_params = jax.jit(lambda key: dodo.init(
      key, tokens, tokens[:, :4], tokens[:, :4], enable_dropout=False)["params"])(dodo_key)
  return Models(decoder, dodo, decoder_params, share_stack(decoder_params, dodo_params))


def share_stack(decoder_params: dict, dodo_params: dict) -> dict:
  """Dodo's params with params['stack'] replaced by the Decoder's (same tree required)."""
  ours = flax.traverse_util.flatten_dict(dodo_params["stack"])
  theirs = flax.traverse_util.flatten_dict(decoder_params["stack"])
  if {k: v.shape for k, v in ours.items()} != {k: v.shape for k, v in theirs.items()}:
    raise ValueError("Dodo's params['stack'] and the Decoder's differ in names or shapes: "
                     "build both from the same DecoderConfig.")
  return {**dodo_params, "stack": decoder_params["stack"]}


def kv_cache_bytes(cache) -> int:
  """Bytes of every `cached_key` / `cached_value` leaf of a flax 'cache' collection."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(cache))
  return sum(leaf.nbytes for path, leaf in flat.items() if path[-1] in CACHE_LEAVES)


def nugget_bytes(encoded: jax.Array) -> int:
  """Bytes of `Dodo.encode`'s output: the nuggets' keys and values, every layer."""
  return encoded.nbytes


# ----------------------------------------------------------------------------- timing
def _zero_cache(init_fn, *args):
  """The 'cache' a dummy decode=True call creates; jitted so XLA drops the dead forward pass
  (the cache's initial values do not depend on it)."""
  return jax.jit(init_fn)(*args)


class Prepared(NamedTuple):
  """A path after its context cost is paid, ready to decode one token per `step`."""
  step: Callable            # (cache, token [batch, 1]) -> (next token, cache); cache donated
  cache: Any                # the flax 'cache' collection the step starts from
  first_token: jax.Array    # [batch, 1] the token the first step reads
  prefix: np.ndarray        # [batch, p] tokens generated before the first step
  cache_bytes: int
  context_seconds: float
  context_memory: Optional[int]
  step_flops: float
  step_bytes_accessed: float


def decode_side_by_side(paths: Sequence[Prepared], steps: int,
                        desc: str = "decode") -> List[Generation]:
  """Greedy-decodes `steps` tokens on every path, interleaving the paths step by step so a
  change of load on a shared machine hits them alike; times every step."""
  caches = [path.cache for path in paths]
  tokens = [path.first_token for path in paths]
  produced = [[] for _ in paths]
  times = [[] for _ in paths]
  for _ in tqdm.trange(steps, desc=desc, leave=False, dynamic_ncols=True):
    for i, path in enumerate(paths):
      (tokens[i], caches[i]), seconds = timed(path.step, caches[i], tokens[i])
      produced[i].append(tokens[i])
      times[i].append(seconds)
  return [Generation(np.concatenate([path.prefix, *map(np.asarray, out)], axis=1),
                     path.cache_bytes, path.context_seconds, took, path.step_flops,
                     path.step_bytes_accessed, path.context_memory)
          for path, out, took in zip(paths, produced, times)]


# ----------------------------------------------------------------------------- paths
def prepare_full_cache(decoder: Decoder, params, context: jax.Array,
                       new_tokens: int) -> Prepared:
  """Prefills `context` [batch, n] into a cache of n + new_tokens slots. The prefill yields
  the first new token; each step then writes one token and yields the next."""
  batch, n = context.shape
  cache = _zero_cache(lambda p: decoder.apply(
      {"params": p}, jnp.ones((batch, n + new_tokens), jnp.int32), decode=True,
      enable_dropout=False, mutable=["cache"])[1]["cache"], params)

  def prefill(params, cache, tokens):
    logits, new_vars = decoder.apply({"params": params, "cache": cache}, tokens, decode=True,
                                     prefill=True, enable_dropout=False, mutable=["cache"])
    return greedy(logits), new_vars["cache"]  # [batch, 1]

  def step(params, cache, token):
    logits, new_vars = decoder.apply({"params": params, "cache": cache}, token, decode=True,
                                     enable_dropout=False, mutable=["cache"])
    return greedy(logits), new_vars["cache"]

  prefill_fn = jax.jit(prefill, donate_argnums=1).lower(params, cache, context).compile()
  check_fits(prefill_fn, f"prefill of {n} tokens")
  cache_bytes = kv_cache_bytes(cache)
  (first, cache), seconds = timed(prefill_fn, params, cache, context)
  step_fn = jax.jit(step, donate_argnums=1).lower(params, cache, first).compile()
  return Prepared(functools.partial(step_fn, params), cache, first, np.asarray(first),
                  cache_bytes, seconds, needed_bytes(prefill_fn), xla_cost(step_fn, "flops"),
                  xla_cost(step_fn, "bytes accessed"))


def prepare_nugget_cache(dodo: Dodo, params, context: jax.Array, new_tokens: int) -> Prepared:
  """Encodes `context` [batch, n] into nuggets and makes the new_tokens-slot cache of
  generated tokens; the first step reads BOS = 0 (as T5X's decoders do)."""
  batch, n = context.shape
  encode = jax.jit(lambda p, tokens: dodo.apply({"params": p}, tokens, enable_dropout=False,
                                                method=Dodo.encode))
  encode_fn = encode.lower(params, context).compile()
  check_fits(encode_fn, f"encode of {n} tokens")
  nuggets, seconds = timed(encode_fn, params, context)
  cache = _zero_cache(lambda p, tokens: dodo.apply(
      {"params": p}, jnp.ones_like(tokens), jnp.ones((batch, new_tokens), jnp.int32),
      jnp.ones((batch, new_tokens), jnp.int32), decode=True, enable_dropout=False,
      mutable=["cache"])[1]["cache"], params, context)

  def step(params, cache, nuggets, tokens, token):
    logits, new_vars = dodo.apply({"params": params, "cache": cache}, nuggets, tokens, token,
                                  token, enable_dropout=False, decode=True,
                                  max_decode_length=new_tokens, mutable=["cache"],
                                  method=Dodo.decode)
    return greedy(logits), new_vars["cache"]

  bos = jnp.zeros((batch, 1), jnp.int32)
  step_fn = jax.jit(step, donate_argnums=1).lower(params, cache, nuggets, context,
                                                  bos).compile()
  return Prepared(lambda cache, token: step_fn(params, cache, nuggets, context, token),
                  cache, bos, np.zeros((batch, 0), np.int32),
                  kv_cache_bytes(cache) + nugget_bytes(nuggets), seconds,
                  needed_bytes(encode_fn), xla_cost(step_fn, "flops"),
                  xla_cost(step_fn, "bytes accessed"))


def full_cache_generate(decoder: Decoder, params, context: jax.Array,
                        new_tokens: int) -> Generation:
  """The full-cache path alone: new_tokens decode steps, new_tokens + 1 greedy tokens (the
  first from the prefill)."""
  path = prepare_full_cache(decoder, params, context, new_tokens)
  return decode_side_by_side([path], new_tokens, "full cache")[0]


def nugget_cache_generate(dodo: Dodo, params, context: jax.Array,
                          new_tokens: int) -> Generation:
  """The nugget path alone: new_tokens decode steps, new_tokens greedy tokens."""
  path = prepare_nugget_cache(dodo, params, context, new_tokens)
  return decode_side_by_side([path], new_tokens, "nugget cache")[0]


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Row:
  context: int
  nuggets: int
  full: Optional[Generation] = None
  dodo: Optional[Generation] = None
  note: str = ""


def decoder_config(args) -> DecoderConfig:
  return DecoderConfig(vocab_size=args.vocab, emb_dim=args.emb_dim, num_heads=args.heads,
                       num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                       mlp_dim=args.mlp_dim, num_layers=args.layers,
                       max_length=max(args.contexts) + args.new_tokens,
                       dtype=jnp.dtype(args.dtype))


def median_step(gen: Generation, warmup: int) -> float:
  return statistics.median(gen.step_seconds[warmup:])


def run(args) -> List[Row]:
  args.load_before = load_average()
  cfg = decoder_config(args)
  models = build(cfg, args.ratio, args.seed)
  rows = []
  for n in tqdm.tqdm(args.contexts, desc="contexts", dynamic_ncols=True):
    rng = np.random.RandomState(args.seed + n)
    context = jnp.asarray(rng.randint(2, args.vocab, (args.batch, n)), jnp.int32)
    row = Row(n, math.ceil(n / args.ratio))
    try:  # the context costs one after the other (each may need much memory), then decode
      full = prepare_full_cache(models.decoder, models.decoder_params, context,
                                args.new_tokens)
      dodo = prepare_nugget_cache(models.dodo, models.dodo_params, context, args.new_tokens)
      row.full, row.dodo = decode_side_by_side([full, dodo], args.new_tokens, f"n={n}")
    except DoesNotFit as e:
      row.note = f"did not fit: {e}"
    rows.append(row)
    tqdm.tqdm.write(_summary(row, args.warmup))
  args.load_after = load_average()
  return rows


def _summary(row: Row, warmup: int) -> str:
  if row.note:
    return f"n={row.context}: {row.note}"
  full, dodo = row.full, row.dodo
  return (f"n={row.context} k={row.nuggets}: cache {full.cache_bytes / 2**20:.2f} MiB vs "
          f"{dodo.cache_bytes / 2**20:.3f} MiB ({full.cache_bytes / dodo.cache_bytes:.1f}x) | "
          f"step {median_step(full, warmup) * 1e3:.2f} ms vs "
          f"{median_step(dodo, warmup) * 1e3:.2f} ms | prefill {full.context_seconds:.2f} s, "
          f"encode {dodo.context_seconds:.2f} s")


def markdown(args, rows: Sequence[Row]) -> str:
  cfg = decoder_config(args)
  lines = benchmarking.header(
      "Dodo's nugget KV cache vs the full KV cache",
      benchmarking.command("tools.bench_nuggets", None),
      f"model (both): {cfg.num_layers} layers, emb {cfg.emb_dim}, {cfg.num_heads} heads / "
      f"{cfg.kv_heads} kv heads x {cfg.head_dim}, mlp {cfg.mlp_dim}, vocab {cfg.vocab_size}, "
      f"{jnp.dtype(cfg.dtype).name}; Dodo r = {args.ratio:g} (k = ceil(n / r)), "
      f"shared stack weights; batch {args.batch}; {args.new_tokens} new tokens.",
      "cache = keys + values of every layer held while decoding: full = n + new_tokens "
      "positions; Dodo = k nuggets + new_tokens generated positions.",
      f"step = one jitted greedy decode step (cache donated), the two paths interleaved "
      f"step by step; median over the {args.new_tokens - args.warmup} steps after "
      f"{args.warmup} warm-up steps; MFLOP and MiB accessed = XLA `cost_analysis()` of the "
      "step. Context cost = prefill (full) / encode (Dodo), one "
      "run after compilation; its GiB = arguments + outputs + temporaries from XLA's "
      "`memory_analysis()` (dense attention: heads x n x n floats per layer).",
      f"host load average (1/5/15 min) before / after the run: "
      f"{getattr(args, 'load_before', 'n/a')} / {getattr(args, 'load_after', 'n/a')}.",
      args.note and f"note: {args.note}")
  lines += [
      "",
      "| context n | nuggets k | full cache MiB | Dodo cache MiB | cache ratio | full step ms "
      "| Dodo step ms | step time ratio | step MFLOP full / Dodo "
      "| step MiB accessed full / Dodo | prefill s | encode s | prefill / encode GiB |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    if row.note:
      lines.append(f"| {row.context} | {row.nuggets} | {row.note} |" + " |" * 10)
      continue
    full, dodo = row.full, row.dodo
    full_ms, dodo_ms = median_step(full, args.warmup) * 1e3, median_step(dodo, args.warmup) * 1e3
    lines.append(
        f"| {row.context} | {row.nuggets} | {full.cache_bytes / 2**20:.2f} | "
        f"{dodo.cache_bytes / 2**20:.3f} | {full.cache_bytes / dodo.cache_bytes:.1f} | "
        f"{full_ms:.2f} | {dodo_ms:.2f} | {full_ms / dodo_ms:.2f} | "
        f"{full.step_flops / 1e6:.1f} / {dodo.step_flops / 1e6:.1f} | "
        f"{full.step_bytes_accessed / 2**20:.1f} / {dodo.step_bytes_accessed / 2**20:.1f} | "
        f"{full.context_seconds:.2f} | {dodo.context_seconds:.2f} | "
        f"{gib(full.context_memory)} / {gib(dodo.context_memory)} |")
  return "\n".join(lines) + "\n"


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--contexts", default="1024,4096,16384",
                      help="comma-separated context lengths n")
  parser.add_argument("--emb_dim", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv_heads", type=int, default=2)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--mlp_dim", type=int, default=704)
  parser.add_argument("--vocab", type=int, default=4224)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--ratio", type=float, default=10.0, help="Dodo's compression ratio r")
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--warmup", type=int, default=2, help="decode steps left out of the median")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=None, help="write the Markdown table here")
  parser.add_argument("--note", default="", help="a line for the results file (e.g. machine "
                      "sharing that affects the timings)")
  args = parser.parse_args(argv)
  try:
    args.contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
  except ValueError:
    parser.error(f"--contexts must be comma-separated integers, got {args.contexts!r}.")
  if not args.contexts or min(args.contexts) < 1:
    parser.error("--contexts needs at least one positive length, e.g. 1024,4096,16384.")
  if not 0 <= args.warmup < args.new_tokens:
    parser.error(f"--warmup ({args.warmup}) must leave at least one of the --new_tokens "
                 f"({args.new_tokens}) steps to time.")
  if args.vocab < 3:
    parser.error("--vocab must be at least 3 (0 = padding, 1 = EOS, then text ids).")
  return args


def main(argv=None):
  args = parse_args(argv)
  table = markdown(args, run(args))
  print(table)
  if args.out:
    results_files.write_text(args.out, table)


if __name__ == "__main__":
  main()
