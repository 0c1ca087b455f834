# python tools/import_hf.py --hf_dir /ckpt/Llama-2-7b-hf --out /ckpt/dodo_llama2_7b \
#     --gin_file=models/dodo_llama2_7b.gin
# python tools/import_hf.py --hf_dir /ckpt/Qwen2-0.5B --out /ckpt/qwen2_05b --model decoder
"""Writes a Hugging Face LLaMA / Qwen2 / Mistral checkpoint as an Orbax checkpoint to start
training from (`INITIAL_CHECKPOINT_PATH`, gin/runs/finetune.gin).

--model dodo (default): the params of the Dodo that the gin files configure (default
models/dodo.gin: LoRA rank 32, scorer layer 3, soft prompt), with the checkpoint's sizes:
its decoder stack comes from the checkpoint, the scorer, soft prompt and LoRA adapters are
freshly initialised (--seed). --model decoder: the plain `Decoder` params.

--out receives `checkpoint_0` (params only: start runs from it, do not resume in it),
`hf_import.gin` (the checkpoint's DecoderConfig sizes, to pass after the model gin file)
and `hf_import.json` (where it came from). Everything is written to a temporary folder
beside --out and renamed into place when complete, so --out is never half-written; an
existing --out is refused unless --overwrite. The gin bindings and the command that starts
a fine-tuning run from the result are printed at the end.

Memory: a 7B model needs about 2 x 27 GB of host memory (float32 checkpoint + fresh Dodo).
"""
import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile
from typing import Dict, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import flax  # noqa: E402
import gin  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from decal_jax import checkpoints, gin_utils, hf_import  # noqa: E402
from decal_jax.networks import decoder, dodo  # noqa: E402

SIZE_FIELDS = ("vocab_size", "emb_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
               "num_layers", "rope_theta", "norm_epsilon", "qkv_bias", "tie_embeddings",
               "max_length")
DEFAULT_DODO_GIN = "models/dodo.gin"


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hf_dir", required=True, help="config.json + *.safetensors")
  parser.add_argument("--out", required=True, help="the new checkpoint's directory")
  parser.add_argument("--model", choices=("dodo", "decoder"), default="dodo")
  parser.add_argument("--gin_file", action="append", default=[],
                      help=f"Dodo options (--model dodo); default {DEFAULT_DODO_GIN}")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="extra gin bindings, e.g. 'LORA_RANK = 8'")
  parser.add_argument("--max_length", type=int, default=None,
                      help="positions the model accepts (default: max_position_embeddings)")
  parser.add_argument("--seed", type=int, default=0, help="init of the non-imported params")
  parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
  args = parser.parse_args(argv)
  if args.model == "decoder" and (args.gin_file or args.gin_bindings):
    parser.error("--gin_file / --gin_bindings configure Dodo; --model decoder takes none.")
  return args


# ------------------------------------------------------------------------------ configs
def gin_dodo_config(files: List[str], bindings: List[str]) -> dodo.DodoConfig:
  """The DodoConfig that the gin files (and bindings) configure."""
  gin.clear_config()
  for path in (str(pathlib.Path.cwd()), str(gin_utils.REPO_GIN_DIR)):
    gin.add_config_file_search_path(path)
  try:
    gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
    reference = gin.query_parameter("decal_jax.networks.dodo.Dodo.config")
    return reference.scoped_configurable_fn()
  except (IOError, OSError) as e:
    sys.exit(f"error: gin file not found: {e}")
  except ValueError as e:
    sys.exit(f"error: the gin files {files} configure no Dodo (dodo.Dodo.config), or a "
             f"binding is wrong: {e}")
  finally:
    gin.clear_config()


def with_checkpoint_sizes(gin_config: dodo.DodoConfig, hf_config: decoder.DecoderConfig
                          ) -> Tuple[dodo.DodoConfig, List[str]]:
  """The gin DodoConfig with the checkpoint's sizes, and a note for each size gin differs on."""
  sizes = {f: getattr(hf_config, f) for f in SIZE_FIELDS}
  notes = [f"gin binds DecoderConfig.{f} = {getattr(gin_config.decoder, f)!r}; the checkpoint "
           f"has {v!r} (used)" for f, v in sizes.items() if getattr(gin_config.decoder, f) != v]
  return dataclasses.replace(gin_config,
                             decoder=dataclasses.replace(gin_config.decoder, **sizes)), notes


def size_bindings(config: decoder.DecoderConfig) -> List[str]:
  return [f"decoder.DecoderConfig.{f} = {getattr(config, f)!r}" for f in SIZE_FIELDS]


def size_gin_file(config: decoder.DecoderConfig, hf_dir: pathlib.Path,
                  bindings: List[str]) -> str:
  """The checkpoint's sizes, then the --gin_bindings the import's Dodo was built with."""
  extra = ["", "# --gin_bindings given to tools/import_hf.py", *bindings] if bindings else []
  return "\n".join([f"# Written by tools/import_hf.py from {hf_dir}: the checkpoint's sizes.",
                    "# Pass it after the model gin file (e.g. models/dodo_llama2_7b.gin).",
                    "from __gin__ import dynamic_registration", "",
                    "from decal_jax.networks import decoder", "",
                    *size_bindings(config), *extra, ""])


# ------------------------------------------------------------------------------ params
def fresh_dodo_params(config: dodo.DodoConfig, seed: int):
  """A Dodo's params as the trainer initialises them (EncoderDecoderModel's dummy call)."""
  module = dodo.Dodo(config)
  tokens = jnp.ones((1, 8), jnp.int32)
  init = jax.jit(lambda rng: module.init(rng, encoder_input_tokens=tokens,
                                         decoder_input_tokens=tokens,
                                         decoder_target_tokens=tokens, decode=False,
                                         enable_dropout=False)["params"])
  return init(jax.random.PRNGKey(seed))


def build_params(args, hf_config: decoder.DecoderConfig, base):
  """(params to save, their DecoderConfig, merge report, notes)."""
  if args.model == "decoder":
    return base, hf_config, {"copied": sorted(_paths(base)), "kept": []}, []
  gin_config = gin_dodo_config(args.gin_file or [DEFAULT_DODO_GIN], args.gin_bindings)
  config, notes = with_checkpoint_sizes(gin_config, hf_config)
  params, report = hf_import.merge_base_params(fresh_dodo_params(config, args.seed), base)
  return params, config.decoder, report, notes


def _paths(tree) -> List[str]:
  return list(flax.traverse_util.flatten_dict(tree, sep="/"))


# ------------------------------------------------------------------------------ writing
def check_out(out: pathlib.Path, overwrite: bool) -> None:
  if out.exists() and not out.is_dir():
    sys.exit(f"error: --out {out} is a file; give a directory.")
  if out.exists() and any(out.iterdir()) and not overwrite:
    held = ", ".join(sorted(p.name for p in out.iterdir())[:4])
    sys.exit(f"error: --out {out} already exists and is not empty ({held}); pass --overwrite "
             "to replace it, or choose another --out.")


def write_atomically(out: pathlib.Path, params, files: Dict[str, str]) -> None:
  """checkpoint_0 + `files` in a temp folder beside `out`, then renamed to `out`."""
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
  try:
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
    ckpt = checkpoints.Checkpointer(str(tmp), keep=1)
    ckpt.save(0, {"params": params}, {}, force=True)
    ckpt.close()
    for name, text in files.items():
      (tmp / name).write_text(text)
    _replace(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _replace(new: pathlib.Path, out: pathlib.Path) -> None:
  if not out.exists():
    new.rename(out)
    return
  old = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
  old.rmdir()
  out.rename(old)
  new.rename(out)
  shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------ main
def report_lines(args, config, report, notes, out: pathlib.Path, count: int) -> List[str]:
  lines = [f"Imported {args.hf_dir} into {out}/checkpoint_0 ({args.model}, {count:,} "
           f"parameters): {len(report['copied'])} tensors from the checkpoint, "
           f"{len(report['kept'])} freshly initialised"
           + (" (scorer, soft prompt, LoRA)." if report["kept"] else ".")]
  lines += [f"  note: {n}" for n in notes]
  lines += ["", f"Gin bindings for this checkpoint (also in {out / 'hf_import.gin'}; pass that "
            "file after the model gin file):"]
  lines += [f"  {b}" for b in size_bindings(config)]
  tokenizer = pathlib.Path(args.hf_dir).absolute() / "tokenizer.model"
  if args.model == "dodo":
    model_gin = " ".join(f"--gin_file={f}" for f in (args.gin_file or [DEFAULT_DODO_GIN]))
    vocab = (f" --gin.LLAMA_TOKENIZER=\"'{tokenizer}'\"" if tokenizer.exists() else "")
    lines += ["", "Start a fine-tuning run from it:",
              f"  python -m decal_jax.train {model_gin} --gin_file={out / 'hf_import.gin'} "
              f"--gin_file=runs/finetune.gin --gin.INITIAL_CHECKPOINT_PATH=\"'{out}'\""
              f"{vocab} --gin.MODEL_DIR=... --gin.MIXTURE_OR_TASK_NAME=... "
              "--gin.TASK_FEATURE_LENGTHS=... --gin.TRAIN_STEPS=..."]
  return lines


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  hf_dir, out = pathlib.Path(args.hf_dir).absolute(), pathlib.Path(args.out).absolute()
  check_out(out, args.overwrite)
  overrides = {} if args.max_length is None else {"max_length": args.max_length}
  try:
    hf = hf_import.read_hf_config(hf_dir)
    hf_config = hf_import.config_from_hf(hf, **overrides)
    _, base = hf_import.load_hf_params(hf_dir, hf_config, progress=True)
    params, config, report, notes = build_params(args, hf_config, base)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  del base
  manifest = {"hf_dir": str(hf_dir), "model": args.model, "gin_files": args.gin_file,
              "gin_bindings": args.gin_bindings, "seed": args.seed, "hf_config": hf,
              "copied": len(report["copied"]), "kept": report["kept"]}
  write_atomically(out, params, {"hf_import.gin": size_gin_file(config, hf_dir, args.gin_bindings),
                                 "hf_import.json": json.dumps(manifest, indent=2) + "\n"})
  count = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
  print("\n".join(report_lines(args, config, report, notes, out, count)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
