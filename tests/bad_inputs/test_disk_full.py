"""A disk that fills while a checkpoint is saved: the run stops with DiskFullError naming the
folder, the free space and the fix; the partial checkpoint folder is removed; the previous
checkpoint is intact and, once there is room, the same command resumes from it."""
import contextlib
import os
import shutil
import subprocess

import orbax.checkpoint as ocp
import pytest

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax.runtime import checkpoints

from bad_input_helpers import _files, _train_tiny

# The tiny test model's checkpoint takes about 3.2 MB: a 5 MB disk holds one, not two.
SMALL_DISK_MB = 5
TENSORSTORE_SAID = (
    'RESOURCE_EXHAUSTED: Error writing "params.x/0" in OCDBT database at local file "...": '
    "Failed to write 670008 bytes to file 19: No space left on device [os_error_code='28']")


@contextlib.contextmanager
def _small_disk(folder, megabytes):
  """A tmpfs of `megabytes` mounted on `folder`; skips where this process cannot mount one."""
  folder.mkdir()
  if os.geteuid() != 0 or not shutil.which("mount"):
    pytest.skip("mounting a small tmpfs needs root; the simulated full disk below still runs")
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs",
                            str(folder)], capture_output=True, text=True)
  if mounted.returncode:
    pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
  try:
    yield folder
  finally:
    subprocess.run(["umount", "-l", str(folder)], check=False)


def _assert_named_and_cleaned(message, run, step, latest):
  assert message.startswith(f"checkpoint_{step} did not fit on the disk of {run}")
  assert f"checkpoint_{latest} is intact and the same command resumes from it" in message
  assert "--gin.KEEP_CHECKPOINTS=1" in message and "a larger disk" in message
  assert "No space left on device" in message  # what the storage said, kept
  assert not [p for p in run.iterdir() if "tmp" in p.name], "a partial folder was left"


def test_a_disk_that_fills_during_a_save_stops_clean_and_the_same_command_resumes(tmp_path):
  with _small_disk(tmp_path / "small", SMALL_DISK_MB) as disk:
    run = disk / "run"
    _train_tiny(run, 1, keep_checkpoints=1)
    first = _files(run / "checkpoint_1")
    with pytest.raises(checkpoints.DiskFullError) as err:
      _train_tiny(run, 3, keep_checkpoints=1)
    _assert_named_and_cleaned(str(err.value), run, step=2, latest=1)
    assert "MB free; checkpoint_1 takes 3." in str(err.value)
    assert _files(run / "checkpoint_1") == first  # the last good checkpoint, unchanged
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    _train_tiny(run, 3, keep_checkpoints=1)  # room again: the same command resumes
    assert checkpoints.Checkpointer(str(run)).all_steps() == [3]


def test_a_simulated_full_disk_anywhere_names_it_and_removes_the_partial_folder(
    tmp_path, monkeypatch):
  """Where no tmpfs can be mounted: Orbax's save leaves its temporary folder and raises
  TensorStore's out-of-space error, as it does on a full disk (test above)."""
  run = tmp_path / "run"
  _train_tiny(run, 1, keep_checkpoints=1)
  first = _files(run / "checkpoint_1")

  def fills_the_disk(manager, step, *args, **kwargs):
    partial = run / f"checkpoint_{step}.orbax-checkpoint-tmp" / "state"
    partial.mkdir(parents=True)
    (partial / "d").write_bytes(b"\0" * 1000)
    raise ValueError(TENSORSTORE_SAID)

  monkeypatch.setattr(ocp.CheckpointManager, "save", fills_the_disk)
  with pytest.raises(checkpoints.DiskFullError) as err:
    _train_tiny(run, 3, keep_checkpoints=1)
  _assert_named_and_cleaned(str(err.value), run, step=2, latest=1)
  assert err.value.errno == 28
  assert _files(run / "checkpoint_1") == first


def test_other_save_errors_pass_unchanged(tmp_path, monkeypatch):
  def breaks(manager, step, *args, **kwargs):
    raise ValueError("INVALID_ARGUMENT: something else")

  monkeypatch.setattr(ocp.CheckpointManager, "save", breaks)
  with pytest.raises(ValueError, match="INVALID_ARGUMENT: something else") as err:
    _train_tiny(tmp_path / "run", 1)
  assert not isinstance(err.value, checkpoints.DiskFullError)
