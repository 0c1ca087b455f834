# python -m decal_jax.retrieve --gin_file=runs/retrieve_builtin.gin --gin.MODEL_DIR="'runs/decal_tiny_retrieval'"
"""Indexes a BEIR corpus with MODEL_DIR's trained dual encoder, searches and scores
(`retrieval_eval.evaluate_retrieval` configured by gin); T5X's flags (decal_jax/runtime/cli.py).
JAX and TensorFlow load only after the command line and the gin files have been checked."""
from decal_jax.runtime import cli  # cli.main quiets TensorFlow once the checks pass


def main(argv=None):
  cli.main("decal_jax.runtime.retrieval_eval:evaluate_retrieval", argv, prog="decal_jax.retrieve",
           about=__doc__)


if __name__ == "__main__":
  main()
