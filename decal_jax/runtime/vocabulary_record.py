"""MODEL_DIR/vocabulary.json: which vocabulary a run's checkpoints were trained with.

A checkpoint holds ids, and the embedding table has the same shape under any vocabulary of
the same size (the built-in recipes 'chars' and 'bytes' both give 4224 rows), so a run read
with another vocabulary decodes wrong text without any error. The trainer records the
identity of the model's input and output vocabularies (`seqio_vocabularies.vocabulary_identity`:
class, file, sha256 of the SentencePiece model, size, built-in recipe) before its first
checkpoint; resume, eval, infer, `gin_utils.load_model` and a run started from it
(INITIAL_CHECKPOINT_PATH, `check_initial`) compare the vocabulary they are
given with it and refuse another one, naming both and the fix. A MODEL_DIR with checkpoints
but no record (a run from before the record) gets a WARNING and is left as it is: a record
written then would only enshrine whichever vocabulary this run happens to be given.
"""
import json
import logging
import pathlib
import re
from typing import Any, Dict, Optional

import jax

from decal_jax import fileio

FILENAME = "vocabulary.json"


class VocabularyMismatchError(ValueError):
  """MODEL_DIR was trained with another vocabulary than the one given (both named)."""


def model_record(model) -> Dict[str, Any]:
  """The record of `model`'s vocabularies: {'features': {'inputs': identity, 'targets': ...}}."""
  # seqio / TensorFlow only now: train_state imports this module on images without them.
  from decal_jax.data import seqio_vocabularies
  identity = seqio_vocabularies.vocabulary_identity
  return {"features": {"inputs": identity(model.input_vocabulary),
                       "targets": identity(model.output_vocabulary)}}


def _has_checkpoints(model_dir: pathlib.Path) -> bool:
  return model_dir.is_dir() and any(
      re.fullmatch(r"checkpoint_\d+", p.name) for p in model_dir.iterdir() if p.is_dir())


def check(model_dir: str, model) -> Optional[Dict[str, Any]]:
  """Refuses a MODEL_DIR recorded with other vocabularies than `model`'s
  (VocabularyMismatchError); warns for one with checkpoints and no record. Returns the
  record to `write` before the first checkpoint when MODEL_DIR has neither (a new run),
  else None. Writes nothing."""
  path = fileio.as_path(model_dir) / FILENAME
  current = model_record(model)
  if not path.exists():
    if not _has_checkpoints(fileio.as_path(model_dir)):
      return current
    logging.warning(
        "%s does not record the vocabulary its checkpoints were trained with (no %s: a run "
        "from before the record). They are read with this run's vocabulary, unchecked. "
        "Runs of the built-in vocabulary from before its byte-fallback recipe used the "
        "earlier one: set DECAL_BUILTIN_VOCAB=chars for them.", model_dir, FILENAME)
    return None
  recorded = _read(path)
  for feature, identity in current["features"].items():
    if feature in recorded and _key(recorded[feature]) != _key(identity):
      raise VocabularyMismatchError(
          f"{model_dir} was trained with another {feature} vocabulary than this run's: "
          f"{path.name} records {_describe(recorded[feature])}, this run has "
          f"{_describe(identity)}. Its checkpoints' ids would be read as other text. "
          f"{_fix(recorded[feature], identity)}, or give another MODEL_DIR for a run of this "
          "vocabulary.")
  return None


def check_initial(checkpoint_path: str, model) -> None:
  """Refuses to start a run from INITIAL_CHECKPOINT_PATH (a decal_jax MODEL_DIR or one of its
  checkpoint_<step> folders) recorded with other vocabularies than `model`'s: embedding
  tables are padded to a multiple of 128 rows, so another vocabulary's table usually has the
  same shape, is restored, and its rows read as other text. A checkpoint without a record
  (a T5X checkpoint, an older run) is not checked."""
  path = fileio.as_path(checkpoint_path)
  run_dir = path.parent if re.fullmatch(r"checkpoint_\d+", path.name) else path
  if not (run_dir / FILENAME).exists():
    return
  recorded = _read(run_dir / FILENAME)
  for feature, identity in model_record(model)["features"].items():
    if feature in recorded and _key(recorded[feature]) != _key(identity):
      raise VocabularyMismatchError(
          f"INITIAL_CHECKPOINT_PATH {checkpoint_path} was trained with another {feature} "
          f"vocabulary than this run's: {FILENAME} records {_describe(recorded[feature])}, "
          f"this run has {_describe(identity)}. Its embedding rows would be restored and read "
          f"as other text. {_fix(recorded[feature], identity)}.")


def _read(path: pathlib.Path) -> Dict[str, Any]:
  try:
    return json.loads(fileio.read_utf8(path))["features"]
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}): restore it from a copy of "
                     "the run, or delete it to read the checkpoints unchecked.") from None


def write(model_dir: str, record: Dict[str, Any]) -> None:
  """Writes MODEL_DIR/vocabulary.json atomically (process 0 of a multi-host run)."""
  if jax.process_index() == 0:
    fileio.write_text_atomic(fileio.join(model_dir, FILENAME),
                             json.dumps(record, indent=2, sort_keys=True) + "\n")


def _key(identity: Dict[str, Any]):
  """Equal for vocabularies that map ids to the same text (file names and places aside)."""
  return identity.get("sha256") or identity["class"], identity["vocab_size"]


def _describe(identity: Dict[str, Any]) -> str:
  what = (f"the built-in vocabulary, recipe {identity['recipe']!r}" if "recipe" in identity
          else identity["class"])
  file = f"{identity['file']}, " if "file" in identity else ""
  digest = f"sha256 {identity['sha256'][:12]}, " if "sha256" in identity else ""
  return f"{what} ({file}{digest}{identity['vocab_size']} ids)"


def _fix(recorded: Dict[str, Any], current: Dict[str, Any]) -> str:
  if "recipe" in recorded and recorded["recipe"] != current.get("recipe"):
    return (f"Fix: read it with the built-in vocabulary of recipe {recorded['recipe']!r}: set "
            f"DECAL_BUILTIN_VOCAB={recorded['recipe']} (with VOCABULARY = "
            "@vocabularies.builtin_vocabulary())")
  if "recipe" in recorded:  # same recipe, another built-in corpus (another Python's docs)
    return (f"Fix: copy {recorded['file']} from the machine that trained it and point "
            "DECAL_T5_VOCAB at the copy, with VOCABULARY = @vocabularies.t5_vocabulary()")
  if "file" in recorded:
    return (f"Fix: point the vocabulary's path back at the file it was trained with, "
            f"{recorded['file']} (sha256 {recorded['sha256'][:12]}): DECAL_T5_VOCAB, "
            "`vocabularies.t5_vocabulary.path` or the tokenizer binding of the model's gin")
  return f"Fix: give the model a {recorded['class']} of {recorded['vocab_size']} ids again"
