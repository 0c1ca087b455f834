"""seqio data sources over local JSON Lines and plain-text files, with line-numbered errors.

Each split is one file or a glob (`train-*.jsonl`); each line is one JSON object (or, for
`TextLineSource`, one line of text). A `Schema` names the fields a task reads, their kind
(`text`: a non-empty string, or a list of strings that is joined; `texts`: a non-empty list
of non-empty strings, or one string) and, through `fields`, which key of the file holds
each one. A line that is not UTF-8 or not JSON, lacks a field, has the wrong type or only
whitespace is reported with its file and line number; `bad_lines='fail'` (the default)
stops with that message, `'skip'` leaves the line out and logs how many were skipped per
file.

The files are checked once, when the split is first read, and then streamed.
"""
import abc
import dataclasses
import glob
import json
import logging
import os
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import seqio
import tensorflow as tf

log = logging.getLogger(__name__)  # decal_jax.* warnings: console.py routes them in the CLI

BAD_LINE_POLICIES = ("fail", "skip")


class BadRecordError(ValueError):
  """A JSONL line that does not fit the task's schema (message names file and line)."""


@dataclasses.dataclass(frozen=True)
class Schema:
  """The fields a task reads: {name: 'text' | 'texts'}, and joiners for lists of text."""
  kinds: Mapping[str, str]
  joiner: str = "\n"

  def signature(self) -> Dict[str, tf.TensorSpec]:
    return {name: tf.TensorSpec([] if kind == "text" else [None], tf.string)
            for name, kind in self.kinds.items()}


def _as_text(value: Any, joiner: str) -> Optional[str]:
  if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
    value = joiner.join(value)
  return value if isinstance(value, str) and value.strip() else None


def _as_texts(value: Any) -> Optional[List[str]]:
  if value == [""]:  # one empty answer: an unanswerable question's target (prepare_jsonl)
    return value
  if isinstance(value, str):
    value = [value]
  if not isinstance(value, list) or not value:
    return None
  if not all(isinstance(v, str) and v.strip() for v in value):
    return None
  return value


def decode(line: Union[bytes, str]) -> str:
  """A line read in binary mode as text; BadRecordError (without location) if not UTF-8."""
  if isinstance(line, str):
    return line
  try:
    return line.decode("utf-8")
  except UnicodeDecodeError as e:
    raise BadRecordError(f"not UTF-8 ({e.reason} at byte {e.start} of the line); re-save "
                         "the file as UTF-8") from None


def parse_line(line: Union[bytes, str], schema: Schema,
               fields: Mapping[str, str]) -> Dict[str, Any]:
  """One JSONL line -> {field: str or [str]}; raises BadRecordError (without location)."""
  text = decode(line)
  try:
    record = json.loads(text)
  except json.JSONDecodeError as e:
    raise BadRecordError(f"not valid JSON ({e.msg})") from None
  except (ValueError, RecursionError) as e:  # a number past 4300 digits; deep nesting
    raise BadRecordError(f"not readable JSON ({json_limit(e)})") from None
  if not isinstance(record, dict):
    raise BadRecordError(f"expected a JSON object, got {type(record).__name__}")
  out = {}
  for name, kind in schema.kinds.items():
    key = fields.get(name, name)
    if key not in record:
      raise BadRecordError(f"missing field {key!r} (has: {sorted(record)})")
    value = record[key]
    parsed = _as_text(value, schema.joiner) if kind == "text" else _as_texts(value)
    if parsed is None:
      want = ("a non-empty string (or list of strings)" if kind == "text"
              else "a non-empty string or a non-empty list of non-empty strings (or [\"\"])")
      raise BadRecordError(f"field {key!r} must be {want}, got {_preview(value)}")
    check_unicode(key, parsed)
    out[name] = parsed
  return out


def json_limit(error: BaseException) -> str:
  """Why json.loads refused text past Python's limits (not a JSONDecodeError)."""
  if isinstance(error, RecursionError):
    return "nested too deeply"
  return str(error).split(";")[0]  # 'Exceeds the limit (4300 digits) for integer ...'


def check_unicode(key: str, value: Union[str, List[str]]) -> None:
  """BadRecordError if a text holds a lone UTF-16 surrogate (a JSON escape such as
  `\\ud800` without its pair): no text, and no tokenizer or tf.string takes it."""
  for text in [value] if isinstance(value, str) else value:
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:
      raise BadRecordError(
          f"field {key!r} holds {text[e.start]!r}, a lone UTF-16 surrogate escape, not "
          "text; write the character itself, or its whole surrogate pair") from None


def _preview(value: Any) -> str:
  text = json.dumps(value)
  return text if len(text) <= 60 else text[:57] + "..."


def expand(pattern: str) -> List[str]:
  """Files matching `pattern` (a path or a glob), sorted; a clear error if none."""
  paths = sorted(glob.glob(os.path.expanduser(pattern)))
  if not paths:
    raise FileNotFoundError(f"No file matches {pattern!r}.")
  folders = [p for p in paths if os.path.isdir(p)]
  if folders:
    raise IsADirectoryError(f"{folders[0]} is a folder, not a data file: each split is one "
                            "file (or a glob of files). Put the file there instead of the "
                            "folder, or move the folder away.")
  return paths


def check_file(path: str, parse: Callable[[bytes], Any],
               bad_lines: str) -> Tuple[List[int], int]:
  """(numbers of the good lines, count of skipped ones): each non-blank line (bytes) goes
  through `parse`, which raises BadRecordError on a bad one; raises on the first bad line
  when `bad_lines == 'fail'`."""
  good, skipped = [], 0
  with open(path, "rb") as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        parse(line)
      except BadRecordError as e:
        if bad_lines == "fail":
          raise BadRecordError(
              f"{path}:{number}: {e}. Fix the line, or skip bad lines with "
              "bad_lines='skip' (gin: downstream_tasks.local_data.bad_lines = 'skip', or "
              "DECAL_BAD_LINES=skip).") from None
        skipped += 1
        continue
      good.append(number)
  if skipped:
    log.warning("%s: skipped %d bad line(s) of %d.", path, skipped, skipped + len(good))
  if not good:
    raise BadRecordError(f"{path}: no usable line (of {skipped} non-blank ones).")
  return good, skipped


class CheckedLineSource(seqio.DataSource):
  """{split: path-or-glob} files whose lines are checked once (`parse`, `bad_lines`) and
  then streamed as `parse`d records of `signature`."""

  def __init__(self, split_files: Mapping[str, str], bad_lines: str = "fail"):
    if bad_lines not in BAD_LINE_POLICIES:
      raise ValueError(f"bad_lines must be one of {BAD_LINE_POLICIES}, got {bad_lines!r}.")
    self._split_files, self.bad_lines = dict(split_files), bad_lines
    self._checked: Dict[str, List[Tuple[str, List[int]]]] = {}
    super().__init__(splits=tuple(self._split_files))

  @abc.abstractmethod
  def parse(self, line: bytes) -> Any:
    """One non-blank line -> the record it yields; BadRecordError if it is bad."""

  @abc.abstractmethod
  def signature(self) -> Any:
    """The tf.data output signature of a record."""

  @property
  def supports_arbitrary_sharding(self) -> bool:
    return False

  def list_shards(self, split: str) -> Sequence[str]:
    return expand(self._files_of(split))

  def _files_of(self, split: str) -> str:
    if split not in self._split_files:
      raise ValueError(f"No local file for split {split!r}; splits: {sorted(self._split_files)}.")
    return self._split_files[split]

  def checked(self, split: str) -> List[Tuple[str, List[int]]]:
    """[(path, good line numbers)] of the split, checked on first call."""
    if split not in self._checked:
      self._checked[split] = [(p, check_file(p, self.parse, self.bad_lines)[0])
                              for p in expand(self._files_of(split))]
    return self._checked[split]

  def num_input_examples(self, split: str) -> int:
    return sum(len(lines) for _, lines in self.checked(split))

  def _records(self, files: List[Tuple[str, List[int]]]) -> Iterator[Any]:
    for path, lines in files:
      wanted = set(lines)
      with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
          if number in wanted:
            yield self.parse(line)

  def get_dataset(self, split: str = "train", shuffle: bool = True, seed: Optional[int] = None,
                  shard_info: Optional[seqio.ShardInfo] = None, *args, **kwargs
                  ) -> tf.data.Dataset:
    files = self.checked(split)
    ds = tf.data.Dataset.from_generator(lambda: self._records(files),
                                        output_signature=self.signature())
    if shard_info is not None and shard_info.num_shards > 1:
      ds = ds.shard(shard_info.num_shards, shard_info.index)
    if shuffle:
      ds = ds.shuffle(min(self.num_input_examples(split), 10_000), seed=seed)
    return ds


class JsonlSource(CheckedLineSource):
  """{split: path-or-glob} JSONL files as a seqio source of `schema`'s fields."""

  def __init__(self, split_files: Mapping[str, str], schema: Schema,
               fields: Optional[Mapping[str, str]] = None, bad_lines: str = "fail"):
    unknown = set(fields or {}) - set(schema.kinds)
    if unknown:
      raise ValueError(f"fields maps unknown names {sorted(unknown)}; the schema has "
                       f"{sorted(schema.kinds)}.")
    self.schema, self.fields = schema, dict(fields or {})
    super().__init__(split_files, bad_lines)

  def parse(self, line: bytes) -> Dict[str, Any]:
    return parse_line(line, self.schema, self.fields)

  def signature(self) -> Dict[str, tf.TensorSpec]:
    return self.schema.signature()


JSON_PROBE_LINES = 5  # a text file whose first non-blank lines are all JSON objects is JSONL


def looks_like_jsonl(path: str, probe: int = JSON_PROBE_LINES) -> bool:
  """Whether the first `probe` non-blank lines of `path` (at least one) are JSON objects."""
  seen = 0
  with open(path, "rb") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        if not line.lstrip().startswith(b"{") or not isinstance(json.loads(line), dict):
          return False
      except (ValueError, RecursionError):  # not JSON, not UTF-8, or past json's limits
        return False
      seen += 1
      if seen == probe:
        break
  return seen > 0


def json_array_start(path: str) -> Optional[str]:
  """The first non-blank line of `path` when the file is a JSON array, else None: that line
  is `[` alone (a pretty-printed array), or the start of an array of objects or strings
  (`[{"text": ...},` or the whole array on one line). A text line such as `[1] Intro` is
  no JSON, and `[1]` no array of documents."""
  with open(path, "rb") as f:
    first = next((line.strip() for line in f if line.strip()), b"")
  if first == b"[":
    return "["
  if not first.startswith(b"["):
    return None
  try:
    first_text = first.decode("utf-8")  # json.loads(bytes) would also take UTF-16 / 32
  except UnicodeDecodeError:
    return None  # check_file names the line
  for text in (first_text, first_text.rstrip(",") + "]"):
    try:
      value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or past json's limits
      continue
    if isinstance(value, list) and value and isinstance(value[0], (dict, str)):
      return first_text[:60]
  return None


def refuse_json_array(path: str) -> None:
  """Refuses a JSON array given where plain text is read (one document per line)."""
  first = json_array_start(path)
  if first is None:
    return
  stem = os.path.splitext(path)[0]
  raise BadRecordError(
      f"{path} is a JSON array (its first non-blank line is {first!r}), not plain text: this "
      "task reads one document per line, and would train on its brackets, braces, keys and "
      "quotes. Convert it to plain text, one document per line (e.g. "
      f"`jq -r '.[].text' {path} > {stem}.txt`; `jq -r '.[]'` for an array of strings), or "
      f"to JSON Lines for a JSONL task (`jq -c '.[]' {path} > {stem}.jsonl`, then "
      "autoencoding_tasks.register_text_autoencode_task(name, files, field=...) or "
      "downstream_tasks.register_jsonl_task).")


class TextLineSource(CheckedLineSource):
  """{split: path-or-glob} UTF-8 text files as a seqio source of their non-blank lines
  (scalar strings without the line break, as `seqio.TextLineDataSource` gives them).
  A file whose first lines are JSON objects is read as text all the same, with a WARNING
  (a JSONL file given to a plain-text task trains on its braces and keys); a JSON array
  (pretty-printed or on one line) is refused (`refuse_json_array`), naming the fix."""

  def parse(self, line: bytes) -> str:
    return decode(line).rstrip("\r\n")

  def checked(self, split: str) -> List[Tuple[str, List[int]]]:
    first_read = split not in self._checked
    for path in expand(self._files_of(split)) if first_read else ():
      refuse_json_array(path)
    files = super().checked(split)
    for path, _ in files if first_read else ():
      if looks_like_jsonl(path):
        logging.warning(
            "%s looks like JSON Lines (its first lines are JSON objects), but this task reads "
            "plain text: every line, braces and keys included, is trained on as text. Give "
            "the text itself, one document per line (e.g. `jq -r .text %s > %s.txt`), or "
            "for JSONL with a text field use a JSONL task (autoencoding_tasks."
            "register_text_autoencode_task(name, files, field=...), downstream_tasks."
            "register_jsonl_task).", path, path, os.path.splitext(path)[0])
    return files

  def signature(self) -> tf.TensorSpec:
    return tf.TensorSpec([], tf.string)


class DeferredSource(seqio.DataSource):
  """A seqio source that picks the real source (`_source()`) each time data is read, so a
  local directory bound in gin or the environment after the task is registered counts."""

  @abc.abstractmethod
  def _source(self) -> seqio.DataSource:
    """The source to read now."""

  @property
  def supports_arbitrary_sharding(self) -> bool:
    return False

  def list_shards(self, split: str):
    return self._source().list_shards(split)

  def num_input_examples(self, split: str) -> Optional[int]:
    return self._source().num_input_examples(split)

  def get_dataset(self, split: str = "train", shuffle: bool = True, seed: Optional[int] = None,
                  shard_info: Optional[seqio.ShardInfo] = None, *args, **kwargs):
    return self._source().get_dataset(split, shuffle=shuffle, seed=seed, shard_info=shard_info)
