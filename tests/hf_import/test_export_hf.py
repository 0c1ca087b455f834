"""Exports to Hugging Face (interop/hf_export.py, commands/export_hf.py): transformers' own
classes load what we write and compute our logits and greedy tokens; importing an export
gives the params back exactly; the decal_jax safetensors layout round-trips bit for bit.

Logit tolerances: both sides compute the same float32 mathematics from the same weights,
summing in other orders (XLA against PyTorch kernels), so `tolerances.network_atol` bounds
the gap: 8 eps sqrt(K) max|logits|, K the lengths of the sums on the path (per layer q/k/v,
attention over the keys, the output projection, the MLP's two matmuls; then the head; for
T5 the encoder's and the decoder's stacks and the cross-attention). A merged LoRA kernel
W + s A B rounds once more than the unmerged x W + s (x A) B: one more emb_dim-term sum per
projection, inside the same bound's margin (measured gaps are 1/10 to 1/50 of it).

Skipped without the `[test-hf]` extra (hf_import_helpers.py).
"""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_import_helpers import torch, transformers, TOKENS, _our_logits, _torch_logits
from decal_jax.interop import hf_export, hf_import
from decal_jax.networks import dodo, t5
from decal_jax.networks.decoder import Decoder, DecoderConfig
import tolerances

LLAMA = DecoderConfig(vocab_size=101, emb_dim=64, num_heads=4, num_kv_heads=2, head_dim=24,
                      mlp_dim=112, num_layers=2, rope_theta=5e5, norm_epsilon=1e-5,
                      max_length=64)
QWEN2 = dataclasses.replace(LLAMA, head_dim=16, rope_theta=1e6, norm_epsilon=1e-6,
                            qkv_bias=True, tie_embeddings=True)
T5_TINY = t5.T5Config(vocab_size=101, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=48,
                      num_encoder_layers=2, num_decoder_layers=2,
                      relative_attention_max_distance=16)
STEPS = 8


def _randomized(params, seed):
  """Every leaf matters: norm scales near 1, everything else N(0, 0.2) (LoRA B included)."""
  leaves, tree = jax.tree_util.tree_flatten_with_path(params)
  rng = np.random.RandomState(seed)
  def value(path, leaf):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return rng.uniform(0.5, 1.5, leaf.shape).astype(np.float32)
    return (0.2 * rng.standard_normal(leaf.shape)).astype(np.float32)
  return jax.tree_util.tree_unflatten(tree, [value(p, x) for p, x in leaves])


def _decoder_params(config, seed):
  tokens = jnp.ones((1, 4), jnp.int32)
  params = Decoder(config).init(jax.random.PRNGKey(0), tokens, enable_dropout=False)["params"]
  return _randomized(params, seed)


def _atol(ours, config, keys):
  return tolerances.network_atol(ours, tolerances.stack_reductions(config, keys))


def _hf_greedy(model, prompt, **kwargs):
  with torch.no_grad():
    out = model.generate(torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=int),
                         max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, **kwargs)
  return out.numpy()


def _decoder_greedy(config, params, prompt):
  """Our uncached greedy decoding, one fixed shape (causal: later slots never matter)."""
  forward = jax.jit(lambda p, t: Decoder(config).apply({"params": p}, t, enable_dropout=False))
  tokens = np.zeros((prompt.shape[0], prompt.shape[1] + STEPS), np.int32)
  tokens[:, :prompt.shape[1]] = prompt
  for i in range(prompt.shape[1], tokens.shape[1]):
    tokens[:, i] = np.argmax(np.asarray(forward(params, tokens))[:, i - 1], axis=-1)
  return tokens[:, prompt.shape[1]:]


def _same_leaves(a, b):
  fa, fb = hf_export._flat(a), hf_export._flat(b)
  assert sorted(fa) == sorted(fb)
  for k in fa:
    assert np.asarray(fa[k]).dtype == np.asarray(fb[k]).dtype, k
    np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


# ------------------------------------------------------------------------------ decoders
@pytest.mark.parametrize("config,family,model_class", [
    (LLAMA, "llama", "LlamaForCausalLM"), (QWEN2, "qwen2", "Qwen2ForCausalLM")])
def test_decoder_export_loads_in_transformers_with_our_logits_and_tokens(
    config, family, model_class, tmp_path):
  params = _decoder_params(config, 0)
  written = hf_export.export_decoder(params, config, tmp_path)
  assert written["architectures"] == [model_class] and written["model_type"] == family
  model, info = getattr(transformers, model_class).from_pretrained(tmp_path,
                                                                   output_loading_info=True)
  assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
  ours, theirs = _our_logits(config, params, TOKENS), _torch_logits(model.eval(), TOKENS)
  atol = _atol(ours, config, TOKENS.shape[1])
  gap = float(np.abs(ours - theirs).max())
  assert gap <= atol, f"{family}: max |logit gap| {gap:.2e} > {atol:.2e}"
  prompt = TOKENS[:, :5]
  expected = _hf_greedy(model, prompt, pad_token_id=0)[:, prompt.shape[1]:]
  np.testing.assert_array_equal(_decoder_greedy(config, params, prompt), expected)


@pytest.mark.parametrize("config", [LLAMA, QWEN2], ids=["llama", "qwen2"])
def test_importing_an_export_gives_the_params_back_exactly(config, tmp_path):
  params = _decoder_params(config, 1)
  hf_export.export_decoder(params, config, tmp_path)
  imported_config, imported = hf_import.load_hf_params(tmp_path)
  assert imported_config == config  # sizes, rms eps, rope theta, bias, tying
  _same_leaves(params, imported)


def test_a_family_the_decoder_cannot_be_is_refused(tmp_path):
  with pytest.raises(ValueError, match="export it as 'qwen2'"):
    hf_export.export_decoder(_decoder_params(QWEN2, 0), QWEN2, tmp_path, family="llama")


def test_zero_id_row_moves_back_to_zero():
  stack = _decoder_params(LLAMA, 2)["stack"]
  moved = hf_import.remap_zero_row({"stack": stack}, 100)["stack"]
  back = hf_export.restore_zero_row(moved, 100)
  for name, axis in (("token_embedder/embedding", 0), ("logits_dense/kernel", 1)):
    original, restored = (hf_export._flat(s)[name] for s in (stack, back))
    np.testing.assert_array_equal(np.take(restored, 0, axis), np.take(original, 0, axis))
    assert not np.take(restored, 100, axis).any()


# ------------------------------------------------------------------------------ Dodo
def _dodo_params(config, seed):
  tokens = jnp.ones((1, 8), jnp.int32)
  params = dodo.Dodo(config).init(jax.random.PRNGKey(0), encoder_input_tokens=tokens,
                                  decoder_input_tokens=tokens, decoder_target_tokens=tokens,
                                  decode=False, enable_dropout=False)["params"]
  return _randomized(params, seed)


def _with_adapter_logits(config, params, tokens, adapter):
  """Dodo's decoder stack with `adapter` active, as a plain causal LM."""
  def forward(module, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    from decal_jax.networks.decoder import causal_bias
    x = module.stack(module.stack.embed(tokens), positions,
                     causal_bias(positions, None, jnp.float32), adapter=adapter)
    return module.stack.logits(x)
  return np.asarray(Decoder(config).apply({"params": {"stack": params["stack"]}},
                                          jnp.asarray(tokens), method=forward))


def test_command_exports_dodo_with_its_decoding_adapter_merged(tmp_path):
  """The whole command on a saved Dodo checkpoint (LoRA rank 4): the LLaMA it writes computes
  Dodo's decoding pass (adapter 'decode' on), and the README names the vocabulary."""
  from decal_jax.commands import export_hf
  from decal_jax.runtime import checkpoints
  bindings = ["LORA_RANK = 4", "decoder.DecoderConfig.vocab_size = 101",
              "decoder.DecoderConfig.emb_dim = 64", "decoder.DecoderConfig.num_layers = 2",
              "decoder.DecoderConfig.mlp_dim = 112", "decoder.DecoderConfig.head_dim = 16",
              "decoder.DecoderConfig.max_length = 64", "SCORER_LAYER = 1"]
  config = dodo.DodoConfig(decoder=dataclasses.replace(
      DecoderConfig(), vocab_size=101, emb_dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
      mlp_dim=112, num_layers=2, max_length=64, lora_rank=4), scorer_layer=1)
  params = _dodo_params(config, 3)
  ckpt = checkpoints.Checkpointer(str(tmp_path / "run"), keep=1)
  ckpt.save(7, {"params": params}, {}, force=True)
  ckpt.close()
  out = tmp_path / "hf"
  assert export_hf.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out),
                         "--gin_file", "models/dodo_tiny.gin",
                         *(f"--gin_bindings={b}" for b in bindings)]) == 0
  readme = (out / "README.md").read_text()
  assert "LoRA adapter 'decode' merged" in readme and "vocabulary" in readme
  model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
  network = dodo.with_adapters(config.decoder)
  ours = _with_adapter_logits(network, params, TOKENS, "decode")
  theirs = _torch_logits(model, TOKENS)
  atol = _atol(ours, config.decoder, TOKENS.shape[1])
  gap = float(np.abs(ours - theirs).max())
  assert gap <= atol, f"Dodo (merged LoRA): max |logit gap| {gap:.2e} > {atol:.2e}"
  base = _with_adapter_logits(network, params, TOKENS, None)
  assert np.abs(base - theirs).max() > 100 * atol  # the adapter really was merged


def test_a_tokenizer_json_vocabulary_is_copied(hf_tokenizer, tmp_path):
  from decal_jax.commands import export_hf
  from decal_jax.data import hf_vocabularies
  _, path = hf_tokenizer
  vocabulary = hf_vocabularies.HfTokenizerVocabulary(str(path), zero_id_to=400)
  zero_id_to, special, line = export_hf.vocabulary_files(vocabulary, tmp_path)
  assert zero_id_to == 400 and "back at 0" in line
  assert (tmp_path / "tokenizer.json").read_bytes() == path.read_bytes()
  assert special["eos_token_id"] == vocabulary.eos_id
  tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
  assert tokenizer.eos_token == "<|endoftext|>"


# ------------------------------------------------------------------------------ T5
@functools.lru_cache(maxsize=None)
def _t5_forward(config):
  return jax.jit(lambda p, e, d: t5.Transformer(config).apply(
      {"params": p}, e, d, d, enable_dropout=False))


def _t5_params(config, seed):
  tokens = jnp.ones((1, 8), jnp.int32)
  params = t5.Transformer(config).init(jax.random.PRNGKey(0), tokens, tokens, tokens,
                                       enable_dropout=False)["params"]
  return _randomized(params, seed)


def _t5_atol(ours, config, keys):
  per_layer = [config.emb_dim, keys, config.num_heads * config.head_dim, config.emb_dim,
               config.mlp_dim]
  reductions = per_layer * (config.num_encoder_layers + 2 * config.num_decoder_layers)
  return tolerances.network_atol(ours, reductions + [config.emb_dim])


def test_t5_export_is_t5_for_conditional_generation_with_our_logits_and_tokens(tmp_path):
  params = _t5_params(T5_TINY, 4)
  hf_export.export_t5(params, T5_TINY, tmp_path)
  model, info = transformers.T5ForConditionalGeneration.from_pretrained(
      tmp_path, output_loading_info=True)
  assert not any(info.values()), info
  model.eval()
  rng = np.random.RandomState(5)
  encoder = rng.randint(2, 101, (2, 20))  # no padding (id 0) and no EOS
  decoder = rng.randint(2, 101, (2, 7))
  decoder[:, 0] = 0  # the start token
  ours = np.asarray(_t5_forward(T5_TINY)(params, encoder, decoder))
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor(encoder),
                   decoder_input_ids=torch.tensor(decoder)).logits.numpy()
  atol = _t5_atol(ours, T5_TINY, encoder.shape[1])
  gap = float(np.abs(ours - theirs).max())
  assert gap <= atol, f"T5: max |logit gap| {gap:.2e} > {atol:.2e}"
  tokens = np.zeros((2, STEPS + 1), np.int32)
  for i in range(1, STEPS + 1):
    logits = np.asarray(_t5_forward(T5_TINY)(params, encoder, tokens))
    tokens[:, i] = np.argmax(logits[:, i - 1], axis=-1)
  expected = _hf_greedy(model, encoder, decoder_start_token_id=0, eos_token_id=None)
  np.testing.assert_array_equal(tokens, expected)


def test_t5_import_of_export_is_exact(tmp_path):
  params = _t5_params(T5_TINY, 6)
  hf_export.export_t5(params, T5_TINY, tmp_path)
  _same_leaves(params, hf_export.load_t5_params(tmp_path, T5_TINY))


def test_decal_t5_is_refused_with_a_pointer_to_the_decal_layout(tmp_path):
  decal = dataclasses.replace(T5_TINY, compression_ratio=4)
  with pytest.raises(hf_export.T5CompressionError,
                     match=r"compression_ratio=4.*decal_jax safetensors layout.*--format decal"):
    hf_export.export_t5(_t5_params(decal, 0), decal, tmp_path)
  assert not (tmp_path / "model.safetensors").exists()


def test_decal_safetensors_layout_round_trips_bitwise(tmp_path):
  decal = dataclasses.replace(T5_TINY, compression_ratio=4)
  params = _t5_params(decal, 7)
  assert any("latent" in k for k in hf_export._flat(params))
  gin_text = "t5.T5Config.compression_ratio = 4\n"
  path = hf_export.save_safetensors_params(params, tmp_path / "model.safetensors", gin_text)
  loaded, text = hf_export.load_safetensors_params(path)
  assert text == gin_text
  _same_leaves(params, loaded)
  from safetensors import safe_open
  with safe_open(str(path), framework="numpy") as f:
    metadata = f.metadata()
    assert "decoder/logits_dense/kernel" in f.keys()
  assert metadata["format"] == "decal_jax" and metadata["decal_jax_version"]
  hf_export.export_t5(_t5_params(T5_TINY, 0), T5_TINY, tmp_path / "t5")
  with pytest.raises(ValueError, match="not in the decal_jax safetensors layout"):
    hf_export.load_safetensors_params(tmp_path / "t5")
  json.loads((tmp_path / "t5" / "config.json").read_text())


# ------------------------------------------------------------------------------ Squid
def test_squid_bundle_decoders_load_in_transformers_and_the_bundle_round_trips(tmp_path):
  """small/ (LLaMA) and large/ (Qwen2) each compute our decoder stacks' logits in
  transformers; the memory tokens and projector ride in squid_joint.safetensors; loading
  the bundle gives every parameter back bit for bit; the command picks the bundle."""
  from decal_jax.commands import export_hf
  from decal_jax.networks import squid
  config = squid.SquidConfig(small=LLAMA, large=QWEN2, memory_tokens=4)
  tokens = jnp.ones((1, 8), jnp.int32)
  params = _randomized(squid.Squid(config).init(
      jax.random.PRNGKey(0), tokens, tokens[:, :4], tokens[:, :4],
      query_tokens=tokens[:, :2], enable_dropout=False)["params"], 5)
  manifest = hf_export.export_squid(params, config, tmp_path)
  assert manifest["decoders"] == {"small": "LlamaForCausalLM", "large": "Qwen2ForCausalLM"}
  assert json.loads((tmp_path / "squid.json").read_text())["memory_tokens"] == 4
  small = dataclasses.replace(LLAMA, tie_embeddings=True)  # Squid never reads its head
  for folder, decoder_config, model_class in (("small", small, "LlamaForCausalLM"),
                                               ("large", QWEN2, "Qwen2ForCausalLM")):
    model, info = getattr(transformers, model_class).from_pretrained(
        tmp_path / folder, output_loading_info=True)
    assert not any(info.values()), info
    stack = {"stack": params[f"{folder}_decoder"]}
    ours = _our_logits(decoder_config, stack, TOKENS)
    theirs = _torch_logits(model.eval(), TOKENS)
    atol = _atol(ours, decoder_config, TOKENS.shape[1])
    gap = float(np.abs(ours - theirs).max())
    assert gap <= atol, f"Squid {folder}: max |logit gap| {gap:.2e} > {atol:.2e}"
  _same_leaves(params, hf_export.load_squid_bundle(tmp_path, config))
  assert export_hf.choose_format("auto", squid.Squid, config) == "squid"


def test_command_exports_a_squid_checkpoint_as_the_bundle(tmp_path):
  """The whole command on a saved tiny Squid (models/squid_tiny.gin): auto picks the bundle,
  the README says how to load it, and the bundle loads back bit for bit."""
  from decal_jax.commands import export_hf
  from decal_jax.networks import squid
  from decal_jax.runtime import checkpoints
  network, config, _, _ = export_hf.read_model(["models/squid_tiny.gin"], [])
  assert network is squid.Squid
  tokens = jnp.ones((1, 16), jnp.int32)
  params = _randomized(squid.Squid(config).init(
      jax.random.PRNGKey(0), tokens, tokens[:, :4], tokens[:, :4],
      query_tokens=tokens[:, :2], enable_dropout=False)["params"], 6)
  ckpt = checkpoints.Checkpointer(str(tmp_path / "run"), keep=1)
  ckpt.save(3, {"params": params}, {}, force=True)
  ckpt.close()
  out = tmp_path / "bundle"
  assert export_hf.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out),
                         "--gin_file", "models/squid_tiny.gin"]) == 0
  readme = (out / "README.md").read_text()
  assert "Squid bundle" in readme and "load_squid_bundle" in readme
  assert sorted(p.name for p in out.iterdir()) == [
      "README.md", "large", "small", "squid.json", "squid_joint.safetensors"]
  _same_leaves(params, hf_export.load_squid_bundle(out, config))
