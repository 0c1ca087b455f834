"""GPTHF against GPTs on real text that does not repeat: validation perplexity over seeds.

  DECAL_DATA_DIR=../shared/data python -m tools.gpthf_table \
      --out docs/results/gpthf_lm_real.md

Every variant trains from scratch with runs/gpthf_lm_real.gin (decal_real_text_sentence_lm:
~1M words of C4, WikiText-2 and TinyStories, each sentence followed by the end id; a
4,000-piece vocabulary of the training split), --steps x --batch chunks of 256 tokens, a
fraction of the ~1.6M training tokens, so no token is read twice:

  gpthf   models/gpthf_tiny.gin: 4 word-level + 2 sentence-level blocks
  gpt-6   models/decoder_tiny.gin with 6 blocks: exactly GPTHF's parameters
  gpt-5   5 blocks: the GPT whose FLOPs per token are closest to GPTHF's, counting only the
          keys each token may see (`flops.gpthf_forward_flops` / `decoder_flops`,
          causal=True, at the validation text's mean sentence length; the same per-token
          count as cached generation). As computed (dense masked attention), GPTHF costs
          exactly what gpt-6 does.

For each run: perplexity per subword over the whole validation split (end ids included, the
same tokens for every model), and the same loss split by where the predicted token sits in
its sentence (first token, 2nd-4th, 5th-16th, later ones, the end id), read from the trained
checkpoint, to see where one model loses to the other. The table gives mean +- standard
error over --seeds (the seed sets initialisation and data order).

Options: --steps (150), --batch (4), --learning_rate (3e-3), --seeds (0,1,2), --variants,
--work (runs/gpthf_table: one folder per run; finished runs are reused), --out.
"""
import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Dict, List

import numpy as np

from decal_jax import fileio
from tools import benchmarking

LENGTH = 256
BASE = ["runs/gpthf_lm_real.gin"]
VARIANTS = {
    "gpthf": (["models/gpthf_tiny.gin"] + BASE, []),
    "gpt-6": (["models/decoder_tiny.gin"] + BASE, ["decoder.DecoderConfig.num_layers = 6"]),
    "gpt-5": (["models/decoder_tiny.gin"] + BASE, ["decoder.DecoderConfig.num_layers = 5"]),
}
# Place of the predicted token in its sentence (0 = first): (name, first place, last place).
PLACES = (("1st", 0, 0), ("2nd-4th", 1, 3), ("5th-16th", 4, 15), ("17th+", 16, 10**6))
BUCKETS = [p[0] for p in PLACES] + ["end"]


def bindings(args, seed: int, model_dir: pathlib.Path) -> List[str]:
  return [f"MODEL_DIR = '{model_dir}'", f"TRAIN_STEPS = {args.steps}",
          f"BATCH_SIZE = {args.batch}", f"LEARNING_RATE = {args.learning_rate}",
          f"WARMUP_STEPS = {max(1, args.steps // 10)}", f"SEED = {seed}",
          f"EVAL_PERIOD = {args.steps}", f"CHECKPOINT_PERIOD = {args.steps}",
          f"TASK_FEATURE_LENGTHS = {{'targets': {LENGTH}}}"]


def run(name: str, seed: int, args, work: pathlib.Path) -> Dict:
  import gin
  from decal_jax.runtime import gin_utils, trainer
  import decal_jax.tasks  # noqa: F401  (registers decal_real_text_sentence_lm)
  folder = work / f"{name}_seed{seed}"
  done = folder / "result.json"
  if done.exists():
    print(f"{name} seed {seed}: finished before ({done}); reusing it.", flush=True)
    return json.loads(done.read_text())
  files, extra = VARIANTS[name]
  binds = bindings(args, seed, folder / "model") + extra
  print(f"{name} seed {seed}: python -m decal_jax.train " +
        " ".join(f"--gin_file={f}" for f in files) + " " +
        " ".join(f'--gin_bindings="{b}"' for b in binds), flush=True)
  gin_utils.parse(files, [], binds)
  start = time.time()
  metrics = gin.get_configurable(trainer.train)(gin_config_text=gin.config_str(),
                                                show_example=False)
  seconds = time.time() - start
  result = {"name": name, "seed": seed, "perplexity": float(metrics["perplexity"]),
            "accuracy": float(metrics["accuracy"]), "tokens": float(metrics["target_tokens"]),
            "train_seconds": round(seconds, 1), "places": by_place(files, binds, folder / "model")}
  folder.mkdir(parents=True, exist_ok=True)
  fileio.write_text_atomic(done, json.dumps(result, indent=1))
  return result


def by_place(files, binds, model_dir: pathlib.Path) -> Dict[str, List[float]]:
  """{bucket: [summed negative log-likelihood, token count]} over the validation split, the
  buckets by the predicted token's place in its sentence (and 'end' for the end id)."""
  import gin
  import jax
  import jax.numpy as jnp
  from decal_jax.runtime import gin_utils
  from decal_jax.data import pipeline, sentences
  model, params, _, _ = gin_utils.load_model(files, str(model_dir), bindings=binds)
  cfg = dataclasses.replace(gin.get_configurable("validation/pipeline.DatasetConfig")(),
                            batch_size=8)
  end = sentences.sentence_end_id(model.output_vocabulary)
  bound = sentences.configured_max_sentence_length()

  @jax.jit
  def nll(batch):  # [b, t] negative log-likelihood of each target token
    logits = model._compute_logits(params, batch)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [b, t, vocab]
    return -jnp.take_along_axis(logp, batch["decoder_target_tokens"][..., None], -1)[..., 0]

  sums = {key: [0.0, 0] for key in BUCKETS}
  for batch in pipeline.lockstep_batches(pipeline.get_dataset(cfg, model, 1), 8, 10**6):
    losses = np.asarray(nll(batch))  # [b, t]
    for key, pick in place_buckets(batch["decoder_target_tokens"], end, bound).items():
      sums[key][0] += float(losses[pick].sum())
      sums[key][1] += int(pick.sum())
  return sums


def place_buckets(targets: np.ndarray, end: int, bound: int) -> Dict[str, np.ndarray]:
  """{bucket: bool `[b, t]`}: the real (non-padding) target tokens by the place of each in
  its sentence (PLACES, counted as `gpthf.sentence_layout` counts them), end ids apart."""
  from decal_jax.networks import gpthf
  place = np.asarray(gpthf.sentence_layout(targets, end, bound).place)  # [b, t]
  words = (targets > 0) & (targets != end)  # [b, t]
  out = {key: words & (place >= low) & (place <= high) for key, low, high in PLACES}
  out["end"] = targets == end
  return out


def equal_flop_note(mean_sentence: float) -> str:
  """GPTHF's and the GPTs' FLOPs per token at LENGTH tokens (causal and dense counting)."""
  from decal_jax.networks import flops
  from decal_jax.networks.decoder import DecoderConfig
  from decal_jax.networks.gpthf import GpthfConfig
  gpt = DecoderConfig(vocab_size=4224, emb_dim=128, num_heads=4, num_kv_heads=2, head_dim=32,
                      mlp_dim=384, num_layers=6)
  hf = GpthfConfig(decoder=gpt, encoder_layers=4, sentence_end_id=4223)
  causal = flops.gpthf_forward_flops(hf, LENGTH, mean_sentence, causal=True) / LENGTH
  dense = flops.gpthf_forward_flops(hf, LENGTH) / LENGTH
  gpts = {n: flops.decoder_flops(dataclasses.replace(gpt, num_layers=n), LENGTH,
                                 causal=True) / LENGTH for n in (4, 5, 6)}
  closest = min(gpts, key=lambda n: abs(gpts[n] - causal))
  return (f"FLOPs per token, forward, {LENGTH}-token chunks, only the keys each token may see "
          f"(causal; sentences of {mean_sentence:.1f} tokens as in the validation text): "
          f"GPTHF {causal / 1e6:.2f} M; GPT " +
          ", ".join(f"{n} blocks {v / 1e6:.2f} M" for n, v in gpts.items()) +
          f": closest is {closest} blocks (gpt-{closest}). Counting the dense masked "
          f"attention the code computes, GPTHF costs {dense / 1e6:.2f} M, exactly gpt-6.")


def mean_se(values: List[float]) -> str:
  return benchmarking.mean_se_text(values, digits=1)


def table(results: List[Dict]) -> List[str]:
  names = list(dict.fromkeys(r["name"] for r in results))
  keys = BUCKETS
  lines = ["| model | validation perplexity (mean ± s.e.) | per seed | token accuracy | "
           + " | ".join(f"ppl, {k} token" for k in keys) + " | train wall per run (s) |",
           "|---|---|---|---|" + "---|" * len(keys) + "---|"]
  for name in names:
    rows = [r for r in results if r["name"] == name]
    ppl = [r["perplexity"] for r in rows]
    cells = [mean_se([math.exp(r["places"][k][0] / max(r["places"][k][1], 1)) for r in rows])
             for k in keys]
    lines.append(f"| {name} | **{mean_se(ppl)}** | "
                 + ", ".join(f"{p:.1f}" for p in ppl)
                 + f" | {mean_se([100 * r['accuracy'] for r in rows])} % | "
                 + " | ".join(cells)
                 + f" | {statistics.mean(r['train_seconds'] for r in rows):.0f} |")
  counts = results[0]["places"]
  gap = max(abs(math.log(r["perplexity"]) - sum(v[0] for v in r["places"].values())
                / sum(v[1] for v in r["places"].values())) for r in results)
  lines += ["", "Validation tokens per bucket: " +
            ", ".join(f"{k} {counts[k][1]:,}" for k in keys) + f" (the buckets' losses, "
            f"summed, give every run's perplexity to within {gap:.1e} in log)."]
  return lines


def mean_sentence_length() -> float:
  from decal_jax.data import real_text, real_text_files, sentences
  vocabulary = real_text.vocabulary()
  end = sentences.sentence_end_id(vocabulary)
  ids = np.concatenate([sentences.encode_sentences(d, vocabulary, end, 64)
                        for d in real_text_files.documents()["validation"]])
  return len(ids) / max(int((ids == end).sum()), 1)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--learning_rate", type=float, default=3e-3)
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--work", default="runs/gpthf_table")
  parser.add_argument("--out", default=None, help="markdown file for the table")
  args = parser.parse_args(argv)
  names = [n.strip() for n in args.variants.split(",") if n.strip()]
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    sys.exit(f"Unknown variants {unknown}; choose from {list(VARIANTS)}.")
  try:
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
  except ValueError:
    parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}.")
  work = pathlib.Path(args.work).resolve() / (
      f"steps{args.steps}_batch{args.batch}_lr{args.learning_rate:g}")
  load_before, start = benchmarking.load_average(), time.time()
  results = [run(name, seed, args, work) for seed in seeds for name in names]
  wall = time.time() - start
  command = benchmarking.command("tools.gpthf_table", argv)
  text = "\n".join(benchmarking.header(
      "GPTHF vs GPT on real text that does not repeat (C4 / WikiText-2 / TinyStories)",
      command,
      f"training: {args.steps} steps of batch {args.batch} x {LENGTH} tokens "
      f"({args.steps * args.batch * LENGTH:,} tokens, each read once), AdamW, cosine "
      f"{args.learning_rate:g}, warm-up {max(1, args.steps // 10)} steps; seeds {args.seeds}",
      equal_flop_note(mean_sentence_length()),
      f"wall time of this command: {wall:.0f} s (runs finished before are reused); host load "
      f"average (1/5/15 min) before / after: {load_before} / {benchmarking.load_average()}")
      + [""] + table(results))
  print(text)
  if args.out:
    fileio.write_text_atomic(pathlib.Path(args.out).resolve(), text + "\n")
    print(f"table written to {args.out}")


if __name__ == "__main__":
  main()
