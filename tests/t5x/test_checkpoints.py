"""Checkpoints between the real T5X and decal_jax (docs/t5x_checkpoints.md).

Run with T5X importable (`PYTHONPATH=$PWD:/path/to/t5x-site`); skipped without it, as in
CI, where tests/test_t5x_checkpoints.py holds the reader to bytes T5X wrote earlier.

- decal_jax -> T5X: an export restores in T5X (`load_t5x_checkpoint`, the `Checkpointer`,
  and the Orbax manager `t5x.eval` / `t5x.infer` use) to exactly the exported values; with
  T5X names T5X's own network then gives our logits, with decal_jax names a T5X model
  running our DeCAL network holds our params.
  An export also starts a T5X fine-tuning run (Adafactor, its state started afresh).
- T5X -> decal_jax: a checkpoint T5X writes now (both layouts) starts our network, whose
  logits then equal T5X's forward on the same batch.
"""
import dataclasses

import flax
import jax
import numpy as np
import pytest

# `t5x.checkpoints`, not `t5x`: without T5X, this tests/t5x folder imports as `t5x`.
pytest.importorskip("t5x.checkpoints", reason="the real T5X is not importable: put a T5X "
                    "install on PYTHONPATH (docs/t5x.md) to run tests/t5x/")
import seqio
from t5x import checkpoints as t5x_checkpointing
from t5x import adafactor, models, partitioning, utils
from t5x import train_state as t5x_train_state
from t5x.examples.t5 import network

from decal_jax.interop import t5x_checkpoints
from decal_jax.runtime import checkpoints
from decal_jax.networks.t5 import T5Config, Transformer
import tolerances

SIZES = dict(vocab_size=40, emb_dim=24, num_heads=3, num_encoder_layers=2,
             num_decoder_layers=3, head_dim=8, mlp_dim=40, mlp_activations=("gelu", "linear"),
             dropout_rate=0.0, logits_via_embedding=False)
OURS = T5Config(**SIZES)


def _batch():
  rng = np.random.default_rng(1)
  encoder = rng.integers(2, SIZES["vocab_size"], (3, 16)).astype(np.int32)  # C = 4 divides
  encoder[2, 9:] = 0
  targets = rng.integers(2, SIZES["vocab_size"], (3, 7)).astype(np.int32)
  targets[1, 5:] = 0
  inputs = np.concatenate([np.zeros((3, 1), np.int32), targets[:, :-1]], axis=1)
  return {"encoder_input_tokens": encoder, "decoder_input_tokens": inputs,
          "decoder_target_tokens": targets}


def _t5x_model(module) -> models.EncoderDecoderModel:
  vocabulary = seqio.PassThroughVocabulary(SIZES["vocab_size"])
  return models.EncoderDecoderModel(module=module, input_vocabulary=vocabulary,
                                    output_vocabulary=vocabulary, optimizer_def=None)


def _inference_state(model, seed: int):
  """What `t5x.eval` / `t5x.infer` restore into: params (no optimizer state) and step."""
  shapes = {k: v.shape for k, v in _batch().items()}
  variables = model.get_initial_variables(jax.random.PRNGKey(seed), shapes)
  return t5x_train_state.InferenceState.create(variables)


def _flat(tree):
  return {k: np.asarray(v) for k, v in flax.traverse_util.flatten_dict(
      flax.core.unfreeze(tree), sep="/").items()}


def _export(params, tmp_path, t5x_names: bool):
  """params saved as a decal_jax run at step 9, exported as decal_jax/commands/export_t5x.py does."""
  run = checkpoints.Checkpointer(str(tmp_path / "run"), keep=1)
  run.save(9, {"params": params}, {}, force=True)
  run.close()
  _, step, flat = checkpoints.read_saved_params(str(tmp_path / "run"))
  flat = t5x_checkpoints.to_t5x_names(flat) if t5x_names else flat
  t5x_checkpoints.write_t5x_checkpoint(flat, str(tmp_path / "t5x"), step)
  return str(tmp_path / "t5x"), flat


def _t5x_restores(state, model_dir: str):
  """The state restored by T5X's three readers, each as a flat dict of params."""
  partitioner = partitioning.PjitPartitioner(num_partitions=1)
  loaded = t5x_checkpointing.load_t5x_checkpoint(model_dir)
  assert int(loaded["state"]["step"]) == 9
  legacy = t5x_checkpointing.Checkpointer(state, partitioner, model_dir).restore(step=9)
  manager = t5x_checkpointing.OrbaxCheckpointManagerInterface(model_dir, state, partitioner)
  orbax = manager.restore(step=9)  # t5x.eval / t5x.infer's restore (use_orbax=True)
  assert int(orbax.step) == 9
  return {"load_t5x_checkpoint": _flat(loaded["target"]), "Checkpointer": _flat(legacy.params),
          "OrbaxCheckpointManagerInterface": _flat(orbax.params)}


def _real(logits):
  return logits[_batch()["decoder_target_tokens"] > 0]  # rows T5X does not mask


def _atol(expected):
  @dataclasses.dataclass
  class Sizes:  # both stacks as tolerances.stack_reductions reads them
    emb_dim: int = OURS.emb_dim
    num_heads: int = OURS.num_heads
    head_dim: int = OURS.head_dim
    mlp_dim: int = OURS.mlp_dim
    num_layers: int = OURS.num_encoder_layers + 2 * OURS.num_decoder_layers
  return tolerances.network_atol(expected, tolerances.stack_reductions(Sizes(), keys=16))


def test_an_export_with_t5x_names_restores_in_t5x_and_gives_our_logits(tmp_path):
  batch = _batch()
  ours = Transformer(OURS).init(jax.random.PRNGKey(4), **batch, enable_dropout=False)["params"]
  model_dir, exported = _export(ours, tmp_path, t5x_names=True)
  model = _t5x_model(network.Transformer(network.T5Config(**SIZES)))
  for reader, restored in _t5x_restores(_inference_state(model, seed=0), model_dir).items():
    assert sorted(restored) == sorted(exported), reader
    for name, value in exported.items():
      np.testing.assert_array_equal(restored[name], value, err_msg=f"{reader}: {name}")
  params = flax.traverse_util.unflatten_dict(exported, sep="/")
  t5x_logits = np.asarray(model.module.apply({"params": params}, **batch, enable_dropout=False))
  our_logits = np.asarray(Transformer(OURS).apply({"params": ours}, **batch,
                                                  enable_dropout=False))
  np.testing.assert_allclose(_real(our_logits), _real(t5x_logits), rtol=0,
                             atol=_atol(t5x_logits))


def test_an_export_starts_t5x_fine_tuning_with_a_fresh_adafactor_state(tmp_path):
  """What `t5x.train` does with INITIAL_CHECKPOINT_PATH and the two bindings of
  docs/t5x_checkpoints.md: params from the export, Adafactor's state from scratch."""
  ours = Transformer(OURS).init(jax.random.PRNGKey(6), **_batch(),
                                enable_dropout=False)["params"]
  model_dir, exported = _export(ours, tmp_path, t5x_names=True)
  optimizer = adafactor.Adafactor(decay_rate=0.8, step_offset=0, logical_factor_rules=
                                  adafactor.standard_logical_factor_rules())
  model = _t5x_model(network.Transformer(network.T5Config(**SIZES)))
  initializer = utils.TrainStateInitializer(
      optimizer_def=optimizer, init_fn=model.get_initial_variables,
      input_shapes={k: v.shape for k, v in _batch().items()},
      partitioner=partitioning.PjitPartitioner(num_partitions=1))
  restore = utils.RestoreCheckpointConfig(
      path=f"{model_dir}/checkpoint_9", mode="specific", fallback_to_scratch=True,
      assignment_map=((r"state/param_states.*", None),))
  state = initializer.from_checkpoint([restore], init_rng=jax.random.PRNGKey(0))
  assert int(state.step) == 9
  restored = _flat(state.params)
  assert sorted(restored) == sorted(exported)
  for name, value in exported.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)


def test_decal_exported_with_its_names_restores_into_t5x_running_our_network(tmp_path):
  """DeCAL C = 4 under T5X (gin/t5x/): T5X restores our export exactly, and what T5X
  saves of it (its default Orbax layout) starts a decal_jax run with the same params."""
  decal = dataclasses.replace(OURS, compression_ratio=4)
  model = _t5x_model(Transformer(decal))
  ours = Transformer(decal).init(jax.random.PRNGKey(5), **_batch(),
                                 enable_dropout=False)["params"]
  model_dir, exported = _export(ours, tmp_path, t5x_names=False)
  state = _inference_state(model, seed=0)
  for reader, restored in _t5x_restores(state, model_dir).items():
    assert sorted(restored) == sorted(exported), reader
    for name, value in exported.items():
      np.testing.assert_array_equal(restored[name], value, err_msg=f"{reader}: {name}")
  saved = state.replace_params(flax.traverse_util.unflatten_dict(exported, sep="/"))
  _save_orbax(saved, partitioning.PjitPartitioner(num_partitions=1), tmp_path / "t5x_run")
  back, report = checkpoints.restore_matching_params(str(tmp_path / "t5x_run"), ours)
  assert report["initialised"] == [] and report["unused"] == []
  for name, value in _flat(back).items():
    np.testing.assert_array_equal(value, exported[name])


def _save_orbax(state, partitioner, model_dir):
  model_dir.mkdir()
  manager = t5x_checkpointing.OrbaxCheckpointManagerInterface(str(model_dir), state,
                                                              partitioner)
  manager.save(state)
  manager.wait_until_finished()
  manager.close()


@pytest.mark.parametrize("layout", ["msgpack", "orbax"])
def test_a_checkpoint_t5x_writes_starts_our_t5_with_t5x_logits(tmp_path, layout):
  batch = _batch()
  model = _t5x_model(network.Transformer(network.T5Config(**SIZES)))
  state = _inference_state(model, seed=11)
  partitioner = partitioning.PjitPartitioner(num_partitions=1)
  if layout == "orbax":
    _save_orbax(state, partitioner, tmp_path / "t5x")
  else:
    t5x_checkpointing.Checkpointer(state, partitioner, str(tmp_path / "t5x")).save(state)
  fresh = Transformer(OURS).init(jax.random.PRNGKey(0), **batch, enable_dropout=False)
  params, report = checkpoints.restore_matching_params(str(tmp_path / "t5x"), fresh["params"])
  assert report["initialised"] == [] and report["unused"] == []
  t5x_logits = np.asarray(model.module.apply({"params": state.params}, **batch,
                                             enable_dropout=False))
  our_logits = np.asarray(Transformer(OURS).apply({"params": params}, **batch,
                                                  enable_dropout=False))
  np.testing.assert_allclose(_real(our_logits), _real(t5x_logits), rtol=0,
                             atol=_atol(t5x_logits))
  assert np.abs(_real(t5x_logits)).max() > 0.5  # the comparison is not of near-zeros
