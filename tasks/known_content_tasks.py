"""Autoencoding tasks whose information content is known exactly: how much of it does a
compressed encoding keep?

Each example is `n` symbols drawn from an alphabet of `k`, written as the words `s00 s01 ...`
of `SymbolVocabulary` (one id per symbol, MAX_ALPHABET symbols + pad / EOS / unknown), so an
example is exactly n tokens (+ EOS) and the target is the input itself. The small vocabulary
keeps the models' output layer at 128 rows, so that runs converge on a CPU.

| name | content | bits per example |
|---|---|---|
| decal_known_uniform_k{k}_n{n} | n symbols, each uniform over k, independent | n log2 k |
| decal_known_repeat_k{k}_n{n} | ceil(n / 2) uniform symbols, then the start again (planted redundancy: the second half is predictable from the first) | ceil(n / 2) log2 k |

Registered for k in KNOWN_ALPHABETS and n in KNOWN_LENGTHS; `register_known_task` makes any
other. Examples are a pure function of (split, index): validation and test never share a
seed with train, and every run sees the same held-out rows. Evaluation reports
`exact` (the whole sequence rebuilt, %) and `symbol_accuracy` (symbols right at their
position, %), beside BLEU. A model reads them with VOCABULARY = `symbol_vocabulary()` and
vocab_size 128 (gin/experiments/known/); bind TASK_FEATURE_LENGTHS = {'inputs': n + 1,
'targets': n + 1}.
"""
import functools
import hashlib
import math
from typing import Dict, List, Sequence

import seqio
import tensorflow as tf

from decal_jax import text_metrics

MAX_ALPHABET = 64
KNOWN_ALPHABETS = (4, 16, 64)
KNOWN_LENGTHS = (7, 15, 31, 63, 127)
KINDS = ("uniform", "repeat")
SPLIT_SEEDS = {"train": 1, "validation": 2, "test": 3}
SPLIT_SIZES = {"train": 10_000_000, "validation": 2_048, "test": 2_048}
SPECIAL = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2: seqio's pad and EOS, then unknown


def symbol(i: int) -> str:
  return f"s{i:02d}"


class SymbolVocabulary(seqio.Vocabulary):
  """Whitespace-separated symbols `s00` .. `s63` as ids 3 .. 66 (0 pad, 1 EOS, 2 unknown)."""

  def __init__(self, alphabet: int = MAX_ALPHABET):
    self.words = SPECIAL + tuple(symbol(i) for i in range(alphabet))
    self._ids = {w: i for i, w in enumerate(self.words)}
    super().__init__(extra_ids=0)

  @property
  def eos_id(self) -> int:
    return 1

  @property
  def unk_id(self) -> int:
    return 2

  @property
  def _base_vocab_size(self) -> int:
    return len(self.words)

  def file_identity(self) -> Dict[str, str]:  # what vocabulary.json records
    return {"symbols_sha256": hashlib.sha256(" ".join(self.words).encode()).hexdigest()}

  def _encode(self, s: str) -> List[int]:
    return [self._ids.get(w, self.unk_id) for w in s.split()]

  def _decode(self, ids: Sequence[int]) -> str:
    return " ".join(self.words[i] for i in ids if 3 <= i < len(self.words))

  def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
    words = tf.strings.split(s)  # [n]: one example's text
    known = tf.strings.regex_full_match(words, r"s[0-9][0-9]")
    digits = tf.strings.to_number(tf.where(known, tf.strings.substr(words, 1, 2), "0"),
                                  out_type=tf.int32)
    ok = tf.logical_and(known, digits < len(self.words) - len(SPECIAL))
    return tf.where(ok, digits + len(SPECIAL), self.unk_id)

  def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
    words = tf.gather(tf.constant(self.words), ids)
    kept = tf.where(ids >= 3, words, "")
    return tf.strings.strip(tf.strings.regex_replace(
        tf.strings.reduce_join(kept, axis=-1, separator=" "), " +", " "))

  def __eq__(self, other) -> bool:
    return isinstance(other, SymbolVocabulary) and other.words == self.words


@functools.lru_cache(maxsize=None)
def symbol_vocabulary() -> SymbolVocabulary:
  """The known-content tasks' vocabulary (one instance, so seqio's caches see one)."""
  return SymbolVocabulary()


def task_name(kind: str, alphabet: int, length: int) -> str:
  return f"decal_known_{kind}_k{alphabet}_n{length}"


def information_bits(kind: str, alphabet: int, length: int) -> float:
  """Bits of information in one example (its entropy, exactly)."""
  free = length if kind == "uniform" else math.ceil(length / 2)
  return free * math.log2(alphabet)


def symbol_ids(kind: str, alphabet: int, length: int, split_seed: int,
               index: tf.Tensor) -> tf.Tensor:
  """[length] int32 symbols of example `index` (a pure function of seed and index)."""
  free = length if kind == "uniform" else math.ceil(length / 2)
  seed = tf.stack([tf.constant(split_seed, tf.int64), index])
  drawn = tf.random.stateless_uniform([free], seed, minval=0, maxval=alphabet,
                                      dtype=tf.int32)  # [free]
  if kind == "repeat":
    drawn = tf.concat([drawn, drawn[:length - free]], axis=0)  # [length]
  return drawn


def dataset_fn(kind: str, alphabet: int, length: int, split: str, shuffle_files: bool,
               seed=None) -> tf.data.Dataset:
  del shuffle_files, seed  # every example is a function of its index
  words = tf.constant([symbol(i) for i in range(alphabet)])
  split_seed = SPLIT_SEEDS[split]

  def example(index):
    text = tf.strings.reduce_join(
        tf.gather(words, symbol_ids(kind, alphabet, length, split_seed, index)), separator=" ")
    return {"text": text}

  return tf.data.Dataset.range(SPLIT_SIZES[split]).map(example)


def reconstruction(targets: Sequence[str], predictions: Sequence[str]) -> Dict[str, float]:
  """{'exact': % of sequences rebuilt whole, 'symbol_accuracy': % of symbols at their
  position} (a prediction shorter than its target misses the rest; extra symbols are not
  counted)."""
  if len(targets) != len(predictions):
    raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions.")
  exact, hits, total = 0, 0, 0
  for target, prediction in zip(targets, predictions):
    ref, hyp = str(target).split(), str(prediction).split()
    exact += ref == hyp
    hits += sum(r == h for r, h in zip(ref, hyp))
    total += len(ref)
  return {"exact": 100.0 * exact / len(targets), "symbol_accuracy": 100.0 * hits / total}


def register_known_task(kind: str, alphabet: int, length: int) -> seqio.Task:
  if kind not in KINDS:
    raise ValueError(f"Unknown known-content kind {kind!r}; choose one of {KINDS}.")
  if not 2 <= alphabet <= MAX_ALPHABET:
    raise ValueError(f"An alphabet of {alphabet} symbols: choose k from 2 to {MAX_ALPHABET}.")
  name = task_name(kind, alphabet, length)
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  features = {k: seqio.Feature(symbol_vocabulary(), add_eos=True, required=True)
              for k in ("inputs", "targets")}
  source = seqio.FunctionDataSource(
      functools.partial(dataset_fn, kind, alphabet, length), splits=list(SPLIT_SEEDS),
      num_input_examples=dict(SPLIT_SIZES))
  return seqio.TaskRegistry.add(
      name, source=source, output_features=features,
      metric_fns=[reconstruction, text_metrics.bleu],
      preprocessors=[
          functools.partial(seqio.preprocessors.rekey,
                            key_map={"inputs": "text", "targets": "text"}),
          seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim])


for _kind in KINDS:
  for _k in KNOWN_ALPHABETS:
    for _n in KNOWN_LENGTHS:
      register_known_task(_kind, _k, _n)
