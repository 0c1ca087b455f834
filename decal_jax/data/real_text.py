"""The real text of the shared data folder (about 1M words of C4, WikiText-2 and TinyStories)
as a seqio source and a SentencePiece vocabulary trained on its training split. The documents
and their train / validation split are `real_text_files`' (its docstring says how they are
read and split).

The vocabulary (`vocabulary()`: at most VOCAB_SIZE pieces with UTF-8 byte fallback, plus 100
sentinels, T5's pad 0 / eos 1 / unk 2) is trained on the training documents only, on first
use, and cached under `$DECAL_CACHE_DIR` by a fingerprint of that text.
"""
import hashlib
import os
from typing import Optional

import seqio
import tensorflow as tf

from decal_jax.data import seqio_vocabularies, vocabularies
# the documents and their split live in real_text_files (seqio-free: the GPU image has no TF)
from decal_jax.data.real_text_files import SPLITS, documents

VOCAB_SIZE = 4000


def _dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None) -> tf.data.Dataset:
  """{'text': scalar string} per document; training reads shuffled by `seed` (seqio repeats
  them, a new order each pass), evaluation reads in the fixed order."""
  if split not in SPLITS:
    raise ValueError(f"The real text has splits {SPLITS}, not {split!r}.")
  docs = documents()[split]
  ds = tf.data.Dataset.from_tensor_slices({"text": docs})
  return ds.shuffle(len(docs), seed=seed or 0) if shuffle_files else ds


def data_source() -> seqio.FunctionDataSource:
  """The real text as a seqio source: splits 'train' / 'validation', feature 'text'."""
  return seqio.FunctionDataSource(_dataset_fn, splits=SPLITS)


# ----------------------------------------------------------------------------- vocabulary
def vocabulary_path(vocab_size: int = VOCAB_SIZE, build: bool = True) -> str:
  """The cached vocabulary of the training documents (trained first if missing and `build`)."""
  train = documents()["train"]
  fingerprint = hashlib.sha256("\n".join(train).encode("utf-8")).hexdigest()[:12]
  path = vocabularies.cache_dir() / f"real_text_spm_{vocab_size}_bytes_{fingerprint}.model"
  if build and not path.exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    with vocabularies._exclusive_lock(path):
      if not path.exists():  # another process may have built it while we waited
        lines = [line for doc in train for line in doc.splitlines() if line.strip()]
        vocabularies.train_sentencepiece(lines, path, vocab_size)
  return str(path)


class RealTextVocabulary(seqio_vocabularies.NamedSentencePieceVocabulary):
  """The real text's SentencePiece vocabulary; its file is named at creation (the documents
  are read then) and trained on first use."""

  def __init__(self, vocab_size: int = VOCAB_SIZE, extra_ids: int = vocabularies.EXTRA_IDS):
    self._size = vocab_size
    super().__init__(vocabulary_path(vocab_size, build=False), extra_ids=extra_ids)

  def _model_context(self):
    if not self._model and not os.path.exists(self._sentencepiece_model_file):
      vocabulary_path(self._size, build=True)
    return super()._model_context()


def vocabulary(vocab_size: int = VOCAB_SIZE,
               extra_ids: int = vocabularies.EXTRA_IDS) -> seqio.SentencePieceVocabulary:
  """At most `vocab_size` pieces of the training documents plus `extra_ids` sentinels (the
  models' VOCABULARY in runs/gpthf_lm_real.gin; the task tokenizes with the model's)."""
  return RealTextVocabulary(vocab_size, extra_ids)
