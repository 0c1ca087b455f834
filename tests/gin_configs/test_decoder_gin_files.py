"""Dodo (autoencoding, LLaMA-2 7B) and the decoder-only language model files."""
import gin
import jax
import jax.numpy as jnp
import pytest

from gin_config_helpers import _build_model, _model_param_count, _parse


# --------------------------------------------------------------------------- Dodo autoencoding
@pytest.mark.parametrize("files,bindings", [
    (["runs/dodo_autoencode_builtin.gin"], []),
    (["models/dodo_tiny.gin", "runs/dodo_autoencode.gin"],  # any Dodo model gin goes first
     ["INITIAL_CHECKPOINT_PATH = '/tmp/imported'"]),
    (["models/dodo_llama2_7b.gin", "runs/dodo_autoencode.gin"],  # the documented pairing
     ["INITIAL_CHECKPOINT_PATH = '/tmp/imported'"])])
def test_dodo_autoencode_runs_bind_every_argument(files, bindings):
  """Both run files train and evaluate: every required argument of trainer.train and
  evaluation.evaluate is bound, the task autoencodes with room for the whole input + EOS."""
  import inspect
  from decal_jax.runtime import evaluation, trainer
  _parse(*files, bindings=["MODEL_DIR = '/tmp/unused'", *bindings])
  for fn in (trainer.train, evaluation.evaluate):
    for name, p in inspect.signature(fn).parameters.items():
      if p.default is inspect.Parameter.empty and name != "gin_config_text":
        assert gin.query_parameter(f"{fn.__module__}.{fn.__name__}.{name}") is not None, name
  lengths = gin.query_parameter("%TASK_FEATURE_LENGTHS")
  assert lengths["targets"] >= lengths["inputs"]
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME").endswith("_autoencode")
  assert _build_model().module.config.compression_ratio == 10
  gin.clear_config()


def test_dodo_autoencode_gin_is_the_papers_lora_recipe():
  """dodo.md appendix B: Adam(1e-4, 0.9, 0.95, 1e-5), cosine with 2k warm-up steps; LoRA
  rank 32 on a frozen base (only adapters, scorer and soft prompt move)."""
  import numpy as np
  _parse("models/dodo_tiny.gin", "runs/dodo_autoencode.gin",
         bindings=["MODEL_DIR = '/m'", "INITIAL_CHECKPOINT_PATH = '/ckpt'"])
  model = _build_model()
  assert model.module.config.decoder.lora_rank == 32
  for name, want in (("b1", 0.9), ("b2", 0.95), ("eps", 1e-5)):
    assert gin.query_parameter(f"decal_jax.runtime.optimizers.adamw.{name}") == want
  schedule = gin.query_parameter("decal_jax.runtime.optimizers.adamw.learning_rate").scoped_configurable_fn()
  # warm-up 1e-4 * step / 2000; then 1e-4 * (1 + cos(pi * (step - 2000) / 150000)) / 2
  for step, want in ((1000, 5e-5), (2000, 1e-4), (77_000, 5e-5), (152_000, 0.0)):
    assert float(schedule(step)) == pytest.approx(want, abs=1e-10), step
  optimizer = gin.query_parameter("decal_jax.runtime.trainer.train.optimizer").scoped_configurable_fn()
  ones = jnp.ones((1, 8), jnp.int32)
  params = model.module.init(jax.random.PRNGKey(0), ones, ones, ones,
                             enable_dropout=False)["params"]
  grads = jax.tree_util.tree_map(jnp.ones_like, params)
  state = optimizer.init(params)
  for _ in range(2):  # the first step has learning rate 0 (warm-up starts at 0)
    updates, state = optimizer.update(grads, state, params)
  moved = {jax.tree_util.keystr(path): bool(np.any(np.asarray(u) != 0))
           for path, u in jax.tree_util.tree_leaves_with_path(updates)}
  trainable = ("lora_", "scorer", "soft_prompt")
  assert all(m == any(t in path for t in trainable) for path, m in moved.items()), moved
  assert any(moved.values())
  gin.clear_config()


# --------------------------------------------------------------------------- Dodo on LLaMA-2-7B
def test_dodo_llama2_7b_base_is_llama2_7b_and_counts_the_extras(monkeypatch, capsys):
  """The Dodo stack without LoRA has LLaMA-2-7B's published 6,738,415,616 parameters
  (meta-llama/Llama-2-7b-hf). Extras against dodo.md Table 5 (LoRA 25.2M per adapter at rank
  32, scorer 16.8M, soft prompt 4,096): 25.2M is exactly three projections x 32 x
  (4096 + 4096) x 32 layers, so the file adapts q, v and o (lora_targets), as the authors'
  training code does; all four would be 33.6M."""
  import flax
  monkeypatch.delenv("DECAL_LLAMA_TOKENIZER", raising=False)
  _parse("models/dodo_llama2_7b.gin")
  model = _build_model()
  _, shapes = _model_param_count(model)
  flat = flax.traverse_util.flatten_dict(shapes["params"], sep="/")
  def count(keep):
    return sum(v.size for k, v in flat.items() if keep(k))
  assert count(lambda k: k.startswith("stack/") and "/lora_" not in k) == 6_738_415_616
  projection = 32 * (4096 + 4096)  # A [4096, 32] + B [32, 4096]
  for adapter in ("compress", "decode"):
    assert count(lambda k: f"/lora_{adapter}_" in k) == 32 * 3 * projection == 25_165_824
  assert count(lambda k: k.startswith("scorer/")) == 4096 * 4096 + 4096 == 16_781_312
  assert count(lambda k: k == "soft_prompt") == 4096
  config = model.module.config
  assert (config.decoder.lora_rank, config.scorer_layer, config.compression_ratio) == (32, 3, 10)
  with capsys.disabled():
    print(f"\nDodo on LLaMA-2-7B: LoRA {count(lambda k: '/lora_decode_' in k):,} per adapter "
          f"(paper 25.2M), scorer {count(lambda k: k.startswith('scorer/')):,} (16.8M), "
          f"soft prompt {count(lambda k: k == 'soft_prompt'):,} (4,096)")
  with pytest.raises(FileNotFoundError, match="LLAMA_TOKENIZER"):
    _ = model.output_vocabulary.vocab_size  # no tokenizer.model bound: a clear error on use
  gin.clear_config()


# --------------------------------------------------------------------------- language models
@pytest.mark.parametrize("files,network", [
    (["models/decoder_tiny.gin", "runs/lm_builtin.gin"], "Decoder"),
    (["models/decoder_tiny.gin", "models/dodo_lm.gin", "runs/lm_builtin.gin"], "DodoLM")])
def test_language_model_files_build_what_they_name(files, network):
  """The plain tiny LM and Dodo's compressed-history LM on the same decoder: the decoder
  part of both has the same shapes (4 layers, 128 wide), Dodo adds only the scorer."""
  _parse(*files, bindings=["MODEL_DIR = '/tmp/lm'"])
  model = _build_model()
  assert type(model.module).__name__ == network
  assert model.DECODER_ONLY
  cfg = getattr(model.module.config, "decoder", model.module.config)
  assert (cfg.num_layers, cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads) == (4, 128, 4, 2)
  if network == "DodoLM":
    assert (model.module.config.compression_ratio, model.module.config.scorer_layer) == (10, 3)
  shapes = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 16)}))["params"]
  assert set(shapes) == ({"stack"} if network == "Decoder" else {"stack", "scorer"})
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == "decal_builtin_lm"
  gin.clear_config()



# --------------------------------------------------------------------------- SmolLM2 (GGUF)
@pytest.mark.parametrize("files,network", [
    (["models/smollm2_135m.gin"], "Decoder"),
    (["models/smollm2_135m.gin", "models/dodo_lm.gin", "runs/lm_builtin.gin"], "DodoLM")])
def test_smollm2_135m_is_smollm2_and_carries_dodo_lm(files, network, monkeypatch):
  """models/smollm2_135m.gin (decal_jax/commands/import_gguf.py --smollm2): SmolLM2-135M's
  published 134,515,008 parameters (tied embeddings) on its GGUF tokenizer's vocabulary, a
  missing tokenizer.json reported on use; with dodo_lm.gin and lm_builtin.gin (the
  docs/methods/dodo.md recipe) Dodo's compressed-history LM on the same decoder."""
  from decal_jax.data import hf_vocabularies
  monkeypatch.delenv("DECAL_HF_TOKENIZER", raising=False)
  _parse(*files, bindings=["MODEL_DIR = '/tmp/smollm2'"])
  model = _build_model()
  assert type(model.module).__name__ == network
  cfg = getattr(model.module.config, "decoder", model.module.config)
  assert (cfg.num_layers, cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
      30, 576, 9, 3, 64)
  assert (cfg.vocab_size, cfg.rope_theta, cfg.tie_embeddings) == (49152, 1e5, True)
  shapes = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 16)}))["params"]
  count = sum(x.size for x in jax.tree_util.tree_leaves(shapes["stack"]))
  assert count == 134_515_008
  assert set(shapes) == ({"stack"} if network == "Decoder" else {"stack", "scorer"})
  assert isinstance(model.output_vocabulary, hf_vocabularies.HfTokenizerVocabulary)
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    _ = model.output_vocabulary.eos_id
  gin.clear_config()
