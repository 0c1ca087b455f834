"""Decoding caches: what an attention layer keeps between one-token decoding steps.

Each cache holds keys/values `[batch, slots, kv_heads, head_dim]` in flax's 'cache'
collection and returns what a step attends over together with which slots are valid.
They differ in where a new token's keys/values go, and so in what they keep:

- `KVCache`: slot = the step index; the whole history (T5's and the plain decoder's).
- `RingCache`: slot = position mod size; the last `slots` tokens (Dodo LM's recent window).
- `AppendCache`: the row's next free slot, only for tokens flagged to keep (Dodo LM's
  nuggets, GPTHF's finished sentences at the body layers).
- `SentenceCache`: slot = the token's place in its sentence, per row (GPTHF's word-level
  encoder: only the current sentence).
- `SegmentCache`: the mean of each finished fixed-length segment (Compressive baseline).
- `StepCounter`: the `cache_index` step shared by a whole network's caches: a scalar, or
  one per row `[batch]` after T5X's prompt prefill with per-row `prefill_lengths`.

`KVCache` is created, as in T5X, by a first call on full-length dummy inputs. The others
declare their variables from `batch` alone, so the creation pass calls them with just that
(and gets None); a decoding step passes the token's keys/values too.
"""
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from decal_jax.layers.core import Array


class StepCounter(nn.Module):
  """The shared `cache_index` of cached decoding (T5X's decoders leave leaves of that name
  alone when they expand or reorder beams, and expand them with the batch once they are
  per row, as after T5X's `DecoderOnlyModel` prefill)."""

  @nn.compact
  def __call__(self, batch: int, advance: int = 1, start: Optional[Array] = None):
    """-> (this step's offset `[batch, 1]`, the index before advancing: a scalar or `[batch]`).
    `start` `[batch]` (per-row prompt lengths) sets the index instead of advancing it."""
    index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    current = index.value
    index.value = current + advance if start is None else start.astype(jnp.int32)
    return jnp.broadcast_to(jnp.reshape(current, (-1, 1)), (batch, 1)), current


class KVCache(nn.Module):
  """One attention layer's `cached_key` / `cached_value` `[batch, slots, kv_heads, head_dim]`,
  written at the step index that the network's `StepCounter` gives.

  The first call creates the cache. Without `prefill` it is T5X's creation pass: the slots
  are the dummy inputs' length and attention runs plainly over them. With `prefill`
  (decoder-only prompts) there are `max_length` slots and the prompt fills `[0, length)`.
  Every later call takes one token and writes it at `index` (a scalar, or one per row).
  """
  max_length: Optional[int] = None  # slots of a cache created by a prefill

  @nn.compact
  def __call__(self, keys: Array, values: Array, index: Optional[Array] = None,
               prefill: bool = False):
    """keys / values `[batch, length, kv_heads, head_dim]` -> (keys, values, filled) to
    attend over; filled `[1, 1, 1, slots]` bool marks the slots written so far, or is None
    where attention runs over the given keys alone (creation pass, prefill)."""
    initialized = self.has_variable("cache", "cached_key")
    batch, length, kv_heads, head_dim = keys.shape
    if prefill and self.max_length is None:
      raise ValueError("A prefill needs KVCache.max_length, the number of slots to create.")
    shape = (batch, self.max_length if prefill else length, kv_heads, head_dim)
    cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, keys.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, values.dtype)
    if prefill:
      cached_key.value = cached_key.value.at[:, :length].set(keys)
      cached_value.value = cached_value.value.at[:, :length].set(values)
      return keys, values, None
    if not initialized:
      return keys, values, None
    if length != 1:
      raise ValueError(f"Cached decoding takes one token per step, got {length}.")
    if index is None:
      raise ValueError("A cached decoding step needs the write index (the network's "
                       "StepCounter) as `index`.")
    slots = cached_key.value.shape[1]
    if jnp.ndim(index) == 0:  # every row at the same step
      cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, keys, (0, index, 0, 0))
      cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, values,
                                                        (0, index, 0, 0))
    else:  # per-row steps [batch] (after a prefill of per-row prompt lengths)
      _write(cached_key, cached_value, jax.nn.one_hot(index, slots, dtype=bool), keys, values)
    index = jnp.reshape(index, (-1, 1))  # [1 | batch, 1]
    filled = (jnp.arange(slots)[None, :] <= index)[:, None, None, :]  # [1 | b, 1, 1, slots]
    return cached_key.value, cached_value.value, filled


class _SlotCache(nn.Module):
  """Keys/values `[batch, slots, kv_heads, head_dim]` (variables `keys`, `values`) written
  per row where a `[batch, slots]` bool says."""
  slots: int
  kv_heads: int
  head_dim: int
  dtype: Any = jnp.float32

  def _declare(self, batch: int):
    shape = (batch, self.slots, self.kv_heads, self.head_dim)
    return (self.variable("cache", "keys", jnp.zeros, shape, self.dtype),
            self.variable("cache", "values", jnp.zeros, shape, self.dtype))



def _write(cache_k, cache_v, write: Array, keys: Array, values: Array) -> None:
  """write `[batch | 1, slots]` bool; keys / values `[batch, 1, kv_heads, head_dim]`."""
  cache_k.value = jnp.where(write[:, :, None, None], keys, cache_k.value)
  cache_v.value = jnp.where(write[:, :, None, None], values, cache_v.value)


class RingCache(_SlotCache):
  """The last `slots` tokens' keys/values of one layer (slot = position mod slots)."""

  @nn.compact
  def __call__(self, batch: int, keys=None, values=None, position=None, split=None):
    """keys/values `[b, 1, kv, d]` of the token at `position` (scalar or `[b, 1]`) -> ring
    keys, values and validity `[b, slots]` for a query that reads tokens from `split` on."""
    cache_k, cache_v = self._declare(batch)
    ring_pos = self.variable("cache", "positions",
                             lambda: jnp.full((batch, self.slots), -1, jnp.int32))
    if keys is None:
      return None
    position = jnp.reshape(position, (-1, 1))  # [1 | b, 1]
    write = jnp.arange(self.slots)[None, :] == position % self.slots  # [1 | b, slots]
    _write(cache_k, cache_v, write, keys, values)
    ring_pos.value = jnp.where(write, position, ring_pos.value)
    valid = (ring_pos.value >= split) & (ring_pos.value <= position)  # [b, slots]
    return cache_k.value, cache_v.value, valid


class AppendCache(_SlotCache):
  """Keys/values of the tokens flagged to keep, one layer: row b appends at its own count
  (a full cache overwrites its last slot)."""

  @nn.compact
  def __call__(self, batch: int, keys=None, values=None, position=None, split=None,
               keep=None, start=None):
    """keys/values `[b, 1, kv, d]` of the token at `position` (scalar or `[b, 1]`), kept
    where `keep` `[b]` -> every kept key, value and validity `[b, slots]`: kept before
    `split` (scalar or `[b, 1]`) and, given `start`, at or after it."""
    cache_k, cache_v = self._declare(batch)
    cache_pos = self.variable("cache", "positions",
                              lambda: jnp.full((batch, self.slots), -1, jnp.int32))
    count = self.variable("cache", "count", lambda: jnp.zeros((batch,), jnp.int32))
    if keys is None:
      return None
    write = (jax.nn.one_hot(jnp.minimum(count.value, self.slots - 1), self.slots,
                            dtype=bool) & keep[:, None])  # [b, slots]
    _write(cache_k, cache_v, write, keys, values)
    cache_pos.value = jnp.where(write, position, cache_pos.value)
    count.value = count.value + keep.astype(jnp.int32)
    valid = (cache_pos.value >= 0) & (cache_pos.value < split)
    if start is not None:
      valid = valid & (cache_pos.value >= start)
    return cache_k.value, cache_v.value, valid


class SentenceCache(_SlotCache):
  """One layer's keys/values of the current sentence: row b writes at its place in it."""

  @nn.compact
  def __call__(self, batch: int, keys=None, values=None, place=None):
    """keys/values `[b, 1, kv, d]` of the token at `place` `[b]` -> slots and validity
    `[b, slots]` (the places up to this one)."""
    cache_k, cache_v = self._declare(batch)
    if keys is None:
      return None
    _write(cache_k, cache_v, jax.nn.one_hot(place, self.slots, dtype=bool), keys, values)
    valid = jnp.arange(self.slots)[None, :] <= place[:, None]  # [b, slots]
    return cache_k.value, cache_v.value, valid


class SegmentCache(nn.Module):
  """Compressive baseline, one layer: the running sum of the current `ratio`-token segment's
  states and the pooled keys/values of every finished segment (slot = segment index)."""
  ratio: int
  slots: int
  emb_dim: int
  kv_heads: int
  head_dim: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, batch: int, x=None, position=None, split=None,
               to_kv: Optional[Callable] = None, start=None):
    """x `[b, 1, embed]`: the layer input of the token at `position` (scalar or `[b, 1]`);
    `to_kv` maps states `[b, 1, embed]` at positions `[b, 1]` to their keys/values
    `[b, 1, kv, d]`. -> pooled keys, values and validity `[b, slots]`: segments finished
    before `split` (scalar or `[b, 1]`) and, given `start`, starting at or after it."""
    shape = (batch, self.slots, self.kv_heads, self.head_dim)
    running = self.variable("cache", "running_sum", jnp.zeros, (batch, self.emb_dim),
                            jnp.float32)
    pooled_k = self.variable("cache", "keys", jnp.zeros, shape, self.dtype)
    pooled_v = self.variable("cache", "values", jnp.zeros, shape, self.dtype)
    if x is None:
      return None
    position = jnp.broadcast_to(jnp.reshape(position, (-1, 1)), (batch, 1)).astype(jnp.int32)
    total = running.value + x[:, 0].astype(jnp.float32)  # [b, embed]
    finished = (position + 1) % self.ratio == 0  # [b, 1]
    mean = (total / self.ratio).astype(x.dtype)[:, None]  # [b, 1, embed]
    keys, values = to_kv(mean, position)
    write = (jnp.arange(self.slots)[None, :] == position // self.ratio) & finished  # [b, slots]
    _write(pooled_k, pooled_v, write, keys, values)
    running.value = jnp.where(finished, 0.0, total)
    segment = jnp.arange(self.slots)[None, :]  # [1, slots]
    valid = (segment + 1) * self.ratio <= jnp.reshape(split, (-1, 1))
    if start is not None:
      valid = valid & (segment * self.ratio >= jnp.reshape(start, (-1, 1)))
    return pooled_k.value, pooled_v.value, jnp.broadcast_to(valid, (batch, self.slots))
