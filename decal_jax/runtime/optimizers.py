"""Optimizers and learning-rate schedules (T5 defaults), built on optax.

Each optimizer built here carries its schedule (`schedule_of`), which the trainer logs to
TensorBoard as `learning_rate`."""
import warnings
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax


def rsqrt_schedule(base_learning_rate: float = 1.0, warmup_steps: int = 10_000,
                   offset: int = 0) -> Callable:
  """T5's inverse-square-root decay with a linear warm-up.

  lr(step) = base * min(step / warmup, 1) / sqrt(max(step, warmup)): a linear ramp to
  base / sqrt(warmup) at `warmup_steps`, then base / sqrt(step).
  """
  def schedule(step):
    step = jnp.maximum(jnp.asarray(step, jnp.float32) - offset, 0.0)
    warm = jnp.minimum(step / max(warmup_steps, 1), 1.0)
    return base_learning_rate * warm / jnp.sqrt(jnp.maximum(step, float(warmup_steps)))
  return schedule


def cosine_schedule(base_learning_rate: float = 1e-4, warmup_steps: int = 2000,
                    decay_steps: int = 150_000, final_fraction: float = 0.0) -> Callable:
  """Linear warm-up, then one half-cosine (Loshchilov & Hutter's annealing, no restarts):
  `optax.warmup_cosine_decay_schedule`, with `decay_steps` counted after the warm-up.

  lr(step) = base * step / warmup for step < warmup; then, with t = min(step - warmup,
  decay_steps) / decay_steps, base * (f + (1 - f) * (1 + cos(pi * t)) / 2), f =
  `final_fraction`: from base down to f * base over `decay_steps`, flat afterwards.
  Dodo's recipe (dodo.md appendix B): base 1e-4, 2,000 warm-up steps, period 150k steps.
  """
  if warmup_steps < 0 or decay_steps < 1:
    raise ValueError(f"cosine_schedule needs warmup_steps >= 0 and decay_steps >= 1, got "
                     f"{warmup_steps} and {decay_steps}.")
  if not 0.0 <= final_fraction <= 1.0:
    raise ValueError(f"final_fraction must lie in [0, 1], got {final_fraction}.")
  # optax counts its decay_steps from step 0, warm-up included.
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=base_learning_rate, warmup_steps=warmup_steps,
      decay_steps=warmup_steps + decay_steps, end_value=final_fraction * base_learning_rate)


class Scheduled(optax.GradientTransformation):
  """An optax transformation that also carries its learning-rate schedule (step -> rate)."""


def with_schedule(optimizer: optax.GradientTransformation,
                  learning_rate: Union[float, Callable, None]) -> Scheduled:
  """`optimizer` with `learning_rate` (a schedule or a constant) attached for logging. The
  logical axis names holder of an `adafactor` inside (`param_axes`) is kept, so that
  `set_param_axes` reaches it through every wrapper built here."""
  scheduled = Scheduled(optimizer.init, optimizer.update)
  if learning_rate is not None and not callable(learning_rate):
    scheduled.learning_rate = lambda step, rate=float(learning_rate): rate
  else:
    scheduled.learning_rate = learning_rate
  scheduled.param_axes = getattr(optimizer, "param_axes", None)
  return scheduled


def schedule_of(optimizer) -> Optional[Callable]:
  """The learning-rate schedule of an optimizer built here; None for any other optax one."""
  return getattr(optimizer, "learning_rate", None)


def adafactor(learning_rate: Union[float, Callable, None] = None, decay_rate: float = 0.8,
              clipping_threshold: Optional[float] = 1.0,
              multiply_by_parameter_scale: bool = True, min_dim_size_to_factor: int = 128,
              factor_rules: Optional[Mapping[str, str]] = None,
              factor_by_axis_names: bool = True) -> optax.GradientTransformation:
  """T5's Adafactor: factored second moments, no momentum, update clipping, relative step.

  Which axes a parameter's second moment is factored over follows T5X's Adafactor: a
  parameter of rank > 2 is factored by its logical axis names (`factor_rules`, default
  `partitioning.adafactor_factor_rules()`: 'embed' a row axis; 'heads', 'kv', 'mlp',
  'vocab' column axes; 'stack' a batch axis kept apart), so an attention kernel
  `[embed, heads, kv]` keeps statistics `[embed]` and `[heads, kv]` instead of a full
  `[embed, heads, kv]` one; a matrix is factored over its two largest axes when both are
  >= `min_dim_size_to_factor` (T5X's and optax's heuristic). As in T5X, each slice of a
  batch axis (a fused `[embed, stack, heads, kv]` QKV kernel's q, k and v) is clipped and
  scaled by its own RMS. The names come from the model's `params_axes` (`set_param_axes`,
  which `train_state.init_state` calls, also through `partially_frozen` /
  `scaled_updates`); until they are set, every parameter is factored by the heuristic
  (optax's `adafactor`, rank > 2 unfactored). `factor_by_axis_names=False` keeps the
  heuristic for good: the optimizer state of checkpoints written before this factoring
  (decal_jax before 0.1.0's change; their attention kernels have full second moments),
  which a resume must read back.

  Parameters stacked by `nn.scan` (T5Config.scan_layers) are updated one layer at a time
  (`per_layer`), so a scanned run takes the same steps as the unrolled one."""
  learning_rate = learning_rate or rsqrt_schedule()
  axes = _ParamAxes(factor_rules, enabled=factor_by_axis_names)
  step = scale_by_adafactor(axes, learning_rate, decay_rate, clipping_threshold,
                            multiply_by_parameter_scale, min_dim_size_to_factor)
  scheduled = with_schedule(per_layer(step), learning_rate)
  scheduled.param_axes = axes
  return scheduled


def set_param_axes(optimizer, params_axes) -> None:
  """Gives an optimizer built here the model's logical axis names (the `params_axes`
  collection), which `adafactor` factors by; other optimizers ignore them."""
  holder = getattr(optimizer, "param_axes", None)
  if isinstance(holder, _ParamAxes):
    holder.set(params_axes)


Dims = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (row axes, column axes)


class _ParamAxes:
  """Logical axis names per parameter path, set once the model is known (T5X's
  `Adafactor.set_param_axes`), and the factoring they imply."""

  def __init__(self, rules: Optional[Mapping[str, str]], enabled: bool = True):
    self.rules = dict(rules) if rules is not None else None
    self.enabled = enabled
    self.names: Dict[Tuple[str, ...], Tuple[str, ...]] = {}
    self.was_set = False

  def set(self, params_axes) -> None:
    self.was_set = True
    if not self.enabled:
      return
    from decal_jax import partitioning
    self.names = partitioning._flat_axes(params_axes)
    if self.rules is None:
      self.rules = partitioning.adafactor_factor_rules()

  def factoring(self, path, shape: Sequence[int], min_dim: int) -> Tuple[Optional[Dims],
                                                                         Tuple[int, ...]]:
    """((row axes, column axes) of the factored statistics, or None: unfactored; the batch
    axes, whose slices keep their own clipping and parameter-scale RMS), as T5X's
    `Adafactor._parse_rule`."""
    names = self.names.get(tuple(str(getattr(k, "key", k)) for k in path))
    if names is not None and len(names) == len(shape) + 1 and "layers" in names:
      names = tuple(n for n in names if n != "layers")  # a slice of a scanned stack
    kinds = [self.rules.get(n, "none") for n in names] if names else None
    if kinds is None or (len(shape) <= 2 and "batch" not in kinds):
      # T5X factors a scanned [layers, a, b] stack by its names even below
      # min_dim; a slice here takes the heuristic, the steps of the unrolled matrix.
      return _two_largest(shape, min_dim), ()
    if len(kinds) != len(shape):
      raise ValueError(f"Parameter {path}: {len(names)} axis names {names} for shape {shape}.")
    rows = tuple(i for i, kind in enumerate(kinds) if kind == "row")
    cols = tuple(i for i, kind in enumerate(kinds) if kind == "column")
    batch = tuple(i for i, kind in enumerate(kinds) if kind == "batch")
    loose = [n for n, kind in zip(names, kinds) if kind == "none"]
    if rows and cols and loose:  # T5X: "Incomplete adafactor spec"
      raise ValueError(
          f"Parameter {'/'.join(str(getattr(k, 'key', k)) for k in path)} has axis names "
          f"{names}, factored as {tuple(kinds)}: rows and columns, and {loose} that are "
          "neither (no rule, or 'none'), so its second moments cannot be factored. Give "
          f"{loose} a factor rule ('row', 'column' or 'batch') in "
          "adafactor(factor_rules=...), as T5X's logical_factor_rules, which refuses "
          "this spec too.")
    return ((rows, cols) if rows and cols else None), batch



def _two_largest(shape: Sequence[int], min_dim: int) -> Optional[Dims]:
  """The heuristic: factor the two largest axes (second largest, largest) if both >= min_dim."""
  if len(shape) < 2:
    return None
  order = np.argsort(shape)
  if shape[order[-2]] < min_dim:
    return None
  return (int(order[-2]),), (int(order[-1]),)


def scale_by_adafactor(axes: _ParamAxes, learning_rate: Union[float, Callable],
                       decay_rate: float = 0.8, clipping_threshold: Optional[float] = 1.0,
                       multiply_by_parameter_scale: bool = True, min_dim: int = 128,
                       epsilon: float = 1e-30) -> optax.GradientTransformation:
  """Adafactor's update of every array in one function (`_adafactor_one`): the gradient
  divided by the root of its (factored) second-moment estimate, clipped to RMS
  `clipping_threshold`, times the learning rate and the parameter's RMS (at least 1e-3),
  negated. Clipping and parameter RMS are taken per slice of the batch axes
  (`_ParamAxes.factoring`).

  Its state has the layout of the optax chain that computed these steps one by one before
  (`_state_layout`: `FactoredState`, empty clipping state, the schedule's count, ...), so
  checkpoints written by it resume."""
  layout = _state_layout(axes, learning_rate, clipping_threshold, multiply_by_parameter_scale,
                         min_dim)
  rate_at = 1 + (clipping_threshold is not None)  # the schedule's state in the chain

  def update(grads, state, params=None):
    if params is None and multiply_by_parameter_scale:
      raise ValueError(optax.NO_PARAMS_MSG)
    factored = state[0]
    rate = (learning_rate(state[rate_at].count) if callable(learning_rate)
            else learning_rate)
    decay = 1.0 - (factored.count.astype(jnp.float32) + 1.0) ** -decay_rate
    params = grads if params is None else params  # unread without the parameter scale
    outputs = jax.tree_util.tree_map_with_path(
        lambda path, g, p, v_row, v_col, v: _adafactor_one(
            g, p, v_row, v_col, v, decay, rate, *axes.factoring(path, g.shape, min_dim),
            clipping_threshold, multiply_by_parameter_scale, epsilon),
        grads, params, factored.v_row, factored.v_col, factored.v)
    updates = jax.tree_util.tree_map(lambda o: o[0], outputs, is_leaf=_is_result)
    new = list(state)
    new[0] = _factored_state(optax.safe_int32_increment(factored.count), jax.tree_util.tree_map(
        lambda o: o[1:], outputs, is_leaf=_is_result))
    if callable(learning_rate):
      new[rate_at] = optax.ScaleByScheduleState(
          count=optax.safe_int32_increment(state[rate_at].count))
    return updates, tuple(new)

  return optax.GradientTransformation(layout.init, update)


def _state_layout(axes, learning_rate, clipping_threshold, multiply_by_parameter_scale,
                  min_dim) -> optax.GradientTransformation:
  """The chain whose state `scale_by_adafactor` keeps (only its `init` is used)."""
  def init(params):
    if axes.enabled and not axes.was_set and any(
        p.ndim > 2 for p in jax.tree_util.tree_leaves(params)):
      warnings.warn(
          "adafactor was never given the model's logical axis names (set_param_axes), so "
          "its parameters of rank > 2 keep full second moments (optax's shape heuristic) "
          "instead of T5X's factoring by axis names. decal_jax's trainer sets them; an "
          "adafactor inside a plain optax.chain or another wrapper cannot be reached: "
          "build the chain with decal_jax.runtime.optimizers.chain(...), or call "
          "set_param_axes on the adafactor itself before init.", stacklevel=3)

    def one(path, p):
      dims, _ = axes.factoring(path, p.shape, min_dim)
      small = jnp.zeros((1,), p.dtype)
      if dims is None:
        return small, small, jnp.zeros_like(p)
      rows, cols = dims
      return (jnp.zeros(np.delete(p.shape, cols), p.dtype),
              jnp.zeros(np.delete(p.shape, rows), p.dtype), small)
    return _factored_state(jnp.zeros([], jnp.int32), jax.tree_util.tree_map_with_path(
        one, params))

  chain = [optax.GradientTransformation(init, None)]
  if clipping_threshold is not None:
    chain.append(optax.clip_by_block_rms(clipping_threshold))
  chain.append(optax.scale_by_learning_rate(learning_rate, flip_sign=False))
  if multiply_by_parameter_scale:
    chain.append(optax.scale_by_param_block_rms())
  chain.append(optax.scale(-1.0))
  return optax.chain(*chain)


def _is_result(x) -> bool:
  return isinstance(x, tuple) and len(x) == 4 and not hasattr(x, "_fields")


def _factored_state(count, triples):
  pick = lambda i: jax.tree_util.tree_map(
      lambda t: t[i], triples, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 3)
  return optax.FactoredState(count=count, v_row=pick(0), v_col=pick(1), v=pick(2))


def _adafactor_one(g, p, v_row, v_col, v, decay, rate, dims, batch, clipping_threshold,
                   multiply_by_parameter_scale, epsilon):
  """(update, new v_row, new v_col, new v) of one array. With rows R and columns C
  (`dims`), v_row (the squared gradient + epsilon averaged over C) and v_col (over R) decay
  with `decay`, and the gradient is divided by sqrt(v_row / mean_R(v_row) * v_col);
  unfactored, v of the array's shape, and it is divided by sqrt(v). RMS over all axes but
  `batch`."""
  g_sqr = jnp.square(g) + epsilon
  if dims is None:
    v = decay * v + (1.0 - decay) * g_sqr  # same shape as g
    y = g * v ** -0.5
  else:
    rows, cols = dims
    v_row = decay * v_row + (1.0 - decay) * jnp.mean(g_sqr, axis=cols)  # g without C axes
    v_col = decay * v_col + (1.0 - decay) * jnp.mean(g_sqr, axis=rows)  # g without R axes
    rows_left = tuple(r - sum(c < r for c in cols) for r in rows)  # R's place in v_row
    row_factor = (v_row / jnp.mean(v_row, axis=rows_left, keepdims=True)) ** -0.5
    y = g * jnp.expand_dims(row_factor, cols) * jnp.expand_dims(v_col ** -0.5, rows)
  over = tuple(i for i in range(g.ndim) if i not in batch)  # one RMS per batch slice
  rms = lambda x: jnp.sqrt(jnp.mean(jnp.square(x), axis=over, keepdims=True))
  if clipping_threshold is not None:
    y = y / jnp.maximum(1.0, rms(y) / clipping_threshold)
  y = jnp.asarray(rate, y.dtype) * y
  if multiply_by_parameter_scale:
    y = y * jnp.maximum(rms(p), 1e-3)
  return -y, v_row, v_col, v


def per_layer(inner: optax.GradientTransformation,
              stack_key: str = "layers") -> optax.GradientTransformation:
  """`inner` applied to each layer of a scanned stack on its own.

  `nn.scan` stacks a layer's parameters on a leading axis under a `stack_key` entry
  (`encoder/layers/...`). Adafactor's parameter scale, update clipping and factoring are
  per array, so on a stacked array they would mix the layers; here `inner` is vmapped over
  the stacked axis instead (what T5X's Adafactor does with its 'layers': BATCH factor rule).
  Trees without such an entry get `inner` itself, with its own state layout, so unrolled
  checkpoints are unaffected. For elementwise optimizers (Adam) this changes nothing.
  """
  def stacked(path) -> bool:
    return any(getattr(key, "key", None) == stack_key for key in path)

  def labels(tree):
    """'rest', or the stack's group: 'stacked' when every stack has the same number of
    layers (the state layout checkpoints have), else 'stacked_<layers>' per layer count,
    since one vmap needs one leading size (e.g. 3 encoder and 2 decoder layers)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    sizes = {leaf.shape[0] for path, leaf in leaves if stacked(path)}
    name = (lambda n: "stacked") if len(sizes) == 1 else (lambda n: f"stacked_{n}")
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: name(leaf.shape[0]) if stacked(path) else "rest", tree)

  vmapped = optax.GradientTransformation(jax.vmap(inner.init), jax.vmap(inner.update))

  def split(tree):  # None: nothing is stacked, `inner` alone (the unrolled state layout)
    groups = set(jax.tree_util.tree_leaves(labels(tree))) | {"rest"}
    if groups == {"rest"}:
      return None
    return optax.multi_transform(
        {g: inner if g == "rest" else vmapped for g in groups}, labels(tree))

  def init(params):
    transform = split(params)
    return inner.init(params) if transform is None else transform.init(params)

  def update(updates, state, params=None):
    transform = split(updates)
    if transform is None:
      return inner.update(updates, state, params)
    return transform.update(updates, state, params)

  return optax.GradientTransformation(init, update)


def adamw(learning_rate: Optional[Callable] = None, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 0.01,
          grad_clip_norm: Optional[float] = 1.0) -> optax.GradientTransformation:
  """AdamW (with optional global-norm clipping); default schedule: rsqrt with warm-up."""
  lr = learning_rate or rsqrt_schedule(base_learning_rate=0.01, warmup_steps=1000)
  chain = [optax.clip_by_global_norm(grad_clip_norm)] if grad_clip_norm else []
  chain.append(optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
  return with_schedule(optax.chain(*chain), lr)


def trains(path: Sequence[str], trainable: Sequence[str]) -> bool:
  """Whether the parameter at `path` (its keys from the top of the parameter tree, e.g.
  ('large_decoder', 'layers_0', 'mlp', 'wi', 'kernel')) trains when only `trainable` do:
  its name 'large_decoder/layers_0/mlp/wi/kernel' contains one of the fragments.

  `partially_frozen` (decal_jax's trainer) and `t5x_optimizers.train_parts` (T5X's
  MultiOptimizer) both decide by it, so TRAIN_PARTS freezes the same parameters in both."""
  name = "/".join(str(key) for key in path)
  return any(fragment in name for fragment in trainable)


def check_trains_some(paths: Sequence[Sequence[str]], trainable: Sequence[str],
                      caller: str, each: bool = False) -> None:
  """Refuses a `trainable` that is in no path of `paths` (nothing would train); with `each`,
  also one of its fragments that is in no path (a misspelled part would stay frozen)."""
  top = sorted({str(path[0]) for path in paths if len(path)})
  if not any(trains(path, trainable) for path in paths):
    raise ValueError(f"{caller}: no parameter path contains any of {list(trainable)}, so "
                     "nothing would train. Name parts that exist (e.g. 'projector', "
                     f"'lora_'); top-level parts here: {top}.")
  unmatched = [part for part in trainable if not any(trains(path, (part,)) for path in paths)]
  if each and unmatched:
    raise ValueError(f"{caller}: no parameter path contains {unmatched}, so those parts "
                     f"would stay frozen. Fix or drop them; top-level parts here: {top}.")


def _keys(path) -> Tuple[str, ...]:
  """A jax key path (DictKey / GetAttrKey / SequenceKey entries) as its plain keys."""
  return tuple(str(next((getattr(entry, name) for name in ("key", "name", "idx")
                         if hasattr(entry, name)), entry)) for entry in path)


def partially_frozen(optimizer: Optional[optax.GradientTransformation] = None,
                     trainable: Sequence[str] = ("lora_", "scorer", "soft_prompt"),
                     each_part_must_match: bool = False) -> optax.GradientTransformation:
  """Updates only parameters whose path contains one of `trainable` (`trains`); the rest
  stay fixed.

  Dodo's default (dodo.md §3): LoRA adapters, the scorer and the soft prompt train, the
  base decoder is frozen (a model without one of them is fine). `optimizer` (default:
  adamw) applies to the trainable part. `each_part_must_match`: refuse a fragment that names
  no parameter (runs/squid.gin's TRAIN_PARTS, where a misspelled part would stay frozen).
  """
  trainable = tuple(trainable)
  if not trainable:
    raise ValueError("partially_frozen needs at least one trainable name fragment.")

  def labels(params):
    paths = [_keys(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    check_trains_some(paths, trainable, "partially_frozen", each_part_must_match)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "train" if trains(_keys(path), trainable) else "freeze", params)

  optimizer = optimizer or adamw()
  return _wrapping(optimizer, optax.multi_transform(
      {"train": optimizer, "freeze": optax.set_to_zero()}, labels))


def scaled_updates(optimizer: Optional[optax.GradientTransformation] = None,
                   scales: Optional[dict] = None) -> optax.GradientTransformation:
  """`optimizer` (default adamw) for every parameter, with the updates of parameters whose
  path contains a key of `scales` multiplied by its value: a per-part learning-rate factor,
  e.g. {'scorer': 0.01} slows Dodo's scorer relative to the LM it selects for."""
  scales = dict(scales or {})
  optimizer = optimizer or adamw()
  if not scales:
    return optimizer
  if any(not value > 0 for value in scales.values()):
    raise ValueError(f"scaled_updates factors must be positive, got {scales}.")

  def labels(params):
    def label(path, _):
      name = jax.tree_util.keystr(path)
      return next((fragment for fragment in scales if fragment in name), "__rest__")
    return jax.tree_util.tree_map_with_path(label, params)

  transforms = {fragment: optax.chain(optimizer, optax.scale(factor))
                for fragment, factor in scales.items()}
  transforms["__rest__"] = optimizer
  return _wrapping(optimizer, optax.multi_transform(transforms, labels))


def chain(*transforms: optax.GradientTransformation) -> Scheduled:
  """`optax.chain(*transforms)` that keeps what this module's optimizers carry (`_wrapping`):
  the axis names holder and schedule of the first member with axis names (else of the first
  with a schedule), so that `set_param_axes` reaches an `adafactor` inside (a plain
  optax.chain hides it) and `schedule_of` sees its schedule."""
  carrier = next((t for t in transforms if getattr(t, "param_axes", None) is not None),
                 next((t for t in transforms if schedule_of(t) is not None), transforms[0]))
  return _wrapping(carrier, optax.chain(*transforms))


def _wrapping(optimizer, transform: optax.GradientTransformation) -> Scheduled:
  """`transform` (built around `optimizer`) with `optimizer`'s schedule and axis names
  holder, so that `schedule_of` and `set_param_axes` see through the wrapper."""
  wrapped = with_schedule(transform, schedule_of(optimizer))
  wrapped.param_axes = getattr(optimizer, "param_axes", None)
  return wrapped
