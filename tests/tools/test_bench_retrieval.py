"""tools/bench_retrieval.py on a BEIR folder written here (40 passages of varied length, 5
queries) with a one-layer tiny dual encoder at C = 1, 2, 4: the index sizes and MaxSim work
it reports equal what the tokenized lengths give when re-derived with SentencePiece itself,
ratios are to the C = 1 row, and the results file holds the command and every row."""
import copy
import importlib
import json
import math
import pathlib

import matplotlib.image
import numpy as np
import pytest
import sentencepiece as spm

from decal_jax.data import vocabularies
from decal_jax.retrieval import beir
from tools import retrieval_cost_report as cost_report

import paths

REPO = paths.REPO
bench = importlib.import_module("tools.bench_retrieval")

RATIOS = (1, 2, 4)
PASSAGE_LENGTH, QUERY_LENGTH, DIM = 64, 16, 16
DOC_CHUNK = 16  # Index.search's doc chunk: 40 passages -> 3 chunks, the last one padded
WORDS = ("river stone light garden winter engine paper signal forest market copper cloud "
         "harbor violin planet orchard lantern meadow compass thunder").split()


def _fixture(folder: pathlib.Path):
  """40 passages of 0-90 words (one empty, some with titles, some longer than the passage
  length), 5 queries judged in qrels/test.tsv."""
  rng = np.random.default_rng(7)
  corpus = {}
  for i in range(40):
    words = rng.choice(WORDS, size=int(rng.integers(0, 91)) if i else 0)
    title = f"{WORDS[i % len(WORDS)].title()} {i}" if i % 3 == 1 else ""
    corpus[f"doc{i:02d}"] = beir.Passage(title, " ".join(words))
  queries = {f"q{j}": " ".join(rng.choice(WORDS, size=1 + 3 * j)) for j in range(5)}
  qrels = {"test": {q: {f"doc{3 * j + 1:02d}": 1} for j, q in enumerate(queries)}}
  beir.write_beir(folder, corpus, queries, qrels)
  return corpus, queries


def _token_count(processor, text: str, max_length: int) -> int:
  """Pieces of the text, cut to max_length - 1, plus EOS."""
  return min(len(processor.EncodeAsIds(text)), max_length - 1) + 1


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("bench_retrieval")
  corpus, queries = _fixture(tmp / "beir")
  out = tmp / "results" / "retrieval.md"
  argv = ["--beir_folder", str(tmp / "beir"), "--size", "tiny",
          "--gin_bindings", "t5.T5Config.num_encoder_layers = 1",
          "--projection_dim", str(DIM), "--passage_length", str(PASSAGE_LENGTH),
          "--query_length", str(QUERY_LENGTH), "--ratios", *map(str, RATIOS),
          "--batch_size", "16", "--doc_batch_size", str(DOC_CHUNK), "--repeats", "2",
          "--encode_repeats", "2", "--out", str(out), "--plot", str(out.with_suffix(".png"))]
  snapshots, real_write = [], bench.results_files.write_partial

  def write_and_snapshot(args, rows, *more, **kwargs):  # what a run stopped here leaves
    real_write(args, rows, *more, **kwargs)
    snapshots.append((copy.deepcopy(list(rows)), out.read_text(),
                      matplotlib.image.imread(out.with_suffix(".png"))))
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(bench.results_files, "write_partial", write_and_snapshot)
    rows = bench.main(argv)
  processor = spm.SentencePieceProcessor(
      model_file=vocabularies.builtin_vocabulary().sentencepiece_model_file)
  full_texts = [". ".join(part for part in (p.title, p.text) if part) for p in corpus.values()]
  doc_lengths = np.array([_token_count(processor, t, PASSAGE_LENGTH) for t in full_texts])
  query_lengths = np.array([_token_count(processor, t, QUERY_LENGTH)
                            for t in queries.values()])
  return rows, out.read_text(), doc_lengths, query_lengths, snapshots


def test_index_bytes_and_vectors_follow_ceil_n_over_c(result):
  rows, _, lengths, *_ = result
  assert [row.ratio for row in rows] == list(RATIOS)
  assert lengths.max() == PASSAGE_LENGTH and lengths.min() == 1  # cut and empty passages
  for row in rows:
    vectors = sum(math.ceil(n / row.ratio) for n in lengths)
    assert row.num_docs == len(lengths) and row.dim == DIM
    assert row.num_vectors == vectors
    assert row.index_bytes == vectors * DIM * 2  # float16
    assert row.vectors_per_passage == pytest.approx(vectors / len(lengths))


def test_maxsim_work_counts_valid_and_padded_pairs(result):
  rows, _, doc_lengths, query_lengths, _ = result
  order = sorted(range(len(doc_lengths)), key=lambda i: doc_lengths[i])  # index order
  for row in rows:
    counts = [math.ceil(doc_lengths[i] / row.ratio) for i in order]
    assert row.valid_pairs == query_lengths.sum() * sum(counts)
    # 5 queries in one batch, padded to width 16; chunks of 16 docs (the last padded with
    # empty docs), each padded to the next power of two of its longest doc's vectors.
    padded = sum(DOC_CHUNK * 2 ** math.ceil(math.log2(max(counts[s:s + DOC_CHUNK])))
                 for s in range(0, len(counts), DOC_CHUNK))
    assert row.computed_pairs == len(query_lengths) * QUERY_LENGTH * padded


def test_ratios_are_to_the_c1_row(result):
  rows, _, lengths, *_ = result
  rel = cost_report.ratios_to_first(rows)
  assert all(value == 1.0 for value in rel[0].values())
  for row, r in zip(rows, rel):
    assert r["index_bytes"] == pytest.approx(
        sum(math.ceil(n / row.ratio) for n in lengths) / lengths.sum())
    assert r["scoring"] == pytest.approx(
        np.median(row.scoring_s) / np.median(rows[0].scoring_s))
    assert r["encode"] == pytest.approx(np.median(row.encode_s) / np.median(rows[0].encode_s))
    assert len(row.scoring_s) == 2 and len(row.encode_s) == 2
  # DeCAL's encoder reads m latents + n tokens: more FLOPs than C = 1, fewer as C grows.
  flop_ratios = [r["encoder_flops"] for r in rel]
  assert flop_ratios[1] > flop_ratios[2] > 1.0


def _table(text: str, heading: str):
  """{C: [cells]} of the table under `heading`."""
  section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
  rows = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("|") and cells[0].isdigit():
      rows[int(cells[0])] = cells
  return rows


def test_results_file_has_the_command_every_row_and_json_lines(result):
  rows, text, lengths, *_ = result
  assert "- command: `python -m tools.bench_retrieval --beir_folder" in text
  assert "--ratios 1 2 4" in text and "random initialisation" in text
  assert "- machine:" in text and "- date:" in text
  for heading in ("Index size", "Corpus encoding", "Query scoring"):
    table = _table(text, heading)
    assert sorted(table) == list(RATIOS)
    ratio_cell = {"Index size": 3, "Corpus encoding": 2, "Query scoring": 2}[heading]
    assert float(table[1][ratio_cell]) == 1.0
  size = _table(text, "Index size")
  for row in rows:
    expected = sum(math.ceil(n / row.ratio) for n in lengths) / lengths.sum()
    assert float(size[row.ratio][3]) == pytest.approx(expected, abs=5e-4)
    assert float(size[row.ratio][4]) == pytest.approx(expected, abs=5e-4)
    assert float(size[row.ratio][5]) == pytest.approx(1 / row.ratio, abs=5e-4)
  records = [json.loads(line) for line in text.split("```jsonl\n", 1)[1].split("```")[0]
             .splitlines()]
  assert [r["ratio"] for r in records] == list(RATIOS)
  for record, row in zip(records, rows):
    assert record["index_bytes"] == row.index_bytes
    assert record["num_vectors"] == row.num_vectors


def _records(text: str):
  return [json.loads(line) for line in text.split("```jsonl\n", 1)[1].split("```")[0]
          .splitlines()]


def test_results_are_rewritten_partial_after_each_build_and_repeat(result):
  """A step per build (3), encoding repeat after the build's (1) and scoring repeat (2):
  after each but the last, --out holds the rows so far under the partial line; a run
  stopped there keeps the builds' index sizes and the first timings the final rows hold."""
  rows, final, lengths, _, snapshots = result
  assert "Partial" not in final
  assert len(snapshots) == 6 and snapshots[-1][1] == snapshots[-2][1]  # the last: no write
  stages = ["1 of 6 steps** (index builds 1 of 3, encoding passes 1 of 2, scoring repeats 0",
            "2 of 6 steps** (index builds 2 of 3, encoding passes 1 of 2, scoring repeats 0",
            "3 of 6 steps** (index builds 3 of 3, encoding passes 1 of 2, scoring repeats 0",
            "4 of 6 steps** (index builds 3 of 3, encoding passes 2 of 2, scoring repeats 0",
            "5 of 6 steps** (index builds 3 of 3, encoding passes 2 of 2, scoring repeats 1"]
  for step, ((partial_rows, text, image), stage) in enumerate(zip(snapshots, stages), 1):
    assert image.ndim == 3 and image.std() > 0  # the partial plot decodes as a PNG
    assert text.splitlines()[2] == f"**Partial: stopped after {stage} of 2)"
    built = RATIOS[:step]
    assert [row.ratio for row in partial_rows] == list(built)
    size, scoring = _table(text, "Index size"), _table(text, "Query scoring")
    assert sorted(size) == sorted(_table(text, "Corpus encoding")) == list(built)
    assert sorted(scoring) == (list(RATIOS) if step == 5 else [])
    for ratio, _row in zip(built, rows):
      expected = sum(math.ceil(n / ratio) for n in lengths) / lengths.sum()
      assert float(size[ratio][3]) == pytest.approx(expected, abs=5e-4)
    records = _records(text)
    assert [r["index_bytes"] for r in records] == [row.index_bytes for row in rows[:step]]
    passes = 1 if step < 4 else 2
    assert [r["encode_s"] for r in records] == [row.encode_s[:passes] for row in rows[:step]]
    assert [r["scoring_s"] for r in records] == [row.scoring_s[:max(step - 4, 0)]
                                                 for row in rows[:step]]
    if step < 5:
      assert all(r["scoring_median_s"] is None and r["ratios_to_c1"]["scoring"] is None
                 for r in records)
  scored = _table(snapshots[4][1], "Query scoring")
  for row in rows:  # one repeat: the median is the final row's first scoring time
    assert scored[row.ratio][1].startswith(f"{row.scoring_s[0]:.3f} ")


def test_queries_read_at_each_rows_ratio_make_the_work_fall_as_c_squared(tmp_path, result):
  """--queries_compressed: every row's queries have ceil(n / C) vectors, so the valid MaxSim
  pairs are sum_q ceil(n_q / C) x sum_d ceil(n_d / C), re-derived from the token counts."""
  _, _, doc_lengths, query_lengths, _ = result
  _fixture(tmp_path / "beir")  # the same seeded passages and queries as the module's run
  rows = bench.main(["--beir_folder", str(tmp_path / "beir"), "--size", "tiny",
                     "--gin_bindings", "t5.T5Config.num_encoder_layers = 1",
                     "--projection_dim", str(DIM), "--passage_length", str(PASSAGE_LENGTH),
                     "--query_length", str(QUERY_LENGTH), "--ratios", "1", "4",
                     "--batch_size", "16", "--doc_batch_size", str(DOC_CHUNK), "--repeats", "1",
                     "--queries_compressed", "--out", str(tmp_path / "r.md")])
  for row in rows:
    queries = sum(math.ceil(n / row.ratio) for n in query_lengths)
    docs = sum(math.ceil(n / row.ratio) for n in doc_lengths)
    assert row.valid_pairs == queries * docs
  assert rows[1].valid_pairs / rows[0].valid_pairs < 1 / 4  # under 1/C: the C² saving
  assert "queries at each row's C (--queries_compressed)" in (tmp_path / "r.md").read_text()
