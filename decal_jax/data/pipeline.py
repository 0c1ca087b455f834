"""The input pipeline of training and evaluation (T5X's `utils.DatasetConfig` and
`get_dataset`): which seqio task to read, each process's shard of it, batching, padding,
and assembling the global batch from the processes' rows.

`DatasetConfig` and `to_global` live in `batches.py` (no seqio / TensorFlow: the benchmarks
that time a train step on synthetic batches use them where TensorFlow is not installed).
`check_feature_lengths` refuses feature lengths that cannot work with a task and model
before anything is read; `resume_batches` puts a training stream back where the latest
checkpoint left it.
"""
import contextlib
import difflib
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import jax
from jax.experimental import multihost_utils
import numpy as np
import seqio
import tensorflow as tf

from decal_jax import partitioning
from decal_jax.data import autoencoding, batch_iterator, sentences, span_corruption, text_to_text
# DatasetConfig (gin files and saved config.gin files bind `pipeline.DatasetConfig`) and
# to_global (the trainer calls `pipeline.to_global`) are this module's API; they live in
# batches.py, which needs neither seqio nor TensorFlow.
from decal_jax.data.batches import Batch, DatasetConfig, to_global  # noqa: F401  (pipeline's API)

# `restore_dataset(step, batches)`: moves `batches` to the input position saved at `step`;
# False when that checkpoint holds none for this process (runtime: the Checkpointer's).
RestoreDataset = Callable[[int, batch_iterator.BatchIterator], bool]


class UnknownTaskError(ValueError):
  """A seqio task or mixture name that nothing registered (a misspelling, most often)."""


# The command that prints every registered task and mixture (decal_jax/commands/list_tasks.py).
LIST_TASKS = "`decal-list-tasks` (or `python -m decal_jax.commands.list_tasks`)"


def registered_task_names() -> List[str]:
  """Every registered seqio task and mixture name, sorted."""
  return sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))


OWN_TASKS = ("a task of your own registers when the module that defines it is imported, e.g. "
             "by an `import my_tasks` line in a gin file")


def unknown_task_message(setting: str, name: str, known: Sequence[str],
                         what: str = "seqio task or mixture", own: str = OWN_TASKS) -> str:
  """`setting` = `name` is no registered `what`: the closest of `known` (difflib), the
  command that lists the registered names, and `own`, how one of the user's own registers."""
  close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
  hint = f"Did you mean {', '.join(close)}?" if close else "No registered name is close to it."
  return (f"{setting} = {name!r}: no {what} has that name. {hint} {LIST_TASKS} lists the "
          f"registered names ({own}).")


def get_task(name: str, setting: str = "MIXTURE_OR_TASK_NAME "
                                       "(pipeline.DatasetConfig.mixture_or_task_name)"):
  """The registered seqio task or mixture `name`; an unknown name is refused
  (`UnknownTaskError`) with the closest registered names."""
  try:
    return seqio.get_mixture_or_task(name)
  except ValueError:
    pass
  raise UnknownTaskError(unknown_task_message(setting, name, registered_task_names()))


def check_feature_lengths(cfg: DatasetConfig, model) -> None:
  """Clear errors for feature lengths that cannot work with this task and model."""
  lengths = dict(cfg.task_feature_lengths)
  for key in model.required_lengths():
    if key not in lengths:
      raise ValueError(f"TASK_FEATURE_LENGTHS needs a positive integer {key!r} length, got "
                       f"{lengths!r}; e.g. --gin.TASK_FEATURE_LENGTHS=\"{{'inputs': 128, "
                       "'targets': 32}\".")
  task = get_task(cfg.mixture_or_task_name)
  tasks = task.tasks if isinstance(task, seqio.Mixture) else [task]
  if any(span_corruption.span_corruption in t.preprocessors for t in tasks):
    need = span_corruption.target_length(lengths["inputs"])
    if lengths["targets"] < need:
      raise ValueError(f"Span corruption of {lengths['inputs']} input tokens makes targets of "
                       f"{need} tokens, but TASK_FEATURE_LENGTHS['targets'] is "
                       f"{lengths['targets']}: targets would be cut. Set 'targets' >= {need}.")
  autoencoders = (autoencoding.autoencode, autoencoding.marked_autoencode)
  if (any(p in t.preprocessors for t in tasks for p in autoencoders)
      and lengths["targets"] < lengths["inputs"]):
    raise ValueError(f"{cfg.mixture_or_task_name!r} autoencodes: its targets are the whole "
                     f"input, but TASK_FEATURE_LENGTHS['targets'] = {lengths['targets']} < "
                     f"'inputs' = {lengths['inputs']}. Set 'targets' >= 'inputs'.")
  task_vocabulary = tasks[0].output_features["targets"].vocabulary
  if task_vocabulary != model.output_vocabulary:
    raise ValueError(f"Task {tasks[0].name!r} tokenizes with {task_vocabulary} but the model "
                     f"reads {model.output_vocabulary}: use a task of the model's vocabulary, "
                     "or a model gin with that VOCABULARY.")
  if model.vocab_size < task_vocabulary.vocab_size:
    raise ValueError(f"The task's vocabulary has {task_vocabulary.vocab_size} ids but the "
                     f"model's vocab_size is {model.vocab_size}; bind T5Config.vocab_size >= "
                     f"{task_vocabulary.vocab_size}.")


def check_first_example(cfg: DatasetConfig, what: str) -> None:
  """Reads and tokenizes the first example of `cfg`'s split, as training reads it (a local
  source checks its files then; the vocabulary loads), so that a bad data file or
  vocabulary is refused before a run writes anything; `what` ('train', 'eval') names the
  dataset when the split is empty. Costs one example, not one batch."""
  task = get_task(cfg.mixture_or_task_name)
  ds = task.get_dataset(cfg.task_feature_lengths, split=cfg.split, use_cached=cfg.use_cached,
                        shuffle=False, num_epochs=1, seed=cfg.seed)
  if next(iter(ds.take(1)), None) is None:
    raise ValueError(f"The {what} data, split {cfg.split!r} of {cfg.mixture_or_task_name!r}, "
                     "gives no example: fill its file(s), or give another split or task.")


def get_dataset(cfg: DatasetConfig, model, num_epochs: Optional[int],
                partitioner: Optional[partitioning.Partitioner] = None) -> tf.data.Dataset:
  """This process's share of the batched dataset: the seqio shard and the rows of each
  global batch that its devices hold (`partitioner.data_shard()`; without a partitioner,
  one shard per process), batched to BATCH_SIZE / shard count rows."""
  if partitioner is not None:
    partitioner.check_batch_size(cfg.batch_size)
  shard = (partitioner.data_shard() if partitioner is not None else
           partitioning.DataShard(jax.process_index(), jax.process_count()))
  get_task(cfg.mixture_or_task_name)  # an unknown name: the closest registered ones
  if cfg.batch_size % shard.count:
    raise ValueError(f"BATCH_SIZE {cfg.batch_size} must divide evenly over the {shard.count} "
                     "data shards (one per process); use a multiple of it.")
  ds = seqio.get_dataset(
      cfg.mixture_or_task_name, cfg.task_feature_lengths,
      feature_converter=model.FEATURE_CONVERTER_CLS(pack=cfg.pack), dataset_split=cfg.split,
      use_cached=cfg.use_cached, shuffle=cfg.shuffle, num_epochs=num_epochs,
      shard_info=seqio.ShardInfo(shard.index, shard.count), seed=cfg.seed, verbose=False)
  return ds.batch(cfg.batch_size // shard.count, drop_remainder=num_epochs is None)


def train_batches(cfg: DatasetConfig, model, skip: int = 0,
                  partitioner: Optional[partitioning.Partitioner] = None
                  ) -> batch_iterator.BatchIterator:
  """Endless, deterministic batches, prefetched; `skip` = batches already consumed."""
  batches = batch_iterator.BatchIterator(
      get_dataset(cfg, model, None, partitioner).prefetch(tf.data.AUTOTUNE))
  batches.advance(skip, show_progress=False)
  return batches


class _NoUncachedDatasetAdvice(logging.Filter):
  """Drops seqio's advice to cache a task before training on it ("Using an uncached
  FunctionDataset for training ... resulting in overfitting"): it is about restarts that
  shuffle afresh, and `resume_batches` continues the same stream at the saved position."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Using an uncached FunctionDataset for training")


@contextlib.contextmanager
def _without_uncached_dataset_advice():
  quiet = _NoUncachedDatasetAdvice()
  seqio_logger = logging.getLogger("absl")  # seqio logs through absl.logging
  seqio_logger.addFilter(quiet)
  try:
    yield
  finally:
    seqio_logger.removeFilter(quiet)


def resume_batches(cfg: DatasetConfig, model, partitioner: partitioning.Partitioner,
                   step: Optional[int], restore_dataset: RestoreDataset,
                   position: Dict[str, Any]) -> batch_iterator.BatchIterator:
  """The training batches from where the checkpoint at `step` (None: none yet) left them:
  its saved iterator state when `restore_dataset` finds one for this process, else by
  reading the consumed batches again. After a change of data seed the stream starts over
  in the new order."""
  def from_the_start():
    with _without_uncached_dataset_advice():
      return train_batches(cfg, model, 0, partitioner)

  batches = from_the_start()
  if step is None or position.get("seed_changed"):
    return batches
  try:
    if restore_dataset(step, batches):
      return batches
    why = (f"holds no input position for process {jax.process_index()} of "
           f"{jax.process_count()} (its input pipeline cannot be saved, or it was written by "
           "another number of processes or an older version)")
  except tf.errors.OpError as e:  # a pipeline of another shape than the one saved
    why = (f"holds an input position this input pipeline cannot take "
           f"({batch_iterator.tf_reason(e)[:160]}...: was the task or its preprocessing changed?)")
    batches = from_the_start()  # nothing half-restored
  partitioning.log(f"note: checkpoint_{step} {why}; reading the "
                   f"{position['batches_consumed']} consumed batches again to resume exactly.")
  batches.advance(position["batches_consumed"], show_progress=jax.process_index() == 0)
  return batches


def pad_batch(batch: Batch, batch_size: int) -> Batch:
  """Pads a short final batch with all-zero rows (zero loss weight)."""
  n = next(iter(batch.values())).shape[0]
  if n == batch_size:
    return batch
  return {k: np.pad(v, [(0, batch_size - n)] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}


def lockstep_batches(ds: tf.data.Dataset, rows: int, max_batches: int) -> Iterator[Batch]:
  """Up to `max_batches` batches of `rows` rows (a short one padded with all-zero rows),
  in step across processes: while any process still has data, one whose shard has run
  out feeds all-zero batches (zero loss weight), so every process runs every collective."""
  it = ds.as_numpy_iterator()
  empty = {k: np.zeros((rows,) + tuple(spec.shape[1:]), spec.dtype.as_numpy_dtype)
           for k, spec in ds.element_spec.items()}
  for _ in range(max_batches):
    batch = next(it, None)
    if jax.process_count() > 1:
      if not multihost_utils.process_allgather(np.int32(batch is not None)).any():
        return
    elif batch is None:
      return
    yield empty if batch is None else pad_batch(batch, rows)


def print_data_notes() -> None:
  """What the input pipeline cut in this process: sequences and long sentences."""
  if jax.process_index() != 0:
    return
  for name, count in text_to_text.truncation_counts().items():
    print(f"note: {name}: {count} sequences cut to TASK_FEATURE_LENGTHS in this run (each pass "
          "over the data counts).")
  for name, count in sentences.sentence_split_counts().items():
    print(f"note: {name}: {count} sentences longer than the maximum sentence length were "
          "split in this run (each pass over the data counts).")
