"""MS MARCO passage ranking on disk, with line-numbered errors (the shared line readers and
errors are `retrieval/beir.py`'s).

MS MARCO passage folder (the official file names; `pairs`, `triples`):

    collection.tsv                pid \\t passage
    queries.<split>.tsv           qid \\t query    (or queries.tsv for every split)
    qrels.<split>.tsv             qid 0 pid rel  (TREC; or qrels.txt for every split)
    triples.train.small.tsv       query \\t positive \\t negative     (texts), or
    qidpidtriples.train.full.tsv  qid \\t positive pid \\t negative pid (ids)

MS MARCO calls its validation split 'dev'; 'validation' is accepted for it.
"""
import pathlib
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

from decal_jax.retrieval.beir import (MissingRetrievalFileError, PathLike, Qrels, bad_line,
                                      check_new_id, collect_qrels, numbered_lines, grade)

COLLECTION = "collection.tsv"
TEXT_TRIPLES = "triples.train.small.tsv"
ID_TRIPLES = "qidpidtriples.train.full.tsv"
LAYOUT = ("an MS MARCO passage folder holds collection.tsv (pid<TAB>passage), "
                  "queries.<split>.tsv or queries.tsv (qid<TAB>query), qrels.<split>.tsv or "
                  "qrels.txt (TREC: 'qid 0 pid rel'), and for triples "
                  f"{TEXT_TRIPLES} (query<TAB>positive<TAB>negative) or "
                  f"{ID_TRIPLES} (qid<TAB>pid<TAB>pid); splits: train, dev")


def _tsv_text_rows(path: PathLike) -> Iterator[Tuple[int, str, str]]:
  for number, line in numbered_lines(path):
    columns = line.split("\t")
    if len(columns) != 2:
      raise bad_line(path, number, f"expected 2 tab-separated columns (id, text), found "
                     f"{len(columns)}", "Write 'id<TAB>text' with no tab inside the text")
    if not columns[0].strip():
      raise bad_line(path, number, "empty id", "Give the line its id")
    yield number, columns[0].strip(), columns[1]


def read_tsv_texts(path: PathLike) -> Dict[str, str]:
  """'id<TAB>text' lines (collection.tsv, queries.*.tsv) -> {id: text}; an empty text is
  kept, a repeated id is an error."""
  texts, seen = {}, {}
  for number, key, text in _tsv_text_rows(path):
    check_new_id(path, number, key, seen, "id")
    texts[key] = text
  return texts


def _trec_rows(path: PathLike) -> Iterator[Tuple[int, str, str, int]]:
  for number, line in numbered_lines(path):
    columns = line.split()
    if len(columns) != 4:
      raise bad_line(path, number, f"expected 4 whitespace-separated columns (qid, 0, pid, rel), "
                     f"found {len(columns)}", "Write TREC qrels lines: 'qid 0 pid rel'")
    yield number, columns[0], columns[2], grade(path, number, columns[3])


def read_trec_qrels(path: PathLike, doc_ids: Optional[Mapping] = None,
                    query_ids: Optional[Mapping] = None) -> Qrels:
  """TREC qrels ('qid 0 pid rel') -> {qid: {pid: rel}}; ids outside `doc_ids` /
  `query_ids` (when given) are errors."""
  return collect_qrels(path, _trec_rows(path), doc_ids, query_ids)


def split_name(split: str) -> str:
  """Our split name -> MS MARCO's ('validation' -> 'dev')."""
  return "dev" if split == "validation" else split


def _missing(folder: pathlib.Path, wanted: str) -> MissingRetrievalFileError:
  found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "no such folder"
  return MissingRetrievalFileError(
      f"{folder}: needs {wanted}; found {found}. Expected layout: {LAYOUT}.")


def find_file(folder: PathLike, kind: str, split: str) -> pathlib.Path:
  """`kind` 'queries' -> queries.<split>.tsv, else queries.tsv; 'qrels' ->
  qrels.<split>.tsv, else qrels.txt; 'collection' -> collection.tsv."""
  folder, split = pathlib.Path(folder), split_name(split)
  names = {"collection": [COLLECTION],
           "queries": [f"queries.{split}.tsv", "queries.tsv"],
           "qrels": [f"qrels.{split}.tsv", "qrels.txt"]}[kind]
  for name in names:
    if (folder / name).is_file():
      return folder / name
  raise _missing(folder, " or ".join(names))


def pairs(folder: PathLike, split: str = "train") -> Iterator[Tuple[str, str]]:
  """(query, relevant passage) for every qrels row of `split` with rel > 0, in qrels file
  order. The files are found now; they are read (and every id checked) on first use."""
  paths = [find_file(folder, kind, split) for kind in ("collection", "queries", "qrels")]

  def read():
    collection, queries = read_tsv_texts(paths[0]), read_tsv_texts(paths[1])
    qrels = read_trec_qrels(paths[2], doc_ids=collection, query_ids=queries)
    for qid, docs in qrels.items():
      for pid, rel in docs.items():
        if rel > 0:
          yield queries[qid], collection[pid]
  return read()


def triples(folder: PathLike) -> Iterator[Tuple[str, str, str]]:
  """(query, positive, negative) texts from triples.train.small.tsv, else from
  qidpidtriples.train.full.tsv resolved through collection.tsv and the train queries.
  Streamed: an id triple naming an unknown id fails at its line."""
  folder = pathlib.Path(folder)
  if (folder / TEXT_TRIPLES).is_file():
    return _text_triples(folder / TEXT_TRIPLES)
  if (folder / ID_TRIPLES).is_file():
    paths = (find_file(folder, "collection", "train"),
             find_file(folder, "queries", "train"))
    return _id_triples(folder / ID_TRIPLES, *paths)
  raise _missing(folder, f"{TEXT_TRIPLES} or {ID_TRIPLES}")


def _triple_columns(path: pathlib.Path, number: int, line: str, what: str) -> List[str]:
  columns = line.split("\t")
  if len(columns) != 3:
    raise bad_line(path, number, f"expected 3 tab-separated columns ({what}), found "
                   f"{len(columns)}", "Write one triple per line, columns separated by tabs")
  return columns


def _text_triples(path: pathlib.Path) -> Iterator[Tuple[str, str, str]]:
  for number, line in numbered_lines(path):
    query, positive, negative = _triple_columns(path, number, line,
                                                "query, positive, negative")
    yield query, positive, negative


def _id_triples(path: pathlib.Path, collection_path: pathlib.Path,
                queries_path: pathlib.Path) -> Iterator[Tuple[str, str, str]]:
  collection, queries = read_tsv_texts(collection_path), read_tsv_texts(queries_path)
  for number, line in numbered_lines(path):
    qid, positive, negative = (c.strip() for c in _triple_columns(
        path, number, line, "qid, positive pid, negative pid"))
    if qid not in queries:
      raise bad_line(path, number, f"query id {qid!r} is not in {queries_path.name}",
                     "Use the train queries file that goes with these triples")
    for pid in (positive, negative):
      if pid not in collection:
        raise bad_line(path, number, f"passage id {pid!r} is not in {collection_path.name}",
                       "Use the full collection.tsv that goes with these triples")
    yield queries[qid], collection[positive], collection[negative]
