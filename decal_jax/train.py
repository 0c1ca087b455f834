# python -m decal_jax.train --gin_file=runs/pretrain_builtin.gin --gin.MODEL_DIR="'runs/decal_tiny'"
"""Trains the gin-configured model (`trainer.train`) in MODEL_DIR, continuing from its latest
checkpoint; T5X's flags (decal_jax/cli.py). JAX and TensorFlow load only after the command
line and the gin files have been checked."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF is only our input pipeline: quiet it

from decal_jax import cli  # noqa: E402


def main(argv=None):
  cli.main("decal_jax.trainer:train", argv, prog="decal_jax.train", about=__doc__,
           pass_config=True)


if __name__ == "__main__":
  main()
