"""Sharding over real meshes, checked against one device and against the rules table.

- One subprocess with 8 CPU devices runs every layout (data-parallel 8, 4 x model 2 given
  as a legacy (data, model) MESH_SHAPE, FSDP 8, data 2 x fsdp 2 x model 2) and a 1-device
  mesh: three Adafactor steps of the tiny T5 + DeCAL that RUN_ARGS configures must give the
  same losses and parameters, every parameter's sharding must be what this file derives
  from its own rules table, and a checkpoint written on one mesh restores onto another.
- Two `python -m decal_jax.train` processes joined by `jax.distributed` (CPU, gloo
  collectives; parameters split across them by FSDP) must match the 1-device run on the
  same global batches.
- Every network family names every parameter axis, and every name has a rule.
"""
import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import flax
import jax
import numpy as np
import pytest

import paths
import processes

REPO = paths.REPO

# The rules as this test reads the design: tensor parallel over heads / mlp / vocab, all
# else whole; batch over (data, fsdp). Re-derived here, not imported from the library.
EXPECTED_RULES = {"vocab": "model", "mlp": "model", "heads": "model", "joined_kv": "model",
                  "kv": None, "embed": None, "length": None, "relpos_buckets": None,
                  "kv_heads": None, "lora_rank": None, "embed_in": None, "embed_out": None,
                  "layers": None, "stack": None}

STEPS = 3
# The run that every layout and the two-process job train: the pretraining gin files at a
# tiny size (DeCAL 4x, 1 + 1 layers), 3 Adafactor steps of 8 examples.
RUN_ARGS = ["--gin_file=models/decal_tiny.gin", "--gin_file=runs/pretrain.gin",
            "--gin.MIXTURE_OR_TASK_NAME='decal_builtin_span_corruption'",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 12}", "--gin.BATCH_SIZE=8",
            f"--gin.TRAIN_STEPS={STEPS}", "--gin.LEARNING_RATE=0.5", "--gin.WARMUP_STEPS=5",
            "--gin.EVAL_BATCHES=1", "--gin.LOG_PERIOD=1", "--gin.trainer.train.show_example=False"
            ] + [f"--gin.t5.T5Config.{k}={v}" for k, v in dict(
                emb_dim=32, num_heads=4, head_dim=8, mlp_dim=64, num_encoder_layers=1,
                num_decoder_layers=1).items()]

# Builds what `python -m decal_jax.train RUN_ARGS` trains (RUN_ARGS and np in scope).
SETUP = textwrap.dedent('''
    import gin
    import decal_jax.tasks
    from decal_jax.runtime import gin_utils
    gin_utils.parse(*gin_utils.split_args(RUN_ARGS + ["--gin.MODEL_DIR='unused'"]))
    model = gin.query_parameter("%MODEL").scoped_configurable_fn()
    data = gin.query_parameter("decal_jax.runtime.trainer.train.train_dataset_cfg").scoped_configurable_fn()
    opt = gin.query_parameter("decal_jax.runtime.trainer.train.optimizer").scoped_configurable_fn()

    def global_batches(steps):
      """The global batches of a 2-process run, read with seqio directly: process i reads
      shard i of 2 (train split, shuffled with the data seed) and feeds rows [4i, 4i + 4)."""
      import seqio
      shards = [seqio.get_dataset(
          data.mixture_or_task_name, data.task_feature_lengths,
          feature_converter=model.FEATURE_CONVERTER_CLS(pack=False), dataset_split="train",
          shuffle=True, num_epochs=None, shard_info=seqio.ShardInfo(i, 2), seed=data.seed,
          verbose=False).batch(4, drop_remainder=True).as_numpy_iterator() for i in range(2)]
      for _ in range(steps):
        parts = [next(shard) for shard in shards]
        yield {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
''')

MESH_SCRIPT = textwrap.dedent("""
    import json, sys, jax, numpy as np, flax
    RUN_ARGS, CKPT_DIR, REFERENCE = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    STEPS = int(sys.argv[4])
""") + SETUP + textwrap.dedent("""
    from decal_jax import partitioning
    from decal_jax.runtime import checkpoints, train_state, trainer
    from decal_jax.data import pipeline
    batches = list(global_batches(STEPS))
    flat = lambda t: flax.traverse_util.flatten_dict(flax.core.unfreeze(t), sep="/")
    LAYOUTS = {"one": (1, 1, 1), "dp8": (8, 1, 1), "tp4x2": (4, 2), "fsdp8": (1, 8, 1),
               "mixed": (2, 2, 2)}
    out, reference = {"devices": len(jax.devices())}, None
    for name, shape in LAYOUTS.items():
      part = partitioning.Partitioner(mesh_shape=shape,
                                      devices=jax.devices()[:1] if name == "one" else None)
      state, shardings = train_state.init_state(model, opt, part, data, seed=0)
      step = trainer.make_train_step(model, opt, part, shardings)
      losses = []
      for batch in batches:
        state, aux = step(state, pipeline.to_global(batch, part), jax.random.PRNGKey(0))
        losses.append(float(aux["loss"]))
      params = flat(state["params"])
      host = {k: np.asarray(jax.device_get(v)) for k, v in params.items()}
      if reference is None:  # the 1-device run: also the two-process test's reference
        reference = host
        np.savez(REFERENCE, **host)
      mirrored = [(k, leaf) for node in jax.tree_util.tree_leaves(
          state["opt_state"], is_leaf=lambda n: isinstance(n, dict) and "encoder" in n)
          if isinstance(node, dict) for k, leaf in flat(node).items()]
      out[name] = {
          "mesh": dict(part.mesh.shape), "losses": losses,
          "max_param_diff": max(float(np.max(np.abs(host[k] - reference[k]))) for k in host),
          "params": {k: {"shape": list(v.shape), "spec": [list(a) if isinstance(a, tuple)
                                                          else a for a in v.sharding.spec],
                         "shard_shape": list(v.addressable_shards[0].data.shape)}
                     for k, v in params.items()},
          "opt_like_param": sum(leaf.shape == params[k].shape and
                                leaf.sharding == params[k].sharding for k, leaf in mirrored),
          "opt_param_shaped": sum(leaf.shape == params[k].shape for k, leaf in mirrored)}
      if name == "tp4x2":  # a checkpoint written on the 4 x 2 mesh ...
        ckpt = checkpoints.Checkpointer(CKPT_DIR)
        ckpt.save(STEPS, state, {"batches_consumed": STEPS, "seed": 0}, force=True)
        ckpt.close()
        saved = host
      if name == "fsdp8":  # ... restores onto the FSDP mesh, with its shardings
        restored, _ = checkpoints.Checkpointer(CKPT_DIR).restore(
            STEPS, checkpoints.abstract_like(state))
        restored = flat(restored["params"])
        out["restore"] = {
            "max_diff": max(float(np.max(np.abs(np.asarray(restored[k]) - saved[k])))
                            for k in saved),
            "same_sharding": all(restored[k].sharding == params[k].sharding for k in saved)}
    variables = jax.eval_shape(lambda: model.get_initial_variables(
        jax.random.PRNGKey(0), {"encoder_input_tokens": (1, 32),
                                "decoder_input_tokens": (1, 12)}))
    out["names"] = {k[:-len("_axes")]: list(v.names)
                    for k, v in flat(variables["params_axes"]).items()}
    errors = {}
    for label, fn in {
        "model8": lambda: train_state.init_state(model, opt,
                                                 partitioning.Partitioner((1, 1, 8)), data,
                                                 seed=0),
        "batch6": lambda: pipeline.get_dataset(pipeline.DatasetConfig(
            data.mixture_or_task_name, data.task_feature_lengths, batch_size=6), model, None,
            partitioning.Partitioner((8, 1, 1))),
        "mesh3": lambda: partitioning.Partitioner((3, 1, -1))}.items():
      try:
        fn()
        errors[label] = None
      except ValueError as e:
        errors[label] = str(e)
    out["errors"] = errors
    print("RESULT" + json.dumps(out))
""")


# Cheaper CPU compiles (the programs are tiny; LLVM's optimisations cost most of the time).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _env(device_count=1):
  """CPU devices only (also on a machine with a GPU), `device_count` of them per process."""
  return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"{FAST_COMPILE} --xla_force_host_platform_device_count={device_count}")


def _result(stdout: str) -> dict:
  line = [l for l in stdout.splitlines() if l.startswith("RESULT")][0]
  return json.loads(line[len("RESULT"):])


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
  """Every 8-device layout, from one subprocess (the device count is fixed at start-up);
  the 1-device run's parameters go to `reference` (an .npz path)."""
  tmp = tmp_path_factory.mktemp("mesh")
  reference = tmp / "reference.npz"
  proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, json.dumps(RUN_ARGS),
                         str(tmp / "ckpt"), str(reference), str(STEPS)],
                        cwd=REPO, env=_env(8), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return dict(_result(proc.stdout), reference=reference)


def _expected_spec(names, shape, mesh):
  """This test's reading of the rules + FSDP: each named axis by EXPECTED_RULES; then, if
  'fsdp' has >1 device, the largest whole dimension it divides (first on ties; never the
  'layers' axis) goes to 'fsdp'."""
  spec = [EXPECTED_RULES[n] for n in names]
  if mesh["fsdp"] > 1:
    free = [d for d, (n, size) in enumerate(zip(names, shape))
            if spec[d] is None and n != "layers" and size % mesh["fsdp"] == 0]
    if free:
      spec[max(free, key=lambda d: (shape[d], -d))] = "fsdp"
  return spec


def test_every_layout_matches_one_device(eight):
  assert eight["devices"] == 8
  one = eight["one"]
  # Other layouts sum the gradients in other orders. Adafactor moves a parameter by about
  # lr x RMS(param) x (the gradient's relative error) per step: float32 sums of 8 x 44 token
  # terms (8 eps sqrt(352) = 1.8e-5 relative) times the 3 steps' lr (0.27 in all) is about
  # at most 5e-6 x |param|. The tolerances (1e-5) lie between that estimate and the gaps
  # measured on a 2-core AVX-512 EPYC: losses 2e-7 relative, parameters 2.8e-6 at most
  # (the 8-device layouts) and 4e-6 (two processes, test_two_processes_match_one).
  for name in ("dp8", "tp4x2", "fsdp8", "mixed"):
    result = eight[name]
    np.testing.assert_allclose(result["losses"], one["losses"], rtol=1e-5, err_msg=name)
    assert result["max_param_diff"] < 1e-5, (name, result["max_param_diff"])
  # The legacy 2-tuple (4, 2) is (data 4, fsdp 1, model 2).
  assert eight["tp4x2"]["mesh"] == {"data": 4, "fsdp": 1, "model": 2}


def test_every_parameter_is_sharded_as_the_rules_say(eight):
  names = eight["names"]
  for name in ("one", "dp8", "tp4x2", "fsdp8", "mixed"):
    mesh = eight[name]["mesh"]
    params = eight[name]["params"]
    assert set(params) == set(names)
    for path, got in params.items():
      want = _expected_spec(names[path], got["shape"], mesh)
      spec = got["spec"] + [None] * (len(want) - len(got["spec"]))
      assert spec == want, (name, path, names[path], got["shape"])
      shard = [size // (mesh[axis] if axis else 1) for size, axis in zip(got["shape"], want)]
      assert got["shard_shape"] == shard, (name, path)
  # FSDP really splits: every parameter of the tiny model has a dimension 8 divides.
  fsdp = eight["fsdp8"]["params"]
  assert all(math.prod(p["shard_shape"]) * 8 == math.prod(p["shape"]) for p in fsdp.values())
  # Optimizer statistics of a parameter's shape carry that parameter's sharding.
  for name in ("tp4x2", "fsdp8", "mixed"):
    result = eight[name]
    assert result["opt_param_shaped"] > 0
    assert result["opt_like_param"] == result["opt_param_shaped"], name


def test_checkpoint_restores_onto_another_mesh(eight):
  assert eight["restore"] == {"max_diff": 0.0, "same_sharding": True}


def test_bad_meshes_and_batches_are_named(eight):
  errors = eight["errors"]
  # 4 heads cannot split over 8 model devices: the parameter and the fix are named.
  assert "heads" in errors["model8"] and "MESH_SHAPE" in errors["model8"]
  assert "/" in errors["model8"].split(":")[0]  # a parameter path, e.g. encoder/.../query
  assert "BATCH_SIZE 6" in errors["batch6"] and "multiple of 8" in errors["batch6"]
  assert "does not divide the 8 devices" in errors["mesh3"]


# ------------------------------------------------------------------------------ families
def _family_models():
  """(label, model, task feature lengths) for every network family, built from the tiny gin
  files with the options that add parameters switched on."""
  import gin
  from decal_jax.runtime import gin_utils  # noqa: F401  (gin file lookup fix)
  cases = [
      ("t5_decal", ["models/decal_tiny.gin"], ["SEPARATE_LATENT_PARAMS = True"],
       {"inputs": 16, "targets": 8}),
      ("t5_attn_pool", ["models/decal_tiny.gin"], ["COMPRESSOR = 'attn_pool'"],
       {"inputs": 16, "targets": 8}),
      ("t5_memory", ["models/decal_tiny.gin"], ["COMPRESSOR = 'memory_tokens'"],
       {"inputs": 16, "targets": 8}),
      ("t5_scanned_fused", ["models/decal_tiny.gin"], ["t5.T5Config.scan_layers = True",
                                                       "t5.T5Config.fused_qkv = True"],
       {"inputs": 16, "targets": 8}),
      ("decoder", ["models/decoder_tiny.gin"], [], {"targets": 16}),
      ("dodo", ["models/dodo_tiny.gin"], ["LORA_RANK = 4"], {"inputs": 16, "targets": 8}),
      ("dodo_lm", ["models/decoder_tiny.gin", "models/dodo_lm.gin"], [], {"targets": 16}),
      ("gpthf", ["models/gpthf_tiny.gin"], [], {"targets": 16}),
      ("squid", ["models/squid_tiny.gin"], [], {"inputs": 16, "query": 4, "targets": 8}),
      ("dual_encoder", ["models/decal_tiny.gin", "models/dual_encoder.gin"],
       ["PROJECTION_DIM = 64"], {"inputs": 16, "targets": 16}),
  ]
  for label, files, bindings, lengths in cases:
    gin.clear_config()
    gin.add_config_file_search_path(str(REPO / "gin"))
    gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
    yield label, gin.query_parameter("%MODEL").scoped_configurable_fn(), lengths
  gin.clear_config()


def test_every_network_family_names_every_parameter_axis():
  from decal_jax import partitioning
  library_rules = {name for name, _ in partitioning.standard_logical_axis_rules()}
  seen = set()
  for label, model, lengths in _family_models():
    shapes = model.input_shapes(lengths)
    variables = jax.eval_shape(lambda: model.get_initial_variables(jax.random.PRNGKey(0),
                                                                   shapes))
    params = jax.tree_util.tree_flatten_with_path(variables["params"])[0]
    axes = {tuple(k.key for k in path[:-1]) + (path[-1].key[:-len("_axes")],): v.names
            for path, v in jax.tree_util.tree_flatten_with_path(
                variables["params_axes"], is_leaf=lambda x: hasattr(x, "names"))[0]}
    assert params, label
    for path, leaf in params:
      key = tuple(k.key for k in path)
      assert key in axes, (label, "/".join(key), "has no params_axes entry")
      assert len(axes[key]) == leaf.ndim, (label, key, axes[key], leaf.shape)
      assert set(axes[key]) <= set(EXPECTED_RULES), (label, key, axes[key])
      seen |= set(axes[key])
    # ... and the library's partitioner shards all of them (1 device: nothing to split).
    partitioning.Partitioner().params_shardings(variables["params_axes"], variables["params"])
  assert seen <= library_rules
  assert {"vocab", "embed", "mlp", "heads", "kv", "kv_heads", "lora_rank", "layers",
          "stack"} <= seen


def test_mesh_shape_and_distributed_settings_errors():
  from decal_jax import partitioning
  assert partitioning.resolve_mesh_shape((-1, 2), 8) == (4, 1, 2)
  assert partitioning.resolve_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
  for bad, message in [((2, 2, 2, 1), "needs 3 sizes"), ((-1, -1, 1), "at most one -1"),
                       ((0, 1, 8), "positive"), ((2, 2, 1), "has 4 devices but there are 8")]:
    with pytest.raises(ValueError, match=message):
      partitioning.resolve_mesh_shape(bad, 8)
  with pytest.raises(ValueError, match="names mesh axis 'tensor'"):
    partitioning.Partitioner(logical_axis_rules=[("mlp", "tensor")])
  settings = partitioning.distributed_settings
  assert settings(None, None, None, None, False, {}) is None  # single process
  assert settings(None, None, None, None, False, {"DECAL_DISTRIBUTED": "auto"}) == {}
  env = {"DECAL_COORDINATOR_ADDRESS": "10.0.0.1:1234", "DECAL_NUM_PROCESSES": "4",
         "DECAL_PROCESS_ID": "3", "DECAL_LOCAL_DEVICE_IDS": "0,1"}
  assert settings(None, None, None, None, False, env) == {
      "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3,
      "local_device_ids": [0, 1]}
  assert settings("h:1", 2, 0, None, False, env)["num_processes"] == 2  # gin wins
  with pytest.raises(ValueError, match="process_id missing"):
    settings("h:1", 2, None, None, False, {})
  with pytest.raises(ValueError, match="DECAL_NUM_PROCESSES='two' is not allowed .not a whole number"):
    settings(None, None, None, None, False, dict(env, DECAL_NUM_PROCESSES="two"))


# ------------------------------------------------------------------------------ multi-host


def _train_losses(model_dir: pathlib.Path):
  import tensorflow as tf
  files = sorted((model_dir / "train").glob("events.out.tfevents.*"))
  losses = {}
  for event in tf.compat.v1.train.summary_iterator(str(files[0])):
    for value in event.summary.value:
      if value.tag == "loss":
        losses[event.step] = float(tf.make_ndarray(value.tensor))
  return files, [losses[s] for s in sorted(losses)]


def _launch(process_id: int, port: int, model_dir: pathlib.Path) -> subprocess.Popen:
  """`python -m decal_jax.train` as process `process_id` of 2, FSDP across the processes
  (MESH_SHAPE (1, 2, 1): every parameter split between them). Process 0 finds the
  coordinator through the DECAL_* environment variables, process 1 through gin bindings."""
  env = _env()
  args = RUN_ARGS + [f"--gin.MODEL_DIR='{model_dir}'", "--gin.MESH_SHAPE=(1, 2, 1)"]
  if process_id == 0:
    env.update(DECAL_COORDINATOR_ADDRESS=f"localhost:{port}", DECAL_NUM_PROCESSES="2",
               DECAL_PROCESS_ID="0")
  else:
    args += [f"--gin.partitioning.initialize_distributed.{k}={v}" for k, v in dict(
        coordinator_address=f"'localhost:{port}'", num_processes=2, process_id=1).items()]
  return subprocess.Popen([sys.executable, "-m", "decal_jax.train"] + args, cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_match_one(tmp_path, eight):
  port, model_dir = processes.free_port(), tmp_path / "model"
  procs = [_launch(i, port, model_dir) for i in range(2)]
  finished = processes.communicate_all(procs, timeout=600)
  for proc, (_, stderr) in zip(procs, finished):
    assert proc.returncode == 0, stderr[-4000:]
  (out0, _), (out1, _) = finished
  assert "Held-out" in out0 and "Held-out" not in out1  # process 0 alone reports
  # Only process 0 wrote metrics and the config; both wrote the checkpoint's shards.
  events, losses = _train_losses(model_dir)
  assert len(events) == 1 and "MESH_SHAPE = (1, 2, 1)" in (model_dir / "config.gin").read_text()
  positions = model_dir / f"checkpoint_{STEPS}" / "dataset"  # each its input position
  assert {p.name for p in positions.glob("*.index")} == {"process_0-of-2.index",
                                                         "process_1-of-2.index"}
  # The losses and parameters of one device on the global batches that the two processes'
  # seqio shards make up: so both took part, each feeding its own shard.
  np.testing.assert_allclose(losses, eight["one"]["losses"], rtol=1e-5)
  from decal_jax import partitioning
  from decal_jax.runtime import checkpoints, train_state
  scope = {"np": np, "RUN_ARGS": RUN_ARGS}
  try:
    exec(SETUP, scope)  # the same model, in this process
  finally:
    import gin
    gin.clear_config()
  abstract, _ = train_state.abstract_params(scope["model"], scope["data"],
                                            partitioning.Partitioner())
  saved = checkpoints.Checkpointer(str(model_dir)).restore_params(STEPS, abstract)
  saved = flax.traverse_util.flatten_dict(flax.core.unfreeze(jax.device_get(saved)), sep="/")
  want = np.load(eight["reference"])
  assert set(saved) == set(want.files)
  for name, value in saved.items():  # see test_every_layout_matches_one_device on the bound
    np.testing.assert_allclose(value, want[name], atol=1e-5, rtol=1e-5, err_msg=name)
