"""Sentence segmentation for GPTHF's data: a rule-based splitter, the end-of-sentence id,
the sentence-index vector, and the seqio preprocessor `sentences_lm`.

`sentences_lm` turns raw {'text'} records into language-modelling chunks in which every
sentence is followed by one end-of-sentence token:

  text -> split_sentences -> each sentence tokenized on its own + [end id]
       -> documents back to back -> chunks of sequence_length['targets'] tokens
       -> {'targets': [<= length], 'sentence_ids': [<= length]}

A sentence of more than `max_sentence_length - 1` tokens is cut into pieces of at most
`max_sentence_length - 1` tokens, each followed by the end id, so no sentence (end token
included) is longer than `max_sentence_length`. Every cut sentence is counted:
`sentence_split_counts()` reports the totals per task, and the first cut and every 10x more
are logged (as `text_to_text.truncation_counts()` does for cut sequences).

The bound must equal the network's `GpthfConfig.max_sentence_length` (its cached generation
keeps at most that many encoder slots per sentence): bind both to one gin macro, e.g.

  MAX_SENTENCE_LENGTH = 64
  sentences_lm.max_sentence_length = %MAX_SENTENCE_LENGTH
  GpthfConfig.max_sentence_length = %MAX_SENTENCE_LENGTH

and likewise `GpthfConfig.sentence_end_id` with `sentence_end_id(vocabulary)`.
`configured_max_sentence_length()` reads the data side's current value.
"""
import collections
import functools
import logging
import re
import threading
from typing import TYPE_CHECKING, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import gin
import numpy as np

from decal_jax.data import corpus, language_modelling, vocabularies

if TYPE_CHECKING:  # the preprocessor's types; splitting and prompts need neither package
  import seqio
  import tensorflow as tf

log = logging.getLogger(__name__)  # decal_jax.* warnings: console.py routes them in the CLI

DEFAULT_MAX_SENTENCE_LENGTH = 64  # tokens per sentence, its end token included
# Words ending in a period that do not end a sentence (compared lower-cased).
ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "mr.", "mrs.", "ms.", "dr.", "prof.",
                 "st.", "jr.", "sr.", "no.", "fig.", "approx.", "inc.", "ltd.", "co.")
CLOSERS = "\"')]}\u201d\u2019\u00bb"  # may follow . ! ? inside the sentence they end
OPENERS = "\"'([{\u201c\u2018\u00ab"  # may start the next sentence
# . ! ? (one or more), closing quotes / brackets, then whitespace before more text.
_CANDIDATE = re.compile(r"([.!?]+)([" + re.escape(CLOSERS) + r"]*)\s+(?=\S)")


# ----------------------------------------------------------------------------- splitting

def _is_abbreviation(word: str, abbreviations: FrozenSet[str]) -> bool:
  """`word` (its trailing period included) is in `abbreviations` (lower-cased) or is a
  capital initial."""
  word = word.lstrip(OPENERS)
  if word.lower() in abbreviations:
    return True
  return len(word) == 2 and word[0].isupper()  # "J." of "J. Smith"


def _ends_sentence(paragraph: str, match: "re.Match", abbreviations: FrozenSet[str]) -> bool:
  """Whether the candidate `match` (terminators, closers, whitespace) is a boundary."""
  following = paragraph[match.end()]
  if not (following.isupper() or following.isdigit() or following in OPENERS):
    return False
  if match.group(1) != ".":  # ! ? ?! ... always end a sentence before a capital
    return True
  word_start = paragraph.rfind(" ", 0, match.start()) + 1  # whitespace is collapsed
  return not _is_abbreviation(paragraph[word_start:match.end(1)], abbreviations)


def _split_paragraph(paragraph: str, abbreviations: FrozenSet[str]) -> List[str]:
  found, start = [], 0
  for match in _CANDIDATE.finditer(paragraph):
    if _ends_sentence(paragraph, match, abbreviations):
      found.append(paragraph[start:match.end(2)])  # terminators and closers included
      start = match.end()
  found.append(paragraph[start:])
  return [s for s in found if s]


@gin.configurable
def split_sentences(text: str, abbreviations: Sequence[str] = ABBREVIATIONS,
                    newline_ends_sentence: bool = True) -> List[str]:
  """Splits `text` into sentences, whitespace inside each collapsed to single spaces.

  A sentence ends at . ! or ? (optionally followed by closing quotes / brackets) followed
  by whitespace and then an uppercase letter, a digit, or an opening quote / bracket. A
  period does not end one after a word in `abbreviations` (case-insensitive, e.g. 'e.g.',
  'Dr.') or after a single capital initial ('J. Smith'); a period inside a token ('3.14',
  'os.path') is never a boundary. A line break always ends a sentence (with
  `newline_ends_sentence=False`, only a blank line does; single line breaks are spaces).
  Text with no boundary is one sentence; empty or whitespace-only lines give nothing.

  Gin: `split_sentences.abbreviations`, `split_sentences.newline_ends_sentence`.
  """
  if newline_ends_sentence:
    paragraphs = text.splitlines()
  else:
    paragraphs = re.split(r"(?:\r\n|\r|\n)[^\S\r\n]*(?:\r\n|\r|\n)\s*", text)
  lowered = frozenset(a.lower() for a in abbreviations)
  out = []
  for paragraph in paragraphs:
    paragraph = " ".join(paragraph.split())
    if paragraph:
      out.extend(_split_paragraph(paragraph, lowered))
  return out


# ----------------------------------------------------------------------------- end id and index

@gin.configurable
def sentence_end_id(vocabulary: "seqio.Vocabulary", end_id: Optional[int] = None) -> int:
  """The end-of-sentence token id for `vocabulary`.

  Default: its last id, `vocab_size - 1`, the top sentinel (extra id) of a T5-style
  vocabulary. The `extra_ids` sentinels lie above the SentencePiece model's own pieces, so
  tokenizing ordinary text never yields one (only the literal string '<extra_id_0>' would).
  An override (gin: `sentence_end_id.end_id`) must be a sentinel too, in
  [vocab_size - extra_ids, vocab_size): lower ids are ordinary pieces and are refused.
  """
  end_id = vocabulary.vocab_size - 1 if end_id is None else int(end_id)
  first_sentinel = vocabulary.vocab_size - vocabulary.extra_ids
  if not first_sentinel <= end_id < vocabulary.vocab_size:
    raise ValueError(
        f"End-of-sentence id {end_id} is not a sentinel of this vocabulary (its "
        f"{vocabulary.extra_ids} sentinels are ids {first_sentinel} .. "
        f"{vocabulary.vocab_size - 1}; ordinary text tokenizes to ids below "
        f"{first_sentinel}). Use a vocabulary with extra_ids > 0 and leave "
        "`sentence_end_id.end_id` unset (the top sentinel) or set it inside that range.")
  return end_id


def sentence_index(tokens: np.ndarray, end_id: int) -> np.ndarray:
  """1-D token ids (0 = padding) -> the 0-based sentence index of every position: the
  number of end tokens strictly before it; padding positions get -1.

  [a b END c END d e f END] -> [0 0 0 1 1 2 2 2 2]
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    raise ValueError(f"sentence_index takes one 1-D token array, got shape {tokens.shape}.")
  ends = (tokens == end_id).astype(np.int32)  # [n]
  before = np.cumsum(ends) - ends  # [n] ends strictly before each position
  return np.where(tokens == 0, -1, before).astype(np.int32)


def sentence_index_tf(tokens: "tf.Tensor", end_id: int) -> "tf.Tensor":
  """TensorFlow twin of `sentence_index` for a 1-D int tensor."""
  import tensorflow as tf
  ends = tf.cast(tf.equal(tokens, end_id), tf.int32)  # [n]
  before = tf.cumsum(ends, exclusive=True)  # [n]
  return tf.where(tf.equal(tokens, 0), -tf.ones_like(before), before)


# ----------------------------------------------------------------------------- split counts

class _SplitCounter:
  """Thread-safe counts, per task, of sentences cut to the maximum sentence length."""

  def __init__(self):
    self._lock = threading.Lock()
    self.counts: Dict[str, int] = collections.Counter()

  def add(self, task: str, max_sentence_length: int) -> None:
    with self._lock:
      self.counts[task] += 1
      n = self.counts[task]
    if n == 1 or np.log10(n).is_integer():
      log.warning("%s: %d sentence(s) so far had more than %d tokens and were cut into "
                  "pieces, each ended by the end-of-sentence token; raise "
                  "max_sentence_length (data and GpthfConfig alike) to keep more whole.",
                  task or "sentences_lm", n, max_sentence_length - 1)


SPLITS = _SplitCounter()


def sentence_split_counts() -> Dict[str, int]:
  """{task: number of sentences cut to the maximum sentence length} since the process
  started (each pass over the data counts)."""
  return {task or "sentences_lm": n for task, n in sorted(SPLITS.counts.items())}


# ----------------------------------------------------------------------------- preprocessor

def encode_sentences(text: str, vocabulary: "seqio.Vocabulary", end_id: int,
                     max_sentence_length: int, task_name: str = "") -> np.ndarray:
  """One document -> `[n]` int32 ids: each sentence's tokens (cut into pieces of at most
  `max_sentence_length - 1`, each cut counted), each sentence or piece followed by
  `end_id`. A sentence that tokenizes to nothing is dropped."""
  room = max_sentence_length - 1
  ids: List[int] = []
  for sentence in split_sentences(text):
    tokens = list(vocabulary.encode(sentence))
    if len(tokens) > room:
      SPLITS.add(task_name, max_sentence_length)
    for start in range(0, len(tokens), room):
      ids.extend(tokens[start:start + room])
      ids.append(end_id)
  return np.asarray(ids, np.int32)


def configured_max_sentence_length() -> int:
  """The data's current bound: the gin binding of `sentences_lm.max_sentence_length`,
  else DEFAULT_MAX_SENTENCE_LENGTH (GpthfConfig.max_sentence_length must equal it)."""
  return int(gin.get_bindings(sentences_lm).get("max_sentence_length",
                                                DEFAULT_MAX_SENTENCE_LENGTH))


@gin.configurable
def sentences_lm(dataset: "tf.data.Dataset", sequence_length: Optional[Mapping[str, int]],
                 output_features: Mapping[str, "seqio.Feature"],
                 max_sentence_length: int = DEFAULT_MAX_SENTENCE_LENGTH,
                 task_name: str = "") -> "tf.data.Dataset":
  """seqio preprocessor: raw {'text': scalar string} -> {'targets': `[<= length]`,
  'sentence_ids': `[<= length]`} chunks of one stream of sentence-segmented documents.

  Tokenizes with output_features['targets'].vocabulary; the end id is
  `sentence_end_id(vocabulary)`; 'sentence_ids' is `sentence_index` of each chunk (a chunk
  that starts mid-sentence starts at index 0). `max_sentence_length` (gin:
  `sentences_lm.max_sentence_length`) must equal the network's
  `GpthfConfig.max_sentence_length`.
  """
  # TensorFlow and seqio only here: splitting and prompts need neither.
  import tensorflow as tf
  from decal_jax.data import seqio_vocabularies
  if max_sentence_length < 2:
    raise ValueError(f"max_sentence_length must be >= 2 (one token and the end token), "
                     f"got {max_sentence_length}.")
  if not sequence_length or not sequence_length.get("targets"):
    raise ValueError("sentences_lm cuts chunks of sequence_length['targets'] tokens: pass "
                     "sequence_length={'targets': n} (TASK_FEATURE_LENGTHS) to get_dataset.")
  vocabulary = output_features["targets"].vocabulary
  if isinstance(vocabulary, seqio_vocabularies.DeferredVocabulary):
    vocabulary = vocabulary.target  # resolve once, not once per sentence
  end_id = sentence_end_id(vocabulary)

  def encode(text) -> np.ndarray:
    text = text.item() if isinstance(text, np.ndarray) else text  # scalar bytes
    return encode_sentences(text.decode("utf-8"), vocabulary, end_id, max_sentence_length,
                            task_name)

  def tokenize(ex):
    ids = tf.numpy_function(encode, [ex["text"]], tf.int32, stateful=True)
    ids.set_shape([None])  # [doc_len], every sentence followed by end_id
    return {"targets": ids}

  documents = dataset.map(tokenize, num_parallel_calls=tf.data.AUTOTUNE)  # order kept
  chunks = language_modelling.lm_chunks(documents, sequence_length)
  return chunks.map(lambda ex: {"targets": ex["targets"],
                                "sentence_ids": sentence_index_tf(ex["targets"], end_id)})


@functools.lru_cache(maxsize=None)
def _builtin_document_ids(max_sentence_length: int) -> Tuple[List[int], ...]:
  """Every built-in corpus paragraph as token ids with the end id after each sentence
  (`encode_sentences`: long sentences cut at the bound, as in GPTHF's training data)."""
  vocabulary = vocabularies.builtin_plain_vocabulary()  # the built-in one's ids, seqio-free
  end_id = sentence_end_id(vocabulary)
  documents = corpus.documents()
  return tuple(encode_sentences(document, vocabulary, end_id, max_sentence_length).tolist()
               for document in documents["train"] + documents["validation"])


@functools.lru_cache(maxsize=None)
def builtin_text_rows(rows: int, length: int, max_sentence_length: int) -> np.ndarray:
  """`[rows, length]` token ids of the built-in corpus, sentence-segmented as above; each
  row a different window that starts at a paragraph start (real prompts for benchmarks)."""
  out, window = [], []
  for ids in _builtin_document_ids(max_sentence_length):
    window += ids
    if len(window) >= length:
      out.append(window[:length])
      window = []
      if len(out) == rows:
        return np.asarray(out, np.int32)
  raise ValueError(f"The built-in corpus holds fewer than {rows} windows of {length} tokens: "
                   "ask for shorter prompts or a smaller batch.")
