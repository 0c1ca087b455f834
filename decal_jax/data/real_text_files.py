"""The real text of the shared data folder (C4, WikiText-2 and TinyStories, `<data dir>/text/`)
read as documents with a fixed train / validation split: plain Python, no seqio or
TensorFlow, so the SmolLM2 tools read it on a GPU image without them. `real_text` builds the
seqio source and the vocabulary on it.

The data dir is `$DECAL_DATA_DIR`, default `../shared/data` (from a checkout's root); the files
are read, never copied. Documents:

  C4          each JSON line's `text` (1,000 web pages)
  WikiText-2  each article of the raw test split: a ` = Title = ` line and the lines up to the
              next one (line ends normalised, blank lines dropped)
  TinyStories each story between `<|endoftext|>` markers (the file's last one is cut short)

Exact repeats are kept once. Each document goes to 'validation' when the SHA-256 of its text
falls in the first VALIDATION_PERCENT buckets of 100 (`corpus.split_of`'s rule), else to
'train': the splits never share a document, and the choice does not depend on file order.
"""
import functools
import json
import pathlib
import re
from typing import Dict, List, Optional

from decal_jax import settings
from decal_jax.data import corpus

SPLITS = ("train", "validation")
VALIDATION_PERCENT = 5
FILES = {"c4": "text/c4_en_train_sample1000.jsonl",
         "wikitext2": "text/wikitext2_raw_test.txt",
         "tinystories": "text/tinystories_sample.txt"}
_ARTICLE_TITLE = re.compile(r"^ = [^=].* = $")  # ' = Title = ', not ' = = Section = = '


def data_dir() -> pathlib.Path:
  """`$DECAL_DATA_DIR`, default `../shared/data`."""
  return pathlib.Path(settings.get("DECAL_DATA_DIR"))


def source_path(source: str, folder: pathlib.Path) -> pathlib.Path:
  """The file of `source` (a FILES key) under `folder`; a clear error if it is absent."""
  path = folder / FILES[source]
  if not path.exists():
    raise FileNotFoundError(
        f"{path} not found: the real-text tasks read {FILES[source]} from the shared data "
        "folder. Set DECAL_DATA_DIR to it (default ../shared/data, from the repository root).")
  return path


def c4_documents(path: pathlib.Path) -> List[str]:
  with path.open(encoding="utf-8") as f:
    return [json.loads(line)["text"] for line in f if line.strip()]


def wikitext_documents(path: pathlib.Path) -> List[str]:
  """One document per article; lines before the first title are dropped."""
  articles: List[List[str]] = []
  with path.open(encoding="utf-8", newline="") as f:
    for line in f:
      line = line.rstrip("\r\n")
      if _ARTICLE_TITLE.match(line):
        articles.append([])
      if articles and line.strip():
        articles[-1].append(line.strip())
  return ["\n".join(lines) for lines in articles]


def tinystories_documents(path: pathlib.Path) -> List[str]:
  text = path.read_text(encoding="utf-8")
  return [story.strip() for story in text.split("<|endoftext|>") if story.strip()]


READERS = {"c4": c4_documents, "wikitext2": wikitext_documents,
           "tinystories": tinystories_documents}


def split_of(document: str) -> str:
  return corpus.split_of(document, VALIDATION_PERCENT)


@functools.lru_cache(maxsize=None)
def _documents(folder: str) -> Dict[str, List[str]]:
  out: Dict[str, List[str]] = {split: [] for split in SPLITS}
  seen = set()
  for source, read in READERS.items():
    for document in read(source_path(source, pathlib.Path(folder))):
      if document not in seen:
        seen.add(document)
        out[split_of(document)].append(document)
  return out


def documents(folder: Optional[pathlib.Path] = None) -> Dict[str, List[str]]:
  """{'train': [...], 'validation': [...]}: C4, then WikiText-2, then TinyStories documents,
  each source in file order."""
  return _documents(str(folder or data_dir()))
