"""The results tables of decal_jax/tools/downstream_table.py and decal_jax/tools/lm_table.py, rendered from
hand-made rows: each cell is the number given, formatted as the header says."""
import importlib
import types

import paths

REPO = paths.REPO


def _tool(name):
  return importlib.import_module(f"decal_jax.tools.{name}")


def _cells(text):
  """Rows of the first Markdown table in `text` (header first), cells stripped."""
  rows = [line for line in text.splitlines() if line.startswith("|")]
  return [[c.strip() for c in line.strip("|").split("|")] for line in rows if "---" not in line]


def test_downstream_table_shows_each_ratios_metrics():
  rows = [{"em": 40.0, "f1": 52.346, "step": 200, "compression_ratio": 1, "num_examples": 100,
           "ratio": 1, "minutes": 12.34},
          {"em": 31.25, "f1": 44.999, "step": 200, "compression_ratio": 4, "num_examples": 100,
           "ratio": 4, "minutes": 7.06}]
  assert _cells(_tool("downstream_table").table(rows, "decal_builtin_qa")) == [
      ["C", "em", "f1", "examples", "wall minutes"],
      ["1", "40.00", "52.35", "100", "12.3"],
      ["4", "31.25", "45.00", "100", "7.1"]]


def test_lm_table_shows_perplexity_accuracy_and_notes():
  results = [{"name": "full attention", "states": "256", "perplexity": 51.234,
              "accuracy": 0.31234, "seconds": 99.6},
             {"name": "Dodo", "states": "32 + 22", "perplexity": 60.006, "accuracy": 0.2876,
              "seconds": 80.4, "note": "threshold calibrated on 4 batches"}]
  text = _tool("lm_table").table(results, types.SimpleNamespace())
  assert _cells(text) == [
      ["model", "states read by the last token", "validation perplexity", "token accuracy",
       "train wall (s)"],
      ["full attention", "256", "51.23", "31.2 %", "100"],
      ["Dodo", "32 + 22", "60.01", "28.8 %", "80"]]
  assert text.endswith("\n- Dodo: threshold calibrated on 4 batches")
