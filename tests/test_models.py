"""The T5X-style model wrapper: loss vs numpy, cached decoding vs uncached, T5X call pattern."""
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio

import numpy_t5 as ref

from decal_jax import decoding, losses, models
from decal_jax.networks.t5 import T5Config, Transformer

VOCAB = seqio.PassThroughVocabulary(size=61, eos_id=1)


def _model(ratio, **kw):
  cfg = T5Config(vocab_size=61, emb_dim=32, num_heads=2, head_dim=8, mlp_dim=48,
                 num_encoder_layers=2, num_decoder_layers=2, compression_ratio=ratio)
  return models.EncoderDecoderModel(Transformer(cfg), VOCAB, VOCAB, **kw)


@functools.lru_cache(maxsize=None)
def _variables(ratio):
  model = _model(ratio)
  shapes = {"encoder_input_tokens": (1, 12), "decoder_input_tokens": (1, 6)}
  return jax.jit(lambda r: model.get_initial_variables(r, shapes))(jax.random.PRNGKey(0))


def _batch(seed=0, batch=3, enc_len=12, dec_len=6):
  rng = np.random.RandomState(seed)
  enc = rng.randint(2, 61, (batch, enc_len)).astype(np.int32)
  enc[1, 7:] = 0
  targets = rng.randint(2, 61, (batch, dec_len)).astype(np.int32)
  targets[-1, 4:] = 0
  return {"encoder_input_tokens": jnp.asarray(enc), "decoder_target_tokens": jnp.asarray(targets),
          "decoder_input_tokens": jnp.asarray(np.pad(targets, ((0, 0), (1, 0)))[:, :-1]),
          "decoder_loss_weights": jnp.asarray((targets > 0).astype(np.float32))}


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_initial_variables_carry_params_axes_for_every_param():
  variables = _variables(4)
  params = flax.traverse_util.flatten_dict(variables["params"])
  axes = flax.traverse_util.flatten_dict(variables["params_axes"])
  assert {k[:-1] + (k[-1] + "_axes",) for k in params} == set(axes)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_loss_matches_numpy(label_smoothing):
  z = 1e-3
  model = _model(4, z_loss=z, label_smoothing=label_smoothing)
  params = _variables(4)["params"]
  batch = _batch()
  loss, aux = jax.jit(model.loss_fn)(params, batch, None)
  logits = np.asarray(model._compute_logits(params, batch), np.float64)
  targets, weights = np.asarray(batch["decoder_target_tokens"]), np.asarray(
      batch["decoder_loss_weights"])
  logp = _np_log_softmax(logits)
  vocab = logits.shape[-1]
  soft = np.full(logits.shape, label_smoothing / (vocab - 1))
  np.put_along_axis(soft, targets[..., None], 1.0 - label_smoothing, axis=-1)
  entropy = -(soft * np.log(np.where(soft > 0, soft, 1.0))).sum(-1)
  ce = -(soft * logp).sum(-1) - entropy
  log_z = np.log(np.exp(logits).sum(-1))
  total = ((ce + z * log_z ** 2) * weights).sum() / weights.sum()
  np.testing.assert_allclose(float(loss), total, rtol=1e-4)
  np.testing.assert_allclose(float(aux["target_tokens"]), weights.sum())
  correct = ((logits.argmax(-1) == targets) * weights).sum()
  np.testing.assert_allclose(float(aux["correct_tokens"]), correct)
  np.testing.assert_allclose(float(aux["z_loss_sum"]), (z * log_z ** 2 * weights).sum(), rtol=1e-4)


def test_z_loss_gradient_matches_hand_derivation():
  # d/dlogits of z * logsumexp^2 = 2 z logsumexp * softmax.
  logits = jnp.asarray(np.random.RandomState(0).randn(4, 7), jnp.float32)
  grad = jax.grad(lambda l: losses.cross_entropy_with_logits(l, jnp.zeros_like(l), 0.3)[1].sum())(
      logits)
  x = np.asarray(logits, np.float64)
  lse = np.log(np.exp(x).sum(-1, keepdims=True))
  np.testing.assert_allclose(np.asarray(grad), 2 * 0.3 * lse * np.exp(x - lse), rtol=1e-5)


@pytest.mark.parametrize("ratio", [1, 4])
def test_cached_greedy_equals_uncached_greedy(ratio):
  model = _model(ratio, decode_fn=decoding.temperature_sample)
  params = _variables(ratio)["params"]
  batch = _batch(seed=ratio, batch=8, dec_len=8)  # 8 rows: more chances for a mismatch
  cached = jax.jit(functools.partial(model.predict_batch, topk=1))(params, batch)
  uncached = jax.jit(model.predict_batch_uncached)(params, batch)
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(uncached))


def test_beam_search_best_scores_at_least_greedy():
  model = _model(4)
  params = _variables(4)["params"]
  batch = _batch(seed=5, dec_len=5)
  seqs, aux = jax.jit(functools.partial(model.predict_batch_with_aux, num_decodes=4))(
      params, batch)
  greedy = jax.jit(model.predict_batch_uncached)(params, batch)

  def normalised_logp(tokens):
    b = dict(batch, decoder_target_tokens=tokens,
             decoder_input_tokens=jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1],
             decoder_loss_weights=(tokens > 0).astype(jnp.float32))
    length = jnp.sum(tokens > 0, axis=-1)
    return model.score_batch(params, b) / decoding.brevity_penalty(0.6, length)

  beam_scores = np.asarray(normalised_logp(seqs))
  np.testing.assert_allclose(beam_scores, np.asarray(aux["scores"]), rtol=1e-4, atol=1e-5)
  ended = np.asarray(jnp.any(greedy == 1, axis=-1))  # greedy hypotheses that finished
  greedy_scores = np.asarray(normalised_logp(greedy))
  assert np.all(beam_scores[ended] >= greedy_scores[ended] - 1e-4)


def test_drives_module_like_t5x_encoder_decoder_model():
  """The exact call sequence of t5x.models.EncoderDecoderModel, without importing T5X: the
  training call's logits equal the numpy re-derivation (tests/numpy_t5.py), and each beam
  that the cached `decode` calls find is scored as the numpy model scores its tokens."""
  module = _model(4).module
  enc = jnp.ones((2, 12), jnp.int32)
  dec = jnp.ones((2, 5), jnp.int32)
  variables = module.init(jax.random.PRNGKey(0), enc, dec, dec, decode=False,
                          enable_dropout=False)
  assert set(variables) == {"params", "params_axes"}
  params = variables["params"]
  batch = _batch(seed=2, batch=2, dec_len=5)
  logits = module.apply({"params": params}, batch["encoder_input_tokens"],
                        batch["decoder_input_tokens"], batch["decoder_target_tokens"],
                        encoder_segment_ids=None, decoder_segment_ids=None,
                        encoder_positions=None, decoder_positions=None, decode=False,
                        enable_dropout=True, rngs={"dropout": jax.random.PRNGKey(1)})
  p = ref.to_numpy(params)

  def numpy_logits(row, decoder_input):  # [t, vocab] float64
    encoded, valid = ref.encoder(p, np.asarray(batch["encoder_input_tokens"][row]), module.config)
    return ref.decoder_logits(p, encoded, valid, np.asarray(decoder_input), module.config)

  # float32 against float64: the same tolerance as tests/test_t5_network.py's numpy checks.
  for row in range(2):
    np.testing.assert_allclose(np.asarray(logits[row]), numpy_logits(
        row, batch["decoder_input_tokens"][row]), rtol=1e-3, atol=1e-4)
  _, initial = module.apply({"params": params}, jnp.ones_like(enc), dec, dec, decode=True,
                            enable_dropout=False, mutable=["cache"])
  encoded = decoding.flat_batch_beam_expand(
      module.apply({"params": params}, batch["encoder_input_tokens"], enable_dropout=False,
                   method=module.encode), 3)
  raw = decoding.flat_batch_beam_expand(batch["encoder_input_tokens"], 3)

  def tokens_to_logits(state):
    out, new = module.apply({"params": params, "cache": state.cache}, encoded, raw,
                            state.cur_token, state.cur_token, enable_dropout=False, decode=True,
                            max_decode_length=5, mutable=["cache"], method=module.decode)
    return out[:, 0], new["cache"]

  seqs, scores = jax.jit(lambda c: decoding.beam_search(jnp.zeros((2, 5), jnp.int32), c,
                                                        tokens_to_logits, 1, num_decodes=3))(
                                                            initial["cache"])
  assert seqs.shape == (2, 3, 5) and np.all(np.diff(np.asarray(scores), axis=1) >= -1e-6)
  for row in range(2):
    for beam, tokens in enumerate(np.asarray(seqs[row])):
      # Teacher-forced log probability of the tokens up to and including EOS (or all 5),
      # divided by the brevity penalty ((5 + length) / 6) ** 0.6.
      log_probs = _np_log_softmax(numpy_logits(row, np.pad(tokens, (1, 0))[:-1]))
      length = int((tokens > 0).sum())
      want = sum(log_probs[t, tokens[t]] for t in range(length)) / ((5 + length) / 6) ** 0.6
      # A sum of 5 float32 log probabilities (|each| < 10) against float64: 1e-4 is ~100 eps.
      assert float(scores[row, beam]) == pytest.approx(want, rel=1e-4, abs=1e-4), (row, beam)
