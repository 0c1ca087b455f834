"""Matmul speed and compile time of a T5.1.1-small-shaped block under the current XLA_FLAGS.

  XLA_FLAGS='--xla_gpu_enable_triton_gemm=false' python -m tools.bench_xla_flags \
      --label cublas --out runs/xla_flags.jsonl

The block is one encoder layer of T5.1.1-small in bf16 with its backward pass (gradients of
every weight and of the input): the fused QKV projection, attention over `--length` positions
(scores and mixing as batched einsums, softmax in float32), the output projection and the
gated-GELU MLP, for `--batch` sequences: a few GEMM shapes of the real train step, compiled in
seconds. It exists to choose XLA_FLAGS on a GPU before the train step is compiled with them
(`gpu_suite`'s `xla_flags` part): on 2026-11-26 an H200 (jax 0.11.2) ran the DeCAL-4x step at
0.1 % MFU with '--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false', while the
same step at XLA's default flags had not compiled after 230 s.

Prints and appends one JSON line: compile seconds, median step milliseconds, the analytical
FLOPs (2 m n k per matmul, x 3 for forward + backward), TFLOP/s, and the fraction of the
device's bf16 dense peak when it is known.
"""
import argparse
import os
import statistics
import time
from typing import Dict, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import jax.numpy as jnp

from tools.benchmarking import device_peak, machine_record
from tools.results_files import write_jsonl

EMB, HEADS, HEAD_DIM, MLP = 512, 6, 64, 1024  # T5.1.1-small


def init_weights(seed: int) -> Dict[str, jax.Array]:
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  inner = HEADS * HEAD_DIM

  def normal(key, shape):
    return (jax.random.normal(key, shape, jnp.float32) * shape[0] ** -0.5).astype(jnp.bfloat16)
  return {"qkv": normal(keys[0], (EMB, 3 * inner)), "out": normal(keys[1], (inner, EMB)),
          "wi": normal(keys[2], (EMB, 2 * MLP)), "wo": normal(keys[3], (MLP, EMB))}


def layer(weights: Dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """One pre-norm-free encoder layer: attention then gated-GELU MLP, residuals kept."""
  batch, length, _ = x.shape
  qkv = (x @ weights["qkv"]).reshape(batch, length, 3, HEADS, HEAD_DIM)  # [b, l, 3, h, d]
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [b, l, h, d]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(scores * HEAD_DIM ** -0.5, axis=-1).astype(x.dtype)  # [b, h, q, k]
  mixed = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, length, -1)  # [b, l, h*d]
  x = x + mixed @ weights["out"]  # [b, l, e]
  gate, up = jnp.split(x @ weights["wi"], 2, axis=-1)  # [b, l, mlp] each
  return x + (jax.nn.gelu(gate) * up) @ weights["wo"]  # [b, l, e]


def loss_and_grads(weights, x):
  loss = lambda w, inputs: jnp.mean(jnp.square(layer(w, inputs).astype(jnp.float32)))
  return jax.value_and_grad(loss, argnums=(0, 1))(weights, x)


def block_flops(batch: int, length: int) -> float:
  """2 m n k per matmul of the forward pass, x 3 (the backward pass's two per forward one)."""
  tokens, inner = batch * length, HEADS * HEAD_DIM
  dense = EMB * 3 * inner + inner * EMB + EMB * 2 * MLP + MLP * EMB
  attention = 2 * HEADS * length * HEAD_DIM  # scores and mixing, per query token
  return 3 * 2 * tokens * (dense + attention)


def measure(batch: int, length: int, steps: int, seed: int = 0) -> Tuple[float, float]:
  """(compile seconds, median step seconds) of the jitted forward + backward."""
  weights = init_weights(seed)
  x = jax.random.normal(jax.random.PRNGKey(seed + 1), (batch, length, EMB), jnp.bfloat16)
  start = time.perf_counter()
  step = jax.jit(loss_and_grads).lower(weights, x).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(step(weights, x))  # warm-up
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(step(weights, x))
    times.append(time.perf_counter() - start)
  return compile_s, statistics.median(times)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--label", default="", help="a name for the flag set (default: XLA_FLAGS)")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--length", type=int, default=640, help="positions (DeCAL-4x: 512 + 128)")
  p.add_argument("--steps", type=int, default=10, help="timed steps (after one warm-up)")
  p.add_argument("--out", default=None, help="append the JSON line here")
  a = p.parse_args(argv)
  compile_s, step_s = measure(a.batch, a.length, a.steps)
  device = jax.devices()[0]
  peak = device_peak(device)
  tflops = block_flops(a.batch, a.length) / step_s / 1e12
  row = dict(machine_record(), label=a.label or os.environ.get("XLA_FLAGS", "") or "default",
             batch=a.batch, length=a.length, compile_s=compile_s, step_s_median=step_s,
             tflops=tflops, peak_fraction=peak and tflops / peak["tflops"])
  print(f"{row['label']}: compiled in {compile_s:.1f} s, step {1e3 * step_s:.2f} ms, "
        f"{tflops:.3g} TFLOP/s" + (f" ({100 * row['peak_fraction']:.1f} % of the bf16 peak)"
                                   if peak else ""), flush=True)
  if a.out:
    write_jsonl(a.out, [row])
  return row


if __name__ == "__main__":
  main()
