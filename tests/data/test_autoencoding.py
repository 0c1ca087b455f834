"""Autoencoding / continuation preprocessors and the 1:1 mixture (CCProxy's recipe)."""
import numpy as np
import pytest
import seqio
import tensorflow as tf

import decal_jax.tasks  # noqa: F401  (registers the seqio tasks)
from decal_jax import models
from decal_jax.data import pipeline
from decal_jax.data import autoencoding, vocabularies
from decal_jax.networks.t5 import T5Config, Transformer


def _docs(*lengths):
  """Tokenized documents whose ids count up across documents: 1, 2, 3, ..."""
  out, start = [], 1
  for n in lengths:
    out.append(list(range(start, start + n)))
    start += n
  return tf.data.Dataset.from_generator(
      lambda: ({"targets": np.array(d, np.int32)} for d in out),
      output_signature={"targets": tf.TensorSpec([None], tf.int32)})


def _list(ds):
  return [{k: v.tolist() for k, v in ex.items()} for ex in ds.as_numpy_iterator()]


def test_autoencode_hand_worked():
  got = _list(autoencoding.autoencode(_docs(3, 4), {"inputs": 4, "targets": 4}))
  assert got == [{"inputs": [1, 2, 3], "targets": [1, 2, 3]},
                 {"inputs": [4, 5, 6], "targets": [4, 5, 6]},
                 {"inputs": [7], "targets": [7]}]


def test_continuation_hand_worked():
  # inputs 4 -> 3 prefix tokens, targets 3 -> 2 continuation tokens: chunks of 5.
  got = _list(autoencoding.continuation(_docs(6, 6), {"inputs": 4, "targets": 3}))
  assert got == [{"inputs": [1, 2, 3], "targets": [4, 5]},
                 {"inputs": [6, 7, 8], "targets": [9, 10]},
                 {"inputs": [11], "targets": [12]}]  # short chunk: target first, input >= 1


def test_continuation_pieces_rebuild_the_stream():
  lengths = {"inputs": 17, "targets": 9}
  got = _list(autoencoding.continuation(_docs(40, 7, 100, 3), lengths))
  stream = [t for ex in got for t in ex["inputs"] + ex["targets"]]
  assert stream == list(range(1, 151))
  assert all(1 <= len(ex["inputs"]) <= 16 and 1 <= len(ex["targets"]) <= 8 for ex in got)


class _MarkerVocabulary:
  """Encodes the two task markers only: 'reconstruct:' -> [90, 91], 'continue:' -> [92]."""
  IDS = {autoencoding.AUTOENCODE_MARKER: [90, 91], autoencoding.CONTINUATION_MARKER: [92]}

  def encode(self, text):
    return self.IDS[text]


MARKER_FEATURES = {"targets": seqio.Feature(_MarkerVocabulary())}


def test_marked_autoencode_hand_worked():
  # targets 6 = marker (2) + chunk (3) + EOS (1); inputs 4 = chunk (3) + EOS: chunks of 3.
  got = _list(autoencoding.marked_autoencode(_docs(3, 4), {"inputs": 4, "targets": 6},
                                             MARKER_FEATURES))
  assert got == [{"inputs": [1, 2, 3], "targets": [90, 91, 1, 2, 3]},
                 {"inputs": [4, 5, 6], "targets": [90, 91, 4, 5, 6]},
                 {"inputs": [7], "targets": [90, 91, 7]}]
  # targets = inputs = 4: the 2 marker tokens shrink the chunk to 4 - 2 - 1 = 1 token.
  got = _list(autoencoding.marked_autoencode(_docs(2), {"inputs": 4, "targets": 4},
                                             MARKER_FEATURES))
  assert got == [{"inputs": [1], "targets": [90, 91, 1]}, {"inputs": [2], "targets": [90, 91, 2]}]


def test_marked_continuation_hand_worked():
  # targets 4 = marker (1) + next part (2) + EOS: the unmarked hand-worked case's parts.
  got = _list(autoencoding.marked_continuation(_docs(6, 6), {"inputs": 4, "targets": 4},
                                               MARKER_FEATURES))
  assert got == [{"inputs": [1, 2, 3], "targets": [92, 4, 5]},
                 {"inputs": [6, 7, 8], "targets": [92, 9, 10]},
                 {"inputs": [11], "targets": [92, 12]}]


def test_a_marker_that_leaves_no_room_is_refused():
  with pytest.raises(ValueError, match="task marker's 2 tokens; give 'targets' >= 4"):
    autoencoding.marked_autoencode(_docs(3), {"inputs": 4, "targets": 3}, MARKER_FEATURES)


def test_mixture_is_about_half_autoencoding_and_marks_every_target():
  """Each target opens with its task's marker; an autoencoding target is then the input."""
  vocab = vocabularies.builtin_vocabulary()
  reconstruct = vocab.encode(autoencoding.AUTOENCODE_MARKER)
  cont = vocab.encode(autoencoding.CONTINUATION_MARKER)
  assert reconstruct[0] != cont[0]  # the first target token tells the two apart
  lengths = {"inputs": 64, "targets": 64}
  ds = seqio.get_mixture_or_task("decal_builtin_autoencode_continuation").get_dataset(
      lengths, split="train", shuffle=True, seed=3)
  kinds = []
  for ex in ds.take(400).as_numpy_iterator():
    inputs, targets = ex["inputs"].tolist(), ex["targets"].tolist()
    is_autoencode = targets[:len(reconstruct)] == reconstruct
    assert is_autoencode or targets[:len(cont)] == cont
    if is_autoencode:
      assert targets == reconstruct + inputs and len(targets) <= 64
    kinds.append(is_autoencode)
  share = np.mean(kinds)
  assert 0.4 < share < 0.6, share  # binomial(400, 0.5): 4.0 standard deviations either side


def test_plain_autoencode_tasks_stay_unmarked():
  """Dodo, the retention tool and your own text read the plain objective: target = input."""
  for name in ("decal_builtin_autoencode", "decal_c4_autoencode", "decal_text_autoencode",
               "decal_public_text_autoencode"):
    preprocessors = seqio.get_mixture_or_task(name).preprocessors
    assert autoencoding.autoencode in preprocessors, name
    assert autoencoding.marked_autoencode not in preprocessors, name
  ds = seqio.get_mixture_or_task("decal_builtin_autoencode").get_dataset(
      {"inputs": 32, "targets": 32}, split="train", shuffle=False)
  for ex in ds.take(3).as_numpy_iterator():
    np.testing.assert_array_equal(ex["inputs"], ex["targets"])


def test_autoencoding_with_short_targets_is_refused():
  vocab = vocabularies.builtin_vocabulary()
  model = models.EncoderDecoderModel(Transformer(T5Config(vocab_size=4224)), vocab, vocab)
  cfg = pipeline.DatasetConfig("decal_builtin_autoencode_continuation",
                               {"inputs": 64, "targets": 16})
  with pytest.raises(ValueError, match="autoencodes.*Set 'targets' >= 'inputs'"):
    pipeline.check_feature_lengths(cfg, model)


# --------------------------------------------------------------------------- metrics, own text
def test_autoencoding_tasks_report_bleu_and_carry_their_text():
  from decal_jax import text_metrics
  for name in ("decal_builtin_autoencode", "decal_c4_autoencode", "decal_text_autoencode"):
    assert seqio.get_mixture_or_task(name).predict_metric_fns == [text_metrics.bleu], name
  assert not seqio.get_mixture_or_task("decal_builtin_continuation").predict_metric_fns
  vocab = vocabularies.builtin_vocabulary()
  ds = seqio.get_mixture_or_task("decal_builtin_autoencode").get_dataset(
      {"inputs": 32, "targets": 32}, split="validation", shuffle=False)
  for ex in ds.take(3).as_numpy_iterator():
    # the text is the chunk's ids decoded (EOS dropped), for inputs and targets alike
    assert vocab.decode(ex["targets"].tolist()[:-1]) == ex["targets_pretokenized"].decode()
    assert ex["inputs_pretokenized"] == ex["targets_pretokenized"]


def test_c4_autoencoding_tokenizes_with_the_models_vocabulary(builtin_vocabulary):
  task = seqio.get_mixture_or_task("decal_c4_autoencode")
  assert task.output_features["targets"].vocabulary == builtin_vocabulary


TEXTS = ["The pass statement does nothing.", "A for loop repeats a block.",
         "Names are bound by assignment."]


def _write_jsonl(path, texts, field="text"):
  import json
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))


def _stream_of(task_name, lengths):
  ds = seqio.get_mixture_or_task(task_name).get_dataset(lengths, split="train", shuffle=False,
                                                        num_epochs=1)
  examples = list(ds.as_numpy_iterator())
  for ex in examples:
    np.testing.assert_array_equal(ex["inputs"], ex["targets"])  # the target is the input
    assert ex["inputs"][-1] == 1 and len(ex["inputs"]) <= lengths["inputs"]
  return examples, [t for ex in examples for t in ex["inputs"][:-1].tolist()]


def test_register_text_autoencode_task_reads_your_file(tmp_path, builtin_vocabulary):
  from decal_jax.tasks import autoencoding_tasks
  _write_jsonl(tmp_path / "mine.jsonl", TEXTS, field="body")
  autoencoding_tasks.register_text_autoencode_task(
      "my_autoencode", {"train": str(tmp_path / "mine.jsonl")}, field="body")
  try:
    lengths = {"inputs": 8, "targets": 8}
    examples, stream = _stream_of("my_autoencode", lengths)
    # the texts back to back, tokenized in Python, cut into chunks of 7 tokens + EOS
    want = [t for text in TEXTS for t in builtin_vocabulary.encode(text)]
    assert stream == want
    assert [len(ex["inputs"]) - 1 for ex in examples[:-1]] == [7] * (len(examples) - 1)
    wide = {"inputs": 64, "targets": 64}  # everything in one chunk: its text is all texts
    (only,), _ = _stream_of("my_autoencode", wide)
    assert only["targets_pretokenized"].decode() == builtin_vocabulary.decode(want)
  finally:
    seqio.TaskRegistry.remove("my_autoencode")


def test_text_autoencode_task_reads_the_local_folder(tmp_path, monkeypatch, builtin_vocabulary):
  lengths = {"inputs": 64, "targets": 64}
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  with pytest.raises(FileNotFoundError, match="text_autoencode.*DECAL_LOCAL_DATA_DIR"):
    _stream_of("decal_text_autoencode", lengths)
  _write_jsonl(tmp_path / "text_autoencode" / "train.jsonl", TEXTS)
  _, stream = _stream_of("decal_text_autoencode", lengths)
  assert stream == [t for text in TEXTS for t in builtin_vocabulary.encode(text)]
