"""T5X-style model wrappers: each owns the loss, prediction and scoring around a network
module and answers the trainer through `base.BaseModel`'s methods.

  base.py             BaseModel (the protocol) and TokenModel (the shared token loss)
  encoder_decoder.py  EncoderDecoderModel (T5 / DeCAL, Dodo autoencoding)
  decoder_only.py     DecoderOnlyModel (causal LMs: Decoder, DodoLM, GPTHF)
  squid.py            SquidModel and its feature converter
  dual_encoder.py     DualEncoderModel (multi-vector retrieval) and its feature converter
  t5x_dual_encoder.py DualEncoderModel as a T5X model class (imports t5x; not imported here)

Gin files name them `models.X` (`from decal_jax import models`).
"""
from decal_jax.models.base import BaseModel, TokenModel
from decal_jax.models.decoder_only import DecoderOnlyModel
from decal_jax.models.dual_encoder import DualEncoderFeatureConverter, DualEncoderModel
from decal_jax.models.encoder_decoder import EncoderDecoderModel
from decal_jax.models.squid import SquidFeatureConverter, SquidModel

__all__ = ["BaseModel", "TokenModel", "EncoderDecoderModel", "DecoderOnlyModel",
           "SquidFeatureConverter", "SquidModel", "DualEncoderFeatureConverter",
           "DualEncoderModel"]
