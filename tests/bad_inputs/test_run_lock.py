"""One trainer per MODEL_DIR (run_lock.py) and eval's output folder: a second trainer is
refused naming the first, a stale lock is taken over with a warning."""
import json
import os
import pathlib
import socket
import subprocess
import sys

import gin
import pytest

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax.runtime import (checkpoints, evaluation, gin_utils, inference_eval, run_lock,
                               train_state)
from decal_jax.data import pipeline

import paths
import processes
from test_trainer import LENGTHS, _model

from bad_input_helpers import _train, _train_tiny, _copy, _files

REPO = paths.REPO


# ---------------------------------------------------------------- one trainer per MODEL_DIR
# and eval's output folder (issue 21 items 9 and 11: decal_jax/runtime/run_lock.py,
# evaluation.check_writable and EVAL_OUTPUT_DIR)
def _write_lock(model_dir, pid, host=None):
  """A lock file as a trainer that never released it would have left it."""
  lock = pathlib.Path(model_dir) / run_lock.LOCK_NAME
  lock.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                              "start_time": "2026-01-02T03:04:05+00:00",
                              "command": "python -m decal_jax.train --gin.MODEL_DIR=..."}))
  return lock


def _dead_pid():
  proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  return int(proc.stdout)  # reaped by subprocess.run: no such process any more


def test_a_second_trainer_on_a_model_dir_in_use_is_refused_naming_the_first(
    two_checkpoints, tmp_path):
  """A real first trainer: another process holding the lock through `run_lock.hold`, as
  `trainer.train` does for its whole run."""
  model_dir = _copy(two_checkpoints, tmp_path)
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time\nfrom decal_jax.runtime import run_lock\n"
       f"with run_lock.hold({str(model_dir)!r}, command='first trainer'):\n"
       "  print('held', flush=True)\n  time.sleep(600)"],
      env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    before = _files(model_dir)
    with pytest.raises(run_lock.ModelDirLockedError) as err:
      _train_tiny(model_dir, 3)
    message = str(err.value)
    assert f"MODEL_DIR {model_dir} is in use by another trainer: pid {holder.pid} on host " \
        f"{socket.gethostname()}, started " in message
    assert "(first trainer); it is running now" in message
    assert "Wait for that run to end" in message and "--gin.MODEL_DIR=" in message
    assert f"delete {model_dir / run_lock.LOCK_NAME}" in message
    assert _files(model_dir) == before  # checkpoints and the holder's lock untouched
  finally:
    holder.kill()
    holder.wait()


def test_a_lock_of_a_live_process_that_does_not_hold_it_is_still_refused(
    two_checkpoints, tmp_path):
  """The JSON names a process on this host that is alive (a sleeping subprocess): refused
  even without the flock (e.g. a trainer of an older version), never taken over."""
  model_dir = _copy(two_checkpoints, tmp_path)
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
  try:
    _write_lock(model_dir, sleeper.pid)
    before = _files(model_dir)
    with pytest.raises(run_lock.ModelDirLockedError,
                       match=rf"pid {sleeper.pid} on host .*; that process is still alive"):
      _train_tiny(model_dir, 3)
    assert _files(model_dir) == before
  finally:
    sleeper.kill()
    sleeper.wait()


def _lock_warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if r.name == "decal_jax.runtime.run_lock" and r.levelname == "WARNING"]


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(
    two_checkpoints, tmp_path, capsys, caplog):
  model_dir = _copy(two_checkpoints, tmp_path)
  dead = _dead_pid()
  lock = _write_lock(model_dir, dead)
  first = _files(model_dir / "checkpoint_1")
  _train_tiny(model_dir, 3)
  out = capsys.readouterr().out
  assert _lock_warnings(caplog) == [
      f"{lock} was left by pid {dead} (2026-01-02T03:04:05+00:00), which is no longer "
      "running (a stale lock); taking it over."]  # a logged warning: also in a --log_dir file
  assert "Resuming from step 2" in out  # nothing lost: the run went on from its checkpoint
  assert _files(model_dir / "checkpoint_1") == first
  assert checkpoints.Checkpointer(str(model_dir)).latest_step() == 3
  assert not lock.exists()  # released at the end


def test_the_lock_is_released_after_a_run_and_after_a_failed_one(tmp_path, capsys, caplog):
  model_dir = tmp_path / "m"
  _train(model_dir)
  assert not (model_dir / run_lock.LOCK_NAME).exists()
  typo = pipeline.DatasetConfig("decal_builtin_span_corruptoin", LENGTHS, batch_size=8)
  with pytest.raises(ValueError, match="Did you mean"):
    _train(model_dir, train_cfg=typo)  # an exception inside the locked run
  assert not (model_dir / run_lock.LOCK_NAME).exists()
  capsys.readouterr()
  _train(model_dir, total_steps=6, checkpoint_period=6, eval_period=6, log_period=6)
  out = capsys.readouterr().out
  assert "Resuming from step 3" in out and "WARNING" not in out
  assert _lock_warnings(caplog) == []  # no stale lock was found
  assert sorted(p.name for p in model_dir.iterdir() if p.name.startswith(".")) == []


def test_a_refused_run_in_a_new_model_dir_leaves_no_folder(tmp_path):
  """The lock creates MODEL_DIR; a run that stops before writing anything removes it."""
  typo = pipeline.DatasetConfig("decal_builtin_span_corruptoin", LENGTHS, batch_size=8)
  with pytest.raises(ValueError, match="Did you mean"):
    _train(tmp_path / "new" / "run", train_cfg=typo)
  assert list(tmp_path.iterdir()) == []


def test_a_lock_from_another_host_is_refused_with_how_to_override(two_checkpoints, tmp_path):
  model_dir = _copy(two_checkpoints, tmp_path)
  lock = _write_lock(model_dir, 4242, host="another-host.example")
  before = _files(model_dir)
  with pytest.raises(run_lock.ModelDirLockedError) as err:
    _train_tiny(model_dir, 3)
  message = str(err.value)
  assert "pid 4242 on host another-host.example, started 2026-01-02T03:04:05+00:00" in message
  assert "from another host, so this one cannot check whether that run is still alive" \
      in message
  assert f"if you are sure that run is over, delete {lock} and start again" in message
  assert _files(model_dir) == before


@pytest.fixture
def read_only(monkeypatch):
  """Makes a folder read-only: chmod a-w; where that denies nothing (root ignores
  permission bits, and no read-only mount is at hand), `os.access` is made to answer for
  that folder as it does for any other user, so the check is exercised either way."""
  made = []

  def make(folder):
    os.chmod(folder, 0o555)
    made.append(folder)
    if os.access(folder, os.W_OK):  # root
      real_access = os.access
      monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
          False if os.path.abspath(path) == os.path.abspath(folder) and mode & os.W_OK
          else real_access(path, mode, **kw)))
    return folder
  yield make
  for folder in made:
    os.chmod(folder, 0o755)


def test_eval_on_a_read_only_model_dir_is_refused_before_any_work_offering_eval_output_dir(
    two_checkpoints, tmp_path, read_only, monkeypatch):
  model_dir = read_only(_copy(two_checkpoints, tmp_path))
  before = _files(model_dir)
  monkeypatch.setattr(train_state, "restore_params", None)  # any model work would crash
  with pytest.raises(PermissionError) as err:
    gin_utils.run(evaluation.evaluate, ["--gin_file=runs/eval_builtin.gin",
                                        f"--gin.MODEL_DIR='{model_dir}'"])
  message = str(err.value)
  assert f"MODEL_DIR (evaluation.evaluate.model_dir) = {str(model_dir)!r} is not writable" \
      in message
  assert "--gin.EVAL_OUTPUT_DIR=\"'/tmp/my_eval'\"" in message
  assert _files(model_dir) == before
  # The fix as offered: a macro that the eval gin files read (so the misspelled-macro check
  # accepts it), bound to evaluate's output folder.
  gin_utils.parse(*gin_utils.split_args(["--gin_file=runs/eval_builtin.gin",
                                         f"--gin.MODEL_DIR='{model_dir}'",
                                         "--gin.EVAL_OUTPUT_DIR='/tmp/my_eval'"]))
  assert gin.query_parameter("evaluation.evaluate.output_dir").scoped_selector == \
      "EVAL_OUTPUT_DIR/gin.macro"
  assert gin.query_parameter("%EVAL_OUTPUT_DIR") == "/tmp/my_eval"


def test_eval_output_dir_gets_the_results_of_a_read_only_model_dir(
    two_checkpoints, tmp_path, read_only, builtin_vocabulary):
  del builtin_vocabulary  # decal_builtin_qa tokenizes with the tiny model's vocabulary
  model_dir = read_only(_copy(two_checkpoints, tmp_path))
  before = _files(model_dir)
  out = tmp_path / "my_eval"
  cfg = pipeline.DatasetConfig("decal_builtin_qa", LENGTHS, batch_size=8, split="validation")
  result = evaluation.evaluate(model=_model(), eval_dataset_cfg=cfg, model_dir=str(model_dir),
                               eval_batches=1, max_predict_examples=3, output_dir=str(out))
  scores = inference_eval.read_metrics(str(out), "decal_builtin_qa", 2)
  assert scores["em"] == result["decal_builtin_qa/em"]
  assert len(inference_eval.read_inferences(str(out), "decal_builtin_qa", 2)) == 3
  assert list((out / "training_eval" / "decal_builtin_qa").glob("events.out.tfevents.*"))
  assert _files(model_dir) == before


TWO_PROCESS_HOLD = """
import sys
import jax
from decal_jax.runtime import run_lock
jax.distributed.initialize(f"localhost:{sys.argv[1]}", num_processes=2,
                           process_id=int(sys.argv[2]))
try:
  with run_lock.hold(sys.argv[3]):
    print("RESULT ran", flush=True)
except run_lock.ModelDirLockedError as e:
  print("RESULT refused:", e, flush=True)
"""


@pytest.mark.parametrize("locked", [False, True])
def test_a_refused_multi_process_run_stops_every_process(tmp_path, locked):
  """Process 0 alone takes the lock; refused, it tells the others, which would otherwise
  wait for it in their first collective."""
  from test_partitioning import _env
  model_dir = tmp_path / "m"
  model_dir.mkdir()
  if locked:
    _write_lock(model_dir, 4242, host="another-host.example")
  port = processes.free_port()
  procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESS_HOLD, str(port), str(i),
                             str(model_dir)], env=dict(_env(), PYTHONPATH=str(REPO)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = processes.communicate_all(procs, timeout=300)
  assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outs]
  out0, out1 = ([line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
                for out, _ in outs)  # (the rest: Gloo's notes)
  if not locked:
    assert out0 == out1 == ["ran"] and list(model_dir.iterdir()) == []  # released
    return
  assert len(out0) == len(out1) == 1  # refused, and neither ran the locked block
  assert out0[0].startswith("refused: MODEL_DIR ") and "another-host.example" in out0[0]
  assert out1[0].startswith(f"refused: Process 0 could not lock MODEL_DIR {model_dir}")
  assert json.loads((model_dir / run_lock.LOCK_NAME).read_text())["pid"] == 4242


def test_eval_at_another_compression_ratio_notes_both_and_writes_apart_from_the_runs_curves(
    two_checkpoints, tmp_path, builtin_vocabulary, capsys):
  """A C = 4 run evaluated at C = 2 (--gin.COMPRESSION_RATIO=2): a note names both ratios,
  and its results go to MODEL_DIR/eval_at_C2/, never into the C = 4 curves at step 2."""
  del builtin_vocabulary  # decal_builtin_qa tokenizes with the tiny model's vocabulary
  model_dir = _copy(two_checkpoints, tmp_path)
  before = _files(model_dir)
  assert json.loads((model_dir / "compression.json").read_text())["compression_ratio"] == 4
  cfg = pipeline.DatasetConfig("decal_builtin_qa", LENGTHS, batch_size=8, split="validation")
  result = evaluation.evaluate(model=_model(ratio=2), eval_dataset_cfg=cfg,
                               model_dir=str(model_dir), eval_batches=1, max_predict_examples=3)
  out = capsys.readouterr().out
  apart = model_dir / "eval_at_C2"
  assert (f"Note: MODEL_DIR {model_dir} was trained at compression ratio C = 4 "
          f"(compression.json); this evaluation runs at C = 2. Its results go to {apart}/ "
          "(training_eval/, inference_eval/), apart from the run's C = 4 curves.") in out
  assert result["decal_builtin_qa/compression_ratio"] == 2.0
  after = _files(model_dir)
  assert {k: v for k, v in after.items() if not k.startswith("eval_at_C2/")} == before
  assert inference_eval.read_metrics(str(apart), "decal_builtin_qa", 2)["em"] == \
      result["decal_builtin_qa/em"]
  assert list((apart / "training_eval" / "decal_builtin_qa").glob("events.out.tfevents.*"))
  # At the trained ratio: no note, and the results join the run's own folders.
  evaluation.evaluate(model=_model(), eval_dataset_cfg=cfg, model_dir=str(model_dir),
                      eval_batches=1, max_predict_examples=3)
  assert "Note: MODEL_DIR" not in capsys.readouterr().out
  assert (model_dir / "inference_eval").is_dir()
  assert list((model_dir / "training_eval" / "decal_builtin_qa").glob("events.out.tfevents.*"))
