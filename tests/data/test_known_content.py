"""tasks/known_content_tasks.py: examples whose information content is known exactly. Checked
against what must hold: one token per symbol, the stated symbol distribution (a chi-square
bound), the planted repetition, determinism per index, and hand-worked bits and metrics."""
import math

import numpy as np
import pytest
import seqio

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax.tasks import known_content_tasks as known


def _examples(name: str, split: str, count: int, length: int):
  task = seqio.get_mixture_or_task(name)
  ds = task.get_dataset({"inputs": length, "targets": length}, split=split, shuffle=False,
                        use_cached=False)
  return [{k: v.numpy() for k, v in ex.items()} for ex in ds.take(count)]


def test_bits_are_hand_worked():
  assert known.information_bits("uniform", 16, 15) == 60.0  # 15 x log2 16
  assert known.information_bits("repeat", 16, 15) == 32.0  # ceil(15 / 2) = 8 free symbols
  assert known.information_bits("uniform", 4, 31) == 62.0


def test_every_symbol_is_one_id_and_the_target_is_the_input():
  vocab = known.symbol_vocabulary()
  assert vocab.vocab_size == 67  # pad, EOS, unknown + 64 symbols: fits a 128-row model
  assert vocab.encode("s00 s15 s63") == [3, 18, 66]
  assert vocab.encode("s64 x s0") == [vocab.unk_id] * 3  # no such symbol
  assert vocab.decode([3, 18, 66, 1, 5]) == "s00 s15 s63"  # stops at EOS
  rows = _examples("decal_known_uniform_k16_n15", "validation", 8, 16)
  for row in rows:
    assert row["inputs"][-1] == vocab.eos_id and len(row["inputs"]) == 16  # 15 symbols + EOS
    assert set(row["inputs"][:-1].tolist()) <= set(range(3, 3 + 16))  # the first k symbols
    np.testing.assert_array_equal(row["inputs"], row["targets"])
    assert vocab.decode(row["inputs"].tolist()) == row["inputs_pretokenized"].decode()


def test_the_tensorflow_encoding_equals_the_python_one():
  import tensorflow as tf
  vocab = known.symbol_vocabulary()
  text = "s07 s00 s99 s63 zz s12"
  assert vocab.encode_tf(tf.constant(text)).numpy().tolist() == vocab.encode(text)
  assert vocab.decode_tf(tf.constant([10, 3, 2, 66, 1, 0])).numpy().decode() == "s07 s00 s63"


def test_uniform_symbols_have_the_stated_distribution():
  """512 x 15 draws from 16 symbols: the chi-square statistic of the counts stays below its
  0.1 % critical value (15 degrees of freedom: 37.70), and the mean position-to-position
  agreement is 1/16 as for independent draws."""
  rows = _examples("decal_known_uniform_k16_n15", "validation", 512, 16)
  symbols = np.stack([r["inputs"][:-1] for r in rows])  # [512, 15]
  _, counts = np.unique(symbols, return_counts=True)
  expected = symbols.size / 16
  assert len(counts) == 16
  assert np.sum((counts - expected) ** 2 / expected) < 37.70
  same = np.mean(symbols[:, 1:] == symbols[:, :-1])
  assert abs(same - 1 / 16) < 5 * math.sqrt((1 / 16) * (15 / 16) / symbols[:, 1:].size)


def test_repeat_plants_the_first_half_again():
  for row in _examples("decal_known_repeat_k4_n15", "validation", 16, 16):
    s = row["inputs"][:-1]  # [15]: 8 free symbols, then the first 7 again
    np.testing.assert_array_equal(s[8:], s[:7])


def test_examples_are_a_function_of_split_and_index():
  first = _examples("decal_known_uniform_k16_n15", "validation", 4, 16)
  again = _examples("decal_known_uniform_k16_n15", "validation", 4, 16)
  train = _examples("decal_known_uniform_k16_n15", "train", 4, 16)
  for a, b, c in zip(first, again, train):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], c["inputs"])  # 16^15 sequences: never equal by chance


def test_reconstruction_metric_is_hand_worked():
  targets = ["is of to", "the be an"]
  predictions = ["is of to", "the an"]  # 2nd: 'the' right, 'an' in the 2nd slot is wrong
  assert known.reconstruction(targets, predictions) == {
      "exact": 50.0, "symbol_accuracy": pytest.approx(100 * 4 / 6)}


def test_an_alphabet_larger_than_the_vocabulary_allows_is_refused():
  with pytest.raises(ValueError, match="from 2 to 64"):
    known.register_known_task("uniform", 65, 15)
