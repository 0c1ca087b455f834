"""The GPU suite's parts (`tools/gpu_suite.py` runs them, in PARTS's order): the `Suite` a
part runs under (settings, clock, records, and `call`, one subprocess within the part's time
limit), `PartFailed`, each part's function, `Part` and PARTS (name, function, the files it
writes, whether it runs on the device image, the data it reads). gpu_suite.py re-exports
every public name here."""
import dataclasses
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tools.gpu_suite_scales import (
    GOAL_MFU, OPTION_SETS, PROFILE_XLA_FLAGS, PROFILED_RATIO, XLA_FLAG_SETS, Scale,
    choose_xla_flags, data_dir)

REPO = pathlib.Path.cwd()  # run from the repository root: docs/results/, runs/, ../shared/data


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
               # one compilation cache for the run (`train` reuses the probe's programs):
               # the caller's if it names one, else the work folder's
               JAX_COMPILATION_CACHE_DIR=(os.environ.get("JAX_COMPILATION_CACHE_DIR")
                                          or str(self.work / "jax_cache")),
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


STOPPED = "stopped at the time limit: the same command continues"


def _smollm2_part(tool: str) -> Callable[["Suite"], str]:
  """tools/<tool>.py (a SmolLM2-135M experiment of issue 43) for the part's time left (minus
  the grace): it keeps each finished run in --work and rewrites its table after each, so a
  stopped part leaves the runs done and the same command continues."""
  def run(suite: Suite) -> str:
    suite.part_deadline -= suite.scale.grace_s
    return STOPPED if _run_smollm2_tool(suite, tool, f"{tool}_gpu.md") else ""
  return run


def _run_smollm2_tool(suite: Suite, tool: str, out: str, *extra: str) -> bool:
  """tools/<tool>.py at the scale's flags + `extra`, its records in WORK/<tool>, its table in
  OUT/`out`; True when stopped at the time limit (a failure raises PartFailed)."""
  code, stopped = suite.call(["-m", f"tools.{tool}", *suite.scale.tools[tool], *extra,
                              "--work", str(suite.work / tool),
                              "--out", str(suite.out / out)], check=False)
  if code and not stopped:
    raise PartFailed(" ".join([f"tools.{tool}", *extra[-2:], f"exited with {code}; see the log"]))
  return stopped


def part_smollm2_lm_train(suite: Suite) -> str:
  """smollm2_lm_train at the scale's settings, then its nuggets rows again with each scorer
  started from the compressor the smollm2_autoencode part trained at that r and seed (the
  paper's order), for the rows whose compressor is there; then the window, nuggets and
  segment-mean rows again with token 0 read in full (`--sink 1`: SmolLM2 parks attention
  there; on CPU keeping it lowered every row's NLL, docs/results/smollm2_lm_trained_sink_cpu.md)."""
  note = _smollm2_part("smollm2_lm_train")(suite)
  if note:
    return note
  from tools import smollm2_lm_train  # the tool's own parser, not run here
  lm = smollm2_lm_train.parse(suite.scale.tools["smollm2_lm_train"])
  note = _lm_from_compressor(suite, lm)
  if note == STOPPED:
    return note
  sink = [name for name in lm.settings if smollm2_lm_train.parse_setting(name, lm.window)[0]
          in ("window", "nuggets", "compressive")]
  stopped = _run_smollm2_tool(suite, "smollm2_lm_train", "smollm2_lm_train_sink_gpu.md",
                              "--settings", *sink, "--sink", "1")
  return STOPPED if stopped else note


def _lm_from_compressor(suite: Suite, lm) -> str:
  """The nuggets rows of `lm` (the tool's parsed flags) again with the scorer from the
  smollm2_autoencode part's compressors (those saved at every seed); '' when done, else a
  note (STOPPED at the time limit)."""
  from tools import smollm2_autoencode, smollm2_lm_train  # the tools' own names, not run here
  saved = (suite.work / "smollm2_autoencode" /
           smollm2_autoencode.run_name(smollm2_autoencode.parse(
               suite.scale.tools["smollm2_autoencode"])) / "r{r}_nuggets_seed{seed}.npz")
  lm.scorer_from = str(saved)
  ready = [name for name in lm.settings if smollm2_lm_train.scorer_source(lm, name, 0) and all(
      pathlib.Path(smollm2_lm_train.scorer_source(lm, name, s)).is_file() for s in lm.seeds)]
  if not ready:
    return "no compressor saved by the smollm2_autoencode part: no 'from AE' rows"
  stopped = _run_smollm2_tool(suite, "smollm2_lm_train", "smollm2_lm_train_gpu.md",
                              "--settings", *ready, "--scorer-from", str(saved))  # last wins
  return STOPPED if stopped else ""


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
    Part("smollm2_autoencode", _smollm2_part("smollm2_autoencode"),
         ("smollm2_autoencode_gpu.md", "smollm2_autoencode_gpu.png"), device_image=True,
         needs_data=("text",)),
    Part("smollm2_lm_train", part_smollm2_lm_train,
         ("smollm2_lm_train_gpu.md", "smollm2_lm_train_gpu.png", "smollm2_lm_train_sink_gpu.md",
          "smollm2_lm_train_sink_gpu.png"), device_image=True,
         needs_data=("text",)),
    Part("smollm2_squid", _smollm2_part("smollm2_squid"),
         ("smollm2_squid_gpu.md", "smollm2_squid_gpu.png"), device_image=True,
         needs_data=("text", "squad")),
    Part("ablation", part_ablation, ("ablation_gpu.md", "ablation_gpu_runs.json")),
]
