"""Hugging Face tokenizers as seqio vocabularies whose ids are the checkpoint's own.

`HfSentencePieceVocabulary`: a checkpoint's SentencePiece `tokenizer.model` (LLaMA-2;
gin/models/dodo_llama2_7b.gin). `HfTokenizerVocabulary`: a `tokenizer.json` (Qwen2's
byte-level BPE; gin/models/squid_qwen2.gin), its id 0 optionally moved out of the way of
our padding (`zero_id_to`, matched in the weights by `hf_import.remap_zero_row`).

Both take their file from the `path` argument, else from an environment variable, and
report a missing file only when first used: gin files parse and models build without it.
"""
import hashlib
import json
import operator
import os
import pathlib
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np
import seqio
import tensorflow as tf
import tokenizers

from decal_jax import settings
from decal_jax.data import seqio_vocabularies

SENTENCEPIECE_ENV = "DECAL_LLAMA_TOKENIZER"  # a tokenizer.model (LLaMA: SentencePiece)
TOKENIZER_JSON_ENV = "DECAL_HF_TOKENIZER"    # a tokenizer.json (Qwen2: byte-level BPE)


def checked_zero_id_to(zero_id_to) -> Optional[int]:
  """`zero_id_to` as an int (None stays None); refuses ids that cannot stand for token 0
  (`HfTokenizerVocabulary`; `hf_import` checks the weights' side with it too)."""
  if zero_id_to is None:
    return None
  if isinstance(zero_id_to, bool):
    raise ValueError(f"zero_id_to={zero_id_to!r} is not a token id: give an int, e.g. 151935 "
                     "for Qwen2, or None for no remapping.")
  try:
    zero_id_to = operator.index(zero_id_to)
  except TypeError:
    raise ValueError(f"zero_id_to={zero_id_to!r} is not a token id: give an int, e.g. 151935 "
                     "for Qwen2, or None for no remapping.") from None
  if zero_id_to <= 0:
    raise ValueError(f"zero_id_to={zero_id_to} must be a positive id (id 0 is what it "
                     "replaces, and is padding): give an id the tokenizer never produces.")
  return zero_id_to


class HfSentencePieceVocabulary(seqio_vocabularies.NamedSentencePieceVocabulary):
  """A checkpoint's SentencePiece `tokenizer.model`, with extra_ids=0: its ids are the
  model's.

  Path: the argument, else `$DECAL_LLAMA_TOKENIZER`. LLaMA's own ids are unk 0, bos 1,
  eos 2; seqio pads with 0 (LLaMA's <unk>, which text never produces).
  """

  FIX = (f"Bind LLAMA_TOKENIZER (or set ${SENTENCEPIECE_ENV}) to the checkpoint's "
         "SentencePiece tokenizer.model; a tokenizer.json goes to QWEN2_TOKENIZER "
         "(HfTokenizerVocabulary) instead")

  def __init__(self, path: Optional[str] = None):
    super().__init__(path or settings.get(SENTENCEPIECE_ENV) or "", extra_ids=0)

  def _model_context(self):
    if not self._model:
      path = self._sentencepiece_model_file
      if not path or ("://" not in path and not os.path.exists(path)):
        raise FileNotFoundError(
            f"SentencePiece model {path!r} not found. Bind LLAMA_TOKENIZER (gin: "
            f"--gin.LLAMA_TOKENIZER=\"'/ckpt/Llama-2-7b-hf/tokenizer.model'\") or set "
            f"${SENTENCEPIECE_ENV} to the checkpoint's tokenizer.model.")
    return super()._model_context()


def _token_content(token) -> Optional[str]:
  """tokenizer_config.json names a token as a string or as {'content': string, ...}."""
  if isinstance(token, Mapping):
    return token.get("content")
  return token


class HfTokenizerVocabulary(seqio.Vocabulary):
  """A Hugging Face `tokenizer.json` (e.g. Qwen2's byte-level BPE) as a seqio Vocabulary.

  Ids are the tokenizer's own (extra_ids=0; id 0 aside when remapped, see Padding), so
  they index the checkpoint's embeddings. encode adds no special tokens (no BOS, no EOS:
  seqio appends EOS itself); decode stops at the first EOS, skips special tokens and ids
  past the tokenizer's last one (a checkpoint's embedding table is often padded beyond
  it: Qwen2-0.5B has 151,936 rows for 151,646 tokens). The TensorFlow versions
  (`encode_tf` / `decode_tf`, used by seqio's preprocessors and metrics) run the same
  Rust tokenizer, and the same remapping, through `tf.numpy_function`.

  Path: the argument, else `$DECAL_HF_TOKENIZER`; a missing file is reported when the
  vocabulary is first used, so gin files parse and models build without it. EOS: the
  `eos_token` argument, else `eos_token` of the `tokenizer_config.json` beside the file
  (Qwen2 base models: '<|endoftext|>').

  Padding: seqio and every model here pad with id 0 and read "id > 0" as "a real token"
  (masks, loss weights targets != 0, BOS = 0, `evaluation.token_text` keeps ids > 0). In
  GPT-2-style byte-level BPE vocabularies (Qwen2's, GPT-2's) id 0 is a real token, '!',
  which would vanish wherever it is tokenised on its own ('Hello!' -> 'Hello', '!').
  `zero_id_to=R` fixes that exactly: encode writes the tokenizer's id 0 as R and decode
  reads R back as it, so text never yields id 0, and decode skips id 0 as padding (the
  TensorFlow paths too). R must be an id the tokenizer never produces (checked on first
  use: a ValueError names the token R already is) and a row of every embedding table the
  ids index; import the checkpoint with `hf_import.remap_zero_row(params, R)`
  (decal_jax/commands/import_hf.py does so when the gin VOCABULARY remaps) so row R holds '!'. Qwen2's
  tokenizer ends at id 151645 (Qwen2.5's at 151664) and its tables have 151,936 (0.5B) and
  152,064 (7B) rows: R = 151935 (gin/models/squid_qwen2.gin); vocab_size is then R + 1.
  The default zero_id_to=None keeps the tokenizer's ids, '!' = 0 included (and lost
  downstream).
  """

  def __init__(self, path: Optional[str] = None, eos_token: Optional[str] = None,
               zero_id_to: Optional[int] = None):
    self._path = str(path or settings.get(TOKENIZER_JSON_ENV) or "")
    self._eos_token = eos_token
    self._zero_id_to = checked_zero_id_to(zero_id_to)
    self._loaded = None  # (tokenizer, {token: id}, tokenizer_config dict)
    super().__init__(extra_ids=0)

  # -------------------------------------------------------------------- loading
  def _load(self):
    if self._loaded is None:
      path = pathlib.Path(self._path)
      if not self._path or not path.is_file():
        raise FileNotFoundError(
            f"tokenizer.json {self._path!r} not found. Bind QWEN2_TOKENIZER (gin: "
            f"--gin.QWEN2_TOKENIZER=\"'/ckpt/Qwen2-0.5B/tokenizer.json'\") or set "
            f"${TOKENIZER_JSON_ENV} to the checkpoint's tokenizer.json.")
      tokenizer = tokenizers.Tokenizer.from_file(str(path))
      vocab = tokenizer.get_vocab(with_added_tokens=True)
      self._check_zero_id_unused(tokenizer, vocab)
      config_path = path.parent / "tokenizer_config.json"
      config = json.loads(config_path.read_text()) if config_path.exists() else {}
      self._loaded = (tokenizer, vocab, config)
    return self._loaded

  def _check_zero_id_unused(self, tokenizer, vocab: Mapping[str, int]) -> None:
    """zero_id_to must be an id the tokenizer never produces (else two tokens share it)."""
    if self._zero_id_to is None or self._zero_id_to not in set(vocab.values()):
      return
    raise ValueError(
        f"zero_id_to={self._zero_id_to} is the id of the token "
        f"{tokenizer.id_to_token(self._zero_id_to)!r} in {self._path}: it must be an id "
        f"the tokenizer never produces, e.g. one past its last ({max(vocab.values()) + 1}) "
        "and below the embedding tables' rows (Qwen2: 151935). Bind another "
        "hf_vocabularies.HfTokenizerVocabulary.zero_id_to.")

  @property
  def zero_id_to(self) -> Optional[int]:
    """The id that stands for the tokenizer's id 0 (None: no remapping)."""
    return self._zero_id_to

  def _from_tokenizer(self, ids: List[int]) -> List[int]:
    """Tokenizer ids -> ours: 0 becomes zero_id_to."""
    if self._zero_id_to is None:
      return list(ids)
    return [self._zero_id_to if i == 0 else i for i in ids]

  def _to_tokenizer(self, ids: List[int]) -> List[int]:
    """Our ids -> the tokenizer's: 0 (padding, BOS) dropped, zero_id_to back to 0."""
    if self._zero_id_to is None:
      return list(ids)
    return [0 if i == self._zero_id_to else i for i in ids if i != 0]

  def _token_id(self, token: Optional[str], what: str) -> Optional[int]:
    if token is None:
      return None
    token_id = self._load()[1].get(token)
    if token_id is None:
      raise ValueError(f"The {what} token {token!r} is not in {self._path}: give one of "
                       "its tokens (gin: hf_vocabularies.HfTokenizerVocabulary.eos_token).")
    return self._from_tokenizer([token_id])[0]

  # -------------------------------------------------------------------- special ids
  @property
  def eos_id(self) -> int:
    token = self._eos_token or _token_content(self._load()[2].get("eos_token"))
    if token is None:
      raise ValueError(f"{self._path} names no EOS token (no eos_token in a "
                       "tokenizer_config.json beside it): pass eos_token, e.g. gin "
                       "hf_vocabularies.HfTokenizerVocabulary.eos_token = '<|endoftext|>'.")
    return self._token_id(token, "EOS")

  @property
  def bos_id(self) -> Optional[int]:
    return self._token_id(_token_content(self._load()[2].get("bos_token")), "BOS")

  @property
  def unk_id(self) -> Optional[int]:
    """The BPE model's unknown token, if any (byte-level BPE needs none: Qwen2 has none)."""
    return self._token_id(getattr(self._load()[0].model, "unk_token", None), "UNK")

  @property
  def _tokenizer_size(self) -> int:
    """One past the tokenizer's largest id, added tokens included."""
    return max(self._load()[1].values()) + 1

  @property
  def _base_vocab_size(self) -> int:
    """One past the largest id encode can return (zero_id_to included)."""
    return max(self._tokenizer_size, (self._zero_id_to or 0) + 1)

  # -------------------------------------------------------------------- python
  def _encode(self, s: str) -> List[int]:
    return self._from_tokenizer(self._load()[0].encode(s, add_special_tokens=False).ids)

  def _decode(self, ids) -> str:
    ids = [int(i) for i in ids]
    eos = self.eos_id
    if eos in ids:
      ids = ids[:ids.index(eos)]
    size = self._tokenizer_size
    return self._load()[0].decode([i for i in self._to_tokenizer(ids) if 0 <= i < size],
                                  skip_special_tokens=True)

  # -------------------------------------------------------------------- tensorflow
  def _encode_rows(self, texts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    rows = [self._encode(t.decode("utf-8")) for t in texts]
    flat = np.array([i for row in rows for i in row], np.int32)
    return flat, np.array([len(row) for row in rows], np.int64)

  def _encode_tf(self, s):
    """String scalar -> int32 `[t]`; string vector `[b]` -> ragged int32 `[b, (t)]`."""
    s = tf.convert_to_tensor(s, tf.string)
    if s.shape.rank not in (0, 1):
      raise ValueError(f"encode_tf takes a string scalar or vector, got shape {s.shape}.")
    flat, lengths = tf.numpy_function(self._encode_rows, [tf.reshape(s, [-1])],
                                      (tf.int32, tf.int64), stateful=False)
    flat.set_shape([None])
    if s.shape.rank == 0:
      return flat  # [t]
    lengths.set_shape(s.shape)
    return tf.RaggedTensor.from_row_lengths(flat, lengths)  # [b, (t)]

  def _decode_rows(self, flat: np.ndarray, splits: np.ndarray) -> np.ndarray:
    return np.array([self._decode(flat[a:b]).encode("utf-8")
                     for a, b in zip(splits[:-1], splits[1:])], dtype=object)

  def _decode_tf(self, ids):
    """Ids `[..., t]` (dense or ragged) -> strings `[...]`: one per last-axis row."""
    if isinstance(ids, tf.RaggedTensor):
      if ids.ragged_rank > 1 or ids.values.shape.rank != 1:
        return ids.with_values(self._decode_tf(ids.values))  # rows of rows
      return self._decode_splits(ids.values, ids.row_splits)  # [rows]
    ids = tf.convert_to_tensor(ids)
    if ids.shape.rank == 0:
      raise ValueError("decode_tf takes ids [..., length], got a scalar.")
    shape = tf.shape(ids)
    rows = tf.reshape(ids, [-1, shape[-1]])  # [rows, t]
    splits = tf.range(tf.shape(rows)[0] + 1, dtype=tf.int64) * tf.cast(shape[-1], tf.int64)
    text = self._decode_splits(tf.reshape(rows, [-1]), splits)  # [rows]
    text = tf.reshape(text, shape[:-1])
    text.set_shape(ids.shape[:-1])
    return text  # [...]: a scalar for one sequence `[t]`

  def _decode_splits(self, flat, splits):
    text = tf.numpy_function(self._decode_rows, [tf.cast(flat, tf.int64),
                                                 tf.cast(splits, tf.int64)],
                             tf.string, stateful=False)
    text.set_shape([splits.shape[0] - 1 if splits.shape[0] is not None else None])
    return text

  # -------------------------------------------------------------------- identity
  def file_identity(self) -> Dict[str, str]:
    """The tokenizer.json's basename and sha256 (`vocabularies.vocabulary_identity`, which
    MODEL_DIR/vocabulary.json records): two runs read the same ids as the same text only
    with the same file, wherever it lies."""
    self._load()  # a missing file is named by its own error first
    digest = hashlib.sha256(pathlib.Path(self._path).read_bytes()).hexdigest()
    return {"file": os.path.basename(self._path), "sha256": digest}

  def _key(self):
    return (os.path.abspath(self._path) if self._path else "", self._eos_token,
            self._zero_id_to)

  def __eq__(self, other):  # the same file, EOS and remap: gin builds one per reference
    return (isinstance(other, HfTokenizerVocabulary) and
            other._key() == self._key())

  def __hash__(self):
    return hash(self._key())

  def __repr__(self):
    return (f"HfTokenizerVocabulary({self._path!r}, eos_token={self._eos_token!r}, "
            f"zero_id_to={self._zero_id_to!r})")

  def __getstate__(self):  # pickle / deepcopy (gin copies arguments): reloaded on use
    return dict(self.__dict__, _loaded=None)

