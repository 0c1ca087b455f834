"""tools/bench_squid.py on its tiny preset: the Markdown has a row per (L, ρ) whose ratios
are the measured medians' and the analytical FLOPs' quotients, and both sides decode what an
uncached greedy loop over the same weights decodes."""
import importlib
import math
import re
import time

import jax
import jax.numpy as jnp
import matplotlib.figure
import matplotlib.image
import numpy as np
import pytest

from decal_jax.networks import flops

import paths

REPO = paths.REPO
bench = importlib.import_module("tools.bench_squid")

CONTEXT, RATIOS, QUERY, ANSWER, REPEATS = 24, (4, 8), 3, 4, 2
PARAM_SCALE = 10.0  # weights of std 0.2: peaked logits, so greedy decoding is not degenerate


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  """(rows, built models, markdown, plot path, the saved figures, main's wall seconds)."""
  out = tmp_path_factory.mktemp("bench_squid")
  built, figures = [], []
  real_build, real_savefig = bench.build, matplotlib.figure.Figure.savefig

  def scaled_build(config, seed=0):
    models = real_build(config, seed)
    params = jax.tree.map(lambda x: x * PARAM_SCALE, models.squid_params)
    models = models._replace(squid_params=params,
                             decoder_params={"stack": params["large_decoder"]})
    built.append(models)
    return models

  def keep_figure(figure, *args, **kwargs):
    figures.append(figure)
    return real_savefig(figure, *args, **kwargs)

  argv = ["--preset", "tiny", "--contexts", str(CONTEXT), "--ratios",
          ",".join(map(str, RATIOS)), "--query_length", str(QUERY), "--answer_length",
          str(ANSWER), "--repeats", str(REPEATS), "--warmup", "0",
          "--out", str(out / "squid.md"), "--plot", str(out / "squid.png")]
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(bench, "build", scaled_build)
    patch.setattr(matplotlib.figure.Figure, "savefig", keep_figure)
    start = time.perf_counter()
    rows = bench.main(argv)
    elapsed = time.perf_counter() - start
  return rows, built[0], (out / "squid.md").read_text(), out / "squid.png", figures, elapsed


def _table_rows(text):
  """{(L, ρ): [cells]} of the results table."""
  rows = {}
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if line.startswith("|") and cells[0].isdigit():
      rows[int(cells[0]), int(cells[1])] = cells
  return rows


def test_markdown_has_the_run_description_and_a_row_per_ratio(result):
  rows, _, text, *_ = result
  assert "- command: `python" in text and "--preset tiny" in text
  assert f"jax {jax.__version__}" in text and f"JAX backend: {jax.default_backend()}" in text
  assert "![latency and FLOPs" in text
  table = _table_rows(text)
  assert set(table) == {(CONTEXT, r) for r in RATIOS}
  for r in RATIOS:
    assert int(table[CONTEXT, r][2]) == math.ceil(CONTEXT / r)  # N = L / ρ


def _totals(side):
  return [sum(run.seconds.values()) for run in side.runs]  # end-to-end seconds per run


def test_plot_draws_the_measured_medians_and_the_flops(result):
  rows, models, _, plot, figures, _ = result
  image = matplotlib.image.imread(plot)  # [height, width, RGBA]: the file decodes as a PNG
  assert image.shape == (round(4.2 * 120), 11 * 120, 4) and image.std() > 0  # 11 x 4.2 in
  (figure,) = figures
  latency_ax, flops_ax = figure.axes
  latency = {line.get_label(): line.get_ydata() for line in latency_ax.lines}
  work = {line.get_label(): line.get_ydata() for line in flops_ax.lines}
  large = flops.answer_flops(models.config.large, CONTEXT + QUERY, ANSWER).total
  assert list(latency["large decoder, full context"]) == [
      pytest.approx(np.median(_totals(rows[0].baseline)))]
  assert list(work["large decoder, full context"]) == [pytest.approx(large / 1e9)]
  for row in rows:  # one point per line: the one context length
    squid = flops.squid_flops(bench.squid_with_memory(models, row.memory)[0].config,
                              CONTEXT, QUERY, ANSWER)
    assert list(latency[f"Squid ρ={row.ratio}"]) == [pytest.approx(np.median(_totals(row.squid)))]
    assert list(work[f"Squid ρ={row.ratio} (large decoder)"]) == [
        pytest.approx(squid.large_decoder / 1e9)]


def test_ratios_are_the_quotients_of_the_measured_medians_and_the_flops(result):
  rows, models, text, _, _, elapsed = result
  table = _table_rows(text)
  for row in rows:
    cells = table[row.context, row.ratio]
    base_totals, squid_totals = _totals(row.baseline), _totals(row.squid)
    assert len(base_totals) == len(squid_totals) == REPEATS
    assert all(t > 0 for run in row.squid.runs for t in run.seconds.values())
    # The runs are timed one after another inside main(): together shorter than main().
    assert sum(base_totals) + sum(squid_totals) < elapsed
    base_ms, squid_ms = np.median(base_totals) * 1e3, np.median(squid_totals) * 1e3
    assert cells[4] == (f"{base_ms:.1f} ({min(base_totals) * 1e3:.1f}-"
                        f"{max(base_totals) * 1e3:.1f})")
    assert cells[6].split()[0] == f"{squid_ms:.1f}"
    assert cells[7] == f"{base_ms / squid_ms:.2f}"
    # FLOPs: the large decoder reads L + q tokens vs N + q, counted by decal_jax.networks.flops
    # (itself checked against XLA in tests/test_flops.py).
    config = models.config
    large = flops.answer_flops(config.large, CONTEXT + QUERY, ANSWER).total
    squid = flops.squid_flops(bench.squid_with_memory(models, row.memory)[0].config,
                              CONTEXT, QUERY, ANSWER)
    assert cells[9] == f"{large / squid.large_decoder:.1f}"
    assert cells[11] == f"{large / squid.total:.1f}"
    xla_base, xla_squid = (float(v) for v in cells[12].split("/"))
    assert xla_base == pytest.approx(large / 1e9, rel=0.25)  # elementwise work is
    assert xla_squid == pytest.approx(squid.total / 1e9, rel=0.25)  # large at this size


def _greedy_uncached(logits_of, tokens, start, count):
  """Fills tokens[:, start:start+count] greedily, rerunning the whole model each time."""
  tokens = np.array(tokens)
  for t in range(start, start + count):
    tokens[:, t] = np.asarray(logits_of(jnp.asarray(tokens)))[:, t - 1].argmax(-1)
  return tokens[:, start:start + count]


def test_both_sides_decode_what_uncached_greedy_decoding_gives(result):
  rows, models, *_ = result
  context, query = rows[0].inputs
  prompt = np.concatenate([context, query], axis=1)
  buffer = np.zeros((1, prompt.shape[1] + ANSWER), np.int32)
  buffer[:, :prompt.shape[1]] = prompt
  forward = jax.jit(lambda t: models.decoder.apply({"params": models.decoder_params}, t,
                                                   enable_dropout=False))
  want = _greedy_uncached(forward, buffer, prompt.shape[1], ANSWER)
  assert len(set(want.ravel().tolist())) > 1  # not a degenerate repetition
  for row in rows:
    for run in row.baseline.runs:
      np.testing.assert_array_equal(run.tokens, want)
  row = rows[0]  # one ρ is enough: the others differ only in N
  squid, params = bench.squid_with_memory(models, row.memory)
  teacher_forced = jax.jit(lambda answer_in: squid.apply(
      {"params": params}, jnp.asarray(context), answer_in, answer_in,
      query_tokens=jnp.asarray(query), enable_dropout=False))
  answer_in = np.zeros((1, ANSWER + 1), np.int32)  # BOS = 0, then the answer so far
  squid_want = _greedy_uncached(teacher_forced, answer_in, 1, ANSWER)
  assert len(set(squid_want.ravel().tolist())) > 1
  for run in row.squid.runs:
    np.testing.assert_array_equal(run.tokens, squid_want)


def test_results_are_rewritten_partial_after_each_context_length(tmp_path, monkeypatch):
  """Two context lengths: after the first, --out holds exactly its rows under the partial
  line (what a run stopped there leaves behind) and --plot decodes; the completed run's file
  has every row and no partial line, the first length's rows as the partial file had them."""
  contexts, out, png = (CONTEXT, 2 * CONTEXT), tmp_path / "squid.md", tmp_path / "squid.png"
  snapshots, real_write = [], bench.results_files.write_partial

  def write_and_snapshot(args, rows, *more, **kwargs):
    real_write(args, rows, *more, **kwargs)
    snapshots.append((list(rows), out.read_text(), matplotlib.image.imread(png)))
  monkeypatch.setattr(bench.results_files, "write_partial", write_and_snapshot)
  rows = bench.main(["--preset", "tiny", "--contexts", ",".join(map(str, contexts)),
                     "--ratios", ",".join(map(str, RATIOS)), "--query_length", str(QUERY),
                     "--answer_length", "2", "--repeats", "1", "--warmup", "0",
                     "--out", str(out), "--plot", str(png)])
  assert len(snapshots) == len(contexts)  # a call per length; the last writes nothing, as
  (partial_rows, partial, image), last = snapshots  # the final results follow at once
  assert last[1] == partial
  assert [(r.context, r.ratio) for r in rows] == [(c, r) for c in contexts for r in RATIOS]
  assert all(a is b for a, b in zip(partial_rows, rows[:len(RATIOS)]))
  assert len(partial_rows) == len(RATIOS)
  lines = partial.splitlines()
  assert lines[0].startswith("# Squid") and lines[1:4] == [
      "", f"**Partial: stopped after {len(RATIOS)} of {2 * len(RATIOS)} rows**", ""]
  table = _table_rows(partial)
  assert set(table) == {(CONTEXT, r) for r in RATIOS}
  for row in partial_rows:
    base, squid = _totals(row.baseline), _totals(row.squid)
    cells = table[row.context, row.ratio]
    assert cells[4] == (f"{np.median(base) * 1e3:.1f} ({min(base) * 1e3:.1f}-"
                        f"{max(base) * 1e3:.1f})")
    assert cells[7] == f"{np.median(base) / np.median(squid):.2f}"
  assert image.ndim == 3 and image.std() > 0  # the partial plot decodes as a PNG
  final = out.read_text()
  assert "Partial" not in final and final.startswith(lines[0] + "\n\n- command:")
  final_table = _table_rows(final)
  assert set(final_table) == {(c, r) for c in contexts for r in RATIOS}
  assert all(final_table[key] == table[key] for key in table)


def test_a_baseline_that_does_not_fit_is_reported_not_run(result, monkeypatch):
  models = result[1]
  def never_fits(compiled, what):
    raise bench.DoesNotFit(f"{what} needs too much")
  monkeypatch.setattr(bench, "check_fits", never_fits)
  monkeypatch.setattr(bench, "build", lambda config, seed: models)
  args = bench.parse_args(["--preset", "tiny", "--contexts", str(CONTEXT), "--ratios", "8",
                           "--query_length", str(QUERY), "--answer_length", "2"])
  (row,) = bench.run(args)
  assert row.squid is None and row.note.startswith("baseline did not fit: the baseline's "
                                                   "prefill of 27 tokens needs too much")
  assert re.search(r"\| 24 \| 8 \| 3 \| baseline did not fit", bench.markdown(args, [row]))


def test_weights_that_do_not_fit_stop_before_initialising(monkeypatch):
  monkeypatch.setattr(bench, "available_bytes", lambda: 1024)
  args = bench.parse_args(["--preset", "tiny", "--contexts", "16"])
  with pytest.raises(bench.DoesNotFit, match="the weights need"):
    bench.build(bench.squid_config(args))


def test_qwen2_shapes_are_qwen2s(monkeypatch):
  monkeypatch.setattr(bench, "QWEN2_GIN", REPO / "no_such.gin")  # the hard-coded shapes
  small, large = bench._qwen2_hard_coded()
  ratio = flops.decoder_flops(large, 1) / flops.decoder_flops(small, 1)
  assert 14 < ratio < 17  # 7B / 0.5B: about 2 * 7.6e9 / (2 * 0.49e9) per token
  config = bench.squid_config(bench.parse_args(["--preset", "qwen2", "--contexts", "8192"]))
  assert config.large.dtype == jnp.bfloat16 and config.memory_tokens == 8192 // 4
  assert config.small.max_length >= 8192 + 2048 and config.large.max_length >= 8192 + 64


@pytest.mark.parametrize("argv", [["--contexts", "1k"], ["--ratios", "0"],
                                  ["--answer_length", "0"], ["--preset", "huge"]])
def test_bad_arguments_are_rejected(argv):
  with pytest.raises(SystemExit):
    bench.parse_args(argv)
