"""`tools/import_hf.py --model squid`: a Squid built from two Qwen2 checkpoints, against a
PyTorch composition of the two models.

Against transformers' PyTorch models; skipped without the `[test-hf]` extra
(hf_import_helpers.py).
"""
import shutil

import flax
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax.interop import hf_import
from decal_jax.runtime import checkpoints
import tolerances
from hf_import_helpers import (
    torch, transformers, REPO, VOCAB, TOKENS, SQUID_SMALL, SQUID_LARGE, _saved_random,
    _write_tokenizer, _tool_module)


# ------------------------------------------------------------------------------ Squid
@pytest.fixture(scope="module")
def squid_checkpoints(tmp_path_factory):
  """A tied Qwen2 (small, emb 32) and an untied one (large, emb 48, more vocab rows), each
  saved with the same tokenizer.json, as Qwen2-0.5B and Qwen2-7B are."""
  root = tmp_path_factory.mktemp("squid_hf")
  for i, (name, tied, sizes) in enumerate((("small", True, SQUID_SMALL),
                                           ("large", False, SQUID_LARGE))):
    config = transformers.Qwen2Config(tie_word_embeddings=tied, rope_theta=1e6, **sizes)
    _saved_random(transformers.Qwen2ForCausalLM, config, 10 + i, root / name)
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
