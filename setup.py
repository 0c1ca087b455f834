"""decal_jax: learned context compression for JAX / Flax in the T5X world."""
import setuptools

setuptools.setup(
    name="decal_jax",
    version="0.1.0",
    description="Learned context compression (DeCAL, Dodo, GPTHF, Squid) in JAX/Flax, T5X-compatible.",
    license="Apache-2.0",
    python_requires=">=3.10",
    # `tasks/` (seqio registrations) lives at the repo root and installs as decal_jax.tasks.
    packages=setuptools.find_packages(include=["decal_jax", "decal_jax.*"]) + ["decal_jax.tasks"],
    package_dir={"decal_jax.tasks": "tasks"},
    install_requires=[
        "jax>=0.6,<0.11",
        "flax>=0.10.6,<0.13",
        "optax>=0.2.4,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "seqio>=0.0.19,<0.1",
        "gin-config>=0.5,<0.6",
        "tensorflow>=2.16,<2.22",  # tensorflow-text (a seqio dependency) requires this name
        "tensorflow-text>=2.16,<2.22",
        "tensorflow-datasets>=4.9.4,<4.10",
        "sentencepiece>=0.2,<0.3",
        "numpy>=1.26,<3",
        "tqdm>=4.66,<5",
        "tensorboard>=2.16,<2.22",
        "rouge-score>=0.1.2,<0.2",  # ROUGE of the summarization tasks
        "sacrebleu>=2.4,<3",        # BLEU of Dodo's autoencoding
        "safetensors>=0.4,<1",      # Hugging Face checkpoints (decal_jax.hf_import)
        "tokenizers>=0.19,<1",      # Hugging Face tokenizer.json vocabularies (data.hf_vocabularies)
    ],
    extras_require={
        # tests draw the ablation plot and compare the LLaMA import with transformers (PyTorch);
        # pytest-xdist runs test files on both cores (-n 2 --dist loadfile)
        "test": ["pytest>=8,<10", "pytest-xdist>=3.5,<4", "matplotlib>=3.8,<4",
                 "torch>=2.4,<3", "transformers>=4.45,<6",
                 "pytrec-eval-terrier>=0.5.6,<0.6"],  # NDCG / recall reference
        "hf": ["torch>=2.4,<3", "transformers>=4.45,<6"],
        "plot": ["matplotlib>=3.8,<4"],
        # T5X is not on the package index and its pins clash with ours: docs/t5x.md installs it.
    },
)
