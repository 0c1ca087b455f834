"""TRAIN_PARTS under T5X: T5X's optimizer for the named parts only, the rest frozen.

Importable only where T5X is (`import t5x`; docs/t5x.md installs it). decal_jax's trainer
freezes parts by `optimizers.partially_frozen`; `t5x.train` takes a T5X `OptimizerDef`
instead, so `train_parts` wraps one (T5X's Adafactor in gin/t5x/encoder_decoder.gin) in
T5X's own `optimizers.MultiOptimizer`, with two `flax.traverse_util.ModelParamTraversal`s
split by `optimizers.trains` (the rule `partially_frozen` uses): the trained parameters get
the wrapped optimizer; the others get `Frozen`, which returns them as they are. They are
never handed to the wrapped optimizer, so they keep their values bit for bit and take no
part in its global-norm clipping or weight decay. Their only optimizer state is one int8
zero each: MultiOptimizer would leave them `None`, which T5X's Orbax checkpointer saves
but cannot restore (a resumed run fails reading it). gin (gin/t5x/squid.gin):

    OPTIMIZER = @t5x_optimizers.train_parts()
    t5x_optimizers.train_parts:
      optimizer = @adafactor.Adafactor()
      parts = %TRAIN_PARTS  # None: every parameter trains (the optimizer itself)
"""
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import struct
from flax import traverse_util
from flax.core import frozen_dict
from t5x import optimizers as t5x_optimizers

from decal_jax.runtime import optimizers


@struct.dataclass
class _FrozenHyperParams:
  learning_rate: Optional[float] = None  # T5X's trainer passes one to every optimizer


class Frozen(t5x_optimizers.OptimizerDef):
  """Leaves its parameters as they are. State: one int8 zero per parameter (replicated,
  1 byte), which T5X's checkpointers save and restore like any array."""

  def __init__(self):
    super().__init__(_FrozenHyperParams())

  def init_state(self, params):
    one_byte_states = jax.tree_util.tree_map(lambda _: jnp.zeros((), jnp.int8), params)
    return t5x_optimizers.OptimizerState(jnp.asarray(0, jnp.int32), one_byte_states)

  def apply_gradient(self, hyper_params, params, state, grads):
    del hyper_params, grads
    return params, t5x_optimizers.OptimizerState(state.step + 1, state.param_states)


class PartsOptimizer(t5x_optimizers.MultiOptimizer):
  """T5X's MultiOptimizer: `optimizer` for the parameters `parts` name, `Frozen` for the
  rest; it refuses a part that names no parameter when it first sees the parameters."""

  def __init__(self, optimizer: t5x_optimizers.OptimizerDef, parts: Sequence[str]):
    self.parts = tuple(parts)

    def trained(path: str, _) -> bool:  # path: '/large_decoder/layers_0/...'
      return optimizers.trains(path.split("/")[1:], self.parts)

    super().__init__([
        (traverse_util.ModelParamTraversal(trained), optimizer),
        (traverse_util.ModelParamTraversal(lambda path, v: not trained(path, v)), Frozen())])

  def init_state(self, params):
    paths = list(traverse_util.flatten_dict(frozen_dict.unfreeze(params)))
    optimizers.check_trains_some(paths, self.parts, "t5x_optimizers.train_parts", each=True)
    return super().init_state(params)


def train_parts(optimizer: t5x_optimizers.OptimizerDef,
                parts: Optional[Sequence[str]] = None) -> t5x_optimizers.OptimizerDef:
  """`optimizer` for the parameters whose path contains one of `parts` (e.g. Squid's
  ['small_decoder', 'memory_tokens', 'projector']), the rest frozen; `parts` None:
  `optimizer` itself, every parameter trains."""
  if parts is None:
    return optimizer
  if isinstance(parts, str) or not parts:
    raise ValueError(f"t5x_optimizers.train_parts: parts must be a non-empty list of part "
                     f"names (e.g. ['projector']) or None for all, got {parts!r}.")
  return PartsOptimizer(optimizer, parts)
