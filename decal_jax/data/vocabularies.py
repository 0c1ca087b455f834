"""SentencePiece vocabularies: the T5 vocabulary, or one trained on the built-in corpus.

The built-in vocabulary is trained on first use (under a second) and cached under
`$DECAL_CACHE_DIR` (default `~/.cache/decal_jax`) as
`builtin_spm_<vocab_size>_<recipe>_<corpus fingerprint>.model`, so a Python version whose
docs differ, or a changed training recipe, gets its own file. Training holds a file lock
(one process trains, the others wait and reuse) and writes atomically
(`fileio.write_bytes_atomic`), so readers never see a partial model.
`python -m decal_jax.commands.make_vocab` builds it ahead of time.

Recipes (`BUILTIN_RECIPES`): 'bytes' (the default) falls back to UTF-8 byte pieces, so no
input byte is ever unknown ('$', '£', 'é', 'ж', '中', emoji all round-trip); 'chars' is the
first recipe (characters of the corpus only, the rest unknown; its files keep their old
name `builtin_spm_<vocab_size>_<corpus fingerprint>.model`). A checkpoint trained with the
'chars' vocabulary (before byte fallback) is evaluated with it by setting
`DECAL_BUILTIN_VOCAB=chars` (read when a vocabulary is created, i.e. also by the built-in
tasks registered at import).

All vocabularies follow T5: pad 0, eos 1, unk 2, no bos, and `extra_ids` sentinels at the
top of the id range (`vocab_size - 1` is the first sentinel).

The vocabulary classes are seqio's (`seqio_vocabularies.py`: NamedSentencePieceVocabulary,
BuiltinVocabulary, T5Vocabulary, DeferredVocabulary, vocabulary_identity; name them from
there), and so is the built-in corpus; this module imports them when a vocabulary is made
(the imports go one way: seqio_vocabularies imports nothing from here). Parsing a model's
gin file (which imports this module) thus needs neither seqio nor TensorFlow:
`bench_train` builds a model with `VOCABULARY = None` on a GPU image that has neither
(docs/performance.md). `PlainSentencePieceVocabulary` (and
`builtin_plain_vocabulary`) give the same ids from SentencePiece alone, for the benchmarks
that tokenize real text there (`bench_gpthf`).
"""
import contextlib
import io
import logging
import os
import pathlib
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

import gin
import sentencepiece as spm

from decal_jax import fileio, settings
from decal_jax.data import corpus

if TYPE_CHECKING:
  import seqio
  from decal_jax.data import seqio_vocabularies

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
  return pathlib.Path(settings.get("DECAL_CACHE_DIR")).expanduser()


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
  """The recipe given, else `$DECAL_BUILTIN_VOCAB` (default DEFAULT_RECIPE; checked)."""
  recipe = recipe or settings.get("DECAL_BUILTIN_VOCAB")
  if recipe not in BUILTIN_RECIPES:
    raise ValueError(f"Unknown built-in vocabulary recipe {recipe!r}; choose one of "
                     f"{sorted(BUILTIN_RECIPES)}.")
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


def builtin_vocabulary(vocab_size: int = BUILTIN_VOCAB_SIZE, extra_ids: int = EXTRA_IDS,
                       recipe: Optional[str] = None) -> "seqio.SentencePieceVocabulary":
  """SentencePiece vocabulary of the built-in corpus (at most `vocab_size` pieces) plus
  `extra_ids` sentinels, trained with `recipe` (default `$DECAL_BUILTIN_VOCAB` or 'bytes').
  Creating it is cheap; the model is built on first use."""
  recipe = builtin_recipe(recipe)
  path = builtin_vocabulary_path(vocab_size, build=False, recipe=recipe)
  return _seqio_classes().BuiltinVocabulary(path, vocab_size, recipe, _build_builtin,
                                            extra_ids)


def _build_builtin(vocab_size: int, recipe: str) -> str:
  """The built-in vocabulary's file, trained if missing (BuiltinVocabulary's first use)."""
  return builtin_vocabulary_path(vocab_size, build=True, recipe=recipe)


class PlainSentencePieceVocabulary:
  """The ids of seqio's SentencePieceVocabulary over the same model file, without seqio or
  TensorFlow (for benchmarks on a GPU image that lacks them): the model with the `extra_ids`
  sentinels appended as seqio appends them (user-defined pieces '▁<extra_id_i>', highest i
  first), so `encode`, `decode`, `vocab_size` and `extra_ids` agree with seqio's."""

  pad_id, eos_id, unk_id = 0, 1, 2

  def __init__(self, path: str, extra_ids: int = EXTRA_IDS):
    from sentencepiece import sentencepiece_model_pb2
    with open(path, "rb") as f:
      model = sentencepiece_model_pb2.ModelProto.FromString(f.read())
    user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    for i in reversed(range(extra_ids)):
      model.pieces.add(piece=f"\u2581<extra_id_{i}>", score=0.0, type=user_defined)
    self.path, self.extra_ids = path, extra_ids
    self.tokenizer = spm.SentencePieceProcessor(model_proto=model.SerializeToString())

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.GetPieceSize()  # the sentinels included, as in seqio

  def encode(self, text: str) -> list:
    return self.tokenizer.EncodeAsIds(text)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` up to the first eos, as seqio decodes: a sentinel as its piece
    ('<extra_id_0>'), an id past the vocabulary as unk."""
    ids = [self.unk_id if i >= self.vocab_size else int(i) for i in ids]
    ids = ids[:ids.index(self.eos_id) + 1] if self.eos_id in ids else ids
    return self.tokenizer.DecodeIds(ids)


@gin.configurable  # bindable in a binding string, where gin files' imports do not reach
def builtin_plain_vocabulary(vocab_size: int = BUILTIN_VOCAB_SIZE, extra_ids: int = EXTRA_IDS,
                             recipe: Optional[str] = None) -> PlainSentencePieceVocabulary:
  """`builtin_vocabulary()`'s ids without seqio or TensorFlow (trained first if missing)."""
  return PlainSentencePieceVocabulary(builtin_vocabulary_path(vocab_size, recipe=recipe),
                                      extra_ids)


def _t5_vocab_path(path: Optional[str]) -> str:
  return path or settings.get("DECAL_T5_VOCAB")


def _check_t5_vocab(path: str) -> None:
  if "://" not in path and not os.path.exists(path):
    raise FileNotFoundError(
        f"T5 SentencePiece vocabulary not found at {path!r}. Set DECAL_T5_VOCAB to a local "
        "copy (from this repo: ../shared/data/vocab/t5_spiece.model), pass the path, or bind "
        "`vocabularies.t5_vocabulary.path` in gin; or use the built-in task "
        "'decal_builtin_span_corruption', whose vocabulary needs no download.")


@gin.configurable  # bindable in a binding string, where gin files' imports do not reach
def t5_plain_vocabulary(path: Optional[str] = None,
                        extra_ids: int = EXTRA_IDS) -> PlainSentencePieceVocabulary:
  """`t5_vocabulary()`'s ids without seqio or TensorFlow, from a local file (the argument,
  else `$DECAL_T5_VOCAB`): gin `VOCABULARY = @vocabularies.t5_plain_vocabulary()`."""
  path = _t5_vocab_path(path)
  if "://" in path:
    raise ValueError(f"t5_plain_vocabulary reads a local file, not {path!r}: set DECAL_T5_VOCAB "
                     "to a copy (../shared/data/vocab/t5_spiece.model).")
  _check_t5_vocab(path)
  return PlainSentencePieceVocabulary(path, extra_ids)


def t5_vocabulary(path: Optional[str] = None, extra_ids: int = EXTRA_IDS,
                  check: bool = True) -> "seqio.SentencePieceVocabulary":
  """The T5 SentencePiece vocabulary (32,000 pieces + 100 sentinels = 32,100 ids).

  Path: the argument, else `$DECAL_T5_VOCAB`, else T5's public copy on GCS. With `check`,
  a missing local file raises now; otherwise when the vocabulary is first used.
  """
  path = _t5_vocab_path(path)
  if check:
    _check_t5_vocab(path)
  return _seqio_classes().T5Vocabulary(path, _check_t5_vocab, extra_ids)


@gin.configurable
def task_vocabulary(vocabulary: Optional["seqio.Vocabulary"] = None) -> "seqio.Vocabulary":
  """The vocabulary of the downstream tasks: the model's (models/t5_1_1.gin binds this to
  its VOCABULARY), else the T5 vocabulary."""
  return vocabulary if vocabulary is not None else t5_vocabulary(check=False)


def deferred_vocabulary() -> "seqio_vocabularies.DeferredVocabulary":
  """The tasks' vocabulary, chosen when first used: `task_vocabulary()` at that point (the
  model's VOCABULARY once gin has parsed its config)."""
  return _seqio_classes().DeferredVocabulary(task_vocabulary)


def _seqio_classes():
  """seqio_vocabularies, imported when a vocabulary is made (it imports seqio and
  TensorFlow, which parsing a gin file must not need)."""
  from decal_jax.data import seqio_vocabularies
  return seqio_vocabularies
