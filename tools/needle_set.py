"""A synthetic "needle" retrieval set: what a passage is about is one invented word that the
built-in SentencePiece vocabulary cuts into several pieces, so that averaging C consecutive
token states (DeCAL's compression) can blur it. Written as a BEIR folder for
`tools/retrieval_table.py`:

  python -m tools.needle_set --out /work/needle_data      # -> /work/needle_data/beir/needle/
  DECAL_LOCAL_DATA_DIR=/work/needle_data python -m tools.retrieval_table \
    --init runs/decal_tiny --task decal_beir_needle --ratios 1 4 8 --passage_length 160 ...
  python -m tools.needle_set --out /work/needle_data --diagnose RUN.trec ...  # what ranked first

Needles are lowercase words of --syllables random syllables (consonant, vowel, maybe a
consonant), each at least --min_pieces pieces long (redrawn otherwise), all distinct, none a
substring of the built-in corpus, of the templates or of another needle. Passages come in
twins: the same filler (consecutive prose sentences of the built-in corpus, about
--passage_tokens pieces) with a carrier sentence at the same sentence boundary, differing
only in the needle; the twins' needles share their first syllable, so the twin is a hard
negative that only the whole word tells apart. Every passage of --test_pairs pairs gets a
test query naming its needle (qrels grade 1 to that passage alone), those of --train_pairs
further pairs (default: all the rest) train queries. Everything follows from --seed.

The folder also holds meta.json: the settings, the vocabulary and corpus identities and the
statistics printed (pieces per needle, filler and passage pieces). It is written atomically;
rerunning the same command leaves it as it is, and a folder with other content is refused.
"""
import argparse
import hashlib
import json
import os
import pathlib
import random
import re
import statistics
import sys
import tempfile
from typing import Dict, List, Tuple

from decal_jax.data import corpus, vocabularies
from decal_jax.retrieval import beir

FORMAT_VERSION = 1
META_FILE = "meta.json"
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"
CARRIERS = ("The name {} is used here.", "This text also mentions {}.",
            "One example is called {}.", "Here the keyword is {}.",
            "A value named {} appears below.")
QUERIES = ("which passage mentions {}?", "where is {} mentioned?", "find the text about {}",
           "what is said about {}?", "{} in context")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
MAX_DRAWS = 1000  # draws per needle pair / filler before giving up


def prose_sentences() -> List[str]:
  """The built-in corpus's plain prose sentences (no code, grammar or markup), in order."""
  docs = corpus.documents()["train"] + corpus.documents()["validation"]
  sentences = [s for doc in docs for s in SENTENCE_END.split(doc)]
  return [s for s in sentences
          if re.fullmatch(r"[A-Z].*[a-z)]\.", s) and not re.search(r">>>|::=|[{}\[\]=|*\\<>]", s)
          and sum(c.isalpha() or c == " " for c in s) > 0.9 * len(s)]


def syllable(rng: random.Random) -> str:
  return rng.choice(CONSONANTS) + rng.choice(VOWELS) + (rng.choice(CONSONANTS)
                                                        if rng.random() < 0.5 else "")


def draw_needles(rng, a, vocab, forbidden: str) -> List[Tuple[str, str]]:
  """--pairs twin needles sharing their first syllable; see the module docstring."""
  pairs, taken = [], []
  for _ in range(MAX_DRAWS * a.pairs):
    if len(pairs) == a.pairs:
      return pairs
    first = syllable(rng)
    twins = [first + "".join(syllable(rng) for _ in range(a.syllables - 1)) for _ in "ab"]
    if all(len(vocab.encode(w)) >= a.min_pieces and w not in forbidden
           and not any(w in t or t in w for t in taken + [twins[1 - i]])
           for i, w in enumerate(twins)):
      pairs.append(tuple(twins))
      taken += twins
  raise ValueError(f"only {len(pairs)} of {a.pairs} needle pairs found in {MAX_DRAWS * a.pairs} "
                   f"draws: lower --min_pieces or raise --syllables.")


def draw_filler(rng, sentences: List[str], counts: List[int], target: int) -> List[str]:
  """Consecutive sentences from a random start, as many as bring their pieces nearest to
  `target`; redrawn unless that is 0.8 to 1.2 x `target`."""
  for _ in range(MAX_DRAWS):
    start = end = rng.randrange(len(sentences))
    total = 0
    while end < len(sentences) and abs(total + counts[end] - target) <= abs(total - target):
      total, end = total + counts[end], end + 1
    if 0.8 * target <= total <= 1.2 * target:
      return sentences[start:end]
  raise ValueError(f"no run of corpus sentences has about {target} pieces; change "
                   "--passage_tokens.")


def build(a, vocab):
  """(passages, queries, qrels by split, statistics) of the set `a` describes."""
  rng = random.Random(a.seed)
  sentences = prose_sentences()
  counts = [len(vocab.encode(s)) for s in sentences]
  docs = corpus.documents()["train"] + corpus.documents()["validation"]
  forbidden = "\n".join(docs + list(CARRIERS + QUERIES)).lower()
  pairs = draw_needles(rng, a, vocab, forbidden)
  order = rng.sample(range(a.pairs), a.pairs)
  split_of = {i: "test" if k < a.test_pairs else "train"
              for k, i in enumerate(order[:a.test_pairs + a.train_pairs])}
  passages, queries, qrels = {}, {}, {"train": {}, "test": {}}
  filler_pieces, passage_pieces = [], []
  for i, twins in enumerate(pairs):
    filler = draw_filler(rng, sentences, counts, a.passage_tokens)
    position, carrier = rng.randint(0, len(filler)), rng.choice(CARRIERS)
    for side, needle in zip("ab", twins):
      doc_id = f"p{i:05d}{side}"
      passages[doc_id] = " ".join(filler[:position] + [carrier.format(needle)]
                                  + filler[position:])
      filler_pieces.append(len(vocab.encode(" ".join(filler))))
      passage_pieces.append(len(vocab.encode(passages[doc_id])) + 1)  # + EOS
      if i in split_of:
        queries[f"q{i:05d}{side}"] = rng.choice(QUERIES).format(needle)
        qrels[split_of[i]][f"q{i:05d}{side}"] = {doc_id: 1}
  needle_pieces = [len(vocab.encode(w)) for twins in pairs for w in twins]
  stats = {"needle_pieces": _summary(needle_pieces), "filler_pieces": _summary(filler_pieces),
           "passage_pieces_with_eos": _summary(passage_pieces),
           "needle_pieces_histogram": {str(n): needle_pieces.count(n)
                                       for n in sorted(set(needle_pieces))},
           "passages": len(passages), "train_queries": len(qrels["train"]),
           "test_queries": len(qrels["test"])}
  return passages, queries, qrels, stats


def _summary(values: List[int]) -> Dict[str, float]:
  return {"min": min(values), "mean": round(statistics.mean(values), 2), "max": max(values)}


def _tree(folder: pathlib.Path) -> Dict[str, bytes]:
  """{relative path: bytes (b'' for a folder)} of everything under `folder`."""
  return {str(p.relative_to(folder)): b"" if p.is_dir() else p.read_bytes()
          for p in sorted(folder.rglob("*"))}


def write_set(folder: pathlib.Path, passages, queries, qrels, meta) -> bool:
  """Writes the BEIR folder and meta.json at `folder` whole or not at all (built in a
  temporary folder two levels up, <out>/, where no task is looked for, then renamed); False
  when it already holds exactly these files; FileExistsError (nothing written) when it holds
  anything else."""
  folder.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=folder.parent.parent, prefix=f".{folder.name}-") as tmp:
    staged = pathlib.Path(beir.write_beir(pathlib.Path(tmp) / folder.name, passages, queries,
                                          qrels))
    (staged / META_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    if folder.is_dir() and not any(folder.iterdir()):
      folder.rmdir()
    elif folder.exists() or folder.is_symlink():
      existing = _tree(folder) if folder.is_dir() else {"": b"(not a folder)"}
      new = _tree(staged)
      if existing == new:
        return False
      other = sorted(k for k in existing if existing[k] != new.get(k))
      raise FileExistsError(
          f"{folder} already exists and holds other content than this command writes "
          f"(differing or extra: {other[:5]}{' ...' if len(other) > 5 else ''}). Choose "
          "another --out or --name, or delete the folder to write it anew.")
    os.rename(staged, folder)
  return True


def vocabulary_identity(vocab) -> Dict[str, str]:
  with open(vocab.path, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()[:12]
  return {"file": os.path.basename(vocab.path), "sha256": digest,
          "vocab_size": vocab.vocab_size, "corpus_fingerprint": corpus.corpus_fingerprint()}


def twin_of(doc_id: str) -> str:
  """The other passage of `doc_id`'s pair (p00012a <-> p00012b)."""
  return doc_id[:-1] + {"a": "b", "b": "a"}[doc_id[-1]]


def first_ranked(qrels: Dict[str, Dict[str, int]], run: Dict[str, Dict[str, float]]):
  """Shares of the judged queries whose top-ranked passage is the relevant one, its twin,
  another passage, or none (the query is absent from the run)."""
  counts = dict.fromkeys(("relevant", "twin", "other", "none"), 0)
  for query, judged in qrels.items():
    (relevant,) = [d for d, grade in judged.items() if grade > 0]
    scores = run.get(query)
    top = max(scores, key=scores.get) if scores else None
    kind = ("none" if top is None else "relevant" if top == relevant
            else "twin" if top == twin_of(relevant) else "other")
    counts[kind] += 1
  return {k: v / len(qrels) for k, v in counts.items()}


def diagnose(folder: pathlib.Path, runs: List[str], split: str = "test") -> None:
  """Prints, per TREC run over the set's `split`, what its queries ranked first."""
  from decal_jax.retrieval import ir_metrics
  qrels = beir.load_beir(folder, split).qrels
  for path in runs:
    shares = first_ranked(qrels, ir_metrics.read_trec_run(path))
    print(f"{path}: first ranked " + ", ".join(f"{k} {v:.3f}" for k, v in shares.items()))


def main(argv=None) -> pathlib.Path:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="writes <out>/beir/<name>/")
  p.add_argument("--name", default="needle", help="the task is decal_beir_<name>")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--pairs", type=int, default=1000, help="twin pairs (2 passages each)")
  p.add_argument("--test_pairs", type=int, default=100)
  p.add_argument("--train_pairs", type=int, default=None, help="default: all the rest")
  p.add_argument("--passage_tokens", type=int, default=96, help="filler pieces per passage")
  p.add_argument("--min_pieces", type=int, default=3, help="pieces per needle, at least")
  p.add_argument("--syllables", type=int, default=3, help="syllables per needle")
  p.add_argument("--diagnose", nargs="+", metavar="RUN", default=None,
                 help="instead of writing: for each TREC run over <out>/beir/<name>'s test "
                 "queries, the share whose first passage is the relevant one, its twin, "
                 "another")
  a = p.parse_args(argv)
  if a.diagnose:
    folder = pathlib.Path(a.out) / "beir" / a.name
    if not (folder / META_FILE).exists():
      p.error(f"--diagnose: {folder} holds no needle set; write it first (the same "
              "command without --diagnose)")
    diagnose(folder, a.diagnose)
    return folder
  if a.train_pairs is None:
    a.train_pairs = a.pairs - a.test_pairs
  if not re.fullmatch(r"\w+", a.name):
    p.error(f"--name {a.name!r}: use letters, digits and _ only")
  if min(a.pairs, a.passage_tokens, a.syllables - 1) < 1 or min(a.test_pairs, a.train_pairs) < 0:
    p.error("--pairs and --passage_tokens must be >= 1, --syllables >= 2, the others >= 0")
  if a.test_pairs + a.train_pairs > a.pairs:
    p.error(f"--test_pairs {a.test_pairs} + --train_pairs {a.train_pairs} > --pairs {a.pairs}")
  vocab = vocabularies.builtin_plain_vocabulary()
  try:
    passages, queries, qrels, stats = build(a, vocab)
  except ValueError as e:
    sys.exit(str(e))
  settings = {k: v for k, v in vars(a).items() if k != "out"}
  meta = {"format": FORMAT_VERSION, "tool": "tools.needle_set", "settings": settings,
          "vocabulary": vocabulary_identity(vocab), "statistics": stats}
  folder = pathlib.Path(a.out) / "beir" / a.name
  try:
    wrote = write_set(folder, passages, queries, qrels, meta)
  except FileExistsError as e:
    sys.exit(str(e))
  print(f"{'wrote' if wrote else 'unchanged (the same set is there)'}: {folder}: "
        f"{stats['passages']} passages, {stats['train_queries']} train / "
        f"{stats['test_queries']} test queries")
  for key in ("needle_pieces", "filler_pieces", "passage_pieces_with_eos"):
    print(f"  {key}: " + ", ".join(f"{k} {v}" for k, v in stats[key].items()))
  print(f"  needle pieces histogram: {stats['needle_pieces_histogram']}")
  print(f"Task decal_beir_{a.name} with DECAL_LOCAL_DATA_DIR={a.out}; a --passage_length of "
        f"at least {stats['passage_pieces_with_eos']['max']} keeps every needle.")
  return folder


if __name__ == "__main__":
  main()
