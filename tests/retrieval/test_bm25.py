"""The bm25s reference (BEIR's settings) against a score worked by hand, and against the
hand-written fallback BM25 when both read text alike."""
import math

import numpy as np
import pytest

from decal_jax.retrieval import bm25

pytest.importorskip("bm25s")
pytest.importorskip("Stemmer")

WORDS = ("river stone light garden winter engine paper signal forest market copper cloud "
         "harbor violin planet orchard lantern meadow compass thunder").split()


def test_bm25s_with_fallback_settings_ranks_as_the_fallback():
  rng = np.random.default_rng(0)
  corpus = {f"d{i}": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40))))
            for i in range(60)}
  queries = {f"q{j}": " ".join(rng.choice(WORDS, size=3, replace=False)) for j in range(12)}
  ours = bm25.run(corpus, queries, k1=0.9, b=0.4, top_k=10)
  theirs = bm25.run_bm25s(corpus, queries, k1=0.9, b=0.4, top_k=10, stem=False,
                          stopwords=None, token_pattern=r"\w+")
  for qid in queries:
    assert set(theirs[qid]) == set(ours[qid]), qid
    for doc, score in ours[qid].items():  # bm25s leaves out the constant factor k1 + 1
      assert theirs[qid][doc] * 1.9 == pytest.approx(score, rel=1e-5), (qid, doc)


def test_bm25s_beir_settings_stem_and_drop_stop_words_worked_by_hand():
  # After stop words ('the', 'a', 'is') and stemming: a = [run, dog], b = [dog, sleep],
  # c = [cat]; avgdl 5/3. k1 1.2, b 0.75; query "the running dog" -> [run, dog].
  #   idf(run) = ln(1 + 2.5 / 1.5) = ln(8/3);  idf(dog) = ln(1 + 1.5 / 2.5) = ln 1.6
  #   a and b: dl 2, K = 1.2 (0.25 + 0.75 * 2 / (5/3)) = 1.38 -> tf part 1 / 2.38
  corpus = {"a": "Running dogs", "b": "the dog is sleeping", "c": "a cat"}
  run = bm25.run_bm25s(corpus, {"q": "the running dog"}, top_k=3)
  assert run["q"] == pytest.approx({"a": (math.log(8 / 3) + math.log(1.6)) / 2.38,
                                    "b": math.log(1.6) / 2.38})
  ranked, name = bm25.reference_run(corpus, {"q": "the running dog"}, top_k=3)
  assert ranked == run and name == bm25.BM25S_NAME
