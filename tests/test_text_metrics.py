"""Text metrics: SQuAD EM / F1 on hand-worked cases; ROUGE against the rouge-score package;
BLEU against a plain-python re-derivation of its definition."""
import collections
import math

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


@pytest.mark.parametrize("reference,prediction,hit", [
    ("Denver Broncos", "The answer is the Denver Broncos.", 1.0),  # inside a longer output
    ("2", "There were two of them", 1.0),                          # number word -> digit
    ("two", "2 of them", 1.0),                                     # both sides normalised
    ("Saint-Denis", "saint denis, near Paris", 1.0),               # '-' and ',' -> spaces
    ("2", "in 12 days", 0.0),                                      # whole words only
    ("Paris", "London", 0.0),
    ("...", "anything", 0.0),                                      # empty once normalised
    ("", "", 1.0),                                  # unanswerable (answers [""]): abstained
    ("", "Paris", 0.0),                             # unanswerable, but the model answered
])
def test_contains_answer_hand_worked(reference, prediction, hit):
  assert text_metrics.answer_contained(reference, prediction) == hit


def test_contains_answer_takes_any_reference_and_sits_beside_em_f1():
  targets = [["Paris", "City of Light"], "Denver Broncos", ("five",)]
  predictions = ["It is the City of Light.", "the Broncos", "5 players"]
  # hits: 1 (2nd reference), 0 ('denver broncos' not in 'the broncos'), 1 (five -> 5)
  assert text_metrics.contains_answer(targets, predictions) == {
      "contains_answer": pytest.approx(200 / 3)}
  assert text_metrics.squad(targets, predictions)["contains_answer"] == pytest.approx(200 / 3)


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


# --------------------------------------------------------------------------- BLEU
def _ngrams(words, n):
  return collections.Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def _reference_bleu(references, hypotheses):
  """Corpus BLEU x 100 from its definition (Papineni et al.): clipped n-gram counts summed
  over the corpus for n = 1..4, their geometric mean, times the brevity penalty
  exp(1 - r / c) when the hypotheses (c words) are shorter than the references (r words).
  Whitespace words: the test texts are already tokenised, so sacrebleu's tokeniser keeps
  them as they are. One reference per example; every order must have a match."""
  matches, totals, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
  for ref, hyp in zip(references, hypotheses):
    ref, hyp = ref.split(), hyp.split()
    hyp_len, ref_len = hyp_len + len(hyp), ref_len + len(ref)
    for n in range(1, 5):
      hyp_counts, ref_counts = _ngrams(hyp, n), _ngrams(ref, n)
      matches[n - 1] += sum(min(c, ref_counts[g]) for g, c in hyp_counts.items())
      totals[n - 1] += max(len(hyp) - n + 1, 0)
  log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
  brevity = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
  return 100 * brevity * math.exp(log_precision)


def test_bleu_of_identical_text_is_100():
  texts = ["the with statement wraps a block", "a b c d e f g"]
  assert text_metrics.bleu(texts, texts)["bleu"] == pytest.approx(100.0)


def test_bleu_hand_worked():
  ref, hyp = "the cat sat on the mat today", "the cat sat on a mat"
  # clipped matches / hypothesis n-grams: 1-grams 5/6 ('a' misses), 2-grams 3/5
  # (the cat, cat sat, sat on), 3-grams 2/4, 4-grams 1/3 (the cat sat on);
  # 6 words against 7: brevity penalty exp(1 - 7/6).
  want = 100 * math.exp(1 - 7 / 6) * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
  assert _reference_bleu([ref], [hyp]) == pytest.approx(want)
  assert text_metrics.bleu([ref], [hyp])["bleu"] == pytest.approx(want, abs=1e-9)


def test_bleu_is_a_corpus_score_not_a_mean_of_sentences():
  refs = ["the cat sat on the mat today", "a quick brown fox jumps over the lazy dog",
          "we read the docs"]
  hyps = ["the cat sat on a mat", "a quick brown fox jumped over a lazy dog and a cat",
          "we read the docs"]
  want = _reference_bleu(refs, hyps)
  assert text_metrics.bleu(refs, hyps)["bleu"] == pytest.approx(want, abs=1e-9)
  sentence_mean = sum(_reference_bleu([r], [h]) for r, h in zip(refs, hyps)) / 3
  assert abs(want - sentence_mean) > 1.0  # the two really differ on this example


def test_bleu_errors_name_the_problem():
  with pytest.raises(ValueError, match="2 targets but 1 predictions"):
    text_metrics.bleu(["a", "b"], ["a"])
  with pytest.raises(ValueError, match="No examples"):
    text_metrics.bleu([], [])


def test_bleu_takes_several_references_per_example():
  # Each hypothesis equals one of its references: every n-gram is matched and the closest
  # reference length equals the hypothesis length, so BLEU is 100 even though the examples
  # have different numbers of references.
  targets = [["the cat sat on the mat today", "the cat sat on a mat"], "we read the docs"]
  assert text_metrics.bleu(targets, ["the cat sat on a mat", "we read the docs"])["bleu"] == \
      pytest.approx(100.0)
