"""The results files of the benchmark tools: Markdown and JSON lines, matplotlib figures, and
the partial results a tool rewrites after each finished row (`write_partial`), marked as
partial until the run completes. Every file is written whole (`fileio`): a run stopped
midway leaves the last complete version, never half a file. A person's reading of the
numbers goes below the `READING` line of a Markdown results file: a rerun rewrites what is
above it and keeps what is below (`keep_reading`).
"""
import io
import json
import os
import pathlib
from typing import Any, Callable, Dict, Optional, Sequence

from decal_jax import fileio


READING = "<!-- reading: written by hand; kept when the tool rewrites the table above -->"


def keep_reading(path, text: str) -> str:
  """`text` followed by the READING line and what the file at `path` holds below it (the
  hand-written reading), when it has one; `text` alone otherwise."""
  path = pathlib.Path(path)
  kept = path.read_text().split(READING, 1) if path.exists() else []
  return text if len(kept) < 2 else text.rstrip("\n") + "\n\n" + READING + kept[1]


def write_text(path: str, text: str) -> None:
  """Writes a results file whole (its folder made if needed) and says so."""
  fileio.write_text_atomic(path, text)
  print(f"wrote {path}")


def report(text: str, out: Optional[str]) -> None:
  """Prints a results text and, with `out`, writes it there."""
  print(text)
  if out:
    write_text(out, keep_reading(out, text))


def write_jsonl(path: str, rows: Sequence[Dict[str, Any]]) -> None:
  """Appends one JSON line per row to `path`."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a") as f:
    for row in rows:
      f.write(json.dumps(row, default=str) + "\n")
  print(f"appended {len(rows)} line(s) to {path}")


def pyplot():
  """matplotlib.pyplot on the file-only Agg backend (a clear error without matplotlib)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise SystemExit("plots need matplotlib: pip install -e '.[plot]'") from e
  return plt


def log_log_axes(ax, xlabel: str, title: Optional[str], ylabel: Optional[str] = None,
                 xbase: int = 10, ybase: int = 10, **legend) -> None:
  """Log-scaled x and y, labels, a light grid and the legend (`legend`: its options)."""
  ax.set_xscale("log", base=xbase)
  ax.set_yscale("log", base=ybase)
  ax.set_xlabel(xlabel)
  if ylabel:
    ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title, fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(**{"fontsize": 8, **legend})


def save_figure(fig, path: str, **kwargs) -> None:
  """Saves a matplotlib figure whole (its folder made if needed) and closes it; the format
  is the file name's extension's, as matplotlib's own savefig(path) picks it."""
  buffer = io.BytesIO()
  fig.savefig(buffer, format=pathlib.Path(path).suffix[1:].lower() or None, dpi=120, **kwargs)
  pyplot().close(fig)
  fileio.write_bytes_atomic(path, buffer.getvalue())
  print(f"wrote {path}")


# ----------------------------------------------------------------------------- partial results
def partial_line(done: int, total: int, unit: str = "rows", detail: str = "") -> str:
  """The line that marks a results file as partial: what the run had finished."""
  return (f"**Partial: stopped after {done} of {total} {unit}**"
          + (f" ({detail})" if detail else ""))


def mark_partial(text: str, line: str) -> str:
  """A Markdown results text (opening with its '# title' line) with `line` under the title."""
  title, _, rest = text.partition("\n")
  return f"{title}\n\n{line}\n{rest}"


def write_partial(args, rows: Sequence, done: int, total: int,
                  markdown: Callable[[Sequence], str],
                  plot: Optional[Callable[[Sequence, str], None]] = None,
                  unit: str = "rows", detail: str = "") -> None:
  """The results of the `rows` finished so far, written whole after each finished row (or
  group of rows): the plot (`plot(rows, args.plot)`, with args.plot) and the Markdown
  (`markdown(rows)`) at args.out, marked by `partial_line(done, total, unit, detail)`. A
  run stopped midway (gpu_suite's time limit: SIGTERM, then SIGKILL) leaves what it had
  finished. Nothing is written once done == total: the tool's final results follow."""
  if done >= total:
    return
  if args.plot and plot:
    plot(rows, args.plot)
  if args.out:
    line = partial_line(done, total, unit, detail)
    fileio.write_text_atomic(args.out, keep_reading(args.out, mark_partial(markdown(rows), line)))
    print(f"wrote {args.out} ({line.replace('**', '')})", flush=True)


def add_record_args(parser, dry_run_help: str) -> None:
  """The options of a resumable table tool: --record, --out, --no-plot, --dry_run and
  --report_only."""
  parser.add_argument("--record", type=pathlib.Path, help="JSON of finished runs (resumable)")
  parser.add_argument("--out", type=pathlib.Path,
                      help="the Markdown report (plot: same name .png)")
  parser.add_argument("--no-plot", action="store_true")
  parser.add_argument("--dry_run", action="store_true", help=dry_run_help)
  parser.add_argument("--report_only", action="store_true",
                      help="redraw the table from --record without training the runs it lacks")
