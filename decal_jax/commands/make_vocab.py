"""Trains a SentencePiece vocabulary with T5's special ids (pad 0, eos 1, unk 2, no bos).

  python -m decal_jax.commands.make_vocab                      # build + cache the built-in vocabulary
  python -m decal_jax.commands.make_vocab --input ../shared/data/text/c4_en_train_sample1000.jsonl --field \
      text --vocab_size 8000 --output /tmp/c4_8k.model

Without --input it builds (or finds) the cached vocabulary of the built-in corpus that the
`decal_builtin_span_corruption` task uses, under $DECAL_CACHE_DIR (default
~/.cache/decal_jax). With --input it trains on a text file or a JSONL file (the --field of
each record) and writes --output. Training sentences are the non-empty lines of the text.
--vocab_size is an upper bound: a small corpus may support fewer pieces. Every vocabulary
falls back to UTF-8 byte pieces (256 of its pieces), so no input byte is ever unknown;
DECAL_BUILTIN_VOCAB=chars builds the built-in one without them (the recipe before byte
fallback, for checkpoints trained with it).
"""
import argparse
import json
import pathlib
import sys
import time
from typing import Iterator, List, Tuple

from decal_jax.data import vocabularies

EXAMPLE = "The with statement wraps the execution of a block."


def _numbered_lines(path: pathlib.Path) -> Iterator[Tuple[int, str]]:
  """(number from 1, text) of each line; a line that is not UTF-8 stops with its number."""
  from decal_jax.data import local_files  # seqio
  with path.open("rb") as f:
    for number, raw in enumerate(f, 1):
      try:
        yield number, local_files.decode(raw)
      except local_files.BadRecordError as e:
        sys.exit(f"error: {path}:{number}: {e}.")


def _read_jsonl(path: pathlib.Path, field: str) -> List[str]:
  texts = []
  for number, line in _numbered_lines(path):
    if line.strip():
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        sys.exit(f"error: {path}:{number} is not valid JSON ({e.msg}); write one JSON object "
                 "per line.")
      if not isinstance(record, dict) or field not in record:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        sys.exit(f"error: {path}:{number} has no field {field!r} (found: {found}); choose "
                 "one with --field.")
      texts.append(record[field])
  return texts


def read_sentences(path: pathlib.Path, field: str) -> List[str]:
  """Non-empty lines of a text file, or of the `field` of every JSONL record."""
  if not path.exists():
    sys.exit(f"error: input file {path} does not exist.")
  if path.suffix == ".jsonl":
    texts = _read_jsonl(path, field)
  else:
    texts = [line for _, line in _numbered_lines(path)]
  sentences = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
  if not sentences:
    sys.exit(f"error: no text found in {path}.")
  return sentences


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--input", type=pathlib.Path, default=None,
                      help="text or .jsonl file (default: the built-in corpus)")
  parser.add_argument("--field", default="text", help="JSONL field holding the text")
  parser.add_argument("--vocab_size", type=int, default=vocabularies.BUILTIN_VOCAB_SIZE)
  parser.add_argument("--output", type=pathlib.Path, default=None,
                      help="where to write the model (required with --input)")
  args = parser.parse_args(argv)
  import seqio  # after the arguments
  start = time.time()
  if args.input is None:
    print(f"Building the built-in vocabulary (<= {args.vocab_size} pieces) under "
          f"{vocabularies.cache_dir()} ...", flush=True)
    path = vocabularies.builtin_vocabulary_path(args.vocab_size)
  else:
    if args.output is None:
      parser.error("--output is required with --input")
    sentences = read_sentences(args.input, args.field)
    print(f"Training on {len(sentences)} lines from {args.input} "
          f"(<= {args.vocab_size} pieces) ...", flush=True)
    path = str(vocabularies.train_sentencepiece(sentences, args.output, args.vocab_size))
  vocab = seqio.SentencePieceVocabulary(path, extra_ids=vocabularies.EXTRA_IDS)
  ids = vocab.encode(EXAMPLE)
  print(f"vocabulary: {path} ({vocab.vocab_size} ids incl. {vocabularies.EXTRA_IDS} "
        f"sentinels; {time.time() - start:.1f}s)")
  print(f"example: {EXAMPLE!r}\n  -> {len(ids)} pieces {ids}\n  -> "
        f"{[vocab.tokenizer.id_to_piece(i) for i in ids]}\n  -> {vocab.decode(ids)!r}")


if __name__ == "__main__":
  main()
