"""Analytical forward-pass FLOPs of the T5 encoder-decoder and its compressors.

Counts the matrix multiplications (2 * M * N * K each), which is where a transformer
spends its compute; norms, softmax and activations add a few percent at realistic sizes
(`tests/test_flops.py` holds the model to XLA's own count within 10 %). Per example:

    encoder          every layer over L positions: QKV + scores + weighted sum + output
                     projection + gated MLP; L = n (plain, AttnPool), m + n (DeCAL latents),
                     n + m (CCProxy memory); plus DeCAL's pooling or AttnPool's layer.
                     The compressor counts its part (`Compressor.encoder_flops`, given
                     `EncoderCounts`, the T5 pieces), so a new one brings its own count.
    cross_attention  decoder queries / outputs over t targets, keys / values over m encodings
    decoder          the rest of the decoder: self-attention, MLP, logits

where m = `cfg.compression.output_length(n)` (ceil(n / C); n uncompressed). Decoding one
token at a time with a cache costs about the same per token; these are teacher-forced
numbers.

Decoder-only models (`networks/decoder.py`) and Squid (`networks/squid.py`) are counted per
example by `decoder_flops` (a LLaMA-style decoder over new positions, GQA-aware, SwiGLU, LM
head only where logits are needed), `answer_flops` (prefill a prompt, then greedy cached
steps) and `squid_flops` (small decoder / projector / large decoder). Attention is counted
as the dense masked product the code computes (every query against every key it is shown,
including a preallocated cache's empty slots) unless `causal=True`, which counts only the
keys each position may see (what a causal-aware kernel would do).

GPTHF (`networks/gpthf.py`) and its GPT baselines are counted per example by
`gpthf_generation_flops` (cached generation, `models.DecoderOnlyModel.generate` on a
`Gpthf`), `gpthf_forward_flops` (one parallel pass), `gpthf_step_flops` (one cached step) and
`gpt_generation_flops` (`generate` on a `Decoder`, with or without a parallel prefill, or
`generate_uncached`): see their docstrings for exactly which keys each counts. The paper's own
count (no keys / values kept on either side) is `gpthf_paper_generation_flops` and
`gpt_paper_generation_flops`; `gpthf_paper_flops` also counts `gpthf.paper_generate` as
computed (its compiled lengths).
"""
import dataclasses
import numbers
from typing import List, Optional, Sequence, Tuple, Union

from decal_jax.networks.decoder import DecoderConfig
from decal_jax.networks.gpthf import GpthfConfig
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


@dataclasses.dataclass(frozen=True)
class EncoderCounts:
  """The T5 pieces a compressor's `encoder_flops` / `own_flops` counts with, at `cfg`."""
  cfg: T5Config

  def attention(self, queries: int, keys: int) -> float:
    """One attention layer (projections, scores, weighted sum) of queries over keys."""
    return _attention(self.cfg, queries, keys)

  def layers(self, length: int) -> float:
    """The whole encoder stack over `length` positions."""
    return self.cfg.num_encoder_layers * _encoder_layer(self.cfg, length)

  def mean_pool(self, n: int, m: int) -> float:
    """A masked mean of n token vectors into m: a [m, n] x [n, embed] product."""
    return 2 * n * m * self.cfg.emb_dim


def encoder_flops(cfg: T5Config, inputs_length: int) -> float:
  """The encoder of one example of n tokens, its compressor's own work included."""
  return cfg.compression.encoder_flops(inputs_length, EncoderCounts(cfg))


def forward_flops(cfg: T5Config, inputs_length: int, targets_length: int) -> Flops:
  """Teacher-forced forward FLOPs of one example (n input tokens, t target tokens)."""
  t = targets_length
  m = cfg.compression.output_length(inputs_length)
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


# ----------------------------------------------------------------------------- GPTHF
# Generation as `models.DecoderOnlyModel.generate` runs it: P + K one-token steps, fed BOS,
# prompt[:-1] (the prompt steps: no LM head, and XLA drops the last layer's queries, attention
# and MLP, whose only reader is the unused logits), then prompt[-1] and the new tokens but the
# last (the generation steps: logits each). Sentence layouts below are those of the fed tokens.
SentenceLengths = Union[None, float, Sequence[int]]


def _layer(cfg: DecoderConfig, positions: int, pairs: int) -> float:
  """One decoder block over `positions` new positions scoring `pairs` (query, key) pairs."""
  query_inner, kv_inner = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
  projections = 2 * positions * cfg.emb_dim * (2 * query_inner + 2 * kv_inner)  # q, out; k, v
  attention = 2 * 2 * pairs * query_inner  # q k^T and weights @ v
  return projections + attention + 2 * positions * cfg.emb_dim * cfg.mlp_dim * 3  # SwiGLU


def _keys_values(cfg: DecoderConfig, positions: int) -> float:
  """A block whose only live outputs are its keys / values (a cache write)."""
  return 2 * positions * cfg.emb_dim * 2 * cfg.kv_heads * cfg.head_dim


def _head(cfg: DecoderConfig, positions: int) -> float:
  return 2 * positions * cfg.emb_dim * cfg.vocab_size


def _bounded(lengths: Sequence[int], max_sentence_length: int) -> List[int]:
  """Sentence lengths as the network closes them: one of more than the bound S is cut into
  pieces of S (`gpthf.sentence_layout` closes at place S - 1)."""
  out = []
  for length in lengths:
    if length < 1:
      raise ValueError(f"sentence lengths must be >= 1, got {length}.")
    out += [max_sentence_length] * (length // max_sentence_length)
    if length % max_sentence_length:
      out.append(length % max_sentence_length)
  return out


def sentence_places(length: int, sentence_lengths: SentenceLengths,
                    max_sentence_length: int) -> Tuple[List[int], List[int]]:
  """(place in its sentence, sentence index) of each of `length` consecutive positions.

  sentence_lengths: the lengths (end token included) of the consecutive sentences covering
  the positions; a number: sentences of that mean length (sentence j spans positions
  [round(j * mean), round((j + 1) * mean))); None: no end token at all, every sentence runs
  to the bound (random weights' generation). Lengths past the bound are cut as the network
  cuts them.
  """
  if sentence_lengths is None:
    lengths = [max_sentence_length] * (length // max_sentence_length + 1)
  elif isinstance(sentence_lengths, numbers.Real):
    mean = float(sentence_lengths)
    if mean < 1:
      raise ValueError(f"the mean sentence length must be >= 1, got {mean}.")
    bounds = [round(j * mean) for j in range(int(length / mean) + 2)]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
  else:
    lengths = list(sentence_lengths)
  lengths = _bounded(lengths, max_sentence_length)
  if sum(lengths) < length:
    raise ValueError(f"sentence lengths summing to {sum(lengths)} do not cover the {length} "
                     "positions: give lengths for every fed position (the last sentence may "
                     "run past the end).")
  place, sentence = [], []
  for index, size in enumerate(lengths):
    place += range(size)
    sentence += [index] * size
  return place[:length], sentence[:length]


def gpthf_step_flops(config: GpthfConfig, place: int = 0, sentence: int = 0,
                     logits: bool = True, causal: bool = False) -> float:
  """One cached GPTHF step (`Gpthf` with decode=True) for the token at `place` of sentence
  `sentence`: the encoder blocks attend to the sentence cache, the body blocks to the body
  cache plus the token's own row, then the LM head.

  Dense (`causal=False`, as the code computes): every encoder block scores all
  `max_sentence_length` slots and every body block all `decoder.max_length` slots plus its
  own row, whatever the sentence structure. Causal: `place + 1` and `sentence + 1` keys (the
  finished sentences and the token itself). `logits=False`: a prompt step, whose logits
  nobody reads (no head; the last body block only writes its keys / values).
  """
  cfg = config.decoder
  body = cfg.num_layers - config.encoder_layers
  sentence_keys = place + 1 if causal else config.max_sentence_length
  body_keys = sentence + 1 if causal else cfg.max_length + 1
  encoder = config.encoder_layers * _layer(cfg, 1, sentence_keys)
  if logits:
    return encoder + body * _layer(cfg, 1, body_keys) + _head(cfg, 1)
  return encoder + (body - 1) * _layer(cfg, 1, body_keys) + _keys_values(cfg, 1)


def gpthf_generation_flops(config: GpthfConfig, prompt_length: int, new_tokens: int,
                           sentence_lengths: SentenceLengths = None,
                           causal: bool = False) -> AnswerFlops:
  """Cached GPTHF generation of one example (`DecoderOnlyModel.generate` on a `Gpthf`):
  `prompt_length` prompt steps then `new_tokens` generation steps, each `gpthf_step_flops`
  at its fed token's place and sentence (`sentence_places` of the P + K fed tokens: BOS,
  the prompt, the new tokens but the last). Dense counting does not depend on the sentence
  structure (every step scores all slots); causal counting does."""
  if prompt_length < 0 or new_tokens < 1:
    raise ValueError(f"need prompt_length >= 0 and new_tokens >= 1, got {prompt_length} and "
                     f"{new_tokens}.")
  total = prompt_length + new_tokens
  place, sentence = sentence_places(total, sentence_lengths, config.max_sentence_length)
  steps = [gpthf_step_flops(config, p, s, logits=i >= prompt_length, causal=causal)
           for i, (p, s) in enumerate(zip(place, sentence))]
  return AnswerFlops(sum(steps[:prompt_length]), sum(steps[prompt_length:]))


def gpthf_forward_flops(config: GpthfConfig, length: int,
                        sentence_lengths: SentenceLengths = None, causal: bool = False) -> float:
  """One parallel GPTHF pass over `length` tokens (training, or one step of uncached
  generation), logits at every position. Dense (as computed): both the block-causal encoder
  and the body score all length x length pairs (the masks zero most of them). Causal: the
  encoder scores each token against the earlier tokens of its sentence and itself, the body
  each token against the sentences finished before it and itself."""
  cfg = config.decoder
  body = cfg.num_layers - config.encoder_layers
  if causal:
    place, sentence = sentence_places(length, sentence_lengths, config.max_sentence_length)
    encoder_pairs, body_pairs = sum(p + 1 for p in place), sum(s + 1 for s in sentence)
  else:
    encoder_pairs = body_pairs = length * length
  return (config.encoder_layers * _layer(cfg, length, encoder_pairs)
          + body * _layer(cfg, length, body_pairs) + _head(cfg, length))


def gpt_generation_flops(cfg: DecoderConfig, prompt_length: int, new_tokens: int,
                         cached: bool, prefill: bool = False, causal: bool = False,
                         bucket: Optional[int] = None) -> AnswerFlops:
  """A plain `Decoder` generating `new_tokens` after `prompt_length` tokens (one example).

  cached (`DecoderOnlyModel.generate`): a KV cache of T = P + K slots (the length of the
  cache-creation call); P prompt steps (no head, the last block keys / values only) then K
  generation steps with logits; dense, every step scores all T slots; causal, step i scores
  i + 1. With `prefill`, the P fed prompt tokens instead go through one causal pass that
  attends within them (dense P x P; no head, last block keys / values only), then the same K
  steps. Not cached (`generate_uncached`): each of the K steps reruns the whole network with
  logits at every position (`prompt` is 0: there is no separate prompt phase), over the
  T-position buffer (`bucket` None) or, in groups of `bucket` steps, over P + e + 1
  positions for the group that ends at step e (the growing buffer).
  """
  if prompt_length < 0 or new_tokens < 1:
    raise ValueError(f"need prompt_length >= 0 and new_tokens >= 1, got {prompt_length} and "
                     f"{new_tokens}.")
  total = prompt_length + new_tokens
  if not cached:
    if prefill:
      raise ValueError("prefill fills a KV cache: pass cached=True with prefill=True.")
    group = new_tokens if bucket is None else bucket
    return AnswerFlops(0.0, sum(
        (min(start + group, new_tokens) - start)
        * decoder_flops(cfg, prompt_length + min(start + group, new_tokens), causal=causal)
        for start in range(0, new_tokens, group)))
  layers = cfg.num_layers
  keys = lambda step: step + 1 if causal else total
  if prefill:
    prompt = decoder_flops(cfg, prompt_length, logits_positions=0, causal=causal,
                           keys_values_only=True) if prompt_length else 0.0
  else:
    prompt = sum((layers - 1) * _layer(cfg, 1, keys(i)) + _keys_values(cfg, 1)
                 for i in range(prompt_length))
  generation = sum(layers * _layer(cfg, 1, keys(i)) + _head(cfg, 1)
                   for i in range(prompt_length, total))
  return AnswerFlops(prompt, generation)


# ----------------------------------------------------------------------------- the paper's count
# How the paper counts (our reading of gpthf_summary.md, which gives no formula): neither side
# keeps keys / values. GPT reruns the whole network over the tokens so far at each of the K
# steps; GPTHF reads the prompt once (its word-level blocks over the P fed tokens, which yields
# the finished sentences' embeddings), then each step reruns the word-level blocks over the
# current sentence so far and the sentence-level blocks over the finished sentences'
# embeddings plus the token's state (`gpthf.paper_generate`). Every pass is counted as a dense
# product over the positions it holds (the paper's dynamic masks zero the pairs they hide, they
# do not skip them), and one LM head row per step (the one read), on both sides.
def gpthf_paper_flops(config: GpthfConfig, prompt_length: int,
                      steps: Sequence[Tuple[int, int]]) -> AnswerFlops:
  """GPTHF without keys / values: the word-level blocks over the P fed prompt tokens (dense
  P x P pairs, no head), then per step (word-level rows, sentence-level rows): every block
  over its rows densely and one LM head row. `steps` from `paper_steps` (what the paper
  counts), or the compiled lengths a jitted run took (as computed)."""
  cfg = config.decoder
  body = cfg.num_layers - config.encoder_layers
  prompt = config.encoder_layers * _layer(cfg, prompt_length, prompt_length ** 2)
  return AnswerFlops(prompt, sum(
      config.encoder_layers * _layer(cfg, words, words ** 2)
      + body * _layer(cfg, sentences, sentences ** 2) + _head(cfg, 1)
      for words, sentences in steps))


def paper_steps(config: GpthfConfig, prompt_length: int, new_tokens: int,
                sentence_lengths: SentenceLengths = None) -> List[Tuple[int, int]]:
  """(word-level rows, sentence-level rows) of each of the K steps: the token at place p of
  sentence j reruns p + 1 tokens and j + 1 rows (`sentence_places` of the P + K fed tokens)."""
  place, sentence = sentence_places(prompt_length + new_tokens, sentence_lengths,
                                    config.max_sentence_length)
  return [(p + 1, j + 1) for p, j in zip(place[prompt_length:], sentence[prompt_length:])]


def gpthf_paper_generation_flops(config: GpthfConfig, prompt_length: int, new_tokens: int,
                                 sentence_lengths: SentenceLengths = None) -> AnswerFlops:
  """GPTHF generation as the paper counts it (see above)."""
  return gpthf_paper_flops(config, prompt_length,
                           paper_steps(config, prompt_length, new_tokens, sentence_lengths))


def gpt_paper_generation_flops(cfg: DecoderConfig, prompt_length: int,
                               new_tokens: int) -> AnswerFlops:
  """GPT generation as the paper counts it: step i reruns the network over the P + i + 1
  positions so far (BOS, the prompt, i new tokens), dense pairs, one LM head row."""
  return AnswerFlops(0.0, sum(
      cfg.num_layers * _layer(cfg, length, length ** 2) + _head(cfg, 1)
      for length in range(prompt_length + 1, prompt_length + new_tokens + 1)))
