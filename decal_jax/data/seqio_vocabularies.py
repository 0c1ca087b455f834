"""The seqio vocabulary classes that `vocabularies`' factories make: SentencePiece
vocabularies that name a bad file, the built-in and the T5 one, the deferred task
vocabulary, and the identity a run records. Kept apart so that `vocabularies` (which every
model gin file imports) needs neither seqio nor TensorFlow until a vocabulary is made.

The imports go one way: `vocabularies` imports this module (when a vocabulary is made),
never the reverse; what a class needs from there (the built-in file's builder, the T5
file's check, the task vocabulary) its factory passes in."""
import hashlib
import os
from typing import Any, Callable, Dict

import seqio
import tensorflow as tf
from google.protobuf import message as protobuf_message


class NotSentencePieceError(ValueError):
  """A vocabulary file SentencePiece cannot read (the message names the file)."""


class NamedSentencePieceVocabulary(seqio.SentencePieceVocabulary):
  """A SentencePiece vocabulary whose file, if it is not a SentencePiece model, is named in
  the error (seqio raises protobuf's DecodeError or a bare RuntimeError, without it)."""

  FIX = ("Give a binary SentencePiece model (e.g. T5's spiece.model, or one written by "
         "decal_jax/commands/make_vocab.py); a Hugging Face tokenizer.json goes to "
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


class BuiltinVocabulary(NamedSentencePieceVocabulary):
  """The built-in-corpus SentencePiece vocabulary at `path` (`vocabularies.
  builtin_vocabulary` makes it); `build(vocab_size, recipe)` trains the file on first use
  if it is missing, not at creation. seqio compares vocabularies by their attributes, so
  `build` is a module function (equal in every instance), not a closure."""

  def __init__(self, path: str, vocab_size: int, recipe: str,
               build: Callable[[int, str], Any], extra_ids: int):
    self._builtin_size, self.recipe, self._build = vocab_size, recipe, build
    super().__init__(path, extra_ids=extra_ids)

  def _model_context(self):
    if not self._model and not os.path.exists(self._sentencepiece_model_file):
      self._build(self._builtin_size, self.recipe)
    return super()._model_context()


class T5Vocabulary(NamedSentencePieceVocabulary):
  """The T5 vocabulary (`vocabularies.t5_vocabulary` makes it); `check_file(path)` reports
  a missing local file clearly when the vocabulary is first used."""

  FIX = ("Point DECAL_T5_VOCAB (or gin `vocabularies.t5_vocabulary.path`) at a binary "
         "SentencePiece model, e.g. T5's spiece.model or one written by "
         "decal_jax/commands/make_vocab.py")

  def __init__(self, path: str, check_file: Callable[[str], None], extra_ids: int):
    self._check_file = check_file
    super().__init__(path, extra_ids=extra_ids)

  def _model_context(self):
    if not self._model:
      self._check_file(self._sentencepiece_model_file)
    return super()._model_context()


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


class DeferredVocabulary(seqio.Vocabulary):
  """A vocabulary chosen when first used rather than when a task is registered.

  seqio tasks are registered on import, before gin has parsed the model's config; the
  downstream tasks hold one (`vocabularies.deferred_vocabulary()`, whose `resolve` is
  `vocabularies.task_vocabulary`) and so tokenize with whatever it returns at that point
  (the model's VOCABULARY under our gin files).
  """

  def __init__(self, resolve: Callable[[], seqio.Vocabulary]):
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
  _base_vocab_size = property(lambda self: self.target._base_vocab_size)

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
