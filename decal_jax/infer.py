# python -m decal_jax.infer --gin_file=runs/infer_builtin.gin --gin.MODEL_DIR="'runs/decal_tiny'"
"""Entry point: `evaluation.infer` configured by gin (see decal_jax/gin_utils.py for flags)."""
from decal_jax import console

console.setup()  # TF (only the input pipeline) imported quietly, off the accelerators

from decal_jax import evaluation, gin_utils  # noqa: E402


def main(argv=None):
  gin_utils.run(evaluation.infer, argv, pass_config=False)


if __name__ == "__main__":
  main()
