"""Orbax checkpoints of the train state, the data position and the architecture.

Each step directory holds up to four items: `state` (params, optimizer state, step), `data`
(how many batches were consumed, the dataset seed and the dropout RNG), `architecture`
(every parameter's path and shape) and `dataset` (each process's tf.data iterator state,
`data.batch_iterator`; absent when the pipeline cannot be saved). Orbax writes a step to
a temporary directory and renames it when complete, so a crash never leaves a
half-written checkpoint that looks like the latest. Before restoring, the saved
architecture is compared with the model's, and a mismatch is reported without touching the
directory. A checkpoint damaged afterwards (a file truncated or deleted) is named with the
error: a resume sets it aside as `checkpoint_<step>.damaged` (kept, never listed or deleted
by Orbax) and continues from the newest intact one; eval / infer name the other steps to
pick instead. Params saved in another layout of the T5 network (`T5Config.scan_layers`,
`fused_qkv`) are converted when loaded for eval / infer (`restore_params`) or to start a
run (`restore_matching_params`), which also reads T5X checkpoints (`t5x_checkpoints`).
"""
import dataclasses
import pathlib
import re
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from decal_jax import fileio, partitioning
from decal_jax.interop import t5x_checkpoints
from decal_jax.networks import param_layout
from decal_jax.runtime import disk_space
from decal_jax.runtime.disk_space import DiskFullError  # raised by save; callers catch it here

if TYPE_CHECKING:  # the `dataset` item's iterator (tf.data); imported where it is saved
  from decal_jax.data import batch_iterator


class ArchitectureMismatchError(ValueError):
  pass


class OptimizerStateMismatchError(ValueError):
  """An intact checkpoint whose optimizer state another optimizer (setting) wrote."""


class NotACheckpointError(FileNotFoundError):
  """A checkpoint path (INITIAL_CHECKPOINT_PATH, export's --checkpoint) that holds none."""


CHECKPOINT_LAYOUTS = (
    "a decal_jax MODEL_DIR or one of its checkpoint_<step> folders (Orbax items state/ and "
    "architecture/), or a T5X checkpoint: a checkpoint_<step> folder (or the MODEL_DIR above "
    "it) holding T5X's msgpack `checkpoint` file, or an Orbax state/ item with `target`")


class DamagedCheckpointError(RuntimeError):
  """A checkpoint whose files no longer read back (truncated or partly deleted)."""


class _DatasetHandler(ocp.CheckpointHandler):
  """The `dataset` item: every process writes its own iterator state into the item folder
  (`batch_iterator.process_file`), inside Orbax's temporary step folder, so it is renamed
  into place with the rest of the checkpoint or not at all."""

  def save(self, directory, args: "DatasetArgs"):
    args.iterator.save(str(directory / _own_process_file()))

  def restore(self, directory, args: "DatasetArgs"):
    args.iterator.restore(str(directory / _own_process_file()))
    return True


@ocp.args.register_with_handler(_DatasetHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class DatasetArgs(ocp.args.CheckpointArgs):
  iterator: "batch_iterator.BatchIterator"


def _own_process_file() -> str:
  from decal_jax.data import batch_iterator  # TF
  return batch_iterator.process_file(jax.process_index(), jax.process_count())


def architecture_of(params: Any) -> Dict[str, list]:
  """{'encoder/layers_0/mlp/wi_0/kernel': [shape...], ...} for any params pytree."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
  return {k: list(v.shape) for k, v in sorted(flat.items())}


def describe_mismatch(saved: Dict[str, list], current: Dict[str, list], limit: int = 6) -> str:
  """A few lines naming the parameters that differ, and how many in all."""
  only_saved = sorted(set(saved) - set(current))
  only_model = sorted(set(current) - set(saved))
  reshaped = sorted(k for k in set(saved) & set(current) if saved[k] != current[k])
  lines = [f"  {len(only_saved)} only in the checkpoint, {len(only_model)} only in the model, "
           f"{len(reshaped)} with another shape; for example:"]
  lines += [f"  only in the checkpoint: {k} {saved[k]}" for k in only_saved[:limit]]
  lines += [f"  only in the model:      {k} {current[k]}" for k in only_model[:limit]]
  lines += [f"  shape differs:          {k} checkpoint {saved[k]} vs model {current[k]}"
            for k in reshaped[:limit]]
  return "\n".join(lines)


class Checkpointer:
  """Keep-N Orbax checkpoints in `directory` (T5X's MODEL_DIR/checkpoint_<step> layout)."""

  def __init__(self, directory: str, keep: int = 3, save_period: int = 1000):
    self.directory = fileio.resolved(directory)  # a URL (gs://...): an epath.Path
    self.save_period = save_period
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           step_prefix="checkpoint",
                                           enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data", "architecture", "dataset"))

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self) -> List[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: Any, data_position: Dict[str, int], force: bool = False,
           batches: Optional["batch_iterator.BatchIterator"] = None):
    """Saves when `step` is a multiple of save_period (or `force`), with the input
    pipeline's position when `batches` can save it."""
    if not force and step % self.save_period:
      return False
    if self.manager.latest_step() == step:
      return False  # already saved (e.g. periodic save on the final step)
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=ocp.args.JsonSave(dict(data_position)),
                              architecture=ocp.args.JsonSave(architecture_of(state["params"])),
                              **_dataset_args(batches))
    try:
      self.manager.save(step, args=args, force=True)
      self.manager.wait_until_finished()
    except Exception as e:
      if not disk_space.out_of_space(e):
        raise
      raise DiskFullError(disk_space.disk_full_message(
          self.directory, step, self.manager.latest_step(), e)) from e
    return True

  def saved_architecture(self, step: int) -> Dict[str, list]:
    restored = self.manager.restore(step, args=ocp.args.Composite(
        architecture=ocp.args.JsonRestore()))
    return dict(restored["architecture"])

  def check_architecture(self, step: int, params_like: Any, convert_layout: bool = False) -> str:
    """Raises ArchitectureMismatchError unless the saved params have the names and shapes
    of `params_like`, with `convert_layout` once converted to its T5 layout. Returns that
    conversion (`param_layout.layout_change`), '' for none."""
    saved, current = self.saved_architecture(step), architecture_of(params_like)
    change = param_layout.layout_change(saved, current) if convert_layout else ""
    if change:
      saved = _converted_architecture(saved, current)
    if saved != current:
      converted = f" (after converting its layout: {change})" if change else ""
      raise ArchitectureMismatchError(
          f"{self.directory} holds a checkpoint (step {step}) of a different architecture"
          f"{converted}:\n{describe_mismatch(saved, current)}\nUse a new MODEL_DIR, or the "
          f"gin config that wrote it (saved as {self.directory / 'config.gin'}). Nothing was "
          "changed on disk.")
    return change

  def saved_optimizer_state(self, step: int) -> Dict[str, list]:
    """{'0/v_row/encoder/.../kernel': [shape...], ...}: the optimizer state that
    checkpoint_<step> holds, read from its metadata (no array is read)."""
    saved = ocp.StandardCheckpointHandler().metadata(
        self.directory / f"checkpoint_{step}" / "state").tree
    return leaf_shapes(saved.get("opt_state", {}))

  def check_optimizer_state(self, step: int, abstract_opt_state: Any) -> None:
    """Raises OptimizerStateMismatchError unless the saved optimizer state has the leaves
    and shapes of `abstract_opt_state` (what this run's optimizer makes); an empty state
    (of an optimizer without one, e.g. SGD) matches only an empty one."""
    saved, current = self.saved_optimizer_state(step), leaf_shapes(abstract_opt_state)
    if saved != current:
      raise OptimizerStateMismatchError(
          f"checkpoint_{step} in {self.directory} is intact, with this run's architecture, "
          "but its optimizer state has other shapes than this run's optimizer makes:\n"
          f"{describe_mismatch(saved, current)}\nIt was written with another optimizer or "
          "setting. Resume with the one it was written with; a run of decal_jax's Adafactor "
          "from before it factored attention kernels by axis name resumes with "
          "--gin.optimizers.adafactor.factor_by_axis_names=False. Or start a new MODEL_DIR "
          "from its weights alone: --gin.INITIAL_CHECKPOINT_PATH=<this MODEL_DIR>. Nothing "
          "was changed on disk.")

  def restore(self, step: int, abstract_state: Any) -> Tuple[Any, Dict[str, int]]:
    """Restores onto `abstract_state` (ShapeDtypeStructs carrying the target shardings, so
    a checkpoint written on one mesh loads onto another)."""
    self.check_architecture(step, abstract_state["params"])
    self.check_optimizer_state(step, abstract_state["opt_state"])
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return restored["state"], dict(restored["data"])

  def restore_dataset(self, step: int, batches: "batch_iterator.BatchIterator") -> bool:
    """Moves `batches` to the position saved at `step`; False (nothing done) when that
    checkpoint holds none for this process (older checkpoint, unsavable pipeline, or
    another process count)."""
    saved = self.directory / f"checkpoint_{step}" / "dataset" / f"{_own_process_file()}.index"
    if not saved.exists():
      return False
    self.manager.restore(step, args=ocp.args.Composite(dataset=DatasetArgs(batches)))
    return True

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Only the params (for eval / infer), whatever optimizer wrote the checkpoint, placed
    with the shardings of `abstract_params`; params saved in another T5 layout are
    converted to that of `abstract_params`. A damaged checkpoint raises
    DamagedCheckpointError naming it, why, and the other steps to use instead."""
    params, reason = self._read(step, lambda: self._params(step, abstract_params))
    if reason:
      others = [s for s in self.all_steps() if s != step]
      choice = (f"Other checkpoints here: steps {others}; use one with "
                "--gin.CHECKPOINT_STEP=<step> (checkpoint_step=)." if others else
                "It is the only checkpoint here: train again, or copy in an intact one.")
      raise DamagedCheckpointError(f"checkpoint_{step} in {self.directory} is damaged "
                                   f"({reason}); nothing was read from it and it is left as "
                                   f"it is. {choice}")
    return params

  def _params(self, step: int, abstract_params: Any) -> Any:
    change = self.check_architecture(step, abstract_params, convert_layout=True)
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=self._whole_state(step)))["state"]["params"]
    if change:
      restored = _to_layout_of(restored, abstract_params)
    return jax.tree_util.tree_map(_placed, restored, abstract_params)

  def _whole_state(self, step: int) -> ocp.args.StandardRestore:
    """How `_params` reads the saved state: in the layout it was saved with (one that names
    devices this run lacks: whole on every device); in a multi-process run whole on every
    device of every process, so that each process holds a copy (a layout saved by one
    process names that process's devices only)."""
    if jax.process_count() == 1:
      return ocp.args.StandardRestore(fallback_sharding=_replicated())
    saved = ocp.StandardCheckpointHandler().metadata(
        self.directory / f"checkpoint_{step}" / "state").tree
    return ocp.args.StandardRestore(jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=_replicated()), saved))

  def restore_newest_intact(self, abstract_state: Any
                            ) -> Optional[Tuple[int, Any, Dict[str, int]]]:
    """(step, state, data position) of the newest checkpoint that reads back (None when
    there is none). The damaged ones after it are set aside (`set_aside`), each named in
    one line with its error; when none reads back, DamagedCheckpointError names them all
    and nothing is renamed. Another architecture or optimizer state is raised as it is."""
    damaged: Dict[int, str] = {}
    for step in reversed(self.all_steps()):
      restored, reason = self._read(step, lambda step=step: self.restore(step, abstract_state))
      if not reason:
        for bad, why in damaged.items():
          aside = self.set_aside(bad)
          partitioning.log(f"checkpoint_{bad} in {self.directory} is damaged ({why}): set "
                           f"aside as {aside.name}, resuming from checkpoint_{step}.")
        return (step, *restored)
      damaged[step] = reason
    if damaged:
      raise DamagedCheckpointError(
          f"Every checkpoint in {self.directory} is damaged: " +
          "; ".join(f"checkpoint_{s} ({why})" for s, why in damaged.items()) +
          ". Nothing was changed on disk. Move them out of MODEL_DIR (or use a new MODEL_DIR) "
          "to start afresh.")
    return None

  def damage(self, step: int) -> str:
    """'' when every saved item of checkpoint_<step> (state, data, architecture) reads back
    as it was written, else the first error in one line."""
    try:
      self.manager.restore(step, args=ocp.args.Composite(
          architecture=ocp.args.JsonRestore(), data=ocp.args.JsonRestore(),
          state=ocp.args.StandardRestore(fallback_sharding=_replicated())))
    except Exception as e:  # whatever a broken file raises
      return one_line(e)
    return ""

  def set_aside(self, step: int) -> pathlib.Path:
    """Renames checkpoint_<step> to checkpoint_<step>.damaged (-2, -3, ... if taken), out
    of Orbax's step listing, so it is neither restored, overwritten nor deleted."""
    source = self.directory / f"checkpoint_{step}"
    target, n = source.with_name(f"{source.name}.damaged"), 1
    while target.exists():
      n += 1
      target = source.with_name(f"{source.name}.damaged-{n}")
    if jax.process_index() == 0:
      source.rename(target)
    ocp.multihost.sync_global_processes(f"set_aside_checkpoint_{step}")
    self.manager.reload()
    return target

  def _read(self, step: int, read: Callable[[], Any]) -> Tuple[Any, str]:
    """(read(), '') or, when it fails because checkpoint_<step> is damaged, (None, why);
    other failures (another architecture, another optimizer) are raised as they are."""
    try:
      return read(), ""
    except ArchitectureMismatchError:
      raise
    except Exception:  # told apart by `damage`
      reason = self.damage(step)
      if not reason:
        raise  # intact: another optimizer state (OptimizerStateMismatchError) or a bug
      return None, reason

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def leaf_shapes(tree: Any) -> Dict[str, list]:
  """{'a/0/b': [shape...]} of every array leaf of `tree` (dict keys, sequence indices and
  named-tuple fields alike, so that a state and its Orbax metadata, which stores named
  tuples as dicts and tuples as lists, give the same names)."""
  def name(key) -> str:
    for field in ("key", "idx", "name"):
      if hasattr(key, field):
        return str(getattr(key, field))
    return str(key)
  return {"/".join(name(k) for k in path): list(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
          if hasattr(leaf, "shape")}


def one_line(error: BaseException, limit: int = 300) -> str:
  """'Type: first line of the message' of the error's root cause (Orbax raises TensorStore's
  errors from one whose message is pages of JSON spec), cut to `limit` characters."""
  while error.__cause__ is not None:
    error = error.__cause__
  first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
  text = f"{type(error).__name__}: {first}" if first else type(error).__name__
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _dataset_args(batches: Optional["batch_iterator.BatchIterator"]) -> Dict[str, Any]:
  return {"dataset": DatasetArgs(batches)} if batches is not None and batches.checkpointable \
      else {}


def _converted_architecture(saved: Dict[str, list], like: Dict[str, list]) -> Dict[str, list]:
  """The architecture `saved` would have once converted to the T5 layout of `like`."""
  shapes = {k: jax.ShapeDtypeStruct(tuple(v), jnp.float32) for k, v in saved.items()}
  return architecture_of(jax.eval_shape(lambda s: param_layout.to_layout_of(s, like), shapes))


def _to_layout_of(params: Any, like: Any) -> Any:
  """Nested `params` converted to the T5 layout of the nested tree `like`."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
  names = architecture_of(like)
  return flax.traverse_util.unflatten_dict(param_layout.to_layout_of(flat, names), sep="/")


def _placed(x: Any, target: Any) -> jax.Array:
  """A restored array with the sharding of `target`. One whole on the devices of several
  processes is placed from this process's own copy (CPU backends have no cross-host device
  transfer for `jax.device_put` to use)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and x.is_fully_replicated:
    local = np.asarray(x.addressable_data(0))
    return jax.make_array_from_callback(local.shape, target.sharding, lambda i: local[i])
  return jax.device_put(x, target.sharding)


def _replicated() -> jax.sharding.NamedSharding:
  """Where a saved array goes when the checkpoint's own layout names devices this run does
  not have (written on another mesh or by more processes): whole on every device."""
  mesh = jax.sharding.Mesh(jax.devices(), ("all",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def resolve_checkpoint(path: str) -> Tuple[str, int]:
  """(model dir, step) for a MODEL_DIR (its latest checkpoint) or a `checkpoint_<step>` dir."""
  p = fileio.resolved(path)
  match = re.fullmatch(r"checkpoint_(\d+)", p.name)
  if match and p.is_dir():
    directory, step = str(p.parent), int(match.group(1))
  elif not p.is_dir():
    raise FileNotFoundError(f"No checkpoint directory at {p}: give a MODEL_DIR of a finished "
                            "run or one of its checkpoint_<step> folders.")
  else:
    directory, step = str(p), Checkpointer(str(p)).latest_step()
  if step is None:
    raise FileNotFoundError(f"{p} holds no checkpoint_<step> folder to start from.")
  if not (fileio.as_path(directory) / f"checkpoint_{step}" / "architecture").is_dir():
    raise FileNotFoundError(
        f"{fileio.join(directory, f'checkpoint_{step}')} is neither a decal_jax checkpoint "
        "(items state/ and architecture/) nor a T5X one (a `checkpoint` msgpack file, or an "
        "Orbax state/ item holding `target`): give a MODEL_DIR or checkpoint_<step> folder "
        "of either.")
  return directory, step


def check_checkpoint_path(path: str, what: str = "The checkpoint path") -> str:
  """'t5x' or 'decal_jax': which checkpoint `path` names, as `read_saved_params` reads it;
  NotACheckpointError names the path, what is there and what a checkpoint folder holds.
  Reads folder listings and metadata only (no array): call it before any work, e.g. for
  INITIAL_CHECKPOINT_PATH before MODEL_DIR gets its first file."""
  if t5x_checkpoints.find_t5x_checkpoint(path) is not None:
    return "t5x"
  try:
    resolve_checkpoint(path)
  except FileNotFoundError:
    raise NotACheckpointError(
        f"{what} {path} is not a checkpoint: {_what_is_at(fileio.resolved(path))}. "
        f"Give {CHECKPOINT_LAYOUTS}.") from None
  return "decal_jax"


def _what_is_at(path: pathlib.Path) -> str:
  """A few words on what lies at a path that is no checkpoint."""
  if not path.exists():
    return "nothing is there"
  if path.is_file():
    return "it is a file"
  names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
  if not names:
    return "it is an empty folder"
  steps = sorted((p for p in path.iterdir() if p.is_dir() and re.fullmatch(r"checkpoint_\d+",
                                                                           p.name)),
                 key=lambda p: int(p.name.split("_")[1]))
  step_dir = path if re.fullmatch(r"checkpoint_\d+", path.name) else (steps or [None])[-1]
  if step_dir is not None:
    return (f"{step_dir} is neither a decal_jax checkpoint (items state/ and architecture/) nor "
            f"a T5X one (it holds {', '.join(sorted(p.name for p in step_dir.iterdir()))})")
  odd = path / t5x_checkpoints.CHECKPOINT_FILE
  why = ("; its `checkpoint` file is not T5X's msgpack (a TensorFlow checkpoint's index?)"
         if odd.is_file() and not t5x_checkpoints.is_msgpack_map(odd) else "")
  shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
  return f"the folder holds {shown}{why}"


def read_saved_params(path: str) -> Tuple[str, int, Dict[str, Any]]:
  """(what it is, step, flat '/'-joined params) of the checkpoint at `path`: a decal_jax
  MODEL_DIR or checkpoint_<step> folder, or a T5X one (`t5x_checkpoints`: msgpack +
  TensorStore or Orbax; T5X network names mapped to the T5 network's)."""
  check_checkpoint_path(path)
  t5x_dir = t5x_checkpoints.find_t5x_checkpoint(path)
  if t5x_dir is not None:
    flat = t5x_checkpoints.from_t5x_names(t5x_checkpoints.read_t5x_params(t5x_dir))
    return f"The T5X checkpoint {t5x_dir}", t5x_checkpoints.step_of(t5x_dir), flat
  directory, step = resolve_checkpoint(path)
  ckpt = Checkpointer(directory)
  saved = ckpt.manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(fallback_sharding=_replicated())))["state"]["params"]
  ckpt.close()
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(saved), sep="/")
  return f"The checkpoint {directory} (step {step})", step, flat


def restore_matching_params(path: str, params: Any, allow_partial: bool = False
                            ) -> Tuple[Any, Dict[str, Any]]:
  """`params` with every parameter that the checkpoint at `path` holds under the same name
  and shape replaced by the saved value (placed with the current sharding); the others keep
  their fresh initialisation. A T5 checkpoint in another layout (scan_layers, fused_qkv) is
  converted to that of `params` first. Returns (params, {'restored', 'initialised',
  'unused', 'reshaped', 'converted'}): 'unused' names every saved tensor not restored,
  'reshaped' those of them the model holds in another shape, 'converted' the layout change
  ('' for none). Fewer than half of the model's parameters restored (a checkpoint of another
  architecture) raises ArchitectureMismatchError unless `allow_partial`. `path` may also
  be a T5X checkpoint (`read_saved_params`)."""
  check_checkpoint_path(path, "INITIAL_CHECKPOINT_PATH")
  source, _, saved = read_saved_params(path)
  current = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
  change = param_layout.layout_change(saved, current)
  if change:
    saved = param_layout.to_layout_of(saved, current)
  saved_shapes = architecture_of(saved)
  matches = {name for name, value in current.items()
             if name in saved and saved_shapes.get(name) == list(value.shape)}
  report = {"restored": sorted(matches), "initialised": sorted(set(current) - matches),
            "unused": sorted(set(saved) - matches),
            "reshaped": sorted((set(saved) & set(current)) - matches), "converted": change}
  if not allow_partial and 2 * len(matches) < len(current):
    raise ArchitectureMismatchError(
        f"{source} restores only {len(matches)} of this "
        f"model's {len(current)} parameters (same name and shape); is it of another "
        f"architecture?\n{describe_mismatch(saved_shapes, architecture_of(params))}\nPoint "
        "INITIAL_CHECKPOINT_PATH at a checkpoint of this model, or set "
        "ALLOW_PARTIAL_RESTORE=True to start from the few that match.")
  if not matches:
    raise ArchitectureMismatchError(
        f"{source} shares no parameter (same name and shape) "
        f"with this model:\n{describe_mismatch(saved_shapes, architecture_of(params))}")
  merged = {name: jax.device_put(saved[name].astype(value.dtype), value.sharding)
            if name in matches else value for name, value in current.items()}
  return flax.traverse_util.unflatten_dict(merged, sep="/"), report


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of a pytree of arrays."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      tree)


def write_config(model_dir: str, config_text: str) -> None:
  """Stores the operative gin config in MODEL_DIR/config.gin (as T5X does); in a
  multi-host run only process 0 writes it."""
  if jax.process_index() != 0:
    return
  fileio.write_text_atomic(fileio.join(model_dir, "config.gin"), config_text)
