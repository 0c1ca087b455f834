"""The entry points' command line (decal_jax/runtime/cli.py): T5X's flags on every entry point,
--help, and errors that come before JAX / TensorFlow load.

"Before the heavy imports" is checked as a property rather than a wall-clock race: each
command runs in a subprocess whose exit hook reports which of jax / tensorflow / seqio were
imported, and what the flags set (the DECAL_* variables, seqio's TFDS and cache settings,
absl's logging flags, JAX's configuration).
"""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

import paths
from decal_jax.runtime import cli

REPO = paths.REPO
HEAVY = ("jax", "tensorflow", "seqio")
ENTRY_POINTS = {"train": "runs/pretrain_builtin.gin", "eval": "runs/eval_builtin.gin",
                "infer": "runs/infer_builtin.gin", "retrieve": "runs/retrieve_builtin.gin"}
# Runs `python -m decal_jax.<module> ARGS...`; at exit (after any error message) prints
# REPORT {...} on stderr: the heavy modules imported and the settings the flags made.
WRAPPER = """
import atexit, json, os, runpy, sys
def report():
  from absl import flags
  seqio, jax = sys.modules.get("seqio"), sys.modules.get("jax")
  print("REPORT " + json.dumps({
      "heavy": [m for m in %r if m in sys.modules],
      "env": {k: v for k, v in os.environ.items() if k.startswith("DECAL_")},
      "tfds_override": seqio and seqio.utils._TFDS_DATA_DIR_OVERRIDE,
      "cache_dirs": seqio and list(seqio.utils._GLOBAL_CACHE_DIRECTORIES),
      "logging": flags.FLAGS.is_parsed() and [flags.FLAGS.alsologtostderr,
                                               flags.FLAGS.verbosity],
      "jax_platforms": jax and jax.config.jax_platforms}), file=sys.stderr)
atexit.register(report)
module = sys.argv.pop(1)
sys.argv[0] = module
runpy.run_module(module, run_name="__main__")
""" % (HEAVY,)


class Result:
  def __init__(self, proc, seconds):
    self.returncode, self.stdout, self.seconds = proc.returncode, proc.stdout, seconds
    self.stderr, _, report = proc.stderr.rpartition("REPORT ")
    self.report = json.loads(report)


def _cli(module, *args, cwd=REPO, **settings):
  env = {k: v for k, v in os.environ.items() if not k.startswith("DECAL_") or k.endswith("DIR")}
  env.update(settings, TF_CPP_MIN_LOG_LEVEL="3")
  start = time.monotonic()
  proc = subprocess.run([sys.executable, "-c", WRAPPER, f"decal_jax.{module}", *args], cwd=cwd,
                        env=env, capture_output=True, text=True, timeout=600)
  return Result(proc, time.monotonic() - start)


def _early_error(result, *fragments):
  """The command failed with `fragments` in its message, no traceback, before any of
  jax / tensorflow / seqio was imported (so in interpreter start-up time; 30 s is a bound
  for a loaded CI machine, the property is the empty import list)."""
  assert result.returncode != 0, result.stdout
  assert all(f in result.stderr for f in fragments), result.stderr
  assert "Traceback" not in result.stderr, result.stderr
  assert result.report["heavy"] == [] and result.seconds < 30


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_help_shows_the_flags_the_gin_form_and_the_required_macros(module):
  result = _cli(module, "--help", f"--gin_file={ENTRY_POINTS[module]}")
  assert result.returncode == 0 and result.report["heavy"] == []
  out = result.stdout
  assert out.startswith(f"usage: python -m decal_jax.{module} --gin_file=FILE")
  for flag in ("gin_file", "gin_bindings", "gin_search_paths", "tfds_data_dir",
               "seqio_additional_cache_dirs", "[no]multiprocess_gpu", "coordinator_address",
               "process_count", "process_index", "initialization_timeout", "[no]alsologtostderr",
               "[no]logtostderr", "log_dir", "stderrthreshold", "logger_levels"):
    assert f"  --{flag}: " in out, flag  # each flag with its help text after the colon
  assert "  -v,--verbosity: " in out
  assert "  --jax_NAME=VALUE: one of JAX's configuration options" in out
  assert "--gin.NAME=VALUE" in out and "--gin.MODEL_DIR=\"'runs/decal_tiny'\"" in out
  required = out.split("leave %gin.REQUIRED (bind each with --gin.NAME=VALUE): ")[1]
  assert required.split(", ")[0].strip() == "MODEL_DIR"


def test_help_without_gin_files_lists_the_shipped_run_files():
  result = _cli("train", "-h")
  assert result.returncode == 0 and "pretrain_builtin.gin" in result.stdout
  assert "Give --gin_file=FILE with --help" in result.stdout


def test_help_lists_what_the_bindings_leave_required(tmp_path):
  (tmp_path / "two.gin").write_text("A_MACRO = %gin.REQUIRED\nB_MACRO = %gin.REQUIRED\n"
                                    "C_MACRO = 3\n")
  result = _cli("train", "--help", f"--gin_file={tmp_path / 'two.gin'}", "--gin.A_MACRO=1")
  assert result.stdout.rstrip().endswith("(bind each with --gin.NAME=VALUE): B_MACRO")


@pytest.mark.parametrize("args,fragments", [
    (["--bogus=1"], ["Unknown command line flag 'bogus'", "--help lists the flags"]),
    (["--process_count=0"], ["--process_count=0: 0 is not a positive integer"]),
    (["--gin.MODEL_DIR"], ["'--gin.MODEL_DIR' has no value"]),
    (["stray"], ["unexpected argument 'stray'"]),
    (["--process_count=2"], ["--process_count takes effect only with --multiprocess_gpu"]),
    (["--multiprocess_gpu", "--process_count=2", "--process_index=0"],
     ["also needs --coordinator_address"]),
    (["--multiprocess_gpu", "--coordinator_address=h:1", "--process_count=2",
      "--process_index=2"], ["--process_index=2 must be below --process_count=2"]),
    (["-v=loud"], ["flag --verbosity=loud: invalid literal for int()"]),
    (["--stderrthreshold=loud"], ["value should be one of <debug|info|warning|error|fatal>"]),
    (["--logger_levels=orbax"], ["flag --logger_levels=orbax: "]),
])
def test_flag_errors_come_before_the_heavy_imports(args, fragments):
  _early_error(_cli("train", "--gin_file=runs/pretrain_builtin.gin", "--gin.MODEL_DIR='m'",
                    *args), "error: ", *fragments)


@pytest.mark.parametrize("settings,fragments", [
    ({"DECAL_NUM_PROCESSES": "abc"},
     ["error: DECAL_NUM_PROCESSES='abc' is not allowed (not a whole number)",
      "must be a whole number >= 1", "e.g. DECAL_NUM_PROCESSES=4"]),
    ({"DECAL_BAD_LINES": "maybe"},
     ["error: DECAL_BAD_LINES='maybe' is not allowed", "must be one of fail, skip"]),
])
def test_a_bad_decal_variable_is_refused_before_the_heavy_imports(settings, fragments):
  _early_error(_cli("train", "--gin_file=runs/pretrain_builtin.gin", "--gin.MODEL_DIR='m'",
                    **settings), *fragments)


def test_a_bad_flag_value_for_a_setting_is_refused_before_the_heavy_imports():
  _early_error(_cli("train", "--gin_file=runs/pretrain_builtin.gin", "--gin.MODEL_DIR='m'",
                    "--multiprocess_gpu", "--coordinator_address=no-port", "--process_count=2",
                    "--process_index=0"),
               "error: DECAL_COORDINATOR_ADDRESS='no-port' is not allowed",
               "host:port, the port a whole number in 1..65535")


@pytest.mark.parametrize("arg,fragment", [
    ("--jax_no_such_option=1", "Unknown command line flag 'jax_no_such_option'"),
    ("--jax_enable_x64=maybe", "flag --jax_enable_x64=maybe: ('Non-boolean argument"),
    ("--jax_numpy_rank_promotion=never", "value should be one of <allow|warn|raise>"),
])
def test_a_bad_jax_flag_is_refused_when_jax_loads_before_any_work(arg, fragment):
  """JAX defines its flags, so they are checked once it has loaded: before TensorFlow,
  seqio or any device."""
  result = _cli("train", "--gin_file=runs/pretrain_builtin.gin", "--gin.MODEL_DIR='m'", arg)
  assert result.returncode != 0 and fragment in result.stderr, result.stderr
  assert "JAX's flags: --jax_NAME=VALUE" in result.stderr and "Traceback" not in result.stderr
  assert result.report["heavy"] == ["jax"]
  assert not (REPO / "m").exists()


def test_gin_file_errors_come_before_the_heavy_imports(tmp_path):
  _early_error(_cli("eval"), "give at least one --gin_file")
  _early_error(_cli("train", "--gin_file=runs/no_such.gin", "--gin.MODEL_DIR='m'"),
               "gin file not found: runs/no_such.gin", str(REPO / "gin"))
  (tmp_path / "broken.gin").write_text("include 'runs/pretrain_builtin.gin'\nTRAIN_STEPS = (\n")
  _early_error(_cli("train", f"--gin_file={tmp_path / 'broken.gin'}", "--gin.MODEL_DIR='m'"),
               "bad gin file", "broken.gin")
  (tmp_path / "includes.gin").write_text("include 'runs/no_such_include.gin'\n")
  _early_error(_cli("train", f"--gin_file={tmp_path / 'includes.gin'}"),
               "gin file not found: runs/no_such_include.gin")
  _early_error(_cli("infer", "--gin_file=runs/infer_builtin.gin"),
               "leave MODEL_DIR %gin.REQUIRED", "--gin.MODEL_DIR=")
  assert not (tmp_path / "m").exists() and not (REPO / "m").exists()


def _t5x_flags(tmp_path, model_dir):
  """Every T5X flag, single-process (process_count 1 joins no job, as in JAX); the gin file
  small.gin is found on the second search path."""
  (tmp_path / "b").mkdir(exist_ok=True)
  (tmp_path / "b" / "small.gin").write_text(
      "BATCH_SIZE = 4\nTASK_FEATURE_LENGTHS = {'inputs': 32, 'targets': 12}\n")
  return ["--gin_file=small.gin", f"--gin_search_paths={tmp_path / 'a'},{tmp_path / 'b'}",
          f"--gin_bindings=MODEL_DIR = '{model_dir}'", f"--tfds_data_dir={tmp_path / 'tfds'}",
          f"--seqio_additional_cache_dirs={tmp_path / 'c1'},{tmp_path / 'c2'}",
          "--multiprocess_gpu", "--coordinator_address=localhost:12355", "--process_count=1",
          "--process_index=0", "--initialization_timeout=30",
          "--alsologtostderr", "-v=1", "--jax_platforms=cpu"]  # absl's and JAX's flags


def _settings_applied(result, tmp_path):
  assert result.report["env"]["DECAL_TFDS_DATA_DIR"] == str(tmp_path / "tfds")
  assert result.report["tfds_override"] == str(tmp_path / "tfds")
  assert result.report["cache_dirs"][-2:] == [str(tmp_path / "c1"), str(tmp_path / "c2")]
  assert {k: result.report["env"][k] for k in ("DECAL_COORDINATOR_ADDRESS",
                                               "DECAL_NUM_PROCESSES", "DECAL_PROCESS_ID")} == {
      "DECAL_COORDINATOR_ADDRESS": "localhost:12355", "DECAL_NUM_PROCESSES": "1",
      "DECAL_PROCESS_ID": "0"}
  assert result.report["logging"] == [True, 1]  # --alsologtostderr -v=1, in absl's flags
  assert result.report["jax_platforms"] == "cpu"
  assert "JAX backend: cpu, 1 device (cpu)" in result.stderr


def test_train_with_every_t5x_flag(tmp_path):
  model_dir = tmp_path / "m"
  result = _cli("train", f"--gin_file={ENTRY_POINTS['train']}", *_t5x_flags(tmp_path, model_dir),
                "--gin.TRAIN_STEPS=1", "--gin.EVAL_BATCHES=1")
  assert result.returncode == 0, result.stderr
  _settings_applied(result, tmp_path)
  config = (model_dir / "config.gin").read_text()
  assert "BATCH_SIZE = 4" in config  # small.gin, found on the second search path
  assert (model_dir / "checkpoint_1").is_dir()  # MODEL_DIR from --gin_bindings


@pytest.mark.parametrize("module", ["eval", "infer", "retrieve"])
def test_every_t5x_flag_reaches_the_job(module, tmp_path):
  """With every flag given, the job itself starts (and stops at the empty MODEL_DIR)."""
  (tmp_path / "m").mkdir()
  inputs = ["--gin.INFER_INPUTS=['some text']"] if module == "infer" else []
  result = _cli(module, f"--gin_file={ENTRY_POINTS[module]}", *_t5x_flags(tmp_path, tmp_path / "m"),
                *inputs)
  assert result.returncode != 0 and f"No checkpoint in {tmp_path / 'm'}" in result.stderr, (
      result.stderr)
  _settings_applied(result, tmp_path)


def _stale_lock(model_dir):
  """MODEL_DIR/.lock as a killed trainer of this host leaves it; the warning a run prints
  when it takes the lock over."""
  dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, check=True).stdout)
  lock = model_dir / ".lock"
  lock.write_text(json.dumps({"pid": dead, "host": socket.gethostname(),
                              "start_time": "2026-01-02T03:04:05+00:00", "command": "train"}))
  return (f"{lock} was left by pid {dead} (2026-01-02T03:04:05+00:00), which is no longer "
          "running (a stale lock); taking it over.")


@pytest.mark.parametrize("also_stderr", [[], ["--alsologtostderr"]])
def test_the_librarys_warnings_reach_the_log_dir_file_and_stderr_once_each(tmp_path,
                                                                          also_stderr):
  """A decal_jax warning logged mid-run (taking over a dead trainer's lock; the run is then
  refused for targets too short for span corruption's, before any compile) is a line of
  absl's --log_dir file in absl's format, and printed once on stderr above the progress bar,
  with or without --alsologtostderr (which copies absl's own lines, not this one, to
  stderr)."""
  (tmp_path / "m").mkdir()
  warning = _stale_lock(tmp_path / "m")
  result = _cli("train", f"--gin_file={ENTRY_POINTS['train']}",
                f"--gin.MODEL_DIR='{tmp_path / 'm'}'",
                "--gin.TASK_FEATURE_LENGTHS={'inputs': 128, 'targets': 4}",
                f"--log_dir={tmp_path / 'logs'}", *also_stderr)
  assert result.returncode != 0, result.stderr
  assert "targets would be cut. Set 'targets' >= " in result.stderr
  log = (tmp_path / "logs" / "decal_jax.train.INFO").read_text()  # absl's link to the file
  assert re.findall(r"^W\d{4} [\d:.]+ +\d+ run_lock\.py:\d+\] (.*)$", log, re.M) == [warning]
  assert "] JAX backend: cpu, 1 device (cpu)" in log  # the INFO lines are there as before
  assert result.stderr.count(warning) == 1 and f"WARNING: {warning}" in result.stderr
  assert ("] JAX backend: cpu" in result.stderr) == bool(also_stderr)


def test_multiprocess_gpu_alone_asks_jax_to_detect_the_cluster(monkeypatch):
  from decal_jax.runtime import cli
  monkeypatch.setenv("DECAL_DISTRIBUTED", "")  # restored after the test
  cli.parse_flags(["--multiprocess_gpu"], "decal_jax.train")
  try:
    cli.apply_settings()
  finally:
    cli.FLAGS.unparse_flags()
  assert os.environ["DECAL_DISTRIBUTED"] == "auto"


def test_each_parse_starts_from_the_defaults_not_the_last_calls_flags():
  """absl adds a repeated flag's values to an earlier parse's: an entry point called twice in
  one process (a notebook, a test) must not also apply the first call's gin files and
  bindings."""
  cli.parse_flags(["--gin_file=first.gin", "--gin.A=1", "--multiprocess_gpu"], "decal-train")
  assert (cli.FLAGS.gin_file, cli.FLAGS.gin_bindings) == (["first.gin"], ["A = 1"])
  cli.parse_flags(["--gin_file=second.gin", "--gin.B=2"], "decal-train")
  assert (cli.FLAGS.gin_file, cli.FLAGS.gin_bindings) == (["second.gin"], ["B = 2"])
  assert not cli.FLAGS.multiprocess_gpu
  cli.parse_flags([], "decal-train")
  assert (cli.FLAGS.gin_file, cli.FLAGS.gin_bindings) == ([], [])


def test_jax_flags_are_set_aside_for_jax_and_the_rest_parsed():
  """--jax_* and --nojax_* (one dash or two) wait for JAX; --gin.jax_x is a gin binding."""
  jax_args = cli.parse_flags(["--jax_platforms=cpu", "-nojax_enable_x64", "--gin.jax_x=1",
                              "--alsologtostderr", "-v", "2"], "decal-train")
  assert jax_args == ["--jax_platforms=cpu", "-nojax_enable_x64"]
  assert cli.FLAGS.gin_bindings == ["jax_x = 1"]
  assert (cli.FLAGS.alsologtostderr, cli.FLAGS.verbosity) == (True, 2)
  assert cli.parse_flags([], "decal-train") == [] and cli.FLAGS.verbosity == -1
