"""LLaMA-style decoder-only transformer: RMSNorm, RoPE, SwiGLU, grouped-query attention.

The blocks here are shared by the plain decoder (`Decoder`, T5X `DecoderOnlyModel` call
signature) and by Dodo (`networks/dodo.py`), which adds per-layer nugget keys/values in
front of each block's own keys. Parameter names mirror Hugging Face's LLaMA / Qwen2 layout
closely enough that `decal_jax.interop.hf_import` maps a checkpoint one tensor at a time:

  token_embedder/embedding [vocab, embed]          <- model.embed_tokens.weight
  layers_i/attention_norm/scale, layers_i/mlp_norm/scale
  layers_i/attention/{query,key,value}/kernel [embed, (kv_)heads, head_dim] (+ bias)
  layers_i/attention/out/kernel [heads, head_dim, embed]
  layers_i/mlp/{wi_0 (gate), wi_1 (up), wo (down)}/kernel
  decoder_norm/scale, logits_dense/kernel [embed, vocab] (absent when embeddings are tied)
"""
import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp

from decal_jax.layers import attention as attn
from decal_jax.layers.caches import KVCache, StepCounter
from decal_jax.layers.core import (Array, DenseGeneral, Embed, MlpBlock, RMSNorm,
                                   with_sharding_constraint)
from decal_jax.layers.lora import LoraDense
from decal_jax.networks.signatures import DecoderOnlyNetwork


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Sizes and options of a LLaMA-style decoder (defaults: LLaMA-2-7B's shape)."""
  vocab_size: int = 32000
  emb_dim: int = 4096
  num_heads: int = 32
  num_kv_heads: Optional[int] = None  # grouped-query attention; None = num_heads (MHA)
  head_dim: int = 128
  mlp_dim: int = 11008
  num_layers: int = 32
  rope_theta: float = 10000.0
  norm_epsilon: float = 1e-5
  qkv_bias: bool = False           # Qwen2 puts a bias on q/k/v
  tie_embeddings: bool = False     # logits via the embedding table (Qwen2 small sizes)
  max_length: int = 4096           # positions the model accepts (prompt + generation)
  dropout_rate: float = 0.0
  lora_rank: int = 0               # > 0: every attention projection carries LoRA adapters
  lora_alpha: float = 32.0
  lora_adapters: Tuple[str, ...] = ()
  # which attention projections carry the adapters ('query', 'key', 'value', 'out')
  lora_targets: Tuple[str, ...] = ("query", "key", "value", "out")
  dtype: Any = jnp.float32

  def __post_init__(self):
    kv = self.kv_heads
    if self.num_heads % kv:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={kv}.")
    if self.head_dim % 2:
      raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}.")
    if self.lora_adapters and self.lora_rank <= 0:
      raise ValueError(f"LoRA adapters {self.lora_adapters} need lora_rank > 0.")
    unknown = set(self.lora_targets) - {"query", "key", "value", "out"}
    if unknown:
      raise ValueError(f"lora_targets {sorted(unknown)} are not attention projections; "
                       "choose from 'query', 'key', 'value', 'out'.")

  compression_ratio: ClassVar[int] = 1  # reads every token (models/base.py)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads


class MemoryKV(NamedTuple):
  """Extra keys/values a block attends to before its own (Dodo's nuggets of one layer)."""
  keys: Array    # [batch, k, kv_heads, head_dim], RoPE already applied
  values: Array  # [batch, k, kv_heads, head_dim]
  bias: Array    # [batch, 1, 1 | q, k]: validity (0 / NEG_INF) + straight-through term


def check_positions(config: DecoderConfig, needed: int, what: str) -> None:
  if needed > config.max_length:
    raise ValueError(f"{what} needs {needed} positions but the model accepts "
                     f"{config.max_length} (DecoderConfig.max_length): shorten the input "
                     f"or raise max_length.")


class Attention(nn.Module):
  """Grouped-query self-attention with RoPE, optional LoRA, memory and a KV cache.

  With `decode=True` the first call (no cache yet) creates the submodule `cache`
  (`layers.caches.KVCache`: `cached_key`/`cached_value` `[batch, max_length, kv_heads,
  head_dim]`) from full-length inputs; `prefill=True` writes the whole given prefix at once;
  later calls take one token each, written at the shared `cache_index` that the network
  advances.
  """
  config: DecoderConfig

  def setup(self):
    cfg = self.config
    def adapters(name):
      return cfg.lora_adapters if name in cfg.lora_targets else ()

    def proj(heads, name):
      return LoraDense((heads, cfg.head_dim), ("embed", "heads" if heads == cfg.num_heads
                                               else "kv_heads", "kv"),
                       adapters(name), cfg.lora_rank, cfg.lora_alpha, cfg.qkv_bias,
                       dtype=cfg.dtype, name=name)
    self.query = proj(cfg.num_heads, "query")
    self.key = proj(cfg.kv_heads, "key")
    self.value = proj(cfg.kv_heads, "value")
    self.out = LoraDense(cfg.emb_dim, ("heads", "kv", "embed"), adapters("out"),
                         cfg.lora_rank, cfg.lora_alpha, contract_dims=2, dtype=cfg.dtype)
    self.cache = KVCache(cfg.max_length)

  def key_value(self, x: Array, positions: Array, adapter: Optional[str] = None):
    """`[batch, n, embed]` (already normed) -> RoPE'd keys and values `[batch, n, kv, d]`."""
    keys = attn.apply_rope(self.key(x, adapter), positions, self.config.rope_theta)
    return keys, self.value(x, adapter)

  def __call__(self, x: Array, positions: Array, bias: Optional[Array],
               memory: Optional[MemoryKV] = None, adapter=None,
               decode: bool = False, prefill: bool = False,
               cache_index: Optional[Array] = None, kv_hook: Optional[Callable] = None) -> Array:
    """kv_hook: `(keys, values, bias) -> (keys, values, bias)`, a caller-owned cache used
    instead of the plain one (Dodo's language model keeps nuggets + a recent window)."""
    cfg = self.config
    query = attn.apply_rope(self.query(x, adapter), positions, cfg.rope_theta)  # [b,t,h,d]
    keys, values = self.key_value(x, positions, adapter)  # [b, t, kv, d]
    if kv_hook is not None:
      keys, values, bias = kv_hook(keys, values, bias)
    elif decode:
      keys, values, filled = self.cache(keys, values, cache_index, prefill)
      if filled is not None:  # a step: only the slots written so far
        bias = attn.combine_biases(bias, attn.mask_to_bias(filled, cfg.dtype))
    if memory is not None:
      keys = jnp.concatenate([memory.keys.astype(keys.dtype), keys], axis=1)  # [b, k+s, kv, d]
      values = jnp.concatenate([memory.values.astype(values.dtype), values], axis=1)
      lead = jnp.broadcast_shapes(bias.shape[:3], memory.bias.shape[:3])  # [b, h, q]
      bias = jnp.concatenate([jnp.broadcast_to(memory.bias, lead + memory.bias.shape[3:]),
                              jnp.broadcast_to(bias, lead + bias.shape[3:])], axis=-1)
    groups = cfg.num_heads // cfg.kv_heads
    keys = jnp.repeat(keys, groups, axis=2)  # [b, s, heads, d]
    values = jnp.repeat(values, groups, axis=2)
    query = query * (cfg.head_dim ** -0.5)
    out = attn.dot_product_attention(query, keys, values, bias, dtype=cfg.dtype)
    out = with_sharding_constraint(out, ("batch", "length", "heads", "kv"))
    return self.out(out, adapter)  # [batch, t, embed]


class DecoderBlock(nn.Module):
  """Pre-norm block: x + Attn(RMSNorm(x)); then + SwiGLU(RMSNorm(x))."""
  config: DecoderConfig

  def setup(self):
    cfg = self.config
    self.attention_norm = RMSNorm(cfg.norm_epsilon, cfg.dtype)
    self.attention = Attention(cfg)
    self.mlp_norm = RMSNorm(cfg.norm_epsilon, cfg.dtype)
    self.mlp = MlpBlock(cfg.mlp_dim, ("silu", "linear"), cfg.dropout_rate, cfg.dtype)
    self.dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))

  def memory_kv(self, states: Array, positions: Array, adapter: Optional[str]):
    """This layer's keys/values of memory states `[batch, k, embed]` (layer inputs)."""
    return self.attention.key_value(self.attention_norm(states), positions, adapter)

  def __call__(self, x, positions, bias, memory=None, adapter=None, decode=False,
               prefill=False, cache_index=None, deterministic=True, kv_hook=None):
    h = self.attention(self.attention_norm(x), positions, bias, memory, adapter, decode,
                       prefill, cache_index, kv_hook)
    x = x + self.dropout(h, deterministic)
    x = x + self.dropout(self.mlp(self.mlp_norm(x), deterministic), deterministic)
    return with_sharding_constraint(x, ("batch", "length", "embed"))


class DecoderStack(nn.Module):
  """Embedding, the blocks, the final norm and the LM head, callable piece by piece."""
  config: DecoderConfig

  def setup(self):
    cfg = self.config
    self.token_embedder = Embed(cfg.vocab_size, cfg.emb_dim, cfg.dtype,
                                embedding_init=nn.initializers.normal(stddev=0.02))
    self.layers = [DecoderBlock(cfg, name=f"layers_{i}") for i in range(cfg.num_layers)]
    self.decoder_norm = RMSNorm(cfg.norm_epsilon, cfg.dtype)
    if not cfg.tie_embeddings:
      self.logits_dense = DenseGeneral(cfg.vocab_size, kernel_axes=("embed", "vocab"),
                                       dtype=jnp.float32)

  def embed(self, tokens: Array) -> Array:
    return self.token_embedder(tokens.astype(jnp.int32))  # [batch, t, embed]

  def logits(self, x: Array) -> Array:
    x = self.decoder_norm(x)
    if self.config.tie_embeddings:
      logits = self.token_embedder.attend(x)
    else:
      logits = self.logits_dense(x)
    return with_sharding_constraint(logits.astype(jnp.float32), ("batch", "length", "vocab"))

  def __call__(self, x: Array, positions: Array, bias: Array, memories=None, adapter=None,
               decode=False, prefill=False, cache_index=None, deterministic=True,
               upto: Optional[int] = None, return_layer_inputs: bool = False,
               kv_hooks=None, start: int = 0):
    """Runs blocks [start, upto) over x `[batch, t, embed]` (embedded, or block start's input).

    memories: per-layer `MemoryKV`, or a function `(layer index, block, block input) ->
    MemoryKV` for memories made from this very pass (None: no memory). kv_hooks: per-layer
    cache hooks (see `Attention`). With `return_layer_inputs`, also returns each block's
    input, stacked `[layers, batch, t, embed]` (Dodo's nugget states).
    """
    inputs = []
    for i in range(start, len(self.layers) if upto is None else upto):
      layer = self.layers[i]
      inputs.append(x)
      memory = memories(i, layer, x) if callable(memories) else (
          None if memories is None else memories[i])
      x = layer(x, positions, bias, memory, adapter, decode, prefill, cache_index,
                deterministic, None if kv_hooks is None else kv_hooks[i])
    if return_layer_inputs:
      return x, jnp.stack(inputs)
    return x


def causal_bias(positions: Array, segment_ids: Optional[Array], dtype) -> Array:
  """`[batch, t]` -> `[batch, 1, t, t]` bias: causal by position, within one segment."""
  mask = attn.make_causal_mask(positions)
  if segment_ids is not None:
    mask = attn.combine_masks(mask, attn.make_attention_mask(segment_ids, segment_ids,
                                                             jnp.equal))
  return attn.mask_to_bias(mask, dtype)


def target_steps(counter: StepCounter, stepping: bool, decode: bool, batch: int, length: int,
                 dtype):
  """Offsets `[batch, t]` of t target tokens that follow a prefix (Dodo's nuggets, Squid's
  memory), their self-attention bias and the KV-cache write index. `stepping` (the cache
  exists): one token at the counter, bias left to the cache; otherwise 0 .. t-1, causal,
  and a `decode` call creates the counter."""
  if stepping:
    offsets, index = counter(batch)  # [batch, 1]
    return offsets, jnp.zeros((batch, 1, 1, 1), dtype), index
  offsets = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  if decode:
    counter(batch, advance=0)
  return offsets, causal_bias(offsets, None, dtype), None


class Decoder(DecoderOnlyNetwork):
  """A plain LLaMA-style LM with T5X `DecoderOnlyModel`'s call signature."""
  config: DecoderConfig
  takes_packed_inputs = True

  def setup(self):
    self.stack = DecoderStack(self.config)
    self.step_counter = StepCounter()

  def forward(self, tokens: Array, targets: Optional[Array], segment_ids: Optional[Array],
              positions: Optional[Array], *, deterministic: bool, decode: bool) -> Array:
    """Logits `[batch, t, vocab]`. decode=True: cache creation, then a cached step."""
    del targets
    cfg = self.config
    batch, length = tokens.shape
    x = self.stack.embed(tokens)
    if decode and self.has_variable("cache", "step_counter"):
      positions, index = self.step_counter(batch)  # [b, 1]; index scalar or per row [b]
      bias = jnp.zeros((batch, 1, 1, 1), cfg.dtype)  # the cache masks unwritten slots
      x = self.stack(x, positions, bias, decode=True, cache_index=index)
      return self.stack.logits(x)
    check_positions(cfg, length, "decoder_input_tokens")
    positions = (positions if positions is not None and not decode else
                 jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)))
    segments = None if decode else segment_ids
    bias = causal_bias(positions, segments, cfg.dtype)
    if decode:
      self.step_counter(batch, advance=0)
    x = self.stack(x, positions, bias, decode=decode, deterministic=deterministic)
    return self.stack.logits(x)

  def prefill_cache(self, tokens: Array, lengths: Optional[Array]) -> Array:
    """The prompt `[batch, t]` in one causal pass: cache slots [0, t) are written, the step
    index moves to each row's length (t when None); a slot at or past a row's length is
    hidden from its steps and overwritten by them. -> logits `[batch, t, vocab]`."""
    cfg = self.config
    batch, length = tokens.shape
    check_positions(cfg, length, "the prompt")
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    self.step_counter(batch, advance=length, start=lengths)
    x = self.stack(self.stack.embed(tokens), positions, causal_bias(positions, None, cfg.dtype),
                   decode=True, prefill=True)
    return self.stack.logits(x)
