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

Results land in --out_dir (default docs/results; each part's files are in PARTS), with
gpu_suite_summary.md (and .json): per part its status, wall time, limit, commands, device
(jax.devices()[0].device_kind) and date; the MFU of each C, the probe's step times and,
below the goal, the profile. A run of some --parts keeps the other parts' rows. --archive
packs every file written into one .tar.gz (for machines that return only a few files).
--dry_run: every part at tiny shapes on CPU (no cuDNN sets, C = 1 and 4, a one-variant
ablation budget), into a temporary folder unless --out_dir is given; minutes, for CI. The
parts marked `device_image` run there with TensorFlow, seqio, clu and t5 refused, as on the
workplace's GPU image. --lease: the GPU shapes in 9 minutes (gpu_suite_scales.lease_scale:
DeCAL-4x timed first, shorter part limits). --xla_flags fixes XLA_FLAGS for every part
(the xla_flags part then only measures). The parts share one persistent compilation cache
(WORK/jax_cache).
"""
import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = pathlib.Path.cwd()  # run from the repository root: docs/results/, runs/, ../shared/data
from decal_jax import fileio  # noqa: E402  (light: the suite itself never touches the GPU)

# F401: CUDNN, RATIOS and RETENTION_STEPS are re-exported (tests read them as gpu_suite.*).
from tools.gpu_suite_scales import (  # noqa: E402, F401  (re-exports: see above)
    CUDNN, DEVICE_IMAGE_LACKS, GOAL_MFU, LEASE_MINUTES, LEASE_XLA_FLAGS, OPTION_SETS,
    PROFILE_XLA_FLAGS, PROFILED_RATIO, RATIOS, REFUSE_IMPORTS, RETENTION_STEPS, XLA_FLAG_SETS,
    Scale, choose_xla_flags, data_dir, dry_run_scale, gpu_scale, lease_scale)
from tools.gpu_suite_report import render  # noqa: E402  (after REPO, as above)


class PartFailed(Exception):
  """A part's subprocess failed, or the part ran out of time (status 'timeout')."""
  def __init__(self, message: str, status: str = "failed"):
    super().__init__(message)
    self.status = status


@dataclasses.dataclass
class Suite:
  """The run's settings, clock and records; `call` runs one subprocess of a part."""
  out: pathlib.Path
  logs: pathlib.Path
  work: pathlib.Path
  scale: Scale
  dry_run: bool
  deadline: float
  part: str = ""
  part_deadline: float = 0.0
  commands: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
  details: Dict[str, object] = dataclasses.field(default_factory=dict)
  refuse_dir: Optional[pathlib.Path] = None  # its sitecustomize.py refuses DEVICE_IMAGE_LACKS
  keep_xla_flags: bool = False  # --xla_flags given: the xla_flags part measures, never switches

  def left(self) -> float:
    return self.deadline - time.time()

  def call(self, argv: Sequence[str], limit_s: Optional[float] = None,
           check: bool = True) -> Tuple[int, bool]:
    """Runs `python argv` from the repository (output appended to the part's log) until
    it ends or the part's deadline (or `limit_s`) passes; returns (exit code, timed out).
    With `check`, a failure or a timeout raises PartFailed."""
    self.commands.setdefault(self.part, []).append(shlex.join(["python", *argv]))
    limit = self.part_deadline - time.time()
    limit = limit if limit_s is None else min(limit, limit_s)
    log = self.logs / f"{self.part}.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
               PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               # one compilation cache for the run: `train` reuses the probe's programs
               JAX_COMPILATION_CACHE_DIR=str(self.work / "jax_cache"),
               XLA_FLAGS=self.scale.all_xla_flags())
    t5_vocab = data_dir() / "vocab" / "t5_spiece.model"
    if t5_vocab.exists():  # offline, T5-vocabulary models read the data folder's copy
      env.setdefault("DECAL_T5_VOCAB", str(t5_vocab.resolve()))
    if self.dry_run:
      env["JAX_PLATFORMS"] = "cpu"
      if self.refuse_dir:  # a device-image part: refuse what the image lacks
        env["PYTHONPATH"] = os.pathsep.join([str(self.refuse_dir), env["PYTHONPATH"]])
    with open(log, "a") as f:
      f.write(f"\n$ {self.commands[self.part][-1]}\n")
      f.flush()
      proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=f,
                              stderr=subprocess.STDOUT, start_new_session=True)
      timed_out = not _wait(proc, max(limit, 1.0), self.scale.grace_s)
    if check and timed_out:
      raise PartFailed(f"stopped at its time limit ({limit:.0f} s): {shlex.join(argv[:2])}", "timeout")
    if check and proc.returncode:
      raise PartFailed(f"{shlex.join(argv[:2])} exited with {proc.returncode}")
    return proc.returncode, timed_out


def _wait(proc: subprocess.Popen, limit: float, grace: float) -> bool:
  """Waits for `proc`; past `limit` its process group gets SIGTERM (a training run saves a
  checkpoint and stops), past `grace` more SIGKILL. True when it ended within `limit`."""
  try:
    proc.wait(timeout=limit)
    return True
  except subprocess.TimeoutExpired:
    pass
  for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      break
    try:
      proc.wait(timeout=wait)
      break
    except subprocess.TimeoutExpired:
      continue
  return False


# ----------------------------------------------------------------------------- parts
def _jsonl_rows(path: pathlib.Path) -> List[dict]:
  return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def bench_train_argv(s: Scale, bindings: Sequence[str], steps: int, label: str,
                     out: pathlib.Path) -> List[str]:
  """tools/bench_train.py's arguments: the scale's model in bf16 plus `bindings`."""
  return ["-m", "tools.bench_train", *s.model, "--gin.ACTIVATION_DTYPE='bfloat16'",
          *[f"--gin.{b}" for b in bindings], f"--batch_size={s.batch}",
          f"--inputs_length={s.lengths[0]}", f"--targets_length={s.lengths[1]}",
          f"--steps={steps}", f"--warmup={s.warmup}", f"--label={label}", f"--out={out}",
          "--init_on_host"]


def _bench_train(suite: Suite, out: str, label: str, bindings: Sequence[str],
                 steps: int, extra: Sequence[str] = (), limit_s: Optional[float] = None,
                 check: bool = True) -> Optional[dict]:
  """One tools/bench_train.py run; the JSON line it appended, or None."""
  path = suite.out / out
  before = len(_jsonl_rows(path))
  budget = min(suite.part_deadline - time.time(), limit_s or float("inf"))
  argv = bench_train_argv(suite.scale, bindings, steps, label, path) + list(extra) + [
      f"--time_budget_s={budget - 5:.0f}"]  # a slow step still reports (fewer steps)
  rc, _ = suite.call(argv, limit_s, check)
  rows = _jsonl_rows(path)[before:]
  return rows[-1] if rc == 0 and rows else None


def part_xla_flags(suite: Suite) -> str:
  """bench_xla_flags under each XLA_FLAG_SETS entry (its share of the part's limit); the
  parts after it run with the chosen set (gpu_suite_scales.choose_xla_flags)."""
  base, rows = suite.scale, {}
  path = suite.out / "bench_xla_flags_gpu.jsonl"
  for name, flags in XLA_FLAG_SETS.items():
    suite.scale = dataclasses.replace(base, xla_flags=flags)
    before = len(_jsonl_rows(path))
    rc, _ = suite.call(["-m", "tools.bench_xla_flags", *base.tools["xla_flags"],
                        "--label", name, "--out", str(path)],
                       limit_s=60 * base.minutes["xla_flags"] / len(XLA_FLAG_SETS), check=False)
    new = _jsonl_rows(path)[before:]
    rows[name] = new[-1] if rc == 0 and new else None
  chosen = choose_xla_flags(rows)
  use = base.xla_flags if suite.keep_xla_flags or not chosen else XLA_FLAG_SETS[chosen]
  suite.scale = dataclasses.replace(base, xla_flags=use)
  suite.details["xla_flags"] = {"sets": rows, "chosen": chosen}
  if not chosen:
    raise PartFailed(f"no flag set ran; the parts keep {base.xla_flags!r}")
  return (f"chosen: {chosen} ({rows[chosen]['tflops']:.3g} TFLOP/s)" +
          (f"; the parts keep --xla_flags {use!r}" if suite.keep_xla_flags else ""))


def part_train_probe(suite: Suite) -> str:
  """A short run of each option set on DeCAL-4x; the fastest is kept for `train`."""
  probe = {}
  for name in suite.scale.option_sets:
    row = _bench_train(suite, "bench_train_probe_gpu.jsonl", f"probe {name} DeCAL-4x bf16",
                       ["COMPRESSION_RATIO=4", *OPTION_SETS[name]], suite.scale.probe_steps,
                       limit_s=60 * suite.scale.probe_minutes, check=False)
    probe[name] = row and row["step_s_median"]
  suite.details["probe"] = probe
  timed = {k: v for k, v in probe.items() if v}
  if not timed:
    raise PartFailed("no option set ran")
  suite.details["best_options"] = best = min(timed, key=timed.get)
  failed = [k for k, v in probe.items() if not v]
  return f"fastest: {best}" + (f"; failed: {', '.join(failed)}" if failed else "")


def part_train(suite: Suite) -> str:
  """Each C with the probe's fastest set and MFU; then C = PROFILED_RATIO again, profiled."""
  best = suite.details.get("best_options") or "einsum"
  rows, failed = {}, []
  for ratio in suite.scale.ratios:
    row = _bench_train(suite, "bench_train_gpu.jsonl", f"DeCAL-{ratio}x bf16 {best}",
                       [f"COMPRESSION_RATIO={ratio}", *OPTION_SETS[best]], suite.scale.steps,
                       check=False)
    if row is None:
      failed.append(ratio)
      continue
    rows[str(ratio)] = {k: row.get(k) for k in (
        "label", "step_s_median", "sequences_per_s", "tokens_per_s", "mfu", "temp_bytes",
        "device_kind")}
  suite.details["train"] = rows
  profiled = _profile_train(suite, best) if suite.part_deadline > time.time() + 30 else None
  if failed:
    raise PartFailed(f"options {best}; failed or out of time at C = {failed}")
  mfu = rows[str(PROFILED_RATIO)]["mfu"]
  return (f"options {best}; DeCAL-{PROFILED_RATIO}x MFU " +
          ("not known (no peak for this device)" if mfu is None else
           f"{100 * mfu:.1f} % ({'meets' if mfu >= GOAL_MFU else 'misses'} the 40 % goal)") +
          ("" if profiled else "; no profile (out of time or failed)"))


def _profile_train(suite: Suite, best: str) -> Optional[dict]:
  """DeCAL-PROFILED_RATIO x traced in a run of its own, CUDA graphs off (PROFILE_XLA_FLAGS:
  the trace then names each kernel), its HLO kept; into details['profile']."""
  base, ratio = suite.scale, PROFILED_RATIO
  suite.scale = dataclasses.replace(base, xla_flags=" ".join(filter(None, [
      base.xla_flags, PROFILE_XLA_FLAGS])))
  try:
    row = _bench_train(
        suite, "bench_train_profile_gpu.jsonl", f"DeCAL-{ratio}x bf16 {best} traced",
        [f"COMPRESSION_RATIO={ratio}", *OPTION_SETS[best]], base.profile_steps,
        [f"--profile_steps={base.profile_steps}", f"--profile_dir={suite.logs / 'profile'}",
         f"--hlo_out={suite.logs / f'train_step_c{ratio}.hlo.txt.gz'}"], check=False)
  finally:
    suite.scale = base
  if row is not None:
    suite.details["profile"] = {k: row.get(k) for k in (
        "label", "step_s_median", "mfu", "xla_flags", "profile_top_ops", "profile_parts",
        "profile_op_ms_per_step", "hlo_traffic_parts")}
  return row


def _tool_part(tool: str, stem: str, plot: bool = True,
               key: Optional[str] = None) -> Callable[[Suite], str]:
  """A part running tools.<tool> with the scale's arguments (`key`, default the
  tool's name without bench_), writing <stem>.md (+ .png)."""
  key = key or tool.replace("bench_", "")

  def run(suite: Suite) -> str:
    outputs = ["--out", str(suite.out / f"{stem}.md")]
    if plot:
      outputs += ["--plot", str(suite.out / f"{stem}.png")]
    suite.call(["-m", f"tools.{tool}", *suite.scale.tools[key], *outputs])
    return ""
  return run


def _resumable(suite: Suite, argv: Sequence[str], record: pathlib.Path, out: pathlib.Path,
               what: str) -> str:
  """A tool that records each finished run in `record` and continues from it, run for the
  part's time left (minus the grace for SIGTERM's checkpoint); a note of what it finished."""
  suite.part_deadline -= suite.scale.grace_s
  _, stopped = suite.call([*argv, "--record", str(record), "--out", str(out)], check=False)
  done = json.loads(record.read_text()) if record.exists() else {}
  done = len(done.get("results", done))  # ablate.py nests its runs under "results"
  if not stopped and not out.exists():
    raise PartFailed(f"{argv[1]} failed with {done} {what} done; see the log")
  return (f"{done} {what} done" + ("; stopped at the time limit: the same command "
                                   "continues" if stopped else ""))


def part_retention(suite: Suite) -> str:
  """retention_table.py at RETENTION_STEPS for the time left; resumable from its record."""
  return _resumable(suite, ["-m", "tools.retention_table", *suite.scale.tools[
      "retention"], "--work", str(suite.work / "retention")], suite.out / "retention_gpu.json",
                    suite.out / "retention_gpu.md", "runs")


def part_ablation(suite: Suite) -> str:
  """ablate.py for the time left (minus the grace for SIGTERM's checkpoint)."""
  return _resumable(suite, ["-m", "tools.ablate", *suite.scale.tools["ablation"],
                            "--work", str(suite.work / "ablate")],
                    suite.out / "ablation_gpu_runs.json",
                    suite.out / "ablation_gpu.md", "variants")


@dataclasses.dataclass(frozen=True)
class Part:
  name: str
  run: Callable[[Suite], str]
  outputs: Tuple[str, ...]  # files it must write (or update) in the output folder
  # Runs on a GPU image without TensorFlow / seqio (DEVICE_IMAGE_LACKS); --dry_run proves it
  # by running the part with those imports refused.
  device_image: bool = False
  # Folders or files under $DECAL_DATA_DIR (../shared/data beside a checkout) it reads; a
  # checkout without them skips the part and says which (a bare clone has no ../shared).
  needs_data: Tuple[str, ...] = ()


def missing_data(suite: "Suite", part: Part) -> List[str]:
  """The data a part reads that is not there: its --beir_folder if the scale names one,
  else its `needs_data` under data_dir()."""
  args = list(suite.scale.tools.get(part.name, []))
  if "--beir_folder" in args and part.needs_data:
    folder = args[args.index("--beir_folder") + 1]
    return [folder] if folder and not pathlib.Path(folder).exists() else []
  return [str(data_dir() / need) for need in part.needs_data if not (data_dir() / need).exists()]


PARTS = [
    Part("xla_flags", part_xla_flags, ("bench_xla_flags_gpu.jsonl",), device_image=True),
    Part("train_probe", part_train_probe, ("bench_train_probe_gpu.jsonl",), device_image=True),
    Part("train", part_train, ("bench_train_gpu.jsonl", "bench_train_profile_gpu.jsonl"),
         device_image=True),
    Part("inference", _tool_part("bench_inference", "inference_throughput_gpu"),
         ("inference_throughput_gpu.md", "inference_throughput_gpu.png"), device_image=True),
    Part("nuggets", _tool_part("bench_nuggets", "nuggets_cache_gpu", plot=False),
         ("nuggets_cache_gpu.md",), device_image=True),
    Part("squid", _tool_part("bench_squid", "squid_latency_gpu"),
         ("squid_latency_gpu.md", "squid_latency_gpu.png"), device_image=True),
    Part("gpthf", _tool_part("bench_gpthf", "gpthf_efficiency_gpu"),
         ("gpthf_efficiency_gpu.md", "gpthf_efficiency_gpu.png"), device_image=True),
    Part("retrieval", _tool_part("bench_retrieval", "retrieval_bench_gpu"),
         ("retrieval_bench_gpu.md", "retrieval_bench_gpu.png"), device_image=True),
    Part("retrieval_scale", _tool_part("bench_retrieval_scale", "retrieval_scale_gpu"),
         ("retrieval_scale_gpu.md", "retrieval_scale_gpu.png"), device_image=True,
         needs_data=("beir/scifact",)),
    Part("retrieval_1m", _tool_part("bench_retrieval_scale", "retrieval_scale_synthetic_gpu",
                                    key="retrieval_scale_synthetic"),
         ("retrieval_scale_synthetic_gpu.md",), device_image=True),
    Part("retention", part_retention, ("retention_gpu.md", "retention_gpu.json"),
         needs_data=("text",)),
    Part("ablation", part_ablation, ("ablation_gpu.md", "ablation_gpu_runs.json")),
]


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
