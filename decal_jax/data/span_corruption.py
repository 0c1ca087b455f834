"""Span corruption (the T5 denoising objective DeCAL pretrains with), as seqio preprocessors.

A chunk of `L` tokens gets `N = round(L * noise_density)` noise tokens (at least one, and
at least one clean token left), grouped into `S = round(N / mean_noise_span_length)` spans
(at least one). The chunk is laid out as alternating runs, clean first:

    clean_1 noise_1 clean_2 noise_2 ... clean_S noise_S

where the S noise-run lengths are a uniformly random composition of N into S positive
parts, and likewise the clean runs of L - N. The encoder input keeps the clean runs and
replaces noise run j (0-based) by the sentinel `vocab_size - 1 - j`; the target is the
complement, `sentinel_j noise_j` for every j. Putting each target span back in place of
its sentinel gives the original chunk.

Task chain: tokenize -> `concatenate_and_split` (one token stream cut into chunks whose
corrupted form fills `inputs_length` exactly, EOS included) -> `span_corruption` ->
`seqio.preprocessors.append_eos_after_trim`.
"""
from typing import Mapping, Optional, Tuple

import seqio
import tensorflow as tf

NOISE_DENSITY = 0.15
MEAN_NOISE_SPAN_LENGTH = 3.0


# ------------------------------------------------------------------------ lengths (python)
def span_counts(length: int, noise_density: float = NOISE_DENSITY,
                mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> Tuple[int, int]:
  """(noise tokens N, noise spans S) for a chunk of `length` >= 2 tokens.

  Float64 arithmetic with round-half-to-even, exactly as `_span_counts_tf` computes it, so
  the lengths predicted here are the lengths the TF graph produces.
  """
  if length < 2:
    raise ValueError(f"Span corruption needs chunks of >= 2 tokens, got {length}.")
  num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
  num_spans = max(int(round(num_noise / mean_noise_span_length)), 1)
  return num_noise, num_spans


def corrupted_lengths(length: int, noise_density: float = NOISE_DENSITY,
                      mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH
                      ) -> Tuple[int, int]:
  """(inputs, targets) lengths, EOS included, after corrupting a `length`-token chunk.

  inputs  = clean tokens + one sentinel per span + EOS = L - N + S + 1
  targets = noise tokens + one sentinel per span + EOS = N + S + 1
  """
  noise, spans = span_counts(length, noise_density, mean_noise_span_length)
  return length - noise + spans + 1, noise + spans + 1


def chunk_and_target_lengths(inputs_length: int, noise_density: float = NOISE_DENSITY,
                             mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH
                             ) -> Tuple[int, int]:
  """(raw chunk length L, targets length) such that a corrupted chunk + EOS is exactly
  `inputs_length` tokens long and its targets + EOS exactly the returned length.

  Derivation: inputs(L) = L - N(L) + S(L) + 1 ~= L * (1 - d + d / mu) + 1. Going from L to
  L + 1 adds one token, and N grows by 0 or 1 while S grows by at most as much as N, so
  inputs(L + 1) - inputs(L) is 0 or 1: inputs(L) is non-decreasing in steps of one. The
  largest L with inputs(L) <= inputs_length therefore has inputs(L) == inputs_length. We
  start from the linear estimate and walk to that L.
  """
  def inputs_of(length):
    return corrupted_lengths(length, noise_density, mean_noise_span_length)[0]

  if inputs_length < inputs_of(2):
    raise ValueError(f"inputs_length must be >= {inputs_of(2)} for span corruption, got "
                     f"{inputs_length}.")
  keep_fraction = 1.0 - noise_density + noise_density / mean_noise_span_length
  length = max(2, int((inputs_length - 1) / keep_fraction))
  while length > 2 and inputs_of(length) > inputs_length:
    length -= 1
  while inputs_of(length + 1) <= inputs_length:
    length += 1
  return length, corrupted_lengths(length, noise_density, mean_noise_span_length)[1]


def target_length(inputs_length: int) -> int:
  """The `targets` feature length that matches `inputs_length` for the default settings."""
  return chunk_and_target_lengths(inputs_length)[1]


# ----------------------------------------------------------------------------- mask (TF)
def _span_counts_tf(length: tf.Tensor, noise_density: float,
                    mean_noise_span_length: float) -> Tuple[tf.Tensor, tf.Tensor]:
  """TF twin of `span_counts`: scalar int32 `length` -> scalar int32 (N, S)."""
  length_f = tf.cast(length, tf.float64)
  num_noise = tf.cast(tf.round(length_f * noise_density), tf.int32)
  num_noise = tf.minimum(tf.maximum(num_noise, 1), length - 1)
  num_spans = tf.cast(tf.round(tf.cast(num_noise, tf.float64) / mean_noise_span_length),
                      tf.int32)
  return num_noise, tf.maximum(num_spans, 1)


def _random_composition(total: tf.Tensor, parts: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
  """`total` split into `parts` positive integers, uniformly over all such compositions.

  A composition is fixed by its parts - 1 distinct cut points in {1, ..., total - 1}; we
  draw them as the first parts - 1 of a seeded random permutation. Returns `[parts]` int32.
  """
  cut_candidates = tf.range(1, total)  # [total - 1]
  keys = tf.random.stateless_uniform(tf.shape(cut_candidates), seed=seed)  # [total - 1]
  cuts = tf.gather(cut_candidates, tf.argsort(keys)[:parts - 1])  # [parts - 1]
  bounds = tf.concat([[0], tf.sort(cuts), [total]], axis=0)  # [parts + 1]
  return bounds[1:] - bounds[:-1]  # [parts]


def noise_mask(length: tf.Tensor, seeds: tf.Tensor, noise_density: float = NOISE_DENSITY,
               mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> tf.Tensor:
  """Bool `[length]` mask, True on noise: clean, noise, clean, noise, ... (clean first,
  noise last). `seeds`: `[2, 2]` int32, one stateless seed per composition."""
  length = tf.convert_to_tensor(length, tf.int32)
  num_noise, num_spans = _span_counts_tf(length, noise_density, mean_noise_span_length)
  noise_runs = _random_composition(num_noise, num_spans, seeds[0])  # [S]
  clean_runs = _random_composition(length - num_noise, num_spans, seeds[1])  # [S]
  runs = tf.reshape(tf.stack([clean_runs, noise_runs], axis=1), [-1])  # [2S]
  run_is_noise = tf.tile([False, True], [num_spans])  # [2S]
  return tf.repeat(run_is_noise, runs)  # [length]


# ------------------------------------------------------------------------ corruption (TF)
def _run_sentinels(mask: tf.Tensor, vocab_size: int, dtype: tf.DType
                   ) -> Tuple[tf.Tensor, tf.Tensor]:
  """For a bool `[L]` mask: (`[L]` bool, True on the first token of each noise run;
  `[L]` the sentinel of the latest run started at or before each position, i.e.
  vocab_size - 1 for the first run, vocab_size - 2 for the second, ...)."""
  previous = tf.concat([[False], mask[:-1]], axis=0)  # [L]
  run_start = mask & ~previous  # [L]
  runs_so_far = tf.cumsum(tf.cast(run_start, tf.int32))  # [L], 1-based run number
  return run_start, tf.cast(vocab_size - runs_so_far, dtype)


def corrupt(tokens: tf.Tensor, seeds: tf.Tensor, vocab_size: int,
            noise_density: float = NOISE_DENSITY,
            mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
            max_sentinels: Optional[int] = None) -> Mapping[str, tf.Tensor]:
  """Span-corrupts one chunk.

  Args:
    tokens: `[L]` int token ids, L >= 2, all below the sentinel range.
    seeds: `[2, 2]` int32 stateless seeds.
    vocab_size: sentinels are vocab_size - 1, vocab_size - 2, ...
    max_sentinels: if given, fail when a chunk needs more spans than this (the
      vocabulary's extra ids) instead of silently using ordinary tokens as sentinels.

  Returns:
    {'inputs': `[L - N + S]` clean tokens with one sentinel per span,
     'targets': `[N + S]` each span preceded by its sentinel}.
  """
  mask = noise_mask(tf.size(tokens), seeds, noise_density, mean_noise_span_length)  # [L]
  run_start, sentinel = _run_sentinels(mask, vocab_size, tokens.dtype)  # [L], [L]
  checks = []
  if max_sentinels is not None:
    checks.append(tf.debugging.assert_less_equal(
        tf.reduce_sum(tf.cast(run_start, tf.int32)), max_sentinels,
        message="span corruption needs more sentinels than the vocabulary's extra ids"))
  with tf.control_dependencies(checks):
    # Inputs: a noise run's first token becomes its sentinel, the rest of the run goes.
    with_sentinels = tf.where(run_start, sentinel, tokens)  # [L]
    inputs = tf.boolean_mask(with_sentinels, ~mask | run_start)  # [L - N + S]
    # Targets: each noise token, preceded by a sentinel where it opens a run.
    pairs = tf.stack([sentinel, tokens], axis=1)  # [L, 2]: (sentinel, token)
    keep = tf.stack([run_start, mask], axis=1)  # [L, 2]
    targets = tf.boolean_mask(tf.reshape(pairs, [-1]), tf.reshape(keep, [-1]))  # [N + S]
  return {"inputs": inputs, "targets": targets}


# ---------------------------------------------------------------------- seqio preprocessors
@seqio.map_over_dataset(num_seeds=2)
def _corrupt_example(example, seeds, vocab_size, noise_density, mean_noise_span_length,
                     max_sentinels):
  return corrupt(example["targets"], seeds, vocab_size, noise_density,
                 mean_noise_span_length, max_sentinels)


def span_corruption(dataset: tf.data.Dataset, output_features: Mapping[str, seqio.Feature],
                    noise_density: float = NOISE_DENSITY,
                    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH
                    ) -> tf.data.Dataset:
  """seqio preprocessor: {'targets': `[L]` chunk} -> {'inputs', 'targets'} (no EOS yet).

  Noise is drawn from seqio's per-preprocessor seeds, so it is deterministic given the
  seed passed to `seqio.get_dataset` / `Task.get_dataset`.
  """
  vocabulary = output_features["targets"].vocabulary
  return _corrupt_example(dataset, vocab_size=vocabulary.vocab_size,
                          noise_density=noise_density,
                          mean_noise_span_length=mean_noise_span_length,
                          max_sentinels=vocabulary.extra_ids or None)


def concatenate_and_split(dataset: tf.data.Dataset, output_features: Mapping[str, seqio.Feature],
                          sequence_length: Mapping[str, int],
                          noise_density: float = NOISE_DENSITY,
                          mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH
                          ) -> tf.data.Dataset:
  """seqio preprocessor: tokenized {'targets': `[doc_len]`} documents -> one token stream
  cut into {'targets': `[L]`} chunks, L from `chunk_and_target_lengths(inputs_length)`
  (the final chunk may be shorter; chunks under 2 tokens are dropped)."""
  chunk, _ = chunk_and_target_lengths(sequence_length["inputs"], noise_density,
                                      mean_noise_span_length)
  _check_enough_sentinels(chunk, output_features, noise_density, mean_noise_span_length)
  stream = dataset.map(_targets_of).unbatch()  # scalar token ids, documents back to back
  chunks = stream.batch(chunk, drop_remainder=False)  # [L] each
  return chunks.filter(_long_enough).map(_as_targets)


def _check_enough_sentinels(chunk: int, output_features, noise_density: float,
                            mean_noise_span_length: float) -> None:
  extra_ids = output_features["targets"].vocabulary.extra_ids
  _, spans = span_counts(chunk, noise_density, mean_noise_span_length)
  if extra_ids and spans > extra_ids:
    raise ValueError(
        f"Chunks of {chunk} tokens get {spans} noise spans, but the vocabulary has only "
        f"{extra_ids} sentinel (extra) ids. Use a shorter 'inputs' length, a longer "
        "mean_noise_span_length, or a vocabulary with more extra_ids.")


def _targets_of(example):
  return example["targets"]


def _long_enough(tokens):
  return tf.size(tokens) >= 2  # one clean and one noise token at least


def _as_targets(tokens):
  return {"targets": tokens}
