"""The input pipeline's saved position: a restored iterator continues the uninterrupted
stream batch for batch; a pipeline TF cannot save says why and is re-read instead."""
import numpy as np
import pytest
import seqio
import tensorflow as tf

import decal_jax.tasks  # noqa: F401  (registers the seqio tasks)
from decal_jax.data import pipeline
from decal_jax.data import batch_iterator


class _EncDec:
  FEATURE_CONVERTER_CLS = seqio.EncDecFeatureConverter


def _span_corruption_batches():
  """The built-in pretraining task, shuffled and prefetched, as training reads it."""
  cfg = pipeline.DatasetConfig("decal_builtin_span_corruption", {"inputs": 32, "targets": 12},
                               batch_size=4, shuffle=True, seed=3)
  return pipeline.train_batches(cfg, _EncDec())


def _assert_same_batches(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert sorted(g) == sorted(w)
    for k in w:
      np.testing.assert_array_equal(g[k], w[k])


def test_restored_position_continues_the_uninterrupted_stream(tmp_path):
  straight = _span_corruption_batches()
  want = [next(straight) for _ in range(7)]

  first = _span_corruption_batches()
  assert first.checkpointable, first.unsavable_reason
  for _ in range(4):
    next(first)
  first.save(str(tmp_path / "position"))
  resumed = _span_corruption_batches()
  resumed.restore(str(tmp_path / "position"))
  _assert_same_batches([next(resumed) for _ in range(3)], want[4:])


def _generator_batches():
  ds = tf.data.Dataset.from_generator(lambda: ({"x": np.full((2,), i)} for i in range(50)),
                                      output_signature={"x": tf.TensorSpec((2,), tf.int64)})
  return batch_iterator.BatchIterator(ds.batch(3))


def test_a_generator_pipeline_is_unsavable_and_advance_reaches_the_same_batch():
  batches = _generator_batches()
  batches.advance(4)
  # Known once started: TF saves a fresh generator iterator, not a started one.
  assert not batches.checkpointable
  assert "GeneratorDataset does not support checkpointing" in batches.unsavable_reason
  # Batch 5 holds examples 12, 13, 14 (hand count: 4 batches of 3 were dropped).
  np.testing.assert_array_equal(next(batches)["x"], [[12, 12], [13, 13], [14, 14]])


def test_process_file_names_each_process():
  assert batch_iterator.process_file(1, 4) == "process_1-of-4"


def _numbers(shuffle: bool):
  ds = tf.data.Dataset.range(100).map(lambda x: {"x": x})
  return batch_iterator.BatchIterator((ds.shuffle(10, seed=1) if shuffle else ds).batch(2))


def test_a_position_saved_by_another_pipeline_is_refused_by_tf(tmp_path):
  saved = _numbers(shuffle=True)
  next(saved)
  saved.save(str(tmp_path / "position"))
  with pytest.raises(tf.errors.OpError, match="dataset definition has not changed"):
    _numbers(shuffle=False).restore(str(tmp_path / "position"))


class _CheckpointOfAnotherPipeline:
  """A checkpoint at step 3 whose saved input position TF refuses (as above)."""

  def latest_step(self):
    return 3

  def restore_dataset(self, step, batches):
    raise tf.errors.NotFoundError(None, None, "Failed to restore dataset iterator from "
                                  "checkpoint: Iterator::Root::Prefetch::BatchV2::Range.")


def test_resume_falls_back_to_rereading_when_the_saved_position_does_not_fit(capsys):
  cfg = pipeline.DatasetConfig("decal_builtin_span_corruption", {"inputs": 32, "targets": 12},
                               batch_size=4, shuffle=True, seed=3)
  position = {"batches_consumed": 3, "seed": 3, "rng": [0, 1]}
  checkpoint = _CheckpointOfAnotherPipeline()
  batches = pipeline.resume_batches(cfg, _EncDec(), None, checkpoint.latest_step(),
                                    checkpoint.restore_dataset, position)
  assert "cannot take (Failed to restore dataset iterator" in capsys.readouterr().out
  straight = _span_corruption_batches()
  want = [next(straight) for _ in range(4)][-1]
  _assert_same_batches([next(batches)], [want])


def test_after_a_change_of_data_seed_the_new_order_starts_from_its_beginning(capsys):
  cfg = pipeline.DatasetConfig("decal_builtin_span_corruption", {"inputs": 32, "targets": 12},
                               batch_size=4, shuffle=True, seed=3)
  position = {"batches_consumed": 3, "seed": 3, "rng": [0, 1], "seed_changed": True}
  checkpoint = _CheckpointOfAnotherPipeline()
  batches = pipeline.resume_batches(cfg, _EncDec(), None, checkpoint.latest_step(),
                                    checkpoint.restore_dataset, position)
  assert "note" not in capsys.readouterr().out  # neither restored nor re-read
  _assert_same_batches([next(batches)], [next(_span_corruption_batches())])
