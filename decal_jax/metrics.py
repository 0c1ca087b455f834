"""Training metrics: averaging the model's summable aux values, and TensorBoard output."""
import math
import os
import time
from typing import Callable, Dict, Mapping

import jax
import tensorflow as tf


def summarize(sums: Mapping[str, float]) -> Dict[str, float]:
  """Per-token averages from summed aux values (`cross_ent_sum`, `z_loss_sum`,
  `correct_tokens`, `target_tokens`)."""
  tokens = max(sums["target_tokens"], 1.0)
  out = {"loss": (sums["cross_ent_sum"] + sums["z_loss_sum"]) / tokens,
         "cross_entropy": sums["cross_ent_sum"] / tokens,
         "z_loss": sums["z_loss_sum"] / tokens,
         "accuracy": sums["correct_tokens"] / tokens,
         "perplexity": math.exp(min(sums["cross_ent_sum"] / tokens, 50.0)),  # per subword
         "target_tokens": sums["target_tokens"]}
  return out


class Window:
  """Accumulates train-step aux values between two log points, and the throughput."""

  def __init__(self, summarize_fn: Callable[[Mapping[str, float]], Dict[str, float]] = None):
    self.summarize_fn = summarize_fn or summarize  # the model's, when it has its own aux
    self._reset()

  def _reset(self):
    self.sums: Dict[str, float] = {}
    self.pending = []
    self.tokens = 0
    self.steps = 0
    self.start = time.perf_counter()

  def add(self, aux, num_tokens: int) -> None:
    self.pending.append(aux)  # device values; fetched together at flush
    self.tokens += num_tokens
    self.steps += 1

  def flush(self) -> Dict[str, float]:
    sums: Dict[str, float] = {}
    grad_norm = 0.0
    for aux in jax.device_get(self.pending):
      for k, v in aux.items():
        if k not in ("loss", "grad_norm"):  # every other aux value is a sum over the batch
          sums[k] = sums.get(k, 0.0) + float(v)
      grad_norm += float(aux["grad_norm"])
    elapsed = max(time.perf_counter() - self.start, 1e-9)
    out = self.summarize_fn(sums)
    out.update(tokens_per_second=self.tokens / elapsed, steps_per_second=self.steps / elapsed,
               grad_norm=grad_norm / max(self.steps, 1))
    self._reset()
    return out


class MetricsWriter:
  """TensorBoard scalars under MODEL_DIR/<split> (train, eval), from process 0 only."""

  def __init__(self, model_dir: str):
    self.model_dir = model_dir
    self._writers = {}

  def write(self, split: str, step: int, values: Mapping[str, float]) -> None:
    if jax.process_index() != 0:
      return
    if split not in self._writers:
      self._writers[split] = tf.summary.create_file_writer(os.path.join(self.model_dir, split))
    with self._writers[split].as_default():
      for name, value in values.items():
        tf.summary.scalar(name, float(value), step=step)
    self._writers[split].flush()

  def close(self) -> None:
    for writer in self._writers.values():
      writer.close()
