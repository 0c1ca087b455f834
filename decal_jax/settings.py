"""Every DECAL_* environment variable decal_jax reads: what it means, its default, what it
may hold, and the one place each is read and checked.

A variable is read when its value is asked for (`get(name)`), never at import: tests and
the command line (`runtime/cli.py`) set them while the process runs. Unset and empty mean
the same: the default. A value the library cannot use raises `SettingError` (a
ValueError) naming the variable, the value, what is allowed and how to fix it. This
module imports nothing from decal_jax, so every room (and the lab in tools/) may use it.

SETTINGS is the table (name, meaning, default, kind of value); `table()` writes it as
markdown, and `python -m decal_jax.settings` prints it. `put` writes a checked value (the
command line's flags), `check_all` checks every variable that is set.
"""
import dataclasses
import os
from typing import Any, Mapping, Optional, Tuple

# The kinds of value a variable holds (Setting.kind).
PATH, LOCATION, CHOICE, COUNT, INDEX, ADDRESS, IDS = (
    "path", "path or URL", "choice", "count", "index", "address", "ids")


class SettingError(ValueError):
  """A DECAL_* variable holds a value decal_jax cannot use (the message names it, the
  value, what is allowed and the fix)."""


@dataclasses.dataclass(frozen=True)
class Setting:
  """One variable: `default` is its value when unset or empty (None: not set)."""
  name: str
  meaning: str
  default: Any
  kind: str
  choices: Tuple[str, ...] = ()

  def allowed(self) -> str:
    """What the variable may hold, in words."""
    return {PATH: "a path (no leading or trailing blanks, no control characters)",
            LOCATION: "a path or a URL such as gs://... (no leading or trailing blanks, no "
                      "control characters)",
            CHOICE: f"one of {', '.join(self.choices)}",
            COUNT: "a whole number >= 1",
            INDEX: "a whole number >= 0",
            ADDRESS: "host:port, the port a whole number in 1..65535",
            IDS: "comma-separated whole numbers >= 0, e.g. 0,1,2,3"}[self.kind]

  def example(self) -> str:
    return {PATH: "/path/to/it", LOCATION: "/path/to/it",
            CHOICE: self.choices[0] if self.choices else "", COUNT: "4", INDEX: "0",
            ADDRESS: "10.0.0.1:1234", IDS: "0,1"}[self.kind]


T5_PUBLIC_VOCAB = "gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model"

SETTINGS = {s.name: s for s in (
    Setting("DECAL_DATA_DIR", "the shared data folder (real text, BEIR, vocabulary copies)",
            os.path.join("..", "shared", "data"), PATH),
    Setting("DECAL_LOCAL_DATA_DIR", "the folder of local task files (<dir>/<task>/<split>"
            ".jsonl; gin downstream_tasks.local_data.directory wins)", None, PATH),
    Setting("DECAL_CACHE_DIR", "where built vocabularies and the built-in BEIR folder are "
            "cached", os.path.join("~", ".cache", "decal_jax"), PATH),
    Setting("DECAL_BUILTIN_VOCAB", "the built-in vocabulary's recipe ('chars' for "
            "checkpoints from before byte fallback)", "bytes", CHOICE, ("bytes", "chars")),
    Setting("DECAL_T5_VOCAB", "the T5 SentencePiece model (a local copy or a gs:// URL)",
            T5_PUBLIC_VOCAB, LOCATION),
    Setting("DECAL_TFDS_DATA_DIR", "where TensorFlow Datasets keeps prepared data "
            "(--tfds_data_dir sets it)", None, PATH),
    Setting("DECAL_BAD_LINES", "a local data line that cannot be read: stop the run, or "
            "skip it (gin downstream_tasks.local_data.bad_lines wins)", "fail", CHOICE,
            ("fail", "skip")),
    Setting("DECAL_LLAMA_TOKENIZER", "LLaMA's tokenizer.model (hf_vocabularies."
            "HfSentencePieceVocabulary)", None, PATH),
    Setting("DECAL_HF_TOKENIZER", "a Hugging Face tokenizer.json (hf_vocabularies."
            "HfTokenizerVocabulary)", None, PATH),
    Setting("DECAL_COORDINATOR_ADDRESS", "multi-host: host:port of process 0", None, ADDRESS),
    Setting("DECAL_NUM_PROCESSES", "multi-host: how many processes the job has", None, COUNT),
    Setting("DECAL_PROCESS_ID", "multi-host: this process's index, 0 .. processes - 1", None,
            INDEX),
    Setting("DECAL_LOCAL_DEVICE_IDS", "multi-host: the devices this process uses (GPU: one "
            "per rank)", None, IDS),
    Setting("DECAL_DISTRIBUTED", "multi-host: 'auto' lets JAX detect the cluster (TPU pod, "
            "SLURM, Open MPI, Kubernetes); --multiprocess_gpu sets it", "off", CHOICE,
            ("auto", "off")),
    Setting("DECAL_PEER_TIMEOUT", "multi-host: seconds a process may give no sign of life "
            "before the others stop, naming it (runtime/peer_watch.py)", 60, COUNT),
    Setting("DECAL_INDEX_CACHE_MIB", "MiB of an exact index's padded document chunks kept "
            "on the device between searches (a served index pads its corpus once); 0: none, "
            "an index that needs more: none", 1024, INDEX),
    Setting("DECAL_SKIPPED_TESTS", "the test suite only: a file to which each skipped "
            "test's id and reason is appended (tests/conftest.py)", None, PATH),
)}


def setting(name: str) -> Setting:
  """The table's row for `name`; an unknown name is a programming error (KeyError)."""
  try:
    return SETTINGS[name]
  except KeyError:
    raise KeyError(f"{name} is not a decal_jax setting; known: {', '.join(SETTINGS)}.") from None


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
  """The value of variable `name` now (from `environ`, default os.environ), checked and
  converted (a count or index: int; ids: a tuple of ints; a choice: lower-cased); the
  default when it is unset or empty."""
  row = setting(name)
  raw = (os.environ if environ is None else environ).get(name)
  if raw is None or raw == "":
    return row.default
  return _parse(row, raw)


def put(name: str, value: Any) -> None:
  """Sets variable `name` in os.environ to `value` (checked first, so a bad value is
  refused where it is given, not where it is read)."""
  text = str(value)
  _parse(setting(name), text)
  os.environ[name] = text


def check_all(environ: Optional[Mapping[str, str]] = None) -> None:
  """Reads every variable that is set; the first bad one raises SettingError (the entry
  points call this before any heavy import)."""
  for name in SETTINGS:
    get(name, environ)


def table() -> str:
  """The variables as a markdown table: name, meaning, default, allowed values."""
  rows = ["| name | meaning | default | allowed |", "|---|---|---|---|"]
  for row in SETTINGS.values():
    default = "unset" if row.default is None else f"`{row.default}`"
    rows.append(f"| {row.name} | {row.meaning} | {default} | {row.allowed()} |")
  return "\n".join(rows)


# ----------------------------------------------------------------------------- parsing

def _refuse(row: Setting, raw: str, why: str = "") -> SettingError:
  default = "unset" if row.default is None else repr(row.default)
  reason = f" ({why})" if why else ""
  return SettingError(
      f"{row.name}={raw!r} is not allowed{reason}: {row.name} ({row.meaning}) must be "
      f"{row.allowed()}. Fix: set it to such a value, e.g. {row.name}={row.example()}, or "
      f"unset it for the default ({default}).")


def _parse(row: Setting, raw: str) -> Any:
  return {PATH: _path, LOCATION: _path, CHOICE: _choice, COUNT: _count, INDEX: _index,
          ADDRESS: _address, IDS: _ids}[row.kind](row, raw)


def _path(row: Setting, raw: str) -> str:
  if raw != raw.strip():
    raise _refuse(row, raw, "leading or trailing blanks: a copy-paste slip?")
  if any(ord(c) < 32 for c in raw):
    raise _refuse(row, raw, "a control character")
  return raw


def _choice(row: Setting, raw: str) -> str:
  value = raw.strip().lower()
  if value not in row.choices:
    raise _refuse(row, raw)
  return value


def _whole(row: Setting, raw: str, low: int) -> int:
  try:
    value = int(raw.strip())
  except ValueError:
    raise _refuse(row, raw, "not a whole number") from None
  if value < low:
    raise _refuse(row, raw, f"below {low}")
  return value


def _count(row: Setting, raw: str) -> int:
  return _whole(row, raw, 1)


def _index(row: Setting, raw: str) -> int:
  return _whole(row, raw, 0)


def _address(row: Setting, raw: str) -> str:
  host, colon, port = raw.strip().rpartition(":")
  if not (colon and host and port.isdigit() and 1 <= int(port) <= 65535):
    raise _refuse(row, raw)
  return raw.strip()


def _ids(row: Setting, raw: str) -> Tuple[int, ...]:
  parts = [p.strip() for p in raw.split(",")]
  if not all(p.isdigit() for p in parts):
    raise _refuse(row, raw)
  return tuple(int(p) for p in parts)


if __name__ == "__main__":
  print(table())
