"""Import Hugging Face LLaMA / Qwen2 / Mistral checkpoints into `networks.decoder` params.

A checkpoint directory holds `config.json` and its weights as safetensors: one
`model.safetensors`, or shards listed in `model.safetensors.index.json`. Typical use:

  config, params = hf_import.load_hf_params("/ckpt/Llama-2-7b-hf")
  logits = Decoder(config).apply({"params": params}, tokens, enable_dropout=False)

Byte-level BPE checkpoints (Qwen2) whose id 0 is a real token ('!') are made to fit our
"id 0 is padding" convention by moving that token to an unused id R, in the vocabulary
(`data.hf_vocabularies.HfTokenizerVocabulary(..., zero_id_to=R)`) and in the weights
(`remap_zero_row`).

`hf_params` puts these params into a fresh Dodo / Squid (`merge_base_params`, `import_dodo`,
`import_squid`); `decal_jax/commands/import_hf.py` writes the result as an Orbax checkpoint the trainer
starts from. The vocabularies are in `data/hf_vocabularies.py`. What we do
not implement (RoPE scaling, a sliding window that actually binds, biases on LLaMA's
projections, activations other than SiLU) is refused with a ValueError, never approximated.

Hugging Face `nn.Linear` weights are `[out, in]`; ours are `[in, out]` kernels, with the
attention heads split out: q/k/v `[embed, heads, head_dim]`, out `[heads, head_dim, embed]`.
Both use the "rotate half" RoPE layout, so q/k need no permutation.
"""
import dataclasses
import json
import pathlib
import re
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from safetensors import safe_open

from decal_jax.networks.decoder import Decoder, DecoderConfig

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "MistralForCausalLM": "mistral"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")  # RoPE buffers some exports keep


# ------------------------------------------------------------------------------ config
def _family(hf: Mapping[str, Any]) -> str:
  archs = hf.get("architectures") or []
  if archs:
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
      raise ValueError(f"Unsupported architectures {archs}: we import {sorted(ARCHITECTURES)} "
                       "(a causal LM with its head).")
    return ARCHITECTURES[archs[0]]
  model_type = hf.get("model_type")
  if model_type not in ARCHITECTURES.values():
    raise ValueError(f"Unsupported model_type {model_type!r} (no 'architectures' given): we "
                     f"import {sorted(set(ARCHITECTURES.values()))}.")
  return model_type


def _required(hf: Mapping[str, Any], key: str):
  if hf.get(key) is None:
    raise ValueError(f"config.json lacks {key!r}, which a LLaMA-style config must give.")
  return hf[key]


def _rope_theta(hf: Mapping[str, Any]) -> float:
  """RoPE base; refuses any scaling (transformers 4.x `rope_scaling`, 5.x `rope_parameters`)."""
  scaling = hf.get("rope_scaling")
  if scaling is not None and _rope_type(scaling) != "default":
    raise ValueError(f"rope_scaling={scaling} is not implemented (only plain RoPE): use a "
                     "checkpoint without RoPE scaling (e.g. not Llama-3.1 / YaRN variants).")
  params = hf.get("rope_parameters")
  if params is not None:
    if not isinstance(params, Mapping) or _rope_type(params) != "default":
      raise ValueError(f"rope_parameters={params} asks for RoPE scaling (or per-layer RoPE), "
                       "which is not implemented: only rope_type 'default' is.")
    if hf.get("rope_theta") is None and params.get("rope_theta") is not None:
      return float(params["rope_theta"])
  factor = hf.get("partial_rotary_factor", 1.0)
  if factor != 1.0:
    raise ValueError(f"partial_rotary_factor={factor} is not implemented (RoPE rotates the "
                     "whole head here).")
  return float(hf.get("rope_theta") or 10000.0)


def _rope_type(rope: Mapping[str, Any]) -> Optional[str]:
  return rope.get("rope_type", rope.get("type"))


def _check_no_window(hf: Mapping[str, Any], family: str, max_length: int) -> None:
  """A sliding window binds only if some layer uses it and it is shorter than max_length."""
  window = hf.get("sliding_window")
  if family == "llama" or window is None:
    return
  layer_types = hf.get("layer_types")
  if layer_types is not None:
    used = any("sliding" in t for t in layer_types)
  else:
    used = hf.get("use_sliding_window", family == "mistral")
  if used and window < max_length:
    raise ValueError(f"sliding_window={window} is shorter than max_length={max_length}: "
                     "windowed attention is not implemented. Import with max_length <= "
                     f"{window} (config_from_hf(..., max_length={window}), or --max_length) "
                     "so the window never binds.")


def config_from_hf(hf_config: Mapping[str, Any], **overrides) -> DecoderConfig:
  """`DecoderConfig` of a LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM
  config.json dict; `overrides` replace fields afterwards (e.g. `max_length`, `lora_rank`)."""
  hf = dict(hf_config)
  family = _family(hf)
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"hidden_act={act!r} is not implemented: the MLP is SwiGLU (silu).")
  if family == "llama":
    for key in ("attention_bias", "mlp_bias"):
      if hf.get(key):
        raise ValueError(f"LLaMA with {key}=True is not implemented (our LLaMA projections "
                         "have no bias).")
  emb, heads = int(_required(hf, "hidden_size")), int(_required(hf, "num_attention_heads"))
  head_dim = hf.get("head_dim")
  if head_dim is None:
    if emb % heads:
      raise ValueError(f"hidden_size={emb} is not a multiple of num_attention_heads={heads} "
                       "and config.json gives no head_dim.")
    head_dim = emb // heads
  fields = dict(
      vocab_size=int(_required(hf, "vocab_size")), emb_dim=emb, num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=int(head_dim),
      mlp_dim=int(_required(hf, "intermediate_size")),
      num_layers=int(_required(hf, "num_hidden_layers")), rope_theta=_rope_theta(hf),
      norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=family == "qwen2",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_length=int(hf.get("max_position_embeddings") or DecoderConfig.max_length))
  unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(DecoderConfig)})
  if unknown:
    raise ValueError(f"Unknown DecoderConfig overrides {unknown}; fields are "
                     f"{[f.name for f in dataclasses.fields(DecoderConfig)]}.")
  fields.update(overrides)
  _check_no_window(hf, family, fields["max_length"])
  return DecoderConfig(**fields)


def read_hf_config(directory) -> Dict[str, Any]:
  path = pathlib.Path(directory) / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"No config.json in {directory}: give a Hugging Face checkpoint "
                            "directory (config.json + *.safetensors).")
  return json.loads(path.read_text())


# ------------------------------------------------------------------------------ tensor map
class Target(NamedTuple):
  """Where one Hugging Face tensor goes: our param path, its HF shape, how to convert."""
  path: Tuple[str, ...]
  hf_shape: Tuple[int, ...]
  convert: Callable[[np.ndarray], np.ndarray]
  meaning: str  # which config fields set the shape (for error messages)


def _linear(heads_out: Optional[Tuple[int, int]] = None,
            heads_in: Optional[Tuple[int, int]] = None):
  """HF `[out, in]` weight -> our `[in, out]` kernel, splitting heads on either side."""
  def convert(w):
    k = w.T  # [in, out]
    if heads_out is not None:
      k = k.reshape(k.shape[0], *heads_out)  # [embed, heads, head_dim]
    if heads_in is not None:
      k = k.reshape(*heads_in, k.shape[-1])  # [heads, head_dim, embed]
    return k
  return convert


def _same(w):
  return w


def tensor_map(cfg: DecoderConfig) -> Dict[str, Target]:
  """{HF tensor name: Target} for every tensor a checkpoint of this config must hold."""
  e, h, kv, d, m = cfg.emb_dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_dim
  out = {"model.embed_tokens.weight": Target(("token_embedder", "embedding"),
                                             (cfg.vocab_size, e), _same,
                                             "(vocab_size, hidden_size)"),
         "model.norm.weight": Target(("decoder_norm", "scale"), (e,), _same, "(hidden_size,)")}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = Target(("logits_dense", "kernel"), (cfg.vocab_size, e), _linear(),
                                   "(vocab_size, hidden_size)")
  for i in range(cfg.num_layers):
    hf, ours = f"model.layers.{i}.", f"layers_{i}"
    attn = {"q": ("query", h, "num_attention_heads"), "k": ("key", kv, "num_key_value_heads"),
            "v": ("value", kv, "num_key_value_heads")}
    for letter, (name, n, field) in attn.items():
      out[f"{hf}self_attn.{letter}_proj.weight"] = Target(
          (ours, "attention", name, "kernel"), (n * d, e), _linear(heads_out=(n, d)),
          f"({field} * head_dim, hidden_size)")
      if cfg.qkv_bias:
        out[f"{hf}self_attn.{letter}_proj.bias"] = Target(
            (ours, "attention", name, "bias"), (n * d,), lambda b, n=n: b.reshape(n, d),
            f"({field} * head_dim,)")
    out[f"{hf}self_attn.o_proj.weight"] = Target(
        (ours, "attention", "out", "kernel"), (e, h * d), _linear(heads_in=(h, d)),
        "(hidden_size, num_attention_heads * head_dim)")
    for hf_name, name in (("gate_proj", "wi_0"), ("up_proj", "wi_1")):
      out[f"{hf}mlp.{hf_name}.weight"] = Target((ours, "mlp", name, "kernel"), (m, e),
                                                _linear(), "(intermediate_size, hidden_size)")
    out[f"{hf}mlp.down_proj.weight"] = Target((ours, "mlp", "wo", "kernel"), (e, m), _linear(),
                                              "(hidden_size, intermediate_size)")
    out[f"{hf}input_layernorm.weight"] = Target((ours, "attention_norm", "scale"), (e,), _same,
                                                "(hidden_size,)")
    out[f"{hf}post_attention_layernorm.weight"] = Target((ours, "mlp_norm", "scale"), (e,),
                                                         _same, "(hidden_size,)")
  return out


# ------------------------------------------------------------------------------ reading
def tensor_files(directory) -> Dict[str, pathlib.Path]:
  """{tensor name: the safetensors file holding it} for one file or a sharded index."""
  directory = pathlib.Path(directory)
  index = directory / INDEX_FILE
  if index.exists():
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index} has no 'weight_map' {{tensor name: shard file}}.")
    files = {name: directory / shard for name, shard in weight_map.items()}
    absent = sorted({str(p.name) for p in files.values() if not p.exists()})
    if absent:
      raise FileNotFoundError(f"{index} lists shards missing from {directory}: {absent}.")
    return files
  single = directory / SINGLE_FILE
  if single.exists():
    with safe_open(str(single), framework="flax") as f:
      return {name: single for name in f.keys()}
  found = sorted(p.name for p in directory.glob("*.safetensors"))
  hint = (f"found {found} but no {INDEX_FILE} naming what they hold" if found else
          "found no *.safetensors (re-save with save_pretrained(..., safe_serialization=True))")
  raise FileNotFoundError(f"No {SINGLE_FILE} or {INDEX_FILE} in {directory}: {hint}.")


def _shapes(files: Mapping[str, pathlib.Path]) -> Dict[str, Tuple[int, ...]]:
  shapes = {}
  for path in sorted(set(files.values())):
    with safe_open(str(path), framework="flax") as f:
      for name in f.keys():
        if files.get(name) == path:
          shapes[name] = tuple(f.get_slice(name).get_shape())
  missing = sorted(set(files) - set(shapes))
  if missing:
    raise ValueError("The index names tensors its shards do not hold: "
                     f"{few_names(missing)}.")
  return shapes


def few_names(names: List[str], limit: int = 6) -> str:
  """The first `limit` names, comma-separated, and how many there are (for error messages)."""
  more = f" ... ({len(names)} in all)" if len(names) > limit else ""
  return ", ".join(names[:limit]) + more


def _check_names(expected: Mapping[str, Target], shapes: Mapping[str, Tuple[int, ...]],
                 cfg: DecoderConfig) -> None:
  present = {n for n in shapes if not IGNORED_TENSORS.match(n)}
  optional = {"lm_head.weight"} if cfg.tie_embeddings else set()
  missing = sorted(set(expected) - present)
  unexpected = sorted(present - set(expected) - optional)
  if missing:
    raise ValueError(f"The checkpoint lacks {len(missing)} tensor(s) the config needs: "
                     f"{few_names(missing)}. Is it a complete *ForCausalLM checkpoint of this "
                     "config (tie_word_embeddings, num_hidden_layers, qkv bias)?")
  if unexpected:
    raise ValueError(f"The checkpoint holds {len(unexpected)} tensor(s) this import does not "
                     f"map: {few_names(unexpected)}. Its architecture has parts we do not "
                     "implement (or config.json does not describe it).")
  bad = [f"{n}: expected {t.hf_shape} {t.meaning}, found {shapes[n]}"
         for n, t in expected.items() if shapes[n] != t.hf_shape]
  if bad:
    raise ValueError("Tensor shapes do not match the config:\n  " + "\n  ".join(bad[:6]) +
                     (f"\n  ... ({len(bad)} in all)" if len(bad) > 6 else "") +
                     "\nCheck config.json (or the DecoderConfig passed) against the weights.")


def _read(path: pathlib.Path, names: List[str]) -> Dict[str, np.ndarray]:
  """Float32 numpy copies of `names` from one file (bf16 / fp16 read through jax on CPU)."""
  out = {}
  with jax.default_device(jax.devices("cpu")[0]):
    with safe_open(str(path), framework="flax") as f:
      for name in names:
        out[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
  return out


def load_hf_params(directory, config: Optional[DecoderConfig] = None,
                   progress: bool = False) -> Tuple[DecoderConfig, Dict[str, Any]]:
  """(config, float32 params of `Decoder(config)`, i.e. {'stack': {...}}) from a checkpoint.

  config: the DecoderConfig to load into (default: `config_from_hf(config.json)`); every
  tensor's shape is checked against it before any data is read. LoRA leaves are not part
  of a checkpoint: merge the result into a LoRA / Dodo tree with `hf_params.merge_base_params`.
  """
  config = config or config_from_hf(read_hf_config(directory))
  files = tensor_files(directory)
  shapes = _shapes(files)
  expected = tensor_map(config)
  _check_names(expected, shapes, config)
  by_file: Dict[pathlib.Path, List[str]] = {}
  for name in expected:
    by_file.setdefault(files[name], []).append(name)
  flat = {}
  for path, names in tqdm.tqdm(sorted(by_file.items()), desc="read safetensors",
                               disable=not progress):
    for name, value in _read(path, names).items():
      flat[("stack",) + expected[name].path] = expected[name].convert(value)
  if config.tie_embeddings and "lm_head.weight" in shapes:
    _check_tied(files["lm_head.weight"], flat[("stack", "token_embedder", "embedding")])
  params = flax.traverse_util.unflatten_dict(flat)
  _check_tree(params, config)
  return config, params


def _check_tied(path: pathlib.Path, embedding: np.ndarray) -> None:
  head = _read(path, ["lm_head.weight"])["lm_head.weight"]
  if head.shape != embedding.shape or not np.array_equal(head, embedding):
    raise ValueError("config.json says tie_word_embeddings=True but lm_head.weight differs "
                     "from model.embed_tokens.weight: set tie_word_embeddings=False.")


def base_config(config: DecoderConfig) -> DecoderConfig:
  """The config without LoRA adapters (the part a Hugging Face checkpoint holds)."""
  return dataclasses.replace(config, lora_adapters=())


def _check_tree(params: Dict[str, Any], config: DecoderConfig) -> None:
  """The loaded tree is exactly `Decoder(base config)`'s (names and shapes)."""
  tokens = jnp.ones((1, 2), jnp.int32)
  abstract = jax.eval_shape(lambda: Decoder(base_config(config)).init(
      jax.random.PRNGKey(0), tokens, enable_dropout=False))["params"]
  want = {k: tuple(v.shape) for k, v in flax.traverse_util.flatten_dict(abstract).items()}
  got = {k: tuple(v.shape) for k, v in flax.traverse_util.flatten_dict(params).items()}
  if want != got:
    diff = sorted(set(want.items()) ^ set(got.items()))
    raise RuntimeError(f"Internal error: the imported tree is not Decoder's: {diff[:6]}.")


# ------------------------------------------------------------------------------ id 0
def check_zero_id_in_table(zero_id_to: int, rows: int, what: str = "the embedding table") -> None:
  """Refuses an R outside a vocab table of `rows` rows (R must index both Squid tables)."""
  # here, not at the top: hf_vocabularies imports seqio and TensorFlow, which the weights'
  # import (gguf.py's too) does without (a GPU image without TensorFlow runs the SmolLM2 tools)
  from decal_jax.data.hf_vocabularies import checked_zero_id_to
  if checked_zero_id_to(zero_id_to) >= rows:
    raise ValueError(f"zero_id_to={zero_id_to} is beyond {what} ({rows} rows, ids 0..{rows - 1})"
                     f": choose an id below {rows} that the tokenizer never produces (Qwen2: "
                     "151935, the last row of Qwen2-0.5B's table).")


def remap_zero_row(params: Mapping[str, Any], zero_id_to: int) -> Dict[str, Any]:
  """Moves token 0 of an imported decoder ({'stack': ...}, as `load_hf_params` returns) to id
  `zero_id_to` (R), for a vocabulary built with `HfTokenizerVocabulary(..., zero_id_to=R)`.

  Row R of token_embedder/embedding `[vocab, embed]` becomes the checkpoint's row 0 and row 0
  becomes zeros; an untied head's logits_dense/kernel `[embed, vocab]` gets column 0 in
  column R and zeros in column 0. The checkpoint's row / column R is overwritten: R must be
  an id its tokenizer never produces (a padding row, e.g. 151935 in Qwen2's tables;
  `HfTokenizerVocabulary` checks that on use). Then ids through the remapping vocabulary give
  exactly the logits the checkpoint gives on the tokenizer's ids, with logit R standing for
  token 0's and logit 0 (of the padding id, never a target) a constant 0: greedy decoding
  picks id 0 only where every real logit is negative, and it decodes to nothing.

  Id 0 is then the zero vector: padding, and the start token (BOS = 0) that our decoders
  put before every target. The checkpoint never saw either: Qwen2 has no BOS (text begins
  with its first token), and without the remap our BOS-0 was the embedding of '!' instead.
  A zero row is not a no-op: RMSNorm keeps it zero, but the position still takes part in
  attention (with Qwen2's q/k/v biases as its query, key and value), so fine-tuning learns
  what the start token means, as it had to for '!'. The inputs are not modified (the
  tables are copied).
  """
  stack = dict(params["stack"])
  check_zero_id_in_table(zero_id_to, np.shape(stack["token_embedder"]["embedding"])[0],
                         "token_embedder/embedding")
  embedding = np.array(stack["token_embedder"]["embedding"], copy=True)  # [vocab, embed]
  embedding[zero_id_to] = embedding[0]
  embedding[0] = 0.0
  stack["token_embedder"] = dict(stack["token_embedder"], embedding=embedding)
  if "logits_dense" in stack:
    check_zero_id_in_table(zero_id_to, np.shape(stack["logits_dense"]["kernel"])[1],
                           "logits_dense/kernel's columns")
    kernel = np.array(stack["logits_dense"]["kernel"], copy=True)  # [embed, vocab]
    kernel[:, zero_id_to] = kernel[:, 0]
    kernel[:, 0] = 0.0
    stack["logits_dense"] = dict(stack["logits_dense"], kernel=kernel)
  return dict(params, stack=stack)
