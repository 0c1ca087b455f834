"""Squid's three built-in stages run in sequence from their gin files (tiny sizes, a few
steps): each stage starts from the one before, and with stage 3 told to train only the
projector and the large decoder (its TRAIN_PARTS switch), the frozen parts (small decoder,
memory tokens) are bitwise the stage-2 values while the trained parts moved."""
import functools

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax import train
from decal_jax.runtime import checkpoints, gin_utils
from decal_jax.networks.squid import Squid

STAGES = ("restore", "continue", "instruct")
# Shrink the tiny model further and run two steps a stage: this checks the wiring, not quality.
SMALLER = ["small/decoder.DecoderConfig.num_layers = 1", "large/decoder.DecoderConfig.num_layers = 2",
           "TRAIN_STEPS = 2", "BATCH_SIZE = 4", "EVAL_BATCHES = 1", "LOG_PERIOD = 1",
           "CHECKPOINT_PERIOD = 2", "trainer.train.show_example = False"]


def _run(stage, model_dir, previous=None):
  argv = [f"--gin_file=runs/squid_{stage}_builtin.gin",
          f"--gin.MODEL_DIR='{model_dir}'"] + [f"--gin.{b.replace(' = ', '=')}" for b in SMALLER]
  if previous is not None:
    argv.append(f"--gin.INITIAL_CHECKPOINT_PATH='{previous}'")
  if stage == "instruct":
    argv.append("--gin.TRAIN_PARTS=['projector', 'large_decoder']")
  train.main(argv)


def _params(model_dir):
  path, _ = checkpoints.resolve_checkpoint(str(model_dir))
  params, report = checkpoints.restore_matching_params(path, _fresh_params())
  assert not report["initialised"], report["initialised"]
  return jax.tree_util.tree_map(np.asarray, params)


@functools.lru_cache(maxsize=1)
def _fresh_params():
  """A Squid built from the same gin files and bindings (the checkpoint's structure)."""
  gin.clear_config()
  gin.add_config_file_search_path(str(gin_utils.GIN_DIR))
  gin.parse_config_files_and_bindings(["runs/squid_restore_builtin.gin"],
                                      SMALLER + ["MODEL_DIR = 'unused'"],
                                      finalize_config=False)
  config = gin.query_parameter("decal_jax.networks.squid.Squid.config").scoped_configurable_fn()
  gin.clear_config()
  tokens = jnp.ones((1, 16), jnp.int32)
  init = jax.jit(lambda rng: Squid(config).init(rng, tokens, tokens, tokens,
                                                 enable_dropout=False)["params"])
  return init(jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
  root = tmp_path_factory.mktemp("squid")
  dirs = [root / stage for stage in STAGES]
  for i, stage in enumerate(STAGES):
    _run(stage, dirs[i], dirs[i - 1] if i else None)
  return dirs


def _same(a, b):
  return all(jax.tree_util.tree_leaves(
      jax.tree_util.tree_map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def _all_moved(a, b):
  return all(jax.tree_util.tree_leaves(
      jax.tree_util.tree_map(lambda x, y: bool(np.any(x != y)), a, b)))


def test_stage_three_freezes_the_compressor_bitwise(stages):
  _, second, third = (_params(d) for d in stages)
  for part in ("small_decoder", "memory_tokens"):
    assert _same(second[part], third[part]), part
  for part in ("projector", "large_decoder"):
    assert _all_moved(second[part], third[part]), part


def test_each_stage_starts_from_the_previous_one(stages):
  first, second, _ = (_params(d) for d in stages)
  # two AdamW steps from stage 1's weights move each leaf by at most ~2 lr = 6e-3; a fresh
  # initialisation would differ by O(init scale) almost everywhere
  for part in ("small_decoder", "projector", "large_decoder"):
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(
        jax.tree_util.tree_leaves(first[part]), jax.tree_util.tree_leaves(second[part])))
    assert gap < 1e-2, (part, gap)
  assert _all_moved(first["projector"], second["projector"])


def test_answer_tool_reuses_a_saved_compression(stages, tmp_path):
  """decal_jax/commands/squid_answer.py: answers from a saved .npz equal answers from the context, and
  both equal the model's own predict_batch on [context; question] (which recompresses)."""
  import importlib
  squid_answer = importlib.import_module("decal_jax.commands.squid_answer")
  context = ("The assignment statement binds names to objects. Targets may be attribute "
             "references, subscriptions or slicings.")
  (tmp_path / "ctx.txt").write_text(context)
  questions = ["Which section of the Python language reference is this from?", "Why?"]
  common = ["--gin_file=runs/squid_instruct_builtin.gin", f"--model_dir={stages[2]}",
            "--max_answer_length=6"] + [f"--gin.{b.replace(' = ', '=')}" for b in SMALLER]
  direct = squid_answer.main(common + [f"--context_file={tmp_path / 'ctx.txt'}",
                                       f"--save_compressed={tmp_path / 'c.npz'}"]
                             + [f"--question={q}" for q in questions])
  reread = squid_answer.main(common + [f"--compressed={tmp_path / 'c.npz'}"]
                             + [f"--question={q}" for q in questions])
  assert direct == reread
  model, params, _ = squid_answer.load_model(squid_answer.parse_args(
      common + [f"--compressed={tmp_path / 'c.npz'}", "--question=x"]))
  vocab = model.input_vocabulary
  predict = jax.jit(model.predict_batch)
  for question, got in zip(questions, direct):
    batch = {"encoder_input_tokens": np.asarray([vocab.encode(context)], np.int32),
             "query_tokens": np.asarray([vocab.encode(question)], np.int32),
             "decoder_input_tokens": np.zeros((1, 6), np.int32)}
    ids = [int(t) for t in np.asarray(predict(params, batch))[0] if t > 0]
    ids = ids[:ids.index(vocab.eos_id)] if vocab.eos_id in ids else ids
    assert got == {"question": question, "answer": vocab.decode(ids)}
  with pytest.raises(ValueError, match="same model"):
    np.savez(tmp_path / "bad.npz", embeddings=np.zeros((1, 8, 5), np.float32),
             valid=np.ones((1, 8), bool))
    squid_answer.main(common + [f"--compressed={tmp_path / 'bad.npz'}", "--question=x"])
