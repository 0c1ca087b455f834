"""A checkpoint that does not fit on its disk: telling a full disk from other save errors,
removing the partial folder Orbax leaves, and the message that names what is intact and the
fix (`checkpoints.Checkpointer.save` raises `DiskFullError` with it)."""
import errno
import pathlib
import shutil
from typing import Any, Optional

import jax

from decal_jax import fileio

OUT_OF_SPACE = ("No space left on device", "Disk quota exceeded", "os_error_code='28'")


class DiskFullError(OSError):
  """A checkpoint did not fit on the disk of its MODEL_DIR (its partial folder is removed)."""

  def __init__(self, message: str):
    super().__init__(message)
    self.errno = errno.ENOSPC


def out_of_space(error: BaseException) -> bool:
  """True when `error` or an error it came from is a full disk (ENOSPC / EDQUOT; TensorStore
  reports them in its message as RESOURCE_EXHAUSTED)."""
  while error is not None:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    if any(mark in str(error) for mark in OUT_OF_SPACE):
      return True
    error = error.__cause__ or error.__context__
  return False


def disk_full_message(directory: Any, step: int, latest: Optional[int],
                      error: BaseException) -> str:
  """Removes checkpoint_<step>'s partial folder in `directory` (process 0); returns what
  happened, what is intact (checkpoint_<latest>) and the fix."""
  partial = [p for p in directory.iterdir()
             if p.name.startswith(f"checkpoint_{step}.orbax-checkpoint-tmp")]
  if jax.process_index() == 0:
    for folder in partial:
      if fileio.is_url(folder):
        folder.rmtree()  # an epath.Path
      else:
        shutil.rmtree(folder, ignore_errors=True)
  intact = (f"checkpoint_{latest} is intact and the same command resumes from it (steps "
            f"{latest + 1}-{step} are not saved)" if latest is not None else
            "no earlier checkpoint exists, so a rerun starts from step 0")
  return (f"checkpoint_{step} did not fit on the disk of {directory}"
          f"{_space_note(directory, latest)}. Removed its partial folder "
          f"({', '.join(p.name for p in partial) or 'none was left'}); {intact}. Free space "
          "there, keep fewer checkpoints (--gin.KEEP_CHECKPOINTS=1), or give a MODEL_DIR on "
          f"a larger disk. The storage said: {_shortened(str(error))}")


def _shortened(message: str) -> str:
  """The first line of `message`, its middle cut when long (TensorStore's paths are)."""
  line = message.strip().splitlines()[0]
  return line if len(line) <= 300 else f"{line[:100]} ... {line[-180:]}"


def _space_note(directory: Any, latest: Optional[int]) -> str:
  """' (N MB free; the last checkpoint takes M MB)' for a local MODEL_DIR, '' for a URL."""
  if fileio.is_url(directory):
    return ""
  free = shutil.disk_usage(directory).free
  note = f" ({free / 1e6:.1f} MB free"
  if latest is not None:
    folder = pathlib.Path(directory) / f"checkpoint_{latest}"
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    note += f"; checkpoint_{latest} takes {size / 1e6:.1f} MB"
  return note + ")"
