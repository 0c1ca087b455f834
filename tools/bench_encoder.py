"""Encoder / decoder cost of DeCAL at compression ratios C, as ratios to C = 1.

  python -m tools.bench_encoder --size small --lengths 512 2048 --ratios 1 2 4 8 --out \
      docs/results/bench_encoder_cpu.md --plot docs/results/bench_encoder_cpu.png

For every input length n and ratio C this measures, in one process and one run:
  * encoder step: one jitted forward pass of `encode` over n tokens (DeCAL runs over the
    m + n stream and outputs m = ceil(n / C) latents);
  * decoder step: one jitted cached decoding step (one new token) cross-attending to the
    m encoded positions;
and reads XLA's own FLOP count of each compiled program (`compiled.cost_analysis()`).
Times are the median of --repeats runs after a warm-up. The table is printed and, with
--out, written as Markdown with the command, machine and date.
"""
import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tools import benchmarking, results_files
from tools.benchmarking import median_seconds, xla_cost
from decal_jax.networks.t5 import T5Config, Transformer

SIZES = {  # T5.1.1 published dimensions (tiny is ours)
    "tiny": dict(emb_dim=128, num_heads=4, head_dim=32, mlp_dim=384, num_encoder_layers=3,
                 num_decoder_layers=2),
    "small": dict(emb_dim=512, num_heads=6, head_dim=64, mlp_dim=1024, num_encoder_layers=8,
                  num_decoder_layers=8),
    "base": dict(emb_dim=768, num_heads=12, head_dim=64, mlp_dim=2048, num_encoder_layers=12,
                 num_decoder_layers=12),
    "large": dict(emb_dim=1024, num_heads=16, head_dim=64, mlp_dim=2816, num_encoder_layers=24,
                  num_decoder_layers=24),
}


def measure(cfg: T5Config, batch: int, n: int, decode_len: int, repeats: int, params):
  """Returns (encoder seconds, encoder flops, decoder-step seconds, decoder-step flops)."""
  model = Transformer(cfg)
  tokens = jnp.asarray(np.random.RandomState(0).randint(2, cfg.vocab_size, (batch, n)), jnp.int32)
  encode = jax.jit(functools.partial(model.apply, enable_dropout=False, method=model.encode))
  enc_compiled = encode.lower({"params": params}, tokens).compile()
  enc_time = median_seconds(enc_compiled, ({"params": params}, tokens), repeats)
  encoded = enc_compiled({"params": params}, tokens)

  dummy_dec = jnp.ones((batch, decode_len), jnp.int32)
  init_cache = jax.jit(functools.partial(model.apply, decode=True, enable_dropout=False,
                                         mutable=["cache"]))
  _, cache = init_cache({"params": params}, jnp.ones_like(tokens), dummy_dec, dummy_dec)
  step = jax.jit(functools.partial(model.apply, decode=True, enable_dropout=False,
                                   mutable=["cache"], method=model.decode))
  one = jnp.ones((batch, 1), jnp.int32)
  step_args = ({"params": params, "cache": cache["cache"]}, encoded, tokens, one, one)
  dec_compiled = step.lower(*step_args).compile()
  dec_time = median_seconds(dec_compiled, step_args, repeats)
  return enc_time, xla_cost(enc_compiled), dec_time, xla_cost(dec_compiled)


def plot(rows, path: str, title: str) -> None:
  """Encoder and decoder-step cost relative to C = 1, per input length (needs matplotlib)."""
  plt = results_files.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for ax, (col, name) in zip(axes, ((7, "encoder"), (9, "decoder step"))):
    for n in sorted({r[0] for r in rows}):
      sel = [r for r in rows if r[0] == n]
      ax.plot([r[1] for r in sel], [r[col] for r in sel], "o-", label=f"time, n={n}")
      ax.plot([r[1] for r in sel], [r[col + 1] for r in sel], "s--", label=f"FLOPs, n={n}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("compression ratio C")
    ax.set_title(f"{name} cost / C=1")
    ax.legend(fontsize=8)
  axes[0].set_ylabel("ratio to C = 1")
  fig.suptitle(title)
  fig.tight_layout()
  results_files.save_figure(fig, path)


def _init_params(cfg: T5Config):
  model, ones = Transformer(cfg), jnp.ones((1, 8), jnp.int32)
  return jax.jit(lambda r: model.init(r, ones, ones[:, :4], ones[:, :4],
                                      enable_dropout=False)["params"])(jax.random.PRNGKey(0))


def run(args) -> str:
  base = T5Config(vocab_size=32128, **SIZES[args.size])
  rows = []
  for n in args.lengths:
    baseline = None
    for ratio in args.ratios:
      cfg = dataclasses.replace(base, compression_ratio=ratio)
      result = measure(cfg, args.batch, n, args.decode_len, args.repeats, _init_params(cfg))
      baseline = baseline or result
      rel = [r / b for r, b in zip(result, baseline)]
      rows.append((n, ratio, cfg.compression.output_length(n), *result, *rel))
      print(f"n={n:5d} C={ratio}: encoder {result[0] * 1e3:9.2f} ms ({rel[0]:.2f}x)  "
            f"{result[1] / 1e9:9.2f} GFLOP ({rel[1]:.2f}x) | decoder step "
            f"{result[2] * 1e3:7.3f} ms ({rel[2]:.2f}x) {result[3] / 1e6:9.2f} MFLOP "
            f"({rel[3]:.2f}x)", flush=True)
  if args.plot:
    plot(rows, args.plot, f"DeCAL vs C=1, T5.1.1 {args.size}, {jax.devices()[0].platform}")
  return _markdown(args, rows)


def _markdown(args, rows) -> str:
  lines = benchmarking.header(
      f"DeCAL encoder / decoder cost vs compression ratio (T5.1.1 {args.size})",
      benchmarking.command("tools.bench_encoder", None),
      f"batch {args.batch}; decoder step = one cached token with a {args.decode_len}-slot "
      f"cache; times are medians of {args.repeats} runs after warm-up; FLOPs from XLA "
      "`compiled.cost_analysis()`; ratios are to C = 1 at the same n, measured in this run.")
  lines += [
      "",
      "| n | C | m | encoder ms | encoder GFLOP | decoder step ms | decoder step MFLOP "
      "| enc time / C=1 | enc FLOPs / C=1 | dec time / C=1 | dec FLOPs / C=1 |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
  for n, c, m, et, ef, dt, df, ret, ref_, rdt, rdf in rows:
    lines.append(f"| {n} | {c} | {m} | {et * 1e3:.2f} | {ef / 1e9:.2f} | {dt * 1e3:.3f} | "
                 f"{df / 1e6:.2f} | {ret:.2f} | {ref_:.2f} | {rdt:.2f} | {rdf:.2f} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", choices=sorted(SIZES), default="small")
  parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
  parser.add_argument("--ratios", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--decode_len", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=None, help="write the Markdown table here")
  parser.add_argument("--plot", default=None, help="write a PNG of the ratios here")
  args = parser.parse_args(argv)
  if args.ratios[0] != 1:
    parser.error("--ratios must start with 1: every ratio is reported relative to C = 1.")
  table = run(args)
  print(table)
  if args.out:
    results_files.write_text(args.out, table)


if __name__ == "__main__":
  main()
