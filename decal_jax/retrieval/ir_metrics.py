"""NDCG@k and Recall@k with trec_eval's definitions, BEIR's full measure set, and TREC
run files.

`beir_measures` gives BEIR's table (nDCG, MAP, Recall, P at k in 1, 3, 5, 10, 100, 1000, its
`ignore_identical_ids`) plus MS MARCO's MRR@10, through pytrec_eval when it is installed
and through this module's own functions (`query_*`, same definitions, tested equal query by
query) when it is not.

A run maps each query id to `{doc id: score}`; qrels map each query id to `{doc id: grade}`
(an int; > 0 means relevant). Both metrics follow trec_eval (`ndcg_cut.k`, `recall.k`), and
a test checks them against `pytrec_eval` query by query:

- the run is ranked by score, highest first, and equal scores by doc id in *descending*
  string order (trec_eval's tie rule);
- NDCG@k: DCG = sum over the first k ranked docs of grade / log2(rank + 1) (rank from 1;
  unjudged docs and grades <= 0 add nothing), divided by the DCG of the best possible
  ranking of the query's positive grades, also cut at k;
- Recall@k: relevant docs (grade > 0) among the first k, over all relevant docs of the query.

Which queries count (where we differ from pytrec_eval, on purpose): the mean is over the
queries of `qrels` that have at least one relevant document. Such a query missing from the
run (or with an empty ranking) scores 0 (trec_eval's `-c`), because dropping it would reward
a system for failing on hard queries. pytrec_eval instead evaluates only the queries present
in both the run and the qrels, and includes qrels queries with no relevant document (which
score 0). On a run that holds every query of qrels whose queries all have a relevant
document, the two agree exactly. Run queries that qrels does not judge are ignored.
"""
import importlib.util
import math
from typing import Dict, List, Mapping, Tuple

from decal_jax import fileio

Run = Dict[str, Dict[str, float]]
Qrels = Dict[str, Dict[str, int]]


def rank(scores: Mapping[str, float]) -> List[str]:
  """Doc ids by score (highest first), ties by doc id descending (trec_eval's order)."""
  return [doc for doc, _ in sorted(scores.items(), key=lambda item: (item[1], item[0]),
                                   reverse=True)]


def _judged_queries(qrels: Mapping[str, Mapping[str, int]]) -> List[str]:
  """Queries with at least one relevant (grade > 0) document, in sorted order."""
  return sorted(qid for qid, grades in qrels.items() if any(g > 0 for g in grades.values()))


def _dcg(gains: List[float]) -> float:
  return sum(g / math.log2(i + 2) for i, g in enumerate(gains) if g > 0)


def query_ndcg(ranking: List[str], grades: Mapping[str, int], k: int) -> float:
  """NDCG@k of one ranked list of doc ids against one query's graded judgements."""
  ideal = _dcg(sorted((g for g in grades.values() if g > 0), reverse=True)[:k])
  if ideal == 0:
    return 0.0
  return _dcg([grades.get(doc, 0) for doc in ranking[:k]]) / ideal


def query_recall(ranking: List[str], grades: Mapping[str, int], k: int) -> float:
  """Recall@k of one ranked list: relevant docs in the first k / all relevant docs."""
  relevant = {doc for doc, g in grades.items() if g > 0}
  if not relevant:
    return 0.0
  return sum(doc in relevant for doc in ranking[:k]) / len(relevant)


def _mean_metric(metric, run: Mapping[str, Mapping[str, float]],
                 qrels: Mapping[str, Mapping[str, int]], k: int
                 ) -> Tuple[float, Dict[str, float]]:
  if k < 1:
    raise ValueError(f"The cutoff k must be >= 1, got {k}.")
  per_query = {qid: metric(rank(run.get(qid, {})), qrels[qid], k)
               for qid in _judged_queries(qrels)}
  mean = sum(per_query.values()) / len(per_query) if per_query else 0.0
  return mean, per_query


def ndcg_at_k(run: Mapping[str, Mapping[str, float]], qrels: Mapping[str, Mapping[str, int]],
              k: int = 10) -> Tuple[float, Dict[str, float]]:
  """(mean NDCG@k, {qid: NDCG@k}) over the qrels queries with a relevant document."""
  return _mean_metric(query_ndcg, run, qrels, k)


def recall_at_k(run: Mapping[str, Mapping[str, float]],
                qrels: Mapping[str, Mapping[str, int]],
                k: int = 100) -> Tuple[float, Dict[str, float]]:
  """(mean Recall@k, {qid: Recall@k}) over the qrels queries with a relevant document."""
  return _mean_metric(query_recall, run, qrels, k)


def evaluate(run: Mapping[str, Mapping[str, float]],
             qrels: Mapping[str, Mapping[str, int]]) -> Dict[str, float]:
  """{'ndcg@10', 'recall@100', 'num_queries' (queries with a relevant document)}."""
  ndcg, per_query = ndcg_at_k(run, qrels, 10)
  recall, _ = recall_at_k(run, qrels, 100)
  return {"ndcg@10": ndcg, "recall@100": recall, "num_queries": len(per_query)}


# ------------------------------------------------------------------------------- BEIR's set
K_VALUES = (1, 3, 5, 10, 100, 1000)


def query_precision(ranking: List[str], grades: Mapping[str, int], k: int) -> float:
  """P@k: relevant docs among the first k, over k (trec_eval's `P.k`: fewer retrieved
  docs still divide by k)."""
  return sum(grades.get(doc, 0) > 0 for doc in ranking[:k]) / k


def query_average_precision(ranking: List[str], grades: Mapping[str, int], k: int) -> float:
  """AP@k (trec_eval's `map_cut.k`): the sum of P@i at the rank i of each relevant doc in
  the first k, over all relevant docs of the query."""
  relevant = sum(g > 0 for g in grades.values())
  if not relevant:
    return 0.0
  found, total = 0, 0.0
  for position, doc in enumerate(ranking[:k], start=1):
    if grades.get(doc, 0) > 0:
      found += 1
      total += found / position
  return total / relevant


def query_reciprocal_rank(ranking: List[str], grades: Mapping[str, int], k: int) -> float:
  """RR@k: 1 / the rank of the first relevant doc in the first k, else 0 (MS MARCO's
  MRR@10 averages it with k = 10)."""
  for position, doc in enumerate(ranking[:k], start=1):
    if grades.get(doc, 0) > 0:
      return 1.0 / position
  return 0.0


_MEASURES = {"NDCG": ("ndcg_cut", query_ndcg), "MAP": ("map_cut", query_average_precision),
             "Recall": ("recall", query_recall), "P": ("P", query_precision)}


def _without_identical_ids(run: Mapping[str, Mapping[str, float]]) -> Run:
  """The run without any doc whose id is its query's id (BEIR's `ignore_identical_ids`,
  for corpora such as ArguAna and Quora where a query is also a document)."""
  return {qid: {doc: s for doc, s in docs.items() if doc != qid} for qid, docs in run.items()}


def _pytrec_per_query(run: Run, qrels: Mapping[str, Mapping[str, int]],
                      k_values: Tuple[int, ...]) -> Dict[str, Dict[str, float]]:
  import pytrec_eval
  cuts = ",".join(str(k) for k in k_values)
  wanted = {f"{name}.{cuts}" for name, _ in _MEASURES.values()}
  qrels = {q: dict(g) for q, g in qrels.items()}
  found = pytrec_eval.RelevanceEvaluator(qrels, wanted).evaluate(run)
  top10 = {q: {doc: docs[doc] for doc in rank(docs)[:10]} for q, docs in run.items()}
  reciprocal = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
  out = {}
  for qid, values in found.items():
    out[qid] = {f"{label}@{k}": values[f"{name}_{k}"] for label, (name, _) in _MEASURES.items()
                for k in k_values}
    out[qid]["MRR@10"] = reciprocal[qid]["recip_rank"]
  return out


def _own_per_query(run: Run, qrels: Mapping[str, Mapping[str, int]],
                   k_values: Tuple[int, ...]) -> Dict[str, Dict[str, float]]:
  out = {}
  for qid in sorted(set(run) & set(qrels)):
    ranking, grades = rank(run[qid]), qrels[qid]
    out[qid] = {f"{label}@{k}": fn(ranking, grades, k) for label, (_, fn) in _MEASURES.items()
                for k in k_values}
    out[qid]["MRR@10"] = query_reciprocal_rank(ranking, grades, 10)
  return out


def beir_per_query(run: Mapping[str, Mapping[str, float]],
                   qrels: Mapping[str, Mapping[str, int]], k_values=K_VALUES,
                   ignore_identical_ids: bool = True, backend: str = "auto"
                   ) -> Dict[str, Dict[str, float]]:
  """{qid: {'NDCG@k', 'MAP@k', 'Recall@k', 'P@k' for each k, 'MRR@10'}} over the queries
  in both the run and qrels (BEIR's convention, unlike `evaluate`'s). backend: 'pytrec_eval',
  'own' (this module's functions, no dependency) or 'auto' (pytrec_eval when installed)."""
  if backend not in ("auto", "pytrec_eval", "own"):
    raise ValueError(f"backend must be 'auto', 'pytrec_eval' or 'own', got {backend!r}.")
  k_values = tuple(sorted(set(k_values)))
  if not k_values or k_values[0] < 1:
    raise ValueError(f"k_values must be cutoffs >= 1, got {k_values}.")
  run = _without_identical_ids(run) if ignore_identical_ids else {q: dict(d) for q, d in
                                                                 run.items()}
  if backend != "own":
    try:
      return _pytrec_per_query(run, qrels, k_values)
    except ImportError:
      if backend == "pytrec_eval":
        raise ImportError("backend 'pytrec_eval' needs pytrec-eval-terrier: pip install "
                          "'decal_jax[test]' (or use backend 'own').") from None
  return _own_per_query(run, qrels, k_values)


def beir_measures(run: Mapping[str, Mapping[str, float]],
                  qrels: Mapping[str, Mapping[str, int]], k_values=K_VALUES,
                  ignore_identical_ids: bool = True, backend: str = "auto"
                  ) -> Dict[str, float]:
  """The mean over queries of each `beir_per_query` measure."""
  per_query = beir_per_query(run, qrels, k_values, ignore_identical_ids, backend)
  if not per_query:
    return {}
  names = next(iter(per_query.values()))
  return {name: sum(v[name] for v in per_query.values()) / len(per_query) for name in names}


def implementation(backend: str = "auto") -> str:
  """Which code computes `beir_measures` for `backend`: 'pytrec_eval' (installed, and not
  'own') or 'own' (this module's functions). Written into every retrieval metrics file."""
  if backend == "own":
    return "own"
  return "pytrec_eval" if importlib.util.find_spec("pytrec_eval") is not None else "own"


def _check_id(name: str, value: str) -> None:
  if not isinstance(value, str) or not value or any(c.isspace() for c in value):
    raise ValueError(f"The {name} {value!r} is not a non-empty string without whitespace, "
                     "which the TREC run format needs. Rename it (no spaces).")


def write_trec_run(path: str, run: Mapping[str, Mapping[str, float]], tag: str = "decal_jax",
                   depth: int = 1000) -> None:
  """Writes `qid Q0 docid rank score tag` lines (best `depth` docs per query in `rank`'s
  order, ranks from 1, queries in sorted order) with `fileio.write_text_atomic`, so the file
  is whole or absent."""
  if depth < 1:
    raise ValueError(f"depth must be >= 1 (docs written per query), got {depth}.")
  if not tag or any(c.isspace() for c in tag):
    raise ValueError(f"The run tag must be one non-empty word (no spaces), got {tag!r}.")
  lines = []
  for qid in sorted(run):
    _check_id("query id", qid)
    for position, doc in enumerate(rank(run[qid])[:depth], start=1):
      _check_id("doc id", doc)
      # repr(float) is the shortest text that reads back to the same double: ranks and
      # ties survive a write / read round trip.
      lines.append(f"{qid} Q0 {doc} {position} {float(run[qid][doc])!r} {tag}\n")
  fileio.write_text_atomic(path, "".join(lines))


def read_trec_run(path: str) -> Run:
  """A TREC run file -> {qid: {docid: score}}; a malformed line is reported with its number."""
  run: Run = {}
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, start=1):
      fields = line.split()
      if not fields:
        continue
      where = f"{path}:{number}"
      if len(fields) != 6:
        raise ValueError(f"{where}: expected 6 columns `qid Q0 docid rank score tag`, got "
                         f"{len(fields)}: {line.strip()!r}. Fix or remove the line.")
      qid, _, doc, _, score, _ = fields
      try:
        value = float(score)
      except ValueError:
        raise ValueError(f"{where}: score {score!r} is not a number. Fix the line.") from None
      scores = run.setdefault(qid, {})
      if doc in scores:
        raise ValueError(f"{where}: doc {doc!r} appears twice for query {qid!r}. Keep one "
                         "line per (query, doc).")
      scores[doc] = value
  return run
