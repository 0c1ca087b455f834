"""What a dataset is read as (`DatasetConfig`, T5X's `utils.DatasetConfig`) and how a
process's numpy batch becomes the global batch on the mesh (`to_global`): the part of the
input pipeline (`pipeline.py`, which names these too) that reads no data, so it needs
neither seqio nor TensorFlow (`bench_train` times the train step on synthetic batches with
it on a GPU image without them)."""
import dataclasses
from typing import Dict, Mapping

import jax
import numpy as np

from decal_jax import partitioning

Batch = Dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
  """Which seqio task or mixture to read, and how (T5X's `utils.DatasetConfig` names)."""
  mixture_or_task_name: str
  task_feature_lengths: Mapping[str, int]
  split: str = "train"
  batch_size: int = 32
  shuffle: bool = True
  seed: int = 0
  use_cached: bool = False
  pack: bool = False

  def __post_init__(self):
    check_count("BATCH_SIZE (pipeline.DatasetConfig.batch_size)", self.batch_size)
    for key, length in dict(self.task_feature_lengths).items():
      check_count(f"TASK_FEATURE_LENGTHS[{key!r}] (pipeline.DatasetConfig.task_feature_lengths)",
                  length)


def check_count(binding: str, value) -> None:
  """Refuses a run setting that must be a whole number >= 1, naming its gin binding."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{binding} = {value!r}: must be a whole number >= 1.")


def to_global(batch: Batch, partitioner: partitioning.Partitioner):
  """Process-local numpy batch `[local_rows, ...]` -> global jax arrays `[local_rows x
  shard count, ...]`, rows split over the ('data', 'fsdp') mesh axes."""
  shard = partitioner.data_shard()

  def one(v):
    v = np.asarray(v)
    global_shape = (v.shape[0] * shard.count,) + v.shape[1:]
    return jax.make_array_from_process_local_data(partitioner.batch_sharding(v.ndim), v,
                                                  global_shape)
  return {k: one(v) for k, v in batch.items()}
