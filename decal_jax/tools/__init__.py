"""Command-line tools: benchmarks, results tables, checkpoint import, vocabulary, data
conversion. Each runs as `python -m decal_jax.tools.<name>` (and as the console script
`decal-<name>`, underscores as dashes); each opens with the command that runs it. Tools
import only the library, never each other."""
