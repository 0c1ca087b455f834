"""tools/gpu_suite.py --dry_run: every part runs at tiny shapes on CPU as the GPU run would
(the same tools, flags and output names), and writes its results file with the fields a
reader needs; a part forced to fail is recorded as failed while the parts after it still
run; the ablation continues on another machine from its record."""
import dataclasses
import importlib
import json
import time

import pytest

import paths

REPO = paths.REPO
gpu_suite = importlib.import_module("tools.gpu_suite")

FAILED_PART = "nuggets"  # runs its tool, then a command that exits 3
MARKDOWN = {"inference_throughput_gpu.md": "bench_inference",
            "nuggets_cache_gpu.md": "bench_nuggets", "squid_latency_gpu.md": "bench_squid",
            "gpthf_efficiency_gpu.md": "bench_gpthf", "retrieval_bench_gpu.md": "bench_retrieval",
            "retrieval_scale_gpu.md": "bench_retrieval_scale",
            "retrieval_scale_synthetic_gpu.md": "bench_retrieval_scale",
            "retention_gpu.md": "retention_table", "ablation_gpu.md": "ablate",
            "smollm2_autoencode_gpu.md": "smollm2_autoencode",
            "smollm2_lm_train_gpu.md": "smollm2_lm_train",
            "smollm2_lm_train_sink_gpu.md": "smollm2_lm_train",
            "smollm2_squid_gpu.md": "smollm2_squid"}
PLOTS = ("inference_throughput_gpu.png", "squid_latency_gpu.png", "gpthf_efficiency_gpu.png",
         "retrieval_bench_gpu.png",
         "retrieval_scale_gpu.png", "retention_gpu.png", "ablation_gpu.png",
         "smollm2_autoencode_gpu.png", "smollm2_lm_train_gpu.png", "smollm2_lm_train_sink_gpu.png",
         "smollm2_squid_gpu.png")


# The parts that read ../shared/data run in a dry run of their own (`data_result`), which a
# bare clone skips; CI reruns only it beside ../shared, not the other parts a second time.
DATA_PARTS = [part.name for part in gpu_suite.PARTS if part.needs_data]
OTHER_PARTS = [part.name for part in gpu_suite.PARTS if not part.needs_data]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  """The dry run of every part that reads no shared data, FAILED_PART forced to fail."""
  out = tmp_path_factory.mktemp("gpu_suite")
  parts = []
  for part in gpu_suite.PARTS:
    if part.name == FAILED_PART:
      def fails_after(suite, real=part.run):
        real(suite)
        suite.call(["-c", "import sys; sys.exit(3)"])
        return ""
      part = gpu_suite.Part(part.name, fails_after, part.outputs)
    parts.append(part)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(gpu_suite, "PARTS", parts)
    summary = gpu_suite.main(["--dry_run", "--out_dir", str(out), "--parts",
                              ",".join(OTHER_PARTS)])
  return summary, out


@pytest.fixture(scope="module")
def data_result(tmp_path_factory):
  """The dry run of the parts that read the shared data (skipped where it is absent)."""
  folder = gpu_suite.data_dir()
  missing = sorted({need for part in gpu_suite.PARTS for need in part.needs_data
                    if not (folder / need).exists()})
  if missing:
    pytest.skip(f"{', '.join(missing)} absent from the shared data folder {folder} (set "
                "DECAL_DATA_DIR to it, default ../shared/data)")
  out = tmp_path_factory.mktemp("gpu_suite_data")
  return gpu_suite.main(["--dry_run", "--out_dir", str(out), "--parts",
                         ",".join(DATA_PARTS)]), out


def _rows(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_part_ran_and_the_forced_failure_is_recorded(result):
  summary, out = result
  parts = summary["parts"]
  assert list(parts) == OTHER_PARTS and set(DATA_PARTS) >= {"retention", "smollm2_squid"}
  for name, row in parts.items():
    assert row["device"].startswith("cpu (cpu; jax"), row
    assert row["commands"] and row["wall_s"] > 0
    if name == FAILED_PART:
      assert row["status"] == "failed" and "exited with 3" in row["note"]
      assert any("sys.exit(3)" in line for line in row["log_tail"])
    else:
      assert row["status"] == "ok", (name, row.get("note"), row.get("log_tail"))
  text = (out / "gpu_suite_summary.md").read_text()
  assert "- device: cpu (cpu; jax" in text and "- command: `python -m tools.gpu_suite" in text
  for name, row in parts.items():
    assert f"| {name} | {row['status']} |" in text
  assert json.loads((out / "gpu_suite_summary.json").read_text())["parts"] == parts


def test_the_probe_times_each_option_set_and_train_uses_the_fastest(result):
  summary, out = result
  probe = _rows(out / "bench_train_probe_gpu.jsonl")
  names = [row["label"].split()[1] for row in probe]
  assert names == ["einsum", "xla+fused"]  # no cuDNN on CPU
  fastest = min(probe, key=lambda row: row["step_s_median"])["label"].split()[1]
  assert summary["details"]["best_options"] == fastest
  train = _rows(out / "bench_train_gpu.jsonl")
  assert [row["config"]["compression_ratio"] for row in train] == [1, 4]
  for row in probe + train:
    assert row["device_kind"] == "cpu" and row["step_s_median"] > 0 and "mfu" in row
    assert row["config"]["dtype"] == "bfloat16"
    assert row["lengths"] == {"inputs": 64, "targets": 16} and row["batch_size"] == 2
  for binding in gpu_suite.OPTION_SETS[fastest]:
    assert binding.replace("=", " = ") in train[0]["gin_bindings"]
  log = (out / "logs" / "train_probe.log").read_text()  # stages on stderr, for a killed run
  assert log.count("XLA compile (") == log.count("compiled in ") == len(probe)


def test_each_xla_flag_set_is_timed_and_the_parts_after_run_with_the_chosen_one(result):
  summary, out = result
  rows = _rows(out / "bench_xla_flags_gpu.jsonl")
  assert [row["label"] for row in rows] == list(gpu_suite.XLA_FLAG_SETS)
  for row in rows:
    assert row["compile_s"] > 0 and row["tflops"] > 0 and row["peak_fraction"] is None
    assert (row["batch"], row["length"]) == (2, 64)
  chosen = summary["details"]["xla_flags"]["chosen"]
  assert chosen == gpu_suite.choose_xla_flags({row["label"]: row for row in rows})
  flags = gpu_suite.XLA_FLAG_SETS[chosen]
  for row in (_rows(out / "bench_train_probe_gpu.jsonl") + _rows(out / "bench_train_gpu.jsonl")
              + _rows(out / "bench_train_profile_gpu.jsonl")):
    # the profiled run adds CUDA graphs off, so its trace shows each kernel
    profiled = row["label"].endswith(" traced")
    want = flags.split() + ([gpu_suite.PROFILE_XLA_FLAGS] if profiled else [])
    got = row.get("xla_flags", "").split()
    assert got[len(got) - len(want):] == want, row["label"]
  assert summary["xla_flags"].endswith(flags)
  text = (out / "gpu_suite_summary.md").read_text()
  assert f"Chosen for the parts after it: {chosen}." in text
  assert all(f"| {name} | `{f or 'none'}` |" in text
             for name, f in gpu_suite.XLA_FLAG_SETS.items())


def test_the_chosen_flags_are_the_fastest_that_compile_quickly():
  """Hand-worked: 'slow-compile' is fastest but compiles in 40 s against the quickest 4 s
  (allowed: up to max(2 x 4, 4 + 5) = 9 s); of the rest 'b' (7 s, inside) beats 'a'."""
  rows = {"a": {"compile_s": 4.0, "tflops": 2.0}, "b": {"compile_s": 7.0, "tflops": 300.0},
          "slow-compile": {"compile_s": 40.0, "tflops": 500.0}, "failed": None}
  assert gpu_suite.choose_xla_flags(rows) == "b"
  assert gpu_suite.choose_xla_flags({"failed": None}) is None


def test_the_block_flops_are_what_xla_counts():
  """bench_xla_flags' analytical count (2 m n k per matmul, x 3) against XLA's own count of
  the compiled forward + backward on CPU (which adds the softmax and GELU's few FLOPs)."""
  import jax
  bench, xla_cost = _tool("bench_xla_flags"), importlib.import_module(
      "tools.benchmarking").xla_cost
  for batch, length in ((2, 64), (1, 160)):
    x = jax.numpy.zeros((batch, length, bench.EMB), jax.numpy.bfloat16)
    compiled = jax.jit(bench.loss_and_grads).lower(bench.init_weights(0), x).compile()
    assert 1.0 <= xla_cost(compiled) / bench.block_flops(batch, length) < 1.03


def test_decal_4x_is_profiled_in_a_run_of_its_own_and_the_summary_shows_it(result):
  """The timed C = 4 row has no trace; the traced run (CUDA graphs off) has the top ops and
  the op time by part of the step, which add up to all of its op time."""
  _, out = result
  assert not any("profile_top_ops" in row for row in _rows(out / "bench_train_gpu.jsonl"))
  row = _rows(out / "bench_train_profile_gpu.jsonl")[-1]
  assert row["config"]["compression_ratio"] == gpu_suite.PROFILED_RATIO
  top, parts = row["profile_top_ops"], row["profile_parts"]
  assert top and all(op["ms_per_step"] > 0 and 0 < op["share"] <= 1 for op in top)
  assert [op["share"] for op in top] == sorted((op["share"] for op in top), reverse=True)
  assert sum(op["share"] for op in top) <= 1 + 1e-9
  assert any("jit(step_fn)" in op["jax_op"] for op in top)  # mapped to the JAX operation
  assert abs(sum(p["ms_per_step"] for p in parts) - row["profile_op_ms_per_step"]) < 1e-6
  assert abs(sum(p["share"] for p in parts) - 1) < 1e-9
  assert all(0 <= p["matmul_ms_per_step"] <= p["ms_per_step"] for p in parts)
  names = {p["part"] for p in parts}
  assert {"attention", "MLP", "optimizer"} <= names  # a T5 step's parts, Adafactor's update
  assert any(p["matmul_ms_per_step"] > 0 for p in parts)  # the dots were recognised
  traffic = row["hlo_traffic_parts"]  # bytes by part from the compiled program's shapes
  assert {"attention", "MLP", "optimizer"} <= set(traffic)
  assert all(v["gb"] >= v["matmul_gb"] >= 0 and v["kernels"] > 0 for v in traffic.values())
  import gzip
  hlo = gzip.open(out / "logs" / "train_step_c4.hlo.txt.gz", "rt").read()
  assert "ENTRY" in hlo and any(op["op"] in hlo for op in top)  # the program profiled
  text = (out / "gpu_suite_summary.md").read_text()
  assert "## What takes DeCAL-4x's time (MFU not known)" in text  # no peak on CPU
  assert f"| {top[0]['op']} |" in text and f"| {parts[0]['part']} | " in text
  assert "| GB moved per step (HLO) |" in text


def _outputs(names):
  return {o for part in gpu_suite.PARTS if part.name in names for o in part.outputs}


def _wrote_results(out, files):
  for file, tool in MARKDOWN.items():
    if file in files:
      text = (out / file).read_text()
      assert f"- command: `python -m tools.{tool}" in text, file
      assert "JAX backend: cpu (cpu)" in text, file
      assert "\n|---" in text, file  # a table
  for file in set(PLOTS) & files:
    assert (out / file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", file


def test_each_benchmark_wrote_its_results_with_command_and_device(result):
  _wrote_results(result[1], _outputs(OTHER_PARTS))


def test_each_part_that_reads_the_shared_data_ran_and_wrote_its_results(data_result):
  summary, out = data_result
  assert list(summary["parts"]) == DATA_PARTS
  for name, row in summary["parts"].items():
    assert row["status"] == "ok", (name, row.get("note"), row.get("log_tail"))
  assert set(MARKDOWN) | set(PLOTS) >= _outputs(DATA_PARTS) - {"retention_gpu.json"}
  _wrote_results(out, _outputs(DATA_PARTS))


def test_the_lm_part_starts_a_scorer_from_the_autoencode_parts_compressor(data_result):
  out = data_result[1]
  text = (out / "smollm2_lm_train_gpu.md").read_text()
  assert "| nuggets-3 from AE | 1 |" in text and "| nuggets-3 | 1 |" in text
  assert "smollm2_autoencode" in text and "r3_nuggets_seed0.npz" in text


def test_the_lm_part_reruns_the_window_and_nuggets_reading_token_0(data_result):
  """The part's last phase: the scale's window and nuggets rows again with --sink 1, in their
  own file (no 'full' row: it reads token 0 anyway)."""
  text = (data_result[1] / "smollm2_lm_train_sink_gpu.md").read_text()
  assert "+ the first 1 tokens (sink)" in text and "--sink 1" in text
  assert "| window-8 | 1 |" in text and "| nuggets-3 | 1 |" in text and "from AE" not in text


def _jsonl_rows(path):
  """The JSON lines at the end of bench_retrieval_scale's report."""
  text = path.read_text().split("```jsonl\n", 1)[1].split("```", 1)[0]
  return [json.loads(line) for line in text.splitlines()]


def test_the_scale_and_retention_parts_measure_what_they_name(data_result):
  out = data_result[1]
  real = _jsonl_rows(out / "retrieval_scale_gpu.md")
  assert {(r["corpus"], r["ratio"], r["search"], r["bits"]) for r in real} == {
      ("scifact", c, s, b) for c in (1, 4)
      for s, b in (("exact", "float16"), ("approximate", 2), ("approximate", "none"))}
  record = json.loads((out / "retention_gpu.json").read_text())
  assert [(r["method"], r["ratio"], r["seed"]) for r in record.values()] == [("decal", 4, 0)]
  assert 0 <= next(iter(record.values()))["teacher_forced_accuracy"] <= 1


def test_the_synthetic_million_part_measures_what_it_names(result):
  synthetic = _jsonl_rows(result[1] / "retrieval_scale_synthetic_gpu.md")
  assert {(r["corpus"], r["num_docs"], r["ratio"]) for r in synthetic} == {
      ("synthetic 300 passages", 300, 4)}


def test_the_device_image_parts_ran_with_tensorflow_and_seqio_refused(result):
  """The parts marked device_image ran (status ok above) under a sitecustomize that refuses
  every DEVICE_IMAGE_LACKS import: so they run on a GPU image without TensorFlow / seqio
  (the train parts too: bench_train's step, the probe and the profile; the SmolLM2 parts
  ran so in the data dry run, checked by the data-parts test)."""
  import subprocess
  import sys
  summary, out = result
  assert {p.name for p in gpu_suite.PARTS if p.device_image} == {
      "xla_flags", "train_probe", "train", "inference", "nuggets", "squid", "gpthf",
      "retrieval", "retrieval_scale", "retrieval_1m", "smollm2_autoencode", "smollm2_lm_train",
      "smollm2_squid"}  # the SmolLM2 parts: in the data dry run (data_result)
  assert {"tensorflow", "tensorflow_text", "seqio", "clu", "t5"} <= set(
      gpu_suite.DEVICE_IMAGE_LACKS)
  for name in ("train_probe", "train"):  # every option set and C ran (the probe test above)
    assert summary["parts"][name]["status"] == "ok"
  env = {"PYTHONPATH": str(out / "work" / "refuse_imports"), "PATH": "/usr/bin:/bin"}
  for lacking in gpu_suite.DEVICE_IMAGE_LACKS:
    run = subprocess.run([sys.executable, "-c", f"import {lacking}"], env=env,
                         capture_output=True, text=True, check=False)
    assert run.returncode == 1 and "is not on the GPU image" in run.stderr, (lacking, run.stderr)
  run = subprocess.run([sys.executable, "-c", "import json, numpy"], env=env, check=False)
  assert run.returncode == 0  # everything else imports


def test_the_ablation_continues_from_its_record_on_a_fresh_machine(result, tmp_path):
  _, out = result
  record = json.loads((out / "ablation_gpu_runs.json").read_text())
  assert list(record["results"]) == ["decal_2x"]
  assert record["budget"]["pretrain_steps"] == 2
  assert "DeCAL 2x" in (out / "ablation_gpu.md").read_text()
  summary = gpu_suite.main(["--dry_run", "--out_dir", str(out), "--parts", "ablation",
                            "--work", str(tmp_path / "fresh_work")])
  row = summary["parts"]["ablation"]
  assert row["status"] == "ok", row
  log = (out / "logs" / "ablation.log").read_text()
  assert "restored from" in log and "done before" in log  # nothing trained again
  assert json.loads((out / "ablation_gpu_runs.json").read_text())["results"] == \
      record["results"]
  assert summary["parts"]["train"]["status"] == "ok"  # the earlier parts' rows are kept


def _tool(name):
  return importlib.import_module(f"tools.{name}")


@pytest.mark.parametrize("option_set", list(gpu_suite.OPTION_SETS))
def test_the_gpu_train_commands_build_their_model(option_set):
  """What the dry run cannot run (cuDNN, T5.1.1-small at batch 128): every GPU option set's
  bench_train arguments parse, and gin builds the model they name with those options."""
  from decal_jax.runtime import gin_utils
  scale = gpu_suite.gpu_scale(None)
  argv = gpu_suite.bench_train_argv(scale, ["COMPRESSION_RATIO=4",
                                            *gpu_suite.OPTION_SETS[option_set]],
                                    scale.steps, "label", REPO / "out.jsonl")
  assert argv[:2] == ["-m", "tools.bench_train"]
  args, (files, paths_, bindings) = _tool("bench_train").parse_args(argv[2:])
  assert (args.batch_size, args.inputs_length, args.targets_length) == (128, 512, 128)
  config = gin_utils.load_model(files, search_paths=paths_, bindings=bindings).model.module.config
  assert config.compression_ratio == 4 and config.dtype == "bfloat16"
  assert config.emb_dim == 512 and config.num_encoder_layers == 8  # T5.1.1-small
  for binding in gpu_suite.OPTION_SETS[option_set]:
    name, value = binding.split("=")
    field = {"ATTENTION_KERNEL": "attention_kernel", "FUSED_QKV": "fused_qkv",
             "SCAN_LAYERS": "scan_layers", "REMAT_POLICY": "remat_policy"}[name]
    assert str(getattr(config, field)) == value.strip("'")


@pytest.mark.parametrize("part,tool", [("nuggets", "bench_nuggets"), ("squid", "bench_squid"),
                                       ("gpthf", "bench_gpthf"), ("retrieval", "bench_retrieval")])
def test_the_gpu_benchmark_flags_exist(part, tool):
  argv = gpu_suite.gpu_scale("beir/folder").tools[part] + ["--out", "x.md"]
  args = _tool(tool).parse_args(argv + ([] if part == "nuggets" else ["--plot", "x.png"]))
  assert args.out == "x.md"
  assert {"nuggets": lambda: args.contexts == [16384, 65536] and args.dtype == "bfloat16",
          "squid": lambda: args.preset == "qwen2", "gpthf": lambda: args.preset == "paper",
          "retrieval": lambda: args.size == "small" and args.beir_folder == "beir/folder"
          }[part]()


def test_the_lease_grids_parse_to_what_they_name():
  """The lease's smaller grids (gpu_suite_scales.LEASE_TOOLS) parse in their tools."""
  lease = gpu_suite.lease_scale("beir/folder")
  squid = _tool("bench_squid").parse_args(lease.tools["squid"] + ["--out", "x.md"])
  assert (squid.preset, squid.contexts, squid.ratios) == ("qwen2", [2048, 8192], [4, 16])
  gpthf = _tool("bench_gpthf").parse_args(lease.tools["gpthf"] + ["--out", "x.md"])
  assert (gpthf.preset, gpthf.prompts, gpthf.new_tokens, gpthf.batches) == (
      "paper", [250, 1000], [100], [32])
  real = _tool("bench_retrieval_scale").parse_args(lease.tools["retrieval_scale"] +
                                                   ["--out", "x.md"])
  assert real.ratios == [1, 4] and real.bits == [2, None]
  assert real.beir_folder == "beir/folder" and real.synthetic_passages == 0
  assert lease.tools["retrieval_scale_synthetic"] == gpu_suite.gpu_scale(None).tools[
      "retrieval_scale_synthetic"]  # the 1M-passage run as in the full suite
  inference = _tool("bench_inference")
  for tools, ratios in ((lease.tools, [1, 4]), (gpu_suite.gpu_scale(None).tools, [1, 2, 4, 8])):
    args = inference.parse_args(tools["inference"] + ["--out", "x.md"])
    assert (args.preset, args.lengths, args.new_tokens, args.batch, args.ratios["decal"]) == (
        "gpu", [4096], 128, "auto", ratios)  # T5.1.1-small, 4k in, 128 out, memory filled


def test_the_gpu_retrieval_scale_and_retention_arguments_parse():
  """What the dry run cannot run at the GPU's size: the 1M-passage run's and the real
  corpora's arguments parse to the corpora, C and bit widths the docs name."""
  scale = gpu_suite.gpu_scale("beir/folder")
  bench = _tool("bench_retrieval_scale")
  real = bench.parse_args(scale.tools["retrieval_scale"] + ["--out", "x.md", "--plot", "x.png"])
  assert real.beir_folder == "beir/folder" and real.synthetic_passages == 0
  assert real.ratios == [1, 2, 4, 8] and real.bits == [1, 2, 4, None]
  synthetic = bench.parse_args(scale.tools["retrieval_scale_synthetic"] + ["--out", "x.md"])
  assert synthetic.synthetic_passages == 1_000_000 and synthetic.ratios == [4]
  assert synthetic.num_centroids == 1.0 and synthetic.sample_vectors == 1 << 20
  assert synthetic.beir_folder == synthetic.msmarco_folder == ""
  assert scale.tools["retention"] == ["--content", "real", "--steps",
                                      str(gpu_suite.RETENTION_STEPS)]
  from tools import retention_table
  retention = retention_table.parse_args(scale.tools["retention"])
  assert (retention.content, retention.steps, retention.ratios) == ("real", 1200, [2, 4, 8])


def test_the_gpu_smollm2_autoencoding_arguments_parse():
  """The GPU's Dodo autoencoding run: the paper's ratios, both controls, 3 seeds, 256-token
  segments, on the whole model (no --layers)."""
  from tools import smollm2_autoencode
  args = smollm2_autoencode.parse(gpu_suite.gpu_scale(None).tools["smollm2_autoencode"])
  assert args.ratios == [2, 5, 10, 20] and args.seeds == [0, 1, 2]
  assert set(args.selections) == {"nuggets", "random", "compressive"}
  assert (args.length, args.batch, args.steps, args.layers) == (256, 16, 2000, None)


def test_the_gpu_smollm2_language_model_arguments_parse():
  """The GPU's Dodo LM run: the paper's ratios against both controls at equal cache and the
  full-context ceiling, 3 seeds, 737-token sequences, on the whole model (no --layers)."""
  from tools import smollm2_lm_train
  args = smollm2_lm_train.parse(gpu_suite.gpu_scale(None).tools["smollm2_lm_train"])
  assert {"nuggets-5", "nuggets-10", "nuggets-20", "window-64", "random-10", "full",
          "compressive-10"} <= set(args.settings)
  assert args.seeds == [0, 1, 2] and args.layers is None
  assert (args.window, args.length, args.batch, args.steps) == (32, 32 * 21 + 64 + 1, 8, 1000)


def test_the_gpu_smollm2_squid_arguments_parse():
  """The GPU's Squid run: ρ = 4 / 8 / 16, the memory tokens against segment means, the
  full-context ceiling and the prior, 3 seeds, the three stages with the large decoder
  trained after stage 1, 256-token contexts, on the whole model (no --layers)."""
  from tools import smollm2_squid
  args = smollm2_squid.parse(gpu_suite.gpu_scale(None).tools["smollm2_squid"])
  assert args.ratios == [4, 8, 16] and args.seeds == [0, 1, 2] and args.layers is None
  assert set(args.memories) == {"tokens", "means", "full", "none"}
  assert [s for s, _ in smollm2_squid.active_stages(args)] == ["restore", "continue", "qa"]
  assert (args.length, args.batch, args.large) == (256, 16, "trains")


def test_the_gpu_smollm2_runs_score_no_more_held_out_examples_than_the_data_holds():
  """Each SmolLM2 part asks for at most the held-out examples the shared data holds at its
  lengths (SmolLM2's own tokens): the first H200 lease found the autoencoder asking for 256
  held-out 256-token segments of the 55 there are, and exiting before any training."""
  from tools import smollm2_autoencode, smollm2_squid
  from tools import smollm2_squid_model as sm
  pytest.importorskip("gguf", reason="reading SmolLM2's GGUF needs the gguf package")
  if not (gpu_suite.data_dir() / "text").exists() or not (gpu_suite.data_dir() / "squad").exists():
    pytest.skip(f"no text / squad under the shared data folder {gpu_suite.data_dir()}")
  from decal_jax.interop import gguf
  try:
    metadata = gguf.read_gguf(gguf.smollm2_gguf_path()).metadata
  except FileNotFoundError as e:
    pytest.skip(str(e))
  tokenizer, _ = gguf.tokenizer_from_gguf(metadata)
  scale = gpu_suite.gpu_scale(None).tools
  ae = smollm2_autoencode.parse(scale["smollm2_autoencode"])
  held_out = len(smollm2_autoencode.segments(tokenizer, ae.length)["validation"])
  assert ae.bleu_segments <= ae.eval_segments <= held_out, (ae.eval_segments, held_out)
  squid = smollm2_squid.parse(scale["smollm2_squid"])
  eos = tokenizer.token_to_id("<|im_end|>")
  data = smollm2_squid.stage_data(squid, tokenizer, eos, tokenizer.encode(sm.RESTORE_PROMPT).ids)
  assert set(data) == {"restore", "continue", "qa"}  # none left out, none too short (exits)
  assert all(len(d["validation"]["decoder_target_tokens"]) == squid.eval_segments
             for d in data.values())


def test_the_lease_times_decal_4x_first_and_fits_one_device_command():
  """--lease (the workplace's device machine: one command of at most 10 minutes): the GPU
  shapes, DeCAL-4x first (the MFU goal's), a probe of a cuDNN and a non-cuDNN set that fits
  its limit, and the train parts within the 9-minute budget with time left for the rest."""
  args = gpu_suite.parse_args(["--lease", "--parts", "train_probe,train,nuggets"])
  assert args.minutes == gpu_suite.LEASE_MINUTES <= 10 - 1
  lease, full = gpu_suite.lease_scale(None), gpu_suite.gpu_scale(None)
  assert (lease.model, lease.batch, lease.lengths, lease.steps) == (
      full.model, full.batch, full.lengths, full.steps)
  assert lease.ratios[0] == gpu_suite.PROFILED_RATIO and sorted(lease.ratios) == sorted(
      full.ratios)
  assert set(lease.option_sets) <= set(gpu_suite.OPTION_SETS)
  assert any(gpu_suite.CUDNN in gpu_suite.OPTION_SETS[n] for n in lease.option_sets)
  assert any(gpu_suite.CUDNN not in gpu_suite.OPTION_SETS[n] for n in lease.option_sets)
  assert len(lease.option_sets) * lease.probe_minutes <= lease.minutes["train_probe"]
  assert lease.minutes["train_probe"] + lease.minutes["train"] < gpu_suite.LEASE_MINUTES
  assert lease.xla_flags == gpu_suite.LEASE_XLA_FLAGS and not full.xla_flags
  order = ["xla_flags", "train", "retrieval_scale", "squid"]
  assert [p.name for p in gpu_suite.parse_args(["--lease", "--parts", ",".join(order)]).parts
          ] == order  # run in the order named: the lease's priorities first
  with pytest.raises(SystemExit):
    gpu_suite.parse_args(["--lease", "--dry_run"])


def test_the_documented_lease_recipe_names_only_parts_the_device_image_runs():
  """The lease command in docs/performance.md (its recipe in docs/results/performance_log.md)
  and in the tool's usage runs on an image
  without TensorFlow / seqio: every part it names is marked device_image (which the dry run
  above proves with those imports refused)."""
  import re
  texts = [(paths.REPO / "docs" / "performance.md").read_text()
           + (paths.REPO / "docs" / "results" / "performance_log.md").read_text(),
           gpu_suite.__doc__]
  recipes = [m for text in texts for m in re.findall(r"gpu_suite --lease\s*\\?\s*--parts (\S+)", text)]
  assert len(recipes) == 2, recipes
  device_image = {p.name for p in gpu_suite.PARTS if p.device_image}
  for parts in recipes:
    assert set(parts.split(",")) <= device_image, parts



def test_the_parts_get_the_xla_flags_and_one_compilation_cache(tmp_path, monkeypatch):
  """A part's subprocess sees the scale's XLA_FLAGS after the caller's own (here: two CPU
  devices where jax would show one) and writes its compiled programs into WORK/jax_cache,
  or into the caller's cache where the caller names one."""
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  scale = dataclasses.replace(gpu_suite.dry_run_scale(tmp_path),
                              xla_flags="--xla_force_host_platform_device_count=2")
  suite = gpu_suite.Suite(tmp_path, tmp_path, tmp_path / "work", scale, True, 1e12,
                          part="flags", part_deadline=time.time() + 120)
  code = ("import os, jax, jax.numpy as jnp; print('XLA_FLAGS', os.environ['XLA_FLAGS']); "
          "print('devices', jax.device_count()); print(float(jax.jit(jnp.sum)(jnp.ones(3))))")
  assert suite.call(["-c", code]) == (0, False)
  log = (tmp_path / "flags.log").read_text()
  assert ("XLA_FLAGS --xla_cpu_enable_fast_math=false "
          "--xla_force_host_platform_device_count=2") in log
  assert "devices 2" in log and "3.0" in log
  assert any((tmp_path / "work" / "jax_cache").iterdir())
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "callers_cache"))
  assert suite.call(["-c", code.replace("ones(3)", "ones(4)")]) == (0, False)
  assert any((tmp_path / "callers_cache").iterdir())
  summary = {"command": "c", "date": "d", "device": "cpu", "machine": "m", "wall_s": 60,
             "minutes": 9, "xla_flags": scale.xla_flags, "parts": {}}
  assert f"- XLA_FLAGS: `{scale.xla_flags}`" in gpu_suite.render(summary)


def test_the_parts_read_the_t5_vocabulary_from_the_data_folder(tmp_path, monkeypatch):
  """Offline (a lent GPU), a part's T5-vocabulary model reads $DECAL_DATA_DIR/vocab's copy
  (the caller's own DECAL_T5_VOCAB wins; without a copy nothing is set)."""
  (tmp_path / "data" / "vocab").mkdir(parents=True)
  (tmp_path / "data" / "vocab" / "t5_spiece.model").write_bytes(b"x")
  monkeypatch.delenv("DECAL_T5_VOCAB", raising=False)
  suite = gpu_suite.Suite(tmp_path, tmp_path, tmp_path / "work", gpu_suite.dry_run_scale(
      tmp_path), True, 1e12, part="vocab", part_deadline=time.time() + 60)
  code = "import os; print('T5', os.environ.get('DECAL_T5_VOCAB'))"
  for data, mine, expected in [(tmp_path / "data", None, tmp_path / "data/vocab/t5_spiece.model"),
                               (tmp_path / "data", "/mine", "/mine"),
                               (tmp_path / "none", None, None)]:
    monkeypatch.setenv("DECAL_DATA_DIR", str(data))
    monkeypatch.setenv("DECAL_T5_VOCAB", mine) if mine else monkeypatch.delenv(
        "DECAL_T5_VOCAB", raising=False)
    assert suite.call(["-c", code]) == (0, False)
    assert (tmp_path / "vocab.log").read_text().splitlines()[-1] == f"T5 {expected}"
