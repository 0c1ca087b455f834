"""Evaluation and inference loops (T5X's `eval.py` / `infer.py`) and the files they write.

`evaluate(...)` restores MODEL_DIR's latest checkpoint, measures the teacher-forced loss /
accuracy over the validation split (TensorBoard: MODEL_DIR/training_eval/<task>/, as T5X)
and, for tasks with metrics (ROUGE, EM / F1, BLEU; seqio's predict, predict-with-aux and
score metric kinds), decodes / scores the split through `seqio.Evaluator`, whose loggers
write MODEL_DIR/inference_eval/<task>-<step:06>.jsonl (one line per example) and
<task>-metrics.jsonl (`inference_eval`); EVAL_OUTPUT_DIR moves both for a read-only
MODEL_DIR. `infer(...)` decodes input texts. Both also read a T5X run's MODEL_DIR (its
latest T5X `checkpoint_<step>`, mapped into the gin's model by `train_state.restore_params`;
docs/t5x_checkpoints.md), writing no checkpoint into it. The trainer uses
`evaluate_params`, `decode_example` and `report` for its periodic and final evaluation.
"""
import dataclasses
import functools
import json
import logging
import os
import pathlib
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

import jax
import numpy as np
import seqio
import tqdm

from decal_jax import fileio, metrics, partitioning
from decal_jax.runtime import inference_eval, model_info, resilience, train_state
from decal_jax.data import batches, local_files, pipeline, text_to_text
from decal_jax.data.batches import DatasetConfig
from decal_jax.models import BaseModel

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ loss
def make_eval_step(model: BaseModel, partitioner):
  """(params, global batch) -> the model's summable aux values, jitted."""
  jitted = jax.jit(lambda params, batch: model.eval_fn(params, batch)[1],
                   out_shardings=partitioner.replicated())

  def run(params, batch):
    with partitioner.activate():
      return jitted(params, batch)
  return run


def evaluate_params(params, model: BaseModel, cfg: DatasetConfig, partitioner,
                    max_batches: int = 50):
  """Validation loss / accuracy over up to `max_batches` batches of `cfg.split`."""
  step = make_eval_step(model, partitioner)
  sums: Dict[str, float] = {}
  ds = pipeline.get_dataset(dataclasses.replace(cfg, shuffle=False), model, 1, partitioner)
  for batch in pipeline.lockstep_batches(ds, cfg.batch_size // partitioner.data_shard().count,
                                         max_batches):
    aux = jax.device_get(step(params, pipeline.to_global(batch, partitioner)))
    for k, v in aux.items():
      sums[k] = sums.get(k, 0.0) + float(v)
  if not sums:
    raise ValueError(f"Split {cfg.split!r} of {cfg.mixture_or_task_name!r} gave no examples.")
  return model.summarize(sums)


# ------------------------------------------------------------------------------ train report
def decode_example(params, model: BaseModel, cfg: DatasetConfig, partitioner) -> Dict[str, str]:
  """Greedy-decodes the first example of `cfg.split` from its compressed encoding."""
  ds = pipeline.get_dataset(dataclasses.replace(cfg, shuffle=False,
                                                batch_size=jax.process_count()),
                            model, num_epochs=1)
  batch = next(ds.as_numpy_iterator())
  with partitioner.activate():
    tokens = jax.jit(model.predict_batch)(params, batch)
  vocab = model.output_vocabulary

  def text(ids):
    return vocab.decode([int(t) for t in ids if t > 0])

  example = {name: text(batch[feature][0]) for name, feature in model.EXAMPLE_FEATURES}
  return dict(example, prediction=text(np.asarray(tokens)[0]))


def can_decode_example(model: BaseModel) -> bool:
  """Whether the model decodes text from inputs (a decoder-only LM has no input to decode
  from; its report is the perplexity)."""
  return model.PREDICTS_TEXT and not model.DECODER_ONLY


def report(result: Mapping[str, float], example: Optional[Mapping[str, str]], step: int) -> None:
  """Prints the held-out metrics and, if given, the decoded example (process 0 only)."""
  if jax.process_index() != 0:
    return
  if "perplexity" in result:
    print(f"\nHeld-out (validation) at step {step}: loss {result['loss']:.4f}, "
          f"token accuracy {result['accuracy']:.4f}, perplexity {result['perplexity']:.2f} "
          f"over {int(result['target_tokens'])} target tokens.")
  else:  # a model with its own summary (the dual encoder: in-batch accuracy)
    print(f"\nHeld-out (validation) at step {step}: " +
          ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
  if example is None:
    return
  print("Validation example, decoded from the compressed encoding:")
  for key, value in example.items():
    print(f"  {key:>10}: {value}")


# ------------------------------------------------------------------------------ evaluate
def evaluate(*, model: BaseModel, eval_dataset_cfg: DatasetConfig, model_dir: str, partitioner=None,
             eval_batches: int = 50, max_predict_examples: Optional[int] = None,
             num_decodes: int = 1, checkpoint_step: Optional[int] = None,
             output_dir: Optional[str] = None) -> Dict[str, float]:
  """Evaluates the latest checkpoint (or checkpoint_<checkpoint_step>): teacher-forced loss /
  accuracy over `eval_batches` batches (TensorBoard: MODEL_DIR/training_eval/<task>) and,
  for tasks with metrics (ROUGE, EM/F1), decodes the split (or the first
  `max_predict_examples` of each task) and logs predictions + metrics to
  MODEL_DIR/inference_eval/ (`inference_eval`). Returns the loss values and each task's
  metrics as `<task>/<name>` (with `num_examples` and `compression_ratio`).
  `output_dir` (EVAL_OUTPUT_DIR) takes training_eval/ and inference_eval/ instead of MODEL_DIR,
  which is then only read; one that cannot be written is refused before any work. A model
  at another compression ratio than the run trained at writes into <output_dir>/eval_at_C<r>/
  instead, with a note (`ratio_output_dir`)."""
  train_state.check_model_dir(model_dir, "evaluation.evaluate.model_dir")
  output_dir = output_dir or model_dir
  check_writable(output_dir, model_dir)
  output_dir = ratio_output_dir(model, eval_dataset_cfg, model_dir, output_dir)
  batches.check_count("EVAL_BATCHES (evaluation.evaluate.eval_batches)", eval_batches)
  partitioner = partitioner or partitioning.Partitioner()
  pipeline.check_feature_lengths(eval_dataset_cfg, model)
  params, step = train_state.restore_params(model, model_dir, eval_dataset_cfg, partitioner,
                                            checkpoint_step)
  result = evaluate_params(params, model, eval_dataset_cfg, partitioner, eval_batches)
  print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
  writer = metrics.MetricsWriter(output_dir)
  writer.write(training_eval_dir(eval_dataset_cfg), step, result)
  writer.close()
  if model.PREDICTS_TEXT and inference_eval.has_metrics(eval_dataset_cfg.mixture_or_task_name):
    scores = inference_eval.evaluate(model, params, eval_dataset_cfg, partitioner, output_dir,
                                     step, max_predict_examples, num_decodes)
    inference_eval.report(output_dir, step, scores)
    ratio = float(model.compression_ratio(eval_dataset_cfg.task_feature_lengths))
    for task, values in scores.items():
      result.update({f"{task}/{k}": v for k, v in dict(values, compression_ratio=ratio).items()})
  pipeline.print_data_notes()
  return result


def check_writable(output_dir: str, model_dir: str) -> None:
  """Refuses an eval output folder (or, when it does not exist yet, the folder it would be
  made in) that this process cannot write, before any model work: otherwise the metrics
  would be computed and then lost to a write error. Remote folders (gs://) are not checked."""
  if "://" in output_dir:
    return
  existing = next((p for p in (output_dir, *pathlib.Path(output_dir).parents)
                   if os.path.exists(p)), None)
  if existing is None or os.access(existing, os.W_OK | os.X_OK):
    return
  where = "" if str(existing) == output_dir else f" (its folder {existing} is not writable)"
  what = ("MODEL_DIR (evaluation.evaluate.model_dir)" if output_dir == model_dir else
          "EVAL_OUTPUT_DIR (evaluation.evaluate.output_dir)")
  raise PermissionError(
      f"{what} = {output_dir!r} is not writable{where}: eval writes inference_eval/ and "
      f"training_eval/ there. Give it a folder it can write, e.g. "
      f"--gin.EVAL_OUTPUT_DIR=\"'/tmp/my_eval'\" (the checkpoints are still read from "
      f"MODEL_DIR {model_dir}).")


def ratio_output_dir(model: BaseModel, cfg: DatasetConfig, model_dir: str,
                     output_dir: str) -> str:
  """`output_dir`, or its subfolder `eval_at_C<ratio>` when the model evaluates at another
  compression ratio than MODEL_DIR's run trained at (model_info's record), with a note:
  the results then never join the trained ratio's curves at the same step."""
  trained = model_info.trained_ratio(model_dir)
  ratio = float(model.compression_ratio(cfg.task_feature_lengths))
  if trained is None or trained == ratio:
    return output_dir
  folder = os.path.join(output_dir, f"eval_at_C{ratio:g}")
  print(f"Note: MODEL_DIR {model_dir} was trained at compression ratio C = {trained:g} "
        f"({model_info.RATIO_FILE}); this evaluation runs at C = {ratio:g}. Its results go "
        f"to {folder}/ (training_eval/, inference_eval/), apart from the run's C = "
        f"{trained:g} curves. To evaluate at the trained ratio, leave COMPRESSION_RATIO as "
        f"the run's config.gin sets it.", flush=True)
  return folder


def training_eval_dir(cfg: DatasetConfig) -> str:
  """The TensorBoard folder of the teacher-forced evaluation (T5X's training_eval/<task>)."""
  return f"training_eval/{cfg.mixture_or_task_name}"


# ------------------------------------------------------------------------------ infer
def infer(*, model: BaseModel, model_dir: str, task_feature_lengths, inputs: Sequence[str] = (),
          input_file: Optional[str] = None, input_field: str = "inputs",
          input_kind: Optional[str] = None, output_file: Optional[str] = None,
          partitioner=None, num_decodes: int = 1, batch_size: int = 32,
          checkpoint_step: Optional[int] = None) -> Sequence[str]:
  """Decodes input texts with the latest checkpoint (or checkpoint_<checkpoint_step>);
  prints and returns the outputs.

  Inputs: `inputs` (texts), and/or `input_file` (JSONL: each line's `input_field`, or with
  `input_kind` = 'summarization' / 'qa', each line's document / question + context formatted
  as that kind's tasks do). Inputs longer than task_feature_lengths['inputs'] are cut, with a
  WARNING naming the longest. `output_file` gets one JSON line per input: {"inputs",
  "prediction"}. Out of accelerator memory: `resilience.OutOfMemoryError` naming the batch's
  shapes and the bindings to lower (batch size, feature lengths, NUM_DECODES)."""
  train_state.check_model_dir(model_dir, "evaluation.infer.model_dir")
  texts = list(inputs)
  if input_file:
    texts += read_inputs(input_file, input_field, input_kind)
  if not texts:
    raise ValueError("Nothing to decode: give INFER_INPUTS=['text', ...] or "
                     "INFER_INPUT_FILE='file.jsonl'.")
  for i, text in enumerate(texts):
    if not isinstance(text, str) or not text.strip():
      raise ValueError(f"Input {i} is empty or whitespace only ({text!r}); give each input "
                       "some text to encode.")
  partitioner = partitioner or partitioning.Partitioner()
  cfg = DatasetConfig("", task_feature_lengths)
  params, _ = train_state.restore_params(model, model_dir, cfg, partitioner, checkpoint_step)
  ids = _input_ids(model.input_vocabulary, texts, task_feature_lengths["inputs"])
  with partitioner.activate():
    predict = jax.jit(functools.partial(model.predict_batch, num_decodes=num_decodes))
  outputs = []
  for start in tqdm.trange(0, len(ids), batch_size, desc="decode", disable=len(ids) <= batch_size):
    chunk = ids[start:start + batch_size]
    enc = np.zeros((batch_size, max(len(x) for x in chunk)), np.int32)
    for i, x in enumerate(chunk):
      enc[i, :len(x)] = x
    batch = {"encoder_input_tokens": enc,
             "decoder_input_tokens": np.zeros((batch_size, task_feature_lengths["targets"]),
                                              np.int32)}
    with partitioner.activate(), resilience.explain_out_of_memory(
        batch, "Decoding (infer)", infer_memory_fix(num_decodes)):
      tokens = np.asarray(predict(params, batch))[:len(chunk)]
    outputs += [token_text(model.output_vocabulary, row) for row in tokens]
  if output_file:
    write_predictions(output_file, texts, outputs)
    print(f"Wrote {len(outputs)} predictions to {output_file}.")
  else:
    for text, out in zip(texts, outputs):
      print(f"input:  {text}\noutput: {out}\n")
  return outputs


def infer_memory_fix(num_decodes: int) -> str:
  """What to lower when infer's decoding runs out of accelerator memory."""
  return (f"([batch size, length]) with NUM_DECODES = {num_decodes} decodes per input. Lower "
          "the batch size (--gin.evaluation.infer.batch_size=8), TASK_FEATURE_LENGTHS (its "
          "'inputs' and 'targets'), or NUM_DECODES (evaluation.infer.num_decodes, the beam).")


def _input_ids(vocab: seqio.Vocabulary, texts: Sequence[str], max_len: int) -> List[List[int]]:
  """Each text's ids cut to `max_len - 1`, then EOS (a WARNING says how many were cut)."""
  encoded = [list(vocab.encode(t)) for t in texts]
  cut = [i for i, x in enumerate(encoded) if len(x) > max_len - 1]
  if cut:
    longest = max(cut, key=lambda i: len(encoded[i]))
    log.warning(
        "%d of %d inputs are longer than TASK_FEATURE_LENGTHS['inputs'] = %d tokens (EOS "
        "included) and were cut to it; the longest, input %d (from 1: INFER_INPUTS, then "
        "the file's lines), has %d. Raise TASK_FEATURE_LENGTHS['inputs'] to keep more.",
        len(cut), len(texts), max_len, longest + 1, len(encoded[longest]) + 1)
  return [x[:max_len - 1] + [vocab.eos_id] for x in encoded]


# ------------------------------------------------------------------------------ texts
def token_text(vocabulary: seqio.Vocabulary, ids: Iterable[int]) -> str:
  """Text of decoded ids, up to the first EOS (padding dropped)."""
  ids = [int(i) for i in ids]
  if vocabulary.eos_id in ids:
    ids = ids[:ids.index(vocabulary.eos_id)]
  return vocabulary.decode([i for i in ids if i > 0])


def write_predictions(path: str, inputs: Sequence[str], predictions: Sequence[str]) -> None:
  """JSONL {"inputs", "prediction"} per line, written atomically."""
  fileio.write_text_atomic(path, "".join(
      json.dumps({"inputs": i, "prediction": p}, ensure_ascii=False) + "\n"
      for i, p in zip(inputs, predictions)))


def read_inputs(path: str, field: str = "inputs", kind: Optional[str] = None) -> List[str]:
  """Input texts from a JSONL file: the `field` of each line as it is or, given a task kind
  ('summarization' / 'qa'), each line's record formatted as that kind's tasks do."""
  texts = []
  with open(path, "rb") as f:  # lines decoded one by one: a bad one is named by its number
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        if kind is None:
          record = local_files.parse_line(line, local_files.Schema({field: "text"}), {})
          texts.append(record[field])
        else:
          record = local_files.parse_line(line, text_to_text.input_schema(kind), {})
          texts.append(text_to_text.format_inputs(kind, record))
      except local_files.BadRecordError as e:
        raise local_files.BadRecordError(f"{path}:{number}: {e}") from None
  if not texts:
    raise ValueError(f"{path} holds no input line.")
  return texts
