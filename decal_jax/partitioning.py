"""Meshes and logical-axis sharding rules (T5X's partitioner, on `jax.jit` + NamedSharding).

The network names every parameter axis and its block-boundary activations with logical
names (`embed`, `mlp`, `heads`, `batch`, ...). A rules table — kept here, outside the
model — maps each logical name to a mesh axis (`data`, `model`) or to None (replicated).
One CPU device is the degenerate 1 x 1 mesh; `--xla_force_host_platform_device_count=8`
gives a real 8-device mesh on one CPU.
"""
import contextlib
from typing import Any, Optional, Sequence, Tuple

import flax
import jax
import numpy as np
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalRules = Sequence[Tuple[str, Optional[str]]]


def standard_logical_axis_rules() -> LogicalRules:
  """Data parallel over `data`, tensor (Megatron-style) parallel over `model`."""
  return (
      ("batch", "data"),
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
  )


class Partitioner:
  """Builds the mesh and turns logical axis names into `NamedSharding`s.

  Attributes:
    mesh_shape: sizes of the (`data`, `model`) mesh axes; -1 = all remaining devices.
    logical_axis_rules: logical name -> mesh axis (or None) table.
  """

  def __init__(self, mesh_shape: Sequence[int] = (-1, 1),
               axis_names: Sequence[str] = ("data", "model"),
               logical_axis_rules: Optional[LogicalRules] = None):
    self.axis_names = tuple(axis_names)
    self.rules = tuple(logical_axis_rules or standard_logical_axis_rules())
    self.mesh = Mesh(self._device_grid(tuple(mesh_shape)), self.axis_names)

  def _device_grid(self, mesh_shape: Tuple[int, ...]) -> np.ndarray:
    devices = np.asarray(jax.devices())
    if len(mesh_shape) != len(self.axis_names):
      raise ValueError(f"mesh_shape {mesh_shape} needs one size per axis {self.axis_names}.")
    known = int(np.prod([s for s in mesh_shape if s != -1]))
    shape = tuple(len(devices) // known if s == -1 else s for s in mesh_shape)
    if int(np.prod(shape)) != len(devices):
      raise ValueError(f"mesh_shape {mesh_shape} does not use the {len(devices)} available "
                       f"devices exactly; pick sizes whose product is {len(devices)}.")
    return devices.reshape(shape)

  @property
  def data_size(self) -> int:
    return self.mesh.shape[self.axis_names[0]]

  def spec(self, logical_names: Sequence[Optional[str]]) -> PartitionSpec:
    return nn_partitioning.logical_to_mesh_axes(tuple(logical_names), self.rules)

  def sharding(self, logical_names: Sequence[Optional[str]]) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(logical_names))

  def params_shardings(self, params_axes: Any) -> Any:
    """The `params_axes` collection (`<name>_axes` entries) -> NamedSharding per param."""
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params_axes))
    out = {k[:-1] + (k[-1][:-len("_axes")],): self.sharding(v.names) for k, v in flat.items()}
    return flax.traverse_util.unflatten_dict(out)

  def batch_sharding(self) -> NamedSharding:
    return self.sharding(("batch", None))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  @contextlib.contextmanager
  def activate(self):
    """Mesh + axis rules, so the layers' logical `with_sharding_constraint` take effect."""
    with self.mesh, nn_partitioning.axis_rules(self.rules):
      yield
