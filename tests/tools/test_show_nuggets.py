"""decal_jax/commands/show_nuggets.py on a tiny random Dodo checkpoint, checked against references made
here: the model applied by the test, a numpy top-k, collections.Counter and html.unescape."""
import collections
import html
import importlib
import math
import re

import gin
import jax
import jax.numpy as jnp
import matplotlib.figure
import matplotlib.image
import matplotlib.patches
import numpy as np
import pytest

from decal_jax.runtime import checkpoints, gin_utils
from decal_jax.networks.dodo import Dodo

import paths

REPO = paths.REPO
RATIO = 4
GIN_ARGS = ["--gin_file=models/dodo_tiny.gin", "--gin.decoder.DecoderConfig.emb_dim=32",
            "--gin.decoder.DecoderConfig.num_heads=2", "--gin.decoder.DecoderConfig.num_kv_heads=1",
            "--gin.decoder.DecoderConfig.head_dim=16", "--gin.decoder.DecoderConfig.mlp_dim=64",
            "--gin.decoder.DecoderConfig.num_layers=2", "--gin.SCORER_LAYER=1",
            f"--gin.COMPRESSION_RATIO={RATIO}"]
TEXTS = ["The with statement wraps the execution of a block with methods defined by a context "
         "manager, so try / except / finally patterns can be reused.",
         "Hi.",
         "if a < b && c: print('<tag>') # x < y & z",
         "A lambda expression yields an unnamed function object."]


def _load_tool():
  return importlib.import_module("decal_jax.commands.show_nuggets")


@pytest.fixture(scope="module")
def tool():
  return _load_tool()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(model, params, model_dir): a random tiny Dodo saved as a step-1 checkpoint."""
  files, paths, bindings = gin_utils.split_args(GIN_ARGS)
  gin_utils.parse(files, paths, bindings)
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  shapes = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 8)}
  init = jax.jit(lambda rng: model.get_initial_variables(rng, shapes)["params"])
  params = init(jax.random.PRNGKey(3))
  model_dir = tmp_path_factory.mktemp("dodo_ckpt")
  ckpt = checkpoints.Checkpointer(str(model_dir))
  ckpt.save(1, {"params": params, "step": jnp.ones((), jnp.int32)}, {"batches_consumed": 1},
            force=True)
  ckpt.close()
  return model, params, model_dir


@pytest.fixture(scope="module")
def shown(tool, checkpoint, tmp_path_factory):
  _, _, model_dir = checkpoint
  out = tmp_path_factory.mktemp("nuggets")
  argv = GIN_ARGS + [f"--model_dir={model_dir}", f"--out={out}", "--max_length=64",
                     "--batch_size=3", "--png_examples=2"] + [f"--text={t}" for t in TEXTS]
  return tool.main(argv), out


@pytest.fixture(scope="module")
def reference(checkpoint):
  """Per text: (ids, pieces, scores from applying the model, numpy top-k selection mask)."""
  model, params, _ = checkpoint
  vocab = model.input_vocabulary
  encoded = [list(vocab.encode(text)) + [vocab.eos_id] for text in TEXTS]
  # [batch, n]: one batch, padded longer than the tool pads its batches of 3
  tokens = np.zeros((len(TEXTS), max(map(len, encoded)) + 7), np.int32)
  for row, ids in enumerate(encoded):
    tokens[row, :len(ids)] = ids
  all_scores = np.asarray(model.module.apply({"params": params}, tokens, method=Dodo.score))
  refs = []
  for ids, scores in zip(encoded, all_scores):
    n = len(ids)
    k = math.ceil(n / RATIO)
    ranked = np.argsort(-scores[:n - 1], kind="stable")[:k - 1]  # ties -> lower index
    mask = np.zeros(n, bool)
    mask[ranked] = True
    mask[n - 1] = True  # the last real token is always kept
    pieces = [vocab.tokenizer.id_to_piece(i) for i in ids]
    refs.append((ids, pieces, scores[:n], mask))
  return refs


def test_selection_matches_numpy_topk_of_the_models_scores(shown, reference):
  result, _ = shown
  assert result["ratio"] == RATIO  # default: the model's compression_ratio
  assert len(result["results"]) == len(TEXTS)
  for ex, (ids, _, scores, mask) in zip(result["results"], reference):
    assert list(ex.ids) == ids  # no padding kept, EOS last
    np.testing.assert_allclose(ex.scores, scores, rtol=1e-4, atol=1e-5)
    assert ex.selected.sum() == math.ceil(len(ids) / RATIO)
    np.testing.assert_array_equal(ex.selected, mask)


def test_frequency_table_matches_a_counter_of_selected_pieces(shown, reference):
  result, _ = shown
  refs = reference
  chosen = collections.Counter(p for _, pieces, _, mask in refs
                               for p, kept in zip(pieces, mask) if kept)
  overall = collections.Counter(p for _, pieces, _, _ in refs for p in pieces)
  table = result["table"]
  assert len(table) == min(20, len(chosen))
  assert [r["selected"] for r in table] == sorted(chosen.values(), reverse=True)[:20]
  for row in table:
    assert row["selected"] == chosen[row["piece"]]
    assert row["selected_share"] == pytest.approx(chosen[row["piece"]] / sum(chosen.values()))
    assert row["overall_share"] == pytest.approx(overall[row["piece"]] / sum(overall.values()))
  assert chosen["</s>"] >= len(TEXTS)  # every text's forced last token


def test_html_marks_the_kept_tokens_and_escapes_the_text(shown, reference):
  _, out = shown
  page = (out / "nuggets.html").read_text(encoding="utf-8")
  blocks = re.findall(r'<div class="example">(.*?)</div>', page, re.S)
  refs = reference
  assert len(blocks) == len(TEXTS)
  for block, (_ids, pieces, _, mask) in zip(blocks, refs):
    spans = re.findall(r'<span class="tok( sel)?"[^>]*>(.*?)</span>', block)
    assert [bool(s) for s, _ in spans] == list(mask)
    contents = [c for _, c in spans]
    assert not any("<" in c or ">" in c for c in contents)
    assert all(re.fullmatch(r"([^&]|&(lt|gt|amp|quot|#x27);)*", c) for c in contents)
    assert [html.unescape(c) for c in contents] == [p.replace("\u2581", " ") for p in pieces]
  assert "&lt;" in blocks[2] and "&amp;" in blocks[2]
  assert f"r = {RATIO}" in page


def _saved_figures(monkeypatch):
  """The matplotlib figures saved from now on, in order."""
  figures, real_savefig = [], matplotlib.figure.Figure.savefig

  def keep_figure(figure, *args, **kwargs):
    figures.append(figure)
    return real_savefig(figure, *args, **kwargs)

  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep_figure)
  return figures


def test_example_plot_outlines_exactly_the_numpy_selection(tool, shown, reference, tmp_path,
                                                           monkeypatch):
  result, _ = shown
  figures = _saved_figures(monkeypatch)
  tool.plot_examples(tmp_path / "examples.png", result["results"][:2],
                     [pieces for _, pieces, _, _ in reference[:2]], RATIO)
  (figure,) = figures
  boxes = [p for p in figure.axes[0].patches if isinstance(p, matplotlib.patches.Rectangle)]
  outlined = [tuple(box.get_edgecolor()) == (0.0, 0.0, 0.0, 1.0) for box in boxes]
  want = np.concatenate([mask for *_, mask in reference[:2]])  # one box per token, in order
  np.testing.assert_array_equal(outlined, want)
  image = matplotlib.image.imread(tmp_path / "examples.png")  # [h, w, RGBA]
  width, height = figure.get_size_inches() * 110  # matplotlib rounds pixels down
  assert image.shape[2] == 4 and abs(image.shape[0] - height) < 1 and abs(
      image.shape[1] - width) < 1


def test_frequency_plot_draws_the_shares_given(tool, tmp_path, monkeypatch):
  rows = [{"piece": "▁the", "selected_share": 0.5, "overall_share": 0.25},
          {"piece": ".", "selected_share": 0.125, "overall_share": 0.0625}]
  figures = _saved_figures(monkeypatch)
  tool.plot_frequencies(tmp_path / "bars.png", rows, RATIO)
  ((ax,),) = [figure.axes for figure in figures]
  heights = [bar.get_height() for bar in ax.patches]  # the kept bars, then the overall bars
  assert heights == [50.0, 12.5, 25.0, 6.25]
  assert [label.get_text() for label in ax.get_xticklabels()] == ["▁the", "."]
  image = matplotlib.image.imread(tmp_path / "bars.png")  # 6 x 4 inches at 110 dpi
  assert image.shape == (4 * 110, 6 * 110, 4) and image.std() > 0


def test_pngs_are_images_and_markdown_is_printed(shown, capsys):
  result, out = shown
  for name in ("nuggets.png", "selected_tokens.png"):
    image = matplotlib.image.imread(out / name)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50
  markdown = (out / "selected_tokens.md").read_text(encoding="utf-8")
  assert "| rank | token | times kept |" in markdown
  assert markdown.count("\n| ") >= len(result["table"]) + 1


def test_task_inputs_and_an_explicit_ratio(tool, checkpoint, tmp_path):
  _, _, model_dir = checkpoint
  result = tool.main(GIN_ARGS + [f"--model_dir={model_dir}", f"--out={tmp_path}",
                                 "--task=decal_builtin_autoencode", "--num_examples=3",
                                 "--max_length=24", "--ratio=2.5"])
  assert len(result["results"]) == 3 and result["ratio"] == 2.5
  for ex in result["results"]:
    assert len(ex.ids) <= 24 and ex.ids[-1] == 1 and (ex.ids > 0).all()
    assert ex.selected.sum() == math.ceil(len(ex.ids) / 2.5) and ex.selected[-1]


def test_missing_model_dir_or_checkpoint_is_a_clear_error(tool, tmp_path):
  base = GIN_ARGS + [f"--out={tmp_path / 'o'}", "--text=hello"]
  with pytest.raises(FileNotFoundError, match="does not exist"):
    tool.main(base + [f"--model_dir={tmp_path / 'nowhere'}"])
  assert not (tmp_path / "nowhere").exists()
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="No checkpoint in"):
    tool.main(base + [f"--model_dir={tmp_path / 'empty'}"])
  with pytest.raises(ValueError, match="either --text"):
    tool.main(base + [f"--model_dir={tmp_path / 'empty'}", "--task=decal_builtin_autoencode"])
