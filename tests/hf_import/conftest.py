"""Fixtures of tests/hf_import/: a tiny random LLaMA and Qwen2 saved as Hugging Face
checkpoints, and a byte-level BPE tokenizer, written once per test file. They import the
helpers (and so torch) only when a test asks for them: without the `[test-hf]` extra the
test files are skipped before that."""
import pytest


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """GQA (4 query / 2 kv heads), head_dim 24 != hidden / heads, RoPE base 5e5."""
  from hf_import_helpers import TINY, _saved_random, transformers
  config = transformers.LlamaConfig(head_dim=24, rope_theta=5e5, **TINY)
  directory = tmp_path_factory.mktemp("llama")
  return _saved_random(transformers.LlamaForCausalLM, config, 0, directory), directory


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
  """Qwen2: biases on q/k/v, tied embeddings (no lm_head tensor)."""
  from hf_import_helpers import TINY, _saved_random, transformers
  config = transformers.Qwen2Config(tie_word_embeddings=True, rope_theta=1e6, **TINY)
  directory = tmp_path_factory.mktemp("qwen2")
  return _saved_random(transformers.Qwen2ForCausalLM, config, 1, directory), directory


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
  from hf_import_helpers import _write_tokenizer
  return _write_tokenizer(tmp_path_factory.mktemp("tokenizer"))
