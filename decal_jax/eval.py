# python -m decal_jax.eval --gin_file=runs/eval_builtin.gin --gin.MODEL_DIR="'runs/decal_tiny'"
"""Evaluates MODEL_DIR's checkpoint on the gin-configured task (`evaluation.evaluate`); T5X's
flags (decal_jax/cli.py). JAX and TensorFlow load only after the command line and the gin
files have been checked."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF is only our input pipeline: quiet it

from decal_jax import cli  # noqa: E402


def main(argv=None):
  cli.main("decal_jax.evaluation:evaluate", argv, prog="decal_jax.eval", about=__doc__)


if __name__ == "__main__":
  main()
