"""Merging an imported decoder into a fresh Dodo (scorer, soft prompt and LoRA kept), the
SentencePiece vocabulary of a checkpoint, and `tools/import_hf.py` writing a checkpoint the
trainer starts from.

Against transformers' PyTorch models; skipped without the `[test-hf]` extra
(hf_import_helpers.py).
"""
import dataclasses

import flax
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax.interop import hf_import, hf_params
from decal_jax.runtime import checkpoints
from decal_jax.data import hf_vocabularies
from decal_jax.networks import decoder
from decal_jax.networks.dodo import Dodo, DodoConfig
from hf_import_helpers import REPO, TOKENS, _torch_logits, _run_tool, _tool_module


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
