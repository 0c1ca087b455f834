"""The pieces of tools/smollm2_squid.py (Squid on SmolLM2-135M, issue 43 step 4): the
memories it compares, the examples of the three stages, SQuAD records, the trainable /
frozen split, greedy answers and compress-once-answer-many latency.

Every memory is a `networks.squid.Squid` whose `compress` is swapped (`Variant`), so all of
them reach the large decoder through the same `read` / `decode` ([memory; query; answer],
positions counting real items only) and the same `models.SquidModel` loss and decoding:

  tokens  the paper: N = ceil(L / ρ) learned memory tokens after the context in the small
          decoder, their final states through the projector
  means   the control: the mean of the small decoder's final states over each ρ-token
          segment through the projector (the same N vectors, the same trained parts, no
          memory token deciding what to keep)
  full    the ceiling: the large decoder's own embeddings of the context tokens (it reads
          the whole context; no small decoder, no projector)
  none    the prior: an empty memory (the large decoder reads only the query)
"""
import dataclasses
import math
from typing import Dict, List, Sequence, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from decal_jax.layers import attention as attn
from decal_jax.networks import squid
from decal_jax.networks.signatures import check_tokens

MEMORIES = ("tokens", "means", "full", "none")
REFERENCES = ("full", "none")  # no small decoder: the same for every ρ
STAGES = ("restore", "continue", "qa")
DECODERS = ("small_decoder", "large_decoder")
# what trains in each stage: the library's runs/squid_{restore,continue,instruct}.gin, the
# large decoder only with --large trains (stage 1 always keeps it frozen, as the library)
STAGE_PARTS = {"restore": ("small_decoder", "memory_tokens", "projector"),
               "continue": ("small_decoder", "memory_tokens", "projector"),
               "qa": ("small_decoder", "memory_tokens", "projector")}
QA_PROMPT = "Question: {}\nAnswer:"  # ends in RESTORE_PROMPT's last token, the start token

# the library's stage-1 prompt (tasks/squid_tasks.py; equal: tests/tools/test_smollm2_squid.py),
# written out here: importing `tasks` registers the seqio tasks, and a GPU image has no seqio
RESTORE_PROMPT = "Restore the compressed text:"


# ----------------------------------------------------------------------------- network
class Variant(squid.Squid):
  """Squid whose compressed context is the memory named by `memory` (MEMORIES), and whose
  large decoder reads the start token 0 of the library's decoding as `start`."""
  memory: str = "tokens"
  start: int = 0

  def compress(self, encoder_input_tokens, *, enable_dropout: bool = False):
    if self.memory == "tokens":
      return super().compress(encoder_input_tokens, enable_dropout=enable_dropout)
    tokens = check_tokens(encoder_input_tokens, "encoder_input_tokens")
    if self.memory == "full":
      return squid.Compressed(self.large_decoder.embed(tokens), tokens > 0)  # [b, n, d]
    if self.memory == "none":
      b = tokens.shape[0]
      return squid.Compressed(jnp.zeros((b, 0, self.config.large.emb_dim)),
                              jnp.zeros((b, 0), bool))  # [b, 0, d]
    return self.segment_means(tokens, enable_dropout)

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens, *args, **kwargs):
    """Squid's decode, with `start` in place of 0 (SmolLM2's <|endoftext|>, the library's
    start token, which reads as a document boundary: after it the model forgets the context)."""
    tokens = jnp.where(decoder_input_tokens == 0, self.start, decoder_input_tokens)  # [b, t]
    return super().decode(encoded, encoder_input_tokens, tokens, *args, **kwargs)

  def segment_means(self, tokens, enable_dropout: bool) -> squid.Compressed:
    """The small decoder over the context alone; each ρ-token segment's mean final state."""
    cfg, (b, n) = self.config, tokens.shape
    rho = cfg.memory_ratio
    m = -(-n // rho)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))  # [b, n]
    valid = tokens > 0  # [b, n]
    mask = attn.combine_masks(attn.make_causal_mask(positions),
                              valid[:, None, None, :].astype(jnp.float32))
    h = self.small_decoder(self.small_decoder.embed(tokens), positions,
                           attn.mask_to_bias(mask, cfg.small.dtype),
                           deterministic=not enable_dropout)  # [b, n, d]
    states = jnp.pad(self.small_decoder.decoder_norm(h), ((0, 0), (0, m * rho - n), (0, 0)))
    weight = jnp.pad(valid, ((0, 0), (0, m * rho - n))).astype(states.dtype)  # [b, m ρ]
    weight = weight.reshape(b, m, rho, 1)  # [b, m, ρ, 1]
    count = weight.sum(axis=2)  # [b, m, 1]
    means = (states.reshape(b, m, rho, -1) * weight).sum(axis=2) / jnp.maximum(count, 1.0)
    return squid.Compressed(self.projector(means), count[..., 0] > 0)  # [b, m, large d]


def build(decoder, memory: str, ratio: int, max_context: int, eos: int, start: int = 0):
  """`models.SquidModel` around a `Variant` with `decoder` as the small and the large one."""
  from decal_jax import decoding, models
  references = memory in REFERENCES
  cfg = squid.SquidConfig(small=decoder, large=decoder,
                          memory_tokens=1 if references else -(-max_context // ratio),
                          memory_ratio=None if references else ratio)
  vocabulary = type("Ids", (), {"eos_id": eos, "vocab_size": decoder.vocab_size})()
  return models.SquidModel(Variant(cfg, memory=memory, start=start), vocabulary, vocabulary,
                           decode_fn=decoding.temperature_sample)


def initial_params(model, imported, seed: int) -> Dict[tuple, jnp.ndarray]:
  """Flat params on the device: each decoder the network has is the imported one (the same
  arrays), the memory tokens and the projector from init with `seed` (run on a one-layer
  copy: their shapes do not depend on depth, and two 30-layer inits would cost a minute)."""
  cfg = model.module.config
  shallow = model.module.clone(config=dataclasses.replace(
      cfg, small=dataclasses.replace(cfg.small, num_layers=1),
      large=dataclasses.replace(cfg.large, num_layers=1)))
  tokens = jnp.ones((1, 8), jnp.int32)
  init = jax.jit(lambda: shallow.init(jax.random.PRNGKey(seed), tokens, tokens[:, :4],
                                      tokens[:, :4], query_tokens=tokens[:, :2],
                                      enable_dropout=False))()
  device = jax.devices()[0]  # the base on the device once, shared by both decoders: numpy
  base = {k: jax.device_put(w, device)  # leaves would travel host -> device at every step
          for k, w in flax.traverse_util.flatten_dict(imported).items()}  # {('stack', ...): ...}
  params = {}
  for k, v in flax.traverse_util.flatten_dict(init["params"]).items():
    if k[0] not in DECODERS:
      params[k] = v
    elif ("stack",) + k[1:] not in base:
      raise ValueError(f"the imported SmolLM2 lacks {k[1:]}")
    else:
      params.update({(k[0],) + b[1:]: w for b, w in base.items()})
  return params


def split(params: Dict[tuple, jnp.ndarray], parts: Sequence[str]) -> Tuple[dict, dict]:
  """(trainable, frozen): the leaves under the named parts, the others."""
  trainable = {k: v for k, v in params.items() if k[0] in parts}
  return trainable, {k: v for k, v in params.items() if k not in trainable}


def stage_parts(stage: str, large_trains: bool) -> Tuple[str, ...]:
  """What trains in `stage`: STAGE_PARTS, + the large decoder in stages 2-3 if it trains."""
  extra = ("large_decoder",) if large_trains and stage != "restore" else ()
  return STAGE_PARTS[stage] + extra


# ----------------------------------------------------------------------------- examples
def examples(contexts: np.ndarray, queries: np.ndarray, start: np.ndarray,
             targets: np.ndarray) -> dict:
  """A stage's examples: contexts `[m, n]`, queries `[m, q]`, the large decoder's first
  input `[m]` and targets `[m, t]` (0-padded)."""
  return {"encoder_input_tokens": contexts.astype(np.int32),
          "query_tokens": queries.astype(np.int32), "start": start.astype(np.int32),
          "decoder_target_tokens": targets.astype(np.int32)}


def batch_of(ex: dict, rows) -> Dict[str, jnp.ndarray]:
  """The model's batch of `rows`: decoder inputs are the targets shifted right after the
  start token."""
  targets = ex["decoder_target_tokens"][rows]  # [b, t]
  inputs = np.concatenate([ex["start"][rows][:, None], targets[:, :-1]], axis=1)  # [b, t]
  return {"encoder_input_tokens": jnp.asarray(ex["encoder_input_tokens"][rows]),
          "query_tokens": jnp.asarray(ex["query_tokens"][rows]),
          "decoder_input_tokens": jnp.asarray(inputs),
          "decoder_target_tokens": jnp.asarray(targets)}


def restore_examples(segments: np.ndarray, prompt: Sequence[int], eos: int) -> dict:
  """Stage 1: context = the segment, query = the restoration prompt but its last token,
  which starts the answer, targets = the segment + EOS."""
  m = len(segments)
  targets = np.concatenate([segments, np.full((m, 1), eos)], axis=1)  # [m, n + 1]
  return examples(segments, np.tile(np.asarray(prompt[:-1]), (m, 1)),
                  np.full(m, prompt[-1]), targets)


def continue_examples(segments: np.ndarray, first: int) -> dict:
  """Stage 2: context = the first `first` - 1 tokens, no query, the large decoder starts
  from token `first` - 1 (read as is, by every memory alike), targets = the rest (no EOS):
  the full-context ceiling is the plain language model over the segment."""
  return examples(segments[:, :first - 1], np.zeros((len(segments), 0)),
                  segments[:, first - 1], segments[:, first:])


def squad_records(path: str) -> Dict[str, List[dict]]:
  """SQuAD v1.1 questions {'train': [...], 'validation': [...]}, split by the hash of the
  paragraph (`real_text_files.split_of`: 5 % validation), so the splits share no context."""
  from decal_jax.data import convert
  from decal_jax.data import real_text_files  # seqio-free (GPU image)
  out = {"train": [], "validation": []}
  for record in convert.squad(path):
    out[real_text_files.split_of(record["context"])].append(record)
  return out


def qa_examples(records: Sequence[dict], tokenizer, eos: int, lengths: Tuple[int, int, int]):
  """Stage 3 examples (context, QA_PROMPT question but its last token, which starts the
  answer, first answer + EOS; each 0-padded to `lengths`) of the records that fit, and
  those records' answers."""
  rows, answers, start = [], [], []
  for r in records:
    query = tokenizer.encode(QA_PROMPT.format(r["question"])).ids
    row = [tokenizer.encode(r["context"]).ids, query[:-1],
           tokenizer.encode(" " + r["answers"][0].strip()).ids + [eos]]
    if all(0 < len(x) <= n for x, n in zip(row, lengths)):
      rows.append([np.pad(np.asarray(x), (0, n - len(x))) for x, n in zip(row, lengths)])
      answers.append(r["answers"])
      start.append(query[-1])
  if not rows:
    return examples(*(np.zeros((0, n)) for n in lengths[:2]), np.zeros(0),
                    np.zeros((0, lengths[2]))), []
  contexts, queries, targets = (np.stack(column) for column in zip(*rows))
  return examples(contexts, queries, np.asarray(start), targets), answers


# ----------------------------------------------------------------------------- answers
def answers_of(tokens: np.ndarray, eos: int) -> List[List[int]]:
  """Each decoded row `[t]` up to its EOS, padding dropped."""
  rows = []
  for row in np.asarray(tokens):
    ids = list(row[:list(row).index(eos)] if eos in row else row)
    rows.append([int(t) for t in ids if t > 0])
  return rows


def answer_questions(model, params, ex: dict, answers: Sequence, tokenizer, eos: int,
                     batch: int) -> Dict[str, object]:
  """Greedy answers to the held-out questions: SQuAD EM / F1 / contains-answer x 100."""
  from decal_jax import text_metrics
  predict = jax.jit(lambda p, b: model.predict_batch(p, b, topk=1))
  texts = []
  for i in range(0, len(answers), batch):
    out = predict(params, batch_of(ex, np.arange(i, min(i + batch, len(answers)))))  # [b, t]
    texts += [tokenizer.decode(ids).strip() for ids in answers_of(out, eos)]
  return {**text_metrics.squad(list(answers), texts), "examples": texts[:3]}


# ----------------------------------------------------------------------------- latency
def latency(decoder, params_of, ratio: int, length: int, query: int, answer: int,
            repeats: int = 3) -> Dict[str, float]:
  """Seconds (median of `repeats`) at batch 1 for a context of `length` tokens: compress
  once (small decoder + projector), answer one `query`-token question with `answer` greedy
  tokens from the N memory vectors, and the large decoder answering it from the whole
  context. EOS is never produced (id -1): every answer runs all `answer` steps."""
  from tools.benchmarking import median_seconds
  context = jnp.full((1, length), 5, jnp.int32)
  question = jnp.full((1, query), 7, jnp.int32)
  out = {}
  for memory in ("tokens", "full"):
    model = build(decoder, memory, ratio, length, eos=-1)
    params = params_of(model)
    compress = jax.jit(lambda p, c, m=model: m.compress(p, c))
    respond = jax.jit(lambda p, c, q, m=model: m.answer(p, c, q, answer, topk=1)[0])
    kept = compress(params, context)
    out[f"{memory}_compress"] = median_seconds(compress, (params, context), repeats)
    out[f"{memory}_answer"] = median_seconds(respond, (params, kept, question), repeats)
  return {"ratio": ratio, "memory_vectors": math.ceil(length / ratio), "length": length,
          "compress": out["tokens_compress"], "answer": out["tokens_answer"],
          "full_answer": out["full_compress"] + out["full_answer"]}


def speedup(row: Dict[str, float], queries: int) -> float:
  """The large decoder reading the context for each of `queries` questions over Squid
  compressing it once and answering them all from the memory."""
  return queries * row["full_answer"] / (row["compress"] + queries * row["answer"])
