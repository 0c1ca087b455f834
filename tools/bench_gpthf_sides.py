"""The sides of tools/bench_gpthf.py: its presets, the one set of random weights both networks
share, each side's program, and the sentence statistics the FLOP counts read.

  python -m tools.bench_gpthf --out docs/results/gpthf_efficiency_cpu.md \
      --plot docs/results/gpthf_efficiency_cpu.png   # (this module runs nothing itself)
"""
import dataclasses
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax import decoding, models
from decal_jax.networks import gpthf
from decal_jax.networks.decoder import Decoder, DecoderConfig
from tools import benchmarking
from tools.benchmarking import NoEos, Run, Side, available_bytes, check_fits, needed_bytes, timed

OURS = ("GPTHF", "GPTHF, paper inference")
BASELINES = ("GPT no cache", "GPT cache", "GPT cache + prefill")
SIDES = OURS + BASELINES


# ----------------------------------------------------------------------------- presets
class Preset(NamedTuple):
  decoder: DecoderConfig       # the GPT's shape; max_length is set per row to n + k
  encoder_layers: int          # GPTHF's word-level blocks (the rest are sentence-level)
  max_sentence_length: int
  dtype: str
  init_std: float              # random weights ~ N(0, init_std); norm scales 1
  max_batch_work: Optional[int]  # batches > 1 only where batch * k * (n + k) <= this
  source: str


def _cpu_preset() -> Preset:
  """GPTHF-16-8's 2 : 1 split shrunk (4 word-level + 2 sentence-level blocks, mlp 4x emb),
  tied embeddings over the built-in vocabulary (4,224 ids as in gin/models/*_tiny.gin)."""
  return Preset(DecoderConfig(vocab_size=4224, emb_dim=128, num_heads=4, head_dim=32,
                              mlp_dim=512, num_layers=6, tie_embeddings=True),
                4, 64, "float32", 0.02, 200_000, "the `cpu` preset (tools/bench_gpthf.py)")


def _paper_preset() -> Preset:
  """GPTHF-16-8 and Baseline-24: 24 blocks of d 1024, 16 heads x 64, SwiGLU 4096, tied."""
  return Preset(DecoderConfig(vocab_size=50304, emb_dim=1024, num_heads=16, head_dim=64,
                              mlp_dim=4096, num_layers=24, tie_embeddings=True),
                16, 64, "bfloat16", 0.02, None,
                "the `paper` preset: GPTHF-16-8 / Baseline-24 shapes (tools/bench_gpthf.py)")


def _tiny_preset() -> Preset:
  return Preset(DecoderConfig(vocab_size=4224, emb_dim=16, num_heads=2, num_kv_heads=1,
                              head_dim=8, mlp_dim=32, num_layers=2, tie_embeddings=True),
                1, 8, "float32", 0.5, None, "the `tiny` preset (tests)")


PRESETS: Dict[str, Callable[[], Preset]] = {"cpu": _cpu_preset, "paper": _paper_preset,
                                            "tiny": _tiny_preset}


def row_configs(args, prompt_length: int, new_tokens: int
                ) -> Tuple[DecoderConfig, gpthf.GpthfConfig]:
  """The GPT's and GPTHF's configs for one row: max_length = n + k (the fewest positions
  `generate` accepts, which also sizes GPTHF's body cache); same weights for every row."""
  preset = args.preset_value
  decoder = dataclasses.replace(preset.decoder, max_length=prompt_length + new_tokens,
                                dtype=jnp.dtype(args.dtype or preset.dtype), dropout_rate=0.0)
  return decoder, gpthf.GpthfConfig(decoder=decoder, encoder_layers=preset.encoder_layers,
                                    sentence_end_id=args.end_id,
                                    max_sentence_length=preset.max_sentence_length)


# ----------------------------------------------------------------------------- weights
def _param_shapes(cfg: DecoderConfig):
  tokens = jnp.ones((1, 1), jnp.int32)
  return jax.eval_shape(lambda: Decoder(cfg).init(jax.random.PRNGKey(0), tokens,
                                                  enable_dropout=False))["params"]


def param_count(cfg: DecoderConfig) -> int:
  return benchmarking.param_count(_param_shapes(cfg))


def random_params(cfg: DecoderConfig, seed: int = 0, std: float = 0.02) -> dict:
  """Random weights of `Decoder`'s tree (also `Gpthf`'s), after checking that they fit."""
  need = param_count(cfg) * jnp.dtype(cfg.dtype).itemsize
  benchmarking.check_weights_fit(need, available_bytes())
  return benchmarking.random_params(_param_shapes(cfg), cfg.dtype, seed, std)


class SentenceCounts(NamedTuple):
  """Sentences GPTHF's layout closes, summed over the batch rows."""
  prompt_end: int    # in the prompt, by the end id
  prompt_bound: int  # in the prompt, by max_sentence_length
  new_end: int       # in the k new tokens, by the end id
  new_bound: int


def sentence_stats(config: gpthf.GpthfConfig, prompt: np.ndarray, new: np.ndarray
                   ) -> Tuple[SentenceCounts, List[List[int]]]:
  """Counts of closed sentences, and per row the sentence lengths of the n + k fed tokens
  (BOS, prompt, new tokens but the last) by the network's own rule (`sentence_layout`)."""
  text = np.concatenate([np.zeros((prompt.shape[0], 1), np.int32), prompt, new], axis=1)
  layout = gpthf.sentence_layout(jnp.asarray(text), config.sentence_end_id,
                                 config.max_sentence_length)
  closes = np.asarray(layout.closes)  # [b, 1 + n + k]
  by_end = closes & (text == config.sentence_end_id)
  n = prompt.shape[1]
  counts = SentenceCounts(int(by_end[:, 1:n + 1].sum()), int((closes & ~by_end)[:, 1:n + 1].sum()),
                          int(by_end[:, n + 1:].sum()), int((closes & ~by_end)[:, n + 1:].sum()))
  fed = text.shape[1] - 1
  lengths = []
  for row in closes[:, :fed]:
    ends = (np.flatnonzero(row) + 1).tolist()  # exclusive ends of the closed sentences
    if not ends or ends[-1] < fed:
      ends.append(fed)  # the sentence still open after the last fed token
    lengths.append(np.diff([0] + ends).tolist())
  return counts, lengths



def paper_computed_steps(config: gpthf.GpthfConfig, fed: np.ndarray,
                         prompt_length: int) -> List[Tuple[int, int]]:
  """The lengths `gpthf.paper_generate` compiles and runs at each of its K steps, from the fed
  tokens `[b, P + K]` (BOS, prompt, new tokens but the last): the smallest of `bucket_sizes`
  holding every row's sentence so far, and the smallest holding every row's finished
  sentences, plus the token's own row (what `flops.gpthf_paper_flops` counts as computed)."""
  layout = gpthf.sentence_layout(jnp.asarray(fed), config.sentence_end_id,
                                 config.max_sentence_length)
  place, sentence = np.asarray(layout.place), np.asarray(layout.sentence)  # [b, P + K]
  words = gpthf.bucket_sizes(config.max_sentence_length)
  slots = gpthf.bucket_sizes(fed.shape[1])
  smallest = lambda sizes, need: next(size for size in sizes if size >= need)
  return [(smallest(words, place[:, t].max() + 1), smallest(slots, sentence[:, t].max()) + 1)
          for t in range(prompt_length, fed.shape[1])]


# ----------------------------------------------------------------------------- the sides
def side_functions(decoder: DecoderConfig, config: gpthf.GpthfConfig, new_tokens: int,
                   continuation: str, bucket: Optional[int]) -> Dict[str, Callable]:
  """{side: fn(params, prompt [b, n], text continuation [b, k]) -> tokens [b, k]}: with
  `continuation` "real" every side feeds the text's next tokens and records its argmax;
  "greedy", its own argmax. `bucket`: steps per compiled buffer length of the uncached GPT."""
  decode_fn = decoding.forced_decode if continuation == "real" else decoding.temperature_sample
  network = gpthf.Gpthf(config)
  ours = models.DecoderOnlyModel(network, NoEos(), decode_fn=decode_fn)
  gpt = models.DecoderOnlyModel(Decoder(decoder), NoEos(), decode_fn=decode_fn)
  k = new_tokens
  if continuation == "real":
    return {
        "GPTHF": lambda p, prompt, text: ours.generate(p, prompt, k, forced=text),
        "GPTHF, paper inference": lambda p, prompt, text: gpthf.paper_generate(
            network, p, prompt, k, forced=text),
        "GPT no cache": lambda p, prompt, text: gpt.generate_uncached(p, prompt, k,
                                                                      bucket=bucket,
                                                                      forced=text),
        "GPT cache": lambda p, prompt, text: gpt.generate(p, prompt, k, forced=text),
        "GPT cache + prefill": lambda p, prompt, text: gpt.generate(p, prompt, k, prefill=True,
                                                                    forced=text)}
  return {"GPTHF": lambda p, prompt, text: ours.generate(p, prompt, k),
          "GPTHF, paper inference": lambda p, prompt, text: gpthf.paper_generate(
              network, p, prompt, k),
          "GPT no cache": lambda p, prompt, text: gpt.generate_uncached(p, prompt, k,
                                                                        bucket=bucket),
          "GPT cache": lambda p, prompt, text: gpt.generate(p, prompt, k),
          "GPT cache + prefill": lambda p, prompt, text: gpt.generate(p, prompt, k, prefill=True)}


def compile_side(name: str, fn: Callable, params, prompt, text, what: str) -> Side:
  compiled = jax.jit(fn).lower(params, prompt, text).compile()
  check_fits(compiled, f"{name} at {what}")

  def run() -> Run:
    tokens, seconds = timed(compiled, params, prompt, text)
    return Run(seconds, np.asarray(tokens))
  return Side(name, run, needed_bytes(compiled))


