"""Stopping a benchmark tool right after its first partial results, as gpu_suite's time
limit would (tests of `results_files.write_partial`'s callers)."""


class Stop(Exception):
  """Raised right after the first partial write."""


def stop_after_first_partial(monkeypatch, results_files) -> list:
  """Makes the tool's next `write_partial` (its `results_files` module's) write, then raise
  `Stop`; returns the list that then holds the rows it wrote."""
  finished, real_write = [], results_files.write_partial

  def write_then_stop(args, rows, *more, **kwargs):
    real_write(args, rows, *more, **kwargs)
    finished.extend(rows)
    raise Stop
  monkeypatch.setattr(results_files, "write_partial", write_then_stop)
  return finished
