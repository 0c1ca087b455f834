"""Squid's model files (Qwen2 sizes, vocabulary), its T5X files and its stage run files."""
import gin
import jax
import jax.numpy as jnp
import pytest

from gin_config_helpers import _Recorder, _arg, _build_model, _parse, _squid_shapes


# --------------------------------------------------------------------------- Squid
def test_squid_qwen2_decoders_are_qwen2_0_5b_and_7b(monkeypatch):
  """The small decoder has Qwen2-0.5B's 494,032,768 parameters (tied embeddings), the large
  one Qwen2-7B's 7,615,616,512 (Qwen/Qwen2-0.5B, Qwen/Qwen2-7B); the projector maps 896 ->
  3584 (Linear-GELU-Linear) and there are 64 memory tokens."""
  monkeypatch.delenv("DECAL_HF_TOKENIZER", raising=False)
  _parse("models/squid_qwen2.gin")
  model = _build_model()
  flat = _squid_shapes(model)
  def count(prefix):
    return sum(v.size for k, v in flat.items() if k.startswith(prefix))
  assert count("small_decoder/") == 494_032_768
  assert count("large_decoder/") == 7_615_616_512
  assert "logits_dense" not in str(list(k for k in flat if k.startswith("small_decoder/")))
  assert flat["memory_tokens/memory_embeddings"].shape == (64, 896)
  assert (flat["projector/dense_0/kernel"].shape, flat["projector/dense_1/kernel"].shape) == \
      ((896, 3584), (3584, 3584))
  config = model.module.config
  assert (config.small.rope_theta, config.small.norm_epsilon, config.large.qkv_bias) == \
      (1e6, 1e-6, True)
  with pytest.raises(FileNotFoundError, match="QWEN2_TOKENIZER"):
    _ = model.output_vocabulary.vocab_size  # no tokenizer.json bound: a clear error on use
  gin.clear_config()


def test_squid_qwen2_vocabulary_moves_token_0_into_both_tables(monkeypatch):
  """Qwen2's id 0 ('!') is read as padding here, so the vocabulary writes it as 151935:
  past the tokenizer's last id (151645, Qwen/Qwen2-0.5B tokenizer.json), a row of both
  tables (151,936 and 152,064 rows). decal_jax/commands/import_hf.py reads the same binding."""
  monkeypatch.delenv("DECAL_HF_TOKENIZER", raising=False)
  _parse("models/squid_qwen2.gin")
  model = _build_model()
  config = model.module.config
  assert model.input_vocabulary.zero_id_to == model.output_vocabulary.zero_id_to == 151935
  assert 151645 < 151935 < min(config.small.vocab_size, config.large.vocab_size)
  gin.clear_config()


def test_squid_tiny_builds_a_small_and_a_larger_decoder():
  _parse("models/squid_tiny.gin")
  model = _build_model()
  config = model.module.config
  assert type(model.module).__name__ == "Squid" and config.memory_tokens == 8
  assert (config.small.emb_dim, config.small.num_layers) == (64, 2)
  assert (config.large.emb_dim, config.large.num_layers) == (128, 4)
  flat = _squid_shapes(model)
  assert flat["projector/dense_0/kernel"].shape == (64, 128)
  assert flat["large_decoder/token_embedder/embedding"].shape == (4224, 128)
  gin.clear_config()


@pytest.mark.parametrize("size", ["tiny", "qwen2"])
def test_t5x_squid_files_join_the_query_where_the_network_reads_it(t5x_modules, monkeypatch,
                                                                   size):
  """t5x/squid_<size>.gin: T5X's model class gets the feature converter that puts the query
  in the last QUERY_LENGTH encoder columns, and SquidT5X reads it there; its parameters are
  those of models/squid_<size>.gin's Squid (name for name, shape for shape), so a decal_jax
  Squid checkpoint (or an imported Qwen2 pair) is one."""
  import flax
  from decal_jax.models.squid_features import SquidT5XFeatureConverter
  monkeypatch.delenv("DECAL_HF_TOKENIZER", raising=False)
  _parse(f"t5x/squid_{size}.gin", bindings=["QUERY_LENGTH = 12"])
  model = _build_model()
  module = _arg(model, "module")
  assert module.query_length == 12
  converter_cls = (model.kwargs["feature_converter_cls"] if isinstance(model, _Recorder)
                   else model.FEATURE_CONVERTER_CLS)  # where T5X's class keeps it
  converter = converter_cls(pack=False)  # as T5X's utils.get_dataset builds it
  assert isinstance(converter, SquidT5XFeatureConverter) and converter.query_length == 12
  joined = jnp.ones((1, 16 + 12), jnp.int32)
  shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), joined, joined[:, :4],
                                              joined[:, :4], enable_dropout=False))["params"]
  theirs = {k: v.shape for k, v in flax.traverse_util.flatten_dict(shapes, sep="/").items()}
  _parse(f"models/squid_{size}.gin")
  ours = {k: v.shape for k, v in _squid_shapes(_build_model()).items()}
  assert theirs == ours
  gin.clear_config()


def test_t5x_squid_train_parts_hands_t5x_adafactor_only_the_named_parts(t5x_modules):
  """t5x/squid.gin's TRAIN_PARTS: T5X's model gets a MultiOptimizer whose traversals
  split the parameters exactly by the named top-level parts (worked out here from the
  names alone): T5X's Adafactor for those, `Frozen` for the rest; unbound, the Adafactor
  itself."""
  import flax
  parts = ["small_decoder", "memory_tokens", "projector"]
  _parse("t5x/squid_tiny.gin", bindings=[f"TRAIN_PARTS = {parts}"])
  model = _build_model()
  optimizer = _arg(model, "optimizer_def")
  assert type(optimizer).__name__ == "PartsOptimizer" and optimizer.parts == tuple(parts)
  pairs = (optimizer.kwargs["traversals_and_optimizers"] if isinstance(optimizer, _Recorder)
           else list(zip(optimizer.traversals, optimizer.sub_optimizers)))  # real T5X's
  [(trained, adafactor), (frozen, frozen_def)] = pairs
  assert (type(adafactor).__name__, type(frozen_def).__name__) == ("Adafactor", "Frozen")
  module = _arg(model, "module")
  joined = jnp.ones((1, 8 + module.query_length), jnp.int32)
  shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), joined, joined[:, :4],
                                              joined[:, :4], enable_dropout=False))["params"]
  names = flax.traverse_util.unflatten_dict(  # each leaf: its own 'a/b/c' name
      {k: "/".join(k) for k in flax.traverse_util.flatten_dict(shapes)})
  every = set(jax.tree_util.tree_leaves(names))
  assert {name.split("/")[0] for name in every} == set(parts) | {"large_decoder"}
  assert set(trained.iterate(names)) == {n for n in every if n.split("/")[0] in parts}
  assert set(frozen.iterate(names)) == {n for n in every if n.startswith("large_decoder/")}
  _parse("t5x/squid_tiny.gin")
  assert type(_arg(_build_model(), "optimizer_def")).__name__ == "Adafactor"


SQUID_STAGES = {  # stage run file -> (task, parts it trains)
    "runs/squid_restore.gin": ("decal_c4_squid_restore",
                               {"small_decoder", "memory_tokens", "projector"}),
    "runs/squid_continue.gin": ("decal_c4_squid_continue",
                                {"small_decoder", "memory_tokens", "projector", "large_decoder"}),
    "runs/squid_instruct.gin": ("decal_squad_squid", {"small_decoder", "memory_tokens",
                                                      "projector", "large_decoder"}),
}


@pytest.mark.parametrize("run_file", sorted(SQUID_STAGES))
def test_squid_stage_files_train_named_parts_of_the_model(run_file):
  """Each imported-checkpoint stage reads its task and trains exactly the parts it names,
  every one of which exists in the Squid it configures (runs/squid.gin's optimizer)."""
  import flax
  task, parts = SQUID_STAGES[run_file]
  _parse("models/squid_tiny.gin", run_file, bindings=["MODEL_DIR = '/tmp/unused'",
                                                      "TRAIN_STEPS = 10", "WARMUP_STEPS = 0",
                                                      "INITIAL_CHECKPOINT_PATH = '/ckpt'"])
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == task
  assert set(gin.query_parameter("%TRAIN_PARTS")) == parts
  model = _build_model()
  optimizer = gin.query_parameter("decal_jax.runtime.trainer.train.optimizer").scoped_configurable_fn()
  gin.clear_config()
  params = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), {"encoder_input_tokens": (1, 16), "decoder_input_tokens": (1, 4),
                              "query_tokens": (1, 4)}))["params"]
  assert parts <= set(params)
  @jax.jit
  def first_update(params):  # one step with every gradient 1
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return jax.tree_util.tree_map(lambda u: jnp.any(u != 0), updates)

  moved_leaves = first_update(jax.tree_util.tree_map(lambda s: jnp.ones(s.shape, s.dtype),
                                                     params))
  moved = {path.split("/")[0] for path, u in
           flax.traverse_util.flatten_dict(moved_leaves, sep="/").items() if u}
  assert moved == parts

