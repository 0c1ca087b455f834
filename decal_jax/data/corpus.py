"""The built-in corpus: documentation text that ships with every Python install.

`pydoc_data.topics.topics` maps 79 topic names to the Python language reference text (about
465k characters on Python 3.11; other versions differ a little). We cut it into paragraph
documents (blank-line separated blocks, whitespace collapsed, blocks under
`MIN_DOCUMENT_CHARS` dropped, repeats kept once) and send each document to `train` or
`validation` by a stable hash of its own text: the splits never overlap and do not depend
on iteration order or on the Python process (`hash()` salting plays no part).

The text itself (`documents`, `titled_documents`, `corpus_fingerprint`) needs neither seqio
nor TensorFlow, so the built-in vocabulary and the benchmarks' real-text prompts work on a
GPU image without them; the seqio source (`data_source`, `StreamingSource`) imports them
when used.
"""
import functools
import hashlib
import re
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

if TYPE_CHECKING:
  import seqio
  import tensorflow as tf

SPLITS = ("train", "validation")
VALIDATION_PERCENT = 8
MIN_DOCUMENT_CHARS = 80
TRAIN_PASSES = 1000  # training reads: this many passes, each in a new document order


def _paragraphs(text: str) -> List[str]:
  """Blank-line separated blocks of `text`, whitespace collapsed, tiny blocks dropped."""
  blocks = re.split(r"\n\s*\n", text)
  return [" ".join(b.split()) for b in blocks if len(b.strip()) >= MIN_DOCUMENT_CHARS]


def split_of(document: str, validation_percent: int = VALIDATION_PERCENT) -> str:
  """'validation' for about `validation_percent` % of documents (the SHA-256 of the text in
  the first buckets of 100), else 'train': stable, whatever order documents are read in."""
  bucket = int(hashlib.sha256(document.encode("utf-8")).hexdigest(), 16) % 100
  return "validation" if bucket < validation_percent else "train"


_split_of = split_of  # older name


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
        out[split_of(doc)].append(doc)
  return out


@functools.lru_cache(maxsize=None)
def titled_documents() -> Dict[str, List[Dict[str, str]]]:
  """The same paragraphs and splits as `documents()`, each with the title of its reference
  section (the topic's first line) and the topic name: {'text', 'title', 'topic'}."""
  from pydoc_data import topics
  wanted = {split: set(docs) for split, docs in documents().items()}
  out = {split: [] for split in SPLITS}
  seen = set()
  for name in sorted(topics.topics):
    title = topics.topics[name].strip().splitlines()[0].strip()
    for doc in _paragraphs(topics.topics[name]):
      if doc not in seen:
        seen.add(doc)
        split = split_of(doc)
        assert doc in wanted[split]
        out[split].append({"text": doc, "title": title, "topic": name})
  return out


def corpus_fingerprint() -> str:
  """12 hex digits of SHA-256 over the training text (changes with the Python docs)."""
  digest = hashlib.sha256("\n".join(documents()["train"]).encode("utf-8"))
  return digest.hexdigest()[:12]


def _dataset_fn(split: str, shuffle_files: bool,
                seed: Optional[int] = None) -> "tf.data.Dataset":
  """{'text': scalar string} per document.

  Evaluation reads (or `shuffle_files=False`) give one pass in the fixed order. Shuffled
  training reads give TRAIN_PASSES passes, each in its own seeded order: the corpus is
  small, and a new order means new chunk boundaries and new span-corruption noise (seeded
  per element downstream) on every pass, instead of seqio's `repeat()` replaying the first
  pass's examples verbatim.
  """
  import tensorflow as tf
  if split not in SPLITS:
    raise ValueError(f"The built-in corpus has splits {SPLITS}, not {split!r}.")
  docs = documents()[split]
  ds = tf.data.Dataset.from_tensor_slices({"text": docs})
  if split != "train" or not shuffle_files:
    return ds
  return reshuffled_passes(ds, len(docs), seed or 0)


def reshuffled_passes(ds: "tf.data.Dataset", n: int, seed: int,
                      passes: int = TRAIN_PASSES) -> "tf.data.Dataset":
  """`passes` passes over the `n` elements of `ds`, pass i ordered by seed (seed, i)."""
  import tensorflow as tf
  def one_pass(i):  # i: scalar int64 pass index
    return ds.shuffle(n, seed=seed * 100_003 + i, reshuffle_each_iteration=False)
  return tf.data.Dataset.range(passes).flat_map(one_pass)


@functools.lru_cache(maxsize=None)
def _streaming_source_class() -> type:
  """`StreamingSource`, defined on first use (its base class is seqio's)."""
  import seqio

  class StreamingSource(seqio.FunctionDataSource):
    """FunctionDataSource whose shuffled training stream is not cached in memory.

    seqio caches any source with fewer than ~10k input examples in memory; a training
    stream of reshuffled passes would only grow memory. Other splits count `count(split)`
    examples.
    """

    def __init__(self, dataset_fn, splits, count: Callable[[str], int]):
      super().__init__(dataset_fn, splits=splits)
      self._count = count

    def num_input_examples(self, split: str) -> Optional[int]:
      return None if split == "train" else self._count(split)

  return StreamingSource


def __getattr__(name: str):
  if name == "StreamingSource":
    return _streaming_source_class()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def data_source() -> "seqio.FunctionDataSource":
  """The built-in corpus as a seqio source: splits 'train' / 'validation', feature 'text'."""
  return _streaming_source_class()(_dataset_fn, SPLITS, lambda split: len(documents()[split]))
