"""tests/bad_inputs/ is the catalogue of bad inputs (docs/reliability.md): each test feeds
one mistake a user can make and checks that the message names the culprit and the fix, and
that nothing on disk was changed or lost; one file per kind of mistake.

Its fixtures: a local data folder for the tasks, and a tiny run with two checkpoints that
each test copies before damaging it."""
import pytest

import decal_jax.tasks  # noqa: F401  (registers the tasks)

from bad_input_helpers import _train_tiny


@pytest.fixture
def local_data(tmp_path, monkeypatch, builtin_vocabulary):
  """The tasks read <tmp_path>/<name>/<split> files with the built-in vocabulary."""
  del builtin_vocabulary  # bound in gin by the fixture (tests/conftest.py)
  monkeypatch.setenv("DECAL_LOCAL_DATA_DIR", str(tmp_path))
  return tmp_path


@pytest.fixture(scope="session")
def two_checkpoints(tmp_path_factory):
  """MODEL_DIR with checkpoint_1 and checkpoint_2 of a 2-step run (each test copies it)."""
  model_dir = tmp_path_factory.mktemp("two_checkpoints")
  _train_tiny(model_dir, 2)
  return model_dir
