"""LoRA: a frozen base projection plus named low-rank adapters, one active at a time.

`LoraDense(x, adapter=None)` is the base map `x W (+ b)`; with `adapter="decode"` it adds
`(alpha / rank) * x A B` from that adapter's own A `[in, rank]` and B `[rank, *features]`.
B starts at zero, so a fresh adapter leaves the base model's output unchanged. Dodo keeps
two adapters on one base (compressing and decoding) and reads its scorer features with
no adapter active (dodo.md §3).
"""
import math
from typing import NamedTuple, Sequence, Tuple, Union

import flax.linen as nn
import jax.numpy as jnp

from decal_jax.layers.core import Array, DType, default_kernel_init, param_with_axes


class PerToken(NamedTuple):
  """Adapter chosen per token: `on` where `mask` `[batch, t]` is true, `off` elsewhere
  (Dodo's language model: nugget tokens compress with ϕ, the others decode with θ)."""
  mask: Array
  on: str
  off: str


class LoraDense(nn.Module):
  """`[..., in] -> [..., *features]` with optional bias and LoRA adapters.

  Attributes:
    features: output feature shape, e.g. `(heads, head_dim)`.
    kernel_axes: logical names of the kernel `[in, *features]`.
    adapters: names of the adapters this projection carries (empty: none).
    rank, alpha: LoRA rank and scale numerator (scale = alpha / rank).
    use_bias: a bias over `features` (Qwen2's q/k/v projections have one).
    contract_dims: how many trailing input axes are contracted (2 for `[heads, head_dim]`).
  """
  features: Union[int, Sequence[int]]
  kernel_axes: Tuple[str, ...]
  adapters: Tuple[str, ...] = ()
  rank: int = 8
  alpha: float = 16.0
  use_bias: bool = False
  contract_dims: int = 1
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, x: Array, adapter: Union[None, str, PerToken] = None) -> Array:
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    in_shape = x.shape[-self.contract_dims:]
    fan_in, fan_out = math.prod(in_shape), math.prod(features)
    kernel = param_with_axes(
        "kernel", lambda k, s, d: default_kernel_init(k, (fan_in, fan_out), d).reshape(s),
        in_shape + features, jnp.float32, axes=self.kernel_axes)
    x = jnp.asarray(x, self.dtype)
    flat_x = x.reshape(x.shape[:-self.contract_dims] + (fan_in,))  # [..., in]
    y = flat_x @ jnp.asarray(kernel, self.dtype).reshape(fan_in, fan_out)  # [..., out]
    if self.use_bias:
      bias = param_with_axes("bias", nn.initializers.zeros, features, jnp.float32,
                             axes=self.kernel_axes[self.contract_dims:])
      y = y + jnp.asarray(bias, self.dtype).reshape(fan_out)
    deltas = {}
    for name in self.adapters:  # create every adapter's variables
      a = param_with_axes(f"lora_{name}_a", nn.initializers.normal(1.0 / math.sqrt(fan_in)),
                          (fan_in, self.rank), jnp.float32, axes=("embed_in", "lora_rank"))
      b = param_with_axes(f"lora_{name}_b", nn.initializers.zeros, (self.rank, fan_out),
                          jnp.float32, axes=("lora_rank", "embed_out"))
      deltas[name] = (a, b)

    if adapter is None or not deltas:  # none active, or a projection outside lora_targets
      return y.reshape(y.shape[:-1] + features)

    def delta(name):  # [..., out]
      if name not in deltas:
        raise ValueError(f"Adapter {name!r} is not one of this layer's adapters "
                         f"{self.adapters}; set DecoderConfig.lora_rank > 0 to create them.")
      a, b = deltas[name]
      return (self.alpha / self.rank) * ((flat_x @ jnp.asarray(a, self.dtype))
                                         @ jnp.asarray(b, self.dtype))

    if isinstance(adapter, PerToken):
      mask = adapter.mask.reshape(adapter.mask.shape + (1,) * (y.ndim - adapter.mask.ndim))
      y = y + jnp.where(mask, delta(adapter.on), delta(adapter.off))
    else:
      y = y + delta(adapter)
    return y.reshape(y.shape[:-1] + features)
