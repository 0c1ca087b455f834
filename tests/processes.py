"""Starting several processes of one multi-process run from a test, and collecting them."""
import socket
import subprocess


_HANDED_OUT = set()  # the ports free_port gave this test process


def free_port() -> int:
  """A TCP port on localhost that nothing listens on now (for jax.distributed's coordinator)
  and that this test process was not given before: two jobs started in a row (a reference
  beside a faulted job) must not share one, and the first has not bound its port yet when
  the second asks."""
  while True:
    with socket.socket() as s:
      s.bind(("localhost", 0))
      port = s.getsockname()[1]
    if port not in _HANDED_OUT:
      _HANDED_OUT.add(port)
      return port


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
  """Each process's (stdout, stderr), waiting up to `timeout` seconds for each. If one fails
  or hangs, the others are killed rather than left waiting for it in a collective."""
  try:
    return [proc.communicate(timeout=timeout) for proc in procs]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
