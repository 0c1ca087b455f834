"""Sentence segmentation (data/sentences.py) and the sentence LM tasks
(tasks/sentence_lm_tasks.py): the splitter on hand-written texts, the sentence-index vector
on hand-worked answers, and the tasks' token streams rebuilt independently from the source
texts with the vocabulary."""
import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax.data import corpus, sentences, vocabularies
from decal_jax.data.sentences import sentence_index, split_sentences
from decal_jax.tasks import sentence_lm_tasks


@pytest.fixture(autouse=True)
def vocab(builtin_vocabulary):
  """Every test here reads the built-in vocabulary (tests/conftest.py)."""
  return builtin_vocabulary


def _stream(vocab, texts, end_id, max_sentence_length):
  """Independent rebuild: the expected token stream of `texts` (lists of sentences), each
  sentence cut into pieces of max_sentence_length - 1 tokens, each piece + [end_id]."""
  room, out, cut = max_sentence_length - 1, [], 0
  for text_sentences in texts:
    for sentence in text_sentences:
      ids = list(vocab.encode(sentence))
      cut += len(ids) > room
      while ids:
        out += ids[:room] + [end_id]
        ids = ids[room:]
  return out, cut


def _chunks(task_name, length, split="validation"):
  ds = seqio.get_mixture_or_task(task_name).get_dataset(
      {"targets": length}, split=split, shuffle=False, num_epochs=1)
  return [{k: v.tolist() for k, v in ex.items()} for ex in ds.as_numpy_iterator()]


def _hand_sentence_index(tokens, end_id):
  """Loop version of the spec: sentence number so far; padding -1."""
  out, sentence = [], 0
  for tok in tokens:
    out.append(-1 if tok == 0 else sentence)
    sentence += tok == end_id
  return out


# ----------------------------------------------------------------------------- splitter

@pytest.mark.parametrize("text, expected", [
    ("It costs 3.14 dollars. Then it rose to 4.5 today.",
     ["It costs 3.14 dollars.", "Then it rose to 4.5 today."]),
    ("Dr. Smith met Mr. Jones. They talked.", ["Dr. Smith met Mr. Jones.", "They talked."]),
    ("Bring fruit, e.g. Apples, pears, etc. The rest, i.e. Bread, is fine. Thanks.",
     ["Bring fruit, e.g. Apples, pears, etc. The rest, i.e. Bread, is fine.", "Thanks."]),
    ("The book by J. R. Smith is long. Read it.",
     ["The book by J. R. Smith is long.", "Read it."]),
    ('He said "Stop." Then he left. (It was late.) "Why?" she asked.',
     ['He said "Stop."', "Then he left.", "(It was late.)", '"Why?" she asked.']),
    ("Wow!! Really?! yes. OK", ["Wow!!", "Really?! yes.", "OK"]),
    ("Chapter one ends. 2 more to go.", ["Chapter one ends.", "2 more to go."]),
    ("os.path.join is a function. it joins paths.",
     ["os.path.join is a function. it joins paths."]),
    ("First line without a stop\nSecond line.\n\n\n   Third.  ",
     ["First line without a stop", "Second line.", "Third."]),
    ("no boundary   here at all", ["no boundary here at all"]),
    ("", []),
    ("   \n\n \t\n", []),
])
def test_split_sentences_on_hand_written_texts(text, expected):
  assert split_sentences(text) == expected


def test_splitter_options():
  assert split_sentences("See Fig. 3 now.") == ["See Fig. 3 now."]
  assert split_sentences("See Fig. 3 now.", abbreviations=()) == ["See Fig.", "3 now."]
  text = "a line that\ncontinues here. Next one.\n \nNew paragraph"
  assert split_sentences(text, newline_ends_sentence=False) == [
      "a line that continues here.", "Next one.", "New paragraph"]
  assert split_sentences(text) == ["a line that", "continues here.", "Next one.",
                                    "New paragraph"]


# ----------------------------------------------------------------------------- index and end id

def test_sentence_index_hand_worked():
  end = 99
  tokens = [5, 6, end, 7, end, 8, 9, 10, end]
  expected = [0, 0, 0, 1, 1, 2, 2, 2, 2]  # the vector
  assert sentence_index(np.array(tokens), end).tolist() == expected
  assert sentences.sentence_index_tf(tf.constant(tokens), end).numpy().tolist() == expected
  padded = [5, end, 6, 7, 0, 0]
  assert sentence_index(np.array(padded), end).tolist() == [0, 0, 1, 1, -1, -1]
  assert sentences.sentence_index_tf(tf.constant(padded), end).numpy().tolist() == [
      0, 0, 1, 1, -1, -1]
  assert sentence_index(np.array([3, 4]), end).tolist() == [0, 0]  # no boundary
  with pytest.raises(ValueError, match="1-D"):
    sentence_index(np.zeros((2, 3), np.int32), end)


def test_sentence_end_id_is_the_top_sentinel_and_refuses_ordinary_pieces(vocab):
  end = sentences.sentence_end_id(vocab)
  first_sentinel = vocab.vocab_size - vocab.extra_ids
  assert end == vocab.vocab_size - 1 and vocab.extra_ids == 100
  assert vocab.decode([end]) == "<extra_id_0>"  # T5 order: the top id is extra id 0
  # Property: ordinary text never tokenizes to a sentinel (the whole validation split).
  ids = vocab.encode(" ".join(corpus.documents()["validation"]))
  assert max(ids) < first_sentinel
  assert sentences.sentence_end_id(vocab, end_id=first_sentinel) == first_sentinel
  for bad in (first_sentinel - 1, 5, vocab.vocab_size):
    with pytest.raises(ValueError, match="not a sentinel"):
      sentences.sentence_end_id(vocab, end_id=bad)
  no_sentinels = vocabularies.builtin_vocabulary(extra_ids=0)
  with pytest.raises(ValueError, match="extra_ids"):
    sentences.sentence_end_id(no_sentinels)


# ----------------------------------------------------------------------------- tasks

def test_builtin_task_matches_an_independent_rebuild(vocab):
  length, max_len = 128, sentences.DEFAULT_MAX_SENTENCE_LENGTH
  end = vocab.vocab_size - 1
  task = "decal_builtin_sentence_lm"
  before = sentences.sentence_split_counts().get(task, 0)
  chunks = _chunks(task, length)
  docs = corpus.documents()["validation"]
  expected, cut = _stream(vocab, [split_sentences(d) for d in docs], end, max_len)
  got = [tok for ex in chunks for tok in ex["targets"]]
  assert got == expected  # end ids exactly at the splitter's boundaries, docs in order
  assert all(len(ex["targets"]) == length for ex in chunks[:-1])
  for ex in chunks:
    assert ex["sentence_ids"] == _hand_sentence_index(ex["targets"], end)
  assert sentences.sentence_split_counts().get(task, 0) - before == cut
  # Read back: a document's sentences, decoded between end ids, are the splitter's.
  doc_index = next(i for i, d in enumerate(docs) if len(split_sentences(d)) >= 3)
  start = len(_stream(vocab, [split_sentences(d) for d in docs[:doc_index]], end, max_len)[0])
  first = split_sentences(docs[doc_index])
  segments, current = [], []
  for tok in got[start:]:
    if tok == end:
      segments.append(current)
      current = []
    else:
      current.append(tok)
    if len(segments) == len(first):
      break
  assert [vocab.decode(s) for s in segments] == first


def test_long_sentence_is_split_and_counted_and_empty_lines_skipped(vocab, tmp_path):
  long_sentence = " ".join(f"word{i}" for i in range(30)) + " without a stop"
  path = tmp_path / "validation.txt"
  path.write_text("Short one. Another here.\n\n   \n" + long_sentence + "\n\nLast line\n")
  name = "test_sentence_lm_long"
  assert sentences.configured_max_sentence_length() == sentences.DEFAULT_MAX_SENTENCE_LENGTH
  sentence_lm_tasks.register_text_sentence_lm_task(name, {"validation": str(path)})
  with gin.unlock_config():
    gin.bind_parameter("sentences_lm.max_sentence_length", 8)
  assert sentences.configured_max_sentence_length() == 8
  end = vocab.vocab_size - 1
  try:
    chunks = _chunks(name, 1000)
  finally:
    seqio.TaskRegistry.remove(name)
  tokens = chunks[0]["targets"]
  assert len(chunks) == 1
  texts = [["Short one.", "Another here."], [long_sentence], ["Last line"]]
  expected, cut = _stream(vocab, texts, end, 8)
  assert tokens == expected
  assert cut >= 1 and sentences.sentence_split_counts()[name] == cut
  long_ids = vocab.encode(long_sentence)
  assert len(long_ids) > 14  # three pieces at least
  ends = [i for i, t in enumerate(tokens) if t == end]
  gaps = np.diff([-1] + ends) - 1  # tokens between end ids
  assert gaps.min() >= 1 and gaps.max() <= 7  # no empty sentence, no piece over 7 tokens
  assert tokens[0] != end and tokens[-1] == end
  assert chunks[0]["sentence_ids"][-1] == len(ends) - 1


def test_local_text_task_and_feature_converter(vocab, tmp_path, monkeypatch):
  folder = tmp_path / "text_lm"
  folder.mkdir()
  (folder / "validation.txt").write_text("\nOne here. Two here!\n\nThree?\n")
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  end = vocab.vocab_size - 1
  chunks = _chunks(sentence_lm_tasks.TEXT_SENTENCE_LM_TASK, 4)
  expected, _ = _stream(vocab, [["One here.", "Two here!"], ["Three?"]], end, 64)
  assert [t for ex in chunks for t in ex["targets"]] == expected
  assert chunks[1]["sentence_ids"] == _hand_sentence_index(chunks[1]["targets"], end)
  assert chunks[1]["sentence_ids"][0] == 0  # a chunk restarts the count
  for pack in (False, True):
    ds = seqio.get_dataset(
        sentence_lm_tasks.TEXT_SENTENCE_LM_TASK, {"targets": 4}, dataset_split="validation",
        shuffle=False, num_epochs=1,
        feature_converter=seqio.DecoderFeatureConverter(pack=pack))
    batch = next(ds.as_numpy_iterator())
    assert "sentence_ids" not in batch
    if not pack:
      assert batch["decoder_target_tokens"].tolist() == chunks[0]["targets"]


def test_c4_task_reads_tfds_mock_data():
  with tfds.testing.mock_data(num_examples=4):
    chunks = _chunks("decal_c4_sentence_lm", 64, split="train")[:5]
  end = vocabularies.builtin_vocabulary().vocab_size - 1
  assert chunks and end in [t for ex in chunks for t in ex["targets"]]
  for ex in chunks:
    assert ex["sentence_ids"] == _hand_sentence_index(ex["targets"], end)


def test_bad_arguments_name_the_fix(vocab):
  ds = tf.data.Dataset.from_tensor_slices({"text": ["A. B."]})
  features = {"targets": seqio.Feature(vocab, add_eos=False)}
  with pytest.raises(ValueError, match="sequence_length"):
    sentences.sentences_lm(ds, None, features)
  with pytest.raises(ValueError, match="max_sentence_length"):
    sentences.sentences_lm(ds, {"targets": 8}, features, max_sentence_length=1)
