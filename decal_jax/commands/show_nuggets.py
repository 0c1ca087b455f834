"""Shows which tokens a trained Dodo scorer keeps as nuggets (our form of the Dodo paper's
Figures 5 and 7): every token shaded by its score, the kept ones outlined, and a table of the
token types kept most often next to how common they are in the text.

  python -m decal_jax.commands.show_nuggets --model_dir=runs/dodo_tiny_ae --text="Some text." --out=/tmp/nug
  python -m decal_jax.commands.show_nuggets --gin_file=models/dodo_tiny.gin --gin.COMPRESSION_RATIO=5 \
      --model_dir=runs/dodo_tiny_ae --task=decal_builtin_autoencode --split=validation \
      --num_examples=20 --ratio=5 --max_length=256 --out=/tmp/nug

The model comes from gin (--gin_file, default models/dodo_tiny.gin; --gin.NAME=VALUE and
--gin_bindings as in decal_jax/runtime/gin_utils.py); its params from the latest checkpoint in
--model_dir. Scores are `Dodo.score` (the scorer on layer-ι states) and the kept tokens are
`compress.nuggets.select_topk` at --ratio (default: the model's compression_ratio), i.e. the
model's own rule: ceil(n / r) tokens per text, the last (EOS) always.

Writes into --out: nuggets.html (every example), nuggets.png (the first --png_examples),
selected_tokens.md (also printed) and selected_tokens.png.
"""
import argparse
import collections
import dataclasses
import datetime
import html
import os
import pathlib
import re
import shlex
import sys
import unicodedata
from typing import Dict, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tqdm

from decal_jax.commands import require_extra


DEFAULT_GIN = "models/dodo_tiny.gin"
WORD_START = "\u2581"  # SentencePiece's '▁': the piece starts a new word
COLORMAP = "YlOrRd"
COLOR_RANGE = 0.75  # use the lighter 3/4 of the colormap so black text stays readable
TOP_TOKENS = 20
FONT_SIZE = 9


@dataclasses.dataclass
class ExampleNuggets:
  """One text: its token ids, their scorer outputs and which ones the model keeps."""
  ids: np.ndarray       # [n] int token ids (no padding)
  scores: np.ndarray    # [n] float scorer outputs
  selected: np.ndarray  # [n] bool: kept as a nugget

  @property
  def normalised(self) -> np.ndarray:
    """Scores scaled to [0, 1] within this example (0.5 everywhere when all are equal)."""
    low, high = float(self.scores.min()), float(self.scores.max())
    if high - low < 1e-12:
      return np.full(self.scores.shape, 0.5)
    return (self.scores - low) / (high - low)


# ------------------------------------------------------------------------------ model
def load_model(args):
  """(model, params, step, partitioner): the gin `MODEL` (default models/dodo_tiny.gin),
  checked to be a Dodo that selects nuggets with a scorer, and its latest checkpoint."""
  from decal_jax.runtime import gin_utils
  from decal_jax.networks.dodo import Dodo
  lengths = {"inputs": args.max_length, "targets": args.max_length}
  loaded = gin_utils.load_model(list(args.gin_files) or [DEFAULT_GIN], args.model_dir,
                                search_paths=args.gin_search_paths, bindings=args.gin_bindings,
                                feature_lengths=lengths)
  module = loaded.model.module
  if not isinstance(module, Dodo):
    raise ValueError(f"The gin MODEL's module is {type(module).__name__}, not Dodo: give "
                     f"a Dodo model gin (e.g. --gin_file={DEFAULT_GIN}).")
  if module.config.selection != "nuggets":
    raise ValueError(f"This Dodo uses selection={module.config.selection!r}, which has "
                     "no scorer; show nuggets of a model with --gin.SELECTION=\"'nuggets'\".")
  if args.max_length > module.config.decoder.max_length:
    raise ValueError(f"--max_length {args.max_length} exceeds the model's max_length "
                     f"{module.config.decoder.max_length}; lower it.")
  return loaded


def configured_ratio(model_dir: str) -> Optional[str]:
  """The COMPRESSION_RATIO the run in `model_dir` was trained with (from its config.gin)."""
  config = pathlib.Path(model_dir) / "config.gin"
  if not config.exists():
    return None
  match = re.search(r"^COMPRESSION_RATIO = (\S+)$", config.read_text(), re.MULTILINE)
  return match.group(1) if match else None


# ------------------------------------------------------------------------------ inputs
def encode_texts(vocab, texts: Sequence[str], max_length: int) -> List[np.ndarray]:
  """Each text -> ids cut to max_length - 1, then EOS (as the Dodo tasks feed `inputs`)."""
  out, cut = [], 0
  for i, text in enumerate(texts):
    if not text.strip():
      raise ValueError(f"--text {i} is empty or whitespace only ({text!r}); give it some text.")
    ids = list(vocab.encode(text))
    cut += len(ids) > max_length - 1
    out.append(np.asarray(ids[:max_length - 1] + [vocab.eos_id], np.int32))
  if cut:
    print(f"note: {cut} of {len(texts)} texts were longer than {max_length - 1} tokens and were "
          "cut; raise --max_length to see more.")
  return out


def task_inputs(task_name: str, split: str, num_examples: int, max_length: int,
                vocab) -> List[np.ndarray]:
  """The first `num_examples` tokenized 'inputs' of a seqio task's split (in order)."""
  import seqio
  import decal_jax.tasks  # noqa: F401  (registers the tasks)
  if task_name not in seqio.TaskRegistry.names():
    near = sorted(n for n in seqio.TaskRegistry.names() if n.startswith("decal_"))
    raise ValueError(f"Unknown task {task_name!r}; registered tasks include: {', '.join(near)}.")
  task = seqio.get_mixture_or_task(task_name)
  task_vocab = task.output_features["inputs"].vocabulary
  if task_vocab != vocab:
    raise ValueError(f"Task {task_name!r} tokenizes with {task_vocab} but the model reads "
                     f"{vocab}: use a task of the model's vocabulary.")
  ds = task.get_dataset({"inputs": max_length, "targets": max_length}, split=split,
                        shuffle=False, num_epochs=1)
  out = [np.asarray(ex["inputs"], np.int32) for ex in ds.take(num_examples).as_numpy_iterator()]
  if not out:
    raise ValueError(f"Task {task_name!r} has no examples in split {split!r}.")
  return out


# ------------------------------------------------------------------------------ scoring
def score_examples(model, params, partitioner, examples: Sequence[np.ndarray], ratio: float,
                   batch_size: int = 8) -> List[ExampleNuggets]:
  """Dodo.score on right-padded batches, then the model's own top-k selection."""
  import jax
  from decal_jax.compress.nuggets import check_ratio, select_topk
  from decal_jax.networks.dodo import Dodo
  check_ratio(ratio)
  length = max(len(x) for x in examples)
  score_fn = jax.jit(lambda p, t: model.module.apply({"params": p}, t, method=Dodo.score))
  results = []
  bar = tqdm.tqdm(total=len(examples), desc="score", unit="example")
  for start in range(0, len(examples), batch_size):
    chunk = examples[start:start + batch_size]
    tokens = np.zeros((batch_size, length), np.int32)  # [batch, n]; 0 = padding
    for row, ids in enumerate(chunk):
      tokens[row, :len(ids)] = ids
    with partitioner.activate():
      scores = score_fn(params, tokens)  # [batch, n]
    selection = select_topk(scores, tokens, ratio)  # indices, valid: [batch, k]
    scores, indices, valid = map(np.asarray, (scores, selection.indices, selection.valid))
    for row, ids in enumerate(chunk):
      selected = np.zeros(length, bool)
      selected[indices[row][valid[row]]] = True
      results.append(ExampleNuggets(ids, scores[row, :len(ids)].astype(np.float64),
                                    selected[:len(ids)]))
    bar.update(len(chunk))
  bar.close()
  return results


# ------------------------------------------------------------------------------ pieces
def token_pieces(vocab, ids: Sequence[int]) -> List[str]:
  """The vocabulary piece of each id ('▁the', '</s>', '<extra_id_0>', ...)."""
  tokenizer = getattr(vocab, "tokenizer", None)
  size = tokenizer.get_piece_size() if tokenizer is not None else 0
  out = []
  for i in (int(x) for x in ids):
    if i < size:
      out.append(tokenizer.id_to_piece(i))
    elif hasattr(vocab, "decode"):
      out.append(vocab.decode([i]) or f"<id {i}>")
    else:
      out.append(f"<id {i}>")
  return out


def display(piece: str) -> str:
  """A piece as text: SentencePiece's word-start mark becomes a space."""
  return piece.replace(WORD_START, " ")


def token_class(piece: str, is_eos: bool) -> str:
  """A coarse kind of token, for the summary: punctuation vs words."""
  if is_eos:
    return "end of text (</s>)"
  body = piece.replace(WORD_START, "")
  if not body:
    return "space alone"
  if all(unicodedata.category(c)[0] in "PS" for c in body):
    return "punctuation / symbols"
  if piece.startswith(WORD_START):
    return "word start"
  return "word continuation"


# ------------------------------------------------------------------------------ html
def _matplotlib():
  """matplotlib (decal_jax[plot]), with the file-only Agg backend: (matplotlib, pyplot)."""
  import matplotlib  # an optional extra
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return matplotlib, plt


def _color(value: float) -> str:
  matplotlib, _ = _matplotlib()
  return matplotlib.colors.to_hex(matplotlib.colormaps[COLORMAP](COLOR_RANGE * value))


HTML_STYLE = """body { font-family: sans-serif; max-width: 60em; margin: 1em auto; }
.example { font-family: monospace; white-space: pre-wrap; line-height: 1.9;
           border: 1px solid #ccc; padding: 0.6em; margin: 0.6em 0 1.4em 0; }
.tok { padding: 1px 0; }
.sel { font-weight: bold; outline: 2px solid #000; outline-offset: -1px; }
.legend span { display: inline-block; padding: 2px 6px; font-family: monospace; }"""


def write_html(path: pathlib.Path, results: Sequence[ExampleNuggets], pieces: Sequence[List[str]],
               ratio: float, meta: Dict[str, str]) -> None:
  """One block per example; background = normalised score, kept tokens bold + outlined."""
  esc = html.escape
  ramp = "".join(f'<span style="background:{_color(v)}">{v:.2f}</span>'
                 for v in np.linspace(0, 1, 6))
  lines = ["<!DOCTYPE html>", '<html><head><meta charset="utf-8">',
           "<title>Dodo nuggets</title>", f"<style>{HTML_STYLE}</style></head><body>",
           "<h1>Which tokens does the Dodo scorer keep?</h1>",
           f"<p>Compression ratio r = {esc(f'{ratio:g}')}: each text keeps ceil(n / r) tokens, "
           "the last (EOS) always.</p>",
           "<ul>" + "".join(f"<li>{esc(k)}: {esc(str(v))}</li>" for k, v in meta.items()) + "</ul>",
           f'<p class="legend">Legend — background: score, normalised per example '
           f'(low → high) {ramp} &nbsp; <span class="sel">kept</span> = selected as a nugget '
           "(bold, outlined). Hover a token for its raw score.</p>"]
  for number, (ex, toks) in enumerate(zip(results, pieces)):
    spans = []
    for piece, value, raw, kept in zip(toks, ex.normalised, ex.scores, ex.selected):
      cls = "tok sel" if kept else "tok"
      spans.append(f'<span class="{cls}" style="background:{_color(value)}" '
                   f'title="{esc(piece)}: score {raw:.4f}">{esc(display(piece))}</span>')
    lines.append(f"<h3>Example {number}: {len(toks)} tokens, {int(ex.selected.sum())} kept</h3>")
    lines.append(f'<div class="example">{"".join(spans)}</div>')
  lines.append("</body></html>")
  path.write_text("\n".join(lines), encoding="utf-8")


# ------------------------------------------------------------------------------ png
def _wrap(pieces: Sequence[str], width: int) -> List[List[int]]:
  """Token indices in lines of at most `width` characters (a long token gets its own line)."""
  lines, current, used = [], [], 0
  for i, piece in enumerate(pieces):
    size = max(1, len(display(piece)))
    if current and used + size > width:
      lines.append(current)
      current, used = [], 0
    current.append(i)
    used += size
  if current:
    lines.append(current)
  return lines


def plot_examples(path: pathlib.Path, results: Sequence[ExampleNuggets],
                  pieces: Sequence[List[str]], ratio: float, width: int = 90) -> None:
  """Wrapped lines of coloured token boxes (monospace, one unit per character)."""
  blocks = [(_wrap(toks, width), ex, toks) for ex, toks in zip(results, pieces)]
  rows = sum(len(lines) + 2 for lines, _, _ in blocks)
  char_in = 0.602 * FONT_SIZE / 72  # a monospace glyph's advance (0.602 em), in inches
  matplotlib, plt = _matplotlib()
  fig = plt.figure(figsize=(width * char_in / 0.96, rows * 0.24 + 0.6))
  ax = fig.add_axes([0.02, 0.02, 0.96, 0.96])
  ax.set_xlim(0, width)
  ax.set_ylim(rows, -1)
  ax.axis("off")
  y = 0
  cmap = matplotlib.colormaps[COLORMAP]
  for number, (lines, ex, toks) in enumerate(blocks):
    ax.text(0, y, f"Example {number}: {len(toks)} tokens, {int(ex.selected.sum())} kept "
            f"(r = {ratio:g}); colour = normalised score, outlined = kept", fontsize=FONT_SIZE,
            va="center", fontweight="bold")
    y += 1
    for line in lines:
      x = 0
      for i in line:
        text = display(toks[i])
        size = max(1, len(text))
        ax.add_patch(matplotlib.patches.Rectangle(
            (x, y - 0.4), size, 0.8, facecolor=cmap(COLOR_RANGE * ex.normalised[i]),
            edgecolor="black" if ex.selected[i] else "white",
            linewidth=1.4 if ex.selected[i] else 0.6))
        ax.text(x + size / 2, y, text, fontsize=FONT_SIZE, family="monospace", ha="center",
                va="center", fontweight="bold" if ex.selected[i] else "normal")
        x += size
      y += 1
    y += 1
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ------------------------------------------------------------------------------ summary
def frequency_table(results: Sequence[ExampleNuggets], pieces: Sequence[List[str]],
                    top: int = TOP_TOKENS) -> List[Dict]:
  """The `top` most-selected pieces: counts and shares among selections and among all tokens."""
  chosen = collections.Counter(p for ex, toks in zip(results, pieces)
                               for p, kept in zip(toks, ex.selected) if kept)
  overall = collections.Counter(p for toks in pieces for p in toks)
  n_chosen, n_all = sum(chosen.values()), sum(overall.values())
  ranked = sorted(chosen.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
  return [{"piece": piece, "selected": count, "selected_share": count / n_chosen,
           "occurrences": overall[piece], "overall_share": overall[piece] / n_all,
           "kept_rate": count / overall[piece]} for piece, count in ranked]


def class_table(results: Sequence[ExampleNuggets], pieces: Sequence[List[str]],
                eos_id: int) -> List[Dict]:
  """Share of selections vs share of all tokens for each coarse token class."""
  chosen, overall = collections.Counter(), collections.Counter()
  for ex, toks in zip(results, pieces):
    for piece, token, kept in zip(toks, ex.ids, ex.selected):
      kind = token_class(piece, int(token) == eos_id)
      overall[kind] += 1
      chosen[kind] += int(kept)
  n_chosen, n_all = sum(chosen.values()), sum(overall.values())
  return [{"class": kind, "selected_share": chosen[kind] / n_chosen,
           "overall_share": overall[kind] / n_all, "kept_rate": chosen[kind] / overall[kind]}
          for kind in sorted(overall, key=lambda k: -chosen[k] / overall[k])]


def _md_piece(piece: str) -> str:
  return "`" + piece.replace("`", "'").replace("|", "\\|") + "`"


def summary_markdown(rows: Sequence[Dict], classes: Sequence[Dict],
                     results: Sequence[ExampleNuggets], ratio: float, meta: Dict[str, str]) -> str:
  n_chosen = int(sum(ex.selected.sum() for ex in results))
  n_all = sum(len(ex.ids) for ex in results)
  covered = sum(r["selected_share"] for r in rows)
  out = ["# Tokens the Dodo scorer keeps", ""]
  out += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in meta.items()]
  out += [f"- compression ratio r = {ratio:g}; {len(results)} examples, {n_all} tokens, "
          f"{n_chosen} kept ({n_chosen / n_all:.1%})",
          "- pieces are SentencePiece pieces: `▁` marks a word start. Every example's last "
          f"token (EOS, `</s>`) is kept by rule, so {len(results)} of the `</s>` selections are "
          "forced.", "",
          f"## Top {len(rows)} kept token types (they cover {covered:.1%} of all selections)", "",
          "| rank | token | times kept | share of kept | times in text | share of text "
          "| kept when seen |", "|---:|---|---:|---:|---:|---:|---:|"]
  for rank, r in enumerate(rows, 1):
    out.append(f"| {rank} | {_md_piece(r['piece'])} | {r['selected']} | "
               f"{r['selected_share']:.1%} | {r['occurrences']} | {r['overall_share']:.1%} | "
               f"{r['kept_rate']:.0%} |")
  out += ["", "## By kind of token", "",
          "| kind | share of kept | share of text | kept when seen |", "|---|---:|---:|---:|"]
  for c in classes:
    out.append(f"| {c['class']} | {c['selected_share']:.1%} | {c['overall_share']:.1%} | "
               f"{c['kept_rate']:.0%} |")
  return "\n".join(out) + "\n"


def plot_frequencies(path: pathlib.Path, rows: Sequence[Dict], ratio: float) -> None:
  """Bars: each top token's share of the kept tokens next to its share of all tokens."""
  labels = [r["piece"] for r in rows]
  x = np.arange(len(rows))
  _, plt = _matplotlib()
  fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(rows) + 2), 4))
  ax.bar(x - 0.2, [100 * r["selected_share"] for r in rows], 0.4, label="share of kept tokens")
  ax.bar(x + 0.2, [100 * r["overall_share"] for r in rows], 0.4,
         label="share of all tokens")
  ax.set_xticks(x)
  ax.set_xticklabels(labels, rotation=60, ha="right", family="monospace")
  ax.set_ylabel("% of tokens")
  ax.set_title(f"Token types the Dodo scorer keeps most (r = {ratio:g})")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ------------------------------------------------------------------------------ main
def parse_args(argv: Optional[Sequence[str]]):
  from decal_jax.runtime import gin_utils
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_dir", required=True, help="a Dodo MODEL_DIR with a checkpoint")
  p.add_argument("--text", action="append", default=[], help="a text to show (repeatable)")
  p.add_argument("--task", help="a seqio task of decal_jax.tasks; shows its 'inputs'")
  p.add_argument("--split", default="validation")
  p.add_argument("--num_examples", type=int, default=20)
  p.add_argument("--ratio", type=float, help="default: the model's compression_ratio")
  p.add_argument("--max_length", type=int, default=256, help="tokens per text, EOS included")
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--png_examples", type=int, default=2, help="examples drawn in nuggets.png")
  p.add_argument("--out", type=pathlib.Path, required=True, help="output directory")
  args, rest = p.parse_known_args(argv)
  args.gin_files, args.gin_search_paths, args.gin_bindings = gin_utils.split_args(rest)
  if bool(args.text) == bool(args.task):
    raise ValueError("Give either --text (repeatable) or --task NAME (with --split and "
                     "--num_examples), not both and not neither.")
  if args.num_examples < 1 or args.max_length < 2 or args.batch_size < 1:
    raise ValueError(f"--num_examples ({args.num_examples}) and --batch_size "
                     f"({args.batch_size}) must be >= 1 and --max_length ({args.max_length}) "
                     ">= 2.")
  return args


def _machine() -> str:
  """The page's machine line: cores, jax's version, backend and device."""
  import jax  # after the flags are parsed
  return (f"{os.cpu_count()} CPU cores; jax {jax.__version__}; JAX backend: "
          f"{jax.default_backend()} ({jax.devices()[0].device_kind})")


def main(argv: Optional[Sequence[str]] = None) -> Dict:
  """Runs the tool; returns {'results', 'pieces', 'table', 'ratio', 'paths'}."""
  args = parse_args(argv)
  require_extra("matplotlib", "plot", "show_nuggets (its page and pictures)")
  model, params, step, partitioner = load_model(args)
  cfg = model.module.config
  ratio = float(args.ratio if args.ratio is not None else cfg.compression_ratio)
  trained_ratio = configured_ratio(args.model_dir)
  if args.ratio is None and trained_ratio not in (None, f"{cfg.compression_ratio:g}",
                                                  str(cfg.compression_ratio)):
    print(f"note: {args.model_dir}/config.gin says COMPRESSION_RATIO = {trained_ratio}, the gin "
          f"here gives {cfg.compression_ratio:g}; pass --ratio or --gin.COMPRESSION_RATIO.")
  vocab = model.input_vocabulary
  if args.text:
    examples = encode_texts(vocab, args.text, args.max_length)
    source = f"{len(args.text)} --text input(s)"
  else:
    examples = task_inputs(args.task, args.split, args.num_examples, args.max_length, vocab)
    source = f"{args.task} ({args.split}, first {len(examples)} examples)"
  results = score_examples(model, params, partitioner, examples, ratio, args.batch_size)
  pieces = [token_pieces(vocab, ex.ids) for ex in results]

  args.out.mkdir(parents=True, exist_ok=True)
  paths = {name: args.out / name for name in
           ("nuggets.html", "nuggets.png", "selected_tokens.md", "selected_tokens.png")}
  command = shlex.join(["python", "-m", "decal_jax.commands.show_nuggets",
                        *(sys.argv[1:] if argv is None else argv)])
  meta = {"command": command,
          "written": f"{datetime.date.today()} on {_machine()}",
          "model": "; ".join([" ".join(args.gin_files) or DEFAULT_GIN] + args.gin_bindings),
          "checkpoint": f"{args.model_dir} (step {step})", "texts": source,
          "scorer layer ι": str(cfg.scorer_layer)}
  write_html(paths["nuggets.html"], results, pieces, ratio, meta)
  shown = slice(0, max(1, args.png_examples))
  plot_examples(paths["nuggets.png"], results[shown], pieces[shown], ratio)
  table = frequency_table(results, pieces)
  classes = class_table(results, pieces, vocab.eos_id)
  markdown = summary_markdown(table, classes, results, ratio, meta)
  paths["selected_tokens.md"].write_text(markdown, encoding="utf-8")
  plot_frequencies(paths["selected_tokens.png"], table, ratio)
  print(markdown)
  print("Wrote " + ", ".join(str(p) for p in paths.values()))
  return {"results": results, "pieces": pieces, "table": table, "ratio": ratio, "paths": paths}


if __name__ == "__main__":
  try:
    main()
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
