"""tools/compare_trainers.py and decal_breakeven.py without training: the run plan,
the steps/s read back from TensorBoard events that decal_jax's own writer made, the
summary arithmetic on hand-made rows, and the break-even FLOP ratios against a hand count."""
import importlib

import pytest

from decal_jax import metrics

compare = importlib.import_module("tools.compare_trainers")
breakeven = importlib.import_module("tools.decal_breakeven")


def test_every_round_runs_t5x_network_only_uncompressed():
  args = compare.parse_args(["--ratios", "1", "4", "--dtypes", "float32"])
  assert compare.variants(args) == [(1, "float32", False, "t5x+t5x"),
                                    (1, "float32", False, "t5x+ours"),
                                    (1, "float32", False, "ours"),
                                    (4, "float32", False, "t5x+ours"),
                                    (4, "float32", False, "ours")]
  with pytest.raises(SystemExit):
    compare.parse_args(["--steps", "10", "--log_period", "10"])  # no window after the first


def test_commands_train_the_same_network_and_batches(tmp_path, monkeypatch):
  monkeypatch.setattr(compare, "t5x_site", lambda: "/site")  # T5X need not be installed
  args = compare.parse_args([])
  ours = compare.command("ours", args, 4, "bfloat16", "/m", str(tmp_path))
  t5x = compare.command("t5x+ours", args, 4, "bfloat16", "/m", str(tmp_path))
  shared = ["--gin.COMPRESSION_RATIO=4", "--gin.ACTIVATION_DTYPE='bfloat16'",
            "--gin.t5.T5Config.emb_dim=256", "--gin.BATCH_SIZE=8",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 128, 'targets': 32}",
            "--gin.MIXTURE_OR_TASK_NAME='decal_builtin_span_corruption'"]
  assert all(flag in ours and flag in t5x for flag in shared)
  assert "--gin.train/utils.DatasetConfig.pack=False" in t5x  # unpacked unless asked
  assert "--gin.train/pipeline.DatasetConfig.pack=False" in ours
  qa = compare.parse_args(["--task", "decal_builtin_qa"])
  packed = [compare.command(t, qa, 4, "float32", "/m", str(tmp_path), pack=True)
            for t in ("ours", "t5x+ours")]
  assert all("--gin.MIXTURE_OR_TASK_NAME='decal_builtin_qa'" in p for p in packed)
  assert "--gin.train/pipeline.DatasetConfig.pack=True" in packed[0]
  assert "--gin.train/utils.DatasetConfig.pack=True" in packed[1]
  compare.command("t5x+t5x", args, 1, "float32", "/m", str(tmp_path))
  written = (tmp_path / "t5x_network_float32.gin").read_text()
  assert "emb_dim = 256" in written and "dtype = 'float32'" in written


def test_steps_per_second_read_back_from_the_trainers_events(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path))
  for step, value in ((30, 3.5), (10, 1.0), (20, 3.0)):  # written out of order
    writer.write("train", step, {"steps_per_second": value, "loss": 9.0})
  writer.close()
  assert compare.read_scalars(str(tmp_path), "steps_per_second") == [1.0, 3.0, 3.5]


def test_packing_is_a_dimension_of_every_round():
  args = compare.parse_args(["--ratios", "4", "--dtypes", "float32", "--trainers", "t5x+ours",
                             "ours", "--packing", "no", "yes"])
  assert compare.variants(args) == [(4, "float32", False, "t5x+ours"), (4, "float32", False, "ours"),
                                    (4, "float32", True, "t5x+ours"), (4, "float32", True, "ours")]


def test_real_tokens_per_batch_counted_from_the_task_itself(builtin_vocabulary):
  """Unpacked: the mean of the first batches' real tokens equals a count over the task's own
  examples (already trimmed to the lengths) taken in order; packed: at least as many real
  tokens per batch, never more than the rows hold."""
  import gin
  import seqio
  if not gin.config_is_locked():
    gin.finalize()  # as an earlier test's parse leaves it: the tool must still bind its vocabulary
  args = compare.parse_args(["--task", "decal_builtin_qa", "--batch_size", "4", "--inputs", "256",
                             "--targets", "16", "--count_batches", "5"])
  unpacked = compare.real_tokens_per_batch(args, pack=False)
  examples = seqio.get_mixture_or_task("decal_builtin_qa").get_dataset(
      {"inputs": 256, "targets": 16}, split="train", shuffle=False)
  lengths = [(len(e["inputs"]), len(e["targets"])) for e in
             examples.take(5 * 4).as_numpy_iterator()]
  assert unpacked["inputs"] == sum(i for i, _ in lengths) / 5
  assert unpacked["targets"] == sum(t for _, t in lengths) / 5
  packed = compare.real_tokens_per_batch(args, pack=True)
  assert unpacked["tokens"] < packed["tokens"] <= 4 * (256 + 16)
  assert packed["target_fraction"] == packed["targets"] / (4 * 16)


def test_summary_medians_ranges_and_ratio_to_the_t5x_trainer():
  rows = [dict(ratio=1, dtype="float32", trainer=t, steps_per_s=v) for t, v in
          (("t5x+ours", 2.0), ("t5x+ours", 4.0), ("t5x+ours", 3.0), ("ours", 3.3),
           ("ours", 3.6), ("ours", 3.9))]
  ours, theirs = sorted(compare.summarize(rows), key=lambda s: s["trainer"])
  assert (theirs["median"], theirs["low"], theirs["high"], theirs["vs_t5x_trainer"]) == \
      (3.0, 2.0, 4.0, 1.0)
  assert ours["median"] == 3.6 and ours["vs_t5x_trainer"] == pytest.approx(1.2)


def test_a_trainer_that_logged_other_tokens_than_seqio_counted_is_flagged(capsys):
  count = {"tokens": 836.8, "target_fraction": 0.214}
  assert compare.check_tokens({"trainer": "ours", "logged_token_check": 820.0}, count)
  assert not compare.check_tokens({"trainer": "ours", "logged_token_check": 1256.0}, count)
  assert "warning: ours logged 1.26e+03" in capsys.readouterr().out
  assert compare.check_tokens({"trainer": "t5x+ours", "logged_token_check": 0.22}, count)
  assert not compare.check_tokens({"trainer": "t5x+ours", "logged_token_check": 0.12}, count)


def test_packed_tokens_per_second_and_ratios_within_one_packing():
  rows = [dict(ratio=4, dtype="float32", trainer=t, pack=p, steps_per_s=v) for t, p, v in
          (("t5x+ours", False, 2.0), ("ours", False, 2.2), ("t5x+ours", True, 1.5),
           ("ours", True, 1.8))]
  summary = {(s["pack"], s["trainer"]): s for s in
             compare.summarize(rows, {False: 600.0, True: 800.0})}
  assert summary[True, "ours"]["tokens_per_s"] == pytest.approx(1.8 * 800)
  assert summary[False, "ours"]["tokens_per_s"] == pytest.approx(2.2 * 600)
  assert summary[True, "ours"]["vs_t5x_trainer"] == pytest.approx(1.8 / 1.5)  # not / 2.0
  assert summary[False, "t5x+ours"]["vs_t5x_trainer"] == 1.0


def test_breakeven_ratio_by_hand():
  """One encoder and one decoder layer, d = heads x head_dim = 8, mlp 16, vocab 32, n = 8,
  t = 4, C = 4 (m = 2): counted matmul by matmul (2 x M x N x K each)."""
  sizes = dict(vocab_size=32, emb_dim=8, num_heads=2, head_dim=4, mlp_dim=16,
               num_encoder_layers=1, num_decoder_layers=1)
  d, f, v, n, t, m = 8, 16, 32, 8, 4, 2

  def attention(q, k):  # q/k/v/o projections, scores, weighted sum
    return 2 * q * d * d * 2 + 2 * k * d * d * 2 + 2 * q * k * d * 2

  def mlp(length):  # gated: two input kernels and the output kernel
    return 2 * length * d * f * 3

  def total(enc_len, mem):
    encoder = attention(enc_len, enc_len) + mlp(enc_len)
    decoder = attention(t, t) + attention(t, mem) + mlp(t) + 2 * t * d * v
    return encoder + decoder

  pooling = 2 * n * m * d + 2 * n * m  # the masked mean as an [m, n] x [n, d] product + mask
  want = (total(n + m, m) + pooling) / total(n, n)
  assert breakeven.step_flop_ratio(sizes, 4, n, t) == pytest.approx(want, rel=1e-9)
