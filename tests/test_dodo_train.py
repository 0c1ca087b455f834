"""Dodo autoencoding end to end at tiny sizes: the trainer lowers the loss, writes a
checkpoint, and evaluation reports BLEU of the reconstructions it decoded (the cosine
schedule of its run files: tests/test_optimizers.py)."""
import jax
import numpy as np
import pytest
import sacrebleu

import decal_jax.tasks  # noqa: F401  (registers decal_builtin_autoencode)
from decal_jax import models, partitioning
from decal_jax.runtime import evaluation, inference_eval, optimizers, train_state, trainer
from decal_jax.data import pipeline
from decal_jax.data import vocabularies
from decal_jax.networks.decoder import DecoderConfig
from decal_jax.networks.dodo import Dodo, DodoConfig

TASK = "decal_builtin_autoencode"
LENGTHS = {"inputs": 16, "targets": 16}  # 15 tokens + EOS; 4 nuggets at r = 4


def _model():
  vocab = vocabularies.builtin_vocabulary()
  decoder = DecoderConfig(vocab_size=4224, emb_dim=32, num_heads=2, num_kv_heads=1,
                          head_dim=16, mlp_dim=64, num_layers=2, max_length=64)
  module = Dodo(DodoConfig(decoder=decoder, compression_ratio=4, scorer_layer=1))
  return models.EncoderDecoderModel(module, vocab, vocab)


def _cfg(split="train"):
  return pipeline.DatasetConfig(TASK, LENGTHS, split=split, batch_size=4, shuffle=False)


def _optimizer():
  return optimizers.adamw(optimizers.cosine_schedule(3e-3, warmup_steps=2, decay_steps=50))


# ------------------------------------------------------------------------------ training
def test_autoencoding_loss_falls_on_a_repeated_batch():
  model, opt, part = _model(), _optimizer(), partitioning.Partitioner()
  state, shardings = train_state.init_state(model, opt, part, _cfg(), seed=0)
  step = trainer.make_train_step(model, opt, part, shardings)
  batch = next(pipeline.train_batches(_cfg(), model, skip=0))
  # an autoencoding batch: the target is the input
  np.testing.assert_array_equal(batch["encoder_input_tokens"], batch["decoder_target_tokens"])
  losses = []
  for _ in range(25):
    state, aux = step(state, pipeline.to_global(batch, part), jax.random.PRNGKey(0))
    losses.append(float(aux["loss"]))
  assert losses[-1] < losses[0] - 2.0, losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("dodo_ae")
  result = trainer.train(model=_model(), train_dataset_cfg=_cfg(), model_dir=str(model_dir),
                         total_steps=4, optimizer=_optimizer(), checkpoint_period=2,
                         eval_period=1000, eval_batches=1, log_period=2, show_example=False)
  return model_dir, result


def test_training_writes_a_checkpoint_and_evaluates(trained):
  model_dir, result = trained
  assert (model_dir / "checkpoint_4").is_dir()
  assert result["target_tokens"] > 0 and 0.0 <= result["accuracy"] <= 1.0


def test_evaluation_reports_bleu_of_the_decoded_reconstructions(trained):
  model_dir, _ = trained
  model, n = _model(), 6
  result = evaluation.evaluate(model=model, eval_dataset_cfg=_cfg("validation"),
                               model_dir=str(model_dir), eval_batches=1, max_predict_examples=n)
  rows = inference_eval.read_inferences(str(model_dir), TASK, 4)  # seqio.JSONLogger's lines
  assert len(rows) == n and result[f"{TASK}/num_examples"] == n
  # The predictions are the greedy decodes of the checkpoint: rerun the uncached reference
  # decoder on the same validation inputs and compare the texts.
  params, _ = train_state.restore_params(model, str(model_dir), _cfg("validation"),
                                         partitioning.Partitioner())
  vocab = model.output_vocabulary
  ds = pipeline.get_dataset(_cfg("validation"), model, num_epochs=1)
  decoded, targets = [], []
  for batch in ds.as_numpy_iterator():
    tokens = np.asarray(jax.jit(model.predict_batch_uncached)(params, batch))
    for row, target in zip(tokens, batch["decoder_target_tokens"]):
      ids = row.tolist()
      decoded.append(vocab.decode(ids[:ids.index(1)] if 1 in ids else ids))
      targets.append(vocab.decode([t for t in target.tolist() if t > 1]))
    if len(decoded) >= n:
      break
  assert [r["prediction"] for r in rows] == decoded[:n]
  assert [r["target"] for r in rows] == targets[:n]  # the target text is the input chunk
  assert all(r["input"]["inputs_pretokenized"] == r["target"] for r in rows)
  want = sacrebleu.corpus_bleu(decoded[:n], [targets[:n]]).score
  assert result[f"{TASK}/bleu"] == pytest.approx(want)
  scores = inference_eval.read_metrics(str(model_dir), TASK, 4)
  assert scores["bleu"] == pytest.approx(want) and result[f"{TASK}/compression_ratio"] == 4
