"""MODEL_DIR/model-info.txt: every parameter's name, size, shape (with its logical axis names)
and mesh partition spec, then the total count, in the lines T5X's `utils.log_model_info`
writes:

  Variable decoder/logits_dense/kernel   size 135168   shape (embed=32, vocab=4224)   partition spec (None, 'model')
  Total number of parameters: 1234567

and MODEL_DIR/compression.json: the compression ratio the run trains at (with the feature
lengths it was computed for), which eval compares with the ratio it evaluates at.
"""
import json
import os
from typing import Any, List, Optional

import flax
import jax
import numpy as np

from decal_jax import fileio
from decal_jax.data.batches import DatasetConfig
from decal_jax.models import BaseModel

FILE_NAME = "model-info.txt"
RATIO_FILE = "compression.json"


def describe(params: Any, params_axes: Any, shardings: Any) -> List[str]:
  """One line per parameter (arrays or ShapeDtypeStructs), then the total."""
  axes = flax.traverse_util.flatten_dict(flax.core.unfreeze(params_axes))
  specs = flax.traverse_util.flatten_dict(flax.core.unfreeze(shardings))
  lines, total = [], 0
  for key, value in flax.traverse_util.flatten_dict(flax.core.unfreeze(params)).items():
    names = axes.get(key[:-1] + (f"{key[-1]}_axes",))
    names = tuple(names.names) if names is not None else ()
    shape = tuple(value.shape)
    if len(names) == len(shape):
      shape_text = "({})".format(", ".join(f"{n}={d}" for n, d in zip(names, shape)))
    else:
      shape_text = str(shape)
    size = int(np.prod(shape, dtype=np.int64))
    total += size
    lines.append("Variable %-80s size %-12s shape %-40s partition spec %s" % (
        "/".join(key), size, shape_text, tuple(specs[key].spec)))
  lines.append(f"Total number of parameters: {total}")
  return lines


def write(model_dir: str, model: BaseModel, cfg: DatasetConfig, partitioner) -> str:
  """Writes MODEL_DIR/model-info.txt (process 0; shapes traced, nothing allocated); returns
  its path."""
  path = os.path.join(model_dir, FILE_NAME)
  if jax.process_index() != 0:
    return path
  shapes = model.input_shapes(cfg.task_feature_lengths)
  variables = jax.eval_shape(lambda: model.get_initial_variables(jax.random.PRNGKey(0), shapes))
  shardings = partitioner.params_shardings(variables["params_axes"], variables["params"])
  lines = describe(variables["params"], variables["params_axes"], shardings)
  fileio.write_text_atomic(path, "\n".join(lines) + "\n")
  write_ratio(model_dir, model, cfg)
  return path


def write_ratio(model_dir: str, model: BaseModel, cfg: DatasetConfig) -> None:
  """MODEL_DIR/compression.json: {"compression_ratio", "task_feature_lengths"} of training."""
  record = {"compression_ratio": float(model.compression_ratio(cfg.task_feature_lengths)),
            "task_feature_lengths": {k: int(v) for k, v in cfg.task_feature_lengths.items()}}
  fileio.write_text_atomic(os.path.join(model_dir, RATIO_FILE), json.dumps(record) + "\n")


def trained_ratio(model_dir: str) -> Optional[float]:
  """The compression ratio MODEL_DIR's run trained at; None for a run without the record
  (T5X's, or one from before it) or one that cannot be read."""
  try:
    with open(os.path.join(model_dir, RATIO_FILE)) as f:
      return float(json.load(f)["compression_ratio"])
  except (OSError, ValueError, KeyError, TypeError):
    return None
