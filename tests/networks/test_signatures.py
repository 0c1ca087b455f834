"""The networks take exactly what T5X's model classes pass them.

`t5x.models.EncoderDecoderModel` passes `prefill` / `prefill_lengths` to `module.decode`
only when its signature lists them (it inspects it), so the encoder-decoder networks must
not list them. `t5x.models.DecoderOnlyModel` always prefills the prompt: one call with
`prefill=True` and per-row `prefill_lengths`, then one token per step from each row's
length on. The reference is the network's own full (teacher-forced) pass: after a
prefill of lengths (2, 5, 8), the step that feeds token `lengths[b] + i` must give the
full pass's logits at that position, row by row.
"""
import inspect

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax.runtime import gin_utils  # noqa: F401  (its fix to gin's file lookup)

import paths
import tolerances

DECODER_ONLY = {"Decoder": ["models/decoder_tiny.gin"],
                "Gpthf": ["models/gpthf_tiny.gin"],
                "DodoLM": ["models/decoder_tiny.gin", "models/dodo_lm.gin"]}


def _model(files, bindings=()):
  gin.clear_config()
  gin.add_config_file_search_path(str(paths.REPO / "gin"))
  gin.parse_config_files_and_bindings(files, ["MODEL_DIR = '/tmp/unused'", *bindings],
                                      finalize_config=False)
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  gin.clear_config()
  return model


@pytest.mark.parametrize("files", [["models/decal_tiny.gin"], ["models/dodo_tiny.gin"],
                                   ["models/squid_tiny.gin"]])
def test_encoder_decoder_decode_lists_no_prefill(files):
  """T5X would pass prefill (and turn on prompt prefilling) if decode listed it."""
  module = _model(files).module
  assert "prefill" not in inspect.signature(module.decode).parameters
  assert "prefill_lengths" not in inspect.signature(module.decode).parameters


@pytest.mark.parametrize("name", sorted(DECODER_ONLY))
def test_per_row_prefill_then_steps_equal_the_full_pass(name):
  bindings = ["DodoLMConfig.threshold = 0.0"] if name == "DodoLM" else []
  model = _model(DECODER_ONLY[name], bindings)
  module = model.module
  assert type(module).__name__ == name
  batch, length, steps = 3, 12, 3
  params = model.get_initial_variables(jax.random.PRNGKey(0),
                                       {"decoder_input_tokens": (1, length)})["params"]
  tokens = jnp.asarray(np.random.RandomState(0).randint(3, 50, (batch, length)), jnp.int32)
  full = module.apply({"params": params}, tokens, enable_dropout=False)  # [b, L, vocab]
  lengths = jnp.array([2, 5, 8], jnp.int32)
  # T5X's prompt: BOS + prompt tokens, zero after each row's own length
  prompts = jnp.where(jnp.arange(length)[None] <= lengths[:, None], tokens, 0)
  ones = jnp.ones((batch, length), jnp.int32)
  _, variables = module.apply({"params": params}, ones, ones, decode=True,
                              enable_dropout=False, mutable=["cache"])
  _, variables = module.apply({"params": params, **variables}, prompts, prompts, decode=True,
                              prefill=True, prefill_lengths=lengths, enable_dropout=False,
                              mutable=["cache"])
  index = lengths
  got, want = [], []
  for _ in range(steps):
    token = jnp.take_along_axis(tokens, index[:, None], axis=1)  # [b, 1]
    logits, variables = module.apply({"params": params, **variables}, token, token,
                                     decode=True, enable_dropout=False, mutable=["cache"])
    got.append(logits[:, 0])
    want.append(full[jnp.arange(batch), index])
    index = index + 1
  tol = tolerances.network_atol(full, tolerances.stack_reductions(
      getattr(module.config, "decoder", module.config), keys=length))
  np.testing.assert_allclose(np.stack(got), np.stack(want), atol=tol)


def test_prefill_lengths_need_prefill():
  model = _model(DECODER_ONLY["Decoder"])
  tokens = jnp.ones((2, 4), jnp.int32)
  params = model.get_initial_variables(jax.random.PRNGKey(0),
                                       {"decoder_input_tokens": (1, 4)})["params"]
  with pytest.raises(ValueError, match="only with prefill=True"):
    model.module.apply({"params": params}, tokens, prefill_lengths=jnp.array([1, 2]),
                       enable_dropout=False)
