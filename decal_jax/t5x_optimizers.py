"""TRAIN_PARTS under T5X: T5X's optimizer for the named parts only, the rest frozen.

Importable only where T5X is (`import t5x`; docs/t5x.md installs it). decal_jax's trainer
freezes parts by `optimizers.partially_frozen`; `t5x.train` takes a T5X `OptimizerDef`
instead, so `train_parts` wraps one (T5X's Adafactor in gin/t5x/encoder_decoder.gin) in
T5X's own `optimizers.MultiOptimizer` with one `flax.traverse_util.ModelParamTraversal`:
the parameters it selects (`optimizers.trains`, the rule `partially_frozen` uses) get the
wrapped optimizer; the others are never handed to it, so they keep their values bit for
bit, hold no optimizer state (`None`, which T5X's checkpointer saves and restores as
nothing), and take no part in the wrapped optimizer's global-norm clipping or weight
decay. gin (gin/t5x/squid.gin):

    OPTIMIZER = @t5x_optimizers.train_parts()
    t5x_optimizers.train_parts:
      optimizer = @adafactor.Adafactor()
      parts = %TRAIN_PARTS  # None: every parameter trains (the optimizer itself)
"""
from typing import Optional, Sequence

from flax import traverse_util
from flax.core import frozen_dict
from t5x import optimizers as t5x_optimizers

from decal_jax import optimizers


class PartsOptimizer(t5x_optimizers.MultiOptimizer):
  """T5X's MultiOptimizer over one traversal (the parameters `parts` name); it refuses
  parts that name no parameter when it first sees the parameters."""

  def __init__(self, optimizer: t5x_optimizers.OptimizerDef, parts: Sequence[str]):
    self.parts = tuple(parts)
    traversal = traverse_util.ModelParamTraversal(  # path: '/large_decoder/layers_0/...'
        lambda path, _: optimizers.trains(path.split("/")[1:], self.parts))
    super().__init__([(traversal, optimizer)])

  def init_state(self, params):
    paths = list(traverse_util.flatten_dict(frozen_dict.unfreeze(params)))
    optimizers.check_trains_some(paths, self.parts, "t5x_optimizers.train_parts")
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
