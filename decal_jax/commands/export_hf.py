# python -m decal_jax.commands.export_hf --checkpoint runs/decoder_tiny --out /ckpt/decoder_tiny_hf
# python -m decal_jax.commands.export_hf --checkpoint /ckpt/dodo_run/checkpoint_2000 \
#     --gin_file=models/dodo_llama2_7b.gin --out /ckpt/dodo_hf --format llama
# python -m decal_jax.commands.export_hf --checkpoint runs/decal_tiny --out /ckpt/decal_st --format decal
"""Writes the params of a decal_jax checkpoint as a Hugging Face checkpoint folder
(model.safetensors + config.json, float32) that transformers' own classes load.

--checkpoint: a MODEL_DIR (its latest checkpoint) or one of its checkpoint_<step> folders.
--gin_file / --gin_bindings: the run's model (default: the MODEL_DIR's config.gin).
--format: llama / qwen2 (a plain decoder, or Dodo's decoder with its --adapter LoRA merged
into the base kernels; qwen2 when the decoder has q/k/v biases) as LlamaForCausalLM /
Qwen2ForCausalLM; t5 (T5.1.1 at compression ratio 1) as T5ForConditionalGeneration; squid
(Squid: small/ and large/, each decoder a LlamaForCausalLM / Qwen2ForCausalLM folder, plus
squid_joint.safetensors with the memory tokens and projector and squid.json; read back by
`hf_export.load_squid_bundle`); decal (any model: the decal_jax safetensors layout, a tensor per '/'-named parameter and the gin
text in the metadata, read back by `hf_export.load_safetensors_params`). auto (default):
the transformers class that computes the model, else decal. A compressive T5 (DeCAL, C > 1)
has no transformers class: --format t5 refuses it.

A Hugging Face tokenizer.json vocabulary (HfTokenizerVocabulary) is copied beside the
weights with a tokenizer_config.json, its token 0 moved back if the import had moved it;
for any other vocabulary README.md names the one whose ids the model uses. The folder is
written whole or not at all; an existing --out is refused unless --overwrite. The library
side is `decal_jax.interop.hf_export`.
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FORMATS = ("auto", "llama", "qwen2", "t5", "squid", "decal")


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--checkpoint", required=True,
                      help="a decal_jax MODEL_DIR or one of its checkpoint_<step> folders")
  parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
  parser.add_argument("--gin_file", action="append", default=[],
                      help="the run's model gin files (default: MODEL_DIR/config.gin)")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="extra gin bindings, e.g. 'LORA_RANK = 8'")
  parser.add_argument("--format", choices=FORMATS, default="auto")
  parser.add_argument("--adapter", default="decode",
                      help="Dodo: the LoRA adapter merged into the base ('none': the base "
                      "alone); ignored without LoRA params")
  parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
  return parser.parse_args(argv)


# ------------------------------------------------------------------------------ gin
def model_dir_of(checkpoint: str) -> pathlib.Path:
  path = pathlib.Path(checkpoint).expanduser().absolute()
  return path.parent if re.fullmatch(r"checkpoint_\d+", path.name) else path


def gin_files(args) -> list:
  if args.gin_file:
    return args.gin_file
  saved = model_dir_of(args.checkpoint) / "config.gin"
  if not saved.exists():
    sys.exit(f"error: no --gin_file given and no {saved}: pass the run's model gin files.")
  return [str(saved)]


def read_model(files, bindings):
  """(network class, its config or None, the VOCABULARY object or None, gin text) from the
  gin files: MODEL's module and that module's config, built (no file is read)."""
  import gin
  from decal_jax.commands.import_hf import parsed_gin
  with parsed_gin(files, bindings, "MODEL with a module"):
    model = gin.query_parameter("%MODEL").configurable.selector
    module = gin.query_parameter(f"{model}.module").configurable
    try:
      config = gin.query_parameter(f"{module.selector}.config").scoped_configurable_fn()
    except (ValueError, TypeError):  # a network configured otherwise (no .config)
      config = None
    try:
      vocabulary = gin.query_parameter("%VOCABULARY").scoped_configurable_fn()
    except (ValueError, TypeError):
      vocabulary = None
    text = gin.config_str()
  header = [f"# decal_jax gin files: {files}", *(f"# binding: {b}" for b in bindings)]
  return module.wrapped, config, vocabulary, "\n".join(header) + "\n" + text


# ------------------------------------------------------------------------------ formats
def choose_format(requested: str, network, config) -> str:
  from decal_jax.networks import decoder, dodo, squid, t5
  from decal_jax.interop import hf_export
  if requested == "decal":
    return requested
  if network is squid.Squid and requested in ("auto", "squid"):
    return "squid"
  if network in (decoder.Decoder, dodo.Dodo):
    base = config.decoder if network is dodo.Dodo else config
    if requested == "auto":
      return hf_export.decoder_family(base)
    if requested in hf_export.FAMILIES:
      hf_export.decoder_family(base, requested)
      return requested
  if network is t5.Transformer:
    if requested == "auto" and config.compression_ratio != 1:
      return "decal"
    if requested in ("auto", "t5"):
      hf_export.check_t5_exportable(config)
      return "t5"
  if requested == "auto":
    return "decal"
  raise ValueError(f"--format {requested} does not fit the model {network.__name__}: use "
                   "--format decal (the decal_jax safetensors layout) or auto.")


def vocabulary_files(vocabulary, tmp: pathlib.Path):
  """(zero_id_to, special ids, README line): copies a tokenizer.json vocabulary's files."""
  from decal_jax.data import hf_vocabularies
  if not isinstance(vocabulary, hf_vocabularies.HfTokenizerVocabulary):
    name = type(vocabulary).__name__ if vocabulary is not None else "unknown (no VOCABULARY)"
    return None, {"pad_token_id": 0}, (
        f"Token ids are those of the run's vocabulary, {name} (gin VOCABULARY), which is no "
        "Hugging Face tokenizer.json: tokenize with it (decal_jax.data) and pass the ids.")
  source = pathlib.Path(vocabulary._path)
  shutil.copy(source, tmp / "tokenizer.json")
  beside = source.parent / "tokenizer_config.json"
  settings = json.loads(beside.read_text()) if beside.exists() else {}
  settings = {k: (v["content"] if k.endswith("_token") and isinstance(v, dict) else v)
              for k, v in settings.items()}  # transformers 5 takes special tokens as text
  settings.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
  (tmp / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
  zero_id_to = vocabulary.zero_id_to
  try:
    eos = vocabulary.eos_id
    eos = 0 if zero_id_to is not None and eos == zero_id_to else eos
  except ValueError:
    eos = None
  special = {"eos_token_id": eos} if zero_id_to is not None else {"eos_token_id": eos,
                                                                  "pad_token_id": 0}
  moved = (f" Token 0 was at id {zero_id_to} in training; it is back at 0 here."
           if zero_id_to is not None else "")
  return zero_id_to, special, (f"tokenizer.json is the run's vocabulary ({source}).{moved}")


def export(fmt: str, network, config, vocabulary, flat, gin_text, adapter, tmp) -> str:
  """Writes `fmt` into `tmp`; returns the README's text."""
  from decal_jax.interop import hf_export
  from decal_jax.networks import dodo
  if fmt == "decal":
    hf_export.save_safetensors_params(flat, tmp / "model.safetensors", gin_text)
    (tmp / "decal_config.gin").write_text(gin_text)
    return ("decal_jax safetensors layout (no transformers class holds this model): load "
            "with `params, gin_text = decal_jax.interop.hf_export.load_safetensors_params("
            "'model.safetensors')`.")
  zero_id_to, special, vocab_line = vocabulary_files(vocabulary, tmp)
  if fmt == "squid":
    manifest = hf_export.export_squid(flat, config, tmp, None, zero_id_to, special)
    return (f"Squid bundle: small/ ({manifest['decoders']['small']}) and large/ "
            f"({manifest['decoders']['large']}) load in transformers alone; "
            f"{hf_export.SQUID_JOINT} holds the memory tokens and projector (decal_jax layout) "
            "and squid.json the settings that join them: load the whole with "
            "`decal_jax.interop.hf_export.load_squid_bundle(folder, squid_config)`. "
            f"{vocab_line}")
  if fmt == "t5":
    hf_export.export_t5(flat, config, tmp, {k: v for k, v in special.items() if v is not None})
    return f"T5ForConditionalGeneration (T5.1.1, gated-gelu). {vocab_line}"
  base = config.decoder if network is dodo.Dodo else config
  has_lora = any("/lora_" in k for k in flat)
  merged = adapter if has_lora and adapter != "none" else None
  hf_export.export_decoder(flat, base, tmp, fmt, merged, zero_id_to, special)
  what = f" with LoRA adapter {merged!r} merged into the base kernels" if merged else ""
  dropped = (" Dodo's scorer, soft prompt and other adapters are not part of it (export "
             "--format decal for the whole model)." if network is dodo.Dodo else "")
  return f"{hf_export.FAMILIES[fmt]}{what}.{dropped} {vocab_line}"


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)  # before JAX / TensorFlow load
  from decal_jax import fileio  # standard library only: no JAX / TensorFlow yet
  out = fileio.resolved(args.out)  # a URL (gs://...): built locally, uploaded when complete
  if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
    sys.exit(f"error: --out {out} exists; pass --overwrite to replace it.")
  files = gin_files(args)
  network, config, vocabulary, gin_text = read_model(files, args.gin_bindings)
  from decal_jax.runtime import checkpoints
  try:
    fmt = choose_format(args.format, network, config)
    source, step, flat = checkpoints.read_saved_params(args.checkpoint)
    with fileio.atomic_directory(out) as tmp:
      readme = export(fmt, network, config, vocabulary, flat, gin_text, args.adapter, tmp)
      (tmp / "README.md").write_text(
          f"# {network.__name__} exported by decal_jax\n\n{source}, step {step}, "
          f"gin files {files}.\n\n{readme}\n")
  except (FileNotFoundError, FileExistsError, ValueError) as e:
    sys.exit(f"error: {e}")
  print(f"{source}: written as {fmt} to {out}\n{readme}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
