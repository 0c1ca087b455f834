"""Analytical forward-pass FLOPs of the T5 encoder-decoder and its compressors.

Counts the matrix multiplications (2 * M * N * K each), which is where a transformer
spends its compute; norms, softmax and activations add a few percent at realistic sizes
(`tests/test_flops.py` holds the model to XLA's own count within 10 %). Per example:

    encoder          every layer over L positions: QKV + scores + weighted sum + output
                     projection + gated MLP; L = n (plain, AttnPool), m + n (DeCAL latents),
                     n + m (CCProxy memory); plus DeCAL's pooling or AttnPool's layer
    cross_attention  decoder queries / outputs over t targets, keys / values over m encodings
    decoder          the rest of the decoder: self-attention, MLP, logits

where m = ceil(n / C). Decoding one token at a time with a cache costs about the same
per token; these are teacher-forced numbers.

Decoder-only models (`networks/decoder.py`) and Squid (`networks/squid.py`) are counted per
example by `decoder_flops` (a LLaMA-style decoder over new positions, GQA-aware, SwiGLU, LM
head only where logits are needed), `answer_flops` (prefill a prompt, then greedy cached
steps) and `squid_flops` (small decoder / projector / large decoder). Attention is counted
as the dense masked product the code computes (every query against every key it is shown,
including a preallocated cache's empty slots) unless `causal=True`, which counts only the
keys each position may see (what a causal-aware kernel would do).
"""
import dataclasses
import math
from typing import Optional

from decal_jax.networks.decoder import DecoderConfig
from decal_jax.networks.squid import SquidConfig
from decal_jax.networks.t5 import T5Config


@dataclasses.dataclass(frozen=True)
class Flops:
  encoder: float
  cross_attention: float
  decoder: float  # everything in the decoder except cross-attention

  @property
  def total(self) -> float:
    return self.encoder + self.cross_attention + self.decoder


def _attention(cfg: T5Config, queries: int, keys: int) -> float:
  """Projections, scores and weighted sum of one attention over `queries` x `keys`."""
  inner = cfg.num_heads * cfg.head_dim
  projections = 2 * queries * cfg.emb_dim * inner * 2 + 2 * keys * cfg.emb_dim * inner * 2
  return projections + 2 * 2 * queries * keys * inner  # + q k^T and weights @ v


def _mlp(cfg: T5Config, length: int) -> float:
  return 2 * length * cfg.emb_dim * cfg.mlp_dim * (len(cfg.mlp_activations) + 1)


def _encoder_layer(cfg: T5Config, length: int) -> float:
  return _attention(cfg, length, length) + _mlp(cfg, length)


def encoder_flops(cfg: T5Config, inputs_length: int) -> float:
  n = inputs_length
  if not cfg.compressed:
    return cfg.num_encoder_layers * _encoder_layer(cfg, n)
  m = math.ceil(n / cfg.compression_ratio)
  pool = 2 * n * m * cfg.emb_dim  # masked mean pool, a [m, n] x [n, embed] product
  if cfg.compressor == "latents":
    return cfg.num_encoder_layers * _encoder_layer(cfg, m + n) + pool + 2 * n * m
  if cfg.compressor == "memory_tokens":
    return cfg.num_encoder_layers * _encoder_layer(cfg, n + m)
  return cfg.num_encoder_layers * _encoder_layer(cfg, n) + pool + _attention(cfg, m, n)


def forward_flops(cfg: T5Config, inputs_length: int, targets_length: int) -> Flops:
  """Teacher-forced forward FLOPs of one example (n input tokens, t target tokens)."""
  t = targets_length
  m = math.ceil(inputs_length / cfg.compression_ratio) if cfg.compressed else inputs_length
  layers = cfg.num_decoder_layers
  cross = layers * _attention(cfg, t, m)
  decoder = layers * (_attention(cfg, t, t) + _mlp(cfg, t)) + 2 * t * cfg.emb_dim * cfg.vocab_size
  return Flops(encoder_flops(cfg, inputs_length), cross, decoder)


# ----------------------------------------------------------------------------- decoder-only
def decoder_flops(cfg: DecoderConfig, length: int, cached_prefix: int = 0,
                  logits_positions: Optional[int] = None, causal: bool = False,
                  keys_values_only: bool = False) -> float:
  """Matmul FLOPs of a LLaMA-style decoder over `length` new positions of one example.

  The new positions attend to `cached_prefix` earlier keys (a KV cache, Squid's prefix,
  a preallocated cache's empty slots) and to the new positions themselves: dense
  (`causal=False`), each of them scores all `cached_prefix + length` keys; causal, new
  position i scores `cached_prefix + i + 1`. GQA: keys / values are projected to
  `kv_heads` only (the scores use all query heads). SwiGLU: gate, up and down matmuls.
  `logits_positions` positions go through the LM head (None: all `length`; 0: none, e.g.
  a prefix whose states are kept but not read out). `keys_values_only`: the pass only
  fills a cache (Squid's read), so the last layer needs just its key / value projections;
  its queries, attention, output projection and MLP feed nothing (XLA drops them too).
  LoRA adapters are not counted.
  """
  if length < 0 or cached_prefix < 0:
    raise ValueError(f"length ({length}) and cached_prefix ({cached_prefix}) must be >= 0.")
  logits_positions = length if logits_positions is None else logits_positions
  if not 0 <= logits_positions <= length:
    raise ValueError(f"logits_positions ({logits_positions}) must lie in [0, length = "
                     f"{length}]: only new positions have logits.")
  query_inner = cfg.num_heads * cfg.head_dim
  kv_inner = cfg.kv_heads * cfg.head_dim
  projections = 2 * length * cfg.emb_dim * (2 * query_inner + 2 * kv_inner)  # q, out; k, v
  if causal:
    scored = length * cached_prefix + length * (length + 1) // 2  # (query, key) pairs
  else:
    scored = length * (cached_prefix + length)
  attention = 2 * 2 * scored * query_inner  # q k^T and weights @ v
  mlp = 2 * length * cfg.emb_dim * cfg.mlp_dim * 3  # gate, up, down
  head = 2 * logits_positions * cfg.emb_dim * cfg.vocab_size
  if keys_values_only:
    if logits_positions:
      raise ValueError("keys_values_only passes have no logits: pass logits_positions=0.")
    last_layer = 2 * length * cfg.emb_dim * 2 * kv_inner  # k, v
    return (cfg.num_layers - 1) * (projections + attention + mlp) + last_layer
  return cfg.num_layers * (projections + attention + mlp) + head


def decode_steps_flops(cfg: DecoderConfig, prefix_length: int, steps: int,
                       cache_slots: Optional[int] = None, causal: bool = False) -> float:
  """`steps` one-token cached decode steps, each with logits, after `prefix_length` keys
  are held. Dense: every step scores the prefix plus all `cache_slots` (default `steps`)
  slots of a preallocated cache; causal: step i scores `prefix_length + i + 1` keys."""
  if causal:
    return sum(decoder_flops(cfg, 1, prefix_length + i, causal=True) for i in range(steps))
  slots = steps if cache_slots is None else cache_slots
  return steps * decoder_flops(cfg, 1, prefix_length + slots - 1)


@dataclasses.dataclass(frozen=True)
class AnswerFlops:
  """A decoder answering from a prompt: the prompt pass, then the generation steps."""
  prompt: float      # prefill of the prompt (or Squid's read of [memory; query])
  generation: float  # the cached one-token steps

  @property
  def total(self) -> float:
    return self.prompt + self.generation


def answer_flops(cfg: DecoderConfig, prompt_length: int, answer_length: int,
                 causal: bool = False) -> AnswerFlops:
  """A plain decoder reads a `prompt_length` prompt (prefill; logits at its last position
  only, which give the first answer token), then takes `answer_length - 1` cached steps
  in a cache of `prompt_length + answer_length` slots: `answer_length` greedy tokens."""
  if answer_length < 1:
    raise ValueError(f"answer_length must be >= 1, got {answer_length}.")
  prompt = decoder_flops(cfg, prompt_length, logits_positions=min(1, prompt_length),
                         causal=causal)
  return AnswerFlops(prompt, decode_steps_flops(cfg, prompt_length, answer_length - 1,
                                                cache_slots=answer_length, causal=causal))


# ----------------------------------------------------------------------------- Squid
@dataclasses.dataclass(frozen=True)
class SquidFlops:
  """Squid answering a query about a context of L tokens, split by part (one example)."""
  small_decoder: float     # compress: [context; N memory tokens], no LM head
  projector: float         # the N memory states -> the large decoder's embeddings
  large_read: float        # the large decoder's keys / values of [N projected vectors; query]
  large_generation: float  # answer_length cached steps from BOS (each with logits)

  @property
  def large_decoder(self) -> float:
    return self.large_read + self.large_generation

  @property
  def total(self) -> float:
    return self.small_decoder + self.projector + self.large_decoder


def projector_flops(config: SquidConfig, memory_count: int) -> float:
  """The MLP projector on `memory_count` vectors: small emb -> hidden ... -> large emb."""
  hidden = config.projector_hidden_dim or config.large.emb_dim
  widths = [config.small.emb_dim] + [hidden] * (config.projector_layers - 1) + [
      config.large.emb_dim]
  return sum(2 * memory_count * a * b for a, b in zip(widths[:-1], widths[1:]))


def squid_flops(config: SquidConfig, context_length: int, query_length: int,
                answer_length: int, causal: bool = False) -> SquidFlops:
  """Squid's FLOPs for one example: the small decoder reads L + N positions (N =
  `config.memory_count(L)`), the projector maps N vectors, the large decoder reads N +
  query positions and then decodes `answer_length` tokens one step at a time from BOS
  (`Squid.decode`: the prefix plus a cache of `answer_length` slots)."""
  if answer_length < 1:
    raise ValueError(f"answer_length must be >= 1, got {answer_length}.")
  memory = config.memory_count(context_length)
  prefix = memory + query_length
  return SquidFlops(
      small_decoder=decoder_flops(config.small, context_length + memory, logits_positions=0,
                                  causal=causal),
      projector=projector_flops(config, memory),
      large_read=decoder_flops(config.large, prefix, logits_positions=0, causal=causal,
                               keys_values_only=True),
      large_generation=decode_steps_flops(config.large, prefix, answer_length,
                                          cache_slots=answer_length, causal=causal))
