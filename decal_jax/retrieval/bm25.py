"""Okapi BM25, the lexical reference that retrieval results are read against (no training).

Lucene's idf = ln(1 + (N - df + 0.5) / (df + 0.5)) and Anserini's defaults k1 = 0.9,
b = 0.4; text is lower-cased word tokens (letters, digits, underscore), no stemming or
stop words, and each distinct query word counts once.
"""
import math
import re
from typing import Dict, List, Mapping


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
