"""Every GPU measurement the docs promise, in one command, within 40 minutes of one H100.

  python -m tools.gpu_suite            # on the GPU machine, from the repository root
  python -m tools.gpu_suite --dry_run  # the same parts at tiny shapes on CPU (CI)
  python -m tools.gpu_suite --parts ablation --minutes 30  # some parts (comma-separated)
  python -m tools.gpu_suite --lease --parts train_probe,train
      # this workplace's device machine: 9 minutes, the parts its image runs (docs/performance.md)

Parts, in this order (--parts: those named, in the order named); each runs as subprocesses
under the part's time limit (at the limit: SIGTERM, then SIGKILL after a grace period), and
one that fails or runs out of time is recorded as such while the next part runs:
  xla_flags    tools/bench_xla_flags.py under each XLA_FLAG_SETS entry (cuBLAS or
               Triton GEMMs, autotuned or not): a T5.1.1-small encoder layer's compile time
               and TFLOP/s; the parts after it use the fastest set that compiles quickly;
  train_probe  tools/bench_train.py, T5.1.1-small DeCAL-4x, bf16, batch 128, 512 / 128: a
               short probe (a few steps) of every option set in OPTION_SETS (attention
               kernel, fused QKV, scan, remat policy), one subprocess each;
  train        the fastest probed set at C = 1, 2, 4, 8 (decal.gin, COMPRESSION_RATIO = C):
               step time, seq/s, MFU; then C = 4 again, a few steps traced by jax.profiler
               with CUDA graphs off: below the 40 % goal the summary lists the top ops and
               the op time by part of the step; the compiled HLO goes to the logs;
  inference    tools/bench_inference.py --gpu: T5.1.1-small encode 4k + generate 128 at C =
               1, 2, 4, 8, each at the batch that fills memory (goal: DeCAL-4x >= 2.5x C = 1);
  nuggets      tools/bench_nuggets.py in bf16 at 16k and 64k context;
  squid        tools/bench_squid.py --preset qwen2;
  gpthf        tools/bench_gpthf.py --preset paper;
  retrieval    tools/bench_retrieval.py, T5.1.1-small at C = 1, 2, 4, 8 (SciFact when
               --beir_folder or $DECAL_DATA_DIR (../shared/data)/beir/scifact exists, else the built-in folder);
  retrieval_scale  tools/bench_retrieval_scale.py: exact vs approximate search x
               residual bits x C on SciFact + TREC-DL 2019;
  retrieval_1m the same on the 1M-passage synthetic corpus at C = 4 (exact scan on the GPU
               against the approximate search; a lease of its own: --lease --parts
               retrieval_1m);
  retention    tools/retention_table.py at 1,200 steps per run (the budget
               docs/results/retention_cpu.md extrapolates for separating the ratios), for
               its time limit; finished runs are kept in retention_gpu.json (--record), so
               the next run, on any machine, continues with the runs not yet done;
  ablation     tools/ablate.py --budget gpu for the time left. Finished variants are kept in
               ablation_gpu_runs.json (ablate.py --record): the next run, on any machine,
               restores them and continues with the variants not yet done.

Results land in --out_dir (default docs/results; each part's files are in PARTS, with the
parts' code in tools/gpu_suite_parts.py), with gpu_suite_summary.md (and .json): per part
its status, wall time, limit, commands, device (jax.devices()[0].device_kind) and date;
the MFU of each C, the probe's step times and, below the goal, the profile. A run of some
--parts keeps the other parts' rows. --archive packs every file written into one .tar.gz
(for machines that return only a few files).
--dry_run: every part at tiny shapes on CPU (no cuDNN sets, C = 1 and 4, a one-variant
ablation budget), into a temporary folder unless --out_dir is given; minutes, for CI. The
parts marked `device_image` run there with TensorFlow, seqio, clu and t5 refused, as on the
workplace's GPU image. --lease: the GPU shapes in 9 minutes (gpu_suite_scales.lease_scale:
DeCAL-4x timed first, shorter part limits). --xla_flags fixes XLA_FLAGS for every part
(the xla_flags part then only measures). The parts share one persistent compilation cache:
$JAX_COMPILATION_CACHE_DIR where the caller sets it, else WORK/jax_cache.
"""
import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Tuple

from decal_jax import fileio  # light: the suite itself never touches the GPU
# F401: the names below that this file does not use are re-exported (tests and readers use
# them as gpu_suite.*): the scales' constants, and the parts' (tools/gpu_suite_parts.py).
from tools.gpu_suite_parts import (  # noqa: F401  (re-exports: see above)
    PARTS, REPO, Part, PartFailed, Suite, bench_train_argv, missing_data, part_ablation,
    part_retention, part_train, part_train_probe, part_xla_flags)
from tools.gpu_suite_report import render
from tools.gpu_suite_scales import (  # noqa: F401  (re-exports: see above)
    CUDNN, DEVICE_IMAGE_LACKS, GOAL_MFU, LEASE_MINUTES, LEASE_XLA_FLAGS, OPTION_SETS,
    PROFILE_XLA_FLAGS, PROFILED_RATIO, RATIOS, REFUSE_IMPORTS, RETENTION_STEPS, XLA_FLAG_SETS,
    Scale, choose_xla_flags, data_dir, dry_run_scale, gpu_scale, lease_scale)


def run_part(suite: Suite, part: Part, device: str) -> dict:
  """Runs one part within its limit; its summary row (status ok / failed / timeout /
  skipped, wall time, note, commands)."""
  start = time.time()
  limit = min(60 * suite.scale.minutes[part.name], suite.left())
  suite.part, suite.part_deadline = part.name, start + limit
  suite.refuse_dir = None
  if suite.dry_run and part.device_image:
    suite.refuse_dir = suite.work / "refuse_imports"
    fileio.write_text_atomic(suite.refuse_dir / "sitecustomize.py",
                             REFUSE_IMPORTS.format(lacks=set(DEVICE_IMAGE_LACKS)))
  row = dict(part=part.name, device=device, limit_s=round(limit),
             date=datetime.datetime.now().isoformat(timespec="seconds"),
             log=str(suite.logs / f"{part.name}.log"))
  if limit < 30:
    return dict(row, status="skipped", wall_s=0, note="no time left", commands=[])
  missing = missing_data(suite, part)
  if missing:
    note = (f"no data at {', '.join(missing)} (set DECAL_DATA_DIR to the shared data folder, "
            "or run from a checkout with ../shared/data beside it)")
    print(f"[{time.strftime('%H:%M:%S')}] {part.name} skipped: {note}", flush=True)
    return dict(row, status="skipped", wall_s=0, note=note, commands=[])
  print(f"[{time.strftime('%H:%M:%S')}] {part.name} (limit {limit / 60:.1f} min) ...", flush=True)
  try:
    note = part.run(suite)
    stale = [o for o in part.outputs if not (suite.out / o).exists() or
             (suite.out / o).stat().st_mtime < start - 1]
    status = "failed" if stale else "ok"
    note += f"; not written: {', '.join(stale)}" if stale else ""
  except PartFailed as e:
    status, note = e.status, str(e)
  except Exception as e:  # recorded; the next part runs
    status, note = "failed", f"{type(e).__name__}: {e}"
  row.update(status=status, wall_s=round(time.time() - start, 1), note=note,
             commands=suite.commands.get(part.name, []))
  log = suite.logs / f"{part.name}.log"
  if status != "ok" and log.exists():
    row["log_tail"] = log.read_text(errors="replace").splitlines()[-12:]
  print(f"  {status} in {row['wall_s']:.0f} s: {note}", flush=True)
  return row


def probe_device(dry_run: bool) -> Tuple[str, str]:
  """(platform, device kind) from a subprocess: the suite itself never takes the GPU."""
  env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if dry_run else {}))
  code = "import jax; d = jax.devices()[0]; print(d.platform); print(d.device_kind); " \
         "print(jax.__version__)"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True).stdout.split("\n")
  return out[0], f"{out[1]} ({out[0]}; jax {out[2]})"


# ----------------------------------------------------------------------------- main
def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dry_run", action="store_true", help="tiny shapes on CPU (CI)")
  p.add_argument("--parts", default=",".join(part.name for part in PARTS),
                 help="comma-separated parts to run, in the order given")
  p.add_argument("--minutes", type=float, default=None,
                 help="the whole run's budget (default 40; --lease 9; --dry_run 20)")
  p.add_argument("--lease", action="store_true", help="a short lease (this workplace's "
                 "device machine): the GPU shapes with gpu_suite_scales.lease_scale's limits")
  p.add_argument("--out_dir", type=pathlib.Path, default=None,
                 help="default docs/results (--dry_run: a temporary folder)")
  p.add_argument("--log_dir", type=pathlib.Path, default=None,
                 help="default runs/gpu_suite/logs (--dry_run: OUT_DIR/logs)")
  p.add_argument("--work", type=pathlib.Path, default=None, help="the ablation's and the "
                 "retention table's runs, in WORK/ablate and WORK/retention (default "
                 "runs/gpu_suite; --dry_run: OUT_DIR/work)")
  p.add_argument("--beir_folder", default=None, help="the retrieval benchmark's corpus "
                 "(default: $DECAL_DATA_DIR/beir/scifact if present, else the built-in one)")
  p.add_argument("--archive", type=pathlib.Path, default=None,
                 help="also pack every file written into this .tar.gz")
  p.add_argument("--xla_flags", default=None, help="XLA_FLAGS added for every part, kept "
                 "whatever the xla_flags part measures (default: that part's choice; before "
                 f"it, none, or with --lease {LEASE_XLA_FLAGS!r})")
  a = p.parse_args(argv)
  names = [n.strip() for n in a.parts.split(",") if n.strip()]
  unknown = sorted(set(names) - {part.name for part in PARTS})
  if unknown or not names:
    p.error(f"unknown parts {unknown}; known: {', '.join(part.name for part in PARTS)}")
  a.parts = [part for name in dict.fromkeys(names) for part in PARTS if part.name == name]
  if a.lease and a.dry_run:
    p.error("--lease sets the GPU run's limits; --dry_run has its own tiny scale: give one.")
  a.minutes = a.minutes or (20.0 if a.dry_run else LEASE_MINUTES if a.lease else 40.0)
  if a.out_dir is None:
    a.out_dir = (pathlib.Path(tempfile.mkdtemp(prefix="gpu_suite_")) if a.dry_run
                 else REPO / "docs" / "results")
  a.log_dir = a.log_dir or (a.out_dir / "logs" if a.dry_run else REPO / "runs/gpu_suite/logs")
  a.work = a.work or (a.out_dir / "work" if a.dry_run else REPO / "runs/gpu_suite")
  scifact = data_dir() / "beir" / "scifact"
  a.beir_folder = a.beir_folder or (str(scifact) if scifact.exists() else None)
  return a


def main(argv=None) -> dict:
  a = parse_args(sys.argv[1:] if argv is None else argv)
  start = time.time()
  platform_name, device = probe_device(a.dry_run)
  if platform_name == "cpu" and not a.dry_run:
    sys.exit("error: no GPU visible to jax (jax.devices() is CPU): the GPU shapes would take "
             "hours here. Run on a GPU machine, or pass --dry_run for the tiny CPU run.")
  a.out_dir.mkdir(parents=True, exist_ok=True)
  a.log_dir.mkdir(parents=True, exist_ok=True)
  scale = (dry_run_scale(a.out_dir) if a.dry_run else lease_scale(a.beir_folder) if a.lease
           else gpu_scale(a.beir_folder))
  if a.xla_flags is not None:
    scale = dataclasses.replace(scale, xla_flags=a.xla_flags)
  summary_path = a.out_dir / "gpu_suite_summary.json"
  summary = json.loads(summary_path.read_text()) if summary_path.exists() else {
      "parts": {}, "details": {}}  # an earlier run's: its probe serves a later `train`
  suite = Suite(a.out_dir, a.log_dir, a.work, scale, a.dry_run, start + 60 * a.minutes,
                details=summary["details"], keep_xla_flags=a.xla_flags is not None)
  for part in a.parts:
    summary["parts"][part.name] = run_part(suite, part, device)
  summary["parts"] = {p.name: summary["parts"][p.name] for p in PARTS
                      if p.name in summary["parts"]}  # the suite's order
  given = sys.argv[1:] if argv is None else argv
  summary.update(command=shlex.join(["python", "-m", "tools.gpu_suite", *given]),
                 date=datetime.date.today().isoformat(), device=device, minutes=a.minutes,
                 xla_flags=suite.scale.all_xla_flags(),
                 machine=f"{platform.node()}, {os.cpu_count()} CPU cores",
                 wall_s=time.time() - start)
  fileio.write_text_atomic(summary_path, json.dumps(summary, indent=1, default=str))
  fileio.write_text_atomic(a.out_dir / "gpu_suite_summary.md", render(summary))
  print(f"wrote {a.out_dir / 'gpu_suite_summary.md'} ({(time.time() - start) / 60:.1f} min)")
  if a.archive:
    _archive(a.archive, a.out_dir, start)
  return summary


def _archive(path: pathlib.Path, out: pathlib.Path, since: float) -> None:
  """Every file under `out` written since `since`, in one .tar.gz (paths relative to out)."""
  with tarfile.open(path, "w:gz") as tar:
    for f in sorted(out.rglob("*")):
      if f.is_file() and f.stat().st_mtime >= since - 1 and f.resolve() != path.resolve():
        tar.add(f, arcname=str(f.relative_to(out)))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
