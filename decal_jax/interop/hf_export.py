"""decal_jax params -> Hugging Face checkpoints: the inverse of `hf_import` / `hf_params`.

Three layouts, each a folder with `model.safetensors` (float32) and what loads it:

- `export_decoder`: a plain `Decoder` or Dodo's base (its `stack`) as `LlamaForCausalLM`
  (`family='llama'`) or `Qwen2ForCausalLM` (`'qwen2'`: q/k/v biases) + config.json.
  Every tensor is `hf_import.tensor_map`'s, converted back (`decoder_tensors`): kernels
  `[in, out]` transposed to `[out, in]`, the heads merged, the same "rotate half" q/k layout,
  no lm_head.weight when the embeddings are tied; rms_norm_eps and rope_theta are the
  config's. One LoRA adapter can be merged into the base kernels first (`merge_lora`:
  W + (alpha / rank) A B); a token 0 moved by the import (`zero_id_to`) is moved back.
  `hf_import.load_hf_params(out)` gives the params back exactly.
- `export_t5`: T5.1.1 at C = 1 as `T5ForConditionalGeneration` (gated-gelu, untied lm_head
  unless `logits_via_embedding`, the relative-position tables in layer 0 of each stack).
  `load_t5_params` reads such a folder back. C > 1 (DeCAL and the other compressors) has
  no transformers class: `T5CompressionError`.
- `export_squid`: Squid as a bundle folder, `small/` and `large/` (each decoder as above,
  a LoRA adapter merged; the small one, whose head Squid never reads, with its head tied) + `squid_joint.safetensors` (memory tokens and projector, the
  decal_jax layout) + `squid.json` (the parts and SquidConfig's joining settings);
  `load_squid_bundle` gives the params back.
- `save_safetensors_params` / `load_safetensors_params`: the decal_jax layout, for what no
  transformers class holds (DeCAL at C > 1, the dual encoder, nugget scorers). One
  tensor per parameter, named by its '/'-joined path (`decoder/layers_0/mlp/wo/kernel`),
  in the params' own dtype; the safetensors metadata hold `format` = 'decal_jax',
  `decal_jax_version` and `gin_config` (the gin text that builds the model). Loading gives
  the same values bit for bit.

decal_jax/commands/export_hf.py is the command line; docs/t5x_checkpoints.md shows it.
"""
import dataclasses
import json
import pathlib
import re
from typing import Any, Dict, Mapping, Optional, Tuple

import flax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

import decal_jax
from decal_jax.interop import hf_import
from decal_jax.networks import param_layout
from decal_jax.networks.decoder import DecoderConfig
from decal_jax.networks.squid import SquidConfig
from decal_jax.networks.t5 import T5Config

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
T5_ARCHITECTURE = "T5ForConditionalGeneration"
LAYOUT_NAME = "decal_jax"
LORA_LEAF = re.compile(r"lora_(?P<adapter>.+)_(?P<side>[ab])")


class T5CompressionError(ValueError):
  """A compressive T5 (C > 1) asked for as a transformers T5."""


# ------------------------------------------------------------------------------ helpers
def _flat(tree) -> Dict[str, Any]:
  return flax.traverse_util.flatten_dict(flax.core.unfreeze(tree), sep="/")


def _unflat(flat: Mapping[str, Any]) -> Dict[str, Any]:
  return flax.traverse_util.unflatten_dict(dict(flat), sep="/")


def _to_hf_shape(value, hf_shape: Tuple[int, ...], kernel: bool) -> np.ndarray:
  """Our leaf -> the HF tensor: a kernel `[in..., out...]` to `[out, in]`, else reshaped."""
  value = np.asarray(value, dtype=np.float32)
  if kernel:
    return np.ascontiguousarray(value.reshape(hf_shape[::-1]).T)
  return np.ascontiguousarray(value.reshape(hf_shape))


def _write_safetensors(tensors: Mapping[str, np.ndarray], out: pathlib.Path,
                       metadata: Optional[Mapping[str, str]] = None) -> pathlib.Path:
  out.mkdir(parents=True, exist_ok=True)
  path = out / hf_import.SINGLE_FILE
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path),
            metadata={"format": "pt", **(metadata or {})})
  return path


def _write_json(path: pathlib.Path, data: Mapping[str, Any]) -> None:
  path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------ LoRA
def merge_lora(stack: Mapping[str, Any], config: DecoderConfig,
               adapter: Optional[str]) -> Dict[str, Any]:
  """A decoder stack's params without LoRA leaves; with `adapter`, its A B merged into each
  projection's kernel: W + (alpha / rank) A B (alpha, rank: the config's), so the base
  model alone computes what the stack computes with that adapter active."""
  flat = {k: np.asarray(v) for k, v in _flat(stack).items()}
  names = {m.group("adapter") for k in flat
           if (m := LORA_LEAF.fullmatch(k.rsplit("/", 1)[-1]))}
  if adapter is not None and adapter not in names:
    raise ValueError(f"No LoRA adapter {adapter!r} in these params (adapters: "
                     f"{sorted(names) or 'none'}); export the base with adapter=None.")
  out = {k: v for k, v in flat.items() if not LORA_LEAF.fullmatch(k.rsplit("/", 1)[-1])}
  if adapter is None:
    return _unflat(out)
  scale = config.lora_alpha / config.lora_rank
  for key in [k for k in flat if k.endswith(f"/lora_{adapter}_a")]:
    module = key.rsplit("/", 1)[0]
    a, b = flat[key].astype(np.float64), flat[f"{module}/lora_{adapter}_b"].astype(np.float64)
    kernel = out[f"{module}/kernel"]
    delta = (scale * (a @ b)).reshape(kernel.shape)
    out[f"{module}/kernel"] = (kernel.astype(np.float64) + delta).astype(kernel.dtype)
  return _unflat(out)


# ------------------------------------------------------------------------------ decoder
def decoder_family(config: DecoderConfig, family: Optional[str] = None) -> str:
  """'qwen2' for q/k/v biases, else 'llama'; a `family` the config cannot be is refused."""
  natural = "qwen2" if config.qkv_bias else "llama"
  family = family or natural
  if family not in FAMILIES:
    raise ValueError(f"Unknown family {family!r}: export as one of {sorted(FAMILIES)}.")
  if family != natural:
    why = ("has q/k/v biases, which LlamaForCausalLM lacks" if config.qkv_bias else
           "has no q/k/v biases, which Qwen2ForCausalLM always has")
    raise ValueError(f"This decoder {why}: export it as {natural!r}.")
  return family


def decoder_hf_config(config: DecoderConfig, family: Optional[str] = None,
                      special_ids: Optional[Mapping[str, Optional[int]]] = None
                      ) -> Dict[str, Any]:
  """config.json of the transformers model that computes `Decoder(config)`; `special_ids`
  ({'bos_token_id': .., 'eos_token_id': .., 'pad_token_id': ..}) name the vocabulary's."""
  family = decoder_family(config, family)
  hf = {"architectures": [FAMILIES[family]], "model_type": family,
        "vocab_size": config.vocab_size, "hidden_size": config.emb_dim,
        "intermediate_size": config.mlp_dim, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.max_length, "rms_norm_eps": config.norm_epsilon,
        "rope_theta": config.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": config.tie_embeddings, "torch_dtype": "float32",
        "dtype": "float32", "initializer_range": 0.02, "use_cache": True,
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None, **(special_ids or {})}
  if family == "llama":
    hf.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  else:
    hf.update(use_sliding_window=False, sliding_window=None,
              max_window_layers=config.num_layers)
  return hf


def decoder_tensors(stack: Mapping[str, Any], config: DecoderConfig) -> Dict[str, np.ndarray]:
  """{HF tensor name: float32 array} of a decoder stack without LoRA leaves (the inverse of
  `hf_import.tensor_map`: converting each back gives the leaf exactly)."""
  flat = _flat(stack)
  stray = sorted(k for k in flat if LORA_LEAF.fullmatch(k.rsplit("/", 1)[-1]))
  if stray:
    raise ValueError(f"LoRA leaves left in the stack ({hf_import.few_names(stray)}): merge "
                     "them first (merge_lora).")
  targets = hf_import.tensor_map(hf_import.base_config(config))
  used = {"/".join(t.path) for t in targets.values()}
  unused = sorted(set(flat) - used)
  if unused:
    raise ValueError(f"The stack holds {len(unused)} parameter(s) a {config} checkpoint has "
                     f"no tensor for: {hf_import.few_names(unused)}.")
  out = {}
  for name, target in targets.items():
    key = "/".join(target.path)
    out[name] = _to_hf_shape(flat[key], target.hf_shape, key.endswith("kernel"))
  return out


def restore_zero_row(stack: Mapping[str, Any], zero_id_to: int) -> Dict[str, Any]:
  """The inverse of `hf_import.remap_zero_row` on a stack: token 0's row (and head column)
  moves from id `zero_id_to` back to 0, and row (column) `zero_id_to` becomes zeros, so the
  tokenizer's own ids index it (the import's overwritten row R is not recoverable)."""
  stack = dict(stack)
  embedding = np.array(stack["token_embedder"]["embedding"], copy=True)
  hf_import.check_zero_id_in_table(zero_id_to, embedding.shape[0])
  embedding[0], embedding[zero_id_to] = embedding[zero_id_to], 0.0
  stack["token_embedder"] = dict(stack["token_embedder"], embedding=embedding)
  if "logits_dense" in stack:
    kernel = np.array(stack["logits_dense"]["kernel"], copy=True)
    kernel[:, 0], kernel[:, zero_id_to] = kernel[:, zero_id_to], 0.0
    stack["logits_dense"] = dict(stack["logits_dense"], kernel=kernel)
  return stack


def export_decoder(params: Mapping[str, Any], config: DecoderConfig, out,
                   family: Optional[str] = None, adapter: Optional[str] = None,
                   zero_id_to: Optional[int] = None,
                   special_ids: Optional[Mapping[str, Optional[int]]] = None
                   ) -> Dict[str, Any]:
  """Writes a Decoder's or Dodo's params ({'stack': ..., ...}: only the stack is exported)
  to `out` as model.safetensors + config.json; `adapter` (Dodo: 'decode') is merged into
  the base first. `params` may be nested or '/'-flat. Returns the config.json written."""
  stack = merge_lora(_unflat(_flat(params))["stack"], config, adapter)
  if zero_id_to is not None:
    stack = restore_zero_row(stack, zero_id_to)
  hf = decoder_hf_config(config, family, special_ids)
  out = pathlib.Path(out)
  _write_safetensors(decoder_tensors(stack, config), out)
  _write_json(out / "config.json", hf)
  return hf


# ------------------------------------------------------------------------------ Squid
SQUID_DECODERS = {"small": "small_decoder", "large": "large_decoder"}  # folder: params key
SQUID_JOINT = "squid_joint.safetensors"


def _single_adapter(stack: Mapping[str, Any]) -> Optional[str]:
  """The one LoRA adapter in a decoder stack (merged on export), None without LoRA."""
  names = sorted({m.group("adapter") for k in _flat(stack)
                  if (m := LORA_LEAF.fullmatch(k.rsplit("/", 1)[-1]))})
  if len(names) > 1:
    raise ValueError(f"The decoder carries LoRA adapters {names}: a bundle merges one.")
  return names[0] if names else None


def squid_decoder_config(config: SquidConfig, folder: str,
                         stack: Optional[Mapping[str, Any]] = None) -> DecoderConfig:
  """The DecoderConfig a bundle's `folder` ('small' / 'large') is written with. Squid reads
  only the small decoder's states, so it has no output head of its own: its folder ties the
  head to the embeddings, which Squid never uses."""
  decoder_config = getattr(config, folder)
  headless = stack is None or "logits_dense" not in stack
  if folder == "small" and headless and not decoder_config.tie_embeddings:
    return dataclasses.replace(decoder_config, tie_embeddings=True)
  return decoder_config


def export_squid(params: Mapping[str, Any], config: SquidConfig, out,
                 family: Optional[str] = None, zero_id_to: Optional[int] = None,
                 special_ids: Optional[Mapping[str, Optional[int]]] = None) -> Dict[str, Any]:
  """Writes Squid's params to the folder `out` as a bundle: `small/` and `large/` (each
  decoder as `export_decoder` writes it: transformers loads either alone), what joins them
  (memory tokens, projector) in `squid_joint.safetensors`, and `squid.json`. Returns the
  squid.json written."""
  tree, out = _unflat(_flat(params)), pathlib.Path(out)
  families = {}
  for folder, key in SQUID_DECODERS.items():
    hf = export_decoder({"stack": tree[key]}, squid_decoder_config(config, folder, tree[key]),
                        out / folder, family, _single_adapter(tree[key]), zero_id_to,
                        special_ids)
    families[folder] = hf["architectures"][0]
  joint = {k: v for k, v in tree.items() if k not in SQUID_DECODERS.values()}
  save_safetensors_params(joint, out / SQUID_JOINT)
  manifest = {"format": "decal_jax squid bundle", "decal_jax_version": decal_jax.__version__,
              "decoders": families, "joint": SQUID_JOINT,
              "memory_tokens": config.memory_tokens, "memory_ratio": config.memory_ratio,
              "projector_layers": config.projector_layers,
              "projector_hidden_dim": config.projector_hidden_dim or config.large.emb_dim,
              "projector_activation": config.projector_activation,
              "order": "the large decoder reads [projected memory; query tokens]"}
  _write_json(out / "squid.json", manifest)
  return manifest


def load_squid_bundle(directory, config: SquidConfig) -> Dict[str, Any]:
  """Squid's params from a folder `export_squid` wrote (LoRA, if any, merged)."""
  directory = pathlib.Path(directory)
  params, _ = load_safetensors_params(directory / SQUID_JOINT)
  for folder, key in SQUID_DECODERS.items():
    decoder_config = squid_decoder_config(config, folder)
    params[key] = hf_import.load_hf_params(directory / folder, decoder_config)[1]["stack"]
  return params


# ------------------------------------------------------------------------------ T5
def check_t5_exportable(config: T5Config) -> None:
  if config.compression_ratio != 1:
    raise T5CompressionError(
        f"This T5 compresses its encoder output (compression_ratio={config.compression_ratio}, "
        f"compressor {config.compressor!r}): T5ForConditionalGeneration has no compressor, "
        "so no transformers class computes it. Export it in the decal_jax safetensors layout "
        "(export_hf --format decal; hf_export.save_safetensors_params), which "
        "hf_export.load_safetensors_params reads back into decal_jax.")


def t5_hf_config(config: T5Config, special_ids: Optional[Mapping[str, int]] = None
                 ) -> Dict[str, Any]:
  """config.json of the T5ForConditionalGeneration that computes `t5.Transformer(config)`."""
  check_t5_exportable(config)
  if tuple(config.mlp_activations) != ("gelu", "linear"):
    raise ValueError(f"mlp_activations={tuple(config.mlp_activations)}: only T5.1.1's "
                     "('gelu', 'linear') (transformers' 'gated-gelu') is exported.")
  return {"architectures": [T5_ARCHITECTURE], "model_type": "t5",
          "vocab_size": config.vocab_size, "d_model": config.emb_dim, "d_kv": config.head_dim,
          "d_ff": config.mlp_dim, "num_layers": config.num_encoder_layers,
          "num_decoder_layers": config.num_decoder_layers, "num_heads": config.num_heads,
          "relative_attention_num_buckets": config.relative_attention_num_buckets,
          "relative_attention_max_distance": config.relative_attention_max_distance,
          "dropout_rate": 0.0, "layer_norm_epsilon": 1e-6, "initializer_factor": 1.0,
          "feed_forward_proj": "gated-gelu", "is_encoder_decoder": True, "use_cache": True,
          "tie_word_embeddings": bool(config.logits_via_embedding),
          "torch_dtype": "float32", "dtype": "float32", "decoder_start_token_id": 0,
          "pad_token_id": 0, "eos_token_id": 1, **(special_ids or {})}


def _t5_attention(hf: str, ours: str, e: int, inner: int) -> Dict[str, Tuple]:
  """{HF name: (our path, HF shape, kernel?)} of one attention's q / k / v / o."""
  out = {f"{hf}.{letter}.weight": (f"{ours}{name}/kernel", (inner, e), True)
         for letter, name in (("q", "query"), ("k", "key"), ("v", "value"))}
  return out


def t5_tensor_map(config: T5Config) -> Dict[str, Tuple[str, Tuple[int, ...], bool]]:
  """{HF tensor name: (our '/'-path in the unrolled, unfused layout, HF shape, is_kernel)}."""
  e, inner, m = config.emb_dim, config.num_heads * config.head_dim, config.mlp_dim
  out = {"shared.weight": ("token_embedder/embedding", (config.vocab_size, e), False),
         "encoder.final_layer_norm.weight": ("encoder/encoder_norm/scale", (e,), False),
         "decoder.final_layer_norm.weight": ("decoder/decoder_norm/scale", (e,), False)}
  if not config.logits_via_embedding:
    out["lm_head.weight"] = ("decoder/logits_dense/kernel", (config.vocab_size, e), True)
  for stack in ("encoder", "decoder"):
    out[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (
        f"{stack}/relpos_bias/rel_embedding", (config.relative_attention_num_buckets,
                                               config.num_heads), True)
  def mlp(hf, ours):
    return {f"{hf}.DenseReluDense.wi_0.weight": (f"{ours}/mlp/wi_0/kernel", (m, e), True),
            f"{hf}.DenseReluDense.wi_1.weight": (f"{ours}/mlp/wi_1/kernel", (m, e), True),
            f"{hf}.DenseReluDense.wo.weight": (f"{ours}/mlp/wo/kernel", (e, m), True),
            f"{hf}.layer_norm.weight": (f"{ours}/pre_mlp_layer_norm/scale", (e,), False)}
  for i in range(config.num_encoder_layers):
    hf, ours = f"encoder.block.{i}.layer", f"encoder/layers_{i}"
    out.update(_t5_attention(f"{hf}.0.SelfAttention", f"{ours}/attention_qkv/", e, inner))
    out[f"{hf}.0.SelfAttention.o.weight"] = (f"{ours}/attention_out/kernel", (e, inner), True)
    out[f"{hf}.0.layer_norm.weight"] = (f"{ours}/pre_attention_layer_norm/scale", (e,), False)
    out.update(mlp(f"{hf}.1", ours))
  for i in range(config.num_decoder_layers):
    hf, ours = f"decoder.block.{i}.layer", f"decoder/layers_{i}"
    for j, (hf_name, name, norm) in enumerate((
        ("SelfAttention", "self_attention", "pre_self_attention_layer_norm"),
        ("EncDecAttention", "encoder_decoder_attention", "pre_cross_attention_layer_norm"))):
      out.update(_t5_attention(f"{hf}.{j}.{hf_name}", f"{ours}/{name}/qkv/", e, inner))
      out[f"{hf}.{j}.{hf_name}.o.weight"] = (f"{ours}/{name}/out/kernel", (e, inner), True)
      out[f"{hf}.{j}.layer_norm.weight"] = (f"{ours}/{norm}/scale", (e,), False)
    out.update(mlp(f"{hf}.2", ours))
  return out


def _plain_t5_layout(flat: Mapping[str, Any]) -> Dict[str, Any]:
  """T5 params in any layout (scanned, fused q/k/v) -> unrolled and unfused."""
  layout = param_layout.layout_of(flat)
  if layout is None:
    raise ValueError("These params are not a T5 encoder-decoder's (no encoder / decoder "
                     "layers).")
  tree = param_layout.convert_params(_unflat(flat), layout, param_layout.Layout(False, False))
  return _flat(tree)


def t5_tensors(params: Mapping[str, Any], config: T5Config) -> Dict[str, np.ndarray]:
  """{HF tensor name: float32 array} of a T5's params (nested or '/'-flat, any layout)."""
  check_t5_exportable(config)
  flat = _plain_t5_layout(_flat(params))
  table = t5_tensor_map(config)
  unused = sorted(set(flat) - {path for path, _, _ in table.values()})
  if unused:
    raise ValueError(f"T5ForConditionalGeneration has no tensor for {len(unused)} of these "
                     f"params: {hf_import.few_names(unused)}.")
  missing = sorted({path for path, _, _ in table.values()} - set(flat))
  if missing:
    raise ValueError(f"The params lack {len(missing)} T5 parameter(s) of this config: "
                     f"{hf_import.few_names(missing)}.")
  return {name: _to_hf_shape(flat[path], shape, kernel)
          for name, (path, shape, kernel) in table.items()}


def export_t5(params: Mapping[str, Any], config: T5Config, out,
              special_ids: Optional[Mapping[str, int]] = None) -> Dict[str, Any]:
  """Writes a T5 (C = 1) to `out` as model.safetensors + config.json that
  `T5ForConditionalGeneration.from_pretrained` loads. Returns the config.json written."""
  tensors = t5_tensors(params, config)
  hf = t5_hf_config(config, special_ids)
  out = pathlib.Path(out)
  _write_safetensors(tensors, out)
  _write_json(out / "config.json", hf)
  return hf


def load_t5_params(directory, config: T5Config) -> Dict[str, Any]:
  """The T5 network's float32 params (unrolled, unfused) from a T5ForConditionalGeneration
  folder of this config (one model.safetensors: what `export_t5` writes)."""
  table = t5_tensor_map(config)
  path = pathlib.Path(directory) / hf_import.SINGLE_FILE
  flat = {}
  with safe_open(str(path), framework="numpy") as f:
    absent = sorted(set(table) - set(f.keys()))
    if absent:
      raise ValueError(f"{path} lacks {len(absent)} tensor(s) of this T5 config: "
                       f"{hf_import.few_names(absent)}.")
    for name, (ours, shape, kernel) in table.items():
      value = np.asarray(f.get_tensor(name), dtype=np.float32)
      if tuple(value.shape) != shape:
        raise ValueError(f"{name}: expected {shape}, found {tuple(value.shape)}.")
      flat[ours] = _from_hf_shape(value, ours, config, kernel)
  return _unflat(flat)


def _from_hf_shape(value: np.ndarray, ours: str, config: T5Config, kernel: bool) -> np.ndarray:
  """An HF T5 tensor -> our leaf (the inverse of `_to_hf_shape` for `t5_tensor_map`)."""
  if not kernel:
    return value
  k = value.T  # [in, out]
  h, d = config.num_heads, config.head_dim
  if re.search(r"/(query|key|value)/kernel$", ours):
    return np.ascontiguousarray(k.reshape(k.shape[0], h, d))
  if re.search(r"(attention_out|/out)/kernel$", ours):
    return np.ascontiguousarray(k.reshape(h, d, k.shape[-1]))
  return np.ascontiguousarray(k)


# ------------------------------------------------------------------------------ decal_jax
def save_safetensors_params(params: Mapping[str, Any], path, gin_text: str = "") -> pathlib.Path:
  """Any decal_jax params (nested, or '/'-flat as `checkpoints.read_saved_params` gives) as
  one safetensors file: a tensor per leaf, named by its '/'-path, in its own dtype; the
  metadata hold format 'decal_jax', decal_jax_version and gin_config (`gin_text`)."""
  flat = {k: np.asarray(v) for k, v in _flat(params).items()}
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in flat.items()}, str(path),
            metadata={"format": LAYOUT_NAME, "decal_jax_version": decal_jax.__version__,
                      "gin_config": gin_text})
  return path


def load_safetensors_params(path) -> Tuple[Dict[str, Any], str]:
  """(nested params, gin text) of a file `save_safetensors_params` wrote (bitwise equal)."""
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / hf_import.SINGLE_FILE
  with safe_open(str(path), framework="numpy") as f:
    metadata = f.metadata() or {}
    if metadata.get("format") != LAYOUT_NAME:
      raise ValueError(f"{path} is not in the decal_jax safetensors layout (metadata format "
                       f"{metadata.get('format')!r}, not {LAYOUT_NAME!r}): a transformers "
                       "checkpoint loads with hf_import / load_t5_params instead.")
    flat = {name: f.get_tensor(name) for name in f.keys()}
  return _unflat(flat), metadata.get("gin_config", "")
