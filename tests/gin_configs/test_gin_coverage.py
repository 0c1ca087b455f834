"""No gin file in gin/ is left out of the tests."""
from gin_config_helpers import GIN_DIR, MODEL_FILES, T5X_COVERED


def test_all_gin_files_are_covered_here():
  covered = (set(MODEL_FILES) | {"models/t5_1_1.gin", "models/decal.gin"} | T5X_COVERED |
             {"runs/pretrain_builtin.gin", "runs/eval_builtin.gin", "runs/infer_builtin.gin",
              "runs/pretrain.gin", "runs/eval.gin", "runs/infer.gin",
              "runs/finetune.gin", "runs/finetune_builtin.gin"} |
             {"runs/dodo_autoencode_builtin.gin", "runs/dodo_autoencode.gin",
              "models/dodo_tiny.gin"} |  # test_decoder_gin_files.py
             {"models/dodo_llama2_7b.gin", "models/dodo.gin"} |
             {"models/squid.gin", "models/squid_tiny.gin", "models/squid_qwen2.gin"} |
             {"runs/squid.gin", "runs/squid_restore.gin", "runs/squid_continue.gin",
              "runs/squid_instruct.gin"} |  # test_squid_gin_files.py
             {"runs/squid_restore_builtin.gin", "runs/squid_continue_builtin.gin",
              "runs/squid_instruct_builtin.gin"} |  # run in order by tests/test_squid_train.py
             {"models/gpthf.gin", "models/gpthf_tiny.gin", "runs/gpthf_lm_builtin.gin",
              "runs/gpthf_lm_real.gin",
              "models/gpthf_16_8.gin", "models/gpthf_8_4.gin", "models/gpt_baseline_24.gin",
              "models/gpt_baseline_12.gin"} |  # test_gpthf_gin_files.py
             {"models/dual_encoder.gin", "runs/retrieval_finetune.gin", "runs/retrieve.gin",
              "runs/retrieval_builtin.gin", "runs/retrieve_builtin.gin"} |  # retrieval file
             {"models/decoder.gin", "models/decoder_tiny.gin", "models/dodo_lm.gin",
              "runs/lm_builtin.gin", "models/smollm2_135m.gin"} |  # test_decoder_gin_files.py
             {"experiments/retention/run.gin", "experiments/retention/t5.gin",
              "experiments/retention/dodo.gin"} |
             {"experiments/known/run.gin", "experiments/known/t5.gin",
              "experiments/known/dodo.gin"} |  # tests/tools/test_retention_table.py
             # tests/test_ablation.py loads every budget and variant and trains with mini.gin
             {f"experiments/{kind}/{p.name}" for kind in ("budgets", "variants", "models")
              for p in (GIN_DIR / "experiments" / kind).glob("*.gin")})
  every = {str(p.relative_to(GIN_DIR)) for p in GIN_DIR.rglob("*.gin")}
  missing = every - covered
  assert not missing, f"gin files no test builds: {sorted(missing)}"
