"""Okapi BM25, the lexical reference that retrieval results are read against (no training).

Lucene's idf = ln(1 + (N - df + 0.5) / (df + 0.5)) and Anserini's defaults k1 = 0.9,
b = 0.4; text is lower-cased word tokens (letters, digits, underscore), no stemming or
stop words, and each distinct query word counts once: the dependency-free fallback.
`run_bm25s` is the reference with BEIR's settings (stemming, stop words) through `bm25s`;
`reference_run` picks it when installed.
"""
import functools
import math
import re
from typing import Dict, List, Mapping, Optional, Tuple


def words(text: str) -> List[str]:
  """Lower-cased word tokens (letters, digits, underscore)."""
  return re.findall(r"\w+", text.lower())


def run(corpus: Mapping[str, str], queries: Mapping[str, str], k1: float = 0.9,
        b: float = 0.4, top_k: int = 100) -> Dict[str, Dict[str, float]]:
  """BM25 over `corpus` {doc id: text} for `queries` {qid: text}: {qid: {doc id: score}},
  the best top_k of each query."""
  postings, lengths = {}, {}
  for doc, text in corpus.items():
    tokens = words(text)
    lengths[doc] = len(tokens)
    for word in set(tokens):
      postings.setdefault(word, {})[doc] = tokens.count(word)
  n, avgdl = len(corpus), sum(lengths.values()) / max(len(corpus), 1)
  ranked = {}
  for qid, text in queries.items():
    scores = {}
    for word in set(words(text)):
      docs = postings.get(word, {})
      idf = math.log(1 + (n - len(docs) + 0.5) / (len(docs) + 0.5))
      for doc, tf in docs.items():
        norm = k1 * (1 - b + b * lengths[doc] / avgdl)
        scores[doc] = scores.get(doc, 0.0) + idf * tf * (k1 + 1) / (tf + norm)
    ranked[qid] = dict(sorted(scores.items(), key=lambda item: -item[1])[:top_k])
  return ranked


def run_bm25s(corpus: Mapping[str, str], queries: Mapping[str, str], k1: float = 1.2,
              b: float = 0.75, top_k: int = 100, stem: bool = True,
              stopwords: Optional[str] = "en", token_pattern: str = r"(?u)\b\w\w+\b"
              ) -> Dict[str, Dict[str, float]]:
  """BM25 through the `bm25s` package (the `[bm25]` extra): {qid: {doc id: score}}, the
  best top_k of each query, documents with score 0 left out.

  The defaults are BEIR's published BM25 rows (Elasticsearch's English analyzer and
  similarity): English stop words removed, Snowball English stemming, words of 2+ letters
  or digits, k1 = 1.2, b = 0.75, Lucene's idf. bm25s scores tf / (tf + k1 * norm), without
  the constant factor (k1 + 1) of `run`: the same ranking, scores smaller by k1 + 1.
  """
  import bm25s
  stemmer = None
  if stem:
    import Stemmer  # PyStemmer, bm25s's stemmer
    stemmer = Stemmer.Stemmer("english")
  doc_ids = list(corpus)
  tokenize = functools.partial(bm25s.tokenize, stopwords=stopwords, stemmer=stemmer,
                               token_pattern=token_pattern, show_progress=False,
                               return_ids=False)
  retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
  retriever.index(tokenize([corpus[d] for d in doc_ids]), show_progress=False)
  qids = list(queries)
  found, scores = retriever.retrieve(tokenize([queries[q] for q in qids]),
                                     k=min(top_k, len(doc_ids)), show_progress=False)
  return {qid: {doc_ids[int(i)]: float(s) for i, s in zip(rows, values) if s > 0}
          for qid, rows, values in zip(qids, found, scores)}


def reference_run(corpus: Mapping[str, str], queries: Mapping[str, str], top_k: int = 100
                  ) -> Tuple[Dict[str, Dict[str, float]], str]:
  """(BM25 run, what computed it): `run_bm25s` with BEIR's settings when bm25s and
  PyStemmer are installed, else the dependency-free `run`."""
  try:
    return run_bm25s(corpus, queries, top_k=top_k), BM25S_NAME
  except ImportError:
    return run(corpus, queries, top_k=top_k), FALLBACK_NAME


BM25S_NAME = ("BM25 (bm25s: k1 1.2, b 0.75, English stop words and Snowball stemming, as "
              "BEIR's BM25 rows)")
FALLBACK_NAME = "BM25 (k1 0.9, b 0.4, lower-cased words, no stemming)"
