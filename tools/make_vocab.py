# python tools/make_vocab.py                      # build + cache the built-in vocabulary
# python tools/make_vocab.py --input ../shared/data/text/c4_en_train_sample1000.jsonl \
#     --field text --vocab_size 8000 --output /tmp/c4_8k.model
"""Trains a SentencePiece vocabulary with T5's special ids (pad 0, eos 1, unk 2).

Without --input it builds (or finds) the cached vocabulary of the built-in corpus that
the `decal_builtin_span_corruption` task uses, under $DECAL_CACHE_DIR. With --input it
trains on a text file (one document per line or blank-line-separated) or a JSONL file
(the --field of each record) and writes --output.
"""
import argparse
import json
import pathlib
import sys
import time

import seqio

from decal_jax.data import vocabularies


def _read_texts(path: pathlib.Path, field: str):
  if not path.exists():
    sys.exit(f"error: input file {path} does not exist.")
  if path.suffix == ".jsonl":
    with path.open() as f:
      texts = [json.loads(line)[field] for line in f if line.strip()]
  else:
    texts = [block.strip() for block in path.read_text().split("\n\n") if block.strip()]
  if not texts:
    sys.exit(f"error: no text found in {path}.")
  return texts


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--input", type=pathlib.Path, default=None)
  parser.add_argument("--field", default="text", help="JSONL field holding the text")
  parser.add_argument("--vocab_size", type=int, default=vocabularies.BUILTIN_VOCAB_SIZE)
  parser.add_argument("--output", type=pathlib.Path, default=None)
  args = parser.parse_args(argv)
  start = time.time()
  if args.input is None:
    print(f"Building the built-in vocabulary ({args.vocab_size} pieces) ...", flush=True)
    path = vocabularies.builtin_vocabulary_path(args.vocab_size)
  else:
    if args.output is None:
      parser.error("--output is required with --input")
    texts = _read_texts(args.input, args.field)
    print(f"Training on {len(texts)} documents from {args.input} ...", flush=True)
    path = str(vocabularies.train_sentencepiece(texts, args.output, args.vocab_size))
  vocab = seqio.SentencePieceVocabulary(path, extra_ids=vocabularies.EXTRA_IDS)
  example = "The with statement wraps the execution of a block."
  ids = vocab.encode(example)
  print(f"vocabulary: {path} ({vocab.vocab_size} ids incl. {vocabularies.EXTRA_IDS} sentinels; "
        f"{time.time() - start:.1f}s)")
  print(f"example: {example!r}\n  -> {len(ids)} pieces {ids}\n  -> {vocab.decode(ids)!r}")


if __name__ == "__main__":
  main()
