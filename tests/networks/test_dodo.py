"""Dodo (networks/dodo.py, compress/nuggets.py) and the LLaMA-style decoder it builds on,
against the numpy re-derivation in tests/numpy_llama.py and properties that must hold."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import seqio

from decal_jax import decoding, models
from decal_jax.runtime import optimizers
from decal_jax.compress import nuggets as nug
from decal_jax.networks.decoder import Decoder, DecoderConfig, DecoderStack, causal_bias
from decal_jax.networks.dodo import Dodo, DodoConfig

import numpy_llama
import tolerances

VOCAB = 61
TINY = DecoderConfig(vocab_size=VOCAB, emb_dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
                     mlp_dim=48, num_layers=3, max_length=64)


def _perturbed(params, seed=0, scale=0.2):
  """Random non-zero values everywhere (LoRA B starts at zero, which would hide bugs)."""
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree_util.tree_unflatten(
      tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _f64(tree):
  return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), tree)


def _batch(seed=0, n=11, t=6):
  rng = np.random.default_rng(seed)
  context = rng.integers(2, VOCAB, (3, n)).astype(np.int32)
  context[1, 7:] = 0   # a shorter context
  context[2, :] = 0    # an empty context
  targets = rng.integers(2, VOCAB, (3, t)).astype(np.int32)
  return context, targets


def _dodo(lora_rank=0, **kw):
  cfg = DodoConfig(decoder=dataclasses.replace(TINY, lora_rank=lora_rank),
                   compression_ratio=kw.pop("ratio", 3), scorer_layer=kw.pop("scorer_layer", 2),
                   **kw)
  module = Dodo(cfg)
  context, targets = _batch()
  params = module.init(jax.random.PRNGKey(1), context, targets, targets,
                       enable_dropout=False)["params"]
  return cfg, module, _perturbed(params)


def test_bad_ratio_and_scorer_layer_are_refused():
  with pytest.raises(ValueError, match="ratio r must be >= 1"):
    DodoConfig(decoder=TINY, compression_ratio=0.5)
  with pytest.raises(ValueError, match="scorer_layer"):
    DodoConfig(decoder=TINY, scorer_layer=4)
  with pytest.raises(ValueError, match="ratio r must be >= 1"):
    nug.calibrate_threshold(np.ones(3), np.ones(3, bool), 0.9)


# --------------------------------------------------------------- the whole network
@pytest.mark.parametrize("lora_rank,selection,scorer_layer",
                         [(0, "nuggets", 2), (0, "nuggets", 3), (4, "nuggets", 2),
                          (4, "compressive", 2)])
def test_dodo_logits_match_numpy_dense_attention_over_gathered_nuggets(lora_rank, selection,
                                                                        scorer_layer):
  cfg, module, params = _dodo(lora_rank, selection=selection, scorer_layer=scorer_layer)
  context, targets = _batch()
  logits = module.apply({"params": params}, context, targets, targets, enable_dropout=False)
  for row in range(len(context)):
    real = context[row][context[row] > 0]
    expect = numpy_llama.dodo_logits(cfg, _f64(params), real, targets[row])
    np.testing.assert_allclose(logits[row], expect, atol=2e-4, rtol=2e-4)


def test_decoder_matches_numpy_and_cached_decoding_and_prefill_match_full_pass():
  module = Decoder(TINY)
  tokens = np.random.default_rng(3).integers(1, VOCAB, (2, 9)).astype(np.int32)
  params = _perturbed(module.init(jax.random.PRNGKey(0), tokens,
                                  enable_dropout=False)["params"])
  full = module.apply({"params": params}, tokens, enable_dropout=False)
  for row in range(2):
    np.testing.assert_allclose(full[row], numpy_llama.Llama(TINY, _f64(params["stack"]))
                               .lm_logits(tokens[row]), atol=2e-4, rtol=2e-4)
  # one token at a time from an empty cache
  _, cache = module.apply({"params": params}, jnp.ones((2, 9), jnp.int32), decode=True,
                          enable_dropout=False, mutable=["cache"])
  steps = []
  for i in range(9):
    out, cache = module.apply({"params": params, **cache}, tokens[:, i:i + 1], decode=True,
                              enable_dropout=False, mutable=["cache"])
    steps.append(out)
  # Cached steps and prefill sum the full pass's terms in other orders: float32 reordering.
  tol = tolerances.network_atol(full, tolerances.stack_reductions(TINY, keys=9))
  np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=tol)
  # prefill 5 tokens at once, then step
  _, cache = module.apply({"params": params}, jnp.ones((2, 9), jnp.int32), decode=True,
                          enable_dropout=False, mutable=["cache"])
  pre, cache = module.apply({"params": params, **cache}, tokens[:, :5], decode=True,
                            prefill=True, enable_dropout=False, mutable=["cache"])
  np.testing.assert_allclose(pre, full[:, :5], atol=tol)
  for i in range(5, 9):
    out, cache = module.apply({"params": params, **cache}, tokens[:, i:i + 1], decode=True,
                              enable_dropout=False, mutable=["cache"])
    np.testing.assert_allclose(out[:, 0], full[:, i], atol=tol)


def _stack_logits(cfg, stack_params, tokens, adapter):
  """Logits of a bare DecoderStack run causally with one adapter active (or none)."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  bias = causal_bias(positions, None, jnp.float32)

  def fn(stack):
    return stack.logits(stack(stack.embed(tokens), positions, bias, adapter=adapter))
  return nn.apply(fn, DecoderStack(cfg))({"params": stack_params})


def test_lora_adapters_match_numpy_and_start_as_the_base_model():
  cfg = dataclasses.replace(TINY, lora_rank=4, lora_adapters=("a", "b"))
  tokens = np.random.default_rng(4).integers(1, VOCAB, (2, 7)).astype(np.int32)
  fresh = Decoder(cfg).init(jax.random.PRNGKey(0), tokens, enable_dropout=False)["params"]
  # B = 0 at initialisation: a fresh adapter gives the base model's output (it adds exact
  # zeros; the two programs may still block their sums differently)
  base = _stack_logits(cfg, fresh["stack"], tokens, None)
  np.testing.assert_allclose(_stack_logits(cfg, fresh["stack"], tokens, "a"), base,
                             atol=tolerances.network_atol(base, tolerances.stack_reductions(
                                 cfg, keys=7)))
  trained = _perturbed(fresh)["stack"]
  for adapter in ("a", "b", None):
    reference = numpy_llama.Llama(cfg, _f64(trained))
    x = np.asarray(trained["token_embedder"]["embedding"], np.float64)[tokens[0]]
    expect = reference.logits(reference.run(x, np.arange(7), adapter)[0])
    np.testing.assert_allclose(_stack_logits(cfg, trained, tokens, adapter)[0], expect,
                               atol=2e-4, rtol=2e-4)
  with pytest.raises(ValueError, match="not one of this layer's adapters"):
    _stack_logits(cfg, trained, tokens, "c")


# ----------------------------------------------------------- straight-through estimator
def test_straight_through_term_changes_gradients_not_values():
  cfg, module, params = _dodo(0)
  context, targets = _batch()
  vocab = seqio.PassThroughVocabulary(VOCAB, eos_id=1)
  model = models.EncoderDecoderModel(module, vocab, vocab)
  batch = {"encoder_input_tokens": context[:2], "decoder_input_tokens": targets[:2],
           "decoder_target_tokens": targets[:2]}

  def loss_with_scores(score_fn):
    def fn(p):
      encoded = module.apply({"params": p}, batch["encoder_input_tokens"], enable_dropout=False,
                             method=Dodo.compress)
      encoded = encoded._replace(scores=score_fn(encoded.scores))
      logits = module.apply({"params": p}, encoded, batch["encoder_input_tokens"],
                            batch["decoder_input_tokens"], enable_dropout=False,
                            method=Dodo.decode_nuggets)
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets[:2]).mean()
    return fn

  with_ste = loss_with_scores(lambda s: s)
  without = loss_with_scores(jax.lax.stop_gradient)
  # stop_gradient is the identity going forward: the same operations on the same values
  assert float(with_ste(params)) == float(without(params))
  grad = jax.grad(with_ste)(params)["scorer"]
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree_util.tree_leaves(grad))
  assert all(float(jnp.abs(g).max()) == 0
             for g in jax.tree_util.tree_leaves(jax.grad(without)(params)["scorer"]))
  # the scorer learns from the LM loss alone: the model's own loss has the same gradient
  model_grad = jax.grad(lambda p: model.loss_fn(p, batch, None)[0])(params)["scorer"]
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree_util.tree_leaves(model_grad))


def test_straight_through_gradient_is_the_summed_logit_gradient(monkeypatch):
  """d loss / d s_i equals the derivative of the loss w.r.t. a real offset added to every
  attention logit toward nugget i (all layers, heads, queries), taken by finite differences."""
  cfg, module, params = _dodo(0)
  context, targets = _batch()
  encoded = module.apply({"params": params}, context, enable_dropout=False,
                         method=Dodo.compress)
  zeros = jnp.zeros_like(encoded.scores)

  def loss(scores):
    logits = module.apply({"params": params}, encoded._replace(scores=scores), context,
                          targets, enable_dropout=False, method=Dodo.decode_nuggets)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets).sum()

  estimator = np.asarray(jax.grad(loss)(zeros))
  valid = np.asarray(encoded.valid)
  assert np.all(estimator[~valid] == 0)
  # now make the score a real logit offset and differentiate numerically
  monkeypatch.setattr(nug, "straight_through", lambda s: s)
  eps = 1e-2
  for row, slot in [(0, 0), (0, 2), (1, 1)]:
    plus = float(loss(zeros.at[row, slot].set(eps)))
    minus = float(loss(zeros.at[row, slot].set(-eps)))
    assert estimator[row, slot] == pytest.approx((plus - minus) / (2 * eps), rel=2e-2,
                                                 abs=1e-3)


# ------------------------------------------------------------------------ decoding
@pytest.mark.parametrize("selection", ["nuggets", "compressive"])
def test_cached_decoding_from_nuggets_equals_recomputing(selection):
  cfg, module, params = _dodo(4, selection=selection)
  context, targets = _batch()
  vocab = seqio.PassThroughVocabulary(VOCAB, eos_id=1)
  model = models.EncoderDecoderModel(module, vocab, vocab, decode_fn=decoding.temperature_sample)
  batch = {"encoder_input_tokens": context, "decoder_input_tokens": targets,
           "decoder_target_tokens": targets}
  cached = model.predict_batch(params, batch, topk=1)
  recomputed = model.predict_batch_uncached(params, batch)
  np.testing.assert_array_equal(cached, recomputed)
  assert len(set(map(tuple, np.asarray(cached).tolist()))) > 1  # not degenerate
  # beam search expands encode's one array per beam (as T5X does) and runs to the end;
  # each best beam's score is the full pass's log probability of its tokens, length-normalised
  beam_model = models.EncoderDecoderModel(module, vocab, vocab)
  beams, aux = beam_model.predict_batch_with_aux(params, batch, num_decodes=2)
  assert beams.shape == targets.shape
  beams = np.asarray(beams)
  length = (beams > 0).sum(-1)
  scored = dict(batch, decoder_target_tokens=beams,
                decoder_input_tokens=np.pad(beams, ((0, 0), (1, 0)))[:, :-1],
                decoder_loss_weights=(beams > 0).astype(np.float32))
  want = np.asarray(beam_model.score_batch(params, scored)) / ((5 + length) / 6) ** 0.6
  # Cached steps against one full pass: float32 sums in two orders, over a handful of log
  # probabilities (|each| < 10); 1e-4 is several hundred eps of that.
  np.testing.assert_allclose(np.asarray(aux["scores"]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("selection", ["nuggets", "compressive"])
def test_encode_is_the_nuggets_keys_and_values_and_decode_rebuilds_their_slots(selection):
  """T5X's form: `encode` is one array; `decode` finds each row's nuggets from its length."""
  cfg, module, params = _dodo(4, selection=selection)
  context, targets = _batch()  # rows of 11, 7 and 0 real tokens; r = 3
  nuggets = module.apply({"params": params}, context, enable_dropout=False, method=Dodo.compress)
  encoded = module.apply({"params": params}, context, enable_dropout=False, method=Dodo.encode)
  np.testing.assert_array_equal(encoded[:, 0], nuggets.keys)
  np.testing.assert_array_equal(encoded[:, 1], nuggets.values)
  filled = np.asarray(nug.filled_slots(context, cfg.compression_ratio, encoded.shape[3]))
  np.testing.assert_array_equal(filled, [[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]])  # ceil(n/3)
  np.testing.assert_array_equal(filled, nuggets.valid)
  from_encode = module.apply({"params": params}, encoded, context, targets,
                             enable_dropout=False, method=Dodo.decode)
  teacher_forced = module.apply({"params": params}, context, targets, targets,
                                enable_dropout=False)  # scores in the graph: zero in value
  np.testing.assert_allclose(from_encode, teacher_forced, rtol=1e-6, atol=1e-6)


def test_context_and_targets_beyond_max_length_are_refused():
  cfg, module, params = _dodo(0)
  context = np.ones((1, 60), np.int32)
  targets = np.ones((1, 8), np.int32)
  with pytest.raises(ValueError, match="max_length"):
    module.apply({"params": params}, context, targets, targets, enable_dropout=False)


def test_packed_inputs_are_refused():
  cfg, module, params = _dodo(0)
  context, targets = _batch()
  with pytest.raises(ValueError, match="packed"):
    module.apply({"params": params}, context, targets, targets,
                 encoder_segment_ids=np.ones_like(context), enable_dropout=False)


# ------------------------------------------------------------------ frozen base
def test_partially_frozen_updates_only_adapters_scorer_and_prompt():
  cfg, module, params = _dodo(4)
  context, targets = _batch()
  vocab = seqio.PassThroughVocabulary(VOCAB, eos_id=1)
  model = models.EncoderDecoderModel(module, vocab, vocab)
  batch = {"encoder_input_tokens": context[:2], "decoder_input_tokens": targets[:2],
           "decoder_target_tokens": targets[:2]}
  opt = optimizers.partially_frozen(optax.sgd(0.1))
  grads = jax.grad(lambda p: model.loss_fn(p, batch, None)[0])(params)
  updates, _ = opt.update(grads, opt.init(params), params)
  new = optax.apply_updates(params, updates)
  for path, old in jax.tree_util.tree_leaves_with_path(params):
    name = jax.tree_util.keystr(path)
    changed = not np.array_equal(np.asarray(old), np.asarray(_get(new, path)))
    trainable = any(f in name for f in ("lora_", "scorer", "soft_prompt"))
    if not trainable:
      assert not changed, name
  assert any(not np.array_equal(a, b) for a, b in zip(
      jax.tree_util.tree_leaves(params["scorer"]), jax.tree_util.tree_leaves(new["scorer"])))


def _get(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree




# ------------------------------------------------- QA: the question on the decoder side
def _questions(seed=3):
  rng = np.random.default_rng(seed)
  query = rng.integers(2, VOCAB, (3, 5)).astype(np.int32)
  query[0, 3:] = 0  # questions of 3, 5 and 1 tokens, right-padded
  query[2, 1:] = 0
  return query


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_question_is_read_uncompressed_after_the_nuggets(lora_rank):
  """dodo.md §6 / D.2: only the document is compressed; the decoder reads [nuggets;
  question; answer]. numpy reference: the same Dodo decoding the question and answer
  as one target sequence after the document's nuggets."""
  cfg, module, params = _dodo(lora_rank, soft_prompt=False)
  context, targets = _batch()
  query = _questions()
  logits = module.apply({"params": params}, context, targets, targets, query_tokens=query,
                        enable_dropout=False)
  for row in range(len(context)):
    real = context[row][context[row] > 0]
    question = query[row][query[row] > 0]
    expect = numpy_llama.dodo_logits(cfg, _f64(params), real,
                                     np.concatenate([question, targets[row]]))
    np.testing.assert_allclose(logits[row], expect[len(question):], atol=2e-4, rtol=2e-4)
  # the question never reaches the compressor: the document's nuggets are the same for any
  memory, _ = module.apply({"params": params}, context, query, method=Dodo.compress_query)
  other, _ = module.apply({"params": params}, context, _questions(4),
                          method=Dodo.compress_query)
  nuggets = module.apply({"params": params}, context, enable_dropout=False,
                         method=Dodo.compress)
  k = nuggets.keys.shape[2]
  np.testing.assert_array_equal(memory.keys[:, :, :k], nuggets.keys)
  np.testing.assert_array_equal(other.keys[:, :, :k], nuggets.keys)


def test_qa_model_cached_answers_equal_recomputing():
  cfg, module, params = _dodo(4)
  context, targets = _batch()
  vocab = seqio.PassThroughVocabulary(VOCAB, eos_id=1)
  model = models.DodoQAModel(module, vocab, vocab, decode_fn=decoding.temperature_sample)
  batch = {"encoder_input_tokens": context, "query_tokens": _questions(),
           "decoder_input_tokens": targets, "decoder_target_tokens": targets}
  cached = np.asarray(model.predict_batch(params, batch, topk=1))
  np.testing.assert_array_equal(cached, model.predict_batch_uncached(params, batch))
  assert len(set(map(tuple, cached.tolist()))) > 1  # not degenerate
  without = np.asarray(model.predict_batch(params, dict(batch, query_tokens=_questions(8)),
                                           topk=1))
  assert (without != cached).any()  # the question matters to the answer
