"""`fileio`: a file (or folder) is written whole or not at all, and nothing is left behind."""
import os
import stat

import pytest

from decal_jax import fileio


class Interrupted(Exception):
  pass


def _mode(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


def test_success_replaces_the_content_with_mode_644(tmp_path):
  path = tmp_path / "sub" / "result.json"  # the parent folder is created
  fileio.write_text_atomic(path, "first")
  fileio.write_text_atomic(path, "second ✓")
  assert path.read_text(encoding="utf-8") == "second ✓"
  assert _mode(path) == 0o644  # not mkstemp's 0o600
  fileio.write_bytes_atomic(path, b"\x00\xff")
  assert path.read_bytes() == b"\x00\xff"
  assert os.listdir(path.parent) == ["result.json"]  # no temporary file


def test_a_failure_mid_write_leaves_the_old_file_and_no_temp_file(tmp_path):
  path = tmp_path / "result.txt"
  path.write_text("old")
  with pytest.raises(Interrupted):
    with fileio.atomic_write(path) as f:
      f.write("half of the new")
      f.flush()
      raise Interrupted()
  assert path.read_text() == "old"
  assert os.listdir(tmp_path) == ["result.txt"]
  with pytest.raises(Interrupted):  # a file that did not exist stays absent
    with fileio.atomic_write(tmp_path / "new.bin", "wb") as f:
      f.write(b"partial")
      raise Interrupted()
  assert os.listdir(tmp_path) == ["result.txt"]


def test_only_whole_file_modes_are_accepted(tmp_path):
  with pytest.raises(ValueError, match="mode must be 'w' or 'wb'"):
    with fileio.atomic_write(tmp_path / "log.txt", "a"):
      pass
  assert os.listdir(tmp_path) == []


def test_a_directory_is_renamed_into_place_whole(tmp_path):
  folder = tmp_path / "index"
  with fileio.atomic_directory(folder) as building:
    (building / "a.txt").write_text("1")
    assert not folder.exists()  # readers see nothing until the body completes
  assert sorted(os.listdir(folder)) == ["a.txt"] and _mode(folder) == 0o755
  with fileio.atomic_directory(folder) as building:  # replaces the old one
    (building / "b.txt").write_text("2")
  assert sorted(os.listdir(folder)) == ["b.txt"]
  assert os.listdir(tmp_path) == ["index"]  # neither the temp nor the old folder is left


def test_a_failed_directory_build_leaves_the_old_one(tmp_path):
  folder = tmp_path / "index"
  with fileio.atomic_directory(folder) as building:
    (building / "a.txt").write_text("1")
  with pytest.raises(Interrupted):
    with fileio.atomic_directory(folder) as building:
      (building / "b.txt").write_text("2")
      raise Interrupted()
  assert sorted(os.listdir(folder)) == ["a.txt"]
  assert os.listdir(tmp_path) == ["index"]


def test_without_replace_an_existing_folder_is_kept(tmp_path):
  folder = tmp_path / "beir"
  folder.mkdir()
  (folder / "theirs.txt").write_text("another process finished first")
  with pytest.raises(OSError):
    with fileio.atomic_directory(folder, replace=False) as building:
      (building / "mine.txt").write_text("late")
  assert os.listdir(folder) == ["theirs.txt"]
  assert os.listdir(tmp_path) == ["beir"]
