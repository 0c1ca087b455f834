"""SentencePiece vocabularies: the T5 vocabulary, or one trained on the built-in corpus.

The built-in vocabulary is trained on first use (a few seconds) and cached atomically under
`$DECAL_CACHE_DIR` (default `~/.cache/decal_jax`), keyed by its size and a fingerprint of
the corpus, so a Python version with different docs gets its own file.
`python tools/make_vocab.py` builds it ahead of time.
"""
import io
import os
import pathlib
import tempfile
from typing import Iterable, Optional

import seqio
import sentencepiece as spm

from decal_jax.data import corpus

T5_PUBLIC_VOCAB = "gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model"
BUILTIN_VOCAB_SIZE = 4000
EXTRA_IDS = 100


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("DECAL_CACHE_DIR", "~/.cache/decal_jax")).expanduser()


def train_sentencepiece(texts: Iterable[str], path: pathlib.Path, vocab_size: int) -> pathlib.Path:
  """Trains a unigram model with T5's special ids (pad 0, eos 1, unk 2, no bos) and writes
  it to `path` atomically (temp file + rename), so readers never see a partial model."""
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(list(texts)), model_writer=model, vocab_size=vocab_size,
      model_type="unigram", character_coverage=1.0, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2,
      max_sentence_length=100_000, hard_vocab_limit=False)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
  with os.fdopen(fd, "wb") as f:
    f.write(model.getvalue())
  os.chmod(tmp, 0o644)
  os.replace(tmp, path)
  return path


def builtin_vocabulary_path(vocab_size: int = BUILTIN_VOCAB_SIZE, build: bool = True) -> str:
  """Path of the cached built-in vocabulary, training it first if missing (and `build`)."""
  path = cache_dir() / f"builtin_spm_{vocab_size}_{corpus.corpus_fingerprint()}.model"
  if not path.exists() and build:
    train_sentencepiece(corpus.documents()["train"], path, vocab_size)
  return str(path)


class BuiltinVocabulary(seqio.SentencePieceVocabulary):
  """The built-in-corpus SentencePiece vocabulary, trained lazily on first use."""

  def __init__(self, vocab_size: int = BUILTIN_VOCAB_SIZE, extra_ids: int = EXTRA_IDS):
    self._builtin_size = vocab_size
    super().__init__(builtin_vocabulary_path(vocab_size, build=False), extra_ids=extra_ids)

  def _model_context(self):
    if not self._model and not os.path.exists(self._sentencepiece_model_file):
      builtin_vocabulary_path(self._builtin_size, build=True)
    return super()._model_context()


def builtin_vocabulary(vocab_size: int = BUILTIN_VOCAB_SIZE,
                       extra_ids: int = EXTRA_IDS) -> seqio.SentencePieceVocabulary:
  return BuiltinVocabulary(vocab_size, extra_ids)


def _t5_vocab_path(path: Optional[str]) -> str:
  return path or os.environ.get("DECAL_T5_VOCAB") or T5_PUBLIC_VOCAB


def _check_t5_vocab(path: str) -> None:
  if "://" not in path and not os.path.exists(path):
    raise FileNotFoundError(
        f"T5 SentencePiece vocabulary not found at {path!r}. Set DECAL_T5_VOCAB to a local "
        "copy (this repo's tests use ../shared/data/vocab/t5_spiece.model), or bind "
        "`vocabularies.t5_vocabulary.path` in gin.")


class T5Vocabulary(seqio.SentencePieceVocabulary):
  """The T5 vocabulary; a missing local file is reported clearly when first used."""

  def _model_context(self):
    if not self._model:
      _check_t5_vocab(self._sentencepiece_model_file)
    return super()._model_context()


def t5_vocabulary(path: Optional[str] = None, extra_ids: int = EXTRA_IDS,
                  check: bool = True) -> seqio.SentencePieceVocabulary:
  """The T5 SentencePiece vocabulary (32,000 pieces + sentinels).

  Path: the argument, else `$DECAL_T5_VOCAB`, else T5's public copy on GCS. With `check`,
  a missing local file raises now; otherwise when the vocabulary is first used.
  """
  path = _t5_vocab_path(path)
  if check:
    _check_t5_vocab(path)
  return T5Vocabulary(path, extra_ids=extra_ids)
