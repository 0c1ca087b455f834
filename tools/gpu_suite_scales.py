"""The GPU suite's shapes and limits (`tools/gpu_suite.py`): the option sets its
probe times, and the arguments each part gives its tool at the GPU's size (`gpu_scale`), in
a short lease of this workplace's device machine (`lease_scale`: the same shapes, less to
probe, limits that fit one command) and at --dry_run's tiny CPU size (`dry_run_scale`)."""
import dataclasses
import os
import pathlib
from typing import Dict, List, Optional, Tuple

from decal_jax import fileio, settings

# What a GPU image may lack that the library's data path needs (the workplace's own image has
# jax, flax, optax and orbax but none of these, and TensorFlow is too large to carry there).
# gin-config is missing there too, but its 61 kB wheel travels with the recipe
# (docs/performance.md), so the parts may use it.
DEVICE_IMAGE_LACKS = ("tensorflow", "tensorflow_text", "seqio", "clu", "t5")
REFUSE_IMPORTS = """# written by gpu_suite --dry_run: refuses the imports a GPU image may lack
import importlib.abc, sys
class _Refuse(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in {lacks!r}:
      raise ImportError(f"{{name}} is not on the GPU image (gpu_suite.DEVICE_IMAGE_LACKS)")
sys.meta_path.insert(0, _Refuse())
"""

GOAL_MFU = 0.40  # T5.1.1-small DeCAL-4x on one H100
# Dodo autoencoding on SmolLM2-135M at the GPU's size (issue 43, step 2): 256-token segments
# (the paper's Fig. 4 spans about 100-500), the paper's ratios and both controls, 3 seeds,
# 2,000 steps of 16 segments, scored on 48 of the 55 held-out 256-token segments the shared
# data holds; the CPU run (docs/results/smollm2_autoencode_cpu.md) is 200 steps of 4 x 64 tokens
# The training setting (segment length, batch, schedule, held-out sizes): the suite's part and
# tools/lease_smollm2_autoencode.sh (one r, its own step count) both read it.
SMOLLM2_AUTOENCODE_SETTING = ["--length", "256", "--batch", "16", "--warmup", "100", "--lr",
                              "1e-3", "--eval-segments", "48", "--bleu-segments", "48",
                              "--eval-batch", "48"]
SMOLLM2_AUTOENCODE = ["--ratios", "2", "5", "10", "20", "--selections", "nuggets", "random",
                      "compressive", "--seeds", "0", "1", "2", "--steps", "2000",
                      "--eval-every", "200"] + SMOLLM2_AUTOENCODE_SETTING
# Dodo as a language model on SmolLM2-135M at the GPU's size (issue 43, step 3): the paper's
# ratios at τ = 32 (737-token sequences: the shared data holds 11 held-out ones), both
# controls at equal cache and the full-context ceiling, 3 seeds, 1,000 steps of 8 sequences;
# then the nuggets rows again with the scorer from the smollm2_autoencode part's compressors
# (the paper's order); the CPU run (docs/results/smollm2_lm_trained_cpu.md) is r = 10, 120
# steps of 1 x 417 tokens
SMOLLM2_LM_TRAIN = ["--settings", "full", "window-64", "nuggets-5", "nuggets-10", "nuggets-20",
                    "random-10", "compressive-5", "compressive-10", "compressive-20", "--seeds",
                    "0", "1", "2", "--window", "32", "--batch", "8", "--steps", "1000",
                    "--warmup", "50", "--lr", "1e-3", "--eval-every", "100",
                    "--eval-documents", "11", "--eval-batch", "11"]
# Squid on SmolLM2-135M at the GPU's size (issue 43, step 4): 256-token contexts (the paper's
# test contexts are under 512 words), ρ = 4 / 8 / 16 against segment means, the full-context
# ceiling and the prior, the three stages with the large decoder trained in stages 2-3 (the
# library's recipe), 3 seeds, batches of 16, scored on 30 held-out examples per stage (the
# shared data holds 31 of 384 tokens for continuation), latency at 512 tokens; the CPU run
# (docs/results/smollm2_squid_cpu.md) is ρ = 4, 80 + 40 steps of 4 x 64 tokens, no QA
SMOLLM2_SQUID = ["--ratios", "4", "8", "16", "--seeds", "0", "1", "2", "--length", "256",
                 "--continue-length", "128", "--steps", "800", "--continue-steps", "400",
                 "--qa-steps", "1000", "--large", "trains", "--batch", "16", "--warmup", "100",
                 "--lr", "1e-3", "--eval-every", "100", "--eval-segments", "30",
                 "--bleu-segments", "30", "--eval-batch", "30", "--latency-length", "512"]
RETENTION_STEPS = 1200  # per run; docs/results/retention_cpu.md: what separates the ratios
RATIOS = (1, 2, 4, 8)
PROFILED_RATIO = 4
CUDNN = "ATTENTION_KERNEL='cudnn'"
# name -> gin bindings added to the bf16 DeCAL step; the probe times each, the fastest wins.
OPTION_SETS: Dict[str, List[str]] = {
    "einsum": [],
    "cudnn": [CUDNN],
    "cudnn+fused": [CUDNN, "FUSED_QKV=True"],
    "cudnn+fused+scan": [CUDNN, "FUSED_QKV=True", "SCAN_LAYERS=True"],
    "cudnn+fused+remat": [CUDNN, "FUSED_QKV=True",
                          "REMAT_POLICY='dots_with_no_batch_dims_saveable'"],
    "xla+fused": ["ATTENTION_KERNEL='xla'", "FUSED_QKV=True"],
}
# The lease's probe: one set per attention path (XLA's einsum, cuDNN, jax.nn's XLA kernel),
# QKV fused where the kernel takes it. Scan and remat save memory or compile time, not step
# time, at T5.1.1-small's batch 128 (a guess, not a measurement: the full run probes them).
LEASE_OPTION_SETS = ("einsum", "cudnn+fused", "xla+fused")
# Smaller grids where the full run's would not fit a lease part (on 2026-11-26 the H200
# compiled each bench_gpthf row's four programs in 22 s, each bench_squid context in ~40 s):
# the longest contexts, and the 1M-passage run after the real corpora at C = 1 and 4 only.
LEASE_TOOLS: Dict[str, List[str]] = {  # retrieval_scale: + the BEIR folder (lease_scale)
    "inference": ["--gpu", "--decal_ratios", "1,4", "--repeats", "2"],  # the goal's pair
    "squid": ["--preset", "qwen2", "--contexts", "2048,8192", "--ratios", "4,16"],
    "gpthf": ["--preset", "paper", "--prompts", "250,1000", "--new_tokens", "100",
              "--batches", "32"],
    "retrieval_scale": ["--passage_length", "128", "--max_queries", "300", "--ratios", "1",
                        "4", "--bits", "2", "none", "--num_centroids", "0.25",
                        "--synthetic_passages", "0"],
}
# The retrieval part tokenizes with SentencePiece alone (the image has no seqio): the same ids.
PLAIN_VOCABULARY = "VOCABULARY = @vocabularies.%s_plain_vocabulary()"
LEASE_MINUTES = 9.0  # one device command (at most 10 minutes) with a minute to spare
# XLA_FLAGS candidates that the `xla_flags` part times on a T5.1.1-small-shaped block
# (bench_xla_flags.py), cheapest to compile first; the parts after it use the chosen set.
# Seen on an H200 (jax 0.11.2), 2026-11-26: at XLA's defaults the DeCAL-4x step had not
# compiled after 230 s (the GEMM autotuner compiles and times Triton tilings per matmul);
# with no autotuning at all ('cublas-untuned') it compiled in 16 s but stepped at 0.1 % MFU.
# The third lease timed these sets on one encoder layer (145-155 TFLOP/s except
# 'triton-untuned', 17): the matmuls were fine; the step's time went to the relative
# position bias's gradient, a contended bf16 scatter-add (layers.attention.bucket_bias).
XLA_FLAG_SETS: Dict[str, str] = {
    "cublas-untuned": "--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false",
    "cublas": "--xla_gpu_enable_triton_gemm=false",  # cuBLAS, its algorithms timed
    "triton-untuned": "--xla_gpu_autotune_level=0",  # Triton GEMMs at their default tiling
    "default": "",
}
# The lease's XLA_FLAGS until its `xla_flags` part has chosen (or when it is left out):
# matmuls on cuBLAS with its algorithms autotuned, no Triton GEMM kernels to generate.
LEASE_XLA_FLAGS = XLA_FLAG_SETS["cublas"]
# Added for the profiled `train` run (PROFILED_RATIO): no CUDA graphs ("command buffers").
# With them the trace shows the whole step as one `command_buffer` event (third lease); without,
# one event per kernel. That run's step time then includes each kernel's launch.
PROFILE_XLA_FLAGS = "--xla_gpu_enable_command_buffer="


def choose_xla_flags(rows: Dict[str, Optional[dict]]) -> Optional[str]:
  """The flag set to run with, from bench_xla_flags rows by set name (None: did not run):
  the fastest (TFLOP/s) of those whose block compiled within twice the quickest compile (or
  5 s more), since the train step compiles ~15 times the block's matmuls."""
  ran = {name: row for name, row in rows.items() if row}
  if not ran:
    return None
  quickest = min(row["compile_s"] for row in ran.values())
  allowed = {name: row for name, row in ran.items()
             if row["compile_s"] <= max(2 * quickest, quickest + 5)}
  return max(allowed, key=lambda name: allowed[name]["tflops"])


DRY_RUN_BUDGET = """# the suite's --dry_run ablation budget: one variant, a few steps
Budget.variants = ['decal_2x']
Budget.model_gin = 'experiments/models/mini.gin'
Budget.pretrain_steps = 2
Budget.finetune_steps = 2
Budget.batch_size = 2
Budget.pretrain_lengths = {'inputs': 32, 'targets': 8}
Budget.autoencode_lengths = {'inputs': 32, 'targets': 32}
Budget.finetune_lengths = {'inputs': 64, 'targets': 8}
Budget.warmup_steps = 1
Budget.eval_batches = 1
Budget.max_predict_examples = 2
"""


@dataclasses.dataclass(frozen=True)
class Scale:
  """The shapes and limits of a run: the GPU's, or tiny ones for --dry_run."""
  model: Tuple[str, ...]  # bench_train's gin files and bindings
  ratios: Tuple[int, ...]
  batch: int
  lengths: Tuple[int, int]  # inputs, targets
  steps: int
  probe_steps: int
  warmup: int
  profile_steps: int
  option_sets: Tuple[str, ...]
  minutes: Dict[str, float]  # each part's time limit
  probe_minutes: float  # one option set's limit
  grace_s: float  # SIGTERM -> SIGKILL
  tools: Dict[str, List[str]]  # the other benchmarks' arguments
  xla_flags: str = ""  # added to XLA_FLAGS for every part's subprocesses

  def all_xla_flags(self) -> str:
    """The parts' XLA_FLAGS: the caller's own, then the scale's."""
    return " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), self.xla_flags]))


def gpu_scale(beir_folder: Optional[str]) -> Scale:
  return Scale(
      model=("--gin_file=models/t5_1_1_small.gin", "--gin_file=models/decal.gin"),
      ratios=RATIOS, batch=128, lengths=(512, 128), steps=20, probe_steps=5, warmup=3,
      profile_steps=3, option_sets=tuple(OPTION_SETS), probe_minutes=2.5, grace_s=90,
      minutes=dict(xla_flags=3, train_probe=8, train=8, inference=6, nuggets=4, squid=5,
                   gpthf=5, retrieval=4, retrieval_scale=3, retrieval_1m=6, retention=12,
                   smollm2_autoencode=60, smollm2_lm_train=60, smollm2_squid=120, ablation=40),
      tools=dict(
          xla_flags=["--batch", "32", "--length", "640", "--steps", "10"],
          inference=["--gpu"],
          nuggets=["--contexts", "16384,65536", "--dtype", "bfloat16"],
          squid=["--preset", "qwen2"],
          gpthf=["--preset", "paper"],
          retrieval=["--size", "small", "--ratios", *map(str, RATIOS), "--encode_repeats", "3",
                     "--repeats", "5", "--gin_bindings", PLAIN_VOCABULARY % "t5"]
          + (["--beir_folder", beir_folder] if beir_folder else []),
          retrieval_scale=["--passage_length", "128", "--max_queries", "300", "--ratios", "1",
                           "2", "4", "8", "--bits", "1", "2", "4", "none", "--num_centroids",
                           "0.25", "--synthetic_passages", "0"]
          + (["--beir_folder", beir_folder] if beir_folder else []),
          # ColBERTv2's full centroid count (32,768 at 1M passages, C = 4), which CPU cores
          # cannot assign within the budget but the GPU's centroid search can (codec.py)
          retrieval_scale_synthetic=["--beir_folder", "", "--msmarco_folder", "",
                                     "--synthetic_passages", "1000000", "--ratios", "4", "--bits",
                                     "2", "none", "--num_centroids", "1.0",
                                     "--sample_vectors", "1048576"],
          retention=["--content", "real", "--steps", str(RETENTION_STEPS)],
          smollm2_autoencode=SMOLLM2_AUTOENCODE,
          smollm2_lm_train=SMOLLM2_LM_TRAIN,
          smollm2_squid=SMOLLM2_SQUID,
          ablation=["--budget", "gpu"]))


def data_dir() -> pathlib.Path:
  """$DECAL_DATA_DIR (from the repository, where the parts run), default ../shared/data."""
  repo = pathlib.Path(__file__).resolve().parents[1]
  return repo / settings.get("DECAL_DATA_DIR")


def lease_scale(beir_folder: Optional[str]) -> Scale:
  """gpu_scale's shapes in LEASE_MINUTES: `xla_flags` chooses the XLA_FLAGS in 1.5 minutes
  (LEASE_XLA_FLAGS until it has), DeCAL-4x (the MFU goal's) is timed first, `train` is given
  5 of the minutes (4 C's, then DeCAL-4x's profile) and the next parts what is left; the
  probe times 3 option sets (1.25 minutes each at most: start, compile, 8 steps);
  `retrieval_1m` (the 1M-passage run) is a lease of its own."""
  full = gpu_scale(beir_folder)
  return dataclasses.replace(
      full, ratios=(PROFILED_RATIO,) + tuple(r for r in RATIOS if r != PROFILED_RATIO),
      option_sets=LEASE_OPTION_SETS, probe_minutes=1.25, grace_s=20, xla_flags=LEASE_XLA_FLAGS,
      minutes=dict(full.minutes, xla_flags=1.5, train_probe=3.75, train=5.0, inference=4.0,
                   nuggets=1.5,
                   squid=1.5, gpthf=3.0, retrieval=1.5, retrieval_scale=2.5,
                   retrieval_1m=8.5),
      tools={**full.tools, **LEASE_TOOLS, "retrieval_scale": LEASE_TOOLS["retrieval_scale"] + (
          ["--beir_folder", beir_folder] if beir_folder else [])})


def dry_run_scale(out: pathlib.Path) -> Scale:
  budget = out / "gpu_dry_run_budget.gin"
  fileio.write_text_atomic(budget, DRY_RUN_BUDGET)
  return Scale(
      model=("--gin_file=models/t5_1_1_tiny.gin", "--gin_file=models/decal.gin",
             "--gin.t5.T5Config.num_encoder_layers=1", "--gin.t5.T5Config.num_decoder_layers=1"),
      ratios=(1, PROFILED_RATIO), batch=2, lengths=(64, 16), steps=2, probe_steps=1, warmup=1,
      profile_steps=1, probe_minutes=3, grace_s=20,
      option_sets=tuple(k for k, v in OPTION_SETS.items() if CUDNN not in v)[:2],
      minutes=dict(xla_flags=2, train_probe=4, train=6, inference=3, nuggets=3, squid=3,
                   gpthf=3, retrieval=3, retrieval_scale=3, retrieval_1m=2, retention=4,
                   smollm2_autoencode=4, smollm2_lm_train=4, smollm2_squid=5, ablation=5),
      tools=dict(
          xla_flags=["--batch", "2", "--length", "64", "--steps", "2"],
          inference=["--preset", "tiny", "--methods", "decal", "--decal_ratios", "1,4",
                     "--lengths", "16", "--breakeven_lengths", "", "--beams", "0",
                     "--new_tokens", "3", "--batch", "auto", "--fit_batches", "6,8",
                     "--max_batch", "16", "--memory_budget_gib", "0.0002", "--repeats", "1",
                     "--warmup", "0"],
          nuggets=["--contexts", "32,64", "--dtype", "bfloat16", "--emb_dim", "32", "--layers",
                   "1", "--heads", "2", "--kv_heads", "1", "--head_dim", "16", "--mlp_dim", "64",
                   "--vocab", "64", "--new_tokens", "3", "--warmup", "1"],
          squid=["--preset", "tiny", "--contexts", "24", "--ratios", "4,8", "--query_length",
                 "3", "--answer_length", "3", "--repeats", "1", "--warmup", "0"],
          gpthf=["--preset", "tiny", "--prompts", "10", "--new_tokens", "3", "--batches", "1",
                 "--repeats", "1", "--warmup", "0"],
          retrieval=["--size", "tiny", "--gin_bindings", "t5.T5Config.num_encoder_layers = 1",
                     "--gin_bindings", PLAIN_VOCABULARY % "builtin",
                     "--projection_dim", "16", "--passage_length", "32", "--query_length", "8",
                     "--ratios", "1", "2", "--max_docs", "40", "--batch_size", "16",
                     "--repeats", "1"],
          retrieval_scale=["--passage_length", "32", "--max_docs", "200", "--max_queries", "10",
                           "--msmarco_folder", "", "--synthetic_passages", "0", "--dim", "16",
                           "--ratios", "1", "4", "--bits", "2", "none"],
          retrieval_scale_synthetic=["--beir_folder", "", "--msmarco_folder", "",
                                     "--synthetic_passages", "300", "--synthetic_length", "8",
                                     "--synthetic_topics", "20", "--synthetic_queries", "10",
                                     "--dim", "16", "--ratios", "4", "--bits", "2", "none"],
          retention=["--content", "real", "--methods", "decal", "--ratios", "4", "--seeds", "0",
                     "--dry_run"],
          smollm2_autoencode=["--layers", "3", "--ratios", "3", "--selections", "nuggets",
                              "--seeds", "0", "--steps", "2", "--batch", "2", "--length", "16",
                              "--eval-every", "1", "--eval-segments", "4", "--bleu-segments",
                              "2", "--eval-batch", "2"],
          smollm2_lm_train=["--layers", "3", "--settings", "window-8", "nuggets-3", "--window",
                            "4", "--continuation", "8", "--seeds", "0", "--steps", "2",
                            "--eval-every", "1", "--eval-documents", "3", "--eval-batch", "3"],
          smollm2_squid=["--layers", "2", "--ratios", "4", "--memories", "tokens",
                         "--seeds", "0", "--steps", "2", "--continue-steps", "1", "--qa-steps",
                         "1", "--large", "trains", "--batch", "2", "--length", "16",
                         "--continue-length", "8", "--qa-length", "160", "--qa-query-length",
                         "40", "--qa-answer-length", "8", "--eval-every", "1",
                         "--eval-segments", "4", "--bleu-segments", "2", "--eval-batch", "2",
                         "--latency-length", "16", "--latency-query", "4",
                         "--latency-answer", "3"],
          ablation=["--budget", str(budget)]))
