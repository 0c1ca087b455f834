"""Squid (networks/squid.py, models.SquidModel) against a plain-numpy re-derivation, and the
properties its inference API promises: cached = uncached generation, compress once = compress
every time, frozen parts stay bitwise fixed, bad configurations fail early."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decal_jax import models
from decal_jax.runtime import optimizers
from decal_jax.networks.decoder import DecoderConfig
from decal_jax.networks.squid import Squid, SquidConfig, SquidT5X
from tests.numpy_llama import Llama, rms_norm

SMALL = DecoderConfig(vocab_size=64, emb_dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
                      mlp_dim=64, num_layers=2, max_length=64)
LARGE = DecoderConfig(vocab_size=72, emb_dim=48, num_heads=4, num_kv_heads=4, head_dim=12,
                      mlp_dim=96, num_layers=3, max_length=64, qkv_bias=True)
CONFIG = SquidConfig(small=SMALL, large=LARGE, memory_tokens=3)


class _Vocab:
  eos_id = 1


@functools.lru_cache(maxsize=None)
def _model(config=CONFIG):
  return models.SquidModel(Squid(config), _Vocab(), _Vocab())


@functools.lru_cache(maxsize=None)
def _params(model, seed=0):
  shapes = {"encoder_input_tokens": (2, 10), "decoder_input_tokens": (2, 5),
            "query_tokens": (2, 4)}
  params = jax.jit(lambda rng: model.get_initial_variables(rng, shapes))(
      jax.random.PRNGKey(seed))["params"]
  # Perturb every leaf (zero biases, unit norm scales at init) so each one matters.
  noise = np.random.default_rng(seed + 1)
  return jax.tree_util.tree_map(
      lambda p: jnp.asarray(p + 0.05 * noise.standard_normal(p.shape), p.dtype), params)


def _batch():
  context = np.array([[5, 6, 7, 8, 9, 10, 11, 0, 0, 0],
                      [12, 13, 14, 15, 16, 17, 18, 19, 20, 21]], np.int32)
  query = np.array([[30, 31, 0, 0], [32, 33, 34, 35]], np.int32)
  answer_in = np.array([[0, 40, 41, 42, 0], [0, 43, 44, 45, 46]], np.int32)
  return {"encoder_input_tokens": context, "query_tokens": query,
          "decoder_input_tokens": answer_in, "decoder_target_tokens": answer_in}


# ------------------------------------------------------------------------------ reference
def _gelu(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _projector(p, x, layers):
  for i in range(layers):
    x = x @ np.asarray(p[f"dense_{i}"]["kernel"], np.float64) + np.asarray(p[f"bias_{i}"])
    if i < layers - 1:
      x = _gelu(x)
  return x


def numpy_squid(config, params, context, query, answer_in):
  """One example (real tokens only) -> answer logits `[t, vocab]`, from the definition: the
  small decoder reads [context; memory], the large one [projected memory; query; answer]."""
  params = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  small = Llama(config.small, params["small_decoder"])
  table = params["memory_tokens"]["memory_embeddings"]
  n = (config.memory_tokens if config.memory_ratio is None
       else math.ceil(len(context) / config.memory_ratio))
  x = np.concatenate([params["small_decoder"]["token_embedder"]["embedding"][context],
                      table[:n]])
  out, _ = small.run(x, np.arange(len(x)))
  states = rms_norm(out[len(context):], params["small_decoder"]["decoder_norm"]["scale"],
                    config.small.norm_epsilon)  # [n, small emb]
  memory = _projector(params["projector"], states, config.projector_layers)
  large = Llama(config.large, params["large_decoder"])
  emb = params["large_decoder"]["token_embedder"]["embedding"]
  y = np.concatenate([memory, emb[query], emb[answer_in]])
  out, _ = large.run(y, np.arange(len(y)))
  return large.logits(out[-len(answer_in):])


def _real(row):
  return row[row > 0]


@pytest.mark.parametrize("config", [CONFIG, dataclasses.replace(CONFIG, memory_ratio=3,
                                                                memory_tokens=4,
                                                                projector_layers=1)],
                         ids=["fixed_n", "ratio"])
def test_logits_match_numpy_reference(config):
  """The large decoder reads exactly [N projected vectors; the query] before the answer;
  padded rows get the positions they would get alone."""
  model = _model(config)
  params = _params(model)
  batch = _batch()
  logits = jax.jit(model._compute_logits)(params, batch)  # [2, 5, vocab]
  for b in range(2):
    want = numpy_squid(config, params, _real(batch["encoder_input_tokens"][b]),
                       _real(batch["query_tokens"][b]), batch["decoder_input_tokens"][b])
    np.testing.assert_allclose(logits[b], want, atol=2e-4, rtol=2e-4)


def test_prefix_is_memory_then_query():
  model = _model()
  params = _params(model)
  batch = _batch()
  compressed = model.compress(params, batch["encoder_input_tokens"])
  assert compressed.embeddings.shape == (2, CONFIG.memory_tokens, LARGE.emb_dim)
  prefix = model.module.apply({"params": params}, compressed, batch["query_tokens"],
                              method=model.module.read)
  assert prefix.keys.shape == (2, LARGE.num_layers, 3 + 4, LARGE.kv_heads, LARGE.head_dim)
  np.testing.assert_array_equal(prefix.length, [3 + 2, 3 + 4])
  np.testing.assert_array_equal(prefix.valid[0], [1, 1, 1, 1, 1, 0, 0])


def test_cached_decoding_equals_full_pass():
  model = _model()
  params = _params(model)
  batch = _batch()
  cached = model.predict_batch(params, batch)  # greedy with the KV cache
  uncached = model.predict_batch_uncached(params, batch)  # reruns the whole network
  np.testing.assert_array_equal(cached, uncached)
  # step logits from the cache equal the teacher-forced logits of the same tokens
  module = model.module
  prefix = module.apply({"params": params}, batch["encoder_input_tokens"],
                        batch["query_tokens"], enable_dropout=False, method=module.encode)
  tokens = jnp.asarray(batch["decoder_input_tokens"])
  _, cache = module.apply({"params": params}, prefix, None, jnp.ones_like(tokens),
                          decode=True, enable_dropout=False, mutable=["cache"],
                          method=module.decode)
  cache = cache["cache"]
  full = model._compute_logits(params, batch)
  for t in range(tokens.shape[1]):
    step, new = module.apply({"params": params, "cache": cache}, prefix, None,
                             tokens[:, t:t + 1], decode=True, enable_dropout=False,
                             mutable=["cache"], method=module.decode)
    cache = new["cache"]
    np.testing.assert_allclose(step[:, 0], full[:, t], atol=1e-4, rtol=1e-4)


def test_compress_once_answer_many_equals_recompressing():
  model = _model()
  params = _params(model)
  context = _batch()["encoder_input_tokens"][1:]  # one context
  queries = np.array([[32, 33, 0], [34, 0, 0], [35, 36, 37]], np.int32)
  kept = model.compress(params, context)  # batch 1, reused for three queries
  answer = jax.jit(model.answer, static_argnums=3)
  once, _ = answer(params, kept, queries, 6)
  repeated = np.repeat(context, 3, axis=0)
  again = jax.jit(model.predict_batch)(params, {"encoder_input_tokens": repeated,
                                       "query_tokens": queries,
                                       "decoder_input_tokens": np.zeros((3, 6), np.int32)})
  np.testing.assert_array_equal(once, again)
  alone, _ = answer(params, kept, queries[2:], 6)  # a query answered on its own
  np.testing.assert_array_equal(alone[0], once[2])


def test_partially_frozen_stage_leaves_frozen_parts_bitwise_unchanged():
  model = _model()
  params = _params(model)
  batch = _batch()
  opt = optimizers.partially_frozen(optax.adam(1e-2), trainable=("projector", "memory_tokens"))
  @jax.jit
  def step(params, state):
    grads = jax.grad(lambda p: model.loss_fn(p, batch, None)[0])(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  new, state = params, opt.init(params)
  for _ in range(3):
    new, state = step(new, state)
  for part in ("small_decoder", "large_decoder"):
    same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(a, b)), params[part],
                                  new[part])
    assert all(jax.tree_util.tree_leaves(same)), part
  for part in ("projector", "memory_tokens"):
    moved = jax.tree_util.tree_map(lambda a, b: bool(np.any(a != b)), params[part], new[part])
    assert all(jax.tree_util.tree_leaves(moved)), part


def test_freezing_everything_fails_before_training():
  params = _params(_model())
  opt = optimizers.partially_frozen(optax.adam(1e-2), trainable=("decoder_x",))
  with pytest.raises(ValueError, match="no parameter .*decoder_x"):
    opt.init(params)


def test_context_shorter_than_n_is_refused():
  model = _model(dataclasses.replace(CONFIG, memory_tokens=8))
  short = np.array([[5, 6, 7, 0, 0, 0, 0, 0, 0, 0]], np.int32)
  with pytest.raises(ValueError, match="shorter than the 8 memory tokens .*shortest: 3"):
    model.compress(None, short)  # refused before any parameter is read
  with pytest.raises(ValueError, match="memory_ratio"):
    model.check_batch({"encoder_input_tokens": short})
  ratio = _model(dataclasses.replace(CONFIG, memory_ratio=4, memory_tokens=8))
  ratio.check_batch({"encoder_input_tokens": short})  # N follows the length: fine


def test_projector_dims_must_match_the_decoders():
  with pytest.raises(ValueError, match="projector_output_dim = 64 .*large decoder's emb_dim = 48"):
    dataclasses.replace(CONFIG, projector_output_dim=64)
  with pytest.raises(ValueError, match="projector_input_dim"):
    dataclasses.replace(CONFIG, projector_input_dim=48)
  dataclasses.replace(CONFIG, projector_input_dim=32, projector_output_dim=48)  # matches


def test_ratio_mode_needs_enough_memory_rows():
  model = _model(dataclasses.replace(CONFIG, memory_ratio=2, memory_tokens=4))
  with pytest.raises(ValueError, match="need 5 memory tokens .*SquidConfig.memory_tokens >= 5"):
    model.get_initial_variables(jax.random.PRNGKey(0), {
        "encoder_input_tokens": (1, 10), "decoder_input_tokens": (1, 4)})


# ------------------------------------------------------------------------------ T5X's interface
def _joined(batch):
  """[context; query] in one `[batch, n + q]` array: what SquidT5X reads as its encoder input."""
  return np.concatenate([batch["encoder_input_tokens"], batch["query_tokens"]], axis=1)


@pytest.mark.parametrize("config", [CONFIG, dataclasses.replace(CONFIG, memory_ratio=3,
                                                                memory_tokens=4)],
                         ids=["fixed_n", "ratio"])
def test_t5x_interface_reads_the_query_from_the_joined_input(config):
  """SquidT5X (Squid's parameters) on [context; query]: teacher-forced logits equal the
  numpy re-derivation, and decoding step by step from `encode`'s one array (rebuilding
  the prefix's validity from the joined tokens, as T5X's beam search calls it) equals them."""
  params = _params(_model(config))
  batch = _batch()
  module = SquidT5X(config, query_length=batch["query_tokens"].shape[1])
  joined = jnp.asarray(_joined(batch))
  tokens = jnp.asarray(batch["decoder_input_tokens"])
  full = jax.jit(functools.partial(module.apply, enable_dropout=False))(
      {"params": params}, joined, tokens, tokens)
  for b in range(2):
    want = numpy_squid(config, params, _real(batch["encoder_input_tokens"][b]),
                       _real(batch["query_tokens"][b]), batch["decoder_input_tokens"][b])
    np.testing.assert_allclose(full[b], want, atol=2e-4, rtol=2e-4)
  encoded = jax.jit(functools.partial(module.apply, enable_dropout=False,
                                      method=module.encode))(
      {"params": params}, joined)  # [b, 2, layers, N + q, kv, d]
  n_memory = config.memory_count(batch["encoder_input_tokens"].shape[1])
  assert encoded.shape == (2, 2, LARGE.num_layers, n_memory + 4, LARGE.kv_heads,
                           LARGE.head_dim)
  _, cache = module.apply({"params": params}, jnp.ones_like(joined), jnp.ones_like(tokens),
                          jnp.ones_like(tokens), decode=True, enable_dropout=False,
                          mutable=["cache"])
  cache = cache["cache"]
  decode_step = jax.jit(functools.partial(module.apply, decode=True, enable_dropout=False,
                                          mutable=["cache"], method=module.decode))
  for t in range(tokens.shape[1]):
    token = tokens[:, t:t + 1]  # [b, 1]
    step, new = decode_step({"params": params, "cache": cache}, encoded, joined, token, token)
    cache = new["cache"]
    np.testing.assert_allclose(step[:, 0], full[:, t], atol=1e-4, rtol=1e-4)


def test_t5x_interface_needs_room_for_the_query():
  params = _params(_model())
  module = SquidT5X(CONFIG, query_length=12)
  with pytest.raises(ValueError, match="11 columns but SquidT5X.query_length = 12"):
    module.apply({"params": params}, jnp.ones((1, 11), jnp.int32), enable_dropout=False,
                 method=module.encode)


def test_t5x_feature_converter_joins_context_and_query():
  """seqio task features -> T5X's encoder-decoder features, the query padded into the last
  QUERY_LENGTH encoder columns; a 'query' length other than QUERY_LENGTH is refused."""
  import tensorflow as tf
  from decal_jax.models.squid_features import SquidT5XFeatureConverter
  ds = tf.data.Dataset.from_tensors({"inputs": tf.constant([5, 6, 7], tf.int32),
                                     "query": tf.constant([8, 9], tf.int32),
                                     "targets": tf.constant([10, 11, 1], tf.int32)})
  lengths = {"inputs": 5, "query": 3, "targets": 4}
  out = next(iter(SquidT5XFeatureConverter(query_length=3)(ds, lengths).as_numpy_iterator()))
  np.testing.assert_array_equal(out["encoder_input_tokens"], [5, 6, 7, 0, 0, 8, 9, 0])
  np.testing.assert_array_equal(out["decoder_target_tokens"], [10, 11, 1, 0])
  np.testing.assert_array_equal(out["decoder_input_tokens"], [0, 10, 11, 1])
  np.testing.assert_array_equal(out["decoder_loss_weights"], [1, 1, 1, 0])
  assert set(out) == {"encoder_input_tokens", "decoder_target_tokens", "decoder_input_tokens",
                      "decoder_loss_weights"}
  with pytest.raises(ValueError, match=r"'query'\] = 3 .*QUERY_LENGTH = 4 .*QUERY_LENGTH=3"):
    SquidT5XFeatureConverter(query_length=4)(ds, lengths)
  with pytest.raises(ValueError, match="packed examples are not supported"):
    SquidT5XFeatureConverter(pack=True)
