"""Lists the registered seqio tasks and mixtures, one a line: the names MIXTURE_OR_TASK_NAME
(and the retrieval run's BEIR_TASK, the `decal_beir_*` ones) may take.

  python -m decal_jax.commands.list_tasks                  # every name (also: decal-list-tasks)
  python -m decal_jax.commands.list_tasks qa               # the names containing 'qa'
  python -m decal_jax.commands.list_tasks --module my_tasks  # with the tasks my_tasks registers

A mixture's line names its tasks. The built-in tasks register when the package loads, with
a `decal_beir_<name>` task for each BEIR folder under $DECAL_LOCAL_DATA_DIR/beir/; a task of
your own registers when the module that defines it is imported (--module here, an
`import my_tasks` line in a gin file for a run). An entry point given a name that is none of
these stops before the run starts, naming the closest ones.
"""
import argparse
import importlib
import sys
from typing import List, Optional, Sequence


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="decal-list-tasks", description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("contains", nargs="?", default="",
                      help="list only the names containing this text")
  parser.add_argument("--module", action="append", default=[],
                      help="import this module first (repeatable): the tasks it registers "
                           "are listed too")
  return parser


def task_lines(contains: str = "") -> List[str]:
  """'name' for each registered task, 'name  (mixture: task, ...)' for each mixture, sorted."""
  import seqio
  lines = []
  for name in sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names())):
    if contains not in name:
      continue
    if name in seqio.MixtureRegistry.names():
      tasks = ", ".join(task.name for task in seqio.get_mixture_or_task(name).tasks)
      lines.append(f"{name}  (mixture: {tasks})")
    else:
      lines.append(name)
  return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  from decal_jax.runtime import console
  console.import_tensorflow_quietly()
  import decal_jax.tasks  # noqa: F401  (registers the built-in tasks)
  for module in args.module:
    try:
      importlib.import_module(module)
    except ImportError as e:
      sys.exit(f"error: --module {module}: {e}")
  lines = task_lines(args.contains)
  if not lines:
    sys.exit(f"error: no registered task or mixture name contains {args.contains!r}.")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
