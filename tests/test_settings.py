"""decal_jax.settings: every DECAL_* variable's default, a good value and a bad one (a
SettingError naming the variable, the value, what is allowed and the fix), read when asked
for (not at import), and no other module of decal_jax/ or tasks/ reading one itself."""
import ast
import re

import pytest

import paths
from decal_jax import settings
from decal_jax.settings import SettingError

REPO = paths.REPO

DEFAULTS = {
    "DECAL_DATA_DIR": "../shared/data",
    "DECAL_LOCAL_DATA_DIR": None,
    "DECAL_CACHE_DIR": "~/.cache/decal_jax",
    "DECAL_BUILTIN_VOCAB": "bytes",
    "DECAL_T5_VOCAB": "gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model",
    "DECAL_TFDS_DATA_DIR": None,
    "DECAL_BAD_LINES": "fail",
    "DECAL_LLAMA_TOKENIZER": None,
    "DECAL_HF_TOKENIZER": None,
    "DECAL_COORDINATOR_ADDRESS": None,
    "DECAL_NUM_PROCESSES": None,
    "DECAL_PROCESS_ID": None,
    "DECAL_LOCAL_DEVICE_IDS": None,
    "DECAL_DISTRIBUTED": "off",
    "DECAL_PEER_TIMEOUT": 60,
    "DECAL_INDEX_CACHE_MIB": 1024,
    "DECAL_SKIPPED_TESTS": None,
}
# name: (what is set, what get() returns)
GOOD = {
    "DECAL_DATA_DIR": ("/data/shared", "/data/shared"),
    "DECAL_LOCAL_DATA_DIR": ("/data/local", "/data/local"),
    "DECAL_CACHE_DIR": ("/tmp/decal cache", "/tmp/decal cache"),
    "DECAL_BUILTIN_VOCAB": ("chars", "chars"),
    "DECAL_T5_VOCAB": ("/vocab/t5_spiece.model", "/vocab/t5_spiece.model"),
    "DECAL_TFDS_DATA_DIR": ("gs://bucket/tfds", "gs://bucket/tfds"),
    "DECAL_BAD_LINES": ("Skip", "skip"),
    "DECAL_LLAMA_TOKENIZER": ("/ckpt/tokenizer.model", "/ckpt/tokenizer.model"),
    "DECAL_HF_TOKENIZER": ("/ckpt/tokenizer.json", "/ckpt/tokenizer.json"),
    "DECAL_COORDINATOR_ADDRESS": ("10.0.0.1:1234", "10.0.0.1:1234"),
    "DECAL_NUM_PROCESSES": ("4", 4),
    "DECAL_PROCESS_ID": ("0", 0),
    "DECAL_LOCAL_DEVICE_IDS": ("0, 1,2", (0, 1, 2)),
    "DECAL_DISTRIBUTED": ("AUTO", "auto"),
    "DECAL_PEER_TIMEOUT": ("30", 30),
    "DECAL_INDEX_CACHE_MIB": ("0", 0),
    "DECAL_SKIPPED_TESTS": ("/tmp/skipped.jsonl", "/tmp/skipped.jsonl"),
}
PATH_RULE = "must be a path (no leading or trailing blanks, no control characters)"
LOCATION_RULE = ("must be a path or a URL such as gs://... (no leading or trailing blanks, "
                 "no control characters)")
BLANKS = "(leading or trailing blanks: a copy-paste slip?)"
# name: (a bad value, the error's words after "NAME=<value> is not allowed")
BAD = {
    "DECAL_DATA_DIR": ("/data/shared\n", f" {BLANKS}: DECAL_DATA_DIR (the shared data folder "
                       f"(real text, BEIR, vocabulary copies)) {PATH_RULE}."),
    "DECAL_LOCAL_DATA_DIR": (" /data/local", f" {BLANKS}"),
    "DECAL_CACHE_DIR": ("/tmp/cache ", f" {BLANKS}"),
    "DECAL_BUILTIN_VOCAB": ("bites", ": DECAL_BUILTIN_VOCAB (the built-in vocabulary's recipe "
                            "('chars' for checkpoints from before byte fallback)) must be one "
                            "of bytes, chars."),
    "DECAL_T5_VOCAB": ("\tgs://t5", f" {BLANKS}: DECAL_T5_VOCAB (the T5 SentencePiece model "
                       f"(a local copy or a gs:// URL)) {LOCATION_RULE}."),
    "DECAL_TFDS_DATA_DIR": ("/tfds\x1bx", " (a control character)"),
    "DECAL_BAD_LINES": ("maybe", ": DECAL_BAD_LINES (a local data line that cannot be read: "
                        "stop the run, or skip it (gin downstream_tasks.local_data.bad_lines "
                        "wins)) must be one of fail, skip."),
    "DECAL_LLAMA_TOKENIZER": ("a\nb", " (a control character)"),
    "DECAL_HF_TOKENIZER": (" tokenizer.json", f" {BLANKS}"),
    "DECAL_COORDINATOR_ADDRESS": ("localhost", ": DECAL_COORDINATOR_ADDRESS (multi-host: "
                                  "host:port of process 0) must be host:port, the port a "
                                  "whole number in 1..65535."),
    "DECAL_NUM_PROCESSES": ("abc", " (not a whole number): DECAL_NUM_PROCESSES (multi-host: how "
                            "many processes the job has) must be a whole number >= 1."),
    "DECAL_PROCESS_ID": ("-1", " (below 0): DECAL_PROCESS_ID (multi-host: this process's "
                         "index, 0 .. processes - 1) must be a whole number >= 0."),
    "DECAL_LOCAL_DEVICE_IDS": ("0;1", ": DECAL_LOCAL_DEVICE_IDS (multi-host: the devices this "
                               "process uses (GPU: one per rank)) must be comma-separated "
                               "whole numbers >= 0, e.g. 0,1,2,3."),
    "DECAL_DISTRIBUTED": ("sometimes", ": DECAL_DISTRIBUTED (multi-host: 'auto' lets JAX "
                          "detect the cluster (TPU pod, SLURM, Open MPI, Kubernetes); "
                          "--multiprocess_gpu sets it) must be one of auto, off."),
    "DECAL_PEER_TIMEOUT": ("0", " (below 1): DECAL_PEER_TIMEOUT (multi-host: seconds a process "
                           "may give no sign of life before the others stop, naming it "
                           "(runtime/peer_watch.py)) must be a whole number >= 1."),
    "DECAL_INDEX_CACHE_MIB": ("1.5", " (not a whole number): DECAL_INDEX_CACHE_MIB (MiB of an exact index's padded "
                              "document chunks kept on the device between searches (a served "
                              "index pads its corpus once); 0: none, an index that needs "
                              "more: none) must be a whole number >= 0."),
    "DECAL_SKIPPED_TESTS": ("skipped.jsonl\r", f" {BLANKS}"),
}


@pytest.fixture(autouse=True)
def _no_decal_variables(monkeypatch):
  """Every DECAL_* variable unset, and each put back as it was afterwards (also those that
  `settings.put` writes: setenv first records the value to restore)."""
  for name in settings.SETTINGS:
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


def test_the_table_names_every_decal_variable_in_the_sources():
  pattern = re.compile(r"\bDECAL_[A-Z][A-Z0-9_]*")
  named = set()
  for folder in ("decal_jax", "tasks", "tools"):
    for path in (REPO / folder).rglob("*.py"):
      named |= set(pattern.findall(path.read_text()))
  named |= set(pattern.findall((REPO / "tests" / "conftest.py").read_text()))
  assert named == set(settings.SETTINGS) == set(DEFAULTS) == set(GOOD) == set(BAD)


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_unset_or_empty_gives_the_default(name, monkeypatch):
  assert settings.get(name) == DEFAULTS[name]
  monkeypatch.setenv(name, "")
  assert settings.get(name) == DEFAULTS[name]


@pytest.mark.parametrize("name", sorted(GOOD))
def test_a_good_value_is_read_when_asked_for(name, monkeypatch):
  raw, value = GOOD[name]
  monkeypatch.setenv(name, raw)  # after import: read at the call
  assert settings.get(name) == value
  assert settings.get(name, {name: raw}) == value  # or from a mapping given


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_names_the_variable_the_value_what_is_allowed_and_the_fix(
    name, monkeypatch):
  raw, words = BAD[name]
  monkeypatch.setenv(name, raw)
  with pytest.raises(SettingError) as error:
    settings.get(name)
  message = str(error.value)
  assert message.startswith(f"{name}={raw!r} is not allowed{words}"), message
  default = "unset" if DEFAULTS[name] is None else repr(DEFAULTS[name])
  assert message.endswith(f"or unset it for the default ({default}).")
  assert isinstance(error.value, ValueError)


def test_the_three_named_bad_values_read_in_full(monkeypatch):
  monkeypatch.setenv("DECAL_NUM_PROCESSES", "abc")
  monkeypatch.setenv("DECAL_BAD_LINES", "maybe")
  monkeypatch.setenv("DECAL_DISTRIBUTED", "sometimes")
  expected = {
      "DECAL_NUM_PROCESSES":
          "DECAL_NUM_PROCESSES='abc' is not allowed (not a whole number): DECAL_NUM_PROCESSES "
          "(multi-host: how many processes the job has) must be a whole number >= 1. Fix: set "
          "it to such a value, e.g. DECAL_NUM_PROCESSES=4, or unset it for the default "
          "(unset).",
      "DECAL_BAD_LINES":
          "DECAL_BAD_LINES='maybe' is not allowed: DECAL_BAD_LINES (a local data line that "
          "cannot be read: stop the run, or skip it (gin downstream_tasks.local_data."
          "bad_lines wins)) must be one of fail, skip. Fix: set it to such a value, e.g. "
          "DECAL_BAD_LINES=fail, or unset it for the default ('fail').",
      "DECAL_DISTRIBUTED":
          "DECAL_DISTRIBUTED='sometimes' is not allowed: DECAL_DISTRIBUTED (multi-host: 'auto' "
          "lets JAX detect the cluster (TPU pod, SLURM, Open MPI, Kubernetes); "
          "--multiprocess_gpu sets it) must be one of auto, off. Fix: set it to such a value, "
          "e.g. DECAL_DISTRIBUTED=auto, or unset it for the default ('off').",
  }
  for name, message in expected.items():
    with pytest.raises(SettingError) as error:
      settings.get(name)
    assert str(error.value) == message


def test_put_checks_before_it_writes(monkeypatch):
  settings.put("DECAL_NUM_PROCESSES", 2)
  assert settings.get("DECAL_NUM_PROCESSES") == 2
  with pytest.raises(SettingError, match="DECAL_NUM_PROCESSES='two' is not allowed"):
    settings.put("DECAL_NUM_PROCESSES", "two")
  assert settings.get("DECAL_NUM_PROCESSES") == 2  # left as it was


def test_check_all_refuses_the_first_bad_variable(monkeypatch):
  settings.check_all()  # nothing set: every default
  monkeypatch.setenv("DECAL_PROCESS_ID", "3")
  settings.check_all()
  monkeypatch.setenv("DECAL_BAD_LINES", "maybe")
  with pytest.raises(SettingError, match="DECAL_BAD_LINES='maybe'"):
    settings.check_all()
  settings.check_all({"DECAL_BAD_LINES": "skip"})  # a mapping given instead of os.environ


def test_an_unknown_name_is_a_programming_error():
  with pytest.raises(KeyError, match="DECAL_NO_SUCH is not a decal_jax setting"):
    settings.get("DECAL_NO_SUCH")


def test_the_table_lists_every_variable_with_its_default():
  lines = settings.table().splitlines()
  assert lines[:2] == ["| name | meaning | default | allowed |", "|---|---|---|---|"]
  assert lines[2] == ("| DECAL_DATA_DIR | the shared data folder (real text, BEIR, vocabulary "
                      "copies) | `../shared/data` | a path (no leading or trailing blanks, no "
                      "control characters) |")
  assert [line.split(" | ")[0][2:] for line in lines[2:]] == list(DEFAULTS)


def test_the_choices_are_the_librarys():
  from decal_jax.data import local_files, vocabularies
  assert settings.setting("DECAL_BUILTIN_VOCAB").choices == tuple(vocabularies.BUILTIN_RECIPES)
  assert settings.setting("DECAL_BUILTIN_VOCAB").default == vocabularies.DEFAULT_RECIPE
  assert set(settings.setting("DECAL_BAD_LINES").choices) == set(local_files.BAD_LINE_POLICIES)


def test_settings_imports_nothing_from_decal_jax():
  tree = ast.parse((REPO / "decal_jax" / "settings.py").read_text())
  imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
  assert not [m for m in imported if m.startswith("decal_jax")]


# ------------------------------------------------------------------- the one reader

# Modules that still read DECAL_* variables themselves, each with what is to be done; an
# entry must go when its module stops (the test below checks both ways).
PENDING = {}  # modules still reading DECAL_* themselves: none


def _decal_names(tree: ast.AST):
  """Module-level names bound to a 'DECAL_...' string (e.g. ENV_NUM_PROCESSES)."""
  names = set()
  for node in ast.walk(tree):
    if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        and str(node.value.value).startswith("DECAL_")):
      names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
  return names


def _environ_reads(tree: ast.AST):
  """Lines that read a DECAL_* variable: environ.get / environ[...] / getenv /
  environ.setdefault / environ.pop of a 'DECAL_...' literal or of a name bound to one."""
  names = _decal_names(tree)

  def decal(arg) -> bool:
    return ((isinstance(arg, ast.Constant) and str(arg.value).startswith("DECAL_"))
            or (isinstance(arg, ast.Name) and arg.id in names))

  def environ(node) -> bool:
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id == "environ"))

  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
      func = node.func
      reads = (func.attr == "getenv" or (func.attr in ("get", "setdefault", "pop")
                                         and environ(func.value)))
      if reads and decal(node.args[0]):
        lines.append(node.lineno)
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
      if environ(node.value) and decal(node.slice):
        lines.append(node.lineno)
  return lines


def test_only_settings_reads_decal_variables():
  readers = {}
  for folder in ("decal_jax", "tasks"):
    for path in sorted((REPO / folder).rglob("*.py")):
      rel = path.relative_to(REPO).as_posix()
      if rel == "decal_jax/settings.py":
        continue
      lines = _environ_reads(ast.parse(path.read_text()))
      if lines:
        readers[rel] = lines
  assert sorted(readers) == sorted(PENDING), (
      f"read DECAL_* variables through decal_jax.settings: {readers}")


def test_the_reader_check_catches_each_form():
  source = ("import os\nX = 'DECAL_A'\nos.environ.get('DECAL_B')\nos.environ['DECAL_C']\n"
            "os.getenv('DECAL_D', '')\nos.environ.get(X)\nos.environ['DECAL_E'] = '1'\n"
            "os.environ.get('HOME')\n")
  assert sorted(_environ_reads(ast.parse(source))) == [3, 4, 5, 6]

