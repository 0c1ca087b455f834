"""Damaged checkpoints: a truncated or deleted file is named and set aside (never deleted) and
the run resumes from the newest intact step; an initial checkpoint of another architecture
is refused with the counts."""

import jax
import numpy as np
import pytest

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax import partitioning
from decal_jax.runtime import checkpoints, evaluation, train_state, trainer

from test_trainer import LENGTHS, _cfg, _model, _optimizer

from bad_input_helpers import _copy, _files, _load_tool, _params, _train, _train_tiny, _write


# ---------------------------------------------------------------- checkpoints






def _truncate_largest_array_file(step_dir):
  """Truncates the biggest file of the saved state to 0 bytes, as a full disk would."""
  biggest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
  biggest.write_bytes(b"")
  return biggest






def test_a_truncated_latest_checkpoint_is_set_aside_and_training_resumes_before_it(
    two_checkpoints, tmp_path, capsys):
  model_dir = _copy(two_checkpoints, tmp_path)
  truncated = _truncate_largest_array_file(model_dir / "checkpoint_2")
  first = _files(model_dir / "checkpoint_1")
  _train_tiny(model_dir, 3)  # the same command again, with one more step
  out = capsys.readouterr().out
  lines = [line for line in out.splitlines() if "damaged" in line]
  assert len(lines) == 1, out  # one line: the checkpoint, the error, what was done
  assert f"checkpoint_2 in {model_dir} is damaged (" in lines[0]
  assert "set aside as checkpoint_2.damaged, resuming from checkpoint_1." in lines[0]
  assert "Resuming from step 1" in out
  # Nothing lost: the damaged one kept as it was, out of Orbax's listing; the one before
  # untouched; the run continued from step 1 and rewrote step 2 exactly as first written.
  aside = model_dir / "checkpoint_2.damaged" / truncated.relative_to(model_dir / "checkpoint_2")
  assert aside.exists() and aside.stat().st_size == 0
  assert _files(model_dir / "checkpoint_1") == first
  ckpt = checkpoints.Checkpointer(str(model_dir))
  assert ckpt.all_steps() == [1, 2, 3]
  ckpt.close()
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(model_dir, 2),
                         _params(two_checkpoints, 2))


def test_every_checkpoint_damaged_stops_the_run_naming_them_and_renames_nothing(
    two_checkpoints, tmp_path):
  model_dir = _copy(two_checkpoints, tmp_path)
  _truncate_largest_array_file(model_dir / "checkpoint_2")
  (model_dir / "checkpoint_1" / "state" / "_METADATA").unlink()  # partly deleted
  before = _files(model_dir)
  with pytest.raises(checkpoints.DamagedCheckpointError) as err:
    _train_tiny(model_dir, 3)
  message = str(err.value)
  assert f"Every checkpoint in {model_dir} is damaged: checkpoint_2 (" in message
  assert "; checkpoint_1 (FileNotFoundError: " in message
  assert "Nothing was changed on disk" in message and "new MODEL_DIR" in message
  assert _files(model_dir) == before


def test_eval_and_infer_name_a_damaged_checkpoint_and_the_steps_to_use_instead(
    two_checkpoints, tmp_path):
  model_dir = _copy(two_checkpoints, tmp_path)
  _truncate_largest_array_file(model_dir / "checkpoint_2")
  before = _files(model_dir)
  with pytest.raises(checkpoints.DamagedCheckpointError) as err:
    evaluation.infer(model=_model(), inputs=["some text"], model_dir=str(model_dir),
                     task_feature_lengths=LENGTHS)
  message = str(err.value)
  assert f"checkpoint_2 in {model_dir} is damaged (" in message
  assert "Other checkpoints here: steps [1]" in message and "CHECKPOINT_STEP" in message
  with pytest.raises(FileNotFoundError, match=r"No checkpoint_7 .* holds steps \[1, 2\]: set "
                     "CHECKPOINT_STEP"):
    _params(model_dir, 7)
  # The step asked for, never another one silently: step 1 is the saved step 1.
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(model_dir, 1),
                         _params(two_checkpoints, 1))
  assert _files(model_dir) == before


def test_an_initial_checkpoint_of_another_architecture_is_refused_with_the_counts(
    two_checkpoints, tmp_path, capsys):
  wider = _model(emb_dim=48)
  fresh, _ = train_state.init_state(wider, _optimizer(), partitioning.Partitioner(), _cfg(),
                                    seed=0)
  with pytest.raises(checkpoints.ArchitectureMismatchError) as err:
    trainer.train(model=wider, train_dataset_cfg=_cfg(), model_dir=str(tmp_path / "new"),
                  total_steps=2, optimizer=_optimizer(),
                  initial_checkpoint_path=str(two_checkpoints))
  message = str(err.value)
  assert f"The checkpoint {two_checkpoints} (step 2) restores only " in message
  assert "shape differs:          decoder/decoder_norm/scale checkpoint [32] vs model [48]" \
      in message
  assert "INITIAL_CHECKPOINT_PATH" in message and "ALLOW_PARTIAL_RESTORE=True" in message
  assert not list((tmp_path / "new").glob("checkpoint_*"))  # no run started
  # Allowed on purpose: the report counts the shape mismatches as unused.
  _, report = checkpoints.restore_matching_params(str(two_checkpoints), fresh["params"],
                                                  allow_partial=True)
  total = len(jax.tree_util.tree_leaves(fresh["params"]))
  assert 0 < len(report["restored"]) < total / 2
  assert len(report["restored"]) + len(report["initialised"]) == total
  assert "decoder/decoder_norm/scale" in report["reshaped"]
  assert set(report["reshaped"]) <= set(report["unused"])
  assert len(report["unused"]) == total - len(report["restored"])  # same names, other shapes
  train_state.start_from(str(two_checkpoints), fresh["params"], allow_partial=True)
  assert (f"{len(report['unused'])} in the checkpoint unused ({len(report['reshaped'])} of "
          "them with another shape in this model)") in capsys.readouterr().out


# ---------------------------------------------------------------- issue 48: a folder that is
# no checkpoint given as INITIAL_CHECKPOINT_PATH
@pytest.mark.parametrize("layout", ["tensorflow", "empty", "missing"])
def test_an_initial_checkpoint_path_that_is_no_checkpoint_names_it_and_what_one_holds(
    tmp_path, layout):
  """A TensorFlow checkpoint folder (its `checkpoint` index is text, not T5X's msgpack) gave
  `msgpack.exceptions.ExtraData` without a path after the model was built."""
  folder = tmp_path / "pretrained"
  if layout == "tensorflow":
    _write(folder / "checkpoint", b'model_checkpoint_path: "model.ckpt-1000"\n')
    _write(folder / "model.ckpt-1000.index", b"\0" * 16)
  elif layout == "empty":
    folder.mkdir()
  before = _files(tmp_path)
  with pytest.raises(checkpoints.NotACheckpointError) as err:
    checkpoints.check_checkpoint_path(str(folder), "INITIAL_CHECKPOINT_PATH")
  message = str(err.value)
  assert message.startswith(f"INITIAL_CHECKPOINT_PATH {folder} is not a checkpoint: ")
  assert {"tensorflow": "the folder holds checkpoint, model.ckpt-1000.index; its `checkpoint` "
                        "file is not T5X's msgpack",
          "empty": "it is an empty folder", "missing": "nothing is there"}[layout] in message
  assert "Give a decal_jax MODEL_DIR or one of its checkpoint_<step> folders (Orbax items " \
         "state/ and architecture/), or a T5X checkpoint" in message
  # The trainer and export_t5x say the same; MODEL_DIR is left without a file.
  with pytest.raises(checkpoints.NotACheckpointError, match="INITIAL_CHECKPOINT_PATH .* is not"):
    _train(tmp_path / "m", initial_checkpoint_path=str(folder))
  assert [p for p in (tmp_path / "m").rglob("*") if p.is_file()] == []
  export = _load_tool("export_t5x")
  assert export.main(["--checkpoint", str(folder), "--out", str(tmp_path / "t5x")]) == 2
  assert _files(tmp_path) == before and not (tmp_path / "t5x").exists()
