"""What every model wrapper answers (T5X's `BaseModel`), and the token loss two kinds share.

The trainer, evaluation and the tools ask a model only through these methods, never by
probing it for attributes. A wrapper owns a network module (`self.module`, with a frozen
`config`) and says:

  FEATURE_CONVERTER_CLS          called: task features -> model features (seqio; `SeqioConverter`
                                 names one of seqio's without importing it)
  DECODER_ONLY                   the task gives only 'targets' (nothing to compress)
  PREDICTS_TEXT                  `predict_batch` decodes text (evaluation scores it)
  EXAMPLE_FEATURES               which features of a decoded example the trainer prints
  required_lengths()             task features whose lengths must be positive
  vocab_size                     ids the network accepts
  input_shapes(lengths)          model-feature shapes (batch 1) for `get_initial_variables`
  get_initial_variables(rng, shapes)  variables: `params`, `params_axes`
  check_batch(numpy batch)       host-side input checks before a train step
  loss_fn / eval_fn              (loss, summable aux)
  summarize(sums) / num_tokens(batch)  metrics from summed aux; tokens a batch holds
  predict_batch(params, batch)   decoded tokens `[batch, length]`
  compression_ratio(lengths)     input tokens per kept vector (1: no compression)
"""
import abc
import importlib
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax import losses, metrics

if TYPE_CHECKING:
  import seqio

Array = jax.Array
Batch = Mapping[str, Array]
Shapes = Dict[str, Tuple[int, ...]]


class SeqioConverter:
  """A FEATURE_CONVERTER_CLS naming a seqio feature converter class (`name` in `module`:
  seqio's own, or one of ours built on it), imported when called. T5X types the attribute
  `Callable[..., seqio.FeatureConverter]` and only calls it (as do `pipeline` and
  `inference_eval`: `model.FEATURE_CONVERTER_CLS(pack=...)`); the model itself never does,
  so it imports (and `bench_train` / `bench_retrieval` time it) without seqio."""

  def __init__(self, name: str, module: str = "seqio"):
    self.name, self.module = name, module

  def __call__(self, *args, **kwargs) -> "seqio.FeatureConverter":
    return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)

  def __repr__(self) -> str:
    return f"SeqioConverter({self.name!r}, {self.module!r})"


class BaseModel(abc.ABC):
  """The protocol; subclasses implement the abstract methods and override the defaults
  that do not fit them."""

  FEATURE_CONVERTER_CLS: Callable[..., "seqio.FeatureConverter"]
  DECODER_ONLY = False
  PREDICTS_TEXT = True
  # (name printed, model feature) of the example the trainer decodes after training.
  EXAMPLE_FEATURES: Tuple[Tuple[str, str], ...] = (("inputs", "encoder_input_tokens"),
                                                   ("targets", "decoder_target_tokens"))

  def __init__(self, module, input_vocabulary: Optional["seqio.Vocabulary"],
               output_vocabulary: Optional["seqio.Vocabulary"]):
    self.module = module
    self.input_vocabulary = input_vocabulary
    self.output_vocabulary = output_vocabulary

  # ------------------------------------------------------------------------- features
  def required_lengths(self) -> Tuple[str, ...]:
    """Task features that TASK_FEATURE_LENGTHS must give a positive length."""
    return ("targets",) if self.DECODER_ONLY else ("inputs", "targets")

  @property
  def vocab_size(self) -> int:
    """Ids the network accepts (a task's vocabulary must fit in them)."""
    return self.module.config.vocab_size

  @abc.abstractmethod
  def input_shapes(self, task_feature_lengths: Mapping[str, int]) -> Shapes:
    """Model-feature shapes (batch 1) for `get_initial_variables`."""

  @abc.abstractmethod
  def get_initial_variables(self, rng: Array, input_shapes: Mapping[str, Tuple[int, ...]],
                            input_types: Optional[Mapping[str, Any]] = None):
    """Variables (`params`, `params_axes`) from dummy inputs of the given shapes."""

  def check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
    """Host-side checks of a numpy batch, before a train step changes anything."""
    del batch

  # ------------------------------------------------------------------------- loss
  @abc.abstractmethod
  def loss_fn(self, params, batch: Batch, dropout_rng: Optional[Array]):
    """(optimised loss, aux: scalars that sum over batches)."""

  def eval_fn(self, params, batch: Batch):
    return self.loss_fn(params, batch, dropout_rng=None)

  def summarize(self, sums: Mapping[str, float]) -> Dict[str, float]:
    """Metrics from aux values summed over batches: per-token loss, accuracy, perplexity."""
    return metrics.summarize(sums)

  def num_tokens(self, batch: Mapping[str, np.ndarray]) -> int:
    """Real (non-padding) input and target tokens of a batch, for tokens / second."""
    return int(np.sum(batch.get("encoder_input_tokens", 0) > 0) +
               np.sum(batch["decoder_target_tokens"] > 0))

  # ------------------------------------------------------------------------- predict
  def predict_batch(self, params, batch: Batch, rng: Optional[Array] = None,
                    **kwargs) -> Array:
    """Decoded tokens `[batch, length]`; a model with PREDICTS_TEXT = False has none."""
    raise NotImplementedError(f"{type(self).__name__} does not decode text "
                              "(PREDICTS_TEXT is False).")

  def compression_ratio(self, task_feature_lengths: Mapping[str, int]) -> float:
    """Input tokens per vector the network keeps: its config's `compression_ratio` (every
    network config declares one; 1 for those that do not compress)."""
    del task_feature_lengths
    return int(self.module.config.compression_ratio)


class TokenModel(BaseModel):
  """Loss / eval / score over `decoder_target_tokens`, shared by the encoder-decoder and
  decoder-only kinds; the subclass provides `_compute_logits(params, batch, dropout_rng)`."""

  def __init__(self, module, input_vocabulary, output_vocabulary, z_loss, label_smoothing,
               loss_normalizing_factor, decode_fn):
    super().__init__(module, input_vocabulary, output_vocabulary)
    self.z_loss = z_loss
    self.label_smoothing = label_smoothing
    self.loss_normalizing_factor = loss_normalizing_factor
    self._decode_fn = decode_fn

  @abc.abstractmethod
  def _compute_logits(self, params, batch: Batch,
                      dropout_rng: Optional[Array] = None) -> Array:
    """Teacher-forced logits `[batch, t, vocab]`."""

  def loss_fn(self, params, batch: Batch, dropout_rng: Optional[Array]):
    """(optimised loss, aux sums) — see docs/CONTRACTS.md for the aux keys."""
    logits = self._compute_logits(params, batch, dropout_rng)  # [batch, t, vocab]
    targets = batch["decoder_target_tokens"]
    weights = batch.get("decoder_loss_weights")
    if weights is None:
      weights = (targets > 0).astype(jnp.float32)
    loss, z_loss, weight_sum = losses.compute_weighted_cross_entropy(
        logits, targets, weights, self.label_smoothing, self.z_loss,
        self.loss_normalizing_factor)
    correct, _ = losses.compute_weighted_accuracy(logits, targets, weights)
    if self.loss_normalizing_factor is None:  # T5X default: mean over target tokens
      loss, z_loss = loss / jnp.maximum(weight_sum, 1.0), z_loss / jnp.maximum(weight_sum, 1.0)
    scale = weight_sum if self.loss_normalizing_factor is None else self.loss_normalizing_factor
    aux = {"cross_ent_sum": (loss - z_loss) * scale, "z_loss_sum": z_loss * scale,
           "correct_tokens": correct, "target_tokens": weight_sum}
    return loss, aux

  def score_batch(self, params, batch: Batch) -> Array:
    """Log-likelihood of each target sequence, `[batch]`."""
    logits = self._compute_logits(params, batch)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    targets = batch["decoder_target_tokens"]
    token_lp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    weights = batch.get("decoder_loss_weights", (targets > 0).astype(jnp.float32))
    return jnp.sum(token_lp * weights, axis=-1)
