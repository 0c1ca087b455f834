"""Converts dataset releases into the local JSONL layout the downstream tasks read
(`<out>/<name>/<split>.jsonl`); then `export DECAL_LOCAL_DATA_DIR=<out>`.

  python -m decal_jax.commands.prepare_jsonl squad ../shared/data/squad/dev-v1.1.json --split validation \
      --out data/local

  squad     SQuAD v1.1 / v2.0 JSON file, or HF squad rows  -> <out>/squad/<split>.jsonl
            (v2's unanswerable questions: left out, or with --keep_unanswerable kept with
            the empty string as their target)
  hotpotqa  HotpotQA JSON file, or HF hotpot_qa rows        -> <out>/hotpotqa/<split>.jsonl
  mediasum  news_dialogue.json train_val_test_split.json
                                        -> <out>/mediasum/{train,validation,test}.jsonl
            or one split's rows (HF nbroad/ccdv mediasum) with --split
                                        -> <out>/mediasum/<split>.jsonl

Hugging Face rows are a JSON list or JSONL (`Dataset.to_json`); `decal_jax/data/convert.py`
lists every layout read. A file in another layout stops with its first bad record, and
nothing is written.

CNN/DailyMail (article, highlights) and arXiv / PubMed in their release JSONL (article_text,
abstract_text) need no conversion: copy or link the files to <out>/<name>/<split>.jsonl.
"""
import argparse
import pathlib

from decal_jax import fileio
from decal_jax.data import convert


def _convert(parser, args, folder, notes):
  """Converts every record, then writes; {split: (written, left out)}; what the
  conversion did beyond reading goes to `notes`."""
  if args.format == "mediasum" and len(args.files) == 2:
    return convert.write_splits(convert.mediasum(*args.files), folder, "summarization")
  if args.split not in ("train", "validation", "test"):
    parser.error("--split must be train, validation or test.")
  if args.format == "mediasum":
    records, kind = convert.mediasum_split(args.files[0]), "summarization"
  elif args.format == "squad":
    records, kind = convert.squad(args.files[0], notes, args.keep_unanswerable), "qa"
  else:
    records, kind = convert.hotpotqa(args.files[0], notes=notes), "qa"
  return {args.split: convert.write(records, folder / f"{args.split}.jsonl", kind)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("format", choices=["squad", "hotpotqa", "mediasum"])
  parser.add_argument("files", nargs="+", help="the release file(s), as listed above")
  parser.add_argument("--split", help="split name for squad / hotpotqa / one mediasum file "
                      "(train, validation, test)")
  parser.add_argument("--out", required=True, help="folder to write <name>/<split>.jsonl into")
  parser.add_argument("--keep_unanswerable", action="store_true",
                      help="squad: keep SQuAD v2's unanswerable questions, with the empty "
                      "string as their target (answers [\"\"]); by default left out")
  args = parser.parse_args(argv)
  if args.keep_unanswerable and args.format != "squad":
    parser.error("--keep_unanswerable is for squad (SQuAD v2's unanswerable questions).")
  folder = pathlib.Path(args.out) / args.format
  max_files = 2 if args.format == "mediasum" else 1
  if not 1 <= len(args.files) <= max_files:
    parser.error(f"{args.format} takes {'1 (with --split) or 2' if max_files == 2 else 1} "
                 f"file(s), got {len(args.files)}.")
  for path in args.files:
    if not pathlib.Path(path).is_file():
      parser.error(f"no such file: {path}")
  notes = []
  try:
    counts = _convert(parser, args, folder, notes)
  except (convert.ReleaseLayoutError, fileio.NotUtf8Error) as e:
    parser.exit(2, f"error: {e}\nNothing was written.\n")
  for note in notes:
    print(f"Note: {note}")
  for split, (written, skipped) in counts.items():
    print(f"{folder / (split + '.jsonl')}: {written} records"
          + (f" ({skipped} left out: empty fields / no answer)" if skipped else ""))
  print(f"Now: export DECAL_LOCAL_DATA_DIR={args.out}")


if __name__ == "__main__":
  main()
