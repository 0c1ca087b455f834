"""decal_jax's Adafactor (`optimizers.adafactor`) against the real T5X's
`t5x.adafactor.Adafactor` on the same parameters, logical axis names and gradients.

Run with T5X importable (`PYTHONPATH=$PWD:/path/to/t5x-site`); skipped without it, as in
CI, where tests/test_optimizers.py holds the same factoring to float64 re-derivations."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

# `t5x.adafactor`, not `t5x`: without T5X, this tests/t5x folder imports as `t5x`.
pytest.importorskip("t5x.adafactor", reason="the real T5X is not importable: put a T5X "
                    "install on PYTHONPATH (docs/t5x.md) to run tests/t5x/")
from flax import traverse_util
from flax.linen import partitioning as flax_partitioning
from t5x import adafactor

from decal_jax.runtime import optimizers

# name: (shape, logical axis names)
PARAMS = {
    "attention/query/kernel": ((8, 2, 4), ("embed", "heads", "kv")),
    "attention/out/kernel": ((2, 4, 8), ("heads", "kv", "embed")),
    "attention/qkv_fused/kernel": ((8, 3, 2, 4), ("embed", "stack", "heads", "kv")),
    # nn.scan's stack: T5X factors it by names, ours each layer as the unrolled matrix (by
    # the heuristic), which agree when both sides are >= min_dim_size_to_factor (128).
    "encoder/layers/mlp/wi/kernel": ((2, 128, 136), ("layers", "embed", "mlp")),
    "mlp/wo/kernel": ((160, 130), ("mlp", "embed")),  # a matrix: T5X's shape heuristic
    "relpos/rel_embedding": ((2, 32), ("heads", "relpos_buckets")),
    "layer_norm/scale": ((8,), ("embed",)),
}


def _slice_scales(shape, flip: bool) -> np.ndarray:
  """Scales 1, 0.01, 5 (reversed when `flip`) along axis 1, broadcastable to `shape`."""
  if len(shape) < 2:
    return np.ones(shape)
  scales = np.resize([1.0, 0.01, 5.0], shape[1])
  return (scales[::-1] if flip else scales).reshape((1, -1) + (1,) * (len(shape) - 2))


def _case():
  """(params, params_axes, three gradients), float32. Slices along axis 1 are scaled 100x
  apart, so that clipping and parameter scale per 'stack' / 'layers' slice matter; the
  second gradient is 21x the others, so that clipping acts."""
  rng = np.random.RandomState(0)
  draw = lambda shape, flip: rng.randn(*shape) * _slice_scales(shape, flip)
  params = {k: draw(shape, False) for k, (shape, _) in PARAMS.items()}
  grads = [{k: draw(shape, True) * (1 + 20 * (step == 1)) for k, (shape, _) in PARAMS.items()}
           for step in range(3)]
  axes = {k + "_axes": flax_partitioning.AxisMetadata(names)
          for k, (_, names) in PARAMS.items()}
  def as32(flat):
    return traverse_util.unflatten_dict(
        {k: jnp.asarray(v, jnp.float32) for k, v in flat.items()}, sep="/")
  return as32(params), traverse_util.unflatten_dict(axes, sep="/"), [as32(g) for g in grads]


def test_three_steps_equal_t5x_adafactor_with_axis_names():
  """Factoring by axis names (rank-3 attention kernels, a fused kernel's 'stack' axis, a
  scanned 'layers' axis), the matrix heuristic, unfactored vectors, per-slice clipping and
  parameter scale: three steps of ours equal T5X's to float32 rounding."""
  params, params_axes, grads = _case()
  theirs = adafactor.Adafactor(learning_rate=0.1, decay_rate=0.8, step_offset=0,
                               logical_factor_rules=adafactor.standard_logical_factor_rules())
  theirs.set_param_axes(flax_partitioning.get_axis_names(params_axes))
  ours = optimizers.adafactor(lambda step: 0.1)
  optimizers.set_param_axes(ours, params_axes)
  p_theirs, s_theirs = params, theirs.init_state(params)
  p_ours, s_ours = params, ours.init(params)
  for g in grads:
    p_theirs, s_theirs = theirs.apply_gradient(theirs.hyper_params, p_theirs, s_theirs, g)
    updates, s_ours = ours.update(g, s_ours, p_ours)
    p_ours = optax.apply_updates(p_ours, updates)
  flat = lambda tree: dict(jax.tree_util.tree_flatten_with_path(tree)[0])
  start, flat_ours = flat(params), flat(p_ours)
  for path, want in flat(p_theirs).items():
    got = flat_ours[path]
    assert np.abs(np.asarray(want) - np.asarray(start[path])).max() > 1e-3  # it moved
    # Two float32 orderings of the same means: a few ulps (measured: <= 1e-6 at |x| < 32).
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6,
                               err_msg=jax.tree_util.keystr(path))

