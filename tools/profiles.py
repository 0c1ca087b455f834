"""Where a step's time goes: a `jax.profiler` trace read into each op's time, the ops mapped
to the JAX operations and parts of a T5 step (attention, MLP, norms, relative bias, logits,
loss, optimizer) through the compiled program's text, and the memory traffic that text
implies. `tools/bench_train.py --profile_steps` records them; the GPU suite's summary shows
them (`gpu_suite_report.py`)."""
import math
import pathlib
import re
from typing import Any, Callable, Dict, List, Tuple

import jax

HloOps = Dict[str, Tuple[str, bool]]  # hlo_ops: instruction -> (JAX operation, a matmul)


def profile_ops(step: Callable[[], Any], steps: int, trace_dir: str) -> Dict[str, float]:
  """Runs `step()` `steps` times under `jax.profiler` (the trace written to `trace_dir`,
  readable by TensorBoard / XProf) and returns each op's milliseconds per step, by op name.
  GPU / TPU: the device planes' "XLA Ops" lines (kernels as they ran); CPU: the events of
  the XLA thread pools."""
  jax.profiler.start_trace(trace_dir)
  try:
    for _ in range(steps):
      jax.block_until_ready(step())
  finally:
    jax.profiler.stop_trace()
  totals: Dict[str, float] = {}
  for path in pathlib.Path(trace_dir).rglob("*.xplane.pb"):
    for name, nanoseconds in _op_events(jax.profiler.ProfileData.from_file(str(path))):
      totals[name] = totals.get(name, 0.0) + nanoseconds / 1e6 / steps
  return totals


def top_ops(ms: Dict[str, float], ops: HloOps, count: int = 15) -> List[Dict[str, Any]]:
  """The `count` ops that took the most time, from `profile_ops`' {op: ms per step}:
  [{'op', 'jax_op', 'ms_per_step', 'share'}] (share of all op time; 'jax_op': the JAX
  operation an op came from, from `hlo_ops` of the compiled program's `as_text()`)."""
  everything = sum(ms.values()) or 1.0
  ranked = sorted(ms.items(), key=lambda item: -item[1])[:count]
  return [{"op": name, "jax_op": ops.get(name, ("", False))[0], "ms_per_step": t,
           "share": t / everything} for name, t in ranked]


# The parts of a T5 train step, by the JAX operation an op came from (first match wins; the
# norms before attention, whose `pre_attention_layer_norm` names both). An op outside the
# model's forward and backward (no `jvp(` in its path) is the optimizer's update.
STEP_PARTS = (
    ("relative position bias", r"relpos_bias"),
    ("layer norms", r"_norm(/|$)"),
    ("attention", r"attention|bqhd,bkhd->bhqk|bhqk,bkhd->bqhd"),  # projections, the einsums
    ("MLP", r"/mlp(/|$)"),
    ("layers, other (softmax, residuals)", r"layers_\d+/"),
    ("embedding + logits", r"token_embedder|logits_dense"),
    ("DeCAL latents", r"latent"),
    ("model, other", r"Transformer"),
    ("loss", r"jvp\("),
    ("optimizer", r"."),
)


def op_parts(ms: Dict[str, float], ops: HloOps) -> List[Dict[str, Any]]:
  """`profile_ops`' {op: ms per step} summed by part of the step (STEP_PARTS; 'unattributed'
  for an op `ops` gives no JAX operation): [{'part', 'ms_per_step', 'share', 'ops',
  'matmul_ms_per_step'}] by time, 'matmul' being the library calls and dots (cuBLAS, cuDNN,
  an HLO dot or convolution) and 'ops' how many distinct ops ran."""
  rows = _by_part(ms.items(), ops, "ms_per_step", "ops")
  everything = sum(ms.values()) or 1.0
  for row in rows:
    row["share"] = row["ms_per_step"] / everything
  return rows


def step_part(jax_op: str) -> str:
  """The part of the step (STEP_PARTS) a JAX operation belongs to; 'unattributed' for ''."""
  return next((label for label, pattern in STEP_PARTS if re.search(pattern, jax_op)),
              "unattributed")


def traffic_parts(hlo_text: str, ops: HloOps) -> List[Dict[str, Any]]:
  """Memory traffic of a compiled program by part of the step, from its text alone: each
  kernel of the entry computation (fusion, library call, copy) reads its operands and
  writes its output once, by their shapes (no reuse through caches, slices read whole, a
  loop body's kernels not counted). [{'part', 'gb', 'matmul_gb', 'kernels'}] by bytes: an
  estimate of what a bandwidth-bound step moves, to set beside the profile's time. `ops`:
  `hlo_ops(hlo_text)`."""
  entry = re.search(r"^ENTRY [^\n]*\{\n(.*?)^\}", hlo_text, re.M | re.S)
  lines = entry.group(1).splitlines() if entry else []
  size = {name: _shape_bytes(out) for line in lines
          for name, out in re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) [a-z][\w\-]*\(", line)}
  moved = []  # (kernel, GB it reads and writes)
  for line in lines:
    call = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? (fusion|custom-call|copy)\(([^)]*)\)", line)
    if call:
      operands = re.findall(r"%([\w.\-]+)", call.group(3))
      moved.append((call.group(1), (size.get(call.group(1), 0) + sum(
          size.get(o, 0) for o in operands)) / 1e9))
  return _by_part(moved, ops, "gb", "kernels")


def _by_part(amounts, ops: HloOps, value: str, count: str) -> List[Dict[str, Any]]:
  """(op name, amount) pairs summed by part of the step: [{'part', value, 'matmul_' + value,
  count}], largest first."""
  parts: Dict[str, Dict[str, Any]] = {}
  for name, amount in amounts:
    jax_op, matmul = ops.get(name, ("", False))
    part = step_part(jax_op)
    row = parts.setdefault(part, {"part": part, value: 0.0, f"matmul_{value}": 0.0, count: 0})
    row[value] += amount
    row[f"matmul_{value}"] += amount if matmul else 0.0
    row[count] += 1
  return sorted(parts.values(), key=lambda row: -row[value])


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape (`bf16[128,640]{1,0}`, or a tuple of shapes)."""
  return sum(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
             for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape)
             if dtype in _DTYPE_BYTES)


_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ([^\n]*)$", re.M)
_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", re.M | re.S)
_MATMUL = re.compile(r'custom_call_target="__(cublas|cudnn)|__triton_gemm| (dot|convolution)\(')


def hlo_ops(hlo_text: str) -> HloOps:
  """{instruction name: (the JAX operation it came from, whether it is a matmul: a cuBLAS /
  cuDNN call, a Triton GEMM fusion, a dot or a convolution, or a fusion of one)} of a
  compiled program's text."""
  computations = _HLO_COMPUTATION.findall(hlo_text)
  with_matmul = {name for name, body in computations if _MATMUL.search(body)}
  origins = {name: origin.group(1) for name, body in computations  # a fusion's, for a
             for origin in [re.search(r'op_name="([^"]*)"', body)] if origin}  # bare call
  ops = {}
  for name, rest in _HLO_INSTRUCTION.findall(hlo_text):
    origin = re.search(r'op_name="([^"]*)"', rest)
    called = (re.findall(r"calls=%?([\w.\-]+)", rest) or [""])[0]
    ops[name] = (origin.group(1) if origin else origins.get(called, ""),
                 bool(_MATMUL.search(rest)) or called in with_matmul)
  return ops


def _op_events(profile):
  """(op name, duration ns) of every op event in a profile. On a device (GPU / TPU): its
  "XLA Ops" lines where the trace has them (XProf derives them), else every kernel on its
  lines that carries an `hlo_op` stat, named by it (a GPU's raw CUPTI trace), else every
  kernel on its "Stream" lines, by kernel name. On the CPU: the host's events that name an
  HLO op."""
  devices = [p for p in profile.planes if p.name.startswith("/device:")]
  if not devices:
    for plane in (p for p in profile.planes if p.name == "/host:CPU"):
      for line in plane.lines:
        yield from ((e.name, e.duration_ns) for e in line.events if _stat(e, "hlo_op"))
    return
  lines = [line for plane in devices for line in plane.lines]
  xla_ops = [(e.name, e) for line in lines if line.name == "XLA Ops" for e in line.events]
  if not xla_ops:
    xla_ops = [(op, e) for line in lines for e in line.events
               for op in [_stat(e, "hlo_op")] if op]
  if not xla_ops:
    xla_ops = [(e.name, e) for line in lines if line.name.startswith("Stream")
               for e in line.events]
  for name, event in xla_ops:
    yield str(name), event.duration_ns


def _stat(event, key: str):
  """The value of an event's stat `key`, or None."""
  return next((value for name, value in event.stats if name == key), None)
