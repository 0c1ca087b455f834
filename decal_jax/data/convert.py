"""Dataset releases -> the downstream tasks' local JSONL layout.

`<out>/<name>/<split>.jsonl`, one record per line: QA {"id", "question", "context",
"answers": [...]}; summarization {"id", "document", "summary"}. `decal_jax/commands/prepare_jsonl.py` is
the command line. Records with an empty question, context, document, summary or answer
list are left out and counted; SQuAD v2's unanswerable questions are named as such and
may be kept with the answers [""] (the empty string as the target).

Each dataset is read in its official release layout or as Hugging Face `datasets` rows (a
JSON list, or JSONL as `Dataset.to_json` writes); `LAYOUTS` describes them. A file in
neither raises `ReleaseLayoutError` naming the file, the first record that does not fit,
the keys it has and the layouts expected. Every record is converted before anything is
written, so a bad file leaves no output behind.
"""
import json
import pathlib
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from decal_jax import fileio

Record = Dict[str, object]

LAYOUTS = {
    "squad": "the official SQuAD v1.1 / v2.0 JSON ({\"data\": [{\"paragraphs\": [{\"context\", "
             "\"qas\": [{\"id\", \"question\", \"answers\": [{\"text\"}]}]}]}]}), or Hugging Face "
             "squad / squad_v2 rows ({\"id\", \"question\", \"context\", \"answers\": {\"text\": "
             "[...], \"answer_start\": [...]}})",
    "hotpotqa": "the official HotpotQA JSON (a list of {\"_id\", \"question\", \"answer\", "
                "\"context\": [[title, [sentences]]]}), or Hugging Face hotpot_qa rows "
                "({\"id\", \"question\", \"answer\", \"context\": {\"title\": [...], "
                "\"sentences\": [[...]]}})",
    "mediasum": "the official news_dialogue.json ({\"id\", \"summary\", \"utt\", \"speaker\"} "
                "records) with train_val_test_split.json; or one split's rows, as Hugging Face "
                "has them: {\"id\", \"summary\", \"utt\", \"speaker\"} (nbroad/mediasum) or "
                "{\"id\", \"document\", \"summary\"} (ccdv/mediasum)",
}


class ReleaseLayoutError(ValueError):
  """A release file in no layout the converter reads (the message names file and record)."""


def load_json(path: str) -> Any:
  """A JSON file's value, or the list of a JSONL file's values; errors name file and line
  (not UTF-8: fileio.NotUtf8Error; not JSON: ReleaseLayoutError)."""
  text = fileio.read_utf8(path)
  try:
    return _loads(path, None, text)
  except json.JSONDecodeError as e:
    if e.msg != "Extra data":
      raise ReleaseLayoutError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column "
                               f"{e.colno}); fix the file or download it again.") from None
  rows = []  # JSON Lines: one value per non-blank line (only \n ends one: JSON strings
  for number, line in enumerate(text.split("\n"), start=1):  # may hold U+2028, \x85 ...)
    if line.strip():
      try:
        rows.append(_loads(path, number, line))
      except json.JSONDecodeError as e:
        raise ReleaseLayoutError(f"{path}:{number}: not valid JSON ({e.msg} at column "
                                 f"{e.colno}); write one JSON object per line.") from None
  return rows


def _loads(path: str, line: Optional[int], text: str) -> Any:
  """json.loads; ReleaseLayoutError past its limits (a number past 4300 digits, nesting
  too deep: not a JSONDecodeError), naming the file and the `line` the text is (if one)."""
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    raise
  except (ValueError, RecursionError) as e:
    reason = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
    where = f"{path}:{line}" if line else path
    raise ReleaseLayoutError(f"{where}: JSON past Python's limits ({reason}); fix the file "
                             "or download it again.") from None


def _expect(condition: bool) -> None:
  if not condition:
    raise ValueError("layout")


def _strings(value: Any) -> List[str]:
  _expect(isinstance(value, list) and all(isinstance(v, str) for v in value))
  return value


def convert_rows(path: str, rows: Any, convert_one: Callable[[dict], Any],
                 dataset: str) -> List[Any]:
  """[convert_one(row)] of a list of rows (one object counts as a list of one); the first
  row it cannot read raises ReleaseLayoutError with its number and keys."""
  rows = rows if isinstance(rows, list) else [rows]
  if not rows:
    raise ReleaseLayoutError(f"{path}: no record; expected {LAYOUTS[dataset]}.")
  out = []
  for number, row in enumerate(rows, start=1):
    try:
      _expect(isinstance(row, dict))
      out.append(convert_one(row))
      json.dumps(out[-1], ensure_ascii=False).encode("utf-8")  # written so by `write`
    except UnicodeEncodeError as e:
      raise ReleaseLayoutError(
          f"{path}: record {number} holds {e.object[e.start]!r}, a lone UTF-16 surrogate "
          "escape (e.g. \\ud800 without its pair), not text. Write the character itself, or "
          "its whole surrogate pair.") from None
    except (AttributeError, KeyError, TypeError, ValueError):
      found = f"keys {sorted(row)}" if isinstance(row, dict) else f"a {type(row).__name__}"
      raise ReleaseLayoutError(
          f"{path}: record {number} is not in a {dataset} layout this converter reads (it "
          f"has {found}). Expected {LAYOUTS[dataset]}.") from None
  return out


# ------------------------------------------------------------------------------ SQuAD
def _squad_article(article: dict) -> List[Record]:
  records = []
  for paragraph in article["paragraphs"]:
    for qa in paragraph["qas"]:
      answers = [a["text"] for a in qa.get("answers", [])]
      records.append(_qa(qa["id"], qa["question"], paragraph["context"], answers))
  return records


def _squad_row(row: dict) -> Record:
  return _qa(row["id"], row["question"], row["context"], _strings(row["answers"]["text"]))


def _qa(id_: Any, question: Any, context: Any, answers: List[str]) -> Record:
  _expect(isinstance(question, str) and isinstance(context, str))
  return {"id": id_, "question": question, "context": context, "answers": answers}


def squad(path: str, notes: Optional[List[str]] = None,
          keep_unanswerable: bool = False) -> List[Record]:
  """SQuAD v1.1 / v2.0 records. Unanswerable v2 questions (no answer) are counted in
  `notes`; they keep an empty answer list (left out when written) or, with
  `keep_unanswerable`, get the answers [""]: the empty string as their target."""
  release = load_json(path)
  if isinstance(release, dict) and "data" in release:
    articles = convert_rows(path, release["data"], _squad_article, "squad")
    records = [record for article in articles for record in article]
  else:
    records = convert_rows(path, release, _squad_row, "squad")
  return _unanswerable(path, records, notes, keep_unanswerable)


NO_ANSWER = [""]  # the answers of an unanswerable question kept: the empty-string target


def _unanswerable(path: str, records: List[Record], notes: Optional[List[str]],
                  keep: bool) -> List[Record]:
  """Names the questions without an answer (SQuAD v2's unanswerable ones) in `notes`;
  `keep` gives them the answers NO_ANSWER."""
  count = sum(1 for r in records if r["answers"] == [])
  if not count:
    return records
  what = (f"{path}: {count} of {len(records)} question(s) are unanswerable (SQuAD v2: no "
          "answer); ")
  if keep:
    records = [dict(r, answers=list(NO_ANSWER)) if r["answers"] == [] else r for r in records]
    what += "kept with the empty string as their target (answers [\"\"])."
  else:
    what += ("left out. --keep_unanswerable keeps them with the empty string as their "
             "target (answers [\"\"]).")
  if notes is not None:
    notes.append(what)
  return records


# ------------------------------------------------------------------------------ HotpotQA
def _hotpot_paragraphs(context: Any) -> List[Tuple[str, List[str]]]:
  """[(title, sentences)] of the official [[title, [sentences]]] or HF {title, sentences}."""
  if isinstance(context, dict):
    titles, sentences = _strings(context["title"]), context["sentences"]
    _expect(isinstance(sentences, list) and len(sentences) == len(titles))
    pairs = list(zip(titles, sentences))
  else:
    _expect(isinstance(context, list) and all(isinstance(p, list) and len(p) == 2
                                              for p in context))
    pairs = [tuple(p) for p in context]
  for title, _ in pairs:
    _expect(isinstance(title, str))
  return [(title, _strings(sentences)) for title, sentences in pairs]


def _hotpot_row(row: dict) -> Record:
  context = "\n".join(f"{title}: {''.join(sentences)}"
                      for title, sentences in _hotpot_paragraphs(row["context"]))
  answer = row.get("answer")
  return _qa(row["_id"] if "_id" in row else row.get("id"), row["question"], context,
             [answer] if answer else [])


def hotpotqa(path: str, notes: Optional[List[str]] = None) -> List[Record]:
  """HotpotQA records (distractor or fullwiki); each context paragraph becomes
  'title: sentences' on its own line. A row without an id (some Hugging Face exports drop
  the column) gets `row-<n>`, n its 0-based row number, with a line in `notes`."""
  records = convert_rows(path, load_json(path), _hotpot_row, "hotpotqa")
  missing = [n for n, record in enumerate(records) if record["id"] is None]
  for n in missing:
    records[n]["id"] = f"row-{n}"
  if missing and notes is not None:
    notes.append(f"{path}: {len(missing)} of {len(records)} record(s) have no id (no `_id` / "
                 "`id` field); gave each the id row-<n>, n its 0-based row number in the "
                 "file (stable while the file's order is).")
  return records


# ------------------------------------------------------------------------------ MediaSum
def _mediasum_row(row: dict) -> Record:
  if "document" in row:  # ccdv/mediasum: the transcript already joined (or a list of turns)
    document = row["document"]
    document = "\n".join(_strings(document)) if isinstance(document, list) else document
  else:  # the official record: parallel speaker / utterance lists
    speakers, utterances = _strings(row["speaker"]), _strings(row["utt"])
    _expect(len(speakers) == len(utterances))
    document = "\n".join(f"{s}: {u}" for s, u in zip(speakers, utterances))
  _expect(isinstance(document, str) and isinstance(row["summary"], str))
  return {"id": row.get("id"), "document": document, "summary": row["summary"]}


def mediasum_split(path: str) -> List[Record]:
  """One split's MediaSum rows (official records or ccdv's {document, summary})."""
  return convert_rows(path, load_json(path), _mediasum_row, "mediasum")


def mediasum(dialogues_path: str, split_path: str) -> List[Tuple[str, Record]]:
  """The official `news_dialogue.json` + `train_val_test_split.json` -> [(split, record)];
  the transcript becomes 'SPEAKER: utterance' lines."""
  splits = load_json(split_path)
  if not (isinstance(splits, dict) and all(isinstance(v, list) for v in splits.values())):
    raise ReleaseLayoutError(
        f"{split_path}: expected train_val_test_split.json, an object {{\"train\": [ids], "
        f"\"val\": [ids], \"test\": [ids]}}; expected {LAYOUTS['mediasum']}.")
  split_of = {str(i): {"val": "validation"}.get(split, split)
              for split, ids in splits.items() for i in ids}
  records = mediasum_split(dialogues_path)
  return [(split_of[str(r["id"])], r) for r in records if str(r["id"]) in split_of]


# ------------------------------------------------------------------------------ writing
REQUIRED = {"qa": ("question", "context", "answers"), "summarization": ("document", "summary")}


def usable(record: Mapping[str, object], kind: str) -> bool:
  """Every required field non-empty; a QA record's answers may be NO_ANSWER."""
  def ok(value):
    if value == NO_ANSWER and kind == "qa":
      return True
    if isinstance(value, list):
      return bool(value) and all(isinstance(v, str) and v.strip() for v in value)
    return isinstance(value, str) and bool(value.strip())
  return all(ok(record.get(field)) for field in REQUIRED[kind])


def write(records: Iterable[Record], path: pathlib.Path, kind: str) -> Tuple[int, int]:
  """Writes usable records as JSONL (whole or not at all: a failure, e.g. a bad source
  record, leaves `path` as it was and no temp file); returns (written, left out)."""
  written = skipped = 0
  with fileio.atomic_write(path) as f:
    for record in records:
      if not usable(record, kind):
        skipped += 1
        continue
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
      written += 1
  return written, skipped


def write_splits(pairs: Iterable[Tuple[str, Record]], folder: pathlib.Path,
                 kind: str) -> Dict[str, Tuple[int, int]]:
  """(split, record) pairs -> folder/<split>.jsonl; {split: (written, left out)}."""
  by_split: Dict[str, List[Record]] = {}
  for split, record in pairs:
    by_split.setdefault(split, []).append(record)
  return {split: write(records, folder / f"{split}.jsonl", kind)
          for split, records in sorted(by_split.items())}
