"""Files that are written whole or not at all.

`atomic_write` is the one way the library writes a result file: into a temporary file in
the target's own folder (so the final rename never crosses a file system), then
`os.replace` over the target. A reader sees the old file or the new one, never a part; a
failure (an exception, Ctrl-C) removes the temporary file and leaves the target as it was.
`atomic_directory` does the same for a folder of files built together. `read_utf8` reads
a user's text file whole, naming the file and line of any bytes that are not UTF-8.
"""
import contextlib
import os
import pathlib
import shutil
import tempfile
from typing import IO, Iterator, Union

PathLike = Union[str, os.PathLike]


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
  tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{path.name}.tmp-"))
  try:
    yield tmp
    tmp.chmod(0o755)
    if replace:
      _replace_directory(tmp, path)
    else:
      tmp.rename(path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


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
