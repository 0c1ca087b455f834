"""Inference evaluation through `seqio.Evaluator`, written where T5X and seqio tooling look.

For a task (or each sub-task of a mixture) with metrics, the split is decoded and scored
with all three of seqio's metric kinds: `predict_metric_fns` (decoded text: ROUGE, EM / F1,
BLEU), `predict_with_aux_metric_fns` (decoded text and the decoder's `scores`) and
`score_metric_fns` (each target's log-likelihood). seqio's loggers write, under
MODEL_DIR/inference_eval/ (T5X's `InferenceEvaluator` layout):

  <task>-metrics.jsonl   one line per evaluation: {"step": N, "<metric>": value, ...}
  <task>-<step:06>.jsonl one line per example: {"input": {task features}, "target": ...,
                         "prediction": ..., "output": ...} (seqio.JSONLogger's fields)
  <task>/events.*        TensorBoard scalars `eval/<metric>` (seqio.TensorBoardLogger)

`read_metrics` and `read_inferences` read them back.
"""
import functools
import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import numpy as np
import seqio
import tensorflow as tf
import tqdm

from decal_jax.data import pipeline
from decal_jax.data.batches import DatasetConfig
from decal_jax.models import BaseModel

DIRECTORY = "inference_eval"


def metrics_path(model_dir: str, task: str) -> str:
  return os.path.join(model_dir, DIRECTORY, f"{task}-metrics.jsonl")


def inferences_path(model_dir: str, task: str, step: int) -> str:
  return os.path.join(model_dir, DIRECTORY, f"{task}-{step:06}.jsonl")


def read_metrics(model_dir: str, task: str, step: int) -> Dict[str, Any]:
  """The metrics of `task` logged at `step` (the last such line: a re-evaluation appends)."""
  path = metrics_path(model_dir, task)
  with open(path, encoding="utf-8") as f:
    lines = [json.loads(line) for line in f if line.strip()]
  at_step = [line for line in lines if line["step"] == step]
  if not at_step:
    raise KeyError(f"{path} has no evaluation at step {step} (steps: "
                   f"{sorted({line['step'] for line in lines})}).")
  return at_step[-1]


def read_inferences(model_dir: str, task: str, step: int) -> List[Dict[str, Any]]:
  """The per-example lines seqio.JSONLogger wrote for `task` at `step`."""
  with open(inferences_path(model_dir, task, step), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def has_metrics(name: str) -> bool:
  """Whether the task, or a sub-task of the mixture, has metrics for seqio to compute."""
  return any(task.metric_objs for task in seqio.get_subtasks(pipeline.get_task(name)))


# ------------------------------------------------------------------------------ model fns
def _enumerated_batches(ds: tf.data.Dataset, batch_size: int, desc: str):
  """(example indices, rows, batch padded to `batch_size`) over seqio's enumerated dataset."""
  total = int(ds.cardinality())
  with tqdm.tqdm(total=total if total >= 0 else None, desc=desc, dynamic_ncols=True,
                 disable=jax.process_index() != 0) as bar:
    for indices, batch in ds.batch(batch_size).as_numpy_iterator():
      yield [int(i) for i in indices], len(indices), pipeline.pad_batch(batch, batch_size)
      bar.update(len(indices))


def model_fns(model: BaseModel, params, partitioner, batch_size: int, num_decodes: int = 1
              ) -> Dict[str, Callable]:
  """seqio's `predict_fn`, `predict_with_aux_fn` and `score_fn` for `Evaluator.evaluate`:
  each maps the enumerated model-feature dataset to [(index, output)] (with aux values:
  ([(index, tokens)], {name: [value per example]})). seqio calls only those a task's
  metrics need; each is jitted when first called."""
  def on_devices(method: Callable) -> Callable:
    jitted = None

    def run(batch):
      nonlocal jitted
      with partitioner.activate():
        jitted = jitted or jax.jit(method)
        return jax.device_get(jitted(params, pipeline.to_global(batch, partitioner)))
    return run

  def predict_with_aux_fn(ds) -> Tuple[List[Tuple[int, Any]], Dict[str, List[Any]]]:
    run = on_devices(functools.partial(model.predict_batch_with_aux, num_decodes=num_decodes))
    outputs, aux = [], {}
    for indices, n, batch in _enumerated_batches(ds, batch_size, "decode"):
      tokens, values = run(batch)
      outputs += list(zip(indices, np.asarray(tokens)[:n]))
      for name, value in values.items():
        aux.setdefault(name, []).extend(np.asarray(value)[:n].tolist())
    return outputs, aux

  def per_example(method: Callable, desc: str):
    def fn(ds) -> List[Tuple[int, Any]]:
      run = on_devices(method)
      outputs = []
      for indices, n, batch in _enumerated_batches(ds, batch_size, desc):
        outputs += list(zip(indices, np.asarray(run(batch))[:n]))
      return outputs
    return fn

  return {"predict_fn": per_example(functools.partial(model.predict_batch,
                                                      num_decodes=num_decodes), "decode"),
          "predict_with_aux_fn": predict_with_aux_fn,
          "score_fn": per_example(model.score_batch, "score")}


# ------------------------------------------------------------------------------ evaluate
def evaluate(model: BaseModel, params, cfg: DatasetConfig, partitioner, model_dir: str,
             step: int, max_examples: Optional[int] = None, num_decodes: int = 1
             ) -> Dict[str, Dict[str, float]]:
  """Decodes / scores every task of `cfg.mixture_or_task_name` that has metrics (the first
  `max_examples` of each), logs them under MODEL_DIR/inference_eval/ (process 0) and
  returns {task: {metric: value}} (the scalar metrics, and num_examples)."""
  evaluator = seqio.Evaluator(
      mixture_or_task_name=cfg.mixture_or_task_name,
      feature_converter=model.FEATURE_CONVERTER_CLS(pack=False), eval_split=cfg.split,
      use_cached=cfg.use_cached, seed=cfg.seed, sequence_length=cfg.task_feature_lengths,
      num_examples=max_examples, logger_cls=[seqio.TensorBoardLogger, seqio.JSONLogger],
      log_dir=os.path.join(model_dir, DIRECTORY), async_compute_metrics=False)
  counts = {task.name: _count(evaluator.cached_task_datasets[task.name])
            for task in evaluator.eval_tasks}
  for name, count in counts.items():
    if not count:
      raise ValueError(f"Split {cfg.split!r} of {name!r} gave no examples.")
  fns = model_fns(model, params, partitioner, cfg.batch_size // jax.process_count(),
                  num_decodes)
  future, _ = evaluator.evaluate(compute_metrics=jax.process_index() == 0, step=step, **fns)
  all_metrics = future.result() or {}
  evaluator.close()
  return {name: dict(_scalars(all_metrics.get(name, {})), num_examples=float(count))
          for name, count in counts.items()}


def _count(ds: tf.data.Dataset) -> int:
  return int(ds.reduce(np.int64(0), lambda n, _: n + 1))


def _scalars(metrics) -> Dict[str, float]:
  """The scalar values of a task's metrics (seqio.metrics.Scalar or plain numbers)."""
  out = {}
  for name, value in metrics.items():
    value = getattr(value, "value", value)
    if np.ndim(value) == 0 and isinstance(np.asarray(value).item(), (int, float)):
      out[name] = float(value)
  return out


def report(model_dir: str, step: int, results: Dict[str, Dict[str, float]]) -> None:
  """Prints each task's metrics and the files that hold them (process 0)."""
  if jax.process_index() != 0:
    return
  for task, values in results.items():
    shown = ", ".join(f"{k} {v:.2f}" for k, v in sorted(values.items()) if k != "num_examples")
    print(f"{task} ({int(values['num_examples'])} examples): {shown}\n"
          f"  predictions: {inferences_path(model_dir, task, step)}\n"
          f"  metrics:     {metrics_path(model_dir, task)}")

