"""tools/lease_smollm2_autoencode.sh, the parts that need no GPU: a `run` on a machine that did
not `stash` stops before installing or writing anything and says why; `stash` leaves the
first part byte for byte; an unknown step prints the usage. (The whole lease was rehearsed on
CPU with tiny flags: docs/results/performance_log.md.)"""
import os
import subprocess

import paths

SCRIPT = paths.REPO / "tools" / "lease_smollm2_autoencode.sh"


def _run(args, cwd, **env):
  return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True,
                        env={**os.environ, **env}, check=False, timeout=60)


def test_a_run_without_the_stashed_part_stops_at_once_and_writes_nothing(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  result = _run(["run"], tmp_path, STASH=str(tmp_path / "absent"), OUT=str(out))
  assert result.returncode == 3
  assert "no " + str(tmp_path / "absent") in result.stdout and "stash" in result.stdout
  assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_stash_leaves_the_first_part_byte_for_byte(tmp_path):
  part = bytes(range(256)) * 64
  (tmp_path / ".device_model_a").mkdir()
  (tmp_path / ".device_model_a" / "gguf_a").write_bytes(part)
  result = _run(["stash"], tmp_path, STASH=str(tmp_path / "stashed"))
  assert result.returncode == 0, result.stderr
  assert (tmp_path / "stashed").read_bytes() == part


def test_an_unknown_step_prints_the_usage(tmp_path):
  result = _run(["train"], tmp_path)
  assert result.returncode == 2 and "prepare|stash|run|setting" in result.stdout


def test_the_lease_trains_in_the_gpu_suites_setting():
  """The lease's flags parse to the suite part's segment length, batch, schedule and held-out
  sizes (only the ratios, seeds, steps and evaluation period differ)."""
  from tools import gpu_suite_scales, smollm2_autoencode
  result = _run(["setting"], paths.REPO, PYTHONPATH=str(paths.REPO))
  assert result.returncode == 0, result.stderr
  lease = vars(smollm2_autoencode.parse(result.stdout.split()))
  suite = vars(smollm2_autoencode.parse(gpu_suite_scales.SMOLLM2_AUTOENCODE))
  own = {"ratios", "selections", "seeds", "steps", "eval_every", "argv"}
  assert {k: v for k, v in lease.items() if k not in own} == \
      {k: v for k, v in suite.items() if k not in own}
  assert lease["length"] == 256 and lease["batch"] == 16
