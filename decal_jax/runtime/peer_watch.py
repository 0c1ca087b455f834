"""A lost process of a multi-process run stops the others within DECAL_PEER_TIMEOUT seconds,
with a message naming it and the fix (restart every process: the run resumes from its latest
complete checkpoint).

Without this, a process killed mid-step (SIGKILL, out of memory, a host gone) leaves the
others either failing a collective with a bare `Gloo all-reduce failed ... Connection reset
by peer`, or waiting in a barrier (an Orbax save) until JAX's coordination service notices
the missing heartbeats and aborts them (SIGABRT, exit status 134) with a C++ log line.

`start` (called by the entry points once the job is joined) adds two things:

- a watchdog thread: every process writes a counter to the coordination service's key-value
  store every `timeout / 10` seconds and reads the others'. A process whose counter has not
  moved for `timeout` seconds (or that exited that long ago while this one still runs) is
  lost: this process prints which one (index, host, pid) and the fix, and exits with status
  75 (EX_TEMPFAIL: restart the job). JAX's own heartbeat timeout is twice `timeout`
  (`partitioning.initialize_distributed`), so the watchdog speaks first.
- a SIGABRT hook: when JAX aborts the process first (it does so at once when process 0,
  which hosts the coordination service, is lost), the same message is printed, naming the
  silent processes or else process 0, and the exit status is 75 too.

The hook and the client come from `jax._src.distributed` (JAX has no public handle on the
coordination client); with another JAX where they are missing, nothing is installed and
JAX's own abort remains. MODEL_DIR's lock (`run_lock`) is released by the kernel when a
process exits however it exits; a lock file left behind names a dead pid, and the restarted
run takes it over with a WARNING.
"""
import atexit
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

EXIT_LOST_PROCESS = 75  # EX_TEMPFAIL: a temporary failure, run the job again
KEY_PREFIX = "decal_jax/alive/"
RUNNING, EXITED = "running", "exited"

_watchdog: Optional["PeerWatchdog"] = None
_abort_handler = None  # the ctypes callback, kept alive while it is installed


class Peer:
  """What this process last read about another: its state, counter, host, pid, and when
  (this process's monotonic clock) the counter or state last changed."""

  def __init__(self, value: str, now: float):
    self.value, self.since = value, now
    parts = value.split(" ", 3)
    self.state = parts[0]
    self.who = f"host {parts[2]}, pid {parts[3]}" if len(parts) == 4 else "host unknown"

  def update(self, value: str, now: float) -> "Peer":
    return self if value == self.value else Peer(value, now)


class PeerWatchdog:
  """Heartbeats through `client` (jax's DistributedRuntimeClient, or a fake with
  key_value_set / key_value_dir_get) and the verdict on the other processes.

  Args:
    client: the coordination service's client.
    process_id, num_processes: this process and the job's size.
    timeout: seconds of silence after which a process is lost.
    clock, report: injected for tests (time.monotonic; print the message and exit).
  """

  def __init__(self, client, process_id: int, num_processes: int, timeout: float,
               clock: Callable[[], float] = time.monotonic,
               report: Optional[Callable[[str], None]] = None):
    self.client, self.me, self.n, self.timeout = client, process_id, num_processes, timeout
    self.period = max(timeout / 10, 0.2)
    self.clock, self.report = clock, report or _print_and_exit
    self.start_time = clock()
    self.peers: Dict[int, Peer] = {}
    self.count, self.state, self.exiting = 0, RUNNING, False
    self._stop = threading.Event()
    self._done = False

  # ------------------------------------------------------------------ one round
  def beat(self) -> None:
    """Writes this process's state and a new counter value."""
    self.count += 1
    value = f"{self.state} {self.count} {socket.gethostname()} {os.getpid()}"
    self.client.key_value_set(f"{KEY_PREFIX}{self.me}", value, True)

  def read(self) -> None:
    """Reads every process's last value; notes which changed."""
    now = self.clock()
    for key, value in self.client.key_value_dir_get(KEY_PREFIX):
      index = int(key.rsplit("/", 1)[-1])
      if index != self.me:
        old = self.peers.get(index)
        self.peers[index] = old.update(value, now) if old else Peer(value, now)

  def lost(self) -> List[Tuple[int, str, str]]:
    """(index, who, why) of every other process silent for `timeout` seconds, or exited that
    long ago while this one still runs."""
    now, found = self.clock(), []
    for index in range(self.n):
      peer = self.peers.get(index)
      if index == self.me:
        continue
      if peer is None:
        if now - self.start_time >= self.timeout:
          found.append((index, "host unknown", f"it has given no sign of life in the "
                        f"{now - self.start_time:.0f} s since this process joined the job"))
      elif now - peer.since >= self.timeout:
        if peer.state == EXITED and not self.exiting:
          found.append((index, peer.who, f"it exited {now - peer.since:.0f} s ago while this "
                        "process still runs (its own output says why)"))
        elif peer.state == RUNNING:
          found.append((index, peer.who, f"it has given no sign of life for "
                        f"{now - peer.since:.0f} s"))
    return found

  def tick(self) -> None:
    """One round: beat, read, report the lost processes (or a lost coordinator)."""
    try:
      self.beat()
      self.read()
    except Exception as e:  # any RPC error: the coordination service is gone
      if self.exiting:  # a normal end: the service shuts down as the processes leave
        self._stop.set()
        return
      self._say(self.coordinator_lost(f"this process's requests to it fail ({_first_line(e)})"))
      return
    lost = self.lost()
    if lost:
      self._say(self.message(lost))

  # ------------------------------------------------------------------ messages
  def message(self, lost: List[Tuple[int, str, str]]) -> str:
    names = "; ".join(f"process {i} of {self.n} ({who}) is lost: {why}" for i, who, why in lost)
    return (f"\nERROR: {names}. It was killed, crashed, or its host went down or off the "
            f"network. Process {self.me} stops too (exit status {EXIT_LOST_PROCESS}) rather "
            f"than wait for it in a collective. {_FIX}")

  def coordinator_lost(self, why: str) -> str:
    peer = self.peers.get(0)
    who = peer.who if peer else "host unknown"
    return (f"\nERROR: process 0 of {self.n} ({who}), which runs the job's coordination "
            f"service, is lost: {why}. It was killed, crashed, or its host went down or off "
            f"the network. Process {self.me} stops too (exit status {EXIT_LOST_PROCESS}). "
            f"{_FIX}")

  def explain_abort(self) -> str:
    """The message when JAX aborts this process: the processes silent for three rounds, or
    else process 0 (JAX aborts at once when the coordination service is unreachable)."""
    now = self.clock()
    silent = [(i, p.who, f"it has given no sign of life for {now - p.since:.0f} s")
              for i, p in sorted(self.peers.items())
              if p.state == RUNNING and now - p.since >= 3 * self.period]
    if silent:
      return self.message(silent)
    if self.me != 0:
      return self.coordinator_lost("JAX's distributed service could not reach it (the "
                                   "log line above says what failed)")
    return (f"\nERROR: JAX's distributed service stopped process 0 of {self.n} (the log line "
            f"above says why: most often another process was lost). {_FIX}")

  def on_abort(self) -> None:
    """JAX is aborting this process: the message, then exit status 75 (not 134)."""
    self._say(self.explain_abort())
    os._exit(EXIT_LOST_PROCESS)

  def _say(self, text: str) -> None:
    if not self._done:  # the thread and the abort hook may both get here
      self._done = True
      self.report(text)

  # ------------------------------------------------------------------ lifetime
  def run(self) -> None:
    while not self._stop.wait(self.period):
      self.tick()

  def mark_exiting(self) -> None:
    """Tells the others this process leaves on purpose (from here on, the service going
    away is no fault)."""
    self.state, self.exiting = EXITED, True
    try:
      self.beat()
    except Exception:  # best effort: the service may already be gone
      pass

  def leave(self, thread: threading.Thread, shutdown: Callable[[], None]) -> None:
    """At exit: `mark_exiting`, then JAX's distributed `shutdown` (it waits for every
    process) with `thread` still watching the others, then that thread ended and joined.

    A daemon thread still inside a coordination-service call when the interpreter finalizes
    is torn down in the middle of C++ code, which can abort the process ('terminate called
    recursively', exit status 134) after a run that succeeded (CPython ends such a thread with
    pthread_exit when it retakes the GIL, and the unwinding runs into the binding's noexcept
    GIL guard: pytorch/pytorch#38228 shows the mechanism); JAX's own exit hook would shut
    the service down only after this one, so the shutdown is done here (it is idempotent:
    JAX's later call does nothing)."""
    self.mark_exiting()
    try:
      shutdown()
    finally:
      self._stop.set()
      thread.join(timeout=max(2 * self.period, 5.0))


_FIX = ("Restart every process of the job with the same command: a training run resumes from "
        "the latest complete checkpoint in MODEL_DIR (a save cut short is never taken as one). "
        "DECAL_PEER_TIMEOUT sets how many seconds a process may be silent.")


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def _print_and_exit(text: str) -> None:
  """Writes straight to stderr's file descriptor (also from a signal handler) and exits."""
  try:
    os.write(2, (text + "\n").encode())
  except OSError:
    pass
  os._exit(EXIT_LOST_PROCESS)


def start(timeout: float) -> bool:
  """Starts the watchdog and the abort hook of a joined multi-process job (once); False
  when there is no job to watch or this JAX offers no coordination client."""
  global _watchdog
  if _watchdog is not None:
    return True
  try:
    from jax._src import distributed
  except ImportError:
    return False
  state = distributed.global_state
  if getattr(state, "client", None) is None or state.num_processes < 2:
    return False
  _watchdog = PeerWatchdog(state.client, state.process_id, state.num_processes, timeout)
  _watchdog.beat()
  thread = threading.Thread(target=_watchdog.run, name="decal-peer-watchdog", daemon=True)
  thread.start()
  atexit.register(_watchdog.leave, thread, distributed.shutdown)  # runs before JAX's exit hook
  _install_abort_hook(_watchdog.on_abort)
  return True


def _install_abort_hook(on_abort: Callable[[], None]) -> None:
  """A C-level SIGABRT handler (Python's own handlers run only in the main thread, between
  bytecodes: never when JAX aborts from its polling thread)."""
  global _abort_handler
  if not sys.platform.startswith(("linux", "darwin")):
    return
  handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
  _abort_handler = handler_type(lambda signum: on_abort())
  libc = ctypes.CDLL(None)
  libc.signal.restype = ctypes.c_void_p
  libc.signal.argtypes = [ctypes.c_int, handler_type]
  libc.signal(signal.SIGABRT, _abort_handler)
