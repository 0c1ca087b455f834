"""The catalogue of bad inputs (issue 21): each test feeds one mistake a user can make and
checks the message names the culprit and the fix, and that nothing on disk was changed or
lost."""
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax import (checkpoints, evaluation, fileio, gin_utils, inference_eval, models,
                       partitioning, resilience, run_lock, train_state, trainer,
                       vocabulary_record)
from decal_jax.data import convert, hf_vocabularies, local_files, pipeline, vocabularies
from decal_jax.retrieval import beir, index

import paths
import processes
from retrieval.test_retrieval_e2e import _write_fixture
from retrieval.test_retrieval_index import _build, _ragged_corpus
from test_trainer import LENGTHS, _cfg, _model, _optimizer


def _load_tool(name):
  return importlib.import_module(f"decal_jax.tools.{name}")


def _files_under(folder):
  return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ---------------------------------------------------------------- data files
NOT_UTF8 = b'{"question": "Who?", "context": "caf\xe9 cr\xe8me", "answers": ["Ada"]}\n'
GOOD_QA = (json.dumps({"question": "Who wrote it?", "context": "Ada wrote it.",
                       "answers": ["Ada"]}) + "\n").encode()


@pytest.fixture
def local_data(tmp_path, monkeypatch, builtin_vocabulary):
  """The tasks read <tmp_path>/<name>/<split> files with the built-in vocabulary."""
  del builtin_vocabulary  # bound in gin by the fixture (tests/conftest.py)
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  return tmp_path


def _write(path, data: bytes):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(data)
  return path


def _examples(task, lengths):
  ds = seqio.get_mixture_or_task(task).get_dataset(lengths, split="validation", shuffle=False,
                                                   num_epochs=1)
  return list(ds.as_numpy_iterator())


QA_LENGTHS = {"inputs": 64, "targets": 16}


def test_a_non_utf8_line_in_a_downstream_jsonl_names_file_line_and_fix(local_data):
  data = GOOD_QA + NOT_UTF8
  path = _write(local_data / "squad" / "validation.jsonl", data)
  with pytest.raises(local_files.BadRecordError) as err:
    _examples("decal_squad", QA_LENGTHS)
  message = str(err.value)
  assert f"{path}:2: not UTF-8" in message and "re-save the file as UTF-8" in message
  assert "DECAL_BAD_LINES=skip" in message
  assert path.read_bytes() == data


def test_a_non_utf8_line_in_a_downstream_jsonl_is_skipped_on_request(local_data, monkeypatch,
                                                                     caplog):
  _write(local_data / "squad" / "validation.jsonl", NOT_UTF8 + GOOD_QA)
  monkeypatch.setenv("DECAL_BAD_LINES", "skip")
  examples = _examples("decal_squad", QA_LENGTHS)
  assert [e["targets_pretokenized"] for e in examples] == [b"Ada"]
  assert "skipped 1 bad line(s) of 2" in caplog.text


def test_a_non_utf8_line_in_a_text_lm_file_names_file_and_line(local_data, monkeypatch):
  data = b"A first line.\n\nA second \xff line.\n"
  path = _write(local_data / "text_lm" / "validation.txt", data)
  with pytest.raises(local_files.BadRecordError, match=f"{path}:3: not UTF-8"):
    _examples("decal_text_lm", {"targets": 8})
  monkeypatch.setenv("DECAL_BAD_LINES", "skip")
  tokens = [t for e in _examples("decal_text_lm", {"targets": 8}) for t in e["targets"]]
  expected = vocabularies.builtin_vocabulary().encode("A first line.")
  assert tokens == list(expected)  # only the good line is read
  assert path.read_bytes() == data


def test_a_non_utf8_line_in_a_squid_qa_jsonl_names_file_and_line(tmp_path, local_data):
  from decal_jax.tasks import squid_tasks
  path = _write(tmp_path / "mine.jsonl", GOOD_QA + GOOD_QA + NOT_UTF8)
  squid_tasks.register_squid_qa_jsonl_task("bad_inputs_squid_qa", {"validation": str(path)})
  try:
    with pytest.raises(local_files.BadRecordError, match=f"{path}:3: not UTF-8"):
      seqio.get_mixture_or_task("bad_inputs_squid_qa").source.num_input_examples("validation")
  finally:
    seqio.TaskRegistry.remove("bad_inputs_squid_qa")


def test_a_non_utf8_line_in_eval_inputs_names_file_and_line(tmp_path):
  path = _write(tmp_path / "inputs.jsonl", b'{"inputs": "fine"}\n{"inputs": "\xc3("}\n')
  with pytest.raises(local_files.BadRecordError, match=f"{path}:2: not UTF-8"):
    evaluation.read_inputs(str(path))


def test_a_non_utf8_line_in_make_vocab_input_names_file_and_line(tmp_path):
  path = _write(tmp_path / "text.txt", b"one line\nbad \xfe line\n")
  output = tmp_path / "out.model"
  with pytest.raises(SystemExit) as err:
    _load_tool("make_vocab").main(["--input", str(path), "--output", str(output)])
  assert f"{path}:2: not UTF-8" in str(err.value) and "re-save" in str(err.value)
  assert _files_under(tmp_path) == ["text.txt"]


HOTPOT_OFFICIAL = [{"_id": "h1", "question": "Which is older?", "answer": "Oslo",
                    "supporting_facts": [["Oslo", 0]],
                    "context": [["Oslo", ["Oslo was founded ", "in 1040."]],
                                ["Bergen", ["Bergen in 1070."]]]}]
HOTPOT_HF = [{"id": "h1", "question": "Which is older?", "answer": "Oslo",
              "type": "comparison", "level": "easy",
              "supporting_facts": {"title": ["Oslo"], "sent_id": [0]},
              "context": {"title": ["Oslo", "Bergen"],
                          "sentences": [["Oslo was founded ", "in 1040."], ["Bergen in 1070."]]}}]
SQUAD_OFFICIAL = {"version": "1.1", "data": [{"title": "Ada", "paragraphs": [
    {"context": "Ada wrote it in 1843.",
     "qas": [{"id": "s1", "question": "When?", "answers": [{"text": "1843",
                                                             "answer_start": 16}]}]}]}]}
SQUAD_HF = [{"id": "s1", "title": "Ada", "context": "Ada wrote it in 1843.", "question": "When?",
             "answers": {"text": ["1843"], "answer_start": [16]}}]


def _prepare(args, out):
  _load_tool("prepare_jsonl").main(args + ["--out", str(out)])


def _jsonl(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("name,official,hf,split_args", [
    ("hotpotqa", HOTPOT_OFFICIAL, HOTPOT_HF, ["--split", "train"]),
    ("squad", SQUAD_OFFICIAL, SQUAD_HF, ["--split", "train"]),
])
def test_prepare_jsonl_reads_the_hugging_face_layout_as_the_official_one(
    tmp_path, name, official, hf, split_args):
  (tmp_path / "official.json").write_text(json.dumps(official))
  (tmp_path / "hf.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hf))  # to_json
  _prepare([name, str(tmp_path / "official.json")] + split_args, tmp_path / "a")
  _prepare([name, str(tmp_path / "hf.jsonl")] + split_args, tmp_path / "b")
  expected = _jsonl(tmp_path / "a" / name / "train.jsonl")
  assert _jsonl(tmp_path / "b" / name / "train.jsonl") == expected and len(expected) == 1
  if name == "hotpotqa":
    assert expected[0]["context"] == "Oslo: Oslo was founded in 1040.\nBergen: Bergen in 1070."


def test_prepare_jsonl_reads_one_hugging_face_mediasum_split(tmp_path):
  rows = [{"id": "NPR-1", "program": "p", "summary": "Talk.", "utt": ["Hi.", "Hello."],
           "speaker": ["A", "B"]},
          {"id": "CNN-2", "document": "C: Yes.\nD: No.", "summary": "More."}]
  source = tmp_path / "validation.json"
  source.write_text("\n".join(json.dumps(r) for r in rows))
  _prepare(["mediasum", str(source), "--split", "validation"], tmp_path / "out")
  records = _jsonl(tmp_path / "out" / "mediasum" / "validation.jsonl")
  assert [r["document"] for r in records] == ["A: Hi.\nB: Hello.", "C: Yes.\nD: No."]


@pytest.mark.parametrize("name,records", [
    ("hotpotqa", HOTPOT_OFFICIAL + [{"id": "h2", "query": "Where?", "passages": []}]),
    ("squad", SQUAD_HF + [{"id": "s2", "question": "Q?", "context": "C.", "answers": ["A"]}]),
    ("mediasum", [{"id": "m1", "transcript": "..."}]),
])
def test_prepare_jsonl_names_the_first_record_in_no_known_layout(tmp_path, capsys, name,
                                                                 records):
  source = tmp_path / "release.json"
  source.write_text(json.dumps(records))
  with pytest.raises(SystemExit) as err:
    _prepare([name, str(source), "--split", "train"], tmp_path / "out")
  message = capsys.readouterr().err
  assert err.value.code == 2 and f"{source}: record {len(records)} " in message
  assert f"it has keys {sorted(records[-1])}" in message
  assert convert.LAYOUTS[name] in message and "Nothing was written" in message
  assert _files_under(tmp_path) == ["release.json"]  # no folder, no .tmp file


def test_prepare_jsonl_names_the_line_of_a_non_utf8_release(tmp_path, capsys):
  source = tmp_path / "release.json"
  data = json.dumps(SQUAD_OFFICIAL, indent=1).encode().replace(b"1843.", b"18\xe943.")
  source.write_bytes(data)
  with pytest.raises(SystemExit):
    _prepare(["squad", str(source), "--split", "train"], tmp_path / "out")
  line = data[:data.index(b"\xe9")].count(b"\n") + 1
  assert f"{source}:{line}: not UTF-8" in capsys.readouterr().err
  assert _files_under(tmp_path) == ["release.json"]


@pytest.mark.parametrize("make", [vocabularies.t5_vocabulary,
                                  hf_vocabularies.HfSentencePieceVocabulary])
@pytest.mark.parametrize("content", [b'{"version": "1.0", "model": {}}', b""])
def test_a_vocabulary_file_that_is_not_sentencepiece_is_named(tmp_path, make, content):
  path = tmp_path / "tokenizer.model"
  path.write_bytes(content)
  with pytest.raises(vocabularies.NotSentencePieceError) as err:
    make(str(path)).encode("hello")
  message = str(err.value)
  assert message.startswith(f"{path} is not a SentencePiece model")
  assert ("DECAL_T5_VOCAB" if make is vocabularies.t5_vocabulary else "LLAMA_TOKENIZER") in message
  assert path.read_bytes() == content


def test_a_non_utf8_squid_context_file_is_named_before_the_model_loads(tmp_path):
  context = _write(tmp_path / "doc.txt", b"A context.\nWith a \x80 byte.\n")
  model_dir = tmp_path / "no_model_here"  # never read: the context is checked first
  with pytest.raises(fileio.NotUtf8Error, match=f"{context}:2: not UTF-8"):
    _load_tool("squid_answer").main(["--model_dir", str(model_dir), "--context_file",
                                     str(context), "--question", "What?"])
  assert _files_under(tmp_path) == ["doc.txt"]


def test_prepare_jsonl_names_the_line_of_a_release_that_is_not_json(tmp_path, capsys):
  source = tmp_path / "release.json"
  source.write_text('{"data": [\n  {"paragraphs": [}\n]}\n')
  with pytest.raises(SystemExit):
    _prepare(["squad", str(source), "--split", "train"], tmp_path / "out")
  assert f"{source}:2: not valid JSON" in capsys.readouterr().err
  assert _files_under(tmp_path) == ["release.json"]


# ---------------------------------------------------------------- retrieval
RETRIEVAL_GIN = ["models/decal_tiny.gin", "models/dual_encoder.gin"]


def _dual_encoder_checkpoint(model_dir: pathlib.Path) -> None:
  """A freshly initialised tiny dual encoder saved as MODEL_DIR's step 1 (no training:
  retrieval only needs a checkpoint to read)."""
  gin_utils.parse(RETRIEVAL_GIN, [], ["PROJECTION_DIM = 32"])
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  gin.clear_config()
  shapes = model.input_shapes({"inputs": 16, "targets": 48})
  params = model.get_initial_variables(jax.random.PRNGKey(0), shapes)["params"]
  ckpt = checkpoints.Checkpointer(str(model_dir))
  ckpt.save(1, {"params": params, "step": jnp.int32(1)}, {"batches_consumed": 0}, force=True)
  ckpt.close()


def _retrieve(model_dir: pathlib.Path, folder: pathlib.Path, *bindings: str) -> None:
  from decal_jax import retrieve
  retrieve.main([f"--gin_file={f}" for f in RETRIEVAL_GIN + ["runs/retrieve.gin"]] + [
      f"--gin.MODEL_DIR='{model_dir}'", f"--gin.BEIR_FOLDER='{folder}'", "--gin.TOP_K=10",
      "--gin.QUERY_LENGTH=16", "--gin.PASSAGE_LENGTH=48", "--gin.PROJECTION_DIM=32",
      *bindings])
  gin.clear_config()


def test_retrieval_index_of_an_edited_corpus_is_rebuilt_not_reused(tmp_path, capsys):
  folder = tmp_path / "beir_fixture"
  corpus, _, _ = _write_fixture(folder)
  model_dir = tmp_path / "dual"
  _dual_encoder_checkpoint(model_dir)
  _retrieve(model_dir, folder)
  capsys.readouterr()

  # Edit corpus.jsonl in place: drop the passages of the train topics (judged only in
  # qrels/train.tsv, so the test split stays valid).
  corpus_file = folder / "corpus.jsonl"
  lines = corpus_file.read_text(encoding="utf-8").splitlines(keepends=True)
  kept = [line for line in lines if json.loads(line)["_id"] in
          {d for d in corpus if not d.startswith(("d2-", "d5-", "d8-", "d11-"))}]
  corpus_file.write_text("".join(kept), encoding="utf-8")
  _retrieve(model_dir, folder)
  out = capsys.readouterr().out
  assert "Reusing the index" not in out
  assert (f"WARNING: the corpus {corpus_file} changed since the index at "
          f"{model_dir / 'index' / 'beir_fixture.step1'} was built "
          f"({len(corpus)} -> {len(kept)} documents); rebuilding the index.") in out

  # The index on disk is the new corpus's; the metrics and run equal a fresh run's.
  rebuilt = index.Index.open(str(model_dir / "index" / "beir_fixture.step1"))
  assert sorted(rebuilt.doc_ids) == sorted(json.loads(line)["_id"] for line in kept)
  assert rebuilt.meta["corpus"] == beir.load_beir(folder, "test").corpus_fingerprint
  stem = model_dir / "retrieval" / "beir_fixture.test.step1"
  after_edit = {ext: pathlib.Path(f"{stem}.{ext}").read_text() for ext in ("metrics.json", "trec")}
  assert json.loads(after_edit["metrics.json"])["num_docs"] == len(kept)
  _retrieve(model_dir, folder,
            f"--gin.pipeline.evaluate_retrieval.index_dir='{tmp_path / 'fresh_index'}'")
  assert "Reusing the index" not in capsys.readouterr().out  # a fresh build
  assert after_edit == {ext: pathlib.Path(f"{stem}.{ext}").read_text()
                        for ext in ("metrics.json", "trec")}


def test_retrieval_index_tells_a_corpus_edit_that_keeps_the_count(tmp_path):
  passages = {f"doc-{i}": beir.Passage("", f"text {i}") for i in range(23)}

  def fingerprint(docs):
    digest = beir.CorpusDigest()
    for doc_id, passage in docs.items():
      digest.add(doc_id, passage)
    return digest.fingerprint()

  built = _build(tmp_path / "idx", _ragged_corpus(),
                 corpus_fingerprint=fingerprint(passages))
  assert built.corpus_change(fingerprint(passages)) == ""
  edited = dict(passages, **{"doc-3": beir.Passage("A title", "text 3")})
  assert built.corpus_change(fingerprint(edited)) == (
      "the same 23 documents, but their ids, titles or texts differ")
  renamed = {("doc-x" if d == "doc-3" else d): p for d, p in passages.items()}
  assert built.corpus_change(fingerprint(renamed)) != ""
  older = _build(tmp_path / "old", _ragged_corpus())  # built before corpora were fingerprinted
  assert "no corpus fingerprint" in older.corpus_change(fingerprint(passages))


def test_empty_queries_are_scored_with_a_warning_naming_them(tmp_path, caplog):
  folder = tmp_path / "set"
  corpus, queries, qrels = _write_fixture(folder)
  empty = sorted(qrels["test"])[:6]  # six of the test split's eight queries
  beir.write_beir(folder, corpus, dict(queries, **{q: "" for q in empty}), qrels,
                  overwrite=True)
  files = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
  with caplog.at_level(logging.WARNING):
    data = beir.load_beir(folder, "test")
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warnings == [
      f"{folder / 'queries.jsonl'}: 6 query(ies) judged in split 'test' have empty text "
      f"(ids: {', '.join(empty[:5])} and 1 more); each is scored as EOS alone and counted in "
      f"NDCG / Recall. Give them text, or remove them from {folder / 'qrels' / 'test.tsv'}."]
  assert data.empty_queries == 6 and all(data.queries[q] == "" for q in empty)  # kept
  assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == files
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert beir.load_beir(folder, "validation").empty_queries == 0
  assert not caplog.records


REPO = paths.REPO


# ---------------------------------------------------------------- command line and run settings
def _parse_command_line(*args):
  gin_utils.parse(*gin_utils.split_args(["--gin_file=runs/pretrain_builtin.gin", *args]))


@pytest.mark.parametrize("flag", ["--gin.TRAIN_STEPZ=10", "--gin_bindings=TRAIN_STEPZ = 10"])
def test_misspelled_macro_is_refused_naming_the_closest_macro(tmp_path, flag):
  with pytest.raises(gin_utils.GinConfigError) as err:
    _parse_command_line(f"--gin.MODEL_DIR='{tmp_path / 'm'}'", flag)
  message = str(err.value)
  assert "'TRAIN_STEPZ = 10'" in message and "no loaded gin file defines or reads" in message
  assert "Did you mean TRAIN_STEPS?" in message
  assert list(tmp_path.iterdir()) == []


def test_misspelled_macro_with_nothing_close_lists_the_known_macros(tmp_path):
  with pytest.raises(gin_utils.GinConfigError) as err:
    _parse_command_line(f"--gin.MODEL_DIR='{tmp_path / 'm'}'", "--gin.XYZZY=3")
  message = str(err.value)
  assert "macro XYZZY" in message and "Did you mean" not in message
  assert "macros are: " in message and "TRAIN_STEPS, " in message and "MODEL_DIR, " in message


def test_macros_a_file_defines_or_a_binding_reads_are_accepted(tmp_path):
  """A macro counts as known when a loaded file defines it, even if only another file
  reads it (models/*.gin define MODEL for the run files; runs/dodo_autoencode.gin sets
  LORA_RANK for models/dodo.gin), or when another command-line binding reads it."""
  (tmp_path / "later.gin").write_text("READ_BY_ANOTHER_FILE = 1\n")
  _parse_command_line(f"--gin_file={tmp_path / 'later.gin'}", "--gin.READ_BY_ANOTHER_FILE=2",
                      "--gin.MODEL_DIR='/unused'", "--gin.trainer.train.total_steps=%MY_STEPS",
                      "--gin.MY_STEPS=7")
  assert gin.query_parameter("%READ_BY_ANOTHER_FILE") == 2
  assert gin.query_parameter("trainer.train.total_steps").scoped_selector == "MY_STEPS/gin.macro"
  assert gin.query_parameter("%MY_STEPS") == 7


def test_misspelled_macro_on_the_train_command_line_stops_before_any_work(tmp_path):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO))
  proc = subprocess.run([sys.executable, "-m", "decal_jax.train",
                         "--gin_file=runs/pretrain_builtin.gin",
                         f"--gin.MODEL_DIR='{tmp_path / 'm'}'", "--gin.TRAIN_STEPZ=10"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr
  assert "TRAIN_STEPZ" in proc.stderr and "Did you mean TRAIN_STEPS?" in proc.stderr
  assert not (tmp_path / "m").exists()


def _train(model_dir, train_cfg=None, **settings):
  kw = dict(total_steps=3, checkpoint_period=3, eval_period=3, log_period=3, eval_batches=1,
            keep_checkpoints=1, show_example=False)
  return trainer.train(model=_model(), train_dataset_cfg=train_cfg or _cfg(),
                       model_dir=str(model_dir), optimizer=_optimizer(), **dict(kw, **settings))


def test_negative_train_steps_are_refused_before_any_checkpoint(tmp_path):
  with pytest.raises(ValueError, match=r"TRAIN_STEPS \(trainer.train.total_steps\) = -5: must "
                                       r"be a whole number >= 1"):
    _train(tmp_path / "m", total_steps=-5)
  assert not (tmp_path / "m").exists()  # no checkpoint_-5


@pytest.mark.parametrize("setting,macro", [("eval_period", "EVAL_PERIOD"),
                                           ("log_period", "LOG_PERIOD"),
                                           ("checkpoint_period", "CHECKPOINT_PERIOD"),
                                           ("keep_checkpoints", "KEEP_CHECKPOINTS"),
                                           ("eval_batches", "EVAL_BATCHES")])
def test_zero_periods_and_counts_are_refused_naming_the_macro(tmp_path, setting, macro):
  with pytest.raises(ValueError, match=rf"{macro} \(trainer.train.{setting}\) = 0: must be a "
                                       r"whole number >= 1"):
    _train(tmp_path / "m", **{setting: 0})
  assert not (tmp_path / "m").exists()


def test_fractional_train_steps_are_refused(tmp_path):
  with pytest.raises(ValueError, match=r"TRAIN_STEPS \(trainer.train.total_steps\) = 1000.0: "
                                       r"must be a whole number"):
    _train(tmp_path / "m", total_steps=1e3)
  assert not (tmp_path / "m").exists()


def test_zero_batch_size_is_refused_naming_the_binding(tmp_path):
  with pytest.raises(ValueError, match=r"BATCH_SIZE \(pipeline.DatasetConfig.batch_size\) = 0: "
                                       r"must be a whole number >= 1"):
    gin_utils.run(trainer.train, ["--gin_file=runs/pretrain_builtin.gin", "--gin.BATCH_SIZE=0",
                                  f"--gin.MODEL_DIR='{tmp_path / 'm'}'"], pass_config=True)
  assert not (tmp_path / "m").exists()


def test_zero_feature_length_is_refused_naming_the_binding():
  with pytest.raises(ValueError, match=r"TASK_FEATURE_LENGTHS\['targets'\] \(pipeline.Dataset"
                                       r"Config.task_feature_lengths\) = 0: must be a whole "
                                       r"number >= 1"):
    pipeline.DatasetConfig("decal_builtin_span_corruption", dict(LENGTHS, targets=0))


def test_unknown_task_lists_the_closest_registered_names(tmp_path):
  typo = pipeline.DatasetConfig("decal_builtin_span_corruptoin", LENGTHS, batch_size=8)
  with pytest.raises(ValueError) as err:
    _train(tmp_path / "m", train_cfg=typo)
  message = str(err.value)
  assert "MIXTURE_OR_TASK_NAME" in message and "'decal_builtin_span_corruptoin'" in message
  assert "Did you mean decal_builtin_span_corruption" in message
  assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_model_dir_that_is_a_file_is_refused_before_start_up(tmp_path, entry):
  notes = tmp_path / "notes.txt"
  notes.write_text("my notes")
  with pytest.raises(NotADirectoryError) as err:
    if entry == "train":
      _train(notes)
    else:
      evaluation.evaluate(model=_model(), eval_dataset_cfg=_cfg(split="validation"),
                          model_dir=str(notes))
  message = str(err.value)
  assert "MODEL_DIR (" in message and f"{str(notes)!r} is a file" in message
  assert "give a folder" in message
  assert notes.read_text() == "my notes" and sorted(tmp_path.iterdir()) == [notes]


def test_model_dir_under_a_file_is_refused(tmp_path):
  notes = tmp_path / "notes.txt"
  notes.write_text("my notes")
  with pytest.raises(NotADirectoryError, match=re.escape(f"lies under the file {notes}")):
    _train(notes / "run")
  assert notes.read_text() == "my notes"


# ---------------------------------------------------------------- checkpoints
def _train_tiny(model_dir, steps, **kw):
  """The tiny test_trainer model, a checkpoint after every step."""
  return trainer.train(model=_model(), train_dataset_cfg=_cfg(), model_dir=str(model_dir),
                       total_steps=steps, optimizer=_optimizer(), checkpoint_period=1,
                       eval_period=1000, eval_batches=1, log_period=1, show_example=False,
                       **kw)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
  """MODEL_DIR with checkpoint_1 and checkpoint_2 of a 2-step run (each test copies it)."""
  model_dir = tmp_path_factory.mktemp("two_checkpoints")
  _train_tiny(model_dir, 2)
  return model_dir


def _copy(source, tmp_path):
  return pathlib.Path(shutil.copytree(source, tmp_path / "run"))


def _truncate_largest_array_file(step_dir):
  """Truncates the biggest file of the saved state to 0 bytes, as a full disk would."""
  biggest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
  biggest.write_bytes(b"")
  return biggest


def _files(directory):
  """{relative path: contents} of every file under `directory`."""
  return {str(p.relative_to(directory)): p.read_bytes()
          for p in sorted(pathlib.Path(directory).rglob("*")) if p.is_file()}


def _params(model_dir, step):
  return train_state.restore_params(_model(), str(model_dir), _cfg(),
                                    partitioning.Partitioner(), step)[0]


def test_a_truncated_latest_checkpoint_is_set_aside_and_training_resumes_before_it(
    two_checkpoints, tmp_path, capsys):
  model_dir = _copy(two_checkpoints, tmp_path)
  truncated = _truncate_largest_array_file(model_dir / "checkpoint_2")
  first = _files(model_dir / "checkpoint_1")
  _train_tiny(model_dir, 3)  # the same command again, with one more step
  out = capsys.readouterr().out
  lines = [line for line in out.splitlines() if "damaged" in line]
  assert len(lines) == 1, out  # one line: the checkpoint, the error, what was done
  assert f"checkpoint_2 in {model_dir} is damaged (" in lines[0]
  assert "set aside as checkpoint_2.damaged, resuming from checkpoint_1." in lines[0]
  assert "Resuming from step 1" in out
  # Nothing lost: the damaged one kept as it was, out of Orbax's listing; the one before
  # untouched; the run continued from step 1 and rewrote step 2 exactly as first written.
  aside = model_dir / "checkpoint_2.damaged" / truncated.relative_to(model_dir / "checkpoint_2")
  assert aside.exists() and aside.stat().st_size == 0
  assert _files(model_dir / "checkpoint_1") == first
  ckpt = checkpoints.Checkpointer(str(model_dir))
  assert ckpt.all_steps() == [1, 2, 3]
  ckpt.close()
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(model_dir, 2),
                         _params(two_checkpoints, 2))


def test_every_checkpoint_damaged_stops_the_run_naming_them_and_renames_nothing(
    two_checkpoints, tmp_path):
  model_dir = _copy(two_checkpoints, tmp_path)
  _truncate_largest_array_file(model_dir / "checkpoint_2")
  (model_dir / "checkpoint_1" / "state" / "_METADATA").unlink()  # partly deleted
  before = _files(model_dir)
  with pytest.raises(checkpoints.DamagedCheckpointError) as err:
    _train_tiny(model_dir, 3)
  message = str(err.value)
  assert f"Every checkpoint in {model_dir} is damaged: checkpoint_2 (" in message
  assert "; checkpoint_1 (FileNotFoundError: " in message
  assert "Nothing was changed on disk" in message and "new MODEL_DIR" in message
  assert _files(model_dir) == before


def test_eval_and_infer_name_a_damaged_checkpoint_and_the_steps_to_use_instead(
    two_checkpoints, tmp_path):
  model_dir = _copy(two_checkpoints, tmp_path)
  _truncate_largest_array_file(model_dir / "checkpoint_2")
  before = _files(model_dir)
  with pytest.raises(checkpoints.DamagedCheckpointError) as err:
    evaluation.infer(model=_model(), inputs=["some text"], model_dir=str(model_dir),
                     task_feature_lengths=LENGTHS)
  message = str(err.value)
  assert f"checkpoint_2 in {model_dir} is damaged (" in message
  assert "Other checkpoints here: steps [1]" in message and "CHECKPOINT_STEP" in message
  with pytest.raises(FileNotFoundError, match=r"No checkpoint_7 .* holds steps \[1, 2\]: set "
                     "CHECKPOINT_STEP"):
    _params(model_dir, 7)
  # The step asked for, never another one silently: step 1 is the saved step 1.
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(model_dir, 1),
                         _params(two_checkpoints, 1))
  assert _files(model_dir) == before


def test_an_initial_checkpoint_of_another_architecture_is_refused_with_the_counts(
    two_checkpoints, tmp_path, capsys):
  wider = _model(emb_dim=48)
  fresh, _ = train_state.init_state(wider, _optimizer(), partitioning.Partitioner(), _cfg(),
                                    seed=0)
  with pytest.raises(checkpoints.ArchitectureMismatchError) as err:
    trainer.train(model=wider, train_dataset_cfg=_cfg(), model_dir=str(tmp_path / "new"),
                  total_steps=2, optimizer=_optimizer(),
                  initial_checkpoint_path=str(two_checkpoints))
  message = str(err.value)
  assert f"The checkpoint {two_checkpoints} (step 2) restores only " in message
  assert "shape differs:          decoder/decoder_norm/scale checkpoint [32] vs model [48]" \
      in message
  assert "INITIAL_CHECKPOINT_PATH" in message and "ALLOW_PARTIAL_RESTORE=True" in message
  assert not list((tmp_path / "new").glob("checkpoint_*"))  # no run started
  # Allowed on purpose: the report counts the shape mismatches as unused.
  _, report = checkpoints.restore_matching_params(str(two_checkpoints), fresh["params"],
                                                  allow_partial=True)
  total = len(jax.tree_util.tree_leaves(fresh["params"]))
  assert 0 < len(report["restored"]) < total / 2
  assert len(report["restored"]) + len(report["initialised"]) == total
  assert "decoder/decoder_norm/scale" in report["reshaped"]
  assert set(report["reshaped"]) <= set(report["unused"])
  assert len(report["unused"]) == total - len(report["restored"])  # same names, other shapes
  train_state.start_from(str(two_checkpoints), fresh["params"], allow_partial=True)
  assert (f"{len(report['unused'])} in the checkpoint unused ({len(report['reshaped'])} of "
          "them with another shape in this model)") in capsys.readouterr().out


# ---------------------------------------------------------------- interrupting a run
def test_a_first_ctrl_c_asks_to_stop_and_a_second_aborts(capsys):
  before = signal.getsignal(signal.SIGINT)
  with resilience.PreemptionWatcher() as watcher:
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: a request, no exception
    assert watcher.requested() and watcher.signal_name == "SIGINT"
    assert "Ctrl-C again to stop at once" in capsys.readouterr().out
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before  # the previous handler is back


def test_ctrl_c_during_training_saves_the_step_and_the_same_command_resumes(
    tmp_path, capsys, monkeypatch):
  """Ctrl-C in step 2 of 5: the step finishes, checkpoint_2 is written, the run says how
  it stopped; the next run resumes from step 2 instead of losing it."""
  to_global, calls = pipeline.to_global, []

  def press_ctrl_c_in_step_two(batch, partitioner):
    calls.append(1)
    if len(calls) == 2:
      os.kill(os.getpid(), signal.SIGINT)
    return to_global(batch, partitioner)

  monkeypatch.setattr(pipeline, "to_global", press_ctrl_c_in_step_two)
  result = _train(tmp_path / "m", total_steps=5, checkpoint_period=5, eval_period=5,
                  log_period=5)
  assert result == {"preempted_at_step": 2.0}
  assert "Preempted (SIGINT) after step 2: saved checkpoint_2" in capsys.readouterr().out
  assert checkpoints.Checkpointer(str(tmp_path / "m")).latest_step() == 2
  monkeypatch.setattr(pipeline, "to_global", to_global)
  _train(tmp_path / "m", total_steps=5, checkpoint_period=5, eval_period=5, log_period=5)
  assert "Resuming from step 2" in capsys.readouterr().out


# ================================================================ issue 21: inputs past
# the lengths, a JSONL file given to a plain-text task, characters the vocabulary lacked
def test_a_jsonl_file_given_to_the_plain_text_lm_task_warns_naming_it_and_the_fix(
    local_data, caplog):
  records = [{"text": "A first document."}, {"text": "A second one.", "id": 2}]
  data = "".join(json.dumps(r) + "\n" for r in records).encode()
  path = _write(local_data / "text_lm" / "validation.txt", data)
  with caplog.at_level(logging.WARNING):
    tokens = [t for e in _examples("decal_text_lm", {"targets": 64}) for t in e["targets"]]
  warnings = [r for r in caplog.records if "looks like JSON Lines" in r.getMessage()]
  assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
  message = warnings[0].getMessage()
  assert message.startswith(f"{path} looks like JSON Lines")
  assert "jq -r .text" in message and "register_text_autoencode_task" in message
  # Read as text all the same (a warning, not a refusal): braces and keys included.
  vocab = vocabularies.builtin_vocabulary()
  assert tokens == [t for line in data.decode().splitlines() for t in vocab.encode(line)]
  assert path.read_bytes() == data
  # Plain text whose lines merely start with a brace, or one JSON line among text: no warning.
  caplog.clear()
  for text in ("{braces} open this line.\nA second line.\n", 'Text first.\n{"a": 1}\n'):
    assert not local_files.looks_like_jsonl(str(_write(local_data / "plain.txt",
                                                       text.encode())))


def test_an_infer_input_past_the_inputs_length_is_cut_with_a_warning_naming_the_lengths(
    two_checkpoints, tmp_path, caplog):
  model_dir = _copy(two_checkpoints, tmp_path)
  before = _files(model_dir)
  long_text = " ".join(["The with statement wraps the execution of a block."] * 400)
  vocab = vocabularies.builtin_vocabulary()
  length = len(vocab.encode(long_text)) + 1  # with EOS
  with caplog.at_level(logging.WARNING):
    outputs = evaluation.infer(model=_model(), inputs=["short text", long_text],
                               model_dir=str(model_dir), task_feature_lengths=LENGTHS)
  assert len(outputs) == 2  # decoded, from the first LENGTHS['inputs'] tokens
  warning = next(r for r in caplog.records if "were cut" in r.getMessage())
  assert warning.levelno == logging.WARNING
  assert (f"1 of 2 inputs are longer than TASK_FEATURE_LENGTHS['inputs'] = "
          f"{LENGTHS['inputs']} tokens") in warning.getMessage()
  assert f"input 2 (from 1" in warning.getMessage() and f"has {length}." in warning.getMessage()
  assert length > 1000 and _files(model_dir) == before


def test_a_squid_question_past_the_large_decoder_is_refused_naming_it_and_the_limit(tmp_path):
  squid_answer = _load_tool("squid_answer")
  model = gin_utils.load_model(["runs/squid_instruct_builtin.gin"],
                               bindings=[f"MODEL_DIR = '{tmp_path}'"]).model
  gin.clear_config()
  large = model.module.config.large  # max_length 512
  long_question = "Which statement wraps a block? " * 300
  tokens = len(model.input_vocabulary.encode(long_question))
  with pytest.raises(ValueError) as err:
    squid_answer.query_tokens(model, ["What?", long_question], memory_count=8,
                              max_answer_length=32)
  message = str(err.value)
  room = large.max_length - 8 - 32
  assert f"--question number 2 ('Which statement" in message
  assert f"has {tokens} tokens; the large decoder reads {room} beside the 8 memory" in message
  assert "Shorten the question, or lower --max_answer_length" in message
  assert squid_answer.query_tokens(model, ["What?"], 8, 32).shape[0] == 1
  # The network refuses it too, before the large decoder runs (no out-of-memory).
  from decal_jax.networks.squid import Compressed
  shapes = {"encoder_input_tokens": (1, 16), "decoder_input_tokens": (1, 4),
            "query_tokens": (1, 4)}
  params = jax.eval_shape(lambda r: model.get_initial_variables(r, shapes),
                          jax.random.PRNGKey(0))["params"]
  compressed = Compressed(jnp.zeros((1, 8, large.emb_dim)), jnp.ones((1, 8), bool))
  with pytest.raises(ValueError, match=f"memory \\+ query tokens needs {8 + tokens} positions "
                     f"but the model accepts {large.max_length}"):
    jax.eval_shape(lambda p: model.module.apply(
        {"params": p}, compressed, jnp.ones((1, tokens), jnp.int32), method=model.module.read),
        params)
  assert list(tmp_path.iterdir()) == []


def test_an_out_of_memory_train_step_names_the_batch_shapes_and_the_bindings(tmp_path):
  """XLA's RESOURCE_EXHAUSTED raised inside the jitted step (here by the loss, as a too
  large batch would on an accelerator) comes out naming the batch and what to lower."""
  model = _model()

  def out_of_memory(*args, **kwargs):
    raise jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 81.00GiB.")

  model.loss_fn = out_of_memory
  with pytest.raises(resilience.OutOfMemoryError) as err:
    trainer.train(model=model, train_dataset_cfg=_cfg(), model_dir=str(tmp_path / "m"),
                  total_steps=2, optimizer=_optimizer(), show_example=False)
  message = str(err.value)
  assert (f"ran out of accelerator memory on a global batch of decoder_input_tokens "
          f"[8, {LENGTHS['targets']}]") in message
  assert f"encoder_input_tokens [8, {LENGTHS['inputs']}]" in message
  assert "Lower BATCH_SIZE (pipeline.DatasetConfig.batch_size) or TASK_FEATURE_LENGTHS" in message
  assert "XLA said: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 81.00GiB." \
      in message
  assert not list((tmp_path / "m").glob("checkpoint_*"))
  with pytest.raises(ValueError, match="not memory"):  # other errors pass unchanged
    with resilience.explain_out_of_memory({}):
      raise ValueError("not memory")


def test_dollar_pound_accents_cyrillic_cjk_and_emoji_round_trip_through_the_builtin_vocabulary():
  """Byte fallback: every byte of the text is spelled by some piece, none is unknown."""
  vocab = vocabularies.builtin_vocabulary()
  text = "Price: $5 or £3, café crème, жук, 中文, 🙂 — naïve Ørsted"
  ids = list(vocab.encode(text))
  assert vocab.unk_id not in ids
  assert vocab.decode(ids) == text
  pieces = [vocab.tokenizer.id_to_piece(i) for i in ids]
  assert "<0xD0>" in pieces and "<0xF0>" in pieces  # ж and 🙂 spelled in UTF-8 bytes
  assert pathlib.Path(vocab.sentencepiece_model_file).name.startswith(
      f"builtin_spm_{vocabularies.BUILTIN_VOCAB_SIZE}_bytes_")


# ================================================================ issue 21: a run read with
# another vocabulary than it was trained with (MODEL_DIR/vocabulary.json)
def _model_of(vocabulary):
  """The tiny model (4224 embedding rows) reading `vocabulary`."""
  return models.EncoderDecoderModel(_model().module, vocabulary, vocabulary)


def _chars_vocabulary():
  return vocabularies.builtin_vocabulary(recipe="chars")  # the recipe before byte fallback


def _tiny_vocabulary(path, words):
  """A SentencePiece model trained on a few sentences of `words` (read as T5's would be)."""
  texts = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20
  vocabularies.train_sentencepiece(texts, path, vocab_size=300)
  return vocabularies.t5_vocabulary(str(path))


def test_resuming_a_checkpoint_of_the_earlier_adafactor_factoring_names_the_setting(tmp_path):
  """Attention kernels [embed, heads, kv] used to keep a full second moment (optax's shape
  heuristic); now [embed] and [heads, kv] ones (T5X's axis names). An old run's optimizer
  state cannot be read into the new layout: refused naming the setting that reads it, and
  resumed with that setting."""
  from decal_jax import optimizers  # pylint: disable=g-import-not-at-top
  earlier = lambda: optimizers.adafactor(  # noqa: E731
      optimizers.rsqrt_schedule(0.5, warmup_steps=5), factor_by_axis_names=False)
  model_dir = tmp_path / "run"
  run = lambda steps, optimizer: trainer.train(  # noqa: E731  (as _train_tiny, any optimizer)
      model=_model(), train_dataset_cfg=_cfg(), model_dir=str(model_dir), total_steps=steps,
      optimizer=optimizer, checkpoint_period=1, eval_period=1000, eval_batches=1,
      log_period=1, show_example=False)
  run(1, earlier())
  before = _files(model_dir)
  with pytest.raises(checkpoints.OptimizerStateMismatchError) as err:
    _train_tiny(model_dir, 2)
  message = str(err.value)
  assert message.startswith(f"checkpoint_1 in {model_dir} is intact, with this run's "
                            "architecture, but its optimizer state has other shapes")
  assert "--gin.optimizers.adafactor.factor_by_axis_names=False" in message
  assert "Nothing was changed on disk." in message
  assert _files(model_dir) == before
  run(2, earlier())
  assert (model_dir / "checkpoint_2").is_dir()


@pytest.mark.parametrize("other", ["heuristic factoring", "adamw"])
def test_another_optimizer_state_is_refused_from_the_metadata_before_any_array_is_read(
    tmp_path, other):
  """The saved optimizer state's shapes (Orbax metadata) are compared with what this run's
  optimizer makes before restoring: the message names the leaf and both shapes, and no
  array of the state is read."""
  from flax.linen.partitioning import AxisMetadata  # pylint: disable=g-import-not-at-top
  from decal_jax import optimizers  # pylint: disable=g-import-not-at-top
  params = {"attn": {"kernel": jnp.zeros((8, 2, 3))}}
  axes = {"attn": {"kernel_axes": AxisMetadata(("embed", "heads", "kv"))}}
  written = (optimizers.adamw() if other == "adamw"
             else optimizers.adafactor(factor_by_axis_names=False))
  ckpt = checkpoints.Checkpointer(str(tmp_path))
  ckpt.save(1, {"params": params, "opt_state": written.init(params),
                "step": jnp.zeros((), jnp.int32)}, {"batches_consumed": 1}, force=True)
  current = optimizers.adafactor()
  optimizers.set_param_axes(current, axes)
  state = {"params": params, "opt_state": current.init(params), "step": jnp.zeros((), jnp.int32)}
  reads = []
  restore = ckpt.manager.restore
  ckpt.manager.restore = lambda step, args: reads.append(sorted(args.keys())) or restore(
      step, args=args)
  with pytest.raises(checkpoints.OptimizerStateMismatchError) as err:
    ckpt.restore(1, checkpoints.abstract_like(state))
  assert all("state" not in items for items in reads)
  message = str(err.value)
  if other == "adamw":  # AdamW's moments mu / nu in place of Adafactor's v_row / v_col
    assert "only in the model:      0/v_row/attn/kernel [8]" in message
    assert "only in the checkpoint: 1/0/mu/attn/kernel [8, 2, 3]" in message
  else:  # the full second moment the heuristic kept, [embed] / [heads, kv] ones now
    assert "shape differs:          0/v/attn/kernel checkpoint [8, 2, 3] vs model [1]" in message
    assert "0/v_col/attn/kernel checkpoint [1] vs model [2, 3]" in message
  ckpt.close()


def test_resuming_with_another_vocabulary_is_refused_naming_both_and_the_fix(
    two_checkpoints, tmp_path):
  model_dir = _copy(two_checkpoints, tmp_path)
  before = _files(model_dir)
  with pytest.raises(vocabulary_record.VocabularyMismatchError) as err:
    trainer.train(model=_model_of(_chars_vocabulary()), train_dataset_cfg=_cfg(),
                  model_dir=str(model_dir), total_steps=3, optimizer=_optimizer(),
                  show_example=False)
  message = str(err.value)
  assert message.startswith(f"{model_dir} was trained with another inputs vocabulary")
  assert ("vocabulary.json records the built-in vocabulary, recipe 'bytes' "
          "(builtin_spm_4000_bytes_") in message
  assert "this run has the built-in vocabulary, recipe 'chars' (builtin_spm_4000_" in message
  assert ("Fix: read it with the built-in vocabulary of recipe 'bytes': set "
          "DECAL_BUILTIN_VOCAB=bytes") in message
  assert "give another MODEL_DIR" in message
  assert _files(model_dir) == before


def test_starting_from_a_checkpoint_of_another_vocabulary_is_refused(two_checkpoints, tmp_path):
  """INITIAL_CHECKPOINT_PATH: the chars recipe's table has the same 4224 (padded) rows as the
  bytes one the run was trained with, so every row would be restored and mean another piece."""
  new_dir = tmp_path / "fine_tune"
  with gin.unlock_config():  # the task tokenizes with the model's vocabulary, as gin binds it
    gin.bind_parameter("decal_jax.data.vocabularies.task_vocabulary.vocabulary",
                       _chars_vocabulary())
  try:
    for start in (two_checkpoints, two_checkpoints / "checkpoint_2"):
      with pytest.raises(vocabulary_record.VocabularyMismatchError) as err:
        trainer.train(model=_model_of(_chars_vocabulary()), train_dataset_cfg=_cfg(),
                      model_dir=str(new_dir), total_steps=3, optimizer=_optimizer(),
                      initial_checkpoint_path=str(start), show_example=False)
      message = str(err.value)
      assert message.startswith(f"INITIAL_CHECKPOINT_PATH {start} was trained with another "
                                "inputs vocabulary than this run's")
      assert "Its embedding rows would be restored and read as other text" in message
      assert "DECAL_BUILTIN_VOCAB=bytes" in message
      assert not list(new_dir.glob("checkpoint_*"))
  finally:
    gin.clear_config()


@pytest.mark.parametrize("entry", ["evaluate", "infer", "restore_params"])
def test_eval_and_infer_of_a_run_trained_with_another_vocabulary_are_refused(
    two_checkpoints, tmp_path, entry):
  """A run trained with the 'chars' built-in vocabulary, read with today's 'bytes' one."""
  model_dir = _copy(two_checkpoints, tmp_path)
  vocabulary_record.write(str(model_dir),
                          vocabulary_record.model_record(_model_of(_chars_vocabulary())))
  before = _files(model_dir)
  with pytest.raises(vocabulary_record.VocabularyMismatchError) as err:
    if entry == "evaluate":
      evaluation.evaluate(model=_model(), eval_dataset_cfg=_cfg(split="validation"),
                          model_dir=str(model_dir), eval_batches=1)
    elif entry == "infer":
      evaluation.infer(model=_model(), inputs=["some text"], model_dir=str(model_dir),
                       task_feature_lengths=LENGTHS)
    else:
      _params(model_dir, None)  # what gin_utils.load_model and retrieval restore with
  message = str(err.value)
  assert message.startswith(f"{model_dir} was trained with another inputs vocabulary")
  assert "records the built-in vocabulary, recipe 'chars' (builtin_spm_4000_" in message
  assert "this run has the built-in vocabulary, recipe 'bytes'" in message
  assert ("Fix: read it with the built-in vocabulary of recipe 'chars': set "
          "DECAL_BUILTIN_VOCAB=chars") in message
  assert _files(model_dir) == before


def test_infer_with_another_sentencepiece_file_is_refused_naming_the_file_to_point_back_at(
    two_checkpoints, tmp_path):
  trained = _tiny_vocabulary(tmp_path / "trained.model", ["alpha", "beta", "gamma", "delta"])
  other = _tiny_vocabulary(tmp_path / "other.model", ["red", "green", "blue", "yellow"])
  model_dir = _copy(two_checkpoints, tmp_path)
  vocabulary_record.write(str(model_dir), vocabulary_record.model_record(_model_of(trained)))
  before = _files(model_dir)
  with pytest.raises(vocabulary_record.VocabularyMismatchError) as err:
    evaluation.infer(model=_model_of(other), inputs=["red"], model_dir=str(model_dir),
                     task_feature_lengths=LENGTHS)
  message = str(err.value)
  digest = hashlib.sha256((tmp_path / "trained.model").read_bytes()).hexdigest()
  assert f"records T5Vocabulary (trained.model, sha256 {digest[:12]}, " in message
  assert "this run has T5Vocabulary (other.model, sha256 " in message
  assert (f"Fix: point the vocabulary's path back at the file it was trained with, "
          f"trained.model (sha256 {digest[:12]}): DECAL_T5_VOCAB") in message
  assert _files(model_dir) == before
  # The same model under another name and folder is the same vocabulary: accepted.
  copy = tmp_path / "elsewhere" / "renamed.model"
  copy.parent.mkdir()
  shutil.copy(tmp_path / "trained.model", copy)
  assert vocabulary_record.check(str(model_dir),
                                 _model_of(vocabularies.t5_vocabulary(str(copy)))) is None


def test_a_run_without_a_vocabulary_record_warns_naming_it_and_gets_none_written(
    two_checkpoints, tmp_path, caplog):
  model_dir = _copy(two_checkpoints, tmp_path)
  (model_dir / vocabulary_record.FILENAME).unlink()  # a run from before the record
  before = _files(model_dir)
  with caplog.at_level(logging.WARNING):
    evaluation.infer(model=_model(), inputs=["some text"], model_dir=str(model_dir),
                     task_feature_lengths=LENGTHS)
  warnings = [r for r in caplog.records if "does not record the vocabulary" in r.getMessage()]
  assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
  message = warnings[0].getMessage()
  assert message.startswith(f"{model_dir} does not record the vocabulary")
  assert "DECAL_BUILTIN_VOCAB=chars" in message
  assert _files(model_dir) == before
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    _train_tiny(model_dir, 3)  # resumed: warned again, and still no record written
  assert any(f"{model_dir} does not record the vocabulary" in r.getMessage()
             for r in caplog.records)
  assert not (model_dir / vocabulary_record.FILENAME).exists()


def test_resuming_with_the_vocabulary_it_was_trained_with_goes_on(two_checkpoints, tmp_path,
                                                                   capsys):
  model_dir = _copy(two_checkpoints, tmp_path)
  record = (model_dir / vocabulary_record.FILENAME).read_bytes()
  # What the new run recorded: the file it read, its sha256, its recipe, for both features.
  vocab_file = pathlib.Path(vocabularies.builtin_vocabulary().sentencepiece_model_file)
  inputs = json.loads(record)["features"]["inputs"]
  assert json.loads(record)["features"]["targets"] == inputs
  assert inputs == {"class": "BuiltinVocabulary", "file": vocab_file.name, "recipe": "bytes",
                    "sha256": hashlib.sha256(vocab_file.read_bytes()).hexdigest(),
                    "vocab_size": vocabularies.builtin_vocabulary().vocab_size}
  _train_tiny(model_dir, 3)
  assert "Resuming from step 2" in capsys.readouterr().out
  assert (model_dir / "checkpoint_3").is_dir()
  assert (model_dir / vocabulary_record.FILENAME).read_bytes() == record


# ---------------------------------------------------------------- one trainer per MODEL_DIR
# and eval's output folder (issue 21 items 9 and 11: decal_jax/run_lock.py,
# evaluation.check_writable and EVAL_OUTPUT_DIR)
def _write_lock(model_dir, pid, host=None):
  """A lock file as a trainer that never released it would have left it."""
  lock = pathlib.Path(model_dir) / run_lock.LOCK_NAME
  lock.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                              "start_time": "2026-01-02T03:04:05+00:00",
                              "command": "python -m decal_jax.train --gin.MODEL_DIR=..."}))
  return lock


def _dead_pid():
  proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  return int(proc.stdout)  # reaped by subprocess.run: no such process any more


def test_a_second_trainer_on_a_model_dir_in_use_is_refused_naming_the_first(
    two_checkpoints, tmp_path):
  """A real first trainer: another process holding the lock through `run_lock.hold`, as
  `trainer.train` does for its whole run."""
  model_dir = _copy(two_checkpoints, tmp_path)
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time\nfrom decal_jax import run_lock\n"
       f"with run_lock.hold({str(model_dir)!r}, command='first trainer'):\n"
       "  print('held', flush=True)\n  time.sleep(600)"],
      env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    before = _files(model_dir)
    with pytest.raises(run_lock.ModelDirLockedError) as err:
      _train_tiny(model_dir, 3)
    message = str(err.value)
    assert f"MODEL_DIR {model_dir} is in use by another trainer: pid {holder.pid} on host " \
        f"{socket.gethostname()}, started " in message
    assert "(first trainer); it is running now" in message
    assert "Wait for that run to end" in message and "--gin.MODEL_DIR=" in message
    assert f"delete {model_dir / run_lock.LOCK_NAME}" in message
    assert _files(model_dir) == before  # checkpoints and the holder's lock untouched
  finally:
    holder.kill()
    holder.wait()


def test_a_lock_of_a_live_process_that_does_not_hold_it_is_still_refused(
    two_checkpoints, tmp_path):
  """The JSON names a process on this host that is alive (a sleeping subprocess): refused
  even without the flock (e.g. a trainer of an older version), never taken over."""
  model_dir = _copy(two_checkpoints, tmp_path)
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
  try:
    _write_lock(model_dir, sleeper.pid)
    before = _files(model_dir)
    with pytest.raises(run_lock.ModelDirLockedError,
                       match=rf"pid {sleeper.pid} on host .*; that process is still alive"):
      _train_tiny(model_dir, 3)
    assert _files(model_dir) == before
  finally:
    sleeper.kill()
    sleeper.wait()


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(
    two_checkpoints, tmp_path, capsys):
  model_dir = _copy(two_checkpoints, tmp_path)
  dead = _dead_pid()
  lock = _write_lock(model_dir, dead)
  first = _files(model_dir / "checkpoint_1")
  _train_tiny(model_dir, 3)
  out = capsys.readouterr().out
  assert (f"WARNING: {lock} was left by pid {dead} (2026-01-02T03:04:05+00:00), which is no "
          "longer running (a stale lock); taking it over.") in out
  assert "Resuming from step 2" in out  # nothing lost: the run went on from its checkpoint
  assert _files(model_dir / "checkpoint_1") == first
  assert checkpoints.Checkpointer(str(model_dir)).latest_step() == 3
  assert not lock.exists()  # released at the end


def test_the_lock_is_released_after_a_run_and_after_a_failed_one(tmp_path, capsys):
  model_dir = tmp_path / "m"
  _train(model_dir)
  assert not (model_dir / run_lock.LOCK_NAME).exists()
  typo = pipeline.DatasetConfig("decal_builtin_span_corruptoin", LENGTHS, batch_size=8)
  with pytest.raises(ValueError, match="Did you mean"):
    _train(model_dir, train_cfg=typo)  # an exception inside the locked run
  assert not (model_dir / run_lock.LOCK_NAME).exists()
  capsys.readouterr()
  _train(model_dir, total_steps=6, checkpoint_period=6, eval_period=6, log_period=6)
  out = capsys.readouterr().out
  assert "Resuming from step 3" in out and "WARNING" not in out  # no stale lock was found
  assert sorted(p.name for p in model_dir.iterdir() if p.name.startswith(".")) == []


def test_a_refused_run_in_a_new_model_dir_leaves_no_folder(tmp_path):
  """The lock creates MODEL_DIR; a run that stops before writing anything removes it."""
  typo = pipeline.DatasetConfig("decal_builtin_span_corruptoin", LENGTHS, batch_size=8)
  with pytest.raises(ValueError, match="Did you mean"):
    _train(tmp_path / "new" / "run", train_cfg=typo)
  assert list(tmp_path.iterdir()) == []


def test_a_lock_from_another_host_is_refused_with_how_to_override(two_checkpoints, tmp_path):
  model_dir = _copy(two_checkpoints, tmp_path)
  lock = _write_lock(model_dir, 4242, host="another-host.example")
  before = _files(model_dir)
  with pytest.raises(run_lock.ModelDirLockedError) as err:
    _train_tiny(model_dir, 3)
  message = str(err.value)
  assert "pid 4242 on host another-host.example, started 2026-01-02T03:04:05+00:00" in message
  assert "from another host, so this one cannot check whether that run is still alive" \
      in message
  assert f"if you are sure that run is over, delete {lock} and start again" in message
  assert _files(model_dir) == before


@pytest.fixture
def read_only(monkeypatch):
  """Makes a folder read-only: chmod a-w; where that denies nothing (root ignores
  permission bits, and no read-only mount is at hand), `os.access` is made to answer for
  that folder as it does for any other user, so the check is exercised either way."""
  made = []

  def make(folder):
    os.chmod(folder, 0o555)
    made.append(folder)
    if os.access(folder, os.W_OK):  # root
      real_access = os.access
      monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
          False if os.path.abspath(path) == os.path.abspath(folder) and mode & os.W_OK
          else real_access(path, mode, **kw)))
    return folder
  yield make
  for folder in made:
    os.chmod(folder, 0o755)


def test_eval_on_a_read_only_model_dir_is_refused_before_any_work_offering_eval_output_dir(
    two_checkpoints, tmp_path, read_only, monkeypatch):
  model_dir = read_only(_copy(two_checkpoints, tmp_path))
  before = _files(model_dir)
  monkeypatch.setattr(train_state, "restore_params", None)  # any model work would crash
  with pytest.raises(PermissionError) as err:
    gin_utils.run(evaluation.evaluate, ["--gin_file=runs/eval_builtin.gin",
                                        f"--gin.MODEL_DIR='{model_dir}'"])
  message = str(err.value)
  assert f"MODEL_DIR (evaluation.evaluate.model_dir) = {str(model_dir)!r} is not writable" \
      in message
  assert "--gin.EVAL_OUTPUT_DIR=\"'/tmp/my_eval'\"" in message
  assert _files(model_dir) == before
  # The fix as offered: a macro that the eval gin files read (so the misspelled-macro check
  # accepts it), bound to evaluate's output folder.
  gin_utils.parse(*gin_utils.split_args(["--gin_file=runs/eval_builtin.gin",
                                         f"--gin.MODEL_DIR='{model_dir}'",
                                         "--gin.EVAL_OUTPUT_DIR='/tmp/my_eval'"]))
  assert gin.query_parameter("evaluation.evaluate.output_dir").scoped_selector == \
      "EVAL_OUTPUT_DIR/gin.macro"
  assert gin.query_parameter("%EVAL_OUTPUT_DIR") == "/tmp/my_eval"


def test_eval_output_dir_gets_the_results_of_a_read_only_model_dir(
    two_checkpoints, tmp_path, read_only, builtin_vocabulary):
  del builtin_vocabulary  # decal_builtin_qa tokenizes with the tiny model's vocabulary
  model_dir = read_only(_copy(two_checkpoints, tmp_path))
  before = _files(model_dir)
  out = tmp_path / "my_eval"
  cfg = pipeline.DatasetConfig("decal_builtin_qa", LENGTHS, batch_size=8, split="validation")
  result = evaluation.evaluate(model=_model(), eval_dataset_cfg=cfg, model_dir=str(model_dir),
                               eval_batches=1, max_predict_examples=3, output_dir=str(out))
  scores = inference_eval.read_metrics(str(out), "decal_builtin_qa", 2)
  assert scores["em"] == result["decal_builtin_qa/em"]
  assert len(inference_eval.read_inferences(str(out), "decal_builtin_qa", 2)) == 3
  assert list((out / "training_eval" / "decal_builtin_qa").glob("events.out.tfevents.*"))
  assert _files(model_dir) == before


TWO_PROCESS_HOLD = """
import sys
import jax
from decal_jax import run_lock
jax.distributed.initialize(f"localhost:{sys.argv[1]}", num_processes=2,
                           process_id=int(sys.argv[2]))
try:
  with run_lock.hold(sys.argv[3]):
    print("RESULT ran", flush=True)
except run_lock.ModelDirLockedError as e:
  print("RESULT refused:", e, flush=True)
"""


@pytest.mark.parametrize("locked", [False, True])
def test_a_refused_multi_process_run_stops_every_process(tmp_path, locked):
  """Process 0 alone takes the lock; refused, it tells the others, which would otherwise
  wait for it in their first collective."""
  from test_partitioning import _env
  model_dir = tmp_path / "m"
  model_dir.mkdir()
  if locked:
    _write_lock(model_dir, 4242, host="another-host.example")
  port = processes.free_port()
  procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESS_HOLD, str(port), str(i),
                             str(model_dir)], env=dict(_env(), PYTHONPATH=str(REPO)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = processes.communicate_all(procs, timeout=300)
  assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outs]
  out0, out1 = ([line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
                for out, _ in outs)  # (the rest: Gloo's notes)
  if not locked:
    assert out0 == out1 == ["ran"] and list(model_dir.iterdir()) == []  # released
    return
  assert len(out0) == len(out1) == 1  # refused, and neither ran the locked block
  assert out0[0].startswith("refused: MODEL_DIR ") and "another-host.example" in out0[0]
  assert out1[0].startswith(f"refused: Process 0 could not lock MODEL_DIR {model_dir}")
  assert json.loads((model_dir / run_lock.LOCK_NAME).read_text())["pid"] == 4242
