"""Hugging Face checkpoint import, checked against transformers' own PyTorch models.

Tiny random LLaMA / Qwen2 models are built and saved here (no hub access), imported with
`decal_jax.hf_import`, and our `Decoder`'s logits and cached greedy tokens compared with
the PyTorch model's: float32 to 1e-4; a bf16 checkpoint exactly (its bf16 weights in
float32) and, more loosely, against PyTorch's bf16 forward pass.
"""
import copy
import dataclasses
import functools
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

# (tests/conftest.py hides Triton, which crashes next to TensorFlow, before torch loads.)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import flax  # noqa: E402
import gin  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from decal_jax import checkpoints, hf_import, trainer  # noqa: E402
from decal_jax.networks import decoder  # noqa: E402
from decal_jax.networks.decoder import Decoder  # noqa: E402
from decal_jax.networks.dodo import Dodo, DodoConfig  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
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
  # PyTorch's bf16 forward pass rounds every activation: a loose match.
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
  params, report = hf_import.merge_base_params(init, base)
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
    hf_import.merge_base_params(_dodo_shapes(wider), base)
  tied = DodoConfig(decoder=dataclasses.replace(config, tie_embeddings=True),
                    scorer_layer=1)
  with pytest.raises(ValueError, match="no parameter for 1 imported.*logits_dense"):
    hf_import.merge_base_params(_dodo_shapes(tied), base)


# ------------------------------------------------------------------------------ vocabulary
def test_checkpoint_vocabulary_reads_a_sentencepiece_file_or_says_what_is_missing(monkeypatch):
  monkeypatch.delenv(hf_import.TOKENIZER_ENV, raising=False)
  with pytest.raises(FileNotFoundError, match="LLAMA_TOKENIZER"):
    _ = hf_import.checkpoint_vocabulary().vocab_size
  spiece = REPO.parent / "shared" / "data" / "vocab" / "t5_spiece.model"
  if not spiece.exists():
    pytest.skip(f"no SentencePiece model at {spiece}")
  monkeypatch.setenv(hf_import.TOKENIZER_ENV, str(spiece))
  vocab = hf_import.checkpoint_vocabulary()
  assert vocab.vocab_size == 32000 and vocab.extra_ids == 0  # no sentinels added


# ------------------------------------------------------------------------------ the tool
def _run_tool(*args):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([sys.executable, str(REPO / "tools" / "import_hf.py"), *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _tool_module():
  spec = importlib.util.spec_from_file_location("import_hf_tool", REPO / "tools" / "import_hf.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


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
  shapes = trainer._input_shapes(trainer.DatasetConfig("unused", {"inputs": 16, "targets": 8}))
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
