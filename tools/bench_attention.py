"""Attention's cost: the einsum path against kernel 'blockwise' (issue 45), side by side.

  nice -n 10 python -m tools.bench_attention --lengths 512,2048,8192 \
      --out docs/results/attention_blockwise_cpu.md

Both compute T5 encoder self-attention over `length` positions: the relative position bias
(32 buckets, max distance 128, bidirectional) and a padding mask, at T5.1.1-small head shapes
(6 heads x 64), value and gradient with respect to q, k, v and the bias table (what a train
step does). The einsum path gets the bias and the mask as `[b, h, L, L]` arrays, as the T5
encoder builds them; 'blockwise' gets them per key block (`RelativePositionBiases(...,
blocks=True)`, `block_mask`). Reported per length and kernel: XLA's temporary bytes of the
compiled program (`memory_analysis`, nothing allocated), the bytes of one float32 score
matrix `b * h * L * L * 4` for comparison, and the median time of --repeats calls, the two
kernels alternating in one run; a program whose XLA estimate exceeds --budget_gib is not
run. Then, compiled only, the lengths (doubling) up to the first at which the einsum
program exceeds the budget.
"""
import argparse
from typing import Dict, List

import jax
import jax.numpy as jnp

from decal_jax.layers import attention as attn
from decal_jax.layers import blockwise_attention as bw
from tools import benchmarking, results_files

KERNELS = ("einsum", "blockwise")
NUM_BUCKETS, MAX_DISTANCE = 32, 128  # T5.1.1's relative position bias


def score_bytes(batch: int, heads: int, length: int, itemsize: int = 4) -> int:
  """Bytes of one `[batch, heads, length, length]` score (or probability) matrix."""
  return batch * heads * length * length * itemsize


def inputs(batch: int, length: int, heads: int, head_dim: int, seed: int = 0):
  """q, k, v `[batch, length, heads, head_dim]` float32 and the bias table `[heads, 32]`."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  qkv = [jax.random.normal(k, (batch, length, heads, head_dim)) / head_dim ** 0.5
         for k in keys[:3]]
  return (*qkv, 0.1 * jax.random.normal(keys[3], (heads, NUM_BUCKETS)))


def _loss(kernel: str, block: int):
  """sum(attention(q, k, v)^2) of T5 self-attention with relative bias and padding mask."""
  def loss(query, key, value, table):
    batch, length = query.shape[:2]
    relpos = attn.RelativePositionBiases(NUM_BUCKETS, MAX_DISTANCE, table.shape[0])
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    valid = jnp.ones((batch, length), bool)
    params = {"params": {"rel_embedding": table}}
    if kernel == "blockwise":
      bias = relpos.apply(params, positions, positions, True, blocks=True)
      mask = bw.block_mask(valid, valid)
    else:
      bias = relpos.apply(params, positions, positions, True)  # [b, h, L, L]
      mask = attn.make_attention_mask(valid, valid)  # [b, 1, L, L]
    bias, mask = attn.split_bias_and_mask(bias, mask, kernel)
    out = attn.dot_product_attention(query, key, value, bias, mask=mask, kernel=kernel,
                                     block_size=block)  # [b, L, h, d]
    return jnp.sum(jnp.square(out))
  return loss


def compile_step(kernel: str, batch: int, length: int, heads: int, head_dim: int,
                 block: int):
  """The compiled forward + backward program (shapes only: nothing is allocated)."""
  x = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)
  table = jax.ShapeDtypeStruct((heads, NUM_BUCKETS), jnp.float32)
  grad = jax.value_and_grad(_loss(kernel, block), argnums=(0, 1, 2, 3))
  return jax.jit(grad).lower(x, x, x, table).compile()


def measure_length(args, length: int) -> List[Dict]:
  """One row per kernel at `length`: temp / needed bytes, and the median seconds of the
  runs (None when over the budget), the kernels alternating."""
  rows, runnable = [], []
  for kernel in KERNELS:
    compiled = compile_step(kernel, args.batch, length, args.heads, args.head_dim, args.block)
    row = {"length": length, "kernel": kernel,
           "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
           "needed_bytes": benchmarking.needed_bytes(compiled),
           "score_bytes": score_bytes(args.batch, args.heads, length), "runs": []}
    rows.append(row)
    if row["needed_bytes"] <= args.budget_gib * 2**30:
      runnable.append((row, compiled))
  data = inputs(args.batch, length, args.heads, args.head_dim, args.seed)
  for repeat in range(args.warmup + args.repeats):
    for row, compiled in benchmarking.alternating(runnable, repeat):
      seconds = benchmarking.timed(compiled, *data)[1]
      if repeat >= args.warmup:
        row["runs"].append(seconds)
  for row in rows:
    row["seconds"] = sorted(row.pop("runs"))[args.repeats // 2] if row["runs"] else None
  return rows


def budget_search(args) -> List[Dict]:
  """Compiled only: needed bytes of both kernels at doubling lengths from the first of
  --lengths until the einsum program exceeds the budget (or --search_max)."""
  rows, length = [], args.lengths[0]
  while length <= args.search_max:
    row = {"length": length, "score_bytes": score_bytes(args.batch, args.heads, length)}
    for kernel in KERNELS:
      row[kernel] = benchmarking.needed_bytes(compile_step(
          kernel, args.batch, length, args.heads, args.head_dim, args.block))
    rows.append(row)
    if row["einsum"] > args.budget_gib * 2**30:
      break
    length *= 2
  return rows


def run(args) -> Dict[str, List[Dict]]:
  rows = []
  for length in args.lengths:
    rows += measure_length(args, length)
    for row in rows[-len(KERNELS):]:
      took = "over budget" if row["seconds"] is None else f"{row['seconds'] * 1e3:.1f} ms"
      print(f"L={length:6d} {row['kernel']:>9}: temp {mib(row['temp_bytes'])} MiB, {took}",
            flush=True)
  return {"rows": rows, "budget": budget_search(args) if args.search_max else []}


def mib(size: int) -> str:
  return f"{size / 2**20:.1f}"


def _ratio(row: Dict, ref: Dict, key: str) -> str:
  if row[key] is None or ref[key] is None:
    return "n/a"
  return f"{row[key] / ref[key]:.3f}"


def markdown(args, results, argv=None) -> str:
  lines = benchmarking.header(
      "Attention: einsum vs blockwise (online softmax), forward + backward",
      benchmarking.command("tools.bench_attention", argv),
      f"T5 encoder self-attention: batch {args.batch}, {args.heads} heads x {args.head_dim}"
      f"{' (T5.1.1 small)' if (args.heads, args.head_dim) == (6, 64) else ''}, float32, "
      f"relative position bias ({NUM_BUCKETS} buckets) and padding mask; blockwise block {args.block} keys, bias and mask built per block",
      "value and gradient w.r.t. q, k, v and the bias table; temp = XLA "
      "`memory_analysis().temp_size_in_bytes` of the compiled program; score matrix = "
      "b * h * L * L * 4 bytes",
      f"times: median of {args.repeats} runs after {args.warmup} warm-up, the kernels "
      f"alternating in one run; programs XLA says need more than {args.budget_gib} GiB "
      "(arguments + outputs + temporaries) are not run", args.note)
  head = ["keys", "kernel", "fwd+bwd ms", "temp MiB", "one score matrix MiB",
          "time / einsum", "temp / einsum"]
  table_rows, lines = [], lines + [""]
  for row in results["rows"]:
    ref = next(r for r in results["rows"] if r["length"] == row["length"]
               and r["kernel"] == "einsum")
    seconds = "over budget" if row["seconds"] is None else benchmarking.ms(row["seconds"])
    table_rows.append([row["length"], row["kernel"], seconds, mib(row["temp_bytes"]),
                       mib(row["score_bytes"]), _ratio(row, ref, "seconds"),
                       _ratio(row, ref, "temp_bytes")])
  lines += benchmarking.table(head, table_rows)
  if results["budget"]:
    lines += ["", f"Memory budget {args.budget_gib} GiB (XLA's estimate: arguments + "
              "outputs + temporaries; compiled, not run):", ""]
    lines += benchmarking.table(
        ["keys", "einsum MiB", "blockwise MiB", "one score matrix MiB", "einsum fits"],
        [[r["length"], mib(r["einsum"]), mib(r["blockwise"]), mib(r["score_bytes"]),
          "yes" if r["einsum"] <= args.budget_gib * 2**30 else "no"]
         for r in results["budget"]])
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", default="512,2048,8192", help="comma-separated key lengths")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=6)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--block", type=int, default=attn.DEFAULT_BLOCK_SIZE)
  parser.add_argument("--budget_gib", type=float, default=2.0,
                      help="run no program XLA says needs more; the einsum search's budget")
  parser.add_argument("--search_max", type=int, default=65536,
                      help="longest length of the budget search (0: no search)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  benchmarking.add_output_args(parser)
  args = parser.parse_args(argv)
  args.lengths = benchmarking.int_list(parser, args.lengths, "--lengths")
  results = run(args)
  results_files.report(markdown(args, results, argv), args.out)
  return results


if __name__ == "__main__":
  main()
