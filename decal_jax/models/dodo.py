"""Dodo for question answering (dodo.md §6, Appendix D.2): the document goes through the
compressor, the question stays uncompressed in the decoder's prompt (`networks.dodo.Dodo`
with `query_tokens`).

Batches come from the same tasks as Squid's stage 3 (features 'inputs' = the document,
'query' = the question, 'targets' = the answer; `tasks/squid_tasks.py`), converted by
`SquidFeatureConverter` (`QueryModel`): encoder_input_tokens <- document, query_tokens <- question.
"""
from typing import Optional

import jax
import jax.numpy as jnp

from decal_jax.models import base
from decal_jax.models.squid import QueryModel

Array = jax.Array
Batch = base.Batch


class DodoQAModel(QueryModel):
  """`QueryModel` for `Dodo`: the decoder reads [the document's nuggets; the question] and
  then produces the answer."""

  def query(self, batch: Batch) -> Array:
    """The batch's question tokens `[batch, q]` (width 1 of padding when it has none)."""
    query = batch.get("query_tokens")
    if query is None:
      return jnp.zeros((batch["encoder_input_tokens"].shape[0], 1), jnp.int32)
    return query

  def _compute_logits_from_slice(self, state, params, encoded, raw_inputs: Array,
                                 max_decode_length: int):
    """One cached step: `encoded` is the [nuggets; question] memory, `raw_inputs` `[b, 1]`
    the positions before the first answer token."""
    del max_decode_length
    logits, new_vars = self.module.apply(
        {"params": params, "cache": state.cache}, encoded, raw_inputs[:, 0], state.cur_token,
        enable_dropout=False, decode=True, mutable=["cache"], method=self.module.decode_memory)
    return logits[:, 0, :], new_vars["cache"]  # [batch * beams, vocab]

  def predict_batch_with_aux(self, params, batch: Batch, rng: Optional[Array] = None, *,
                             num_decodes: int = 1, return_all_decodes: bool = False,
                             **decoder_kwargs):
    """Compresses each row's document, reads its question, decodes the answer."""
    inputs, query = batch["encoder_input_tokens"], self.query(batch)
    targets_shape = batch["decoder_input_tokens"].shape
    dummy = jnp.ones(targets_shape, jnp.int32)
    _, init_vars = self.module.apply(
        {"params": params}, jnp.ones_like(inputs), dummy, dummy, query_tokens=jnp.ones_like(query),
        decode=True, enable_dropout=False, mutable=["cache"])
    memory, prefix = self.module.apply({"params": params}, inputs, query,
                                       method=self.module.compress_query)
    return self._decode_from(params, memory, prefix[:, None], init_vars["cache"], targets_shape,
                             rng, num_decodes, return_all_decodes, **decoder_kwargs)

