"""The user commands a wheel carries: data conversion (prepare_jsonl), vocabularies
(make_vocab), the registered task names (list_tasks), checkpoint import and export
(import_hf, export_t5x), Dodo's threshold (calibrate_nuggets, show_nuggets) and Squid's
compress-once answering (squid_answer). Each runs as `python -m decal_jax.commands.<name>`
and as the console script `decal-<name>` (underscores as dashes), opens with the command that
runs it, and imports only the library, never another command. Each parses its arguments before it imports JAX, TensorFlow or seqio
(so --help and argument errors come back at once), and names a missing optional extra
(`require_extra`) before any work. Benchmarks and results tables are the lab: top-level
`tools/`."""
import importlib
import importlib.util
import os
import sys


def script() -> int:
  """The console scripts' entry point: `decal-<name>` runs `decal_jax.commands.<name>.main()`.
  What a tool's `main` returns (result rows, a summary) is for in-process callers; as an
  exit status only an int counts, anything else is a success (0)."""
  name = os.path.basename(sys.argv[0]).removesuffix(".exe")
  if not name.startswith("decal-"):
    raise SystemExit(f"error: {name!r} is not a decal-<command> console script; run "
                     "`python -m decal_jax.commands.<command>` instead.")
  tool = importlib.import_module(f"decal_jax.commands.{name[len('decal-'):].replace('-', '_')}")
  result = tool.main()
  return result if isinstance(result, int) and not isinstance(result, bool) else 0


def require_extra(module: str, extra: str, needed_for: str) -> None:
  """Stops with the pip line that installs `extra` when `module` is not importable (looked up
  without importing it), e.g. require_extra("matplotlib", "plot", "show_nuggets (its page and pictures)")."""
  if importlib.util.find_spec(module) is None:
    raise SystemExit(f"error: {needed_for} needs {module}, which the optional extra "
                     f"[{extra}] installs: pip install 'decal_jax[{extra}]'")
