"""decal_jax.runtime.inference_eval: seqio.Evaluator's three metric kinds (predict, predict with aux,
score) computed for a tiny model, logged in seqio.JSONLogger's layout, read back, and held to
the model's own outputs computed without seqio."""
import jax
import numpy as np
import pytest
import seqio
import tensorflow as tf

from decal_jax import models, partitioning
from decal_jax.runtime import inference_eval
from decal_jax.data import pipeline, vocabularies
from decal_jax.networks.t5 import T5Config, Transformer

TASK = "decal_test_inference_eval_kinds"
LENGTHS = {"inputs": 16, "targets": 8}
TEXTS = [("the pass statement", "pass"), ("a while loop", "loop"),
         ("the import system", "import"), ("class definitions", "class"),
         ("the with statement", "with")]  # 5 examples: a batch of 4 and a padded one


def exact_match(targets, predictions):
  return {"exact": 100.0 * float(np.mean([t == p for t, p in zip(targets, predictions)]))}


def mean_decode_score(targets, predictions, aux_values):
  del targets, predictions
  return {"mean_decode_score": float(np.mean(aux_values["scores"]))}


def mean_log_likelihood(targets, scores):
  del targets
  return {"mean_log_likelihood": float(np.mean(scores))}


def _register(vocab):
  def source(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices({"inputs": [i for i, _ in TEXTS],
                                               "targets": [t for _, t in TEXTS]})
  features = {k: seqio.Feature(vocab, add_eos=True) for k in ("inputs", "targets")}
  seqio.TaskRegistry.remove(TASK)
  seqio.TaskRegistry.add(
      TASK, seqio.FunctionDataSource(source, splits=["validation"]),
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
      output_features=features,
      metric_fns=[exact_match, mean_decode_score, mean_log_likelihood])


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
  vocab = vocabularies.builtin_vocabulary()
  _register(vocab)
  cfg = T5Config(vocab_size=4224, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                 num_encoder_layers=1, num_decoder_layers=1, compression_ratio=2)
  model = models.EncoderDecoderModel(Transformer(cfg), vocab, vocab)
  part = partitioning.Partitioner()
  dataset_cfg = pipeline.DatasetConfig(TASK, LENGTHS, split="validation", batch_size=4,
                                       shuffle=False)
  params = model.get_initial_variables(jax.random.PRNGKey(0),
                                       model.input_shapes(LENGTHS))["params"]
  model_dir = str(tmp_path_factory.mktemp("inference_eval"))
  results = inference_eval.evaluate(model, params, dataset_cfg, part, model_dir, step=7)
  yield model, params, dataset_cfg, model_dir, results
  seqio.TaskRegistry.remove(TASK)


def _reference_outputs(model, params, dataset_cfg):
  """Each example's log-likelihood and decode score, straight from the model's batches."""
  ds = pipeline.get_dataset(dataset_cfg, model, num_epochs=1)
  scores, decode_scores = [], []
  for batch in ds.as_numpy_iterator():
    scores += np.asarray(jax.jit(model.score_batch)(params, batch)).tolist()
    _, aux = jax.jit(model.predict_batch_with_aux)(params, batch)
    decode_scores += np.asarray(aux["scores"]).tolist()
  return np.array(scores), np.array(decode_scores)


def test_all_three_metric_kinds_match_the_models_outputs(evaluated):
  model, params, dataset_cfg, model_dir, results = evaluated
  scores, decode_scores = _reference_outputs(model, params, dataset_cfg)
  assert len(scores) == len(TEXTS) and results[TASK]["num_examples"] == len(TEXTS)
  logged = inference_eval.read_metrics(model_dir, TASK, 7)
  # Mean of 5 float32 sums computed in two compiled programs (batches of 4 and padded 1):
  # rounding may differ by a few ulps of the ~20-nat sums.
  assert logged["mean_log_likelihood"] == pytest.approx(scores.mean(), rel=1e-5)
  assert logged["mean_decode_score"] == pytest.approx(decode_scores.mean(), rel=1e-5)
  del logged["step"]
  assert results[TASK] == pytest.approx(dict(logged, num_examples=5.0))  # what evaluate returns


def test_json_logger_lines_hold_each_example_and_its_outputs(evaluated):
  model, params, dataset_cfg, model_dir, _ = evaluated
  rows = inference_eval.read_inferences(model_dir, TASK, 7)
  assert [r["input"]["inputs_pretokenized"] for r in rows] == [i for i, _ in TEXTS]
  assert [r["target"] for r in rows] == [t for _, t in TEXTS]
  want = 100.0 * np.mean([r["prediction"] == r["target"] for r in rows])
  assert inference_eval.read_metrics(model_dir, TASK, 7)["exact"] == pytest.approx(want)
  scores, _ = _reference_outputs(model, params, dataset_cfg)
  np.testing.assert_allclose([r["score"] for r in rows], scores, rtol=1e-5)


def test_reading_a_step_that_was_not_evaluated_names_the_steps(evaluated):
  _, _, _, model_dir, _ = evaluated
  with pytest.raises(KeyError, match=r"no evaluation at step 8 \(steps: \[7\]\)"):
    inference_eval.read_metrics(model_dir, TASK, 8)
