"""What the import refuses, naming it: a tensor of another shape, RoPE scalings and
architectures we do not implement, missing and unexpected tensors.

Against transformers' PyTorch models; skipped without the `[test-hf]` extra
(hf_import_helpers.py).
"""
import json

import flax
import pytest

from decal_jax.interop import hf_import
from hf_import_helpers import torch, safetensors_torch, TINY, _copy_with_config


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
