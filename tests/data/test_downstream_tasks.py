"""Downstream tasks: TFDS layouts (offline, tfds.testing.mock_data with records we write),
local JSONL files and their errors, truncation counts, and the metrics each task carries."""
import json
import os
import pathlib

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax import text_metrics
from decal_jax.data import local_files, text_to_text, vocabularies
from decal_jax.tasks import downstream_tasks

import paths

pytestmark = pytest.mark.usefixtures("builtin_vocabulary")  # tests/conftest.py

LENGTHS = {"inputs": 96, "targets": 24}
DATA_DIR = pathlib.Path(os.environ.get(
    "DECAL_DATA_DIR", paths.REPO.parent / "shared" / "data"))
TASKS = {"decal_cnn_dailymail": "summarization", "decal_arxiv": "summarization",
         "decal_pubmed": "summarization", "decal_mediasum": "summarization",
         "decal_squad": "qa", "decal_triviaqa": "qa", "decal_hotpotqa": "qa",
         "decal_builtin_qa": "qa"}


def _examples(name, split="validation", lengths=LENGTHS, n=None):
  ds = seqio.get_mixture_or_task(name).get_dataset(lengths, split=split, shuffle=False,
                                                   num_epochs=1)
  return list(ds.take(n).as_numpy_iterator() if n else ds.as_numpy_iterator())


def _check_features(ex, vocab, lengths=LENGTHS):
  for key in ("inputs", "targets"):
    ids = ex[key].tolist()
    assert 1 < len(ids) <= lengths[key] and ids[-1] == 1 and 1 not in ids[:-1]
  # the target text round-trips through the vocabulary (EOS dropped)
  assert vocab.decode(ex["targets"].tolist()[:-1]) == ex["targets_pretokenized"].decode()


def test_every_task_is_registered_with_its_metric():
  for name, kind in TASKS.items():
    task = seqio.get_mixture_or_task(name)
    assert set(task.output_features) == {"inputs", "targets"}
    want = text_metrics.rouge if kind == "summarization" else text_metrics.squad
    assert task.predict_metric_fns == [want], name


# ------------------------------------------------------------------------------ TFDS layouts
def _fill(spec, given):
  """A record matching a TFDS tensor spec: given values, empty / zero elsewhere."""
  if isinstance(spec, dict):
    return {k: _fill(s, (given or {}).get(k)) for k, s in spec.items()}
  if given is not None:
    return given
  shape = [0 if d is None else d for d in spec.shape]
  if spec.dtype == tf.string and not shape:
    return b""
  return np.zeros(shape, dtype=object if spec.dtype == tf.string else spec.dtype.as_numpy_dtype)


def _mock(records):
  def as_dataset(self, split, **kwargs):
    spec = self.info.features.get_tensor_spec()
    return tf.data.Dataset.from_generator(lambda: (_fill(spec, r) for r in records),
                                          output_signature=spec)
  return tfds.testing.mock_data(as_dataset_fn=as_dataset)


TFDS_CASES = {
    "decal_cnn_dailymail": (
        {"article": "The river rose by two metres overnight.", "highlights": "River rose."},
        "summarize: The river rose by two metres overnight.", "River rose.", ["River rose."]),
    "decal_arxiv": (
        {"article": "We study sparse attention.", "abstract": "<S> sparse attention is studied . </S>"},
        "summarize: We study sparse attention.", "sparse attention is studied .",
        ["sparse attention is studied ."]),
    "decal_pubmed": (
        {"article": "Patients were treated.", "abstract": "<S> treatment helped . </S> <S> a lot . </S>"},
        "summarize: Patients were treated.", "treatment helped . a lot .",
        ["treatment helped . a lot ."]),
    "decal_mediasum": (
        {"utt": ["Hello.", "Hi there."], "speaker": ["ANNA", "BOB"], "summary": "A greeting."},
        "summarize: ANNA: Hello.\nBOB: Hi there.", "A greeting.", ["A greeting."]),
    "decal_squad": (
        {"question": "Who won?", "context": "The Broncos won the game.",
         "answers": {"text": ["The Broncos", "Broncos"], "answer_start": [0, 4]}},
        "question: Who won? context: The Broncos won the game.", "The Broncos",
        ["The Broncos", "Broncos"]),
    "decal_triviaqa": (
        {"question": "Which city?", "answer": {"value": "Paris", "aliases": ["Paris", "Paree"]},
         "entity_pages": {"wiki_context": ["Paris is a city."]},
         "search_results": {"search_context": ["The city of Paris."]}},
        "question: Which city? context: Paris is a city.\nThe city of Paris.", "Paris",
        ["Paris", "Paris", "Paree"]),
}


@pytest.mark.parametrize("name", sorted(TFDS_CASES))
def test_tfds_tasks_map_their_layout_offline(name, builtin_vocabulary):
  record, inputs, target, answers = TFDS_CASES[name]
  split = "validation"
  with _mock([record, record]):
    examples = _examples(name, split)
  assert len(examples) == 2
  ex = examples[0]
  assert ex["inputs_pretokenized"].decode() == inputs
  assert ex["targets_pretokenized"].decode() == target
  assert [a.decode() for a in ex["answers"]] == answers
  _check_features(ex, builtin_vocabulary)
  task = seqio.get_mixture_or_task(name)
  assert task.postprocess_fn(target, example=ex, is_target=True) == answers


def test_unprepared_tfds_names_the_command_and_the_local_alternative(tmp_path, monkeypatch):
  monkeypatch.setenv("DECAL_TFDS_DATA_DIR", str(tmp_path / "empty"))
  with pytest.raises(FileNotFoundError) as err:
    _examples("decal_squad")
  message = str(err.value)
  assert "tfds build squad" in message and "DECAL_LOCAL_DATA_DIR" in message


def test_hotpotqa_without_local_files_says_where_to_put_them():
  with pytest.raises(FileNotFoundError, match="hotpotqa/"):
    _examples("decal_hotpotqa")


# ------------------------------------------------------------------------------ local JSONL
def _write_jsonl(path, records):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return path


QA_RECORDS = [{"question": "Who wrote it?", "context": "It was written by Ada.",
               "answers": ["Ada", "Ada Lovelace"]},
              {"question": "When?", "context": ["In 1843.", "Long ago."], "answers": "1843"}]


def test_local_files_win_over_tfds_and_accept_lists(tmp_path, monkeypatch, builtin_vocabulary):
  _write_jsonl(tmp_path / "hotpotqa" / "validation.jsonl", QA_RECORDS)
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  examples = _examples("decal_hotpotqa")
  assert [e["inputs_pretokenized"].decode() for e in examples] == [
      "question: Who wrote it? context: It was written by Ada.",
      "question: When? context: In 1843.\nLong ago."]
  assert [list(e["answers"]) for e in examples] == [[b"Ada", b"Ada Lovelace"], [b"1843"]]
  for ex in examples:
    _check_features(ex, builtin_vocabulary)


def test_local_folder_from_gin_and_the_dataset_field_names(tmp_path):
  _write_jsonl(tmp_path / "cnn_dailymail" / "validation.jsonl",
               [{"id": "x", "article": "A long story.", "highlights": "Short."}])
  with gin.unlock_config():
    gin.bind_parameter("downstream_tasks.local_data.directory", str(tmp_path))
  (ex,) = _examples("decal_cnn_dailymail")
  assert ex["inputs_pretokenized"] == b"summarize: A long story."
  assert ex["targets_pretokenized"] == b"Short."


@pytest.mark.parametrize("line,problem", [
    ('{"question": "q", "answers": ["a"]}', "missing field 'context'"),
    ('{"question": "q", "context": 7, "answers": ["a"]}', "field 'context' must be"),
    ('{"question": "q", "context": "   ", "answers": ["a"]}', "field 'context' must be"),
    ('{"question": "q", "context": "c", "answers": []}', "field 'answers' must be"),
    ('{"question": "q", "context": "c", "answers": ["a", ""]}', "field 'answers' must be"),
    ('{"question": "q", "context": "c", "answers"', "not valid JSON"),
    ('["q", "c"]', "expected a JSON object"),
])
def test_bad_lines_fail_with_file_and_line(tmp_path, monkeypatch, line, problem):
  path = _write_jsonl(tmp_path / "squad" / "validation.jsonl", [QA_RECORDS[0], "", line])
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  with pytest.raises(local_files.BadRecordError) as err:
    _examples("decal_squad")
  assert f"{path}:3: " in str(err.value) and problem in str(err.value)
  assert "bad_lines='skip'" in str(err.value)


def test_bad_lines_can_be_skipped_and_are_counted(tmp_path, monkeypatch, caplog):
  _write_jsonl(tmp_path / "squad" / "validation.jsonl",
               [QA_RECORDS[0], '{"question": "q"}', QA_RECORDS[1], "{oops"])
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  monkeypatch.setenv("DECAL_BAD_LINES", "skip")
  examples = _examples("decal_squad")
  assert [e["targets_pretokenized"] for e in examples] == [b"Ada", b"1843"]
  assert "skipped 2 bad line(s) of 4" in caplog.text


def test_register_your_own_jsonl_task(tmp_path, builtin_vocabulary):
  path = _write_jsonl(tmp_path / "mine.jsonl", [{"body": "Text one.", "tldr": "One."}] * 3)
  downstream_tasks.register_jsonl_task("my_summaries", "summarization",
                                       {"validation": str(path)},
                                       fields={"document": "body", "summary": "tldr"})
  try:
    examples = _examples("my_summaries")
    assert len(examples) == 3 and examples[0]["targets_pretokenized"] == b"One."
  finally:
    seqio.TaskRegistry.remove("my_summaries")
  with pytest.raises(ValueError, match="unknown names"):
    downstream_tasks.register_jsonl_task("x", "qa", {"train": str(path)}, fields={"body": "b"})


def test_long_inputs_are_cut_to_length_with_eos_and_counted(tmp_path, monkeypatch):
  long_context = " ".join(["word"] * 400)
  _write_jsonl(tmp_path / "squad" / "validation.jsonl",
               [{"question": "q?", "context": long_context, "answers": ["word"]}] * 3)
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  before = text_to_text.truncation_counts().get("decal_squad/inputs", 0)
  examples = _examples("decal_squad")
  assert all(len(e["inputs"]) == LENGTHS["inputs"] and e["inputs"][-1] == 1 for e in examples)
  assert text_to_text.truncation_counts()["decal_squad/inputs"] - before == 3


def test_pubmed_in_its_release_format_from_shared_data(tmp_path, monkeypatch):
  source = DATA_DIR / "pubmed" / "validation.jsonl"
  if not source.exists():
    pytest.skip(f"{source} not found: set DECAL_DATA_DIR to the shared data folder")
  (tmp_path / "pubmed").mkdir()
  (tmp_path / "pubmed" / "validation.jsonl").symlink_to(source)
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  examples = _examples("decal_pubmed", lengths={"inputs": 512, "targets": 128})
  first = json.loads(source.read_text().splitlines()[0])
  assert len(examples) == len(source.read_text().splitlines())
  assert examples[0]["inputs_pretokenized"].decode() == \
      "summarize: " + "\n".join(first["article_text"])
  target = examples[0]["targets_pretokenized"].decode()
  assert "<S>" not in target and "</S>" not in target
  assert target.split() == " ".join(first["abstract_text"]).replace("<S>", " ").replace(
      "</S>", " ").split()


# ------------------------------------------------------------------------------ built-in QA
def test_builtin_qa_pairs_paragraphs_with_their_section_titles(builtin_vocabulary):
  from pydoc_data import topics
  examples = _examples("decal_builtin_qa", n=20)
  for ex in examples:
    title, topic = [a.decode() for a in ex["answers"]]
    assert topics.topics[topic].startswith(title)
    context = ex["inputs_pretokenized"].decode().split(" context: ", 1)[1]
    assert " ".join(topics.topics[topic].split()).find(context[:60]) >= 0
    _check_features(ex, builtin_vocabulary, lengths=LENGTHS)


# ------------------------------------------------------------------------------ converters
def test_squad_release_converts_and_feeds_decal_squad(tmp_path, monkeypatch, builtin_vocabulary):
  source = DATA_DIR / "squad" / "dev-v1.1.json"
  if not source.exists():
    pytest.skip(f"{source} not found: set DECAL_DATA_DIR to the shared data folder")
  import subprocess
  import sys
  proc = subprocess.run([sys.executable, "-m", "decal_jax.commands.prepare_jsonl", "squad",
                         str(source), "--split", "validation", "--out", str(tmp_path)],
                        capture_output=True, text=True, check=True)
  assert "10570 records" in proc.stdout  # every question of the official dev set
  release = json.loads(source.read_text())["data"][0]["paragraphs"][0]
  qa = release["qas"][0]
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  (ex,) = _examples("decal_squad", lengths={"inputs": 512, "targets": 32}, n=1)
  assert ex["inputs_pretokenized"].decode() == \
      f"question: {qa['question']} context: {release['context']}"
  assert [a.decode() for a in ex["answers"]] == [a["text"] for a in qa["answers"]]


def test_hotpotqa_and_mediasum_releases_convert(tmp_path):
  from decal_jax.data import convert
  hotpot = tmp_path / "hotpot.json"
  hotpot.write_text(json.dumps([
      {"_id": "a1", "question": "Which is older?", "answer": "Oslo",
       "context": [["Oslo", ["Oslo was founded ", "in 1040."]], ["Bergen", ["Bergen: 1070."]]]},
      {"_id": "a2", "question": "Empty?", "answer": "", "context": [["X", ["y"]]]}]))
  written = convert.write(convert.hotpotqa(str(hotpot)), tmp_path / "h" / "train.jsonl", "qa")
  assert written == (1, 1)
  record = json.loads((tmp_path / "h" / "train.jsonl").read_text())
  assert record["context"] == "Oslo: Oslo was founded in 1040.\nBergen: Bergen: 1070."
  dialogues, splits = tmp_path / "news_dialogue.json", tmp_path / "split.json"
  dialogues.write_text(json.dumps([
      {"id": "NPR-1", "summary": "Talk.", "utt": ["Hi.", "Hello."], "speaker": ["A", "B"]},
      {"id": "CNN-2", "summary": "More.", "utt": ["Yes."], "speaker": ["C"]}]))
  splits.write_text(json.dumps({"train": ["NPR-1"], "val": ["CNN-2"], "test": []}))
  counts = convert.write_splits(convert.mediasum(str(dialogues), str(splits)), tmp_path / "m",
                                "summarization")
  assert counts == {"train": (1, 0), "validation": (1, 0)}
  assert json.loads((tmp_path / "m" / "train.jsonl").read_text())["document"] == "A: Hi.\nB: Hello."


def test_a_jsonl_write_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path):
  from decal_jax.data import convert
  path = tmp_path / "train.jsonl"
  path.write_text("old\n")

  def records():  # a source that breaks after one good record
    yield {"id": "1", "question": "Q?", "context": "C.", "answers": ["A"]}
    raise ValueError("malformed release")

  with pytest.raises(ValueError, match="malformed release"):
    convert.write(records(), path, "qa")
  assert path.read_text() == "old\n"
  assert [p.name for p in tmp_path.iterdir()] == ["train.jsonl"]


def test_a_task_and_model_of_different_vocabularies_are_refused():
  t5_vocab = DATA_DIR / "vocab" / "t5_spiece.model"
  if not t5_vocab.exists():
    pytest.skip(f"{t5_vocab} not found: set DECAL_DATA_DIR to the shared data folder")
  from decal_jax import models
  from decal_jax.data import pipeline
  from decal_jax.networks.t5 import T5Config, Transformer
  with gin.unlock_config():
    gin.bind_parameter("decal_jax.data.vocabularies.task_vocabulary.vocabulary",
                       vocabularies.t5_vocabulary(str(t5_vocab)))
  builtin = vocabularies.builtin_vocabulary()
  model = models.EncoderDecoderModel(Transformer(T5Config(vocab_size=32128)), builtin, builtin)
  cfg = pipeline.DatasetConfig("decal_squad", LENGTHS)
  with pytest.raises(ValueError, match="tokenizes with .* but the model reads"):
    pipeline.check_feature_lengths(cfg, model)
