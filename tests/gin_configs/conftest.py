"""tests/gin_configs/: every gin file in gin/ parses and builds what it names, one file per
family (T5.1.1 and DeCAL, the T5X drop-in files, the run files, Dodo and the decoders,
Squid, GPTHF, retrieval), and a test that no gin file is left out.

Model sizes are checked against the published parameter counts; shapes come from
`jax.eval_shape`, so no full-size model is ever materialised."""
import sys

import gin
import pytest

from gin_config_helpers import T5X_MODULES


@pytest.fixture
def t5x_modules(monkeypatch):
  for name, module in T5X_MODULES.items():
    monkeypatch.setitem(sys.modules, name, module)
  yield
  gin.clear_config()
