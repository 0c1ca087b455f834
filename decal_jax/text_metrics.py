"""Metrics of generated text, as seqio `metric_fns(targets, predictions) -> {name: value}`: the
seqio tasks' (`decal_jax.tasks`) and the lab's (the SmolLM2 tools). A foundation with no seqio
or TensorFlow, so a GPU image without them scores generated text too.

* `rouge`: ROUGE-1 / ROUGE-2 / ROUGE-L / ROUGE-Lsum F-measure (the `rouge-score` package,
  Porter stemming, as in the DeCAL summarization tables), averaged over examples, x 100.
  ROUGE-Lsum splits both texts into sentences at newlines.
* `squad`: exact match and token F1 after SQuAD answer normalisation (lower case, no
  punctuation, no articles a/an/the, single spaces); each prediction takes its best score
  over the reference answers. x 100.
* `contains_answer` (also in `squad`'s output): Dodo's QA accuracy (dodo.md Appendix E) —
  the share of predictions that contain a reference answer after number words become
  digits, punctuation becomes spaces, and both are lower-cased; x 100. Containment is by
  whole words ("2" is not found in "12").
* `bleu`: corpus BLEU (sacrebleu's defaults: 13a tokenisation, exponential smoothing),
  0-100; the reconstruction score of Dodo's autoencoding.

A target may be one string or a sequence of reference strings (QA tasks pass every answer).
"""
import collections
import re
import string
from typing import Dict, List, Sequence, Union

import numpy as np
import sacrebleu

Target = Union[str, Sequence[str]]
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def _references(target: Target) -> List[str]:
  refs = [target] if isinstance(target, (str, bytes)) else list(target)
  refs = [r.decode("utf-8") if isinstance(r, bytes) else str(r) for r in refs]
  if not refs:
    raise ValueError("A target has no reference text; every example needs at least one.")
  return refs


def _check_lengths(targets: Sequence[Target], predictions: Sequence[str]) -> None:
  if len(targets) != len(predictions):
    raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions.")
  if not targets:
    raise ValueError("No examples to score.")


def rouge(targets: Sequence[Target], predictions: Sequence[str]) -> Dict[str, float]:
  """Mean ROUGE F-measure x 100 (best reference per example when there are several)."""
  _check_lengths(targets, predictions)
  from rouge_score import rouge_scorer  # here: only ROUGE needs it (sacrebleu: BLEU)
  scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True,
                                    split_summaries=False)
  totals = collections.defaultdict(float)
  for target, prediction in zip(targets, predictions):
    per_ref = [scorer.score(_lsum_ready(ref), _lsum_ready(prediction))
               for ref in _references(target)]
    for name in ROUGE_TYPES:
      totals[name] += max(s[name].fmeasure for s in per_ref)
  return {name: 100.0 * totals[name] / len(targets) for name in ROUGE_TYPES}


def _lsum_ready(text: str) -> str:
  """ROUGE-Lsum reads sentences from lines; blank lines would be empty sentences."""
  return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def normalize_answer(text: str) -> str:
  """SQuAD's answer normalisation."""
  text = text.lower()
  text = "".join(ch for ch in text if ch not in set(string.punctuation))
  text = re.sub(r"\b(a|an|the)\b", " ", text)
  return " ".join(text.split())


def token_f1(reference: str, prediction: str) -> float:
  """F1 of the normalised token bags (1.0 when both are empty after normalisation)."""
  ref, pred = normalize_answer(reference).split(), normalize_answer(prediction).split()
  if not ref or not pred:
    return float(ref == pred)
  common = sum((collections.Counter(ref) & collections.Counter(pred)).values())
  if common == 0:
    return 0.0
  precision, recall = common / len(pred), common / len(ref)
  return 2 * precision * recall / (precision + recall)


def exact_match(reference: str, prediction: str) -> float:
  return float(normalize_answer(reference) == normalize_answer(prediction))


def squad(targets: Sequence[Target], predictions: Sequence[str]) -> Dict[str, float]:
  """{'em', 'f1', 'contains_answer'} x 100, max over each example's reference answers."""
  _check_lengths(targets, predictions)
  em = [max(exact_match(r, p) for r in _references(t)) for t, p in zip(targets, predictions)]
  f1 = [max(token_f1(r, p) for r in _references(t)) for t, p in zip(targets, predictions)]
  return {"em": 100.0 * float(np.mean(em)), "f1": 100.0 * float(np.mean(f1)),
          **contains_answer(targets, predictions)}


NUMBER_WORDS = dict(zip(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty".split(), range(21)))
NUMBER_WORDS.update({"thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
                     "eighty": 80, "ninety": 90, "hundred": 100, "thousand": 1000})


def normalize_for_containment(text: str) -> str:
  """dodo.md Appendix E: punctuation -> spaces, lower case, number words -> digits, trimmed."""
  text = "".join(" " if ch in string.punctuation else ch for ch in text.lower())
  return " ".join(str(NUMBER_WORDS.get(word, word)) for word in text.split())


def answer_contained(reference: str, prediction: str) -> float:
  """1.0 when the normalised reference occurs in the normalised prediction as whole words.
  An empty reference (an unanswerable question kept as answers [""]) is contained only in an
  empty prediction: the model is right when it abstains, as EM scores it."""
  ref, hyp = normalize_for_containment(reference), normalize_for_containment(prediction)
  if not ref:
    return float(not hyp)
  return float(f" {ref} " in f" {hyp} ")


def contains_answer(targets: Sequence[Target], predictions: Sequence[str]) -> Dict[str, float]:
  """{'contains_answer': % of predictions containing one of their reference answers}."""
  _check_lengths(targets, predictions)
  hits = [max(answer_contained(r, p) for r in _references(t))
          for t, p in zip(targets, predictions)]
  return {"contains_answer": 100.0 * float(np.mean(hits))}


def bleu(targets: Sequence[Target], predictions: Sequence[str]) -> Dict[str, float]:
  """{'bleu': corpus BLEU x 100} of the predictions against their reference(s).

  Examples may have different numbers of references; the missing ones are left out."""
  _check_lengths(targets, predictions)
  references = [_references(t) for t in targets]
  streams = [[refs[i] if i < len(refs) else None for refs in references]
             for i in range(max(len(refs) for refs in references))]  # [refs][examples]
  score = sacrebleu.corpus_bleu([str(p) for p in predictions], streams)
  return {"bleu": float(score.score)}
