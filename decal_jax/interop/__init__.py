"""Other formats in and out: Hugging Face checkpoints (LLaMA / Qwen2 / Mistral families and
their tokenizers) into our parameter trees, T5X checkpoints in and out, and T5X's
MultiOptimizer for running our networks inside `t5x.train`."""
