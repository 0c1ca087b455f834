"""Parameter-carrying building blocks with T5X logical axis names.

Every parameter is declared through `flax.linen.partitioning.param_with_axes`, so the
`params_axes` collection that T5X's partitioner and Adafactor read is emitted alongside
`params`. Activations are constrained with logical `with_sharding_constraint`, which is a
no-op unless the caller has set axis rules and a mesh (see `decal_jax.partitioning`).
"""
import math
from typing import Any, Callable, Iterable, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import partitioning as nn_partitioning

param_with_axes = nn_partitioning.param_with_axes
with_sharding_constraint = nn_partitioning.with_sharding_constraint

Array = jax.Array
DType = Any
Initializer = Callable[..., Array]

default_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def _normalize_axes(axes: Iterable[int], ndim: int) -> Tuple[int, ...]:
  return tuple(ax if ax >= 0 else ndim + ax for ax in axes)


def _canonicalize_tuple(x: Union[Sequence[int], int]) -> Tuple[int, ...]:
  return tuple(x) if isinstance(x, Iterable) else (x,)


class DenseGeneral(nn.Module):
  """A linear map over arbitrary input axes to arbitrary output features, no bias.

  Attributes:
    features: output feature shape, e.g. `(heads, head_dim)`.
    axis: input axes contracted (default: the last).
    kernel_axes: logical names of the kernel's axes (contracted axes, then features).
  """
  features: Union[int, Sequence[int]]
  axis: Union[int, Sequence[int]] = -1
  kernel_axes: Tuple[str, ...] = ()
  dtype: DType = jnp.float32
  kernel_init: Initializer = default_kernel_init

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    features = _canonicalize_tuple(self.features)
    axis = _normalize_axes(_canonicalize_tuple(self.axis), inputs.ndim)
    kernel_in_shape = tuple(inputs.shape[ax] for ax in axis)
    kernel_shape = kernel_in_shape + features
    fan_in = math.prod(kernel_in_shape)
    fan_out = math.prod(features)

    def init_2d_then_reshape(key, shape, dtype):
      # Initialise as a [fan_in, fan_out] matrix so variance scaling sees the true fans.
      return jnp.reshape(self.kernel_init(key, (fan_in, fan_out), dtype), shape)

    kernel = param_with_axes("kernel", init_2d_then_reshape, kernel_shape, jnp.float32,
                             axes=self.kernel_axes)
    kernel = jnp.asarray(kernel, self.dtype)
    inputs = jnp.asarray(inputs, self.dtype)
    contract = (axis, tuple(range(len(axis))))
    return jax.lax.dot_general(inputs, kernel, (contract, ((), ())))


class RMSNorm(nn.Module):
  """T5's layer norm: scale by the root mean square, learned scale, no bias or centering."""
  epsilon: float = 1e-6
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    x = jnp.asarray(x, jnp.float32)
    mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)  # [..., 1]
    y = x * jax.lax.rsqrt(mean_square + self.epsilon)
    scale = param_with_axes("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32,
                            axes=("embed",))
    return jnp.asarray(y * scale, self.dtype)


class Embed(nn.Module):
  """Token embedding table `[vocab, embed]`; `attend` gives logits against it (tied)."""
  num_embeddings: int
  features: int
  dtype: DType = jnp.float32
  embedding_init: Initializer = nn.initializers.normal(stddev=1.0)

  def setup(self):
    self.embedding = param_with_axes("embedding", self.embedding_init,
                                     (self.num_embeddings, self.features), jnp.float32,
                                     axes=("vocab", "embed"))

  def __call__(self, tokens: Array) -> Array:
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"Embed expects integer token ids, got dtype {tokens.dtype}.")
    # Gather from the float32 table, then cast: the table's gradient (a scatter-add over
    # every token of the batch, thousands of them on a frequent id) then sums in float32.
    # Casting first would sum it in the activation dtype, where bf16 loses most of it.
    return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)  # [batch, length, embed]

  def attend(self, query: Array) -> Array:
    return jnp.einsum("ble,ve->blv", jnp.asarray(query, self.dtype),
                      jnp.asarray(self.embedding, self.dtype))  # [batch, length, vocab]


class MlpBlock(nn.Module):
  """Gated MLP: `wo(act_0(wi_0 x) * act_1(wi_1 x))` (T5.1.1 gated-GELU by default)."""
  intermediate_dim: int
  activations: Sequence[str] = ("gelu", "linear")
  dropout_rate: float = 0.0
  dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    hidden = None
    for i, act in enumerate(self.activations):
      h = DenseGeneral(self.intermediate_dim, kernel_axes=("embed", "mlp"), dtype=self.dtype,
                       name=f"wi_{i}" if len(self.activations) > 1 else "wi")(x)
      h = activation(act)(h)  # [batch, length, mlp]
      hidden = h if hidden is None else hidden * h
    hidden = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(hidden, deterministic)
    hidden = with_sharding_constraint(hidden, ("batch", "length", "mlp"))
    out = DenseGeneral(x.shape[-1], kernel_axes=("mlp", "embed"), dtype=self.dtype,
                       name="wo")(hidden)  # [batch, length, embed]
    return out


def activation(name: str) -> Callable[[Array], Array]:
  table = {"linear": lambda x: x, "gelu": nn.gelu, "relu": nn.relu, "silu": nn.silu,
           "swish": nn.silu}
  if name not in table:
    raise ValueError(f"Unknown MLP activation {name!r}; choose one of {sorted(table)}.")
  return table[name]
