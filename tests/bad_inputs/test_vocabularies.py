"""Vocabularies and optimizer state: text round-trips through the built-in vocabulary; a run
read with another vocabulary than it was trained with (MODEL_DIR/vocabulary.json) or with
another optimizer-state layout is refused, naming both and the fix."""
import hashlib
import json
import logging
import pathlib
import shutil

import gin
import jax.numpy as jnp
import pytest

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax import models
from decal_jax.runtime import checkpoints, evaluation, trainer, vocabulary_record
from decal_jax.data import vocabularies

from test_trainer import LENGTHS, _cfg, _model, _optimizer

from bad_input_helpers import _train_tiny, _copy, _files, _params


def test_dollar_pound_accents_cyrillic_cjk_and_emoji_round_trip_through_the_builtin_vocabulary():
  """Byte fallback: every byte of the text is spelled by some piece, none is unknown."""
  vocab = vocabularies.builtin_vocabulary()
  text = "Price: $5 or £3, café crème, жук, 中文, 🙂 — naïve Ørsted"
  ids = list(vocab.encode(text))
  assert vocab.unk_id not in ids
  assert vocab.decode(ids) == text
  pieces = [vocab.tokenizer.id_to_piece(i) for i in ids]
  assert "<0xD0>" in pieces and "<0xF0>" in pieces  # ж and 🙂 spelled in UTF-8 bytes
  assert pathlib.Path(vocab.sentencepiece_model_file).name.startswith(
      f"builtin_spm_{vocabularies.BUILTIN_VOCAB_SIZE}_bytes_")


# ================================================================ issue 21: a run read with
# another vocabulary than it was trained with (MODEL_DIR/vocabulary.json)
def _model_of(vocabulary):
  """The tiny model (4224 embedding rows) reading `vocabulary`."""
  return models.EncoderDecoderModel(_model().module, vocabulary, vocabulary)


def _chars_vocabulary():
  return vocabularies.builtin_vocabulary(recipe="chars")  # the recipe before byte fallback


def _tiny_vocabulary(path, words):
  """A SentencePiece model trained on a few sentences of `words` (read as T5's would be)."""
  texts = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20
  vocabularies.train_sentencepiece(texts, path, vocab_size=300)
  return vocabularies.t5_vocabulary(str(path))


def test_resuming_a_checkpoint_of_the_earlier_adafactor_factoring_names_the_setting(tmp_path):
  """Attention kernels [embed, heads, kv] used to keep a full second moment (optax's shape
  heuristic); now [embed] and [heads, kv] ones (T5X's axis names). An old run's optimizer
  state cannot be read into the new layout: refused naming the setting that reads it, and
  resumed with that setting."""
  from decal_jax.runtime import optimizers
  earlier = lambda: optimizers.adafactor(
      optimizers.rsqrt_schedule(0.5, warmup_steps=5), factor_by_axis_names=False)
  model_dir = tmp_path / "run"
  run = lambda steps, optimizer: trainer.train(
      model=_model(), train_dataset_cfg=_cfg(), model_dir=str(model_dir), total_steps=steps,
      optimizer=optimizer, checkpoint_period=1, eval_period=1000, eval_batches=1,
      log_period=1, show_example=False)
  run(1, earlier())
  before = _files(model_dir)
  with pytest.raises(checkpoints.OptimizerStateMismatchError) as err:
    _train_tiny(model_dir, 2)
  message = str(err.value)
  assert message.startswith(f"checkpoint_1 in {model_dir} is intact, with this run's "
                            "architecture, but its optimizer state has other shapes")
  assert "--gin.optimizers.adafactor.factor_by_axis_names=False" in message
  assert "Nothing was changed on disk." in message
  assert _files(model_dir) == before
  run(2, earlier())
  assert (model_dir / "checkpoint_2").is_dir()


@pytest.mark.parametrize("other", ["heuristic factoring", "adamw"])
def test_another_optimizer_state_is_refused_from_the_metadata_before_any_array_is_read(
    tmp_path, other):
  """The saved optimizer state's shapes (Orbax metadata) are compared with what this run's
  optimizer makes before restoring: the message names the leaf and both shapes, and no
  array of the state is read."""
  from flax.linen.partitioning import AxisMetadata
  from decal_jax.runtime import optimizers
  params = {"attn": {"kernel": jnp.zeros((8, 2, 3))}}
  axes = {"attn": {"kernel_axes": AxisMetadata(("embed", "heads", "kv"))}}
  written = (optimizers.adamw() if other == "adamw"
             else optimizers.adafactor(factor_by_axis_names=False))
  ckpt = checkpoints.Checkpointer(str(tmp_path))
  ckpt.save(1, {"params": params, "opt_state": written.init(params),
                "step": jnp.zeros((), jnp.int32)}, {"batches_consumed": 1}, force=True)
  current = optimizers.adafactor()
  optimizers.set_param_axes(current, axes)
  state = {"params": params, "opt_state": current.init(params), "step": jnp.zeros((), jnp.int32)}
  reads = []
  restore = ckpt.manager.restore
  ckpt.manager.restore = lambda step, args: reads.append(sorted(args.keys())) or restore(
      step, args=args)
  with pytest.raises(checkpoints.OptimizerStateMismatchError) as err:
    ckpt.restore(1, checkpoints.abstract_like(state))
  assert all("state" not in items for items in reads)
  message = str(err.value)
  if other == "adamw":  # AdamW's moments mu / nu in place of Adafactor's v_row / v_col
    assert "only in the model:      0/v_row/attn/kernel [8]" in message
    assert "only in the checkpoint: 1/0/mu/attn/kernel [8, 2, 3]" in message
  else:  # the full second moment the heuristic kept, [embed] / [heads, kv] ones now
    assert "shape differs:          0/v/attn/kernel checkpoint [8, 2, 3] vs model [1]" in message
    assert "0/v_col/attn/kernel checkpoint [1] vs model [2, 3]" in message
  ckpt.close()


def test_resuming_with_another_vocabulary_is_refused_naming_both_and_the_fix(
    two_checkpoints, tmp_path):
  model_dir = _copy(two_checkpoints, tmp_path)
  before = _files(model_dir)
  with pytest.raises(vocabulary_record.VocabularyMismatchError) as err:
    trainer.train(model=_model_of(_chars_vocabulary()), train_dataset_cfg=_cfg(),
                  model_dir=str(model_dir), total_steps=3, optimizer=_optimizer(),
                  show_example=False)
  message = str(err.value)
  assert message.startswith(f"{model_dir} was trained with another inputs vocabulary")
  assert ("vocabulary.json records the built-in vocabulary, recipe 'bytes' "
          "(builtin_spm_4000_bytes_") in message
  assert "this run has the built-in vocabulary, recipe 'chars' (builtin_spm_4000_" in message
  assert ("Fix: read it with the built-in vocabulary of recipe 'bytes': set "
          "DECAL_BUILTIN_VOCAB=bytes") in message
  assert "give another MODEL_DIR" in message
  assert _files(model_dir) == before


def test_starting_from_a_checkpoint_of_another_vocabulary_is_refused(two_checkpoints, tmp_path):
  """INITIAL_CHECKPOINT_PATH: the chars recipe's table has the same 4224 (padded) rows as the
  bytes one the run was trained with, so every row would be restored and mean another piece."""
  new_dir = tmp_path / "fine_tune"
  with gin.unlock_config():  # the task tokenizes with the model's vocabulary, as gin binds it
    gin.bind_parameter("decal_jax.data.vocabularies.task_vocabulary.vocabulary",
                       _chars_vocabulary())
  try:
    for start in (two_checkpoints, two_checkpoints / "checkpoint_2"):
      with pytest.raises(vocabulary_record.VocabularyMismatchError) as err:
        trainer.train(model=_model_of(_chars_vocabulary()), train_dataset_cfg=_cfg(),
                      model_dir=str(new_dir), total_steps=3, optimizer=_optimizer(),
                      initial_checkpoint_path=str(start), show_example=False)
      message = str(err.value)
      assert message.startswith(f"INITIAL_CHECKPOINT_PATH {start} was trained with another "
                                "inputs vocabulary than this run's")
      assert "Its embedding rows would be restored and read as other text" in message
      assert "DECAL_BUILTIN_VOCAB=bytes" in message
      assert not list(new_dir.glob("checkpoint_*"))
  finally:
    gin.clear_config()


@pytest.mark.parametrize("entry", ["evaluate", "infer", "restore_params"])
def test_eval_and_infer_of_a_run_trained_with_another_vocabulary_are_refused(
    two_checkpoints, tmp_path, entry):
  """A run trained with the 'chars' built-in vocabulary, read with today's 'bytes' one."""
  model_dir = _copy(two_checkpoints, tmp_path)
  vocabulary_record.write(str(model_dir),
                          vocabulary_record.model_record(_model_of(_chars_vocabulary())))
  before = _files(model_dir)
  with pytest.raises(vocabulary_record.VocabularyMismatchError) as err:
    if entry == "evaluate":
      evaluation.evaluate(model=_model(), eval_dataset_cfg=_cfg(split="validation"),
                          model_dir=str(model_dir), eval_batches=1)
    elif entry == "infer":
      evaluation.infer(model=_model(), inputs=["some text"], model_dir=str(model_dir),
                       task_feature_lengths=LENGTHS)
    else:
      _params(model_dir, None)  # what gin_utils.load_model and retrieval restore with
  message = str(err.value)
  assert message.startswith(f"{model_dir} was trained with another inputs vocabulary")
  assert "records the built-in vocabulary, recipe 'chars' (builtin_spm_4000_" in message
  assert "this run has the built-in vocabulary, recipe 'bytes'" in message
  assert ("Fix: read it with the built-in vocabulary of recipe 'chars': set "
          "DECAL_BUILTIN_VOCAB=chars") in message
  assert _files(model_dir) == before


def test_infer_with_another_sentencepiece_file_is_refused_naming_the_file_to_point_back_at(
    two_checkpoints, tmp_path):
  trained = _tiny_vocabulary(tmp_path / "trained.model", ["alpha", "beta", "gamma", "delta"])
  other = _tiny_vocabulary(tmp_path / "other.model", ["red", "green", "blue", "yellow"])
  model_dir = _copy(two_checkpoints, tmp_path)
  vocabulary_record.write(str(model_dir), vocabulary_record.model_record(_model_of(trained)))
  before = _files(model_dir)
  with pytest.raises(vocabulary_record.VocabularyMismatchError) as err:
    evaluation.infer(model=_model_of(other), inputs=["red"], model_dir=str(model_dir),
                     task_feature_lengths=LENGTHS)
  message = str(err.value)
  digest = hashlib.sha256((tmp_path / "trained.model").read_bytes()).hexdigest()
  assert f"records T5Vocabulary (trained.model, sha256 {digest[:12]}, " in message
  assert "this run has T5Vocabulary (other.model, sha256 " in message
  assert (f"Fix: point the vocabulary's path back at the file it was trained with, "
          f"trained.model (sha256 {digest[:12]}): DECAL_T5_VOCAB") in message
  assert _files(model_dir) == before
  # The same model under another name and folder is the same vocabulary: accepted.
  copy = tmp_path / "elsewhere" / "renamed.model"
  copy.parent.mkdir()
  shutil.copy(tmp_path / "trained.model", copy)
  assert vocabulary_record.check(str(model_dir),
                                 _model_of(vocabularies.t5_vocabulary(str(copy)))) is None


def test_a_run_without_a_vocabulary_record_warns_naming_it_and_gets_none_written(
    two_checkpoints, tmp_path, caplog):
  model_dir = _copy(two_checkpoints, tmp_path)
  (model_dir / vocabulary_record.FILENAME).unlink()  # a run from before the record
  before = _files(model_dir)
  with caplog.at_level(logging.WARNING):
    evaluation.infer(model=_model(), inputs=["some text"], model_dir=str(model_dir),
                     task_feature_lengths=LENGTHS)
  warnings = [r for r in caplog.records if "does not record the vocabulary" in r.getMessage()]
  assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
  message = warnings[0].getMessage()
  assert message.startswith(f"{model_dir} does not record the vocabulary")
  assert "DECAL_BUILTIN_VOCAB=chars" in message
  assert _files(model_dir) == before
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    _train_tiny(model_dir, 3)  # resumed: warned again, and still no record written
  assert any(f"{model_dir} does not record the vocabulary" in r.getMessage()
             for r in caplog.records)
  assert not (model_dir / vocabulary_record.FILENAME).exists()


def test_resuming_with_the_vocabulary_it_was_trained_with_goes_on(two_checkpoints, tmp_path,
                                                                   capsys):
  model_dir = _copy(two_checkpoints, tmp_path)
  record = (model_dir / vocabulary_record.FILENAME).read_bytes()
  # What the new run recorded: the file it read, its sha256, its recipe, for both features.
  vocab_file = pathlib.Path(vocabularies.builtin_vocabulary().sentencepiece_model_file)
  inputs = json.loads(record)["features"]["inputs"]
  assert json.loads(record)["features"]["targets"] == inputs
  assert inputs == {"class": "BuiltinVocabulary", "file": vocab_file.name, "recipe": "bytes",
                    "sha256": hashlib.sha256(vocab_file.read_bytes()).hexdigest(),
                    "vocab_size": vocabularies.builtin_vocabulary().vocab_size}
  _train_tiny(model_dir, 3)
  assert "Resuming from step 2" in capsys.readouterr().out
  assert (model_dir / "checkpoint_3").is_dir()
  assert (model_dir / vocabulary_record.FILENAME).read_bytes() == record
