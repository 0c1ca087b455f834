"""Command-line tools: benchmarks, results tables, checkpoint import, vocabulary, data
conversion. Each runs as `python -m decal_jax.tools.<name>` (and as the console script
`decal-<name>`, underscores as dashes); each opens with the command that runs it. Tools
import only the library, never each other."""
import importlib
import os
import sys


def script() -> int:
  """The console scripts' entry point: `decal-<name>` runs `decal_jax.tools.<name>.main()`.
  What a tool's `main` returns (result rows, a summary) is for in-process callers; as an
  exit status only an int counts, anything else is a success (0)."""
  name = os.path.basename(sys.argv[0]).removesuffix(".exe")
  if not name.startswith("decal-"):
    raise SystemExit(f"error: {name!r} is not a decal-<tool> console script; run "
                     "`python -m decal_jax.tools.<tool>` instead.")
  tool = importlib.import_module(f"decal_jax.tools.{name[len('decal-'):].replace('-', '_')}")
  result = tool.main()
  return result if isinstance(result, int) and not isinstance(result, bool) else 0
