"""Training metrics: averaging the model's summable aux values, and TensorBoard output
(through `clu.metric_writers`, as T5X; imported when a writer is made, so the averaging that
every model uses needs no clu)."""
import math
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, Mapping

import gin
import jax

from decal_jax import fileio


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
  """TensorBoard summaries under MODEL_DIR/<folder> (T5X's `train`, `training_eval/<task>`),
  written by `clu.metric_writers.SummaryWriter` from process 0 only.

  A remote MODEL_DIR (gs://...): the event files are written in a local temporary folder
  and uploaded through `fileio` after every flush (TensorFlow's summary writer reaches GCS
  only through its own client, which cannot be pointed at an emulator)."""

  def __init__(self, model_dir: str):
    self.model_dir = model_dir
    self._writers: Dict[str, Any] = {}  # folder -> clu.metric_writers.MetricWriter
    self._staging = (tempfile.mkdtemp(prefix="decal_jax-events-")
                     if fileio.is_url(model_dir) else None)

  def _local(self, folder: str) -> str:
    return os.path.join(self._staging or self.model_dir, folder)

  def _writer(self, folder: str):
    if folder not in self._writers:
      from clu import metric_writers
      self._writers[folder] = metric_writers.SummaryWriter(self._local(folder))
    return self._writers[folder]

  def _flush(self, folder: str) -> None:
    self._writers[folder].flush()
    if self._staging:
      for name in os.listdir(self._local(folder)):
        fileio.upload_file(os.path.join(self._local(folder), name),
                           fileio.join(self.model_dir, folder, name))

  def write(self, folder: str, step: int, values: Mapping[str, float]) -> None:
    if jax.process_index() != 0:
      return
    writer = self._writer(folder)
    writer.write_scalars(step, {name: float(value) for name, value in values.items()})
    self._flush(folder)

  def write_config(self, step: int, gin_config_text: str, hparams: Mapping[str, Any]) -> None:
    """The run's gin config as a text summary (T5X's `summarize_gin_config`) and its
    hyperparameters (TensorBoard's HPARAMS tab), under MODEL_DIR/train."""
    if jax.process_index() != 0:
      return
    writer = self._writer("train")
    if gin_config_text:
      writer.write_texts(step, {"config": gin.markdown(gin_config_text)})
    writer.write_hparams(dict(hparams))
    self._flush("train")

  def close(self) -> None:
    for folder, writer in self._writers.items():
      self._flush(folder)
      writer.close()
    if self._staging:
      shutil.rmtree(self._staging, ignore_errors=True)


def run_hparams(model, cfg, total_steps: int, seed: int) -> Dict[str, Any]:
  """What a run is, for TensorBoard's HPARAMS tab: task, batch, lengths, steps, seed, model."""
  lengths = {f"{name}_length": int(n) for name, n in cfg.task_feature_lengths.items()}
  return dict(lengths, task=cfg.mixture_or_task_name, batch_size=cfg.batch_size,
              total_steps=total_steps, seed=seed, model=type(model).__name__,
              compression_ratio=float(model.compression_ratio(cfg.task_feature_lengths)))
