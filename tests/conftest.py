"""Test-session setup shared by every test module."""
import os
import sys

import pytest

# TensorFlow (which seqio imports) and Triton's compiler library crash the process when
# Triton is loaded second; transformers' PyTorch models import it through torch._dynamo.
# The tests run PyTorch on CPU only, which needs no Triton: hide it before torch looks.
if "triton" not in sys.modules:
  sys.modules["triton"] = None

# Many tests compile the same programs (the same tiny models, trained and evaluated again
# by each resume / restart test, in this process and in the CLI subprocesses they start).
# XLA's persistent compilation cache turns every repeat into a load of the stored
# executable: the same binary, so results are unchanged, and the suite runs about a third
# faster. Set here, before JAX is imported; subprocesses inherit it through the environment.
_CACHE_ROOT = os.environ.get("DECAL_CACHE_DIR") or os.path.join(
    os.path.expanduser("~"), ".cache", "decal_jax")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_CACHE_ROOT, "xla_test_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Cheap compiles: the suite's programs are tiny, so XLA's CPU optimisation passes cost more
# seconds than they save (measured on test_squid_train + test_dodo: 23 % less CPU time). Both
# sides of every comparison are compiled alike; tolerances do not rely on a fusion order.
# Subprocesses (CLI runs, the 2-process partitioning test) inherit it.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


# The two xdist workers take whole files (`--dist loadfile`) in collection order. By
# default xdist reorders files by their number of tests, which leaves a slow file with few
# tests for the end while the other worker idles. Instead, the slowest files (measured with
# `--durations`, about 2-4 minutes each on 2 cores) go first and the many short ones fill
# in behind them, so both workers finish together.
SLOWEST_FIRST = ("test_entry_points.py", "test_ablation.py", "test_trainer.py",
                 "test_fault_tolerance.py", "test_partitioning.py", "test_squid_train.py",
                 "test_dodo_lm.py", "test_dodo.py", "test_retrieval_e2e.py",
                 "test_multiprocess_faults.py")


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable for the rest


@pytest.fixture
def builtin_vocabulary(monkeypatch):
  """Tasks of 'the model's' vocabulary tokenize with the built-in one (as a tiny model's gin
  binds it); no local data folder and the default bad-line mode unless a test sets them;
  gin cleared afterwards."""
  import gin  # after XLA_FLAGS above
  from decal_jax.data import vocabularies
  monkeypatch.delenv("DECAL_LOCAL_DATA_DIR", raising=False)
  monkeypatch.delenv("DECAL_BAD_LINES", raising=False)
  vocab = vocabularies.builtin_vocabulary()
  with gin.unlock_config():
    gin.bind_parameter("decal_jax.data.vocabularies.task_vocabulary.vocabulary", vocab)
  yield vocab
  gin.clear_config()



def pytest_runtest_logreport(report):
  """With DECAL_SKIPPED_TESTS=FILE, each skipped test's id and reason as a JSON line (the
  controller's copy only): .ci/run reruns, beside ../shared, those a bare clone skipped for
  want of the shared data."""
  path = os.environ.get("DECAL_SKIPPED_TESTS")
  if not path or not report.skipped or os.environ.get("PYTEST_XDIST_WORKER"):
    return
  longrepr = report.longrepr
  reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
  import json
  with open(path, "a") as f:
    f.write(json.dumps({"nodeid": report.nodeid, "reason": reason}) + "\n")
