"""Starting several processes of one multi-process run from a test, and collecting them."""
import socket
import subprocess


def free_port() -> int:
  """A TCP port on localhost that nothing listens on now (for jax.distributed's
  coordinator)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
  """Each process's (stdout, stderr), waiting up to `timeout` seconds for each. If one fails
  or hangs, the others are killed rather than left waiting for it in a collective."""
  try:
    return [proc.communicate(timeout=timeout) for proc in procs]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
