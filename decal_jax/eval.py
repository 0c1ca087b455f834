# python -m decal_jax.eval --gin_file=runs/eval_builtin.gin --gin.MODEL_DIR="'runs/decal_tiny'"
"""Evaluates MODEL_DIR's checkpoint on the gin-configured task (`evaluation.evaluate`); T5X's
flags (decal_jax/runtime/cli.py). JAX and TensorFlow load only after the command line and the gin
files have been checked."""
from decal_jax.runtime import cli  # cli.main quiets TensorFlow once the checks pass


def main(argv=None):
  cli.main("decal_jax.runtime.evaluation:evaluate", argv, prog="decal_jax.eval", about=__doc__)


if __name__ == "__main__":
  main()
