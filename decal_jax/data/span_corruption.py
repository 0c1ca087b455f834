"""Span corruption (T5's denoising objective), as our own seqio preprocessors.

A chunk of `L` tokens gets about `noise_density * L` noise tokens, grouped into spans of
mean length `mean_noise_span_length`. The encoder input keeps the clean tokens and replaces
each noise span by one sentinel; the target is the complement: every noise span preceded by
its sentinel. Sentinel j (0-based, in order of appearance) is id `vocab_size - 1 - j`.
Interleaving inputs and targets by sentinel gives back the original chunk exactly.
"""
from typing import Mapping, Tuple

import seqio
import tensorflow as tf

NOISE_DENSITY = 0.15
MEAN_NOISE_SPAN_LENGTH = 3.0


def span_counts(length: int, noise_density: float = NOISE_DENSITY,
                mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> Tuple[int, int]:
  """(noise tokens, noise spans) for a chunk of `length` tokens (at least 1 each, and at
  least one clean token)."""
  num_noise = int(round(length * noise_density))
  num_noise = min(max(num_noise, 1), length - 1)
  num_spans = max(int(round(num_noise / mean_noise_span_length)), 1)
  return num_noise, num_spans


def chunk_and_target_lengths(inputs_length: int, noise_density: float = NOISE_DENSITY,
                             mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH
                             ) -> Tuple[int, int]:
  """The longest raw chunk whose corrupted input (+ EOS) fits `inputs_length`, and the
  length of its target (+ EOS).

  input = clean tokens + one sentinel per span + EOS = L - noise + spans + 1;
  target = noise tokens + one sentinel per span + EOS = noise + spans + 1.
  """
  def corrupted_input(length):
    noise, spans = span_counts(length, noise_density, mean_noise_span_length)
    return length - noise + spans + 1

  if inputs_length < 3:
    raise ValueError(f"inputs_length must be >= 3 for span corruption, got {inputs_length}.")
  length = 2
  while corrupted_input(length + 1) <= inputs_length:
    length += 1
  noise, spans = span_counts(length, noise_density, mean_noise_span_length)
  return length, noise + spans + 1


def _random_partition(total: tf.Tensor, parts: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
  """Splits `total` into `parts` positive integers, uniformly over compositions: choose
  parts - 1 distinct cut points in [1, total - 1]. Returns `[parts]` int32."""
  candidates = tf.range(1, total)  # [total - 1]
  scores = tf.random.stateless_uniform(tf.shape(candidates), seed=seed)
  cuts = tf.sort(tf.gather(candidates, tf.argsort(scores)[:parts - 1]))  # [parts - 1]
  bounds = tf.concat([[0], cuts, [total]], axis=0)  # [parts + 1]
  return bounds[1:] - bounds[:-1]


def noise_mask(length: tf.Tensor, seeds: tf.Tensor, noise_density: float = NOISE_DENSITY,
               mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> tf.Tensor:
  """A bool `[length]` mask: clean run, noise span, clean run, noise span, ..."""
  length_f = tf.cast(length, tf.float32)
  num_noise = tf.cast(tf.round(length_f * noise_density), tf.int32)
  num_noise = tf.clip_by_value(num_noise, 1, length - 1)
  num_spans = tf.maximum(tf.cast(tf.round(tf.cast(num_noise, tf.float32) /
                                          mean_noise_span_length), tf.int32), 1)
  noise_lengths = _random_partition(num_noise, num_spans, seeds[0])  # [spans]
  clean_lengths = _random_partition(length - num_noise, num_spans, seeds[1])  # [spans]
  run_lengths = tf.reshape(tf.stack([clean_lengths, noise_lengths], axis=1), [-1])
  is_noise = tf.tile([False, True], [num_spans])  # [2 * spans]
  return tf.repeat(is_noise, run_lengths)  # [length]


def _span_sentinels(mask: tf.Tensor, vocab_size: int, dtype):
  """For a `[length]` mask: (first token of each masked run, the sentinel of the run each
  position is in — vocab_size - 1 for the first run, then counting down)."""
  prev = tf.concat([[False], mask[:-1]], axis=0)
  span_start = mask & ~prev
  span_number = tf.cumsum(tf.cast(span_start, tf.int32))  # 1-based index of the run
  return span_start, tf.cast(vocab_size, dtype) - tf.cast(span_number, dtype)


def _replace_spans(tokens: tf.Tensor, mask: tf.Tensor, vocab_size: int) -> tf.Tensor:
  """Replaces every run of `mask`ed tokens by its sentinel and drops the rest of the run.
  `[length]` -> `[kept]`."""
  span_start, sentinel = _span_sentinels(mask, vocab_size, tokens.dtype)
  replaced = tf.where(span_start, sentinel, tokens)
  keep = ~mask | span_start
  return tf.boolean_mask(replaced, keep)


def _targets_with_sentinels(tokens: tf.Tensor, mask: tf.Tensor, vocab_size: int) -> tf.Tensor:
  """Noise spans only, each preceded by the sentinel that replaced it in the input."""
  span_start, sentinel = _span_sentinels(mask, vocab_size, tokens.dtype)
  noise_tokens = tf.boolean_mask(tokens, mask)  # [noise]
  starts = tf.boolean_mask(span_start, mask)  # [noise] does this noise token open a span
  sentinels = tf.boolean_mask(sentinel, mask)  # [noise]
  # Interleave: before each span-opening noise token, its sentinel.
  pairs = tf.stack([sentinels, noise_tokens], axis=1)  # [noise, 2]
  keep = tf.stack([starts, tf.ones_like(starts)], axis=1)  # [noise, 2]
  return tf.boolean_mask(tf.reshape(pairs, [-1]), tf.reshape(keep, [-1]))


def corrupt(tokens: tf.Tensor, seeds: tf.Tensor, vocab_size: int,
            noise_density: float = NOISE_DENSITY,
            mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> Mapping[str, tf.Tensor]:
  """`[length]` tokens -> {'inputs': clean + sentinels, 'targets': sentinels + noise}.
  `seeds` is `[2, 2]` int32 (two stateless seeds)."""
  mask = noise_mask(tf.size(tokens), seeds, noise_density, mean_noise_span_length)
  return {"inputs": _replace_spans(tokens, mask, vocab_size),
          "targets": _targets_with_sentinels(tokens, mask, vocab_size)}


@seqio.map_over_dataset(num_seeds=2)
def _span_corruption_map(example, seeds, vocab_size, noise_density, mean_noise_span_length):
  return corrupt(example["targets"], seeds, vocab_size, noise_density, mean_noise_span_length)


def span_corruption(dataset: tf.data.Dataset, output_features: Mapping[str, seqio.Feature],
                    noise_density: float = NOISE_DENSITY,
                    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> tf.data.Dataset:
  """seqio preprocessor: tokenized 'targets' chunks -> span-corrupted inputs / targets."""
  vocab_size = output_features["targets"].vocabulary.vocab_size
  return _span_corruption_map(dataset, vocab_size=vocab_size, noise_density=noise_density,
                              mean_noise_span_length=mean_noise_span_length)


def concatenate_and_split(dataset: tf.data.Dataset, output_features, sequence_length,
                          noise_density: float = NOISE_DENSITY,
                          mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH
                          ) -> tf.data.Dataset:
  """seqio preprocessor: joins the tokenized documents into one stream and cuts it into
  chunks whose corrupted form fits `sequence_length['inputs']` (EOS included)."""
  del output_features
  chunk, _ = chunk_and_target_lengths(sequence_length["inputs"], noise_density,
                                      mean_noise_span_length)
  tokens = dataset.map(_targets_of).unbatch()  # one stream of token ids
  chunks = tokens.batch(chunk, drop_remainder=False)  # [chunk] each (the last may be short)
  return chunks.filter(_long_enough).map(_as_targets)


def _targets_of(example):
  return example["targets"]


def _long_enough(tokens):
  return tf.size(tokens) >= 2  # span corruption needs one clean and one noise token


def _as_targets(tokens):
  return {"targets": tokens}


def target_length(inputs_length: int) -> int:
  """The `targets` feature length that matches `inputs_length` for the default settings."""
  return chunk_and_target_lengths(inputs_length)[1]
