"""TRAIN_PARTS under the real T5X (decal_jax/runtime/t5x_optimizers.py, gin/t5x/squid.gin).

Skipped, with the reason, where `import t5x` fails (docs/t5x.md installs it). Squid's
imported-checkpoint stage 1 under `python -m t5x.train`: only the small decoder, memory
tokens and projector train. The reference is the checkpoint T5X itself writes before its
first step (`checkpoint_0`), read back with Orbax as T5X saved it. Stage 1 runs 1 step,
then a second `t5x.train` resumes it from its own checkpoint to step 2 (T5X's Orbax
restore of the frozen parts' optimizer state); every large-decoder array is then
bit-identical to `checkpoint_0`, with no Adafactor state, and every array of the trained
parts moved. Then stage 2 (every part trains) starts from that checkpoint by T5X's
finetune.gin, optimizer state afresh, and moves the large decoder too (so stage 1 kept it
by freezing, not for want of a gradient).

  PYTHONPATH=$PWD:/path/to/t5x-site python -m pytest -q tests/t5x/test_t5x_train_parts.py
"""
import pathlib

import pytest

# `t5x.optimizers`, not `t5x`: without T5X, this tests/t5x folder imports as `t5x`.
pytest.importorskip("t5x.optimizers", reason="the real T5X is not importable: put a T5X "
                    "install on PYTHONPATH (docs/t5x.md) to run tests/t5x/")
import flax
import jax
import numpy as np
import orbax.checkpoint as ocp

from test_real_t5x import _run

TRAINED = ("small_decoder", "memory_tokens", "projector")
COMMON = ["--gin.MIXTURE_OR_TASK_NAME='decal_builtin_squid_restore'",
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'query': 16, 'targets': 40}",
          "--gin.BATCH_SIZE=4", "--gin.utils.SaveCheckpointConfig.period=1",
          "--gin.train.train_eval_dataset_cfg=None", "--gin.train.infer_eval_dataset_cfg=None"]
# a run whose TRAIN_PARTS differ from its checkpoint's starts the optimizer state afresh
# (docs/t5x.md), as decal_jax's trainer starts every stage
FRESH_OPTIMIZER_STATE = [
    "--gin.utils.RestoreCheckpointConfig.assignment_map=((r'state/param_states.*', None),)",
    "--gin.utils.RestoreCheckpointConfig.fallback_to_scratch=True"]


def _state(step_dir: pathlib.Path):
  """(params, Adafactor's per-parameter state) of a T5X Orbax step folder, flat by name."""
  state_dir = step_dir.absolute() / "state"
  tree = ocp.PyTreeCheckpointHandler().metadata(state_dir).tree
  as_numpy = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  saved = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
      state_dir, args=ocp.args.PyTreeRestore(item=tree, restore_args=as_numpy))
  params = flax.traverse_util.flatten_dict(saved["target"], sep="/")
  states = flax.traverse_util.flatten_dict(saved["state"]["param_states"], sep="/",
                                           keep_empty_nodes=True)
  return params, states


def _part(name: str) -> str:
  return name.split("/")[0]


def test_t5x_train_keeps_frozen_parts_bit_identical_then_trains_them(tmp_path):
  stage_1, stage_2 = tmp_path / "stage_1", tmp_path / "stage_2"
  for steps in (1, 2):  # the second run resumes the first from its checkpoint_1
    _run("train", "squid", *COMMON, f"--gin.TRAIN_STEPS={steps}",
         f"--gin.MODEL_DIR='{stage_1}'", f"--gin.TRAIN_PARTS={list(TRAINED)}", cwd=tmp_path)
  initial, _ = _state(stage_1 / "checkpoint_0")
  trained, states = _state(stage_1 / "checkpoint_2")
  assert {_part(n) for n in initial} == set(TRAINED) | {"large_decoder"}
  for name, value in initial.items():
    if _part(name) == "large_decoder":
      assert trained[name].dtype == value.dtype and np.array_equal(trained[name], value), name
      assert states[name].shape == () and states[name] == 0, name  # Frozen's placeholder
    else:
      assert np.any(trained[name] != value), name
      assert f"{name}/v" in states, name  # Adafactor's second-moment statistics
  # stage 2: every part trains, from stage 1's checkpoint (finetune.gin)
  _run("train", "squid", *COMMON, "--gin.TRAIN_STEPS=3", f"--gin.MODEL_DIR='{stage_2}'",
       f"--gin.INITIAL_CHECKPOINT_PATH='{stage_1 / 'checkpoint_2'}'", *FRESH_OPTIMIZER_STATE,
       cwd=tmp_path, run_file="finetune")
  restored, _ = _state(stage_2 / "checkpoint_2")  # what T5X restored and starts from
  assert all(np.array_equal(restored[n], trained[n]) for n in trained)
  moved, states = _state(stage_2 / "checkpoint_3")
  for name in initial:
    assert np.any(moved[name] != trained[name]), name
    assert f"{name}/v" in states, name


def test_train_parts_refuses_parts_that_name_nothing_and_is_the_optimizer_when_unbound():
  from t5x import adafactor
  from decal_jax.runtime import t5x_optimizers
  inner = adafactor.Adafactor()
  assert t5x_optimizers.train_parts(inner, None) is inner
  with pytest.raises(ValueError, match="non-empty list"):
    t5x_optimizers.train_parts(inner, "projector")
  params = {"projector": {"kernel": np.ones((2, 2), np.float32)},
            "large_decoder": {"scale": np.ones(2, np.float32)}}
  with pytest.raises(ValueError, match=r"any of \['projecter'\].*"
                                       r"\['large_decoder', 'projector'\]"):
    t5x_optimizers.train_parts(inner, ["projecter"]).init_state(params)
  with pytest.raises(ValueError, match=r"no parameter path contains \['projecter'\]"):
    t5x_optimizers.train_parts(inner, ["projector", "projecter"]).init_state(params)
