"""Real public text for held-out measurements: the C4, WikiText-2 and TinyStories samples
in `<data dir>/text/` (the project's `../shared/data`, see its README; not shipped).

The data directory is `$DECAL_DATA_DIR`, else `../shared/data` from the working directory
(a checkout's root). Each file becomes documents:

- `c4_en_train_sample1000.jsonl`: one document per line ("text" field).
- `wikitext2_raw_test.txt`: one document per paragraph line; " = Heading = " lines and blank
  lines are dropped (CRLF endings stripped).
- `tinystories_sample.txt`: one document per story (stories end with `<|endoftext|>`).

Every document goes to `train` or `validation` by a stable SHA-256 of its text (about
VALIDATION_PERCENT %), so the splits never overlap and do not depend on reading order. The
three sources are interleaved round-robin, so any prefix of a split mixes all three.
"""
import functools
import pathlib
from typing import Dict, List, Optional

import seqio
import tensorflow as tf

from decal_jax.data import corpus, real_text_files

SPLITS = ("train", "validation")
VALIDATION_PERCENT = 3
FILES = {"c4": "c4_en_train_sample1000.jsonl", "wikitext": "wikitext2_raw_test.txt",
         "tinystories": "tinystories_sample.txt"}
TRAIN_PASSES = 100  # shuffled training reads: this many passes, each in its own order


def _wikitext_paragraphs(path: pathlib.Path) -> List[str]:
  """One document per paragraph line (real_text reads whole articles): heading lines and
  blank lines dropped."""
  lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
  return [line for line in lines if line and not (line.startswith("=") and line.endswith("="))]


READERS = {"c4": real_text_files.c4_documents, "wikitext": _wikitext_paragraphs,
           "tinystories": real_text_files.tinystories_documents}


def split_of(document: str) -> str:
  return corpus.split_of(document, VALIDATION_PERCENT)


def _interleave(lists: List[List[str]]) -> List[str]:
  """Round-robin: a[0], b[0], c[0], a[1], ... (a list that runs out is skipped)."""
  out = []
  for i in range(max(map(len, lists), default=0)):
    out += [docs[i] for docs in lists if i < len(docs)]
  return out


@functools.lru_cache(maxsize=None)
def documents(directory: Optional[str] = None) -> Dict[str, List[str]]:
  """{'train': [...], 'validation': [...]}: the three sources' documents, interleaved."""
  folder = pathlib.Path(directory) if directory else real_text_files.data_dir()
  per_source = {split: [] for split in SPLITS}
  for name, file in FILES.items():
    path = folder / "text" / file
    if not path.exists():
      raise FileNotFoundError(
          f"{path} is missing: the public text samples live in the project's ../shared/data "
          "(run from the checkout's root, or set DECAL_DATA_DIR to the data folder).")
    docs = READERS[name](path)
    for split in SPLITS:
      per_source[split].append([d for d in docs if split_of(d) == split])
  return {split: _interleave(lists) for split, lists in per_source.items()}


def _dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None) -> tf.data.Dataset:
  """{'text': scalar string} per document; shuffled training reads give TRAIN_PASSES
  passes, pass i in the order of seed (seed, i)."""
  if split not in SPLITS:
    raise ValueError(f"The public text has splits {SPLITS}, not {split!r}.")
  docs = documents()[split]
  ds = tf.data.Dataset.from_tensor_slices({"text": docs})
  if split != "train" or not shuffle_files:
    return ds
  return corpus.reshuffled_passes(ds, len(docs), seed or 0, TRAIN_PASSES)


def data_source() -> seqio.FunctionDataSource:
  """The public text as a seqio source: splits 'train' / 'validation', feature 'text'."""
  return corpus.StreamingSource(_dataset_fn, SPLITS, lambda split: len(documents()[split]))
