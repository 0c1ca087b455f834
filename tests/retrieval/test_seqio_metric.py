"""decal_jax.retrieval.seqio_metric (t5x.eval's retrieval metrics) against a hand-worked
ranking."""
import math

import numpy as np
import pytest

from decal_jax.retrieval.seqio_metric import InCorpusRetrieval, in_corpus_metrics

# Three (query, passage) examples: query A is paired with passages X and Y, query B with Z.
QUERIES = [np.array([5, 1]), np.array([5, 1]), np.array([6, 1])]
PASSAGES = [np.array([7, 1]), np.array([8, 1]), np.array([9, 1])]
# one valid vector each (d = 2), and an invalid slot holding a value that would win if read
BIG = [100.0, 100.0]
AUX = {"query_vectors": np.array([[[1, 0], BIG], [[1, 0], BIG], [[0, 1], BIG]], np.float32),
       "query_valid": np.array([[1, 0]] * 3, bool),
       "passage_vectors": np.array([[[0.9, 0], BIG], [[0.2, 0.5], BIG], [[0.5, 0.3], BIG]],
                                   np.float32),
       "passage_valid": np.array([[1, 0]] * 3, bool)}
# A scores X .9, Z .5, Y .2 (relevant at ranks 1 and 3); B scores Y .5, Z .3, X 0 (rank 2)
IDEAL_TWO = 1 + 1 / math.log2(3)


def test_hand_worked_ranking_at_10_and_at_2():
  got = in_corpus_metrics(QUERIES, PASSAGES, AUX)
  assert got["ndcg@10"] == pytest.approx(((1 + 1 / math.log2(4)) / IDEAL_TWO
                                          + 1 / math.log2(3)) / 2)
  assert got["recall@10"] == 1.0 and got["mrr@10"] == pytest.approx(0.75)
  assert (got["num_queries"], got["num_passages"]) == (2, 3)
  at_two = in_corpus_metrics(QUERIES, PASSAGES, AUX, k=2)
  assert at_two["ndcg@2"] == pytest.approx((1 / IDEAL_TWO + 1 / math.log2(3)) / 2)
  assert at_two["recall@2"] == pytest.approx((0.5 + 1) / 2)


def test_seqio_metric_object_reads_examples_and_aux_and_names_the_fix():
  examples = [{"inputs": q, "targets": p} for q, p in zip(QUERIES, PASSAGES)]
  metric = InCorpusRetrieval().from_model_output(examples, (np.zeros(3), AUX))
  assert metric.compute() == in_corpus_metrics(QUERIES, PASSAGES, AUX)
  with pytest.raises(ValueError, match="inference_mode='similarity'"):
    InCorpusRetrieval().from_model_output(examples, (np.zeros(3), {"valid": AUX["query_valid"]}))


def test_retrieval_tasks_carry_the_metric():
  import seqio
  import decal_jax.tasks  # noqa: F401  (registers the tasks)
  task = seqio.get_mixture_or_task("decal_beir_builtin")
  assert [type(m) for m in task.metric_objs] == [InCorpusRetrieval]
