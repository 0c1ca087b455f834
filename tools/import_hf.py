# python tools/import_hf.py --hf_dir /ckpt/Llama-2-7b-hf --out /ckpt/dodo_llama2_7b \
#     --gin_file=models/dodo_llama2_7b.gin
# python tools/import_hf.py --hf_dir /ckpt/Qwen2-0.5B --out /ckpt/qwen2_05b --model decoder
# python tools/import_hf.py --model squid --hf_dir /ckpt/Qwen2-0.5B \
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
`hf_import.tokenizer_vocabulary(..., zero_id_to=R)`, so for --model dodo / squid it
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

Memory: a 7B model needs about 2 x 27 GB of host memory (float32 checkpoint + fresh Dodo);
Squid on Qwen2-0.5B + 7B about 2 x 32 GB.
"""
import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import flax  # noqa: E402
import gin  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from decal_jax import checkpoints, gin_utils, hf_import  # noqa: E402
from decal_jax.networks import decoder, dodo, squid  # noqa: E402

SIZE_FIELDS = ("vocab_size", "emb_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
               "num_layers", "rope_theta", "norm_epsilon", "qkv_bias", "tie_embeddings",
               "max_length")
DEFAULT_DODO_GIN = "models/dodo.gin"
DEFAULT_SQUID_GIN = "models/squid_qwen2.gin"
DEFAULT_GIN = {"dodo": DEFAULT_DODO_GIN, "squid": DEFAULT_SQUID_GIN}
SQUID_DECODERS = (("small", "small_decoder"), ("large", "large_decoder"))  # scope, params


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
                      "gin VOCABULARY's hf_import.tokenizer_vocabulary.zero_id_to; --model "
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
  for path in (str(pathlib.Path.cwd()), str(gin_utils.REPO_GIN_DIR)):
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
  """The gin VOCABULARY's zero_id_to: None unless it is `hf_import.tokenizer_vocabulary`
  (built here, lazily: no file is read) with zero_id_to bound."""
  with parsed_gin(files, bindings, "VOCABULARY"):
    try:
      reference = gin.query_parameter("%VOCABULARY")
    except ValueError:  # no VOCABULARY macro: nothing says token 0 moves
      return None
    configurable = getattr(reference, "configurable", None)
    if getattr(configurable, "wrapped", None) is not hf_import.tokenizer_vocabulary:
      return None
    return reference.scoped_configurable_fn().zero_id_to


def resolve_zero_id_to(args) -> Optional[int]:
  """--zero_id_to, defaulting to (and for dodo / squid, required to equal) the gin
  VOCABULARY's zero_id_to: weights and vocabulary must move token 0 to the same id."""
  if args.model == "decoder":
    return hf_import.checked_zero_id_to(args.zero_id_to)
  files = args.gin_file or [DEFAULT_GIN[args.model]]
  from_gin = gin_zero_id_to(files, args.gin_bindings)
  if args.zero_id_to is not None and args.zero_id_to != from_gin:
    raise ValueError(f"--zero_id_to {args.zero_id_to} differs from the gin VOCABULARY's "
                     f"zero_id_to ({from_gin}; gin files {files}): the model would read '!' "
                     "at another id than the weights hold it. Drop --zero_id_to, or bind "
                     f"VOCABULARY = @hf_import.tokenizer_vocabulary() with "
                     f"hf_import.tokenizer_vocabulary.zero_id_to = {args.zero_id_to}.")
  return hf_import.checked_zero_id_to(from_gin)


def gin_dodo_config(files: List[str], bindings: List[str]) -> dodo.DodoConfig:
  """The DodoConfig that the gin files (and bindings) configure."""
  return gin_model_config(files, bindings, "dodo")


def with_sizes(gin_decoder: decoder.DecoderConfig, hf_config: decoder.DecoderConfig,
               scope: Optional[str] = None) -> Tuple[decoder.DecoderConfig, List[str]]:
  """A gin DecoderConfig with the checkpoint's sizes, and a note for each size gin differs on."""
  sizes = {f: getattr(hf_config, f) for f in SIZE_FIELDS}
  prefix = f"{scope}/" if scope else ""
  notes = [f"gin binds {prefix}DecoderConfig.{f} = {getattr(gin_decoder, f)!r}; the "
           f"checkpoint has {v!r} (used)" for f, v in sizes.items()
           if getattr(gin_decoder, f) != v]
  return dataclasses.replace(gin_decoder, **sizes), notes


def with_checkpoint_sizes(gin_config: dodo.DodoConfig, hf_config: decoder.DecoderConfig
                          ) -> Tuple[dodo.DodoConfig, List[str]]:
  """The gin DodoConfig with the checkpoint's sizes, and a note for each size gin differs on."""
  config, notes = with_sizes(gin_config.decoder, hf_config)
  return dataclasses.replace(gin_config, decoder=config), notes


def squid_with_checkpoint_sizes(gin_config: squid.SquidConfig,
                                hf_configs: Dict[str, decoder.DecoderConfig]
                                ) -> Tuple[squid.SquidConfig, List[str]]:
  """The gin SquidConfig with each decoder's checkpoint sizes ({'small': .., 'large': ..})."""
  changes, notes = {}, []
  for scope in ("small", "large"):
    changes[scope], more = with_sizes(getattr(gin_config, scope), hf_configs[scope], scope)
    notes += more
  try:
    return dataclasses.replace(gin_config, **changes), notes
  except ValueError as e:  # e.g. projector_input_dim declared for other decoders
    sys.exit(f"error: the checkpoints' sizes do not fit the gin SquidConfig: {e}")


def size_bindings(config: decoder.DecoderConfig, scope: Optional[str] = None) -> List[str]:
  prefix = f"{scope}/" if scope else ""
  return [f"{prefix}decoder.DecoderConfig.{f} = {getattr(config, f)!r}" for f in SIZE_FIELDS]


def zero_id_binding(zero_id_to: Optional[int]) -> List[str]:
  """The vocabulary binding that matches a remapped checkpoint (none when not remapped)."""
  if zero_id_to is None:
    return []
  return [f"hf_import.tokenizer_vocabulary.zero_id_to = {zero_id_to}"]


def size_gin_file(configs: Dict[Optional[str], decoder.DecoderConfig], source: str,
                  bindings: List[str], zero_id_to: Optional[int] = None) -> str:
  """The checkpoints' sizes ({scope: config}; scope None for Dodo / Decoder), the
  vocabulary's zero_id_to when token 0 was remapped, then the --gin_bindings the import's
  model was built with."""
  extra = ["", "# --gin_bindings given to tools/import_hf.py", *bindings] if bindings else []
  sizes = [line for scope, config in configs.items() for line in size_bindings(config, scope)]
  remap = (["", f"# Token 0 ('!' in Qwen2) was moved to id {zero_id_to}: the vocabulary must "
            "say so.", *zero_id_binding(zero_id_to)] if zero_id_to is not None else [])
  example = "squid_qwen2.gin" if None not in configs else "dodo_llama2_7b.gin"
  imports = (["from decal_jax import hf_import"] if zero_id_to is not None else [])
  return "\n".join([f"# Written by tools/import_hf.py: the DecoderConfig sizes of {source}.",
                    f"# Pass it after the model gin file (e.g. models/{example}).",
                    "from __gin__ import dynamic_registration", "",
                    *imports, "from decal_jax.networks import decoder", "",
                    *sizes, *remap, *extra, ""])


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


def fresh_squid_params(config: squid.SquidConfig, seed: int):
  """A Squid's params as the trainer initialises them (SquidModel's dummy call)."""
  module = squid.Squid(config)
  tokens = jnp.ones((1, 8), jnp.int32)
  init = jax.jit(lambda rng: module.init(rng, tokens, tokens, tokens, query_tokens=tokens,
                                         enable_dropout=False)["params"])
  return init(jax.random.PRNGKey(seed))


def merge_into(params, name: str, base) -> Tuple[Dict, Dict[str, List[str]]]:
  """`base` ({'stack': decoder tree}) copied into the DecoderStack `params[name]` with
  `hf_import.merge_base_params`; the report's paths name `name` instead of 'stack'."""
  params = flax.core.unfreeze(params)
  merged, report = hf_import.merge_base_params({"stack": params[name]}, base)
  params[name] = merged["stack"]
  return params, {key: [name + path[len("stack"):] for path in paths]
                  for key, paths in report.items()}


def build_params(args, hf_config: decoder.DecoderConfig, base):
  """(params to save, their DecoderConfig, merge report, notes)."""
  if args.model == "decoder":
    return base, hf_config, {"copied": sorted(_paths(base)), "kept": []}, []
  gin_config = gin_dodo_config(args.gin_file or [DEFAULT_DODO_GIN], args.gin_bindings)
  config, notes = with_checkpoint_sizes(gin_config, hf_config)
  params, report = hf_import.merge_base_params(fresh_dodo_params(config, args.seed), base)
  return params, config.decoder, report, notes


def build_squid_params(args, hf_configs: Dict[str, decoder.DecoderConfig], bases):
  """(params to save, SquidConfig, merge report, notes): `small_decoder` <- bases['small'],
  `large_decoder` <- bases['large']; memory tokens and projector keep their init."""
  gin_config = gin_model_config(args.gin_file or [DEFAULT_SQUID_GIN], args.gin_bindings,
                                "squid")
  config, notes = squid_with_checkpoint_sizes(gin_config, hf_configs)
  params, copied = fresh_squid_params(config, args.seed), []
  for scope, name in SQUID_DECODERS:
    params, report = merge_into(params, name, bases[scope])
    copied += report["copied"]
  kept = sorted(set(_paths(params)) - set(copied))
  return params, config, {"copied": sorted(copied), "kept": kept}, notes


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
def report_lines(args, configs, report, notes, out: pathlib.Path, count: int,
                 zero_id_to: Optional[int] = None) -> List[str]:
  """What was written, the size bindings ({scope: DecoderConfig}) and the next command."""
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
  lines += [f"  {b}" for scope, c in configs.items() for b in size_bindings(c, scope)]
  lines += [f"  {b}" for b in zero_id_binding(zero_id_to)]
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


def check_same_tokenizer(small_dir: pathlib.Path, large_dir: pathlib.Path) -> None:
  """Squid feeds one token sequence to both decoders: their tokenizers must agree."""
  paths = [d / "tokenizer.json" for d in (small_dir, large_dir)]
  if not all(p.exists() for p in paths):
    return
  def vocab(path):
    data = json.loads(path.read_text())
    added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    return dict(data.get("model", {}).get("vocab") or {}, **added)
  small, large = (vocab(p) for p in paths)
  if small != large:
    differ = sorted(set(small.items()) ^ set(large.items()), key=str)[:4]
    raise ValueError(f"{paths[0]} and {paths[1]} map tokens to different ids (e.g. "
                     f"{differ}): Squid gives both decoders the same ids. Pair checkpoints "
                     "of one tokenizer family (Qwen2-0.5B with Qwen2-7B).")


def check_zero_id_to(hf_dir: pathlib.Path, config: decoder.DecoderConfig,
                     zero_id_to: Optional[int]) -> None:
  """Before any weight is read: R is a row of the checkpoint's table and no token of the
  tokenizer.json beside it (if there is one)."""
  if zero_id_to is None:
    return
  hf_import.check_zero_id_in_table(zero_id_to, config.vocab_size,
                                   f"the embedding table of {hf_dir}")
  tokenizer = hf_dir / "tokenizer.json"
  if tokenizer.exists():
    _ = hf_import.tokenizer_vocabulary(str(tokenizer), zero_id_to=zero_id_to).vocab_size


def read_checkpoint_config(hf_dir: pathlib.Path, overrides, zero_id_to: Optional[int] = None
                           ) -> Tuple[Dict, decoder.DecoderConfig]:
  """(config.json, its DecoderConfig) of one checkpoint, zero_id_to checked against it."""
  hf = hf_import.read_hf_config(hf_dir)
  hf_config = hf_import.config_from_hf(hf, **overrides)
  check_zero_id_to(hf_dir, hf_config, zero_id_to)
  return hf, hf_config


def load_weights(hf_dir: pathlib.Path, hf_config: decoder.DecoderConfig,
                 zero_id_to: Optional[int] = None) -> Dict:
  """Float32 {'stack': params} of one checkpoint, token 0 moved to zero_id_to if given."""
  _, base = hf_import.load_hf_params(hf_dir, hf_config, progress=True)
  if zero_id_to is not None:
    base = hf_import.remap_zero_row(base, zero_id_to)
  return base


def load_checkpoint(hf_dir: pathlib.Path, overrides, zero_id_to: Optional[int] = None
                    ) -> Tuple[Dict, decoder.DecoderConfig, Dict]:
  """(config.json, its DecoderConfig, float32 {'stack': params}) of one checkpoint."""
  hf, hf_config = read_checkpoint_config(hf_dir, overrides, zero_id_to)
  return hf, hf_config, load_weights(hf_dir, hf_config, zero_id_to)


def import_squid(args, hf_dir: pathlib.Path, overrides, zero_id_to: Optional[int] = None):
  """(params, {scope: DecoderConfig}, report, notes, manifest extras) for --model squid;
  with zero_id_to, token 0 of both decoders moves there (checked on both before loading)."""
  large_dir = pathlib.Path(args.large_hf_dir).absolute()
  check_same_tokenizer(hf_dir, large_dir)
  dirs = {"small": hf_dir, "large": large_dir}
  hf, hf_configs = {}, {}
  for scope, directory in dirs.items():
    hf[scope], hf_configs[scope] = read_checkpoint_config(directory, overrides, zero_id_to)
  bases = {scope: load_weights(dirs[scope], hf_configs[scope], zero_id_to) for scope in dirs}
  params, config, report, notes = build_squid_params(args, hf_configs, bases)
  extras = {"large_hf_dir": str(large_dir), "hf_config": hf["small"],
            "large_hf_config": hf["large"]}
  return params, {"small": config.small, "large": config.large}, report, notes, extras


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  hf_dir, out = pathlib.Path(args.hf_dir).absolute(), pathlib.Path(args.out).absolute()
  check_out(out, args.overwrite)
  overrides = {} if args.max_length is None else {"max_length": args.max_length}
  try:
    zero_id_to = resolve_zero_id_to(args)
    if args.model == "squid":
      params, configs, report, notes, extras = import_squid(args, hf_dir, overrides,
                                                            zero_id_to)
      source = f"{hf_dir} (small) and {extras['large_hf_dir']} (large)"
    else:
      hf, hf_config, base = load_checkpoint(hf_dir, overrides, zero_id_to)
      params, config, report, notes = build_params(args, hf_config, base)
      del base
      configs, extras, source = {None: config}, {"hf_config": hf}, str(hf_dir)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  manifest = {"hf_dir": str(hf_dir), "model": args.model, "gin_files": args.gin_file,
              "gin_bindings": args.gin_bindings, "seed": args.seed,
              "zero_id_to": zero_id_to, **extras,
              "copied": len(report["copied"]), "kept": report["kept"]}
  write_atomically(out, params, {"hf_import.gin": size_gin_file(configs, source,
                                                                args.gin_bindings, zero_id_to),
                                 "hf_import.json": json.dumps(manifest, indent=2) + "\n"})
  count = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
  if zero_id_to is not None:
    notes = notes + [f"token 0 moved to id {zero_id_to} in every embedding table (and untied "
                     "head); row 0 is zeros. Train with a vocabulary of the same zero_id_to."]
  print("\n".join(report_lines(args, configs, report, notes, out, count, zero_id_to)),
        flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
