# python -m decal_jax.infer --gin_file=runs/infer_builtin.gin --gin.MODEL_DIR="'runs/decal_tiny'"
"""Decodes the gin-configured inputs with MODEL_DIR's checkpoint (`evaluation.infer`); T5X's
flags (decal_jax/runtime/cli.py). JAX and TensorFlow load only after the command line and the gin
files have been checked."""
from decal_jax.runtime import cli  # cli.main quiets TensorFlow once the checks pass


def main(argv=None):
  cli.main("decal_jax.runtime.evaluation:infer", argv, prog="decal_jax.infer", about=__doc__)


if __name__ == "__main__":
  main()
