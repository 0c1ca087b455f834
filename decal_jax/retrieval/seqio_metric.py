"""Retrieval metrics for seqio's `Evaluator` (T5X's `t5x.eval` of the dual encoder).

`InCorpusRetrieval` is a seqio metric object (`Task(metric_objs=...)`) of the
predict-with-aux kind: the model's predictions in T5X Retrieval's `'similarity'` mode,
whose aux values carry the encodings (`query_vectors` `[m_q, d]`, `query_valid`,
`passage_vectors` `[m_p, d]`, `passage_valid` per example). The corpus is the split's own
passages: every distinct query (by its tokens) is ranked by MaxSim against every distinct
passage of the split, and the passages it was paired with are its relevant ones. Reported,
with `ir_metrics`' trec_eval definitions: `ndcg@10`, `recall@10`, `mrr@10`, `num_queries`,
`num_passages`. The full BEIR evaluation over a whole corpus is `python -m decal_jax.retrieve`.
"""
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import flax
import numpy as np
import seqio

from decal_jax.retrieval import ir_metrics, maxsim

AUX_KEYS = ("query_vectors", "query_valid", "passage_vectors", "passage_valid")
K = 10


def _distinct(token_rows: Sequence[np.ndarray]) -> Tuple[list, list]:
  """(id of each row, index of the first row of each id): ids 0, 1, ... by first sight."""
  ids, first, seen = [], [], {}
  for row, tokens in enumerate(token_rows):
    key = tuple(np.asarray(tokens).tolist())
    if key not in seen:
      seen[key] = len(first)
      first.append(row)
    ids.append(seen[key])
  return ids, first


def in_corpus_metrics(queries: Sequence[np.ndarray], passages: Sequence[np.ndarray],
                      aux: Mapping[str, np.ndarray], k: int = K) -> Dict[str, float]:
  """Ranks each distinct query's encoding against every distinct passage of the examples.

  queries / passages: each example's token ids (which text it is); aux: the encodings,
  `[examples, m, d]` vectors and `[examples, m]` validity (AUX_KEYS)."""
  query_ids, query_rows = _distinct(queries)
  passage_ids, passage_rows = _distinct(passages)
  scores = np.asarray(maxsim.maxsim(
      np.asarray(aux["query_vectors"])[query_rows], np.asarray(aux["query_valid"])[query_rows],
      np.asarray(aux["passage_vectors"])[passage_rows],
      np.asarray(aux["passage_valid"])[passage_rows]))  # [queries, passages]
  run = {f"q{q}": {f"p{p}": float(s) for p, s in enumerate(row)}
         for q, row in enumerate(scores)}
  qrels: Dict[str, Dict[str, int]] = {}
  for q, p in zip(query_ids, passage_ids):
    qrels.setdefault(f"q{q}", {})[f"p{p}"] = 1
  ndcg, per_query = ir_metrics.ndcg_at_k(run, qrels, k)
  recall, _ = ir_metrics.recall_at_k(run, qrels, k)
  mrr = np.mean([ir_metrics.query_reciprocal_rank(ir_metrics.rank(run[q]), qrels[q], k)
                 for q in per_query])
  return {f"ndcg@{k}": ndcg, f"recall@{k}": recall, f"mrr@{k}": float(mrr),
          "num_queries": float(len(per_query)), "num_passages": float(len(passage_rows))}


@flax.struct.dataclass
class InCorpusRetrieval(seqio.metrics.Metric):
  """seqio metric object: `in_corpus_metrics` over the split (see the module docstring)."""
  model_output_type: seqio.metrics.ModelOutputType = flax.struct.field(
      pytree_node=False, default=seqio.metrics.ModelOutputType.PREDICTION_WITH_AUX)
  values: Optional[Dict[str, float]] = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def from_model_output(cls, inputs: Sequence[Mapping[str, Any]], model_output,
                        features=None, target_field_name: str = "targets",
                        mask: Optional[np.ndarray] = None, indices_2d=None
                        ) -> "InCorpusRetrieval":
    del features, target_field_name, indices_2d
    _, aux = model_output
    missing = [key for key in AUX_KEYS if key not in aux]
    if missing:
      raise ValueError(f"In-corpus retrieval metrics read the encodings from the model's aux "
                       f"values, which lack {missing}: evaluate the dual encoder with "
                       f"inference_mode='similarity' (--gin.INFERENCE_MODE=\"'similarity'\"; "
                       f"gin/t5x/runs/eval_dual_encoder.gin sets it).")
    examples = list(inputs)
    keep = np.ones(len(examples), bool) if mask is None else np.asarray(mask, bool)
    rows = np.flatnonzero(keep)
    aux = {key: np.asarray(aux[key])[rows] for key in AUX_KEYS}
    return cls(values=in_corpus_metrics([examples[i]["inputs"] for i in rows],
                                        [examples[i]["targets"] for i in rows], aux))

  def compute(self) -> Dict[str, float]:
    return dict(self.values)
