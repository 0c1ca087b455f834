"""GPTHF (networks/gpthf.py) against its definition, position by position, in plain numpy;
the block mask against a hand-built one; sentence isolation; cached generation = uncached."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax import models
from decal_jax.networks import gpthf
from decal_jax.networks.decoder import DecoderConfig
from tests.numpy_llama import Llama

END = 60  # the end-of-sentence id of these tests
DECODER = DecoderConfig(vocab_size=64, emb_dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
                        mlp_dim=64, num_layers=3, max_length=48)
CONFIG = gpthf.GpthfConfig(decoder=DECODER, encoder_layers=2, sentence_end_id=END,
                           max_sentence_length=6)


class _Vocab:
  eos_id = 1


@functools.lru_cache(maxsize=None)
def _model(config=CONFIG):
  return models.DecoderOnlyModel(gpthf.Gpthf(config), _Vocab())


@functools.lru_cache(maxsize=None)
def _params(config=CONFIG):
  model = _model(config)
  params = jax.jit(lambda rng: model.get_initial_variables(
      rng, {"decoder_input_tokens": (1, 8)}))(jax.random.PRNGKey(0))["params"]
  noise = np.random.default_rng(1)  # move zero-init / unit leaves so every one matters
  return jax.tree_util.tree_map(
      lambda p: jnp.asarray(p + 0.05 * noise.standard_normal(p.shape), p.dtype), params)


# ------------------------------------------------------------------------------ reference
def numpy_layout(tokens, end, max_len):
  place, sentence, closes, p, s = [], [], [], 0, 0
  for token in tokens:
    place.append(p)
    sentence.append(s)
    close = token == end or p == max_len - 1
    closes.append(close)
    p, s = (0, s + 1) if close else (p + 1, s)
  return np.array(place), np.array(sentence), np.array(closes)


def numpy_gpthf(config, params, tokens):
  """One row -> logits `[n, vocab]` by the definition: each sentence alone through the
  encoder blocks; token t of sentence j -> body over [e_0 .. e_{j-1}, h_t]."""
  params = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  model = Llama(config.decoder, params["stack"])
  enc = config.encoder_layers
  emb = params["stack"]["token_embedder"]["embedding"][np.asarray(tokens)]
  place, sentence, closes = numpy_layout(list(tokens), config.sentence_end_id,
                                         config.max_sentence_length)
  h = np.zeros_like(emb)
  for j in range(sentence.max() + 1):
    members = np.flatnonzero(sentence == j)
    x = emb[members]
    allowed = np.tril(np.ones((len(x), len(x)), bool))
    for layer in range(enc):
      x = model.block(layer, x, np.arange(len(x)), allowed, None)
    h[members] = x
  embeddings = {sentence[t]: h[t] for t in range(len(tokens)) if closes[t]}
  out = []
  for t in range(len(tokens)):
    rows = np.stack([embeddings[k] for k in range(sentence[t])] + [h[t]])
    allowed = np.tril(np.ones((len(rows), len(rows)), bool))
    for layer in range(enc, config.decoder.num_layers):
      rows = model.block(layer, rows, np.arange(len(rows)), allowed, None)
    out.append(model.logits(rows[-1:])[0])
  return np.stack(out)


# ------------------------------------------------------------------------------ masks
def test_block_mask_matches_the_hand_built_one():
  tokens = jnp.array([[5, 6, END, 7, END, 8, 9, 10, END]])
  layout = gpthf.sentence_layout(tokens, END, 64)
  np.testing.assert_array_equal(layout.sentence[0], [0, 0, 0, 1, 1, 2, 2, 2, 2])
  np.testing.assert_array_equal(layout.place[0], [0, 1, 2, 0, 1, 0, 1, 2, 3])
  ids = [0, 0, 0, 1, 1, 2, 2, 2, 2]
  want = np.zeros((9, 9), bool)  # key i visible to query t: same sentence, i <= t
  for t in range(9):
    for i in range(t + 1):
      want[t, i] = ids[t] == ids[i]
  np.testing.assert_array_equal(gpthf.encoder_mask(layout)[0, 0], want)
  body = np.eye(9, dtype=bool)  # itself + every earlier sentence-closing row (2 and 4)
  for t in range(9):
    for i in (2, 4):
      body[t, i] |= i < t
  np.testing.assert_array_equal(gpthf.body_mask(layout)[0, 0], body)


def test_long_sentences_close_at_the_length_bound():
  tokens = jnp.array([[5, 6, 7, 8, 9, 10, 11, END, 12]])
  layout = gpthf.sentence_layout(tokens, END, 3)
  np.testing.assert_array_equal(layout.sentence[0], [0, 0, 0, 1, 1, 1, 2, 2, 3])
  np.testing.assert_array_equal(layout.closes[0], [0, 0, 1, 0, 0, 1, 0, 1, 0])


def test_layout_matches_a_left_to_right_loop_on_random_text():
  rng = np.random.default_rng(0)
  tokens = rng.choice([5, 6, 7, END], size=(4, 40), p=[0.3, 0.3, 0.3, 0.1])
  layout = gpthf.sentence_layout(jnp.asarray(tokens), END, 5)
  for row, got in zip(tokens, zip(*layout)):
    for want, value in zip(numpy_layout(list(row), END, 5), got):
      np.testing.assert_array_equal(value, want)


# ------------------------------------------------------------------------------ network
def test_parallel_pass_equals_the_position_by_position_definition():
  params = _params()
  tokens = np.array([[0, 5, 6, END, 7, 8, 9, 10, 11, 12, 13, END, 14, 15],  # 2nd: bound at 6
                     [0, 21, END, 22, 23, END, 24, END, 25, 26, 27, 28, 29, 30]], np.int32)
  logits = jax.jit(lambda p, t: _model().module.apply({"params": p}, t,
                                                       enable_dropout=False))(params, tokens)
  for b in range(2):
    want = numpy_gpthf(CONFIG, params, tokens[b])
    np.testing.assert_allclose(logits[b], want, atol=2e-4, rtol=2e-4)


def test_sentences_are_isolated():
  """A sentence's word-level states ignore every other sentence, and a token's logits ignore
  everything after it."""
  module, params = _model().module, _params()
  base = np.array([[0, 5, 6, END, 7, 8, 9, END, 10, 11]], np.int32)
  earlier_changed = base.copy()
  earlier_changed[0, 1:3] = [30, 31]  # sentence 0, same length
  later_changed = base.copy()
  later_changed[0, 8:] = [40, 41]
  states = jax.jit(lambda t: module.apply({"params": params}, t, method=module.word_states)[0])
  np.testing.assert_array_equal(states(base)[0, 4:], states(earlier_changed)[0, 4:])
  logits = jax.jit(lambda t: module.apply({"params": params}, t, enable_dropout=False))
  np.testing.assert_array_equal(logits(base)[0, :8], logits(later_changed)[0, :8])
  assert not np.allclose(logits(base)[0, 4:], logits(earlier_changed)[0, 4:])  # body reads e_0


@pytest.mark.parametrize("prompt", [
    np.array([[5, 6, END, 7, 8]], np.int32),       # ends mid-sentence
    np.array([[5, END, 6, 7, END]], np.int32),     # ends on a sentence end
    np.zeros((1, 0), np.int32)], ids=["mid_sentence", "at_end", "empty"])
def test_cached_generation_equals_uncached(prompt):
  """Greedy tokens with the sentence caches equal rerunning the whole network every step;
  random weights rarely emit END, so the length bound (6) closes most sentences here."""
  model, params = _model(), _params()
  prompt = np.repeat(prompt, 2, axis=0)
  if prompt.shape[1]:
    prompt[1, 0] = 9  # the two rows differ
  cached = jax.jit(model.generate, static_argnums=2)(params, prompt, 20)
  uncached = jax.jit(model.generate_uncached, static_argnums=2)(params, prompt, 20)
  np.testing.assert_array_equal(cached, uncached)
  full = np.concatenate([prompt, np.asarray(cached)], axis=1)
  layout = gpthf.sentence_layout(jnp.asarray(full), END, CONFIG.max_sentence_length)
  assert int(layout.sentence[0, -1]) >= 3  # several sentences closed during generation


def test_same_parameters_as_the_equally_sized_gpt():
  from decal_jax.networks.decoder import Decoder
  tokens = jnp.ones((1, 8), jnp.int32)
  gpt = jax.eval_shape(lambda: Decoder(DECODER).init(jax.random.PRNGKey(0), tokens))
  ours = jax.eval_shape(lambda: gpthf.Gpthf(CONFIG).init(jax.random.PRNGKey(0), tokens))
  assert (jax.tree_util.tree_map(lambda s: s.shape, gpt["params"]) ==
          jax.tree_util.tree_map(lambda s: s.shape, ours["params"]))


def test_bad_configurations_are_refused():
  with pytest.raises(ValueError, match="at least one body layer"):
    gpthf.GpthfConfig(decoder=DECODER, encoder_layers=3, sentence_end_id=END)
  with pytest.raises(ValueError, match="not an id"):
    gpthf.GpthfConfig(decoder=DECODER, encoder_layers=1, sentence_end_id=64)
  with pytest.raises(ValueError, match="generate fewer"):
    _model().generate(_params(), np.zeros((1, 40), np.int32), 20)


def test_training_on_the_sentence_task_lowers_the_loss():
  """The built-in sentence-marked LM task feeds GPTHF (its end id = the task's), and the
  trainer's step lowers the loss on a repeated batch."""
  import decal_jax.tasks  # noqa: F401  (registers decal_builtin_sentence_lm)
  from decal_jax import partitioning
  from decal_jax.runtime import optimizers, train_state, trainer
  from decal_jax.data import pipeline
  from decal_jax.data import sentences, vocabularies
  vocab = vocabularies.builtin_vocabulary()
  decoder = DecoderConfig(vocab_size=4224, emb_dim=32, num_heads=2, num_kv_heads=1,
                          head_dim=16, mlp_dim=64, num_layers=3, max_length=64)
  config = gpthf.GpthfConfig(decoder=decoder, encoder_layers=2,
                             sentence_end_id=sentences.sentence_end_id(vocab))
  model = models.DecoderOnlyModel(gpthf.Gpthf(config), vocab)
  cfg = pipeline.DatasetConfig("decal_builtin_sentence_lm", {"targets": 64}, split="validation",
                               batch_size=4, shuffle=False)
  opt = optimizers.adamw(optimizers.cosine_schedule(3e-3, warmup_steps=0, decay_steps=100))
  part = partitioning.Partitioner()
  state, shardings = train_state.init_state(model, opt, part, cfg, seed=0)
  step = trainer.make_train_step(model, opt, part, shardings)
  batch = next(pipeline.train_batches(cfg, model, skip=0))
  ends = batch["decoder_target_tokens"] == config.sentence_end_id
  assert ends.sum() >= 4  # the batch really is split into sentences
  losses = []
  for _ in range(15):
    state, aux = step(state, pipeline.to_global(batch, part), jax.random.PRNGKey(0))
    losses.append(float(aux["loss"]))
  assert losses[-1] < losses[0] - 1.0, losses
