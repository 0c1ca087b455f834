"""One trainer per MODEL_DIR: an exclusive lock held for the whole run.

Two `python -m decal_jax.train` runs on one folder would both write checkpoints and the
last writer would win; the second one is refused instead. The lock is the file
MODEL_DIR/.lock, holding JSON {pid, host, start_time, command} so that the refusal can say
who holds it, and kept under `fcntl.flock` by the running trainer:

- flock is held by the process, so the kernel drops it the moment the process ends,
  however it ends (an exception, SIGKILL, a crash); a file nobody holds is therefore a
  lock left behind, never a run in progress on this machine.
- The JSON decides what to do with a file left behind. From this host, with its pid no
  longer alive: a stale lock, taken over with a WARNING naming the dead pid (its pid
  alive, e.g. reused by another program: refused, to be safe). From another host (a
  shared disk), liveness cannot be checked from here: refused; delete the file once you
  are sure that run is over (the documented override).
- A normal end, an exception or a preemption (SIGTERM, Ctrl-C) deletes the file.

Only process 0 of a multi-process run takes it; when it is refused, every process stops.
On a mounted file system without flock (some FUSE mounts of buckets) the JSON checks alone
decide: a run on this host is still seen by its live pid.

A remote MODEL_DIR (`gs://...`) has no flock: its lock is the object MODEL_DIR/.lock, created
only if absent (gcsfs's exclusive `xb` open: on GCS an upload with the generation
precondition ifGenerationMatch=0, which fails when the object exists, so of two runs
creating it at once one wins). The JSON in it, with a random token, decides as above (a
lock from a dead pid of this host is taken over; any other is refused); this run reads its
token back before going on, and deletes the object at the end only if the token is still
its own. A run killed outright leaves the object: from another host, delete it once you are
sure that run is over. GCS emulators may ignore the precondition (gcp-storage-emulator
does), and epath without gcsfs has no exclusive create: there the lock is
check-then-create, which still refuses a second run started once the first holds it.
"""
import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
import sys
import uuid
from typing import Dict, Iterator, List, Optional

import jax
import numpy as np

from decal_jax import fileio

LOCK_NAME = ".lock"
log = logging.getLogger(__name__)  # in an entry point: stderr and the --log_dir file


class ModelDirLockedError(RuntimeError):
  """Another trainer holds (or may hold) MODEL_DIR's lock."""


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)  # signal 0: only asks whether the process exists
  except ProcessLookupError:
    return False
  except PermissionError:  # it exists, owned by another user
    pass
  return True


def _read_holder(fd: int) -> Optional[Dict]:
  """The JSON in the lock file, {} when it is not JSON, None when the file is empty."""
  os.lseek(fd, 0, os.SEEK_SET)
  raw = b""
  while chunk := os.read(fd, 65536):
    raw += chunk
  return _holder(raw) if raw.strip() else None


def _holder(raw: bytes) -> Dict:
  """A lock's JSON record; {} when it is not a JSON object."""
  try:
    holder = json.loads(raw)
  except ValueError:
    return {}
  return holder if isinstance(holder, dict) else {}


def _describe(holder: Dict) -> str:
  return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
          f"{holder.get('start_time', '?')} ({holder.get('command', 'command unknown')})")


def _refuse(path: str, holder: Dict, why: str) -> ModelDirLockedError:
  model_dir = os.path.dirname(path)
  return ModelDirLockedError(
      f"MODEL_DIR {model_dir} is in use by another trainer: {_describe(holder)}; {why}. "
      f"Two trainers on one folder would overwrite each other's checkpoints. Wait for that "
      f"run to end, or give this run another folder (--gin.MODEL_DIR=\"'runs/other'\"), or, "
      f"if you are sure that run is over, delete {path} and start again.")


def _this_process(command: Optional[str]) -> Dict:
  return {"pid": os.getpid(), "host": socket.gethostname(),
          "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(
              timespec="seconds"),
          "command": command if command is not None else " ".join(sys.argv)}


def _check_left_behind(path: str, holder: Optional[Dict]) -> None:
  """Nobody holds the flock: refuses a file that may still be another host's (or a live
  process's) lock; notes a stale one from a dead process on this host."""
  if holder is None:
    return  # an empty file: a lock being created, or one whose JSON never got written
  if holder.get("host") != socket.gethostname():
    raise _refuse(path, holder, "it is from another host, so this one cannot check whether "
                  "that run is still alive")
  pid = holder.get("pid")
  if not isinstance(pid, int):
    raise _refuse(path, holder, "the lock names no process id to check")
  if pid != os.getpid() and _pid_alive(pid):
    raise _refuse(path, holder, "that process is still alive")
  log.warning("%s was left by pid %s (%s), which is no longer running (a stale lock); "
              "taking it over.", path, pid, holder.get("start_time", "?"))


def _is_file_at(fd: int, path: str) -> bool:
  """Whether the open file `fd` is still the one at `path` (not deleted or replaced)."""
  try:
    return os.stat(path).st_ino == os.fstat(fd).st_ino
  except FileNotFoundError:
    return False


def _acquire(path: str, command: Optional[str]) -> int:
  """Opens and flocks the lock file, writes this process into it; returns the open fd."""
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read_holder(fd) or {}
      os.close(fd)
      raise _refuse(path, holder, "it is running now") from None
    except OSError:
      pass  # a file system without flock (some FUSE mounts): the JSON checks alone decide
    if not _is_file_at(fd, path):
      os.close(fd)  # the holder deleted the file as we opened it: try again
      continue
    try:
      _check_left_behind(path, _read_holder(fd))
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(_this_process(command)).encode() + b"\n", 0)
      os.fsync(fd)
    except BaseException:
      os.close(fd)  # the file (another run's, or stale) stays as it was
      raise
    return fd


@contextlib.contextmanager
def hold(model_dir: str, command: Optional[str] = None) -> Iterator[None]:
  """Holds MODEL_DIR's lock (creating the folder) while the block runs; raises
  `ModelDirLockedError` naming the holder when another trainer has it (on every process of
  a multi-process run). `command` goes into the lock for the message another run will
  print (default: this process's argv)."""
  if fileio.is_url(model_dir):
    with _hold_remote(model_dir, command):
      yield
    return
  path, fd, refusal, created = os.path.join(model_dir, LOCK_NAME), None, None, []
  if jax.process_index() == 0:  # the others write no run-level files
    created = _missing_folders(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    try:
      fd = _acquire(path, command)
    except ModelDirLockedError as e:
      refusal = e
      _remove_if_empty(created)
  _stop_all_if_refused(refusal, model_dir)
  try:
    yield
  finally:
    if fd is not None:
      if _is_file_at(fd, path):  # not if someone deleted it (and another run made its own)
        os.unlink(path)  # before the flock goes: a waiting run never sees our JSON as stale
      os.close(fd)
    _remove_if_empty(created)  # a run that stopped before writing anything leaves no folder


def _stop_all_if_refused(refusal: Optional[ModelDirLockedError], model_dir: str) -> None:
  """Raises process 0's refusal there, and a pointer to it on the other processes (which
  would otherwise wait for process 0 in the first collective)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    refused = multihost_utils.process_allgather(np.asarray(int(refusal is not None), np.int32))
    if refusal is None and np.any(refused):
      raise ModelDirLockedError(f"Process 0 could not lock MODEL_DIR {model_dir} (its message "
                                "names the trainer holding it); this process stops too.")
  if refusal is not None:
    raise refusal


def _missing_folders(path: str) -> List[str]:
  """`path` and those of its parents that do not exist yet, deepest first."""
  missing = []
  while path and not os.path.exists(path):
    missing.append(path)
    path = os.path.dirname(path.rstrip(os.sep))
  return missing


def _remove_if_empty(folders: List[str]) -> None:
  for folder in folders:
    try:
      os.rmdir(folder)  # fails, and stops, at the first one that holds something
    except OSError:
      return


# ------------------------------------------------------------------------- remote folders
@contextlib.contextmanager
def _hold_remote(model_dir: str, command: Optional[str]) -> Iterator[None]:
  """`hold` for a URL: the lock object MODEL_DIR/.lock (see the module docstring)."""
  path, refusal, token = fileio.join(model_dir, LOCK_NAME), None, None
  if jax.process_index() == 0:
    try:
      token = _acquire_remote(path, command)
    except ModelDirLockedError as e:
      refusal = e
  _stop_all_if_refused(refusal, model_dir)
  try:
    yield
  finally:
    if token is not None and (_read_remote(path) or {}).get("token") == token:
      fileio.as_path(path).unlink()


def _read_remote(path: str) -> Optional[Dict]:
  """The lock object's JSON ({} when it is not JSON), None when there is no object."""
  try:
    raw = fileio.as_path(path).read_bytes()
  except FileNotFoundError:
    return None
  return _holder(raw)


def _acquire_remote(path: str, command: Optional[str]) -> str:
  """Creates the lock object (or takes over a stale one); returns this run's token."""
  me = dict(_this_process(command), token=uuid.uuid4().hex)
  holder = _read_remote(path)
  if holder is not None:
    _check_left_behind(path, holder)  # refuses, or notes a stale lock to take over
    fileio.as_path(path).write_bytes(json.dumps(me).encode() + b"\n")
  elif not _create_if_absent(path, json.dumps(me).encode() + b"\n"):
    raise _refuse(path, _read_remote(path) or {}, "it was created as this run started")
  if (_read_remote(path) or {}).get("token") != me["token"]:
    raise _refuse(path, _read_remote(path) or {}, "it was taken as this run started")
  return me["token"]


def _create_if_absent(path: str, data: bytes) -> bool:
  """Writes `data` to the object `path` unless one exists (False then): gcsfs's exclusive
  open, a precondition GCS checks; without gcsfs a plain write after the existence check."""
  try:
    import fsspec
    fs, name = fsspec.core.url_to_fs(path)
  except (ImportError, ValueError):  # no fsspec filesystem for the scheme: epath's write
    fileio.as_path(path).write_bytes(data)
    return True
  try:
    with fs.open(name, "xb") as f:
      f.write(data)
  except FileExistsError:
    return False
  return True
