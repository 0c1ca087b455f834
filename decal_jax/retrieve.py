# python -m decal_jax.retrieve --gin_file=runs/retrieve_builtin.gin --gin.MODEL_DIR="'runs/decal_tiny_retrieval'"
"""Entry point: index a BEIR corpus with a trained dual encoder, search, and score
(`retrieval.pipeline.evaluate_retrieval` configured by gin; see decal_jax/gin_utils.py)."""
from decal_jax import console

console.setup()  # TF (only the input pipeline) imported quietly, off the accelerators

from decal_jax import gin_utils  # noqa: E402
from decal_jax.retrieval import pipeline  # noqa: E402


def main(argv=None):
  gin_utils.run(pipeline.evaluate_retrieval, argv)


if __name__ == "__main__":
  main()
