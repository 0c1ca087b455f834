"""The dual encoder's model file and the retrieval run files."""
import gin
import jax
import pytest

from gin_config_helpers import _build_model, _parse


def test_dual_encoder_gin_shares_the_decal_encoder_at_two_ratios():
  """models/dual_encoder.gin on a size + decal.gin: one encoder whose parameters carry the
  encoder-decoder's names (so its pretraining checkpoint loads), queries and passages both
  at the run's C (decal.txt §4.3), T5X Retrieval's loss (logit scale 100, both directions);
  the asymmetric encoder and the single-vector variant are one binding away."""
  _parse("models/t5_1_1_base.gin", "models/decal.gin", "models/dual_encoder.gin",
         bindings=["PASSAGE_COMPRESSION_RATIO = 8", "PROJECTION_DIM = 128"])
  model = _build_model()
  cfg = model.module.config
  assert (cfg.query_compression_ratio, cfg.passage_compression_ratio) == (8, 8)
  assert (model.logit_scale, model.learnable_logit_scale, model.bidirectional) == (
      100.0, False, True)
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
  _parse("models/t5_1_1_tiny.gin", "models/decal.gin", "models/dual_encoder.gin")
  cfg = _build_model().module.config
  assert (cfg.query_compression_ratio, cfg.passage_compression_ratio) == (4, 4)  # decal.gin's
  _parse("models/t5_1_1_tiny.gin", "models/decal.gin", "models/dual_encoder.gin",
         bindings=["POOLING = 'mean'", "QUERY_COMPRESSION_RATIO = 1", "LOGIT_SCALE = 20.0",
                   "LEARNABLE_LOGIT_SCALE = True", "BIDIRECTIONAL_LOSS = False"])
  model = _build_model()
  cfg = model.module.config
  assert cfg.pooling == "mean" and (cfg.query_compression_ratio,
                                    cfg.passage_compression_ratio) == (1, 4)
  assert (model.logit_scale, model.learnable_logit_scale, model.bidirectional) == (
      20.0, True, False)
  assert model.temperature == 0.05
  gin.clear_config()


@pytest.mark.parametrize("run_file,fn", [("runs/retrieval_builtin.gin", "runtime.trainer.train"),
                                         ("runs/retrieve_builtin.gin",
                                          "runtime.retrieval_eval.evaluate_retrieval")])
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
  assert model.module.config.query_compression_ratio == 4  # both sides at C
  if fn_name == "train":
    assert gin.query_parameter("decal_jax.runtime.trainer.train.show_example") is False
    assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == "decal_beir_builtin"
  else:  # the search backend is an explicit setting, numpy's by default (no optional extra)
    from decal_jax.retrieval import residual_search
    assert gin.query_parameter("%SEARCH_BACKEND") == residual_search.DEFAULT_BACKEND == "numpy"
  gin.clear_config()
