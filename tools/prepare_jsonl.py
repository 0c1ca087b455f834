"""Converts official dataset releases into the local JSONL layout the downstream tasks read
(`<out>/<name>/<split>.jsonl`); then `export DECAL_LOCAL_DATA_DIR=<out>`.

  python tools/prepare_jsonl.py squad ../shared/data/squad/dev-v1.1.json --split validation \
      --out data/local

  squad     SQuAD v1.1 / v2.0 JSON file             -> <out>/squad/<split>.jsonl
  hotpotqa  HotpotQA JSON file (distractor or fullwiki) -> <out>/hotpotqa/<split>.jsonl
  mediasum  news_dialogue.json train_val_test_split.json -> <out>/mediasum/{train,validation,test}.jsonl

CNN/DailyMail (article, highlights) and arXiv / PubMed in their release JSONL (article_text,
abstract_text) need no conversion: copy or link the files to <out>/<name>/<split>.jsonl.
"""
import argparse
import pathlib

from decal_jax.data import convert


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("format", choices=["squad", "hotpotqa", "mediasum"])
  parser.add_argument("files", nargs="+", help="the release file(s), as listed above")
  parser.add_argument("--split", help="split name for squad / hotpotqa (train, validation, test)")
  parser.add_argument("--out", required=True, help="folder to write <name>/<split>.jsonl into")
  args = parser.parse_args(argv)
  folder = pathlib.Path(args.out) / args.format
  want_files = 2 if args.format == "mediasum" else 1
  if len(args.files) != want_files:
    parser.error(f"{args.format} takes {want_files} file(s), got {len(args.files)}.")
  for path in args.files:
    if not pathlib.Path(path).is_file():
      parser.error(f"no such file: {path}")
  if args.format == "mediasum":
    counts = convert.write_splits(convert.mediasum(*args.files), folder, "summarization")
  else:
    if args.split not in ("train", "validation", "test"):
      parser.error("--split must be train, validation or test.")
    records = getattr(convert, args.format)(args.files[0])
    counts = {args.split: convert.write(records, folder / f"{args.split}.jsonl", "qa")}
  for split, (written, skipped) in counts.items():
    print(f"{folder / (split + '.jsonl')}: {written} records"
          + (f" ({skipped} left out: empty fields / no answer)" if skipped else ""))
  print(f"Now: export DECAL_LOCAL_DATA_DIR={args.out}")


if __name__ == "__main__":
  main()
