# python -m decal_jax.train --gin_file=runs/pretrain_builtin.gin --gin.MODEL_DIR="'runs/decal_tiny'"
"""Entry point: `trainer.train` configured by gin (see decal_jax/gin_utils.py for flags)."""
from decal_jax import console

console.setup()  # TF (only the input pipeline) imported quietly, off the accelerators

from decal_jax import gin_utils, trainer  # noqa: E402


def main(argv=None):
  gin_utils.run(trainer.train, argv, pass_config=True)


if __name__ == "__main__":
  main()
