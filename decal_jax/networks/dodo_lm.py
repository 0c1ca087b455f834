"""Dodo as an autoregressive language model with compressed history (dodo.md §2.2).

Each token t reads its last τ tokens [p(t), t] at full resolution (Eq. 9's recent window)
and, before the split point p(t), only the nuggets: earlier tokens whose score exceeds a
threshold Λ (Eq. 8). p(t) = max(0, t + 1 - τ): a sliding window, so every token sees τ
recent tokens. `chunk` c > 1 is the paper's training shortcut (tokens of a chunk share one
split point); here a chunk's split is placed so that its *first* token still sees τ tokens
(the last sees τ + c - 1), and the cache's ring holds τ + c - 1 slots. Training stays one
parallel pass with a structured mask.

* Scores come from a 2-layer FFN on base-model features (adapters off) after ι layers,
  computed over the recent window only, so selecting a nugget needs no cache beyond it.
* Selection never looks ahead, nor at other rows. With Λ (`DodoLMConfig.threshold`, e.g.
  calibrated by `calibrate_threshold` on a scorer started from a trained compressor, the
  paper's footnote 2) training, evaluation and generation all use Eq. 8. While Λ is None
  (training from scratch) token i is a nugget when its score is among the ceil((i + 1) / r)
  highest of its own row's s_0 .. s_i (`nuggets.select_prefix_rank`).
* `history` H (Table 1's fixed histories): the nuggets come only from the H tokens right
  before the split point, [p(t) - H, p(t)), so every token attends to at most τ recent
  states plus the nuggets of H tokens (about H / r); None: all earlier text.
* With LoRA, a nugget token runs with the compressing adapter ϕ and every other token with
  the decoding adapter θ, on one frozen base; logits toward nugget i get
  `s_i - stop_gradient(s_i)` so the scorer learns from the next-token loss.
* `selection='compressive'`: the Compressive Transformer baseline at the same ratio — the
  distant text is the mean of each finished r-token segment's states, at every layer.
* `selection='window'`: no distant text at all, only the recent window (the paper's FULL
  model with its context cut to the same number of states).
* `sink` k > 0: every token also reads the text's first k tokens in full, at every layer
  (StreamingLLM's attention sink: a model pretrained with full attention parks attention on
  them, and a sliding window that drops them degrades it). They are never nuggets, so no
  state is read twice; the scorer reads them too. Not in the paper, whose model is trained
  with the window from the start.

Cached decoding keeps, per layer, a ring of the last τ + c - 1 tokens' keys/values plus the
nuggets' (or the pooled segments'), not the whole history: its size is fixed by τ, the
nugget capacity (`DodoLMConfig.nugget_capacity`) and the layer count (`layers/caches.py`).
"""
import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax.compress import nuggets as nug
from decal_jax.layers import attention as attn
from decal_jax.layers.caches import AppendCache, RingCache, SegmentCache, StepCounter
from decal_jax.layers.lora import PerToken
from decal_jax.networks.decoder import DecoderConfig, DecoderStack, MemoryKV, check_positions
from decal_jax.networks.dodo import with_adapters
from decal_jax.networks.signatures import DecoderOnlyNetwork

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DodoLMConfig:
  """Defaults: the paper's r = 10, ι = 3; τ = 64 recent tokens for every position."""
  decoder: DecoderConfig = DecoderConfig()
  compression_ratio: float = 10.0
  window: int = 64                  # τ: recent tokens every token reads uncompressed
  chunk: int = 1                    # c: tokens sharing one split point (1: sliding window)
  history: Optional[int] = None     # H: tokens before the window that nuggets cover
  scorer_layer: int = 3             # ι
  scorer_hidden_dim: Optional[int] = None
  threshold: Optional[float] = None  # Λ; None: the causal prefix-rank rule
  selection: str = "nuggets"        # or 'compressive', 'window' (recent text only)
  nugget_capacity: Optional[int] = None  # cached nugget slots; None: 2 * max_length / r
  sink: int = 0                     # first tokens every token reads in full (0: none)

  @property
  def max_length(self) -> int:
    return self.decoder.max_length

  def __post_init__(self):
    nug.check_ratio(self.compression_ratio)
    if self.selection not in ("nuggets", "compressive", "window"):
      raise ValueError(f"DodoLMConfig.selection must be 'nuggets', 'compressive' or "
                       f"'window', got {self.selection!r}.")
    if self.chunk < 1 or self.window < 1:
      raise ValueError(f"Need chunk (c = {self.chunk}) >= 1 and window (τ = {self.window}) "
                       ">= 1.")
    if self.sink < 0:
      raise ValueError(f"sink must be >= 0 tokens, got {self.sink}.")
    if self.history is not None and self.history < 0:
      raise ValueError(f"history (H) must be >= 0 tokens or None, got {self.history}.")
    if self.window >= self.decoder.max_length:
      raise ValueError(f"window τ = {self.window} must be smaller than the model's "
                       f"max_length {self.decoder.max_length}, or nothing is ever compressed.")
    if not 1 <= self.scorer_layer <= self.decoder.num_layers:
      raise ValueError(f"scorer_layer (ι) = {self.scorer_layer} must lie in [1, "
                       f"{self.decoder.num_layers}].")
    if self.selection == "compressive" and int(self.compression_ratio) != self.compression_ratio:
      raise ValueError("The compressive baseline pools whole segments: use an integer ratio.")

  @property
  def network_config(self) -> DecoderConfig:
    return with_adapters(self.decoder)

  @property
  def capacity(self) -> int:
    if self.nugget_capacity is not None:
      return self.nugget_capacity
    return 2 * math.ceil(self.decoder.max_length / self.compression_ratio)

  @property
  def vocab_size(self) -> int:
    return self.decoder.vocab_size

  @property
  def ring_slots(self) -> int:
    """Recent tokens a cached step may read: τ + c - 1 (τ with the sliding window)."""
    return self.window + self.chunk - 1


def split_points(positions: Array, config: DodoLMConfig) -> Array:
  """p(t) = max(0, chunk_start(t) + 1 - τ): the first token t reads uncompressed; a chunk's
  first token (every token when c = 1) reads exactly τ recent tokens, itself included."""
  c, tau = config.chunk, config.window
  return jnp.maximum(0, (positions // c) * c + 1 - tau)


def history_starts(split: Array, config: DodoLMConfig) -> Array:
  """The first position whose nugget (or pooled segment) token t may read: p(t) - H, or 0."""
  if config.history is None:
    return jnp.zeros_like(split)
  return jnp.maximum(0, split - config.history)


def _real_tokens(tokens: Array, targets: Optional[Array]) -> Array:
  """`[batch, n]` bool: input t is BOS (t = 0) or a real token, padding only after the text."""
  n = tokens.shape[1]
  if targets is not None:  # input t is BOS (t = 0) or target t - 1
    length = jnp.sum(targets > 0, axis=1)
    return jnp.arange(n)[None, :] < jnp.maximum(length, 1)[:, None]
  return (tokens > 0) | (jnp.arange(n)[None, :] == 0)  # BOS is id 0 at position 0


# ----------------------------------------------------------------------------- network
class DodoLM(DecoderOnlyNetwork):
  """A decoder-only LM (T5X `DecoderOnlyModel` call signature) reading compressed history."""
  config: DodoLMConfig

  def setup(self):
    cfg = self.config
    self.stack = DecoderStack(cfg.network_config)
    self.scorer = nug.Scorer(cfg.scorer_hidden_dim or cfg.decoder.emb_dim)
    self.step_counter = StepCounter()
    layers = cfg.decoder.num_layers
    dec = cfg.decoder
    shape = (dec.kv_heads, dec.head_dim, dec.dtype)
    self.scorer_rings = [RingCache(cfg.ring_slots, *shape) for _ in range(cfg.scorer_layer)]
    self.rings = [RingCache(cfg.ring_slots, *shape) for _ in range(layers)]
    self.nugget_caches, self.segment_caches = [], []
    sinks = cfg.scorer_layer + layers if cfg.sink else 0
    self.sink_caches = [AppendCache(cfg.sink, *shape) for _ in range(sinks)]  # scorer, then all
    if cfg.selection == "nuggets":
      self.nugget_caches = [AppendCache(cfg.capacity, *shape) for _ in range(layers)]
    elif cfg.selection == "compressive":
      slots = math.ceil(dec.max_length / cfg.compression_ratio)
      self.segment_caches = [SegmentCache(int(cfg.compression_ratio), slots, dec.emb_dim,
                                          *shape) for _ in range(layers)]

  def _lora(self) -> bool:
    return bool(self.config.network_config.lora_adapters)

  # ---------------------------------------------------------------- the parallel pass
  def scores(self, tokens: Array) -> Array:
    """Scorer output `[batch, n]` from base features over each token's recent window."""
    n = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), tokens.shape)
    window = self._window_mask(n)
    bias = attn.mask_to_bias(window[None, None].astype(jnp.float32))  # [1, 1, n, n]
    x = self.stack(self.stack.embed(tokens), positions, bias, upto=self.config.scorer_layer)
    return self.scorer(jax.lax.stop_gradient(x))

  def _window_mask(self, n: int) -> Array:
    """`[n (query), n]`: [p(t), t] and the first `sink` tokens up to t."""
    t = jnp.arange(n)
    split = split_points(t, self.config)
    recent = (t[None, :] >= split[:, None]) | (t[None, :] < self.config.sink)
    return recent & (t[None, :] <= t[:, None])

  def select(self, scores: Array, real: Array) -> Array:
    """`[batch, n]` bool nuggets: score > Λ (Eq. 8), or while Λ is None the prefix-rank
    rule; either way token i's choice reads only s_0 .. s_i of its own row. The sink tokens
    are read in full, never as nuggets."""
    real = real & (jnp.arange(real.shape[1]) >= self.config.sink)[None]  # [b, n]
    if self.config.threshold is not None:
      return nug.select_threshold(scores, real, self.config.threshold)
    return nug.select_prefix_rank(scores, real, self.config.compression_ratio)

  def nuggets(self, tokens: Array, targets: Optional[Array] = None) -> Array:
    """`[batch, n]` bool: which tokens the parallel pass keeps as nuggets."""
    scores = self.scores(tokens)  # [b, n]
    return self.select(scores, _real_tokens(tokens, targets))

  def attended(self, tokens: Array, targets: Optional[Array] = None) -> Array:
    """`[batch, n (query), n]` bool: the states each token reads, at every layer (the
    pooled segments of 'compressive' are not token states and are left out)."""
    n = tokens.shape[1]
    window = self._window_mask(n)[None]  # [1, n, n]
    if self.config.selection != "nuggets":
      return jnp.broadcast_to(window, (tokens.shape[0], n, n))
    return window | self._to_nugget(self.nuggets(tokens, targets))

  def _to_nugget(self, is_nugget: Array) -> Array:
    """`[b, n]` nuggets -> `[b, n (query), n]`: nugget i lies in [p(t) - H, p(t))."""
    n = is_nugget.shape[1]
    t = jnp.arange(n)
    split = split_points(t, self.config)  # [n]
    distant = ((t[None, :] < split[:, None])
               & (t[None, :] >= history_starts(split, self.config)[:, None]))  # [n, n]
    return is_nugget[:, None, :] & distant[None]

  def forward(self, tokens: Array, targets: Optional[Array], segment_ids, positions, *,
              deterministic: bool, decode: bool) -> Array:
    """Next-token logits `[batch, n, vocab]` (decode=True: one cached step)."""
    del segment_ids, positions  # refused by DecoderOnlyNetwork; positions: 0..n-1
    if decode and self.has_variable("cache", "step_counter"):
      return self._step(tokens)
    check_positions(self.config.decoder, tokens.shape[1], "decoder_input_tokens")
    if decode:  # cache creation: sizes come from the config, not from these dummy inputs
      self._create_caches(tokens.shape[0])
    return self._parallel(tokens, targets, deterministic)

  def _parallel(self, tokens, targets, deterministic):
    cfg = self.config
    batch, n = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    real = _real_tokens(tokens, targets)  # [b, n]
    window = self._window_mask(n)[None]  # [1, n, n]
    split = split_points(jnp.arange(n), cfg)  # [n]
    x = self.stack.embed(tokens)
    if cfg.selection != "nuggets":
      adapter = "decode" if self._lora() else None
      bias = attn.mask_to_bias(window[:, None].astype(jnp.float32))  # [1, 1, n, n]
      memories = (self._pooled_memories(tokens, real, split, adapter)
                  if cfg.selection == "compressive" else None)
      x = self.stack(x, positions, bias, memories, adapter, deterministic=deterministic)
      return self.stack.logits(x)
    scores = self.scores(tokens)  # [b, n]
    is_nugget = self.select(scores, real)  # [b, n]
    to_nugget = self._to_nugget(is_nugget)  # [b, n (query), n]
    allowed = window | to_nugget
    bias = (attn.mask_to_bias(allowed.astype(jnp.float32))
            + jnp.where(to_nugget, nug.straight_through(scores)[:, None, :], 0.0))[:, None]
    adapter = PerToken(is_nugget, "compress", "decode") if self._lora() else None
    x = self.stack(x, positions, bias, adapter=adapter, deterministic=deterministic)
    return self.stack.logits(x)

  def _pooled_memories(self, tokens, real, split, adapter):
    """Per-layer memory of mean-pooled finished segments, from this pass's layer inputs."""
    r = int(self.config.compression_ratio)
    start = history_starts(split, self.config)  # [n]

    def memory(index, block, x):
      means, ends, valid = nug.segment_means(x[None], real.astype(jnp.int32), r)
      keys, values = block.memory_kv(means[0], ends, adapter)  # [b, m, kv, d]
      m = means.shape[2]
      segment = jnp.arange(m)[None, :]  # [1, m]
      finished = ((segment + 1) * r <= split[:, None]) & (segment * r >= start[:, None])
      allowed = valid[:, None, :] & finished[None]  # [b, n, m]
      return MemoryKV(keys, values, attn.mask_to_bias(allowed.astype(jnp.float32))[:, None])
    return memory

  # ---------------------------------------------------------------- cached decoding
  def _create_caches(self, batch: int) -> None:
    """Declares every cache variable (sizes come from the config)."""
    self.step_counter(batch, advance=0)
    for cache in (list(self.scorer_rings) + list(self.rings) + list(self.nugget_caches) +
                  list(self.segment_caches) + list(self.sink_caches)):
      cache(batch)

  def _step(self, tokens):
    cfg = self.config
    batch = tokens.shape[0]
    if tokens.shape[1] != 1:
      raise ValueError(f"Cached decoding takes one token per step, got {tokens.shape[1]}.")
    offsets, _ = self.step_counter(batch)  # [b, 1]: rows may differ after a T5X prefill
    position = offsets
    split = split_points(position, cfg)  # [b, 1]
    start = history_starts(split, cfg)  # [b, 1]
    x = self.stack.embed(tokens)
    no_bias = jnp.zeros((batch, 1, 1, 1), cfg.decoder.dtype)

    def recent(ring, sink, keys, values):
      """The ring's keys / values, then the sink's not yet in the ring; validity [b, slots]."""
      k, v, valid = ring(batch, keys, values, position, split)
      if sink is None:
        return k, v, valid
      sk, sv, sink_valid = sink(batch, keys, values, position, split, position[:, 0] < cfg.sink)
      return (jnp.concatenate([sk, k], 1), jnp.concatenate([sv, v], 1),
              jnp.concatenate([sink_valid, valid], 1))

    def ring_hook(ring, sink=None):
      def hook(keys, values, bias):
        k, v, valid = recent(ring, sink, keys, values)
        return k, v, attn.mask_to_bias(valid[:, None, None, :].astype(jnp.float32))
      return hook

    sinks = self.sink_caches or [None] * (cfg.scorer_layer + cfg.decoder.num_layers)
    scorer_sinks, sinks = sinks[:cfg.scorer_layer], sinks[cfg.scorer_layer:]

    if cfg.selection != "nuggets":
      adapter = "decode" if self._lora() else None

      def memory(index, block, h):
        to_kv = functools.partial(block.memory_kv, adapter=adapter)
        k, v, valid = self.segment_caches[index](batch, h, position, split, to_kv, start)
        return MemoryKV(k, v, attn.mask_to_bias(valid[:, None, None, :].astype(jnp.float32)))
      x = self.stack(x, offsets, no_bias, memory if cfg.selection == "compressive" else None,
                     adapter, kv_hooks=[ring_hook(r, s) for r, s in zip(self.rings, sinks)])
      return self.stack.logits(x)

    if cfg.threshold is None:
      raise ValueError("Cached decoding selects nuggets with a fixed threshold: set "
                       "DodoLMConfig.threshold (decal_jax/commands/calibrate_nuggets.py computes it).")
    h = self.stack(x, offsets, no_bias, upto=cfg.scorer_layer,
                   kv_hooks=[ring_hook(r, s) for r, s in zip(self.scorer_rings, scorer_sinks)])
    is_nugget = (self.scorer(h)[:, 0] > cfg.threshold) & (position[:, 0] >= cfg.sink)  # [b]

    def nugget_hook(index):
      def hook(keys, values, bias):
        rk, rv, ring_valid = recent(self.rings[index], sinks[index], keys, values)
        nk, nv, nugget_valid = self.nugget_caches[index](batch, keys, values, position, split,
                                                         is_nugget, start)
        valid = jnp.concatenate([nugget_valid, ring_valid], axis=1)  # [b, capacity + ring]
        return (jnp.concatenate([nk, rk], 1), jnp.concatenate([nv, rv], 1),
                attn.mask_to_bias(valid[:, None, None, :].astype(jnp.float32)))
      return hook

    adapter = PerToken(is_nugget[:, None], "compress", "decode") if self._lora() else None
    x = self.stack(x, offsets, no_bias, adapter=adapter,
                   kv_hooks=[nugget_hook(i) for i in range(cfg.decoder.num_layers)])
    return self.stack.logits(x)


# --------------------------------------------------------------------------- calibration
def calibrate_threshold(module: DodoLM, params, token_batches) -> float:
  """Λ from sample text: about 1/r of the scorer's outputs on real tokens exceed it
  (`nuggets.calibrate_threshold`).

  token_batches: iterable of `[batch, n]` int arrays (0 = padding after the text).
  """
  scores, valid = [], []
  score_fn = jax.jit(lambda p, t: module.apply({"params": p}, t, method=DodoLM.scores))
  for tokens in token_batches:
    tokens = np.asarray(tokens)
    scores.append(np.asarray(score_fn(params, tokens)).ravel())
    valid.append((tokens > 0).ravel())
  if not scores:
    raise ValueError("calibrate_threshold needs at least one batch of sample text.")
  return nug.calibrate_threshold(np.concatenate(scores), np.concatenate(valid),
                                 module.config.compression_ratio)


def nugget_fraction(module: DodoLM, params, tokens, threshold: float) -> float:
  """The share of real tokens whose score exceeds `threshold` (the achieved 1 / r)."""
  tokens = np.asarray(tokens)
  scores = np.asarray(module.apply({"params": params}, tokens, method=DodoLM.scores))
  real = tokens > 0
  return float(np.mean(scores[real] > threshold))
