"""The gin-configurable train / evaluate / infer loops (T5X-style, on jax.jit + a mesh).

`train(...)` builds the model's variables sharded over the partitioner's mesh, restores
the latest checkpoint in MODEL_DIR if there is one (params, optimizer state, step, the
dropout RNG and the input pipeline's position, so the data stream continues where it
stopped without re-reading it), runs jitted
train steps with a progress bar, writes TensorBoard metrics to MODEL_DIR/train and
MODEL_DIR/eval, saves Orbax checkpoints, evaluates on the validation split and prints a
decoded example.
"""
import dataclasses
import functools
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
import optax
import seqio
import tensorflow as tf
import tqdm

from decal_jax import checkpoints, inference, metrics, optimizers, partitioning, resilience
from decal_jax.data import autoencoding, batch_iterator, sentences, span_corruption, text_to_text

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


# ------------------------------------------------------------------------------ data
def check_feature_lengths(cfg: DatasetConfig, model) -> None:
  """Clear errors for feature lengths that cannot work with this task and model."""
  lengths = dict(cfg.task_feature_lengths)
  for key in (("targets",) if _decoder_only(model) else ("inputs", "targets")):
    if not isinstance(lengths.get(key), int) or lengths[key] < 1:
      raise ValueError(f"TASK_FEATURE_LENGTHS needs a positive integer {key!r} length, got "
                       f"{lengths!r}; e.g. --gin.TASK_FEATURE_LENGTHS=\"{{'inputs': 128, "
                       "'targets': 32}\".")
  task = seqio.get_mixture_or_task(cfg.mixture_or_task_name)
  tasks = task.tasks if isinstance(task, seqio.Mixture) else [task]
  if any(span_corruption.span_corruption in t.preprocessors for t in tasks):
    need = span_corruption.target_length(lengths["inputs"])
    if lengths["targets"] < need:
      raise ValueError(f"Span corruption of {lengths['inputs']} input tokens makes targets of "
                       f"{need} tokens, but TASK_FEATURE_LENGTHS['targets'] is "
                       f"{lengths['targets']}: targets would be cut. Set 'targets' >= {need}.")
  if (any(autoencoding.autoencode in t.preprocessors for t in tasks)
      and lengths["targets"] < lengths["inputs"]):
    raise ValueError(f"{cfg.mixture_or_task_name!r} autoencodes: its targets are the whole "
                     f"input, but TASK_FEATURE_LENGTHS['targets'] = {lengths['targets']} < "
                     f"'inputs' = {lengths['inputs']}. Set 'targets' >= 'inputs'.")
  task_vocabulary = tasks[0].output_features["targets"].vocabulary
  if task_vocabulary != model.output_vocabulary:
    raise ValueError(f"Task {tasks[0].name!r} tokenizes with {task_vocabulary} but the model "
                     f"reads {model.output_vocabulary}: use a task of the model's vocabulary, "
                     "or a model gin with that VOCABULARY.")
  model_vocab = getattr(getattr(model.module, "config", None), "vocab_size", None)
  task_vocab = task_vocabulary.vocab_size
  if model_vocab is not None and model_vocab < task_vocab:
    raise ValueError(f"The task's vocabulary has {task_vocab} ids but the model's vocab_size "
                     f"is {model_vocab}; bind T5Config.vocab_size >= {task_vocab}.")


def get_dataset(cfg: DatasetConfig, model, num_epochs: Optional[int],
                partitioner: Optional[partitioning.Partitioner] = None) -> tf.data.Dataset:
  """This process's share of the batched dataset: the seqio shard and the rows of each
  global batch that its devices hold (`partitioner.data_shard()`; without a partitioner,
  one shard per process), batched to BATCH_SIZE / shard count rows."""
  if partitioner is not None:
    partitioner.check_batch_size(cfg.batch_size)
  shard = (partitioner.data_shard() if partitioner is not None else
           partitioning.DataShard(jax.process_index(), jax.process_count()))
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


def _resume_batches(cfg: DatasetConfig, model, partitioner: partitioning.Partitioner,
                    ckpt: checkpoints.Checkpointer, position: Dict[str, Any]
                    ) -> batch_iterator.BatchIterator:
  """The training batches from where the latest checkpoint left them: its saved iterator
  state when it has one for this process, else by reading the consumed batches again.
  After a change of data seed the stream starts over in the new order."""
  batches = train_batches(cfg, model, 0, partitioner)
  step = ckpt.latest_step()
  if step is None or position.get("seed_changed"):
    return batches
  try:
    if ckpt.restore_dataset(step, batches):
      return batches
    why = (f"holds no input position for process {jax.process_index()} of "
           f"{jax.process_count()} (its input pipeline cannot be saved, or it was written by "
           "another number of processes or an older version)")
  except tf.errors.OpError as e:  # a pipeline of another shape than the one saved
    why = (f"holds an input position this input pipeline cannot take "
           f"({batch_iterator.tf_reason(e)[:160]}...: was the task or its preprocessing changed?)")
    batches = train_batches(cfg, model, 0, partitioner)  # nothing half-restored
  _log(f"note: checkpoint_{step} {why}; reading the {position['batches_consumed']} consumed "
       "batches again to resume exactly.")
  batches.advance(position["batches_consumed"], show_progress=jax.process_index() == 0)
  return batches


def pad_batch(batch: Batch, batch_size: int) -> Batch:
  """Pads a short final batch with all-zero rows (zero loss weight)."""
  n = next(iter(batch.values())).shape[0]
  if n == batch_size:
    return batch
  return {k: np.pad(v, [(0, batch_size - n)] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}


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


# ------------------------------------------------------------------------------ state
def _decoder_only(model) -> bool:
  return bool(getattr(model, "DECODER_ONLY", False))


def _input_shapes(cfg: DatasetConfig, model=None):
  lengths = cfg.task_feature_lengths
  if hasattr(model, "input_shapes"):  # e.g. the dual encoder's left / right features
    return model.input_shapes(lengths)
  shapes = {"decoder_input_tokens": (1, lengths["targets"])}
  if "inputs" in lengths:
    shapes["encoder_input_tokens"] = (1, lengths["inputs"])
  if "query" in lengths:  # Squid's query feature
    shapes["query_tokens"] = (1, lengths["query"])
  return shapes


def abstract_params(model, cfg: DatasetConfig, partitioner):
  """(params as ShapeDtypeStructs carrying their mesh shardings, those shardings)."""
  shapes = _input_shapes(cfg, model)
  variables = jax.eval_shape(lambda: model.get_initial_variables(jax.random.PRNGKey(0), shapes))
  shardings = partitioner.params_shardings(variables["params_axes"], variables["params"])
  abstract = jax.tree_util.tree_map(
      lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), variables["params"],
      shardings)
  return abstract, shardings


def init_state(model, optimizer, partitioner, cfg: DatasetConfig, seed: int):
  """Sharded {'params', 'opt_state', 'step'} built directly on the mesh."""
  shapes = _input_shapes(cfg, model)
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
    state = jax.jit(make, out_shardings=shardings)(jax.random.PRNGKey(seed))
  return state, shardings


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


def make_train_step(model, optimizer, partitioner, shardings):
  """(state, global batch, rng) -> (state, aux), jitted with the state donated.

  A step whose loss or gradient norm is NaN / Inf changes neither params nor optimizer
  state (only the step counter); its aux values read 0 and `aux['nonfinite']` is 1, for
  `resilience.NonFiniteGuard` to raise or skip."""
  def step_fn(state, batch, rng):
    dropout_rng = jax.random.fold_in(rng, state["step"])
    grad_fn = jax.value_and_grad(model.loss_fn, has_aux=True)
    (loss, aux), grads = grad_fn(state["params"], batch, dropout_rng)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    aux = dict(aux, loss=loss, grad_norm=optax.global_norm(grads))
    finite = jnp.isfinite(aux["loss"]) & jnp.isfinite(aux["grad_norm"])

    def if_finite(new, old):
      return jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)

    aux = jax.tree_util.tree_map(lambda v: jnp.where(finite, v, jnp.zeros_like(v)), aux)
    aux["nonfinite"] = (~finite).astype(jnp.int32)
    return {"params": if_finite(params, state["params"]),
            "opt_state": if_finite(opt_state, state["opt_state"]),
            "step": state["step"] + 1}, aux

  jitted = jax.jit(step_fn, out_shardings=(shardings, partitioner.replicated()),
                   donate_argnums=(0,))

  def run(state, batch, rng):
    with partitioner.activate():
      return jitted(state, batch, rng)
  run.jitted = jitted  # for ahead-of-time lowering (tools/bench_train.py)
  return run


def make_eval_step(model, partitioner):
  jitted = jax.jit(lambda params, batch: model.eval_fn(params, batch)[1],
                   out_shardings=partitioner.replicated())

  def run(params, batch):
    with partitioner.activate():
      return jitted(params, batch)
  return run


# ------------------------------------------------------------------------------ eval
def evaluate_params(params, model, cfg: DatasetConfig, partitioner, max_batches: int = 50):
  """Validation loss / accuracy over up to `max_batches` batches of `cfg.split`."""
  step = make_eval_step(model, partitioner)
  sums: Dict[str, float] = {}
  ds = get_dataset(dataclasses.replace(cfg, shuffle=False), model, 1, partitioner)
  for batch in _lockstep_batches(ds, cfg.batch_size // partitioner.data_shard().count,
                                 max_batches):
    aux = jax.device_get(step(params, to_global(batch, partitioner)))
    for k, v in aux.items():
      sums[k] = sums.get(k, 0.0) + float(v)
  if not sums:
    raise ValueError(f"Split {cfg.split!r} of {cfg.mixture_or_task_name!r} gave no examples.")
  return _summarize_fn(model)(sums)


def _lockstep_batches(ds: tf.data.Dataset, rows: int, max_batches: int) -> Iterator[Batch]:
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


def _summarize_fn(model):
  """The model's own summary of summed aux values (the dual encoder's loss / in-batch
  accuracy), else the token-level one (loss, accuracy, perplexity)."""
  return getattr(model, "summarize", metrics.summarize)


def _num_tokens(model, batch: Batch) -> int:
  if hasattr(model, "num_tokens"):
    return model.num_tokens(batch)
  return int(np.sum(batch.get("encoder_input_tokens", 0) > 0) +
             np.sum(batch["decoder_target_tokens"] > 0))


def _can_decode(model) -> bool:
  return hasattr(model, "predict_batch") and not _decoder_only(model)


def decode_example(params, model, cfg: DatasetConfig, partitioner) -> Dict[str, str]:
  """Greedy-decodes the first example of `cfg.split` from its compressed encoding."""
  ds = get_dataset(dataclasses.replace(cfg, shuffle=False, batch_size=jax.process_count()),
                   model, num_epochs=1)
  batch = next(ds.as_numpy_iterator())
  with partitioner.activate():
    tokens = jax.jit(model.predict_batch)(params, batch)
  vocab = model.output_vocabulary

  def text(ids):
    return vocab.decode([int(t) for t in ids if t > 0])

  example = {"inputs": text(batch.get("encoder_input_tokens", np.zeros((1, 0), int))[0])}
  if "query_tokens" in batch:  # Squid: what the large decoder reads after the context
    example["query"] = text(batch["query_tokens"][0])
  return dict(example, targets=text(batch["decoder_target_tokens"][0]),
              prediction=text(np.asarray(tokens)[0]))


# ------------------------------------------------------------------------------ train
def train(*, model, train_dataset_cfg: DatasetConfig,
          eval_dataset_cfg: Optional[DatasetConfig] = None, model_dir: str,
          total_steps: int, optimizer=None, partitioner=None, seed: int = 0,
          eval_period: int = 200, eval_batches: int = 20, log_period: int = 10,
          checkpoint_period: int = 200, keep_checkpoints: int = 3,
          show_example: bool = True, gin_config_text: str = "",
          initial_checkpoint_path: Optional[str] = None,
          nonfinite_policy: str = "raise",
          checkpoint_input: bool = True) -> Dict[str, float]:
  """Trains to `total_steps`, resuming from MODEL_DIR; returns the final eval metrics
  (and, with `show_example`, prints one validation example decoded by the model).

  Resuming is exact: a checkpoint holds params, optimizer state, step, the dropout RNG and
  the number of batches consumed, so a run killed at any point and started again with the
  same command ends with the same parameters as one that never stopped. SIGTERM makes the
  run finish its step, save, and return {'preempted_at_step': step}.

  `initial_checkpoint_path` (a MODEL_DIR or one of its checkpoint_<step> folders) starts a
  run whose MODEL_DIR is still empty from those weights: every parameter with the same
  name and shape is restored, the others (e.g. DeCAL's latent vector on top of an
  uncompressed model) keep their initialisation; optimizer state and step start fresh.

  `nonfinite_policy`: a step with a NaN / Inf loss or gradient never changes the state;
  'raise' then stops with `resilience.NonFiniteError` naming the step (no checkpoint after
  it is written), 'skip' notes it and goes on.

  `checkpoint_input`: each checkpoint also holds every process's input-pipeline position
  (`data.batch_iterator`), so a resume reads nothing twice; False leaves it out (smaller
  checkpoints when shuffle buffers are large; a resume then re-reads the consumed batches)."""
  optimizer = optimizer or optimizers.adafactor()
  partitioner = partitioner or partitioning.Partitioner()
  guard = resilience.NonFiniteGuard(nonfinite_policy)
  check_feature_lengths(train_dataset_cfg, model)
  state, shardings = init_state(model, optimizer, partitioner, train_dataset_cfg, seed)
  ckpt = checkpoints.Checkpointer(model_dir, keep=keep_checkpoints, save_period=checkpoint_period)
  state, position = _maybe_restore(ckpt, state, train_dataset_cfg, seed)
  if initial_checkpoint_path and ckpt.latest_step() is None:
    state = dict(state, params=_start_from(initial_checkpoint_path, state["params"]))
  if gin_config_text:
    checkpoints.write_config(model_dir, gin_config_text)
  writer = metrics.MetricsWriter(model_dir)
  step_fn = make_train_step(model, optimizer, partitioner, shardings)
  start = int(jax.device_get(state["step"]))
  batches = _resume_batches(train_dataset_cfg, model, partitioner, ckpt, position)
  position.pop("seed_changed", None)  # not part of what a checkpoint stores
  rng = jnp.asarray(position["rng"], jnp.uint32)
  eval_cfg = eval_dataset_cfg or dataclasses.replace(train_dataset_cfg, split="validation")
  window = metrics.Window(_summarize_fn(model))
  bar = tqdm.tqdm(range(start, total_steps), initial=start, total=total_steps, desc="train",
                  dynamic_ncols=True, disable=jax.process_index() != 0)

  def save(step: int, force: bool = False):
    if force or step % checkpoint_period == 0:
      guard.check(ckpt.latest_step(), model_dir)  # never save after a non-finite step
    ckpt.save(step, state, position, force=force,
              batches=batches if checkpoint_input else None)

  with resilience.PreemptionWatcher() as preemption:
    for step in bar:
      batch = next(batches)
      if hasattr(model, "check_batch"):  # host-side input checks, before any state changes
        model.check_batch(batch)
      position["batches_consumed"] += 1
      state, aux = step_fn(state, to_global(batch, partitioner), rng)
      guard.add(step + 1, aux.pop("nonfinite"))
      window.add(aux, num_tokens=_num_tokens(model, batch))
      done = step + 1
      if done % log_period == 0 or done == total_steps:
        guard.check(ckpt.latest_step(), model_dir)
        summary = window.flush()
        bar.set_postfix(loss=f"{summary['loss']:.3f}", acc=f"{summary['accuracy']:.3f}",
                        tok_s=f"{summary['tokens_per_second']:.0f}")
        writer.write("train", done, summary)
      if done < total_steps and preemption.requested():
        save(done, force=True)
        return _stop_preempted(done, bar, writer, ckpt)
      save(done)
      if done % eval_period == 0 and done != total_steps:
        writer.write("eval", done, evaluate_params(state["params"], model, eval_cfg, partitioner,
                                                   eval_batches))
  if start < total_steps or ckpt.latest_step() != total_steps:
    save(total_steps, force=True)
  result = evaluate_params(state["params"], model, eval_cfg, partitioner, eval_batches)
  writer.write("eval", total_steps, result)
  writer.close()
  ckpt.close()
  # A decoder-only LM has no input to decode from; its report is the perplexity.
  example = (decode_example(state["params"], model, eval_cfg, partitioner)
             if show_example and _can_decode(model) else None)
  _report(result, example, total_steps)
  _data_notes()
  return result


def _stop_preempted(step: int, bar, writer, ckpt) -> Dict[str, float]:
  bar.close()
  writer.close()
  ckpt.close()
  if jax.process_index() == 0:
    print(f"\nPreempted (SIGTERM) after step {step}: saved checkpoint_{step} in "
          f"{ckpt.directory}. Run the same command again to continue from it.", flush=True)
  return {"preempted_at_step": float(step)}


def _maybe_restore(ckpt: checkpoints.Checkpointer, state, cfg: DatasetConfig, seed: int):
  """(state, data position) from MODEL_DIR's latest checkpoint, or the fresh ones. The
  position holds the batches consumed, the data seed and the dropout RNG key."""
  fresh_rng = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed + 1))).tolist()
  step = ckpt.latest_step()
  if step is None:
    return state, {"batches_consumed": 0, "seed": cfg.seed, "rng": fresh_rng}
  restored, data = ckpt.restore(step, checkpoints.abstract_like(state))
  seed_changed = data.get("seed", cfg.seed) != cfg.seed
  if seed_changed:
    _log(f"note: the checkpoint's data seed {data['seed']} differs from {cfg.seed}; the data "
         "stream restarts from the start of the new order.")
  _log(f"Resuming from step {step} in {ckpt.directory} "
       f"({data.get('batches_consumed', 0)} batches consumed).")
  return restored, {"batches_consumed": int(data.get("batches_consumed", 0)), "seed": cfg.seed,
                    "rng": data.get("rng", fresh_rng),  # checkpoints before the RNG was saved
                    "seed_changed": seed_changed}


def _start_from(path: str, params):
  params, report = checkpoints.restore_matching_params(path, params)
  _log(f"Starting from {path}: {len(report['restored'])} parameters restored, "
       f"{len(report['initialised'])} newly initialised, {len(report['unused'])} in the "
       "checkpoint unused.")
  if report["converted"]:
    _log(f"  converted the checkpoint's layout: {report['converted']}")
  for key in ("initialised", "unused"):
    if report[key]:
      _log(f"  {key}: " + ", ".join(report[key][:8]) + (" ..." if len(report[key]) > 8 else ""))
  return params


def _log(message: str) -> None:
  """Prints from process 0 only (every process runs the same code)."""
  if jax.process_index() == 0:
    print(message, flush=True)


def _report(result: Mapping[str, float], example: Optional[Mapping[str, str]], step: int) -> None:
  if jax.process_index() != 0:
    return
  if "perplexity" in result:
    print(f"\nHeld-out (validation) at step {step}: loss {result['loss']:.4f}, "
          f"token accuracy {result['accuracy']:.4f}, perplexity {result['perplexity']:.2f} "
          f"over {int(result['target_tokens'])} target tokens.")
  else:  # a model with its own summary (the dual encoder: in-batch accuracy)
    print(f"\nHeld-out (validation) at step {step}: " +
          ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
  if example is None:
    return
  print("Validation example, decoded from the compressed encoding:")
  for key, value in example.items():
    print(f"  {key:>10}: {value}")


# ------------------------------------------------------------------------------ eval / infer
def restore_params(model, model_dir: str, cfg: DatasetConfig, partitioner):
  """The params of the latest checkpoint in `model_dir` (clear error if there is none)."""
  ckpt = checkpoints.Checkpointer(model_dir)
  step = ckpt.latest_step()
  if step is None:
    raise FileNotFoundError(f"No checkpoint in {model_dir}: train first with "
                            "`python -m decal_jax.train ... --gin.MODEL_DIR=...`.")
  params = ckpt.restore_params(step, abstract_params(model, cfg, partitioner)[0])
  ckpt.close()
  return params, step


def evaluate(*, model, eval_dataset_cfg: DatasetConfig, model_dir: str, partitioner=None,
             eval_batches: int = 50, max_predict_examples: Optional[int] = None,
             num_decodes: int = 1) -> Dict[str, float]:
  """Evaluates the latest checkpoint: teacher-forced loss / accuracy over `eval_batches`
  batches and, for tasks with metrics (ROUGE, EM/F1), decodes the split (or its first
  `max_predict_examples`) and writes predictions + metrics to MODEL_DIR/eval_results/.
  TensorBoard gets everything under MODEL_DIR/eval."""
  partitioner = partitioner or partitioning.Partitioner()
  check_feature_lengths(eval_dataset_cfg, model)
  params, step = restore_params(model, model_dir, eval_dataset_cfg, partitioner)
  result = evaluate_params(params, model, eval_dataset_cfg, partitioner, eval_batches)
  print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
  tasks = (inference.tasks_with_metrics(eval_dataset_cfg.mixture_or_task_name)
           if hasattr(model, "predict_batch") else [])  # the dual encoder: decal_jax.retrieve
  if tasks:
    with partitioner.activate():
      predict = jax.jit(functools.partial(model.predict_batch, num_decodes=num_decodes))
  local_batch = eval_dataset_cfg.batch_size // jax.process_count()
  for task in tasks:
    def predict_fn(batch):
      with partitioner.activate():
        return jax.device_get(predict(params, to_global(batch, partitioner)))
    scores, rows = inference.predict_task(
        task, predict_fn, model.FEATURE_CONVERTER_CLS(pack=False),
        eval_dataset_cfg.task_feature_lengths, eval_dataset_cfg.split, local_batch,
        max_predict_examples)
    scores = dict(scores, num_examples=len(rows), step=step,
                  compression_ratio=_compression_ratio(model,
                                                       eval_dataset_cfg.task_feature_lengths))
    if jax.process_index() == 0:
      paths = inference.write_results(model_dir, task.name, eval_dataset_cfg.split, step,
                                      scores, rows)
      print(f"{task.name} ({len(rows)} examples): " + ", ".join(
          f"{k} {v:.2f}" for k, v in sorted(scores.items())
          if k not in ("step", "num_examples", "compression_ratio")) +
            f"\n  predictions: {paths['predictions']}\n  metrics:     {paths['metrics']}")
    result.update({f"{task.name}/{k}": float(v) for k, v in scores.items() if k != "step"})
  _data_notes()
  writer = metrics.MetricsWriter(model_dir)
  writer.write("eval", step, result)
  writer.close()
  return result


def _data_notes() -> None:
  """What the input pipeline cut in this process: sequences and long sentences."""
  if jax.process_index() != 0:
    return
  for name, count in text_to_text.truncation_counts().items():
    print(f"note: {name}: {count} sequences cut to TASK_FEATURE_LENGTHS in this run (each pass "
          "over the data counts).")
  for name, count in sentences.sentence_split_counts().items():
    print(f"note: {name}: {count} sentences longer than the maximum sentence length were "
          "split in this run (each pass over the data counts).")


def _compression_ratio(model, lengths: Mapping[str, int]):
  config = getattr(model.module, "config", None)
  if hasattr(config, "memory_count") and "inputs" in lengths:  # Squid: tokens per vector
    return lengths["inputs"] / config.memory_count(lengths["inputs"])
  return int(getattr(config, "compression_ratio", 1))


def infer(*, model, model_dir: str, task_feature_lengths, inputs: Sequence[str] = (),
          input_file: Optional[str] = None, input_field: str = "inputs",
          input_kind: Optional[str] = None, output_file: Optional[str] = None,
          partitioner=None, num_decodes: int = 1, batch_size: int = 32) -> Sequence[str]:
  """Decodes input texts with the latest checkpoint; prints and returns the outputs.

  Inputs: `inputs` (texts), and/or `input_file` (JSONL: each line's `input_field`, or with
  `input_kind` = 'summarization' / 'qa', each line's document / question + context formatted
  as that kind's tasks do). Inputs longer than task_feature_lengths['inputs'] are cut, with a
  note. `output_file` gets one JSON line per input: {"inputs", "prediction"}."""
  texts = list(inputs)
  if input_file:
    texts += inference.read_inputs(input_file, input_field, input_kind)
  if not texts:
    raise ValueError("Nothing to decode: give INFER_INPUTS=['text', ...] or "
                     "INFER_INPUT_FILE='file.jsonl'.")
  for i, text in enumerate(texts):
    if not isinstance(text, str) or not text.strip():
      raise ValueError(f"Input {i} is empty or whitespace only ({text!r}); give each input "
                       "some text to encode.")
  partitioner = partitioner or partitioning.Partitioner()
  cfg = DatasetConfig("", task_feature_lengths)
  params, _ = restore_params(model, model_dir, cfg, partitioner)
  vocab = model.input_vocabulary
  max_len = task_feature_lengths["inputs"]
  ids = [list(vocab.encode(t))[:max_len - 1] + [vocab.eos_id] for t in texts]
  cut = sum(len(vocab.encode(t)) > max_len - 1 for t in texts)
  if cut:
    print(f"note: {cut} of {len(texts)} inputs were longer than {max_len - 1} tokens and were "
          "cut; raise TASK_FEATURE_LENGTHS['inputs'] to keep more.")
  with partitioner.activate():
    predict = jax.jit(functools.partial(model.predict_batch, num_decodes=num_decodes))
  outputs = []
  for start in tqdm.trange(0, len(ids), batch_size, desc="decode", disable=len(ids) <= batch_size):
    chunk = ids[start:start + batch_size]
    enc = np.zeros((batch_size, max(len(x) for x in chunk)), np.int32)
    for i, x in enumerate(chunk):
      enc[i, :len(x)] = x
    batch = {"encoder_input_tokens": enc,
             "decoder_input_tokens": np.zeros((batch_size, task_feature_lengths["targets"]),
                                              np.int32)}
    with partitioner.activate():
      tokens = np.asarray(predict(params, batch))[:len(chunk)]
    outputs += [inference.token_text(model.output_vocabulary, row) for row in tokens]
  if output_file:
    inference.write_predictions(output_file, texts, outputs)
    print(f"Wrote {len(outputs)} predictions to {output_file}.")
  else:
    for text, out in zip(texts, outputs):
      print(f"input:  {text}\noutput: {out}\n")
  return outputs
