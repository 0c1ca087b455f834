"""What the tests of tests/hf_import/ share: tiny model sizes and texts, random weights,
our logits and PyTorch's, a byte-level BPE tokenizer written here, the import tool.
Importing it without the `[test-hf]` extra skips the importing test file, saying why."""
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

# (tests/conftest.py hides Triton, which crashes next to TensorFlow, before torch loads.)
NEEDS_HF = ("compares with transformers' PyTorch models: pip install torch (the CPU build) "
            "and -e '.[test-hf]'")
torch = pytest.importorskip("torch", reason=NEEDS_HF)
transformers = pytest.importorskip("transformers", reason=NEEDS_HF)
safetensors_torch = pytest.importorskip("safetensors.torch", reason=NEEDS_HF)

import jax  # noqa: E402  (after the skips above)
import jax.numpy as jnp  # noqa: E402  (after the skips above)

from decal_jax.networks.decoder import Decoder  # noqa: E402  (after the skips above)
import paths  # noqa: E402  (after the skips above)

REPO = paths.REPO
VOCAB = 101
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=112,
            num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
            rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 12))
TEXTS = ["Hello world! How are you? Fine, thanks.", "Ünïcödé ✓ and émojis 🦑 too",
         "numbers 12345 and  double  spaces\nnew lines\ttabs", "!!! wow!"]
SQUID_SMALL = dict(TINY, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=64, num_hidden_layers=1)
SQUID_LARGE = dict(TINY, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=96, num_hidden_layers=2, vocab_size=128)


def _randomize(model, seed):
  """Weights big enough that every tensor matters (norm scales near 1, biases non-zero)."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
      else:
        p.normal_(0.0, 0.2)
  return model.eval()


def _saved_random(model_class, config, seed, directory):
  """A `model_class(config)` with `_randomize`d weights, saved to `directory` as safetensors
  (a Hugging Face checkpoint folder); returns the model."""
  model = _randomize(model_class(config), seed)
  model.save_pretrained(directory, safe_serialization=True)
  return model


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()  # [batch, t, vocab]


@functools.lru_cache(maxsize=None)
def _forward(config):
  """Jitted `Decoder(config)` logits, compiled once per config for every test that uses it."""
  return jax.jit(lambda params, tokens: Decoder(config).apply(
      {"params": params}, tokens, enable_dropout=False))


def _our_logits(config, params, tokens):
  return np.asarray(_forward(config)(params, jnp.asarray(tokens)))


def _copy_with_config(directory, target, **changes):
  shutil.copytree(directory, target)
  path = target / "config.json"
  path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))
  return target


def _write_tokenizer(directory, eos_in_config=True):
  """A tiny byte-level BPE trained here, laid out like Qwen2's: the byte alphabet first (so
  id 0 is '!'), the special token last; `tokenizer_config.json` names the EOS."""
  tokenizers = pytest.importorskip("tokenizers")
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  trainer_ = tokenizers.trainers.BpeTrainer(
      vocab_size=320, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(TEXTS * 10, trainer_)
  tokenizer.add_special_tokens(["<|endoftext|>"])
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  if eos_in_config:
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|endoftext|>"}, "bos_token": None}))
  return tokenizer, directory / "tokenizer.json"


def _run_tool(*args):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([sys.executable, "-m", "decal_jax.commands.import_hf", *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _tool_module():
  return importlib.import_module("decal_jax.commands.import_hf")
