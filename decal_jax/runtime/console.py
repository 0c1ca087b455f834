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
bar instead of breaking it, and with absl's `--log_dir` also into that log file (absl's line
format, the file only: the console copy is tqdm's); Python's `warnings.warn` messages take
the same way for the run (`logging.captureWarnings`); the library's INFO lines (the device
line, the training step lines) go to the root logger's handlers (absl's in an entry point:
stderr, or the --log_dir file) with the bar cleared for the write. `bar_options` turns the
bar off where it would only clutter a log: on a stderr that is not a terminal.

`report_devices()` logs the start-up line every entry point prints once JAX has loaded
(`JAX backend: cpu, 1 device (cpu)`), and a warning when a GPU / TPU extra is installed but
JAX sees only the CPU.
"""
import contextlib
import importlib.util
import logging
import os
import sys
from typing import Dict, Optional, Sequence

import tqdm

log = logging.getLogger(__name__)
# (module an accelerator extra installs, the extra, the accelerator): pyproject's extras
ACCELERATOR_EXTRAS = (("jax_cuda12_plugin", "cuda12", "GPU"), ("libtpu", "tpu", "TPU"))


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
    import tensorflow as tf
    try:
      tf.config.set_visible_devices([], "GPU")  # looks for devices (cuInit) here, quietly
    except RuntimeError:  # TF's devices were already in use: too late to hide them
      pass


class TqdmHandler(logging.Handler):
  """Writes log records with `tqdm.write`, which keeps an open progress bar intact."""

  def emit(self, record: logging.LogRecord) -> None:
    try:
      tqdm.tqdm.write(self.format(record), file=sys.stderr)
    except Exception:
      self.handleError(record)


class AboveTheBar(logging.Handler):
  """Hands each record to the root logger's handlers with any tqdm bar cleared for the
  write (and redrawn after), so a log line never lands in the middle of the bar."""

  def emit(self, record: logging.LogRecord) -> None:
    with tqdm.tqdm.external_write_mode(file=sys.stderr):
      logging.getLogger().handle(record)


class CopyToLogFile(logging.Handler):
  """Writes each record into the file of `target`, a StreamHandler on a log file (absl's
  handler after --log_dir), formatted as that handler's own lines, and nowhere else."""

  def __init__(self, target: logging.StreamHandler, level: int = logging.WARNING):
    super().__init__(level)
    self.target = target

  def emit(self, record: logging.LogRecord) -> None:
    self.target.acquire()  # the target's own lock: pipeline threads log warnings too
    try:
      self.target.stream.write(self.target.format(record) + "\n")
      self.target.stream.flush()
    except Exception:
      self.handleError(record)
    finally:
      self.target.release()


def _one_block(record: logging.LogRecord) -> bool:
  """A `warnings.warn` message as a log record: without the newline that ends it."""
  record.msg = str(record.msg).rstrip()
  return True


@contextlib.contextmanager
def library_warnings_through_tqdm(log_file: Optional[logging.StreamHandler] = None):
  """For the block (an entry point's run), the `decal_jax` loggers' warnings go to stderr
  through `tqdm.write`, and only there: they do not also propagate to the root logger's
  handlers, which would print them a second time, breaking the bar. `log_file`, the
  handler of a --log_dir file (absl's), gets them too, in the file only (not when it writes
  to stderr, as with --logtostderr). Their INFO lines go to the root logger's handlers
  (`AboveTheBar`). Python's `warnings.warn` messages (the library's own, e.g. an optimizer
  given no axis names, and any other package's) take the same way (`logging.captureWarnings`:
  the `py.warnings` logger): once above the bar, and into the --log_dir file, where they
  were printed raw across the bar and missing from the file. Python's warning filters
  still decide which are shown. Restored afterwards, so a host program (or a test) that ran
  an entry point in-process keeps its own logging and warnings."""
  loggers = [logging.getLogger("decal_jax"), logging.getLogger("py.warnings")]
  warnings = TqdmHandler(logging.WARNING)
  warnings.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
  info = AboveTheBar()
  info.addFilter(lambda record: record.levelno < logging.WARNING)
  added = [warnings, info]
  if log_file is not None and log_file.stream not in (sys.stderr, sys.__stderr__):
    added.append(CopyToLogFile(log_file))
  propagate = [logger.propagate for logger in loggers]
  captured = logging._warnings_showwarning is not None  # captureWarnings(True) already
  for logger in loggers:
    for handler in added:
      logger.addHandler(handler)
    logger.propagate = False
  loggers[1].addFilter(_one_block)
  logging.captureWarnings(True)
  try:
    yield
  finally:
    if not captured:
      logging.captureWarnings(False)
    loggers[1].removeFilter(_one_block)
    for logger, was in zip(loggers, propagate):
      for handler in added:
        logger.removeHandler(handler)
      logger.propagate = was


def bar_options(process_index: int) -> Dict[str, bool]:
  """tqdm's `disable` for a progress bar: off on every process but 0, and when stderr is not
  a terminal (a pipe or a log file, which get the INFO step lines instead). Otherwise left
  unset, so tqdm's own TQDM_DISABLE (and its other TQDM_* variables) still apply: passing
  `disable=` would override them."""
  if process_index != 0 or not sys.stderr.isatty():
    return {"disable": True}
  return {}


# ------------------------------------------------------------------------------ devices
def device_line(devices: Sequence, process_count: int = 1) -> str:
  """'JAX backend: gpu, 8 devices (NVIDIA H100 80GB HBM3)': the platform, how many devices
  (of every process) and their kinds."""
  kinds = ", ".join(sorted({d.device_kind for d in devices}))
  count = f"{len(devices)} device{'s' if len(devices) != 1 else ''}"
  processes = f" over {process_count} processes" if process_count > 1 else ""
  return f"JAX backend: {devices[0].platform}, {count} ({kinds}){processes}"


def cpu_only_warning(devices: Sequence, platforms: Optional[str]) -> Optional[str]:
  """Why a run that could use an accelerator is on the CPU, or None: an accelerator extra is
  installed (its module importable) but JAX sees only CPU devices, and the CPU was not
  asked for (--jax_platforms / JAX_PLATFORMS = cpu)."""
  if any(d.platform != "cpu" for d in devices):
    return None
  if platforms and {p.strip() for p in platforms.split(",")} == {"cpu"}:
    return None
  for module, extra, kind in ACCELERATOR_EXTRAS:
    if importlib.util.find_spec(module) is not None:
      return (f"decal_jax[{extra}] is installed ({module}) but JAX sees only the CPU: no "
              f"{kind} was found or it failed to start (JAX's own message above says why; "
              f"check the driver, e.g. nvidia-smi, and CUDA_VISIBLE_DEVICES / JAX_PLATFORMS). "
              "Pass --jax_platforms=cpu to run on the CPU on purpose.")
  return None


def report_devices() -> None:
  """Logs the device line (INFO, process 0) and `cpu_only_warning` if there is one."""
  import jax
  devices = jax.devices()
  if jax.process_index() != 0:
    return
  log.info(device_line(devices, jax.process_count()))
  warning = cpu_only_warning(devices, jax.config.jax_platforms)
  if warning:
    log.warning(warning)
