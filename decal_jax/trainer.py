"""The gin-configurable train / evaluate / infer loops (T5X-style, on jax.jit + a mesh).

`train(...)` builds the model's variables sharded over the partitioner's mesh, restores
the latest checkpoint in MODEL_DIR if there is one (params, optimizer state, step and the
number of batches consumed, so the data stream continues where it stopped), runs jitted
train steps with a progress bar, writes TensorBoard metrics to MODEL_DIR/train and
MODEL_DIR/eval, saves Orbax checkpoints, evaluates on the validation split and prints a
decoded example.
"""
import dataclasses
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import seqio
import tensorflow as tf
import tqdm

from decal_jax import checkpoints, metrics, optimizers, partitioning
from decal_jax.data import span_corruption

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
  for key in ("inputs", "targets"):
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
  model_vocab = getattr(getattr(model.module, "config", None), "vocab_size", None)
  task_vocab = tasks[0].output_features["targets"].vocabulary.vocab_size
  if model_vocab is not None and model_vocab < task_vocab:
    raise ValueError(f"The task's vocabulary has {task_vocab} ids but the model's vocab_size "
                     f"is {model_vocab}; bind T5Config.vocab_size >= {task_vocab}.")


def get_dataset(cfg: DatasetConfig, model, num_epochs: Optional[int]) -> tf.data.Dataset:
  """This process's share of the batched dataset (seqio shards by process)."""
  if cfg.batch_size % jax.process_count():
    raise ValueError(f"BATCH_SIZE {cfg.batch_size} must divide evenly over "
                     f"{jax.process_count()} processes.")
  ds = seqio.get_dataset(
      cfg.mixture_or_task_name, cfg.task_feature_lengths,
      feature_converter=model.FEATURE_CONVERTER_CLS(pack=cfg.pack), dataset_split=cfg.split,
      use_cached=cfg.use_cached, shuffle=cfg.shuffle, num_epochs=num_epochs,
      shard_info=seqio.ShardInfo(jax.process_index(), jax.process_count()), seed=cfg.seed,
      verbose=False)
  local = cfg.batch_size // jax.process_count()
  return ds.batch(local, drop_remainder=num_epochs is None)


def train_batches(cfg: DatasetConfig, model, skip: int) -> Iterator[Batch]:
  """Endless, deterministic batches; `skip` = batches already consumed (resume)."""
  return get_dataset(cfg, model, num_epochs=None).skip(skip).as_numpy_iterator()


def pad_batch(batch: Batch, batch_size: int) -> Batch:
  """Pads a short final batch with all-zero rows (zero loss weight)."""
  n = next(iter(batch.values())).shape[0]
  if n == batch_size:
    return batch
  return {k: np.pad(v, [(0, batch_size - n)] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}


def to_global(batch: Batch, partitioner: partitioning.Partitioner):
  """Process-local numpy batch -> global jax arrays sharded over the `data` mesh axis."""
  sharding = partitioner.batch_sharding()
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


# ------------------------------------------------------------------------------ state
def _input_shapes(cfg: DatasetConfig):
  lengths = cfg.task_feature_lengths
  return {"encoder_input_tokens": (1, lengths["inputs"]),
          "decoder_input_tokens": (1, lengths["targets"])}


def abstract_params(model, cfg: DatasetConfig, partitioner):
  """(params as ShapeDtypeStructs carrying their mesh shardings, those shardings)."""
  shapes = _input_shapes(cfg)
  variables = jax.eval_shape(lambda: model.get_initial_variables(jax.random.PRNGKey(0), shapes))
  shardings = partitioner.params_shardings(variables["params_axes"])
  abstract = jax.tree_util.tree_map(
      lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), variables["params"],
      shardings)
  return abstract, shardings


def init_state(model, optimizer, partitioner, cfg: DatasetConfig, seed: int):
  """Sharded {'params', 'opt_state', 'step'} built directly on the mesh."""
  shapes = _input_shapes(cfg)
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
  """Optimizer-state subtrees that mirror the params (Adam moments, unfactored Adafactor
  statistics) are sharded like the params where shapes agree; the rest is replicated."""
  params_tree = jax.tree_util.tree_structure(abstract["params"])

  def mirrors_params(node):
    return jax.tree_util.tree_structure(node) == params_tree

  def shard(node):
    if not mirrors_params(node):
      return jax.tree_util.tree_map(lambda _: partitioner.replicated(), node)
    return jax.tree_util.tree_map(
        lambda leaf, param, sharding: sharding if leaf.shape == param.shape
        else partitioner.replicated(), node, abstract["params"], params_sharding)

  return jax.tree_util.tree_map(shard, abstract["opt_state"], is_leaf=mirrors_params)


def make_train_step(model, optimizer, partitioner, shardings):
  def step_fn(state, batch, rng):
    dropout_rng = jax.random.fold_in(rng, state["step"])
    grad_fn = jax.value_and_grad(model.loss_fn, has_aux=True)
    (loss, aux), grads = grad_fn(state["params"], batch, dropout_rng)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    aux = dict(aux, loss=loss, grad_norm=optax.global_norm(grads))
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, aux

  jitted = jax.jit(step_fn, out_shardings=(shardings, partitioner.replicated()),
                   donate_argnums=(0,))

  def run(state, batch, rng):
    with partitioner.activate():
      return jitted(state, batch, rng)
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
  batches = get_dataset(dataclasses.replace(cfg, shuffle=False), model, num_epochs=1)
  for i, batch in enumerate(batches.as_numpy_iterator()):
    if i >= max_batches:
      break
    batch = pad_batch(batch, cfg.batch_size // jax.process_count())
    aux = jax.device_get(step(params, to_global(batch, partitioner)))
    for k, v in aux.items():
      sums[k] = sums.get(k, 0.0) + float(v)
  if not sums:
    raise ValueError(f"Split {cfg.split!r} of {cfg.mixture_or_task_name!r} gave no examples.")
  return metrics.summarize(sums)


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

  return {"inputs": text(batch["encoder_input_tokens"][0]),
          "targets": text(batch["decoder_target_tokens"][0]),
          "prediction": text(np.asarray(tokens)[0])}


# ------------------------------------------------------------------------------ train
def train(*, model, train_dataset_cfg: DatasetConfig,
          eval_dataset_cfg: Optional[DatasetConfig] = None, model_dir: str,
          total_steps: int, optimizer=None, partitioner=None, seed: int = 0,
          eval_period: int = 200, eval_batches: int = 20, log_period: int = 10,
          checkpoint_period: int = 200, keep_checkpoints: int = 3,
          show_example: bool = True, gin_config_text: str = "") -> Dict[str, float]:
  """Trains to `total_steps`, resuming from MODEL_DIR; returns the final eval metrics
  (and, with `show_example`, prints one validation example decoded by the model)."""
  optimizer = optimizer or optimizers.adafactor()
  partitioner = partitioner or partitioning.Partitioner()
  check_feature_lengths(train_dataset_cfg, model)
  state, shardings = init_state(model, optimizer, partitioner, train_dataset_cfg, seed)
  ckpt = checkpoints.Checkpointer(model_dir, keep=keep_checkpoints, save_period=checkpoint_period)
  state, consumed = _maybe_restore(ckpt, state, train_dataset_cfg)
  if gin_config_text:
    checkpoints.write_config(model_dir, gin_config_text)
  writer = metrics.MetricsWriter(model_dir)
  step_fn = make_train_step(model, optimizer, partitioner, shardings)
  start = int(jax.device_get(state["step"]))
  batches = train_batches(train_dataset_cfg, model, skip=consumed)
  rng = jax.random.PRNGKey(seed + 1)
  eval_cfg = eval_dataset_cfg or dataclasses.replace(train_dataset_cfg, split="validation")
  result: Dict[str, float] = {}
  window = metrics.Window()
  bar = tqdm.tqdm(range(start, total_steps), initial=start, total=total_steps, desc="train",
                  dynamic_ncols=True, disable=jax.process_index() != 0)
  for step in bar:
    batch = next(batches)
    consumed += 1
    state, aux = step_fn(state, to_global(batch, partitioner), rng)
    window.add(aux, num_tokens=int(np.sum(batch["encoder_input_tokens"] > 0) +
                                   np.sum(batch["decoder_target_tokens"] > 0)))
    done = step + 1
    if done % log_period == 0 or done == total_steps:
      summary = window.flush()
      bar.set_postfix(loss=f"{summary['loss']:.3f}", acc=f"{summary['accuracy']:.3f}",
                      tok_s=f"{summary['tokens_per_second']:.0f}")
      writer.write("train", done, summary)
    ckpt.save(done, state, {"batches_consumed": consumed, "seed": train_dataset_cfg.seed})
    if done % eval_period == 0 and done != total_steps:
      writer.write("eval", done, evaluate_params(state["params"], model, eval_cfg, partitioner,
                                                 eval_batches))
  if start < total_steps or ckpt.latest_step() != total_steps:
    ckpt.save(total_steps, state, {"batches_consumed": consumed,
                                   "seed": train_dataset_cfg.seed}, force=True)
  result = evaluate_params(state["params"], model, eval_cfg, partitioner, eval_batches)
  writer.write("eval", total_steps, result)
  writer.close()
  ckpt.close()
  example = decode_example(state["params"], model, eval_cfg, partitioner) if show_example else None
  _report(result, example, total_steps)
  return result


def _maybe_restore(ckpt: checkpoints.Checkpointer, state, cfg: DatasetConfig):
  step = ckpt.latest_step()
  if step is None:
    return state, 0
  restored, data = ckpt.restore(step, checkpoints.abstract_like(state))
  if data.get("seed", cfg.seed) != cfg.seed:
    print(f"note: the checkpoint's data seed {data['seed']} differs from {cfg.seed}; the data "
          "stream restarts from a new order.")
  print(f"Resuming from step {step} in {ckpt.directory} "
        f"({data.get('batches_consumed', 0)} batches consumed).", flush=True)
  return restored, int(data.get("batches_consumed", 0))


def _report(result: Mapping[str, float], example: Optional[Mapping[str, str]], step: int) -> None:
  if jax.process_index() != 0:
    return
  print(f"\nHeld-out (validation) at step {step}: loss {result['loss']:.4f}, "
        f"token accuracy {result['accuracy']:.4f} over {int(result['target_tokens'])} "
        "target tokens.")
  if example is None:
    return
  print("Denoising example, decoded from the compressed encoding:")
  for key in ("inputs", "targets", "prediction"):
    print(f"  {key:>10}: {example[key]}")


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
             eval_batches: int = 50) -> Dict[str, float]:
  """Evaluates the latest checkpoint; writes MODEL_DIR/eval metrics and prints them."""
  partitioner = partitioner or partitioning.Partitioner()
  params, step = restore_params(model, model_dir, eval_dataset_cfg, partitioner)
  result = evaluate_params(params, model, eval_dataset_cfg, partitioner, eval_batches)
  writer = metrics.MetricsWriter(model_dir)
  writer.write("eval", step, result)
  writer.close()
  print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
  return result


def infer(*, model, inputs: Sequence[str], model_dir: str, task_feature_lengths,
          partitioner=None, num_decodes: int = 1) -> Sequence[str]:
  """Decodes each input text with the latest checkpoint; prints and returns the outputs."""
  texts = list(inputs)
  for i, text in enumerate(texts):
    if not isinstance(text, str) or not text.strip():
      raise ValueError(f"Input {i} is empty or whitespace only ({text!r}); give each input "
                       "some text to encode.")
  partitioner = partitioner or partitioning.Partitioner()
  cfg = DatasetConfig("", task_feature_lengths)
  params, _ = restore_params(model, model_dir, cfg, partitioner)
  vocab = model.input_vocabulary
  ids = [list(vocab.encode(t)) + [vocab.eos_id] for t in texts]
  length = max(len(x) for x in ids)
  enc = np.zeros((len(ids), length), np.int32)
  for i, x in enumerate(ids):
    enc[i, :len(x)] = x
  batch = {"encoder_input_tokens": enc,
           "decoder_input_tokens": np.zeros((len(ids), task_feature_lengths["targets"]),
                                            np.int32)}
  with partitioner.activate():
    tokens = np.asarray(model.predict_batch(params, batch, num_decodes=num_decodes))
  outputs = [model.output_vocabulary.decode([int(t) for t in row if t > 0]) for row in tokens]
  for text, out in zip(texts, outputs):
    print(f"input:  {text}\noutput: {out}\n")
  return outputs
