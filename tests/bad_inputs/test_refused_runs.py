"""Validate before writing: a run whose train data, eval data or vocabulary is bad is refused
before MODEL_DIR gets its first file (config.gin, vocabulary.json, model-info.txt, the
train/ events), so a refused run leaves the folder as it found it: a new one not made, a
run's unchanged."""
import json

import gin
import pytest

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax import models
from decal_jax.runtime import trainer
from decal_jax.data import local_files, pipeline, seqio_vocabularies, vocabularies
from decal_jax.networks.t5 import T5Config, Transformer

from test_trainer import _model, _optimizer

from bad_input_helpers import _copy, _files, _write

QA_LENGTHS = {"inputs": 64, "targets": 16}
GOOD_QA = "".join(json.dumps({"question": f"Who wrote {n}?", "context": f"Ada wrote {n}.",
                              "answers": ["Ada"]}) + "\n" for n in range(4)).encode()


def _train_squad(model_dir, model=None, **kw):
  cfg = pipeline.DatasetConfig("decal_squad", QA_LENGTHS, batch_size=8)
  return trainer.train(model=model or _model(), train_dataset_cfg=cfg, model_dir=str(model_dir),
                       total_steps=2, optimizer=_optimizer(), eval_period=1000, eval_batches=1,
                       log_period=1, show_example=False, gin_config_text="# a config\n", **kw)


def test_a_bad_train_data_file_is_refused_before_model_dir_gets_a_file(local_data, tmp_path):
  train = _write(local_data / "squad" / "train.jsonl",
                 GOOD_QA + b'{"question": "Who?", "context": "caf\xe9", "answers": ["Ada"]}\n')
  _write(local_data / "squad" / "validation.jsonl", GOOD_QA)
  with pytest.raises(local_files.BadRecordError) as err:
    _train_squad(tmp_path / "run")
  assert str(err.value).startswith(f"{train}:5: not UTF-8")
  assert "DECAL_BAD_LINES=skip" in str(err.value)
  assert not (tmp_path / "run").exists()


def test_a_folder_named_as_the_eval_file_is_refused_before_model_dir_gets_a_file(local_data,
                                                                                  tmp_path):
  _write(local_data / "squad" / "train.jsonl", GOOD_QA)
  folder = local_data / "squad" / "validation.jsonl"
  _write(folder / "part-0.jsonl", GOOD_QA)
  with pytest.raises(IsADirectoryError) as err:
    _train_squad(tmp_path / "run")
  assert str(err.value) == (
      f"{folder} is a folder, not a data file: each split is one file (or a glob of files). "
      "Put the file there instead of the folder, or move the folder away.")
  assert not (tmp_path / "run").exists()


def test_an_empty_eval_file_leaves_a_runs_model_dir_as_it_was(local_data, tmp_path,
                                                              two_checkpoints):
  """Resuming a run (checkpoint_2 of 2 -> 3 steps) with an empty validation file: refused,
  and MODEL_DIR holds exactly what it held (no new config.gin, events, lock)."""
  _write(local_data / "squad" / "train.jsonl", GOOD_QA)
  empty = _write(local_data / "squad" / "validation.jsonl", b"\n\n")
  model_dir = _copy(two_checkpoints, tmp_path)
  before = _files(model_dir)
  cfg = pipeline.DatasetConfig("decal_squad", QA_LENGTHS, batch_size=8, split="validation")
  with pytest.raises(local_files.BadRecordError) as err:
    trainer.train(model=_model(), train_dataset_cfg=pipeline.DatasetConfig(
        "decal_builtin_span_corruption", {"inputs": 32, "targets": 12}, batch_size=8),
                  eval_dataset_cfg=cfg, model_dir=str(model_dir), total_steps=3,
                  optimizer=_optimizer(), show_example=False, gin_config_text="# another\n")
  assert str(err.value) == f"{empty}: no usable line (of 0 non-blank ones)."
  assert _files(model_dir) == before


def test_a_vocabulary_that_is_not_sentencepiece_is_refused_before_model_dir_gets_a_file(
    local_data, tmp_path):
  _write(local_data / "squad" / "train.jsonl", GOOD_QA)
  _write(local_data / "squad" / "validation.jsonl", GOOD_QA)
  path = _write(tmp_path / "spm.model", b'{"version": "1.0", "model": {}}')
  vocab = vocabularies.t5_vocabulary(str(path))
  with gin.unlock_config():
    gin.bind_parameter("decal_jax.data.vocabularies.task_vocabulary.vocabulary", vocab)
  cfg = T5Config(vocab_size=4224, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                 num_encoder_layers=2, num_decoder_layers=2, compression_ratio=4)
  model = models.EncoderDecoderModel(Transformer(cfg), vocab, vocab)
  with pytest.raises(seqio_vocabularies.NotSentencePieceError) as err:
    _train_squad(tmp_path / "run", model=model)
  assert str(err.value).startswith(f"{path} is not a SentencePiece model")
  assert not (tmp_path / "run").exists()


def test_a_split_that_gives_no_example_is_named(local_data, monkeypatch):
  """A task whose split yields nothing (e.g. every example filtered out) is named with the
  split; a good one passes."""
  import tensorflow as tf
  _write(local_data / "squad" / "validation.jsonl", GOOD_QA)
  cfg = pipeline.DatasetConfig("decal_squad", QA_LENGTHS, split="validation")
  pipeline.check_first_example(cfg, "eval")  # a good file: no error

  class NoExamples:
    def get_dataset(self, *args, **kwargs):
      return tf.data.Dataset.from_tensor_slices({"targets": [[1]]}).take(0)

  monkeypatch.setattr(pipeline, "get_task", lambda name: NoExamples())
  with pytest.raises(ValueError) as err:
    pipeline.check_first_example(cfg, "eval")
  assert str(err.value) == ("The eval data, split 'validation' of 'decal_squad', gives no "
                            "example: fill its file(s), or give another split or task.")
