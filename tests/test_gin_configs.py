"""Every gin file in gin/ parses and builds its model.

Model sizes are checked against the published T5.1.1 parameter counts (the Hugging Face
`google/t5-v1_1-*` checkpoints, which share the embedding between encoder and decoder and
keep the LM head separate, as T5.1.1 does); shapes come from `jax.eval_shape`, so no
full-size model is ever materialised.
"""
import importlib
import pathlib
import sys
import types

import gin
import jax
import jax.numpy as jnp
import pytest

from decal_jax import gin_utils  # noqa: F401  (its fix to gin's file lookup: ./runs may exist)

import paths

REPO = paths.REPO
GIN_DIR = REPO / "gin"
PUBLISHED_T5_1_1_PARAMS = {"small": 76_961_152, "base": 247_577_856, "large": 783_150_080}


def _parse(*files, bindings=()):
  gin.clear_config()
  gin.add_config_file_search_path(str(GIN_DIR))
  gin.parse_config_files_and_bindings(list(files), list(bindings), finalize_config=False)


def _model_param_count(model):
  ones = jnp.ones((1, 8), jnp.int32)
  shapes = jax.eval_shape(lambda: model.module.init(jax.random.PRNGKey(0), ones, ones, ones,
                                                    enable_dropout=False))
  return sum(x.size for x in jax.tree_util.tree_leaves(shapes["params"])), shapes


def _build_model():
  return gin.query_parameter("%MODEL").scoped_configurable_fn()


def test_all_gin_files_are_covered_here():
  covered = (set(MODEL_FILES) | {"models/t5_1_1.gin", "models/decal.gin"} | T5X_COVERED |
             {"runs/pretrain_builtin.gin", "runs/eval_builtin.gin", "runs/infer_builtin.gin",
              "runs/pretrain.gin", "runs/eval.gin", "runs/infer.gin",
              "runs/finetune.gin", "runs/finetune_builtin.gin"} |
             {"runs/dodo_autoencode_builtin.gin", "runs/dodo_autoencode.gin",
              "models/dodo_tiny.gin"} |  # built by the dodo_autoencode tests below
             {"models/dodo_llama2_7b.gin", "models/dodo.gin"} |
             {"models/squid.gin", "models/squid_tiny.gin", "models/squid_qwen2.gin"} |
             {"runs/squid.gin", "runs/squid_restore.gin", "runs/squid_continue.gin",
              "runs/squid_instruct.gin"} |  # test_squid_stage_files_train_named_parts...
             {"runs/squid_restore_builtin.gin", "runs/squid_continue_builtin.gin",
              "runs/squid_instruct_builtin.gin"} |  # run in order by tests/test_squid_train.py
             {"models/gpthf.gin", "models/gpthf_tiny.gin", "runs/gpthf_lm_builtin.gin",
              "runs/gpthf_lm_real.gin",
              "models/gpthf_16_8.gin", "models/gpthf_8_4.gin", "models/gpt_baseline_24.gin",
              "models/gpt_baseline_12.gin"} |  # the GPTHF tests at the end
             {"models/dual_encoder.gin", "runs/retrieval_finetune.gin", "runs/retrieve.gin",
              "runs/retrieval_builtin.gin", "runs/retrieve_builtin.gin"} |  # retrieval tests
             {"models/decoder.gin", "models/decoder_tiny.gin", "models/dodo_lm.gin",
              "runs/lm_builtin.gin"} |  # test_language_model_files_build_what_they_name
             {"experiments/retention/run.gin", "experiments/retention/t5.gin",
              "experiments/retention/dodo.gin"} |  # tests/tools/test_retention_table.py
             # tests/test_ablation.py loads every budget and variant and trains with mini.gin
             {f"experiments/{kind}/{p.name}" for kind in ("budgets", "variants", "models")
              for p in (GIN_DIR / "experiments" / kind).glob("*.gin")})
  every = {str(p.relative_to(GIN_DIR)) for p in GIN_DIR.rglob("*.gin")}
  missing = every - covered
  assert not missing, f"gin files no test builds: {sorted(missing)}"


MODEL_FILES = ["models/t5_1_1_tiny.gin", "models/t5_1_1_small.gin", "models/t5_1_1_base.gin",
               "models/t5_1_1_large.gin", "models/decal_tiny.gin"]


@pytest.mark.parametrize("size", ["small", "base", "large"])
def test_t5_1_1_sizes_match_published_parameter_counts(size):
  _parse(f"models/t5_1_1_{size}.gin")
  count, _ = _model_param_count(_build_model())
  assert count == PUBLISHED_T5_1_1_PARAMS[size]


@pytest.mark.parametrize("size", ["small", "base", "large"])
def test_decal_on_every_size_adds_only_the_latent_vector_and_norm(size):
  _parse(f"models/t5_1_1_{size}.gin", "models/decal.gin")
  model = _build_model()
  assert model.module.config.compression_ratio == 4
  assert model.module.config.relative_attention_num_buckets == 128
  count, shapes = _model_param_count(model)
  emb = model.module.config.emb_dim
  # latent vector v + its norm scale; the relative-position tables grow 32 -> 128 buckets
  # in both stacks (heads x 96 more entries each).
  heads = model.module.config.num_heads
  assert count == PUBLISHED_T5_1_1_PARAMS[size] + 2 * emb + 2 * heads * 96
  assert shapes["params"]["encoder"]["latents"]["latent_vector"].shape == (emb,)


def test_tiny_and_decal_tiny_build_and_run():
  for name, ratio in (("models/t5_1_1_tiny.gin", 1), ("models/decal_tiny.gin", 4)):
    _parse(name)
    model = _build_model()
    assert model.module.config.compression_ratio == ratio
    ones = jnp.ones((2, 16), jnp.int32)
    variables = jax.jit(lambda rng: model.module.init(rng, ones, ones[:, :4], ones[:, :4],
                                                      enable_dropout=False))(
                                                          jax.random.PRNGKey(0))
    encoded = model.module.apply(variables, ones, enable_dropout=False,
                                 method=model.module.encode)
    assert encoded.shape == (2, 16 // ratio, model.module.config.emb_dim)


def test_compression_ratio_binding_from_the_command_line():
  _parse("models/t5_1_1_tiny.gin", "models/decal.gin", bindings=["COMPRESSION_RATIO = 8"])
  assert _build_model().module.config.compression_ratio == 8


def test_performance_macros_reach_the_network():
  """t5_1_1.gin's performance macros (docs/performance.md) bind T5Config, and the model
  they configure builds with its stacked, fused layout."""
  import numpy as np
  _parse("models/decal_tiny.gin", bindings=[
      "SCAN_LAYERS = True", "REMAT_POLICY = 'dots_saveable'", "ACTIVATION_DTYPE = 'bfloat16'",
      "FUSED_QKV = True", "ATTENTION_KERNEL = 'xla'"])
  cfg = _build_model().module.config
  assert (cfg.scan_layers, cfg.remat_policy, cfg.fused_qkv, cfg.attention_kernel) == (
      True, "dots_saveable", True, "xla")
  assert cfg.dtype == jnp.bfloat16
  _, shapes = _model_param_count(_build_model())
  layers = shapes["params"]["encoder"]["layers"]
  assert layers["attention_qkv"]["qkv_fused"]["kernel"].shape == (
      cfg.num_encoder_layers, cfg.emb_dim, 3, cfg.num_heads, cfg.head_dim)
  _parse("models/decal_tiny.gin")  # the defaults: the plain path
  cfg = _build_model().module.config
  assert (cfg.scan_layers, cfg.remat_policy, cfg.fused_qkv, cfg.attention_kernel) == (
      False, "none", False, "einsum") and cfg.dtype == np.float32


@pytest.mark.parametrize("compressor,scope", [("attn_pool", "attn_pool"),
                                              ("memory_tokens", "memory")])
def test_baselines_are_one_binding_away(compressor, scope):
  _parse("models/t5_1_1_tiny.gin", "models/decal.gin",
         bindings=[f"COMPRESSOR = '{compressor}'", "COMPRESSION_RATIO = 2"])
  model = _build_model()
  assert model.module.config.compressor == compressor
  _, shapes = _model_param_count(model)
  assert scope in shapes["params"]["encoder"] and "latents" not in shapes["params"]["encoder"]


# --------------------------------------------------------------------------- T5X configs
# The drop-in files for T5X users (gin/t5x/): family file -> (T5X model class, our network).
# t5x/runs/*.gin include T5X's own run files, so only tests/t5x (real T5X) parses them.
T5X_FILES = {"t5x/decal_t5_1_1_tiny.gin": ("EncoderDecoderModel", "Transformer"),
             "t5x/decal_t5_1_1_small.gin": ("EncoderDecoderModel", "Transformer"),
             "t5x/decal_t5_1_1_base.gin": ("EncoderDecoderModel", "Transformer"),
             "t5x/decal_t5_1_1_large.gin": ("EncoderDecoderModel", "Transformer"),
             "t5x/dodo_tiny.gin": ("EncoderDecoderModel", "Dodo"),
             "t5x/dodo_llama2_7b.gin": ("EncoderDecoderModel", "Dodo"),
             "t5x/squid_tiny.gin": ("EncoderDecoderModel", "SquidT5X"),
             "t5x/squid_qwen2.gin": ("EncoderDecoderModel", "SquidT5X"),
             "t5x/decoder_tiny.gin": ("DecoderOnlyModel", "Decoder"),
             "t5x/gpthf_tiny.gin": ("DecoderOnlyModel", "Gpthf"),
             "t5x/gpthf_8_4.gin": ("DecoderOnlyModel", "Gpthf"),
             "t5x/gpthf_16_8.gin": ("DecoderOnlyModel", "Gpthf"),
             "t5x/dodo_lm_tiny.gin": ("DecoderOnlyModel", "DodoLM"),
             "t5x/de_decal_t5_1_1_tiny.gin": ("DualEncoderModel", "DualEncoder"),
             "t5x/de_decal_t5_1_1_small.gin": ("DualEncoderModel", "DualEncoder"),
             "t5x/de_decal_t5_1_1_base.gin": ("DualEncoderModel", "DualEncoder")}
T5X_COVERED = set(T5X_FILES) | {"t5x/encoder_decoder.gin", "t5x/decoder_only.gin",
                                "t5x/dual_encoder.gin", "t5x/squid.gin"} | {
    f"t5x/runs/{run}.gin" for run in ("pretrain", "finetune", "eval", "infer",
                                      "train_dual_encoder", "eval_dual_encoder")}  # tests/t5x
# The gin configurable of each T5X model class (the dual encoder's is decal_jax's own).
T5X_DUAL_ENCODER = "decal_jax.models.t5x_dual_encoder"
T5X_OPTIMIZERS = "decal_jax.t5x_optimizers"  # TRAIN_PARTS in t5x/squid.gin
T5X_OURS = (T5X_DUAL_ENCODER, T5X_OPTIMIZERS)  # our modules that import t5x
T5X_CONFIGURABLES = {"EncoderDecoderModel": "t5x.models.EncoderDecoderModel",
                     "DecoderOnlyModel": "t5x.models.DecoderOnlyModel",
                     "DualEncoderModel": f"{T5X_DUAL_ENCODER}.DualEncoderModel"}
# T5X's Adafactor factor rules know these parameter axis names (t5x/adafactor.py
# standard_logical_factor_rules at cc342d41, re-listed here).
T5X_FACTOR_NAMES = {"vocab", "embed", "mlp", "heads", "kv", "joined_kv", "relpos_buckets",
                    "layers", "stack", "q_wi_fused", "o_wo_fused", "multiquery_heads",
                    "kv_fused", "layer_norm_scale", "mlp_activations"}


class _Recorder:
  """Stands in for a T5X class: records the keyword arguments gin passes to it."""

  def __init__(self, **kwargs):
    self.kwargs = kwargs


def _arg(model, name: str):
  """An argument the T5X model class was built with (`module`, `optimizer_def`): the
  stand-in records it, the real T5X's class keeps it as an attribute."""
  return model.kwargs[name] if isinstance(model, _Recorder) else getattr(model, name)


T5X_MODULE_NAMES = ("t5x", "t5x.models", "t5x.adafactor", "t5x.decoding", "t5x.metrics",
                    "t5x.optimizers")


def _t5x_modules():
  """The modules our T5X gin files import. Where the real T5X is importable, the real ones:
  gin keeps one class per name for the whole process, so building these files against
  stand-ins would clash with tests/t5x's real T5X runs in the same pytest process."""
  try:
    for name in (*T5X_MODULE_NAMES, *T5X_OURS):
      importlib.import_module(name)
  except ImportError:
    return _fake_t5x_modules()
  return {name: sys.modules[name] for name in (*T5X_MODULE_NAMES, *T5X_OURS)}


def _fake_t5x_modules():
  """T5X is not on the package index: modules exposing the names our T5X gin files use.
  Built once, since gin remembers each class it has registered."""
  t5x = types.ModuleType("t5x")
  t5x_models = types.ModuleType("t5x.models")
  t5x_adafactor = types.ModuleType("t5x.adafactor")
  t5x_decoding = types.ModuleType("t5x.decoding")
  t5x_metrics = types.ModuleType("t5x.metrics")  # read only when a loss is computed
  t5x_optimizers = types.ModuleType("t5x.optimizers")  # MultiOptimizer: TRAIN_PARTS
  t5x_models.BaseTransformerModel = type("BaseTransformerModel", (_Recorder,), {})
  t5x_models.EncoderDecoderModel = type("EncoderDecoderModel", (_Recorder,), {})
  t5x_models.DecoderOnlyModel = type("DecoderOnlyModel", (_Recorder,), {})
  t5x_adafactor.Adafactor = type("Adafactor", (_Recorder,), {})
  t5x_adafactor.standard_logical_factor_rules = lambda: {"embed": "row"}
  t5x_decoding.temperature_sample = lambda **kwargs: kwargs
  t5x.models, t5x.adafactor, t5x.decoding = t5x_models, t5x_adafactor, t5x_decoding
  t5x_optimizers.OptimizerDef = type("OptimizerDef", (), {
      "__init__": lambda self, hyper_params: setattr(self, "hyper_params", hyper_params)})
  t5x_optimizers.MultiOptimizer = type("MultiOptimizer", (_Recorder,), {
      "__init__": lambda self, traversals_and_optimizers: _Recorder.__init__(
          self, traversals_and_optimizers=traversals_and_optimizers)})
  t5x.metrics, t5x.optimizers = t5x_metrics, t5x_optimizers
  fakes = dict(zip(T5X_MODULE_NAMES, (t5x, t5x_models, t5x_adafactor, t5x_decoding,
                                      t5x_metrics, t5x_optimizers)))
  for name in T5X_OURS:
    fakes[name] = _import_against(fakes, name)
  return fakes


def _import_against(fakes, name):
  """Imports module `name` with `fakes` in sys.modules, then restores sys.modules."""
  saved = {k: sys.modules.get(k) for k in [*fakes, name]}
  sys.modules.update(fakes)
  sys.modules.pop(name, None)
  try:
    return importlib.import_module(name)
  finally:
    for k, module in saved.items():
      if module is None:
        sys.modules.pop(k, None)
      else:
        sys.modules[k] = module


T5X_MODULES = _t5x_modules()


@pytest.fixture
def t5x_modules(monkeypatch):
  for name, module in T5X_MODULES.items():
    monkeypatch.setitem(sys.modules, name, module)
  yield
  gin.clear_config()


def _param_axes(module, decoder_only: bool):
  """Every parameter's logical axis names (eval_shape: nothing is materialised)."""
  from flax.linen import partitioning as nn_partitioning
  ones = jnp.ones((1, 8), jnp.int32)
  # Squid's T5X network reads [context; query]: its encoder input holds the query too
  encoder = jnp.ones((1, 8 + getattr(module, "query_length", 0)), jnp.int32)
  args = (ones, ones) if decoder_only else (encoder, ones, ones)
  shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *args,
                                              enable_dropout=False))
  axes = nn_partitioning.get_axis_names(shapes["params_axes"])
  return {name for spec in jax.tree_util.tree_leaves(
      axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)) for name in spec}


def _shared_t5_vocab(monkeypatch):
  """GPTHF's paper sizes read their end-of-sentence id from the T5 vocabulary's size."""
  import os
  data = pathlib.Path(os.environ.get("DECAL_DATA_DIR", REPO.parent / "shared" / "data"))
  t5_vocab = data / "vocab" / "t5_spiece.model"
  if not t5_vocab.exists():
    pytest.skip(f"{t5_vocab} not found: set DECAL_DATA_DIR to the shared data folder")
  monkeypatch.setenv("DECAL_T5_VOCAB", str(t5_vocab))


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
  """T5.1.1's encoder read at two ratios (queries 1, passages DeCAL's 4), T5X Retrieval's
  defaults for the model class."""
  _parse(name)
  model = _build_model()
  config = _arg(model, "module").config
  assert (config.encoder.emb_dim, config.encoder.num_encoder_layers) == (emb, layers)
  assert config.encoder.compression_ratio == 1 and config.encoder.dtype == "bfloat16"
  assert (config.query_compression_ratio, config.passage_compression_ratio) == (1, 4)
  assert (model.inference_mode, model.use_negatives, model.logit_scale) == (
      "encode", False, 1.0)


def test_t5x_gin_files_pass_the_performance_options(t5x_modules):
  _parse("t5x/decal_t5_1_1_large.gin", bindings=[
      "DROPOUT_RATE = 0.0", "SCAN_LAYERS = True", "REMAT_POLICY = 'full'", "FUSED_QKV = True",
      "ATTENTION_KERNEL = 'xla'", "ACTIVATION_DTYPE = 'float32'"])
  config = _arg(_build_model(), "module").config
  assert (config.scan_layers, config.remat_policy, config.fused_qkv, config.attention_kernel,
          config.dtype) == (True, "full", True, "xla", "float32")


@pytest.mark.parametrize("run_file,fn_name", [
    ("runs/pretrain_builtin.gin", "trainer.train"),
    ("runs/eval_builtin.gin", "evaluation.evaluate"),
    ("runs/infer_builtin.gin", "evaluation.infer"),
    ("runs/finetune_builtin.gin", "trainer.train")])
def test_run_gin_files_bind_every_argument(run_file, fn_name):
  """The run files (with the generic pretrain/eval/infer files they include) leave no
  required argument of their entry point's function unbound."""
  import importlib
  import inspect
  bindings = ["MODEL_DIR = '/tmp/unused'", "INFER_INPUTS = ['text']",
              "INITIAL_CHECKPOINT_PATH = '/tmp/pretrained'"]
  _parse(run_file, bindings=bindings)
  module_name, name_in_module = fn_name.split(".")
  fn = getattr(importlib.import_module(f"decal_jax.{module_name}"), name_in_module)
  required = [name for name, p in inspect.signature(fn).parameters.items()
              if p.default is inspect.Parameter.empty and name != "gin_config_text"]
  for name in required:
    value = gin.query_parameter(f"decal_jax.{fn_name}.{name}")
    assert value is not None, name
  model = _build_model()
  assert model.module.config.compression_ratio == 4


def test_generic_pretrain_gin_requires_the_run_macros():
  from decal_jax import gin_utils
  with pytest.raises(gin_utils.GinConfigError, match="MODEL_DIR/macro.value set to `%gin.REQUIRED`"):
    gin_utils.parse(["models/decal_tiny.gin", "runs/pretrain.gin"], [], [])
  gin.clear_config()


def test_finetune_gin_starts_from_a_checkpoint_at_a_constant_learning_rate():
  """T5's fine-tuning recipe: Adafactor at a constant 1e-3; the model's vocabulary is the
  downstream tasks' vocabulary."""
  from decal_jax.data import vocabularies
  _parse("models/t5_1_1_tiny.gin", "runs/finetune.gin",
         bindings=["INITIAL_CHECKPOINT_PATH = '/ckpt'", "MODEL_DIR = '/m'", "TRAIN_STEPS = 1",
                   "MIXTURE_OR_TASK_NAME = 'decal_squad'",
                   "TASK_FEATURE_LENGTHS = {'inputs': 8, 'targets': 4}"])
  ref = gin.query_parameter("decal_jax.trainer.train.initial_checkpoint_path")
  assert str(ref) == "%INITIAL_CHECKPOINT_PATH"
  assert gin.query_parameter("%INITIAL_CHECKPOINT_PATH") == "/ckpt"
  assert str(gin.query_parameter("decal_jax.optimizers.adafactor.learning_rate")) == \
      "@optax.constant_schedule()"
  assert gin.query_parameter("%LEARNING_RATE") == 0.001
  vocab = vocabularies.task_vocabulary()
  assert vocab == vocabularies.builtin_vocabulary()
  gin.clear_config()


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
  from decal_jax import evaluation, trainer
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
    assert gin.query_parameter(f"decal_jax.optimizers.adamw.{name}") == want
  schedule = gin.query_parameter("decal_jax.optimizers.adamw.learning_rate").scoped_configurable_fn()
  # warm-up 1e-4 * step / 2000; then 1e-4 * (1 + cos(pi * (step - 2000) / 150000)) / 2
  for step, want in ((1000, 5e-5), (2000, 1e-4), (77_000, 5e-5), (152_000, 0.0)):
    assert float(schedule(step)) == pytest.approx(want, abs=1e-10), step
  optimizer = gin.query_parameter("decal_jax.trainer.train.optimizer").scoped_configurable_fn()
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


# --------------------------------------------------------------------------- Squid
def _squid_shapes(model):
  """Squid's params by name (eval_shape: nothing is materialised)."""
  import flax
  shapes = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), {"encoder_input_tokens": (1, 16), "decoder_input_tokens": (1, 4),
                              "query_tokens": (1, 4)}))["params"]
  return flax.traverse_util.flatten_dict(shapes, sep="/")


def test_squid_qwen2_decoders_are_qwen2_0_5b_and_7b(monkeypatch):
  """The small decoder has Qwen2-0.5B's 494,032,768 parameters (tied embeddings), the large
  one Qwen2-7B's 7,615,616,512 (Qwen/Qwen2-0.5B, Qwen/Qwen2-7B); the projector maps 896 ->
  3584 (Linear-GELU-Linear) and there are 64 memory tokens."""
  monkeypatch.delenv("DECAL_HF_TOKENIZER", raising=False)
  _parse("models/squid_qwen2.gin")
  model = _build_model()
  flat = _squid_shapes(model)
  def count(prefix):
    return sum(v.size for k, v in flat.items() if k.startswith(prefix))
  assert count("small_decoder/") == 494_032_768
  assert count("large_decoder/") == 7_615_616_512
  assert "logits_dense" not in str(list(k for k in flat if k.startswith("small_decoder/")))
  assert flat["memory_tokens/memory_embeddings"].shape == (64, 896)
  assert (flat["projector/dense_0/kernel"].shape, flat["projector/dense_1/kernel"].shape) == \
      ((896, 3584), (3584, 3584))
  config = model.module.config
  assert (config.small.rope_theta, config.small.norm_epsilon, config.large.qkv_bias) == \
      (1e6, 1e-6, True)
  with pytest.raises(FileNotFoundError, match="QWEN2_TOKENIZER"):
    _ = model.output_vocabulary.vocab_size  # no tokenizer.json bound: a clear error on use
  gin.clear_config()


def test_squid_qwen2_vocabulary_moves_token_0_into_both_tables(monkeypatch):
  """Qwen2's id 0 ('!') is read as padding here, so the vocabulary writes it as 151935:
  past the tokenizer's last id (151645, Qwen/Qwen2-0.5B tokenizer.json), a row of both
  tables (151,936 and 152,064 rows). decal_jax/tools/import_hf.py reads the same binding."""
  monkeypatch.delenv("DECAL_HF_TOKENIZER", raising=False)
  _parse("models/squid_qwen2.gin")
  model = _build_model()
  config = model.module.config
  assert model.input_vocabulary.zero_id_to == model.output_vocabulary.zero_id_to == 151935
  assert 151645 < 151935 < min(config.small.vocab_size, config.large.vocab_size)
  gin.clear_config()


def test_squid_tiny_builds_a_small_and_a_larger_decoder():
  _parse("models/squid_tiny.gin")
  model = _build_model()
  config = model.module.config
  assert type(model.module).__name__ == "Squid" and config.memory_tokens == 8
  assert (config.small.emb_dim, config.small.num_layers) == (64, 2)
  assert (config.large.emb_dim, config.large.num_layers) == (128, 4)
  flat = _squid_shapes(model)
  assert flat["projector/dense_0/kernel"].shape == (64, 128)
  assert flat["large_decoder/token_embedder/embedding"].shape == (4224, 128)
  gin.clear_config()


@pytest.mark.parametrize("size", ["tiny", "qwen2"])
def test_t5x_squid_files_join_the_query_where_the_network_reads_it(t5x_modules, monkeypatch,
                                                                   size):
  """t5x/squid_<size>.gin: T5X's model class gets the feature converter that puts the query
  in the last QUERY_LENGTH encoder columns, and SquidT5X reads it there; its parameters are
  those of models/squid_<size>.gin's Squid (name for name, shape for shape), so a decal_jax
  Squid checkpoint (or an imported Qwen2 pair) is one."""
  import flax
  from decal_jax.models.squid import SquidT5XFeatureConverter
  monkeypatch.delenv("DECAL_HF_TOKENIZER", raising=False)
  _parse(f"t5x/squid_{size}.gin", bindings=["QUERY_LENGTH = 12"])
  model = _build_model()
  module = _arg(model, "module")
  assert module.query_length == 12
  converter_cls = (model.kwargs["feature_converter_cls"] if isinstance(model, _Recorder)
                   else model.FEATURE_CONVERTER_CLS)  # where T5X's class keeps it
  converter = converter_cls(pack=False)  # as T5X's utils.get_dataset builds it
  assert isinstance(converter, SquidT5XFeatureConverter) and converter.query_length == 12
  joined = jnp.ones((1, 16 + 12), jnp.int32)
  shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), joined, joined[:, :4],
                                              joined[:, :4], enable_dropout=False))["params"]
  theirs = {k: v.shape for k, v in flax.traverse_util.flatten_dict(shapes, sep="/").items()}
  _parse(f"models/squid_{size}.gin")
  ours = {k: v.shape for k, v in _squid_shapes(_build_model()).items()}
  assert theirs == ours
  gin.clear_config()


def test_t5x_squid_train_parts_hands_t5x_adafactor_only_the_named_parts(t5x_modules):
  """t5x/squid.gin's TRAIN_PARTS: T5X's model gets a MultiOptimizer whose traversals
  split the parameters exactly by the named top-level parts (worked out here from the
  names alone): T5X's Adafactor for those, `Frozen` for the rest; unbound, the Adafactor
  itself."""
  import flax
  parts = ["small_decoder", "memory_tokens", "projector"]
  _parse("t5x/squid_tiny.gin", bindings=[f"TRAIN_PARTS = {parts}"])
  model = _build_model()
  optimizer = _arg(model, "optimizer_def")
  assert type(optimizer).__name__ == "PartsOptimizer" and optimizer.parts == tuple(parts)
  pairs = (optimizer.kwargs["traversals_and_optimizers"] if isinstance(optimizer, _Recorder)
           else list(zip(optimizer.traversals, optimizer.sub_optimizers)))  # real T5X's
  [(trained, adafactor), (frozen, frozen_def)] = pairs
  assert (type(adafactor).__name__, type(frozen_def).__name__) == ("Adafactor", "Frozen")
  module = _arg(model, "module")
  joined = jnp.ones((1, 8 + module.query_length), jnp.int32)
  shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), joined, joined[:, :4],
                                              joined[:, :4], enable_dropout=False))["params"]
  names = flax.traverse_util.unflatten_dict(  # each leaf: its own 'a/b/c' name
      {k: "/".join(k) for k in flax.traverse_util.flatten_dict(shapes)})
  every = set(jax.tree_util.tree_leaves(names))
  assert {name.split("/")[0] for name in every} == set(parts) | {"large_decoder"}
  assert set(trained.iterate(names)) == {n for n in every if n.split("/")[0] in parts}
  assert set(frozen.iterate(names)) == {n for n in every if n.startswith("large_decoder/")}
  _parse("t5x/squid_tiny.gin")
  assert type(_arg(_build_model(), "optimizer_def")).__name__ == "Adafactor"


SQUID_STAGES = {  # stage run file -> (task, parts it trains)
    "runs/squid_restore.gin": ("decal_c4_squid_restore",
                               {"small_decoder", "memory_tokens", "projector"}),
    "runs/squid_continue.gin": ("decal_c4_squid_continue",
                                {"small_decoder", "memory_tokens", "projector", "large_decoder"}),
    "runs/squid_instruct.gin": ("decal_squad_squid", {"small_decoder", "memory_tokens",
                                                      "projector", "large_decoder"}),
}


@pytest.mark.parametrize("run_file", sorted(SQUID_STAGES))
def test_squid_stage_files_train_named_parts_of_the_model(run_file):
  """Each imported-checkpoint stage reads its task and trains exactly the parts it names,
  every one of which exists in the Squid it configures (runs/squid.gin's optimizer)."""
  import flax
  task, parts = SQUID_STAGES[run_file]
  _parse("models/squid_tiny.gin", run_file, bindings=["MODEL_DIR = '/tmp/unused'",
                                                      "TRAIN_STEPS = 10", "WARMUP_STEPS = 0",
                                                      "INITIAL_CHECKPOINT_PATH = '/ckpt'"])
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == task
  assert set(gin.query_parameter("%TRAIN_PARTS")) == parts
  model = _build_model()
  optimizer = gin.query_parameter("decal_jax.trainer.train.optimizer").scoped_configurable_fn()
  gin.clear_config()
  params = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), {"encoder_input_tokens": (1, 16), "decoder_input_tokens": (1, 4),
                              "query_tokens": (1, 4)}))["params"]
  assert parts <= set(params)
  @jax.jit
  def first_update(params):  # one step with every gradient 1
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return jax.tree_util.tree_map(lambda u: jnp.any(u != 0), updates)

  moved_leaves = first_update(jax.tree_util.tree_map(lambda s: jnp.ones(s.shape, s.dtype),
                                                     params))
  moved = {path.split("/")[0] for path, u in
           flax.traverse_util.flatten_dict(moved_leaves, sep="/").items() if u}
  assert moved == parts


# --------------------------------------------------------------------------- GPTHF
def _decoder_only_param_count(model):
  shapes = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 16)}))["params"]
  return sum(x.size for x in jax.tree_util.tree_leaves(shapes))


# 24 blocks x (4 * 1024^2 attention + 3 * 1024 * 4096 SwiGLU + 2 * 1024 norms) + 32,128 x 1024
# tied embedding + 1024 final norm; 12 blocks at width 768 likewise (hand-worked).
GPTHF_SIZES = {("models/gpthf_16_8.gin", "models/gpt_baseline_24.gin"): (16, 24, 435_602_432),
               ("models/gpthf_8_4.gin", "models/gpt_baseline_12.gin"): (8, 12, 137_939_712)}


@pytest.mark.parametrize("files", sorted(GPTHF_SIZES))
def test_gpthf_paper_sizes_match_their_gpt_baselines(files, monkeypatch):
  """GPTHF-16-8 / -8-4 have exactly the parameters of Baseline-24 / -12 (one stack, split
  into word- and sentence-level blocks); ends of sentences are the T5 top sentinel."""
  import os
  data = pathlib.Path(os.environ.get("DECAL_DATA_DIR", REPO.parent / "shared" / "data"))
  t5_vocab = data / "vocab" / "t5_spiece.model"
  if not t5_vocab.exists():
    pytest.skip(f"{t5_vocab} not found: set DECAL_DATA_DIR to the shared data folder")
  monkeypatch.setenv("DECAL_T5_VOCAB", str(t5_vocab))  # the end id comes from its size
  encoder, layers, count = GPTHF_SIZES[files]
  _parse(files[0])
  model = _build_model()
  cfg = model.module.config
  assert type(model.module).__name__ == "Gpthf"
  assert (cfg.encoder_layers, cfg.decoder.num_layers, cfg.sentence_end_id) == (encoder, layers,
                                                                                32099)
  assert _decoder_only_param_count(model) == count
  gin.clear_config()
  _parse(files[1])
  baseline = _build_model()
  assert type(baseline.module).__name__ == "Decoder"
  assert _decoder_only_param_count(baseline) == count
  gin.clear_config()


def test_gpthf_tiny_and_its_run_file():
  _parse("models/gpthf_tiny.gin", "runs/gpthf_lm_builtin.gin",
         bindings=["MODEL_DIR = '/tmp/unused'"])
  model = _build_model()
  cfg = model.module.config
  assert (cfg.encoder_layers, cfg.decoder.num_layers, cfg.decoder.emb_dim) == (4, 6, 128)
  assert cfg.sentence_end_id == model.output_vocabulary.vocab_size - 1
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == "decal_builtin_sentence_lm"
  assert gin.query_parameter("%MAX_SENTENCE_LENGTH") == cfg.max_sentence_length == 64
  gin.clear_config()


# 6 blocks x (q, o 128 x 128 + k, v 128 x 64 + SwiGLU 3 x 128 x 384 + 2 norms of 128) +
# embedding and logits 2 x 4,224 x 128 + final norm 128 (hand-worked; untied).
TINY_6_BLOCKS = (6 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384 + 2 * 128)
                 + 2 * 4224 * 128 + 128)


def test_gpthf_real_text_run_file_reads_each_token_once(monkeypatch):
  """runs/gpthf_lm_real.gin (docs/results/gpthf_lm_real.md): the real-text task with its own
  vocabulary; GPTHF and the 6-block GPT have the same parameters (2,262,656); the run reads
  fewer tokens than the training split holds, counted here by tokenizing it."""
  import os
  from decal_jax.data import real_text, sentences
  data = pathlib.Path(os.environ.get("DECAL_DATA_DIR", REPO.parent / "shared" / "data"))
  if not (data / real_text.FILES["c4"]).exists():
    pytest.skip(f"{data / 'text'} not found: set DECAL_DATA_DIR to the shared data folder")
  monkeypatch.setenv("DECAL_DATA_DIR", str(data))
  _parse("models/gpthf_tiny.gin", "runs/gpthf_lm_real.gin",
         bindings=["MODEL_DIR = '/tmp/unused'"])
  model = _build_model()
  cfg, vocab = model.module.config, model.output_vocabulary
  assert isinstance(vocab, real_text.RealTextVocabulary)
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == "decal_real_text_sentence_lm"
  assert cfg.sentence_end_id == vocab.vocab_size - 1 < cfg.decoder.vocab_size == 4224
  assert (cfg.encoder_layers, cfg.decoder.num_layers) == (4, 6)
  assert _decoder_only_param_count(model) == TINY_6_BLOCKS
  read = (gin.query_parameter("%TRAIN_STEPS") * gin.query_parameter("%BATCH_SIZE") *
          gin.query_parameter("%TASK_FEATURE_LENGTHS")["targets"])
  end = vocab.vocab_size - 1
  held = sum(len(sentences.encode_sentences(d, vocab, end, cfg.max_sentence_length))
             for d in real_text.documents()["train"])
  assert read < held
  gin.clear_config()
  _parse("models/decoder_tiny.gin", "runs/gpthf_lm_real.gin",
         bindings=["MODEL_DIR = '/tmp/unused'", "decoder.DecoderConfig.num_layers = 6"])
  gpt = _build_model()
  assert type(gpt.module).__name__ == "Decoder" and gpt.output_vocabulary == vocab
  assert _decoder_only_param_count(gpt) == TINY_6_BLOCKS
  gin.clear_config()


def test_dual_encoder_gin_shares_the_decal_encoder_at_two_ratios():
  """models/dual_encoder.gin on a size + decal.gin: one encoder whose parameters carry the
  encoder-decoder's names (so its pretraining checkpoint loads), queries at C = 1 and
  passages at the run's C; the single-vector variant is two bindings away."""
  _parse("models/t5_1_1_base.gin", "models/decal.gin", "models/dual_encoder.gin",
         bindings=["PASSAGE_COMPRESSION_RATIO = 8", "PROJECTION_DIM = 128"])
  model = _build_model()
  cfg = model.module.config
  assert (cfg.query_compression_ratio, cfg.passage_compression_ratio) == (1, 8)
  assert cfg.encoder.compression_ratio == 1  # decal.gin's C = 4 binds the sides, not the encoder
  assert cfg.encoder.emb_dim == 768 and cfg.output_dim == 128 and cfg.pooling == "multi"
  shapes = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), {"left_encoder_input_tokens": (1, 8),
                              "right_encoder_input_tokens": (1, 16)}))["params"]
  _parse("models/t5_1_1_base.gin", "models/decal.gin")
  encdec = jax.eval_shape(lambda: _build_model().get_initial_variables(
      jax.random.PRNGKey(0), {"encoder_input_tokens": (1, 16),
                              "decoder_input_tokens": (1, 4)}))["params"]
  assert jax.tree_util.tree_map(lambda x: x.shape, shapes["encoder"]) == \
      jax.tree_util.tree_map(lambda x: x.shape, encdec["encoder"])
  assert shapes["projection"]["kernel"].shape == (768, 128)
  _parse("models/t5_1_1_tiny.gin", "models/decal.gin", "models/dual_encoder.gin",
         bindings=["POOLING = 'mean'", "TEMPERATURE = 0.05"])
  model = _build_model()
  assert model.module.config.pooling == "mean" and model.temperature == 0.05
  gin.clear_config()


@pytest.mark.parametrize("run_file,fn", [("runs/retrieval_builtin.gin", "trainer.train"),
                                         ("runs/retrieve_builtin.gin",
                                          "retrieval.pipeline.evaluate_retrieval")])
def test_retrieval_run_files_bind_every_argument(run_file, fn):
  import importlib
  import inspect
  module_name, fn_name = fn.rsplit(".", 1)
  target = getattr(importlib.import_module(f"decal_jax.{module_name}"), fn_name)
  _parse(run_file, bindings=["MODEL_DIR = '/tmp/unused'",
                             "INITIAL_CHECKPOINT_PATH = '/tmp/pretrained'"])
  required = [name for name, p in inspect.signature(target).parameters.items()
              if p.default is inspect.Parameter.empty and name != "gin_config_text"]
  for name in required:
    assert gin.query_parameter(f"decal_jax.{fn}.{name}") is not None, name
  model = _build_model()
  assert type(model).__name__ == "DualEncoderModel"
  assert model.module.config.passage_compression_ratio == 4
  if fn_name == "train":
    assert gin.query_parameter("decal_jax.trainer.train.show_example") is False
    assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == "decal_beir_builtin"
  gin.clear_config()
