"""The entry points' command line: T5X's flags (absl, as in t5x/train.py), checked before
JAX or TensorFlow is imported.

`--gin_file=F` (repeatable), `--gin_bindings='NAME = VALUE'` (repeatable) and its short form
`--gin.NAME=VALUE`, comma-separated `--gin_search_paths`, `--tfds_data_dir`,
`--seqio_additional_cache_dirs` and the multi-host GPU flags `--multiprocess_gpu`,
`--coordinator_address`, `--process_count`, `--process_index`, `--initialization_timeout`.
They map onto the DECAL_* settings (environment variables, which still work on their own):
`--tfds_data_dir` sets DECAL_TFDS_DATA_DIR; `--multiprocess_gpu` sets DECAL_DISTRIBUTED=auto,
or with the three process flags DECAL_COORDINATOR_ADDRESS / DECAL_NUM_PROCESSES /
DECAL_PROCESS_ID. Flag errors, DECAL_* variables that hold a bad value
(`decal_jax.settings`), missing or malformed gin files and macros left `%gin.REQUIRED` are
reported before the heavy imports, in well under a second of work.

absl's logging flags work as in a T5X (absl `app.run`) program: `--logtostderr`,
`--alsologtostderr`, `-v` / `--verbosity`, `--log_dir`, `--stderrthreshold`,
`--logger_levels` (`start_logging`). JAX's own flags, `--jax_NAME=VALUE` (e.g.
`--jax_platforms=cpu`), are JAX's configuration options as `jax.config.config_with_absl`
defines them; they are checked and applied when JAX loads, before anything touches a device
(`apply_jax_flags`).
"""
import importlib
import logging
import os
import sys
from typing import List, Optional, Sequence

from absl import flags
from absl import logging as absl_logging  # defines absl's logging flags (flags.FLAGS)

from decal_jax import settings
from decal_jax.runtime import console, gin_utils

FLAGS = flags.FlagValues()  # our own, so a host program's absl flags are left alone
flags.DEFINE_multi_string(
    "gin_file", [], "A gin file (repeatable; later files override earlier ones). Looked up "
    "as given, then under --gin_search_paths, the current directory and the package's gin "
    "files, e.g. runs/pretrain_builtin.gin.", flag_values=FLAGS)
flags.DEFINE_multi_string(
    "gin_bindings", [], "A gin binding, e.g. --gin_bindings='TRAIN_STEPS = 100' (repeatable; "
    "applied after the gin files). --gin.NAME=VALUE is the short form.", flag_values=FLAGS)
flags.DEFINE_list(
    "gin_search_paths", [], "Comma-separated folders to look gin files up in, before the "
    "current directory and the package's gin files.", flag_values=FLAGS)
flags.DEFINE_string(
    "tfds_data_dir", None, "Where TensorFlow Datasets keeps prepared data (e.g. C4 for "
    "decal_c4_span_corruption); sets DECAL_TFDS_DATA_DIR and overrides every seqio TFDS "
    "task's data_dir.", flag_values=FLAGS)
flags.DEFINE_list(
    "seqio_additional_cache_dirs", [], "Comma-separated folders to search for cached seqio "
    "tasks, in addition to the defaults.", flag_values=FLAGS)
flags.DEFINE_boolean(
    "multiprocess_gpu", False, "Join a multi-host GPU job before touching devices: with "
    "--coordinator_address, --process_count and --process_index, else JAX's cluster "
    "detection (SLURM, Open MPI, Kubernetes). Sets the DECAL_* multi-host variables.",
    flag_values=FLAGS)
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (with "
                    "--multiprocess_gpu; DECAL_COORDINATOR_ADDRESS).", flag_values=FLAGS)
flags.DEFINE_integer("process_count", None, "How many processes the job has (with "
                     "--multiprocess_gpu; DECAL_NUM_PROCESSES).", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_integer("process_index", None, "This process's index, 0 .. process_count - 1 "
                     "(with --multiprocess_gpu; DECAL_PROCESS_ID).", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_integer("initialization_timeout", None, "Seconds to wait for the other "
                     "processes in jax.distributed.initialize (default 300).", lower_bound=1,
                     flag_values=FLAGS)

# absl's logging flags, defined again on FLAGS (same names and parsers, so --help lists them
# and a bad value is a usage error) and handed to absl's own flags by `start_logging`.
flags.DEFINE_boolean("logtostderr", False, "absl logging: log to stderr only (not to the "
                     "--log_dir file).", flag_values=FLAGS)
flags.DEFINE_boolean("alsologtostderr", False, "absl logging: with --log_dir, also log to "
                     "stderr.", flag_values=FLAGS)
flags.DEFINE_integer("verbosity", -1, "absl logging verbosity: -1 (default) warnings plus "
                     "decal_jax's INFO lines (the device line, the training step lines); 0 "
                     "every library's INFO lines (T5X's default); 1 debug.", short_name="v",
                     flag_values=FLAGS)
flags.DEFINE_string("log_dir", None, "absl logging: write the log (INFO and above) to a file "
                    "in this folder (created if needed), stderr keeping only what "
                    "--alsologtostderr / --stderrthreshold add.", flag_values=FLAGS)
flags.DEFINE_enum("stderrthreshold", "fatal", ["debug", "info", "warning", "error", "fatal"],
                  "absl logging: with --log_dir, also print messages at this level or above "
                  "on stderr.", case_sensitive=False, flag_values=FLAGS)
flags.DEFINE_string("logger_levels", None, "absl logging: levels of named loggers, "
                    "e.g. 'orbax:INFO,jax:DEBUG'.", flag_values=FLAGS)
LOGGING_FLAGS = ("logtostderr", "alsologtostderr", "verbosity", "log_dir", "stderrthreshold",
                 "logger_levels")
HELP_ARGS = ("-h", "--help", "--helpfull", "--helpshort")
PROCESS_FLAGS = ("coordinator_address", "process_count", "process_index")


class UsageError(SystemExit):
  """A command-line error, reported without a traceback (exit status 2)."""

  def __init__(self, message: str, prog: str):
    super().__init__(f"error: {message}\n(python -m {prog} --help lists the flags.)")


def _rewrite_gin_args(argv: Sequence[str], prog: str):
  """`--gin.NAME=VALUE` -> `--gin_bindings=NAME = VALUE` (T5X's short form)."""
  out = []
  for arg in argv:
    if arg.startswith("--gin."):
      if "=" not in arg:
        raise UsageError(f"{arg!r} has no value: write --gin.NAME=VALUE, strings in inner "
                         "quotes (--gin.MODEL_DIR=\"'/tmp/m'\").", prog)
      name, value = arg[len("--gin."):].split("=", 1)
      arg = f"--gin_bindings={name} = {value}"
    out.append(arg)
  return out


def is_jax_flag(arg: str) -> bool:
  """--jax_NAME[=VALUE] or --nojax_NAME (one dash or two, as absl reads them)."""
  return arg.lstrip("-").startswith(("jax_", "nojax_")) and arg.startswith("-")


def parse_flags(argv: Sequence[str], prog: str) -> List[str]:
  """Parses `argv` (without the program name) into FLAGS; a bad flag raises UsageError.
  Returns the --jax_* flags, set aside for `apply_jax_flags` (JAX defines them, so they are
  checked when it loads). Every call starts from the defaults: absl adds a repeated flag's
  values to those of an earlier parse, so an entry point called twice in one process would
  otherwise also apply the first call's --gin_file / --gin.NAME=VALUE."""
  FLAGS.unparse_flags()
  jax_args = [arg for arg in argv if is_jax_flag(arg)]
  argv = [arg for arg in argv if not is_jax_flag(arg)]
  try:
    rest = FLAGS([prog] + _rewrite_gin_args(argv, prog))
  except flags.Error as e:
    raise UsageError(str(e), prog) from None
  if len(rest) > 1:
    raise UsageError(f"unexpected argument {rest[1]!r}: every option is a --flag "
                     "(e.g. --gin_file=F, --gin.NAME=VALUE).", prog)
  given = [name for name in PROCESS_FLAGS + ("initialization_timeout",)
           if FLAGS[name].present]
  if given and not FLAGS.multiprocess_gpu:
    raise UsageError(f"--{given[0]} takes effect only with --multiprocess_gpu (as in T5X).",
                     prog)
  process = [name for name in PROCESS_FLAGS if FLAGS[name].value is not None]
  if process and len(process) < len(PROCESS_FLAGS):
    missing = [f"--{name}" for name in PROCESS_FLAGS if name not in process]
    raise UsageError(f"--multiprocess_gpu with --{process[0]} also needs "
                     f"{' and '.join(missing)} (or none of them for JAX's cluster detection).",
                     prog)
  if process and FLAGS.process_index >= FLAGS.process_count:
    raise UsageError(f"--process_index={FLAGS.process_index} must be below "
                     f"--process_count={FLAGS.process_count}.", prog)
  return jax_args


def apply_settings() -> None:
  """The flags as the DECAL_* environment variables the library reads (`settings`)."""
  if FLAGS.tfds_data_dir:
    settings.put("DECAL_TFDS_DATA_DIR", FLAGS.tfds_data_dir)
  if FLAGS.multiprocess_gpu and FLAGS.coordinator_address is None:
    settings.put("DECAL_DISTRIBUTED", "auto")
  elif FLAGS.multiprocess_gpu:
    settings.put("DECAL_COORDINATOR_ADDRESS", FLAGS.coordinator_address)
    settings.put("DECAL_NUM_PROCESSES", FLAGS.process_count)
    settings.put("DECAL_PROCESS_ID", FLAGS.process_index)


def check_settings(prog: str) -> None:
  """Every DECAL_* variable that is set, checked now (before the heavy imports): a bad one
  (or a bad flag value for one) stops the command, naming it and the fix."""
  try:
    apply_settings()
    settings.check_all()
  except settings.SettingError as e:
    raise UsageError(str(e), prog) from None


def start_logging(prog: str, own_process: bool) -> None:
  """absl's logging flags, handed to absl (`flags.FLAGS`), as `app.run` would. In its own
  process (`own_process`: the command line is sys.argv) the entry point also does what
  app.run does: absl's handler on the root logger, on stderr or with --log_dir in a file
  there. Without -v the libraries' INFO lines (orbax, seqio, JAX: hundreds a run) stay off
  while decal_jax's own INFO lines (the device line, the training step lines) show; -v=0
  shows them all, as T5X. A program that calls an entry point with its own argv keeps its
  logging set-up, and gets only the logging flags it passed."""
  given = [FLAGS[name].serialize() for name in LOGGING_FLAGS if FLAGS[name].present]
  if not (given or own_process):
    return
  try:
    flags.FLAGS([prog, *given], known_only=True)
  except (flags.Error, ValueError) as e:  # absl's logging flags raise ValueError themselves
    raise UsageError(str(e), prog) from None
  if not own_process:
    return
  absl_logging.use_absl_handler()
  if not FLAGS["verbosity"].present:
    logging.getLogger("decal_jax").setLevel(logging.INFO)
  if FLAGS.log_dir:
    os.makedirs(FLAGS.log_dir, exist_ok=True)
    absl_logging.get_absl_handler().use_absl_log_file(prog, FLAGS.log_dir)


def apply_jax_flags(jax_args: Sequence[str], prog: str) -> None:
  """--jax_NAME=VALUE: JAX's configuration options, defined as `jax.config.config_with_absl`
  defines them (from `jax.config.meta`: type, choices, help), but on a FlagValues of their
  own (config_with_absl would define them on absl's global flags, once per process), then
  set with `jax.config.update` before anything touches a device. Imports JAX."""
  if not jax_args:
    return
  import jax
  defines = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float,
             str: flags.DEFINE_string, "enum": flags.DEFINE_enum,
             "enum_class": flags.DEFINE_enum_class}
  jax_flags = flags.FlagValues()
  for name, (kind, args, kwargs) in jax.config.meta.items():
    defines[kind](name, None, *args, flag_values=jax_flags, **kwargs)
  try:
    jax_flags([prog, *jax_args])
  except flags.Error as e:
    raise UsageError(f"{e} (JAX's flags: --jax_NAME=VALUE, a jax.config option)", prog) from None
  for name in jax.config.meta:
    if jax_flags[name].present:
      jax.config.update(name, jax_flags[name].value)


def _seqio_settings() -> None:
  """What seqio itself takes (imported only now, after every check has passed)."""
  if not (FLAGS.tfds_data_dir or FLAGS.seqio_additional_cache_dirs):
    return
  import seqio
  if FLAGS.tfds_data_dir:
    seqio.set_tfds_data_dir_override(FLAGS.tfds_data_dir)
  seqio.add_global_cache_dirs(FLAGS.seqio_additional_cache_dirs)


def help_text(prog: str, about: str) -> str:
  """--help: usage, the flags with their help, the --gin.NAME=VALUE form, and the macros
  the given gin files leave %gin.REQUIRED (or, without gin files, the run files shipped)."""
  flag_help = FLAGS.get_help(include_special_flags=False).split("\n", 2)[-1]
  lines = [f"usage: python -m {prog} --gin_file=FILE [--gin_file=FILE ...] "
           "[--gin.NAME=VALUE ...] [flags]", "", about.strip(), "",
           "Gin bindings:",
           "  --gin.NAME=VALUE: one gin binding, the same as --gin_bindings='NAME = VALUE';",
           "    Python literals, strings in inner quotes, e.g.",
           "    --gin.TRAIN_STEPS=100 --gin.MODEL_DIR=\"'runs/decal_tiny'\"", "",
           "JAX's flags:",
           "  --jax_NAME=VALUE: one of JAX's configuration options (jax.config), e.g.",
           "    --jax_platforms=cpu --jax_enable_x64 --jax_log_compiles; checked when JAX",
           "    loads, before anything touches a device.", "",
           "Flags (T5X's, as in t5x/train.py, and absl's logging flags):", flag_help.rstrip(),
           ""]
  if FLAGS.gin_file:
    try:
      required = gin_utils.required_macros(FLAGS.gin_file, search_paths(), FLAGS.gin_bindings)
      lines.append(f"Macros {', '.join(FLAGS.gin_file)} leave %gin.REQUIRED (bind each with "
                   "--gin.NAME=VALUE): " + (", ".join(required) or "none"))
    except gin_utils.GinConfigError as e:
      lines.append(str(e))
  else:
    runs = sorted(p.name for p in (gin_utils.GIN_DIR / "runs").glob("*.gin"))
    lines += ["Give --gin_file=FILE with --help to list the macros it leaves %gin.REQUIRED.",
              f"Run files shipped (--gin_file=runs/NAME): {', '.join(runs)}"]
  return "\n".join(lines)


def search_paths():
  return [p for p in FLAGS.gin_search_paths if p]


def main(target: str, argv: Optional[Sequence[str]], *, prog: str, about: str,
         pass_config: bool = False):
  """Checks the command line, then imports `target` ('module:function') and calls it
  configured by gin (`gin_utils.call`)."""
  own_process = argv is None
  argv = list(sys.argv[1:] if argv is None else argv)
  wants_help = any(arg in HELP_ARGS for arg in argv)
  jax_args = parse_flags([arg for arg in argv if arg not in HELP_ARGS], prog)
  if wants_help:
    print(help_text(prog, about))
    return None
  required = gin_utils.required_macros(FLAGS.gin_file, search_paths(), FLAGS.gin_bindings)
  if required:
    raise gin_utils.GinConfigError(
        f"error: the gin files leave {', '.join(required)} %gin.REQUIRED: bind each with "
        f"--gin.NAME=VALUE (e.g. --gin.{required[0]}=...; strings in inner quotes).")
  check_settings(prog)
  start_logging(prog, own_process)
  apply_jax_flags(jax_args, prog)
  console.import_tensorflow_quietly()  # TF is only the input pipeline: off the accelerators
  module_name, fn_name = target.split(":")
  fn = getattr(importlib.import_module(module_name), fn_name)
  _seqio_settings()
  with console.library_warnings_through_tqdm(log_file_handler(own_process)):
    return _run(fn, pass_config)


def log_file_handler(own_process: bool) -> Optional[logging.Handler]:
  """absl's handler of the --log_dir file, where this process writes one (`start_logging`),
  so the library's warnings reach that file too (`console.library_warnings_through_tqdm`)."""
  if not (own_process and FLAGS.log_dir):
    return None
  return absl_logging.get_absl_handler().python_handler


def _run(fn, pass_config: bool):
  """`gin_utils.call`, with the device line (`console.report_devices`) between joining a
  multi-host job and the run: gin is parsed first for the job's bindings, the job joined,
  the devices reported; gin_utils.call then parses again (milliseconds) and finds the job
  already joined."""
  files, paths, bindings = FLAGS.gin_file, search_paths(), FLAGS.gin_bindings
  gin_utils.parse(files, paths, bindings)
  gin_utils.check_task_names()  # a misspelled task: named before the run writes anything
  gin_utils.start_distributed(FLAGS.initialization_timeout)
  console.report_devices()
  return gin_utils.call(fn, files, paths, bindings, pass_config=pass_config,
                        initialization_timeout=FLAGS.initialization_timeout)
