"""tools/bench_nuggets.py at a tiny size: cache bytes computed by hand from the shapes, and
the tokens each cached path decodes checked against an uncached greedy reference."""
import importlib
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio

from decal_jax import models
from tools import benchmarking
from decal_jax.networks.decoder import DecoderConfig

import paths

REPO = paths.REPO
bench = importlib.import_module("tools.bench_nuggets")

VOCAB_SIZE, EOS = 61, 1
CFG = DecoderConfig(vocab_size=VOCAB_SIZE, emb_dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
                    mlp_dim=64, num_layers=2, max_length=128)
BATCH, N, RATIO, NEW = 2, 64, 4, 6
PARAM_SCALE = 3.0  # larger random weights: peaked logits, so greedy decoding is not degenerate


@pytest.fixture(scope="module")
def setup():
  built = bench.build(CFG, RATIO, seed=0)
  scale = lambda tree: jax.tree.map(lambda x: x * PARAM_SCALE, tree)
  decoder_params = scale(built.decoder_params)
  dodo_params = bench.share_stack(decoder_params, scale(built.dodo_params))
  context = jnp.asarray(np.random.RandomState(1).randint(2, VOCAB_SIZE, (BATCH, N)), jnp.int32)
  start = time.perf_counter()
  paths = [bench.prepare_full_cache(built.decoder, decoder_params, context, NEW),
           bench.prepare_nugget_cache(built.dodo, dodo_params, context, NEW)]
  full, dodo = bench.decode_side_by_side(paths, NEW)  # as the benchmark runs them
  elapsed = time.perf_counter() - start
  return built, decoder_params, dodo_params, context, full, dodo, elapsed


def _hand_kv_bytes(positions):
  return 2 * CFG.num_layers * BATCH * positions * CFG.kv_heads * CFG.head_dim * 4  # float32


def _cut_after_eos(tokens):
  """Zeros after each row's first EOS, as predict_batch_uncached leaves them."""
  ended = np.cumsum(tokens == EOS, axis=1) - (tokens == EOS) > 0
  return np.where(ended, 0, tokens)


def test_cache_bytes_match_the_shapes(setup):
  *_, full, dodo, _ = setup
  assert full.cache_bytes == _hand_kv_bytes(N + NEW)
  assert dodo.cache_bytes == _hand_kv_bytes(math.ceil(N / RATIO) + NEW)


def test_stack_weights_are_shared(setup):
  _, decoder_params, dodo_params, *_ = setup
  shared = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), decoder_params["stack"],
                        dodo_params["stack"])
  assert all(jax.tree.leaves(shared))


def test_nugget_cache_decodes_what_recomputing_from_the_nuggets_gives(setup):
  built, _, dodo_params, context, _, dodo, _ = setup
  vocab = seqio.PassThroughVocabulary(VOCAB_SIZE, eos_id=EOS)
  model = models.EncoderDecoderModel(built.dodo, vocab, vocab)
  batch = {"encoder_input_tokens": context,
           "decoder_input_tokens": jnp.zeros((BATCH, NEW), jnp.int32)}
  reference = np.asarray(model.predict_batch_uncached(dodo_params, batch))
  assert dodo.tokens.shape == (BATCH, NEW)
  np.testing.assert_array_equal(_cut_after_eos(dodo.tokens), reference)
  assert len(set(dodo.tokens.ravel().tolist())) > 2  # not a degenerate repetition


def test_full_cache_decodes_what_the_uncached_forward_pass_gives(setup):
  built, decoder_params, _, context, full, *_ = setup
  forward = jax.jit(lambda tokens: built.decoder.apply({"params": decoder_params}, tokens,
                                                       enable_dropout=False))
  # One fixed-length buffer (one compilation): a causal LM's logits at t ignore later slots.
  tokens = np.zeros((BATCH, N + NEW + 1), np.int32)
  tokens[:, :N] = np.asarray(context)
  for t in range(N - 1, N + NEW):  # the prefill's token, then one per decode step
    logits = np.asarray(forward(jnp.asarray(tokens)))  # [batch, N + NEW + 1, vocab]
    tokens[:, t + 1] = logits[:, t].argmax(-1)
  np.testing.assert_array_equal(full.tokens, tokens[:, N:])
  assert len(set(full.tokens.ravel().tolist())) > 2


def test_every_decode_step_is_timed(setup):
  *_, full, dodo, elapsed = setup
  assert len(full.step_seconds) == len(dodo.step_seconds) == NEW
  # Every timed interval lies inside the fixture's calls, one after another.
  timed = [full.context_seconds, dodo.context_seconds, *full.step_seconds, *dodo.step_seconds]
  assert min(timed) > 0 and sum(timed) < elapsed


def test_markdown_has_the_command_and_a_row_per_context(setup):
  *_, full, dodo, _ = setup
  args = bench.parse_args(["--contexts", f"{N},40", "--ratio", str(RATIO), "--new_tokens",
                           str(NEW), "--warmup", "1"])
  rows = [bench.Row(N, math.ceil(N / RATIO), full, dodo),
          bench.Row(40, 10, note="did not fit: prefill of 40 tokens needs 9 GiB")]
  text = bench.markdown(args, rows)
  assert "- command: `python" in text and f"jax {jax.__version__}" in text
  ratio = f"{_hand_kv_bytes(N + NEW) / _hand_kv_bytes(math.ceil(N / RATIO) + NEW):.1f}"
  assert f"| {N} | {math.ceil(N / RATIO)} | " in text and f" | {ratio} | " in text
  assert "| 40 | 10 | did not fit: prefill of 40 tokens needs 9 GiB |" in text


def test_run_reports_a_context_that_does_not_fit_instead_of_running_it(setup, monkeypatch):
  def never_fits(compiled, what):
    raise bench.DoesNotFit(f"{what} needs too much")
  monkeypatch.setattr(bench, "check_fits", never_fits)
  monkeypatch.setattr(bench, "build", lambda cfg, ratio, seed: setup[0])  # reuse the models
  args = bench.parse_args(["--contexts", "16", "--vocab", str(VOCAB_SIZE), "--new_tokens",
                           "2", "--warmup", "1"])
  (row,) = bench.run(args)
  assert row.full is None and row.note == "did not fit: prefill of 16 tokens needs too much"


def test_check_fits_compares_the_compiled_need_with_free_memory(monkeypatch):
  compiled = jax.jit(lambda x: x * 2).lower(jnp.ones((256, 256))).compile()
  monkeypatch.setattr(benchmarking, "available_bytes", lambda: 1 << 40)
  benchmarking.check_fits(compiled, "toy")  # 512 KiB of 1 TiB: fits
  monkeypatch.setattr(benchmarking, "available_bytes", lambda: 1024)
  with pytest.raises(benchmarking.DoesNotFit, match="toy needs"):
    benchmarking.check_fits(compiled, "toy")


def test_bad_contexts_are_rejected():
  with pytest.raises(SystemExit):
    bench.parse_args(["--contexts", "1k"])
