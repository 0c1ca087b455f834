"""Official dataset releases -> the downstream tasks' local JSONL layout.

`<out>/<name>/<split>.jsonl`, one record per line: QA {"id", "question", "context",
"answers": [...]}; summarization {"id", "document", "summary"}. `tools/prepare_jsonl.py` is
the command line. Records with an empty question, context, document, summary or answer
list are left out and counted.
"""
import json
import pathlib
from typing import Dict, Iterable, Iterator, List, Mapping, Tuple

from decal_jax import fileio

Record = Dict[str, object]


def squad(path: str) -> Iterator[Record]:
  """SQuAD v1.1 / v2.0 JSON (data -> paragraphs -> qas); unanswerable v2 questions are
  left out."""
  release = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
  for article in release["data"]:
    for paragraph in article["paragraphs"]:
      for qa in paragraph["qas"]:
        yield {"id": qa["id"], "question": qa["question"], "context": paragraph["context"],
               "answers": [a["text"] for a in qa.get("answers", [])]}


def hotpotqa(path: str) -> Iterator[Record]:
  """HotpotQA JSON (a list of {_id, question, answer, context: [[title, [sentences]]]});
  each context paragraph becomes 'title: sentences' on its own line."""
  for item in json.loads(pathlib.Path(path).read_text(encoding="utf-8")):
    context = "\n".join(f"{title}: {''.join(sentences)}" for title, sentences in item["context"])
    yield {"id": item["_id"], "question": item["question"], "context": context,
           "answers": [item["answer"]] if item.get("answer") else []}


def mediasum(dialogues_path: str, split_path: str) -> Iterator[Tuple[str, Record]]:
  """MediaSum `news_dialogue.json` + `train_val_test_split.json` -> (split, record); the
  transcript becomes 'SPEAKER: utterance' lines."""
  split_of = {}
  for split, ids in json.loads(pathlib.Path(split_path).read_text(encoding="utf-8")).items():
    name = {"val": "validation"}.get(split, split)
    split_of.update({str(i): name for i in ids})
  for item in json.loads(pathlib.Path(dialogues_path).read_text(encoding="utf-8")):
    split = split_of.get(str(item["id"]))
    if split is None:
      continue
    document = "\n".join(f"{s}: {u}" for s, u in zip(item["speaker"], item["utt"]))
    yield split, {"id": item["id"], "document": document, "summary": item["summary"]}


REQUIRED = {"qa": ("question", "context", "answers"), "summarization": ("document", "summary")}


def usable(record: Mapping[str, object], kind: str) -> bool:
  def ok(value):
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
