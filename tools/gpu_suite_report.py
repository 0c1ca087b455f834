"""The GPU suite's summary page (`tools/gpu_suite.py`): the parts' table, the
XLA_FLAGS probe, the training step per C, the option probe, and what takes DeCAL-4x's time
when it misses the MFU goal."""
from typing import List

from tools.gpu_suite_scales import GOAL_MFU, OPTION_SETS, PROFILED_RATIO, XLA_FLAG_SETS


def render(summary: dict) -> str:
  """The Markdown summary: the parts' table, the training step per C, the probe, and the
  profile when DeCAL-4x misses the MFU goal."""
  lines = ["# GPU suite", "", f"- command: `{summary['command']}`", f"- date: {summary['date']}",
           f"- device: {summary['device']}", f"- machine: {summary['machine']}",
           f"- XLA_FLAGS: `{summary.get('xla_flags') or 'none'}`",
           f"- wall time: {summary['wall_s'] / 60:.1f} min of a {summary['minutes']:.0f}-minute "
           "budget", "", "| part | status | wall s | limit s | device | date | note |",
           "|---|---|---|---|---|---|---|"]
  for r in summary["parts"].values():
    lines.append(f"| {r['part']} | {r['status']} | {r['wall_s']:.0f} | {r['limit_s']} | "
                 f"{r['device']} | {r['date']} | {r.get('note', '').replace('|', '/')} |")
  details = summary.get("details", {})
  if details.get("xla_flags"):
    lines += _xla_flags_lines(details["xla_flags"])
  if details.get("train"):
    lines += ["", "## Training step (bench_train_gpu.jsonl)", "",
              "| C | configuration | step ms | seq/s | tok/s | MFU | temp GiB |",
              "|---|---|---|---|---|---|---|"]
    for ratio, r in sorted(details["train"].items(), key=lambda item: int(item[0])):
      mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %"
      lines.append(f"| {ratio} | {r['label']} | {1e3 * r['step_s_median']:.1f} | "
                   f"{r['sequences_per_s']:.1f} | {r['tokens_per_s']:.0f} | {mfu} | "
                   f"{(r.get('temp_bytes') or 0) / 2**30:.2f} |")
    if str(PROFILED_RATIO) in details["train"]:
      lines += _profile_lines(details["train"][str(PROFILED_RATIO)]["mfu"],
                              details.get("profile") or details["train"][str(PROFILED_RATIO)])
  if details.get("probe"):
    lines += ["", "## Option probe (bench_train_probe_gpu.jsonl, DeCAL-4x bf16)", "",
              "| option set | bindings | step ms |", "|---|---|---|"]
    for name, seconds in details["probe"].items():
      lines.append(f"| {name} | {', '.join(OPTION_SETS[name]) or 'none'} | "
                   f"{'failed' if not seconds else f'{1e3 * seconds:.1f}'} |")
  for r in summary["parts"].values():
    lines += ["", f"## Commands: {r['part']}", ""] + [f"    {c}" for c in r["commands"]]
    if r.get("log_tail"):
      lines += ["", f"Last lines of {r['log']}:", ""] + [f"    {t}" for t in r["log_tail"]]
  return "\n".join(lines) + "\n"


def _xla_flags_lines(probe: dict) -> List[str]:
  lines = ["", "## XLA_FLAGS (bench_xla_flags_gpu.jsonl: a T5.1.1-small encoder layer, bf16, "
           "forward + backward)", "", "| set | XLA_FLAGS | compile s | step ms | TFLOP/s | "
           "of peak |", "|---|---|---|---|---|---|"]
  for name, row in probe["sets"].items():
    cells = ["did not run (see the log)"] + [""] * 3 if not row else [
        f"{row['compile_s']:.1f}", f"{1e3 * row['step_s_median']:.2f}", f"{row['tflops']:.3g}",
        "n/a" if row.get("peak_fraction") is None else f"{100 * row['peak_fraction']:.1f} %"]
    lines.append(f"| {name} | `{XLA_FLAG_SETS.get(name, '?') or 'none'}` | {' | '.join(cells)} |")
  return lines + ["", f"Chosen for the parts after it: {probe.get('chosen') or 'none ran'}."]


def _profile_lines(mfu, profile: dict) -> List[str]:
  """Below the goal: the traced run's top ops and op time by part of the step (a summary
  written before the profile had its own run keeps them on the train row)."""
  top, parts = profile.get("profile_top_ops") or [], profile.get("profile_parts") or []
  if mfu is not None and mfu >= GOAL_MFU:
    return ["", f"DeCAL-{PROFILED_RATIO}x meets the {100 * GOAL_MFU:.0f} % MFU goal."]
  state = "not known" if mfu is None else f"{100 * mfu:.1f} %, under the goal"
  lines = ["", f"## What takes DeCAL-{PROFILED_RATIO}x's time (MFU {state})", ""]
  if parts:
    op_ms, step_ms = profile["profile_op_ms_per_step"], 1e3 * profile["step_s_median"]
    traffic = profile.get("hlo_traffic_parts") or {}
    lines += [f"jax.profiler trace of `{profile['label']}` (XLA_FLAGS "
              f"`{profile.get('xla_flags') or 'none'}`): {op_ms:.1f} ms of ops in a "
              f"{step_ms:.1f} ms step. Op time by part of the step, and the bytes its kernels "
              "read and write by the compiled program's shapes (`profiles.traffic_parts`, "
              "an estimate):", "", "| part | ms / step | share | of which matmuls, ms | ops | "
              "GB moved per step (HLO) |", "|---|---|---|---|---|---|"]
    lines += [f"| {p['part']} | {p['ms_per_step']:.3f} | {100 * p['share']:.1f} % | "
              f"{p['matmul_ms_per_step']:.3f} | {p['ops']} | "
              f"{traffic.get(p['part'], {}).get('gb', 0.0):.2f} |" for p in parts] + [
                  "", "The ops that took the most time:", ""]
  else:
    lines += ["jax.profiler trace of the step; ops by time, share of all op time:", ""]
  lines += ["| share | ms / step | op | from (JAX) |", "|---|---|---|---|"]
  return lines + [f"| {100 * op['share']:.1f} % | {op['ms_per_step']:.3f} | {op['op']} | "
                  f"{op['jax_op'][-100:]} |" for op in top]
