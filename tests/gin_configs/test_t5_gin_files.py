"""T5.1.1 sizes, DeCAL on each, the tiny files, the command-line and performance
bindings, and the baselines one binding away."""
import jax
import jax.numpy as jnp
import pytest

from gin_config_helpers import PUBLISHED_T5_1_1_PARAMS, _build_model, _model_param_count, _parse


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

