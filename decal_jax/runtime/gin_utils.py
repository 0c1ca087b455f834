"""Command-line gin handling shared by the entry points (T5X's flag vocabulary).

`--gin_file=F` (repeatable; resolved against the paths given, `--gin_search_paths`, the
current directory and the package's gin files, `GIN_DIR`), `--gin.NAME=VALUE` (one binding, e.g.
`--gin.MODEL_DIR="'/tmp/m'"`) and `--gin_bindings='NAME = VALUE'`; `load_model` builds the
gin `MODEL` and restores its latest checkpoint (what the tools and scripts need).
"""
import argparse
import difflib
import importlib.util  # noqa: F401  (gin's package-resource reader uses it unimported)
import logging
import pathlib
import re
import sys
import tokenize
from typing import Any, Callable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import gin
from gin import config_parser

from decal_jax.runtime import peer_watch



def _gin_dir() -> pathlib.Path:
  """The gin files shipped with the package: decal_jax/gin in an installed wheel; gin/ beside
  the package in a checkout (setup.py maps it to decal_jax/gin; an editable install keeps it)."""
  package = pathlib.Path(__file__).resolve().parents[1]  # decal_jax/
  installed = package / "gin"
  return installed if installed.is_dir() else package.parent / "gin"


GIN_DIR = _gin_dir()


class _QuietSearchMisses(logging.Filter):
  """gin logs an error for every search path a file is not in; only the outcome matters."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Path not found")


logging.getLogger().addFilter(_QuietSearchMisses())


def _never_raises(existence_check):
  def check(path):
    try:
      return existence_check(path)
    except (TypeError, ValueError, ImportError):
      return False
  return check


# gin also looks gin files up as Python package resources ('runs/x.gin' -> package 'runs');
# a plain folder named like a gin subfolder in the working directory (e.g. a MODEL_DIR under
# ./runs) is a namespace package without a file, and gin's check then crashes instead of
# moving on to the search paths. Make that check answer "not here" instead.
gin.config._FILE_READERS[:] = [(reader, _never_raises(check))
                               for reader, check in gin.config._FILE_READERS]


class GinConfigError(SystemExit):
  """A gin file or binding problem, reported without a traceback."""


class _ArgumentParser(argparse.ArgumentParser):
  """argparse whose usage errors (`--gin_file` without a value, an ambiguous `--gin`) are
  GinConfigErrors, like the other command-line mistakes."""

  def error(self, message):
    raise GinConfigError(f"error: {message}; use --gin_file=F, --gin.NAME=VALUE or "
                         "--gin_bindings='NAME = VALUE'.")


def split_args(argv: Sequence[str]) -> Tuple[List[str], List[str], List[str]]:
  """(gin files, search paths, bindings) from the command line."""
  parser = _ArgumentParser(add_help=True)
  parser.add_argument("--gin_file", action="append", default=[])
  parser.add_argument("--gin_search_paths", action="append", default=[])
  parser.add_argument("--gin_bindings", action="append", default=[])
  known, rest = parser.parse_known_args(list(argv))
  bindings = list(known.gin_bindings)
  for arg in rest:
    if arg.startswith("--gin.") and "=" in arg:
      name, value = arg[len("--gin."):].split("=", 1)
      bindings.append(f"{name} = {value}")
    else:
      raise GinConfigError(f"error: unrecognised argument {arg!r}; use --gin_file=F, "
                           "--gin.NAME=VALUE or --gin_bindings='NAME = VALUE'.")
  paths = [p for group in known.gin_search_paths for p in group.split(",") if p]
  return known.gin_file, paths, bindings


def parse(files: Sequence[str], search_paths: Sequence[str], bindings: Sequence[str],
          register_tasks: bool = True) -> None:
  """Parses gin files and bindings; a missing file, an unknown binding or a binding of a
  macro no file defines or reads (a misspelling) exits with a message naming it. With
  `register_tasks` (seqio, TensorFlow), the seqio tasks and their configurables
  (`local_data`, `beir_tasks`) are registered first, for the run files that name them; a
  caller that reads no task (bench_train's synthetic batches) may leave them out."""
  if register_tasks:
    import decal_jax.tasks  # noqa: F401  (registers the seqio tasks that gin files name)
  gin.clear_config()
  all_paths = _search_paths(search_paths)
  for path in all_paths:
    gin.add_config_file_search_path(path)
  if not files:
    raise GinConfigError("error: give at least one --gin_file (e.g. "
                         "--gin_file=runs/pretrain_builtin.gin).")
  check_bindings(files, search_paths, bindings)  # malformed or repeated: named, before gin
  try:
    for file in files:
      gin.parse_config_file(file)
    defined_by_files = _macros_defined()
    gin.parse_config(list(bindings))
    check_macro_bindings(bindings, defined_by_files)
    gin.finalize()
  except (IOError, OSError) as e:
    raise GinConfigError(f"error: gin file not found: {e}\nSearched: {all_paths}") from e
  except ImportError as e:  # an `import` line of a gin file or binding
    raise GinConfigError(f"error: a gin import failed: {e}\nCheck the module name, or "
                         "install the package that provides it.") from e
  except (ValueError, KeyError, SyntaxError, TypeError, tokenize.TokenError) as e:
    raise GinConfigError(f"error: bad gin configuration: {e}\nCheck the binding's name and "
                         "value (e.g. --gin.TRAIN_STEPS=100, strings as "
                         "--gin.MODEL_DIR=\"'/tmp/m'\").") from e


def _search_paths(search_paths: Sequence[str]) -> List[str]:
  """Where gin files are looked up (after the path as given): the paths the user gave, the
  current directory, the package's gin files."""
  return list(search_paths) + [str(pathlib.Path.cwd()), str(GIN_DIR)]


_REQUIRED = object()  # what _NamesOnly makes of `%gin.REQUIRED`


class _NamesOnly(config_parser.ParserDelegate):
  """Reads binding statements without resolving the configurables their values name."""

  def configurable_reference(self, scoped_configurable_name, evaluate):
    return None

  def macro(self, macro_name):
    return _REQUIRED if macro_name == "gin.REQUIRED" else None


def _open_gin_file(file: str, search_paths: Sequence[str]):
  """The gin file opened as gin would find it (the path itself, then each search path)."""
  prefixes = [""] if pathlib.Path(file).is_absolute() else [""] + _search_paths(search_paths)
  for prefix in prefixes:
    path = str(pathlib.Path(prefix, file)) if prefix else file
    for reader, exists in gin.config._FILE_READERS:
      if exists(path):
        return reader(path)
  raise GinConfigError(f"error: gin file not found: {file}\nSearched: {prefixes}")


def _statements(file: str, search_paths: Sequence[str]):
  """The binding statements of a gin file and the files it includes, in order."""
  with _open_gin_file(file, search_paths) as handle:
    try:
      statements = list(config_parser.ConfigParser(handle, _NamesOnly()))
    except (SyntaxError, tokenize.TokenError) as e:
      raise GinConfigError(f"error: bad gin file {file}: {e}") from e
  for statement in statements:
    if isinstance(statement, config_parser.IncludeStatement):
      yield from _statements(statement.filename, search_paths)
    elif isinstance(statement, config_parser.BindingStatement):
      yield statement


def required_macros(files: Sequence[str], search_paths: Sequence[str],
                    bindings: Sequence[str]) -> List[str]:
  """The macros the gin files (and includes) leave `%gin.REQUIRED` after the bindings. Reads
  the files only (no configurable is imported): a missing file or a syntax error raises
  GinConfigError here, long before JAX or TensorFlow would load."""
  if not files:
    raise GinConfigError("error: give at least one --gin_file (e.g. "
                         "--gin_file=runs/pretrain_builtin.gin).")
  required = {}
  from_files, from_command_line = check_bindings(files, search_paths, bindings)
  statements = from_files + [statement for _, _, statement in from_command_line]
  for statement in statements:
    if isinstance(statement, config_parser.BindingStatement) and not statement.arg_name:
      required[(statement.scope, statement.selector)] = statement.value is _REQUIRED
  return [selector for (scope, selector), left in required.items() if left and not scope]


def check_bindings(files: Sequence[str], search_paths: Sequence[str], bindings: Sequence[str]
                   ) -> Tuple[list, list]:
  """(the gin files' binding statements, (number, binding, statement) of each command-line
  binding): exits naming a malformed binding (with its fix), or a macro bound twice with
  two values in one gin file or on the command line, which gin would silently settle by
  taking the last. Reads the files only (nothing is imported)."""
  from_files = [s for file in files for s in _statements(file, search_paths)]
  from_command_line = _binding_statements(bindings)
  _check_repeated_in_files(from_files)
  _check_repeated_on_command_line(from_command_line)
  return from_files, from_command_line


def _binding_statements(bindings: Sequence[str]) -> List[Tuple[int, str, Any]]:
  """(number, binding, statement) of each command-line binding, parsed one by one."""
  out = []
  for number, binding in enumerate(bindings, start=1):
    try:
      statements = list(config_parser.ConfigParser(binding, _NamesOnly()))
    except (SyntaxError, ValueError, TypeError, tokenize.TokenError) as e:
      raise GinConfigError(_malformed(binding, e)) from None
    out += [(number, binding, s) for s in statements
            if isinstance(s, config_parser.BindingStatement)]
  return out


def _malformed(binding: str, error: BaseException) -> str:
  """The message for a binding gin cannot parse: the binding, why, and the fix."""
  name, _, value = (part.strip() for part in binding.partition("="))
  if name and _unquoted_string(value):
    return (f"error: the gin binding {binding!r} is malformed: its value {value} is not a "
            "Python literal. A string needs quotes that reach gin, inside the shell's: "
            f"--gin.{name}=\"'{value}'\" (or --gin_bindings=\"{name} = '{value}'\").")
  return (f"error: the gin binding {binding!r} is malformed ({_reason(error)}). Write "
          "NAME=VALUE with VALUE a Python literal (a number, True / False / None, a list, a "
          "quoted string), %MACRO or @configurable, e.g. --gin.TRAIN_STEPS=100, "
          "--gin.MODEL_DIR=\"'/tmp/m'\".")


def _unquoted_string(value: str) -> bool:
  """Whether `value` reads as a string whose quotes the shell took: a bare word or path."""
  return bool(re.fullmatch(r"[\w./~:+-]*[A-Za-z_/~][\w./~:+-]*", value)) and value not in (
      "True", "False", "None")


def _reason(error: BaseException) -> str:
  """gin's parse error without its line numbers and AST object addresses."""
  if isinstance(error, tokenize.TokenError):  # 'EOF in multi-line statement'
    return "a bracket or quote is not closed"
  else:
    text = str(getattr(error, "msg", None) or error)
  text = re.sub(r"\s*(?:on line \d+|\(line \d+\))", "", text.splitlines()[0] if text else "")
  return re.sub(r":?\s*<ast\.\w+ object at 0x[0-9a-f]+>", "", text).strip() or type(
      error).__name__


def _is_macro(statement) -> bool:
  return (not statement.scope and not statement.arg_name
          and bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", statement.selector)))


def _value_text(statement) -> str:
  return statement.location.line_content.split("=", 1)[-1].strip()


def _check_repeated_in_files(statements) -> None:
  """Refuses a macro bound twice, to two values, in one gin file."""
  seen = {}
  for s in statements:
    if not _is_macro(s):
      continue
    key = (s.location.filename, s.selector)
    first = seen.setdefault(key, s)
    if first.location.line_num != s.location.line_num and _value_text(first) != _value_text(s):
      raise GinConfigError(
          f"error: {s.location.filename} binds the macro {s.selector} twice: to "
          f"{_value_text(first)} on line {first.location.line_num} and to {_value_text(s)} "
          f"on line {s.location.line_num}; gin would silently take the last. Keep one of "
          "the two lines.")


def _ordinal(n: int) -> str:
  return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _check_repeated_on_command_line(numbered) -> None:
  """Refuses a macro bound twice, to two values, on the command line."""
  seen = {}
  for number, binding, s in numbered:
    if not _is_macro(s):
      continue
    first_number, first_binding, first = seen.setdefault(s.selector, (number, binding, s))
    if first_number != number and _value_text(first) != _value_text(s):
      name = s.selector
      raise GinConfigError(
          f"error: the macro {name} is bound twice on the command line: to "
          f"{_value_text(first)} by the {_ordinal(first_number)} binding "
          f"(--gin.{name}={_value_text(first)}, {first_binding!r}) and to {_value_text(s)} by "
          f"the {_ordinal(number)} (--gin.{name}={_value_text(s)}, {binding!r}); gin would "
          "silently take the last. Give it once.")


def _macros_defined() -> set:
  """The macros the parsed gin config binds (`NAME = value`: gin keys it (NAME, 'gin.macro'))."""
  bindings = gin.config._CONFIG
  return {scope for scope, selector in bindings if selector == "gin.macro"}


def _macros_read() -> set:
  """The macros some binding of the parsed gin config reads (`... = %NAME`)."""
  bindings = gin.config._CONFIG
  references = gin.config.iterate_references(bindings, to=gin.get_configurable(gin.config.macro))
  return {ref.scoped_selector.rsplit("/", 1)[0] for ref in references}  # 'NAME/gin.macro'


def check_macro_bindings(bindings: Sequence[str], defined_by_files: set) -> None:
  """Refuses a command-line binding of a MACRO (an all-caps name) that no loaded gin file
  defines and no binding reads: a misspelling such as TRAIN_STEPZ would otherwise change
  nothing, silently. Call it with the gin files and the bindings parsed, before finalising."""
  read = _macros_read()
  known = sorted(defined_by_files | read)
  statements = config_parser.ConfigParser("\n".join(bindings), _NamesOnly())
  for statement in statements:
    if not isinstance(statement, config_parser.BindingStatement) or statement.arg_name:
      continue
    name = statement.selector
    if (statement.scope or not re.fullmatch(r"[A-Z][A-Z0-9_]*", name)
        or name in defined_by_files or name in read):
      continue
    close = difflib.get_close_matches(name, known, n=3)
    hint = (f"Did you mean {', '.join(close)}?" if close else
            f"The loaded gin files' macros are: {', '.join(known) or 'none'}.")
    raise GinConfigError(
        f"error: the binding {statement.location.line_content.strip()!r} sets the macro "
        f"{name}, which no loaded gin file defines or reads, so it would change nothing. "
        f"{hint} (Each gin file's header lists the macros it takes.)")


# The parameters that name a registered task: {parameter: configurables it is checked for
# (None: any)}. `evaluate_retrieval.task_name` (BEIR_TASK) names a BEIR task.
TASK_PARAMETERS = {"mixture_or_task_name": None, "task_name": ("evaluate_retrieval",)}
BEIR_OF_YOUR_OWN = ("a BEIR folder of your own: give it as BEIR_FOLDER, or register it with "
                    "`retrieval_tasks.beir_tasks.folders = {name: folder}` in a gin file")


def _bound_value(scope: str, selector: str, parameter: str) -> Tuple[Any, List[str]]:
  """The value bound to `scope/selector.parameter` with its macros followed, and the macros
  it went through (the first is the one the user binds, e.g. MIXTURE_OR_TASK_NAME)."""
  value = gin.query_parameter(f"{scope}/{selector}.{parameter}" if scope else
                              f"{selector}.{parameter}")
  macros: List[str] = []
  while (isinstance(value, gin.config.ConfigurableReference)  # %NAME is @NAME/gin.macro()
         and value.scoped_selector.endswith("/gin.macro") and len(macros) < 20):
    macros.append(value.scoped_selector.rsplit("/", 1)[0])
    value = gin.query_parameter(f"%{macros[-1]}")
  return value, macros


def check_task_names() -> None:
  """Refuses a task name in the parsed config that no task or mixture registers (a
  `mixture_or_task_name` of any configurable: MIXTURE_OR_TASK_NAME in the run files; the
  retrieval run's BEIR_TASK), naming the binding, the closest registered names and the
  command that lists them. The entry points call it once gin is parsed (and the tasks its
  files import registered), before the run starts, so MODEL_DIR stays as it was found; the
  run itself would refuse it later (`pipeline.get_task`) with a traceback."""
  from decal_jax.data import pipeline
  from decal_jax.tasks import retrieval_tasks
  for (scope, selector), parameters in list(gin.config._CONFIG.items()):
    for parameter, owners in TASK_PARAMETERS.items():
      if parameter not in parameters or (
          owners is not None and selector.rsplit(".", 1)[-1] not in owners):
        continue
      try:
        name, macros = _bound_value(scope, selector, parameter)
      except ValueError:  # a macro left unbound: the required-macros check names those
        continue
      if not isinstance(name, str):
        continue  # None (e.g. BEIR_TASK when a BEIR_FOLDER is given), or computed
      beir = parameter == "task_name"
      known = retrieval_tasks.beir_task_names() if beir else pipeline.registered_task_names()
      if name in known:
        continue
      binding = ".".join(selector.split(".")[-2:] + [parameter])  # pipeline.DatasetConfig...
      setting = f"{macros[0]} ({binding})" if macros else binding
      if beir:
        raise GinConfigError("error: " + pipeline.unknown_task_message(
            setting, name, known, "BEIR task", own=BEIR_OF_YOUR_OWN))
      raise GinConfigError("error: " + pipeline.unknown_task_message(setting, name, known))


def start_distributed(initialization_timeout: Optional[int] = None) -> bool:
  """Joins a multi-host job (`partitioning.initialize_distributed`, with its gin bindings
  if any, else the DECAL_* / JAX environment variables) before anything touches devices."""
  from decal_jax import partitioning
  fn = partitioning.initialize_distributed
  try:
    fn = gin.get_configurable(fn)  # registered when a gin file binds one of its arguments
  except ValueError:
    pass
  if initialization_timeout is not None:
    joined = fn(initialization_timeout=initialization_timeout)
  else:
    joined = fn()
  if joined:  # a lost process then stops the others, naming it (once per process)
    peer_watch.start(partitioning.peer_timeout_of(_bound_peer_timeout()))
  return joined


def _bound_peer_timeout() -> Optional[int]:
  """`partitioning.initialize_distributed.peer_timeout` if gin binds it."""
  try:
    return gin.query_parameter("partitioning.initialize_distributed.peer_timeout")
  except ValueError:
    return None


def run(fn: Callable, argv: Optional[Sequence[str]] = None, pass_config: bool = False):
  """Parses a command line (`split_args`) and calls the gin-configured `fn` (the entry
  points parse T5X's full flag set with decal_jax.runtime.cli instead)."""
  files, paths, bindings = split_args(sys.argv[1:] if argv is None else argv)
  return call(fn, files, paths, bindings, pass_config=pass_config)


def call(fn: Callable, files: Sequence[str], search_paths: Sequence[str],
         bindings: Sequence[str], *, pass_config: bool = False,
         initialization_timeout: Optional[int] = None):
  """Parses the gin files and bindings, joins a multi-host job if one is configured, and
  calls the gin-configured `fn` (with the gin config text if `pass_config`)."""
  parse(files, search_paths, bindings)
  start_distributed(initialization_timeout)
  configured = gin.get_configurable(fn)
  try:
    if pass_config:
      return configured(gin_config_text=gin.config_str())
    return configured()
  except TypeError as e:
    if "missing" in str(e) and "argument" in str(e):
      raise GinConfigError(f"error: {e}. Bind it in a gin file or with --gin.NAME=VALUE.") from e
    raise


class LoadedModel(NamedTuple):
  """What `load_model` gives: the gin `MODEL`, and with a MODEL_DIR its latest params."""
  model: Any
  params: Any            # None without a model_dir
  step: Optional[int]    # the checkpoint's step; None without a model_dir
  partitioner: Any       # the partitioner the params were restored with (None without)


def load_model(gin_files: Sequence[str], model_dir: Optional[str] = None, *,
               search_paths: Sequence[str] = (), bindings: Sequence[str] = (),
               feature_lengths: Optional[Mapping[str, int]] = None,
               partitioner=None, register_tasks: bool = True) -> LoadedModel:
  """The model that gin files + bindings configure (`MODEL`), and with `model_dir` the
  params of the latest checkpoint there. Parameter shapes do not depend on the lengths;
  `feature_lengths` (default: the gin `TASK_FEATURE_LENGTHS`) only shape the dummy batch
  that traces them. The gin config stays parsed for the caller's further queries.
  `register_tasks`: as `parse`."""
  parse(gin_files, search_paths, bindings, register_tasks)
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  if model_dir is None:
    return LoadedModel(model, None, None, None)
  from decal_jax import partitioning
  from decal_jax.runtime import train_state
  from decal_jax.data import pipeline
  path = pathlib.Path(model_dir)
  if not path.is_dir():
    raise FileNotFoundError(f"--model_dir {model_dir} does not exist: give the MODEL_DIR of a "
                            "trained run (python -m decal_jax.train ... --gin.MODEL_DIR=...).")
  if not any(re.fullmatch(r"checkpoint_\d+", p.name) for p in path.iterdir() if p.is_dir()):
    raise FileNotFoundError(f"No checkpoint in {model_dir} (no checkpoint_<step> folder): "
                            "train first with `python -m decal_jax.train ... "
                            "--gin.MODEL_DIR=...`, or point --model_dir at a finished run.")
  if feature_lengths is None:
    try:
      feature_lengths = gin.query_parameter("%TASK_FEATURE_LENGTHS")
    except ValueError as e:
      raise ValueError("load_model needs feature_lengths (or a gin TASK_FEATURE_LENGTHS) "
                       "to trace the parameter shapes.") from e
  partitioner = partitioner or partitioning.Partitioner()
  cfg = pipeline.DatasetConfig("", dict(feature_lengths))
  params, step = train_state.restore_params(model, model_dir, cfg, partitioner)
  return LoadedModel(model, params, step, partitioner)
