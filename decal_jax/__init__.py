"""decal_jax: learned context compression for JAX / Flax in the T5X world."""

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)
