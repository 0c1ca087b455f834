"""Calibrating Dodo's nugget threshold Λ for a trained compressed-history LM (`DodoLM` with
selection='nuggets'): cached generation keeps the tokens whose score exceeds Λ, so Λ is set
between two neighbouring scorer outputs on sample text with 1 / r of them above it, and
about 1 / r of the tokens become nuggets. `decal_jax/commands/calibrate_nuggets.py` runs it; `tools/lm_table.py` uses it too.
"""
import dataclasses
import pathlib
from typing import Dict, Iterator

import numpy as np
import tqdm

from decal_jax import fileio


def token_batches(dataset_cfg, model, count: int) -> Iterator[np.ndarray]:
  """The first `count` batches of `decoder_input_tokens` [batch, n] of a split, in order."""
  from decal_jax.data import pipeline
  ds = pipeline.get_dataset(dataclasses.replace(dataset_cfg, shuffle=False), model, num_epochs=1)
  for i, batch in enumerate(ds.as_numpy_iterator()):
    if i >= count:
      break
    yield batch["decoder_input_tokens"]


def calibrate(model, params, train_cfg, eval_cfg, batches: int = 8) -> Dict[str, float]:
  """Λ from `batches` training batches, and the share of nuggets it gives there and on the
  validation split: {'threshold', 'train_fraction', 'validation_fraction',
  'target_fraction'}."""
  from decal_jax.networks import dodo_lm
  module = model.module
  if not isinstance(module, dodo_lm.DodoLM) or module.config.selection != "nuggets":
    raise ValueError("Calibration is for Dodo's compressed-history LM with "
                     "selection='nuggets' (models/dodo_lm.gin).")
  sample = list(tqdm.tqdm(token_batches(train_cfg, model, batches), total=batches,
                          desc="score sample text"))
  threshold = dodo_lm.calibrate_threshold(module, params, sample)
  held_out = np.concatenate(list(token_batches(eval_cfg, model, batches)))
  return {"threshold": threshold,
          "train_fraction": dodo_lm.nugget_fraction(module, params, np.concatenate(sample),
                                                    threshold),
          "validation_fraction": dodo_lm.nugget_fraction(module, params, held_out, threshold),
          "target_fraction": 1.0 / module.config.compression_ratio}


def write_binding(model_dir: str, threshold: float) -> pathlib.Path:
  """Writes MODEL_DIR/nugget_threshold.gin (`NUGGET_THRESHOLD = Λ`), one more --gin_file."""
  path = pathlib.Path(model_dir) / "nugget_threshold.gin"
  fileio.write_text_atomic(path, "# written by decal_jax/commands/calibrate_nuggets.py\n"
                                 f"NUGGET_THRESHOLD = {threshold!r}\n")
  return path
