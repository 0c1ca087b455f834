"""Meshes, logical-axis sharding rules and multi-host start-up (T5X's partitioner, on
`jax.jit` + NamedSharding).

The network names every parameter axis and its block-boundary activations with logical
names (`embed`, `mlp`, `heads`, `batch`, ...). A rules table — kept here, outside the
model — maps each logical name to mesh axes or to None (replicated). The mesh has three
named axes:

  data   pure data parallelism: the batch is split, parameters are replicated;
  fsdp   data parallelism whose devices also split every parameter (and its optimizer
         state) along the parameter's largest dimension that the rules leave whole
         (ZeRO-3 / MaxText `fsdp` / T5X `parameter_partitioning_dims=2`);
  model  tensor (Megatron-style) parallelism over `heads`, `mlp`, `vocab`.

The batch is split over ('data', 'fsdp'). One CPU device is the degenerate 1 x 1 x 1 mesh;
`--xla_force_host_platform_device_count=8` gives a real 8-device mesh on one CPU, and
`initialize_distributed` joins several processes (hosts) into one mesh. docs/scaling.md
says how to launch on TPU pod slices and GPU hosts.
"""
import contextlib
import dataclasses
import functools
import math
import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import flax
import jax
from flax.linen import partitioning as nn_partitioning
from jax.experimental import mesh_utils

from decal_jax import settings
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = Union[None, str, Tuple[str, ...]]
LogicalRules = Sequence[Tuple[str, MeshAxes]]

MESH_AXES = ("data", "fsdp", "model")
BATCH_MESH_AXES = ("data", "fsdp")
# Logical axes FSDP never splits: a scanned stack's layer axis is sliced once per layer.
FSDP_EXCLUDED = ("layers",)


def standard_logical_axis_rules() -> LogicalRules:
  """The vocabulary of every logical axis name in decal_jax, mapped onto the mesh.

  Parameters: `vocab` (token and memory-token tables), `embed, mlp, heads, kv, joined_kv,
  relpos_buckets, kv_heads, lora_rank, embed_in, embed_out`, `layers` (scanned stacks),
  `stack` (fused q/k/v kernels). Activations: `batch, length, embed, mlp, heads, kv,
  vocab`. Names that map to None are replicated by the rules; FSDP may still split a
  parameter along one of them.
  """
  return (
      ("batch", BATCH_MESH_AXES),
      ("vocab", "model"),
      ("mlp", "model"),
      ("heads", "model"),
      ("joined_kv", "model"),
      ("kv", None),
      ("embed", None),
      ("length", None),
      ("relpos_buckets", None),
      ("kv_heads", None),   # grouped-query K/V heads: often fewer than the model axis
      ("lora_rank", None),
      ("embed_in", None),   # LoRA factors' flattened input / output features
      ("embed_out", None),
      ("layers", None),     # the stacked-layer axis of nn.scan'ed blocks
      ("stack", None),      # fused q/k/v (3) or k/v (2) kernels' projection axis
  )


def adafactor_factor_rules() -> Dict[str, str]:
  """T5X Adafactor's `logical_factor_rules` for every parameter axis name above, as the
  strings T5X reads ('row', 'column', 'batch', 'none'): T5X's own names factored as its
  `standard_logical_factor_rules` does, and the decoder families' extra names (grouped K/V
  heads like heads; LoRA factors, which are matrices and so factored by T5X's heuristic).
  Bind it as `adafactor.Adafactor.logical_factor_rules` where a network uses those names."""
  return {"vocab": "column", "embed": "row", "mlp": "column", "heads": "column",
          "kv": "column", "joined_kv": "column", "relpos_buckets": "none", "layers": "batch",
          "stack": "batch", "kv_heads": "column", "embed_in": "row", "lora_rank": "column",
          "embed_out": "column"}


def log(message: str) -> None:
  """Prints from process 0 only (every process runs the same code)."""
  if jax.process_index() == 0:
    print(message, flush=True)


@dataclasses.dataclass(frozen=True)
class DataShard:
  """The rows of every global batch that this process feeds (seqio's ShardInfo).

  With a global batch of B rows, this process reads the seqio shard `index` of `count`
  and contributes rows [index * B / count, (index + 1) * B / count). Processes whose
  devices hold the same rows (e.g. a model axis that spans hosts) share one shard.
  """
  index: int
  count: int


class Partitioner:
  """Builds the ('data', 'fsdp', 'model') mesh and turns logical axis names into
  `NamedSharding`s for parameters, optimizer state, batches and activations.

  Args:
    mesh_shape: (data, fsdp, model) sizes; one of them may be -1 = all remaining devices.
      A 2-tuple is read as (data, model) with fsdp = 1 (the older gin files' MESH_SHAPE).
    logical_axis_rules: (logical name, mesh axis / tuple of axes / None) pairs, first
      match wins (flax's `logical_to_mesh_axes`); default `standard_logical_axis_rules()`.
    fsdp: when the 'fsdp' axis has more than one device, split every parameter's largest
      dimension that is divisible by it and not already split by the rules (optimizer
      statistics of the parameter's shape follow). False: 'fsdp' is one more data axis
      and parameters are replicated over it.
    devices: the devices to lay out (default: all devices of all processes).
  """

  def __init__(self, mesh_shape: Sequence[int] = (-1, 1, 1),
               logical_axis_rules: Optional[LogicalRules] = None, fsdp: bool = True,
               devices: Optional[Sequence[Any]] = None):
    self.rules = tuple((name, _as_tuple_axes(axes))
                       for name, axes in (logical_axis_rules or standard_logical_axis_rules()))
    _check_rules(self.rules)
    self.fsdp = fsdp
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(mesh_shape, len(devices))
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    self.mesh = Mesh(grid, MESH_AXES)

  # ---------------------------------------------------------------- mesh facts
  @property
  def batch_axis_size(self) -> int:
    """How many ways every global batch is split (data x fsdp)."""
    return self.axis_size(BATCH_MESH_AXES)

  def axis_size(self, axes: MeshAxes) -> int:
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(self.mesh.shape[a] for a in axes)

  # ---------------------------------------------------------------- shardings
  def spec(self, logical_names: Sequence[Optional[str]]) -> PartitionSpec:
    return nn_partitioning.logical_to_mesh_axes(tuple(logical_names), self.rules)

  def sharding(self, logical_names: Sequence[Optional[str]]) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(logical_names))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def batch_sharding(self, ndim: int = 2) -> NamedSharding:
    """Rows over ('data', 'fsdp'), the other `ndim - 1` axes whole."""
    return self.sharding(("batch",) + (None,) * (ndim - 1))

  def param_spec(self, path: str, logical_names: Sequence[str],
                 shape: Sequence[int]) -> PartitionSpec:
    """The rules' spec for one parameter, plus the FSDP split; clear errors for names
    without a rule and dimensions that the mesh does not divide."""
    self._check_known(path, logical_names)
    spec = list(self.spec(logical_names))
    spec += [None] * (len(shape) - len(spec))
    if self.fsdp and self.mesh.shape["fsdp"] > 1 and not _uses(spec, "fsdp"):
      dim = self._fsdp_dim(logical_names, shape, spec)
      if dim is not None:
        spec[dim] = "fsdp"
    self._check_divides(path, logical_names, shape, spec)
    return PartitionSpec(*spec)

  def params_shardings(self, params_axes: Any, params: Any) -> Any:
    """NamedSharding per parameter from the `params_axes` collection (`<name>_axes`
    entries) and the parameters' shapes (arrays or ShapeDtypeStructs)."""
    axes = _flat_axes(params_axes)
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params))
    out = {}
    for key, value in flat.items():
      path = "/".join(key)
      if key not in axes:
        raise ValueError(f"Parameter {path} {tuple(value.shape)} has no params_axes entry: "
                         "declare it with flax.linen.partitioning.param_with_axes(..., "
                         "axes=(...)) so that it can be sharded.")
      out[key] = NamedSharding(self.mesh, self.param_spec(path, axes[key], value.shape))
    return flax.traverse_util.unflatten_dict(out)

  # ---------------------------------------------------------------- data feed
  def data_shard(self) -> DataShard:
    """Which seqio shard this process reads, from where its devices sit in the mesh."""
    return self._data_shard

  @functools.cached_property
  def _data_shard(self) -> DataShard:
    blocks = self.batch_axis_size  # the batch splits into this many equal row blocks
    index_map = self.batch_sharding(1).devices_indices_map((blocks,))
    mine = sorted({(s.start or 0, blocks if s.stop is None else s.stop)
                   for s, in (index_map[d] for d in self.mesh.local_devices)})
    lo, hi = mine[0][0], mine[-1][1]
    covered = sum(stop - start for start, stop in mine)
    rows = hi - lo
    if covered != rows or blocks % rows or lo % rows:
      raise ValueError(
          f"Process {jax.process_index()}'s devices hold batch blocks {mine} of {blocks}: not "
          "one contiguous, evenly sized slice, so it cannot read one seqio shard. Order the "
          "mesh so that each host's devices share the 'model' axis (e.g. a 'model' size "
          "that divides the devices per host).")
    return DataShard(index=lo // rows, count=blocks // rows)

  def check_batch_size(self, batch_size: int) -> None:
    if batch_size % self.batch_axis_size:
      raise ValueError(
          f"BATCH_SIZE {batch_size} does not split over the {self.batch_axis_size} "
          f"data x fsdp devices of mesh {dict(self.mesh.shape)}: use a BATCH_SIZE that is a "
          f"multiple of {self.batch_axis_size}, or another MESH_SHAPE.")

  @contextlib.contextmanager
  def activate(self):
    """Mesh + axis rules, so the layers' logical `with_sharding_constraint` take effect."""
    # `with mesh:` is deprecated from jax 0.10; jax.set_mesh exists from 0.7.1.
    use_mesh = jax.set_mesh if hasattr(jax, "set_mesh") else (lambda mesh: mesh)
    with use_mesh(self.mesh), nn_partitioning.axis_rules(self.rules):
      yield

  # ---------------------------------------------------------------- helpers
  def _check_known(self, path: str, logical_names: Sequence[str]) -> None:
    known = {name for name, _ in self.rules}
    for name in logical_names:
      if name is not None and name not in known:
        raise ValueError(f"Parameter {path}: logical axis {name!r} has no partitioning rule. "
                         f"Add ({name!r}, None) (replicated) or ({name!r}, 'model') to the "
                         "logical axis rules (partitioning.standard_logical_axis_rules or "
                         "Partitioner.logical_axis_rules in gin).")

  def _fsdp_dim(self, logical_names, shape, spec) -> Optional[int]:
    """The largest dimension left whole by the rules that 'fsdp' divides (first on ties)."""
    size = self.mesh.shape["fsdp"]
    names = list(logical_names) + [None] * (len(shape) - len(logical_names))
    free = [d for d in range(len(shape)) if spec[d] is None
            and names[d] not in FSDP_EXCLUDED and shape[d] % size == 0]
    return max(free, key=lambda d: shape[d]) if free else None

  def _check_divides(self, path, logical_names, shape, spec) -> None:
    for dim, (size, axes) in enumerate(zip(shape, spec)):
      ways = self.axis_size(axes)
      if size % ways:
        name = logical_names[dim] if dim < len(logical_names) else None
        raise ValueError(
            f"Parameter {path} {tuple(shape)}: dimension {dim} ({name!r}, size {size}) is "
            f"split {ways} ways over mesh axis {axes!r}, which does not divide it. Use a "
            f"MESH_SHAPE whose {axes!r} size divides {size}, or map {name!r} to None in the "
            "logical axis rules.")


def resolve_mesh_shape(mesh_shape: Sequence[int], num_devices: int) -> Tuple[int, int, int]:
  """(data, fsdp, model) sizes from a 3-tuple or a legacy (data, model) 2-tuple, with one
  -1 filled in; a clear error if the sizes do not use `num_devices` exactly."""
  shape = tuple(int(s) for s in mesh_shape)
  if len(shape) == 2:
    shape = (shape[0], 1, shape[1])
  if len(shape) != 3:
    raise ValueError(f"MESH_SHAPE {tuple(mesh_shape)} needs 3 sizes (data, fsdp, model), or "
                     "2 (data, model); e.g. MESH_SHAPE = (-1, 1, 1).")
  if shape.count(-1) > 1 or any(s < 1 and s != -1 for s in shape):
    raise ValueError(f"MESH_SHAPE {tuple(mesh_shape)}: sizes must be positive, with at most "
                     "one -1 (= all remaining devices).")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f"MESH_SHAPE {tuple(mesh_shape)}: {known} does not divide the "
                       f"{num_devices} devices; pick sizes whose product divides "
                       f"{num_devices}.")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(f"MESH_SHAPE {tuple(mesh_shape)} has {math.prod(shape)} devices but "
                     f"there are {num_devices}: pick sizes whose product is {num_devices} "
                     "(or use -1 for one of them).")
  return shape


def _as_tuple_axes(axes) -> MeshAxes:
  """Rules from gin arrive as lists; flax wants None, a string or a tuple."""
  return tuple(axes) if isinstance(axes, list) else axes


def _check_rules(rules: LogicalRules) -> None:
  for name, axes in rules:
    for axis in (() if axes is None else (axes,) if isinstance(axes, str) else axes):
      if axis not in MESH_AXES:
        raise ValueError(f"Logical axis rule ({name!r}, {axes!r}) names mesh axis {axis!r}; "
                         f"the mesh axes are {MESH_AXES}.")


def _uses(spec, axis: str) -> bool:
  return any(a == axis or (isinstance(a, tuple) and axis in a) for a in spec)


def _flat_axes(params_axes: Any) -> Dict[Tuple[str, ...], Tuple[str, ...]]:
  """{param key path: logical names} from the `params_axes` collection."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params_axes))
  return {k[:-1] + (k[-1][:-len("_axes")],): tuple(v.names) for k, v in flat.items()}


# ---------------------------------------------------------------------- multi-host
ENV_COORDINATOR_ADDRESS = "DECAL_COORDINATOR_ADDRESS"  # host:port of process 0
ENV_NUM_PROCESSES = "DECAL_NUM_PROCESSES"
ENV_PROCESS_ID = "DECAL_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "DECAL_LOCAL_DEVICE_IDS"        # e.g. "0,1,2,3" (GPU: one per rank)
ENV_DISTRIBUTED = "DECAL_DISTRIBUTED"                  # "auto": JAX's cluster detection
ENV_PEER_TIMEOUT = "DECAL_PEER_TIMEOUT"                # seconds of silence: a process is lost


def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None,
                           local_device_ids: Optional[Sequence[int]] = None,
                           auto_detect: bool = False, cpu_collectives: str = "gloo",
                           initialization_timeout: int = 300,
                           peer_timeout: Optional[int] = None) -> bool:
  """Joins this process to a multi-process (multi-host) JAX job; True if it did.

  Must run before anything touches devices (the entry points call it right after gin is
  parsed). Settings come from the arguments (gin: `partitioning.initialize_distributed.*`),
  else from DECAL_COORDINATOR_ADDRESS / DECAL_NUM_PROCESSES / DECAL_PROCESS_ID (and
  optionally DECAL_LOCAL_DEVICE_IDS). `auto_detect=True` or DECAL_DISTRIBUTED=auto lets
  JAX find them itself (Cloud TPU pod slices, SLURM, Open MPI, Kubernetes). With none of
  these, or a single process, it does nothing: the run is single-process.

  `peer_timeout` (default DECAL_PEER_TIMEOUT, 60 s): a process silent that long is lost
  (`runtime/peer_watch.py` stops the others naming it); JAX's own heartbeat timeout, after
  which its coordination service aborts the job, is set to twice that.
  """
  settings = distributed_settings(coordinator_address, num_processes, process_id,
                                  local_device_ids, auto_detect, os.environ)
  if settings is None or jax.distributed.is_initialized():
    return jax.distributed.is_initialized()
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(initialization_timeout=initialization_timeout,
                             heartbeat_timeout_seconds=2 * peer_timeout_of(peer_timeout),
                             **settings)
  return True


def peer_timeout_of(peer_timeout: Optional[int] = None) -> int:
  """Seconds of silence after which a process of the job is lost: the argument, else
  DECAL_PEER_TIMEOUT."""
  return int(peer_timeout) if peer_timeout is not None else settings.get(ENV_PEER_TIMEOUT)


def distributed_settings(coordinator_address, num_processes, process_id, local_device_ids,
                         auto_detect: bool, environ: Mapping[str, str]) -> Optional[dict]:
  """`jax.distributed.initialize` keyword arguments, {} for JAX's auto-detection, or None
  for a single-process run. Arguments win; the DECAL_* variables in `environ` fill the rest
  (read and checked by decal_jax.settings)."""
  env = lambda name: settings.get(name, environ)
  coordinator_address = coordinator_address or env(ENV_COORDINATOR_ADDRESS)
  num_processes = int(num_processes) if num_processes is not None else env(ENV_NUM_PROCESSES)
  process_id = int(process_id) if process_id is not None else env(ENV_PROCESS_ID)
  if local_device_ids is None and env(ENV_LOCAL_DEVICE_IDS):
    local_device_ids = list(env(ENV_LOCAL_DEVICE_IDS))
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
           "process_id": process_id}
  if all(v is None for v in given.values()):
    auto = auto_detect or env(ENV_DISTRIBUTED) == "auto"
    return {} if auto else None
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise ValueError(
        f"Multi-host start-up needs coordinator_address, num_processes and process_id; "
        f"{', '.join(missing)} missing. Set {ENV_COORDINATOR_ADDRESS}, {ENV_NUM_PROCESSES} "
        f"and {ENV_PROCESS_ID} (or bind partitioning.initialize_distributed.* in gin), or "
        f"{ENV_DISTRIBUTED}=auto on a TPU pod / SLURM / Open MPI cluster.")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id {process_id} must lie in [0, num_processes = "
                     f"{num_processes}).")
  if num_processes == 1:
    return None
  return dict(given, local_device_ids=local_device_ids)
