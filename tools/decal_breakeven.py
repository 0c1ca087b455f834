"""Where DeCAL-C pays for itself in a training step: its model FLOPs over the plain T5's, by
input length, for targets that grow with the input or stay fixed.

  python -m tools.decal_breakeven --ratio=4 --lengths 128 256 512 1024 2048 4096 8192
  python -m tools.decal_breakeven --ratio=4 --lengths 128 256 512 1024 --measure
  python -m tools.decal_breakeven --ratio=4 --lengths 1024 2048 --measure \
      --measure_targets n --batch_size 2 --steps 6   # autoencoding, where the FLOPs cross
      # (both steps are compiled in one process: 2048 at batch 2 takes about 13 GB)

A training step costs about 3x the teacher-forced forward pass (`decal_jax/networks/flops.py`), so the
ratio of forward FLOPs is the ratio of step FLOPs. DeCAL's encoder runs over m + n positions
(m = ceil(n / C) latents prepended) and the decoder cross-attends to m instead of n, so C > 1
costs more encoder work and saves cross-attention work; it pays for itself when the saving is
larger, i.e. when the targets are long compared with the inputs. Printed for three target
lengths: t = n / 4 (span corruption's targets, at least 32), t = --fixed_targets and t = n
(autoencoding). The network is sized by --emb_dim / --layers / --heads / --head_dim /
--mlp_dim (default the "reduced small" T5 of docs/performance.md).

`--measure` also times the training step at each length with t = n / 4 (`--measure_targets
n` for t = n, or both): decal_jax's own step (`tools/bench_train.py`, synthetic
batches of --batch_size), C = 1 and C = --ratio built in one process and stepped
alternately, the median of --steps steps each; it prints the measured step-time ratio beside
the FLOP ratio and appends both configurations' rows to --out. End-to-end trainers at
128 / 32: `tools/compare_trainers.py`.
"""
import argparse
import json
import os
import tempfile
from typing import Dict, List, Optional, Sequence

from decal_jax.networks import flops
from tools import benchmarking, results_files
from decal_jax.networks.t5 import T5Config

# the target length of each measured column, by input length n
TARGETS = {"n/4": lambda n: max(32, n // 4), "n": lambda n: n}
SIZE_FLAGS = ("vocab_size", "emb_dim", "num_heads", "head_dim", "mlp_dim",
              "num_encoder_layers", "num_decoder_layers")


def step_flop_ratio(sizes: Dict[str, int], ratio: int, inputs: int, targets: int) -> float:
  """Forward (= step) model FLOPs of DeCAL-`ratio` over the plain T5 at these lengths."""
  plain = flops.forward_flops(T5Config(compression_ratio=1, **sizes), inputs, targets)
  decal = flops.forward_flops(T5Config(compression_ratio=ratio, compressor="latents", **sizes),
                              inputs, targets)
  return decal.total / plain.total


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, float]]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--ratio", type=int, default=4)
  p.add_argument("--lengths", type=int, nargs="+",
                 default=[128, 256, 512, 1024, 2048, 4096, 8192])
  p.add_argument("--fixed_targets", type=int, default=32)
  p.add_argument("--emb_dim", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--mlp_dim", type=int, default=1024)
  p.add_argument("--vocab_size", type=int, default=4224)
  p.add_argument("--measure", action="store_true",
                 help="also time C = 1 and C = --ratio training steps (at --measure_targets)")
  p.add_argument("--measure_targets", nargs="+", default=["n/4"], choices=sorted(TARGETS),
                 help="the target lengths --measure times: n/4 (span corruption), n "
                 "(autoencoding)")
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--out", default=None, help="JSONL file to append --measure's "
                 "bench_train rows to")
  args = p.parse_args(argv)
  if args.ratio < 2:
    p.error("--ratio must be >= 2 (it is compared with C = 1).")
  sizes = dict(vocab_size=args.vocab_size, emb_dim=args.emb_dim, num_heads=args.heads,
               head_dim=args.head_dim, mlp_dim=args.mlp_dim, num_encoder_layers=args.layers,
               num_decoder_layers=args.layers, relative_attention_num_buckets=128,
               relative_attention_max_distance=512)
  rows = []
  print(f"model FLOPs of a training step, DeCAL C={args.ratio} / C=1 (< 1: DeCAL is cheaper)")
  print(f"{'n':>6}{'t = n/4':>10}{f't = {args.fixed_targets}':>10}{'t = n':>10}")
  for n in args.lengths:
    row = {"inputs": n, "targets_fixed": step_flop_ratio(sizes, args.ratio, n, args.fixed_targets),
           **{f"targets_{kind}": step_flop_ratio(sizes, args.ratio, n, targets(n))
              for kind, targets in TARGETS.items()}}
    rows.append(row)
    print(f"{n:>6}{row['targets_n/4']:>10.3f}{row['targets_fixed']:>10.3f}"
          f"{row['targets_n']:>10.3f}")
  for kind in args.measure_targets if args.measure else []:
    for row in rows:
      row[f"measured_{kind}"] = measured_ratio(sizes, args, row["inputs"],
                                               TARGETS[kind](row["inputs"]))
    print(f"\nstep time, DeCAL C={args.ratio} / C=1 at t = {kind}: FLOPs vs measured "
          f"(decal_jax's step, batch {args.batch_size}, {args.dtype})")
    for row in rows:
      print(f"{row['inputs']:>6}{row[f'targets_{kind}']:>10.3f}{row[f'measured_{kind}']:>10.3f}")
  return rows


def measured_ratio(sizes: Dict[str, int], args, inputs: int, targets: int) -> float:
  """C = --ratio's median step time over C = 1's, both timed alternately in one
  `python -m tools.bench_train` process (its rows also go to --out when given)."""
  with tempfile.TemporaryDirectory(prefix="decal_breakeven_") as tmp:
    rows_file, log = os.path.join(tmp, "rows.jsonl"), os.path.join(tmp, "bench_train.log")
    argv = ["--gin_file=models/t5_1_1_small.gin", "--gin_file=models/decal.gin",
            *[f"--gin.t5.T5Config.{k}={sizes[k]}" for k in SIZE_FLAGS],
            "--gin.COMPRESSION_RATIO=1", f"--gin.ACTIVATION_DTYPE='{args.dtype}'",
            "--gin.DROPOUT_RATE=0.0", f"--batch_size={args.batch_size}",
            f"--inputs_length={inputs}", f"--targets_length={targets}",
            f"--steps={args.steps}", "--label=C=1", f"--compare=COMPRESSION_RATIO={args.ratio}",
            f"--compare_label=C={args.ratio}", f"--out={rows_file}"]
    print(f"n = {inputs}, t = {targets}: timing C = 1 and C = {args.ratio} (bench_train) ...",
          flush=True)
    benchmarking.run_entry_point("tools.bench_train", argv, log)
    with open(rows_file) as f:
      rows = [json.loads(line) for line in f]
  if args.out:
    results_files.write_jsonl(args.out, rows)
  return rows[-1]["ratio_to_a"]["step_s_median"]

if __name__ == "__main__":
  main()
