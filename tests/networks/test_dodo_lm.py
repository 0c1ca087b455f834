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
                     chunk=kw.pop("chunk", 3), scorer_layer=2, selection=selection,
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


def _reference_logits(cfg, params, tokens, threshold):
  """numpy: scores from base features over each token's window; token t attends to
  [p(t), t] and to earlier nuggets (score > Λ) before p(t)."""
  stack = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params["stack"])
  model = numpy_llama.Llama(cfg.decoder, stack)
  n = len(tokens)
  split = [max(0, (t // cfg.chunk) * cfg.chunk + cfg.chunk - cfg.window) for t in range(n)]
  window = np.array([[split[t] <= i <= t for i in range(n)] for t in range(n)])
  x = stack["token_embedder"]["embedding"][tokens]
  positions = np.arange(n)
  nugget = np.zeros(n, bool)
  if np.isfinite(threshold):  # (the window-only model has no scorer)
    h = x
    for layer in range(cfg.scorer_layer):
      h = model.block(layer, h, positions, window, None)
    scores = numpy_llama.scorer(jax.tree_util.tree_map(np.asarray, params["scorer"]), h)
    nugget = scores > threshold
  allowed = window | np.array([[nugget[i] and i < split[t] for i in range(n)]
                               for t in range(n)])
  for layer in range(cfg.decoder.num_layers):
    x = model.block(layer, x, positions, allowed, None)
  return model.logits(x), nugget


def test_parallel_pass_matches_numpy_mixed_resolution_attention():
  cfg, module, params = _model()
  tokens = _tokens()
  threshold = _calibrated_threshold(module, params, tokens)
  module = DodoLM(dataclasses.replace(cfg, threshold=threshold))
  logits = module.apply({"params": params}, tokens, enable_dropout=False)
  for row in range(2):
    expect, nugget = _reference_logits(cfg, params, tokens[row], threshold)
    assert 0 < nugget.sum() < len(nugget)  # some history is compressed, not all of it
    np.testing.assert_allclose(logits[row], expect, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("lora_rank,selection", [(0, "nuggets"), (4, "nuggets"),
                                                 (4, "compressive"), (0, "window")])
def test_compressed_cache_decodes_like_the_parallel_pass(lora_rank, selection):
  cfg, module, params = _model(lora_rank, selection)
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
      assert leaf.shape[1] == cfg.window


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
                     compression_ratio=5, window=16, chunk=8, scorer_layer=2)
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
    DodoLMConfig(decoder=TINY, window=4, chunk=8)
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
