"""tools/bench_inference.py at tiny shapes: what each configuration generates against the
library's decode called directly and against the uncached (full forward pass) reference,
the throughput and ratio arithmetic on hand-made timings, the largest-batch line against
XLA's memory analysis compiled at that batch and one more, and the break-even rule."""
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax import decoding, models
from tools import benchmarking, inference_report as report

bench = importlib.import_module("tools.bench_inference")

N, NEW, BATCH = 16, 4, 2
NO_EOS = benchmarking.NoEos()  # as the tool: every row decodes all NEW steps
PARAM_SCALE = 10.0  # random weights of std 0.2: peaked logits, so greedy is not degenerate
ARGV = ["--preset", "tiny", "--methods", "decal", "--decal_ratios", "1,4", "--lengths",
        str(N), "--breakeven_lengths", "", "--beams", "0", "--new_tokens", str(NEW),
        "--batch", str(BATCH), "--repeats", "2", "--warmup", "0", "--fit_batches", "6,8",
        "--memory_budget_gib", "0.0002"]  # about 14 sequences


def _scaled(real):
  return lambda *args, **kwargs: jax.tree.map(lambda x: x * PARAM_SCALE, real(*args, **kwargs))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(rows, markdown, a Zoo made as the run's, parsed args), weights scaled."""
  out = tmp_path_factory.mktemp("bench_inference")
  argv = ARGV + ["--out", str(out / "inference.md"), "--plot", str(out / "inference.png")]
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(benchmarking, "random_params", _scaled(benchmarking.random_params))
    rows = bench.main(argv)
    args = bench.parse_args(argv)
    zoo = bench.Zoo(args.preset_value, N, NEW, [], args.seed)
    zoo.params(report.Config("decal", 1))  # made (scaled) here, as the run made its own
  assert (out / "inference.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  return rows, (out / "inference.md").read_text(), zoo, args


def _row(rows, ratio):
  return next(r for r in rows if r.config == report.Config("decal", ratio))


def _batch(zoo, cfg):
  return bench.make_batch(zoo.program(cfg), BATCH, N, NEW)


def test_c1_generates_what_the_librarys_greedy_decode_and_the_uncached_pass_give(run):
  rows, _, zoo, _ = run
  cfg = report.Config("decal", 1)
  params, batch = zoo.params(cfg), _batch(zoo, cfg)
  tokens = _row(rows, 1).tokens  # the first timed run's
  assert tokens.shape == (BATCH, NEW) and len({*tokens.ravel().tolist()}) > 2
  for run_ in _row(rows, 1).side.runs:
    np.testing.assert_array_equal(run_.tokens, tokens)
  model = models.EncoderDecoderModel(zoo.network(cfg), NO_EOS, NO_EOS,
                                     decode_fn=decoding.temperature_sample)
  direct = jax.jit(model.predict_batch)(params, batch)  # what decal_jax.infer jits
  np.testing.assert_array_equal(tokens, np.asarray(direct))
  uncached = jax.jit(model.predict_batch_uncached)(params, batch)  # whole decoder each step
  np.testing.assert_array_equal(tokens, np.asarray(uncached))


def test_the_table_holds_the_measured_medians_and_their_quotients(run):
  rows, text, *_ = run
  lines = {line.split(" | ")[1]: line.strip("|").split(" | ") for line in text.splitlines()
           if line.startswith(f"| {N} | ")}
  for row in rows:
    cells = [c.strip() for c in lines[row.config.name]]
    walls = sorted(r.seconds["wall"] for r in row.side.runs)
    cpus = sorted(r.seconds["cpu"] for r in row.side.runs)
    median, cpu = (walls[0] + walls[1]) / 2, (cpus[0] + cpus[1]) / 2  # two repeats
    assert int(cells[2]) == BATCH and cells[3].startswith(f"{median * 1e3:.1f} (")
    assert float(cells[4]) == pytest.approx(cpu * 1e3, abs=0.06) and 0 < cpu
    assert float(cells[5]) == pytest.approx(BATCH / median, rel=1e-2)
    assert float(cells[6]) == pytest.approx(BATCH * NEW / median, rel=1e-3)
  c1, c4 = _row(rows, 1), _row(rows, 4)
  cells = [c.strip() for c in lines["DeCAL C=4"]]
  assert float(cells[10]) == pytest.approx(c1.seconds / c4.seconds, abs=0.006)
  assert float(cells[11]) == pytest.approx(c1.cpu_seconds / c4.cpu_seconds, abs=0.006)
  assert float(cells[13]) == pytest.approx(c4.fit.needed[0] / c1.fit.needed[0], abs=0.006)
  assert "- command: `python -m tools.bench_inference --preset tiny" in text


def test_throughput_and_ratios_by_hand():
  def row(batch, walls, cpus, largest):
    side = benchmarking.Side("x", None, None)
    side.runs = [benchmarking.Run({"wall": w, "cpu": c}, np.zeros((batch, 1)))
                 for w, c in zip(walls, cpus)]
    return report.Row(1024, report.Config("decal", 4), "table", 128, batch, side, None, None,
                     largest)
  assert report.throughput(3, 128, 2.0) == (1.5, 192.0)
  c4 = row(3, [4.0, 2.0, 1.0], [1.0, 1.5, 3.0], benchmarking.Largest(30, True))  # medians 2, 1.5 s
  c1 = row(2, [1.0], [0.5], benchmarking.Largest(12, True))
  assert c4.throughput == (1.5, 192.0) and c1.throughput == (2.0, 256.0)
  assert (c4.seconds, c4.cpu_seconds, c4.wall_range()) == (2.0, 1.5, "2000.0 (1000.0-4000.0)")
  r = report.ratios(c4, c1)
  assert (r.sequences, r.tokens, r.largest, r.cpu) == (0.75, 0.75, 2.5, 0.5)  # 2 vs 4 /CPU-s
  assert r.memory is None  # different batches, no fit: no like-for-like memory ratio
  assert report.ratios(c1, c1) == (1.0, 1.0, None, 1.0, 1.0)


def test_the_largest_batch_line_by_hand():
  fit = benchmarking.MemoryFit((2, 4), (1000, 1600))  # 300 bytes per sequence + 400 fixed
  assert (fit.per_sequence, fit.fixed) == (300, 400)
  assert [fit.largest_batch(b) for b in (399, 700, 2199, 2200)] == [0, 1, 5, 6]
  # needs steeper past batch 4 (100 -> 150 bytes per sequence): the line through 2 and 4
  # says 20 for 3,000 bytes; 20 needs 3,800, the line through 4 and 20 says 14 (2,900),
  # and 15 (3,050) is over: 14 is the largest
  need = lambda b: 1000 + 100 * b if b <= 4 else 1400 + 150 * (b - 4)
  calls = []
  fit, largest = benchmarking.largest_batch(lambda b: calls.append(b) or need(b), (2, 4), 3000)
  assert (fit.per_sequence, largest, calls) == (100, (14, True), [2, 4, 20, 14, 15])
  assert str(largest) == "14"
  assert benchmarking.largest_batch(need, (2, 4), 1050)[1] == (0, True)  # not even batch 1
  fit, largest = benchmarking.largest_batch(need, (2, 4), 3000, tries=2)  # stopped at 20, 14
  assert largest == (14, False) and str(largest) == ">= 14"


def test_the_largest_batch_fits_the_budget_by_xlas_own_count_and_one_more_does_not(run):
  """The tool's largest batch against memory_analysis() compiled here at that batch and
  one more."""
  rows, _, zoo, args = run

  def need(cfg, batch):
    program = zoo.program(cfg)
    inputs = (program.params, bench.make_batch(program, batch, N, NEW))
    return benchmarking.needed_bytes(jax.jit(program.predict).lower(*inputs).compile())
  for row in rows:
    largest = row.largest.batch
    assert row.fit.batches == (6, 8) and row.largest.exact and largest > 8
    assert need(row.config, 6) == row.fit.needed[0]
    assert need(row.config, largest) <= args.budget < need(row.config, largest + 1)


def test_break_even_is_the_shortest_length_where_the_compressed_model_is_faster():
  def row(n, cfg, seconds):
    side = benchmarking.Side("x", None, None)
    side.runs = [benchmarking.Run({"wall": seconds, "cpu": 1.0}, np.zeros((1, 1)))]
    return report.Row(n, cfg, "scan", 8, 1, side)
  args = bench.parse_args(["--preset", "tiny", "--methods", "decal"])
  speeds = {128: 0.8, 256: 1.1, 512: 0.95, 1024: 1.2, 2048: 1.3}  # seq/s ratio of C = 4
  rows = [r for n, s in speeds.items() for r in (row(n, report.Config("decal", 1), 1.0),
                                                row(n, report.Config("decal", 4), 1 / s))]
  shortest, again, points = report.breakeven(args, rows, "decal")
  assert (shortest, again) == (256, [512]) and [n for n, _ in points] == list(speeds)
  assert [round(r, 6) for _, r in points] == list(speeds.values())
  assert report.breakeven(args, rows[:2], "decal")[:2] == (None, [])  # 128 only: slower
  assert report.breakeven(args, rows, "decal", "cpu")[:2] == (None, [])  # equal CPU time
  text = "\n".join(report.breakeven_lines(args, rows))
  assert "| DeCAL C=4 | 128: 0.80, 256: 1.10, 512: 0.95, 1024: 1.20, 2048: 1.30 | 256 | 512 |" \
      in text


def test_the_other_methods_generate_what_their_uncached_passes_give():
  """Dodo, Squid (through EncoderDecoderModel, the route infer takes) and the decoder
  reference against the full forward pass rerun for every token (no cache)."""
  args = bench.parse_args(["--preset", "tiny"])
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(benchmarking, "random_params", _scaled(benchmarking.random_params))
    zoo = bench.Zoo(args.preset_value, N, NEW, [4], 0)
    configs = (report.Config("dodo", 4), report.Config("squid", 4),
               report.Config(report.REFERENCE, 1))
    programs = {c: zoo.program(c) for c in configs}
  for cfg, program in programs.items():
    batch = _batch(zoo, cfg)
    got = np.asarray(jax.jit(program.predict)(program.params, batch))  # [BATCH, NEW]
    if cfg.method == report.REFERENCE:
      model = models.DecoderOnlyModel(zoo.network(cfg), NO_EOS)
      want = model.generate_uncached(program.params, batch["encoder_input_tokens"], NEW)
    else:
      model = models.EncoderDecoderModel(zoo.network(cfg), NO_EOS, NO_EOS)
      want = jax.jit(model.predict_batch_uncached)(program.params, batch)
    np.testing.assert_array_equal(got, np.asarray(want), err_msg=cfg.name)
    assert got.shape == (BATCH, NEW) and len({*got.ravel().tolist()}) > 2, cfg.name
  # one set of weights for the family: Dodo's stack is the decoder's and Squid's large one
  dodo, squid, ref = (programs[c].params for c in configs)
  assert ref["stack"] is dodo["stack"] and squid["large_decoder"] is dodo["stack"]


def test_the_gpu_preset_is_t5_1_1_small_at_4k_filling_memory():
  args = bench.parse_args(["--gpu"])
  t5 = args.preset_value.t5
  assert (t5.emb_dim, t5.num_heads, t5.head_dim, t5.mlp_dim, t5.num_encoder_layers,
          t5.num_decoder_layers, t5.vocab_size) == (512, 6, 64, 1024, 8, 8, 32128)
  assert (t5.relative_attention_num_buckets, t5.relative_attention_max_distance) == (128, 512)
  assert jnp.dtype(t5.dtype) == jnp.bfloat16 and args.new_tokens == 128
  assert args.lengths == [4096] and args.batch == "auto" and args.methods == ["decal"]
  assert math.isclose(args.budget, bench.default_budget()[0])
