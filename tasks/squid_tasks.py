"""Squid's three-stage curriculum as seqio tasks: restoration, continuation, then
instruction tuning (decal_jax/networks/squid.py; ../shared/papers/squid_summary.md).

| stage | name | source | vocabulary |
|---|---|---|---|
| 1, 2 | decal_builtin_squid_restore, decal_builtin_squid_continue | built-in corpus | built-in |
| 1, 2 | decal_c4_squid_restore, decal_c4_squid_continue | TFDS c4/en:3.1.0 | the model's |
| 1, 2 | decal_text_squid_restore, decal_text_squid_continue | `<dir>/text_autoencode/` | the model's |
| 3 | decal_builtin_squid_qa | built-in QA records (paragraph -> section title) | built-in |
| 3 | decal_squad_squid | `<dir>/squad/`, else TFDS squad/v1.1:3.0.0 | the model's |
| 3 | decal_squid_qa_jsonl | `<dir>/squid_qa/` | the model's |

Stage 1 is restoration, 2 continuation, 3 instruction tuning (question answering). `<dir>/x/`
holds `<split>.jsonl` files (splits train / validation / test): text_autoencode/ has a "text"
field per line (the folder decal_text_autoencode reads), squad/ and squid_qa/ question /
context / answers.

Every task gives three features, tokenized with one vocabulary and read through
`models.SquidFeatureConverter` (TASK_FEATURE_LENGTHS needs 'inputs', 'query', 'targets'):

  inputs   the context the small decoder compresses (no EOS: it is just text)
  query    what the large decoder reads after the compressed context (no EOS; may be empty)
  targets  what the large decoder must produce

Stage 1 (restoration): documents are tokenized, read back to back and cut into chunks of
inputs_length tokens (`autoencoding.autoencode`; the stream's shorter tail is dropped);
inputs = the chunk, query = RESTORE_PROMPT, targets = the chunk + EOS. Targets therefore need 'targets' >= 'inputs' + 1 (a shorter length
is refused with a ValueError). Evaluation reports BLEU of the reconstruction.

Stage 2 (continuation): chunks of inputs_length + targets_length tokens are cut into C1 ->
inputs and C2 -> targets (`autoencoding.continuation`; a tail too short for a whole C1 is
dropped). Neither part ends in EOS: C2 goes on,
it does not end. The query is CONTINUE_PROMPT, empty, as the paper's continuation stage has
no prompt.

Stage 3 (instruction tuning): context -> inputs, question -> query, first answer + EOS ->
targets; exact match / F1 against every answer (`text_metrics.squad`). A context longer
than inputs_length keeps its first inputs_length tokens (cuts are counted, see
`text_to_text.truncation_counts()`); a context that tokenizes to no token is dropped.
`register_squid_qa_jsonl_task(name, {split: path})` makes a task of any JSONL file with
question / context / answers fields (answers: a string or a list of strings).

"The model's" vocabulary is `vocabularies.task_vocabulary()` (the model gin's VOCABULARY) when
data is read; the local directory is `downstream_tasks.local_data.directory` (gin) or
`$DECAL_LOCAL_DATA_DIR`. decal_squad_squid reads local files when `<dir>/squad/` exists, as
decal_squad does.
"""
import functools
from typing import Mapping, Optional

import seqio
import tensorflow as tf

from decal_jax import text_metrics
from decal_jax.data import autoencoding, corpus, local_files, text_to_text, vocabularies
from decal_jax.tasks import autoencoding_tasks, downstream_tasks
from decal_jax.tasks.span_corruption_tasks import C4_TFDS_NAME, PreparedTfdsSource

RESTORE_PROMPT = "Restore the compressed text:"
CONTINUE_PROMPT = ""
FEATURES = ("inputs", "query", "targets")
SQUID_QA_FOLDER = "squid_qa"
SQUID_QA_JSONL_TASK = "decal_squid_qa_jsonl"


def _features(vocabulary: seqio.Vocabulary, targets_eos: bool) -> Mapping[str, seqio.Feature]:
  """Inputs and query without EOS; targets with EOS when `targets_eos`."""
  return {key: seqio.Feature(vocabulary, add_eos=key == "targets" and targets_eos, required=True)
          for key in FEATURES}


def _replace(name: str) -> None:
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)


# ------------------------------------------------------------------------------ preprocessors
def _check_lengths(sequence_length: Optional[Mapping[str, int]],
                   output_features: Mapping[str, seqio.Feature], prompt: str) -> None:
  """Positive inputs / targets lengths, and a query length that holds the whole `prompt`."""
  lengths = dict(sequence_length or {})
  if not all(isinstance(lengths.get(k), int) and lengths[k] > 0 for k in ("inputs", "targets")):
    raise ValueError("Squid's restoration / continuation tasks cut the token stream by "
                     "TASK_FEATURE_LENGTHS: give positive 'inputs' and 'targets' lengths (and "
                     f"'query'), got {sequence_length!r}.")
  prompt_tokens = len(output_features["query"].vocabulary.encode(prompt)) if prompt else 0
  if lengths.get("query", 0) < prompt_tokens:
    raise ValueError(f"The prompt {prompt!r} is {prompt_tokens} tokens but "
                     f"TASK_FEATURE_LENGTHS['query'] = {lengths.get('query')}: set "
                     f"'query' >= {prompt_tokens}.")


def _with_prompt(dataset: tf.data.Dataset, output_features: Mapping[str, seqio.Feature],
                 prompt: str) -> tf.data.Dataset:
  """Adds 'query': the tokenized `prompt` (the same ids on every example)."""
  vocabulary = output_features["query"].vocabulary

  def fn(ex):
    query = tf.cast(tf.reshape(vocabulary.encode_tf(tf.constant(prompt)), [-1]), tf.int32)
    return dict(ex, query=query)  # [prompt_len]
  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


def restoration(dataset: tf.data.Dataset, sequence_length: Mapping[str, int],
                output_features: Mapping[str, seqio.Feature]) -> tf.data.Dataset:
  """seqio preprocessor: tokenized {'targets': `[doc_len]`} -> {'inputs': c, 'query':
  RESTORE_PROMPT, 'targets': c} with chunks c of up to inputs_length tokens (EOS is appended
  to targets later, so they need inputs_length + 1 tokens)."""
  _check_lengths(sequence_length, output_features, RESTORE_PROMPT)
  inputs, targets = sequence_length["inputs"], sequence_length["targets"]
  if targets < inputs + 1:
    raise ValueError(f"Squid restoration's targets are the whole context (up to 'inputs' = "
                     f"{inputs} tokens) plus EOS, but TASK_FEATURE_LENGTHS['targets'] = "
                     f"{targets}: set TASK_FEATURE_LENGTHS['targets'] >= {inputs + 1}.")
  chunks = autoencoding.autoencode(dataset, sequence_length, reserve_eos=False)
  return _with_prompt(_full_contexts(chunks, inputs), output_features, RESTORE_PROMPT)


def continuation(dataset: tf.data.Dataset, sequence_length: Mapping[str, int],
                 output_features: Mapping[str, seqio.Feature]) -> tf.data.Dataset:
  """seqio preprocessor: tokenized {'targets': `[doc_len]`} -> {'inputs': C1 (<= inputs_length
  tokens), 'query': CONTINUE_PROMPT, 'targets': C2 (<= targets_length tokens)}, no EOS."""
  _check_lengths(sequence_length, output_features, CONTINUE_PROMPT)
  parts = autoencoding.continuation(dataset, sequence_length, reserve_eos=False)
  parts = _full_contexts(parts, sequence_length["inputs"])
  return _with_prompt(parts, output_features, CONTINUE_PROMPT)


def _full_contexts(dataset: tf.data.Dataset, length: int) -> tf.data.Dataset:
  """Keeps examples whose context is exactly `length` tokens: only the stream's short tail
  is dropped, so a fixed number of memory tokens never meets a context shorter than N."""
  return dataset.filter(lambda ex: tf.size(ex["inputs"]) == length)


def qa_fields(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """seqio preprocessor: {'question', 'context', 'answers'} -> {'inputs': context, 'query':
  question, 'targets': the first answer, 'answers': every answer (the metric's references)}."""
  def fn(ex):
    return {"inputs": ex["context"], "query": ex["question"], "targets": ex["answers"][0],
            "answers": ex["answers"]}
  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


def drop_empty_contexts(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """seqio preprocessor (after tokenizing): drops examples whose 'inputs' has no token."""
  return dataset.filter(lambda ex: tf.size(ex["inputs"]) > 0)


# ------------------------------------------------------------------------------ registration
def _register_stream_task(name: str, source: seqio.DataSource, vocabulary: seqio.Vocabulary,
                          stage: str) -> seqio.Task:
  """A stage-1 ('restore') or stage-2 ('continue') task over a source of {'text': str}."""
  _replace(name)
  restore = stage == "restore"
  return seqio.TaskRegistry.add(
      name, source=source, output_features=_features(vocabulary, targets_eos=restore),
      metric_fns=[text_metrics.bleu] if restore else [],
      preprocessors=[functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
                     seqio.preprocessors.tokenize,
                     restoration if restore else continuation,
                     autoencoding.add_pretokenized,
                     seqio.preprocessors.append_eos_after_trim])


def register_stream_tasks(prefix: str, source_fn, vocabulary: seqio.Vocabulary) -> None:
  """`<prefix>_squid_restore` and `<prefix>_squid_continue` over `source_fn()`'s texts."""
  for stage in ("restore", "continue"):
    _register_stream_task(f"{prefix}_squid_{stage}", source_fn(), vocabulary, stage)


def register_squid_qa_task(name: str, source: seqio.DataSource,
                           vocabulary: Optional[seqio.Vocabulary] = None) -> seqio.Task:
  """Stage-3 task over a source of {'question': str, 'context': str, 'answers': [str]};
  `vocabulary` defaults to the model's (`vocabularies.task_vocabulary()` when read)."""
  _replace(name)
  return seqio.TaskRegistry.add(
      name, source=source,
      output_features=_features(vocabulary or vocabularies.deferred_vocabulary(),
                                targets_eos=True),
      preprocessors=[qa_fields, seqio.preprocessors.tokenize, drop_empty_contexts,
                     functools.partial(text_to_text.trim_and_count, task_name=name),
                     seqio.preprocessors.append_eos_after_trim],
      postprocess_fn=text_to_text.references, metric_fns=[text_metrics.squad])


def register_squid_qa_jsonl_task(name: str, split_files: Mapping[str, str],
                                 fields: Optional[Mapping[str, str]] = None,
                                 bad_lines: str = "fail",
                                 vocabulary: Optional[seqio.Vocabulary] = None) -> seqio.Task:
  """Stage-3 task of your JSONL files, {split: path or glob}; `fields` maps question /
  context / answers to your files' keys (answers: a string or a list of strings)."""
  schema = local_files.Schema(text_to_text.QA)
  source = local_files.JsonlSource(split_files, schema, fields, bad_lines=bad_lines)
  return register_squid_qa_task(name, source, vocabulary)


def _squad_dataset() -> downstream_tasks.Dataset:
  return next(d for d in downstream_tasks.DATASETS if d.name == "squad")


def register_all() -> None:
  register_stream_tasks("decal_builtin", corpus.data_source, vocabularies.builtin_vocabulary())
  register_stream_tasks("decal_c4", lambda: PreparedTfdsSource(C4_TFDS_NAME),
                        vocabularies.deferred_vocabulary())
  for stage in ("restore", "continue"):
    name = f"decal_text_squid_{stage}"
    source = autoencoding_tasks.LocalTextSource(autoencoding_tasks.TEXT_AUTOENCODE_FOLDER, name)
    _register_stream_task(name, source, vocabularies.deferred_vocabulary(), stage)
  builtin_qa_records = downstream_tasks._builtin_qa_dataset
  builtin_qa = seqio.FunctionDataSource(builtin_qa_records, splits=corpus.SPLITS)
  register_squid_qa_task("decal_builtin_squid_qa", builtin_qa, vocabularies.builtin_vocabulary())
  register_squid_qa_task("decal_squad_squid",
                         downstream_tasks.LocalOrTfdsSource(_squad_dataset(), "decal_squad_squid"))
  squid_qa = downstream_tasks.Dataset(SQUID_QA_FOLDER, "qa", None)
  register_squid_qa_task(SQUID_QA_JSONL_TASK,
                         downstream_tasks.LocalOrTfdsSource(squid_qa, SQUID_QA_JSONL_TASK))


register_all()
