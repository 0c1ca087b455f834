"""The user commands a wheel carries: data conversion (prepare_jsonl), vocabularies
(make_vocab), checkpoint import and export (import_hf, export_t5x), Dodo's threshold
(calibrate_nuggets, show_nuggets) and Squid's compress-once answering (squid_answer). Each
runs as `python -m decal_jax.commands.<name>` and as the console script `decal-<name>`
(underscores as dashes), opens with the command that runs it, and imports only the library,
never another command. Benchmarks and results tables are the lab: top-level `tools/`."""
import importlib
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
