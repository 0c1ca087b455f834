"""Where a test finds the repository, wherever in tests/ its file sits."""
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]  # the checkout: decal_jax/, gin/, docs/
