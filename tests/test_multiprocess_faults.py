"""Faults across hosts: a 2-process `python -m decal_jax.train` job (one CPU device per
process, gloo collectives, FSDP across the two) loses one process to SIGKILL, mid-step or
mid-save; the other stops within DECAL_PEER_TIMEOUT with a message naming the lost process
(exit status 75), and the same command restarted on both ends bitwise equal to a job that
never stopped. The watchdog's verdicts are also checked alone, on a fake coordination
service and clock.

One scenario of four jobs (the uninterrupted reference runs beside the first): about 6
minutes on 2 cores shared with other work (load 9), most of it start-up and compilation:
1. process 1 killed during step 4 (checkpoint_2 saved): process 0 stops, naming process 1;
2. the restarted job resumes from checkpoint_2; process 0 (the coordinator) is killed while
   checkpoint_4 is being written: process 1 stops at once, naming process 0;
3. the restarted job resumes from checkpoint_2 again (the half-written checkpoint_4 is not a
   checkpoint; the lock the killed process 0 left is taken over as stale) and finishes.
"""
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import paths
import processes
from decal_jax.runtime import checkpoints, peer_watch

REPO = paths.REPO
STEPS = 8
PEER_TIMEOUT = 10  # seconds (DECAL_PEER_TIMEOUT); the library's default is 60
STOP_BOUND = PEER_TIMEOUT + 15  # the watchdog's timeout, plus rounds and a loaded machine
ARGS = ["--gin_file=models/decal_tiny.gin", "--gin_file=runs/pretrain.gin",
        "--gin.MIXTURE_OR_TASK_NAME='decal_builtin_span_corruption'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 12}", "--gin.BATCH_SIZE=8",
        f"--gin.TRAIN_STEPS={STEPS}", "--gin.LEARNING_RATE=0.5", "--gin.WARMUP_STEPS=5",
        "--gin.EVAL_BATCHES=1", "--gin.EVAL_PERIOD=1000", "--gin.LOG_PERIOD=1",
        "--gin.CHECKPOINT_PERIOD=2", "--gin.KEEP_CHECKPOINTS=10",
        "--gin.trainer.train.show_example=False", "--gin.MESH_SHAPE=(1, 2, 1)"] + [
            f"--gin.t5.T5Config.{k}={v}" for k, v in dict(
                emb_dim=32, num_heads=4, head_dim=8, mlp_dim=64, num_encoder_layers=1,
                num_decoder_layers=1).items()]


# ------------------------------------------------------------------ two real processes
class Job:
  """Processes 0 and 1 of one job on `model_dir`, their merged stdout / stderr collected
  line by line as they run."""

  def __init__(self, model_dir: pathlib.Path):
    port = processes.free_port()
    self.lines = [[], []]
    self.procs = [self._launch(i, port, model_dir) for i in range(2)]
    for proc, lines in zip(self.procs, self.lines):
      threading.Thread(target=lambda p=proc, l=lines: l.extend(p.stdout), daemon=True).start()

  @staticmethod
  def _launch(process_id: int, port: int, model_dir: pathlib.Path) -> subprocess.Popen:
    # XLA's compilation cache is the suite's (tests/conftest.py): the jobs compile the same
    # programs, and a later session finds them compiled.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu",
               DECAL_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", DECAL_NUM_PROCESSES="2",
               DECAL_PROCESS_ID=str(process_id), DECAL_PEER_TIMEOUT=str(PEER_TIMEOUT))
    command = [sys.executable, "-m", "decal_jax.train", *ARGS, f"--gin.MODEL_DIR='{model_dir}'"]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

  def output(self, i: int) -> str:
    return "".join(self.lines[i])

  def wait_for(self, done, what: str, timeout: float = 300) -> None:
    """Polls `done()` every 5 ms; fails naming `what` if a process ends first."""
    deadline = time.monotonic() + timeout
    while not done():
      for i, proc in enumerate(self.procs):
        assert proc.poll() is None, f"process {i} ended before {what}:\n{self.output(i)[-3000:]}"
      assert time.monotonic() < deadline, f"no {what} in {timeout} s"
      time.sleep(0.005)

  def kill(self, i: int) -> "Stop":
    """SIGKILLs process `i`; the other's exit status, output, and seconds it took to stop."""
    self.procs[i].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    other = self.procs[1 - i]
    try:
      code = other.wait(timeout=120)
    finally:
      self.close()
    return Stop(code, time.monotonic() - killed, self.output(1 - i), self.procs[i].pid)

  def finish(self, timeout: float = 400) -> None:
    try:
      for i, proc in enumerate(self.procs):
        assert proc.wait(timeout=timeout) == 0, self.output(i)[-4000:]
    finally:
      self.close()

  def close(self) -> None:
    for proc in self.procs:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
    time.sleep(0.1)  # the reader threads take the last lines


class Stop:
  def __init__(self, code: int, seconds: float, output: str, lost_pid: int):
    self.code, self.seconds, self.output, self.lost_pid = code, seconds, output, lost_pid

  def message(self) -> str:
    """The watchdog's message (the output's last ERROR paragraph)."""
    return self.output[self.output.rindex("\nERROR: ") + 1:].strip()


def _saved(model_dir: pathlib.Path, step: int):
  """Every leaf of checkpoint_<step>'s state (on this process's one device) and its data
  position."""
  path = model_dir / f"checkpoint_{step}"
  tree = ocp.StandardCheckpointHandler().metadata(path / "state").tree
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree_util.tree_map(
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree)
  manager = checkpoints.Checkpointer(str(model_dir)).manager
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
  manager.close()
  return jax.device_get(restored["state"]), dict(restored["data"])


def _saving(model_dir: pathlib.Path, step: int):
  return lambda: (model_dir / f"checkpoint_{step}.orbax-checkpoint-tmp").exists()


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
  root = tmp_path_factory.mktemp("faults")
  run, reference = root / "run", Job(root / "straight")
  found = {}
  try:
    job = Job(run)  # 1. process 1 killed mid-step
    job.wait_for(lambda: f"train step 3/{STEPS}" in job.output(0), "step 3")
    found["mid_step"] = job.kill(1)
    found["after_mid_step"] = sorted(p.name for p in run.iterdir())
    job = Job(run)  # 2. restarted; process 0 killed mid-save
    job.wait_for(lambda: f"train step 3/{STEPS}" in job.output(0), "step 3 after the restart")
    job.wait_for(_saving(run, 4), "checkpoint_4 being written")
    found["mid_save"] = job.kill(0)
    found["resumed_first"] = job.output(0)
    found["after_mid_save"] = sorted(p.name for p in run.iterdir())
    job = Job(run)  # 3. restarted again, to the end
    job.finish()
    found["resumed_again"] = job.output(0)
    reference.finish()
  finally:
    reference.close()
  found["run"], found["reference"] = run, root / "straight"
  return found


def test_a_process_killed_mid_step_stops_the_other_naming_it(scenario):
  stop = scenario["mid_step"]
  assert stop.code == peer_watch.EXIT_LOST_PROCESS, stop.output[-3000:]
  assert stop.seconds <= STOP_BOUND, stop.seconds
  message = stop.message()
  assert message.startswith(f"ERROR: process 1 of 2 (host {os.uname().nodename}, pid "
                            f"{stop.lost_pid}) is lost: it has given no sign of life for ")
  assert ("Process 0 stops too (exit status 75)" in message
          and "Restart every process of the job with the same command" in message)
  print(f"\nmid-step kill of process 1: process 0 stopped after {stop.seconds:.1f} s:\n"
        f"{message}")
  # Process 0 left through its exception: the lock is gone, no checkpoint after 2.
  assert scenario["after_mid_step"].count("checkpoint_2") == 1
  assert ".lock" not in scenario["after_mid_step"]
  assert not any(n.startswith("checkpoint_4") for n in scenario["after_mid_step"])


def test_the_coordinator_killed_mid_save_stops_the_other_at_once_naming_it(scenario):
  stop = scenario["mid_save"]
  assert stop.code == peer_watch.EXIT_LOST_PROCESS, stop.output[-3000:]
  assert stop.seconds <= STOP_BOUND, stop.seconds
  message = stop.message()
  assert message.startswith(f"ERROR: process 0 of 2 (host {os.uname().nodename}, pid "
                            f"{stop.lost_pid}), which runs the job's coordination service, "
                            "is lost: ")
  assert "Process 1 stops too (exit status 75)" in message
  print(f"\nmid-save kill of process 0: process 1 stopped after {stop.seconds:.1f} s:\n"
        f"{message}")
  assert "Resuming from step 2 " in scenario["resumed_first"]
  # The save was cut short: its temporary folder is left, and no checkpoint_4.
  left = scenario["after_mid_save"]
  assert "checkpoint_4.orbax-checkpoint-tmp" in left and "checkpoint_4" not in left
  assert ".lock" in left  # process 0 was killed holding it


def test_the_restarted_job_resumes_from_the_last_complete_checkpoint_bitwise(scenario):
  out = scenario["resumed_again"]
  assert "Resuming from step 2 " in out  # not from the half-written checkpoint_4
  assert "which is no longer running (a stale lock); taking it over." in out
  got, got_data = _saved(scenario["run"], STEPS)
  want, want_data = _saved(scenario["reference"], STEPS)
  assert got_data == want_data and got_data["batches_consumed"] == STEPS
  want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
  got_leaves, got_tree = jax.tree_util.tree_flatten(got)
  assert got_tree == want_tree
  for (path, a), b in zip(want_leaves, got_leaves):  # bitwise, every leaf of the state
    np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------ the watchdog alone
class FakeService:
  """The coordination service's key-value store; `down` makes every request fail."""

  def __init__(self):
    self.store, self.down = {}, False

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
    self.store[key] = value

  def key_value_dir_get(self, prefix):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
    return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]


def _three_processes(timeout=10.0):
  """Watchdogs of processes 0, 1, 2 on one fake service and clock; their reports."""
  service, now, said = FakeService(), [0.0], {0: [], 1: [], 2: []}
  dogs = [peer_watch.PeerWatchdog(service, i, 3, timeout, clock=lambda: now[0],
                                  report=said[i].append) for i in range(3)]
  return service, now, said, dogs


def _round(dogs, now, seconds, alive=(0, 1, 2)):
  now[0] += seconds
  for i in alive:
    dogs[i].tick()


def test_a_silent_process_is_named_after_the_timeout_and_not_before():
  _, now, said, dogs = _three_processes()
  for _ in range(5):
    _round(dogs, now, 1.0)
  # Process 2 beat last at t = 5; the others see that value change at t = 6 (their next
  # round), and time its silence from there.
  for _ in range(10):
    _round(dogs, now, 1.0, alive=(0, 1))
  assert said == {0: [], 1: [], 2: []}
  _round(dogs, now, 1.0, alive=(0, 1))  # t = 16: silent for 10 s
  for i in (0, 1):
    [message] = said[i]
    assert message.startswith(f"\nERROR: process 2 of 3 (host {os.uname().nodename}, pid "
                              f"{os.getpid()}) is lost: it has given no sign of life for 10 s.")
    assert f"Process {i} stops too (exit status 75)" in message
  _round(dogs, now, 5.0, alive=(0, 1))
  assert len(said[0]) == len(said[1]) == 1  # said once


def test_a_process_that_exits_early_is_lost_but_not_at_a_normal_end():
  _, now, said, dogs = _three_processes()
  _round(dogs, now, 1.0)
  dogs[2].mark_exiting()  # process 2 leaves; 0 and 1 still train
  for _ in range(11):
    _round(dogs, now, 1.0, alive=(0, 1))
  assert "process 2 of 3" in said[0][0] and "exited 10 s ago while this process still runs" in (
      said[0][0])
  _, now, said, dogs = _three_processes()
  _round(dogs, now, 1.0)
  for dog in dogs:  # a normal end: all leave, then wait in JAX's shutdown
    dog.mark_exiting()
  for _ in range(30):
    _round(dogs, now, 1.0)
  assert said == {0: [], 1: [], 2: []}


def test_an_unreachable_coordinator_is_named_as_process_0():
  service, now, said, dogs = _three_processes()
  _round(dogs, now, 1.0)
  service.down = True
  _round(dogs, now, 1.0, alive=(1,))
  assert said[1][0].startswith(f"\nERROR: process 0 of 3 (host {os.uname().nodename}, pid "
                               f"{os.getpid()}), which runs the job's coordination service, is "
                               "lost: this process's requests to it fail (UNAVAILABLE: Failed")
  dogs[2].mark_exiting()  # at a normal end the service going away is no fault
  dogs[2].tick()
  assert said[2] == []


def test_when_jax_aborts_the_message_names_the_silent_process_or_else_process_0():
  _, now, _, dogs = _three_processes()
  _round(dogs, now, 1.0)
  _round(dogs, now, 1.0)  # each has seen the others
  for _ in range(4):  # process 2 silent: seen last at the first of these, 3 rounds ago
    _round(dogs, now, 1.0, alive=(0, 1))
  assert "process 2 of 3" in dogs[0].explain_abort()
  _, now, _, dogs = _three_processes()
  _round(dogs, now, 1.0)
  assert "process 0 of 3" in dogs[1].explain_abort()  # nobody silent: the coordinator
  assert "JAX's distributed service stopped process 0" in dogs[0].explain_abort()


def test_at_exit_the_thread_watches_through_the_shutdown_then_has_ended():
  """At exit the others learn this process leaves, JAX's shutdown runs with the thread still
  watching, and the thread has ended before the interpreter finalizes (a daemon thread left
  inside a service call then can abort a run that succeeded); also when the shutdown fails."""
  for failing in (False, True):
    service, said, seen = FakeService(), [], []
    dog = peer_watch.PeerWatchdog(service, 0, 1, 5.0, report=said.append)  # a round: 0.5 s
    thread = threading.Thread(target=dog.run, daemon=True)
    thread.start()

    def shutdown():
      rounds = dog.count
      time.sleep(1.6)  # JAX's shutdown barrier, waiting for the other processes
      seen.append((service.store[f"{peer_watch.KEY_PREFIX}0"].split()[0], dog.count - rounds,
                   thread.is_alive()))
      service.down = True  # the service goes away
      if failing:
        raise RuntimeError("DEADLINE_EXCEEDED: barrier timed out")

    if failing:
      with pytest.raises(RuntimeError, match="barrier timed out"):
        dog.leave(thread, shutdown)
    else:
      dog.leave(thread, shutdown)
    [(state, rounds, alive)] = seen
    assert state == peer_watch.EXITED and rounds >= 1 and alive
    assert not thread.is_alive() and said == []


def test_two_jobs_started_in_a_row_get_two_ports(monkeypatch):
  """The kernel may hand a just-released port out again before the first job binds it."""
  offered = iter([41001, 41001, 41002])

  class OneSocket:
    def __enter__(self):
      self.port = next(offered)
      return self

    def __exit__(self, *exc):
      return False

    def bind(self, address):
      pass

    def getsockname(self):
      return ("127.0.0.1", self.port)

  monkeypatch.setattr(processes, "_HANDED_OUT", set())
  monkeypatch.setattr(processes.socket, "socket", OneSocket)
  assert [processes.free_port(), processes.free_port()] == [41001, 41002]
