"""Tolerances for comparing two float32 computations of the same mathematics.

Two programs that evaluate the same sums in different orders (another blocking of a matmul,
AVX2 against AVX-512 kernels, XLA against PyTorch, a cached step against a full pass) round
differently, so their float32 results differ even though the mathematics is equal. Each
addition rounds by at most eps / 2 of its partial sum; over K terms of size up to M these
rounding errors add like a random walk, to about eps * sqrt(K) * M, and rarely to more than
a few times that. A test comparing two float32 runs states K and M through these helpers
instead of a bare number such as 1e-5, so the bound holds on any x86-64 CPU.

`network_atol` scales by the output's size, which assumes the layer norms keep hidden states
of the output's order; where a path grows them (a second adapter pass, running sums), a test
states its measured gap and margin instead. Measured on a 2-core AVX-512 AMD EPYC, the
gaps of the comparisons that use these bounds are 1/19 to 1/90 of them (or zero).

Comparisons against a float64 numpy reference need no helper: the float32 side's own
rounding is the whole difference, and those tests state their tolerance where they use it.
"""
import math
from typing import Iterable

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7: the spacing of float32 numbers at 1.0
SAFETY = 8.0  # a random walk of K steps ends past 8 standard deviations almost never


def reorder_atol(terms: int, magnitude: float, safety: float = SAFETY) -> float:
  """Bound on |a - b| when a and b are float32 sums of the same `terms` values, each of
  absolute size up to `magnitude`, added in two different orders."""
  return safety * EPS32 * math.sqrt(terms) * float(magnitude)


def network_atol(output, reductions: Iterable[int], safety: float = SAFETY) -> float:
  """Bound on |a - b| for two float32 runs of one network that differ only in summation
  order. `reductions`: the lengths of the sums on the path from input to output (per layer
  e.g. the embedding width, the attended length, the MLP width); their rounding errors,
  relative to the activations, add up along the path and reach the output scaled by its
  size, `max |output|`."""
  return reorder_atol(sum(reductions), np.max(np.abs(np.asarray(output))), safety)


def stack_reductions(cfg, keys: int, layers: int = None):
  """The sums on the path through a transformer stack of config `cfg` (emb_dim, num_heads,
  head_dim, mlp_dim, num_layers): per layer q / k / v (emb_dim terms), attention over
  `keys` positions, the output projection (heads x head_dim), the MLP's two matmuls
  (emb_dim, mlp_dim); then the logits (emb_dim). `layers` defaults to cfg.num_layers."""
  layers = cfg.num_layers if layers is None else layers
  per_layer = [cfg.emb_dim, keys, cfg.num_heads * cfg.head_dim, cfg.emb_dim, cfg.mlp_dim]
  return per_layer * layers + [cfg.emb_dim]
