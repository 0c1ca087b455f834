"""tools/smollm2_runs.py, the resumable sweep and common flags of the SmolLM2 tools, held to
outcomes worked out by hand: records read back in the order written, a sweep stopped by a
failing run keeps the runs finished before it and the table written after each, and the
common flags' refusals."""
import argparse

import pytest

from tools import results_files, smollm2_runs


def test_records_read_back_in_the_order_written(tmp_path):
  log = smollm2_runs.log_path(str(tmp_path / "work"), "n64_steps2")
  assert log == tmp_path / "work" / "n64_steps2.jsonl" and smollm2_runs.read(log) == []
  results_files.write_jsonl(str(log), [{"seed": 0, "nll": [1.5]}, {"latency": {"ratio": 4}}])
  assert smollm2_runs.read(log) == [{"seed": 0, "nll": [1.5]}, {"latency": {"ratio": 4}}]


def test_a_stopped_sweep_keeps_what_finished_and_its_table(tmp_path, capsys):
  log, records, tables = tmp_path / "runs.jsonl", [{"seed": 0}], []

  def train(seed):
    if seed == 2:
      raise KeyboardInterrupt  # stopped during the third run
    return {"seed": seed}
  with pytest.raises(KeyboardInterrupt):
    smollm2_runs.sweep([1, 2, 3], log, records, train,
                       lambda: tables.append([r["seed"] for r in records]))
  assert smollm2_runs.read(log) == [{"seed": 1}] and records == [{"seed": 0}, {"seed": 1}]
  assert tables == [[0, 1]]
  assert "run 1 (1 of 3)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,minimum,needle", [
    (["--layers", "2"], 3, "--layers must be at least 3: the scorer reads"),
    (["--layers", "0"], 1, "--layers must be at least 1"),
    (["--eval-every", "0"], 1, "--eval-every and --eval-batch must be at least 1")])
def test_the_common_flags_refuse_what_cannot_run(capsys, argv, minimum, needle):
  p = argparse.ArgumentParser()
  smollm2_runs.add_arguments(p, work="runs/x", lr=1e-3, warmup=2, eval_every=5, eval_batch=4)
  args = p.parse_args(argv)
  with pytest.raises(SystemExit):
    smollm2_runs.check_arguments(p, args, argv, min_layers=minimum)
  assert needle in capsys.readouterr().err
