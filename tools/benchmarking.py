"""What the benchmark tools in tools/ share: timing, memory checks and the largest batch in a budget, the machine's
description, random weights from parameter shapes, the results header and tables, and the
tools' command-line options. Writing the results files and plots is results_files.py's.

A results file states numbers: the command, date and machine, the settings, then tables,
JSON lines or plots. What the numbers mean is written in docs/, not generated here.
"""
import dataclasses
import datetime
import math
import os
import pathlib
import platform
import shlex
import statistics
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from tools import results_files

REPO = pathlib.Path(__file__).resolve().parents[1]  # the repository (tools run from here)


# ----------------------------------------------------------------------------- timing
def timed(fn: Callable, *args) -> Tuple[Any, float]:
  """(fn(*args) once it is ready, wall seconds it took)."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - start


def median_seconds(fn: Callable, args: Sequence, repeats: int) -> float:
  """Median wall time of `repeats` calls of fn(*args), after one untimed warm-up call."""
  jax.block_until_ready(fn(*args))
  return statistics.median(timed(fn, *args)[1] for _ in range(repeats))


def alternating(items: Sequence, repeat: int) -> List:
  """`items` in order on even repeats, reversed on odd ones: load that changes during a
  run then hits every item alike."""
  return list(items) if repeat % 2 == 0 else list(reversed(items))


def measure_sides(sides: Sequence, warmup: int, repeats: int, desc: str = "measure") -> None:
  """Runs every side (an object with `runner()` and a list `runs`) warmup + repeats times,
  the order reversed every repeat; the runs after the warm-up are appended to `runs`."""
  import tqdm
  for repeat in tqdm.trange(warmup + repeats, desc=desc, leave=False, dynamic_ncols=True):
    for side in alternating(sides, repeat):
      result = side.runner()
      if repeat >= warmup:
        side.runs.append(result)


class Run(NamedTuple):
  """One timed run of a side: wall seconds (one number, or a dict phase -> seconds) and
  the tokens it produced."""
  seconds: Union[float, Dict[str, float]]
  tokens: np.ndarray

  @property
  def total(self) -> float:
    return sum(self.seconds.values()) if isinstance(self.seconds, dict) else self.seconds


class Side:
  """One way to do the work being compared: a compiled `runner() -> Run`, what XLA says
  it costs, and the timed runs collected (`measure_sides`)."""

  def __init__(self, name: str, runner: Callable[[], Run], memory_bytes: Optional[int],
               xla_flops: float = float("nan")):
    self.name, self.runner, self.memory_bytes = name, runner, memory_bytes
    self.xla_flops = xla_flops  # per example, XLA's count of every compiled program
    self.runs: List[Run] = []

  def median(self, phase: Optional[str] = None) -> float:
    """Median seconds of one phase, or (phase None) of the whole run."""
    return statistics.median(r.total if phase is None else r.seconds[phase] for r in self.runs)

  def ms_range(self) -> str:
    """'median (min-max)' milliseconds of the whole run."""
    totals = [r.total for r in self.runs]
    return f"{ms(self.median())} ({ms(min(totals))}-{ms(max(totals))})"

  @property
  def tokens(self) -> np.ndarray:
    return self.runs[0].tokens


def mean_stderr(values: Sequence[float]) -> Tuple[float, float]:
  """(mean, standard error of the mean = sample standard deviation / sqrt(n)), in float64;
  the s.e. of a single value is nan (no error bar, rather than a zero one)."""
  x = np.asarray(list(values), np.float64)
  se = x.std(ddof=1) / np.sqrt(x.size) if x.size > 1 else float("nan")
  return float(x.mean()), float(se)


def mean_se_text(values: Sequence[float], digits: int = 2) -> str:
  """'mean ± s.e.' for a results table; a single value is written alone (no error bar)."""
  mean, se = mean_stderr(values)
  return f"{mean:.{digits}f}" if len(values) < 2 else f"{mean:.{digits}f} ± {se:.{digits}f}"


def xla_cost(compiled, key: str = "flops") -> float:
  """One entry of XLA's `cost_analysis()` of a compiled program ('flops', 'bytes
  accessed'); NaN when the backend does not report it."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older jax: one dict per device
    analysis = analysis[0] if analysis else None
  return float(analysis.get(key, float("nan"))) if analysis else float("nan")


def greedy(logits: jax.Array) -> jax.Array:
  """The argmax token of the last position: logits [batch, t, vocab] -> [batch, 1]."""
  return jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)


def greedy_steps(step_fn: Callable, params, count: int, tokens: list, *extra) -> Callable:
  """A function (cache, token) -> (token, cache) running `count` greedy decode steps
  `step_fn(params, cache, *extra, token)`, appending each new token [batch, 1] to `tokens`."""
  def steps(cache, token):
    for _ in range(count):
      token, cache = step_fn(params, cache, *extra, token)
      tokens.append(token)
    return token, cache
  return steps


class NoEos:
  """A vocabulary for the model wrappers, which read only its `eos_id`: -1 matches no token,
  so every row runs all its decode steps (a benchmark measures a fixed amount of work)."""
  eos_id = -1


def zeros_like_tree(shapes) -> Callable[[], Any]:
  """A function making a fresh zero tree of these shapes (a donated cache is used up)."""
  return lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


# ----------------------------------------------------------------------------- memory
class DoesNotFit(RuntimeError):
  """A compiled program (or a set of weights) needs more memory than is available."""


def available_bytes() -> Optional[int]:
  """Free memory of the default device (host MemAvailable on CPU); None when unknown."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    try:
      with open("/proc/meminfo") as f:
        for line in f:
          if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    except OSError:
      return None
    return None
  stats = device.memory_stats() or {}
  if "bytes_limit" not in stats:
    return None
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def needed_bytes(compiled) -> Optional[int]:
  """Arguments + outputs + temporaries of a compiled program (XLA's own estimate)."""
  try:
    stats = compiled.memory_analysis()
  except (NotImplementedError, RuntimeError):  # a backend without the analysis
    return None
  if stats is None:
    return None
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def check_fits(compiled, what: str, headroom: float = 0.9) -> None:
  """Raises DoesNotFit when `compiled` needs more than `headroom` of the free memory."""
  need, have = needed_bytes(compiled), available_bytes()
  if need is not None and have is not None and need > headroom * have:
    raise DoesNotFit(f"{what} needs {need / 2**30:.1f} GiB (XLA memory analysis), "
                     f"{have / 2**30:.1f} GiB available")


def check_weights_fit(need: int, have: Optional[int]) -> None:
  """Raises DoesNotFit when `need` bytes of weights exceed half the free memory `have`."""
  if have is not None and need > 0.5 * have:
    raise DoesNotFit(f"the weights need {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB "
                     "available (a smaller --preset, or a machine with more memory)")


# The largest batch within a memory budget, by XLA's own need at each batch size.
@dataclasses.dataclass(frozen=True)
class MemoryFit:
  """XLA's memory need at two batch sizes, and the line through them."""
  batches: Tuple[int, int]
  needed: Tuple[int, int]  # bytes

  @property
  def per_sequence(self) -> float:
    return (self.needed[1] - self.needed[0]) / (self.batches[1] - self.batches[0])

  @property
  def fixed(self) -> float:  # weights, mostly
    return self.needed[0] - self.per_sequence * self.batches[0]

  def largest_batch(self, budget: float) -> int:
    """The largest batch whose need on the line is within `budget` bytes (0: none)."""
    if self.per_sequence <= 0:
      raise ValueError(f"The memory need does not grow with the batch ({self.needed} bytes "
                       f"at batches {self.batches}); no batch limit follows.")
    return max(0, math.floor((budget - self.fixed) / self.per_sequence))


class Largest(NamedTuple):
  """The largest batch within a budget, by XLA's own need at it: `batch` fits; when `exact`,
  batch + 1 was compiled too and does not."""
  batch: int
  exact: bool

  def __str__(self) -> str:
    return f"{self.batch}" if self.exact else f">= {self.batch}"


def largest_batch(need: Callable[[int], int], batches: Tuple[int, int], budget: float,
                  tries: int = 4) -> Tuple[MemoryFit, Largest]:
  """(the line through the needs at `batches`, the largest batch within `budget`). XLA's
  buffer assignment does not grow exactly linearly, so the line only gives the first
  guess: each guess is compiled and its need read, and the next one comes from the line
  through the two known needs around the budget, until a batch that fits sits next to one
  that does not (at most `tries` compiles past the fit)."""
  fit = MemoryFit(batches, tuple(need(b) for b in batches))
  known = dict(zip(batches, fit.needed))
  for attempt in range(tries + 1):
    fits = max((b for b, m in known.items() if m <= budget), default=0)
    over = min((b for b, m in known.items() if m > budget), default=None)
    if over == fits + 1:
      return fit, Largest(fits, True)
    if attempt < tries:
      guess = max(fits + 1, _next_guess(known, budget, fits, over))
      guess = guess if over is None else min(guess, over - 1)
      known[guess] = need(guess)
  return fit, Largest(fits, False)


def _next_guess(known: Dict[int, int], budget: float, fits: int, over: Optional[int]) -> int:
  """The budget's batch on the line through the known needs just under and over it (or,
  lacking one side, the two nearest the side known)."""
  order = sorted(known)
  pair = (fits, over) if fits and over else tuple(order[:2] if over else order[-2:])
  try:
    return MemoryFit(pair, (known[pair[0]], known[pair[1]])).largest_batch(budget)
  except ValueError:  # equal needs at both: no slope, step on
    return fits + 1


# ----------------------------------------------------------------------------- weights
RANDOM_BLOCK = 1 << 22  # random values drawn once and shared by every weight matrix


def param_count(shapes) -> int:
  """Number of values in a tree of parameter shapes."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def random_params(shapes, dtype, seed: int = 0, std: float = 0.02):
  """Random weights of these shapes in `dtype`: norm scales ('scale' leaves) 1, every other
  leaf a stretch of one block of N(0, std) values drawn on the host (from a random offset;
  tiled past the block). Seconds for billions of parameters, where jitting `init` would
  compile the forward pass and a per-leaf RNG; timings do not depend on the values."""
  rng = np.random.default_rng(seed)
  block = std * rng.standard_normal(RANDOM_BLOCK, dtype=np.float32)

  def make(path, shape):
    if path[-1].key == "scale":
      return jnp.ones(shape.shape, dtype)
    size = math.prod(shape.shape)
    if size <= RANDOM_BLOCK:
      start = int(rng.integers(0, RANDOM_BLOCK - size + 1))
      return jnp.asarray(block[start:start + size].reshape(shape.shape), dtype)
    return jnp.resize(jnp.asarray(block, dtype), shape.shape)

  return jax.tree_util.tree_map_with_path(make, shapes)


# ----------------------------------------------------------------------------- machine
def cpu_name() -> str:
  """The CPU model from /proc/cpuinfo (Linux), else the platform's machine name."""
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f
                  if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
  """CPU cores this process may run on."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine() -> str:
  """One line: CPU, cores, jax version, JAX backend and device kind."""
  return (f"{cpu_name()}, {cpu_cores()} CPU cores; jax {jax.__version__}; JAX backend: "
          f"{jax.default_backend()} ({jax.devices()[0].device_kind})")


def machine_record() -> Dict[str, Any]:
  """The machine and the moment (and XLA_FLAGS when set), as fields of a JSON line."""
  device = jax.devices()[0]
  return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "command": "python " + " ".join(sys.argv), "host": platform.node(),
          "cpu": cpu_name(), "cpu_cores": os.cpu_count(), "platform": device.platform,
          "device_kind": device.device_kind, "jax": jax.__version__,
          **({"xla_flags": os.environ["XLA_FLAGS"]} if os.environ.get("XLA_FLAGS") else {})}


# bf16 dense (no 2:4 sparsity) peak TFLOP/s per chip, by a substring of jax's device_kind
# (first match wins, so the more specific names come first), with the source of each number.
PEAKS = (
    ("H100 PCIe", 756.0, "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): PCIe "
                         "BF16 Tensor Core 1,513 TFLOPS with sparsity; dense is half"),
    ("H100 NVL", 835.0, "NVIDIA H100 datasheet: NVL BF16 1,671 TFLOPS with sparsity; half"),
    ("H100", 989.0, "NVIDIA H100 datasheet: SXM BF16 Tensor Core 1,979 TFLOPS with "
                    "sparsity; dense is half"),
    ("H200", 989.0, "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 "
                    "1,979 TFLOPS with sparsity; dense is half"),
    ("A100", 312.0, "NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 "
                    "Tensor Core 312 TFLOPS dense (624 with sparsity)"),
    ("TPU v4", 275.0, "Cloud TPU v4 docs (cloud.google.com/tpu/docs/v4): 275 TFLOPS "
                      "bf16 per chip"),
    ("TPU v5 lite", 197.0, "Cloud TPU v5e docs (cloud.google.com/tpu/docs/v5e): 197 "
                           "TFLOPS bf16 per chip"),
    ("TPU v5e", 197.0, "Cloud TPU v5e docs: 197 TFLOPS bf16 per chip"),
    ("TPU v5p", 459.0, "Cloud TPU v5p docs (cloud.google.com/tpu/docs/v5p): 459 TFLOPS "
                       "bf16 per chip"),
    ("TPU v5", 459.0, "Cloud TPU v5p docs: 459 TFLOPS bf16 per chip (jax names v5p 'TPU v5')"),
)
def device_peak(device) -> Optional[Dict[str, Any]]:
  """{'tflops', 'source'} of a device's bf16 dense peak, or None (CPU, unknown)."""
  if device.platform == "cpu":
    return None
  for name, tflops, source in PEAKS:
    if name.lower() in device.device_kind.lower():
      return {"tflops": tflops, "source": source}
  return None


def load_average() -> str:
  """The host's 1 / 5 / 15 minute load averages, e.g. '1.2/0.9/0.7'."""
  return "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def command(module: str, argv: Optional[Sequence[str]]) -> str:
  """The command line that ran a tool, as `-m <module> ARGS` (ARGS: `argv` when called
  in-process, else sys.argv's); `header` puts `python` in front."""
  return shlex.join(["-m", module, *(sys.argv[1:] if argv is None else argv)])


def header(title: str, command_line: str, *settings: str) -> List[str]:
  """The opening lines of a Markdown results file: title, command, date, machine, and one
  bullet per setting."""
  return [f"# {title}", "", f"- command: `python {command_line}`",
          f"- date: {datetime.date.today().isoformat()}",
          f"- machine: {machine()}",
          *(f"- {line}" for line in settings if line)]


# ----------------------------------------------------------------------------- writing
def ms(seconds: float) -> str:
  return f"{seconds * 1e3:.1f}"


def gflop(value: float) -> str:
  return f"{value / 1e9:.3g}"


def gib(size: Optional[int]) -> str:
  return "n/a" if size is None else f"{size / 2**30:.2f}"


def decoder_line(cfg) -> str:
  """A `DecoderConfig`'s shape in one line."""
  return (f"{cfg.num_layers} layer{'s' if cfg.num_layers != 1 else ''}, emb {cfg.emb_dim}, "
          f"{cfg.num_heads} heads / {cfg.kv_heads} kv heads x {cfg.head_dim}, mlp "
          f"{cfg.mlp_dim}, vocab {cfg.vocab_size}{', q/k/v bias' if cfg.qkv_bias else ''}"
          f"{', tied embeddings' if cfg.tie_embeddings else ''}")


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
  """A Markdown table's lines: a header row, the rule, then one line per row."""
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def run_and_report(args, run: Callable, markdown: Callable, plot: Callable):
  """rows = run(args); the plot (with args.plot) and the Markdown results (printed, and
  written to args.out); weights that do not fit end the tool with a message."""
  try:
    rows = run(args)
  except DoesNotFit as e:
    raise SystemExit(f"error: {e}") from e
  if args.plot:
    plot(rows, args.plot)
  results_files.report(markdown(args, rows), args.out)
  return rows


# ----------------------------------------------------------------------------- arguments
def int_list(parser, text: str, name: str) -> List[int]:
  """Comma-separated positive integers from the command line (a parser error otherwise)."""
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    parser.error(f"{name} must be comma-separated integers, got {text!r}.")
  if not values or min(values) < 1:
    parser.error(f"{name} needs at least one positive integer, got {text!r}.")
  return values


def add_side_by_side_args(parser) -> None:
  """The options of a tool that times sides against each other on preset shapes."""
  parser.add_argument("--repeats", type=int, default=3, help="timed runs per side")
  parser.add_argument("--warmup", type=int, default=1, help="untimed runs per side first")
  parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                      help="compute dtype and weights (default: the preset's)")
  parser.add_argument("--seed", type=int, default=0)
  add_output_args(parser)


def add_output_args(parser) -> None:
  """--out (the Markdown results), --plot (a PNG) and --note (a line for the results)."""
  parser.add_argument("--out", default=None, help="write the Markdown results here")
  parser.add_argument("--plot", default=None, help="write a PNG plot here (matplotlib)")
  parser.add_argument("--note", default="", help="a line for the results file")


def run_entry_point(module: str, args: Sequence[str], log) -> float:
  """Runs `python -m <module> args` from the repository (`module` is a lab tool,
  "tools.<name>", or the library's, "train" for decal_jax.train), output appended to `log`; exits on failure with the log's last lines (the log may live in a temporary
  folder that is gone by then). Returns the seconds it took."""
  start = time.time()
  with open(log, "a") as f:
    target = module if module.startswith("tools.") else f"decal_jax.{module}"
    proc = subprocess.run([sys.executable, "-m", target, *args], cwd=REPO,
                          stdout=f, stderr=subprocess.STDOUT, check=False)
  if proc.returncode:
    with open(log, errors="replace") as f:
      tail = "".join(f.readlines()[-12:])
    killed = (" (killed by SIGKILL: on Linux usually the out-of-memory killer; use a smaller "
              "batch size or shorter lengths)" if proc.returncode == -signal.SIGKILL else "")
    sys.exit(f"{module} failed (exit {proc.returncode}){killed}; the end of {log}:\n{tail}")
  return time.time() - start
