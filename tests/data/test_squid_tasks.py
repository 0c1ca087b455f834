"""Squid's curriculum tasks (tasks/squid_tasks.py), read through SquidFeatureConverter and
checked against the corpus / records tokenized here in Python."""
import functools
import json

import numpy as np
import pytest
import seqio
import tensorflow as tf

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax import models
from decal_jax import text_metrics
from decal_jax.data import corpus, seqio_vocabularies, vocabularies
from decal_jax.tasks import downstream_tasks, squid_tasks

LENGTHS = {"inputs": 64, "query": 16, "targets": 80}
EOS = 1


@functools.lru_cache(maxsize=None)
def _vocab():
  return vocabularies.builtin_vocabulary()


@functools.lru_cache(maxsize=None)
def _validation_stream():
  """The built-in validation documents tokenized one by one in Python, back to back."""
  return np.array([t for doc in corpus.documents()["validation"] for t in _vocab().encode(doc)])


def _converted(name, n, lengths=LENGTHS):
  ds = seqio.get_dataset(name, lengths, feature_converter=models.SquidFeatureConverter(pack=False),
                         dataset_split="validation", shuffle=False)
  return list(ds.take(n).as_numpy_iterator())


def _real(tokens):
  return [int(t) for t in tokens if t != 0]


def _is_window(sequence, stream):
  windows = np.lib.stride_tricks.sliding_window_view(stream, len(sequence))  # [starts, len]
  return bool((windows == np.asarray(sequence)).all(axis=1).any())


# ------------------------------------------------------------------------------ registration
STAGE_OF = {"decal_builtin_squid_restore": "restore", "decal_c4_squid_restore": "restore",
            "decal_text_squid_restore": "restore", "decal_builtin_squid_continue": "continue",
            "decal_c4_squid_continue": "continue", "decal_text_squid_continue": "continue",
            "decal_builtin_squid_qa": "qa", "decal_squad_squid": "qa",
            "decal_squid_qa_jsonl": "qa"}


@pytest.mark.parametrize("name", sorted(STAGE_OF))
def test_every_task_has_the_squid_features(name):
  task, stage = seqio.get_mixture_or_task(name), STAGE_OF[name]
  features = task.output_features
  assert sorted(features) == ["inputs", "query", "targets"]
  assert not features["inputs"].add_eos and not features["query"].add_eos
  assert features["targets"].add_eos == (stage != "continue")
  assert len({id(f.vocabulary) for f in features.values()}) == 1  # one vocabulary
  builtin = name.startswith("decal_builtin")
  assert isinstance(features["targets"].vocabulary,
                    seqio_vocabularies.BuiltinVocabulary if builtin
                    else seqio_vocabularies.DeferredVocabulary)
  want_metrics = {"restore": [text_metrics.bleu], "continue": [], "qa": [text_metrics.squad]}
  assert task.predict_metric_fns == want_metrics[stage]


# ------------------------------------------------------------------------------ stage 1
def test_restoration_targets_are_the_context_plus_eos():
  examples = _converted("decal_builtin_squid_restore", 4)
  prompt = _vocab().encode(squid_tasks.RESTORE_PROMPT)
  chunks = []
  for ex in examples:
    context = _real(ex["encoder_input_tokens"])
    assert len(context) == LENGTHS["inputs"]  # a full chunk, no EOS
    want = context + [EOS] + [0] * (LENGTHS["targets"] - len(context) - 1)
    assert ex["decoder_target_tokens"].tolist() == want
    assert ex["query_tokens"].tolist() == prompt + [0] * (LENGTHS["query"] - len(prompt))
    chunks += context
  # the chunks, back to back, are the start of the tokenized validation documents
  assert chunks == _validation_stream()[:len(chunks)].tolist()


def test_restoration_refuses_targets_shorter_than_inputs_plus_eos():
  with pytest.raises(ValueError, match=r"TASK_FEATURE_LENGTHS\['targets'\] >= 65"):
    _converted("decal_builtin_squid_restore", 1, dict(LENGTHS, targets=64))
  with pytest.raises(ValueError, match=r"TASK_FEATURE_LENGTHS\['query'\] = 4"):
    _converted("decal_builtin_squid_restore", 1, dict(LENGTHS, query=4))


def test_restoration_text_is_the_chunk_for_bleu():
  task = seqio.get_mixture_or_task("decal_builtin_squid_restore")
  ex = next(task.get_dataset(LENGTHS, split="validation", shuffle=False).as_numpy_iterator())
  assert ex["inputs_pretokenized"] == ex["targets_pretokenized"]
  assert ex["targets_pretokenized"].decode() == _vocab().decode(ex["inputs"].tolist())


# ------------------------------------------------------------------------------ stage 2
def test_continuation_pieces_are_a_window_of_the_corpus_stream():
  examples = _converted("decal_builtin_squid_continue", 4)
  joined = []
  for ex in examples:
    first, rest = _real(ex["encoder_input_tokens"]), _real(ex["decoder_target_tokens"])
    assert (len(first), len(rest)) == (LENGTHS["inputs"], LENGTHS["targets"])
    assert EOS not in rest  # a continuation, not an ending
    assert not ex["query_tokens"].any()  # CONTINUE_PROMPT is empty
    joined += first + rest
  assert _is_window(joined, _validation_stream())


# ------------------------------------------------------------------------------ stage 3
def test_builtin_qa_holds_context_question_and_first_answer():
  examples = _converted("decal_builtin_squid_qa", 3)
  records = corpus.titled_documents()["validation"][:3]
  vocab = _vocab()
  for ex, record in zip(examples, records):
    context = _real(ex["encoder_input_tokens"])
    assert context == vocab.encode(record["text"])[:LENGTHS["inputs"]]  # long contexts cut
    assert record["text"].startswith(vocab.decode(context))
    assert vocab.decode(_real(ex["query_tokens"])) == downstream_tasks.BUILTIN_QA_QUESTION
    answer = _real(ex["decoder_target_tokens"])
    assert answer[-1] == EOS and vocab.decode(answer[:-1]) == record["title"]


QA_RECORDS = [
    {"question": "What is the capital of France?", "context": "Paris is the capital of France.",
     "answers": "Paris"},
    {"question": "How many legs does a cat have?", "context": "A cat walks on four legs.",
     "answers": ["four", "4"]},
]


def _write_jsonl(path, records):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _check_qa_examples(task_name, records, vocab):
  task = seqio.get_mixture_or_task(task_name)
  examples = list(task.get_dataset(LENGTHS, split="validation", shuffle=False)
                  .as_numpy_iterator())
  assert len(examples) == len(records)
  for ex, record in zip(examples, records):
    answers = record["answers"] if isinstance(record["answers"], list) else [record["answers"]]
    assert vocab.decode(ex["inputs"].tolist()) == record["context"]
    assert vocab.decode(ex["query"].tolist()) == record["question"]
    assert ex["targets"][-1] == EOS and vocab.decode(ex["targets"][:-1].tolist()) == answers[0]
    assert task.postprocess_fn(b"", example=ex, is_target=True) == answers  # every reference


def test_register_squid_qa_jsonl_task_reads_string_and_list_answers(tmp_path):
  renamed = [{"passage": r["context"], **{k: v for k, v in r.items() if k != "context"}}
             for r in QA_RECORDS]
  _write_jsonl(tmp_path / "qa.jsonl", renamed)
  squid_tasks.register_squid_qa_jsonl_task(
      "test_squid_qa", {"validation": str(tmp_path / "qa.jsonl")}, fields={"context": "passage"},
      vocabulary=_vocab())
  try:
    _check_qa_examples("test_squid_qa", QA_RECORDS, _vocab())
  finally:
    seqio.TaskRegistry.remove("test_squid_qa")


@pytest.mark.parametrize("name,folder", [("decal_squid_qa_jsonl", "squid_qa"),
                                         ("decal_squad_squid", "squad")])
def test_local_folder_qa_tasks(name, folder, tmp_path, monkeypatch, builtin_vocabulary):
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  if name == "decal_squid_qa_jsonl":  # local files only: a missing folder names the task
    with pytest.raises(FileNotFoundError, match="decal_squid_qa_jsonl.*squid_qa"):
      seqio.get_mixture_or_task(name).get_dataset(LENGTHS, split="validation")
  _write_jsonl(tmp_path / folder / "validation.jsonl", QA_RECORDS)
  _check_qa_examples(name, QA_RECORDS, builtin_vocabulary)


def test_contexts_without_tokens_are_dropped():
  contexts = ["The pass statement does nothing.", "", "   ", "A for loop repeats a block."]

  def records(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices({
        "question": ["What does it do?"] * len(contexts), "context": contexts,
        "answers": tf.ragged.constant([["something"]] * len(contexts))})

  source = seqio.FunctionDataSource(records, splits=("validation",))
  squid_tasks.register_squid_qa_task("test_squid_empty", source, _vocab())
  try:
    ds = seqio.get_dataset("test_squid_empty", LENGTHS,
                           feature_converter=models.SquidFeatureConverter(pack=False),
                           dataset_split="validation", shuffle=False)
    got = [_vocab().decode(_real(ex["encoder_input_tokens"])) for ex in ds.as_numpy_iterator()]
    assert got == [contexts[0], contexts[3]]
  finally:
    seqio.TaskRegistry.remove("test_squid_empty")


# ------------------------------------------------------------------------------ your own text
TEXTS = ["The pass statement does nothing.", "A for loop repeats a block.",
         "Names are bound by assignment."]


def test_text_tasks_read_the_text_autoencode_folder(tmp_path, monkeypatch, builtin_vocabulary):
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  lengths = {"inputs": 8, "query": 16, "targets": 9}
  with pytest.raises(FileNotFoundError, match="decal_text_squid_restore.*text_autoencode"):
    _converted("decal_text_squid_restore", 1, lengths)
  _write_jsonl(tmp_path / "text_autoencode" / "validation.jsonl", [{"text": t} for t in TEXTS])
  stream = [t for text in TEXTS for t in builtin_vocabulary.encode(text)]
  restored = _converted("decal_text_squid_restore", 100, lengths)
  full = len(stream) // 8 * 8  # whole 8-token chunks; the shorter tail is dropped
  assert [t for ex in restored for t in _real(ex["encoder_input_tokens"])] == stream[:full]
  assert all(len(_real(ex["encoder_input_tokens"])) == 8 for ex in restored)
  for ex in restored:
    assert _real(ex["decoder_target_tokens"]) == _real(ex["encoder_input_tokens"]) + [EOS]
  continued = _converted("decal_text_squid_continue", 100, lengths)
  pieces = [t for ex in continued
            for t in _real(ex["encoder_input_tokens"]) + _real(ex["decoder_target_tokens"])]
  assert pieces == stream[:len(stream) // 17 * 17]  # whole 8 + 9 chunks; the tail is dropped
