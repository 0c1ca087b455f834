# python tools/bench_gpthf.py --out docs/results/gpthf_efficiency_cpu.md --plot docs/results/gpthf_efficiency_cpu.png
"""GPTHF (cached) against an equally sized GPT without and with a KV cache: FLOPs and time.

  python tools/bench_gpthf.py --out docs/results/gpthf_efficiency_cpu.md \
      --plot docs/results/gpthf_efficiency_cpu.png
  python tools/bench_gpthf.py --preset paper --out docs/results/gpthf_efficiency_gpu.md \
      --plot docs/results/gpthf_efficiency_gpu.png  # GPTHF-16-8 vs Baseline-24: a GPU

For every prompt length n, generation length k and batch size, on one set of random weights
(GPTHF has exactly the parameters of the GPT built from the same DecoderConfig, so one
parameter tree serves both networks):
  * GPTHF: `DecoderOnlyModel.generate` on `Gpthf`: the prompt fed one token at a time
    through its sentence and body caches, then k cached steps;
  * GPT, no cache (the paper's baseline, its Tables 2-3): `generate_uncached` on `Decoder`,
    k steps, each rerunning the whole network over the n + k token buffer;
  * GPT, cache (the like-for-like one): `generate` on `Decoder`, the prompt fed one token at
    a time through the KV cache exactly as GPTHF's is, then k cached steps;
  * GPT, cache + prefill (how GPT serving reads a prompt): the prompt written into the KV
    cache by one causal pass, then the same k cached steps (GPTHF has no prefill).
Every side is one jitted program timed end to end (median of --repeats runs after
compilation and --warmup untimed runs; within a row the sides run once per repeat in an
order reversed every repeat, so load on a shared machine hits all alike). FLOPs are
analytical (`decal_jax.flops`, matmuls, per example): "as computed" counts dense attention
over every slot a side scores (GPTHF: max_sentence_length sentence slots and
decoder.max_length = n + k body slots; GPT: its n + k cache slots, or the whole buffer),
"causal" only the keys each token may see.

Prompts are real text: built-in corpus paragraphs split into sentences
(`data.sentences.split_sentences`), tokenized with the built-in vocabulary, each sentence
followed by the end-of-sentence id (`sentences.encode_sentences`, as GPTHF's training data);
each batch row is a different window starting at a paragraph start. Random weights almost
never emit the end id, so greedily generated sentences close only at max_sentence_length:
`--continuation real` (default) feeds the text's own next k tokens through the very same
steps (same per-token compute as generation, real sentence ends; the uncached GPT likewise
writes them into its buffer) and records each step's argmax; `--continuation greedy` feeds
each side's own argmax. No row stops at EOS: every side runs all k steps. The report counts
the sentences GPTHF closed by the end id and by the length bound.

Presets: `cpu` (default; a 6-layer model, 4 word-level + 2 sentence-level, for 2 CPU
cores; batches above 1 only where batch * k * (n + k) <= --max_batch_work), `paper`
(GPTHF-16-8 vs Baseline-24 shapes, bfloat16: for a GPU), `tiny` (tests). Before any
program runs, the weights' and each compiled program's memory need is compared with what
the machine has; a row that does not fit is reported as such.
"""
import argparse
import dataclasses
import datetime
import functools
import math
import os
import pathlib
import shlex
import statistics
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from bench_nuggets import (DoesNotFit, _timed, available_bytes, check_fits,  # noqa: E402
                           load_average, machine, needed_bytes)
from bench_squid import _int_list, measure  # noqa: E402
from decal_jax import decoding, flops, models  # noqa: E402
from decal_jax.data import corpus, vocabularies  # noqa: E402
from decal_jax.data.sentences import encode_sentences, sentence_end_id  # noqa: E402
from decal_jax.networks import gpthf  # noqa: E402
from decal_jax.networks.decoder import Decoder, DecoderConfig  # noqa: E402

SIDES = ("GPTHF", "GPT no cache", "GPT cache", "GPT cache + prefill")
PAPER = {"n": 500, "k": 20, "flop_ratio": 9.73, "speedup": 2.99, "speedup_batch": 32}


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
  """GPTHF-16-8's 2 : 1 split shrunk: 4 word-level + 2 sentence-level blocks, emb 128, 4
  heads x 32, SwiGLU mlp 512 (4x emb, as the paper's), tied embeddings over the built-in
  vocabulary (its ids, sentinels included, rounded up to 4,224 as in gin/models/*_tiny.gin)."""
  return Preset(DecoderConfig(vocab_size=4224, emb_dim=128, num_heads=4, head_dim=32,
                              mlp_dim=512, num_layers=6, tie_embeddings=True),
                4, 64, "float32", 0.02, 200_000, "the `cpu` preset (tools/bench_gpthf.py)")


def _paper_preset() -> Preset:
  """GPTHF-16-8 and Baseline-24: 24 blocks of d 1024, 16 heads x 64, SwiGLU 4096, tied
  embeddings over a 50,304-id vocabulary; sentences of at most 64 tokens."""
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
  return sum(math.prod(x.shape) for x in jax.tree.leaves(_param_shapes(cfg)))


RANDOM_BLOCK = 1 << 22  # random values drawn once and shared by every weight matrix


def random_params(cfg: DecoderConfig, seed: int = 0, std: float = 0.02) -> dict:
  """Random weights (`Decoder`'s tree, which is also `Gpthf`'s) in the compute dtype: norm
  scales 1, every other leaf a stretch of one block of N(0, std) values drawn on the host.
  Checks first that they fit in memory (seconds for the paper's shapes, no compile)."""
  shapes = _param_shapes(cfg)
  need = param_count(cfg) * jnp.dtype(cfg.dtype).itemsize
  have = available_bytes()
  if have is not None and need > 0.5 * have:
    raise DoesNotFit(f"the weights need {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB "
                     "available (a smaller --preset, or a machine with more memory)")
  rng = np.random.default_rng(seed)
  block = std * rng.standard_normal(RANDOM_BLOCK, dtype=np.float32)

  def make(path, shape):
    if path[-1].key == "scale":
      return jnp.ones(shape.shape, cfg.dtype)
    size = math.prod(shape.shape)
    if size <= RANDOM_BLOCK:
      start = int(rng.integers(0, RANDOM_BLOCK - size + 1))
      return jnp.asarray(block[start:start + size].reshape(shape.shape), cfg.dtype)
    return jnp.resize(jnp.asarray(block, cfg.dtype), shape.shape)

  return jax.tree_util.tree_map_with_path(make, shapes)


# ----------------------------------------------------------------------------- text
@functools.lru_cache(maxsize=None)
def _document_ids(max_sentence_length: int) -> Tuple[List[int], ...]:
  """Every built-in corpus paragraph as token ids with the end id after each sentence
  (`encode_sentences`: long sentences cut at the bound, as in GPTHF's training data)."""
  vocabulary = vocabularies.builtin_vocabulary()
  end_id = sentence_end_id(vocabulary)
  documents = corpus.documents()
  return tuple(encode_sentences(document, vocabulary, end_id, max_sentence_length).tolist()
               for document in documents["train"] + documents["validation"])


@functools.lru_cache(maxsize=None)
def text_rows(rows: int, length: int, max_sentence_length: int) -> np.ndarray:
  """`[rows, length]` token ids of the built-in corpus, sentence-segmented; each row a
  different window that starts at a paragraph start."""
  out, window = [], []
  for ids in _document_ids(max_sentence_length):
    window += ids
    if len(window) >= length:
      out.append(window[:length])
      window = []
      if len(out) == rows:
        return np.asarray(out, np.int32)
  raise ValueError(f"The built-in corpus holds fewer than {rows} windows of {length} tokens: "
                   "ask for shorter prompts or a smaller batch.")


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


# ----------------------------------------------------------------------------- generation
class NoEos:
  """The model wrappers read only `eos_id` from their vocabulary; -1 matches no token, so
  every row runs all k steps (a benchmark measures a fixed amount of work)."""
  eos_id = -1


def forced_decode(inputs, cache, tokens_to_logits, eos_id, forced=None, **unused):
  """A `decode_fn` (`decoding.temperature_sample`'s signature) that feeds the given tokens:
  step i feeds forced[:, i - 1] (step 0: the prompt's last token, which `generate`
  substitutes) and records the argmax of its logits. -> (predictions `[b, 1, k]`, zeros)."""
  del eos_id, unused
  batch, length = inputs.shape
  feed = jnp.pad(forced, ((0, 0), (1, 0)))  # [b, k + 1]: a start slot, then the text

  def step(i, carry):
    predicted, cache = carry
    token = jax.lax.dynamic_slice(feed, (0, i), (batch, 1))  # [b, 1]
    logits, cache = tokens_to_logits(decoding.DecodingState(i, predicted, token, cache))
    best = jnp.argmax(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
    predicted = jax.lax.dynamic_update_slice(predicted, best[:, None].astype(jnp.int32), (0, i))
    return predicted, cache

  predicted, _ = jax.lax.fori_loop(0, length, step, (inputs, cache))
  return predicted[:, None, :], jnp.zeros((batch, 1), jnp.float32)


def uncached_continuation(model: models.DecoderOnlyModel, params, prompt, continuation):
  """`DecoderOnlyModel.generate_uncached` step for step, except that step i writes the
  text's token continuation[:, i] into the buffer; its argmax is recorded. `[b, k]`."""
  batch, length = prompt.shape
  new_tokens = continuation.shape[1]
  tokens = jnp.zeros((batch, length + new_tokens), jnp.int32).at[:, :length].set(prompt)

  def step(i, carry):
    tokens, predicted = carry
    inputs = jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]  # BOS + everything so far
    logits = model.module.apply({"params": params}, inputs, enable_dropout=False)
    best = jnp.argmax(logits[:, length + i], axis=-1).astype(jnp.int32)  # [b]
    tokens = tokens.at[:, length + i].set(continuation[:, i])
    return tokens, predicted.at[:, i].set(best)

  init = (tokens, jnp.zeros((batch, new_tokens), jnp.int32))
  return jax.lax.fori_loop(0, new_tokens, step, init)[1]


def side_functions(decoder: DecoderConfig, config: gpthf.GpthfConfig, new_tokens: int,
                   continuation: str) -> Dict[str, Callable]:
  """{side: fn(params, prompt [b, n], text continuation [b, k]) -> tokens [b, k]}."""
  decode_fn = forced_decode if continuation == "real" else decoding.temperature_sample
  ours = models.DecoderOnlyModel(gpthf.Gpthf(config), NoEos(), decode_fn=decode_fn)
  gpt = models.DecoderOnlyModel(Decoder(decoder), NoEos(), decode_fn=decode_fn)
  k = new_tokens
  if continuation == "real":
    return {
        "GPTHF": lambda p, prompt, text: ours.generate(p, prompt, k, forced=text),
        "GPT no cache": lambda p, prompt, text: uncached_continuation(gpt, p, prompt, text),
        "GPT cache": lambda p, prompt, text: gpt.generate(p, prompt, k, forced=text),
        "GPT cache + prefill": lambda p, prompt, text: gpt.generate(p, prompt, k, prefill=True,
                                                                    forced=text)}
  return {"GPTHF": lambda p, prompt, text: ours.generate(p, prompt, k),
          "GPT no cache": lambda p, prompt, text: gpt.generate_uncached(p, prompt, k),
          "GPT cache": lambda p, prompt, text: gpt.generate(p, prompt, k),
          "GPT cache + prefill": lambda p, prompt, text: gpt.generate(p, prompt, k, prefill=True)}


# ----------------------------------------------------------------------------- sides
class Run(NamedTuple):
  seconds: float
  tokens: np.ndarray  # [batch, k]


class Side:
  """One compiled program, runnable end to end, collecting timed runs."""

  def __init__(self, name: str, runner: Callable[[], Run], memory_bytes: Optional[int]):
    self.name, self.runner, self.memory_bytes = name, runner, memory_bytes
    self.runs: List[Run] = []

  def median(self) -> float:
    return statistics.median(r.seconds for r in self.runs)

  def ms(self) -> str:
    """'median (min-max)' milliseconds."""
    times = [r.seconds for r in self.runs]
    return f"{_ms(self.median())} ({_ms(min(times))}-{_ms(max(times))})"

  @property
  def tokens(self) -> np.ndarray:
    return self.runs[0].tokens


def compile_side(name: str, fn: Callable, params, prompt, text, what: str) -> Side:
  compiled = jax.jit(fn).lower(params, prompt, text).compile()
  check_fits(compiled, f"{name} at {what}")

  def run() -> Run:
    tokens, seconds = _timed(compiled, params, prompt, text)
    return Run(seconds, np.asarray(tokens))

  return Side(name, run, needed_bytes(compiled))


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Row:
  prompt: int
  new: int
  batch: int
  sides: Dict[str, Side] = dataclasses.field(default_factory=dict)
  flops: Dict[str, float] = dataclasses.field(default_factory=dict)         # as computed
  causal_flops: Dict[str, float] = dataclasses.field(default_factory=dict)  # visible keys
  counts: Optional[SentenceCounts] = None
  text: Optional[np.ndarray] = None  # [batch, n + k] the prompts and their continuations
  configs: Optional[Tuple[DecoderConfig, gpthf.GpthfConfig]] = None
  note: str = ""

  @property
  def done(self) -> bool:
    return not self.note


def _gpt_flops(decoder: DecoderConfig, n: int, k: int, causal: bool) -> Dict[str, float]:
  return {"GPT no cache": flops.gpt_generation_flops(decoder, n, k, False, causal=causal).total,
          "GPT cache": flops.gpt_generation_flops(decoder, n, k, True, causal=causal).total,
          "GPT cache + prefill": flops.gpt_generation_flops(decoder, n, k, True, prefill=True,
                                                            causal=causal).total}


def grid(args) -> List[Row]:
  rows = []
  for n in args.prompts:
    for k in args.new_tokens:
      for batch in args.batches:
        row = Row(n, k, batch)
        if batch > 1 and args.max_batch_work is not None and (
            batch * k * (n + k) > args.max_batch_work):
          row.note = (f"skipped: batch x k x (n + k) = {batch * k * (n + k):,} > "
                      f"--max_batch_work {args.max_batch_work:,}")
        rows.append(row)
  return rows


def run_row(row: Row, args, params) -> None:
  n, k, batch = row.prompt, row.new, row.batch
  decoder, config = row.configs = row_configs(args, n, k)
  row.text = text_rows(batch, n + k, config.max_sentence_length)
  prompt, continuation = jnp.asarray(row.text[:, :n]), jnp.asarray(row.text[:, n:])
  what = f"n={n}, k={k}, batch={batch}"
  functions = side_functions(decoder, config, k, args.continuation)
  for name in tqdm.tqdm(SIDES, desc=f"compile {what}", leave=False, dynamic_ncols=True):
    row.sides[name] = compile_side(name, functions[name], params, prompt, continuation, what)
  measure(list(row.sides.values()), args.warmup, args.repeats, what)
  new = row.text[:, n:] if args.continuation == "real" else row.sides["GPTHF"].tokens
  row.counts, lengths = sentence_stats(config, row.text[:, :n], new)
  row.flops = {"GPTHF": flops.gpthf_generation_flops(config, n, k).total,
               **_gpt_flops(decoder, n, k, causal=False)}
  row.causal_flops = {"GPTHF": statistics.mean(
      flops.gpthf_generation_flops(config, n, k, lengths_b, causal=True).total
      for lengths_b in lengths), **_gpt_flops(decoder, n, k, causal=True)}


def run(args) -> List[Row]:
  args.load_before = load_average()
  rows = grid(args)
  decoder, _ = row_configs(args, 1, 1)
  params = random_params(decoder, args.seed, args.init_std)
  for row in tqdm.tqdm([r for r in rows if r.done], desc="rows", dynamic_ncols=True):
    try:
      run_row(row, args, params)
    except DoesNotFit as e:
      row.sides, row.note = {}, f"did not fit: {e}"
    tqdm.tqdm.write(_summary(row))
  args.load_after = load_average()
  return rows


# ----------------------------------------------------------------------------- report
def speedup(row: Row, baseline: str) -> float:
  """Measured: the baseline's median time / GPTHF's."""
  return row.sides[baseline].median() / row.sides["GPTHF"].median()


def flop_ratio(row: Row, baseline: str, causal: bool = False) -> float:
  table = row.causal_flops if causal else row.flops
  return table[baseline] / table["GPTHF"]


def _summary(row: Row) -> str:
  head = f"n={row.prompt} k={row.new} batch={row.batch}"
  if not row.done:
    return f"{head}: {row.note}"
  times = ", ".join(f"{name} {row.sides[name].median() * 1e3:.1f} ms" for name in SIDES)
  return (f"{head}: {times}; GPTHF speedup {speedup(row, 'GPT no cache'):.2f}x vs no cache, "
          f"{speedup(row, 'GPT cache'):.2f}x vs cache; FLOP ratio "
          f"{flop_ratio(row, 'GPT no cache'):.1f} / {flop_ratio(row, 'GPT cache'):.2f}")


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.1f}"


def _gflop(value: float) -> str:
  return f"{value / 1e9:.3g}"


def time_table(rows: Sequence[Row]) -> List[str]:
  lines = ["| n | k | batch | GPTHF ms (min-max) | GPT no cache ms | GPT cache ms "
           "| GPT cache + prefill ms | speedup vs no cache (paper) | speedup vs cache (fair) "
           "| speedup vs cache + prefill |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    head = f"| {row.prompt} | {row.new} | {row.batch} |"
    if not row.done:
      lines.append(f"{head} {row.note} |" + " |" * 6)
      continue
    lines.append(f"{head} {' | '.join(row.sides[name].ms() for name in SIDES)} | "
                 + " | ".join(f"{speedup(row, name):.2f}" for name in SIDES[1:]) + " |")
  return lines


def flop_table(rows: Sequence[Row]) -> List[str]:
  lines = ["| n | k | batch | GFLOP as computed: GPTHF / no cache / cache / cache + prefill "
           "| FLOP ratio as computed: no cache / cache / cache + prefill "
           "| FLOP ratio causal: no cache / cache / cache + prefill "
           "| GPTHF sentences closed in prompt: end id / bound "
           "| in the k new tokens: end id / bound |",
           "|---|---|---|---|---|---|---|---|"]
  for row in rows:
    if not row.done:
      continue
    counts = row.counts
    lines.append(
        f"| {row.prompt} | {row.new} | {row.batch} | "
        f"{' / '.join(_gflop(row.flops[name]) for name in SIDES)} | "
        f"{' / '.join(f'{flop_ratio(row, name):.2f}' for name in SIDES[1:])} | "
        f"{' / '.join(f'{flop_ratio(row, name, True):.2f}' for name in SIDES[1:])} | "
        f"{counts.prompt_end} / {counts.prompt_bound} | {counts.new_end} / {counts.new_bound} |")
  return lines


def _range(values, digits: int = 2) -> str:
  values = list(values)
  low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
  return low if low == high else f"{low}-{high}"


def token_agreement(rows: Sequence[Row]) -> Tuple[int, int]:
  """(tokens where both cached GPT sides equal the uncached one, tokens compared)."""
  same = total = 0
  for row in rows:
    if row.done:
      reference = row.sides["GPT no cache"].tokens
      for name in ("GPT cache", "GPT cache + prefill"):
        same += int((row.sides[name].tokens == reference).sum())
        total += reference.size
  return same, total


def reading(args, rows: Sequence[Row]) -> List[str]:
  """A few sentences drawn from the numbers (no claims beyond them)."""
  done = [row for row in rows if row.done]
  if not done:
    return ["- nothing ran to completion; see the notes in the table."]
  lines = []
  headline = [row for row in done if (row.prompt, row.new) == (PAPER["n"], PAPER["k"])]
  for row in headline:
    lines.append(
        f"- n = {row.prompt}, k = {row.new}, batch {row.batch} (the paper's headline point: "
        f"{PAPER['flop_ratio']}x fewer FLOPs, {PAPER['speedup']}x faster at batch "
        f"{PAPER['speedup_batch']}, against GPT without a cache): FLOP ratio "
        f"{flop_ratio(row, 'GPT no cache'):.1f} as computed "
        f"({flop_ratio(row, 'GPT no cache', True):.1f} causal), measured speedup "
        f"{speedup(row, 'GPT no cache'):.2f}; against GPT with a cache, FLOP ratio "
        f"{flop_ratio(row, 'GPT cache'):.2f} ({flop_ratio(row, 'GPT cache', True):.2f} causal), "
        f"speedup {speedup(row, 'GPT cache'):.2f}; against GPT with a cache and a prefill, "
        f"speedup {speedup(row, 'GPT cache + prefill'):.2f}.")
  for name, label in (("GPT no cache", "without a cache (paper)"),
                      ("GPT cache", "with a cache, prompt token by token (fair)"),
                      ("GPT cache + prefill", "with a cache and a parallel prefill")):
    lines.append(
        f"- Against GPT {label}: measured speedup {_range(speedup(r, name) for r in done)}, "
        f"FLOP ratio as computed {_range(flop_ratio(r, name) for r in done)}, causal "
        f"{_range(flop_ratio(r, name, True) for r in done)} over all rows.")
  for batch in sorted({r.batch for r in done}):
    at = [r for r in done if r.batch == batch]
    per_token = lambda name: _range(  # noqa: E731
        (r.sides[name].median() * 1e3 / (r.prompt + r.new) for r in at), 3)
    lines.append(
        f"- Batch {batch}, median time per fed token (n + k steps): GPTHF {per_token('GPTHF')} "
        f"ms, GPT with a cache {per_token('GPT cache')} ms; GPT with a cache and a prefill "
        f"replaces the n prompt steps by one pass ({per_token('GPT cache + prefill')} ms per "
        "token on the same count).")
  slower = [f"n={r.prompt} k={r.new} b={r.batch}" for r in done
            if speedup(r, "GPT cache") < 1]
  if slower:
    lines.append(f"- GPTHF is slower than the cached GPT fed the same way in {len(slower)} of "
                 f"{len(done)} rows ({', '.join(slower)}).")
  new_end = sum(r.counts.new_end for r in done)
  new_bound = sum(r.counts.new_bound for r in done)
  lines.append(
      f"- Sentences GPTHF closed in the new tokens over all rows: {new_end} by the end id, "
      f"{new_bound} by the {args.preset_value.max_sentence_length}-token bound "
      f"({args.continuation} continuation); in the prompts "
      f"{sum(r.counts.prompt_end for r in done)} / {sum(r.counts.prompt_bound for r in done)}.")
  same, total = token_agreement(done)
  lines.append(f"- The two cached GPT sides produced the uncached GPT's tokens in {same} of "
               f"{total} places (same weights, different arithmetic order).")
  return lines


def _decoder_line(cfg: DecoderConfig) -> str:
  return (f"{cfg.num_layers} blocks, emb {cfg.emb_dim}, {cfg.num_heads} heads / "
          f"{cfg.kv_heads} kv heads x {cfg.head_dim}, SwiGLU mlp {cfg.mlp_dim}, vocab "
          f"{cfg.vocab_size}{', tied embeddings' if cfg.tie_embeddings else ''}")


def markdown(args, rows: Sequence[Row]) -> str:
  preset = args.preset_value
  decoder, config = row_configs(args, 1, 1)
  skipped = [row for row in rows if row.note.startswith("skipped")]
  lines = [
      "# GPTHF vs an equally sized GPT without and with a KV cache: FLOPs and wall clock", "",
      f"- command: `python {args.command}`",
      f"- date: {datetime.date.today().isoformat()}",
      f"- machine: {machine()}; JAX backend: {jax.default_backend()}",
      f"- shapes: {preset.source}; {jnp.dtype(decoder.dtype).name}; random weights "
      f"(N(0, {preset.init_std}), seed {args.seed}). GPT: {_decoder_line(decoder)} "
      f"({param_count(decoder) / 1e6:.2f} M parameters); GPTHF: the same blocks and weights, "
      f"{config.encoder_layers} word-level + {decoder.num_layers - config.encoder_layers} "
      f"sentence-level, sentences of at most {config.max_sentence_length} tokens. Every row "
      "sets max_length = n + k (GPT's cache slots and GPTHF's body slots).",
      "- sides: GPTHF = `DecoderOnlyModel.generate` on `Gpthf` (prompt through the caches one "
      "token at a time, then k steps); GPT no cache = `generate_uncached` on `Decoder` (k "
      "steps, each the whole network over the n + k buffer); GPT cache = `generate` on "
      "`Decoder` (the prompt one token at a time through the KV cache, as GPTHF, then k steps); "
      "GPT cache + prefill = the prompt in one causal pass into the KV cache, then the same k "
      "steps. Every side runs all k steps (no EOS stop).",
      f"- prompts: built-in corpus text, sentences split by `split_sentences`, the end id "
      f"{args.end_id} after each (`encode_sentences`); each batch row a different window. "
      f"Continuation: `{args.continuation}` ("
      + ("each side feeds the text's own next k tokens through its generation steps and "
         "records its argmax: generation's per-token work with real sentence ends)"
         if args.continuation == "real" else
         "each side feeds its own argmax; random weights rarely emit the end id, so GPTHF's "
         "new sentences close at the length bound)") + ".",
      f"- times: median of {args.repeats} runs per side after compilation and {args.warmup} "
      "warm-up run(s); the four sides of a row run once per repeat, in an order reversed "
      "every repeat. Speedup = the baseline's median / GPTHF's.",
      "- FLOPs: analytical, per example (`decal_jax.flops.gpthf_generation_flops` / "
      "`gpt_generation_flops`: matmuls; prompt steps without LM head). As computed: dense "
      "attention over every slot the code scores (GPTHF: all sentence slots in the word-level "
      "blocks, all n + k body slots in the sentence-level ones; GPT: all n + k cache slots, or "
      "the full n + k buffer with logits everywhere for no cache). Causal: only the keys a "
      "token may see (GPTHF: its sentence so far / the finished sentences, from the "
      "network's own sentence layout of each row). Ratio = the baseline's / GPTHF's.",
      "- context: this GPTHF keeps keys / values in both parts (the current sentence's in the "
      "word-level blocks, the finished sentences' in the sentence-level ones), so only one "
      "token passes through the network per step. The paper's GPTHF, as "
      "../shared/papers/gpthf_summary.md reads it, caches sentence embeddings but no keys / "
      "values, and its GPT baseline has no KV cache: our `no cache` ratios compare a fully "
      "cached GPTHF with that baseline, and the `cache` ratios are the like-for-like ones.",
      f"- host load average (1/5/15 min) before / after: "
      f"{getattr(args, 'load_before', 'n/a')} / {getattr(args, 'load_after', 'n/a')}."]
  done = [row for row in rows if row.done]
  closed = sum(r.counts.prompt_end + r.counts.prompt_bound for r in done)
  if closed:
    lines.append(f"- the prompts' sentences: {closed} closed in "
                 f"{sum(r.prompt * r.batch for r in done):,} prompt tokens over all rows, "
                 f"{sum(r.prompt * r.batch for r in done) / closed:.1f} tokens per sentence.")
  if skipped:
    lines.append(f"- {len(skipped)} row(s) with batch > 1 skipped on this preset to keep the "
                 f"run short: batch x k x (n + k) > {args.max_batch_work:,} (the no-cache "
                 "GPT's token-forwards); they are listed in the time table.")
  if args.note:
    lines.append(f"- note: {args.note}")
  lines += ["", "## Wall clock", "", *time_table(rows), "", "## FLOPs", "", *flop_table(rows),
            "", "## Reading", "", *reading(args, rows)]
  if args.plot:
    lines += ["", f"![speedups and FLOP ratios vs n]({os.path.basename(args.plot)})"]
  return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], path: str) -> None:
  """Measured speedups (left) and FLOP ratios (right) of GPTHF vs prompt length n: colour =
  baseline, line style = k, marker = batch; the paper's point as a star."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  done = [row for row in rows if row.done]
  colours = {"GPT no cache": "tab:red", "GPT cache": "tab:blue",
             "GPT cache + prefill": "tab:green"}
  styles = dict(zip(sorted({r.new for r in done}), ["-", "--", ":", "-."] * 4))
  markers = dict(zip(sorted({r.batch for r in done}), "osD^v" * 4))
  fig, (time_ax, flop_ax) = plt.subplots(1, 2, figsize=(12, 5.2))
  for (k, batch) in sorted({(r.new, r.batch) for r in done}):
    at = sorted((r for r in done if (r.new, r.batch) == (k, batch)), key=lambda r: r.prompt)
    xs = [r.prompt for r in at]
    for name, colour in colours.items():
      style = dict(color=colour, linestyle=styles[k], marker=markers[batch])
      time_ax.plot(xs, [speedup(r, name) for r in at], **style,
                   label=f"vs {name}, k={k}, batch {batch}")
      if batch == min(markers):  # FLOPs per example do not depend on the batch
        flop_ax.plot(xs, [flop_ratio(r, name) for r in at], **style,
                     label=f"vs {name}, k={k}")
        flop_ax.plot(xs, [flop_ratio(r, name, True) for r in at], color=colour,
                     linestyle="none", marker="x")
  flop_ax.plot([], [], "kx", linestyle="none", label="causal counting (same colours)")
  time_ax.plot([PAPER["n"]], [PAPER["speedup"]], "k*", markersize=12,
               label=f"paper vs no cache (k={PAPER['k']}, batch {PAPER['speedup_batch']})")
  flop_ax.plot([PAPER["n"]], [PAPER["flop_ratio"]], "k*", markersize=12,
               label=f"paper vs no cache (k={PAPER['k']})")
  for ax, title in ((time_ax, "measured speedup of GPTHF (baseline time / GPTHF's)"),
                    (flop_ax, "FLOP ratio as computed (baseline / GPTHF)")):
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("prompt length n (tokens)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
  parser.add_argument("--prompts", default="100,250,500,1000", help="prompt lengths n")
  parser.add_argument("--new_tokens", default="20,100", help="generation lengths k")
  parser.add_argument("--batches", default="1,32", help="batch sizes")
  parser.add_argument("--max_batch_work", type=int, default=-1,
                      help="run batches > 1 only where batch * k * (n + k) <= this (default: "
                           "the preset's; 0: no limit)")
  parser.add_argument("--continuation", default="real", choices=["real", "greedy"])
  parser.add_argument("--repeats", type=int, default=3, help="timed runs per side")
  parser.add_argument("--warmup", type=int, default=1, help="untimed runs per side first")
  parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                      help="compute dtype and weights (default: the preset's)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=None, help="write the Markdown results here")
  parser.add_argument("--plot", default=None, help="write a PNG plot here (matplotlib)")
  parser.add_argument("--note", default="", help="a line for the results file")
  args = parser.parse_args(argv)
  args.prompts = _int_list(parser, args.prompts, "--prompts")
  args.new_tokens = _int_list(parser, args.new_tokens, "--new_tokens")
  args.batches = _int_list(parser, args.batches, "--batches")
  if args.repeats < 1 or args.warmup < 0:
    parser.error(f"need --repeats >= 1 and --warmup >= 0, got {args.repeats}, {args.warmup}.")
  args.preset_value = PRESETS[args.preset]()
  args.init_std = args.preset_value.init_std
  if args.max_batch_work < 0:
    args.max_batch_work = args.preset_value.max_batch_work
  elif args.max_batch_work == 0:
    args.max_batch_work = None
  args.end_id = sentence_end_id(vocabularies.builtin_vocabulary())
  if args.end_id >= args.preset_value.decoder.vocab_size:
    parser.error(f"the built-in vocabulary's end id {args.end_id} is outside the preset's "
                 f"{args.preset_value.decoder.vocab_size}-id vocabulary.")
  args.command = shlex.join(sys.argv if argv is None else ["tools/bench_gpthf.py", *argv])
  return args


def main(argv=None) -> List[Row]:
  args = parse_args(argv)
  try:
    rows = run(args)
  except DoesNotFit as e:  # the weights themselves
    raise SystemExit(f"error: {e}") from e
  if args.plot:
    plot(rows, args.plot)
  text = markdown(args, rows)
  print(text)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      f.write(text)
    print(f"wrote {args.out}")
  return rows


if __name__ == "__main__":
  main()
