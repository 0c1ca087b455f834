"""Text-to-text preprocessing shared by the downstream tasks (summarization, QA).

Every source is first mapped to one of two record layouts:
  summarization: {'document': str, 'summary': str}
  qa:            {'question': str, 'context': str, 'answers': [str, ...]}
then formatted as T5 does: 'summarize: <document>' -> summary, and
'question: <q> context: <c>' -> the first answer. Every reference answer stays in the
example (`answers`) so metrics take the best match; `references` is the postprocess function
that hands them to the metric.

Inputs and targets longer than the task's feature lengths are cut (EOS kept) and counted:
the first cut and every 10x more are logged, and `truncation_counts()` reports the totals.
"""
import collections
import functools
import logging
import threading
from typing import Any, Dict, Mapping, Optional

import numpy as np
import seqio
import tensorflow as tf

from decal_jax.data import local_files

log = logging.getLogger(__name__)  # decal_jax.* warnings: console.py routes them in the CLI

SUMMARIZATION = {"document": "text", "summary": "text"}
QA = {"question": "text", "context": "text", "answers": "texts"}
KINDS = {"summarization": SUMMARIZATION, "qa": QA}
# The input text of each kind: [(literal prefix, field), ...] concatenated.
INPUT_FORMAT = {"summarization": [("summarize: ", "document")],
                "qa": [("question: ", "question"), (" context: ", "context")]}


def input_schema(kind: str):
  """The fields an input of `kind` needs (for inference, where there is no target)."""
  return local_files.Schema({field: "text" for _, field in INPUT_FORMAT[kind]})


def format_inputs(kind: str, record: Mapping[str, str]) -> str:
  """Python twin of the tasks' input formatting (used by inference on raw records)."""
  return "".join(prefix + record[field] for prefix, field in INPUT_FORMAT[kind])


def _inputs_tf(kind: str, ex) -> tf.Tensor:
  return tf.strings.join([part for prefix, field in INPUT_FORMAT[kind]
                          for part in (prefix, ex[field])])


def format_summarization(dataset: tf.data.Dataset) -> tf.data.Dataset:
  def fn(ex):
    return {"inputs": _inputs_tf("summarization", ex), "targets": ex["summary"],
            "answers": tf.reshape(ex["summary"], [1])}
  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


def format_qa(dataset: tf.data.Dataset) -> tf.data.Dataset:
  def fn(ex):
    return {"inputs": _inputs_tf("qa", ex), "targets": ex["answers"][0],
            "answers": ex["answers"]}
  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


class _TruncationCounter:
  """Thread-safe counts of cut sequences per (task, feature)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.counts: Dict[tuple, int] = collections.Counter()

  def add(self, task: str, feature: str, length: int) -> None:
    with self._lock:
      self.counts[(task, feature)] += 1
      n = self.counts[(task, feature)]
    if n == 1 or np.log10(n).is_integer():
      log.warning("%s: %d '%s' sequence(s) so far were longer than %d tokens and were "
                  "truncated; raise TASK_FEATURE_LENGTHS['%s'] to keep more.",
                  task, n, feature, length, feature)


TRUNCATIONS = _TruncationCounter()


def truncation_counts() -> Dict[str, int]:
  """{'task/feature': number of truncated sequences} since the process started."""
  return {f"{t}/{f}": n for (t, f), n in sorted(TRUNCATIONS.counts.items())}


def trim_and_count(dataset: tf.data.Dataset, sequence_length: Optional[Mapping[str, int]],
                   output_features, task_name: str = "") -> tf.data.Dataset:
  """Cuts 'inputs' / 'targets' to their length minus one (room for EOS), counting cuts."""
  if not sequence_length:
    return dataset

  def count(feature, length):
    def note(_):
      TRUNCATIONS.add(task_name, feature, length)
      return np.int32(0)
    return note

  def fn(ex):
    ex = dict(ex)
    for feature in ("inputs", "targets"):
      length = sequence_length.get(feature)
      if length is None or feature not in ex:
        continue
      room = length - 1 if output_features[feature].add_eos else length
      too_long = tf.size(ex[feature]) > room
      zero = tf.cond(  # 0 either way; the cut depends on it so the count always runs
          too_long,
          lambda f=feature, l=length: tf.py_function(count(f, l), [too_long], tf.int32),
          lambda: tf.constant(0, tf.int32))
      ex[feature] = ex[feature][:room + zero]
    return ex
  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


def references(output: Any, example: Optional[Mapping[str, Any]] = None,
               is_target: bool = False) -> Any:
  """seqio postprocess_fn: targets become every reference answer; predictions pass as is."""
  if is_target and example is not None and "answers" in example:
    return [a.decode("utf-8") if isinstance(a, bytes) else str(a) for a in example["answers"]]
  return output


def preprocessors(kind: str, task_name: str):
  """The seqio preprocessors for a task of `kind` ('summarization' or 'qa')."""
  fmt = {"summarization": format_summarization, "qa": format_qa}[kind]
  return [fmt, seqio.preprocessors.tokenize,
          functools.partial(trim_and_count, task_name=task_name),
          seqio.preprocessors.append_eos_after_trim]
