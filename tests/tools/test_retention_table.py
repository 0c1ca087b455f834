"""tools/retention_table.py and its data (decal_jax/data/public_text.py): the
statistics against numpy, the reconstruction accuracy against hand-worked cases, the splits
of the public text on a small folder made here, and the gin files it trains with."""
import argparse
import json
import math
import pathlib

import gin
import numpy as np
import pytest

from tools import benchmarking, results_files
from decal_jax.data import public_text
from tools import retention_table as rt


GAINS = [0.01, 0.03, 0.02]  # teacher-forced minus swapped-encoding accuracy, per seed


def _results(values):
  """Per-seed rows as the tool records them: {(method, ratio): [greedy acc per seed]}."""
  out = []
  for (method, ratio), accs in values.items():
    for seed, acc in enumerate(accs):
      out.append({"method": method, "ratio": ratio, "seed": seed, "greedy_accuracy": acc,
                  "teacher_forced_accuracy": acc / 2, "bleu": 100 * acc,
                  "swapped_accuracy": acc / 2 - GAINS[seed], "steps": 80, "seconds": 60.0,
                  "train_seconds": 50.0, "load_average": "1.0/1.0/1.0",
                  "curve": [[40, acc / 4], [80, acc / 2]]})
  return out


def test_table_mean_and_standard_error_are_numpys_over_the_seed_rows():
  values = {("decal", 2): [0.31, 0.35, 0.30], ("dodo", 2): [0.2, 0.25, 0.27],
            ("decal", 8): [0.1, 0.1, 0.16]}
  rows = rt.summarize(_results(values))
  assert [(r["method"], r["ratio"]) for r in rows] == [("decal", 2), ("decal", 8), ("dodo", 2)]
  for row in rows:
    x = np.array(values[(row["method"], row["ratio"])], np.float64)
    se = np.sqrt(np.sum((x - x.mean()) ** 2) / (len(x) - 1) / len(x))  # s / sqrt(n)
    assert row["greedy_accuracy"] == pytest.approx((100 * x.mean(), 100 * se), rel=1e-12)
    assert row["bleu"] == pytest.approx((100 * x.mean(), 100 * se), rel=1e-12)
    assert row["teacher_forced_accuracy"] == pytest.approx((50 * x.mean(), 50 * se), rel=1e-12)
    # the gain is paired per seed: its s.e. is that of the differences, not of either side
    assert row["encoding_gain"] == pytest.approx((2.0, 100 * 0.01 / np.sqrt(3)), rel=1e-9)
  cells = [line.split("|")[1:-1] for line in rt.table(rows).splitlines()]
  assert [c.strip() for c in cells[2]] == ["DeCAL", "2", "3", "16.00 ± 0.76", "2.00 ± 0.58",
                                           "32.00 ± 1.53", "32.00 ± 1.53"]  # 0.32; s.e. 0.01528
  assert math.isnan(benchmarking.mean_stderr([0.5])[1])  # one seed: no error bar, not a zero
  one = rt.summarize(_results({("decal", 4): [0.25]}))
  assert "| DeCAL | 4 | 1 | 12.50 |" in rt.table(one)  # written alone, not "± nan"


def test_rewriting_the_report_keeps_the_hand_written_reading(tmp_path):
  out = tmp_path / "retention.md"
  out.write_text("an older table\n" + results_files.READING + "\nMy reading.\n")
  args = argparse.Namespace(out=out, no_plot=True, argv=["--steps", "80"], content="real")
  rt.write(args, _results({("decal", 2): [0.3, 0.31, 0.32]}), 36)
  text = out.read_text()
  assert "an older table" not in text
  assert text.endswith(results_files.READING + "\nMy reading.\n")
  assert "| DeCAL | 2 | 3 | 15.50 ± 0.29 |" in text and "3 of 36 runs done so far" in text


def test_greedy_accuracy_is_one_for_a_perfect_copy_and_counts_positions():
  refs = [[5, 6, 7, 1], [9, 9, 1]]
  assert rt.greedy_token_accuracy(refs, refs) == 1.0
  # 1st: positions 0 and 3 match (2 of 4); 2nd: stops after 1 token (1 of 3); 3 / 7
  assert rt.greedy_token_accuracy([[5, 0, 0, 1, 4, 4], [9]], refs) == pytest.approx(3 / 7)
  assert rt.greedy_token_accuracy([[6, 7, 1, 5], [1, 1, 9]], refs) == 0.0  # 1st shifted by one


def test_swap_gives_each_chunk_the_encoding_of_another_and_keeps_its_targets():
  batch = {"encoder_input_tokens": np.array([[1, 1], [2, 2], [3, 3]]),
           "decoder_target_tokens": np.array([[7, 1], [8, 1], [9, 1]])}
  swapped = rt.swap_encodings(batch)
  np.testing.assert_array_equal(swapped["encoder_input_tokens"], [[3, 3], [1, 1], [2, 2]])
  np.testing.assert_array_equal(swapped["decoder_target_tokens"], batch["decoder_target_tokens"])


def _data_dir(tmp_path: pathlib.Path) -> pathlib.Path:
  text = tmp_path / "text"
  text.mkdir()
  c4 = [f"c4 document number {i} about barbecue classes" for i in range(40)]
  (text / public_text.FILES["c4"]).write_text(
      "".join(json.dumps({"text": t, "url": "u"}) + "\n" for t in c4))
  wiki = [" = Heading = ", "", f" Paragraph {0} of the article . ", " = = Section = = "]
  wiki += [f" Paragraph {i} of the article . " for i in range(1, 40)]
  (text / public_text.FILES["wikitext"]).write_text("\r\n".join(wiki) + "\r\n")
  stories = [f"Once upon a time story {i} happened." for i in range(40)]
  (text / public_text.FILES["tinystories"]).write_text(
      "\n<|endoftext|>\n".join(stories) + "\n<|endoftext|>\n")
  return tmp_path, c4, [f"Paragraph {i} of the article ." for i in range(40)], stories


def test_public_text_documents_split_by_hash_and_interleave_sources(tmp_path):
  folder, c4, wiki, stories = _data_dir(tmp_path)
  docs = public_text.documents(str(folder))
  train, held = docs["train"], docs["validation"]
  assert sorted(train + held) == sorted(c4 + wiki + stories)  # headings and blanks dropped
  assert not set(train) & set(held)
  for split, mine in docs.items():  # independent of the order read: the text's own hash
    import hashlib
    for d in mine:
      bucket = int(hashlib.sha256(d.encode()).hexdigest(), 16) % 100
      assert (bucket < public_text.VALIDATION_PERCENT) == (split == "validation")
  kinds = [("c4" if d.startswith("c4") else "w" if d.startswith("Para") else "s")
           for d in train[:3]]
  assert sorted(kinds) == ["c4", "s", "w"]  # round-robin: every source early on


def test_public_text_missing_folder_names_the_fix(tmp_path):
  with pytest.raises(FileNotFoundError, match="DECAL_DATA_DIR"):
    public_text.documents(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("method,compressor", [
    ("decal", "latents"), ("attn_pool", "attn_pool"), ("ccproxy", "memory_tokens"),
    ("dodo", None)])
def test_every_method_trains_under_the_same_budget(method, compressor):
  """The tool's gin files build each method at the asked ratio, and the budget (steps,
  batch, optimiser, task, lengths) is the same for all four."""
  from decal_jax.runtime import gin_utils
  args = rt.parse_args(["--content", "real"])
  files, bindings = rt.run_config(method, 4, 1, args, pathlib.Path("/tmp/unused"))
  gin_utils.parse(files, [], bindings)
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  config = model.module.config
  assert config.compression_ratio == 4
  if compressor:
    assert config.compressor == compressor
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == rt.TASK
  assert gin.query_parameter("%TASK_FEATURE_LENGTHS") == {"inputs": 64, "targets": 64}
  assert (gin.query_parameter("%TRAIN_STEPS"), gin.query_parameter("%BATCH_SIZE"),
          gin.query_parameter("%SEED")) == (80, 16, 1)
  assert gin.query_parameter("trainer.train.optimizer").selector == "optimizers.adamw"
  gin.clear_config()


@pytest.mark.parametrize("method", list(rt.METHODS))
def test_every_method_trains_the_known_content_under_one_budget(method):
  """Known content: each of the six methods is built at the asked ratio, with the ablation's
  switch where it has one, on the asked task and lengths (n symbols + EOS), same budget."""
  from decal_jax.runtime import gin_utils
  args = rt.parse_args(["--task", "decal_known_repeat_k4_n31"])
  assert (args.methods, args.ratios, args.length) == (list(rt.METHODS), [1, 2, 4, 8, 16], 32)
  files, bindings = rt.run_config(method, 8, 2, args, pathlib.Path("/tmp/unused"))
  gin_utils.parse(files, [], bindings)
  config = gin.query_parameter("%MODEL").scoped_configurable_fn().module.config
  assert config.compression_ratio == 8
  if method != "dodo":
    assert config.use_pooling == (method != "decal_no_pooling")
    assert config.separate_latent_params == (method == "decal_separate")
  assert gin.query_parameter("%KNOWN_TASK") == "decal_known_repeat_k4_n31"  # the task macro
  assert gin.query_parameter("%TASK_FEATURE_LENGTHS") == {"inputs": 32, "targets": 32}
  assert (gin.query_parameter("%TRAIN_STEPS"), gin.query_parameter("%BATCH_SIZE"),
          gin.query_parameter("%SEED")) == (1500, 64, 2)
  gin.clear_config()


def test_a_ratio_that_does_not_divide_the_input_is_refused():
  with pytest.raises(SystemExit):
    rt.parse_args(["--task", "decal_known_uniform_k16_n15", "--ratios", "3"])  # 16 tokens


def test_flat_step_is_where_the_curve_stays_near_its_last_value():
  curve = [[100, 0.20], [200, 0.90], [300, 0.987], [400, 0.99], [500, 0.995]]
  assert rt.flat_step(curve) == 300  # 0.987 .. 0.995 within 0.01 of 0.995; 0.90 is not
  assert rt.flat_step([[100, 0.5], [200, 0.7]]) == 200  # still rising: its last step
  assert rt.flat_step([[100, 0.5], [200, 0.98], [300, 0.5]]) == 300  # a late fall counts
  assert math.isnan(rt.flat_step([]))


def test_bits_per_latent_divide_the_content_by_the_encodings_vectors():
  assert rt.bits_per_latent("decal_known_uniform_k16_n15", 1, 16) == 60 / 16
  assert rt.bits_per_latent("decal_known_uniform_k16_n15", 4, 16) == 15.0
  assert rt.bits_per_latent("decal_known_repeat_k16_n15", 16, 16) == 32.0  # one latent


def test_known_content_rows_report_exact_rebuilds_and_the_swapped_control():
  results = []
  for seed, exact in enumerate([98.0, 100.0, 99.0]):
    results.append({"method": "decal", "ratio": 4, "seed": seed, "exact": exact,
                    "symbol_accuracy": exact, "teacher_forced_accuracy": exact / 100,
                    "swapped_accuracy": 0.0625, "bits_per_latent": 15.0,
                    "curve": [[375, 0.5], [750, 0.991], [1125, exact / 100]]})
  rows = rt.summarize(results)
  assert rows[0]["exact"] == pytest.approx((99.0, 1 / np.sqrt(3)))  # s.d. 1, n = 3
  assert rows[0]["swapped_accuracy"] == pytest.approx((6.25, 0.0))
  cells = [c.strip() for c in rt.table(rows, rt.KNOWN_METRICS).splitlines()[2].split("|")[1:-1]]
  assert cells[:5] == ["DeCAL", "4", "15.0", "3", "99.00 ± 0.58"]
  assert cells[-1] == "875"  # 1125 (0.991 is 0.011 from its last 0.98) / 750 / 750
