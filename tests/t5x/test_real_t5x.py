"""Every family that fits T5X's model classes, run by the real T5X (google-research/t5x).

Skipped, with the reason, where `import t5x` fails (CI: T5X is not on the package index;
docs/t5x.md installs it). For each family, at a tiny size on the built-in tasks (no
download): `python -m t5x.train` a few steps with the drop-in gin files (gin/t5x/), then
`t5x.infer` and `t5x.eval` (decoding metrics: SQuAD on the built-in QA task) from that
checkpoint (DeCAL and Squid also fine-tuned from it by T5X's finetune.gin); and in
process, T5X's own `predict_batch` (greedy) equals decal_jax's decoding on the same
parameters, Dodo's compressor through T5X's beam expansion of its nuggets, Squid's through
its prefix's keys and values (the query joined to the context), decoder-only families with
T5X's per-row prompt prefill.

  PYTHONPATH=$PWD:/path/to/t5x-site python -m pytest -q tests/t5x
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

try:
  import t5x  # noqa: F401  (only whether T5X imports)
  import fiddle  # noqa: F401  (t5x.train's flags need it)
except ImportError as error:
  pytest.skip(f"the real T5X is not importable ({error}); docs/t5x.md installs it",
              allow_module_level=True)

import gin
import jax
import jax.numpy as jnp
import numpy as np

import paths

REPO = paths.REPO
TINY_T5 = [f"--gin.t5.T5Config.{k}={v}" for k, v in dict(
    emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64, num_encoder_layers=1,
    num_decoder_layers=1).items()]
TINY_DECODER = [f"--gin.decoder.DecoderConfig.{k}={v}" for k, v in dict(
    emb_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64).items()]
ENC_DEC_LENGTHS = "{'inputs': 32, 'targets': 8}"
# CCProxy's memory tokens, Dodo, GPTHF and Dodo LM read one unpacked text per row
UNPACKED = ["--gin.train/utils.DatasetConfig.pack=False",
            "--gin.train_eval/utils.DatasetConfig.pack=False"]
# family: (drop-in file, training task, training lengths, extra bindings)
FAMILIES = {
    "decal_c4": ("t5x/decal_t5_1_1_tiny.gin", "decal_builtin_span_corruption",
                 ENC_DEC_LENGTHS, TINY_T5),
    "decal_c1": ("t5x/decal_t5_1_1_tiny.gin", "decal_builtin_span_corruption",
                 ENC_DEC_LENGTHS, TINY_T5 + ["--gin.COMPRESSION_RATIO=1"]),
    "attn_pool": ("t5x/decal_t5_1_1_tiny.gin", "decal_builtin_span_corruption",
                  ENC_DEC_LENGTHS, TINY_T5 + ["--gin.COMPRESSOR='attn_pool'"]),
    "ccproxy": ("t5x/decal_t5_1_1_tiny.gin", "decal_builtin_span_corruption",
                ENC_DEC_LENGTHS, TINY_T5 + ["--gin.COMPRESSOR='memory_tokens'"] + UNPACKED),
    "decal_scan_fused": ("t5x/decal_t5_1_1_tiny.gin", "decal_builtin_span_corruption",
                         ENC_DEC_LENGTHS, TINY_T5 + ["--gin.SCAN_LAYERS=True",
                                                     "--gin.FUSED_QKV=True"]),
    "dodo": ("t5x/dodo_tiny.gin", "decal_builtin_autoencode", ENC_DEC_LENGTHS,
             TINY_DECODER + ["--gin.decoder.DecoderConfig.num_layers=2",
                             "--gin.SCORER_LAYER=1"] + UNPACKED),
    "decoder": ("t5x/decoder_tiny.gin", "decal_builtin_lm", "{'targets': 32}",
                TINY_DECODER + ["--gin.decoder.DecoderConfig.num_layers=1"]),
    "gpthf": ("t5x/gpthf_tiny.gin", "decal_builtin_sentence_lm", "{'targets': 32}",
              TINY_DECODER + ["--gin.decoder.DecoderConfig.num_layers=2",
                              "--gin.ENCODER_LAYERS=1"] + UNPACKED),
    "dodo_lm": ("t5x/dodo_lm_tiny.gin", "decal_builtin_lm", "{'targets': 32}",
                TINY_DECODER + ["--gin.decoder.DecoderConfig.num_layers=2",
                                "--gin.SCORER_LAYER=1", "--gin.NUGGET_THRESHOLD=0.0"] + UNPACKED),
}
# Squid's small and large decoders (scoped configs), each one layer
TINY_SQUID = [f"--gin.{scope}/decoder.DecoderConfig.{k}={v}" for scope in ("small", "large")
              for k, v in dict(emb_dim=32, num_heads=2, num_kv_heads=1, head_dim=16,
                               mlp_dim=64, num_layers=1).items()]
FAMILIES["squid"] = ("t5x/squid_tiny.gin", "decal_builtin_squid_restore",
                     "{'inputs': 32, 'query': 16, 'targets': 40}", TINY_SQUID + UNPACKED)
STEPS = 2
# also fine-tuned by T5X's finetune.gin from its pretraining checkpoint, on the QA task
# (Squid: its stage 3 from stage 1's checkpoint)
FINETUNED = {"decal_c4", "squid"}
EVAL_TASK = "decal_builtin_qa"  # inputs -> targets with SQuAD metrics, built-in vocabulary
# Squid's is the same QA with the question as its query (SQuAD metrics too)
EVAL_TASKS = {"squid": ("decal_builtin_squid_qa", "{'inputs': 32, 'query': 16, 'targets': 8}")}


def _run(entry: str, family: str, *args: str, cwd: pathlib.Path,
         run_file: str = "") -> str:
  """Runs `python -m t5x.<entry>` with the family's drop-in file and t5x/runs/<run_file>.gin
  (default: pretrain for train, else the entry's own); returns its log."""
  drop_in, _, _, bindings = FAMILIES[family]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  run_file = run_file or ("pretrain" if entry == "train" else entry)
  command = [sys.executable, "-m", f"t5x.{entry}", f"--gin_search_paths={REPO / 'gin'}",
             f"--gin_file={drop_in}", f"--gin_file=t5x/runs/{run_file}.gin", *bindings, *args]
  done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=1800)
  log = done.stdout + done.stderr
  assert done.returncode == 0, f"t5x.{entry} failed for {family}:\n{log[-6000:]}"
  return log


def _eval_task(family: str):
  """(task, lengths) that t5x.infer / t5x.eval read for `family`."""
  if family in EVAL_TASKS:
    return EVAL_TASKS[family]
  return EVAL_TASK, (ENC_DEC_LENGTHS if FAMILIES[family][2] == ENC_DEC_LENGTHS else
                     "{'inputs': 24, 'targets': 8}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_t5x_trains_infers_and_evaluates(family, tmp_path):
  _, task, lengths, _ = FAMILIES[family]
  model_dir = tmp_path / "model"
  _run("train", family, f"--gin.MIXTURE_OR_TASK_NAME='{task}'",
       f"--gin.TASK_FEATURE_LENGTHS={lengths}", f"--gin.TRAIN_STEPS={STEPS}",
       "--gin.BATCH_SIZE=4", f"--gin.MODEL_DIR='{model_dir}'", "--gin.train.eval_steps=1",
       f"--gin.train.eval_period={STEPS}", f"--gin.utils.SaveCheckpointConfig.period={STEPS}",
       cwd=tmp_path)
  checkpoint = model_dir / f"checkpoint_{STEPS}"
  assert (checkpoint / "_CHECKPOINT_METADATA").exists()  # T5X's Orbax checkpoint
  eval_task, eval_lengths = _eval_task(family)
  common = [f"--gin.MIXTURE_OR_TASK_NAME='{eval_task}'",
            f"--gin.TASK_FEATURE_LENGTHS={eval_lengths}",
            f"--gin.CHECKPOINT_PATH='{checkpoint}'", "--gin.utils.DatasetConfig.batch_size=4",
            "--gin.utils.DatasetConfig.split='validation'"]
  _run("infer", family, *common, f"--gin.INFER_OUTPUT_DIR='{tmp_path / 'infer'}'",
       cwd=tmp_path)
  predictions = list((tmp_path / "infer").glob(f"{eval_task}-predict.jsonl-*-of-*"))
  rows = [json.loads(line) for p in predictions if not p.name.endswith("COMPLETED")
          for line in p.read_text().splitlines()]
  assert rows and all(isinstance(r["prediction"], str) for r in rows)
  _run("eval", family, *common, f"--gin.EVAL_OUTPUT_DIR='{tmp_path / 'eval'}'",
       cwd=tmp_path)
  metrics = [json.loads(line) for p in (tmp_path / "eval").rglob("*-metrics.jsonl")
             for line in p.read_text().splitlines()]
  assert metrics and {"f1", "em"} <= set(metrics[-1]), metrics
  if family in FINETUNED:
    _finetune(family, checkpoint, tmp_path)


def _finetune(family: str, initial: pathlib.Path, tmp_path: pathlib.Path) -> None:
  """t5x/runs/finetune.gin from the 2-step pretraining (INITIAL_CHECKPOINT_PATH): T5X
  restores its step and parameters, then trains STEPS more steps on the QA task."""
  model_dir = tmp_path / "finetune"
  task, lengths = _eval_task(family)
  log = _run("train", family, f"--gin.MIXTURE_OR_TASK_NAME='{task}'",
             f"--gin.TASK_FEATURE_LENGTHS={lengths}",
             f"--gin.TRAIN_STEPS={2 * STEPS}", "--gin.BATCH_SIZE=4",
             f"--gin.MODEL_DIR='{model_dir}'", f"--gin.INITIAL_CHECKPOINT_PATH='{initial}'",
             "--gin.EVAL_STEPS=1", f"--gin.EVAL_PERIOD={STEPS}",
             "--gin.train.infer_eval_dataset_cfg=None",
             f"--gin.utils.SaveCheckpointConfig.period={STEPS}", cwd=tmp_path,
             run_file="finetune")
  # T5X saves the state it starts from: the restored step STEPS (step 0 without a restore)
  saved = sorted(p.name for p in model_dir.glob("checkpoint_*"))
  assert saved == [f"checkpoint_{STEPS}", f"checkpoint_{2 * STEPS}"], (saved, log[-3000:])
  assert str(initial) in log, log[-3000:]


# ---------------------------------------------------------------- decodes: T5X == decal_jax
def _parse(files, bindings):
  gin.clear_config()
  gin.add_config_file_search_path(str(REPO / "gin"))
  gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  gin.clear_config()
  return model


def _bindings(family):
  return [b[len("--gin."):] for b in FAMILIES[family][3] if b not in UNPACKED]


@pytest.mark.parametrize("family", ["decal_c4", "decal_c1", "ccproxy", "attn_pool",
                                    "decal_scan_fused", "dodo"])
def test_t5x_greedy_decodes_equal_ours_encoder_decoder(family):
  """Dodo: T5X beam-expands `encode`'s one array (the nuggets' keys and values); the rows'
  context lengths (32 and 20 tokens) leave them different numbers of nuggets."""
  from decal_jax import models as our_models
  drop_in = FAMILIES[family][0]
  fp32 = [] if family == "dodo" else ["ACTIVATION_DTYPE = 'float32'"]  # Dodo's is float32
  t5x_model = _parse([drop_in], _bindings(family) + fp32)
  ours = our_models.EncoderDecoderModel(t5x_model.module, t5x_model.input_vocabulary,
                                        t5x_model.output_vocabulary)
  batch_size, n, t = 3, 32, 8
  params = t5x_model.get_initial_variables(
      jax.random.PRNGKey(1), {"encoder_input_tokens": (1, n), "decoder_input_tokens": (1, t)}
  )["params"]
  rng = np.random.RandomState(0)
  inputs = rng.randint(3, 200, (batch_size, n))
  inputs[1, 20:] = 0  # rows of different lengths
  batch = {"encoder_input_tokens": jnp.asarray(inputs, jnp.int32),
           "decoder_input_tokens": jnp.zeros((batch_size, t), jnp.int32),
           "decoder_target_tokens": jnp.zeros((batch_size, t), jnp.int32)}
  theirs, _ = t5x_model.predict_batch_with_aux(params, batch, num_decodes=1)
  mine, _ = ours.predict_batch_with_aux(params, batch, num_decodes=1)
  np.testing.assert_array_equal(np.asarray(theirs), np.asarray(mine))
  assert len(set(np.asarray(mine).ravel().tolist())) > 1  # not one repeated token


@pytest.mark.parametrize("family", ["decoder", "gpthf", "dodo_lm"])
def test_t5x_prefilled_greedy_decodes_equal_ours_decoder_only(family):
  """T5X prefills prompts of lengths 2, 5 and 9 (per-row prefill_lengths) and samples at
  temperature 0; decal_jax's generate continues each prompt alone."""
  from decal_jax import models as our_models
  t5x_model = _parse([FAMILIES[family][0]], _bindings(family))
  ours = our_models.DecoderOnlyModel(t5x_model.module, t5x_model.output_vocabulary)
  length, new = 16, 4
  params = t5x_model.get_initial_variables(
      jax.random.PRNGKey(1), {"decoder_input_tokens": (1, length)})["params"]
  rng = np.random.RandomState(0)
  prompts = [rng.randint(3, 200, size) for size in (2, 5, 9)]
  tokens = np.zeros((len(prompts), length), np.int32)
  causal = np.zeros_like(tokens)
  for row, prompt in enumerate(prompts):
    tokens[row, 1:1 + len(prompt)] = prompt  # BOS (0), then the prompt
    causal[row, :1 + len(prompt)] = 1
  batch = {"decoder_input_tokens": jnp.asarray(tokens),
           "decoder_target_tokens": jnp.asarray(np.roll(tokens, -1, axis=1)),
           "decoder_causal_attention": jnp.asarray(causal)}
  theirs, _ = t5x_model.predict_batch_with_aux(params, batch,
                                               decoder_params={"temperature": 0.0})
  theirs = np.asarray(theirs)
  for row, prompt in enumerate(prompts):
    mine = np.asarray(ours.generate(params, jnp.asarray(prompt[None], jnp.int32), new,
                                    temperature=0.0))[0]
    np.testing.assert_array_equal(theirs[row, :new], mine, err_msg=f"row {row}")


@pytest.mark.parametrize("memory_ratio", [None, 4], ids=["fixed_n", "ratio"])
def test_t5x_squid_greedy_decodes_equal_ours(memory_ratio):
  """T5X's EncoderDecoderModel around squid.SquidT5X, fed [context; query]: contexts of 32,
  20 and 12 tokens (N = 8 memory vectors each, or ceil(n / 4) = 8, 5 and 3) with queries of
  4, 6 and 2 tokens in one batch. T5X's greedy `predict_batch` and its 3-beam search
  (beam-expanding the prefix's keys and values) equal decal_jax's SquidModel (context and
  query apart) on the same parameters, and so do the teacher-forced logits through T5X's
  `_compute_logits`."""
  from decal_jax import models as our_models
  from decal_jax.networks import squid
  q = 6
  t5x_model = _parse([FAMILIES["squid"][0]], _bindings("squid") + [
      f"QUERY_LENGTH = {q}", f"MEMORY_RATIO = {memory_ratio}"])
  assert t5x_model.module.config.memory_ratio == memory_ratio
  ours = our_models.SquidModel(squid.Squid(t5x_model.module.config),
                               t5x_model.input_vocabulary, t5x_model.output_vocabulary)
  batch_size, n, t = 3, 32, 8
  params = t5x_model.get_initial_variables(
      jax.random.PRNGKey(1), {"encoder_input_tokens": (1, n + q),
                              "decoder_input_tokens": (1, t)})["params"]
  rng = np.random.RandomState(0)
  context, query = rng.randint(3, 200, (batch_size, n)), rng.randint(3, 200, (batch_size, q))
  for row, (n_b, q_b) in enumerate([(32, 4), (20, 6), (12, 2)]):
    context[row, n_b:], query[row, q_b:] = 0, 0
  answers = rng.randint(3, 200, (batch_size, t))
  targets = {"decoder_input_tokens": jnp.asarray(np.roll(answers, 1, axis=1) * (
      np.arange(t) > 0), jnp.int32), "decoder_target_tokens": jnp.asarray(answers, jnp.int32)}
  theirs_batch = dict(targets, encoder_input_tokens=jnp.asarray(
      np.concatenate([context, query], axis=1), jnp.int32))
  our_batch = dict(targets, encoder_input_tokens=jnp.asarray(context, jnp.int32),
                   query_tokens=jnp.asarray(query, jnp.int32))
  np.testing.assert_array_equal(t5x_model._compute_logits(params, theirs_batch),
                                ours._compute_logits(params, our_batch))
  theirs, _ = t5x_model.predict_batch_with_aux(params, theirs_batch, num_decodes=1)
  mine, _ = ours.predict_batch_with_aux(params, our_batch, num_decodes=1)
  np.testing.assert_array_equal(np.asarray(theirs), np.asarray(mine))
  assert len(set(np.asarray(mine).ravel().tolist())) > 1  # not one repeated token
  # 3 beams: T5X tiles the one array per beam; every beam, in order, is ours
  theirs, _ = t5x_model.predict_batch_with_aux(params, theirs_batch, num_decodes=3,
                                               return_all_decodes=True)
  mine, _ = ours.predict_batch_with_aux(params, our_batch, num_decodes=3,
                                        return_all_decodes=True)
  np.testing.assert_array_equal(np.asarray(theirs), np.asarray(mine))  # [3, 3, t]
