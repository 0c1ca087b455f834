"""Hugging Face checkpoints -> the params of a model we train: a Decoder, a Dodo or a Squid.

`hf_import.load_hf_params` reads one checkpoint as a plain `Decoder`'s params
({'stack': ...}); `merge_base_params` copies them into a fresh model's tree:

  config, base = hf_import.load_hf_params("/ckpt/Llama-2-7b-hf")
  init = Dodo(dodo_config).init(...)["params"]              # a fresh Dodo
  params, report = hf_params.merge_base_params(init, base)  # base <- checkpoint

`import_decoder` / `import_dodo` / `import_squid` run a whole import (decal_jax/commands/import_hf.py is
their command line): read each checkpoint's sizes and give them to the configured model
(noting where its config said otherwise), move token 0 if asked (`hf_import.remap_zero_row`),
initialise what no checkpoint holds (Dodo's scorer, soft prompt and LoRA adapters; Squid's
memory tokens and projector) and copy the rest in. `size_gin_file` is the gin file that
gives the training run the same sizes.
"""
import dataclasses
import json
import pathlib
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from decal_jax.interop import hf_import
from decal_jax.data import hf_vocabularies
from decal_jax.networks import dodo, squid
from decal_jax.networks.decoder import DecoderConfig

SIZE_FIELDS = ("vocab_size", "emb_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
               "num_layers", "rope_theta", "norm_epsilon", "qkv_bias", "tie_embeddings",
               "max_length")
SQUID_DECODERS = (("small", "small_decoder"), ("large", "large_decoder"))  # scope, params


class Imported(NamedTuple):
  """What an import built. Scopes are Squid's 'small' / 'large'; None for one decoder."""
  params: Dict[str, Any]                           # the model's params, to save
  configs: Dict[Optional[str], DecoderConfig]      # each decoder's config, checkpoint sizes
  report: Dict[str, List[str]]                     # {'copied': paths, 'kept': fresh paths}
  notes: List[str]                                 # each size the model's config bound else
  hf_configs: Dict[Optional[str], Dict[str, Any]]  # each checkpoint's config.json


# ------------------------------------------------------------------------------ merging
def _is_lora(path: str) -> bool:
  return path.rsplit("/", 1)[-1].startswith("lora_")


def _paths(tree) -> List[str]:
  return list(flax.traverse_util.flatten_dict(tree, sep="/"))


def merge_base_params(init_params: Mapping[str, Any], base: Mapping[str, Any]
                      ) -> Tuple[Dict[str, Any], Dict[str, List[str]]]:
  """Copies an imported decoder tree ({'stack': ...}) into a fresh `Decoder` / `Dodo` tree.

  Every base leaf must exist in `init_params` with the same shape, and every non-LoRA leaf
  of `init_params['stack']` must come from `base`; the rest (Dodo's scorer and soft prompt,
  LoRA adapters) keep their initialisation. Copied values take the initial leaf's dtype.
  Returns (params, {'copied': [paths], 'kept': [paths]}).
  """
  init = flax.traverse_util.flatten_dict(flax.core.unfreeze(init_params), sep="/")
  flat_base = flax.traverse_util.flatten_dict(flax.core.unfreeze(base), sep="/")
  absent = sorted(set(flat_base) - set(init))
  if absent:
    raise ValueError(f"The model has no parameter for {len(absent)} imported tensor(s): "
                     f"{hf_import.few_names(absent)}. Build the model with the checkpoint's "
                     "DecoderConfig (tie_embeddings, qkv_bias, num_layers).")
  reshaped = [f"{k}: model {tuple(init[k].shape)} vs checkpoint {tuple(v.shape)}"
              for k, v in flat_base.items() if tuple(init[k].shape) != tuple(v.shape)]
  if reshaped:
    raise ValueError("Imported shapes differ from the model's:\n  " + "\n  ".join(reshaped[:6])
                     + "\nBind the checkpoint's sizes (decal_jax/commands/import_hf.py prints them).")
  uncovered = sorted(k for k in init if k.startswith("stack/") and k not in flat_base
                     and not _is_lora(k))
  if uncovered:
    raise ValueError(f"The checkpoint gives no value for {len(uncovered)} base parameter(s) "
                     f"of the model: {hf_import.few_names(uncovered)}. Do the model's "
                     "tie_embeddings / qkv_bias match the checkpoint?")
  merged = {k: (np.asarray(flat_base[k], dtype=v.dtype) if k in flat_base else v)
            for k, v in init.items()}
  report = {"copied": sorted(flat_base), "kept": sorted(set(init) - set(flat_base))}
  return flax.traverse_util.unflatten_dict(merged, sep="/"), report


def _merge_into(params, name: str, base) -> Tuple[Dict, Dict[str, List[str]]]:
  """`base` ({'stack': decoder tree}) copied into the DecoderStack `params[name]` with
  `merge_base_params`; the report's paths name `name` instead of 'stack'."""
  params = flax.core.unfreeze(params)
  merged, report = merge_base_params({"stack": params[name]}, base)
  params[name] = merged["stack"]
  return params, {key: [name + path[len("stack"):] for path in paths]
                  for key, paths in report.items()}


# ------------------------------------------------------------------------------ sizes
def with_sizes(gin_decoder: DecoderConfig, hf_config: DecoderConfig,
               scope: Optional[str] = None) -> Tuple[DecoderConfig, List[str]]:
  """A configured DecoderConfig with the checkpoint's sizes, and a note for each size the
  configured one differs on (`scope` names it in the notes)."""
  sizes = {f: getattr(hf_config, f) for f in SIZE_FIELDS}
  prefix = f"{scope}/" if scope else ""
  notes = [f"gin binds {prefix}DecoderConfig.{f} = {getattr(gin_decoder, f)!r}; the "
           f"checkpoint has {v!r} (used)" for f, v in sizes.items()
           if getattr(gin_decoder, f) != v]
  return dataclasses.replace(gin_decoder, **sizes), notes


def _squid_with_sizes(gin_config: squid.SquidConfig, hf_configs: Dict[str, DecoderConfig]
                      ) -> Tuple[squid.SquidConfig, List[str]]:
  """The SquidConfig with each decoder's checkpoint sizes ({'small': .., 'large': ..})."""
  changes, notes = {}, []
  for scope, _ in SQUID_DECODERS:
    changes[scope], more = with_sizes(getattr(gin_config, scope), hf_configs[scope], scope)
    notes += more
  try:
    return dataclasses.replace(gin_config, **changes), notes
  except ValueError as e:  # e.g. projector_input_dim declared for other decoders
    raise ValueError(f"the checkpoints' sizes do not fit the gin SquidConfig: {e}") from e


def size_bindings(config: DecoderConfig, scope: Optional[str] = None) -> List[str]:
  prefix = f"{scope}/" if scope else ""
  return [f"{prefix}decoder.DecoderConfig.{f} = {getattr(config, f)!r}" for f in SIZE_FIELDS]


def zero_id_binding(zero_id_to: Optional[int]) -> List[str]:
  """The vocabulary binding that matches a remapped checkpoint (none when not remapped)."""
  if zero_id_to is None:
    return []
  return [f"hf_vocabularies.HfTokenizerVocabulary.zero_id_to = {zero_id_to}"]


def size_gin_file(configs: Mapping[Optional[str], DecoderConfig], source: str,
                  bindings: List[str], zero_id_to: Optional[int] = None) -> str:
  """The checkpoints' sizes ({scope: config}; scope None for Dodo / Decoder), the
  vocabulary's zero_id_to when token 0 was remapped, then the gin `bindings` the import's
  model was built with."""
  extra = ["", "# --gin_bindings given to decal_jax/commands/import_hf.py", *bindings] if bindings else []
  sizes = [line for scope, config in configs.items() for line in size_bindings(config, scope)]
  remap = (["", f"# Token 0 ('!' in Qwen2) was moved to id {zero_id_to}: the vocabulary must "
            "say so.", *zero_id_binding(zero_id_to)] if zero_id_to is not None else [])
  example = "squid_qwen2.gin" if None not in configs else "dodo_llama2_7b.gin"
  imports = (["from decal_jax.data import hf_vocabularies"] if zero_id_to is not None else [])
  return "\n".join([f"# Written by decal_jax/commands/import_hf.py: the DecoderConfig sizes of {source}.",
                    f"# Pass it after the model gin file (e.g. models/{example}).",
                    "from __gin__ import dynamic_registration", "",
                    *imports, "from decal_jax.networks import decoder", "",
                    *sizes, *remap, *extra, ""])


# ------------------------------------------------------------------------------ checkpoints
def check_zero_id_to(hf_dir: pathlib.Path, config: DecoderConfig,
                     zero_id_to: Optional[int]) -> None:
  """Before any weight is read: R is a row of the checkpoint's table and no token of the
  tokenizer.json beside it (if there is one)."""
  if zero_id_to is None:
    return
  hf_import.check_zero_id_in_table(zero_id_to, config.vocab_size,
                                   f"the embedding table of {hf_dir}")
  tokenizer = pathlib.Path(hf_dir) / "tokenizer.json"
  if tokenizer.exists():
    _ = hf_vocabularies.HfTokenizerVocabulary(str(tokenizer), zero_id_to=zero_id_to).vocab_size


def check_same_tokenizer(small_dir: pathlib.Path, large_dir: pathlib.Path) -> None:
  """Squid feeds one token sequence to both decoders: their tokenizers must agree."""
  paths = [pathlib.Path(d) / "tokenizer.json" for d in (small_dir, large_dir)]
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


def read_checkpoint_config(hf_dir: pathlib.Path, overrides: Optional[Mapping[str, Any]] = None,
                           zero_id_to: Optional[int] = None
                           ) -> Tuple[Dict[str, Any], DecoderConfig]:
  """(config.json, its DecoderConfig) of one checkpoint, `overrides` (e.g. max_length)
  applied and zero_id_to checked against it."""
  hf = hf_import.read_hf_config(hf_dir)
  hf_config = hf_import.config_from_hf(hf, **(overrides or {}))
  check_zero_id_to(hf_dir, hf_config, zero_id_to)
  return hf, hf_config


def load_weights(hf_dir: pathlib.Path, hf_config: DecoderConfig,
                 zero_id_to: Optional[int] = None, progress: bool = True) -> Dict[str, Any]:
  """Float32 {'stack': params} of one checkpoint, token 0 moved to zero_id_to if given."""
  _, base = hf_import.load_hf_params(hf_dir, hf_config, progress=progress)
  if zero_id_to is not None:
    base = hf_import.remap_zero_row(base, zero_id_to)
  return base


# ------------------------------------------------------------------------------ imports
def _fresh_params(module, seed: int, *args, **kwargs) -> Dict[str, Any]:
  """`module`'s params as the trainer initialises them (the model's dummy call)."""
  init = jax.jit(lambda rng: module.init(rng, *args, enable_dropout=False, **kwargs)["params"])
  return init(jax.random.PRNGKey(seed))


def import_decoder(hf_dir: pathlib.Path, overrides: Optional[Mapping[str, Any]] = None,
                   zero_id_to: Optional[int] = None, progress: bool = True) -> Imported:
  """A plain `Decoder`: the checkpoint's params as they are (token 0 moved if asked)."""
  hf, config = read_checkpoint_config(hf_dir, overrides, zero_id_to)
  base = load_weights(hf_dir, config, zero_id_to, progress)
  return Imported(base, {None: config}, {"copied": sorted(_paths(base)), "kept": []}, [],
                  {None: hf})


def import_dodo(hf_dir: pathlib.Path, gin_config: dodo.DodoConfig, seed: int = 0,
                overrides: Optional[Mapping[str, Any]] = None,
                zero_id_to: Optional[int] = None, progress: bool = True) -> Imported:
  """The Dodo `gin_config` configures, with the checkpoint's sizes: its decoder stack from
  the checkpoint; scorer, soft prompt and LoRA adapters freshly initialised (`seed`)."""
  hf, hf_config = read_checkpoint_config(hf_dir, overrides, zero_id_to)
  decoder_config, notes = with_sizes(gin_config.decoder, hf_config)
  config = dataclasses.replace(gin_config, decoder=decoder_config)
  base = load_weights(hf_dir, hf_config, zero_id_to, progress)
  tokens = jnp.ones((1, 8), jnp.int32)
  fresh = _fresh_params(dodo.Dodo(config), seed, encoder_input_tokens=tokens,
                        decoder_input_tokens=tokens, decoder_target_tokens=tokens,
                        decode=False)
  params, report = merge_base_params(fresh, base)
  return Imported(params, {None: config.decoder}, report, notes, {None: hf})


def import_squid(small_dir: pathlib.Path, large_dir: pathlib.Path,
                 gin_config: squid.SquidConfig, seed: int = 0,
                 overrides: Optional[Mapping[str, Any]] = None,
                 zero_id_to: Optional[int] = None, progress: bool = True) -> Imported:
  """The Squid `gin_config` configures: `small_decoder` from `small_dir`, `large_decoder`
  from `large_dir`, each with its checkpoint's sizes; memory tokens and projector freshly
  initialised (`seed`). With zero_id_to, token 0 of both decoders moves there (checked on
  both before any weight is read)."""
  check_same_tokenizer(small_dir, large_dir)
  dirs = {"small": small_dir, "large": large_dir}
  hf, hf_configs = {}, {}
  for scope, directory in dirs.items():
    hf[scope], hf_configs[scope] = read_checkpoint_config(directory, overrides, zero_id_to)
  config, notes = _squid_with_sizes(gin_config, hf_configs)
  tokens = jnp.ones((1, 8), jnp.int32)
  params = _fresh_params(squid.Squid(config), seed, tokens, tokens, tokens,
                         query_tokens=tokens)
  copied = []
  for scope, name in SQUID_DECODERS:
    base = load_weights(dirs[scope], hf_configs[scope], zero_id_to, progress)
    params, report = _merge_into(params, name, base)
    copied += report["copied"]
  kept = sorted(set(_paths(params)) - set(copied))
  return Imported(params, {"small": config.small, "large": config.large},
                  {"copied": sorted(copied), "kept": kept}, notes, hf)
