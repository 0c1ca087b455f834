"""T5X-style model wrappers: each owns the loss, prediction and scoring around a network
module and answers the trainer through `base.BaseModel`'s methods.

  base.py             BaseModel (the protocol) and TokenModel (the shared token loss)
  encoder_decoder.py  EncoderDecoderModel (T5 / DeCAL, Dodo autoencoding)
  decoder_only.py     DecoderOnlyModel (causal LMs: Decoder, DodoLM, GPTHF)
  squid.py            SquidModel, QueryModel (the base Dodo QA shares)
  squid_features.py   their seqio feature converters (seqio, TF)
  dodo.py             DodoQAModel (Dodo with the question on the decoder side)
  dual_encoder.py     DualEncoderModel (multi-vector retrieval)
  dual_encoder_features.py  its seqio feature converter (seqio, TF)
  t5x_dual_encoder.py DualEncoderModel as a T5X model class (imports t5x; not imported here)

Gin files name them `models.X` (`from decal_jax import models`). Each is imported when first
named, so a T5 model needs neither TensorFlow nor the other models' feature converters
(`bench_train` on a GPU image without them: docs/performance.md).
"""
import importlib

_WHERE = {"BaseModel": "base", "TokenModel": "base", "DecoderOnlyModel": "decoder_only",
          "DodoQAModel": "dodo",
          "DualEncoderFeatureConverter": "dual_encoder_features",
          "DualEncoderModel": "dual_encoder",
          "EncoderDecoderModel": "encoder_decoder", "SquidFeatureConverter": "squid_features",
          "SquidModel": "squid"}
__all__ = list(_WHERE)


def __getattr__(name: str):
  if name in _WHERE:
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + __all__)
