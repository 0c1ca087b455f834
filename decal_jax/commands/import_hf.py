# python -m decal_jax.commands.import_hf --hf_dir /ckpt/Llama-2-7b-hf --out /ckpt/dodo_llama2_7b \
#     --gin_file=models/dodo_llama2_7b.gin
# python -m decal_jax.commands.import_hf --hf_dir /ckpt/Qwen2-0.5B --out /ckpt/qwen2_05b --model decoder
# python -m decal_jax.commands.import_hf --model squid --hf_dir /ckpt/Qwen2-0.5B \
#     --large_hf_dir /ckpt/Qwen2-7B --out /ckpt/squid_qwen2 --gin_file=models/squid_qwen2.gin
"""Writes a Hugging Face LLaMA / Qwen2 / Mistral checkpoint as an Orbax checkpoint to start
training from (`INITIAL_CHECKPOINT_PATH`, gin/runs/finetune.gin).

--model dodo (default): the params of the Dodo that the gin files configure (default
models/dodo.gin: LoRA rank 32, scorer layer 3, soft prompt), with the checkpoint's sizes:
its decoder stack comes from the checkpoint, the scorer, soft prompt and LoRA adapters are
freshly initialised (--seed). --model decoder: the plain `Decoder` params. --model squid:
the params of the Squid that the gin files configure (default models/squid_qwen2.gin), its
small decoder from --hf_dir and its large decoder from --large_hf_dir, the memory tokens
and projector freshly initialised; each decoder takes its checkpoint's sizes.

--zero_id_to R moves the checkpoint's token 0 to id R (`hf_import.remap_zero_row`: row R of
the embedding, and column R of an untied head, get token 0's weights; row 0 becomes zeros),
for byte-level BPE checkpoints (Qwen2) whose id 0 is a real token ('!') while our pipelines
pad with 0. It must match the vocabulary the model trains with,
`hf_vocabularies.HfTokenizerVocabulary(..., zero_id_to=R)`, so for --model dodo / squid it
defaults to the gin VOCABULARY's zero_id_to (models/squid_qwen2.gin binds 151935: both
Squid decoders are remapped) and a different value is refused; --model decoder has no gin
files and remaps only when given it. R is refused if it is past any imported embedding
table or is a token of the tokenizer.json beside a checkpoint. The written hf_import.gin
then binds the same zero_id_to.

--out receives `checkpoint_0` (params only: start runs from it, do not resume in it),
`hf_import.gin` (the checkpoint's DecoderConfig sizes, to pass after the model gin file;
for Squid scoped `small/decoder.DecoderConfig` / `large/decoder.DecoderConfig`)
and `hf_import.json` (where it came from). Everything is written to a temporary folder
beside --out and renamed into place when complete, so --out is never half-written; an
existing --out is refused unless --overwrite. The gin bindings and the command that starts
a fine-tuning run from the result are printed at the end.

The import itself is `decal_jax.interop.hf_params` (`import_decoder` / `import_dodo` /
`import_squid`); this file reads the gin files and flags, writes, and reports.

Memory: a 7B model needs about 2 x 27 GB of host memory (float32 checkpoint + fresh Dodo);
Squid on Qwen2-0.5B + 7B about 2 x 32 GB.
"""
import argparse
import contextlib
import json
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gin

from decal_jax import fileio
from decal_jax.runtime import gin_utils

if TYPE_CHECKING:  # JAX, TensorFlow and seqio load in the functions, after the arguments
  from decal_jax.interop import hf_params

DEFAULT_DODO_GIN = "models/dodo.gin"
DEFAULT_SQUID_GIN = "models/squid_qwen2.gin"
DEFAULT_GIN = {"dodo": DEFAULT_DODO_GIN, "squid": DEFAULT_SQUID_GIN}


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hf_dir", required=True,
                      help="config.json + *.safetensors (--model squid: the small decoder's)")
  parser.add_argument("--large_hf_dir", default=None,
                      help="--model squid only: the large decoder's checkpoint")
  parser.add_argument("--out", required=True, help="the new checkpoint's directory")
  parser.add_argument("--model", choices=("dodo", "decoder", "squid"), default="dodo")
  parser.add_argument("--gin_file", action="append", default=[],
                      help=f"the model's options: default {DEFAULT_DODO_GIN} (dodo), "
                      f"{DEFAULT_SQUID_GIN} (squid)")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="extra gin bindings, e.g. 'LORA_RANK = 8'")
  parser.add_argument("--max_length", type=int, default=None,
                      help="positions the model accepts (default: max_position_embeddings)")
  parser.add_argument("--seed", type=int, default=0, help="init of the non-imported params")
  parser.add_argument("--zero_id_to", type=int, default=None,
                      help="move token 0's weights to this id and zero row 0 (default: the "
                      "gin VOCABULARY's HfTokenizerVocabulary.zero_id_to; --model "
                      "decoder: no remap)")
  parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
  args = parser.parse_args(argv)
  if args.model == "decoder" and (args.gin_file or args.gin_bindings):
    parser.error("--gin_file / --gin_bindings configure Dodo; --model decoder takes none.")
  if args.model == "squid" and not args.large_hf_dir:
    parser.error("--model squid needs --large_hf_dir (the large decoder's checkpoint; "
                 "--hf_dir is the small one's).")
  if args.model != "squid" and args.large_hf_dir:
    parser.error(f"--large_hf_dir is for --model squid only (got --model {args.model}).")
  return args


# ------------------------------------------------------------------------------ configs
@contextlib.contextmanager
def parsed_gin(files: List[str], bindings: List[str], what: str):
  """The gin files and bindings parsed (not finalised) for the `with` body, then cleared;
  a missing file or a ValueError in parsing or in the body exits naming `what`."""
  gin.clear_config()
  for path in (str(pathlib.Path.cwd()), str(gin_utils.GIN_DIR)):
    gin.add_config_file_search_path(path)
  try:
    gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
    yield
  except (IOError, OSError) as e:
    sys.exit(f"error: gin file not found: {e}")
  except ValueError as e:
    sys.exit(f"error: the gin files {files} configure no {what}, or a binding is wrong: {e}")
  finally:
    gin.clear_config()


def gin_model_config(files: List[str], bindings: List[str], model: str):
  """The config that the gin files (and bindings) give `model` ('dodo' or 'squid')."""
  name = {"dodo": "Dodo", "squid": "Squid"}[model]
  with parsed_gin(files, bindings, f"{name} ({model}.{name}.config)"):
    reference = gin.query_parameter(f"decal_jax.networks.{model}.{name}.config")
    return reference.scoped_configurable_fn()


def gin_zero_id_to(files: List[str], bindings: List[str]) -> Optional[int]:
  """The gin VOCABULARY's zero_id_to: None unless it is an `HfTokenizerVocabulary` (built
  here, lazily: no file is read) with zero_id_to bound."""
  from decal_jax.data import hf_vocabularies
  with parsed_gin(files, bindings, "VOCABULARY"):
    try:
      reference = gin.query_parameter("%VOCABULARY")
    except ValueError:  # no VOCABULARY macro: nothing says token 0 moves
      return None
    configurable = getattr(reference, "configurable", None)
    if getattr(configurable, "wrapped", None) is not hf_vocabularies.HfTokenizerVocabulary:
      return None
    return reference.scoped_configurable_fn().zero_id_to


def resolve_zero_id_to(args) -> Optional[int]:
  """--zero_id_to, defaulting to (and for dodo / squid, required to equal) the gin
  VOCABULARY's zero_id_to: weights and vocabulary must move token 0 to the same id."""
  from decal_jax.data.hf_vocabularies import checked_zero_id_to
  if args.model == "decoder":
    return checked_zero_id_to(args.zero_id_to)
  files = args.gin_file or [DEFAULT_GIN[args.model]]
  from_gin = gin_zero_id_to(files, args.gin_bindings)
  if args.zero_id_to is not None and args.zero_id_to != from_gin:
    raise ValueError(f"--zero_id_to {args.zero_id_to} differs from the gin VOCABULARY's "
                     f"zero_id_to ({from_gin}; gin files {files}): the model would read '!' "
                     "at another id than the weights hold it. Drop --zero_id_to, or bind "
                     "VOCABULARY = @hf_vocabularies.HfTokenizerVocabulary() with "
                     f"hf_vocabularies.HfTokenizerVocabulary.zero_id_to = {args.zero_id_to}.")
  return checked_zero_id_to(from_gin)


# ------------------------------------------------------------------------------ writing
def check_out(out: pathlib.Path, overwrite: bool) -> None:
  if out.exists() and not out.is_dir():
    sys.exit(f"error: --out {out} is a file; give a directory.")
  if out.exists() and any(out.iterdir()) and not overwrite:
    held = ", ".join(sorted(p.name for p in out.iterdir())[:4])
    sys.exit(f"error: --out {out} already exists and is not empty ({held}); pass --overwrite "
             "to replace it, or choose another --out.")


def write_checkpoint(out: pathlib.Path, params, files: Dict[str, str],
                     write_more: Optional[Callable[[pathlib.Path], None]] = None) -> None:
  """checkpoint_0 + `files` ({name: text}) + what `write_more(folder)` writes, built in a
  temporary folder renamed to `out` (import_gguf writes its checkpoints this way too)."""
  from decal_jax.runtime import checkpoints
  with fileio.atomic_directory(out) as tmp:
    ckpt = checkpoints.Checkpointer(str(tmp), keep=1)
    ckpt.save(0, {"params": params}, {}, force=True)
    ckpt.close()
    if write_more is not None:
      write_more(tmp)
    for name, text in files.items():
      (tmp / name).write_text(text)


# ------------------------------------------------------------------------------ main
def report_lines(args, configs, report, notes, out: pathlib.Path, count: int,
                 zero_id_to: Optional[int] = None) -> List[str]:
  """What was written, the size bindings ({scope: DecoderConfig}) and the next command."""
  from decal_jax.interop import hf_params
  source = (f"{args.hf_dir} (small) + {args.large_hf_dir} (large)" if args.model == "squid"
            else args.hf_dir)
  fresh = {"dodo": " (scorer, soft prompt, LoRA).", "squid": " (memory tokens, projector"
           + (", LoRA)." if any("/lora_" in k for k in report["kept"]) else ").")}
  lines = [f"Imported {source} into {out}/checkpoint_0 ({args.model}, {count:,} "
           f"parameters): {len(report['copied'])} tensors from the checkpoint"
           f"{'s' if args.model == 'squid' else ''}, {len(report['kept'])} freshly initialised"
           + (fresh.get(args.model, ".") if report["kept"] else ".")]
  lines += [f"  note: {n}" for n in notes]
  lines += ["", f"Gin bindings for this checkpoint (also in {out / 'hf_import.gin'}; pass that "
            "file after the model gin file):"]
  lines += [f"  {b}" for scope, c in configs.items() for b in hf_params.size_bindings(c, scope)]
  lines += [f"  {b}" for b in hf_params.zero_id_binding(zero_id_to)]
  model_gin = " ".join(f"--gin_file={f}"
                       for f in (args.gin_file or [DEFAULT_GIN.get(args.model, "")]))
  if args.model == "dodo":
    tokenizer = pathlib.Path(args.hf_dir).absolute() / "tokenizer.model"
    vocab = (f" --gin.LLAMA_TOKENIZER=\"'{tokenizer}'\"" if tokenizer.exists() else "")
    lines += ["", "Start a fine-tuning run from it:",
              f"  python -m decal_jax.train {model_gin} --gin_file={out / 'hf_import.gin'} "
              f"--gin_file=runs/finetune.gin --gin.INITIAL_CHECKPOINT_PATH=\"'{out}'\""
              f"{vocab} --gin.MODEL_DIR=... --gin.MIXTURE_OR_TASK_NAME=... "
              "--gin.TASK_FEATURE_LENGTHS=... --gin.TRAIN_STEPS=..."]
  if args.model == "squid":
    tokenizer = pathlib.Path(args.hf_dir).absolute() / "tokenizer.json"
    vocab = (f" --gin.QWEN2_TOKENIZER=\"'{tokenizer}'\"" if tokenizer.exists() else "")
    lines += ["", "Start Squid's stage 1 (restoration) from it:",
              f"  python -m decal_jax.train {model_gin} --gin_file={out / 'hf_import.gin'} "
              f"--gin_file=runs/squid_restore.gin --gin.INITIAL_CHECKPOINT_PATH=\"'{out}'\""
              f"{vocab} --gin.MODEL_DIR=..."]
  return lines


def run_import(args, hf_dir: pathlib.Path, zero_id_to: Optional[int]) -> "hf_params.Imported":
  """The import --model asks for, its model configured by the gin files."""
  from decal_jax.interop import hf_params
  overrides = {} if args.max_length is None else {"max_length": args.max_length}
  if args.model == "decoder":
    return hf_params.import_decoder(hf_dir, overrides, zero_id_to)
  files = args.gin_file or [DEFAULT_GIN[args.model]]
  gin_config = gin_model_config(files, args.gin_bindings, args.model)
  if args.model == "dodo":
    return hf_params.import_dodo(hf_dir, gin_config, args.seed, overrides, zero_id_to)
  return hf_params.import_squid(hf_dir, pathlib.Path(args.large_hf_dir).absolute(),
                                gin_config, args.seed, overrides, zero_id_to)


def manifest(args, hf_dir: pathlib.Path, imported: "hf_params.Imported",
             zero_id_to: Optional[int]) -> Dict:
  """hf_import.json: where the checkpoint came from and how it was built."""
  if args.model == "squid":
    sources = {"large_hf_dir": str(pathlib.Path(args.large_hf_dir).absolute()),
               "hf_config": imported.hf_configs["small"],
               "large_hf_config": imported.hf_configs["large"]}
  else:
    sources = {"hf_config": imported.hf_configs[None]}
  return {"hf_dir": str(hf_dir), "model": args.model, "gin_files": args.gin_file,
          "gin_bindings": args.gin_bindings, "seed": args.seed, "zero_id_to": zero_id_to,
          **sources, "copied": len(imported.report["copied"]), "kept": imported.report["kept"]}


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)  # before JAX / TensorFlow load
  import jax
  from decal_jax.interop import hf_params
  hf_dir, out = pathlib.Path(args.hf_dir).absolute(), pathlib.Path(args.out).absolute()
  check_out(out, args.overwrite)
  try:
    zero_id_to = resolve_zero_id_to(args)
    imported = run_import(args, hf_dir, zero_id_to)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  source = (f"{hf_dir} (small) and {pathlib.Path(args.large_hf_dir).absolute()} (large)"
            if args.model == "squid" else str(hf_dir))
  gin_text = hf_params.size_gin_file(imported.configs, source, args.gin_bindings, zero_id_to)
  write_checkpoint(out, imported.params, {
      "hf_import.gin": gin_text,
      "hf_import.json": json.dumps(manifest(args, hf_dir, imported, zero_id_to), indent=2) + "\n"})
  count = sum(int(x.size) for x in jax.tree_util.tree_leaves(imported.params))
  notes = imported.notes
  if zero_id_to is not None:
    notes = notes + [f"token 0 moved to id {zero_id_to} in every embedding table (and untied "
                     "head); row 0 is zeros. Train with a vocabulary of the same zero_id_to."]
  print("\n".join(report_lines(args, imported.configs, imported.report, notes, out, count,
                               zero_id_to)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
