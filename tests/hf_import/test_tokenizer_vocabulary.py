"""The tokenizer.json vocabulary (hf_vocabularies): encodes and decodes as the tokenizer
does, in Python and in TensorFlow through seqio, recorded by its file contents, and says
what is missing.

Against transformers' PyTorch models; skipped without the `[test-hf]` extra
(hf_import_helpers.py).
"""
import copy
import json
import shutil
import types

import numpy as np
import pytest


from decal_jax.data import hf_vocabularies, seqio_vocabularies
from hf_import_helpers import TEXTS, _write_tokenizer


# ------------------------------------------------------------------------------ tokenizer.json






def test_tokenizer_vocabulary_encodes_and_decodes_as_the_tokenizer_does(hf_tokenizer):
  tokenizer, path = hf_tokenizer
  vocab = hf_vocabularies.HfTokenizerVocabulary(str(path))
  assert isinstance(vocab, hf_vocabularies.HfTokenizerVocabulary)
  eos = tokenizer.token_to_id("<|endoftext|>")
  assert (vocab.eos_id, vocab.unk_id, vocab.bos_id) == (eos, None, None)
  assert vocab.vocab_size == tokenizer.get_vocab_size() == eos + 1 and vocab.extra_ids == 0
  for text in TEXTS:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert list(vocab.encode(text)) == ids
    assert vocab.decode(ids) == tokenizer.decode(ids) == text
    # Decoding stops at EOS; ids past the tokenizer (padded embedding rows) are skipped.
    assert vocab.decode(ids + [eos, 5, 6]) == text
    assert vocab.decode(ids[:3] + [vocab.vocab_size + 7] + ids[3:]) == text
  # As in Qwen2, id 0 is a real token ('!'), the id our pipelines pad with.
  assert tokenizer.id_to_token(0) == "!" and list(vocab.encode("wow!"))[-1] == 0
  assert vocab == hf_vocabularies.HfTokenizerVocabulary(str(path))
  assert vocab != hf_vocabularies.HfTokenizerVocabulary(str(path), eos_token="!")
  copied = copy.deepcopy(vocab)  # seqio may copy vocabularies; the copy reads the same file
  assert copied == vocab and list(copied.encode(TEXTS[0])) == list(vocab.encode(TEXTS[0]))


def test_tokenizer_vocabulary_is_recorded_by_its_file_contents(hf_tokenizer, tmp_path):
  """MODEL_DIR/vocabulary.json names a tokenizer.json by sha256, so a run read with another
  tokenizer of the same size is refused, and the same file elsewhere is accepted."""
  import hashlib
  from decal_jax.runtime import vocabulary_record
  tokenizer, path = hf_tokenizer
  identity = seqio_vocabularies.vocabulary_identity(hf_vocabularies.HfTokenizerVocabulary(str(path)))
  assert identity == {"class": "HfTokenizerVocabulary", "vocab_size": tokenizer.get_vocab_size(),
                      "file": "tokenizer.json",
                      "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
  elsewhere = tmp_path / "copy" / "tokenizer.json"
  elsewhere.parent.mkdir()
  shutil.copy(path, elsewhere)
  other = tmp_path / "other" / "tokenizer.json"
  other.parent.mkdir()
  spec = json.loads(path.read_text())
  vocab = spec["model"]["vocab"]
  vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two ids swapped: same size, other text
  other.write_text(json.dumps(spec))
  model = lambda p: types.SimpleNamespace(
      input_vocabulary=hf_vocabularies.HfTokenizerVocabulary(str(p)),
      output_vocabulary=hf_vocabularies.HfTokenizerVocabulary(str(p)))
  run = tmp_path / "run"
  run.mkdir()
  vocabulary_record.write(str(run), vocabulary_record.model_record(model(path)))
  assert vocabulary_record.check(str(run), model(elsewhere)) is None
  with pytest.raises(vocabulary_record.VocabularyMismatchError, match="sha256"):
    vocabulary_record.check(str(run), model(other))


def test_tokenizer_vocabulary_in_tensorflow_through_seqio(hf_tokenizer):
  import seqio
  import tensorflow as tf
  tokenizer, path = hf_tokenizer
  vocab = hf_vocabularies.HfTokenizerVocabulary(str(path))
  want = [tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS]
  # seqio's tokenize preprocessor (encode_tf on each example's string scalar), then EOS.
  features = {"targets": seqio.Feature(vocab, add_eos=True)}
  ds = tf.data.Dataset.from_tensor_slices({"targets": TEXTS})
  ds = seqio.preprocessors.append_eos(seqio.preprocessors.tokenize(ds, features), features)
  got = [list(ex["targets"]) for ex in ds.as_numpy_iterator()]
  assert got == [ids + [vocab.eos_id] for ids in want]
  ragged = vocab.encode_tf(tf.constant(TEXTS))  # a batch of strings -> [b, (t)]
  assert isinstance(ragged, tf.RaggedTensor) and ragged.to_list() == want
  assert vocab.encode_tf(tf.constant("")).shape == (0,)
  # decode_tf: one sequence -> a scalar; [b, t] -> [b] cut at EOS (seqio pads after EOS
  # with 0, which is '!' here); ragged [b, (t)] -> [b]; inside tf.function and tf.data.
  eos, width = vocab.eos_id, max(len(ids) for ids in want) + 2
  dense = np.zeros((len(want), width), np.int32)
  for row, ids in zip(dense, want):
    row[:len(ids) + 1] = ids + [eos]
  texts = [t.encode() for t in TEXTS]
  assert vocab.decode_tf(tf.constant(want[0])).numpy() == texts[0]
  assert vocab.decode_tf(tf.constant(dense)).numpy().tolist() == texts
  assert vocab.decode_tf(tf.ragged.constant(want)).numpy().tolist() == texts
  traced = tf.function(vocab.decode_tf).get_concrete_function(
      tf.TensorSpec([None, width], tf.int32))
  assert traced.output_shapes.as_list() == [None]
  assert traced(tf.constant(dense)).numpy().tolist() == texts
  mapped = tf.data.Dataset.from_tensor_slices(dense).map(vocab.decode_tf)
  assert list(mapped.as_numpy_iterator()) == texts


def test_tokenizer_vocabulary_reports_what_is_missing_on_use(hf_tokenizer, tmp_path, monkeypatch):
  monkeypatch.delenv(hf_vocabularies.TOKENIZER_JSON_ENV, raising=False)
  vocab = hf_vocabularies.HfTokenizerVocabulary()  # builds without a file ...
  with pytest.raises(FileNotFoundError, match="QWEN2_TOKENIZER.*DECAL_HF_TOKENIZER"):
    _ = vocab.vocab_size  # ... and says what to bind when used
  monkeypatch.setenv(hf_vocabularies.TOKENIZER_JSON_ENV, str(hf_tokenizer[1]))
  eos = hf_tokenizer[0].token_to_id("<|endoftext|>")
  assert hf_vocabularies.HfTokenizerVocabulary().eos_id == eos
  _, bare = _write_tokenizer(tmp_path / "bare", eos_in_config=False)
  with pytest.raises(ValueError, match="names no EOS token.*eos_token"):
    _ = hf_vocabularies.HfTokenizerVocabulary(str(bare)).eos_id
  assert hf_vocabularies.HfTokenizerVocabulary(str(bare), eos_token="!").eos_id == 0
  with pytest.raises(ValueError, match="'<eos>' is not in"):
    _ = hf_vocabularies.HfTokenizerVocabulary(str(bare), eos_token="<eos>").eos_id
