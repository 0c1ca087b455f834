# python tools/calibrate_nuggets.py --gin_file=models/decoder_tiny.gin --gin_file=models/dodo_lm.gin \
#     --gin_file=runs/lm_builtin.gin --gin.MODEL_DIR="'runs/dodo_lm_tiny'"
"""Calibrate Dodo's nugget threshold Λ for a trained compressed-history LM, so that about
1 / r of the tokens become nuggets; cached generation needs it.

  python tools/calibrate_nuggets.py --gin_file=models/decoder_tiny.gin \
    --gin_file=models/dodo_lm.gin --gin_file=runs/lm_builtin.gin \
    --gin.MODEL_DIR="'runs/dodo_lm_tiny'" [--batches 8]

Reads --batches batches of the run's training split, takes the (1 - 1/r) quantile of the
scorer's outputs, reports the share of nuggets it gives on the validation split, and writes
MODEL_DIR/nugget_threshold.gin (`NUGGET_THRESHOLD = ...`) to pass as one more --gin_file.
"""
import argparse
import dataclasses
import os
import pathlib
import sys
from typing import Dict

import numpy as np
import tqdm


def _token_batches(cfg, model, count: int):
  from decal_jax import trainer
  ds = trainer.get_dataset(dataclasses.replace(cfg, shuffle=False), model, num_epochs=1)
  for i, batch in enumerate(ds.as_numpy_iterator()):
    if i >= count:
      break
    yield batch["decoder_input_tokens"]


def calibrate(model, params, train_cfg, eval_cfg, batches: int = 8) -> Dict[str, float]:
  """{'threshold', 'train_fraction', 'validation_fraction', 'target_fraction'}."""
  from decal_jax.networks import dodo_lm
  module = model.module
  if not isinstance(module, dodo_lm.DodoLM) or module.config.selection != "nuggets":
    raise ValueError("Calibration is for Dodo's compressed-history LM with "
                     "selection='nuggets' (models/dodo_lm.gin).")
  sample = list(tqdm.tqdm(_token_batches(train_cfg, model, batches), total=batches,
                          desc="score sample text"))
  threshold = dodo_lm.calibrate_threshold(module, params, sample)
  held_out = np.concatenate(list(_token_batches(eval_cfg, model, batches)))
  return {"threshold": threshold,
          "train_fraction": dodo_lm.nugget_fraction(module, params, np.concatenate(sample),
                                                    threshold),
          "validation_fraction": dodo_lm.nugget_fraction(module, params, held_out, threshold),
          "target_fraction": 1.0 / module.config.compression_ratio}


def write_binding(model_dir: str, threshold: float) -> pathlib.Path:
  path = pathlib.Path(model_dir) / "nugget_threshold.gin"
  tmp = path.with_suffix(".tmp")
  tmp.write_text(f"# written by tools/calibrate_nuggets.py\nNUGGET_THRESHOLD = {threshold!r}\n")
  os.replace(tmp, path)
  return path


def main(argv=None):
  import gin
  from decal_jax import gin_utils, partitioning, trainer
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batches", type=int, default=8)
  args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
  files, paths, bindings = gin_utils.split_args(rest)
  gin_utils.parse(files, paths, bindings)
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  model_dir = gin.query_parameter("%MODEL_DIR")
  train_cfg = gin.get_configurable("train/trainer.DatasetConfig")()
  eval_cfg = gin.get_configurable("validation/trainer.DatasetConfig")()
  params, step = trainer.restore_params(model, model_dir, train_cfg, partitioning.Partitioner())
  result = calibrate(model, params, train_cfg, eval_cfg, args.batches)
  path = write_binding(model_dir, result["threshold"])
  print(f"step {step}: Λ = {result['threshold']:.6g} keeps "
        f"{100 * result['train_fraction']:.1f} % of sample tokens and "
        f"{100 * result['validation_fraction']:.1f} % of validation tokens (target "
        f"{100 * result['target_fraction']:.1f} %).\nwritten {path}: add "
        f"--gin_file={path} (or --gin.NUGGET_THRESHOLD={result['threshold']!r}).")


if __name__ == "__main__":
  main()
