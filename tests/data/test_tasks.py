"""seqio tasks: the built-in corpus task, the C4 task (offline via TFDS mock data), the
T5 vocabulary, and the errors that name the fix."""
import hashlib
import importlib
import os
import pathlib
import re
import unicodedata

import numpy as np
import pytest
import seqio
import tensorflow_datasets as tfds

import decal_jax.tasks
from decal_jax.data import corpus, span_corruption, vocabularies
from decal_jax.tasks import span_corruption_tasks

import paths

BUILTIN = "decal_builtin_span_corruption"
C4 = "decal_c4_span_corruption"
DATA_DIR = pathlib.Path(os.environ.get(
    "DECAL_DATA_DIR", paths.REPO.parent / "shared" / "data"))
T5_VOCAB = DATA_DIR / "vocab" / "t5_spiece.model"
CONTRACT_FEATURES = {"encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens",
                     "decoder_loss_weights"}


def _needs_t5_vocab():
  if not T5_VOCAB.exists():
    pytest.skip(f"T5 vocabulary not found at {T5_VOCAB}: set DECAL_DATA_DIR to the folder "
                "holding vocab/t5_spiece.model")


def _reassemble(inputs, targets, first_sentinel):
  """Plain-python inverse of span corruption on EOS-free id lists."""
  span_of, current = {}, None
  for tok in targets:
    if tok >= first_sentinel:
      current, span_of[tok] = tok, []
    else:
      span_of[current].append(tok)
  out = []
  for tok in inputs:
    out.extend(span_of[tok] if tok >= first_sentinel else [tok])
  return out


def _examples(task_name, split, lengths, n, seed=0, shuffle=False):
  task = seqio.get_mixture_or_task(task_name)
  ds = task.get_dataset(lengths, split=split, shuffle=shuffle, seed=seed)
  return task, [{k: v.tolist() for k, v in ex.items()}
                for _, ex in zip(range(n), ds.as_numpy_iterator())]


def test_both_tasks_are_registered_with_eos_features_and_reimport_is_safe():
  importlib.reload(span_corruption_tasks)  # a second registration replaces, never raises
  importlib.reload(decal_jax.tasks)
  for name in (BUILTIN, C4):
    task = seqio.get_mixture_or_task(name)
    assert set(task.output_features) == {"inputs", "targets"}
    assert all(f.add_eos and f.required for f in task.output_features.values())
    assert span_corruption.span_corruption in task.preprocessors
  assert set(seqio.get_mixture_or_task(BUILTIN).source.splits) == {"train", "validation"}


def test_builtin_examples_are_held_out_corpus_text_with_sentinels():
  lengths = {"inputs": 64, "targets": 16}
  task, examples = _examples(BUILTIN, "validation", lengths, n=6)
  vocab = task.output_features["targets"].vocabulary
  top = vocab.vocab_size - 1
  validation = " ".join(unicodedata.normalize("NFKC", d)
                        for d in corpus.documents()["validation"])
  texts = []
  for ex in examples:
    assert ex["inputs"][-1] == 1 and ex["targets"][-1] == 1  # EOS
    assert len(ex["inputs"]) == 64  # chunks fill the inputs exactly
    assert ex["targets"][0] == top and top in ex["inputs"]  # first sentinel, both sides
    tokens = _reassemble(ex["inputs"][:-1], ex["targets"][:-1], vocab.vocab_size - 100)
    texts.append(vocab.decode(tokens))
    assert texts[-1].strip() in validation  # a real stretch of held-out text
  assert validation.startswith(texts[0])  # the stream starts with the first document


def _independent_documents():
  """The corpus re-derived here: blank-line blocks of every topic, whitespace collapsed,
  blocks of >= 80 characters."""
  from pydoc_data import topics
  docs = set()
  for text in topics.topics.values():
    for block in re.split(r"\n[ \t]*\n", text):
      if len(block.strip()) >= 80:
        docs.add(" ".join(block.split()))
  return docs


def test_corpus_splits_cover_the_docs_and_never_overlap():
  from pydoc_data import topics
  assert len(topics.topics) > 50 and sum(map(len, topics.topics.values())) > 300_000
  train, validation = map(set, (corpus.documents()["train"], corpus.documents()["validation"]))
  assert not train & validation
  assert train | validation == _independent_documents()
  assert 0.03 < len(validation) / (len(train) + len(validation)) < 0.15
  for doc in validation:  # the split is a function of the document's text alone
    assert int(hashlib.sha256(doc.encode()).hexdigest(), 16) % 100 < 8


def test_training_reads_no_validation_text():
  """Every 12-word window of a shuffled training example's text comes from a training
  document or straddles two of them, never from a validation document alone."""
  task, examples = _examples(BUILTIN, "train", {"inputs": 128, "targets": 32}, n=8,
                             shuffle=True, seed=3)
  vocab = task.output_features["targets"].vocabulary
  norm = lambda s: unicodedata.normalize("NFKC", s)
  only_validation = [norm(d) for d in corpus.documents()["validation"]]
  train_text = " ".join(norm(d) for d in corpus.documents()["train"])
  for ex in examples:
    tokens = _reassemble(ex["inputs"][:-1], ex["targets"][:-1], vocab.vocab_size - 100)
    words = vocab.decode(tokens).split()[1:-1]  # drop words cut by the chunk edges
    for i in range(0, max(len(words) - 12, 1), 6):
      window = " ".join(words[i:i + 12])
      assert not any(window in d for d in only_validation) or window in train_text


def test_encdec_feature_converter_gives_the_contract_batch():
  lengths = {"inputs": 64, "targets": 16}
  ds = seqio.get_dataset(BUILTIN, lengths, dataset_split="train", shuffle=True, seed=0,
                         feature_converter=seqio.EncDecFeatureConverter(pack=False))
  batch = next(ds.batch(4).as_numpy_iterator())
  assert set(batch) == CONTRACT_FEATURES
  for name, array in batch.items():
    assert array.dtype == np.int32
    assert array.shape == (4, 64 if name.startswith("encoder") else 16)
  targets = batch["decoder_target_tokens"]
  np.testing.assert_array_equal(batch["decoder_input_tokens"][:, 1:], targets[:, :-1])
  assert np.all(batch["decoder_input_tokens"][:, 0] == 0)
  np.testing.assert_array_equal(batch["decoder_loss_weights"], targets != 0)
  # Span corruption of 64 inputs gives 14 targets: padded to 16, and inputs are full.
  assert np.all((targets != 0).sum(1) == span_corruption.target_length(64))
  assert np.all(batch["encoder_input_tokens"][:, -1] == 1)


def test_shuffled_reads_are_deterministic_given_the_seed():
  lengths = {"inputs": 64, "targets": 16}
  _, a = _examples(BUILTIN, "train", lengths, n=3, shuffle=True, seed=5)
  _, b = _examples(BUILTIN, "train", lengths, n=3, shuffle=True, seed=5)
  _, c = _examples(BUILTIN, "train", lengths, n=3, shuffle=True, seed=6)
  assert a == b and a != c


def test_c4_task_reads_tfds_offline_with_mock_data():
  _needs_t5_vocab()
  span_corruption_tasks.register_c4(str(T5_VOCAB))
  try:
    with tfds.testing.mock_data(num_examples=12):  # random words: a few chunks' worth
      for split in ("train", "validation"):
        task, examples = _examples(C4, split, {"inputs": 64, "targets": 16}, n=2)
        assert len(examples) == 2
        for ex in examples:
          assert ex["inputs"][-1] == 1 and ex["targets"][-1] == 1
          assert len(ex["inputs"]) == 64
          assert ex["targets"][0] == 32099  # the T5 vocabulary's first sentinel
  finally:
    span_corruption_tasks.register_c4()  # back to the default registration


def test_missing_tfds_data_says_how_to_prepare_it(tmp_path, monkeypatch):
  monkeypatch.setenv("DECAL_TFDS_DATA_DIR", str(tmp_path))
  for shards in (1, 2):  # one process, or sharded over several
    with pytest.raises(FileNotFoundError) as error:
      seqio.get_dataset(C4, {"inputs": 64, "targets": 16}, dataset_split="train",
                        shuffle=False, shard_info=seqio.ShardInfo(0, shards),
                        feature_converter=seqio.EncDecFeatureConverter(pack=False))
    message = str(error.value)
    for needed in ("tfds build c4/en", "DECAL_TFDS_DATA_DIR", str(tmp_path), BUILTIN,
                   "no download"):
      assert needed in message
  assert not list(tmp_path.iterdir())  # it never started a download or a build


def test_t5_vocabulary_from_shared_data():
  _needs_t5_vocab()
  vocab = vocabularies.t5_vocabulary(str(T5_VOCAB))
  assert vocab.vocab_size == 32100
  assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
  text = "Latent tokens summarise windows of the encoder input."
  ids = vocab.encode(text)
  assert 2 not in ids and max(ids) < 32000 and vocab.decode(ids) == text


def test_t5_vocabulary_path_comes_from_the_environment(monkeypatch):
  _needs_t5_vocab()
  monkeypatch.setenv("DECAL_T5_VOCAB", str(T5_VOCAB))
  assert vocabularies.t5_vocabulary().sentencepiece_model_file == str(T5_VOCAB)
  monkeypatch.delenv("DECAL_T5_VOCAB")
  assert vocabularies.t5_vocabulary(check=False).sentencepiece_model_file.startswith("gs://")


def test_missing_t5_vocabulary_names_the_path_and_the_fix(tmp_path):
  missing = tmp_path / "nope.model"
  with pytest.raises(FileNotFoundError) as error:
    vocabularies.t5_vocabulary(str(missing))
  assert str(missing) in str(error.value) and "DECAL_T5_VOCAB" in str(error.value)
  lazy = vocabularies.t5_vocabulary(str(missing), check=False)  # reported on first use
  with pytest.raises(FileNotFoundError, match="t5_spiece.model"):
    lazy.encode("text")
