"""The drop-in files for T5X users (gin/t5x/) build T5X's model classes around our
networks, with axis names T5X's Adafactor knows and the performance options passed."""
import gin
import pytest

from gin_config_helpers import (T5X_CONFIGURABLES, T5X_FACTOR_NAMES, T5X_FILES, _arg, _build_model,
                                _param_axes, _parse, _shared_t5_vocab)


@pytest.mark.parametrize("name", sorted(T5X_FILES))
def test_t5x_gin_files_put_our_network_into_t5x_models(t5x_modules, monkeypatch, name):
  """Each family file builds T5X's model class around our network, with T5X's OPTIMIZER
  macro and the model file's vocabulary, which decal_jax's tasks then tokenize with."""
  from decal_jax.data import vocabularies
  model_class, network = T5X_FILES[name]
  if name.startswith("t5x/gpthf_") and "tiny" not in name:
    _shared_t5_vocab(monkeypatch)
  _parse(name)
  model = _build_model()
  assert type(model).__name__ == model_class
  assert type(_arg(model, "module")).__name__ == network
  configurable = T5X_CONFIGURABLES[model_class]
  assert str(gin.query_parameter(f"{configurable}.optimizer_def")) == "%OPTIMIZER"
  assert type(_arg(model, "optimizer_def")).__name__ == "Adafactor"
  vocab_key = "vocabulary" if model_class == "DecoderOnlyModel" else "output_vocabulary"
  assert str(gin.query_parameter(f"{configurable}.{vocab_key}")) == "%VOCABULARY"
  assert str(gin.query_parameter("decal_jax.data.vocabularies.task_vocabulary.vocabulary")
             ) == "%VOCABULARY"
  if name.endswith("_tiny.gin"):  # the built-in vocabulary: offline, the tasks' own
    assert vocabularies.task_vocabulary() == vocabularies.builtin_vocabulary()


@pytest.mark.parametrize("name", [n for n in sorted(T5X_FILES) if "tiny" in n])
def test_t5x_families_name_axes_the_factor_rules_know(t5x_modules, name):
  """T5X's Adafactor looks up every parameter axis name in its factor rules (a missing
  one is a KeyError at the first step): encoder-decoder families use only T5X's names
  (CCProxy's memory table included); the LLaMA-based ones (decoder-only, Dodo) bind
  decal_jax's rules (FACTOR_RULES), which cover their extra names."""
  from decal_jax import partitioning
  model_class, _ = T5X_FILES[name]
  decoder_only = model_class == "DecoderOnlyModel"
  llama = decoder_only or "dodo" in name or "squid" in name  # LLaMA-style decoders
  compressors = ["latents"] if llama else ["latents", "attn_pool", "memory_tokens"]
  for compressor in compressors:
    _parse(name, bindings=[] if llama else [f"COMPRESSOR = '{compressor}'"])
    names = _param_axes(_arg(_build_model(), "module"), decoder_only)
    ours = "adafactor_factor_rules" in str(gin.query_parameter("%FACTOR_RULES"))
    known = set(partitioning.adafactor_factor_rules()) if ours else T5X_FACTOR_NAMES
    assert ours == llama  # T5's families: T5X's own rules
    assert names <= known, (compressor, names - known)
  rules = partitioning.adafactor_factor_rules()
  assert {k: rules[k] for k in ("vocab", "embed", "mlp", "heads", "kv")} == {
      "vocab": "column", "embed": "row", "mlp": "column", "heads": "column", "kv": "column"}


@pytest.mark.parametrize("name,emb,layers", [("t5x/decal_t5_1_1_small.gin", 512, 8),
                                             ("t5x/decal_t5_1_1_base.gin", 768, 12),
                                             ("t5x/decal_t5_1_1_large.gin", 1024, 24)])
def test_t5x_decal_sizes_are_t5_1_1s(t5x_modules, name, emb, layers):
  from decal_jax.networks import t5
  _parse(name, bindings=["DROPOUT_RATE = 0.1"])
  model = _build_model()
  module = _arg(model, "module")
  assert isinstance(module, t5.Transformer)
  assert (module.config.emb_dim, module.config.num_encoder_layers) == (emb, layers)
  assert module.config.compression_ratio == 4 and module.config.dropout_rate == 0.1
  assert gin.query_parameter("t5x.adafactor.Adafactor.decay_rate") == 0.8
  assert module.config.dtype == "bfloat16" and not module.config.scan_layers  # T5X's default


@pytest.mark.parametrize("name,emb,layers", [("t5x/de_decal_t5_1_1_small.gin", 512, 8),
                                             ("t5x/de_decal_t5_1_1_base.gin", 768, 12)])
def test_t5x_dual_encoder_sizes_are_t5_1_1s(t5x_modules, name, emb, layers):
  """T5.1.1's encoder read at DeCAL's 4 on both sides, T5X Retrieval's defaults for the
  model class (logit scale 100, the two-way loss)."""
  _parse(name)
  model = _build_model()
  config = _arg(model, "module").config
  assert (config.encoder.emb_dim, config.encoder.num_encoder_layers) == (emb, layers)
  assert config.encoder.compression_ratio == 1 and config.encoder.dtype == "bfloat16"
  assert (config.query_compression_ratio, config.passage_compression_ratio) == (4, 4)
  assert (model.inference_mode, model.use_negatives, model.logit_scale) == (
      "encode", False, 100.0)
  assert (model.learnable_logit_scale, model.bidirectional) == (False, True)


def test_t5x_gin_files_pass_the_performance_options(t5x_modules):
  _parse("t5x/decal_t5_1_1_large.gin", bindings=[
      "DROPOUT_RATE = 0.0", "SCAN_LAYERS = True", "REMAT_POLICY = 'full'", "FUSED_QKV = True",
      "ATTENTION_KERNEL = 'xla'", "ACTIVATION_DTYPE = 'float32'"])
  config = _arg(_build_model(), "module").config
  assert (config.scan_layers, config.remat_policy, config.fused_qkv, config.attention_kernel,
          config.dtype) == (True, "full", True, "xla", "float32")

