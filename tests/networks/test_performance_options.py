"""The T5 network's performance options compute the plain path's function.

Each option (T5Config.scan_layers, remat_policy, dtype, fused_qkv, attention_kernel) is
checked against the plain configuration with the same weights mapped between layouts
(`networks/param_layout.py`): logits, gradients and, for scan, Adafactor steps. The
attention kernels are also checked against each other at the layer level with a relative
position bias, a padding mask and a causal mask. Checkpoints written in one layout load,
converted, into the other. All on a tiny DeCAL 4x model.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decal_jax import models, partitioning
from decal_jax.runtime import checkpoints, optimizers, train_state
from decal_jax.data import pipeline
from decal_jax.layers import attention as attn
from decal_jax.networks import param_layout
from decal_jax.networks.t5 import REMAT_POLICIES, T5Config, Transformer

PLAIN = T5Config(vocab_size=61, emb_dim=32, num_heads=2, head_dim=8, mlp_dim=48,
                 num_encoder_layers=2, num_decoder_layers=2, compression_ratio=4,
                 relative_attention_num_buckets=8, relative_attention_max_distance=20)


# Cheap compiles: these programs are tiny, XLA's CPU backend optimisation is not worth its
# seconds here (both sides of every comparison are compiled the same way).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compiled(fn, *args):
  """fn(*args), jitted with FAST_COMPILE."""
  return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


def _random_params(cfg, seed=0):
  """Random weights in `cfg`'s layout (norm scales near 1), from shapes alone: no init
  program to compile."""
  rng = np.random.RandomState(seed)
  def draw(path, leaf):
    if jax.tree_util.keystr(path).endswith("['scale']"):
      return jnp.asarray(1.0 + 0.1 * rng.randn(*leaf.shape), jnp.float32)
    return jnp.asarray(0.3 * rng.randn(*leaf.shape), jnp.float32)
  return jax.tree_util.tree_map_with_path(draw, _own_layout(cfg)["params"])


@functools.lru_cache(maxsize=None)
def _plain_params():
  return _random_params(PLAIN)


def _batch():
  rng = np.random.RandomState(0)
  enc = rng.randint(2, 61, (2, 11)).astype(np.int32)
  enc[1, 6:] = 0  # padding: a partly empty and an empty latent window
  targets = rng.randint(2, 61, (2, 6)).astype(np.int32)
  targets[1, 4:] = 0
  return {"encoder_input_tokens": jnp.asarray(enc),
          "decoder_input_tokens": jnp.asarray(np.pad(targets, ((0, 0), (1, 0)))[:, :-1]),
          "decoder_target_tokens": jnp.asarray(targets)}


def _model(cfg):
  return models.EncoderDecoderModel(Transformer(cfg), None, None)


def _run(cfg, params, steps=0):
  """One compiled program: logits, loss and grads at `params`, then `steps` Adafactor steps
  (trained params and their losses); one compile per config keeps the tests cheap."""
  model, batch = _model(cfg), _batch()
  optimizer = optimizers.adafactor(optimizers.rsqrt_schedule(0.5, 5))
  loss_and_grads = jax.value_and_grad(lambda p: model.loss_fn(p, batch, None)[0])

  def train_step(carry, _):
    params, opt_state = carry
    loss, grads = loss_and_grads(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  def run(params):
    loss, grads = loss_and_grads(params)
    logits = model._compute_logits(params, batch)
    out = {"logits": logits, "loss": loss, "grads": grads}
    if steps:
      (out["trained"], _), out["losses"] = jax.lax.scan(
          train_step, (params, optimizer.init(params)), None, length=steps)
    return out

  return _compiled(run, params)


@functools.lru_cache(maxsize=None)
def _plain_run():
  return _run(PLAIN, _plain_params(), steps=STEPS)


STEPS = 3


# ----------------------------------------------------------------------------- tolerance
# Every option computes the plain path's function with its fp32 sums in another order
# (stacked layers, fused projections, another attention kernel). Such results differ by
# rounding alone, and the bound on that rounding comes from the magnitudes involved, not
# from one fixed number: a length-K fp32 dot product is off by at most K * eps * sum|terms|
# (the summands are of the tensor's largest magnitude, so an entry near 0 is the cancellation
# of large terms and carries an error of that scale, not of its own), and the errors of the
# chained contractions add. The chain here: per layer and direction (forward, backward) six
# contractions (q, k, v, scores, weights @ values, output; the MLP's two are within that
# count's slack), each of length at most LONGEST. The resulting bound, about 3.5e-4 of the
# largest magnitude, holds on any CPU's summation order; a wrong weight mapping or a
# dropped mask is off by order 1 of it. How the tolerance was found wanting: AVX-512 AMD
# EPYC gave 3.8e-5 against a fixed atol of 1e-5 on gradients of magnitude 7.
EPS32 = float(np.finfo(np.float32).eps)
LONGEST = max(PLAIN.vocab_size, PLAIN.mlp_dim, PLAIN.emb_dim, PLAIN.num_heads * PLAIN.head_dim,
              11)  # 11: the longest input of _batch()
CHAIN = 2 * 6 * (PLAIN.num_encoder_layers + PLAIN.num_decoder_layers)
REORDER_BOUND = CHAIN * LONGEST * EPS32  # relative to the largest magnitude: about 3.5e-4


def _assert_close_up_to_reordering(actual, desired, what=""):
  """|actual - desired| <= REORDER_BOUND * max|desired|, elementwise (see above)."""
  actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
  scale = max(float(np.max(np.abs(desired), initial=0.0)), np.finfo(np.float32).tiny)
  np.testing.assert_allclose(actual, desired, rtol=0, atol=REORDER_BOUND * scale,
                             err_msg=f"{what} (scale {scale:.3g})")


def _assert_trees_close(a, b, exact=False):
  """Leaf by leaf: equal (`exact`), or equal up to fp32 reordering at each leaf's scale."""
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0],
                          jax.tree_util.tree_leaves(b)):
    if exact:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
    else:
      _assert_close_up_to_reordering(x, y, jax.tree_util.keystr(path))


def _own_layout(cfg):
  """The params / params_axes shapes the configured model initialises by itself."""
  model = Transformer(cfg)
  ones = jnp.ones((1, 8), jnp.int32)
  return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ones, ones[:, :4],
                                           ones[:, :4], enable_dropout=False))


def _shapes(tree):
  return jax.tree_util.tree_map(lambda x: tuple(x.shape), tree)


# ----------------------------------------------------------------------------- scan
def test_scan_equals_unrolled_logits_grads_and_adafactor_steps():
  scanned = dataclasses.replace(PLAIN, scan_layers=True)
  mapped = param_layout.convert_params(_plain_params(), PLAIN, scanned)
  own = _own_layout(scanned)
  assert _shapes(own["params"]) == _shapes(mapped)  # the mapping lands in nn.scan's layout
  axes = own["params_axes"]["encoder"]["layers"]["mlp"]["wi_0"]["kernel_axes"].names
  assert axes == ("layers", "embed", "mlp")
  assert mapped["encoder"]["layers"]["mlp"]["wi_0"]["kernel"].shape[0] == 2

  plain, scan = _plain_run(), _run(scanned, mapped, steps=STEPS)
  _assert_close_up_to_reordering(scan["logits"], plain["logits"], "logits")
  _assert_close_up_to_reordering(scan["loss"], plain["loss"], "loss")
  _assert_trees_close(param_layout.convert_params(scan["grads"], scanned, PLAIN),
                      plain["grads"])
  # Adafactor steps: per-layer scale / clipping (optimizers.per_layer) make the scanned run
  # take the unrolled run's steps.
  _assert_trees_close(param_layout.convert_params(scan["trained"], scanned, PLAIN),
                      plain["trained"])


def test_scanned_adafactor_statistics_are_sharded_like_their_params():
  """`optimizers.per_layer` state does not mirror the params tree; its statistics of a
  parameter's shape must still follow that parameter's (FSDP) sharding, not be replicated."""
  cfg = dataclasses.replace(PLAIN, scan_layers=True)
  model = _model(cfg)
  data = pipeline.DatasetConfig("unused", {"inputs": 11, "targets": 6}, batch_size=2)
  part = partitioning.Partitioner()
  state, _ = train_state.init_state(model, optimizers.adafactor(), part, data, seed=0)
  params = {jax.tree_util.keystr(path): leaf for path, leaf in
            jax.tree_util.tree_flatten_with_path(state["params"])[0]}
  checked = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]:
    owner = [name for name in params if jax.tree_util.keystr(path).endswith(name)]
    if owner and params[owner[0]].shape == leaf.shape:
      assert leaf.sharding.spec == params[owner[0]].sharding.spec, owner[0]
      checked.append(owner[0])
  stacked = [name for name in checked if "['layers']" in name]
  assert stacked and any(params[n].sharding.spec != jax.sharding.PartitionSpec()
                         for n in stacked)


def test_state_initialised_on_host_equals_the_mesh_initialised_state():
  """bench_train --init_on_host: the host CPU builds the state, then it is placed on the
  mesh; every leaf must equal the state jitted onto the mesh, with the same sharding."""
  model = _model(dataclasses.replace(PLAIN, scan_layers=True))
  data = pipeline.DatasetConfig("unused", {"inputs": 11, "targets": 6}, batch_size=2)
  part = partitioning.Partitioner(mesh_shape=(1, -1, 1))  # FSDP: sharded parameters
  on_mesh, shardings = train_state.init_state(model, optimizers.adafactor(), part, data, 0)
  on_host, host_shardings = train_state.init_state(model, optimizers.adafactor(), part, data,
                                                   0, on_host=True)
  assert host_shardings == shardings
  mesh_leaves = jax.tree_util.tree_leaves_with_path(on_mesh)
  host_leaves = jax.tree_util.tree_leaves(on_host)
  assert len(mesh_leaves) == len(host_leaves)
  assert any(leaf.sharding.spec != jax.sharding.PartitionSpec() for _, leaf in mesh_leaves)
  for (path, want), got in zip(mesh_leaves, host_leaves):
    assert got.sharding == want.sharding, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                  err_msg=jax.tree_util.keystr(path))


# ----------------------------------------------------------------------------- remat
def test_remat_policies_equal_plain_loss_and_grads():
  plain = _plain_run()
  assert set(REMAT_POLICIES) == {"none", "full", "dots_saveable",
                                 "dots_with_no_batch_dims_saveable"}
  # 'full' on unrolled layers; a dots policy inside nn.scan (where remat skips CSE
  # prevention). Every policy name maps to a jax.checkpoint_policies function.
  scanned = dataclasses.replace(PLAIN, scan_layers=True)
  for cfg in (dataclasses.replace(PLAIN, remat_policy="full"),
              dataclasses.replace(scanned, remat_policy="dots_with_no_batch_dims_saveable")):
    out = _run(cfg, param_layout.convert_params(_plain_params(), PLAIN, cfg))
    _assert_close_up_to_reordering(out["loss"], plain["loss"], cfg.remat_policy)
    _assert_trees_close(param_layout.convert_params(out["grads"], cfg, PLAIN), plain["grads"])


# ----------------------------------------------------------------------------- bf16
def test_bf16_activations_keep_fp32_params_and_loss_close_to_fp32():
  bf16 = dataclasses.replace(PLAIN, dtype="bfloat16")
  assert bf16.dtype == jnp.bfloat16  # gin passes the name; the config holds the dtype
  plain, out = _plain_run(), _run(bf16, _plain_params(), steps=STEPS)
  assert out["logits"].dtype == jnp.float32  # fp32 logits -> fp32 loss
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves((out["grads"],
                                                                        out["trained"])))
  assert plain["losses"][-1] < plain["losses"][0]  # the steps do train
  np.testing.assert_allclose(np.asarray(out["losses"]), np.asarray(plain["losses"]),
                             rtol=2e-2)


# ----------------------------------------------------------------------------- attention
def test_attention_kernels_agree_with_relative_bias_padding_and_causal_masks():
  rng = np.random.RandomState(1)
  b, q, k, h, d = 2, 5, 7, 3, 4
  query, key, value = (jnp.asarray(rng.randn(b, n, h, d), jnp.float32) for n in (q, k, k))
  relpos = attn.RelativePositionBiases(8, 20, h)
  q_pos, k_pos = jnp.broadcast_to(jnp.arange(2, 2 + q), (b, q)), jnp.broadcast_to(
      jnp.arange(k), (b, k))
  bias = relpos.apply(relpos.init(jax.random.PRNGKey(0), q_pos, k_pos, False), q_pos, k_pos,
                      False)  # [b, h, q, k]
  key_valid = jnp.asarray(np.arange(k)[None] < np.array([[7], [4]]))  # row 1 padded from 4
  mask = attn.combine_masks(attn.make_attention_mask(jnp.ones((b, q), bool), key_valid),
                            attn.make_attention_mask(q_pos, k_pos, jnp.greater_equal))

  def run(kernel):
    def f(query, key, value, bias):
      bias_, mask_ = attn.split_bias_and_mask(bias, mask, kernel)
      return attn.dot_product_attention(query, key, value, bias_, mask=mask_, kernel=kernel)
    value_and_grads = jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3))
    return _compiled(lambda *a: (f(*a), value_and_grads(*a)[1]), query, key, value, bias)

  ref_out, ref_grads = run("einsum")
  # The einsum path against softmax(q k^T + bias) v written out with numpy.
  # In float64, so the reference carries no rounding of its own.
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (query, key, value))
  logits = np.einsum("bqhd,bkhd->bhqk", q64, k64) + np.asarray(bias, np.float64)
  logits = np.where(np.asarray(mask) > 0, logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  _assert_close_up_to_reordering(ref_out, np.einsum("bhqk,bkhd->bqhd", weights, v64), "numpy")
  for kernel in ("xla", "auto"):
    out, grads = run(kernel)
    _assert_close_up_to_reordering(out, ref_out, kernel)
    _assert_trees_close(grads, ref_grads)


def test_blockwise_kernel_equals_einsum_logits_loss_and_grads():
  """attention_kernel='blockwise' with blocks of 4 keys (several per row, a ragged last one
  over the 11-token inputs): the encoder's relative bias and its mask (DeCAL latents,
  padding, an empty window) are made per key block, never whole; logits, loss and every
  gradient (the relative bias tables' included) equal the einsum path's up to reordering."""
  plain = _plain_run()
  cfg = dataclasses.replace(PLAIN, attention_kernel="blockwise", attention_block_size=4)
  out = _run(cfg, _plain_params())
  _assert_close_up_to_reordering(out["logits"], plain["logits"], "blockwise logits")
  _assert_close_up_to_reordering(out["loss"], plain["loss"], "blockwise loss")
  _assert_trees_close(out["grads"], plain["grads"])


def test_cudnn_kernel_and_dropout_are_refused_clearly():
  with pytest.raises(ValueError, match="'cudnn' runs bf16 / fp16 only"):
    dataclasses.replace(PLAIN, attention_kernel="cudnn")
  with pytest.raises(ValueError, match="no attention dropout"):
    dataclasses.replace(PLAIN, attention_kernel="xla", dropout_rate=0.1)
  with pytest.raises(ValueError, match="Unknown T5Config.remat_policy"):
    dataclasses.replace(PLAIN, remat_policy="everything")
  with pytest.raises(ValueError, match="must be one of"):
    dataclasses.replace(PLAIN, dtype="int8")
  with pytest.raises(ValueError, match="Unknown attention kernel"):
    dataclasses.replace(PLAIN, attention_kernel="flash")
  if jax.default_backend() != "gpu":
    cfg = dataclasses.replace(PLAIN, attention_kernel="cudnn", dtype="bfloat16")
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
      jax.eval_shape(_model(cfg)._compute_logits, _plain_params(), _batch())


# ----------------------------------------------------------------------------- fused q/k/v
def test_fused_qkv_equals_unfused_with_weights_mapped():
  fused = dataclasses.replace(PLAIN, fused_qkv=True)
  mapped = param_layout.convert_params(_plain_params(), PLAIN, fused)
  assert _shapes(_own_layout(fused)["params"]) == _shapes(mapped)
  layer = mapped["decoder"]["layers_0"]
  assert layer["self_attention"]["qkv"]["qkv_fused"]["kernel"].shape == (32, 3, 2, 8)
  assert layer["encoder_decoder_attention"]["qkv"]["kv_fused"]["kernel"].shape == (32, 2, 2, 8)
  plain, out = _plain_run(), _run(fused, mapped)
  _assert_close_up_to_reordering(out["loss"], plain["loss"], "loss")
  _assert_trees_close(param_layout.convert_params(out["grads"], fused, PLAIN), plain["grads"])


def test_layout_conversion_round_trips_and_matches_every_layout():
  params = _plain_params()
  every = dataclasses.replace(PLAIN, scan_layers=True, fused_qkv=True)
  there = param_layout.convert_params(params, PLAIN, every)
  assert "layers" in there["decoder"] and "layers_0" not in there["decoder"]
  _assert_trees_close(param_layout.convert_params(there, every, PLAIN), params, exact=True)
  # DeCAL's separate latent parameters have their own q/k/v: fused and scanned too.
  split = dataclasses.replace(PLAIN, separate_latent_params=True)
  split_every = dataclasses.replace(split, scan_layers=True, fused_qkv=True)
  abstract = _own_layout(split)["params"]
  converted = jax.eval_shape(lambda p: param_layout.convert_params(p, split, split_every),
                             abstract)
  assert _shapes(converted) == _shapes(_own_layout(split_every)["params"])


# ----------------------------------------------------------------------------- all together
def test_all_options_keep_decal_and_cached_decoding_equal_full_forward():
  every = dataclasses.replace(PLAIN, scan_layers=True, fused_qkv=True, attention_kernel="xla",
                              remat_policy="dots_saveable")
  model, batch = Transformer(every), _batch()
  mapped = param_layout.convert_params(_plain_params(), PLAIN, every)
  enc, dec_in = batch["encoder_input_tokens"], batch["decoder_input_tokens"]
  full = _compiled(_model(every)._compute_logits, mapped, batch)
  _assert_close_up_to_reordering(full, _plain_run()["logits"], "logits")
  _, variables = _compiled(functools.partial(model.apply, decode=True, enable_dropout=False,
                                             mutable=["cache"]), {"params": mapped},
                           jnp.ones_like(enc), jnp.ones_like(dec_in), jnp.ones_like(dec_in))
  cache = variables["cache"]
  # scanned caches put the layer axis after the batch: [batch, layers, length, heads, kv]
  assert cache["decoder"]["layers"]["self_attention"]["cache"]["cached_key"].shape == (
      2, 2, 6, 2, 8)
  encoded = _compiled(functools.partial(model.apply, enable_dropout=False, method=model.encode),
                      {"params": mapped}, enc)
  step = jax.jit(functools.partial(model.apply, decode=True, enable_dropout=False,
                                   mutable=["cache"], method=model.decode))
  step = step.lower({"params": mapped, "cache": cache}, encoded, enc, dec_in[:, :1],
                    dec_in[:, :1]).compile(FAST_COMPILE)
  steps = []
  for t in range(dec_in.shape[1]):
    logits, variables = step({"params": mapped, "cache": cache}, encoded, enc,
                             dec_in[:, t:t + 1], dec_in[:, t:t + 1])
    cache = variables["cache"]
    steps.append(logits)
  _assert_close_up_to_reordering(jnp.concatenate(steps, axis=1), full, "cached decoding")


# ----------------------------------------------------------------------------- checkpoints
SCANNED_FUSED = dataclasses.replace(PLAIN, scan_layers=True, fused_qkv=True)


def _logits(cfg, params):
  logits = _model(cfg)._compute_logits
  return np.asarray(_compiled(logits, params, _batch()))  # [batch, targets, vocab]


def _save(directory, params):
  ckpt = checkpoints.Checkpointer(str(directory))
  ckpt.save(3, {"params": params, "step": jnp.int32(3)}, {"batches_consumed": 3}, force=True)
  ckpt.close()


@pytest.mark.parametrize("src,dst", [(PLAIN, SCANNED_FUSED), (SCANNED_FUSED, PLAIN)],
                         ids=["unrolled_to_scanned", "scanned_to_unrolled"])
def test_checkpoints_load_converted_into_the_other_layout(tmp_path, capsys, src, dst):
  """A checkpoint written in one layout starts a run (INITIAL_CHECKPOINT_PATH) and is
  evaluated (eval / infer's restore) in the other: every parameter restored, and the
  model computes the logits of the model that wrote it."""
  saved = _random_params(src)
  _save(tmp_path, saved)
  fresh = _random_params(dst, seed=1)
  params, report = checkpoints.restore_matching_params(str(tmp_path), fresh)
  names = sorted(checkpoints.architecture_of(fresh))
  assert sorted(report["restored"]) == names
  assert report["initialised"] == [] and report["unused"] == []
  assert report["converted"] == (f"scan_layers: {src.scan_layers} -> {dst.scan_layers}, "
                                 f"fused_qkv: {src.fused_qkv} -> {dst.fused_qkv}")
  train_state.start_from(str(tmp_path), fresh)
  assert f"converted the checkpoint's layout: {report['converted']}" in capsys.readouterr().out
  ckpt = checkpoints.Checkpointer(str(tmp_path))
  evaluated = ckpt.restore_params(3, checkpoints.abstract_like(fresh))
  ckpt.close()
  _assert_trees_close(evaluated, params, exact=True)
  _assert_close_up_to_reordering(_logits(dst, params), _logits(src, saved), "logits")


def test_eval_restore_still_refuses_another_architecture_after_conversion(tmp_path):
  _save(tmp_path, _random_params(PLAIN))
  wider = dataclasses.replace(SCANNED_FUSED, mlp_dim=64)
  ckpt = checkpoints.Checkpointer(str(tmp_path))
  with pytest.raises(checkpoints.ArchitectureMismatchError,
                     match=r"(?s)after converting its layout: scan_layers: False -> True.*"
                           r"shape differs: +encoder/layers/mlp/wi_0/kernel.*Use a new MODEL_DIR"):
    ckpt.restore_params(3, _own_layout(wider)["params"])
  ckpt.close()
