"""Other formats in and out: Hugging Face checkpoints (LLaMA / Qwen2 / Mistral families and
their tokenizers) into our parameter trees, and T5X checkpoints in and out. (T5X's
MultiOptimizer for `t5x.train`, which builds on our optimizers, is runtime/t5x_optimizers.py.)"""
