"""Interrupting a run (Ctrl-C / SIGTERM saves the step and the same command resumes) and input
past a limit (a JSONL file given to the plain-text task, an infer input or Squid question
longer than the model reads, an out-of-memory step): each warned or refused by name."""
import fcntl
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

import gin
import jax
import jax.numpy as jnp
import pytest

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax.runtime import checkpoints, evaluation, gin_utils, resilience, trainer
from decal_jax import fileio
from decal_jax.data import local_files, pipeline, vocabularies

import paths
from retrieval.test_retrieval_index import _build, _ragged_corpus
from test_trainer import LENGTHS, _cfg, _model, _optimizer

from bad_input_helpers import _load_tool, _write, _examples, _train, _copy, _files


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
  assert "input 2 (from 1" in warning.getMessage() and f"has {length}." in warning.getMessage()
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
  assert "--question number 2 ('Which statement" in message
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


def test_an_out_of_memory_infer_names_the_batch_shapes_the_beam_and_the_bindings(
    two_checkpoints, tmp_path):
  """XLA's RESOURCE_EXHAUSTED from infer's decoding (injected in the model's decode, as a
  too large batch or beam would raise it on an accelerator) names the batch and what to
  lower; nothing is written."""
  model_dir = _copy(two_checkpoints, tmp_path)
  before = _files(model_dir)
  model = _model()

  def out_of_memory(*args, **kwargs):
    raise jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 40.00GiB.\nmore lines")

  model.predict_batch = out_of_memory
  vocab = vocabularies.builtin_vocabulary()
  texts = ["short text", "a somewhat longer input text"]
  longest = max(len(vocab.encode(t)) for t in texts) + 1  # with EOS
  output = tmp_path / "out.jsonl"
  with pytest.raises(resilience.OutOfMemoryError) as err:
    evaluation.infer(model=model, inputs=texts, model_dir=str(model_dir),
                     task_feature_lengths=LENGTHS, batch_size=4, num_decodes=3,
                     output_file=str(output))
  message = str(err.value)
  assert message.startswith(
      f"Decoding (infer) ran out of accelerator memory on a global batch of "
      f"decoder_input_tokens [4, {LENGTHS['targets']}], encoder_input_tokens [4, {longest}] "
      "([batch size, length]) with NUM_DECODES = 3 decodes per input.")
  assert ("Lower the batch size (--gin.evaluation.infer.batch_size=8), TASK_FEATURE_LENGTHS "
          "(its 'inputs' and 'targets'), or NUM_DECODES (evaluation.infer.num_decodes, the "
          "beam).") in message
  assert message.endswith("XLA said: RESOURCE_EXHAUSTED: Out of memory while trying to "
                          "allocate 40.00GiB.")
  assert not output.exists() and _files(model_dir) == before


# ---------------------------------------------------------------- issue 48: what a build
# killed outright (kill -9) leaves
def _killed_build(target):
  """The `<target>.tmp-<random>` folder of an `atomic_directory` build killed with -9."""
  code = ("import sys, time\nfrom decal_jax import fileio\n"
          "build = fileio.atomic_directory(sys.argv[1])\ntmp = build.__enter__()\n"
          "(tmp / 'vectors.npy').write_bytes(b'part of an index')\n"
          "print(tmp, flush=True)\ntime.sleep(600)\n")
  proc = subprocess.Popen([sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE,
                          text=True, env=dict(os.environ, PYTHONPATH=str(paths.REPO)))
  left = pathlib.Path(proc.stdout.readline().strip())
  proc.kill()  # SIGKILL: no cleanup runs
  proc.wait()
  proc.stdout.close()
  assert left.is_dir() and left.name.startswith(f"{target.name}.tmp-")
  return left


def test_a_rerun_removes_the_temporary_folder_a_killed_index_build_left(tmp_path, caplog):
  target = tmp_path / "idx"
  killed = _killed_build(target)
  old = _write(tmp_path / "idx.tmp-oldbuild" / "vectors.npy", b"x").parent  # no owner file:
  os.utime(old, (time.time() - 3600,) * 2)  # from before owner files, an hour old
  young = _write(tmp_path / "idx.tmp-justmade" / "vectors.npy", b"x").parent  # just created
  running = _write(tmp_path / "idx.tmp-running1" / fileio.OWNER_FILE, b"{}").parent
  holder = os.open(running / fileio.OWNER_FILE, os.O_RDWR)
  fcntl.flock(holder, fcntl.LOCK_EX)  # a build running now holds its owner file
  others = [_write(tmp_path / name / "f", b"mine").parent
            for name in ("idx.tmp-123", "idx.tmp-backup!!", "other.tmp-abcdefgh", "idx.bak")]
  try:
    with caplog.at_level(logging.WARNING):
      built = _build(target, _ragged_corpus())
  finally:
    os.close(holder)
  assert built.num_docs == 23 and not killed.exists() and not old.exists()
  assert young.is_dir() and running.is_dir() and all((o / "f").read_bytes() == b"mine"
                                                     for o in others)
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 2
  by_kill = next(w for w in warnings if w.startswith(f"Removed {killed},"))
  assert by_kill.startswith(f"Removed {killed}, the temporary folder of a build of {target} "
                            "that was killed before it finished (pid ")
  assert by_kill.endswith("no longer holds it).")
  assert (f"Removed {old}, the temporary folder of a build of {target} that was killed before "
          "it finished (no owner file, unchanged for 60 minutes).") in warnings
  assert not list(target.glob(".tmp-owner"))


def test_export_t5x_removes_the_temporary_folder_a_killed_export_left(two_checkpoints, tmp_path,
                                                                     caplog):
  out = tmp_path / "t5x"
  killed = _killed_build(out / "checkpoint_2")
  export = _load_tool("export_t5x")
  with caplog.at_level(logging.WARNING):
    assert export.main(["--checkpoint", str(two_checkpoints), "--out", str(out)]) == 0
  assert not killed.exists() and sorted(p.name for p in out.iterdir()) == ["checkpoint_2"]
  assert (out / "checkpoint_2" / "checkpoint").is_file()
  assert not (out / "checkpoint_2" / fileio.OWNER_FILE).exists()
  assert any(r.getMessage().startswith(f"Removed {killed}, the temporary folder of a build of "
                                       f"{out / 'checkpoint_2'}") for r in caplog.records)
