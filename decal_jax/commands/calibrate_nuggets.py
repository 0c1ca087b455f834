"""Calibrate Dodo's nugget threshold Λ for a trained compressed-history LM, so that about
1 / r of the tokens become nuggets; cached generation needs it.

  python -m decal_jax.commands.calibrate_nuggets --gin_file=models/decoder_tiny.gin \
    --gin_file=models/dodo_lm.gin --gin_file=runs/lm_builtin.gin \
    --gin.MODEL_DIR="'runs/dodo_lm_tiny'" [--batches 8]

Reads --batches batches of the run's training split, sets Λ between two neighbouring
scorer outputs with 1 / r of them above it, reports the share of nuggets it gives on the validation split, and writes
MODEL_DIR/nugget_threshold.gin (`NUGGET_THRESHOLD = ...`) to pass as one more --gin_file
(`decal_jax.runtime.calibration`).
"""
import argparse
import sys

import gin

from decal_jax.runtime import calibration, gin_utils


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batches", type=int, default=8)
  args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
  files, paths, bindings = gin_utils.split_args(rest)
  gin_utils.parse(files, paths, bindings)
  model_dir = gin.query_parameter("%MODEL_DIR")
  train_cfg = gin.get_configurable("train/pipeline.DatasetConfig")()
  eval_cfg = gin.get_configurable("validation/pipeline.DatasetConfig")()
  model, params, step, _ = gin_utils.load_model(files, model_dir, search_paths=paths,
                                                bindings=bindings,
                                                feature_lengths=train_cfg.task_feature_lengths)
  result = calibration.calibrate(model, params, train_cfg, eval_cfg, args.batches)
  path = calibration.write_binding(model_dir, result["threshold"])
  print(f"step {step}: Λ = {result['threshold']:.6g} keeps "
        f"{100 * result['train_fraction']:.1f} % of sample tokens and "
        f"{100 * result['validation_fraction']:.1f} % of validation tokens (target "
        f"{100 * result['target_fraction']:.1f} %).\nwritten {path}: add "
        f"--gin_file={path} (or --gin.NUGGET_THRESHOLD={result['threshold']!r}).")


if __name__ == "__main__":
  main()
