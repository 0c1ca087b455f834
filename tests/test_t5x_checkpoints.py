"""T5X checkpoints read and written without T5X (`decal_jax.interop.t5x_checkpoints`).

The reader is held to T5X's own bytes: tests/fixtures/t5x_tiny_checkpoint/ is a tiny T5.1.1
of T5X's network saved by the real T5X in both of its layouts, with T5X's forward logits on
a fixed batch (tests/fixtures/make_t5x_fixture.py made it). Mapped into our T5 network at
the same sizes, the params must give T5X's logits. The writer is checked here by reading
back; tests/t5x/test_checkpoints.py restores its output with the real T5X.
"""
import dataclasses
import os
import subprocess
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax.interop import t5x_checkpoints
from decal_jax.runtime import checkpoints, train_state
from decal_jax.networks import param_layout
from decal_jax.networks.t5 import T5Config, Transformer
import paths
import tolerances

FIXTURE = paths.REPO / "tests" / "fixtures" / "t5x_tiny_checkpoint"
LAYOUTS = {"msgpack": FIXTURE / "legacy", "orbax": FIXTURE / "orbax"}
# The sizes of make_t5x_fixture.CONFIG in our T5Config.
TINY = T5Config(vocab_size=32, emb_dim=16, num_heads=2, num_encoder_layers=2,
                num_decoder_layers=2, head_dim=8, mlp_dim=32)


@dataclasses.dataclass
class _Sizes:  # TINY as tolerances.stack_reductions reads it (both stacks)
  emb_dim: int = TINY.emb_dim
  num_heads: int = TINY.num_heads
  head_dim: int = TINY.head_dim
  mlp_dim: int = TINY.mlp_dim
  num_layers: int = TINY.num_encoder_layers + 2 * TINY.num_decoder_layers  # cross-attention


def _batch():
  return {k: jnp.asarray(v) for k, v in np.load(FIXTURE / "batch.npz").items()}


def _fresh(cfg: T5Config, seed: int = 0):
  batch = _batch()
  return Transformer(cfg).init(jax.random.PRNGKey(seed), **batch, enable_dropout=False)["params"]


def _flat(tree):
  return {k: np.asarray(v) for k, v in flax.traverse_util.flatten_dict(
      flax.core.unfreeze(tree), sep="/").items()}


def _logits(cfg: T5Config, params):
  return np.asarray(Transformer(cfg).apply({"params": params}, **_batch(),
                                           enable_dropout=False))  # [batch, 6, vocab]


def _assert_t5x_logits(logits):
  """Equal to T5X's at every real target position (T5X also masks padded target rows,
  whose logits no loss or decode reads)."""
  expected = np.load(FIXTURE / "logits.npy")
  real = np.asarray(_batch()["decoder_target_tokens"]) > 0
  reductions = tolerances.stack_reductions(_Sizes(), keys=12)  # 12 encoder positions
  np.testing.assert_allclose(logits[real], expected[real], rtol=0,
                             atol=tolerances.network_atol(expected, reductions))


# ------------------------------------------------------------------------------ reading
def test_both_t5x_layouts_are_found_and_hold_the_same_t5x_params():
  legacy = t5x_checkpoints.find_t5x_checkpoint(str(LAYOUTS["msgpack"]))  # a MODEL_DIR
  assert legacy == LAYOUTS["msgpack"] / "checkpoint_100"
  assert t5x_checkpoints.find_t5x_checkpoint(str(legacy / "checkpoint")) == legacy
  assert t5x_checkpoints.find_t5x_checkpoint(str(FIXTURE)) is None  # holds no step folder
  orbax = t5x_checkpoints.find_t5x_checkpoint(str(LAYOUTS["orbax"] / "checkpoint_100"))
  assert [t5x_checkpoints.t5x_format(d) for d in (legacy, orbax)] == ["msgpack", "orbax"]
  a, b = t5x_checkpoints.read_t5x_params(legacy), t5x_checkpoints.read_t5x_params(orbax)
  assert sorted(a) == sorted(b) and len(a) == 52  # target only: no optimizer state
  for name in a:
    np.testing.assert_array_equal(a[name], b[name])
  assert a["encoder/layers_0/attention/query/kernel"].shape == (16, 16)  # [embed, heads*kv]
  assert a["decoder/layers_1/encoder_decoder_attention/out/kernel"].shape == (16, 16)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_t5x_checkpoint_starts_our_t5_with_t5x_logits(layout):
  fresh = _fresh(TINY)
  params, report = checkpoints.restore_matching_params(str(LAYOUTS[layout]), fresh)
  assert report["initialised"] == [] and report["unused"] == []
  assert len(report["restored"]) == len(_flat(fresh))
  _assert_t5x_logits(_logits(TINY, params))


def test_a_t5x_checkpoint_loads_into_the_scanned_fused_layout():
  cfg = dataclasses.replace(TINY, scan_layers=True, fused_qkv=True)
  params, report = checkpoints.restore_matching_params(str(LAYOUTS["msgpack"]), _fresh(cfg))
  assert report["converted"] == "scan_layers: False -> True, fused_qkv: False -> True"
  _assert_t5x_logits(_logits(cfg, params))


def test_decal_from_t5x_initialises_exactly_its_latents_and_reports_them(capsys):
  """The paper's fine-tune-only start: every T5.1.1 weight copied, DeCAL's latent vector
  and norm freshly initialised and named."""
  cfg = dataclasses.replace(TINY, compression_ratio=4)
  fresh = _fresh(cfg, seed=3)
  params = train_state.start_from(str(LAYOUTS["orbax"]), fresh)
  out = capsys.readouterr().out
  assert "2 newly initialised" in out and "encoder/latents/latent_vector" in out
  mapped = t5x_checkpoints.from_t5x_names(
      t5x_checkpoints.read_t5x_params(LAYOUTS["orbax"] / "checkpoint_100"))
  got, init = _flat(params), _flat(fresh)
  assert sorted(set(got) - set(mapped)) == ["encoder/latents/latent_norm/scale",
                                            "encoder/latents/latent_vector"]
  for name, value in got.items():
    np.testing.assert_array_equal(value, mapped[name] if name in mapped else init[name])


def test_a_folder_that_is_neither_checkpoint_is_named(tmp_path):
  (tmp_path / "checkpoint_3" / "state").mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match="neither a decal_jax checkpoint .* nor a T5X"):
    checkpoints.restore_matching_params(str(tmp_path), _fresh(TINY))


# ------------------------------------------------------------------------------ names
def test_t5x_names_round_trip_and_refuse_what_t5x_has_not():
  ours = _flat(_fresh(TINY))
  t5x = t5x_checkpoints.to_t5x_names(ours)
  legacy = t5x_checkpoints.read_t5x_params(LAYOUTS["msgpack"] / "checkpoint_100")
  assert {k: v.shape for k, v in t5x.items()} == {k: v.shape for k, v in legacy.items()}
  back = t5x_checkpoints.from_t5x_names(t5x)
  assert sorted(back) == sorted(ours)
  for name in ours:
    np.testing.assert_array_equal(back[name], ours[name])
  with pytest.raises(ValueError, match="encoder/latents/latent_vector"):
    t5x_checkpoints.to_t5x_names(_flat(_fresh(dataclasses.replace(TINY, compression_ratio=4))))
  with pytest.raises(ValueError, match="128 buckets|\\[128\\] buckets"):
    t5x_checkpoints.to_t5x_names(_flat(_fresh(dataclasses.replace(
        TINY, relative_attention_num_buckets=128))))


def test_scanned_fused_params_export_unrolled_with_t5x_names():
  cfg = dataclasses.replace(TINY, scan_layers=True, fused_qkv=True)
  scanned = _flat(_fresh(cfg))
  plain = param_layout.convert_params(
      flax.traverse_util.unflatten_dict(scanned, sep="/"), cfg, TINY)
  expected = t5x_checkpoints.to_t5x_names(_flat(plain))
  got = t5x_checkpoints.to_t5x_names(scanned)
  assert sorted(got) == sorted(expected)
  for name in got:
    np.testing.assert_array_equal(got[name], expected[name])


# ------------------------------------------------------------------------------ writing
def test_written_checkpoints_read_back_exactly(tmp_path):
  params = _flat(_fresh(dataclasses.replace(TINY, compression_ratio=4)))
  params["decoder/decoder_norm/scale"] = params["decoder/decoder_norm/scale"].astype(
      jnp.bfloat16)  # T5X's version 3 stores bfloat16 as it is
  step_dir = t5x_checkpoints.write_t5x_checkpoint(params, str(tmp_path), 7)
  assert step_dir == tmp_path / "checkpoint_7" and sorted(os.listdir(tmp_path)) == \
      ["checkpoint_7"]
  assert t5x_checkpoints.find_t5x_checkpoint(str(tmp_path)) == step_dir
  back = t5x_checkpoints.read_t5x_params(step_dir)
  assert sorted(back) == sorted(params)
  for name, value in params.items():
    assert back[name].dtype == value.dtype
    np.testing.assert_array_equal(back[name], value)
  with pytest.raises(FileExistsError):
    t5x_checkpoints.write_t5x_checkpoint(params, str(tmp_path), 7)


def test_chunks_divide_the_shape_within_the_budget():
  assert t5x_checkpoints.chunk_shape((32128, 4096), 2**24) == [4016, 4096]
  assert t5x_checkpoints.chunk_shape((16, 16), 100) == [8, 8]  # the larger dim halves first
  assert t5x_checkpoints.chunk_shape((), 10) == []
  for shape, budget in [((12, 10, 7), 50), ((97,), 10)]:
    chunk = t5x_checkpoints.chunk_shape(shape, budget)
    assert np.prod(chunk) <= budget and all(s % c == 0 for s, c in zip(shape, chunk))


def test_export_tool_writes_what_restore_reads_back(tmp_path):
  params = _fresh(TINY)
  ckpt = checkpoints.Checkpointer(str(tmp_path / "run"), keep=1)
  ckpt.save(5, {"params": params}, {}, force=True)
  ckpt.close()
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(paths.REPO))
  run = lambda *args: subprocess.run(
      [sys.executable, "-m", "decal_jax.commands.export_t5x", *args], env=env,
      capture_output=True, text=True, timeout=300)
  done = run("--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "t5x"),
             "--t5x_names")
  assert done.returncode == 0, done.stderr
  assert "52 params written with T5X network names" in done.stdout
  got = t5x_checkpoints.read_t5x_params(tmp_path / "t5x" / "checkpoint_5")
  expected = t5x_checkpoints.to_t5x_names(_flat(params))
  for name in expected:
    np.testing.assert_array_equal(got[name], expected[name])
  again = run("--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "t5x"))
  assert again.returncode == 2 and "exists already" in again.stderr
