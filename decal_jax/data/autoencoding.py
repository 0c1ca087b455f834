"""Autoencoding and text continuation: the compression-training recipe of ICAE / COCOM that
the DeCAL paper uses for CCProxy and for its "autoencode" ablation (mixed 1:1).

Both read one stream of tokenized documents (back to back, as span corruption does) cut into
chunks, with EOS appended after (`seqio.preprocessors.append_eos_after_trim`):

- `autoencode`: chunks of inputs_length - 1 tokens; the target is the input itself.
- `continuation`: chunks of (inputs_length - 1) + (targets_length - 1) tokens; the input is
  the first inputs_length - 1 tokens, the target the rest. A short final chunk of L tokens
  gives its last up to targets_length - 1 tokens to the target and at least one to the input.

With `reserve_eos=False` no room is kept for EOS (chunks of inputs_length, and of
inputs_length + targets_length): Squid's tasks (tasks/squid_tasks.py) read the context
without EOS.

`marked_autoencode` / `marked_continuation` are the two objectives as the 1:1 mixture trains
them (CCProxy, DeCAL's autoencode ablation): the target opens with the tokens of a task
marker (`AUTOENCODE_MARKER`, `CONTINUATION_MARKER`), on the decoder side, as ICAE prompts its
decoder with a special token before reconstructing. The compressed input stays the text
alone; the decoder, after the marker, knows which task it is doing. The chunks shrink by
the marker's length so that the marked target still fits TASK_FEATURE_LENGTHS['targets'].

A chunk is token ids cut from the stream, so it has no source text of its own;
`add_pretokenized` decodes each chunk back to text (`inputs_pretokenized`,
`targets_pretokenized`) for the metrics (BLEU of the reconstruction) and predictions files.
"""
from typing import List, Mapping

import seqio

import tensorflow as tf


def _token_stream(dataset: tf.data.Dataset) -> tf.data.Dataset:
  return dataset.map(lambda ex: ex["targets"]).unbatch()  # scalar ids, documents back to back


def autoencode(dataset: tf.data.Dataset, sequence_length: Mapping[str, int],
               reserve_eos: bool = True) -> tf.data.Dataset:
  """seqio preprocessor: tokenized {'targets': `[doc_len]`} -> {'inputs': c, 'targets': c},
  chunks of inputs_length - 1 tokens (inputs_length without `reserve_eos`)."""
  room = 1 if reserve_eos else 0
  chunks = _token_stream(dataset).batch(sequence_length["inputs"] - room)  # [<= inputs - room]
  return chunks.map(lambda c: {"inputs": c, "targets": c})


def continuation(dataset: tf.data.Dataset, sequence_length: Mapping[str, int],
                 reserve_eos: bool = True) -> tf.data.Dataset:
  """seqio preprocessor: tokenized {'targets': `[doc_len]`} -> {'inputs': first part,
  'targets': the next part}; each part keeps one token of its length free for EOS unless
  `reserve_eos` is False."""
  room = 1 if reserve_eos else 0
  prefix, rest = sequence_length["inputs"] - room, sequence_length["targets"] - room
  chunks = _token_stream(dataset).batch(prefix + rest)  # [<= prefix + rest]

  def split(chunk):
    cut = tf.minimum(prefix, tf.maximum(1, tf.size(chunk) - rest))
    return {"inputs": chunk[:cut], "targets": chunk[cut:]}

  return chunks.filter(lambda c: tf.size(c) >= 2).map(split)


AUTOENCODE_MARKER = "reconstruct:"
CONTINUATION_MARKER = "continue:"


def marker_ids(output_features: Mapping[str, seqio.Feature], marker: str) -> List[int]:
  """The marker's token ids in the targets' vocabulary."""
  return list(output_features["targets"].vocabulary.encode(marker))


def _open_targets_with(dataset: tf.data.Dataset, marker: List[int]) -> tf.data.Dataset:
  prefix = tf.constant(marker, tf.int32)  # [k]
  return dataset.map(lambda ex: dict(ex, targets=tf.concat([prefix, ex["targets"]], 0)))


def _room_for(marker: List[int], sequence_length: Mapping[str, int], least: int) -> int:
  """targets_length less the marker; refuses lengths that leave under `least` tokens."""
  room = sequence_length["targets"] - len(marker)
  if room < least:
    raise ValueError(f"TASK_FEATURE_LENGTHS['targets'] = {sequence_length['targets']} leaves "
                     f"no room after the task marker's {len(marker)} tokens; give 'targets' "
                     f">= {len(marker) + least}.")
  return room


def marked_autoencode(dataset: tf.data.Dataset, sequence_length: Mapping[str, int],
                      output_features: Mapping[str, seqio.Feature]) -> tf.data.Dataset:
  """`autoencode` whose target is AUTOENCODE_MARKER's k tokens + the chunk; chunks of
  min(inputs_length, targets_length - k) - 1 tokens."""
  marker = marker_ids(output_features, AUTOENCODE_MARKER)
  room = _room_for(marker, sequence_length, 2)
  chunks = autoencode(dataset, {"inputs": min(sequence_length["inputs"], room)})
  return _open_targets_with(chunks, marker)


def marked_continuation(dataset: tf.data.Dataset, sequence_length: Mapping[str, int],
                        output_features: Mapping[str, seqio.Feature]) -> tf.data.Dataset:
  """`continuation` whose target is CONTINUATION_MARKER's k tokens + the next part; the
  next part keeps k fewer tokens."""
  marker = marker_ids(output_features, CONTINUATION_MARKER)
  room = _room_for(marker, sequence_length, 2)
  parts = continuation(dataset, {"inputs": sequence_length["inputs"], "targets": room})
  return _open_targets_with(parts, marker)


def add_pretokenized(dataset: tf.data.Dataset, output_features: Mapping[str, seqio.Feature]
                     ) -> tf.data.Dataset:
  """seqio preprocessor: adds '<key>_pretokenized', the text of the 'inputs' / 'targets'
  token ids (each key decoded with its feature's vocabulary)."""
  def fn(ex):
    texts = {f"{key}_pretokenized": output_features[key].vocabulary.decode_tf(ex[key])
             for key in ("inputs", "targets")}
    return dict(ex, **texts)
  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)
