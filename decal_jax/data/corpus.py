"""The built-in corpus: documentation text that ships with every Python install.

`pydoc_data.topics.topics` holds the Python language reference topics (about 465k
characters on Python 3.11). We split it into paragraph documents and assign each document
to `train` or `validation` by a stable hash of its text, so the splits never overlap and
do not depend on iteration order.
"""
import functools
import hashlib
import re
from typing import Dict, List, Optional

import seqio
import tensorflow as tf

SPLITS = ("train", "validation")
VALIDATION_PERCENT = 8
MIN_DOCUMENT_CHARS = 80


def _paragraphs(text: str) -> List[str]:
  blocks = re.split(r"\n\s*\n", text)
  return [" ".join(b.split()) for b in blocks if len(b.strip()) >= MIN_DOCUMENT_CHARS]


def _split_of(document: str) -> str:
  bucket = int(hashlib.sha256(document.encode("utf-8")).hexdigest(), 16) % 100
  return "validation" if bucket < VALIDATION_PERCENT else "train"


@functools.lru_cache(maxsize=None)
def documents() -> Dict[str, List[str]]:
  """{'train': [...], 'validation': [...]} paragraph documents, in a fixed order."""
  from pydoc_data import topics  # part of the standard library
  out = {split: [] for split in SPLITS}
  seen = set()
  for name in sorted(topics.topics):
    for doc in _paragraphs(topics.topics[name]):
      if doc not in seen:  # identical paragraphs recur across topics: keep one copy
        seen.add(doc)
        out[_split_of(doc)].append(doc)
  return out


def corpus_fingerprint() -> str:
  """A short hash of the training text (changes with the Python version's docs)."""
  digest = hashlib.sha256("\n".join(documents()["train"]).encode("utf-8"))
  return digest.hexdigest()[:12]


TRAIN_PASSES = 1000


def _dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None) -> tf.data.Dataset:
  """One pass over a split; or, for shuffled training reads, many passes, each in a new
  document order. The corpus is small, so this is what makes every pass see new chunk
  boundaries and new span-corruption noise (seeded per element downstream) instead of
  repeating the first pass's examples verbatim."""
  if split not in SPLITS:
    raise ValueError(f"The built-in corpus has splits {SPLITS}, not {split!r}.")
  ds = tf.data.Dataset.from_tensor_slices({"text": documents()[split]})
  if split != "train" or not shuffle_files:
    return ds
  return _reshuffled_passes(ds, len(documents()[split]), seed or 0)


def _reshuffled_passes(ds: tf.data.Dataset, n: int, seed: int) -> tf.data.Dataset:
  """TRAIN_PASSES passes over `ds`, pass i in the document order seeded by (seed, i)."""
  def one_pass(i):  # i: scalar int64 pass index
    return ds.shuffle(n, seed=seed * 100_003 + i, reshuffle_each_iteration=False)
  return tf.data.Dataset.range(TRAIN_PASSES).flat_map(one_pass)


def data_source() -> seqio.FunctionDataSource:
  return seqio.FunctionDataSource(
      _dataset_fn, splits=SPLITS,
      num_input_examples={s: len(documents()[s]) for s in SPLITS})
