"""Compress a context once with a trained Squid, then answer any number of questions from
the kept memory vectors, without reading the context again.

  python -m decal_jax.commands.squid_answer --gin_file=runs/squid_instruct_builtin.gin \
      --model_dir=runs/squid_3 --context_file=doc.txt \
      --question="Which section of the Python language reference is this from?" \
      --question="What is this about?" --save_compressed=doc.squid.npz
  python -m decal_jax.commands.squid_answer --gin_file=runs/squid_instruct_builtin.gin \
      --model_dir=runs/squid_3 --compressed=doc.squid.npz --question="Another question?"

The model comes from gin (--gin_file, --gin.NAME=VALUE, --gin_bindings as in
decal_jax/runtime/gin_utils.py) and its params from the latest checkpoint in --model_dir.
--save_compressed writes the N projected vectors and their validity (`squid.Compressed`,
numpy .npz, written atomically); --compressed reads them back instead of a context, so the
small decoder does not run at all. Answers are greedy (or beam search with --num_decodes)
and are printed, and written as JSON lines with --out.
"""
import argparse
import json
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from decal_jax import fileio


def parse_args(argv: Optional[Sequence[str]]):
  from decal_jax.runtime import gin_utils
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_dir", required=True, help="a Squid MODEL_DIR with a checkpoint")
  p.add_argument("--context_file", help="the context, a UTF-8 text file")
  p.add_argument("--compressed", help="an .npz from --save_compressed, instead of a context")
  p.add_argument("--save_compressed", help="write the compressed context here (.npz)")
  p.add_argument("--question", action="append", default=[], help="a question (repeatable)")
  p.add_argument("--max_answer_length", type=int, default=32)
  p.add_argument("--num_decodes", type=int, default=1, help="1: greedy; >1: beam search")
  p.add_argument("--out", help="write {question, answer} JSON lines here")
  args, rest = p.parse_known_args(argv)
  args.gin_files, args.gin_search_paths, args.gin_bindings = gin_utils.split_args(rest)
  if bool(args.context_file) == bool(args.compressed):
    p.error("give exactly one of --context_file (a text to compress) and --compressed "
            "(an .npz written by --save_compressed).")
  if not args.question and not args.save_compressed:
    p.error("nothing to do: give --question (repeatable) and/or --save_compressed.")
  if args.max_answer_length < 1 or args.num_decodes < 1:
    p.error("--max_answer_length and --num_decodes must be >= 1.")
  return args


def load_model(args):
  """(model, params, step): the gin Squid model and its latest checkpoint in --model_dir."""
  from decal_jax import models
  from decal_jax.runtime import gin_utils
  bindings = [f"MODEL_DIR = {args.model_dir!r}"] + list(args.gin_bindings)  # run files need it
  shapes = {"inputs": 8, "query": 1, "targets": 1}  # parameter shapes do not depend on them
  model, params, step, _ = gin_utils.load_model(
      args.gin_files, args.model_dir, search_paths=args.gin_search_paths, bindings=bindings,
      feature_lengths=shapes)
  if not isinstance(model, models.SquidModel):
    raise ValueError(f"The gin MODEL is a {type(model).__name__}, not a SquidModel: give a "
                     "Squid gin file (e.g. --gin_file=runs/squid_instruct_builtin.gin).")
  return model, params, step


def context_tokens(model, text: str) -> np.ndarray:
  """The context's ids `[1, n]`, cut to what the small decoder can read beside N memories."""
  cfg = model.module.config
  ids = list(model.input_vocabulary.encode(text))
  if not ids:
    raise ValueError("The context file holds no text (it tokenizes to nothing).")
  room = cfg.small.max_length - cfg.memory_count(len(ids))
  if len(ids) > room:
    print(f"note: the context has {len(ids)} tokens; the small decoder reads {room} beside "
          f"its memory tokens, so the rest is cut.")
    ids = ids[:room]
  return np.asarray([ids], np.int32)


def query_tokens(model, questions: Sequence[str], memory_count: int,
                 max_answer_length: int) -> np.ndarray:
  """Right-padded question ids `[q, longest]`; a question that does not fit the large
  decoder beside the `memory_count` memories and the answer is refused, naming it."""
  encoded = [list(model.input_vocabulary.encode(q)) for q in questions]
  room = model.module.config.large.max_length - memory_count - max_answer_length
  for number, ids in enumerate(encoded, 1):
    if len(ids) > room:
      raise ValueError(
          f"--question number {number} ({questions[number - 1][:40]!r}...) has {len(ids)} "
          f"tokens; the large decoder reads {room} beside the {memory_count} memory vectors "
          f"and --max_answer_length {max_answer_length} (large DecoderConfig.max_length "
          f"{model.module.config.large.max_length}). Shorten the question, or lower "
          "--max_answer_length.")
  width = max(1, max(len(e) for e in encoded))
  return np.asarray([e + [0] * (width - len(e)) for e in encoded], np.int32)


def save_compressed(path: str, compressed) -> None:
  with fileio.atomic_write(path, "wb") as f:
    np.savez(f, embeddings=np.asarray(compressed.embeddings),
             valid=np.asarray(compressed.valid))


def load_compressed(path: str, model):
  from decal_jax.networks.squid import Compressed
  with np.load(path) as data:
    compressed = Compressed(data["embeddings"], data["valid"])
  width = model.module.config.large.emb_dim
  if compressed.embeddings.ndim != 3 or compressed.embeddings.shape[-1] != width:
    raise ValueError(f"{path} holds vectors of shape {compressed.embeddings.shape}; this "
                     f"model's large decoder reads [batch, N, {width}]: compress with the "
                     "same model.")
  return compressed


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, str]]:
  args = parse_args(argv)  # before JAX loads: --help and argument errors at once
  import jax
  text = None if args.compressed else fileio.read_utf8(args.context_file)  # fail early
  model, params, step = load_model(args)
  start = time.perf_counter()
  if args.compressed:
    compressed = load_compressed(args.compressed, model)
    print(f"Read {compressed.embeddings.shape[1]} memory vectors from {args.compressed}.")
  else:
    context = context_tokens(model, text)
    compressed = model.compress(params, context)
    jax.block_until_ready(compressed)
    print(f"Compressed {context.shape[1]} context tokens into {compressed.embeddings.shape[1]} "
          f"memory vectors in {time.perf_counter() - start:.2f} s (step {step}).")
  if args.save_compressed:
    save_compressed(args.save_compressed, compressed)
    print(f"Saved the compressed context to {args.save_compressed}.")
  results = []
  if args.question:
    answer = jax.jit(model.answer, static_argnums=3, static_argnames="num_decodes")
    queries = query_tokens(model, args.question, compressed.embeddings.shape[1],
                           args.max_answer_length)
    tokens, _ = answer(params, compressed, queries, args.max_answer_length,
                       num_decodes=args.num_decodes)
    vocab = model.output_vocabulary
    for question, row in zip(args.question, np.asarray(tokens)):
      ids = [int(t) for t in row if t > 0]
      if vocab.eos_id in ids:
        ids = ids[:ids.index(vocab.eos_id)]
      results.append({"question": question, "answer": vocab.decode(ids)})
      print(f"Q: {question}\nA: {results[-1]['answer']}")
  if args.out:
    fileio.write_text_atomic(args.out, "".join(json.dumps(r) + "\n" for r in results))
  return results


if __name__ == "__main__":
  main()
