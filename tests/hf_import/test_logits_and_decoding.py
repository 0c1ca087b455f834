"""Imported LLaMA / Qwen2 checkpoints give transformers' logits (float32 to 1e-4; sharded
and bf16 checkpoints) and its cached greedy generation.

Against transformers' PyTorch models; skipped without the `[test-hf]` extra
(hf_import_helpers.py).
"""
import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax.interop import hf_import
from decal_jax.networks.decoder import Decoder
from hf_import_helpers import torch, TOKENS, _torch_logits, _our_logits


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
