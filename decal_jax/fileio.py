"""Files that are written whole or not at all.

`atomic_write` is the one way the library writes a result file: into a temporary file in
the target's own folder (so the final rename never crosses a file system), then
`os.replace` over the target. A reader sees the old file or the new one, never a part; a
failure (an exception, Ctrl-C) removes the temporary file and leaves the target as it was.
`atomic_directory` does the same for a folder of files built together; a build killed
outright (`kill -9`, a lost machine) leaves its `<name>.tmp-<random>` folder, which the next
build of the same folder removes (`remove_stale_temporaries`). `read_utf8` reads a user's
text file whole, naming the file and line of any bytes that are not UTF-8.
"""
import contextlib
import fcntl
import json
import logging
import os
import pathlib
import re
import shutil
import socket
import tempfile
import time
from typing import IO, Iterator, List, Optional, Union

PathLike = Union[str, os.PathLike]
log = logging.getLogger(__name__)  # decal_jax.* warnings: console.py routes them in the CLI
OWNER_FILE = ".tmp-owner"  # in a folder being built: flock-ed by the building process
UNOWNED_STALE_S = 600  # a temporary folder without an owner file (a build from before it,
# or one killed within microseconds of starting) is stale once unchanged this long


class NotUtf8Error(ValueError):
  """A text file with bytes that are not UTF-8 (the message names file and line)."""


def read_utf8(path: PathLike) -> str:
  """The whole of a UTF-8 text file; NotUtf8Error names the line of a bad byte."""
  raw = pathlib.Path(path).read_bytes()
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw[:e.start].count(b"\n") + 1
    raise NotUtf8Error(f"{path}:{line}: not UTF-8 ({e.reason}); re-save the file as "
                       "UTF-8.") from None


@contextlib.contextmanager
def atomic_write(path: PathLike, mode: str = "w",
                 encoding: str = "utf-8") -> Iterator[IO]:
  """Opens a temporary file beside `path` for writing; renames it over `path` on success.

  `mode` is 'w' (text, `encoding`) or 'wb' (bytes). Parent folders are created. The file
  gets mode 0o644 (mkstemp's 0o600 would hide results from other users of a shared disk).
  """
  if mode not in ("w", "wb"):
    raise ValueError(f"atomic_write writes whole files: mode must be 'w' or 'wb', not {mode!r}")
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
  try:
    with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding})) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise


def write_text_atomic(path: PathLike, text: str) -> None:
  """Writes `text` (UTF-8) to `path` whole or not at all."""
  with atomic_write(path, "w") as f:
    f.write(text)


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
  """Writes `data` to `path` whole or not at all."""
  with atomic_write(path, "wb") as f:
    f.write(data)


@contextlib.contextmanager
def atomic_directory(path: PathLike, replace: bool = True) -> Iterator[pathlib.Path]:
  """Yields an empty temporary folder beside `path`; on success renames it to `path`.

  replace: an existing folder at `path` is moved aside, replaced, then deleted; with
  replace=False the final rename fails (OSError) if a non-empty folder is there, e.g. one
  another process finished meanwhile. The temporary folder is named
  `<name>.tmp-<random>`, so a crash that skips the cleanup leaves a name that says what it
  is; a failure inside the `with` body deletes it and leaves `path` as it was. The folder
  gets mode 0o755 (mkdtemp's 0o700 would outlive the rename).
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  remove_stale_temporaries(path)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{path.name}.tmp-"))
  owner = _own(tmp)
  try:
    yield tmp
    tmp.chmod(0o755)
    (tmp / OWNER_FILE).unlink()  # still locked through `owner` until the rename is done
    if replace:
      _replace_directory(tmp, path)
    else:
      tmp.rename(path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    os.close(owner)


def _temporary_name(path: pathlib.Path) -> "re.Pattern":
  """The names `atomic_directory` gives its temporary folders for `path` (mkdtemp's)."""
  return re.compile(re.escape(path.name) + r"\.tmp-[a-z0-9_]{8}")


def _own(tmp: pathlib.Path) -> int:
  """Marks `tmp` as being built by this process: a lock (released by the kernel however the
  process ends) on its owner file, which also names the process for a person."""
  fd = os.open(tmp / OWNER_FILE, os.O_RDWR | os.O_CREAT, 0o644)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.time()}).encode())
  return fd


def remove_stale_temporaries(path: PathLike) -> List[pathlib.Path]:
  """Deletes the temporary folders `atomic_directory` left beside `path` in builds that
  were killed outright (only names of its own pattern, `<name>.tmp-<8 characters>`): those
  whose owner file no process holds locked, and those without one (from before the owner
  file, or killed as they began) unchanged for UNOWNED_STALE_S. A folder a running build
  holds is kept. Each removal is named in a WARNING; returns the folders removed."""
  path = pathlib.Path(path)
  if not path.parent.is_dir():
    return []
  pattern, removed = _temporary_name(path), []
  for folder in sorted(path.parent.iterdir()):
    if not pattern.fullmatch(folder.name) or not folder.is_dir() or folder.is_symlink():
      continue
    why = _stale_because(folder)
    if why:
      log.warning("Removed %s, the temporary folder of a build of %s that was killed "
                  "before it finished (%s).", folder, path, why)
      removed.append(folder)
  return removed


def _stale_because(folder: pathlib.Path) -> Optional[str]:
  """Why `folder` is stale, having deleted it ('' or None: kept, a build still holds it)."""
  try:
    fd = os.open(folder / OWNER_FILE, os.O_RDONLY)
  except FileNotFoundError:
    age = time.time() - folder.stat().st_mtime
    if age < UNOWNED_STALE_S:
      return None
    shutil.rmtree(folder, ignore_errors=True)
    return f"no owner file, unchanged for {age / 60:.0f} minutes"
  except OSError:
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:  # held: its build is running
    os.close(fd)
    return None
  try:
    owner = _describe_owner(os.read(fd, 4096))
    shutil.rmtree(folder, ignore_errors=True)
  finally:
    os.close(fd)
  return f"{owner} no longer holds it"


def _describe_owner(record: bytes) -> str:
  try:
    owner = json.loads(record)
    return f"pid {owner['pid']} on {owner['host']}"
  except (ValueError, KeyError, TypeError):
    return "no process"


def _replace_directory(new: pathlib.Path, path: pathlib.Path) -> None:
  """Renames `new` to `path`; an old `path` is renamed aside first and deleted after."""
  if not path.exists():
    new.rename(path)
    return
  old = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{path.name}.old-"))
  old.rmdir()
  path.rename(old)
  new.rename(path)
  shutil.rmtree(old, ignore_errors=True)
