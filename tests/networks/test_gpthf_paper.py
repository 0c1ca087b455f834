"""The paper's GPTHF inference (`gpthf.paper_generate`: no keys / values kept) against the
plain-numpy definition and the other two paths; the uncached GPT baseline's growing buffer
(`DecoderOnlyModel.generate_uncached(bucket=...)`) against the cached GPT."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax import models
from decal_jax.networks import gpthf
from decal_jax.networks.decoder import Decoder
from tests.networks.test_gpthf import CONFIG, DECODER, END, _params, numpy_gpthf


class _NoEos:
  eos_id = -1  # every row runs all its steps


@functools.lru_cache(maxsize=None)
def _model():
  return models.DecoderOnlyModel(gpthf.Gpthf(CONFIG), _NoEos())


# Float32 against float64: XLA's float32 rounding (~6e-8 relative per operation) over three
# blocks of width 32 and a 64-id head leaves logit errors near 1e-6; 2e-4 bounds them with room
# (the bound tests/networks/test_gpthf.py holds the parallel pass to).
TOLERANCE = 2e-4


def test_bucket_sizes_double_up_to_the_limit():
  assert gpthf.bucket_sizes(64) == [8, 16, 32, 64]
  assert gpthf.bucket_sizes(50) == [8, 16, 32, 50]
  assert gpthf.bucket_sizes(6) == [6]


def test_paper_logits_equal_the_definition_with_sentences_closing_mid_generation():
  """Teacher-forced: the prompt is mid-sentence; the forced continuation closes one sentence
  by the end id and one by the 6-token bound (7 tokens without an end id) while generating."""
  params = _params()
  text = np.array([[5, 6, END, 7, 8, 9, 10, END, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
                   [21, 22, 23, END, 24, 25, 26, 27, 28, 29, 30, 31, END, 32, 33, 34, 35, 36]],
                  np.int32)
  n = 6
  logits = jax.jit(functools.partial(gpthf.paper_generate, _model().module, return_logits=True),
                   static_argnums=2)(params, text[:, :n], text.shape[1] - n, text[:, n:])
  fed = np.pad(text, ((0, 0), (1, 0)))[:, :-1]  # BOS + text[:-1]: logit t predicts text[t]
  for b in range(2):
    want = numpy_gpthf(CONFIG, params, fed[b])[n:]  # [K, vocab] by the definition, float64
    np.testing.assert_allclose(logits[b], want, atol=TOLERANCE, rtol=TOLERANCE)
  layout = gpthf.sentence_layout(jnp.asarray(fed), END, CONFIG.max_sentence_length)
  closes_new = np.asarray(layout.closes)[:, n:]
  bound = closes_new & (fed[:, n:] != END)
  assert closes_new.sum(1).min() >= 2 and bound.any()  # end-id and bound closes in the steps


@pytest.mark.parametrize("prompt", [
    np.array([[5, 6, END, 7, 8]], np.int32),       # ends mid-sentence
    np.array([[5, END, 6, 7, END]], np.int32),     # ends on a sentence end
    np.zeros((1, 0), np.int32)], ids=["mid_sentence", "at_end", "empty"])
def test_paper_greedy_tokens_equal_cached_and_uncached_generation(prompt):
  model, params = _model(), _params()
  prompt = np.repeat(prompt, 2, axis=0)
  if prompt.shape[1]:
    prompt[1, 0] = 9  # the two rows differ
  paper = jax.jit(functools.partial(gpthf.paper_generate, model.module),
                  static_argnums=2)(params, prompt, 20)
  cached = jax.jit(model.generate, static_argnums=2)(params, prompt, 20)
  uncached = jax.jit(model.generate_uncached, static_argnums=2)(params, prompt, 20)
  np.testing.assert_array_equal(paper, cached)
  np.testing.assert_array_equal(paper, uncached)
  full = np.concatenate([prompt, np.asarray(paper)], axis=1)
  layout = gpthf.sentence_layout(jnp.asarray(full), END, CONFIG.max_sentence_length)
  assert int(layout.sentence[0, -1]) >= 3  # sentences closed during generation (the bound)


# ------------------------------------------------------------------------------ GPT baseline
class _Widths:
  """Stands in for a DecoderOnlyModel's module: records the input length of every traced
  call (one per compiled buffer length) and runs the real network."""

  def __init__(self, module):
    self.module, self.widths = module, []

  def apply(self, variables, tokens, **kwargs):
    self.widths.append(tokens.shape[1])
    return self.module.apply(variables, tokens, **kwargs)


@pytest.mark.parametrize("bucket, widths", [(None, [12]), (1, list(range(6, 13))),
                                            (3, [8, 11, 12])])
def test_uncached_gpt_grows_its_buffer_and_equals_the_cached_gpt(bucket, widths):
  """P = 5, K = 7: step i needs P + i + 1 positions; a group of steps runs at its last
  step's length. Its greedy tokens equal the KV-cached GPT's."""
  network = Decoder(DECODER)
  model = models.DecoderOnlyModel(network, _NoEos())
  params = _params()  # Gpthf's tree is Decoder's (test_same_parameters_as_the_equally_sized_gpt)
  prompt = np.array([[5, 6, 7, 8, 9], [21, 22, 23, 24, 25]], np.int32)
  cached = jax.jit(model.generate, static_argnums=2)(params, prompt, 7)
  recording = models.DecoderOnlyModel(network, _NoEos())
  recording.module = _Widths(network)
  grown = recording.generate_uncached(params, prompt, 7, bucket=bucket)
  assert recording.module.widths == widths
  np.testing.assert_array_equal(grown, cached)
  assert len(set(np.asarray(cached).ravel().tolist())) > 1


def test_uncached_gpt_with_forced_tokens_equals_its_parallel_pass():
  model = models.DecoderOnlyModel(Decoder(DECODER), _NoEos())
  params = _params()
  text = np.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]], np.int32)
  got = model.generate_uncached(params, text[:, :4], 6, bucket=4, forced=text[:, 4:])
  fed = np.pad(text, ((0, 0), (1, 0)))[:, :-1]
  logits = model.module.apply({"params": params}, fed, enable_dropout=False)
  np.testing.assert_array_equal(got, np.argmax(logits[:, 4:], axis=-1))
  with pytest.raises(ValueError, match="bucket"):
    model.generate_uncached(params, text[:, :4], 6, bucket=0)
