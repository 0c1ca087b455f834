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
"""
import dataclasses
import math

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
