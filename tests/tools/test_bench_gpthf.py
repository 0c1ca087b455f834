"""tools/bench_gpthf.py on its tiny preset: a row per (n, k, batch), ratios that are the
quotients of the recorded medians and FLOPs (the paper inference's compiled lengths and the
paper's count from numpy scans of the text), sentence counts as a numpy scan gives them, and
every side's tokens equal to its own network's uncached reference (GPTHF and GPT are
different networks, so each is checked against itself)."""
import importlib
import statistics
import time

import jax
import jax.numpy as jnp
import matplotlib.figure
import matplotlib.image
import numpy as np
import pytest

from decal_jax import models
from decal_jax.networks import flops
from decal_jax.networks import gpthf
from decal_jax.networks.decoder import Decoder

import partial_runs
import paths

REPO = paths.REPO
bench = importlib.import_module("tools.bench_gpthf")

PROMPTS, NEW, BATCH, REPEATS = (10, 20), 6, 2, 2
WORK = BATCH * NEW * (PROMPTS[0] + NEW)  # --max_batch_work: n = 10 runs, n = 20 is skipped


def _main(tmp_path, monkeypatch, *extra):
  """Runs main() on the tiny preset; returns (rows, params, markdown, plot path, the saved
  matplotlib figures, main's wall-clock seconds)."""
  built, figures = [], []
  real_params, real_savefig = bench.random_params, matplotlib.figure.Figure.savefig

  def capture(*args, **kwargs):
    built.append(real_params(*args, **kwargs))
    return built[-1]

  def keep_figure(figure, *args, **kwargs):
    figures.append(figure)
    return real_savefig(figure, *args, **kwargs)

  monkeypatch.setattr(bench, "random_params", capture)
  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep_figure)
  argv = ["--preset", "tiny", "--new_tokens", str(NEW), "--repeats", str(REPEATS),
          "--warmup", "0", "--out", str(tmp_path / "gpthf.md"),
          "--plot", str(tmp_path / "gpthf.png"), *extra]
  start = time.perf_counter()
  rows = bench.main(argv)
  elapsed = time.perf_counter() - start
  return (rows, built[0], (tmp_path / "gpthf.md").read_text(), tmp_path / "gpthf.png",
          figures, elapsed)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
  with pytest.MonkeyPatch.context() as patch:
    return _main(tmp_path_factory.mktemp("real"), patch, "--prompts",
                 ",".join(map(str, PROMPTS)), "--batches", str(BATCH),
                 "--max_batch_work", str(WORK))


def _cells(text, header):
  """{(n, k, batch): [cells]} of the table under `## header`."""
  section = text.split(f"## {header}\n", 1)[1].split("\n## ", 1)[0]
  rows = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("|") and cells[0].isdigit():
      rows[int(cells[0]), int(cells[1]), int(cells[2])] = cells
  return rows


def test_markdown_has_a_row_per_grid_point_and_says_what_ran(real):
  rows, _, text, *_ = real
  assert "- command: `python -m tools.bench_gpthf --preset tiny" in text
  assert "Partial" not in text  # a completed run
  assert f"jax {jax.__version__}" in text and "![speedups" in text
  times = _cells(text, "Wall clock")
  assert set(times) == {(n, NEW, BATCH) for n in PROMPTS}
  assert "skipped: batch x k x (n + k)" in times[PROMPTS[1], NEW, BATCH][3]
  done = {(r.prompt, r.new, r.batch) for r in rows if r.done}
  assert done == {(PROMPTS[0], NEW, BATCH)}
  assert set(_cells(text, "FLOPs")) == done


def test_plot_draws_the_rows_speedups_and_flop_ratios(real):
  rows, _, _, plot, figures, _ = real
  (figure,) = figures
  image = matplotlib.image.imread(plot)  # [height, width, RGBA]: the file decodes as a PNG
  assert image.ndim == 3 and image.shape[2] == 4 and image.std() > 0
  time_ax, flop_ax = figure.axes
  (row,) = [r for r in rows if r.done]
  medians = {name: statistics.median(run.seconds for run in row.sides[name].runs)
             for name in bench.SIDES}
  decoder, config = row.configs
  n, k = row.prompt, row.new
  flop = {"GPTHF": flops.gpthf_generation_flops(config, n, k).total,
          "GPT no cache": flops.gpt_generation_flops(decoder, n, k, cached=False).total,
          "GPT cache": flops.gpt_generation_flops(decoder, n, k, cached=True).total,
          "GPT cache + prefill": flops.gpt_generation_flops(decoder, n, k, cached=True,
                                                            prefill=True).total}
  speedups = {line.get_label(): line.get_ydata() for line in time_ax.lines}
  ratios = {line.get_label(): line.get_ydata() for line in flop_ax.lines}
  for name in bench.BASELINES:  # one point per line: the one finished row, at x = n
    label = f"vs {name}, k={k}, batch {row.batch}"
    assert list(speedups[label]) == [pytest.approx(medians[name] / medians["GPTHF"])]
    assert list(ratios[f"vs {name}, k={k}"]) == [pytest.approx(flop[name] / flop["GPTHF"])]
    line = next(line for line in time_ax.lines if line.get_label() == label)
    assert list(line.get_xdata()) == [n]


def test_ratios_are_the_quotients_of_the_medians_and_the_flops(real):
  rows, _, text, _, _, elapsed = real
  times, flop_cells = _cells(text, "Wall clock"), _cells(text, "FLOPs")
  for row in (r for r in rows if r.done):
    key = (row.prompt, row.new, row.batch)
    medians = {}
    for name in bench.SIDES:
      seconds = [run.seconds for run in row.sides[name].runs]
      assert len(seconds) == REPEATS and min(seconds) > 0
      medians[name] = statistics.median(seconds)
    # The runs are timed one after another inside main(): together shorter than main().
    assert sum(run.seconds for side in row.sides.values() for run in side.runs) < elapsed
    assert times[key][3].split()[0] == f"{medians['GPTHF'] * 1e3:.1f}"
    for cell, name in zip(times[key][8:11], bench.BASELINES):
      assert cell == f"{medians[name] / medians['GPTHF']:.2f}"
    assert times[key][11] == f"{medians['GPT no cache'] / medians[bench.PAPER_SIDE]:.2f}"
    # The FLOPs are decal_jax.networks.flops' (checked against XLA in tests/test_flops.py).
    decoder, config = row.configs
    n, k = row.prompt, row.new
    fed = np.concatenate([np.zeros((row.batch, 1), np.int32), row.text], 1)[:, :n + k]
    want = [flops.gpthf_generation_flops(config, n, k).total,
            flops.gpthf_paper_flops(config, n, _numpy_paper_steps(config, fed, n)).total,
            flops.gpt_generation_flops(decoder, n, k, cached=False).total,
            flops.gpt_generation_flops(decoder, n, k, cached=True).total,
            flops.gpt_generation_flops(decoder, n, k, cached=True, prefill=True).total]
    assert flop_cells[key][3] == " / ".join(f"{w / 1e9:.3g}" for w in want)
    assert flop_cells[key][4] == " / ".join(f"{w / want[0]:.2f}" for w in want[2:])
    causal = [float(c) for c in flop_cells[key][5].split("/")]
    assert causal == [pytest.approx(row.causal_flops[s] / row.causal_flops["GPTHF"], abs=0.01)
                      for s in bench.BASELINES]
    # Causal counting sees fewer keys than dense counting, on every side.
    assert all(row.causal_flops[s] < row.flops[s] for s in row.causal_flops)
    # The paper's count: GPTHF's paper inference (mean over the rows' sentences) / GPT's.
    paper = statistics.mean(flops.gpthf_paper_generation_flops(config, n, k, lengths).total
                            for lengths in _numpy_lengths(fed, config))
    gpt = flops.gpt_paper_generation_flops(decoder, n, k).total
    assert flop_cells[key][6] == f"{paper / 1e9:.3g} / {gpt / 1e9:.3g} ({gpt / paper:.2f})"


def test_a_run_stopped_after_its_first_row_leaves_that_row_marked_partial(tmp_path,
                                                                         monkeypatch):
  out, png = tmp_path / "gpthf.md", tmp_path / "gpthf.png"
  finished = partial_runs.stop_after_first_partial(monkeypatch, bench.results_files)
  with pytest.raises(partial_runs.Stop):
    bench.main(["--preset", "tiny", "--prompts", "8,12", "--new_tokens", "4", "--batches", "1",
                "--repeats", "1", "--warmup", "0", "--out", str(out), "--plot", str(png)])
  (row,) = finished
  assert (row.prompt, row.new, row.batch) == (8, 4, 1) and row.done
  text = out.read_text()
  assert text.splitlines()[:3] == [
      "# GPTHF vs an equally sized GPT without and with a KV cache: FLOPs and wall clock", "",
      "**Partial: stopped after 1 of 2 rows**"]
  times, flop_cells = _cells(text, "Wall clock"), _cells(text, "FLOPs")
  assert set(times) == set(flop_cells) == {(8, 4, 1)}
  seconds = {name: [run.seconds for run in row.sides[name].runs] for name in bench.SIDES}
  assert times[8, 4, 1][3:8] == [f"{s[0] * 1e3:.1f} ({s[0] * 1e3:.1f}-{s[0] * 1e3:.1f})"
                                 for s in seconds.values()]  # one repeat: its seconds
  decoder, config = row.configs
  fed = np.concatenate([np.zeros((1, 1), np.int32), row.text], 1)[:, :12]
  want = [flops.gpthf_generation_flops(config, 8, 4).total,
          flops.gpthf_paper_flops(config, 8, _numpy_paper_steps(config, fed, 8)).total,
          *(flops.gpt_generation_flops(decoder, 8, 4, cached=cached, prefill=prefill).total
            for cached, prefill in ((False, False), (True, False), (True, True)))]
  assert flop_cells[8, 4, 1][3] == " / ".join(f"{w / 1e9:.3g}" for w in want)
  assert matplotlib.image.imread(png).std() > 0  # the partial plot decodes as a PNG
  assert sorted(p.name for p in tmp_path.iterdir()) == ["gpthf.md", "gpthf.png"]


def _numpy_lengths(fed, config):
  """Per row, the lengths of the sentences GPTHF's rule closes in `fed` (the open one last)."""
  out = []
  for row in fed:
    lengths, size = [], 0
    for token in row.tolist():
      size += 1
      if token == config.sentence_end_id or size == config.max_sentence_length:
        lengths.append(size)
        size = 0
    out.append(lengths + [size] if size else lengths)
  return out


def _numpy_paper_steps(config, fed, n):
  """The lengths `gpthf.paper_generate` runs at each step, by a left-to-right scan: the
  power-of-two sizes from 8 (capped by the limit) holding every row's sentence so far and
  its finished sentences, plus the token's own row."""
  def smallest(need, limit):
    size = min(8, limit)
    while size < need:
      size = min(2 * size, limit)
    return size
  places, counts = np.zeros(fed.shape, int), np.zeros(fed.shape, int)
  for b, row in enumerate(fed):
    place = count = 0
    for t, token in enumerate(row.tolist()):
      places[b, t], counts[b, t] = place, count
      closes = token == config.sentence_end_id or place == config.max_sentence_length - 1
      place, count = (0, count + 1) if closes else (place + 1, count)
  return [(smallest(places[:, t].max() + 1, config.max_sentence_length),
           smallest(counts[:, t].max(), fed.shape[1]) + 1) for t in range(n, fed.shape[1])]


def _numpy_counts(text, n, end, bound):
  """(prompt end, prompt bound, new end, new bound) closes of [BOS, text] by GPTHF's rule."""
  counts = np.zeros(4, int)
  for row in text:
    place = 0
    for position, token in enumerate([0, *row.tolist()]):
      closes = token == end or place == bound - 1
      place = 0 if closes else place + 1
      if closes and position >= 1:
        counts[(0 if position <= n else 2) + (token != end)] += 1
  return tuple(counts)


def test_sentence_counts_follow_the_text(real):
  rows, *_ = real
  (row,) = [r for r in rows if r.done]
  _, config = row.configs
  want = _numpy_counts(row.text, row.prompt, config.sentence_end_id,
                       config.max_sentence_length)
  assert tuple(row.counts) == want
  assert want[0] > 0 and want[2] > 0  # real text closes sentences by the end id


def _forward_argmax(module, params, text, n):
  """Teacher-forced reference: one parallel pass over BOS + text[:-1]; the argmax at the
  positions that predict text[n:]."""
  inputs = jnp.pad(jnp.asarray(text), ((0, 0), (1, 0)))[:, :-1]
  logits = jax.jit(lambda p, t: module.apply({"params": p}, t, enable_dropout=False))(
      params, inputs)
  return np.asarray(jnp.argmax(logits[:, n:], axis=-1))


def test_real_continuation_tokens_equal_each_networks_parallel_pass(real):
  rows, params, *_ = real
  for row in (r for r in rows if r.done):
    decoder, config = row.configs
    gpthf_want = _forward_argmax(gpthf.Gpthf(config), params, row.text, row.prompt)
    gpt_want = _forward_argmax(Decoder(decoder), params, row.text, row.prompt)
    assert len(set(gpthf_want.ravel().tolist())) > 1  # not a degenerate repetition
    assert not np.array_equal(gpthf_want, gpt_want)  # two different networks
    for name in bench.OURS:
      for run in row.sides[name].runs:
        np.testing.assert_array_equal(run.tokens, gpthf_want)
    for name in bench.BASELINES:
      for run in row.sides[name].runs:
        np.testing.assert_array_equal(run.tokens, gpt_want)


def test_greedy_tokens_equal_each_networks_uncached_generation(real):
  """--continuation greedy: the sides' own programs (`side_functions`) against uncached
  greedy generation of their network (the no-cache GPT side is GPT's)."""
  _, params, *_ = real
  args = bench.parse_args(["--preset", "tiny", "--continuation", "greedy"])
  prompt_length = 12
  decoder, config = bench.row_configs(args, prompt_length, NEW)
  text = bench.text_rows(2, prompt_length + NEW, config.max_sentence_length)
  prompt, unused = jnp.asarray(text[:, :prompt_length]), jnp.asarray(text[:, prompt_length:])
  functions = bench.side_functions(decoder, config, NEW, "greedy", bucket=4)
  sides = {name: np.asarray(jax.jit(functions[name])(params, prompt, unused))  # prefill: as
           for name in ("GPTHF", bench.PAPER_SIDE, "GPT no cache", "GPT cache")}  # in real mode
  model = models.DecoderOnlyModel(gpthf.Gpthf(config), bench.NoEos())
  want = jax.jit(model.generate_uncached, static_argnums=2)(params, prompt, NEW)
  np.testing.assert_array_equal(sides["GPTHF"], want)
  np.testing.assert_array_equal(sides[bench.PAPER_SIDE], want)
  assert len(set(np.asarray(want).ravel().tolist())) > 1
  np.testing.assert_array_equal(sides["GPT cache"], sides["GPT no cache"])
  counts, lengths = bench.sentence_stats(config, text[:, :prompt_length], sides["GPTHF"])
  assert tuple(counts) == _numpy_counts(np.concatenate([text[:, :prompt_length],
                                                        sides["GPTHF"]], axis=1),
                                        prompt_length, config.sentence_end_id,
                                        config.max_sentence_length)
  assert [sum(row) for row in lengths] == [prompt_length + NEW] * 2  # BOS, prompt, new[:-1]


@pytest.mark.parametrize("argv", [["--prompts", "1k"], ["--new_tokens", "0"],
                                  ["--preset", "huge"], ["--continuation", "sampled"],
                                  ["--repeats", "0"], ["--bucket", "-1"]])
def test_bad_arguments_are_rejected(argv):
  with pytest.raises(SystemExit):
    bench.parse_args(argv)


def test_paper_preset_has_the_papers_shapes():
  args = bench.parse_args(["--preset", "paper"])
  decoder, config = bench.row_configs(args, 500, 20)
  assert (decoder.num_layers, decoder.emb_dim, decoder.num_heads, decoder.head_dim,
          decoder.mlp_dim, decoder.vocab_size) == (24, 1024, 16, 64, 4096, 50304)
  assert decoder.tie_embeddings and config.encoder_layers == 16
  assert config.max_sentence_length == 64 and decoder.max_length == 520
  assert 450e6 < bench.param_count(decoder) < 460e6  # 24 x 16.8 M + 51.5 M: the paper's 454 M
