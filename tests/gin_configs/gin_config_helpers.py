"""What tests/gin_configs/ shares: parsing gin files, building a model's shapes, the
T5X drop-in files and the T5X modules they import (the real T5X where it is installed,
stand-ins otherwise), and the file lists the coverage test checks."""
import importlib
import pathlib
import sys
import types

import gin
import jax
import jax.numpy as jnp
import pytest

from decal_jax.runtime import gin_utils  # noqa: F401  (its fix to gin's file lookup: ./runs may exist)

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



MODEL_FILES = ["models/t5_1_1_tiny.gin", "models/t5_1_1_small.gin", "models/t5_1_1_base.gin",
               "models/t5_1_1_large.gin", "models/decal_tiny.gin"]


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
T5X_OPTIMIZERS = "decal_jax.runtime.t5x_optimizers"  # TRAIN_PARTS in t5x/squid.gin
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



def _squid_shapes(model):
  """Squid's params by name (eval_shape: nothing is materialised)."""
  import flax
  shapes = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), {"encoder_input_tokens": (1, 16), "decoder_input_tokens": (1, 4),
                              "query_tokens": (1, 4)}))["params"]
  return flax.traverse_util.flatten_dict(shapes, sep="/")




def _decoder_only_param_count(model):
  shapes = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 16)}))["params"]
  return sum(x.size for x in jax.tree_util.tree_leaves(shapes))

