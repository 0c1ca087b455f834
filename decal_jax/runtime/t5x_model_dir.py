"""A T5X-written MODEL_DIR read for eval / infer: its `checkpoint_<step>` folders found
(`t5x_steps`) and one step's params read, named and laid out as decal_jax's, checked against
the gin's model and placed with its shardings (`restore_t5x_params`)."""
import pathlib
from typing import Any, Dict

import flax
import jax
import numpy as np

from decal_jax.interop import t5x_checkpoints
from decal_jax.networks import param_layout
from decal_jax.runtime import checkpoints


def t5x_steps(model_dir: str) -> Dict[int, pathlib.Path]:
  """{step: folder} of the T5X `checkpoint_<step>` folders in `model_dir` (a T5X run's
  MODEL_DIR: `t5x_checkpoints.t5x_format`); empty for a decal_jax MODEL_DIR, also one that
  holds a decal_jax checkpoint beside T5X's (its steps are Orbax's, restored as ever)."""
  path = pathlib.Path(model_dir).expanduser().absolute()
  if not path.is_dir():
    return {}
  folders = [p for p in path.iterdir()
             if p.is_dir() and t5x_checkpoints.STEP_DIR.fullmatch(p.name)]
  if any((p / "architecture").is_dir() for p in folders):
    return {}
  return {t5x_checkpoints.step_of(p): p for p in folders if t5x_checkpoints.t5x_format(p)}


def restore_t5x_params(step_dir: pathlib.Path, abstract_params: Any, fix: str = "") -> Any:
  """The params of the T5X checkpoint in `step_dir` for a model whose params are
  `abstract_params` (ShapeDtypeStructs with shardings), for eval / infer of a T5X MODEL_DIR:
  read and named as `checkpoints.read_saved_params` does, converted to the model's T5 layout, cast to
  its dtypes and placed with its shardings. Unless every name and shape is the model's,
  ArchitectureMismatchError names the differences, the checkpoint's T5 sizes and `fix`
  (where to change the model's)."""
  source, step, saved = checkpoints.read_saved_params(str(step_dir))
  sizes = t5x_checkpoints.t5_sizes(saved)
  current = checkpoints.architecture_of(abstract_params)
  if param_layout.layout_change(saved, current):
    saved = param_layout.to_layout_of(saved, current)
  if checkpoints.architecture_of(saved) != current:
    raise checkpoints.ArchitectureMismatchError(_t5x_mismatch(f"{source} (step {step})", sizes,
                                                  checkpoints.architecture_of(saved), current, fix))
  like = flax.traverse_util.flatten_dict(flax.core.unfreeze(abstract_params), sep="/")
  placed = {name: _from_host(np.asarray(saved[name]).astype(target.dtype), target)
            for name, target in like.items()}
  return flax.traverse_util.unflatten_dict(placed, sep="/")


def _t5x_mismatch(source: str, sizes: Dict[str, int], saved: Dict[str, list],
                  current: Dict[str, list], fix: str) -> str:
  """Why a T5X checkpoint does not fit the gin's model: the differences, its sizes, the fix."""
  shown = ", ".join(f"{k} = {v}" for k, v in sizes.items())
  return (f"{source} does not fit the model the gin files configure:\n"
          f"{checkpoints.describe_mismatch(saved, current)}\n"
          + (f"The checkpoint is a T5 of {shown}. " if shown else "")
          + "Give the model gin file of the T5X run's sizes, or set them on t5.T5Config in "
          f"the model gin file given{fix}. Nothing was read into the model and nothing was "
          "written.")


def _from_host(value: np.ndarray, target: Any) -> jax.Array:
  """A host array placed with the sharding of `target` (each process holds all of it)."""
  return jax.make_array_from_callback(value.shape, target.sharding, lambda i: value[i])
