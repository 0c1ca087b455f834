"""The compressed multi-vector dual encoder under the real T5X (models/t5x_dual_encoder.py).

Skipped, with the reason, where `import t5x` fails (CI). `python -m t5x.train` trains the
tiny drop-in (gin/t5x/de_decal_t5_1_1_tiny.gin) on the built-in BEIR task and `t5x.infer`
scores pairs from its checkpoint, `t5x.eval` ranks the validation split's queries against its
passages (gin/t5x/runs/eval_dual_encoder.gin); in process, the
T5X model's loss equals decal_jax's own DualEncoderModel's, 'similarity' equals a numpy
MaxSim over the encodings, and hard negatives ([batch, n_neg, length]) change the loss as a
numpy softmax cross entropy over [positives | negatives] says.

  PYTHONPATH=$PWD:/path/to/t5x-site python -m pytest -q tests/t5x/test_t5x_dual_encoder.py
"""
import json
import math
import os
import re
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
from decal_jax import models as our_models
from decal_jax.models import t5x_dual_encoder
from decal_jax.retrieval import beir

REPO = paths.REPO
DROP_IN = "t5x/de_decal_t5_1_1_tiny.gin"
STEPS = 4


def _t5x(entry: str, run_file: str, *args: str, cwd) -> str:
  """Runs `python -m t5x.<entry>` with the tiny drop-in on the built-in BEIR task."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  command = [sys.executable, "-m", f"t5x.{entry}", f"--gin_search_paths={REPO / 'gin'}",
             f"--gin_file={DROP_IN}", f"--gin_file=t5x/runs/{run_file}.gin",
             "--gin.MIXTURE_OR_TASK_NAME='decal_beir_builtin'",
             "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 64}", *args]
  done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=1800)
  log = done.stdout + done.stderr
  assert done.returncode == 0, f"t5x.{entry} failed:\n{log[-6000:]}"
  return log


def test_t5x_train_and_infer_the_dual_encoder(tmp_path):
  model_dir = tmp_path / "model"
  log = _t5x("train", "train_dual_encoder", f"--gin.TRAIN_STEPS={STEPS}",
             "--gin.BATCH_SIZE=4", f"--gin.MODEL_DIR='{model_dir}'",
             "--gin.train.eval_steps=1", f"--gin.train.eval_period={STEPS}",
             f"--gin.utils.SaveCheckpointConfig.period={STEPS}", cwd=tmp_path)
  checkpoint = model_dir / f"checkpoint_{STEPS}"
  assert (checkpoint / "_CHECKPOINT_METADATA").exists()
  losses = [float(v) for v in re.findall(r"collection=train .*?\bloss=([0-9.eE+-]+)", log)]
  assert losses and all(math.isfinite(v) and v > 0 for v in losses), log[-3000:]
  # the training evaluation ran T5X's eval_fn on the validation split
  assert re.search(r"collection=training_eval/decal_beir_builtin .*accuracy=", log)
  # t5x.infer in 'score' mode: MaxSim of each (query, passage) pair
  _t5x("infer", "infer", f"--gin.CHECKPOINT_PATH='{checkpoint}'",
       f"--gin.INFER_OUTPUT_DIR='{tmp_path / 'infer'}'", "--gin.infer.mode='score'",
       "--gin.utils.DatasetConfig.split='validation'", "--gin.utils.DatasetConfig.batch_size=4",
       cwd=tmp_path)
  rows = [json.loads(line)
          for p in (tmp_path / "infer").glob("decal_beir_builtin-score.jsonl-*-of-*")
          if not p.name.endswith("COMPLETED") for line in p.read_text().splitlines()]
  assert rows and all(math.isfinite(r["score"]) for r in rows)
  assert len({round(r["score"], 6) for r in rows}) > 1  # not one repeated score
  # t5x.eval: the validation queries ranked against the validation passages
  _t5x("eval", "eval_dual_encoder", f"--gin.CHECKPOINT_PATH='{checkpoint}'",
       f"--gin.EVAL_OUTPUT_DIR='{tmp_path / 'eval'}'",
       "--gin.utils.DatasetConfig.split='validation'", "--gin.utils.DatasetConfig.batch_size=4",
       cwd=tmp_path)
  metrics = [json.loads(line) for p in (tmp_path / "eval").rglob("*-metrics.jsonl")
             for line in p.read_text().splitlines()]
  assert metrics, list((tmp_path / "eval").rglob("*"))
  last = metrics[-1]
  for name in ("ndcg@10", "recall@10", "mrr@10"):
    assert 0 < last[name] <= 1, last
  # one ranking per distinct validation query, against the split's relevant passages
  data = beir.load_beir(beir.builtin_beir_folder(), "validation")
  assert last["num_queries"] == len({data.queries[q] for q in data.qrels}), last
  passages = {doc for grades in data.qrels.values() for doc, g in grades.items() if g > 0}
  assert last["num_queries"] < last["num_passages"] <= len(passages), last


# ------------------------------------------------------------------- in process
@pytest.fixture(scope="module")
def network_and_params():
  gin.clear_config()
  gin.add_config_file_search_path(str(REPO / "gin"))
  gin.parse_config_files_and_bindings([DROP_IN], [], finalize_config=False)
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  gin.clear_config()
  assert isinstance(model, t5x_dual_encoder.DualEncoderModel)
  params = model.get_initial_variables(
      jax.random.PRNGKey(0), {"left_encoder_input_tokens": (1, 12),
                              "right_encoder_input_tokens": (1, 20)})["params"]
  return model.module, model.input_vocabulary, params


def _tokens(rng, shape, lengths):
  tokens = rng.randint(3, 200, shape)  # [..., n]
  n = shape[-1]
  return jnp.asarray(tokens * (np.arange(n) < np.asarray(lengths)[..., None]), jnp.int32)


def _batch(negatives_per_query=0):
  rng = np.random.RandomState(1)
  b = 4
  batch = {"left_encoder_input_tokens": _tokens(rng, (b, 12), [12, 5, 8, 3]),
           "right_encoder_input_tokens": _tokens(rng, (b, 20), [20, 9, 14, 6])}
  if negatives_per_query:
    lengths = rng.randint(4, 21, (b, negatives_per_query))
    batch["right_negative_encoder_input_tokens"] = _tokens(
        rng, (b, negatives_per_query, 20), lengths)  # [b, n_neg, n]
  return batch


def _t5x_model(network_and_params, **kwargs):
  module, vocab, params = network_and_params
  return t5x_dual_encoder.DualEncoderModel(module, vocab, optimizer_def=None, **kwargs), params


def _numpy_maxsim(q, qm, p, pm):
  """q [b, mq, d], p [c, mp, d] -> [b, c]: sum over valid query vectors of the best match."""
  sims = np.einsum("qad,pbd->qpab", q, p)  # [b, c, mq, mp]
  sims = np.where(pm[None, :, None, :], sims, -np.inf).max(-1)  # [b, c, mq]
  return np.sum(np.where(qm[:, None, :], sims, 0.0), axis=-1)


def _encode(ours, params, tokens, side):
  e = ours.encode(params, tokens, side)
  return np.asarray(e.vectors, np.float64), np.asarray(e.valid)


def test_t5x_loss_equals_our_models_loss(network_and_params):
  module, vocab, _ = network_and_params
  model, params = _t5x_model(network_and_params, logit_scale=5.0)
  batch = _batch()
  loss, metrics = model.loss_fn(params, batch, None)
  ours_loss, sums = our_models.DualEncoderModel(module, vocab, temperature=0.2).loss_fn(
      params, batch, None)
  np.testing.assert_allclose(float(loss), float(ours_loss), rtol=1e-6)
  assert math.isfinite(float(loss)) and float(loss) > 0
  assert float(metrics["accuracy"].compute()) == float(sums["correct"]) / 4
  # T5X's eval_fn is the same loss without dropout
  np.testing.assert_allclose(float(model.eval_fn(params, batch)[0]), float(loss), rtol=1e-6)


def test_similarity_and_encodings_equal_our_maxsim(network_and_params):
  module, vocab, params = network_and_params
  ours = our_models.DualEncoderModel(module, vocab)
  batch = _batch()
  q, qm = _encode(ours, params, batch["left_encoder_input_tokens"], "query")
  p, pm = _encode(ours, params, batch["right_encoder_input_tokens"], "passage")
  expected = np.diag(_numpy_maxsim(q, qm, p, pm))  # [b]: each query with its own passage
  similarity, aux = _t5x_model(network_and_params, inference_mode="similarity")[0] \
      .predict_batch_with_aux(params, batch)
  np.testing.assert_allclose(np.asarray(similarity), expected, rtol=1e-5, atol=1e-5)
  # its aux values are the encodings t5x.eval's retrieval metrics rank
  for key, want in [("query_vectors", q), ("passage_vectors", p)]:
    np.testing.assert_allclose(np.asarray(aux[key]), want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(aux["query_valid"]), qm)
  np.testing.assert_array_equal(np.asarray(aux["passage_valid"]), pm)
  for mode, (vectors, valid) in [("encode", (q, qm)), ("encode_left", (q, qm)),
                                 ("encode_right", (p, pm))]:
    got, aux = _t5x_model(network_and_params, inference_mode=mode)[0] \
        .predict_batch_with_aux(params, batch)
    np.testing.assert_allclose(np.asarray(got), vectors, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux["valid"]), valid)


def test_hard_negatives_join_the_softmax_as_numpy_says(network_and_params):
  module, vocab, params = network_and_params
  ours = our_models.DualEncoderModel(module, vocab)
  batch = _batch(negatives_per_query=2)
  scale = 3.0
  with_negatives, _ = _t5x_model(network_and_params, use_negatives=True, logit_scale=scale)
  without, _ = _t5x_model(network_and_params, use_negatives=False, logit_scale=scale)
  q, qm = _encode(ours, params, batch["left_encoder_input_tokens"], "query")
  positives = _encode(ours, params, batch["right_encoder_input_tokens"], "passage")
  negatives = _encode(ours, params, batch["right_negative_encoder_input_tokens"].reshape(8, 20),
                      "passage")  # query 0's two negatives, then query 1's, ...

  def diagonal_nll(logits):  # [r, k] -> [r]: -log softmax(row i)[i]
    logits = logits - logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -np.diag(log_probs[:, :len(logits)])

  def numpy_loss(candidates):
    """T5X Retrieval's two-way loss, averaged: query -> passage over all candidates (the
    positive of query i is candidate i), passage -> query over the 4 queries."""
    logits = scale * np.concatenate([_numpy_maxsim(q, qm, *c) for c in candidates], axis=1)
    return np.mean((diagonal_nll(logits) + diagonal_nll(logits[:, :4].T)) / 2)

  loss = float(with_negatives.loss_fn(params, batch, None)[0])
  np.testing.assert_allclose(loss, numpy_loss([positives, negatives]), rtol=1e-5)
  loss_without = float(without.loss_fn(params, batch, None)[0])
  np.testing.assert_allclose(loss_without, numpy_loss([positives]), rtol=1e-5)
  assert loss > loss_without  # more candidates, lower probability for the positive
  # one negative per query, [b, n] (what decal_jax's triple tasks give) == [b, 1, n]
  one = dict(batch, right_negative_encoder_input_tokens=batch[
      "right_negative_encoder_input_tokens"][:, 0])  # [b, n]
  np.testing.assert_allclose(
      float(with_negatives.loss_fn(params, one, None)[0]),
      float(with_negatives.loss_fn(params, dict(one, right_negative_encoder_input_tokens=one[
          "right_negative_encoder_input_tokens"][:, None]), None)[0]), rtol=1e-6)
  logits = np.asarray(with_negatives._compute_logits(params, batch))
  assert logits.shape == (4, 4 + 8)
  with pytest.raises(ValueError, match="use_negatives"):
    with_negatives.loss_fn(params, _batch(), None)


def test_model_refuses_unknown_inference_modes(network_and_params):
  with pytest.raises(ValueError, match="inference_mode"):
    _t5x_model(network_and_params, inference_mode="decode")
