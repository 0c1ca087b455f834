"""decal_jax.runtime.console: the library's warnings print through tqdm.write in the CLI; the C++
stderr of a block is hidden while Python's stays (the CLI's own run: test_entry_points)."""
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
