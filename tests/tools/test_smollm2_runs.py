"""tools/smollm2_runs.py, the resumable sweep and common flags of the SmolLM2 tools, held to
outcomes worked out by hand: records read back in the order written, a sweep stopped by a
failing run keeps the runs finished before it and the table written after each, and the
common flags' refusals."""
import argparse

import pytest

from tools import results_files, smollm2_runs


def test_records_read_back_in_the_order_written(tmp_path):
  log, records = smollm2_runs.open_records(str(tmp_path / "work"), "n64_steps2", None)
  assert log == tmp_path / "work" / "n64_steps2.jsonl" and records == []
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


def _written_from(tmp_path, lines: int):
  """A results file written by `report` from `lines` records in work/a.jsonl, and that log."""
  log = tmp_path / "work" / "a.jsonl"
  results_files.write_jsonl(str(log), [{"seed": s} for s in range(lines)])
  out = tmp_path / "table.md"
  smollm2_runs.report("| r | BLEU |\n|---|---|\n| 10 | 8.1 |", str(out), log, lines)
  return out, log


def test_a_table_is_not_rewritten_from_fewer_records_than_it_came_from(tmp_path):
  out, log = _written_from(tmp_path, 3)
  before = out.read_text()
  log.write_text(log.read_text().splitlines()[0] + "\n")  # a checkout holding 1 of the 3
  with pytest.raises(SystemExit) as refused:
    smollm2_runs.open_records(str(log.parent), "a", str(out))
  message = str(refused.value)
  assert "written from 3 records" in message and "from 1 in" in message
  assert "--work" in message and "--out at a new file" in message
  assert out.read_text() == before


def test_a_table_is_not_rewritten_from_another_records_file(tmp_path):
  out, _ = _written_from(tmp_path, 2)
  other = tmp_path / "work" / "b.jsonl"  # other flags name another file
  results_files.write_jsonl(str(other), [{"seed": s} for s in range(5)])
  with pytest.raises(SystemExit, match="a.jsonl"):
    smollm2_runs.check_out(str(out), other, 5)


def test_a_table_is_rewritten_from_its_records_or_more_and_a_new_file_is_written(tmp_path):
  out, log = _written_from(tmp_path, 2)
  smollm2_runs.check_out(str(out), log, 2)
  smollm2_runs.check_out(str(out), log, 3)  # a run added since
  smollm2_runs.check_out(str(tmp_path / "new.md"), log, 0)
  smollm2_runs.check_out(None, log, 0)
  (tmp_path / "by_hand.md").write_text("a table with no records line\n")
  smollm2_runs.check_out(str(tmp_path / "by_hand.md"), log, 0)
