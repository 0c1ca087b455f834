"""The train state {'params', 'opt_state', 'step'}: built sharded on the mesh, restored from
MODEL_DIR's latest checkpoint, or started from another run's parameters (T5X's
`train_state.py` and `utils.restore`).

Parameters are sharded by their logical axis names (`partitioner.params_shardings`); each
optimizer-state leaf that mirrors a parameter is sharded like it, the rest is replicated.
"""
import pathlib
import sys
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax import fileio, partitioning
from decal_jax.runtime import checkpoints, optimizers, t5x_model_dir, vocabulary_record
from decal_jax.data.batches import DatasetConfig
from decal_jax.models import BaseModel


def check_model_dir(model_dir: str, binding: str) -> None:
  """Refuses a MODEL_DIR that is (or lies under) an existing file, before any start-up work;
  `binding` names the gin parameter it came from."""
  path = fileio.as_path(model_dir)
  above = () if fileio.is_url(model_dir) else path.parents  # an object store: no folders
  existing = next((p for p in (path, *above) if p.exists()), None)
  if existing is not None and not existing.is_dir():
    where = "is a file" if existing == path else f"lies under the file {existing}"
    raise NotADirectoryError(f"MODEL_DIR ({binding}) = {model_dir!r} {where}, not a folder: "
                             "give a folder for the run's checkpoints (new or existing), e.g. "
                             "--gin.MODEL_DIR=\"'runs/my_run'\".")


def abstract_variables(model: BaseModel, cfg: DatasetConfig):
  """The model's variables ('params', 'params_axes') as ShapeDtypeStructs."""
  shapes = model.input_shapes(cfg.task_feature_lengths)
  return jax.eval_shape(lambda: model.get_initial_variables(jax.random.PRNGKey(0), shapes))


def abstract_params(model: BaseModel, cfg: DatasetConfig, partitioner):
  """(params as ShapeDtypeStructs carrying their mesh shardings, those shardings)."""
  variables = abstract_variables(model, cfg)
  shardings = partitioner.params_shardings(variables["params_axes"], variables["params"])
  abstract = jax.tree_util.tree_map(
      lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), variables["params"],
      shardings)
  return abstract, shardings


def init_state(model: BaseModel, optimizer, partitioner, cfg: DatasetConfig, seed: int,
               on_host: bool = False):
  """Sharded {'params', 'opt_state', 'step'} built directly on the mesh. An optimizer of
  `optimizers` that factors by logical axis names (Adafactor) is given the model's here.
  `on_host`: built by the host's CPU backend, then placed on the mesh (the same values: a
  GPU compiles the initializers' many small kernels slowly, 75 s for T5.1.1-small on an
  H200; for a model that fits in host memory, e.g. a benchmark's)."""
  shapes = model.input_shapes(cfg.task_feature_lengths)
  optimizers.set_param_axes(optimizer, abstract_variables(model, cfg)["params_axes"])
  _, params_sharding = abstract_params(model, cfg, partitioner)

  def make(rng):
    params = model.get_initial_variables(rng, shapes)["params"]
    return {"params": params, "opt_state": optimizer.init(params),
            "step": jnp.zeros((), jnp.int32)}

  with partitioner.activate():
    abstract = jax.eval_shape(make, jax.random.PRNGKey(seed))
    shardings = {"params": params_sharding,
                 "opt_state": _opt_state_shardings(abstract, params_sharding, partitioner),
                 "step": partitioner.replicated()}
    if not on_host:
      return jax.jit(make, out_shardings=shardings)(jax.random.PRNGKey(seed)), shardings
  with jax.default_device(jax.devices("cpu")[0]):  # outside the mesh: no constraints
    state = jax.jit(make)(jax.random.PRNGKey(seed))
  return jax.device_put(state, shardings), shardings


def _opt_state_shardings(abstract, params_sharding, partitioner):
  """Each optimizer-state leaf of a parameter's shape that sits under that parameter's
  path (Adam moments, Adafactor's unfactored statistics, also inside `multi_transform` /
  `optimizers.per_layer` states whose trees do not mirror the params) is sharded like the
  parameter; the rest (factored row / column statistics, counters) is replicated."""
  params = {_dict_keys(path): (leaf.shape, sharding) for (path, leaf), sharding in zip(
      jax.tree_util.tree_flatten_with_path(abstract["params"])[0],
      jax.tree_util.tree_leaves(params_sharding))}

  def shard(path, leaf):
    keys = _dict_keys(path)
    for start in range(len(keys)):  # the param path is the leaf path's trailing dict keys
      shape, sharding = params.get(keys[start:], (None, None))
      if shape is not None:
        return sharding if shape == leaf.shape else partitioner.replicated()
    return partitioner.replicated()

  return jax.tree_util.tree_map_with_path(shard, abstract["opt_state"])


def _dict_keys(path) -> Tuple[str, ...]:
  """The trailing run of dict keys of a pytree path: ('encoder', 'layers', ..., 'kernel')."""
  keys = []
  for key in reversed(path):
    if not isinstance(key, jax.tree_util.DictKey):
      break
    keys.append(str(key.key))
  return tuple(reversed(keys))


def restore_latest(ckpt: checkpoints.Checkpointer, state, cfg: DatasetConfig, seed: int
                   ) -> Tuple[Any, Dict[str, Any]]:
  """(state, data position) from MODEL_DIR's newest intact checkpoint (damaged ones after
  it are set aside and named), or the fresh ones. The position holds the batches consumed,
  the data seed and the dropout RNG key."""
  fresh_rng = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed + 1))).tolist()
  found = ckpt.restore_newest_intact(checkpoints.abstract_like(state))
  if found is None:
    return state, {"batches_consumed": 0, "seed": cfg.seed, "rng": fresh_rng}
  step, restored, data = found
  seed_changed = data.get("seed", cfg.seed) != cfg.seed
  if seed_changed:
    partitioning.log(f"note: the checkpoint's data seed {data['seed']} differs from "
                     f"{cfg.seed}; the data stream restarts from the start of the new order.")
  partitioning.log(f"Resuming from step {step} in {ckpt.directory} "
                   f"({data.get('batches_consumed', 0)} batches consumed).")
  return restored, {"batches_consumed": int(data.get("batches_consumed", 0)), "seed": cfg.seed,
                    "rng": data.get("rng", fresh_rng),  # checkpoints before the RNG was saved
                    "seed_changed": seed_changed}


def start_from(path: str, params, allow_partial: bool = False):
  """`params` with every parameter of the same name and shape restored from `path` (a
  MODEL_DIR or one of its checkpoint_<step> folders); the others keep their values. Fewer
  than half restored is refused unless `allow_partial`."""
  params, report = checkpoints.restore_matching_params(path, params, allow_partial)
  partitioning.log(f"Starting from {path}: {len(report['restored'])} parameters restored, "
                   f"{len(report['initialised'])} newly initialised, {len(report['unused'])} "
                   f"in the checkpoint unused ({len(report['reshaped'])} of them with another "
                   "shape in this model).")
  if report["converted"]:
    partitioning.log(f"  converted the checkpoint's layout: {report['converted']}")
  for key in ("initialised", "unused"):
    if report[key]:
      partitioning.log(f"  {key}: " + ", ".join(report[key][:8]) +
                       (" ..." if len(report[key]) > 8 else ""))
  return params


def restore_params(model: BaseModel, model_dir: str, cfg: DatasetConfig, partitioner,
                   step: Optional[int] = None):
  """(params, step) of checkpoint_<step> in `model_dir`, by default the latest (clear error
  if there is none, if it is damaged: `checkpoints.DamagedCheckpointError`, or if the run
  was trained with another vocabulary: `vocabulary_record.VocabularyMismatchError`). A T5X
  run's MODEL_DIR (`t5x_model_dir.t5x_steps`) is read by `restore_t5x_params`."""
  t5x = t5x_model_dir.t5x_steps(model_dir)
  if t5x:
    return restore_t5x_params(model, model_dir, t5x, cfg, partitioner, step)
  ckpt = checkpoints.Checkpointer(model_dir)
  steps = ckpt.all_steps()
  if not steps:
    raise FileNotFoundError(f"No checkpoint in {model_dir}: train first with "
                            "`python -m decal_jax.train ... --gin.MODEL_DIR=...`.")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise FileNotFoundError(f"No checkpoint_{step} in {model_dir}; it holds steps {steps}: "
                            "set CHECKPOINT_STEP (checkpoint_step=) to one of them.")
  vocabulary_record.check(model_dir, model)  # another vocabulary than the run's: refused
  params = ckpt.restore_params(step, abstract_params(model, cfg, partitioner)[0])
  ckpt.close()
  return params, step


def restore_t5x_params(model: BaseModel, model_dir: str, t5x: Dict[int, pathlib.Path],
                       cfg: DatasetConfig, partitioner, step: Optional[int] = None):
  """(params, step) of the T5X checkpoint_<step> folders `t5x` ({step: folder}) of a T5X
  run's `model_dir`, by default the latest, mapped into the model (T5X network names to
  ours, `t5x_model_dir.restore_t5x_params`; another architecture than the gin's model is
  refused naming the shapes and the gin files). Nothing is written into `model_dir`, and
  the vocabulary is not checked: T5X records none."""
  steps = sorted(t5x)
  step = steps[-1] if step is None else step
  if step not in t5x:
    raise FileNotFoundError(f"No checkpoint_{step} in {model_dir}; this T5X MODEL_DIR holds "
                            f"steps {steps}: set CHECKPOINT_STEP (checkpoint_step=) to one "
                            "of them.")
  files = gin_files_given()
  fix = f" (--gin_file={', '.join(files)})" if files else ""
  params = t5x_model_dir.restore_t5x_params(t5x[step], abstract_params(model, cfg, partitioner)[0],
                                          fix)
  partitioning.log(f"Read the T5X checkpoint {t5x[step]} (step {step}); its vocabulary is "
                   "not recorded: decode with the one the T5X run was trained with.")
  return params, step


def gin_files_given() -> List[str]:
  """The --gin_file values of the entry point's command line (`decal_jax.runtime.cli`,
  looked up only if loaded); empty when there is none (a call from Python)."""
  cli = sys.modules.get("decal_jax.runtime.cli")
  if cli is None or not cli.FLAGS.is_parsed():
    return []
  return list(cli.FLAGS.gin_file)
