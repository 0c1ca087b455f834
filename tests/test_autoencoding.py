"""Autoencoding / continuation preprocessors and the 1:1 mixture (CCProxy's recipe)."""
import numpy as np
import pytest
import seqio
import tensorflow as tf

import decal_jax.tasks  # noqa: F401
from decal_jax import models, trainer
from decal_jax.data import autoencoding, vocabularies
from decal_jax.networks.t5 import T5Config, Transformer


def _docs(*lengths):
  """Tokenized documents whose ids count up across documents: 1, 2, 3, ..."""
  out, start = [], 1
  for n in lengths:
    out.append(list(range(start, start + n)))
    start += n
  return tf.data.Dataset.from_generator(
      lambda: ({"targets": np.array(d, np.int32)} for d in out),
      output_signature={"targets": tf.TensorSpec([None], tf.int32)})


def _list(ds):
  return [{k: v.tolist() for k, v in ex.items()} for ex in ds.as_numpy_iterator()]


def test_autoencode_hand_worked():
  got = _list(autoencoding.autoencode(_docs(3, 4), {"inputs": 4, "targets": 4}))
  assert got == [{"inputs": [1, 2, 3], "targets": [1, 2, 3]},
                 {"inputs": [4, 5, 6], "targets": [4, 5, 6]},
                 {"inputs": [7], "targets": [7]}]


def test_continuation_hand_worked():
  # inputs 4 -> 3 prefix tokens, targets 3 -> 2 continuation tokens: chunks of 5.
  got = _list(autoencoding.continuation(_docs(6, 6), {"inputs": 4, "targets": 3}))
  assert got == [{"inputs": [1, 2, 3], "targets": [4, 5]},
                 {"inputs": [6, 7, 8], "targets": [9, 10]},
                 {"inputs": [11], "targets": [12]}]  # short chunk: target first, input >= 1


def test_continuation_pieces_rebuild_the_stream():
  lengths = {"inputs": 17, "targets": 9}
  got = _list(autoencoding.continuation(_docs(40, 7, 100, 3), lengths))
  stream = [t for ex in got for t in ex["inputs"] + ex["targets"]]
  assert stream == list(range(1, 151))
  assert all(1 <= len(ex["inputs"]) <= 16 and 1 <= len(ex["targets"]) <= 8 for ex in got)


def test_mixture_is_about_half_autoencoding():
  lengths = {"inputs": 64, "targets": 64}
  ds = seqio.get_mixture_or_task("decal_builtin_autoencode_continuation").get_dataset(
      lengths, split="train", shuffle=True, seed=3)
  kinds = [bool(np.array_equal(ex["inputs"], ex["targets"]))
           for ex in ds.take(400).as_numpy_iterator()]
  share = np.mean(kinds)
  assert 0.4 < share < 0.6, share  # binomial(400, 0.5): 4.0 standard deviations either side


def test_autoencoding_with_short_targets_is_refused():
  vocab = vocabularies.builtin_vocabulary()
  model = models.EncoderDecoderModel(Transformer(T5Config(vocab_size=4224)), vocab, vocab)
  cfg = trainer.DatasetConfig("decal_builtin_autoencode_continuation",
                              {"inputs": 64, "targets": 16})
  with pytest.raises(ValueError, match="autoencodes.*Set 'targets' >= 'inputs'"):
    trainer.check_feature_lengths(cfg, model)
