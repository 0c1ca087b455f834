"""The multi-vector dual encoder: MaxSim, the in-batch loss, the network and its converter.

References: MaxSim against a numpy loop over vector pairs; the loss against a softmax worked
out by hand, and T5X Retrieval's two-way loss (logit scale x MaxSim, query -> passage and
passage -> query averaged) and its gradient against numpy; the encoder against
`t5.Transformer.encode` with the same weights (so a DeCAL pretraining checkpoint
initialises it); pooling and normalisation against numpy.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from decal_jax import partitioning
from decal_jax.runtime import checkpoints
from decal_jax.models import DualEncoderFeatureConverter, DualEncoderModel
from decal_jax.models import dual_encoder as de_model
from decal_jax.networks import dual_encoder as de
from decal_jax.networks import t5
from decal_jax.retrieval import maxsim

import tolerances

TINY = t5.T5Config(vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=48,
                   num_encoder_layers=2, num_decoder_layers=1)


def _numpy_maxsim(q, qm, p, pm):
  out = np.zeros((len(q), len(p)))
  for i in range(len(q)):
    for j in range(len(p)):
      total = 0.0
      for a in range(q.shape[1]):
        if not qm[i, a]:
          continue
        dots = [float(q[i, a] @ p[j, b]) for b in range(p.shape[1]) if pm[j, b]]
        total += max(dots) if dots else 0.0
      out[i, j] = total
  return out


def test_maxsim_matches_a_loop_over_vector_pairs_with_padding():
  rng = np.random.default_rng(0)
  q, p = rng.normal(size=(3, 4, 5)), rng.normal(size=(5, 6, 5))
  qm = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], bool)
  pm = np.array([[1, 1, 1, 0, 0, 0], [1] * 6, [1, 0, 0, 0, 0, 0], [0] * 6, [1, 1, 0, 0, 0, 1]],
                bool)
  got = maxsim.maxsim(jnp.asarray(q), jnp.asarray(qm), jnp.asarray(p), jnp.asarray(pm))
  np.testing.assert_allclose(np.asarray(got), _numpy_maxsim(q, qm, p, pm), rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[:, 3] == 0.0)  # a passage without vectors scores 0


def test_in_batch_loss_equals_a_hand_computed_softmax():
  # Two queries of one vector, two positives of one vector, one hard negative (d = 2):
  #   q0 = (1, 0), q1 = (0, 1);  p0 = (1, 0), p1 = (1, 1), n0 = (0, 2)
  # MaxSim = plain dot products: row q0 -> [1, 1, 0], row q1 -> [0, 1, 2].
  # With temperature 0.5 the logits are [2, 2, 0] and [0, 2, 4]:
  #   loss q0 = -log(e^2 / (e^2 + e^2 + 1)),  loss q1 = -log(e^2 / (1 + e^2 + e^4)).
  q = jnp.array([[[1.0, 0.0]], [[0.0, 1.0]]])
  passages = jnp.array([[[1.0, 0.0]], [[1.0, 1.0]], [[0.0, 2.0]]])
  ones = lambda n: jnp.ones((n, 1), bool)
  loss, sums = maxsim.in_batch_softmax_loss(q, ones(2), passages, ones(3), jnp.ones(2),
                                            jnp.ones(3, bool), temperature=0.5)
  e = math.e
  l0 = -math.log(e**2 / (2 * e**2 + 1))
  l1 = -math.log(e**2 / (1 + e**2 + e**4))
  assert float(loss) == pytest.approx((l0 + l1) / 2, rel=1e-6)
  assert float(sums["loss_sum"]) == pytest.approx(l0 + l1, rel=1e-6)
  # q0: a tie between p0 and p1 -> argmax takes p0 (correct); q1 prefers the negative.
  assert float(sums["correct"]) == 1.0 and float(sums["num_queries"]) == 2.0


def test_padding_rows_neither_count_as_queries_nor_compete_as_candidates():
  rng = np.random.default_rng(1)
  q, p = rng.normal(size=(3, 2, 4)), rng.normal(size=(3, 3, 4))
  qm, pm = np.ones((3, 2), bool), np.ones((3, 3), bool)
  full, _ = maxsim.in_batch_softmax_loss(q, qm, p, pm, np.ones(3), np.ones(3, bool))
  # The same batch padded by a fourth all-zero row (as the trainer pads a short eval batch):
  qp = np.concatenate([q, np.zeros((1, 2, 4))])
  pp = np.concatenate([p, 5 * np.ones((1, 3, 4))])  # large scores if it were a candidate
  padded, sums = maxsim.in_batch_softmax_loss(qp, np.ones((4, 2), bool), pp, np.ones((4, 3), bool),
                                              np.array([1, 1, 1, 0.0]),
                                              np.array([True, True, True, False]))
  # The same sums over more (masked) terms, in float32 in other orders: dot products (4
  # terms), MaxSim over 2 query vectors, log-sum-exp over 4 candidates, mean over 3
  # queries; of scores up to max |MaxSim|.
  scores = np.einsum("qad,pbd->qpab", q, p).max(-1).sum(-1)  # [3, 3] MaxSim, temperature 1
  np.testing.assert_allclose(float(padded), float(full), rtol=0, atol=tolerances.reorder_atol(
      4 + 2 + 4 + 3, max(np.abs(scores).max(), float(full))))
  assert float(sums["num_queries"]) == 3.0


def _init(config, n_query=8, n_passage=20):
  model = DualEncoderModel(de.DualEncoder(config), None)
  variables = model.get_initial_variables(
      jax.random.PRNGKey(0), {"left_encoder_input_tokens": (1, n_query),
                              "right_encoder_input_tokens": (1, n_passage)})
  return model, variables["params"]


def _jit_encode(model):
  return jax.jit(model.encode, static_argnums=2)


def _tokens(rng, rows, n, lengths):
  tokens = rng.integers(2, TINY.vocab_size, (rows, n)).astype(np.int32)
  for r, length in enumerate(lengths):
    tokens[r, length:] = 0
  return tokens


def test_the_shared_encoder_is_the_pretrained_decal_encoder_at_each_sides_ratio(tmp_path):
  """A DeCAL pretraining checkpoint (a t5.Transformer's) initialises the dual encoder by
  name, its decoder unused; without projection / normalisation the vectors are that
  encoder's output at the query ratio (1) and the passage ratio (4), m = ceil(n / C) valid."""
  transformer = t5.Transformer(dataclasses.replace(TINY, compression_ratio=4))  # DeCAL, C = 4
  ones = jnp.ones((1, 20), jnp.int32)
  t5_params = transformer.init(jax.random.PRNGKey(3), ones, ones, ones,
                               enable_dropout=False)["params"]
  ckpt = checkpoints.Checkpointer(str(tmp_path / "pretrained"))
  ckpt.save(7, {"params": t5_params, "step": jnp.int32(7)}, {"batches_consumed": 7}, force=True)
  ckpt.close()
  config = de.DualEncoderConfig(TINY, query_compression_ratio=1, passage_compression_ratio=4,
                                normalize=False)
  model, params = _init(config)
  params, report = checkpoints.restore_matching_params(str(tmp_path / "pretrained"), params)
  assert not report["initialised"] and report["unused"]
  assert all(k.startswith("decoder/") for k in report["unused"])
  rng = np.random.default_rng(2)
  tokens = _tokens(rng, 3, 20, [20, 13, 1])
  for side, ratio in (("query", 1), ("passage", 4)):
    got = _jit_encode(model)(params, tokens, side)
    ref = t5.Transformer(t5.T5Config(**{**TINY.__dict__, "compression_ratio": ratio}))
    want = jax.jit(lambda p, x: ref.apply({"params": p}, x, enable_dropout=False,
                                          method=ref.encode))(t5_params, tokens)
    m = want.shape[1]
    valid = np.arange(m)[None, :] < np.ceil(np.array([20, 13, 1]) / ratio)[:, None]
    np.testing.assert_array_equal(np.asarray(got.valid), valid)
    # The same encoder in another program: the float32 reordering bound of its sums.
    tol = tolerances.network_atol(want, tolerances.stack_reductions(
        TINY, keys=20 + m, layers=TINY.num_encoder_layers))
    np.testing.assert_allclose(np.asarray(got.vectors), np.asarray(want) * valid[..., None],
                               rtol=0, atol=tol)


def test_projection_normalisation_and_mean_pooling_follow_their_definitions():
  rng = np.random.default_rng(4)
  tokens = _tokens(rng, 3, 20, [20, 9, 3])
  plain = de.DualEncoderConfig(TINY, projection_dim=8, normalize=False)
  model, params = _init(plain)
  raw = model.encode(params, tokens, "passage")
  vectors, valid = np.asarray(raw.vectors), np.asarray(raw.valid)
  assert vectors.shape[-1] == 8
  unit = DualEncoderModel(de.DualEncoder(de.DualEncoderConfig(TINY, projection_dim=8)), None)
  normed = unit.encode(params, tokens, "passage")
  norms = np.linalg.norm(np.asarray(normed.vectors), axis=-1)
  np.testing.assert_allclose(norms[valid], 1.0, rtol=1e-5)
  assert np.all(norms[~valid] == 0.0)
  mean = DualEncoderModel(de.DualEncoder(de.DualEncoderConfig(TINY, projection_dim=8,
                                                              pooling="mean")), None)
  pooled = mean.encode(params, tokens, "passage")
  want = np.stack([vectors[r][valid[r]].mean(axis=0) for r in range(3)])
  want /= np.linalg.norm(want, axis=-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(pooled.vectors)[:, 0], want, rtol=1e-5, atol=1e-6)


def _numpy_two_way(scores, scale, weights, candidates):
  """(loss, d loss / d scores) of T5X Retrieval's two-way in-batch loss, in float64:
  scores `[b, c]` (positives first), weights `[b]`, candidates `[c]` bool."""
  b = scores.shape[0]

  def softmax_rows(logits, mask):  # [r, k], [k] -> probabilities, masked columns 0
    z = np.where(mask[None, :], logits, -np.inf)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)

  w = weights / weights.sum()
  to_passages = softmax_rows(scale * scores, candidates)  # [b, c]
  to_queries = softmax_rows(scale * scores[:, :b].T, weights > 0)  # [b passages, b queries]
  eye = np.eye(b, scores.shape[1])
  with np.errstate(divide="ignore"):  # a padding pair's positive has probability 0
    nll = -(np.log(np.diag(to_passages)) + np.log(np.diag(to_queries))) / 2  # [b]
  nll = np.where(weights > 0, nll, 0.0)
  grad = w[:, None] * (to_passages - eye) / 2  # d loss / d logits, query -> passage
  grad[:, :b] += (w[:, None] * (to_queries - np.eye(b)) / 2).T  # passage -> query
  return float(np.sum(w * nll)), scale * grad


def test_two_way_loss_and_its_gradient_match_numpy():
  """T5X Retrieval's loss: logits = scale x MaxSim; query -> passage over all candidates
  (hard negatives included), passage -> query over the batch's queries, averaged; padding
  pairs neither count nor compete. Its gradient w.r.t. the scores is the softmax minus the
  one-hot, per direction (numpy) = jax.grad."""
  rng = np.random.default_rng(6)
  scores = rng.normal(size=(4, 6))  # 4 pairs (the last one padding), 2 hard negatives
  weights = np.array([1.0, 1.0, 1.0, 0.0])
  candidates = np.array([True, True, True, False, True, False])  # a padding negative too
  scale = 7.0

  def loss(s):
    logits = jnp.where(candidates[None, :], scale * s, -1e9)
    return de_model.in_batch_loss(logits, jnp.asarray(weights))

  (got, sums), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(scores, jnp.float32))
  want, want_grad = _numpy_two_way(scores, scale, weights, candidates)
  # float32 against float64 over logits up to |7 x 3|: a few ulps of the log-sum-exps.
  assert float(got) == pytest.approx(want, rel=1e-5)
  assert float(sums["loss_sum"]) == pytest.approx(3 * want, rel=1e-5)
  assert float(sums["num_queries"]) == 3.0
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)
  assert np.all(np.asarray(grad)[:, [3, 5]] == 0.0)  # padding candidates get no gradient
  # One-way, it is the older maxsim.in_batch_softmax_loss at temperature 1 / scale.
  q, p = rng.normal(size=(4, 2, 5)), rng.normal(size=(6, 3, 5))
  qm, pm = np.ones((4, 2), bool), np.ones((6, 3), bool)
  old, _ = maxsim.in_batch_softmax_loss(q, qm, p, pm, weights, candidates, 1 / scale)
  logits = jnp.where(candidates[None, :], scale * maxsim.maxsim(q, qm, p, pm), -1e9)
  one_way, _ = de_model.in_batch_loss(logits, jnp.asarray(weights), bidirectional=False)
  assert float(one_way) == pytest.approx(float(old), rel=1e-6)


def test_the_scaled_loss_can_approach_zero_where_temperature_one_cannot():
  """128 pairs of two unit query vectors, each passage a copy of its query: MaxSim 2 on
  the diagonal, 0 elsewhere. At temperature 1 the loss is log(1 + 127 e^-2) ~ 2.9, and no
  batch of two unit vectors can go below log(1 + 127 e^-4) ~ 1.2 (positive at most 2,
  negatives at least -2); T5X Retrieval's scale 100 takes it to ~0."""
  b, d = 128, 256
  vectors = np.eye(d, dtype=np.float32).reshape(b, 2, d)  # query i: e_2i, e_2i+1
  valid, weights, candidates = np.ones((b, 2), bool), np.ones(b), np.ones(b, bool)
  scores = maxsim.maxsim(vectors, valid, vectors, valid)  # [b, b]
  old, _ = maxsim.in_batch_softmax_loss(vectors, valid, vectors, valid, weights, candidates,
                                        temperature=1.0)
  assert float(old) == pytest.approx(math.log1p(127 * math.exp(-2)), rel=1e-5)
  assert math.log1p(127 * math.exp(-4)) > 1.2
  new, sums = de_model.in_batch_loss(de_model.DEFAULT_LOGIT_SCALE * scores, weights)
  assert de_model.DEFAULT_LOGIT_SCALE == 100.0
  assert 0.0 <= float(new) < 1e-6 and float(sums["correct"]) == b


def test_loss_fn_scores_negatives_and_score_batch_is_maxsim_of_the_pairs():
  config = de.DualEncoderConfig(TINY, projection_dim=8)
  model, params = _init(config)
  assert (model.logit_scale, model.bidirectional) == (100.0, True)  # T5X Retrieval's
  rng = np.random.default_rng(5)
  batch = {"left_encoder_input_tokens": _tokens(rng, 4, 8, [8, 5, 2, 8]),
           "right_encoder_input_tokens": _tokens(rng, 4, 20, [20, 17, 6, 11]),
           "right_negative_encoder_input_tokens": _tokens(rng, 4, 12, [12, 3, 9, 1])}
  loss, sums = jax.jit(model.loss_fn)(params, batch, None)
  encode = _jit_encode(model)
  q = encode(params, batch["left_encoder_input_tokens"], "query")
  enc = [encode(params, batch[k], "passage")
         for k in ("right_encoder_input_tokens", "right_negative_encoder_input_tokens")]
  scores = np.concatenate([_numpy_maxsim(np.asarray(q.vectors), np.asarray(q.valid),
                                         np.asarray(e.vectors), np.asarray(e.valid))
                           for e in enc], axis=1)  # [4 queries, 8 candidates]
  want, _ = _numpy_two_way(scores, 100.0, np.ones(4), np.ones(8, bool))
  # MaxSim in float32 (sums of <= 2 x 8 products of unit vectors) x 100: logits within
  # ~1e-4, the loss within twice that.
  assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-3)
  np.testing.assert_allclose(np.asarray(jax.jit(model.score_batch)(params, batch)),
                             np.diag(scores[:, :4]), rtol=1e-5)


def test_a_learnable_logit_scale_is_a_parameter_at_log_scale_that_training_moves():
  config = de.DualEncoderConfig(TINY, projection_dim=8)
  fixed, params = _init(config)
  assert de_model.LOGIT_SCALE_PARAM not in params
  learnt = DualEncoderModel(de.DualEncoder(config), None, logit_scale=30.0,
                            learnable_logit_scale=True)
  variables = learnt.get_initial_variables(
      jax.random.PRNGKey(0), {"left_encoder_input_tokens": (1, 8),
                              "right_encoder_input_tokens": (1, 20)})
  learnt_params = variables["params"]
  assert float(learnt_params["logit_scale"]) == pytest.approx(math.log(30.0), rel=1e-6)
  # It has logical axes (a scalar's: none), so the partitioner and Adafactor know it.
  shardings = partitioning.Partitioner().params_shardings(variables["params_axes"],
                                                          learnt_params)
  assert tuple(shardings["logit_scale"].spec) == ()
  rng = np.random.default_rng(7)
  batch = {"left_encoder_input_tokens": _tokens(rng, 4, 8, [8, 5, 2, 8]),
           "right_encoder_input_tokens": _tokens(rng, 4, 20, [20, 17, 6, 11])}
  loss, grads = jax.value_and_grad(lambda p: learnt.loss_fn(p, batch, None)[0])(learnt_params)
  same_scale = DualEncoderModel(de.DualEncoder(config), None, temperature=1 / 30.0)
  without = {k: v for k, v in learnt_params.items() if k != "logit_scale"}
  assert float(loss) == pytest.approx(float(same_scale.loss_fn(without, batch, None)[0]),
                                      rel=1e-5)
  assert math.isfinite(float(grads["logit_scale"])) and float(grads["logit_scale"]) != 0.0
  with pytest.raises(ValueError, match="logit_scale"):
    learnt.loss_fn(without, batch, None)  # a checkpoint trained with a fixed scale


def test_logit_scale_and_the_older_temperature_are_one_setting():
  module = de.DualEncoder(de.DualEncoderConfig(TINY))
  assert DualEncoderModel(module, None).logit_scale == 100.0
  assert DualEncoderModel(module, None, temperature=0.05).logit_scale == pytest.approx(20.0)
  assert DualEncoderModel(module, None, logit_scale=20.0).temperature == pytest.approx(0.05)
  with pytest.raises(ValueError, match="disagree"):
    DualEncoderModel(module, None, logit_scale=100.0, temperature=0.05)
  for bad in ({"logit_scale": 0.0}, {"temperature": -1.0}):
    with pytest.raises(ValueError, match="must be positive"):
      DualEncoderModel(module, None, **bad)


def test_feature_converter_pads_and_renames_like_t5x_retrieval():
  ds = tf.data.Dataset.from_tensor_slices({
      "inputs": tf.ragged.constant([[7, 8, 5, 1], [8, 4, 9, 3, 1]]),
      "targets": tf.ragged.constant([[3, 9, 1], [4, 1]]),
      "negative_targets": tf.ragged.constant([[2, 7, 1], [3, 1]])}).map(
          lambda ex: {k: v for k, v in ex.items()})
  pairs = list(DualEncoderFeatureConverter()(
      ds.map(lambda ex: {"inputs": ex["inputs"], "targets": ex["targets"]}),
      {"inputs": 6, "targets": 4}).as_numpy_iterator())
  assert sorted(pairs[0]) == ["left_encoder_input_tokens", "right_encoder_input_tokens"]
  np.testing.assert_array_equal(pairs[1]["left_encoder_input_tokens"], [8, 4, 9, 3, 1, 0])
  np.testing.assert_array_equal(pairs[1]["right_encoder_input_tokens"], [4, 1, 0, 0])
  triples = list(DualEncoderFeatureConverter()(
      ds, {"inputs": 6, "targets": 4, "negative_targets": 5}).as_numpy_iterator())
  np.testing.assert_array_equal(triples[0]["right_negative_encoder_input_tokens"],
                                [2, 7, 1, 0, 0])
  with pytest.raises(ValueError, match="packed"):
    DualEncoderFeatureConverter(pack=True)


def test_queries_are_read_at_the_passages_ratio_by_default():
  """decal.txt §4.3 compresses both sides (MaxSim costs m_q x m_p: C^2 fewer products);
  the asymmetric encoder is a setting."""
  config = de.DualEncoderConfig(TINY)
  assert config.query_compression_ratio == config.passage_compression_ratio == 4
  assert de.DualEncoderConfig(TINY, query_compression_ratio=1).ratio("query") == 1


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="passage_compression_ratio"):
    de.DualEncoderConfig(TINY, passage_compression_ratio=0)
  with pytest.raises(ValueError, match="pooling"):
    de.DualEncoderConfig(TINY, pooling="max")
  # The encoder's own ratio would be ignored (each side has its own): refused, naming those.
  with pytest.raises(ValueError, match=r"encoder.compression_ratio is 4.*"
                                       r"query_compression_ratio / passage_compression_ratio"):
    de.DualEncoderConfig(dataclasses.replace(TINY, compression_ratio=4))
