"""Surviving faults: SIGKILL and SIGTERM mid-run, then the same command again, end bitwise
equal to a run that never stopped; a NaN / Inf step stops training (naming the step, nothing
saved after it) or is skipped, by choice."""
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import decal_jax.tasks  # noqa: F401  (registers the seqio tasks)
from decal_jax import models, partitioning
from decal_jax.runtime import checkpoints, optimizers, resilience, train_state, trainer
from decal_jax.data import pipeline
from decal_jax.data import vocabularies
from decal_jax.networks.t5 import T5Config, Transformer

import paths

REPO = paths.REPO
STEPS = 12


# ------------------------------------------------------------------ kill and resume
def _command(model_dir):
  """The README's main job, shrunk: one checkpoint per step so a kill can land anywhere."""
  return [sys.executable, "-m", "decal_jax.train", "--gin_file=runs/pretrain_builtin.gin",
          f"--gin.MODEL_DIR='{model_dir}'", f"--gin.TRAIN_STEPS={STEPS}",
          "--gin.BATCH_SIZE=8", "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 12}",
          "--gin.WARMUP_STEPS=4", "--gin.CHECKPOINT_PERIOD=1", "--gin.KEEP_CHECKPOINTS=2",
          "--gin.LOG_PERIOD=1", "--gin.EVAL_PERIOD=1000", "--gin.EVAL_BATCHES=1",
          "--gin.trainer.train.show_example=False"]


def _start(model_dir):
  """The run in its own process; the four processes of a test share XLA's compilation
  cache (same programs: compiled once, then loaded)."""
  cache = pathlib.Path(model_dir).parent / "xla_cache"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return subprocess.Popen(_command(model_dir), cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _wait_for_checkpoint(model_dir, step, proc, timeout=300):
  deadline = time.time() + timeout
  while not (pathlib.Path(model_dir) / f"checkpoint_{step}").exists():
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    assert time.time() < deadline, "no checkpoint appeared"
    time.sleep(0.02)


def _finish(proc, timeout=300):
  out, _ = proc.communicate(timeout=timeout)
  return proc.returncode, out


def _saved(model_dir, step):
  manager = checkpoints.Checkpointer(str(model_dir)).manager
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))
  return jax.device_get(restored["state"]), dict(restored["data"])


def test_sigkill_then_sigterm_then_the_same_command_ends_bitwise_equal(tmp_path):
  straight = _start(tmp_path / "straight")  # the uninterrupted reference, alongside
  run = tmp_path / "interrupted"
  # 1. SIGKILL at a random moment after checkpoint 3: possibly mid-step or mid-save.
  proc = _start(run)
  _wait_for_checkpoint(run, 3, proc)
  time.sleep(random.uniform(0.0, 0.3))
  proc.send_signal(signal.SIGKILL)
  assert _finish(proc)[0] == -signal.SIGKILL
  # 2. The same command resumes; SIGTERM after checkpoint 7: save, message, exit 0.
  proc = _start(run)
  _wait_for_checkpoint(run, 7, proc)
  proc.send_signal(signal.SIGTERM)
  code, out = _finish(proc)
  assert code == 0, out[-3000:]
  assert "Resuming from step" in out
  stopped = int(out.split("Preempted (SIGTERM) after step ")[1].split(":")[0])
  assert 7 <= stopped < STEPS and (run / f"checkpoint_{stopped}").is_dir()
  # 3. The same command again finishes the run.
  code, out = _finish(_start(run))
  assert code == 0 and f"Resuming from step {stopped}" in out, out[-3000:]
  code, out = _finish(straight)
  assert code == 0, out[-3000:]
  got, got_data = _saved(run, STEPS)
  want, want_data = _saved(tmp_path / "straight", STEPS)
  assert got_data == want_data and got_data["batches_consumed"] == STEPS
  assert int(got["step"]) == STEPS
  want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
  got_leaves, got_tree = jax.tree_util.tree_flatten(got)
  assert got_tree == want_tree
  for (path, a), b in zip(want_leaves, got_leaves):  # bitwise, every leaf of the state
    np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------ non-finite guard
LENGTHS = {"inputs": 32, "targets": 12}


class PoisonedModel(models.EncoderDecoderModel):
  """The loss is NaN on the one batch whose target tokens sum to `poison`."""
  poison = -1

  def loss_fn(self, params, batch, dropout_rng):
    loss, aux = super().loss_fn(params, batch, dropout_rng)
    hit = jnp.sum(batch["decoder_target_tokens"]) == self.poison
    return jnp.where(hit, jnp.nan, loss), aux


def _model(cls=models.EncoderDecoderModel):
  vocab = vocabularies.builtin_vocabulary()
  cfg = T5Config(vocab_size=4224, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                 num_encoder_layers=1, num_decoder_layers=1, compression_ratio=4)
  return cls(Transformer(cfg), vocab, vocab)


def _cfg():
  return pipeline.DatasetConfig("decal_builtin_span_corruption", LENGTHS, batch_size=8)


def _optimizer():
  return optimizers.adafactor(optimizers.rsqrt_schedule(0.5, warmup_steps=2))


@pytest.fixture(scope="module")
def batches():
  stream = pipeline.train_batches(_cfg(), _model(), skip=0)
  return [next(stream) for _ in range(5)]


def _poisoned(batches, index):
  model = _model(PoisonedModel)
  model.poison = int(np.sum(batches[index]["decoder_target_tokens"]))
  assert sum(int(np.sum(b["decoder_target_tokens"])) == model.poison for b in batches) == 1
  return model


def _train(model, model_dir, policy, steps=5):
  return trainer.train(model=model, train_dataset_cfg=_cfg(), model_dir=str(model_dir),
                       total_steps=steps, optimizer=_optimizer(), checkpoint_period=2,
                       eval_period=1000, eval_batches=1, log_period=1, show_example=False,
                       nonfinite_policy=policy)


def test_a_nan_loss_stops_training_naming_the_step_and_keeps_the_last_good_checkpoint(
    tmp_path, batches):
  with pytest.raises(resilience.NonFiniteError) as err:
    _train(_poisoned(batches, 2), tmp_path, "raise")  # the 3rd batch: step 3
  message = str(err.value)
  assert message.startswith("Step 3: the loss or a gradient is NaN / Inf")
  assert "latest checkpoint, step 2" in message and "NONFINITE_POLICY" in message
  ckpt = checkpoints.Checkpointer(str(tmp_path))
  assert ckpt.latest_step() == 2  # the periodic save at step 4 never happened
  ckpt.close()
  saved, data = _saved(tmp_path, 2)
  assert data["batches_consumed"] == 2
  # The checkpoint holds the two good steps: the plain model trained on batches 1 and 2.
  jax.tree_util.tree_map(np.testing.assert_array_equal, saved["params"],
                         _trained_on(batches[:2]))


def _trained_on(batches):
  """Params of the plain model trained from seed 0 on `batches`, one step each."""
  model, opt, part = _model(), _optimizer(), partitioning.Partitioner()
  state, shardings = train_state.init_state(model, opt, part, _cfg(), seed=0)
  step = trainer.make_train_step(model, opt, part, shardings)
  for batch in batches:
    state, _ = step(state, pipeline.to_global(batch, part), jax.random.PRNGKey(1))
  return jax.device_get(state["params"])


def test_skipping_a_nan_step_equals_training_without_that_batch(tmp_path, batches, capsys):
  _train(_poisoned(batches, 2), tmp_path, "skip")
  assert "step(s) [3]: the loss or a gradient was NaN / Inf" in capsys.readouterr().out
  got, data = _saved(tmp_path, 5)
  assert int(got["step"]) == 5 and data["batches_consumed"] == 5
  # Reference: the plain model trained on batches 1, 2, 4, 5 only. The same jitted step on
  # the same batches and optimizer state (a skipped step leaves it, and so the learning
  # rate, as it was): bitwise equal.
  jax.tree_util.tree_map(np.testing.assert_array_equal, got["params"],
                         _trained_on(batches[:2] + batches[3:]))


def test_an_unknown_nonfinite_policy_is_refused():
  with pytest.raises(ValueError, match="nonfinite_policy must be one of"):
    resilience.NonFiniteGuard("ignore")
