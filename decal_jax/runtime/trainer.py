"""The gin-configurable training loop (T5X's `trainer.py`): `train`, around the jitted step
of `train_step.make_train_step`.

`train(...)` builds the model's variables sharded over the partitioner's mesh
(`train_state`), restores the latest checkpoint in MODEL_DIR if there is one (params,
optimizer state, step, the dropout RNG and the input pipeline's position, so the data
stream continues where it stopped without re-reading it), runs jitted train steps with a
progress bar (`console.bar_options`: off when stderr is not a terminal) and an INFO log line
every `log_period` steps (step, loss, accuracy, learning rate, steps/s: kept by a pipe or the
--log_dir file), writes TensorBoard metrics to MODEL_DIR/train and
MODEL_DIR/training_eval/<task> (T5X's folders), saves Orbax checkpoints, evaluates on the
validation split and prints a decoded example (`evaluation`).
"""
import dataclasses
import logging
from typing import Dict, Mapping, Optional

import jax
import jax.numpy as jnp
import tqdm

from decal_jax import metrics, partitioning
from decal_jax.runtime import (checkpoints, console, evaluation, model_info, optimizers,
                               resilience, run_lock, train_state, vocabulary_record)
from decal_jax.data import batches as data_batches
from decal_jax.data import pipeline
from decal_jax.data.batches import DatasetConfig
from decal_jax.models import BaseModel
from decal_jax.runtime.train_step import make_train_step

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ train
RUN_SETTING_MACROS = {"total_steps": "TRAIN_STEPS", "eval_period": "EVAL_PERIOD",
                      "eval_batches": "EVAL_BATCHES", "log_period": "LOG_PERIOD",
                      "checkpoint_period": "CHECKPOINT_PERIOD",
                      "keep_checkpoints": "KEEP_CHECKPOINTS"}


def check_run_settings(model_dir: str, **settings: int) -> None:
  """Refuses a MODEL_DIR that is a file and counts below 1 (TRAIN_STEPS = -5 would write
  checkpoint_-5), naming the gin binding, before any start-up work."""
  train_state.check_model_dir(model_dir, "trainer.train.model_dir")
  for name, value in settings.items():
    data_batches.check_count(f"{RUN_SETTING_MACROS[name]} (trainer.train.{name})", value)


def train(*, model: BaseModel, train_dataset_cfg: DatasetConfig,
          eval_dataset_cfg: Optional[DatasetConfig] = None, model_dir: str,
          total_steps: int, optimizer=None, partitioner=None, seed: int = 0,
          eval_period: int = 200, eval_batches: int = 20, log_period: int = 10,
          checkpoint_period: int = 200, keep_checkpoints: int = 3,
          show_example: bool = True, gin_config_text: str = "",
          initial_checkpoint_path: Optional[str] = None, allow_partial_restore: bool = False,
          nonfinite_policy: str = "raise",
          checkpoint_input: bool = True) -> Dict[str, float]:
  """Trains to `total_steps`, resuming from MODEL_DIR; returns the final eval metrics
  (and, with `show_example`, prints one validation example decoded by the model). A run
  already at `total_steps` prints "already at step N = TRAIN_STEPS; nothing to train",
  writes nothing to MODEL_DIR and returns the held-out metrics of its last checkpoint.

  Resuming is exact: a checkpoint holds params, optimizer state, step, the dropout RNG and
  the number of batches consumed, so a run killed at any point and started again with the
  same command ends with the same parameters as one that never stopped; a resume with
  another vocabulary than MODEL_DIR/vocabulary.json records (written before the first
  checkpoint) is refused (`vocabulary_record`). SIGTERM makes the run finish its step,
  save, and return {'preempted_at_step': step}; so does a first Ctrl-C (a second aborts
  at once).

  `initial_checkpoint_path` (a MODEL_DIR or one of its checkpoint_<step> folders) starts a
  run whose MODEL_DIR is still empty from those weights: every parameter with the same
  name and shape is restored, the others (e.g. DeCAL's latent vector on top of an
  uncompressed model) keep their initialisation; optimizer state and step start fresh.
  Fewer than half of the model's parameters restored (another architecture) is refused
  unless `allow_partial_restore`.

  `nonfinite_policy`: a step with a NaN / Inf loss or gradient never changes the state;
  'raise' then stops with `resilience.NonFiniteError` naming the step (no checkpoint after
  it is written), 'skip' notes it and goes on.

  `checkpoint_input`: each checkpoint also holds every process's input-pipeline position
  (`data.batch_iterator`), so a resume reads nothing twice; False leaves it out (smaller
  checkpoints when shuffle buffers are large; a resume then re-reads the consumed batches).

  The run holds MODEL_DIR's lock (`run_lock`) from the checks to the end: a second trainer
  on the same folder is refused, naming this one. Before MODEL_DIR's first file, the first
  example of the train and eval splits is read (`check_inputs`): a bad data file or
  vocabulary leaves the folder as it was."""
  check_run_settings(model_dir, total_steps=total_steps, eval_period=eval_period,
                     eval_batches=eval_batches, log_period=log_period,
                     checkpoint_period=checkpoint_period, keep_checkpoints=keep_checkpoints)
  if initial_checkpoint_path:  # a folder that is no checkpoint: named before MODEL_DIR's first file
    checkpoints.check_checkpoint_path(initial_checkpoint_path, "INITIAL_CHECKPOINT_PATH")
  with run_lock.hold(model_dir):
    new_record = vocabulary_record.check(model_dir, model)  # resuming with another: refused
    if initial_checkpoint_path:  # so is starting from a run of another same-size vocabulary
      vocabulary_record.check_initial(initial_checkpoint_path, model)
    optimizer = optimizer or optimizers.adafactor()
    partitioner = partitioner or partitioning.Partitioner()
    guard = resilience.NonFiniteGuard(nonfinite_policy)
    pipeline.check_feature_lengths(train_dataset_cfg, model)
    eval_cfg = eval_dataset_cfg or dataclasses.replace(train_dataset_cfg, split="validation")
    check_inputs(train_dataset_cfg, eval_cfg)  # before MODEL_DIR's first file
    state, shardings = train_state.init_state(model, optimizer, partitioner, train_dataset_cfg,
                                              seed)
    ckpt = checkpoints.Checkpointer(model_dir, keep=keep_checkpoints, save_period=checkpoint_period)
    state, position = train_state.restore_latest(ckpt, state, train_dataset_cfg, seed)
    start = int(jax.device_get(state["step"]))
    if start >= total_steps:  # a finished run: nothing is written, the metrics are returned
      ckpt.close()
      relation = "=" if start == total_steps else f"> {total_steps} ="
      print(f"already at step {start} {relation} TRAIN_STEPS; nothing to train")
      return evaluation.evaluate_params(state["params"], model, eval_cfg, partitioner,
                                        eval_batches)
    if initial_checkpoint_path and ckpt.latest_step() is None:
      state = dict(state, params=train_state.start_from(initial_checkpoint_path, state["params"],
                                                        allow_partial_restore))
    if gin_config_text:
      checkpoints.write_config(model_dir, gin_config_text)
    if new_record:
      vocabulary_record.write(model_dir, new_record)
    writer = metrics.MetricsWriter(model_dir)
    step_fn = make_train_step(model, optimizer, partitioner, shardings)
    writer.write_config(start, gin_config_text,
                        metrics.run_hparams(model, train_dataset_cfg, total_steps, seed))
    model_info.write(model_dir, model, train_dataset_cfg, partitioner)  # T5X's model-info.txt
    schedule = optimizers.schedule_of(optimizer)
    batches = pipeline.resume_batches(train_dataset_cfg, model, partitioner, ckpt.latest_step(),
                                      ckpt.restore_dataset, position)
    position.pop("seed_changed", None)  # not part of what a checkpoint stores
    rng = jnp.asarray(position["rng"], jnp.uint32)
    window = metrics.Window(model.summarize)
    bar = tqdm.tqdm(range(start, total_steps), initial=start, total=total_steps, desc="train",
                    dynamic_ncols=True, **console.bar_options(jax.process_index()))

    def save(step: int, force: bool = False):
      if force or step % checkpoint_period == 0:
        guard.check(ckpt.latest_step(), model_dir)  # never save after a non-finite step
      ckpt.save(step, state, position, force=force,
                batches=batches if checkpoint_input else None)

    with resilience.PreemptionWatcher() as preemption:
      for step in bar:
        batch = next(batches)
        model.check_batch(batch)  # host-side input checks, before any state changes
        position["batches_consumed"] += 1
        state, aux = step_fn(state, pipeline.to_global(batch, partitioner), rng)
        guard.add(step + 1, aux.pop("nonfinite"))
        window.add(aux, num_tokens=model.num_tokens(batch))
        done = step + 1
        if done % log_period == 0 or done == total_steps:
          guard.check(ckpt.latest_step(), model_dir)
          summary = window.flush()
          if schedule is not None:  # the rate of the step just taken (optax counts from 0)
            summary["learning_rate"] = float(schedule(done - 1))
          bar.set_postfix(loss=f"{summary['loss']:.3f}", acc=f"{summary['accuracy']:.3f}",
                          tok_s=f"{summary['tokens_per_second']:.0f}")
          writer.write("train", done, summary)
          log_step(done, total_steps, summary)
        if done < total_steps and preemption.requested():
          save(done, force=True)
          return _stop_preempted(done, bar, writer, ckpt, preemption.signal_name)
        save(done)
        if done % eval_period == 0 and done != total_steps:
          writer.write(evaluation.training_eval_dir(eval_cfg), done, evaluation.evaluate_params(
              state["params"], model, eval_cfg, partitioner, eval_batches))
    if start < total_steps or ckpt.latest_step() != total_steps:
      save(total_steps, force=True)
    result = evaluation.evaluate_params(state["params"], model, eval_cfg, partitioner,
                                        eval_batches)
    writer.write(evaluation.training_eval_dir(eval_cfg), total_steps, result)
    writer.close()
    ckpt.close()
    example = (evaluation.decode_example(state["params"], model, eval_cfg, partitioner)
               if show_example and evaluation.can_decode_example(model) else None)
    evaluation.report(result, example, total_steps)
    pipeline.print_data_notes()
    return result


def check_inputs(train_cfg: DatasetConfig, eval_cfg: DatasetConfig) -> None:
  """The first example of the train and the eval split, read and tokenized: a bad data
  file (not UTF-8, a folder, empty) or vocabulary is refused before MODEL_DIR gets its
  first file, so a refused run leaves the folder as it found it."""
  pipeline.check_first_example(train_cfg, "train")
  if (eval_cfg.mixture_or_task_name, eval_cfg.split) != (train_cfg.mixture_or_task_name,
                                                         train_cfg.split):
    pipeline.check_first_example(eval_cfg, "eval")


def step_line(step: int, total_steps: int, summary: Mapping[str, float]) -> str:
  """'train step 10/100: loss=2.345, accuracy=0.4012, learning_rate=0.01, steps/s=3.21,
  tokens/s=1234' (the learning rate when the optimizer has a schedule)."""
  names = {"loss": "loss", "accuracy": "accuracy", "learning_rate": "learning_rate",
           "steps_per_second": "steps/s", "tokens_per_second": "tokens/s"}
  values = ", ".join(f"{shown}={summary[name]:.4g}" for name, shown in names.items()
                     if name in summary)
  return f"train step {step}/{total_steps}: {values}"


def log_step(step: int, total_steps: int, summary: Mapping[str, float]) -> None:
  """The step line at INFO from process 0 (T5X logs its train metrics through absl)."""
  if jax.process_index() == 0:
    log.info(step_line(step, total_steps, summary))


def _stop_preempted(step: int, bar, writer, ckpt, signal_name: str) -> Dict[str, float]:
  bar.close()
  writer.close()
  ckpt.close()
  partitioning.log(f"\nPreempted ({signal_name}) after step {step}: saved checkpoint_{step} in "
                   f"{ckpt.directory}. Run the same command again to continue from it.")
  return {"preempted_at_step": float(step)}
