"""Downstream seqio tasks: long-document summarization and question answering.

| task | TFDS (read-only; prepare with `tfds build`) | local JSONL fields (default) |
|---|---|---|
| decal_cnn_dailymail | cnn_dailymail:3.4.0 | article, highlights |
| decal_arxiv | scientific_papers/arxiv:1.1.1 | article_text, abstract_text |
| decal_pubmed | scientific_papers/pubmed:1.1.1 | article_text, abstract_text |
| decal_mediasum | media_sum:1.0.0 (manual download) | document, summary |
| decal_squad | squad/v1.1:3.0.0 | question, context, answers |
| decal_triviaqa | trivia_qa/rc:1.1.0 | question, context, answers |
| decal_hotpotqa | (not in TFDS: local files only) | question, context, answers |
| decal_builtin_qa | the built-in corpus (no download) | - |

Local files win over TFDS: a task reads `<dir>/<name>/<split>.jsonl` (name = the task name
without `decal_`; splits train / validation / test) when that folder exists, where `<dir>` is
`downstream_tasks.local_data.directory` (gin) or `$DECAL_LOCAL_DATA_DIR`. A text field may
also be a list of strings (joined with newlines); `answers` may be one string or a list.
`python -m decal_jax.commands.prepare_jsonl` writes this layout from the official SQuAD, HotpotQA and
MediaSum releases. Your own dataset: `register_jsonl_task(...)`.

Summarization: 'summarize: <document>' -> summary, ROUGE-1/2/L/Lsum. QA: 'question: <q>
context: <c>' -> first answer, exact match / F1 against every answer. Every task tokenizes
with `vocabularies.task_vocabulary()` (the model's VOCABULARY under our gin files).
"""
import abc
import dataclasses
import pathlib
from typing import Callable, Dict, Mapping, Optional

import gin
import seqio
import tensorflow as tf

from decal_jax import settings
from decal_jax import text_metrics
from decal_jax.data import corpus, local_files, text_to_text, vocabularies
from decal_jax.tasks.span_corruption_tasks import PreparedTfdsSource

SPLITS = ("train", "validation", "test")


@gin.configurable
def local_data(directory: Optional[str] = None, bad_lines: Optional[str] = None):
  """(folder of local JSONL datasets, bad-line policy), read each time a task is read:
  gin bindings, else $DECAL_LOCAL_DATA_DIR / $DECAL_BAD_LINES, else (None, 'fail')."""
  return (directory or settings.get("DECAL_LOCAL_DATA_DIR"),
          bad_lines or settings.get("DECAL_BAD_LINES"))


def local_split_files(folder_name: str, suffix: str):
  """(<local dir>/<folder_name> or None, {split: path} of the `<split><suffix>` files there)."""
  directory, _ = local_data()
  folder = pathlib.Path(directory).expanduser() / folder_name if directory else None
  files = ({s: str(folder / f"{s}{suffix}") for s in SPLITS if (folder / f"{s}{suffix}").exists()}
           if folder else {})
  return folder, files


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Where one downstream dataset comes from, mapped to the task kind's record layout."""
  name: str                     # decal_<name>; also the local folder name
  kind: str                     # 'summarization' | 'qa'
  tfds_name: Optional[str]      # None: local files only
  tfds_map: Optional[Callable[[Dict[str, tf.Tensor]], Dict[str, tf.Tensor]]] = None
  tfds_splits: Mapping[str, str] = dataclasses.field(
      default_factory=lambda: {"train": "train", "validation": "validation", "test": "test"})
  local_fields: Mapping[str, str] = dataclasses.field(default_factory=dict)


class LocalFirstSource(local_files.DeferredSource):
  """Local files in `<local dir>/<folder_name>/` when that folder exists, else a TFDS
  dataset (`self._tfds`, None where TFDS has none). The choice is made each time data is
  read, so gin bindings made after import count. Subclasses say how to open the folder,
  what to tell a user who has neither, and how TFDS records become the task's."""
  folder_name: str
  _tfds: Optional[seqio.DataSource]

  def local_folder(self) -> Optional[pathlib.Path]:
    directory, _ = local_data()
    folder = pathlib.Path(directory).expanduser() / self.folder_name if directory else None
    return folder if folder is not None and folder.is_dir() else None

  @abc.abstractmethod
  def _open_local(self, folder: pathlib.Path) -> seqio.DataSource:
    """The source over the local folder (cached by the subclass)."""

  @abc.abstractmethod
  def _no_data_message(self) -> str:
    """Why there is nothing to read: no local folder and no TFDS dataset."""

  @abc.abstractmethod
  def _local_files_hint(self, split: str) -> str:
    """Where local files would go, added to TFDS's own error."""

  def _from_tfds(self, ds: tf.data.Dataset) -> tf.data.Dataset:
    return ds

  def _source(self) -> seqio.DataSource:
    folder = self.local_folder()
    if folder is not None:
      return self._open_local(folder)
    if self._tfds is None:
      raise FileNotFoundError(self._no_data_message())
    return self._tfds

  def get_dataset(self, split: str = "train", shuffle: bool = True, seed: Optional[int] = None,
                  shard_info: Optional[seqio.ShardInfo] = None, *args, **kwargs):
    source = self._source()
    try:
      ds = source.get_dataset(split, shuffle=shuffle, seed=seed, shard_info=shard_info)
    except FileNotFoundError as e:
      if source is self._tfds:
        raise FileNotFoundError(f"{e}\nOr use local files: {self._local_files_hint(split)}") from e
      raise
    return self._from_tfds(ds) if source is self._tfds else ds


class LocalOrTfdsSource(LocalFirstSource):
  """A downstream dataset: local JSONL files when `<local dir>/<name>/` exists, else its
  TFDS dataset. `task_name` (default decal_<name>) is the name its error messages give."""

  def __init__(self, dataset: Dataset, task_name: Optional[str] = None):
    self.dataset, self.task_name = dataset, task_name or f"decal_{dataset.name}"
    self.folder_name = dataset.name
    self._tfds = (PreparedTfdsSource(dataset.tfds_name, splits=dict(dataset.tfds_splits))
                  if dataset.tfds_name else None)
    self._local: Dict[tuple, local_files.JsonlSource] = {}
    super().__init__(splits=SPLITS)

  def _open_local(self, folder: pathlib.Path) -> seqio.DataSource:
    key = (str(folder), local_data()[1])
    if key not in self._local:
      files = {s: str(folder / f"{s}.jsonl") for s in SPLITS if (folder / f"{s}.jsonl").exists()}
      schema = local_files.Schema(text_to_text.KINDS[self.dataset.kind])
      self._local[key] = local_files.JsonlSource(files, schema, self.dataset.local_fields,
                                                 bad_lines=key[1])
    return self._local[key]

  def _no_data_message(self) -> str:
    directory = local_data()[0] or "$DECAL_LOCAL_DATA_DIR"
    return (f"{self.task_name} reads local files only (it is not in TFDS): put "
            f"train.jsonl / validation.jsonl in {directory}/{self.dataset.name}/ (fields "
            f"{list(text_to_text.KINDS[self.dataset.kind])}; decal_jax/commands/prepare_jsonl.py converts the "
            "official release) and set DECAL_LOCAL_DATA_DIR or "
            "downstream_tasks.local_data.directory.")

  def _local_files_hint(self, split: str) -> str:
    return (f"put {split}.jsonl (fields {list(text_to_text.KINDS[self.dataset.kind])}) in "
            f"<dir>/{self.dataset.name}/ and set DECAL_LOCAL_DATA_DIR=<dir>.")

  def _from_tfds(self, ds: tf.data.Dataset) -> tf.data.Dataset:
    if self.dataset.tfds_map is None:
      return ds
    return ds.map(self.dataset.tfds_map, num_parallel_calls=tf.data.AUTOTUNE)


# ------------------------------------------------------------------------------ TFDS layouts
def _strip_sentence_tags(text: tf.Tensor) -> tf.Tensor:
  """'<S> a . </S> <S> b . </S>' -> 'a . b .' (the arXiv / PubMed abstracts' markup)."""
  text = tf.strings.regex_replace(text, r"</?S>", " ")
  return tf.strings.strip(tf.strings.regex_replace(text, r"\s+", " "))


def _cnn_dailymail(ex):
  return {"document": ex["article"], "summary": ex["highlights"]}


def _scientific_papers(ex):
  return {"document": ex["article"], "summary": _strip_sentence_tags(ex["abstract"])}


def _media_sum(ex):
  turns = tf.strings.join([ex["speaker"], ex["utt"]], separator=": ")
  return {"document": tf.strings.reduce_join(turns, separator="\n"), "summary": ex["summary"]}


def _squad(ex):
  return {"question": ex["question"], "context": ex["context"],
          "answers": ex["answers"]["text"]}


def _trivia_qa(ex):
  """Context = the Wikipedia pages, then the web search results (as T5's TriviaQA tasks)."""
  context = tf.strings.reduce_join(
      tf.concat([ex["entity_pages"]["wiki_context"], ex["search_results"]["search_context"]], 0),
      separator="\n")
  answer = ex["answer"]
  return {"question": ex["question"], "context": context,
          "answers": tf.concat([[answer["value"]], answer["aliases"]], 0)}


DATASETS = (
    Dataset("cnn_dailymail", "summarization", "cnn_dailymail:3.4.0", _cnn_dailymail,
            local_fields={"document": "article", "summary": "highlights"}),
    Dataset("arxiv", "summarization", "scientific_papers/arxiv:1.1.1", _scientific_papers,
            local_fields={"document": "article_text", "summary": "abstract_text"}),
    Dataset("pubmed", "summarization", "scientific_papers/pubmed:1.1.1", _scientific_papers,
            local_fields={"document": "article_text", "summary": "abstract_text"}),
    Dataset("mediasum", "summarization", "media_sum:1.0.0", _media_sum,
            tfds_splits={"train": "train", "validation": "val", "test": "test"}),
    Dataset("squad", "qa", "squad/v1.1:3.0.0", _squad,
            tfds_splits={"train": "train", "validation": "validation"}),
    Dataset("triviaqa", "qa", "trivia_qa/rc:1.1.0", _trivia_qa),
    Dataset("hotpotqa", "qa", None),
)


# ------------------------------------------------------------------------------ registration
def _metric_fns(kind: str):
  return [text_metrics.rouge] if kind == "summarization" else [text_metrics.squad]


def register_task(name: str, kind: str, source: seqio.DataSource,
                  vocabulary: Optional[seqio.Vocabulary] = None) -> seqio.Task:
  """Registers (or replaces) a text-to-text task of `kind` over a source that yields the
  kind's record layout (text_to_text.SUMMARIZATION / QA)."""
  if kind not in text_to_text.KINDS:
    raise ValueError(f"kind must be one of {sorted(text_to_text.KINDS)}, got {kind!r}.")
  vocabulary = vocabulary or vocabularies.deferred_vocabulary()
  features = {"inputs": seqio.Feature(vocabulary, add_eos=True, required=True),
              "targets": seqio.Feature(vocabulary, add_eos=True, required=True)}
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  preprocessors = list(text_to_text.preprocessors(kind, name))
  if kind == "summarization" and name in ("decal_arxiv", "decal_pubmed"):
    preprocessors.insert(0, _clean_abstracts)
  return seqio.TaskRegistry.add(
      name, source=source, preprocessors=preprocessors, output_features=features,
      postprocess_fn=text_to_text.references, metric_fns=_metric_fns(kind))


def _clean_abstracts(dataset: tf.data.Dataset) -> tf.data.Dataset:
  return dataset.map(lambda ex: dict(ex, summary=_strip_sentence_tags(ex["summary"])))


def register_jsonl_task(name: str, kind: str, split_files: Mapping[str, str],
                        fields: Optional[Mapping[str, str]] = None, bad_lines: str = "fail",
                        vocabulary: Optional[seqio.Vocabulary] = None) -> seqio.Task:
  """Your own dataset as a task: {split: JSONL path or glob}; `fields` maps the kind's
  names (document/summary or question/context/answers) to the keys in your files."""
  schema = local_files.Schema(text_to_text.KINDS[kind])
  source = local_files.JsonlSource(split_files, schema, fields, bad_lines=bad_lines)
  return register_task(name, kind, source, vocabulary)


# ------------------------------------------------------------------------------ built-in QA
BUILTIN_QA_TASK = "decal_builtin_qa"
BUILTIN_QA_QUESTION = "Which section of the Python language reference is this from?"


def _builtin_qa_dataset(split: str, shuffle_files: bool, seed: Optional[int] = None):
  records = corpus.titled_documents()[split]
  ds = tf.data.Dataset.from_tensor_slices({
      "question": [BUILTIN_QA_QUESTION] * len(records),
      "context": [r["text"] for r in records],
      "answers": tf.ragged.constant([[r["title"], r["topic"]] for r in records])})
  return ds.shuffle(len(records), seed=seed) if shuffle_files else ds


def register_builtin_qa() -> seqio.Task:
  """`decal_builtin_qa`: a built-in-corpus paragraph -> the title of its reference section
  (references: the title and the topic name), so fine-tuning runs with no download."""
  source = seqio.FunctionDataSource(_builtin_qa_dataset, splits=corpus.SPLITS)
  return register_task(BUILTIN_QA_TASK, "qa", source)


def register_all() -> None:
  for dataset in DATASETS:
    register_task(f"decal_{dataset.name}", dataset.kind, LocalOrTfdsSource(dataset))
  register_builtin_qa()


register_all()
