"""The token loss's cost: ours (`losses.compute_weighted_cross_entropy`, which never builds
a `[batch, length, vocab]` target tensor) against the one-hot formulation T5X uses
(`jax.nn.one_hot` of the targets, smoothed, times the log-softmax), side by side.

  python -m tools.bench_loss --batch_size=8 --length=128 --vocab=32128 --label_smoothing=0.1

Both compute the value and the gradient with respect to the logits (what a train step
does), compiled for the default device. Reported per formulation: XLA's temporary bytes
(`memory_analysis`), bytes accessed (`cost_analysis`), and the median time of --repeats
calls; then B / A. The two must agree (value and gradient) before anything is timed.
Appends one JSON line per run to --out.
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax import losses
from tools.benchmarking import machine_record, median_seconds, xla_cost
from tools.results_files import write_jsonl


def onehot_loss(logits, targets, weights, label_smoothing: float, z_loss: float):
  """The definition, written out: smoothed one-hot targets times the log-softmax."""
  vocab = logits.shape[-1]
  confidence, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
  constant = -(confidence * np.log(confidence) + (vocab - 1) * low * np.log(low + 1e-20))
  onehot = jax.nn.one_hot(targets, vocab, dtype=jnp.float32)  # [b, t, vocab]
  soft = onehot * confidence + (1.0 - onehot) * low  # [b, t, vocab]
  log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # [b, t]
  log_probs = logits.astype(jnp.float32) - log_z[..., None]  # [b, t, vocab]
  per_token = -jnp.sum(soft * log_probs, axis=-1) - constant + z_loss * jnp.square(log_z)
  return jnp.sum(per_token * weights)


def ours(logits, targets, weights, label_smoothing: float, z_loss: float):
  return losses.compute_weighted_cross_entropy(logits, targets, weights, label_smoothing,
                                               z_loss)[0]


FORMULATIONS = {"one-hot (T5X)": onehot_loss, "decal_jax": ours}


def inputs(batch: int, length: int, vocab: int, dtype: str, seed: int = 0):
  rng = np.random.RandomState(seed)
  logits = jnp.asarray(3 * rng.randn(batch, length, vocab), dtype)  # [b, t, vocab]
  targets = jnp.asarray(rng.randint(0, vocab, (batch, length)), jnp.int32)  # [b, t]
  weights = jnp.asarray(rng.rand(batch, length) > 0.1, jnp.float32)  # [b, t]
  return logits, targets, weights


def measure(fn, args, label_smoothing: float, z_loss: float, repeats: int):
  """(value, gradient, {temp_bytes, bytes_accessed, seconds}) of value_and_grad(fn)."""
  step = jax.jit(jax.value_and_grad(lambda l, t, w: fn(l, t, w, label_smoothing, z_loss)))
  compiled = step.lower(*args).compile()
  value, grad = compiled(*args)
  return value, grad, {"temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                       "bytes_accessed": xla_cost(compiled, "bytes accessed"),
                       "seconds": median_seconds(compiled, args, repeats)}


def run(batch: int, length: int, vocab: int, label_smoothing: float, z_loss: float,
        dtype: str = "float32", repeats: int = 10):
  args = inputs(batch, length, vocab, dtype)
  results, values = {}, {}
  for name, fn in FORMULATIONS.items():
    value, grad, results[name] = measure(fn, args, label_smoothing, z_loss, repeats)
    values[name] = (np.asarray(value, np.float64), np.asarray(grad, np.float32))
  (va, ga), (vb, gb) = values.values()
  np.testing.assert_allclose(vb, va, rtol=1e-5, err_msg="the two losses differ")
  np.testing.assert_allclose(gb, ga, atol=1e-6, rtol=1e-4, err_msg="the gradients differ")
  a, b = results.values()
  ratios = {k: b[k] / a[k] for k in a if a[k]}
  return {"shape": [batch, length, vocab], "dtype": dtype, "label_smoothing": label_smoothing,
          "z_loss": z_loss, "results": results, "ratio_ours_over_onehot": ratios}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--length", type=int, default=128)
  parser.add_argument("--vocab", type=int, default=32128)
  parser.add_argument("--label_smoothing", type=float, default=0.0)
  parser.add_argument("--z_loss", type=float, default=1e-4)
  parser.add_argument("--dtype", default="float32", help="the logits' dtype")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--out", default=None,
                      help="JSON lines file (default docs/results/bench_loss_<platform>.jsonl)")
  args = parser.parse_args(argv)
  row = run(args.batch_size, args.length, args.vocab, args.label_smoothing, args.z_loss,
            args.dtype, args.repeats)
  row.update(machine_record())
  print(f"loss + gradient over logits {row['shape']} {args.dtype}, "
        f"label smoothing {args.label_smoothing}")
  print(f"{'formulation':<16}{'temp MB':>10}{'GB accessed':>13}{'ms':>9}")
  for name, r in row["results"].items():
    print(f"{name:<16}{r['temp_bytes'] / 2**20:>10.1f}{r['bytes_accessed'] / 1e9:>13.2f}"
          f"{1e3 * r['seconds']:>9.1f}")
  print("ours / one-hot: " + ", ".join(f"{k} x{v:.3f}"
                                       for k, v in row["ratio_ours_over_onehot"].items()))
  write_jsonl(args.out or f"docs/results/bench_loss_{row['platform']}.jsonl", [row])


if __name__ == "__main__":
  main()
