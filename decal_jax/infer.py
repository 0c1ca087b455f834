# python -m decal_jax.infer --gin_file=runs/infer_builtin.gin --gin.MODEL_DIR="'runs/decal_tiny'"
"""Entry point: `trainer.infer` configured by gin (see decal_jax/gin_utils.py for flags)."""
from decal_jax import gin_utils, trainer


def main(argv=None):
  gin_utils.run(trainer.infer, argv, pass_config=False)


if __name__ == "__main__":
  main()
