"""Hugging Face checkpoint import, checked against transformers' own PyTorch models.

Tiny random LLaMA / Qwen2 models are built and saved here (no hub access), imported with
`decal_jax.hf_import`, and our `Decoder`'s logits and cached greedy tokens compared with
the PyTorch model's: float32 to 1e-4; a bf16 checkpoint exactly (its bf16 weights in
float32) and, more loosely, against PyTorch's bf16 forward pass. Needs the `[test-hf]`
extra (torch + transformers): without it the file is skipped, saying so.
"""
import copy
import dataclasses
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

# (tests/conftest.py hides Triton, which crashes next to TensorFlow, before torch loads.)
NEEDS_HF = ("compares with transformers' PyTorch models: pip install torch (the CPU build) "
            "and -e '.[test-hf]'")
torch = pytest.importorskip("torch", reason=NEEDS_HF)
transformers = pytest.importorskip("transformers", reason=NEEDS_HF)
safetensors_torch = pytest.importorskip("safetensors.torch", reason=NEEDS_HF)

import flax  # noqa: E402
import gin  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from decal_jax import checkpoints, hf_import, hf_params  # noqa: E402
from decal_jax.data import hf_vocabularies  # noqa: E402
from decal_jax.networks import decoder  # noqa: E402
from decal_jax.networks.decoder import Decoder  # noqa: E402
from decal_jax.networks.dodo import Dodo, DodoConfig  # noqa: E402
import tolerances  # noqa: E402
import paths  # noqa: E402

REPO = paths.REPO
VOCAB = 101
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=112,
            num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
            rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 12))


def _randomize(model, seed):
  """Weights big enough that every tensor matters (norm scales near 1, biases non-zero)."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
      else:
        p.normal_(0.0, 0.2)
  return model.eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """GQA (4 query / 2 kv heads), head_dim 24 != hidden / heads, RoPE base 5e5."""
  config = transformers.LlamaConfig(head_dim=24, rope_theta=5e5, **TINY)
  model = _randomize(transformers.LlamaForCausalLM(config), seed=0)
  directory = tmp_path_factory.mktemp("llama")
  model.save_pretrained(directory, safe_serialization=True)
  return model, directory


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
  """Qwen2: biases on q/k/v, tied embeddings (no lm_head tensor)."""
  config = transformers.Qwen2Config(tie_word_embeddings=True, rope_theta=1e6, **TINY)
  model = _randomize(transformers.Qwen2ForCausalLM(config), seed=1)
  directory = tmp_path_factory.mktemp("qwen2")
  model.save_pretrained(directory, safe_serialization=True)
  return model, directory


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()  # [batch, t, vocab]


@functools.lru_cache(maxsize=None)
def _forward(config):
  """Jitted `Decoder(config)` logits, compiled once per config for every test that uses it."""
  return jax.jit(lambda params, tokens: Decoder(config).apply(
      {"params": params}, tokens, enable_dropout=False))


def _our_logits(config, params, tokens):
  return np.asarray(_forward(config)(params, jnp.asarray(tokens)))


def _copy_with_config(directory, target, **changes):
  shutil.copytree(directory, target)
  path = target / "config.json"
  path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))
  return target


# ------------------------------------------------------------------------------ logits
def test_llama_logits_match_transformers(llama):
  model, directory = llama
  config, params = hf_import.load_hf_params(directory)
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 24)
  assert (config.rope_theta, config.norm_epsilon, config.qkv_bias) == (5e5, 1e-5, False)
  np.testing.assert_allclose(_our_logits(config, params, TOKENS), _torch_logits(model, TOKENS),
                             atol=1e-4, rtol=1e-4)


def test_qwen2_with_qkv_bias_and_tied_embeddings_matches_transformers(qwen2):
  model, directory = qwen2
  config, params = hf_import.load_hf_params(directory)
  assert config.qkv_bias and config.tie_embeddings and config.rope_theta == 1e6
  assert "logits_dense" not in params["stack"]
  assert params["stack"]["layers_1"]["attention"]["key"]["bias"].shape == (2, 16)
  np.testing.assert_allclose(_our_logits(config, params, TOKENS), _torch_logits(model, TOKENS),
                             atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_matches_transformers(llama, tmp_path):
  model, _ = llama
  model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
  assert (tmp_path / hf_import.INDEX_FILE).exists()
  assert len(list(tmp_path.glob("*.safetensors"))) > 2
  config, params = hf_import.load_hf_params(tmp_path)
  np.testing.assert_allclose(_our_logits(config, params, TOKENS), _torch_logits(model, TOKENS),
                             atol=1e-4, rtol=1e-4)


def test_bf16_checkpoint_loads_its_exact_values(llama, tmp_path):
  model_bf16 = copy.deepcopy(llama[0]).to(torch.bfloat16)
  model_bf16.save_pretrained(tmp_path, safe_serialization=True)
  with open(tmp_path / "model.safetensors", "rb") as f:
    assert b'"BF16"' in f.read(4096)  # the file really holds bf16 tensors
  config, params = hf_import.load_hf_params(tmp_path)
  embedding = params["stack"]["token_embedder"]["embedding"]
  assert embedding.dtype == np.float32
  np.testing.assert_array_equal(embedding,
                                model_bf16.model.embed_tokens.weight.float().detach().numpy())
  ours = _our_logits(config, params, TOKENS)
  # The same bf16-rounded weights computed in float32 by PyTorch: as tight as float32.
  # (Not model_bf16.float(): that would also round the RoPE inv_freq buffer.)
  rounded = copy.deepcopy(llama[0])
  with torch.no_grad():
    for p in rounded.parameters():
      p.copy_(p.to(torch.bfloat16).float())
  np.testing.assert_allclose(ours, _torch_logits(rounded, TOKENS), atol=1e-4, rtol=1e-4)
  # PyTorch's bf16 forward pass rounds every activation to 8 significant bits (2^-9 = 0.2 %
  # each): a loose match. Measured: 2 % of max |logits| (2 layers); 5 % leaves 2.5x.
  reference = _torch_logits(model_bf16, TOKENS)
  scale = np.abs(reference).max()
  np.testing.assert_allclose(ours, reference, atol=0.05 * scale)


# ------------------------------------------------------------------------------ decoding
def _greedy(config, params, prompt, steps):
  """Our KV-cached greedy decoding: create the cache, prefill the prompt, then 1 token/step."""
  model, total = Decoder(config), prompt.shape[1] + steps
  apply = functools.partial(model.apply, decode=True, enable_dropout=False, mutable=["cache"])
  _, variables = jax.jit(apply)({"params": params},
                                jnp.ones((prompt.shape[0], total), jnp.int32))
  logits, variables = jax.jit(functools.partial(apply, prefill=True))(
      {"params": params, **variables}, jnp.asarray(prompt))
  step = jax.jit(apply)
  tokens = [jnp.argmax(logits[:, -1], axis=-1)]  # [batch]
  for _ in range(steps - 1):
    logits, variables = step({"params": params, **variables}, tokens[-1][:, None])
    tokens.append(jnp.argmax(logits[:, -1], axis=-1))
  return np.stack([np.asarray(t) for t in tokens], axis=1)  # [batch, steps]


def test_cached_greedy_generation_equals_transformers_generate(llama):
  model, directory = llama
  config, params = hf_import.load_hf_params(directory)
  prompt, steps = TOKENS[:, :5], 8  # the same ids to both: our Decoder adds no BOS
  with torch.no_grad():
    out = model.generate(torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=int),
                         max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         pad_token_id=0)
  expected = out[:, prompt.shape[1]:].numpy()
  assert expected.shape == (2, steps)
  np.testing.assert_array_equal(_greedy(config, params, prompt, steps), expected)


# ------------------------------------------------------------------------------ errors
def test_a_shape_mismatch_names_the_tensor_and_both_shapes(llama, tmp_path):
  directory = _copy_with_config(llama[1], tmp_path / "bad", intermediate_size=128)
  with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: expected "
                                       r"\(128, 64\) \(intermediate_size, hidden_size\), "
                                       r"found \(112, 64\)"):
    hf_import.load_hf_params(directory)


def test_unsupported_rope_scaling_is_refused(llama, tmp_path):
  scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
  directory = _copy_with_config(llama[1], tmp_path / "scaled", rope_parameters=scaled)
  with pytest.raises(ValueError, match="RoPE scaling"):
    hf_import.load_hf_params(directory)
  legacy = {"architectures": ["LlamaForCausalLM"], **TINY,
            "rope_scaling": {"type": "dynamic", "factor": 4.0}}  # transformers 4.x spelling
  with pytest.raises(ValueError, match="rope_scaling"):
    hf_import.config_from_hf(legacy)


def _hf(arch, **changes):
  return {"architectures": [arch], **TINY, **changes}


@pytest.mark.parametrize("hf,match", [
    (_hf("LlamaForCausalLM", attention_bias=True), "attention_bias"),
    (_hf("LlamaForCausalLM", mlp_bias=True), "mlp_bias"),
    (_hf("LlamaForCausalLM", hidden_act="gelu"), "hidden_act"),
    (_hf("GemmaForCausalLM"), "Unsupported architectures"),
    (_hf("MistralForCausalLM", sliding_window=16), "sliding_window=16"),
    (_hf("Qwen2ForCausalLM", sliding_window=16, use_sliding_window=True), "sliding_window=16"),
])
def test_what_we_do_not_implement_is_refused(hf, match):
  with pytest.raises(ValueError, match=match):
    hf_import.config_from_hf(hf)


def test_unused_sliding_windows_and_overrides_are_accepted():
  # Qwen2's released configs name a window they do not use.
  qwen = hf_import.config_from_hf(_hf("Qwen2ForCausalLM", sliding_window=16,
                                      use_sliding_window=False))
  assert qwen.qkv_bias and qwen.max_length == 64
  # A Mistral window that max_length never reaches does not bind.
  mistral = hf_import.config_from_hf(_hf("MistralForCausalLM", sliding_window=16),
                                     max_length=16, lora_rank=4)
  assert (mistral.max_length, mistral.lora_rank, mistral.qkv_bias) == (16, 4, False)
  # No head_dim: hidden / heads.
  assert hf_import.config_from_hf(_hf("LlamaForCausalLM")).head_dim == 16
  with pytest.raises(ValueError, match="Unknown DecoderConfig overrides"):
    hf_import.config_from_hf(_hf("LlamaForCausalLM"), max_len=8)


def test_missing_and_unexpected_tensors_are_named_and_inv_freq_ignored(llama, tmp_path):
  tensors = safetensors_torch.load_file(str(llama[1] / "model.safetensors"))
  config = json.loads((llama[1] / "config.json").read_text())

  def save(name, tensors):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file(tensors, str(tmp_path / name / "model.safetensors"))
    return tmp_path / name

  extra = dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(12)})
  _, params = hf_import.load_hf_params(save("inv_freq", extra))
  assert "rotary_emb" not in str(flax.traverse_util.flatten_dict(params).keys())
  missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
  with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
    hf_import.load_hf_params(save("missing", missing))
  unexpected = dict(tensors, **{"model.layers.0.mlp.extra.weight": torch.ones(2)})
  with pytest.raises(ValueError, match=r"does not map: model\.layers\.0\.mlp\.extra\.weight"):
    hf_import.load_hf_params(save("unexpected", unexpected))
  (tmp_path / "no_weights").mkdir()
  (tmp_path / "no_weights" / "config.json").write_text(json.dumps(config))
  with pytest.raises(FileNotFoundError, match=r"found no \*\.safetensors"):
    hf_import.load_hf_params(tmp_path / "no_weights")


# ------------------------------------------------------------------------------ merging
def _stack_logits(module, tokens):
  """The bare decoder inside a Dodo (no adapter, no nuggets): logits `[batch, t, vocab]`."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  bias = decoder.causal_bias(positions, None, jnp.float32)
  return module.stack.logits(module.stack(module.stack.embed(tokens), positions, bias))


def _dodo_shapes(config):
  tokens = jnp.ones((1, 8), jnp.int32)
  return jax.eval_shape(lambda: Dodo(config).init(jax.random.PRNGKey(0), tokens, tokens, tokens,
                                                  enable_dropout=False)["params"])


def _random_like(shapes, seed=3):
  """Stand-in for a fresh init: random values in every leaf (merging reads names and shapes)."""
  rng = np.random.RandomState(seed)
  return jax.tree_util.tree_map(lambda x: rng.normal(size=x.shape).astype(x.dtype), shapes)


def test_merge_into_a_fresh_dodo_keeps_scorer_soft_prompt_and_lora(llama):
  model, directory = llama
  config, base = hf_import.load_hf_params(directory)
  dodo_config = DodoConfig(decoder=dataclasses.replace(config, lora_rank=4),
                           scorer_layer=1)
  init = _random_like(_dodo_shapes(dodo_config))
  params, report = hf_params.merge_base_params(init, base)
  kept = set(report["kept"])
  assert {"scorer/hidden/kernel", "scorer/score/kernel", "soft_prompt",
          "stack/layers_0/attention/query/lora_compress_a",
          "stack/layers_1/attention/out/lora_decode_b"} <= kept
  assert all(k.startswith(("scorer", "soft_prompt")) or "/lora_" in k for k in kept)
  assert len(report["copied"]) == len(jax.tree_util.tree_leaves(base))
  flat_init = flax.traverse_util.flatten_dict(flax.core.unfreeze(init), sep="/")
  flat = flax.traverse_util.flatten_dict(params, sep="/")
  for name in kept:
    np.testing.assert_array_equal(flat[name], flat_init[name])
  logits = jax.jit(lambda p, t: Dodo(dodo_config).apply({"params": p}, t,
                                                       method=_stack_logits))(
                                                           params, jnp.asarray(TOKENS))
  np.testing.assert_allclose(np.asarray(logits), _torch_logits(model, TOKENS), atol=1e-4,
                             rtol=1e-4)


def test_merge_refuses_a_model_of_other_shapes(llama):
  config, base = hf_import.load_hf_params(llama[1])
  wider = DodoConfig(decoder=dataclasses.replace(config, mlp_dim=128),
                     scorer_layer=1)
  with pytest.raises(ValueError, match=r"stack/layers_0/mlp/wi_0/kernel: model \(64, 128\) vs "
                                       r"checkpoint \(64, 112\)"):
    hf_params.merge_base_params(_dodo_shapes(wider), base)
  tied = DodoConfig(decoder=dataclasses.replace(config, tie_embeddings=True),
                    scorer_layer=1)
  with pytest.raises(ValueError, match="no parameter for 1 imported.*logits_dense"):
    hf_params.merge_base_params(_dodo_shapes(tied), base)


# ------------------------------------------------------------------------------ vocabulary
def test_sentencepiece_vocabulary_reads_a_checkpoint_file_or_says_what_is_missing(monkeypatch):
  monkeypatch.delenv(hf_vocabularies.SENTENCEPIECE_ENV, raising=False)
  with pytest.raises(FileNotFoundError, match="LLAMA_TOKENIZER"):
    _ = hf_vocabularies.HfSentencePieceVocabulary().vocab_size
  spiece = REPO.parent / "shared" / "data" / "vocab" / "t5_spiece.model"
  if not spiece.exists():
    pytest.skip(f"no SentencePiece model at {spiece}")
  monkeypatch.setenv(hf_vocabularies.SENTENCEPIECE_ENV, str(spiece))
  vocab = hf_vocabularies.HfSentencePieceVocabulary()
  assert vocab.vocab_size == 32000 and vocab.extra_ids == 0  # no sentinels added


# ------------------------------------------------------------------------------ the tool
def _run_tool(*args):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([sys.executable, "-m", "decal_jax.tools.import_hf", *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _tool_module():
  return importlib.import_module("decal_jax.tools.import_hf")


def test_import_tool_writes_a_checkpoint_the_trainer_starts_from(llama, tmp_path):
  model, directory = llama
  out = tmp_path / "imported"
  args = ["--hf_dir", str(directory), "--out", str(out), "--gin_file=models/dodo_tiny.gin",
          "--gin_bindings=SCORER_LAYER = 1", "--gin_bindings=LORA_RANK = 4"]
  proc = _run_tool(*args)
  assert proc.returncode == 0, proc.stderr
  assert "decoder.DecoderConfig.head_dim = 24" in proc.stdout
  assert f"--gin.INITIAL_CHECKPOINT_PATH=\"'{out}'\"" in proc.stdout
  # The params the trainer builds from the model gin file + the printed bindings.
  gin.clear_config()
  gin.add_config_file_search_path(str(REPO / "gin"))
  gin.parse_config_files_and_bindings(["models/dodo_tiny.gin", str(out / "hf_import.gin")],
                                      [], finalize_config=False)
  trainer_model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  gin.clear_config()
  shapes = trainer_model.input_shapes({"inputs": 16, "targets": 8})
  abstract = jax.eval_shape(lambda: trainer_model.get_initial_variables(
      jax.random.PRNGKey(9), shapes)["params"])  # names and shapes are what restoring needs
  fresh = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)
  params, report = checkpoints.restore_matching_params(str(out), fresh)
  assert report["initialised"] == [] and report["unused"] == []
  assert sum(k.startswith("stack/") and "/lora_" not in k for k in report["restored"]) == 21
  # Independently of the import code: the checkpoint's tensors, transposed by hand.
  q = model.model.layers[1].self_attn.q_proj.weight.detach().numpy()  # [heads * 24, 64]
  np.testing.assert_array_equal(params["stack"]["layers_1"]["attention"]["query"]["kernel"],
                                q.T.reshape(64, 4, 24))
  down = model.model.layers[0].mlp.down_proj.weight.detach().numpy()  # [64, 112]
  np.testing.assert_array_equal(params["stack"]["layers_0"]["mlp"]["wo"]["kernel"], down.T)
  # An existing checkpoint is never replaced without --overwrite.
  tool, before = _tool_module(), sorted(p.name for p in out.rglob("*"))
  with pytest.raises(SystemExit, match="already exists.*--overwrite"):
    tool.main(args[:4] + ["--model", "decoder"])
  assert sorted(p.name for p in out.rglob("*")) == before
  # --overwrite swaps in the new checkpoint (here the plain Decoder) and leaves no debris.
  assert tool.main(args[:4] + ["--model", "decoder", "--overwrite"]) == 0
  written = checkpoints.Checkpointer(str(out))
  shapes = written.saved_architecture(0)
  written.close()
  assert "scorer/hidden/kernel" not in shapes and len(shapes) == 21
  assert sorted(p.name for p in tmp_path.iterdir()) == ["imported"]


# ------------------------------------------------------------------------------ tokenizer.json
TEXTS = ["Hello world! How are you? Fine, thanks.", "Ünïcödé ✓ and émojis 🦑 too",
         "numbers 12345 and  double  spaces\nnew lines\ttabs", "!!! wow!"]


def _write_tokenizer(directory, eos_in_config=True):
  """A tiny byte-level BPE trained here, laid out like Qwen2's: the byte alphabet first (so
  id 0 is '!'), the special token last; `tokenizer_config.json` names the EOS."""
  tokenizers = pytest.importorskip("tokenizers")
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  trainer_ = tokenizers.trainers.BpeTrainer(
      vocab_size=320, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(TEXTS * 10, trainer_)
  tokenizer.add_special_tokens(["<|endoftext|>"])
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  if eos_in_config:
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|endoftext|>"}, "bos_token": None}))
  return tokenizer, directory / "tokenizer.json"


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
  return _write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_tokenizer_vocabulary_encodes_and_decodes_as_the_tokenizer_does(hf_tokenizer):
  tokenizer, path = hf_tokenizer
  vocab = hf_vocabularies.HfTokenizerVocabulary(str(path))
  assert isinstance(vocab, hf_vocabularies.HfTokenizerVocabulary)
  eos = tokenizer.token_to_id("<|endoftext|>")
  assert (vocab.eos_id, vocab.unk_id, vocab.bos_id) == (eos, None, None)
  assert vocab.vocab_size == tokenizer.get_vocab_size() == eos + 1 and vocab.extra_ids == 0
  for text in TEXTS:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert list(vocab.encode(text)) == ids
    assert vocab.decode(ids) == tokenizer.decode(ids) == text
    # Decoding stops at EOS; ids past the tokenizer (padded embedding rows) are skipped.
    assert vocab.decode(ids + [eos, 5, 6]) == text
    assert vocab.decode(ids[:3] + [vocab.vocab_size + 7] + ids[3:]) == text
  # As in Qwen2, id 0 is a real token ('!'), the id our pipelines pad with.
  assert tokenizer.id_to_token(0) == "!" and list(vocab.encode("wow!"))[-1] == 0
  assert vocab == hf_vocabularies.HfTokenizerVocabulary(str(path))
  assert vocab != hf_vocabularies.HfTokenizerVocabulary(str(path), eos_token="!")
  copied = copy.deepcopy(vocab)  # seqio may copy vocabularies; the copy reads the same file
  assert copied == vocab and list(copied.encode(TEXTS[0])) == list(vocab.encode(TEXTS[0]))


def test_tokenizer_vocabulary_is_recorded_by_its_file_contents(hf_tokenizer, tmp_path):
  """MODEL_DIR/vocabulary.json names a tokenizer.json by sha256, so a run read with another
  tokenizer of the same size is refused, and the same file elsewhere is accepted."""
  import hashlib  # pylint: disable=g-import-not-at-top
  from decal_jax import vocabulary_record  # pylint: disable=g-import-not-at-top
  from decal_jax.data import vocabularies  # pylint: disable=g-import-not-at-top
  tokenizer, path = hf_tokenizer
  identity = vocabularies.vocabulary_identity(hf_vocabularies.HfTokenizerVocabulary(str(path)))
  assert identity == {"class": "HfTokenizerVocabulary", "vocab_size": tokenizer.get_vocab_size(),
                      "file": "tokenizer.json",
                      "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
  elsewhere = tmp_path / "copy" / "tokenizer.json"
  elsewhere.parent.mkdir()
  shutil.copy(path, elsewhere)
  other = tmp_path / "other" / "tokenizer.json"
  other.parent.mkdir()
  spec = json.loads(path.read_text())
  vocab = spec["model"]["vocab"]
  vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two ids swapped: same size, other text
  other.write_text(json.dumps(spec))
  model = lambda p: types.SimpleNamespace(  # noqa: E731  (what the record reads of a model)
      input_vocabulary=hf_vocabularies.HfTokenizerVocabulary(str(p)),
      output_vocabulary=hf_vocabularies.HfTokenizerVocabulary(str(p)))
  run = tmp_path / "run"
  run.mkdir()
  vocabulary_record.write(str(run), vocabulary_record.model_record(model(path)))
  assert vocabulary_record.check(str(run), model(elsewhere)) is None
  with pytest.raises(vocabulary_record.VocabularyMismatchError, match="sha256"):
    vocabulary_record.check(str(run), model(other))


def test_tokenizer_vocabulary_in_tensorflow_through_seqio(hf_tokenizer):
  import seqio
  import tensorflow as tf
  tokenizer, path = hf_tokenizer
  vocab = hf_vocabularies.HfTokenizerVocabulary(str(path))
  want = [tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS]
  # seqio's tokenize preprocessor (encode_tf on each example's string scalar), then EOS.
  features = {"targets": seqio.Feature(vocab, add_eos=True)}
  ds = tf.data.Dataset.from_tensor_slices({"targets": TEXTS})
  ds = seqio.preprocessors.append_eos(seqio.preprocessors.tokenize(ds, features), features)
  got = [list(ex["targets"]) for ex in ds.as_numpy_iterator()]
  assert got == [ids + [vocab.eos_id] for ids in want]
  ragged = vocab.encode_tf(tf.constant(TEXTS))  # a batch of strings -> [b, (t)]
  assert isinstance(ragged, tf.RaggedTensor) and ragged.to_list() == want
  assert vocab.encode_tf(tf.constant("")).shape == (0,)
  # decode_tf: one sequence -> a scalar; [b, t] -> [b] cut at EOS (seqio pads after EOS
  # with 0, which is '!' here); ragged [b, (t)] -> [b]; inside tf.function and tf.data.
  eos, width = vocab.eos_id, max(len(ids) for ids in want) + 2
  dense = np.zeros((len(want), width), np.int32)
  for row, ids in zip(dense, want):
    row[:len(ids) + 1] = ids + [eos]
  texts = [t.encode() for t in TEXTS]
  assert vocab.decode_tf(tf.constant(want[0])).numpy() == texts[0]
  assert vocab.decode_tf(tf.constant(dense)).numpy().tolist() == texts
  assert vocab.decode_tf(tf.ragged.constant(want)).numpy().tolist() == texts
  traced = tf.function(vocab.decode_tf).get_concrete_function(
      tf.TensorSpec([None, width], tf.int32))
  assert traced.output_shapes.as_list() == [None]
  assert traced(tf.constant(dense)).numpy().tolist() == texts
  mapped = tf.data.Dataset.from_tensor_slices(dense).map(vocab.decode_tf)
  assert list(mapped.as_numpy_iterator()) == texts


def test_tokenizer_vocabulary_reports_what_is_missing_on_use(hf_tokenizer, tmp_path, monkeypatch):
  monkeypatch.delenv(hf_vocabularies.TOKENIZER_JSON_ENV, raising=False)
  vocab = hf_vocabularies.HfTokenizerVocabulary()  # builds without a file ...
  with pytest.raises(FileNotFoundError, match="QWEN2_TOKENIZER.*DECAL_HF_TOKENIZER"):
    _ = vocab.vocab_size  # ... and says what to bind when used
  monkeypatch.setenv(hf_vocabularies.TOKENIZER_JSON_ENV, str(hf_tokenizer[1]))
  assert hf_vocabularies.HfTokenizerVocabulary().eos_id == hf_tokenizer[0].token_to_id("<|endoftext|>")
  _, bare = _write_tokenizer(tmp_path / "bare", eos_in_config=False)
  with pytest.raises(ValueError, match="names no EOS token.*eos_token"):
    _ = hf_vocabularies.HfTokenizerVocabulary(str(bare)).eos_id
  assert hf_vocabularies.HfTokenizerVocabulary(str(bare), eos_token="!").eos_id == 0
  with pytest.raises(ValueError, match="'<eos>' is not in"):
    _ = hf_vocabularies.HfTokenizerVocabulary(str(bare), eos_token="<eos>").eos_id


# ------------------------------------------------------------------------------ Squid
SQUID_SMALL = dict(TINY, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=64, num_hidden_layers=1)
SQUID_LARGE = dict(TINY, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=96, num_hidden_layers=2, vocab_size=128)


@pytest.fixture(scope="module")
def squid_checkpoints(tmp_path_factory):
  """A tied Qwen2 (small, emb 32) and an untied one (large, emb 48, more vocab rows), each
  saved with the same tokenizer.json, as Qwen2-0.5B and Qwen2-7B are."""
  root = tmp_path_factory.mktemp("squid_hf")
  for i, (name, tied, sizes) in enumerate((("small", True, SQUID_SMALL),
                                           ("large", False, SQUID_LARGE))):
    config = transformers.Qwen2Config(tie_word_embeddings=tied, rope_theta=1e6, **sizes)
    _randomize(transformers.Qwen2ForCausalLM(config), seed=10 + i).save_pretrained(
        root / name, safe_serialization=True)
    _write_tokenizer(root / name)
  return root / "small", root / "large"


def test_import_tool_builds_squid_from_two_checkpoints(squid_checkpoints, tmp_path, capsys):
  from decal_jax.networks.squid import Squid
  small, large = squid_checkpoints
  out = tmp_path / "squid"
  assert _tool_module().main(["--model", "squid", "--hf_dir", str(small), "--large_hf_dir",
                              str(large), "--out", str(out), "--gin_file=models/squid_tiny.gin",
                              "--gin_bindings=MEMORY_TOKENS = 4"]) == 0
  printed = capsys.readouterr().out
  assert "small/decoder.DecoderConfig.emb_dim = 32" in printed
  assert "large/decoder.DecoderConfig.tie_embeddings = False" in printed
  assert "note: gin binds large/DecoderConfig.emb_dim = 128; the checkpoint has 48" in printed
  assert (f"--gin_file=runs/squid_restore.gin --gin.INITIAL_CHECKPOINT_PATH=\"'{out}'\" "
          f"--gin.QWEN2_TOKENIZER=\"'{small / 'tokenizer.json'}'\"") in printed
  # The trainer's params: the model gin file + the written sizes (which repeat the bindings).
  gin.clear_config()
  gin.add_config_file_search_path(str(REPO / "gin"))
  gin.parse_config_files_and_bindings(["models/squid_tiny.gin", str(out / "hf_import.gin")],
                                      [], finalize_config=False)
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  gin.clear_config()
  config = model.module.config
  assert (config.memory_tokens, config.small.emb_dim, config.large.num_layers) == (4, 32, 2)
  shapes = {"encoder_input_tokens": (2, 12), "decoder_input_tokens": (2, 6),
            "query_tokens": (2, 3)}
  abstract = jax.eval_shape(lambda: model.get_initial_variables(jax.random.PRNGKey(9),
                                                                shapes)["params"])
  fresh = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)
  params, report = checkpoints.restore_matching_params(str(out), fresh)
  assert report["initialised"] == [] and report["unused"] == []
  # Each decoder holds exactly its checkpoint, as the plain import reads it.
  for name, directory in (("small_decoder", small), ("large_decoder", large)):
    want = flax.traverse_util.flatten_dict(hf_import.load_hf_params(directory)[1]["stack"])
    got = flax.traverse_util.flatten_dict(params[name])
    assert set(got) == set(want), name
    for key, value in want.items():
      np.testing.assert_array_equal(got[key], value, err_msg=f"{name}/{key}")
  assert "logits_dense" not in params["small_decoder"]  # tied, as Qwen2-0.5B
  assert params["projector"]["dense_0"]["kernel"].shape == (32, 48)
  assert params["memory_tokens"]["memory_embeddings"].shape == (4, 32)
  assert np.any(np.asarray(params["projector"]["dense_0"]["kernel"]) != 0)  # initialised
  context = np.random.RandomState(1).randint(1, VOCAB, (2, 12))  # [batch, n]
  forward = jax.jit(lambda p, c, q, a: Squid(config).apply({"params": p}, c, a, query_tokens=q,
                                                          enable_dropout=False))
  query, answer = TOKENS[:, :3], TOKENS[:, 3:9]  # no 0 (padding) among them
  logits = np.asarray(forward(params, context, query, answer))  # [batch, 6, large vocab]
  want = _torch_squid(small, large, params, config, context, query, answer)
  # Two float32 programs (XLA, PyTorch) of the same sums: the bound for their reordering.
  # The sums on the path: per layer q/k/v (emb), attention (its keys), out (emb), MLP in
  # (emb) and out (mlp); small: 1 layer, emb 32, 16 keys; projector 32, 48; large: 2 layers,
  # emb 48, 13 keys; logits 48.
  reductions = [32, 16, 32, 32, 64] + [32, 48] + [48, 13, 48, 48, 96] * 2 + [48]
  np.testing.assert_allclose(logits, want, rtol=0,
                             atol=tolerances.network_atol(want, reductions))


def _torch_squid(small_dir, large_dir, params, config, context, query, answer):
  """Squid's answer logits `[batch, t, vocab]` from transformers' Qwen2 models: the small one
  reads [context; memory table] embeddings, its final (normed) states at the memory slots go
  through the projector (written out here), the large one reads [memory; query; answer]."""
  small = transformers.Qwen2ForCausalLM.from_pretrained(small_dir).eval()
  large = transformers.Qwen2ForCausalLM.from_pretrained(large_dir).eval()
  table = torch.tensor(np.asarray(params["memory_tokens"]["memory_embeddings"]))  # [N, 32]
  projector = params["projector"]
  assert config.memory_ratio is None and config.projector_activation == "gelu"
  with torch.no_grad():
    x = torch.cat([small.get_input_embeddings()(torch.tensor(context)),
                   table.expand(len(context), -1, -1)], 1)  # [batch, n + N, 32]
    memory = small.model(inputs_embeds=x).last_hidden_state[:, context.shape[1]:]
    for i in range(config.projector_layers):
      memory = (memory @ torch.tensor(np.asarray(projector[f"dense_{i}"]["kernel"]))
                + torch.tensor(np.asarray(projector[f"bias_{i}"])))  # [batch, N, width]
      if i < config.projector_layers - 1:
        memory = torch.nn.functional.gelu(memory, approximate="tanh")
    embed = large.get_input_embeddings()
    y = torch.cat([memory, embed(torch.tensor(query)), embed(torch.tensor(answer))], 1)
    return large(inputs_embeds=y).logits[:, -answer.shape[1]:].numpy()  # [batch, t, 128]


def test_import_tool_refuses_a_half_given_squid(squid_checkpoints, tmp_path, capsys):
  small, large = squid_checkpoints
  tool, out = _tool_module(), str(tmp_path / "never")
  with pytest.raises(SystemExit):
    tool.main(["--model", "squid", "--hf_dir", str(small), "--out", out])
  assert "--model squid needs --large_hf_dir" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    tool.main(["--hf_dir", str(small), "--large_hf_dir", str(large), "--out", out])
  assert "--large_hf_dir is for --model squid only" in capsys.readouterr().err
  other = shutil.copytree(large, tmp_path / "other_tokenizer")
  (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace(
      '"<|endoftext|>"', '"<|end|>"'))
  with pytest.raises(SystemExit, match="map tokens to different ids"):
    tool.main(["--model", "squid", "--hf_dir", str(small), "--large_hf_dir", str(other),
               "--out", out])
  assert not (tmp_path / "never").exists()


# ------------------------------------------------------------------------------ id 0 remap
# Our pipelines pad with id 0, which is '!' in byte-level BPE: zero_id_to moves it.
BANG_TEXTS = ["Hello!", "!!! wow!", "Hello world! How are you? Fine, thanks."]


def _free_id(tokenizer, past=7):
  """An id the tokenizer never produces: past its last one (added tokens included)."""
  return tokenizer.get_vocab_size(with_added_tokens=True) + past


def _with_zero_as(ids, zero_id_to):
  return [zero_id_to if i == 0 else i for i in ids]


def test_zero_id_to_round_trips_a_standalone_bang(hf_tokenizer):
  tokenizer, path = hf_tokenizer
  free = _free_id(tokenizer)
  vocab = hf_vocabularies.HfTokenizerVocabulary(str(path), zero_id_to=free)
  assert vocab.zero_id_to == free and vocab.vocab_size == free + 1
  eos = tokenizer.token_to_id("<|endoftext|>")
  assert vocab.eos_id == eos  # other ids keep the tokenizer's values
  hello = tokenizer.encode("Hello!", add_special_tokens=False).ids
  assert hello[-1] == 0 and tokenizer.id_to_token(0) == "!"  # '!' on its own is id 0
  for text in BANG_TEXTS + TEXTS:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    ours = list(vocab.encode(text))
    assert 0 not in ours and ours == _with_zero_as(ids, free)
    assert vocab.decode(ours) == text
    # Id 0 is padding / BOS now: skipped before, between (never produced) and after EOS.
    assert vocab.decode([0, 0] + ours + [eos, 0, 0]) == text
  assert list(vocab.encode("Hello!"))[-1] == free and vocab.decode([free]) == "!"
  # The vocabulary without the remap is another vocabulary (gin / seqio compare them).
  plain = hf_vocabularies.HfTokenizerVocabulary(str(path))
  assert vocab != plain and plain.zero_id_to is None and list(plain.encode("Hello!")) == hello
  copied = copy.deepcopy(vocab)
  assert copied == vocab and copied.zero_id_to == free


def test_zero_id_to_round_trips_in_tensorflow(hf_tokenizer):
  import seqio
  import tensorflow as tf
  tokenizer, path = hf_tokenizer
  free = _free_id(tokenizer)
  vocab = hf_vocabularies.HfTokenizerVocabulary(str(path), zero_id_to=free)
  want = [_with_zero_as(tokenizer.encode(t, add_special_tokens=False).ids, free)
          for t in BANG_TEXTS]
  assert all(0 not in ids and free in ids for ids in want)
  assert vocab.encode_tf(tf.constant("Hello!")).numpy().tolist() == want[0]
  assert vocab.encode_tf(tf.constant(BANG_TEXTS)).to_list() == want
  features = {"targets": seqio.Feature(vocab, add_eos=True)}
  ds = tf.data.Dataset.from_tensor_slices({"targets": BANG_TEXTS})
  ds = seqio.preprocessors.append_eos(seqio.preprocessors.tokenize(ds, features), features)
  assert [list(ex["targets"]) for ex in ds.as_numpy_iterator()] == \
      [ids + [vocab.eos_id] for ids in want]
  # [b, t] as the models emit it: BOS 0 first, EOS, then 0-padding.
  eos, width = vocab.eos_id, max(len(ids) for ids in want) + 3
  dense = np.zeros((len(want), width), np.int32)
  for row, ids in zip(dense, want):
    row[1:len(ids) + 2] = ids + [eos]
  texts = [t.encode() for t in BANG_TEXTS]
  assert vocab.decode_tf(tf.constant(dense)).numpy().tolist() == texts
  assert vocab.decode_tf(tf.ragged.constant(want)).numpy().tolist() == texts
  assert vocab.decode_tf(tf.constant(want[0])).numpy() == b"Hello!"


def test_zero_id_to_refuses_an_id_the_tokenizer_uses(hf_tokenizer):
  tokenizer, path = hf_tokenizer
  used = tokenizer.token_to_id("<|endoftext|>")
  for zero_id_to in (5, used):
    vocab = hf_vocabularies.HfTokenizerVocabulary(str(path), zero_id_to=zero_id_to)  # lazy ...
    with pytest.raises(ValueError, match=rf"zero_id_to={zero_id_to} is the id of the token "
                                         rf"'{re.escape(tokenizer.id_to_token(zero_id_to))}'"):
      vocab.encode("Hello!")  # ... refused on first use, before anything is encoded
  for bad in (0, -3, True, "151935", 2.5):
    with pytest.raises(ValueError, match="zero_id_to"):
      hf_vocabularies.HfTokenizerVocabulary(str(path), zero_id_to=bad)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def qwen2_over_tokenizer(request, hf_tokenizer, tmp_path_factory):
  """A tiny Qwen2 whose table covers the tiny tokenizer plus 12 padding rows, as Qwen2's
  tables are padded past its tokenizer; tied (as 0.5B) or with an LM head (as 7B)."""
  rows = hf_tokenizer[0].get_vocab_size(with_added_tokens=True) + 12
  config = transformers.Qwen2Config(tie_word_embeddings=request.param, rope_theta=1e6,
                                    **dict(TINY, vocab_size=rows))
  model = _randomize(transformers.Qwen2ForCausalLM(config), seed=20 + request.param)
  directory = tmp_path_factory.mktemp("qwen2_tied" if request.param else "qwen2_untied")
  model.save_pretrained(directory, safe_serialization=True)
  return model, directory, rows


def test_remapped_import_gives_the_checkpoints_logits_on_text_with_bangs(
    hf_tokenizer, qwen2_over_tokenizer):
  tokenizer, path = hf_tokenizer
  model, directory, rows = qwen2_over_tokenizer
  free = rows - 1  # the table's last row, as 151935 in Qwen2-0.5B's
  vocab = hf_vocabularies.HfTokenizerVocabulary(str(path), zero_id_to=free)
  config, params = hf_import.load_hf_params(directory)
  remapped = hf_import.remap_zero_row(params, free)
  for text in BANG_TEXTS:
    theirs = np.array([tokenizer.encode(text, add_special_tokens=False).ids])  # [1, t]
    ours = np.array([list(vocab.encode(text))])  # [1, t]: '!' as `free`
    assert 0 in theirs and 0 not in ours and free in ours
    want = _torch_logits(model, theirs)  # [1, t, rows]
    got = _our_logits(config, remapped, ours)  # [1, t, rows]
    np.testing.assert_allclose(got[..., free], want[..., 0], atol=1e-4, rtol=1e-4)  # '!'
    np.testing.assert_allclose(got[..., 1:free], want[..., 1:free], atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(got[..., 0], 0.0)  # padding: a zero row / column
    # Without the remap, '!' would be read as the padding row: the logits differ.
    assert not np.allclose(_our_logits(config, remapped, theirs), want, atol=1e-2)
  stack, original = remapped["stack"], params["stack"]
  np.testing.assert_array_equal(stack["token_embedder"]["embedding"][0], 0.0)
  np.testing.assert_array_equal(original["token_embedder"]["embedding"][0],  # input kept
                                model.model.embed_tokens.weight[0].detach().numpy())


def test_remap_zero_row_refuses_an_id_outside_the_table(qwen2_over_tokenizer):
  _, directory, rows = qwen2_over_tokenizer
  _, params = hf_import.load_hf_params(directory)
  for beyond in (rows, rows + 5):
    with pytest.raises(ValueError, match=rf"zero_id_to={beyond} is beyond "
                                         rf"token_embedder/embedding \({rows} rows"):
      hf_import.remap_zero_row(params, beyond)
  with pytest.raises(ValueError, match="must be a positive id"):
    hf_import.remap_zero_row(params, 0)


# ------------------------------------------------------------------------------ the tool, remapped
@pytest.fixture(scope="module")
def squid_checkpoints_over_tokenizer(tmp_path_factory):
  """Qwen2 pairs as 0.5B / 7B: tied small, untied large, both tables padded past the tiny
  tokenizer (small by 8 rows, large by 24), one tokenizer.json beside each."""
  root = tmp_path_factory.mktemp("squid_remap")
  _write_tokenizer(root / "small")
  tokens = json.loads((root / "small" / "tokenizer.json").read_text())
  size = 1 + max(list(tokens["model"]["vocab"].values()) +
                 [t["id"] for t in tokens["added_tokens"]])
  for i, (name, tied, sizes, pad) in enumerate((("small", True, SQUID_SMALL, 8),
                                                ("large", False, SQUID_LARGE, 24))):
    config = transformers.Qwen2Config(tie_word_embeddings=tied, rope_theta=1e6,
                                      **dict(sizes, vocab_size=size + pad))
    model = _randomize(transformers.Qwen2ForCausalLM(config), seed=30 + i)
    model.save_pretrained(root / name, safe_serialization=True)
    _write_tokenizer(root / name)
  return root / "small", root / "large", size


def _remap_gin(tmp_path, tokenizer_json, zero_id_to):
  """models/squid_tiny.gin with the checkpoints' tokenizer.json as VOCABULARY, remapping."""
  path = tmp_path / f"squid_remap_{zero_id_to}.gin"
  path.write_text("\n".join([
      "from __gin__ import dynamic_registration", "from decal_jax.data import hf_vocabularies",
      "include 'models/squid_tiny.gin'", "VOCABULARY = @hf_vocabularies.HfTokenizerVocabulary()",
      f"hf_vocabularies.HfTokenizerVocabulary.path = '{tokenizer_json}'",
      f"hf_vocabularies.HfTokenizerVocabulary.zero_id_to = {zero_id_to}", "MEMORY_TOKENS = 4", ""]))
  return str(path)


def _torch_weight(directory, name):
  return safetensors_torch.load_file(str(directory / "model.safetensors"))[name].numpy()


def test_import_tool_remaps_both_squid_decoders_from_the_gin_vocabulary(
    squid_checkpoints_over_tokenizer, tmp_path, capsys):
  small, large, size = squid_checkpoints_over_tokenizer
  free, out = size + 7, tmp_path / "squid"  # the small table's last row
  gin_file = _remap_gin(tmp_path, small / "tokenizer.json", free)
  assert _tool_module().main(["--model", "squid", "--hf_dir", str(small), "--large_hf_dir",
                              str(large), "--out", str(out), f"--gin_file={gin_file}"]) == 0
  printed = capsys.readouterr().out
  assert f"hf_vocabularies.HfTokenizerVocabulary.zero_id_to = {free}" in printed
  assert f"token 0 moved to id {free}" in printed
  assert json.loads((out / "hf_import.json").read_text())["zero_id_to"] == free
  # The trainer's model from the model gin + hf_import.gin reads '!' as `free` ...
  gin.clear_config()
  gin.add_config_file_search_path(str(REPO / "gin"))
  gin.parse_config_files_and_bindings([gin_file, str(out / "hf_import.gin")], [],
                                      finalize_config=False)
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  gin.clear_config()
  assert model.output_vocabulary.encode("Hello!")[-1] == free
  # ... and both decoders hold token 0's weights there (the checkpoints' own tensors).
  shapes = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 4),
            "query_tokens": (1, 2)}
  abstract = jax.eval_shape(lambda: model.get_initial_variables(jax.random.PRNGKey(0),
                                                                shapes)["params"])
  fresh = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)
  params, report = checkpoints.restore_matching_params(str(out), fresh)
  assert report["initialised"] == [] and report["unused"] == []
  for name, directory in (("small_decoder", small), ("large_decoder", large)):
    table = _torch_weight(directory, "model.embed_tokens.weight")  # [rows, embed]
    ours = np.asarray(params[name]["token_embedder"]["embedding"])
    np.testing.assert_array_equal(ours[free], table[0])
    np.testing.assert_array_equal(ours[0], 0.0)
    keep = np.r_[1:free, free + 1:len(table)]
    np.testing.assert_array_equal(ours[keep], table[keep])
  head = _torch_weight(large, "lm_head.weight")  # [rows, embed]
  kernel = np.asarray(params["large_decoder"]["logits_dense"]["kernel"])  # [embed, rows]
  np.testing.assert_array_equal(kernel[:, free], head[0])
  np.testing.assert_array_equal(kernel[:, 0], 0.0)
  np.testing.assert_array_equal(kernel[:, 1:free], head[1:free].T)


def test_import_tool_refuses_a_remap_that_does_not_fit(squid_checkpoints_over_tokenizer,
                                                       tmp_path):
  small, large, size = squid_checkpoints_over_tokenizer
  tool, out = _tool_module(), str(tmp_path / "never")
  squid = ["--model", "squid", "--hf_dir", str(small), "--large_hf_dir", str(large),
           "--out", out]
  tokenizer_json = small / "tokenizer.json"
  # Past the small table (size + 8 rows), though inside the large one.
  with pytest.raises(SystemExit, match=rf"zero_id_to={size + 8} is beyond the embedding "
                                       rf"table of {re.escape(str(small))}"):
    tool.main(squid + [f"--gin_file={_remap_gin(tmp_path, tokenizer_json, size + 8)}"])
  # A token of the tokenizer.
  with pytest.raises(SystemExit, match="zero_id_to=5 is the id of the token"):
    tool.main(squid + [f"--gin_file={_remap_gin(tmp_path, tokenizer_json, 5)}"])
  # A flag that disagrees with the gin vocabulary (here: one that does not remap).
  with pytest.raises(SystemExit, match=r"--zero_id_to 9 differs from the gin VOCABULARY's "
                                       r"zero_id_to \(None"):
    tool.main(squid + ["--gin_file=models/squid_tiny.gin", "--zero_id_to", "9"])
  # --model decoder remaps only when asked, and refuses ids past its table.
  with pytest.raises(SystemExit, match=rf"zero_id_to={size + 24} is beyond"):
    tool.main(["--model", "decoder", "--hf_dir", str(large), "--out", out,
               "--zero_id_to", str(size + 24)])
  assert not (tmp_path / "never").exists()


def test_import_tool_remaps_a_plain_decoder_when_asked(squid_checkpoints_over_tokenizer,
                                                       tmp_path):
  _, large, size = squid_checkpoints_over_tokenizer
  free, out = size + 23, tmp_path / "decoder"
  assert _tool_module().main(["--model", "decoder", "--hf_dir", str(large), "--out", str(out),
                              "--zero_id_to", str(free)]) == 0
  assert f"zero_id_to = {free}" in (out / "hf_import.gin").read_text()
  config = hf_import.config_from_hf(hf_import.read_hf_config(large))
  abstract = jax.eval_shape(lambda: Decoder(config).init(
      jax.random.PRNGKey(0), jnp.ones((1, 2), jnp.int32), enable_dropout=False))["params"]
  params, report = checkpoints.restore_matching_params(
      str(out), jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), abstract))
  assert report["initialised"] == [] and report["unused"] == []
  table = _torch_weight(large, "model.embed_tokens.weight")
  np.testing.assert_array_equal(params["stack"]["token_embedder"]["embedding"][free], table[0])
  np.testing.assert_array_equal(params["stack"]["logits_dense"]["kernel"][:, 0], 0.0)
