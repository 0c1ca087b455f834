"""Span corruption, the built-in corpus, vocabularies and the seqio tasks."""
import os
import pathlib

import numpy as np
import pytest
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax.data import corpus, span_corruption, vocabularies

VOCAB_SIZE = 1000
DATA_DIR = pathlib.Path(os.environ.get(
    "DECAL_DATA_DIR", pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"))


def _corrupt(length, seed):
  tokens = tf.range(3, 3 + length)  # distinct ids below the sentinel range
  seeds = tf.constant([[seed, 1], [seed, 2]])
  out = span_corruption.corrupt(tokens, seeds, VOCAB_SIZE)
  return np.arange(3, 3 + length), out["inputs"].numpy(), out["targets"].numpy()


def _reassemble(inputs, targets):
  """Plain-python inverse: replace each sentinel in the inputs by the span that follows the
  same sentinel in the targets."""
  spans, current = {}, None
  for tok in targets:
    if tok >= VOCAB_SIZE - 100:
      current = int(tok)
      spans[current] = []
    else:
      spans[current].append(int(tok))
  out = []
  for tok in inputs:
    out.extend(spans[int(tok)] if tok >= VOCAB_SIZE - 100 else [int(tok)])
  return out


@pytest.mark.parametrize("length", [10, 57, 141, 568])
def test_inputs_and_targets_reassemble_the_original(length):
  for seed in range(5):
    original, inputs, targets = _corrupt(length, seed)
    assert _reassemble(inputs, targets) == list(original)


def test_sentinels_count_down_from_the_top_of_the_vocabulary():
  _, inputs, targets = _corrupt(200, 0)
  sentinels = [t for t in inputs if t >= VOCAB_SIZE - 100]
  assert sentinels == list(range(VOCAB_SIZE - 1, VOCAB_SIZE - 1 - len(sentinels), -1))
  assert [t for t in targets if t >= VOCAB_SIZE - 100] == sentinels
  assert targets[0] == VOCAB_SIZE - 1  # the target starts with the first sentinel


def test_noise_density_and_mean_span_length_statistics():
  noise, spans, total = 0, 0, 0
  for seed in range(300):
    mask = span_corruption.noise_mask(tf.constant(100), tf.constant([[seed, 7], [seed, 8]]))
    mask = mask.numpy()
    noise += mask.sum()
    spans += np.sum(mask & ~np.concatenate([[False], mask[:-1]]))
    total += mask.size
  assert abs(noise / total - 0.15) < 0.01
  assert abs(noise / spans - 3.0) < 0.15
  assert not mask[0]  # every mask starts with a clean run


def test_corruption_is_deterministic_given_the_seed():
  a = _corrupt(141, 3)
  b = _corrupt(141, 3)
  c = _corrupt(141, 4)
  np.testing.assert_array_equal(a[1], b[1])
  assert not np.array_equal(a[1], c[1])


@pytest.mark.parametrize("inputs_length", [32, 128, 512, 1024])
def test_chunk_length_fits_inputs_exactly(inputs_length):
  chunk, target_len = span_corruption.chunk_and_target_lengths(inputs_length)
  # Corrupt a chunk of that length: inputs + EOS must fit, and one more token must not.
  for length, fits in ((chunk, True), (chunk + 1, False)):
    _, inputs, targets = _corrupt(length, 0)
    assert (len(inputs) + 1 <= inputs_length) == fits
  _, inputs, targets = _corrupt(chunk, 0)
  assert len(targets) + 1 == target_len
  if inputs_length == 512:  # T5's published setting: 568 raw tokens, 114 target tokens
    assert (chunk, target_len) == (568, 114)


def test_builtin_corpus_splits_do_not_overlap_and_are_stable():
  docs = corpus.documents()
  train, validation = set(docs["train"]), set(docs["validation"])
  assert len(train) > 500 and len(validation) > 30
  assert not train & validation
  ratio = len(validation) / (len(train) + len(validation))
  assert 0.03 < ratio < 0.15
  for doc in docs["validation"][:20]:  # the split is a function of the text alone
    assert corpus._split_of(doc) == "validation"


def test_builtin_vocabulary_special_ids_roundtrip_and_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("DECAL_CACHE_DIR", str(tmp_path))
  path = pathlib.Path(vocabularies.builtin_vocabulary_path(vocab_size=800))
  assert path.exists() and corpus.corpus_fingerprint() in path.name
  mtime = path.stat().st_mtime_ns
  vocab = seqio.SentencePieceVocabulary(str(path), extra_ids=100)
  assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
  for text in corpus.documents()["validation"][:10]:
    assert vocab.decode(vocab.encode(text)) == text
  vocabularies.builtin_vocabulary_path(vocab_size=800)
  assert path.stat().st_mtime_ns == mtime  # reused, not retrained
  assert not list(tmp_path.glob("*.tmp*"))  # atomic write leaves no temp files


def test_t5_vocabulary_from_shared_data():
  path = DATA_DIR / "vocab" / "t5_spiece.model"
  if not path.exists():
    pytest.skip(f"shared data not found at {path} (set DECAL_DATA_DIR)")
  vocab = vocabularies.t5_vocabulary(str(path))
  assert vocab.vocab_size == 32100
  text = "DeCAL compresses the encoder input."
  assert vocab.decode(vocab.encode(text)) == text


def test_missing_t5_vocabulary_names_the_fix(tmp_path):
  with pytest.raises(FileNotFoundError, match="DECAL_T5_VOCAB"):
    vocabularies.t5_vocabulary(str(tmp_path / "nope.model"))


def _first_examples(task_name, split, n, lengths):
  task = seqio.get_mixture_or_task(task_name)
  ds = task.get_dataset(lengths, split=split, shuffle=False)
  return task, [ex for _, ex in zip(range(n), ds.as_numpy_iterator())]


def test_builtin_task_yields_corpus_text_with_sentinels():
  lengths = {"inputs": 64, "targets": 16}
  task, examples = _first_examples("decal_builtin_span_corruption", "validation", 3, lengths)
  vocab = task.output_features["inputs"].vocabulary
  validation_text = " ".join(corpus.documents()["validation"])
  for ex in examples:
    assert ex["inputs"][-1] == 1 and len(ex["inputs"]) <= 64  # EOS-terminated, fits
    sentinels = [t for t in ex["inputs"] if t >= vocab.vocab_size - 100]
    assert sentinels and sentinels[0] == vocab.vocab_size - 1
    clean = [t for t in ex["inputs"][:-1] if t < vocab.vocab_size - 100]
    words = vocab.decode([int(t) for t in clean]).split()
    known = set(validation_text.split())
    # Real held-out text: nearly every word occurs in the validation documents (words cut
    # by a span or joined across a document boundary may not).
    assert np.mean([w in known for w in words]) > 0.8


def test_encdec_feature_converter_produces_the_contract_features():
  ds = seqio.get_dataset("decal_builtin_span_corruption", {"inputs": 64, "targets": 16},
                         feature_converter=seqio.EncDecFeatureConverter(pack=False),
                         dataset_split="train", shuffle=False)
  ex = next(ds.as_numpy_iterator())
  assert set(ex) == {"encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens",
                     "decoder_loss_weights"}
  assert ex["encoder_input_tokens"].shape == (64,) and ex["decoder_target_tokens"].shape == (16,)
  np.testing.assert_array_equal(ex["decoder_input_tokens"][1:], ex["decoder_target_tokens"][:-1])


def test_c4_task_reads_tfds_offline_with_mock_data(monkeypatch):
  path = DATA_DIR / "vocab" / "t5_spiece.model"
  if not path.exists():
    pytest.skip(f"shared data not found at {path} (set DECAL_DATA_DIR)")
  monkeypatch.setenv("DECAL_T5_VOCAB", str(path))
  import importlib
  from decal_jax.tasks import span_corruption_tasks
  importlib.reload(span_corruption_tasks)  # re-register with the local vocabulary
  try:
    with tfds.testing.mock_data(num_examples=20):
      _, examples = _first_examples("decal_c4_span_corruption", "train", 2,
                                    {"inputs": 64, "targets": 16})
    assert examples and all(ex["inputs"][-1] == 1 for ex in examples)
    assert all(32099 in ex["inputs"] for ex in examples)  # T5 vocabulary's first sentinel
  finally:
    monkeypatch.delenv("DECAL_T5_VOCAB")
    importlib.reload(span_corruption_tasks)


def test_missing_tfds_data_says_how_to_prepare_it(tmp_path, monkeypatch):
  monkeypatch.setenv("DECAL_TFDS_DATA_DIR", str(tmp_path))
  import importlib
  from decal_jax.tasks import span_corruption_tasks
  importlib.reload(span_corruption_tasks)
  try:
    task = seqio.get_mixture_or_task("decal_c4_span_corruption")
    with pytest.raises(FileNotFoundError) as err:
      task.source.get_dataset("train", shuffle=False)
    message = str(err.value)
    assert "tfds build c4" in message and "decal_builtin_span_corruption" in message
  finally:
    monkeypatch.delenv("DECAL_TFDS_DATA_DIR")
    importlib.reload(span_corruption_tasks)


def test_make_vocab_tool_trains_from_jsonl(tmp_path, capsys):
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "make_vocab", pathlib.Path(__file__).resolve().parents[1] / "tools" / "make_vocab.py")
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  docs = corpus.documents()["train"][:200]
  src = tmp_path / "docs.jsonl"
  src.write_text("\n".join('{"text": %s}' % __import__("json").dumps(d) for d in docs))
  out = tmp_path / "v.model"
  tool.main(["--input", str(src), "--vocab_size", "300", "--output", str(out)])
  vocab = seqio.SentencePieceVocabulary(str(out))
  assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
  assert vocab.decode(vocab.encode(docs[0])) == docs[0]
  assert "vocabulary:" in capsys.readouterr().out
