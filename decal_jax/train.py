# python -m decal_jax.train --gin_file=runs/pretrain_builtin.gin --gin.MODEL_DIR="'runs/decal_tiny'"
"""Trains the gin-configured model (`trainer.train`) in MODEL_DIR, continuing from its latest
checkpoint; T5X's flags (decal_jax/runtime/cli.py). JAX and TensorFlow load only after the command
line and the gin files have been checked."""
from decal_jax.runtime import cli  # cli.main quiets TensorFlow once the checks pass


def main(argv=None):
  cli.main("decal_jax.runtime.trainer:train", argv, prog="decal_jax.train", about=__doc__,
           pass_config=True)


if __name__ == "__main__":
  main()
