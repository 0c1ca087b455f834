"""decal_jax.runtime.console: the library's warnings print through tqdm.write in the CLI and its
INFO lines through the root logger's handlers; the C++ stderr of a block is hidden while
Python's stays; the bar is off off a terminal; the device line and the warning for an
accelerator extra that found no accelerator (the CLI's own run: test_entry_points)."""
import importlib.util
import io
import logging
import os
import subprocess
import sys

import tqdm

from decal_jax.runtime import console


def test_library_warnings_go_through_tqdm_write_only_inside_the_block(monkeypatch, caplog):
  written = []
  monkeypatch.setattr(tqdm.tqdm, "write", lambda text, file=None: written.append(text))
  logger = logging.getLogger("decal_jax")
  handlers, propagate = list(logger.handlers), logger.propagate
  source = logging.getLogger("decal_jax.data.text_to_text")
  with caplog.at_level(logging.WARNING):
    with console.library_warnings_through_tqdm():
      source.warning("t: %d sequence(s) cut", 1)
      source.info("not shown")
    assert (logger.handlers, logger.propagate) == (handlers, propagate)  # restored
    source.warning("after the run")
  assert written == ["WARNING: t: 1 sequence(s) cut"]  # printed once, through tqdm
  assert [r.getMessage() for r in caplog.records] == ["after the run"]  # not also via root


def test_library_warnings_also_reach_a_log_file_handler_in_its_format_and_only_there(
    monkeypatch, caplog):
  """--log_dir: the warnings go into absl's log file (`log_file`, a StreamHandler on it), in
  that handler's line format, once; INFO lines are left to the root handlers; a handler that
  writes to stderr (--logtostderr) gets no copy, tqdm already printed it there."""
  written = []
  monkeypatch.setattr(tqdm.tqdm, "write", lambda text, file=None: written.append(text))
  log_file = logging.StreamHandler(io.StringIO())
  log_file.setFormatter(logging.Formatter("%(levelname).1s %(name)s] %(message)s"))
  source = logging.getLogger("decal_jax.runtime.run_lock")
  with caplog.at_level(logging.INFO, logger="decal_jax"):
    with console.library_warnings_through_tqdm(log_file):
      source.warning("stale %s", "lock")
      source.info("train step 1/2")
    source.warning("after the run")
    with console.library_warnings_through_tqdm(logging.StreamHandler(sys.stderr)):
      source.warning("to stderr")
  assert log_file.stream.getvalue() == "W decal_jax.runtime.run_lock] stale lock\n"
  assert written == ["WARNING: stale lock", "WARNING: to stderr"]


def test_python_warnings_take_the_library_warnings_way_inside_the_block_only(monkeypatch,
                                                                          caplog):
  """`warnings.warn` in a run (the library's own, or another package's) printed raw across
  the bar and never reached the --log_dir file: inside the block it is written once through
  tqdm and into the log file, not also through the root handlers; afterwards warnings are
  shown as before."""
  import warnings
  written = []
  monkeypatch.setattr(tqdm.tqdm, "write", lambda text, file=None: written.append(text))
  log_file = logging.StreamHandler(io.StringIO())
  log_file.setFormatter(logging.Formatter("%(levelname).1s %(name)s] %(message)s"))
  showwarning = warnings.showwarning
  with caplog.at_level(logging.WARNING):
    with console.library_warnings_through_tqdm(log_file):
      warnings.warn("a package's deprecation, mid-run", UserWarning, stacklevel=1)
    assert warnings.showwarning is showwarning  # restored
    with warnings.catch_warnings(record=True) as after:
      warnings.simplefilter("always")
      warnings.warn("after the run", UserWarning, stacklevel=1)
  assert len(written) == 1 and written[0].startswith("WARNING: ")
  assert "test_console.py:" in written[0]  # file:line: Category: message, and its source line
  assert "UserWarning: a package's deprecation, mid-run\n  warnings.warn(" in written[0]
  assert not written[0].endswith("\n")
  assert log_file.stream.getvalue() == "W py.warnings] " + written[0][len("WARNING: "):] + "\n"
  assert caplog.records == [] and [str(w.message) for w in after] == ["after the run"]


def test_native_stderr_is_hidden_only_inside_the_block():
  code = ("import os, sys\n"
          "from decal_jax.runtime import console\n"
          "with console.native_stderr_hidden():\n"
          "  os.write(2, b'native inside\\n')\n"
          "os.write(2, b'native after\\n')\n"
          "print('python after', file=sys.stderr)\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env=dict(os.environ), timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr == "native after\npython after\n"


def test_library_info_lines_reach_the_root_handlers_once_and_warnings_only_tqdm(monkeypatch,
                                                                                caplog):
  """Inside the block an INFO line (the trainer's step line) goes to the root logger's
  handlers (absl's in an entry point: stderr or the --log_dir file) with the bar cleared for
  the write; a warning still goes only through tqdm.write."""
  written = []
  monkeypatch.setattr(tqdm.tqdm, "write", lambda text, file=None: written.append(text))
  caplog.set_level(logging.INFO, logger="decal_jax")
  source = logging.getLogger("decal_jax.runtime.trainer")
  with console.library_warnings_through_tqdm():
    source.info("train step 1/2: loss=9")
    source.warning("cut")
  assert [r.getMessage() for r in caplog.records] == ["train step 1/2: loss=9"]
  assert written == ["WARNING: cut"]


class _Stream:
  def __init__(self, tty):
    self.tty = tty

  def isatty(self):
    return self.tty

  def write(self, text):
    return len(text)

  def flush(self):
    pass


def test_the_bar_is_off_off_a_terminal_and_else_left_to_tqdm(monkeypatch):
  """A pipe or a file (or a process other than 0) gets disable=True; a terminal gets no
  `disable` at all, so tqdm's own TQDM_DISABLE still turns it off."""
  monkeypatch.setattr(sys, "stderr", _Stream(tty=False))
  assert console.bar_options(0) == {"disable": True}
  monkeypatch.setattr(sys, "stderr", _Stream(tty=True))
  assert console.bar_options(0) == {} and console.bar_options(1) == {"disable": True}
  code = "import tqdm; print(tqdm.tqdm(range(3)).disable)"  # tqdm reads TQDM_* on import
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env=dict(os.environ, TQDM_DISABLE="1"), timeout=120)
  assert proc.stdout.strip() == "True", proc.stderr


class _Device:
  def __init__(self, platform, kind):
    self.platform, self.device_kind = platform, kind


def test_the_device_line_names_backend_count_and_kind():
  assert console.device_line([_Device("cpu", "cpu")]) == "JAX backend: cpu, 1 device (cpu)"
  gpus = [_Device("gpu", "NVIDIA H200")] * 8
  assert console.device_line(gpus) == "JAX backend: gpu, 8 devices (NVIDIA H200)"
  assert console.device_line(gpus, process_count=2) == (
      "JAX backend: gpu, 8 devices (NVIDIA H200) over 2 processes")


def _installed(monkeypatch, *modules):
  """importlib.util.find_spec as if exactly `modules` of the accelerator extras were there."""
  extras = {module for module, _, _ in console.ACCELERATOR_EXTRAS}
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
      (object() if name in modules else None) if name in extras else find_spec(name, *a)))


def test_an_installed_gpu_extra_with_only_a_cpu_is_a_warning(monkeypatch):
  cpu, gpu = [_Device("cpu", "cpu")], [_Device("gpu", "NVIDIA H200")]
  _installed(monkeypatch, "jax_cuda12_plugin")
  warning = console.cpu_only_warning(cpu, None)
  assert warning.startswith("decal_jax[cuda12] is installed (jax_cuda12_plugin) but JAX sees "
                            "only the CPU") and "--jax_platforms=cpu" in warning
  assert console.cpu_only_warning(gpu, None) is None           # it found the GPU
  assert console.cpu_only_warning(cpu, "cpu") is None          # the CPU was asked for
  _installed(monkeypatch, "libtpu")
  assert "decal_jax[tpu] is installed (libtpu)" in console.cpu_only_warning(cpu, "")
  _installed(monkeypatch)
  assert console.cpu_only_warning(cpu, None) is None           # a CPU-only install


def test_report_devices_logs_the_line_and_the_warning(monkeypatch, caplog):
  import jax
  monkeypatch.setattr(jax, "devices", lambda *a: [_Device("cpu", "cpu")] * 2)
  monkeypatch.setattr(type(jax.config), "jax_platforms", property(lambda self: None))
  _installed(monkeypatch, "jax_cuda12_plugin")
  caplog.set_level(logging.INFO, logger="decal_jax")
  console.report_devices()
  assert [(r.levelname, r.getMessage()[:40]) for r in caplog.records] == [
      ("INFO", "JAX backend: cpu, 2 devices (cpu)"),
      ("WARNING", "decal_jax[cuda12] is installed (jax_cuda")]
