"""Text metrics: SQuAD EM / F1 on hand-worked cases; ROUGE against the rouge-score package."""
import pytest
from rouge_score import rouge_scorer

from decal_jax import text_metrics


@pytest.mark.parametrize("reference,prediction,em,f1", [
    ("Denver Broncos", "the Denver Broncos", 1.0, 1.0),        # article dropped
    ("Denver Broncos", "Denver Broncos!", 1.0, 1.0),           # punctuation dropped
    ("Denver Broncos", "broncos of denver", 0.0, 0.8),         # P 2/3, R 1 -> 0.8
    ("Saint Bernadette Soubirous", "Bernadette", 0.0, 0.5),    # P 1, R 1/3 -> 0.5
    ("1,000 miles", "1000 miles", 1.0, 1.0),                   # ',' is punctuation
    ("Paris", "London", 0.0, 0.0),
    ("Paris", "", 0.0, 0.0),
    ("the", "a", 1.0, 1.0),                                    # both empty once normalised
])
def test_squad_scores_hand_worked(reference, prediction, em, f1):
  assert text_metrics.exact_match(reference, prediction) == em
  assert text_metrics.token_f1(reference, prediction) == pytest.approx(f1)


def test_squad_takes_the_best_reference_and_averages_times_100():
  targets = [["Paris", "the city of Paris"], "Denver Broncos", ("Bernadette",)]
  predictions = ["City of Paris.", "Broncos", "nobody"]
  # example 1: EM 1 against the 2nd reference; example 2: F1 = 2 * 1 * 0.5 / 1.5 = 2/3
  got = text_metrics.squad(targets, predictions)
  assert got["em"] == pytest.approx(100 / 3)
  assert got["f1"] == pytest.approx(100 * (1 + 2 / 3 + 0) / 3)


def test_rouge_matches_the_package_on_the_same_strings():
  targets = ["police killed the gunman .\nthe gunman had hostages .",
             "the cat sat on the mat", ["a plane landed", "the plane landed safely"]]
  predictions = ["the gunman was killed by police .\nhostages were freed .",
                 "the cat sat", "plane landed safely today"]
  scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"],
                                    use_stemmer=True)
  want = {k: 0.0 for k in text_metrics.ROUGE_TYPES}
  for target, prediction in zip(targets, predictions):
    refs = [target] if isinstance(target, str) else target
    for k in want:
      want[k] += max(scorer.score(r, prediction)[k].fmeasure for r in refs) * 100 / 3
  got = text_metrics.rouge(targets, predictions)
  for k in want:
    assert got[k] == pytest.approx(want[k]), k


def test_rouge_hand_worked_and_stemmed():
  # reference 6 unigrams, prediction 3 all matching: P 1, R 1/2 -> F 2/3
  assert text_metrics.rouge(["the cat sat on the mat"], ["the cat sat"])["rouge1"] == \
      pytest.approx(200 / 3)
  # Porter stemming: cats/cat and running/runs/run meet
  assert text_metrics.rouge(["cats running"], ["cat runs"])["rouge1"] == pytest.approx(100.0)


def test_metric_errors_name_the_problem():
  with pytest.raises(ValueError, match="2 targets but 1 predictions"):
    text_metrics.squad(["a", "b"], ["a"])
  with pytest.raises(ValueError, match="no reference"):
    text_metrics.squad([[]], ["a"])
