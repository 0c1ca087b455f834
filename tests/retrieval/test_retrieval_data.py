"""Retrieval data: BEIR / MS MARCO readers and their line-numbered errors, the built-in BEIR
folder, and the seqio retrieval tasks.

References: hand-written files with the dicts they must give, line numbers counted by hand,
real data counted with plain Python (json / split) in the test, the built-in corpus's own
titles, and texts decoded back through the vocabulary.
"""
import collections
import json
import os
import pathlib
import threading

import gin
import pytest
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax.runtime import gin_utils
from decal_jax.data import corpus as builtin_corpus
from decal_jax.retrieval import beir, msmarco
from decal_jax.tasks import retrieval_tasks

import paths

pytestmark = pytest.mark.usefixtures("builtin_vocabulary")  # tests/conftest.py

DATA_DIR = pathlib.Path(os.environ.get(
    "DECAL_DATA_DIR", paths.REPO.parent / "shared" / "data"))
LENGTHS = {"inputs": 64, "targets": 128, "negative_targets": 128}

CORPUS = "\n".join([
    '{"_id": "d1", "title": "Rivers", "text": "The river runs to the sea."}',
    '{"_id": "d2", "title": "", "text": "Mountains are tall."}',
    '{"_id": "d3", "text": "A lake is still.", "metadata": {}}',
    "",  # a blank line is skipped
    '{"_id": "d4", "title": "Empty", "text": ""}',
]) + "\n"
QUERIES = "\n".join([
    '{"_id": "q1", "text": "where does the river go"}',
    '{"_id": "q2", "text": "how tall are mountains", "metadata": {}}',
    '{"_id": "q3", "text": "is the lake still"}',
]) + "\n"
TEST_QRELS = "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td3\t0\nq2\td2\t2\n"
TRAIN_QRELS = "query-id\tcorpus-id\tscore\nq3\td3\t1\n"


def _write(folder: pathlib.Path, files: dict) -> pathlib.Path:
  for name, text in files.items():
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text, encoding="utf-8")
  return folder


def _beir_files(**replace):
  files = {"corpus.jsonl": CORPUS, "queries.jsonl": QUERIES, "qrels/test.tsv": TEST_QRELS,
           "qrels/train.tsv": TRAIN_QRELS}
  files.update(replace)
  return {k: v for k, v in files.items() if v is not None}


def _examples(name, split, lengths=LENGTHS):
  ds = seqio.get_mixture_or_task(name).get_dataset(lengths, split=split, shuffle=False,
                                                   num_epochs=1)
  return list(ds.as_numpy_iterator())


def _decoded(ex, feature, vocab):
  ids = ex[feature].tolist()
  assert ids[-1] == 1 and 1 not in ids[:-1]  # one EOS, at the end
  return vocab.decode(ids[:-1])


# ------------------------------------------------------------------------------ BEIR readers
def test_readers_give_the_hand_written_folder(tmp_path):
  folder = _write(tmp_path / "set", _beir_files())
  data = beir.load_beir(folder, "test")
  assert data.corpus == {"d1": beir.Passage("Rivers", "The river runs to the sea."),
                         "d2": beir.Passage("", "Mountains are tall."),
                         "d3": beir.Passage("", "A lake is still."),
                         "d4": beir.Passage("Empty", "")}
  assert data.queries == {"q1": "where does the river go", "q2": "how tall are mountains"}
  assert data.qrels == {"q1": {"d1": 1, "d3": 0}, "q2": {"d2": 2}}  # grade 0 kept
  assert data.positive_pairs() == [("q1", "d1"), ("q2", "d2")]
  assert (data.split, data.name, data.empty_passages, data.empty_queries) == ("test", "set", 0, 0)
  assert data.corpus["d1"].full_text == "Rivers. The river runs to the sea."
  assert data.corpus["d2"].full_text == "Mountains are tall."
  assert data.corpus["d4"].full_text == "Empty"
  assert beir.load_beir(folder, "train").queries == {"q3": "is the lake still"}
  assert beir.read_queries(folder / "queries.jsonl") == {
      "q1": "where does the river go", "q2": "how tall are mountains", "q3": "is the lake still"}
  assert beir.read_qrels(folder / "qrels/train.tsv") == {"q3": {"d3": 1}}


def test_dev_qrels_serve_the_validation_split(tmp_path):
  folder = _write(tmp_path / "set", _beir_files(**{"qrels/dev.tsv": TRAIN_QRELS}))
  assert beir.load_beir(folder, "validation").qrels == {"q3": {"d3": 1}}


def test_empty_queries_and_passages_are_kept_and_counted(tmp_path):
  corpus = CORPUS + '{"_id": "d5", "title": "", "text": ""}\n{"_id": "d6", "text": ""}\n'
  queries = QUERIES + '{"_id": "q4", "text": ""}\n{"_id": "q5", "text": ""}\n'
  qrels = TEST_QRELS + "q4\td5\t1\nq4\td6\t1\n"  # q5 is judged in no split
  folder = _write(tmp_path / "set", _beir_files(**{
      "corpus.jsonl": corpus, "queries.jsonl": queries, "qrels/test.tsv": qrels}))
  data = beir.load_beir(folder, "test")
  assert data.corpus["d5"] == beir.Passage("", "") and data.corpus["d5"].full_text == ""
  assert data.queries["q4"] == ""
  assert (data.empty_passages, data.empty_queries) == (2, 1)
  assert ("q4", "d5") in data.positive_pairs() and ("q4", "d6") in data.positive_pairs()


BAD_BEIR = {
    # case: (files to replace, file named in the error, its line, words in the error)
    "bad json": ({"corpus.jsonl": '{"_id": "d1", "text": "a"}\n{"_id": "d2", "text": \n'},
                 "corpus.jsonl", 2, "not valid JSON"),
    "not an object": ({"queries.jsonl": '["q1", "text"]\n'}, "queries.jsonl", 1, "JSON object"),
    "missing _id": ({"queries.jsonl": QUERIES.replace('"_id": "q3", ', "")},
                    "queries.jsonl", 3, "'_id'"),
    "empty _id": ({"corpus.jsonl": CORPUS.replace('"_id": "d2"', '"_id": ""')},
                  "corpus.jsonl", 2, "'_id'"),
    "duplicate doc id": ({"corpus.jsonl": CORPUS.replace('"_id": "d3"', '"_id": "d1"')},
                         "corpus.jsonl", 3, "first on line 1"),
    "duplicate query id": ({"queries.jsonl": QUERIES.replace('"_id": "q2"', '"_id": "q1"')},
                           "queries.jsonl", 2, "first on line 1"),
    "missing text": ({"corpus.jsonl": '{"_id": "d1", "title": "t"}\n'}, "corpus.jsonl", 1,
                     "'text'"),
    "text not a string": ({"queries.jsonl": '{"_id": "q1", "text": 7}\n'}, "queries.jsonl", 1,
                          "must be a string"),
    "qrels to unknown doc": ({"qrels/test.tsv": TEST_QRELS + "q2\td9\t1\n"}, "test.tsv", 5,
                             "'d9' is not in the corpus"),
    "qrels to unknown query": ({"qrels/test.tsv": "query-id\tcorpus-id\tscore\nq7\td1\t1\n"},
                               "test.tsv", 2, "'q7' is not in the queries"),
    "bad score": ({"qrels/test.tsv": "query-id\tcorpus-id\tscore\nq1\td1\thigh\n"}, "test.tsv",
                  2, "not an integer"),
    "wrong column count": ({"qrels/test.tsv": TEST_QRELS + "q2 d1 1\n"}, "test.tsv", 5,
                           "3 tab-separated columns"),
    "pair judged twice": ({"qrels/test.tsv": TEST_QRELS + "q1\td1\t2\n"}, "test.tsv", 5,
                          "first on line 2"),
    "missing file": ({"queries.jsonl": None}, "queries.jsonl", None, "corpus.jsonl"),
}


@pytest.mark.parametrize("case", sorted(BAD_BEIR))
def test_bad_beir_input_names_file_and_line(tmp_path, case):
  replace, name, line, words = BAD_BEIR[case]
  folder = _write(tmp_path / "set", _beir_files(**replace))
  with pytest.raises(beir.BadRetrievalFileError) as error:
    beir.load_beir(folder, "test")
  message = str(error.value)
  assert name in message and words in message, message
  if line is not None:
    assert f"{name}:{line}: " in message, message


def test_missing_split_lists_the_splits_there(tmp_path):
  folder = _write(tmp_path / "set", _beir_files())
  with pytest.raises(beir.BadRetrievalFileError) as error:
    beir.load_beir(folder, "validation")
  message = str(error.value)
  assert "validation.tsv" in message and "['test', 'train']" in message
  assert isinstance(error.value, FileNotFoundError)


def test_write_beir_reads_back_and_refuses_to_overwrite(tmp_path):
  corpus = {"a": beir.Passage("T", "x y"), "b": "only text", "c": {"title": "U", "text": "z"}}
  queries = {"q": "find a", "r": "find c"}
  folder = tmp_path / "written"
  beir.write_beir(folder, corpus, queries,
                  {"test": {"q": {"a": 1, "b": 0}}, "dev": {"r": {"c": 1}}})
  data = beir.load_beir(folder, "test")
  assert data.corpus == {"a": beir.Passage("T", "x y"), "b": beir.Passage("", "only text"),
                         "c": beir.Passage("U", "z")}
  assert data.qrels == {"q": {"a": 1, "b": 0}} and data.queries == {"q": "find a"}
  assert beir.load_beir(folder, "validation").qrels == {"r": {"c": 1}}
  assert sorted(os.listdir(tmp_path)) == ["written"]  # no temp folder left
  with pytest.raises(FileExistsError):
    beir.write_beir(folder, corpus, queries, {})
  with pytest.raises(ValueError, match="not in the corpus"):
    beir.write_beir(tmp_path / "bad", corpus, queries, {"test": {"q": {"zz": 1}}})


# ------------------------------------------------------------------------------ MS MARCO readers
MSMARCO = {
    "collection.tsv": "10\tThe river runs to the sea.\n11\tMountains are tall.\n"
                      "12\tA lake is still.\n13\t\n",
    "queries.train.tsv": "1\twhere does the river go\n2\thow tall are mountains\n",
    "queries.dev.tsv": "3\tis the lake still\n4\twhat is tall\n",
    "qrels.train.tsv": "1 0 10 1\n2 0 11 1\n2 0 12 0\n",
    "qrels.dev.tsv": "3 0 12 1\n4 0 11 1\n",
    "triples.train.small.tsv": "where does the river go\tThe river runs to the sea.\tA lake is "
                               "still.\nhow tall are mountains\tMountains are tall.\tThe "
                               "river runs to the sea.\n",
}


def test_msmarco_readers(tmp_path):
  folder = _write(tmp_path / "msmarco", MSMARCO)
  assert msmarco.read_tsv_texts(folder / "collection.tsv") == {
      "10": "The river runs to the sea.", "11": "Mountains are tall.", "12": "A lake is still.",
      "13": ""}
  assert msmarco.read_trec_qrels(folder / "qrels.train.tsv") == {"1": {"10": 1},
                                                              "2": {"11": 1, "12": 0}}
  assert list(msmarco.pairs(folder, "train")) == [
      ("where does the river go", "The river runs to the sea."),
      ("how tall are mountains", "Mountains are tall.")]
  assert list(msmarco.pairs(folder, "validation")) == [
      ("is the lake still", "A lake is still."), ("what is tall", "Mountains are tall.")]
  assert list(msmarco.triples(folder)) == [
      ("where does the river go", "The river runs to the sea.", "A lake is still."),
      ("how tall are mountains", "Mountains are tall.", "The river runs to the sea.")]


def test_msmarco_id_triples_resolve_through_collection_and_queries(tmp_path):
  files = {k: v for k, v in MSMARCO.items() if k != "triples.train.small.tsv"}
  files["qidpidtriples.train.full.tsv"] = "1\t10\t12\n2\t11\t13\n"
  folder = _write(tmp_path / "msmarco", files)
  assert list(msmarco.triples(folder)) == [
      ("where does the river go", "The river runs to the sea.", "A lake is still."),
      ("how tall are mountains", "Mountains are tall.", "")]


BAD_MSMARCO = {
    "collection columns": ({"collection.tsv": "10\ta\n11\tb\tc\n"}, "collection.tsv", 2,
                           "2 tab-separated columns"),
    "duplicate pid": ({"collection.tsv": "10\ta\n11\tb\n10\tc\n"}, "collection.tsv", 3,
                      "first on line 1"),
    "duplicate qid": ({"queries.train.tsv": "1\ta\n1\tb\n"}, "queries.train.tsv", 2,
                      "first on line 1"),
    "trec columns": ({"qrels.train.tsv": "1 0 10 1\n2 11 1\n"}, "qrels.train.tsv", 2,
                     "4 whitespace-separated columns"),
    "trec unknown pid": ({"qrels.train.tsv": "1 0 10 1\n2 0 99 1\n"}, "qrels.train.tsv", 2,
                         "'99' is not in the corpus"),
    "trec unknown qid": ({"qrels.train.tsv": "7 0 10 1\n"}, "qrels.train.tsv", 1,
                         "'7' is not in the queries"),
    "trec bad rel": ({"qrels.train.tsv": "1 0 10 yes\n"}, "qrels.train.tsv", 1,
                     "not an integer"),
}


@pytest.mark.parametrize("case", sorted(BAD_MSMARCO))
def test_bad_msmarco_input_names_file_and_line(tmp_path, case):
  replace, name, line, words = BAD_MSMARCO[case]
  folder = _write(tmp_path / "msmarco", dict(MSMARCO, **replace))
  with pytest.raises(beir.BadRetrievalFileError) as error:
    list(msmarco.pairs(folder, "train"))
  assert f"{name}:{line}: " in str(error.value) and words in str(error.value), str(error.value)


def test_msmarco_bad_triples_name_file_and_line(tmp_path):
  files = {k: v for k, v in MSMARCO.items() if k != "triples.train.small.tsv"}
  folder = _write(tmp_path / "ids", dict(files, **{
      "qidpidtriples.train.full.tsv": "1\t10\t12\n2\t11\t77\n"}))
  with pytest.raises(beir.BadRetrievalFileError, match=r"qidpidtriples.train.full.tsv:2: "
                     r"passage id '77' is not in collection.tsv"):
    list(msmarco.triples(folder))
  folder = _write(tmp_path / "texts", dict(files, **{
      "triples.train.small.tsv": "q\tp\tn\nq\tp\n"}))
  with pytest.raises(beir.BadRetrievalFileError, match=r"triples.train.small.tsv:2: .*3 tab"):
    list(msmarco.triples(folder))


def test_msmarco_missing_files_list_what_is_there_and_expected(tmp_path):
  folder = _write(tmp_path / "msmarco", {"collection.tsv": MSMARCO["collection.tsv"]})
  with pytest.raises(beir.BadRetrievalFileError) as error:
    msmarco.pairs(folder, "train")
  message = str(error.value)
  assert "queries.train.tsv or queries.tsv" in message and "['collection.tsv']" in message
  with pytest.raises(FileNotFoundError, match="triples.train.small.tsv or qidpidtriples"):
    msmarco.triples(folder)


# ------------------------------------------------------------------------------ real data
def _need(path: pathlib.Path) -> pathlib.Path:
  if not path.exists():
    pytest.skip(f"{path} is absent (real data lives in ../shared/data; set DECAL_DATA_DIR)")
  return path


def test_scifact_loads_with_the_counts_of_its_files():
  folder = _need(DATA_DIR / "beir" / "scifact")
  with open(folder / "corpus.jsonl", encoding="utf-8") as f:
    doc_ids = [json.loads(line)["_id"] for line in f if line.strip()]
  with open(folder / "qrels" / "test.tsv", encoding="utf-8") as f:
    rows = [line.rstrip("\n").split("\t") for line in f][1:]
  data = beir.load_beir(folder, "test")
  assert len(data.corpus) == len(set(doc_ids)) == len(doc_ids) == 5183
  assert len(data.queries) == len({r[0] for r in rows}) == 300
  assert len(data.positive_pairs()) == sum(int(r[2]) > 0 for r in rows)
  assert sorted(data.positive_pairs()) == sorted((r[0], r[1]) for r in rows if int(r[2]) > 0)


def test_msmarco_trecdl2019_reads():
  folder = _need(DATA_DIR / "msmarco_trecdl2019")
  with open(folder / "collection.tsv", encoding="utf-8") as f:
    passages = dict(line.rstrip("\n").split("\t", 1) for line in f)
  with open(folder / "queries.tsv", encoding="utf-8") as f:
    queries = dict(line.rstrip("\n").split("\t", 1) for line in f)
  with open(folder / "qrels.txt", encoding="utf-8") as f:
    rows = [line.split() for line in f if line.strip()]
  assert len(msmarco.read_tsv_texts(folder / "collection.tsv")) == len(passages) == 4103
  qrels = msmarco.read_trec_qrels(folder / "qrels.txt")
  assert len(qrels) == len({r[0] for r in rows}) == 43
  want = [(queries[r[0]], passages[r[2]]) for r in rows if int(r[3]) > 0]
  assert list(msmarco.pairs(folder, "validation")) == want


# ------------------------------------------------------------------------------ tasks
def test_beir_task_yields_each_positive_pair_as_text(tmp_path, builtin_vocabulary):
  corpus = {"a": beir.Passage("Rivers", "The river runs to the sea."),
            "b": beir.Passage("", "Mountains are tall."),
            "c": beir.Passage("Lakes", "A lake is still."), "e": beir.Passage("", "")}
  queries = {"q1": "where does the river go", "q2": "how tall are mountains", "q3": ""}
  test_qrels = {"q1": {"a": 1, "c": 2, "b": 0}, "q2": {"b": 1}, "q3": {"e": 1}}
  folder = beir.write_beir(tmp_path / "set", corpus, queries,
                           {"test": test_qrels, "train": {"q2": {"b": 1}}})
  task = retrieval_tasks.register_beir_task("fixture_data", folder)
  assert task.name == "decal_beir_fixture_data" and set(task.splits) == {"train", "test"}
  assert set(task.output_features) == {"inputs", "targets"} and not task.metric_fns
  assert retrieval_tasks.beir_folder("decal_beir_fixture_data") == folder
  got = [(_decoded(ex, "inputs", builtin_vocabulary), _decoded(ex, "targets", builtin_vocabulary))
         for ex in _examples(task.name, "test")]
  want = [("where does the river go", "Rivers. The river runs to the sea."),
          ("where does the river go", "Lakes. A lake is still."),
          ("how tall are mountains", "Mountains are tall."), ("", "")]
  assert collections.Counter(got) == collections.Counter(want)
  assert len(got) == sum(s > 0 for docs in test_qrels.values() for s in docs.values())
  # Registering the name again replaces the task (and its folder).
  other = beir.write_beir(tmp_path / "other", corpus, queries, {"test": {"q2": {"b": 1}}})
  retrieval_tasks.register_beir_task("fixture_data", other)
  assert retrieval_tasks.beir_folder("decal_beir_fixture_data") == other
  assert len(_examples("decal_beir_fixture_data", "test")) == 1
  with pytest.raises(ValueError, match="decal_beir_fixture_data"):
    retrieval_tasks.beir_folder("decal_beir_unknown")


def test_msmarco_tasks_read_the_local_folder(tmp_path, monkeypatch, builtin_vocabulary):
  _write(tmp_path / "msmarco", MSMARCO)
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  examples = _examples("decal_msmarco_retrieval_negatives", "train")
  got = [tuple(_decoded(ex, f, builtin_vocabulary)
               for f in ("inputs", "targets", "negative_targets")) for ex in examples]
  assert got == [("where does the river go", "The river runs to the sea.", "A lake is still."),
                 ("how tall are mountains", "Mountains are tall.",
                  "The river runs to the sea.")]
  pairs = [(_decoded(ex, "inputs", builtin_vocabulary), _decoded(ex, "targets", builtin_vocabulary))
           for ex in _examples("decal_msmarco_retrieval", "validation")]
  assert pairs == [("is the lake still", "A lake is still."),
                   ("what is tall", "Mountains are tall.")]
  # Validation of the negatives task: each dev pair, negative = another query's positive.
  dev = [tuple(_decoded(ex, f, builtin_vocabulary) for f in ("inputs", "targets",
                                                             "negative_targets"))
         for ex in _examples("decal_msmarco_retrieval_negatives", "validation")]
  assert dev == [("is the lake still", "A lake is still.", "Mountains are tall."),
                 ("what is tall", "Mountains are tall.", "A lake is still.")]


def test_negatives_come_from_other_queries():
  pairs = [("a", "p1"), ("a", "p2"), ("b", "p3"), ("c", "p4")]
  triples = retrieval_tasks.other_query_negatives(pairs)
  positives_of = collections.defaultdict(set)
  for query, positive in pairs:
    positives_of[query].add(positive)
  assert [t[:2] for t in triples] == pairs
  assert all(negative not in positives_of[query] for query, _, negative in triples)


def test_msmarco_without_data_says_where_to_put_files(tmp_path, monkeypatch):
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  with pytest.raises(FileNotFoundError) as error:
    _examples("decal_msmarco_retrieval_negatives", "train")
  message = str(error.value)
  assert f"{tmp_path}/msmarco/" in message and "triples.train.small.tsv" in message
  assert "TFDS has no MS MARCO triples" in message


def test_msmarco_pairs_fall_back_to_tfds(builtin_vocabulary):
  records = [{"query": "what is tall", "passage": "Mountains are tall.", "score": 1.0},
             {"query": "what is tall", "passage": "A lake is still.", "score": 0.0}]

  def as_dataset(self, split, **kwargs):
    spec = self.info.features.get_tensor_spec()
    full = [dict({k: "" for k in spec if k != "score"}, **r) for r in records]
    return tf.data.Dataset.from_generator(lambda: iter(full), output_signature=spec)
  with tfds.testing.mock_data(as_dataset_fn=as_dataset):
    examples = _examples("decal_msmarco_retrieval", "train")
  assert [(_decoded(ex, "inputs", builtin_vocabulary), _decoded(ex, "targets", builtin_vocabulary))
          for ex in examples] == [("what is tall", "Mountains are tall.")]


def test_local_beir_folders_and_gin_bindings_register_tasks(tmp_path, monkeypatch):
  _write(tmp_path / "beir" / "my-set", _beir_files())
  (tmp_path / "beir" / "not_beir").mkdir()
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  assert retrieval_tasks.register_local_beir_tasks() == ["decal_beir_my_set"]
  assert retrieval_tasks.beir_folder("decal_beir_my_set") == str(tmp_path / "beir" / "my-set")
  assert "decal_beir_not_beir" not in seqio.TaskRegistry.names()

  folder = _write(tmp_path / "anywhere" / "set", _beir_files())
  gin_file = tmp_path / "register.gin"
  gin_file.write_text("from __gin__ import dynamic_registration\n"
                      "from decal_jax.tasks import retrieval_tasks\n"
                      f"retrieval_tasks.beir_tasks.folders = {{'gin_set': '{folder}'}}\n")
  gin_utils.parse([str(gin_file)], [], [])
  gin.clear_config()
  assert retrieval_tasks.beir_folder("decal_beir_gin_set") == str(folder)
  assert seqio.get_mixture_or_task("decal_beir_gin_set").splits == ("train", "test")


# ------------------------------------------------------------------------------ built-in folder
def test_builtin_folder_is_built_on_first_read_only(tmp_path, monkeypatch):
  monkeypatch.setenv("DECAL_CACHE_DIR", str(tmp_path / "cache"))
  retrieval_tasks.register_all()  # what importing does: no folder yet
  assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("beir_*"))
  results = []
  threads = [threading.Thread(target=lambda: results.append(
      retrieval_tasks.beir_folder("decal_beir_builtin"))) for _ in range(2)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert len(results) == 2 and results[0] == results[1]
  folder = pathlib.Path(results[0])
  assert folder.parent == tmp_path / "cache" and folder.name.startswith("beir_builtin_")
  assert [p.name for p in folder.parent.iterdir() if p.is_dir()] == [folder.name]  # no temp


def test_builtin_folder_judges_paragraphs_by_their_section_title(tmp_path, monkeypatch):
  monkeypatch.setenv("DECAL_CACHE_DIR", str(tmp_path / "cache"))
  folder = beir.builtin_beir_folder()
  titled = builtin_corpus.titled_documents()
  title_of = {r["text"]: r["title"] for records in titled.values() for r in records}
  section = collections.defaultdict(set)  # title -> every paragraph of that section
  for text, title in title_of.items():
    section[title].add(text)
  judged, titles_of_split = collections.Counter(), {}
  for split in ("train", "validation", "test"):
    data = beir.load_beir(folder, split)
    assert data.qrels, split
    for query_id, docs in data.qrels.items():
      assert query_id.startswith(f"{split}-q")
      texts = {data.corpus[doc_id].text for doc_id in docs}  # every judged doc is in the corpus
      assert set(docs.values()) == {1}
      # the whole section is judged: no paragraph of it sits unjudged in the corpus
      assert texts == section[data.queries[query_id]]
      judged.update(texts)
    titles_of_split[split] = set(data.queries.values())
    assert len(titles_of_split[split]) == len(data.queries)  # one query per title
  assert sorted(p.text for p in data.corpus.values()) == sorted(title_of)
  assert all(p.title == "" for p in data.corpus.values())  # the title is the query
  # A section lies in one split, so each paragraph is judged exactly once.
  assert set(judged) == set(title_of) and set(judged.values()) == {1}
  assert sum(len(t) for t in titles_of_split.values()) == len(section)
  assert len(titles_of_split["test"]) >= 15 and len(titles_of_split["validation"]) >= 4
