"""The real text of ../shared/data (data/real_text.py) and its sentence LM task: the documents
are the source files' own text (checked against the files read here independently), every
document lies in exactly one split and no validation document occurs in the training text,
and the task's validation chunks decode back to the validation documents."""
import json
import os
import pathlib
import unicodedata

import pytest
import seqio

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax.data import real_text_files

import paths

DATA_DIR = pathlib.Path(os.environ.get("DECAL_DATA_DIR", paths.REPO.parent / "shared" / "data"))
TASK = "decal_real_text_sentence_lm"


@pytest.fixture(autouse=True)
def data(monkeypatch):
  if not (DATA_DIR / real_text_files.FILES["tinystories"]).exists():
    pytest.skip(f"{DATA_DIR / 'text'} not found: set DECAL_DATA_DIR to the shared data folder")
  monkeypatch.setenv("DECAL_DATA_DIR", str(DATA_DIR))
  return real_text_files.documents(DATA_DIR)


def _squeeze(text: str) -> str:
  """Whitespace removed (documents keep words; line ends and spacing are not compared)."""
  return "".join(text.split())


def _raw_texts():
  """Each source's whole text as the files hold it, read here without the readers."""
  c4 = [json.loads(line)["text"] for line in
        (DATA_DIR / real_text_files.FILES["c4"]).read_text(encoding="utf-8").splitlines()]
  wiki = (DATA_DIR / real_text_files.FILES["wikitext2"]).read_text(encoding="utf-8")
  stories = (DATA_DIR / real_text_files.FILES["tinystories"]).read_text(encoding="utf-8")
  return {"c4": "".join(c4), "wikitext2": wiki, "tinystories": stories.replace(
      "<|endoftext|>", "")}


def test_documents_are_the_files_text_split_once(data):
  raw = {source: _squeeze(text) for source, text in _raw_texts().items()}
  read = {s: real_text_files.READERS[s](DATA_DIR / real_text_files.FILES[s]) for s in raw}
  for source, text in raw.items():
    # Each document is the file's own text, in file order, and together they cover every
    # non-space character of it (markers and JSON syntax aside).
    position = 0
    for doc in read[source]:
      found = text.find(_squeeze(doc), position)
      assert found == position, (source, doc[:80])
      position += len(_squeeze(doc))
    assert position == len(text), source
  every = list(dict.fromkeys(d for docs in read.values() for d in docs))  # repeats once
  assert sorted(data["train"] + data["validation"]) == sorted(every)
  assert not set(data["train"]) & set(data["validation"])
  # ~1M words; the validation share is near VALIDATION_PERCENT of the documents.
  assert 0.9e6 < sum(len(d.split()) for d in every) < 1.2e6
  assert 0.5 * real_text_files.VALIDATION_PERCENT < 100 * len(data["validation"]) / len(every) < \
      2 * real_text_files.VALIDATION_PERCENT


def test_no_validation_document_occurs_in_the_training_text(data):
  train = "\n".join(" ".join(d.split()) for d in data["train"])
  for doc in data["validation"]:
    assert " ".join(doc.split()) not in train


def test_validation_chunks_decode_to_the_validation_documents(builtin_vocabulary, data):
  """Read back through the task (tokenized with the built-in vocabulary, which falls back to
  bytes): the chunks' ids without the end ids decode to the documents, in order."""
  vocab, end = builtin_vocabulary, builtin_vocabulary.vocab_size - 1
  ds = seqio.get_mixture_or_task(TASK).get_dataset(
      {"targets": 256}, split="validation", shuffle=False, num_epochs=1)
  ids = [int(t) for ex in ds.as_numpy_iterator() for t in ex["targets"]]
  assert all(len(ex["targets"]) == 256 for ex in list(ds.as_numpy_iterator())[:-1])
  text = vocab.decode([t for t in ids if t != end])
  expected = " ".join(" ".join(d.split()) for d in data["validation"])
  expected = unicodedata.normalize("NFKC", expected).replace("\ufeff", "")  # as SentencePiece
  assert " ".join(text.split()) == " ".join(expected.split())  # normalises: NFKC, no BOM
  assert ids.count(end) >= sum(d.count(". ") for d in data["validation"]) // 2  # sentences


def test_missing_data_folder_names_the_fix(tmp_path):
  with pytest.raises(FileNotFoundError, match="DECAL_DATA_DIR"):
    real_text_files.documents(tmp_path)
