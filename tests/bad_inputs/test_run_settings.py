"""Bad run settings: misspelled gin macros (named with the closest one), zero / negative /
fractional steps, periods, batch sizes and lengths, unknown tasks and a MODEL_DIR that is a
file; each refused before any work, naming the binding."""
import os
import re
import subprocess
import sys

import gin
import pytest

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax.runtime import evaluation, gin_utils, trainer
from decal_jax.data import pipeline

import paths
from test_trainer import LENGTHS, _cfg, _model

from bad_input_helpers import _files, _train

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
  with pytest.raises(pipeline.UnknownTaskError) as err:
    _train(tmp_path / "m", train_cfg=typo)
  message = str(err.value)
  assert "MIXTURE_OR_TASK_NAME" in message and "'decal_builtin_span_corruptoin'" in message
  assert "Did you mean decal_builtin_span_corruption" in message
  assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("entry,gin_file,binding,setting,closest", [
    ("train", "runs/pretrain_builtin.gin", "MIXTURE_OR_TASK_NAME='decal_builtin_qa_typo'",
     "MIXTURE_OR_TASK_NAME (pipeline.DatasetConfig.mixture_or_task_name) = "
     "'decal_builtin_qa_typo': no seqio task or mixture", "decal_builtin_qa"),
    ("eval", "runs/eval_builtin.gin", "MIXTURE_OR_TASK_NAME='decal_builtin_qa_typo'",
     "MIXTURE_OR_TASK_NAME (pipeline.DatasetConfig.mixture_or_task_name) = "
     "'decal_builtin_qa_typo': no seqio task or mixture", "decal_builtin_qa"),
    ("retrieve", "runs/retrieve_builtin.gin", "BEIR_TASK='decal_beir_bultin'",
     "BEIR_TASK (retrieval_eval.evaluate_retrieval.task_name) = 'decal_beir_bultin': no BEIR "
     "task", "decal_beir_builtin")])
def test_a_mistyped_task_on_the_command_line_names_the_closest_before_model_dir_gets_a_file(
    tmp_path, capsys, entry, gin_file, binding, setting, closest):
  """issue 46: `--gin.MIXTURE_OR_TASK_NAME="'decal_builtin_qa_typo'"` was a ValueError
  traceback from inside the run. The entry points check the task names gin binds once it is
  parsed: refused with the binding, the closest registered names and the command that lists
  them; a run's MODEL_DIR stays as it was, a new one is not made."""
  import importlib
  from decal_jax.commands import list_tasks
  main = importlib.import_module(f"decal_jax.{entry}").main
  run_dir = tmp_path / "run"  # a run's MODEL_DIR (eval, retrieve) and a new one (train)
  (run_dir / "checkpoint_2").mkdir(parents=True)
  (run_dir / "config.gin").write_text("# the run's\n")
  before = _files(run_dir)
  for model_dir in (run_dir, tmp_path / "new"):
    with pytest.raises(gin_utils.GinConfigError) as err:
      main([f"--gin_file={gin_file}", f"--gin.MODEL_DIR='{model_dir}'", f"--gin.{binding}"])
    message = str(err.value)
    assert message.startswith(f"error: {setting} has that name. Did you mean {closest}")
    assert message.endswith("`decal-list-tasks` (or `python -m decal_jax.commands.list_tasks`) "
                            "lists the registered names (" + (
                                gin_utils.BEIR_OF_YOUR_OWN if entry == "retrieve"
                                else pipeline.OWN_TASKS) + ").")
    assert "Traceback" not in message
  assert _files(run_dir) == before and not (tmp_path / "new").exists()
  # The command the message names lists the name meant.
  capsys.readouterr()
  assert list_tasks.main([closest]) == 0
  assert closest in capsys.readouterr().out.split()


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


# ---------------------------------------------------------------- issue 48: bindings given
# twice, unquoted strings, malformed bindings
def test_a_macro_bound_twice_on_the_command_line_is_refused_naming_both_values(tmp_path):
  from decal_jax import train
  with pytest.raises(gin_utils.GinConfigError) as err:
    train.main(["--gin_file=runs/pretrain_builtin.gin", f"--gin.MODEL_DIR='{tmp_path / 'm'}'",
                "--gin.TRAIN_STEPS=5", "--gin.TRAIN_STEPS=7"])
  message = str(err.value)
  assert message.startswith("error: the macro TRAIN_STEPS is bound twice on the command line")
  assert "to 5 by the 2nd binding (--gin.TRAIN_STEPS=5" in message
  assert "to 7 by the 3rd (--gin.TRAIN_STEPS=7" in message
  assert "silently take the last. Give it once." in message
  assert list(tmp_path.iterdir()) == []  # refused before any work
  # --gin_bindings counts the same; the same value twice is no conflict.
  with pytest.raises(gin_utils.GinConfigError, match="bound twice on the command line"):
    _parse_command_line("--gin.MODEL_DIR='/unused'", "--gin_bindings=TRAIN_STEPS = 5",
                        "--gin.TRAIN_STEPS=7")
  _parse_command_line("--gin.MODEL_DIR='/unused'", "--gin.TRAIN_STEPS=5", "--gin.TRAIN_STEPS=5")
  assert gin.query_parameter("%TRAIN_STEPS") == 5


def test_a_macro_bound_twice_in_one_gin_file_is_refused_naming_both_lines(tmp_path):
  gin_file = tmp_path / "mine.gin"
  text = 'include "runs/pretrain_builtin.gin"\nTRAIN_STEPS = 5\nBATCH_SIZE = 2\nTRAIN_STEPS = 7\n'
  gin_file.write_text(text)
  with pytest.raises(gin_utils.GinConfigError) as err:
    gin_utils.parse([str(gin_file)], [], [f"MODEL_DIR = '{tmp_path / 'm'}'"])
  assert str(err.value) == (
      f"error: {gin_file} binds the macro TRAIN_STEPS twice: to 5 on line 2 and to 7 on line "
      "4; gin would silently take the last. Keep one of the two lines.")
  assert gin_file.read_text() == text and list(tmp_path.iterdir()) == [gin_file]
  # A file that sets a macro its include set (the usual override) is accepted.
  gin_file.write_text('include "runs/pretrain_builtin.gin"\nTRAIN_STEPS = 5\n')
  gin_utils.parse([str(gin_file)], [], ["MODEL_DIR = '/unused'"])
  assert gin.query_parameter("%TRAIN_STEPS") == 5


@pytest.mark.parametrize("flag", ["--gin.MODEL_DIR=runs/x", "--gin_bindings=MODEL_DIR = runs/x"])
def test_an_unquoted_string_binding_names_the_binding_and_the_quotes_to_add(tmp_path,
                                                                          monkeypatch, flag):
  """What the shell leaves of --gin.MODEL_DIR='runs/x' (outer quotes only): gin said
  `malformed node or string ... <ast.Name object at 0x...>`."""
  monkeypatch.chdir(tmp_path)
  from decal_jax import train
  for parse in (lambda: train.main(["--gin_file=runs/pretrain_builtin.gin", flag]),
                lambda: _parse_command_line(flag)):
    with pytest.raises(gin_utils.GinConfigError) as err:
      parse()
    message = str(err.value)
    assert "the gin binding 'MODEL_DIR = runs/x' is malformed: its value runs/x" in message
    assert "--gin.MODEL_DIR=\"'runs/x'\"" in message
    assert "ast." not in message and "0x" not in message
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("binding,reason", [
    ("TRAIN_STEPS = (5", "a bracket or quote is not closed"),
    ("TRAIN_STEPS = 5 6", "Expected newline.")])
def test_a_malformed_binding_is_echoed_without_a_line_number(tmp_path, binding, reason):
  from decal_jax import train
  for parse in (lambda: train.main(["--gin_file=runs/pretrain_builtin.gin",
                                    f"--gin.MODEL_DIR='{tmp_path / 'm'}'",
                                    f"--gin_bindings={binding}"]),
                lambda: _parse_command_line("--gin.MODEL_DIR='/unused'",
                                            f"--gin_bindings={binding}")):
    with pytest.raises(gin_utils.GinConfigError) as err:
      parse()
    message = str(err.value)
    assert message.startswith(f"error: the gin binding {binding!r} is malformed ({reason})")
    assert not re.search(r"line \d", message) and "--gin.TRAIN_STEPS=100" in message
  assert list(tmp_path.iterdir()) == []
