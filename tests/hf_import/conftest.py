"""Fixtures of tests/hf_import/: a tiny random LLaMA and Qwen2 saved as Hugging Face
checkpoints, and a byte-level BPE tokenizer, written once per test file. They import the
helpers (and so torch) only when a test asks for them: without the `[test-hf]` extra the
test files are skipped before that."""
import pytest


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """GQA (4 query / 2 kv heads), head_dim 24 != hidden / heads, RoPE base 5e5."""
  from hf_import_helpers import TINY, _randomize, transformers
  config = transformers.LlamaConfig(head_dim=24, rope_theta=5e5, **TINY)
  model = _randomize(transformers.LlamaForCausalLM(config), seed=0)
  directory = tmp_path_factory.mktemp("llama")
  model.save_pretrained(directory, safe_serialization=True)
  return model, directory


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
  """Qwen2: biases on q/k/v, tied embeddings (no lm_head tensor)."""
  from hf_import_helpers import TINY, _randomize, transformers
  config = transformers.Qwen2Config(tie_word_embeddings=True, rope_theta=1e6, **TINY)
  model = _randomize(transformers.Qwen2ForCausalLM(config), seed=1)
  directory = tmp_path_factory.mktemp("qwen2")
  model.save_pretrained(directory, safe_serialization=True)
  return model, directory


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
  from hf_import_helpers import _write_tokenizer
  return _write_tokenizer(tmp_path_factory.mktemp("tokenizer"))
