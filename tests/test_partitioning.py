"""Sharding over a real 8-device mesh (8 CPU devices in a subprocess)."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, jax, numpy as np
    import decal_jax.tasks
    import sys
    from decal_jax import checkpoints, models, optimizers, partitioning, trainer
    CKPT_DIR = sys.argv[1]
    from decal_jax.data import vocabularies
    from decal_jax.networks.t5 import T5Config, Transformer
    vocab = vocabularies.builtin_vocabulary()
    cfg = T5Config(vocab_size=4224, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=64,
                   num_encoder_layers=1, num_decoder_layers=1, compression_ratio=4)
    model = models.EncoderDecoderModel(Transformer(cfg), vocab, vocab)
    data = trainer.DatasetConfig("decal_builtin_span_corruption",
                                 {"inputs": 32, "targets": 12}, batch_size=8)
    batch = next(trainer.train_batches(data, model, skip=0))
    out = {"devices": len(jax.devices())}
    saved = None
    for shape in [(2, 4), (8, 1)] if len(jax.devices()) == 8 else [(1, 1)]:
      part = partitioning.Partitioner(mesh_shape=shape)
      opt = optimizers.adafactor(optimizers.rsqrt_schedule(0.5, 5))
      state, shardings = trainer.init_state(model, opt, part, data, seed=0)
      step = trainer.make_train_step(model, opt, part, shardings)
      losses = []
      for _ in range(2):
        state, aux = step(state, trainer.to_global(batch, part), jax.random.PRNGKey(0))
        losses.append(float(aux["loss"]))
      wi = state["params"]["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
      mu = jax.tree_util.tree_leaves(state["opt_state"])  # Adafactor's unfactored v
      v_wi = [x for x in mu if x.shape == wi.shape][0]
      out[str(shape)] = {"losses": losses, "wi_spec": str(wi.sharding.spec),
                         "opt_shard_shape": list(v_wi.addressable_shards[0].data.shape),
                         "wi_shards": len(wi.addressable_shards),
                         "wi_shard_shape": list(wi.addressable_shards[0].data.shape)}
      if saved is None:  # save on the first mesh ...
        saved = jax.device_get(state["params"])
        ckpt = checkpoints.Checkpointer(CKPT_DIR)
        ckpt.save(2, state, {"batches_consumed": 2, "seed": 0}, force=True)
        ckpt.close()
      else:  # ... and restore onto the second, with its shardings
        ckpt = checkpoints.Checkpointer(CKPT_DIR)
        fresh, _ = trainer.init_state(model, opt, part, data, seed=1)
        restored, _ = ckpt.restore(2, checkpoints.abstract_like(fresh))
        rwi = restored["params"]["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
        out["restored_shard_shape"] = list(rwi.addressable_shards[0].data.shape)
        out["restored_max_diff"] = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(
            jax.tree_util.tree_leaves(restored["params"]), jax.tree_util.tree_leaves(saved)))
    print("RESULT" + json.dumps(out))
""")


def _run(device_count, ckpt_dir):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={device_count}")
  proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ckpt_dir)], cwd=REPO, env=env,
                        capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][0]
  return json.loads(line[len("RESULT"):])


def test_model_parallel_mesh_shards_mlp_and_matches_one_device(tmp_path):
  many = _run(8, tmp_path / "eight")
  one = _run(1, tmp_path / "one")
  assert many["devices"] == 8 and one["devices"] == 1
  tp = many["(2, 4)"]
  # 'mlp' maps to the 'model' axis: the [embed, mlp] kernel is split 4 ways along mlp.
  assert "model" in tp["wi_spec"] and tp["wi_shard_shape"] == [32, 16]
  assert tp["opt_shard_shape"] == [32, 16]  # optimizer statistics sharded like the param
  dp = many["(8, 1)"]
  assert dp["wi_shard_shape"] == [32, 64]  # pure data parallel: replicated weights
  # A checkpoint written on the (2, 4) mesh restores onto the (8, 1) mesh unchanged.
  assert many["restored_max_diff"] == 0.0 and many["restored_shard_shape"] == [32, 64]
  for result in (tp, dp):
    for got, want in zip(result["losses"], one["(1, 1)"]["losses"]):
      assert abs(got - want) < 1e-4 * max(1.0, abs(want)), (result, one)
