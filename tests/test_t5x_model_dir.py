"""A T5X run's MODEL_DIR evaluated / decoded directly (`decal_jax.eval` / `decal_jax.infer`).

tests/fixtures/t5x_tiny_checkpoint/ (a tiny T5.1.1 written by the real T5X in both of its
layouts, with T5X's forward logits) is copied into a MODEL_DIR as T5X lays one out
(`checkpoint_<step>/`) and read with a model gin of its sizes. The params must be those the
existing INITIAL_CHECKPOINT_PATH route reads (`checkpoints.restore_matching_params`), give
T5X's logits, decode as they do, and MODEL_DIR must be left exactly as it was.
"""
import json
import pathlib
import shutil

import flax
import jax
import numpy as np
import pytest

from decal_jax import infer, partitioning
from decal_jax.data.batches import DatasetConfig
from decal_jax.interop import t5x_checkpoints
from decal_jax.runtime import checkpoints, evaluation, gin_utils, train_state
from test_t5x_checkpoints import LAYOUTS, _assert_t5x_logits, _batch

LENGTHS = {"inputs": 12, "targets": 6}
# The fixture's sizes (make_t5x_fixture.CONFIG) on models/t5_1_1.gin; byte ids 3..31 are
# the bytes 0..28, so inputs of those bytes stay inside its 32-row embedding.
MODEL_GIN = """
from __gin__ import dynamic_registration
import seqio
from decal_jax.networks import t5

include 'models/t5_1_1.gin'

VOCABULARY = @seqio.ByteVocabulary()
t5.T5Config:
  vocab_size = 32
  emb_dim = 16
  num_heads = 2
  head_dim = 8
  mlp_dim = 32
  num_encoder_layers = 2
  num_decoder_layers = 2
"""
INPUTS = ["\x04\x05\x08\x10\x11", "\x07\x03\x01\x12"]


@pytest.fixture(name="model_gin")
def _model_gin(tmp_path):
  path = tmp_path / "t5x_tiny.gin"
  path.write_text(MODEL_GIN)
  return str(path)


def _t5x_model_dir(tmp_path, layout):
  """A T5X MODEL_DIR: the fixture's step 100, and an older step 40 of other params."""
  model_dir = tmp_path / "t5x_run"
  shutil.copytree(LAYOUTS[layout] / "checkpoint_100", model_dir / "checkpoint_100")
  older = t5x_checkpoints.read_t5x_params(model_dir / "checkpoint_100")
  t5x_checkpoints.write_t5x_checkpoint({k: v * 0.5 for k, v in older.items()},
                                       str(model_dir), 40)
  return model_dir


def _files(directory):
  return {str(p.relative_to(directory)): p.read_bytes()
          for p in sorted(pathlib.Path(directory).rglob("*")) if p.is_file()}


def _initial_checkpoint_params(model, path):
  """The params the existing route (INITIAL_CHECKPOINT_PATH) restores from `path`."""
  shapes = model.input_shapes(LENGTHS)
  fresh = model.get_initial_variables(jax.random.PRNGKey(0), shapes)["params"]
  params, report = checkpoints.restore_matching_params(str(path), fresh)
  assert report["initialised"] == [] and report["unused"] == []
  return params


def _assert_same(a, b):
  flat_a, flat_b = (flax.traverse_util.flatten_dict(flax.core.unfreeze(t), sep="/")
                    for t in (a, b))
  assert sorted(flat_a) == sorted(flat_b)
  for name in flat_a:
    np.testing.assert_array_equal(np.asarray(flat_a[name]), np.asarray(flat_b[name]))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_latest_t5x_step_restores_the_initial_checkpoint_params_and_t5x_logits(
    tmp_path, model_gin, layout):
  model_dir = _t5x_model_dir(tmp_path, layout)
  before = _files(model_dir)
  model = gin_utils.load_model([model_gin]).model
  cfg, partitioner = DatasetConfig("", LENGTHS), partitioning.Partitioner()
  params, step = train_state.restore_params(model, str(model_dir), cfg, partitioner)
  assert step == 100
  _assert_same(params, _initial_checkpoint_params(model, LAYOUTS[layout]))
  logits = model.module.apply({"params": params}, **_batch(), enable_dropout=False)
  _assert_t5x_logits(np.asarray(logits))
  older, step = train_state.restore_params(model, str(model_dir), cfg, partitioner, 40)
  assert step == 40
  _assert_same(older, jax.tree_util.tree_map(lambda x: x * 0.5, params))
  with pytest.raises(FileNotFoundError, match=r"T5X MODEL_DIR holds steps \[40, 100\]"):
    train_state.restore_params(model, str(model_dir), cfg, partitioner, 7)
  assert _files(model_dir) == before


def test_infer_decodes_a_t5x_model_dir_as_the_initial_checkpoint_params_do(
    tmp_path, model_gin, monkeypatch):
  model_dir, out = _t5x_model_dir(tmp_path, "msgpack"), tmp_path / "predictions.jsonl"
  before = _files(model_dir)
  args = [f"--gin_file={model_gin}", "--gin_file=runs/infer.gin",
          f"--gin.MODEL_DIR='{model_dir}'", f"--gin.TASK_FEATURE_LENGTHS={LENGTHS}",
          "--gin.INFER_INPUTS=" + repr(INPUTS), f"--gin.INFER_OUTPUT_FILE='{out}'"]
  infer.main(args)
  outputs = [json.loads(line)["prediction"] for line in out.read_text().splitlines()]
  assert len(outputs) == 2 and all(outputs)
  assert _files(model_dir) == before  # nothing written: no decal_jax checkpoint, no record

  model = gin_utils.load_model([model_gin]).model  # the same decode, params of the old route
  reference = _initial_checkpoint_params(model, LAYOUTS["msgpack"])
  monkeypatch.setattr(train_state, "restore_params", lambda *a, **k: (reference, 100))
  expected = evaluation.infer(model=model, model_dir=str(tmp_path / "elsewhere"),
                              task_feature_lengths=LENGTHS, inputs=INPUTS)
  assert outputs == expected


def test_a_t5x_model_dir_of_other_sizes_than_the_gin_model_names_both_and_the_gin_file(
    tmp_path):
  model_dir = _t5x_model_dir(tmp_path, "orbax")
  before = _files(model_dir)
  args = ["--gin_file=models/t5_1_1_tiny.gin", "--gin_file=runs/infer.gin",
          f"--gin.MODEL_DIR='{model_dir}'", f"--gin.TASK_FEATURE_LENGTHS={LENGTHS}",
          "--gin.INFER_INPUTS=['some text']"]
  with pytest.raises(checkpoints.ArchitectureMismatchError) as err:
    infer.main(args)
  message = str(err.value)
  assert f"The T5X checkpoint {model_dir / 'checkpoint_100'} (step 100)" in message
  assert ("shape differs:          decoder/layers_0/mlp/wi_0/kernel checkpoint [16, 32] vs "
          "model [128, 384]") in message
  assert "vocab_size = 32, emb_dim = 16, num_heads = 2, head_dim = 8, mlp_dim = 32" in message
  assert "t5.T5Config in the model gin file given (--gin_file=models/t5_1_1_tiny.gin, " \
      "runs/infer.gin)" in message
  assert _files(model_dir) == before
