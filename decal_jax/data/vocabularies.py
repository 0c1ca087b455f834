"""SentencePiece vocabularies: the T5 vocabulary, or one trained on the built-in corpus.

The built-in vocabulary is trained on first use (under a second) and cached under
`$DECAL_CACHE_DIR` (default `~/.cache/decal_jax`) as
`builtin_spm_<vocab_size>_<recipe>_<corpus fingerprint>.model`, so a Python version whose
docs differ, or a changed training recipe, gets its own file. Training holds a file lock
(one process trains, the others wait and reuse) and writes atomically
(`fileio.write_bytes_atomic`), so readers never see a partial model.
`python -m decal_jax.tools.make_vocab` builds it ahead of time.

Recipes (`BUILTIN_RECIPES`): 'bytes' (the default) falls back to UTF-8 byte pieces, so no
input byte is ever unknown ('$', '£', 'é', 'ж', '中', emoji all round-trip); 'chars' is the
first recipe (characters of the corpus only, the rest unknown; its files keep their old
name `builtin_spm_<vocab_size>_<corpus fingerprint>.model`). A checkpoint trained with the
'chars' vocabulary (before byte fallback) is evaluated with it by setting
`DECAL_BUILTIN_VOCAB=chars` (read when a vocabulary is created, i.e. also by the built-in
tasks registered at import).

All vocabularies follow T5: pad 0, eos 1, unk 2, no bos, and `extra_ids` sentinels at the
top of the id range (`vocab_size - 1` is the first sentinel).
"""
import contextlib
import hashlib
import io
import logging
import os
import pathlib
from typing import Any, Callable, Dict, Iterable, Iterator, Optional

import gin
import seqio
import sentencepiece as spm
import tensorflow as tf
from google.protobuf import message as protobuf_message

from decal_jax import fileio
from decal_jax.data import corpus

T5_PUBLIC_VOCAB = "gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model"
BUILTIN_VOCAB_SIZE = 4000  # an upper bound: 256 byte pieces + Python 3.11 docs' pieces
EXTRA_IDS = 100
# SentencePiece trainer options that differ between the recipes of the built-in vocabulary.
BUILTIN_RECIPES = {"bytes": {"byte_fallback": True}, "chars": {"byte_fallback": False}}
DEFAULT_RECIPE = "bytes"

try:
  import fcntl  # POSIX
except ImportError:  # pragma: no cover  (Windows: atomic writes alone keep files whole)
  fcntl = None


def cache_dir() -> pathlib.Path:
  """`$DECAL_CACHE_DIR`, default `~/.cache/decal_jax`."""
  return pathlib.Path(os.environ.get("DECAL_CACHE_DIR", "~/.cache/decal_jax")).expanduser()


def train_sentencepiece(texts: Iterable[str], path: pathlib.Path, vocab_size: int,
                        byte_fallback: bool = True) -> pathlib.Path:
  """Trains a unigram model (pad 0, eos 1, unk 2, no bos) and writes it to `path`
  atomically. `vocab_size` is an upper bound: a small corpus may support fewer pieces.
  With `byte_fallback`, 256 of the pieces are UTF-8 bytes that spell any character the
  others do not cover, so nothing encodes to unk."""
  model = io.BytesIO()
  # Left unset when off, so a 'chars' model is byte for byte the one trained before the option.
  fallback = {"byte_fallback": True} if byte_fallback else {}
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(list(texts)), model_writer=model, vocab_size=vocab_size,
      model_type="unigram", character_coverage=1.0, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2,
      max_sentence_length=100_000, hard_vocab_limit=False,
      num_threads=16, **fallback)  # num_threads fixed: the model depends on it
  fileio.write_bytes_atomic(path, model.getvalue())
  return pathlib.Path(path)


class NotSentencePieceError(ValueError):
  """A vocabulary file SentencePiece cannot read (the message names the file)."""


class NamedSentencePieceVocabulary(seqio.SentencePieceVocabulary):
  """A SentencePiece vocabulary whose file, if it is not a SentencePiece model, is named in
  the error (seqio raises protobuf's DecodeError or a bare RuntimeError, without it)."""

  FIX = ("Give a binary SentencePiece model (e.g. T5's spiece.model, or one written by "
         "decal_jax/tools/make_vocab.py); a Hugging Face tokenizer.json goes to "
         "hf_vocabularies.HfTokenizerVocabulary instead")

  def _model_context(self):
    if self._model:
      return self._model
    try:
      return super()._model_context()
    except (protobuf_message.DecodeError, RuntimeError) as e:
      raise NotSentencePieceError(
          f"{self._sentencepiece_model_file} is not a SentencePiece model "
          f"({type(e).__name__}: {e}). {self.FIX}.") from None


@contextlib.contextmanager
def _exclusive_lock(path: pathlib.Path) -> Iterator[None]:
  """Holds an exclusive lock on `path` + '.lock' (no-op where fcntl is missing)."""
  with open(str(path) + ".lock", "a") as handle:
    if fcntl is not None:
      fcntl.flock(handle, fcntl.LOCK_EX)
    try:
      yield
    finally:
      if fcntl is not None:
        fcntl.flock(handle, fcntl.LOCK_UN)


def builtin_recipe(recipe: Optional[str] = None) -> str:
  """The recipe given, else `$DECAL_BUILTIN_VOCAB`, else DEFAULT_RECIPE (checked)."""
  recipe = recipe or os.environ.get("DECAL_BUILTIN_VOCAB") or DEFAULT_RECIPE
  if recipe not in BUILTIN_RECIPES:
    raise ValueError(f"Unknown built-in vocabulary recipe {recipe!r} (DECAL_BUILTIN_VOCAB); "
                     f"choose one of {sorted(BUILTIN_RECIPES)}.")
  return recipe


def builtin_vocabulary_path(vocab_size: int = BUILTIN_VOCAB_SIZE, build: bool = True,
                            recipe: Optional[str] = None) -> str:
  """Path of the cached built-in vocabulary of `recipe` (default: `builtin_recipe()`),
  training it first if missing (and `build`)."""
  recipe = builtin_recipe(recipe)
  tag = "" if recipe == "chars" else f"{recipe}_"  # 'chars' files predate the recipe tag
  path = cache_dir() / f"builtin_spm_{vocab_size}_{tag}{corpus.corpus_fingerprint()}.model"
  if build and not path.exists():
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      with _exclusive_lock(path):
        if not path.exists():  # another process may have built it while we waited
          logging.info("Training the built-in SentencePiece vocabulary -> %s", path)
          train_sentencepiece(corpus.documents()["train"], path, vocab_size,
                              **BUILTIN_RECIPES[recipe])
    except OSError as e:
      raise OSError(f"Cannot write the built-in vocabulary to {path} ({e}). Point "
                    "DECAL_CACHE_DIR at a writable directory.") from e
  return str(path)


class BuiltinVocabulary(NamedSentencePieceVocabulary):
  """The built-in-corpus SentencePiece vocabulary; trained on first use, not at creation."""

  def __init__(self, vocab_size: int = BUILTIN_VOCAB_SIZE, extra_ids: int = EXTRA_IDS,
               recipe: Optional[str] = None):
    self._builtin_size, self.recipe = vocab_size, builtin_recipe(recipe)
    super().__init__(builtin_vocabulary_path(vocab_size, build=False, recipe=self.recipe),
                     extra_ids=extra_ids)

  def _model_context(self):
    if not self._model and not os.path.exists(self._sentencepiece_model_file):
      builtin_vocabulary_path(self._builtin_size, build=True, recipe=self.recipe)
    return super()._model_context()


def builtin_vocabulary(vocab_size: int = BUILTIN_VOCAB_SIZE, extra_ids: int = EXTRA_IDS,
                       recipe: Optional[str] = None) -> seqio.SentencePieceVocabulary:
  """SentencePiece vocabulary of the built-in corpus (at most `vocab_size` pieces) plus
  `extra_ids` sentinels, trained with `recipe` (default `$DECAL_BUILTIN_VOCAB` or 'bytes').
  Creating it is cheap; the model is built on first use."""
  return BuiltinVocabulary(vocab_size, extra_ids, recipe)


def vocabulary_identity(vocabulary: seqio.Vocabulary) -> Dict[str, Any]:
  """What fixes the text each id stands for: {'class', 'vocab_size'} and, for a SentencePiece
  vocabulary (or a Hugging Face tokenizer.json), its file's basename and sha256 (as
  `sha256sum` gives it); for the built-in one, its recipe too. Two vocabularies with the same sha256 and size (or, for
  others, class and size) map ids to the same text, wherever their files lie."""
  if isinstance(vocabulary, DeferredVocabulary):
    vocabulary = vocabulary.target
  identity = {"class": type(vocabulary).__name__, "vocab_size": int(vocabulary.vocab_size)}
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    identity["file"] = os.path.basename(vocabulary.sentencepiece_model_file)
    identity["sha256"] = _model_file_sha256(vocabulary)
  if isinstance(vocabulary, BuiltinVocabulary):
    identity["recipe"] = vocabulary.recipe
  if hasattr(vocabulary, "file_identity"):  # hf_vocabularies.HfTokenizerVocabulary
    identity.update(vocabulary.file_identity())
  return identity


def _model_file_sha256(vocabulary: seqio.SentencePieceVocabulary) -> str:
  """sha256 of the model file, read after the vocabulary has loaded it (so the built-in one
  is built, and a missing or bad file named by the vocabulary's own error, first)."""
  if not vocabulary.sp_model:
    raise ValueError(f"{vocabulary.sentencepiece_model_file} holds an empty SentencePiece model.")
  with tf.io.gfile.GFile(vocabulary.sentencepiece_model_file, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _t5_vocab_path(path: Optional[str]) -> str:
  return path or os.environ.get("DECAL_T5_VOCAB") or T5_PUBLIC_VOCAB


def _check_t5_vocab(path: str) -> None:
  if "://" not in path and not os.path.exists(path):
    raise FileNotFoundError(
        f"T5 SentencePiece vocabulary not found at {path!r}. Set DECAL_T5_VOCAB to a local "
        "copy (from this repo: ../shared/data/vocab/t5_spiece.model), pass the path, or bind "
        "`vocabularies.t5_vocabulary.path` in gin; or use the built-in task "
        "'decal_builtin_span_corruption', whose vocabulary needs no download.")


class T5Vocabulary(NamedSentencePieceVocabulary):
  """The T5 vocabulary; a missing local file is reported clearly when first used."""

  FIX = ("Point DECAL_T5_VOCAB (or gin `vocabularies.t5_vocabulary.path`) at a binary "
         "SentencePiece model, e.g. T5's spiece.model or one written by decal_jax/tools/make_vocab.py")

  def _model_context(self):
    if not self._model:
      _check_t5_vocab(self._sentencepiece_model_file)
    return super()._model_context()


def t5_vocabulary(path: Optional[str] = None, extra_ids: int = EXTRA_IDS,
                  check: bool = True) -> seqio.SentencePieceVocabulary:
  """The T5 SentencePiece vocabulary (32,000 pieces + 100 sentinels = 32,100 ids).

  Path: the argument, else `$DECAL_T5_VOCAB`, else T5's public copy on GCS. With `check`,
  a missing local file raises now; otherwise when the vocabulary is first used.
  """
  path = _t5_vocab_path(path)
  if check:
    _check_t5_vocab(path)
  return T5Vocabulary(path, extra_ids=extra_ids)


@gin.configurable
def task_vocabulary(vocabulary: Optional[seqio.Vocabulary] = None) -> seqio.Vocabulary:
  """The vocabulary of the downstream tasks: the model's (models/t5_1_1.gin binds this to
  its VOCABULARY), else the T5 vocabulary."""
  return vocabulary if vocabulary is not None else t5_vocabulary(check=False)


class DeferredVocabulary(seqio.Vocabulary):
  """A vocabulary chosen when first used rather than when a task is registered.

  seqio tasks are registered on import, before gin has parsed the model's config; the
  downstream tasks hold this and so tokenize with whatever `task_vocabulary()` returns at
  that point (the model's VOCABULARY under our gin files).
  """

  def __init__(self, resolve: Callable[[], seqio.Vocabulary] = task_vocabulary):
    self._resolve = resolve
    super().__init__(extra_ids=0)

  @property
  def target(self) -> seqio.Vocabulary:
    return self._resolve()

  # The public seqio.Vocabulary API, forwarded.
  eos_id = property(lambda self: self.target.eos_id)
  unk_id = property(lambda self: self.target.unk_id)
  pad_id = property(lambda self: self.target.pad_id)
  bos_id = property(lambda self: self.target.bos_id)
  extra_ids = property(lambda self: self.target.extra_ids)
  vocab_size = property(lambda self: self.target.vocab_size)
  _base_vocab_size = property(lambda self: self.target._base_vocab_size)  # pylint: disable=protected-access

  def encode(self, s):
    return self.target.encode(s)

  def decode(self, ids):
    return self.target.decode(ids)

  def encode_tf(self, s):
    return self.target.encode_tf(s)

  def decode_tf(self, ids):
    return self.target.decode_tf(ids)

  _encode, _decode, _encode_tf, _decode_tf = encode, decode, encode_tf, decode_tf

  def __getattr__(self, name):  # anything else (e.g. sp_model, tokenizer)
    if name.startswith("__") or name == "_resolve":
      raise AttributeError(name)
    return getattr(self.target, name)

  def __eq__(self, other):
    other = other.target if isinstance(other, DeferredVocabulary) else other
    return self.target == other

  def __hash__(self):
    return id(self)

  def __str__(self):
    return f"DeferredVocabulary({self.target})"
