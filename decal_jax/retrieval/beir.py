"""Retrieval data on disk: BEIR folders, with line-numbered errors; and a BEIR folder built
from the built-in corpus (no download). MS MARCO's passage layout: `retrieval/msmarco.py`.

BEIR folder (what `load_beir` reads and `write_beir` writes):

    corpus.jsonl          {"_id": "d1", "title": "...", "text": "..."} per line
    queries.jsonl         {"_id": "q1", "text": "..."} per line
    qrels/<split>.tsv     "query-id\\tcorpus-id\\tscore" header, then one row per judgement

A qrels score is an integer grade; every row is kept (grade 0 included), and only grades
> 0 count as relevant. A `dev.tsv` qrels file serves the split 'validation' (and the other
way round), as TFDS's `beir` names it. Empty query texts and empty passages (no title, no
text) are kept, since an encoder still reads them (as EOS alone), and counted
(`BeirData.empty_queries`, `BeirData.empty_passages`). An empty query of the split is
warned about, not refused: `load_beir` logs a WARNING naming queries.jsonl, the count and
the first ids, because such a query is scored as EOS alone and counted in NDCG / Recall.

While the corpus is read, `CorpusDigest` fingerprints it (document count and a sha256 over
every id, title and text, in file order; `BeirData.corpus_fingerprint`), so an index built
from it can tell when the folder was edited since (`pipeline.build_or_open_index`).

A line that breaks these layouts raises `BadRetrievalFileError` naming the file, the line
(from 1), the problem and the fix; a missing file names what was expected.
"""
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

from decal_jax import fileio

PathLike = Union[str, os.PathLike]
Qrels = Dict[str, Dict[str, int]]

CORPUS_FILE, QUERIES_FILE, QRELS_DIR = "corpus.jsonl", "queries.jsonl", "qrels"
QRELS_HEADER = ("query-id", "corpus-id", "score")
BEIR_LAYOUT = ("a BEIR folder holds corpus.jsonl ({\"_id\", \"title\", \"text\"} per line), "
               "queries.jsonl ({\"_id\", \"text\"} per line) and qrels/<split>.tsv (header "
               "'query-id<TAB>corpus-id<TAB>score', then one row per judgement)")
SPLIT_ALIASES = {"validation": "dev", "dev": "validation"}

class BadRetrievalFileError(ValueError):
  """A retrieval data file that breaks its layout; the message names file, line and fix."""


class MissingRetrievalFileError(BadRetrievalFileError, FileNotFoundError):
  """A file the layout needs is not there (the message lists what was expected)."""


def bad_line(path: PathLike, line: int, problem: str, fix: str) -> BadRetrievalFileError:
  return BadRetrievalFileError(f"{path}:{line}: {problem}. {fix}.")


@dataclasses.dataclass(frozen=True)
class Passage:
  """One corpus document."""
  title: str
  text: str

  @property
  def full_text(self) -> str:
    """'title. text' (what the encoder reads); just the text when there is no title."""
    return ". ".join(part for part in (self.title.strip(), self.text.strip()) if part)

  @property
  def is_empty(self) -> bool:
    return not self.full_text


# ------------------------------------------------------------------------------ lines
def numbered_lines(path: PathLike) -> Iterator[Tuple[int, str]]:
  """(1-based line number, text without the line break) of every non-blank line."""
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8").rstrip("\r\n")
      except UnicodeDecodeError as e:
        raise bad_line(path, number, f"not UTF-8 ({e.reason} at byte {e.start})",
                       "Re-save the file as UTF-8") from None
      if line.strip():
        yield number, line


def _json_object(path: PathLike, number: int, line: str) -> dict:
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise bad_line(path, number, f"not valid JSON ({e.msg} at column {e.colno})",
                   "Write one JSON object per line") from None
  except (ValueError, RecursionError) as e:  # a number past 4300 digits; deep nesting
    reason = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
    raise bad_line(path, number, f"not readable JSON ({reason})",
                   "Write one JSON object per line, within Python's JSON limits") from None
  if not isinstance(record, dict):
    raise bad_line(path, number, f"expected a JSON object, got {type(record).__name__}",
                   "Write one JSON object per line")
  return record


def _record_id(path: PathLike, number: int, record: dict) -> str:
  value = record.get("_id")
  if isinstance(value, int) and not isinstance(value, bool):
    value = str(value)
  if not isinstance(value, str) or not value.strip():
    got = "no '_id'" if "_id" not in record else f"'_id' = {json.dumps(value)}"
    raise bad_line(path, number, f"{got}; every line needs a non-empty string '_id'",
                   "Give the line its id")
  return _unicode(path, number, "_id", value)


def _unicode(path: PathLike, number: int, key: str, value: str) -> str:
  """`value`, refused if it holds a lone UTF-16 surrogate (a JSON escape such as
  `\\ud800` without its pair), which is no text: no tokenizer or output file takes it."""
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    raise bad_line(path, number, f"field {key!r} holds {value[e.start]!r}, a lone UTF-16 "
                   "surrogate escape, not text",
                   "Write the character itself, or its whole surrogate pair") from None
  return value


def _string_field(path: PathLike, number: int, record: dict, key: str,
                  optional: bool = False) -> str:
  """record[key] as a string; an optional field may be missing or null (-> '')."""
  if key not in record and not optional:
    raise bad_line(path, number, f"missing field {key!r}",
                   f"Add {key!r} (an empty string is allowed)")
  value = record.get(key)
  if value is None and optional:
    return ""
  if not isinstance(value, str):
    raise bad_line(path, number, f"field {key!r} must be a string, got {json.dumps(value)[:60]}",
                   f"Write {key!r} as a JSON string")
  return _unicode(path, number, key, value)


def check_new_id(path: PathLike, number: int, key: str, seen: Dict[str, int],
                 what: str) -> None:
  if key in seen:
    raise bad_line(path, number, f"duplicate {what} {key!r} (first on line {seen[key]})",
                   "Give every line its own id, or remove the repeated line")
  seen[key] = number


# ------------------------------------------------------------------------------ BEIR
class CorpusDigest:
  """A corpus fingerprint taken while it is read: the document count and a sha256 over
  each document's id, title and text, in file order."""

  def __init__(self):
    self._sha = hashlib.sha256()
    self.num_docs = 0

  def add(self, doc_id: str, passage: Passage) -> None:
    line = json.dumps([doc_id, passage.title, passage.text], ensure_ascii=False) + "\n"
    self._sha.update(line.encode("utf-8"))  # one JSON line per document: unambiguous
    self.num_docs += 1

  def fingerprint(self) -> Dict[str, Any]:
    """{'num_docs', 'sha256'} (JSON-serialisable; an index keeps it in its meta.json)."""
    return {"num_docs": self.num_docs, "sha256": self._sha.hexdigest()}


def _read_records(path: PathLike, what: str, make,
                  on_record: Optional[Callable[[str, Any], None]] = None) -> dict:
  """{'_id': make(line number, record)} of a JSONL file, in file order; `what` names the
  ids in errors ('document id'); `on_record(id, value)` sees each entry as it is read."""
  records, seen = {}, {}
  for number, line in numbered_lines(path):
    record = _json_object(path, number, line)
    record_id = _record_id(path, number, record)
    check_new_id(path, number, record_id, seen, what)
    records[record_id] = make(number, record)
    if on_record is not None:
      on_record(record_id, records[record_id])
  return records


def read_corpus(path: PathLike, digest: Optional[CorpusDigest] = None) -> Dict[str, Passage]:
  """corpus.jsonl -> {doc id: Passage}, in file order ('title' may be missing or null);
  each passage is added to `digest` (when given) as it is read."""
  return _read_records(path, "document id", lambda number, record: Passage(
      _string_field(path, number, record, "title", optional=True),
      _string_field(path, number, record, "text")), digest.add if digest else None)


def read_queries(path: PathLike) -> Dict[str, str]:
  """queries.jsonl -> {query id: text}, in file order."""
  return _read_records(path, "query id",
                       lambda number, record: _string_field(path, number, record, "text"))


def grade(path: PathLike, number: int, text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise bad_line(path, number, f"score {text!r} is not an integer",
                   "Write the relevance grade as an integer (e.g. 0, 1, 2)") from None


def _qrels_rows(path: PathLike) -> Iterator[Tuple[int, str, str, int]]:
  """(line, query id, doc id, score) of a BEIR qrels TSV (its header line is skipped)."""
  for number, line in numbered_lines(path):
    columns = line.split("\t")
    if number == 1 and tuple(c.strip() for c in columns) == QRELS_HEADER:
      continue
    if len(columns) != 3:
      raise bad_line(path, number, f"expected 3 tab-separated columns (query-id, corpus-id, "
                     f"score), found {len(columns)}", "Separate the three columns by single tabs")
    query_id, doc_id = columns[0].strip(), columns[1].strip()
    if not query_id or not doc_id:
      raise bad_line(path, number, "empty query-id or corpus-id", "Fill in both ids")
    yield number, query_id, doc_id, grade(path, number, columns[2].strip())


def collect_qrels(path: PathLike, rows: Iterable[Tuple[int, str, str, int]],
                  doc_ids: Optional[Mapping] = None,
                  query_ids: Optional[Mapping] = None) -> Qrels:
  qrels: Qrels = {}
  seen: Dict[Tuple[str, str], int] = {}
  for number, query_id, doc_id, score in rows:
    if query_ids is not None and query_id not in query_ids:
      raise bad_line(path, number, f"query id {query_id!r} is not in the queries file",
                     "Add the query, or remove this judgement")
    if doc_ids is not None and doc_id not in doc_ids:
      raise bad_line(path, number, f"document id {doc_id!r} is not in the corpus",
                     "Add the document to the corpus, or remove this judgement")
    if (query_id, doc_id) in seen:
      raise bad_line(path, number, f"pair ({query_id!r}, {doc_id!r}) judged twice (first on line "
                     f"{seen[(query_id, doc_id)]})", "Keep one judgement per pair")
    seen[(query_id, doc_id)] = number
    qrels.setdefault(query_id, {})[doc_id] = score
  return qrels


def read_qrels(path: PathLike, doc_ids: Optional[Mapping] = None,
               query_ids: Optional[Mapping] = None) -> Qrels:
  """qrels/<split>.tsv -> {query id: {doc id: score}}; rows naming a document or query
  outside `doc_ids` / `query_ids` (when given) are errors."""
  return collect_qrels(path, _qrels_rows(path), doc_ids, query_ids)


@dataclasses.dataclass
class BeirData:
  """One split of a BEIR folder: the whole corpus, the split's judged queries, its qrels."""
  corpus: Dict[str, Passage]
  queries: Dict[str, str]       # only the queries with qrels in this split
  qrels: Qrels
  folder: str
  split: str
  name: str
  empty_passages: int = 0       # passages with neither title nor text (kept)
  empty_queries: int = 0        # queries of this split with empty text (kept, warned about)
  corpus_fingerprint: Dict[str, Any] = dataclasses.field(default_factory=dict)
  # {'num_docs', 'sha256'} of corpus.jsonl (`CorpusDigest`)

  def positive_pairs(self) -> List[Tuple[str, str]]:
    """(query id, doc id) of every judgement with score > 0, in qrels file order."""
    return [(q, d) for q, docs in self.qrels.items() for d, score in docs.items() if score > 0]


def qrels_splits(folder: PathLike) -> List[str]:
  """The splits a BEIR folder has qrels for (file stems of qrels/*.tsv), sorted."""
  qrels_dir = pathlib.Path(folder) / QRELS_DIR
  return sorted(p.stem for p in qrels_dir.glob("*.tsv")) if qrels_dir.is_dir() else []


def qrels_path(folder: PathLike, split: str) -> pathlib.Path:
  """qrels/<split>.tsv (or the dev / validation alias); a clear error when neither exists."""
  folder = pathlib.Path(folder)
  check_beir_folder(folder)
  for name in (split, SPLIT_ALIASES.get(split)):
    if name and (folder / QRELS_DIR / f"{name}.tsv").is_file():
      return folder / QRELS_DIR / f"{name}.tsv"
  present = qrels_splits(folder)
  raise MissingRetrievalFileError(
      f"{folder / QRELS_DIR / (split + '.tsv')}: no qrels for split {split!r}; this folder has "
      f"qrels for {present or 'no split'}. Choose one of those splits, or add "
      f"qrels/{split}.tsv.")


def check_beir_folder(folder: pathlib.Path) -> None:
  """A clear error when `folder` is missing or lacks a file of the BEIR layout."""
  if not folder.is_dir():
    raise MissingRetrievalFileError(f"{folder}: no such folder; {BEIR_LAYOUT}.")
  for name in (CORPUS_FILE, QUERIES_FILE, QRELS_DIR):
    if not (folder / name).exists():
      found = sorted(p.name for p in folder.iterdir())
      raise MissingRetrievalFileError(
          f"{folder / name}: missing (the folder has {found}); {BEIR_LAYOUT}.")


def empty_corpus(path: pathlib.Path) -> BadRetrievalFileError:
  """The error for a corpus.jsonl without a document (said so, not as a qrels row naming a
  document the corpus lacks)."""
  size = path.stat().st_size
  what = "an empty file" if not size else f"{size} bytes of blank lines"
  return BadRetrievalFileError(
      f"{path}: the corpus is empty (no document: {what}), so there is nothing to index. "
      "Fill it with one JSON object per line, {\"_id\", \"title\", \"text\"} (the BEIR "
      "layout; an interrupted download or conversion leaves it empty), or point the run at "
      "the folder that has the documents.")


def load_beir(folder: PathLike, split: str = "test") -> BeirData:
  """Reads a BEIR folder's corpus, queries and one split's qrels, checking every id and
  fingerprinting the corpus. Empty queries of the split are kept, with a WARNING."""
  qrels_file = qrels_path(folder, split)  # checks the layout first
  folder = pathlib.Path(folder)
  digest = CorpusDigest()
  corpus = read_corpus(folder / CORPUS_FILE, digest)
  if not corpus:
    raise empty_corpus(folder / CORPUS_FILE)
  all_queries = read_queries(folder / QUERIES_FILE)
  qrels = read_qrels(qrels_file, doc_ids=corpus, query_ids=all_queries)
  queries = {q: all_queries[q] for q in qrels}
  empty = [q for q, text in queries.items() if not text.strip()]
  data = BeirData(corpus, queries, qrels, str(folder), split, folder.name,
                  empty_passages=sum(p.is_empty for p in corpus.values()),
                  empty_queries=len(empty), corpus_fingerprint=digest.fingerprint())
  if data.empty_passages:
    logging.info("%s: %d empty passage(s) kept.", folder / CORPUS_FILE, data.empty_passages)
  if empty:
    logging.warning(
        "%s: %d query(ies) judged in split %r have empty text (ids: %s%s); each is scored "
        "as EOS alone and counted in NDCG / Recall. Give them text, or remove them from "
        "%s.", folder / QUERIES_FILE, len(empty), split, ", ".join(empty[:5]),
        f" and {len(empty) - 5} more" if len(empty) > 5 else "", qrels_file)
  return data


def _check_id(key: str, what: str) -> None:
  if not isinstance(key, str) or not key.strip() or any(c in key for c in "\t\r\n"):
    raise ValueError(f"{what} {key!r} must be a non-empty string without tabs or line breaks.")


def _as_passage(value) -> Passage:
  if isinstance(value, Passage):
    return value
  if isinstance(value, str):
    return Passage("", value)
  return Passage(value.get("title") or "", value["text"])


def write_beir(folder: PathLike, corpus: Mapping[str, Union[Passage, str, Mapping]],
               queries: Mapping[str, str], qrels_by_split: Mapping[str, Mapping[str, Mapping]],
               overwrite: bool = False) -> str:
  """Writes a BEIR folder atomically (a temp folder beside it, renamed into place) and
  returns its path. Passages may be `Passage`s, texts, or {'title', 'text'} dicts."""
  folder = pathlib.Path(folder)
  if folder.exists() and not overwrite:
    raise FileExistsError(f"{folder} exists; pass overwrite=True to replace it.")
  passages = {doc_id: _as_passage(p) for doc_id, p in corpus.items()}
  _check_write_ids(passages, queries, qrels_by_split)
  with fileio.atomic_directory(folder, replace=overwrite) as tmp:
    _write_beir_files(tmp, passages, queries, qrels_by_split)
  return str(folder)


def _check_write_ids(passages, queries, qrels_by_split) -> None:
  for doc_id in passages:
    _check_id(doc_id, "document id")
  for query_id in queries:
    _check_id(query_id, "query id")
  for split, qrels in qrels_by_split.items():
    _check_id(split, "split name")
    for query_id, docs in qrels.items():
      if query_id not in queries:
        raise ValueError(f"qrels[{split!r}] judges query {query_id!r}, which is not in queries.")
      unknown = [d for d in docs if d not in passages]
      if unknown:
        raise ValueError(f"qrels[{split!r}][{query_id!r}] names documents not in the corpus: "
                         f"{unknown[:5]}.")


def _write_beir_files(tmp: pathlib.Path, passages, queries, qrels_by_split) -> None:
  with open(tmp / CORPUS_FILE, "w", encoding="utf-8") as f:
    for doc_id, p in passages.items():
      f.write(json.dumps({"_id": doc_id, "title": p.title, "text": p.text},
                         ensure_ascii=False) + "\n")
  with open(tmp / QUERIES_FILE, "w", encoding="utf-8") as f:
    for query_id, text in queries.items():
      f.write(json.dumps({"_id": query_id, "text": text}, ensure_ascii=False) + "\n")
  (tmp / QRELS_DIR).mkdir()
  for split, qrels in qrels_by_split.items():
    with open(tmp / QRELS_DIR / f"{split}.tsv", "w", encoding="utf-8") as f:
      f.write("\t".join(QRELS_HEADER) + "\n")
      for query_id, docs in qrels.items():
        for doc_id, score in docs.items():
          f.write(f"{query_id}\t{doc_id}\t{int(score)}\n")


# ------------------------------------------------------------------------------ built-in
BUILTIN_FORMAT_VERSION = 2  # 2: split by section (1 split paragraphs)


def _builtin_split(title: str) -> str:
  """The split of a whole section, by a stable hash of its title: 30 % of the sections
  test, 10 % validation, the rest train (68 sections: 20 / 6 / 42)."""
  bucket = hashlib.sha256(("beir-section|" + title).encode("utf-8")).digest()[0] % 10
  return "test" if bucket < 3 else "validation" if bucket == 3 else "train"


def builtin_beir_records() -> Dict[str, List[Mapping[str, str]]]:
  """{'train' | 'validation' | 'test': [{'text', 'title', 'topic'}, ...]}: the built-in
  corpus's paragraphs, every section's paragraphs in one split, so that a query (a
  section title) has all of its section's paragraphs judged and none left unjudged in the
  corpus."""
  from decal_jax.data import corpus
  out = {"train": [], "validation": [], "test": []}
  for records in corpus.titled_documents().values():
    for record in records:
      out[_builtin_split(record["title"])].append(record)
  return out


def builtin_beir_contents():
  """(corpus, queries, qrels_by_split) of the built-in BEIR folder.

  Corpus: every paragraph (ids p00001, ...; no title, because the title is the query).
  Queries: each split's distinct section titles (ids <split>-q0001, ...). Qrels: a title
  query -> every paragraph of that split with that title, score 1.
  """
  corpus, queries, qrels = {}, {}, {}
  for split, records in builtin_beir_records().items():
    title_ids: Dict[str, str] = {}
    qrels[split] = {}
    for record in records:
      doc_id = f"p{len(corpus) + 1:05d}"
      corpus[doc_id] = Passage("", record["text"])
      if record["title"] not in title_ids:
        title_ids[record["title"]] = f"{split}-q{len(title_ids) + 1:04d}"
        queries[title_ids[record["title"]]] = record["title"]
      qrels[split].setdefault(title_ids[record["title"]], {})[doc_id] = 1
  return corpus, queries, qrels


def builtin_fingerprint() -> str:
  """12 hex digits over the built-in corpus (texts, titles, splits) and this format."""
  records = builtin_beir_records()
  payload = json.dumps([BUILTIN_FORMAT_VERSION, {s: [(r["title"], r["text"]) for r in rs]
                                                 for s, rs in records.items()}])
  return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:12]


def builtin_beir_folder() -> str:
  """The built-in BEIR folder, written once under the cache dir (`$DECAL_CACHE_DIR`) as
  `beir_builtin_<fingerprint>`. Safe when processes race: one writes under a file lock,
  atomically; the others wait and reuse it."""
  from decal_jax.data import vocabularies
  folder = vocabularies.cache_dir() / f"beir_builtin_{builtin_fingerprint()}"
  if (folder / QRELS_DIR).is_dir():
    return str(folder)
  try:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with vocabularies._exclusive_lock(folder):
      if not folder.exists():
        with contextlib.suppress(FileExistsError):
          write_beir(folder, *builtin_beir_contents())
  except OSError as e:
    if (folder / QRELS_DIR).is_dir():  # another process (without a lock) won the rename
      return str(folder)
    raise OSError(f"Cannot write the built-in BEIR folder to {folder} ({e}). Point "
                  "DECAL_CACHE_DIR at a writable directory.") from e
  return str(folder)
