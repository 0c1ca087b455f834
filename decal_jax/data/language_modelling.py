"""Language-modelling chunks (targets only; the decoder-only models' data): the seqio
preprocessor that reads tokenized documents back to back and cuts the stream into chunks
of TASK_FEATURE_LENGTHS['targets'] tokens. `tasks/lm_tasks.py` and
`sentences.sentences_lm` use it. It calls only tf.data's methods, so importing this module
needs no TensorFlow."""
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
  import tensorflow as tf


def lm_chunks(dataset: "tf.data.Dataset",
              sequence_length: Mapping[str, int]) -> "tf.data.Dataset":
  """seqio preprocessor: tokenized {'targets': `[doc_len]`} -> {'targets': `[<= length]`}
  chunks of one stream of documents read back to back."""
  stream = dataset.map(lambda ex: ex["targets"]).unbatch()  # scalar ids
  return stream.batch(sequence_length["targets"]).map(lambda c: {"targets": c})
