"""A quiet console for the command-line entry points (`console.setup()`).

TensorFlow is only the input pipeline here, but importing it prints its C++ start-up lines
on stderr (oneDNN, "Could not find cuda drivers", once per TF library that loads them) and
its first look for devices prints `failed call to cuInit ... (303)` on a machine without a
GPU. These lines come from absl's C++ logging before it is initialised, which
TF_CPP_MIN_LOG_LEVEL does not reach, so `setup` imports TensorFlow with the process's
stderr file descriptor pointed at /dev/null, and hides the accelerators from it (JAX keeps
them; TF would otherwise reserve GPU memory). Python's own errors, warnings and tracebacks
are untouched.

It also routes the library's warnings (the `decal_jax.*` loggers, e.g. the counts of cut
sequences, which the input pipeline logs from its threads mid-training) through
`tqdm.write`, so they print above the progress bar instead of breaking it.
"""
import contextlib
import logging
import os
import sys

import tqdm


@contextlib.contextmanager
def native_stderr_hidden():
  """Points file descriptor 2, where C++ libraries write, at /dev/null for the block."""
  sys.stderr.flush()
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, 2)
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)


def import_tensorflow_quietly() -> None:
  """Imports TensorFlow with its C++ start-up logging hidden, on the CPU only."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # its later C++ info / warning lines
  with native_stderr_hidden():
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    try:
      tf.config.set_visible_devices([], "GPU")  # looks for devices (cuInit) here, quietly
    except RuntimeError:  # TF's devices were already in use: too late to hide them
      pass


class TqdmHandler(logging.Handler):
  """Writes log records with `tqdm.write`, which keeps an open progress bar intact."""

  def emit(self, record: logging.LogRecord) -> None:
    try:
      tqdm.tqdm.write(self.format(record), file=sys.stderr)
    except Exception:  # pylint: disable=broad-except
      self.handleError(record)


def route_library_warnings_through_tqdm() -> None:
  """The `decal_jax` loggers' warnings go to stderr through `tqdm.write`, once."""
  logger = logging.getLogger("decal_jax")
  if not any(isinstance(h, TqdmHandler) for h in logger.handlers):
    handler = TqdmHandler(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def setup() -> None:
  """What every entry point calls before it imports the input pipeline (TensorFlow)."""
  import_tensorflow_quietly()
  route_library_warnings_through_tqdm()
