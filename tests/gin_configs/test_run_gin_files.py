"""The run files (gin/runs/) bind every argument of what they run."""
import gin
import pytest

from gin_config_helpers import _build_model, _parse


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
  fn = getattr(importlib.import_module(f"decal_jax.runtime.{module_name}"), name_in_module)
  required = [name for name, p in inspect.signature(fn).parameters.items()
              if p.default is inspect.Parameter.empty and name != "gin_config_text"]
  for name in required:
    value = gin.query_parameter(f"decal_jax.runtime.{fn_name}.{name}")
    assert value is not None, name
  model = _build_model()
  assert model.module.config.compression_ratio == 4


def test_generic_pretrain_gin_requires_the_run_macros():
  from decal_jax.runtime import gin_utils
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
  ref = gin.query_parameter("decal_jax.runtime.trainer.train.initial_checkpoint_path")
  assert str(ref) == "%INITIAL_CHECKPOINT_PATH"
  assert gin.query_parameter("%INITIAL_CHECKPOINT_PATH") == "/ckpt"
  assert str(gin.query_parameter("decal_jax.runtime.optimizers.adafactor.learning_rate")) == \
      "@optax.constant_schedule()"
  assert gin.query_parameter("%LEARNING_RATE") == 0.001
  vocab = vocabularies.task_vocabulary()
  assert vocab == vocabularies.builtin_vocabulary()
  gin.clear_config()

