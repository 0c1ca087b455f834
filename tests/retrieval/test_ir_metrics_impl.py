"""ir_metrics.implementation names the code that computes the BEIR measures: what
beir_per_query('auto') really runs, checked by hiding pytrec_eval."""
import sys

from decal_jax.retrieval import ir_metrics


def test_implementation_names_what_auto_runs(monkeypatch):
  run = {"q": {"d1": 2.0, "d2": 1.0}}
  qrels = {"q": {"d2": 1}}
  assert ir_metrics.implementation("own") == "own"
  if ir_metrics.implementation() == "pytrec_eval":
    assert ir_metrics.beir_per_query(run, qrels, backend="auto") == ir_metrics.beir_per_query(
        run, qrels, backend="pytrec_eval")
  monkeypatch.setitem(sys.modules, "pytrec_eval", None)  # import fails as if absent
  monkeypatch.setattr(ir_metrics.importlib.util, "find_spec",
                      lambda name: None if name == "pytrec_eval" else object())
  assert ir_metrics.implementation() == "own"
  own = ir_metrics.beir_per_query(run, qrels, backend="auto")  # falls back, as recorded
  assert own == ir_metrics.beir_per_query(run, qrels, backend="own")
  assert own["q"]["MRR@10"] == 0.5  # the relevant document is second: 1/2
