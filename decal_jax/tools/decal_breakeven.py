"""Where DeCAL-C pays for itself in a training step: its model FLOPs over the plain T5's, by
input length, for targets that grow with the input or stay fixed.

  python -m decal_jax.tools.decal_breakeven --ratio=4 --lengths 128 256 512 1024 2048 4096 8192

A training step costs about 3x the teacher-forced forward pass (`decal_jax/flops.py`), so the
ratio of forward FLOPs is the ratio of step FLOPs. DeCAL's encoder runs over m + n positions
(m = ceil(n / C) latents prepended) and the decoder cross-attends to m instead of n, so C > 1
costs more encoder work and saves cross-attention work; it pays for itself when the saving is
larger, i.e. when the targets are long compared with the inputs. Printed for three target
lengths: t = n / 4 (span corruption's targets, at least 32), t = --fixed_targets and t = n
(autoencoding). The network is sized by --emb_dim / --layers / --heads / --head_dim /
--mlp_dim (default the "reduced small" T5 of docs/performance.md). Measured steps / s at 128
/ 32: `decal_jax/tools/compare_trainers.py`.
"""
import argparse
from typing import Dict, List, Optional, Sequence

from decal_jax import flops
from decal_jax.networks.t5 import T5Config


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
    row = {"inputs": n, "targets_n/4": step_flop_ratio(sizes, args.ratio, n, max(32, n // 4)),
           "targets_fixed": step_flop_ratio(sizes, args.ratio, n, args.fixed_targets),
           "targets_n": step_flop_ratio(sizes, args.ratio, n, n)}
    rows.append(row)
    print(f"{n:>6}{row['targets_n/4']:>10.3f}{row['targets_fixed']:>10.3f}"
          f"{row['targets_n']:>10.3f}")
  return rows


if __name__ == "__main__":
  main()
