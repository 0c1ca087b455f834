"""Dodo as an autoregressive LM (networks/dodo_lm.py) and the decoder-only model wrapper:
the parallel pass against a numpy re-derivation of its attention pattern, the compressed
cache against the parallel pass, threshold calibration on held-out text, generation."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio

from decal_jax import models
from decal_jax.networks.decoder import Decoder, DecoderConfig
from decal_jax.networks.dodo_lm import (DodoLM, DodoLMConfig, calibrate_threshold,
                                        nugget_fraction)

import numpy_llama

VOCAB = 61
TINY = DecoderConfig(vocab_size=VOCAB, emb_dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
                     mlp_dim=48, num_layers=3, max_length=64)


def _perturbed(params, scale=0.2):
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
  return jax.tree_util.tree_unflatten(
      tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _model(lora_rank=0, selection="nuggets", threshold=None, **kw):
  cfg = DodoLMConfig(decoder=dataclasses.replace(TINY, lora_rank=lora_rank),
                     compression_ratio=kw.pop("ratio", 3), window=kw.pop("window", 6),
                     chunk=kw.pop("chunk", 1), scorer_layer=2, selection=selection,
                     threshold=threshold, **kw)
  module = DodoLM(cfg)
  tokens = np.ones((2, 20), np.int32)
  params = _perturbed(module.init(jax.random.PRNGKey(1), tokens, enable_dropout=False)["params"])
  return cfg, module, params


def _tokens(seed=0, n=20):
  return np.random.default_rng(seed).integers(2, VOCAB, (2, n)).astype(np.int32)


def _calibrated_threshold(module, params, tokens):
  """calibrate_threshold's Λ on these tokens, which it puts halfway between two scores: no
  score may sit near Λ, or a cached step or the numpy reference, computing that score with
  other rounding, could put it on the other side."""
  threshold = calibrate_threshold(module, params, [tokens])
  scores = np.asarray(module.apply({"params": params}, tokens, method=DodoLM.scores))
  scores = scores[tokens > 0]  # [real tokens]
  assert np.min(np.abs(scores - threshold)) > 5e-5  # far wider than float32 rounding
  return threshold


def _reference_split(cfg, n):
  """The paper's split t - τ (dodo.md Eq. 9): token t reads its last τ tokens (itself
  included) in full; with chunks, the split of a chunk's first token is shared."""
  return [max(0, (t // cfg.chunk) * cfg.chunk + 1 - cfg.window) for t in range(n)]


def _reference_mask(cfg, n, nugget):
  """numpy: [p(t), t] and the first `sink` tokens in full, plus the nuggets in
  [p(t) - H, p(t)) (H = None: all)."""
  split = _reference_split(cfg, n)
  start = [0 if cfg.history is None else max(0, p - cfg.history) for p in split]
  window = np.array([[(split[t] <= i or i < cfg.sink) and i <= t for i in range(n)]
                     for t in range(n)])
  distant = np.array([[bool(nugget[i]) and start[t] <= i < split[t] for i in range(n)]
                      for t in range(n)])
  return window, window | distant


def _reference_logits(cfg, params, tokens, threshold):
  """numpy: scores from base features over each token's window; token t attends to
  [p(t), t] and to earlier nuggets (score > Λ) before p(t)."""
  stack = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params["stack"])
  model = numpy_llama.Llama(cfg.decoder, stack)
  n = len(tokens)
  window, _ = _reference_mask(cfg, n, np.zeros(n, bool))
  x = stack["token_embedder"]["embedding"][tokens]
  positions = np.arange(n)
  nugget = np.zeros(n, bool)
  if np.isfinite(threshold):  # (the window-only model has no scorer)
    h = x
    for layer in range(cfg.scorer_layer):
      h = model.block(layer, h, positions, window, None)
    scores = numpy_llama.scorer(jax.tree_util.tree_map(np.asarray, params["scorer"]), h)
    nugget = (scores > threshold) & (positions >= cfg.sink)  # sink tokens are read in full
  _, allowed = _reference_mask(cfg, n, nugget)
  for layer in range(cfg.decoder.num_layers):
    x = model.block(layer, x, positions, allowed, None)
  return model.logits(x), nugget


@pytest.mark.parametrize("kw", [{}, {"chunk": 3}, {"history": 5}, {"sink": 2}])
def test_parallel_pass_matches_numpy_mixed_resolution_attention(kw):
  cfg, module, params = _model(**kw)
  tokens = _tokens()
  threshold = _calibrated_threshold(module, params, tokens)
  module = DodoLM(dataclasses.replace(cfg, threshold=threshold))
  logits = module.apply({"params": params}, tokens, enable_dropout=False)
  for row in range(2):
    expect, nugget = _reference_logits(cfg, params, tokens[row], threshold)
    assert 0 < nugget.sum() < len(nugget)  # some history is compressed, not all of it
    np.testing.assert_allclose(logits[row], expect, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("lora_rank,selection,kw", [
    (0, "nuggets", {}), (4, "nuggets", {}), (4, "compressive", {}), (0, "window", {}),
    (0, "nuggets", {"chunk": 3, "history": 6}), (0, "compressive", {"history": 7}),
    (4, "nuggets", {"sink": 2}), (0, "compressive", {"sink": 1}), (0, "window", {"sink": 3})])
def test_compressed_cache_decodes_like_the_parallel_pass(lora_rank, selection, kw):
  cfg, module, params = _model(lora_rank, selection, **kw)
  tokens = _tokens(1)
  if selection == "nuggets":
    cfg = dataclasses.replace(cfg, threshold=_calibrated_threshold(module, params, tokens))
  module = DodoLM(cfg)
  full = module.apply({"params": params}, tokens, enable_dropout=False)
  _, cache = module.apply({"params": params}, jnp.ones_like(tokens), decode=True,
                          enable_dropout=False, mutable=["cache"])
  for i in range(tokens.shape[1]):
    step, cache = module.apply({"params": params, **cache}, tokens[:, i:i + 1], decode=True,
                               enable_dropout=False, mutable=["cache"])
    # Float32 in two orders: the steps read the nuggets through a second (adapter) pass and
    # running sums where the parallel pass uses one pass and segment means. Measured on an
    # AVX-512 EPYC: up to 8.6e-5 (LoRA + compressive) on logits up to 3.8, 6x inside this.
    np.testing.assert_allclose(step[:, 0], full[:, i], atol=5e-4, rtol=5e-4)
  cached = jax.tree_util.tree_leaves_with_path(cache)
  # the cache holds a τ-slot ring and the nugget / segment slots, never all 20 positions
  for path, leaf in cached:
    if "rings" in jax.tree_util.keystr(path) and leaf.ndim == 4:
      assert leaf.shape[1] == cfg.window + cfg.chunk - 1


def test_compressed_cache_greedy_generation_equals_recomputing():
  cfg, module, params = _model(4)
  prompt = _tokens(2, n=9)
  cfg = dataclasses.replace(cfg, threshold=calibrate_threshold(module, params, [prompt]))
  module = DodoLM(cfg)
  model = models.DecoderOnlyModel(module, seqio.PassThroughVocabulary(VOCAB, eos_id=1))
  generated = np.asarray(model.generate(params, prompt, max_new_tokens=8, topk=1))
  # recompute: run the parallel pass over prompt + generated so far, take the argmax
  seq = np.pad(prompt, ((0, 0), (1, 0)))  # BOS first
  for i in range(8):
    logits = module.apply({"params": params}, seq, enable_dropout=False)
    nxt = np.asarray(jnp.argmax(logits[:, -1], axis=-1))
    np.testing.assert_array_equal(generated[:, i], np.where(
        (generated[:, :i] == 1).any(axis=1), 0, nxt))
    seq = np.concatenate([seq, nxt[:, None]], axis=1)


def test_generation_with_an_empty_prompt_starts_from_bos():
  module = Decoder(TINY)
  params = _perturbed(module.init(jax.random.PRNGKey(0), np.ones((2, 4), np.int32),
                                  enable_dropout=False)["params"])
  model = models.DecoderOnlyModel(module, seqio.PassThroughVocabulary(VOCAB, eos_id=1))
  out = np.asarray(model.generate(params, np.zeros((2, 0), np.int32), max_new_tokens=5))
  seq = np.zeros((2, 1), np.int32)  # BOS
  for i in range(5):
    nxt = np.asarray(jnp.argmax(module.apply({"params": params}, seq,
                                             enable_dropout=False)[:, -1], -1))
    live = ~(out[:, :i] == 1).any(axis=1)
    np.testing.assert_array_equal(out[live, i], nxt[live])
    seq = np.concatenate([seq, nxt[:, None]], 1)
  with pytest.raises(ValueError, match="positions"):
    model.generate(params, np.ones((1, 60), np.int32), max_new_tokens=10)


def test_prefilled_generation_equals_rerunning_the_whole_decoder():
  """`generate(prefill=True)` writes the prompt into the KV cache in one causal pass; its
  greedy tokens equal the uncached reference (the whole decoder rerun at every step) and
  token-by-token prefeeding."""
  module = Decoder(TINY)
  params = _perturbed(module.init(jax.random.PRNGKey(1), np.ones((2, 4), np.int32),
                                  enable_dropout=False)["params"])
  model = models.DecoderOnlyModel(module, seqio.PassThroughVocabulary(VOCAB, eos_id=1))
  prompt = _tokens(seed=5, n=11)
  prefilled = np.asarray(model.generate(params, prompt, max_new_tokens=9, prefill=True,
                                        topk=1))
  np.testing.assert_array_equal(prefilled, model.generate_uncached(params, prompt, 9))
  np.testing.assert_array_equal(prefilled, model.generate(params, prompt, max_new_tokens=9,
                                                          topk=1))
  assert len(set(prefilled.ravel().tolist())) > 2  # not one repeated token


def test_threshold_calibration_hits_the_ratio_on_held_out_text():
  """Λ from the built-in corpus's training paragraphs keeps 1 / r (±10 %) of the tokens of
  its 104 held-out validation paragraphs."""
  from decal_jax.data import corpus, vocabularies
  vocab = vocabularies.builtin_vocabulary()
  docs = corpus.documents()
  cfg = DodoLMConfig(decoder=dataclasses.replace(TINY, vocab_size=vocab.vocab_size + 124,
                                                 max_length=256),
                     compression_ratio=5, window=16, scorer_layer=2)
  module = DodoLM(cfg)

  def batch(texts):
    rows = [vocab.encode(t)[:128] for t in texts]
    out = np.zeros((len(rows), 128), np.int32)
    for i, r in enumerate(rows):
      out[i, :len(r)] = r
    return out

  sample, held_out = batch(docs["train"][:1136]), batch(docs["validation"])
  params = module.init(jax.random.PRNGKey(0), sample[:1], enable_dropout=False)["params"]
  threshold = calibrate_threshold(module, params, np.split(sample, 4))
  achieved = nugget_fraction(module, params, held_out, threshold)
  assert abs(achieved - 1 / 5) <= 0.1 * (1 / 5), achieved


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="window"):
    DodoLMConfig(decoder=TINY, window=64)  # τ as large as the whole context
  with pytest.raises(ValueError, match="chunk"):
    DodoLMConfig(decoder=TINY, window=4, chunk=0)
  with pytest.raises(ValueError, match="history"):
    DodoLMConfig(decoder=TINY, window=4, history=-1)
  with pytest.raises(ValueError, match="sink"):
    DodoLMConfig(decoder=TINY, window=4, sink=-1)
  with pytest.raises(ValueError, match="ratio r must be >= 1"):
    DodoLMConfig(decoder=TINY, compression_ratio=0.5)
  cfg, module, params = _model()
  _, cache = module.apply({"params": params}, np.ones((2, 8), np.int32), decode=True,
                          enable_dropout=False, mutable=["cache"])
  with pytest.raises(ValueError, match="threshold"):
    module.apply({"params": params, **cache}, np.ones((2, 1), np.int32), decode=True,
                 enable_dropout=False, mutable=["cache"])
  with pytest.raises(ValueError, match="max_length"):
    module.apply({"params": params}, np.ones((1, 80), np.int32), enable_dropout=False)


def test_window_only_baseline_matches_numpy_with_no_nuggets():
  cfg, module, params = _model(selection="window")
  tokens = _tokens(3)
  logits = module.apply({"params": params}, tokens, enable_dropout=False)
  for row in range(2):
    expect, _ = _reference_logits(cfg, params, tokens[row], threshold=np.inf)
    np.testing.assert_allclose(logits[row], expect, atol=2e-4, rtol=2e-4)


def test_every_token_reads_its_last_tau_tokens_in_full():
  """Eq. 9's window for every position, not only a chunk's last token: row t of the mask
  holds exactly the min(t + 1, τ) positions t - τ + 1 .. t, plus nuggets before them."""
  cfg, module, params = _model(window=6)
  tokens = _tokens(4)
  attended = np.asarray(module.apply({"params": params}, tokens, method=DodoLM.attended))
  nugget = np.asarray(module.apply({"params": params}, tokens, method=DodoLM.nuggets))
  for row in range(2):
    for t in range(tokens.shape[1]):
      recent = np.flatnonzero(attended[row, t, max(0, t - 5):])  # the last τ positions
      assert len(recent) == min(t + 1, 6), (t, recent)
      older = np.flatnonzero(attended[row, t, :max(0, t - 5)])
      assert set(older) == set(np.flatnonzero(nugget[row, :max(0, t - 5)]))
    _, expect = _reference_mask(cfg, tokens.shape[1], nugget[row])
    np.testing.assert_array_equal(attended[row], expect)
  assert not attended[:, np.triu_indices(tokens.shape[1], 1)[0],
                      np.triu_indices(tokens.shape[1], 1)[1]].any()  # never the future


def _prefix_rank_reference(scores, ratio):
  """numpy: i is kept when fewer than ceil((i + 1) / r) of s_0 .. s_i rank above s_i."""
  keep = np.zeros(len(scores), bool)
  for i, s in enumerate(scores):
    above = sum(1 for j in range(i + 1) if scores[j] > s or (scores[j] == s and j < i))
    keep[i] = above < np.ceil((i + 1) / ratio)
  return keep


def test_training_selection_never_looks_ahead_nor_at_other_rows():
  """With no Λ yet (training from scratch) a token's nugget choice, and its logits, are
  the same whatever follows it and whatever the other rows hold."""
  cfg, module, params = _model()
  tokens = _tokens(5)
  nuggets = np.asarray(module.apply({"params": params}, tokens, method=DodoLM.nuggets))
  scores = np.asarray(module.apply({"params": params}, tokens, method=DodoLM.scores))
  for row in range(2):
    np.testing.assert_array_equal(nuggets[row], _prefix_rank_reference(scores[row], 3))
  assert 0 < nuggets.sum() < nuggets.size
  logits = np.asarray(module.apply({"params": params}, tokens, enable_dropout=False))
  rng = np.random.default_rng(9)
  for i in (3, 9, 14):
    changed = tokens.copy()
    changed[:, i + 1:] = rng.integers(2, VOCAB, changed[:, i + 1:].shape)
    changed[1] = rng.integers(2, VOCAB, tokens.shape[1])  # row 1: another text entirely
    after = np.asarray(module.apply({"params": params}, changed, method=DodoLM.nuggets))
    np.testing.assert_array_equal(after[0, :i + 1], nuggets[0, :i + 1])
    new_logits = np.asarray(module.apply({"params": params}, changed, enable_dropout=False))
    np.testing.assert_allclose(new_logits[0, :i + 1], logits[0, :i + 1], atol=1e-5)
  alone = np.asarray(module.apply({"params": params}, tokens[:1], method=DodoLM.nuggets))
  np.testing.assert_array_equal(alone[0], nuggets[0])  # the batch around it plays no part


def test_fixed_history_bounds_the_attended_states():
  """Table 1's setting: with H = 12 history tokens and τ = 4, a token attends to at most
  τ + (nuggets among the H tokens before its window); when every token is a nugget that is
  exactly min(t + 1, τ + H) states, so positions far apart see equal totals."""
  cfg, module, params = _model(window=4, history=12, threshold=-1e9)  # every token a nugget
  tokens = _tokens(6, n=40)
  attended = np.asarray(module.apply({"params": params}, tokens, method=DodoLM.attended))
  counts = attended.sum(axis=-1)  # [b, n]
  np.testing.assert_array_equal(counts, np.minimum(np.arange(40) + 1, 16)[None].repeat(2, 0))
  cfg, module, params = _model(window=4, history=12)  # the learned selection
  nugget = np.asarray(module.apply({"params": params}, tokens, method=DodoLM.nuggets))
  attended = np.asarray(module.apply({"params": params}, tokens, method=DodoLM.attended))
  for row in range(2):
    _, expect = _reference_mask(cfg, 40, nugget[row])
    np.testing.assert_array_equal(attended[row], expect)
    for t in range(40):
      split = max(0, t - 3)
      assert attended[row, t].sum() == min(t + 1, 4) + nugget[row, max(0, split - 12):split].sum()


def test_the_lm_scorer_and_stack_start_from_a_trained_compressor():
  """dodo.md footnote 2: the LM's scorer starts from the compressor's. Both networks name
  their parameters alike, so a compressor MODEL_DIR as initial_checkpoint_path restores
  every LM parameter (the trainer restores by name and shape)."""
  from decal_jax.networks.dodo import Dodo, DodoConfig
  cfg, module, params = _model(lora_rank=4)
  compressor = Dodo(DodoConfig(decoder=cfg.decoder, compression_ratio=3, scorer_layer=2))
  ones = np.ones((1, 8), np.int32)
  compressor_params = compressor.init(jax.random.PRNGKey(0), ones, ones, ones,
                                      enable_dropout=False)["params"]
  have = {jax.tree_util.keystr(p): x.shape
          for p, x in jax.tree_util.tree_leaves_with_path(compressor_params)}
  need = {jax.tree_util.keystr(p): x.shape
          for p, x in jax.tree_util.tree_leaves_with_path(params)}
  assert any("scorer" in k for k in need)
  assert {k: have.get(k) for k in need} == need
