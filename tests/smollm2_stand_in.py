"""The stand-in for SmolLM2-135M that the SmolLM2 tools' tests share: a tiny random decoder
of the same family (grouped-query attention, tied embeddings), the tree the GGUF import gives
a tool, and a word-level tokenizer, so that a test runs a tool's own functions in seconds
where the tool itself loads the 135M model."""
import types

import jax
import jax.numpy as jnp

from decal_jax.networks.decoder import Decoder, DecoderConfig

EOS = 2


def tiny_decoder(num_layers: int, max_length: int) -> DecoderConfig:
  """A 40-token vocabulary, width 32, 2 query heads sharing 1 key/value head."""
  return DecoderConfig(vocab_size=40, emb_dim=32, num_heads=2, num_kv_heads=1, head_dim=16,
                       mlp_dim=64, num_layers=num_layers, tie_embeddings=True,
                       max_length=max_length)


def imported_stack(config: DecoderConfig) -> dict:
  """`{'stack': ...}` as `interop.gguf` gives it, here the decoder's random init (seed 7)."""
  tokens = jnp.ones((1, 8), jnp.int32)
  return {"stack": Decoder(config).init(jax.random.PRNGKey(7), tokens)["params"]["stack"]}


class WordTokenizer:
  """Ids of the 'w<k>' words (k in 3..39), other words dropped; decodes back to words; every
  special token is EOS."""
  def encode(self, text):
    return types.SimpleNamespace(ids=[int(w[1:]) for w in text.split()
                                      if w[0] == "w" and w[1:].isdigit()])

  def decode(self, ids):
    return " ".join(f"w{i}" for i in ids)

  def token_to_id(self, token):
    return EOS
