"""Decoding whole splits of seqio tasks: predictions, metrics, and the files they go to.

`predict_task` decodes every example of a task split (or the first `max_examples`) in
batches, turns predictions and targets into text with the task's vocabulary and
`postprocess_fn` (targets see the whole example, so QA targets carry every answer), and
computes the task's `predict_metric_fns`. `write_results` stores them in
MODEL_DIR/eval_results/ as `<task>.<split>.<step>.predictions.jsonl` (one line per example:
inputs, target, prediction) and `.metrics.json`, each written atomically.
"""
import json
import pathlib
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np
import seqio
import tqdm

from decal_jax import fileio


def tasks_with_metrics(name: str) -> List[seqio.Task]:
  """The task itself, or a mixture's sub-tasks, that have prediction metrics."""
  task = seqio.get_mixture_or_task(name)
  tasks = task.tasks if isinstance(task, seqio.Mixture) else [task]
  return [t for t in tasks if t.predict_metric_fns]


def token_text(vocabulary: seqio.Vocabulary, ids: Iterable[int]) -> str:
  """Text of decoded ids, up to the first EOS (padding dropped)."""
  ids = [int(i) for i in ids]
  if vocabulary.eos_id in ids:
    ids = ids[:ids.index(vocabulary.eos_id)]
  return vocabulary.decode([i for i in ids if i > 0])


def _plain(value: Any) -> Any:
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, np.ndarray):
    return [_plain(v) for v in value.tolist()]
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def predict_task(task: seqio.Task, predict_fn, feature_converter, lengths: Mapping[str, int],
                 split: str, batch_size: int, max_examples: Optional[int] = None
                 ) -> Tuple[Dict[str, float], List[Dict[str, Any]]]:
  """(metrics, [{'inputs', 'target', 'prediction'}]) over a task split.

  `predict_fn(batch) -> [batch, length]` token ids (a padded final batch is cut back)."""
  ds = task.get_dataset(lengths, split=split, shuffle=False, num_epochs=1)
  if max_examples:
    ds = ds.take(max_examples)
  ds = ds.cache()  # read (and truncation-counted) once, then replayed for the model features
  examples = list(ds.as_numpy_iterator())
  if not examples:
    raise ValueError(f"Split {split!r} of {task.name!r} gave no examples.")
  model_ds = feature_converter(ds, lengths).batch(batch_size)
  vocab = task.output_features["targets"].vocabulary
  predictions: List[str] = []
  bar = tqdm.tqdm(total=len(examples), desc=f"decode {task.name}", dynamic_ncols=True,
                  disable=jax.process_index() != 0)
  for batch in model_ds.as_numpy_iterator():
    n = len(batch["encoder_input_tokens"])
    padded = {k: np.pad(v, [(0, batch_size - n)] + [(0, 0)] * (v.ndim - 1))
              for k, v in batch.items()}
    tokens = np.asarray(predict_fn(padded))[:n]
    predictions += [token_text(vocab, row) for row in tokens]
    bar.update(n)
  bar.close()
  targets = [task.postprocess_fn(_plain(ex["targets_pretokenized"]), example=ex, is_target=True)
             for ex in examples]
  outputs = [task.postprocess_fn(p, example=ex, is_target=False)
             for p, ex in zip(predictions, examples)]
  metrics: Dict[str, float] = {}
  for fn in task.predict_metric_fns:
    metrics.update(fn(targets, outputs))
  rows = [{"inputs": _plain(ex["inputs_pretokenized"]), "target": _plain(t), "prediction": p}
          for ex, t, p in zip(examples, targets, outputs)]
  return metrics, rows


def write_results(model_dir: str, task: str, split: str, step: int,
                  metrics: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> Dict[str, str]:
  """Writes the predictions JSONL and the metrics JSON; returns their paths."""
  base = pathlib.Path(model_dir) / "eval_results" / f"{task}.{split}.{step}"
  paths = {"predictions": str(base) + ".predictions.jsonl", "metrics": str(base) + ".metrics.json"}
  fileio.write_text_atomic(paths["predictions"],
                           "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
  fileio.write_text_atomic(paths["metrics"], json.dumps(dict(metrics), indent=2) + "\n")
  return paths


def write_predictions(path: str, inputs: Sequence[str], predictions: Sequence[str]) -> None:
  """JSONL {"inputs", "prediction"} per line, written atomically."""
  fileio.write_text_atomic(path, "".join(
      json.dumps({"inputs": i, "prediction": p}, ensure_ascii=False) + "\n"
      for i, p in zip(inputs, predictions)))


def read_inputs(path: str, field: str = "inputs", kind: Optional[str] = None) -> List[str]:
  """Input texts from a JSONL file: the `field` of each line as it is or, given a task kind
  ('summarization' / 'qa'), each line's record formatted as that kind's tasks do."""
  from decal_jax.data import local_files, text_to_text  # pylint: disable=import-outside-toplevel
  texts = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        if kind is None:
          record = local_files.parse_line(line, local_files.Schema({field: "text"}), {})
          texts.append(record[field])
        else:
          record = local_files.parse_line(line, text_to_text.input_schema(kind), {})
          texts.append(text_to_text.format_inputs(kind, record))
      except local_files.BadRecordError as e:
        raise local_files.BadRecordError(f"{path}:{number}: {e}") from None
  if not texts:
    raise ValueError(f"{path} holds no input line.")
  return texts
