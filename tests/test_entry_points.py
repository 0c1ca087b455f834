"""The command-line entry points, run as a user runs them (subprocesses, tiny settings)."""
import os
import re
import subprocess
import sys

import pytest

import paths

REPO = paths.REPO
SMALL = ["--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 12}", "--gin.BATCH_SIZE=4"]


def _run(module, *args, check=True):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run([sys.executable, "-m", f"decal_jax.{module}", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=600)
  if check and proc.returncode != 0:
    raise AssertionError(f"{module} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
  return proc


def _log_dir(model_dir):
  return model_dir.parent / f"{model_dir.name}_logs"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """Three steps, logged every step, stdout and stderr piped (not a terminal), the log also
  kept in a --log_dir file."""
  model_dir = tmp_path_factory.mktemp("main_job")
  proc = _run("train", "--gin_file=runs/pretrain_builtin.gin", f"--gin.MODEL_DIR='{model_dir}'",
              "--gin.TRAIN_STEPS=3", "--gin.EVAL_BATCHES=1", "--gin.CHECKPOINT_PERIOD=2",
              "--gin.LOG_PERIOD=1", f"--log_dir={_log_dir(model_dir)}", "--alsologtostderr",
              *SMALL)
  return model_dir, proc


def test_train_writes_checkpoint_metrics_config_and_prints_an_example(trained):
  model_dir, proc = trained
  assert (model_dir / "checkpoint_3").is_dir() and (model_dir / "config.gin").exists()
  assert list((model_dir / "train").glob("events.out.tfevents.*"))
  assert "Held-out (validation) at step 3" in proc.stdout
  assert "prediction:" in proc.stdout and "<extra_id_0>" in proc.stdout


def test_a_run_prints_no_tensorflow_or_seqio_start_up_noise(trained):
  """TF's C++ start-up lines (oneDNN, the CUDA-driver probe, the `cuInit` failure of a
  machine without a GPU) and seqio's advice to cache a task whose position the checkpoint
  keeps anyway stay off the console."""
  _, proc = trained
  for noise in ("cuInit", "oneDNN", "cudart", "absl::InitializeLog", "FunctionDataset"):
    assert noise not in proc.stderr, proc.stderr


STEP_LINE = re.compile(r"^I\d{4} [\d:.]+ +\d+ trainer\.py:\d+\] train step (\d)/3: "
                       r"loss=[\d.]+, accuracy=[\d.e+-]+, learning_rate=[\d.e+-]+, "
                       r"steps/s=[\d.e+-]+, tokens/s=[\d.e+-]+$", re.M)


def test_a_piped_run_logs_a_line_per_step_and_draws_no_bar(trained):
  """Off a terminal the log keeps absl-formatted INFO lines (step, loss, accuracy, learning
  rate, steps/s) every LOG_PERIOD steps, after the device line, and no progress bar; the
  --log_dir file holds the same lines."""
  model_dir, proc = trained
  assert [int(step) for step in STEP_LINE.findall(proc.stderr)] == [1, 2, 3], proc.stderr
  assert "] JAX backend: cpu, 1 device (cpu)" in proc.stderr
  assert "it/s" not in proc.stderr and "\r" not in proc.stderr and "train:" not in proc.stderr
  log_file = _log_dir(model_dir) / "decal_jax.train.INFO"  # absl's link to the newest log
  assert STEP_LINE.findall(log_file.read_text()) == ["1", "2", "3"]


def test_rerunning_the_same_command_continues(trained):
  model_dir, _ = trained
  proc = _run("train", "--gin_file=runs/pretrain_builtin.gin", f"--gin.MODEL_DIR='{model_dir}'",
              "--gin.TRAIN_STEPS=4", "--gin.EVAL_BATCHES=1", *SMALL)
  assert "Resuming from step 3" in proc.stdout
  assert (model_dir / "checkpoint_4").is_dir()


def _snapshot(folder):
  """Every path under `folder` with its modification time and size."""
  return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
          for p in folder.rglob("*")}


def test_rerunning_a_finished_run_says_so_and_writes_nothing(trained):
  model_dir, _ = trained
  latest = max(int(p.name.split("_")[1]) for p in model_dir.glob("checkpoint_*"))
  before = _snapshot(model_dir)
  proc = _run("train", "--gin_file=runs/pretrain_builtin.gin", f"--gin.MODEL_DIR='{model_dir}'",
              f"--gin.TRAIN_STEPS={latest}", "--gin.EVAL_BATCHES=1", *SMALL)
  assert f"already at step {latest} = TRAIN_STEPS; nothing to train" in proc.stdout
  assert "Held-out" not in proc.stdout and "train:" not in proc.stderr  # no bar, no report
  assert _snapshot(model_dir) == before


def test_eval_and_infer_use_the_checkpoint(trained):
  model_dir, _ = trained
  proc = _run("eval", "--gin_file=runs/eval_builtin.gin", f"--gin.MODEL_DIR='{model_dir}'",
              "--gin.EVAL_BATCHES=1", *SMALL)
  assert "accuracy" in proc.stdout and "loss" in proc.stdout
  proc = _run("infer", "--gin_file=runs/infer_builtin.gin", f"--gin.MODEL_DIR='{model_dir}'",
              "--gin.INFER_INPUTS=['The <extra_id_0> statement wraps a block.']",
              "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}")
  assert "input:  The <extra_id_0> statement wraps a block." in proc.stdout
  assert "output:" in proc.stdout


def test_empty_infer_input_is_a_clear_error(trained):
  model_dir, _ = trained
  proc = _run("infer", "--gin_file=runs/infer_builtin.gin", f"--gin.MODEL_DIR='{model_dir}'",
              "--gin.INFER_INPUTS=['fine', '  ']", check=False)
  assert proc.returncode != 0 and "Input 1 is empty or whitespace only" in proc.stderr


def test_unknown_binding_and_missing_file_are_clear_errors(tmp_path):
  proc = _run("train", "--gin_file=runs/pretrain_builtin.gin", "--gin.MODEL_DIR='/tmp/x'",
              "--gin.trainer.train.no_such_arg=3", check=False)
  assert proc.returncode != 0 and "no_such_arg" in proc.stderr and "Traceback" not in proc.stderr
  proc = _run("train", "--gin_file=runs/no_such_file.gin", check=False)
  assert proc.returncode != 0 and "gin file not found" in proc.stderr
  assert str(REPO / "gin") in proc.stderr  # says where it looked
  assert not (tmp_path / "x").exists()


def test_bad_compression_ratio_from_the_command_line(tmp_path):
  proc = _run("train", "--gin_file=runs/pretrain_builtin.gin", f"--gin.MODEL_DIR='{tmp_path}/m'",
              "--gin.COMPRESSION_RATIO=0", check=False)
  assert proc.returncode != 0 and "compression ratio C must be an integer >= 1" in proc.stderr
  assert not (tmp_path / "m").exists()  # nothing written


def test_gin_files_resolve_when_the_working_directory_has_a_runs_folder(tmp_path):
  """The README's MODEL_DIR is runs/decal_tiny: a ./runs folder must not shadow gin/runs."""
  (tmp_path / "runs" / "decal_tiny").mkdir(parents=True)
  (tmp_path / "models").mkdir()
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run([sys.executable, "-m", "decal_jax.eval", "--gin_file=runs/eval_builtin.gin",
                         "--gin.MODEL_DIR='runs/decal_tiny'"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode != 0 and "No checkpoint in runs/decal_tiny" in proc.stderr, proc.stderr


QA_SMALL = ["--gin.TASK_FEATURE_LENGTHS={'inputs': 48, 'targets': 12}", "--gin.BATCH_SIZE=4"]


@pytest.fixture(scope="module")
def finetuned(trained):
  pretrained, _ = trained
  model_dir = pretrained.parent / "qa"
  proc = _run("train", "--gin_file=runs/finetune_builtin.gin", f"--gin.MODEL_DIR='{model_dir}'",
              f"--gin.INITIAL_CHECKPOINT_PATH='{pretrained}'", "--gin.TRAIN_STEPS=2",
              "--gin.EVAL_BATCHES=1", *QA_SMALL)
  return model_dir, proc


def test_finetune_starts_from_the_pretrained_checkpoint(finetuned):
  model_dir, proc = finetuned
  assert "Starting from" in proc.stdout and "0 newly initialised" in proc.stdout
  assert (model_dir / "checkpoint_2").is_dir()


def test_eval_writes_seqio_json_logger_files_whose_metrics_match_the_predictions(finetuned):
  """MODEL_DIR/inference_eval/ in T5X / seqio's layout, read back as seqio.JSONLogger wrote
  it: <task>-<step:06>.jsonl ({"input": task features, "target", "prediction", "output"} per
  example) and <task>-metrics.jsonl ({"step", metrics...} per evaluation); EM recomputed from
  the logged predictions."""
  import json
  from decal_jax import text_metrics
  model_dir, _ = finetuned
  proc = _run("eval", "--gin_file=models/decal_tiny.gin", "--gin_file=runs/eval.gin",
              f"--gin.MODEL_DIR='{model_dir}'", "--gin.MIXTURE_OR_TASK_NAME='decal_builtin_qa'",
              "--gin.EVAL_BATCHES=1", "--gin.MAX_PREDICT_EXAMPLES=6", *QA_SMALL)
  logged = model_dir / "inference_eval"
  rows = [json.loads(line) for line in
          (logged / "decal_builtin_qa-000002.jsonl").read_text().splitlines()]
  lines = [json.loads(line) for line in
           (logged / "decal_builtin_qa-metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 6 and [line["step"] for line in lines] == [2]
  assert all(set(r) == {"input", "target", "prediction", "output"} for r in rows)
  assert all(r["input"]["inputs_pretokenized"].startswith("question: ") and
             r["target"] == r["input"]["answers"] and len(r["target"]) == 2 for r in rows)
  em = 100 * sum(any(text_metrics.normalize_answer(r["prediction"]) ==
                     text_metrics.normalize_answer(t) for t in r["target"]) for r in rows) / 6
  assert lines[0]["em"] == pytest.approx(em) and 0 <= lines[0]["f1"] <= 100
  assert list((logged / "decal_builtin_qa").glob("events.out.tfevents.*"))  # TensorBoardLogger
  assert list((model_dir / "training_eval" / "decal_builtin_qa").glob("events.out.tfevents.*"))
  assert "decal_builtin_qa (6 examples)" in proc.stdout


def test_infer_reads_a_jsonl_file_and_writes_predictions(finetuned, tmp_path):
  import json
  model_dir, _ = finetuned
  source = tmp_path / "in.jsonl"
  source.write_text(json.dumps({"question": "Which section?", "context": "The pass statement."})
                    + "\n\n" + json.dumps({"question": "And this?", "context": "A loop."}) + "\n")
  out = tmp_path / "out.jsonl"
  _run("infer", "--gin_file=models/decal_tiny.gin", "--gin_file=runs/infer.gin",
       f"--gin.MODEL_DIR='{model_dir}'", f"--gin.INFER_INPUT_FILE='{source}'",
       "--gin.INFER_INPUT_KIND='qa'", f"--gin.INFER_OUTPUT_FILE='{out}'", *QA_SMALL[:1])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["inputs"] for r in rows] == ["question: Which section? context: The pass statement.",
                                         "question: And this? context: A loop."]
  assert all(isinstance(r["prediction"], str) for r in rows)
  source.write_text('{"question": "q"}\n')
  proc = _run("infer", "--gin_file=models/decal_tiny.gin", "--gin_file=runs/infer.gin",
              f"--gin.MODEL_DIR='{model_dir}'", f"--gin.INFER_INPUT_FILE='{source}'",
              "--gin.INFER_INPUT_KIND='qa'", check=False)
  assert proc.returncode != 0 and f"{source}:1: missing field 'context'" in proc.stderr
