# python -m decal_jax.infer --gin_file=runs/infer_builtin.gin --gin.MODEL_DIR="'runs/decal_tiny'"
"""Entry point: `evaluation.infer` configured by gin (see decal_jax/gin_utils.py for flags)."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF is only our input pipeline: quiet it

from decal_jax import evaluation, gin_utils  # noqa: E402


def main(argv=None):
  gin_utils.run(evaluation.infer, argv, pass_config=False)


if __name__ == "__main__":
  main()
