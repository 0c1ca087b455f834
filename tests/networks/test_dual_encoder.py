"""The multi-vector dual encoder: MaxSim, the in-batch loss, the network and its converter.

References: MaxSim against a numpy loop over vector pairs; the loss against a softmax worked
out by hand; the encoder against `t5.Transformer.encode` with the same weights (so a DeCAL
pretraining checkpoint initialises it); pooling and normalisation against numpy.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from decal_jax.runtime import checkpoints
from decal_jax.models import DualEncoderFeatureConverter, DualEncoderModel
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


def test_loss_fn_scores_negatives_and_score_batch_is_maxsim_of_the_pairs():
  config = de.DualEncoderConfig(TINY, projection_dim=8)
  model, params = _init(config)
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
  log_z = np.log(np.exp(scores).sum(axis=1))
  want = np.mean(log_z - np.diag(scores[:, :4]))
  assert float(loss) == pytest.approx(want, rel=1e-5)
  np.testing.assert_allclose(np.asarray(jax.jit(model.score_batch)(params, batch)),
                             np.diag(scores[:, :4]), rtol=1e-5)


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


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="passage_compression_ratio"):
    de.DualEncoderConfig(TINY, passage_compression_ratio=0)
  with pytest.raises(ValueError, match="pooling"):
    de.DualEncoderConfig(TINY, pooling="max")
  # The encoder's own ratio would be ignored (each side has its own): refused, naming those.
  with pytest.raises(ValueError, match=r"encoder.compression_ratio is 4.*"
                                       r"query_compression_ratio / passage_compression_ratio"):
    de.DualEncoderConfig(dataclasses.replace(TINY, compression_ratio=4))
