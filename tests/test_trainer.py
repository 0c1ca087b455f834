"""Trainer: the loss falls, a resumed run equals an uninterrupted one, bad input is refused."""
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decal_jax.tasks  # noqa: F401  (registers the seqio tasks)
from decal_jax import models, partitioning
from decal_jax.runtime import checkpoints, evaluation, optimizers, train_state, trainer
from decal_jax.data import pipeline
from decal_jax.data import batch_iterator, vocabularies
from decal_jax.networks.t5 import T5Config, Transformer

LENGTHS = {"inputs": 32, "targets": 12}


def _model(emb_dim=32, ratio=4, compressor="latents"):
  vocab = vocabularies.builtin_vocabulary()
  cfg = T5Config(vocab_size=4224, emb_dim=emb_dim, num_heads=2, head_dim=16, mlp_dim=64,
                 num_encoder_layers=2, num_decoder_layers=2, compression_ratio=ratio,
                 compressor=compressor)
  return models.EncoderDecoderModel(Transformer(cfg), vocab, vocab)


def _cfg(**kw):
  return pipeline.DatasetConfig("decal_builtin_span_corruption", LENGTHS, batch_size=8, **kw)


def _optimizer():
  return optimizers.adafactor(optimizers.rsqrt_schedule(0.5, warmup_steps=5))


def test_short_training_run_lowers_the_loss():
  model, opt, part = _model(), _optimizer(), partitioning.Partitioner()
  state, shardings = train_state.init_state(model, opt, part, _cfg(), seed=0)
  step = trainer.make_train_step(model, opt, part, shardings)
  batches = pipeline.train_batches(_cfg(), model, skip=0)
  losses = []
  for _ in range(40):
    state, aux = step(state, pipeline.to_global(next(batches), part), jax.random.PRNGKey(0))
    losses.append(float(aux["loss"]))
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses


def _train(model_dir, steps, **kw):
  return trainer.train(model=_model(), train_dataset_cfg=_cfg(), model_dir=str(model_dir),
                       total_steps=steps, optimizer=_optimizer(), checkpoint_period=3,
                       eval_period=1000, eval_batches=1, log_period=3, show_example=False,
                       **kw)


def _restore(model_dir):
  return _restore_with(model_dir, _optimizer())


def test_resume_continues_where_it_stopped(tmp_path, capsys, monkeypatch):
  _train(tmp_path / "straight", 6)
  _train(tmp_path / "resumed", 3)
  assert (tmp_path / "resumed/checkpoint_3/dataset/process_0-of-1.index").exists()
  # A checkpoint without the input position (written before it was saved) still resumes
  # exactly, by reading the consumed batches again.
  shutil.copytree(tmp_path / "resumed", tmp_path / "old_format")
  shutil.rmtree(tmp_path / "old_format/checkpoint_3/dataset")
  advanced = []
  monkeypatch.setattr(batch_iterator.BatchIterator, "advance",
                      lambda self, n, show_progress=True: advanced.append(n) or
                      [next(self._iterator) for _ in range(n)])
  _train(tmp_path / "resumed", 6)  # the same command again, with more steps
  assert "Resuming from step 3" in capsys.readouterr().out
  assert sum(advanced) == 0  # the saved position, not 3 batches read again
  _train(tmp_path / "old_format", 6)
  assert "reading the 3 consumed batches again" in capsys.readouterr().out
  assert sum(advanced) == 3
  straight, straight_data = _restore(tmp_path / "straight")
  for name in ("resumed", "old_format"):
    resumed, resumed_data = _restore(tmp_path / name)
    assert int(resumed["step"]) == int(straight["step"]) == 6
    assert resumed_data == straight_data == {"batches_consumed": 6, "seed": 0, "rng": [0, 1]}
    # Bitwise: the same compiled step on the same batches from the same state.
    jax.tree_util.tree_map(np.testing.assert_array_equal, resumed["params"],
                           straight["params"])
    jax.tree_util.tree_map(np.testing.assert_array_equal, resumed["opt_state"],
                           straight["opt_state"])
  # The batch after a resume at step 3 is the 4th batch of an uninterrupted stream.
  model = _model()
  fresh = pipeline.train_batches(_cfg(), model, skip=0)
  fourth = [next(fresh) for _ in range(4)][-1]
  after_resume = next(pipeline.train_batches(_cfg(), model, skip=3))
  for k in fourth:
    np.testing.assert_array_equal(fourth[k], after_resume[k])


def _snapshot(directory):
  return sorted((str(p.relative_to(directory)), p.stat().st_mtime_ns, p.stat().st_size)
                for p in pathlib.Path(directory).rglob("*"))


def test_checkpoint_of_another_architecture_is_refused_and_left_intact(tmp_path):
  _train(tmp_path, 3)
  before = _snapshot(tmp_path)
  with pytest.raises(checkpoints.ArchitectureMismatchError) as err:
    trainer.train(model=_model(emb_dim=48), train_dataset_cfg=_cfg(), model_dir=str(tmp_path),
                  total_steps=6, optimizer=_optimizer())
  message = str(err.value)
  assert "with another shape" in message
  assert "shape differs:          decoder/decoder_norm/scale checkpoint [32] vs model [48]" in message
  assert "new MODEL_DIR" in message
  assert _snapshot(tmp_path) == before


def test_feature_lengths_that_do_not_fit_are_refused():
  with pytest.raises(ValueError, match="targets would be cut"):
    pipeline.check_feature_lengths(
        pipeline.DatasetConfig("decal_builtin_span_corruption", {"inputs": 128, "targets": 8}),
        _model())
  with pytest.raises(ValueError, match="positive integer 'inputs'"):
    pipeline.check_feature_lengths(
        pipeline.DatasetConfig("decal_builtin_span_corruption", {"targets": 8}), _model())
  small = _model()
  small.module = Transformer(T5Config(vocab_size=512, emb_dim=16, num_heads=2, head_dim=8,
                                      mlp_dim=16, num_encoder_layers=1, num_decoder_layers=1))
  with pytest.raises(ValueError, match="vocab_size >= "):
    pipeline.check_feature_lengths(_cfg(), small)


def test_infer_refuses_empty_input(tmp_path):
  with pytest.raises(ValueError, match="Input 1 is empty or whitespace only"):
    evaluation.infer(model=_model(), inputs=["some text", "   "], model_dir=str(tmp_path),
                     task_feature_lengths=LENGTHS)


def _summaries(folder: pathlib.Path):
  """{tag: [(step, summary value)]} from a TensorBoard folder's event files."""
  import tensorflow as tf
  out = {}
  for path in sorted(folder.glob("events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      for value in event.summary.value:
        out.setdefault(value.tag, []).append((event.step, value))
  return out


def test_tensorboard_metrics_learning_rate_config_and_hparams_are_written(tmp_path):
  import tensorflow as tf
  _train(tmp_path, 6, gin_config_text="# operative config\nMODEL_DIR = 'x'\n",
         checkpoint_input=False)
  assert not (tmp_path / "checkpoint_6" / "dataset").exists()  # switched off
  assert (tmp_path / "config.gin").read_text() == "# operative config\nMODEL_DIR = 'x'\n"
  assert list((tmp_path / "training_eval" / _cfg().mixture_or_task_name)  # T5X's layout
              .glob("events.out.tfevents.*"))
  train = _summaries(tmp_path / "train")
  # rsqrt_schedule(0.5, warmup_steps=5) at the step taken last (optax counts from 0):
  # 0.5 * min(s / 5, 1) / sqrt(max(s, 5)) for s = 2 (logged at step 3) and s = 5 (step 6).
  logged = {step: float(tf.make_ndarray(v.tensor)) for step, v in train["learning_rate"]}
  want = {3: 0.5 * (2 / 5) / np.sqrt(5), 6: 0.5 / np.sqrt(5)}
  assert logged == pytest.approx(want, rel=1e-6)
  assert {step for step, _ in train["loss"]} == {3, 6}
  (step, text), = train["config"]  # a text summary (plugin "text")
  assert text.metadata.plugin_data.plugin_name == "text"
  assert step == 0 and "MODEL_DIR = 'x'" in tf.make_ndarray(text.tensor).item().decode()
  hparams = [v for values in train.values() for _, v in values
             if v.metadata.plugin_data.plugin_name == "hparams"]
  assert hparams and b"decal_builtin_span_corruption" in b"".join(
      v.metadata.plugin_data.content for v in hparams)


def test_model_info_lists_every_parameter_with_its_shape_and_partitioning(tmp_path):
  """MODEL_DIR/model-info.txt (T5X's lines) against the model's own parameter tree."""
  import flax
  _train(tmp_path, 1)
  model, part = _model(), partitioning.Partitioner()
  variables = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), model.input_shapes(LENGTHS)))
  params = flax.traverse_util.flatten_dict(variables["params"], sep="/")
  specs = flax.traverse_util.flatten_dict(
      part.params_shardings(variables["params_axes"], variables["params"]), sep="/")
  lines = (tmp_path / "model-info.txt").read_text().splitlines()
  listed = {}
  for line in lines[:-1]:
    name, size, shape, spec = re.fullmatch(
        r"Variable (\S+) +size (\d+) +shape (\(.*?\)) +partition spec (.*)", line).groups()
    dims = tuple(int(d.split("=")[-1]) for d in shape.strip("()").split(", ") if d)
    listed[name] = (int(size), dims, spec)
  assert listed == {name: (int(np.prod(v.shape)), tuple(v.shape), str(tuple(specs[name].spec)))
                    for name, v in params.items()}
  assert "shape (embed=32, mlp=64)" in (tmp_path / "model-info.txt").read_text()  # logical names
  assert lines[-1] == f"Total number of parameters: {sum(s for s, _, _ in listed.values())}"


def test_a_half_written_checkpoint_is_never_taken_as_the_latest(tmp_path):
  """Orbax writes into a temporary directory and renames it when complete; a crash mid-save
  leaves only the temporary directory, which must be ignored on resume."""
  _train(tmp_path, 3)
  partial = tmp_path / "checkpoint_9.orbax-checkpoint-tmp-1234567890"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "half_written").write_bytes(b"\0" * 100)
  ckpt = checkpoints.Checkpointer(str(tmp_path))
  assert ckpt.latest_step() == 3
  ckpt.close()
  restored, data = _restore(tmp_path)
  assert int(restored["step"]) == 3 and data["batches_consumed"] == 3


def test_eval_restores_params_whatever_optimizer_trained_them(tmp_path):
  trainer.train(model=_model(), train_dataset_cfg=_cfg(), model_dir=str(tmp_path),
                total_steps=2, optimizer=optimizers.adamw(lambda step: 1e-3),
                eval_batches=1, show_example=False)
  saved, _ = _restore_with(tmp_path, optimizers.adamw(lambda step: 1e-3))
  params, step = train_state.restore_params(_model(), str(tmp_path), _cfg(),
                                            partitioning.Partitioner())
  assert step == 2
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, saved["params"])


def _restore_with(model_dir, optimizer):
  model, part = _model(), partitioning.Partitioner()
  state, _ = train_state.init_state(model, optimizer, part, _cfg(), seed=0)
  ckpt = checkpoints.Checkpointer(str(model_dir))
  restored = ckpt.restore(ckpt.latest_step(), checkpoints.abstract_like(state))
  ckpt.close()
  return restored


@pytest.fixture(scope="module")
def baseline_dir(tmp_path_factory):
  """A C = 1 (uncompressed) model trained for 2 steps."""
  base = tmp_path_factory.mktemp("baseline")
  trainer.train(model=_model(ratio=1), train_dataset_cfg=_cfg(), model_dir=str(base),
                total_steps=2, optimizer=_optimizer(), checkpoint_period=2, eval_batches=1,
                show_example=False)
  return base


@pytest.mark.parametrize("compressor,new_scope", [("latents", "encoder/latents/"),
                                                  ("attn_pool", "encoder/attn_pool/"),
                                                  ("memory_tokens", "encoder/memory/")])
def test_starting_from_an_uncompressed_checkpoint_initialises_exactly_the_new_params(
    baseline_dir, compressor, new_scope):
  """CCProxy / fine-tune-only recipe: a C = 1 baseline's weights go into a 4x model; only
  the compressor's own parameters (DeCAL's latent vector and norm, AttnPool's pooling
  layer, CCProxy's memory table) keep their fresh values."""
  import orbax.checkpoint as ocp
  base = checkpoints.Checkpointer(str(baseline_dir)).manager.restore(
      2, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]["params"]
  model, part = _model(ratio=4, compressor=compressor), partitioning.Partitioner()
  fresh, _ = train_state.init_state(model, _optimizer(), part, _cfg(), seed=7)
  params, report = checkpoints.restore_matching_params(str(baseline_dir / "checkpoint_2"),
                                                       fresh["params"])
  flat = lambda t: {"/".join(k): np.asarray(v) for k, v in
                    __import__("flax").traverse_util.flatten_dict(t).items()}
  got, saved, init = flat(params), flat(base), flat(fresh["params"])
  new = sorted(set(init) - set(saved))
  assert new and all(k.startswith(new_scope) for k in new)
  assert sorted(report["initialised"]) == new and report["unused"] == []
  for k in saved:
    np.testing.assert_array_equal(got[k], saved[k])
  for k in new:
    np.testing.assert_array_equal(got[k], init[k])


def test_a_run_starts_from_an_initial_checkpoint_once_then_resumes_its_own(tmp_path, capsys):
  _train(tmp_path / "pre", 2)
  pre = _restore(tmp_path / "pre")[0]["params"]
  _train(tmp_path / "ft", 1, initial_checkpoint_path=str(tmp_path / "pre"), seed=5)
  assert "Starting from" in capsys.readouterr().out
  _train(tmp_path / "ft", 2, initial_checkpoint_path=str(tmp_path / "pre"), seed=5)
  out = capsys.readouterr().out
  assert "Resuming from step 1" in out and "Starting from" not in out
  ft = _restore(tmp_path / "ft")[0]
  assert int(ft["step"]) == 2  # counted from 0, not from the pretraining step
  seed5 = train_state.init_state(_model(), _optimizer(), partitioning.Partitioner(), _cfg(),
                                 seed=5)[0]["params"]
  kernel = lambda p: np.asarray(p["decoder"]["logits_dense"]["kernel"])
  # two small steps from the pretrained weights, not from the run's own (seed 5) init
  assert np.abs(kernel(ft["params"]) - kernel(pre)).max() < \
      0.1 * np.abs(kernel(seed5) - kernel(pre)).max()


def test_initial_checkpoint_errors_name_the_problem(tmp_path):
  with pytest.raises(FileNotFoundError, match="No checkpoint directory"):
    checkpoints.resolve_checkpoint(str(tmp_path / "nowhere"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="holds no checkpoint_<step>"):
    checkpoints.resolve_checkpoint(str(tmp_path / "empty"))


def test_the_steps_grad_norm_is_the_l2_norm_of_every_gradient_together():
  """train_step.global_norm (aux['grad_norm'], the NaN guard's input) against numpy in
  float64 over the leaves flattened into one vector."""
  from decal_jax.runtime import train_step
  rng = np.random.default_rng(0)
  tree = {"a": rng.normal(size=(3, 4)), "b": [rng.normal(size=5), rng.normal(size=(2, 2, 2))]}
  want = np.linalg.norm(np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)]))
  got = train_step.global_norm(jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32),
                                                      tree))
  np.testing.assert_allclose(float(got), want, rtol=1e-6)
  assert not np.isfinite(float(train_step.global_norm({"a": jnp.array([1.0, jnp.inf])})))
