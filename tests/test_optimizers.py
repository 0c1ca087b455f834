"""decal_jax.runtime.optimizers: learning-rate schedules against their formulas worked by hand,
AdamW against numpy, and the update wrappers (scaled parts) against the plain optimizer."""
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decal_jax.runtime import optimizers


def test_rsqrt_schedule_hand_worked():
  lr = optimizers.rsqrt_schedule(base_learning_rate=2.0, warmup_steps=100)
  # ramp: 2 * (step / 100) / sqrt(100); after: 2 / sqrt(step)
  for step, want in ((0, 0.0), (50, 0.1), (100, 0.2), (400, 0.1), (10_000, 0.02)):
    assert abs(float(lr(step)) - want) < 1e-6


def test_adamw_step_matches_numpy():
  opt = optimizers.adamw(lambda step: 0.1, weight_decay=0.01, grad_clip_norm=None)
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  grads = {"w": jnp.array([0.5, 0.25, -1.0])}
  updates, _ = opt.update(grads, opt.init(params), params)
  g, w = np.array([0.5, 0.25, -1.0]), np.array([1.0, -2.0, 3.0])
  m, v = 0.1 * g, 0.001 * g ** 2
  m_hat, v_hat = m / 0.1, v / 0.001
  want = -0.1 * (m_hat / (np.sqrt(v_hat) + 1e-8) + 0.01 * w)
  # Elementwise float32 against float64, no sums: deterministic on every CPU. The gap
  # (6.6e-6 relative) is the float32 bias correction 1 - 0.999 (1.3e-5 off), halved by sqrt.
  np.testing.assert_allclose(np.asarray(updates["w"]), want, rtol=1e-5)


def test_cosine_schedule_hand_worked():
  lr = optimizers.cosine_schedule(base_learning_rate=1e-4, warmup_steps=2000,
                                  decay_steps=150_000)
  # ramp 1e-4 * step / 2000; then 1e-4 * (1 + cos(pi * t)) / 2, t = (step - 2000) / 150000
  # (t = 1/3: cos = 1/2 -> 0.75; t = 1/2: cos = 0 -> 0.5); flat at 0 after the period.
  for step, want in ((0, 0.0), (500, 2.5e-5), (2000, 1e-4), (52_000, 7.5e-5),
                     (77_000, 5e-5), (152_000, 0.0), (300_000, 0.0)):
    assert float(lr(step)) == pytest.approx(want, rel=1e-6, abs=1e-12), step
  floor = optimizers.cosine_schedule(1.0, warmup_steps=0, decay_steps=10, final_fraction=0.1)
  # f + (1 - f) * (1 + cos(pi * step / 10)) / 2 with f = 0.1
  for step in (0, 3, 5, 10, 20):
    want = 0.1 + 0.9 * (1 + math.cos(math.pi * min(step, 10) / 10)) / 2
    assert float(floor(step)) == pytest.approx(want, rel=1e-6), step


def numpy_warmup_cosine(step, base, warmup, decay, final_fraction):
  """The schedule re-derived in numpy: a linear ramp over `warmup` steps, then a half-cosine
  from base to final_fraction * base over the next `decay` steps, flat after."""
  step = np.asarray(step, np.float64)
  ramp = base * step / max(warmup, 1)
  t = np.clip((step - warmup) / decay, 0.0, 1.0)
  cosine = base * (final_fraction + (1 - final_fraction) * 0.5 * (1 + np.cos(np.pi * t)))
  return np.where(step < warmup, ramp, cosine)


@pytest.mark.parametrize("base, warmup, decay, final_fraction",
                         [(3e-3, 2, 50, 0.0), (1e-4, 2000, 150_000, 0.0), (1.0, 0, 10, 0.1),
                          (0.5, 7, 13, 0.25)])
def test_cosine_schedule_matches_numpy(base, warmup, decay, final_fraction):
  lr = optimizers.cosine_schedule(base, warmup_steps=warmup, decay_steps=decay,
                                  final_fraction=final_fraction)
  steps = sorted({0, 1, warmup // 2, max(warmup - 1, 0), warmup, warmup + 1,
                  warmup + decay // 3, warmup + decay // 2, warmup + decay - 1, warmup + decay,
                  2 * (warmup + decay)})
  got = np.array([float(lr(s)) for s in steps])
  want = numpy_warmup_cosine(steps, base, warmup, decay, final_fraction)
  # float32 schedule against float64: cos near pi / 2 is the worst case, a few ulps of base.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * base)


def test_cosine_schedule_refuses_bad_settings():
  with pytest.raises(ValueError, match="decay_steps >= 1"):
    optimizers.cosine_schedule(warmup_steps=10, decay_steps=0)
  with pytest.raises(ValueError, match="final_fraction"):
    optimizers.cosine_schedule(final_fraction=1.5)


def test_scaled_updates_multiply_only_the_named_part():
  params = {"scorer": {"w": jnp.ones(3)}, "stack": {"w": jnp.ones(3)}}
  grads = {"scorer": {"w": jnp.array([0.1, -2.0, 3.0])}, "stack": {"w": jnp.array([1., 2., -3.])}}
  base = optax.adam(1e-2)
  plain, _ = base.update(grads, base.init(params), params)
  scaled_opt = optimizers.scaled_updates(base, {"scorer": 0.01})
  scaled, _ = scaled_opt.update(grads, scaled_opt.init(params), params)
  # Elementwise float32 Adam in two compiled programs, no sums: they may round a step
  # differently (1 ulp seen here), never by much; 1e-6 is 8 ulps.
  np.testing.assert_allclose(scaled["scorer"]["w"], 0.01 * plain["scorer"]["w"], rtol=1e-6)
  np.testing.assert_allclose(scaled["stack"]["w"], plain["stack"]["w"], rtol=1e-6)
  with pytest.raises(ValueError, match="positive"):
    optimizers.scaled_updates(base, {"scorer": 0.0})


def test_trains_matches_fragments_of_the_slash_joined_path_hand_worked():
  """The rule TRAIN_PARTS freezes by, in decal_jax's trainer and T5X's (t5x_optimizers):
  a fragment anywhere in 'key/key/...' (so 'decoder' is in 'small_decoder' too)."""
  squid = ["small_decoder", "memory_tokens", "projector"]
  cases = [((("large_decoder", "layers_0", "mlp", "wi_0", "kernel"), squid), False),
           ((("small_decoder", "layers_0", "mlp", "wi_0", "kernel"), squid), True),
           ((("projector", "bias_0"), squid), True),
           ((("memory_tokens", "memory_embeddings"), squid), True),
           ((("large_decoder", "token_embedder", "embedding"), ["decoder"]), True),
           ((("stack", 0, "lora_a"), ["lora_"]), True),  # a list index is a key too
           ((("stack", 1, "kernel"), ["stack/1"]), True),
           ((("stack", 1, "kernel"), ["stack/0"]), False),
           ((("projector", "bias_0"), []), False)]
  assert [optimizers.trains(*args) for args, _ in cases] == [want for _, want in cases]


def test_partially_frozen_refuses_parts_that_name_no_parameter():
  params = {"small_decoder": {"w": jnp.ones(2)}, "projector": [jnp.ones(2)]}
  with pytest.raises(ValueError, match=r"any of \['projecter'\].*parts here: "
                                       r"\['projector', 'small_decoder'\]"):
    optimizers.partially_frozen(optax.sgd(1.0), ("projecter",)).init(params)
  with pytest.raises(ValueError, match="at least one"):
    optimizers.partially_frozen(optax.sgd(1.0), ())
  # a misspelled part beside a right one: refused when each part must match (TRAIN_PARTS)
  optimizers.partially_frozen(optax.sgd(1.0), ("projector", "projecter")).init(params)
  with pytest.raises(ValueError, match=r"no parameter path contains \['projecter'\], so "
                                       "those parts would stay frozen"):
    optimizers.partially_frozen(optax.sgd(1.0), ("projector", "projecter"),
                                each_part_must_match=True).init(params)
  opt = optimizers.partially_frozen(optax.sgd(1.0), ("projector/0",))  # the list's item
  updates, _ = opt.update(jax.tree_util.tree_map(jnp.ones_like, params), opt.init(params))
  assert [float(u[0]) for u in jax.tree_util.tree_leaves(updates)] == [-1.0, 0.0]


def test_each_optimizer_carries_its_schedule_for_the_trainer_to_log():
  cosine = optimizers.cosine_schedule(1e-3, warmup_steps=10, decay_steps=100)
  adamw = optimizers.adamw(cosine)
  assert optimizers.schedule_of(adamw) is cosine
  assert optimizers.schedule_of(optimizers.adafactor(cosine)) is cosine
  assert optimizers.schedule_of(optimizers.partially_frozen(adamw, ("w",))) is cosine
  assert optimizers.schedule_of(optimizers.scaled_updates(adamw, {"w": 0.5})) is cosine
  assert float(optimizers.schedule_of(optimizers.adamw(0.25))(1000)) == 0.25  # a constant
  default = optimizers.schedule_of(optimizers.adafactor())  # T5's rsqrt, 10k warm-up steps
  assert float(default(40_000)) == pytest.approx(1 / math.sqrt(40_000), rel=1e-6)
  assert optimizers.schedule_of(optax.sgd(0.1)) is None  # not built here: nothing to log
  # The attached schedule changes nothing about the updates.
  params, grads = {"w": jnp.ones(3)}, {"w": jnp.array([0.5, -1.0, 2.0])}
  plain = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(cosine, weight_decay=0.01))
  np.testing.assert_array_equal(adamw.update(grads, adamw.init(params), params)[0]["w"],
                                plain.update(grads, plain.init(params), params)[0]["w"])


def numpy_adafactor_step(param, grad, v_row, v_col, step, lr, rows, cols, batch=()):
  """One Adafactor step re-derived in float64 (Shazeer & Stern 2018; T5X's `Adafactor`
  with decay_rate 0.8, clipping 1.0, parameter scale, no momentum), the second moment
  factored into row statistics (averaged over `cols`) and column statistics (over `rows`);
  the clipping and parameter RMS taken per slice of the `batch` axes."""
  over = tuple(i for i in range(param.ndim) if i not in batch)
  rms = lambda x: np.sqrt(np.mean(x ** 2, axis=over, keepdims=True))
  decay = 1.0 - (step + 1.0) ** -0.8
  g2 = grad ** 2 + 1e-30
  v_row = decay * v_row + (1 - decay) * g2.mean(axis=cols)
  v_col = decay * v_col + (1 - decay) * g2.mean(axis=rows)
  rows_in_v_row = tuple(r - sum(c < r for c in cols) for r in rows)
  r = np.expand_dims(v_row / v_row.mean(axis=rows_in_v_row, keepdims=True), cols)
  c = np.expand_dims(v_col, rows)  # both back to param rank
  y = grad / np.sqrt(r * c)
  y = y / np.maximum(1.0, rms(y))  # update clipping at RMS 1
  scale = lr * np.maximum(rms(param), 1e-3)  # relative step
  return param - scale * y, v_row, v_col


@pytest.mark.parametrize("names, rows, cols", [(("embed", "heads", "kv"), (0,), (1, 2)),
                                               (("heads", "kv", "embed"), (2,), (0, 1))])
def test_adafactor_factors_attention_kernels_by_axis_names_as_t5x(names, rows, cols):
  """With the model's axis names, a rank-3 attention kernel keeps statistics [embed] and
  [heads, kv] (T5X's standard factor rules; optax's heuristic keeps a full one), and two
  steps equal the float64 re-derivation."""
  from flax.linen.partitioning import AxisMetadata
  rng = np.random.RandomState(0)
  shape = (8, 2, 3) if rows == (0,) else (2, 3, 8)
  param = rng.randn(*shape)
  grads = [rng.randn(*shape) for _ in range(2)]
  opt = optimizers.adafactor(lambda step: 0.1)
  optimizers.set_param_axes(opt, {"attn": {"kernel_axes": AxisMetadata(names)}})
  p = {"attn": {"kernel": jnp.asarray(param, jnp.float32)}}
  state = opt.init(p)
  factored = state[0]
  assert factored.v_row["attn"]["kernel"].shape == (8,)
  assert factored.v_col["attn"]["kernel"].shape == (2, 3)
  assert factored.v["attn"]["kernel"].shape == (1,)  # no full-size statistics
  want, v_row, v_col = param, np.zeros(8), np.zeros((2, 3))
  for step, g in enumerate(grads):
    updates, state = opt.update({"attn": {"kernel": jnp.asarray(g, jnp.float32)}}, state, p)
    p = optax.apply_updates(p, updates)
    want, v_row, v_col = numpy_adafactor_step(want, g, v_row, v_col, step, 0.1, rows, cols)
  # float32 means of 6-48 terms against float64: a few ulps of values near 1.
  np.testing.assert_allclose(np.asarray(p["attn"]["kernel"]), want, rtol=2e-5, atol=2e-6)


def test_adafactor_without_axis_names_is_optax_adafactor():
  """Before `set_param_axes` (or for an optimizer used outside the trainer) every array is
  factored by the two-largest-axes heuristic: the same updates as optax's adafactor, to the
  bit, including a rank-3 array that stays unfactored."""
  rng = np.random.RandomState(1)
  params = {"k3": jnp.asarray(rng.randn(256, 4, 8), jnp.float32),
            "m": jnp.asarray(rng.randn(256, 128), jnp.float32),
            "s": jnp.asarray(rng.rand(16) + 0.5, jnp.float32)}
  grads = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.randn(*x.shape), jnp.float32), params)
  ours = optimizers.adafactor(lambda step: 0.01)
  plain = optax.adafactor(learning_rate=lambda step: 0.01, min_dim_size_to_factor=128,
                          momentum=None)
  with pytest.warns(UserWarning, match="never given the model's logical axis names"):
    state = ours.init(params)  # the rank-3 array: says it is not factored by names
  a, _ = ours.update(grads, state, params)
  b, _ = plain.update(grads, plain.init(params), params)
  for key in params:
    np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))


def test_a_plain_optax_chain_hides_adafactor_from_set_param_axes_and_says_so():
  """set_param_axes cannot see into optax.chain: init warns, naming decal_jax's `chain`,
  and the [embed, heads, kv] kernel keeps a full second moment; `optimizers.chain` keeps
  the names (no warning, [embed] and [heads, kv] statistics) and the schedule."""
  params, axes, _ = _attention_case()
  p = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
  hidden = optax.chain(optimizers.adafactor(lambda step: 0.1), optax.scale(0.5))
  optimizers.set_param_axes(hidden, axes)
  with pytest.warns(UserWarning, match=r"optimizers\.chain"):
    state = hidden.init(p)
  assert (8, 2, 3) in [x.shape for x in jax.tree_util.tree_leaves(state)]
  kept = optimizers.chain(optimizers.adafactor(lambda step: 0.1 + step), optax.scale(0.5))
  optimizers.set_param_axes(kept, axes)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    shapes = [x.shape for x in jax.tree_util.tree_leaves(kept.init(p))]
  assert (8,) in shapes and (2, 3) in shapes and (8, 2, 3) not in shapes
  assert optimizers.schedule_of(kept)(3) == pytest.approx(3.1)


def _fused_qkv_case():
  """A fused QKV kernel [embed, stack, heads, kv] whose q, k and v slices have parameter
  and gradient scales 100x apart, and its numpy re-derivation's arguments."""
  rng = np.random.RandomState(2)
  scales = np.array([1.0, 0.01, 5.0])[None, :, None, None]
  param = rng.randn(8, 3, 2, 4) * scales
  grads = [rng.randn(8, 3, 2, 4) * scales[..., ::-1] * (1 + 20 * (step == 1))
           for step in range(3)]
  return param, grads


def test_adafactor_clips_and_scales_each_stack_slice_of_a_fused_kernel_as_t5x():
  """T5X's Adafactor takes the update-clipping and parameter-scale RMS of a fused
  [embed, stack, heads, kv] kernel per 'stack' slice (q, k, v on their own): three steps
  equal the float64 re-derivation with per-slice RMS, and differ from the whole-array one."""
  from flax.linen.partitioning import AxisMetadata
  param, grads = _fused_qkv_case()
  opt = optimizers.adafactor(lambda step: 0.1)
  optimizers.set_param_axes(opt, {"qkv": {"kernel_axes": AxisMetadata(
      ("embed", "stack", "heads", "kv"))}})
  p = {"qkv": {"kernel": jnp.asarray(param, jnp.float32)}}
  state = opt.init(p)
  assert state[0].v_row["qkv"]["kernel"].shape == (8, 3)  # [embed, stack]
  assert state[0].v_col["qkv"]["kernel"].shape == (3, 2, 4)  # [stack, heads, kv]
  want = whole = param
  stats = stats_whole = (np.zeros((8, 3)), np.zeros((3, 2, 4)))
  for step, g in enumerate(grads):
    updates, state = opt.update({"qkv": {"kernel": jnp.asarray(g, jnp.float32)}}, state, p)
    p = optax.apply_updates(p, updates)
    want, *stats = numpy_adafactor_step(want, g, *stats, step, 0.1, (0,), (2, 3), batch=(1,))
    whole, *stats_whole = numpy_adafactor_step(whole, g, *stats_whole, step, 0.1, (0,), (2, 3))
  got = np.asarray(p["qkv"]["kernel"])
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
  assert np.abs(got - whole).max() > 100 * np.abs(got - want).max()  # the test tells them apart


def _attention_case():
  """Params {'attn': [embed 8, heads 2, kv 3] kernel, 'base': matrix}, their axis names and
  two gradients."""
  from flax.linen.partitioning import AxisMetadata
  rng = np.random.RandomState(3)
  params = {"attn": {"kernel": rng.randn(8, 2, 3)}, "base": {"w": rng.randn(4, 5)}}
  axes = {"attn": {"kernel_axes": AxisMetadata(("embed", "heads", "kv"))},
          "base": {"w_axes": AxisMetadata(("embed", "mlp"))}}
  grads = [jax.tree_util.tree_map(lambda x: rng.randn(*x.shape), params) for _ in range(2)]
  return params, axes, grads


@pytest.mark.parametrize("wrap, factor", [
    (lambda opt: optimizers.partially_frozen(opt, trainable=("attn",)), 1.0),
    (lambda opt: optimizers.scaled_updates(opt, {"attn": 0.5}), 0.5),
    (lambda opt: optimizers.with_schedule(opt, 0.1), 1.0),
    (lambda opt: optimizers.chain(opt, optax.scale(0.25)), 0.25)],
    ids=["partially_frozen", "scaled_updates", "with_schedule", "chain"])
def test_wrappers_pass_the_axis_names_on_to_adafactor(wrap, factor):
  """`set_param_axes` on `partially_frozen` / `scaled_updates` / `with_schedule` / `chain`
  of an adafactor reaches it: the [embed, heads, kv] kernel keeps [embed] and [heads, kv]
  statistics (by the shape heuristic it would keep a full one) and steps as the float64
  re-derivation of that factoring (times the wrapper's factor)."""
  params, axes, grads = _attention_case()
  opt = wrap(optimizers.adafactor(lambda step: 0.1))
  optimizers.set_param_axes(opt, axes)
  p = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
  state = opt.init(p)
  shapes = sorted(x.shape for x in jax.tree_util.tree_leaves(state) if x.ndim)
  assert (8,) in shapes and (2, 3) in shapes and (8, 2, 3) not in shapes
  want, v_row, v_col = params["attn"]["kernel"], np.zeros(8), np.zeros((2, 3))
  for step, g in enumerate(grads):
    g32 = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), g)
    updates, state = opt.update(g32, state, p)
    new, v_row, v_col = numpy_adafactor_step(want, g["attn"]["kernel"], v_row, v_col, step,
                                             0.1, (0,), (1, 2))
    np.testing.assert_allclose(np.asarray(updates["attn"]["kernel"]), factor * (new - want),
                               rtol=2e-5, atol=1e-6)
    p, want = optax.apply_updates(p, updates), want + factor * (new - want)


@pytest.mark.parametrize("names", [("embed", "heads", "length"), ("embed", "mystery", "kv")])
def test_adafactor_refuses_rows_and_columns_with_an_axis_that_is_neither(names):
  """T5X's 'Incomplete adafactor spec': a rank-3 kernel with a row axis, a column axis and
  one without a rule (or ruled 'none') has no factoring; refused at init, naming the axis."""
  from flax.linen.partitioning import AxisMetadata
  opt = optimizers.adafactor(0.1)
  optimizers.set_param_axes(opt, {"attn": {"kernel_axes": AxisMetadata(names)}})
  loose = [n for n in names if n not in ("embed", "heads", "kv")]
  with pytest.raises(ValueError, match=rf"attn/kernel .*\['{loose[0]}'\].*factor_rules"):
    opt.init({"attn": {"kernel": jnp.zeros((4, 2, 3))}})
  # a rule for the axis makes it factorable: 'batch' keeps its slices apart
  from decal_jax import partitioning
  opt = optimizers.adafactor(0.1, factor_rules=dict(partitioning.adafactor_factor_rules(),
                                                    **{loose[0]: "batch"}))
  optimizers.set_param_axes(opt, {"attn": {"kernel_axes": AxisMetadata(names)}})
  state = opt.init({"attn": {"kernel": jnp.zeros((4, 2, 3))}})
  assert state[0].v["attn"]["kernel"].shape == (1,)  # factored: no full-size statistics


def test_scanned_stacks_of_different_depths_step_like_their_unrolled_layers():
  """Scanned encoder and decoder stacks of 3 and 2 layers (one vmap cannot take both) take,
  layer by layer, the steps Adafactor takes on the unrolled layers; a stack-free tree and a
  tree whose stacks share one depth keep the state layouts checkpoints were written with."""
  rng = np.random.RandomState(0)
  enc, dec, emb = rng.randn(3, 8, 6), rng.randn(2, 8, 6), rng.randn(8, 6)
  stacked = {"encoder": {"layers": {"w": enc}}, "decoder": {"layers": {"w": dec}}, "emb": emb}
  unrolled = {"emb": emb, **{f"enc{i}": enc[i] for i in range(3)},
              **{f"dec{i}": dec[i] for i in range(2)}}
  grads = [jax.tree_util.tree_map(lambda x: rng.randn(*x.shape), stacked) for _ in range(3)]

  def run(params, grads_of):
    opt = optimizers.adafactor(lambda step: 0.1)
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
    state = opt.init(params)
    for g in grads:
      updates, state = opt.update(jax.tree_util.tree_map(
          lambda x: jnp.asarray(x, jnp.float32), grads_of(g)), state, params)
      params = optax.apply_updates(params, updates)
    return params, state

  got, state = run(stacked, lambda g: g)
  want, _ = run(unrolled, lambda g: {
      "emb": g["emb"], **{f"enc{i}": g["encoder"]["layers"]["w"][i] for i in range(3)},
      **{f"dec{i}": g["decoder"]["layers"]["w"][i] for i in range(2)}})
  for i in range(3):
    np.testing.assert_allclose(got["encoder"]["layers"]["w"][i], want[f"enc{i}"], atol=1e-6)
  for i in range(2):
    np.testing.assert_allclose(got["decoder"]["layers"]["w"][i], want[f"dec{i}"], atol=1e-6)
  np.testing.assert_allclose(got["emb"], want["emb"], atol=1e-6)
  assert set(state.inner_states) == {"rest", "stacked_2", "stacked_3"}
  same_depth = {"encoder": {"layers": {"w": enc[:2]}}, "decoder": {"layers": {"w": dec}}}
  layout = optimizers.adafactor(0.1).init(jax.tree_util.tree_map(jnp.asarray, same_depth))
  assert set(layout.inner_states) == {"rest", "stacked"}
