"""A quiet console for the command-line entry points (`cli.main` uses both parts).

TensorFlow is only the input pipeline here, but importing it prints its C++ start-up lines
on stderr (oneDNN, "Could not find cuda drivers", once per TF library that loads them) and
its first look for devices prints `failed call to cuInit ... (303)` on a machine without a
GPU. These lines come from absl's C++ logging before it is initialised, which
TF_CPP_MIN_LOG_LEVEL does not reach, so `import_tensorflow_quietly` imports TensorFlow with the process's
stderr file descriptor pointed at /dev/null, and hides the accelerators from it (JAX keeps
them; TF would otherwise reserve GPU memory). Python's own errors, warnings and tracebacks
are untouched.

`library_warnings_through_tqdm()` routes the library's warnings (the `decal_jax.*` loggers,
e.g. the counts of cut sequences, which the input pipeline logs from its threads
mid-training) through `tqdm.write` for the length of a run, so they print above the progress
bar instead of breaking it.
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


@contextlib.contextmanager
def library_warnings_through_tqdm():
  """For the block (an entry point's run), the `decal_jax` loggers' warnings go to stderr
  through `tqdm.write`, and only there: they do not also propagate to the root logger's
  handlers, which would print them a second time, breaking the bar. Restored afterwards, so
  a host program (or a test) that ran an entry point in-process keeps its own logging."""
  logger = logging.getLogger("decal_jax")
  handler = TqdmHandler(logging.WARNING)
  handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
  propagate = logger.propagate
  logger.addHandler(handler)
  logger.propagate = False
  try:
    yield
  finally:
    logger.removeHandler(handler)
    logger.propagate = propagate
