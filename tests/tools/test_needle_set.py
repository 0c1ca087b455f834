"""tools/needle_set.py: the set read back with load_beir, each query's needle found (by plain
substring search) in its relevant passage alone, the twin found as the passage whose words
differ in that one word, needles' pieces counted with seqio's built-in vocabulary, the
printed statistics recomputed, split counts and disjointness, byte-identical reruns,
refusal of other content, no trace of an interrupted write, and the task found through
DECAL_LOCAL_DATA_DIR."""
import argparse
import os
import pathlib
import re
import statistics

import pytest

from decal_jax.retrieval import beir
from tools import needle_set as ns

PAIRS, TEST_PAIRS, TRAIN_PAIRS = 40, 6, 30  # 4 pairs without queries: distractors only
MIN_PIECES = 5  # above the default 3, which 3-syllable words nearly always reach unaided
ARGS = ["--pairs", str(PAIRS), "--test_pairs", str(TEST_PAIRS), "--train_pairs",
        str(TRAIN_PAIRS), "--min_pieces", str(MIN_PIECES)]


def _generate(out, *extra):
  return ns.main(["--out", str(out), *ARGS, *extra])


def _tree(folder):
  return {str(p.relative_to(folder)): b"" if p.is_dir() else p.read_bytes()
          for p in sorted(pathlib.Path(folder).rglob("*"))}


def _slot(template):
  """A regex of `template` whose group is the word put in its '{}'."""
  return re.escape(template).replace(re.escape("{}"), r"\b([a-z]+)\b")


def _needle(query):
  """The needle of a query text, read through the query templates."""
  for template in ns.QUERIES:
    match = re.fullmatch(_slot(template), query)
    if match:
      return match.group(1)
  raise AssertionError(f"query {query!r} fits no template")


def _twin(doc_id, corpus):
  """(twin id, its differing word): the one other passage whose text differs in one word."""
  words = re.split(r"(\W)", corpus[doc_id].text)
  found = []
  for other, passage in corpus.items():
    theirs = re.split(r"(\W)", passage.text)
    diff = [i for i, (x, y) in enumerate(zip(words, theirs)) if x != y]
    if other != doc_id and len(theirs) == len(words) and len(diff) == 1:
      found.append((other, theirs[diff[0]]))
  assert len(found) == 1, (doc_id, found)
  return found[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  return _generate(tmp_path_factory.mktemp("needles"))


def test_each_needle_is_in_its_passage_alone_and_its_twin_differs_only_there(folder):
  positives = {}
  for split in ("train", "test"):
    data = beir.load_beir(folder, split)
    assert len(data.corpus) == 2 * PAIRS
    assert len(data.queries) == 2 * (TEST_PAIRS if split == "test" else TRAIN_PAIRS)
    for query, docs in data.qrels.items():
      needle = _needle(data.queries[query])
      (relevant, grade), = docs.items()
      assert grade == 1
      assert [d for d, p in data.corpus.items() if needle in p.text] == [relevant]
      twin, other_needle = _twin(relevant, data.corpus)
      assert other_needle != needle and re.fullmatch("[a-z]+", other_needle)
      assert re.match(f"[{ns.CONSONANTS}][{ns.VOWELS}]", needle)
      assert other_needle[:2] == needle[:2]  # the shared first syllable, at least C + V
      positives[relevant] = (split, twin)
  # Every twin is queried too, in the same split: the pairs of the splits are disjoint.
  assert all(positives[twin][0] == split for split, twin in positives.values())
  assert len(positives) == 2 * (TEST_PAIRS + TRAIN_PAIRS)


def test_needles_have_enough_pieces_and_the_statistics_are_right(folder, builtin_vocabulary):
  meta = ns.json.loads((folder / ns.META_FILE).read_text())
  corpus = beir.load_beir(folder, "test").corpus
  needles, fillers = [], []
  for doc_id, passage in corpus.items():
    carriers = [m for c in ns.CARRIERS for m in re.finditer(_slot(c), passage.text)]
    assert len(carriers) == 1, (doc_id, carriers)
    needles.append(carriers[0].group(1))
    filler = passage.text.replace(carriers[0].group(0), "").replace("  ", " ").strip()
    fillers.append(len(builtin_vocabulary.encode(filler)))
  pieces = [len(builtin_vocabulary.encode(w)) for w in needles]
  docs = ns.corpus.documents()
  builtin_text = "\n".join(docs["train"] + docs["validation"]).lower()
  assert not [w for w in needles if w in builtin_text]
  assert len(set(needles)) == 2 * PAIRS and min(pieces) >= MIN_PIECES
  assert all(0.8 * 96 <= n <= 1.2 * 96 for n in fillers)
  stats = meta["statistics"]
  assert stats["needle_pieces"] == {"min": min(pieces), "max": max(pieces),
                                    "mean": round(statistics.mean(pieces), 2)}
  assert stats["filler_pieces"]["max"] == max(fillers)
  assert stats["filler_pieces"]["mean"] == pytest.approx(statistics.mean(fillers), abs=0.01)
  assert sum(stats["needle_pieces_histogram"].values()) == 2 * PAIRS
  assert meta["settings"]["seed"] == 0 and meta["settings"]["min_pieces"] == MIN_PIECES


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_needles(folder, tmp_path):
  again = _generate(tmp_path / "again")
  assert _tree(again) == _tree(folder)
  other = _generate(tmp_path / "other", "--seed", "1")
  needles = [{_needle(q) for q in beir.read_queries(f / "queries.jsonl").values()}
             for f in (folder, other)]
  assert needles[0] and needles[1] and not needles[0] & needles[1]


def test_a_rerun_keeps_the_folder_and_other_content_is_refused(tmp_path, capsys):
  folder = _generate(tmp_path)
  inode = os.stat(folder / "corpus.jsonl").st_ino
  assert _generate(tmp_path) == folder
  assert "unchanged" in capsys.readouterr().out
  assert os.stat(folder / "corpus.jsonl").st_ino == inode  # not even rewritten
  before = _tree(folder)
  with pytest.raises(SystemExit, match="other content.*another --out"):
    _generate(tmp_path, "--seed", "1")
  (folder / "notes.txt").write_text("mine")
  with pytest.raises(SystemExit, match="notes.txt"):
    _generate(tmp_path)
  assert _tree(folder) == dict(before, **{"notes.txt": b"mine"})
  assert sorted(os.listdir(tmp_path)) == ["beir"] and os.listdir(tmp_path / "beir") == ["needle"]


def test_an_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
  rename = os.rename

  def interrupted(src, dst):
    if pathlib.Path(dst) == tmp_path / "beir" / "needle":
      raise KeyboardInterrupt
    rename(src, dst)
  monkeypatch.setattr(ns.os, "rename", interrupted)
  with pytest.raises(KeyboardInterrupt):
    _generate(tmp_path)
  assert sorted(os.listdir(tmp_path)) == ["beir"] and not os.listdir(tmp_path / "beir")


def test_the_task_resolves_through_the_local_data_dir(folder, monkeypatch):
  from decal_jax.tasks import retrieval_tasks
  from tools import retrieval_table
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(folder.parent.parent))
  assert "decal_beir_needle" in retrieval_tasks.register_local_beir_tasks()
  assert retrieval_tasks.beir_folder("decal_beir_needle") == str(folder)
  a = argparse.Namespace(task="decal_beir_needle", eval_split="test", validation_split=None)
  retrieval_table.resolve_splits(a)
  assert (a.folder, a.validation_split) == (str(folder), "test")


def test_what_ranked_first_is_counted_against_a_hand_made_run(folder, capsys):
  """Three test queries: one ranks its own passage first, one its twin, one a passage of
  another pair; the others are absent from the run (none)."""
  from decal_jax.retrieval import ir_metrics
  qrels = beir.load_beir(folder, "test").qrels
  (q1, d1), (q2, d2), (q3, d3) = [(q, next(iter(j))) for q, j in sorted(qrels.items())[:3]]
  other = next(d for d in beir.load_beir(folder, "test").corpus
               if d[:-1] not in (d1[:-1], d2[:-1], d3[:-1]))
  run = {q1: {d1: 3.0, ns.twin_of(d1): 2.0}, q2: {d2: 1.0, ns.twin_of(d2): 2.5},
         q3: {d3: 0.5, other: 0.9}}
  n = len(qrels)
  assert ns.first_ranked(qrels, run) == {"relevant": 1 / n, "twin": 1 / n, "other": 1 / n,
                                         "none": (n - 3) / n}
  path = folder.parent.parent / "run.trec"
  ir_metrics.write_trec_run(str(path), run, depth=10)
  ns.main(["--out", str(folder.parent.parent), "--diagnose", str(path)])
  assert f"first ranked relevant {1 / n:.3f}, twin {1 / n:.3f}" in capsys.readouterr().out
