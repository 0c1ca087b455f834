"""Retrieval seqio tasks for the dual encoder, with T5X Retrieval's feature names:
`inputs` (the query), `targets` (a relevant passage) and, with hard negatives,
`negative_targets`. Each is tokenized with the model's vocabulary and ends with EOS (an empty
query or passage is EOS alone). Retrieval over a corpus is scored by indexing and searching
(`python -m decal_jax.retrieve`); for seqio's evaluator (`t5x.eval`, the model in
'similarity' mode) each task carries `InCorpusRetrieval`: its split's queries ranked
against its split's passages (`decal_jax.retrieval.seqio_metric`).

| task | splits | source |
|---|---|---|
| decal_msmarco_retrieval | train, validation | `<local dir>/msmarco/`, else TFDS beir/msmarco |
| decal_msmarco_retrieval_negatives | train, validation | `<local dir>/msmarco/` (triples) |
| decal_beir_builtin | train, validation, test | built-in corpus: section title -> paragraphs |
| decal_beir_<name> | the qrels splits | a BEIR folder (`<local dir>/beir/<name>/`, gin, code) |

MS MARCO (`<local dir>` is `downstream_tasks.local_data.directory` in gin, else
`$DECAL_LOCAL_DATA_DIR`; looked up each time the data is read). The folder holds the official
files (see `decal_jax.retrieval.beir`): collection.tsv, queries.{train,dev}.tsv,
qrels.{train,dev}.tsv (or one queries.tsv / qrels.txt for every split), and for the
negatives task triples.train.small.tsv (texts) or qidpidtriples.train.full.tsv (ids). Split
'validation' is MS MARCO's dev. Pairs: every qrels row with rel > 0. Without local files
the pairs task reads TFDS `beir/msmarco:1.0.0` (BEIR's MS MARCO passage ranking: one record
per judged (query, passage), `score`; rows with score > 0 are kept; prepare it with
`tfds build beir/msmarco`, which needs apache-beam). TFDS has no MS MARCO triples, so the
negatives task reads local files only. Its validation split has no official triples: each
dev pair gets as negative the positive passage of another dev query (a random negative).

decal_beir_builtin reads `beir.builtin_beir_folder()` (written on first read under
`$DECAL_CACHE_DIR`): the corpus is every paragraph of the built-in corpus (no titles), the
queries are section titles, and a title's relevant passages are all of its section's
paragraphs. Whole sections are split (by a hash of the title: 42 train, 6 validation, 20
test), so no paragraph of a query's section sits unjudged in the corpus.

BEIR: a task yields one (query, passage) example per qrels row with score > 0 (a query with
three relevant passages gives three); the passage text is `title. text`. `beir_folder(task)`
returns a task's folder (the index tool reads the corpus from it). Folder names become task
names with characters other than letters, digits, '_' and '.' replaced by '_'
(`trec-covid` -> `decal_beir_trec_covid`). A `dev` qrels file serves split 'validation'.

Registering a BEIR folder from a run gin (any path; done when gin finalizes the config):

    from __gin__ import dynamic_registration
    from decal_jax.tasks import retrieval_tasks
    retrieval_tasks.beir_tasks.folders = {'scifact': '/data/beir/scifact'}
    MIXTURE_OR_TASK_NAME = 'decal_beir_scifact'

(or, in a gin file without dynamic registration,
`decal_jax.tasks.retrieval_tasks.beir_tasks.folders = {...}`).
"""
import abc
import functools
import logging
import os
import pathlib
import re
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import gin
import seqio
import tensorflow as tf

from decal_jax.data import text_to_text, vocabularies
from decal_jax.retrieval import beir, msmarco
from decal_jax.retrieval.seqio_metric import InCorpusRetrieval
from decal_jax.tasks import downstream_tasks
from decal_jax.tasks.span_corruption_tasks import PreparedTfdsSource

SPLITS = ("train", "validation", "test")
MSMARCO_SPLITS = ("train", "validation")
MSMARCO_FOLDER = "msmarco"
MSMARCO_TFDS = "beir/msmarco:1.0.0"
MSMARCO_TASK = "decal_msmarco_retrieval"
MSMARCO_NEGATIVES_TASK = "decal_msmarco_retrieval_negatives"
BEIR_FOLDER = "beir"
BEIR_PREFIX = "decal_beir_"
BUILTIN_BEIR_TASK = "decal_beir_builtin"
PAIR_FEATURES = ("inputs", "targets")
TRIPLE_FEATURES = ("inputs", "targets", "negative_targets")
SHUFFLE_BUFFER = 10_000

Folder = Union[str, os.PathLike, Callable[[], str]]
ExamplesFn = Callable[[], Iterable[Tuple[str, ...]]]


# ------------------------------------------------------------------------------ sources
class TextExamplesSource(seqio.DataSource):
  """Examples of text features made by Python code: `_examples(split)` gives (a function
  returning a fresh iterable of text tuples, in `features` order; the count if known)."""

  def __init__(self, features: Sequence[str], splits: Sequence[str]):
    self.features = tuple(features)
    super().__init__(splits=tuple(splits))

  @abc.abstractmethod
  def _examples(self, split: str) -> Tuple[ExamplesFn, Optional[int]]:
    """(function yielding the split's text tuples, their number or None)."""

  @property
  def supports_arbitrary_sharding(self) -> bool:
    return True  # get_dataset shards the examples itself

  def list_shards(self, split: str) -> Sequence[str]:
    return [split]

  def num_input_examples(self, split: str) -> Optional[int]:
    return self._examples(split)[1]

  def get_dataset(self, split: str = "train", shuffle: bool = True, seed: Optional[int] = None,
                  shard_info: Optional[seqio.ShardInfo] = None, *args, **kwargs
                  ) -> tf.data.Dataset:
    examples, count = self._examples(split)
    features = self.features

    def records():
      for texts in examples():
        yield dict(zip(features, texts))
    signature = {f: tf.TensorSpec([], tf.string) for f in features}
    ds = tf.data.Dataset.from_generator(records, output_signature=signature)
    if shard_info is not None and shard_info.num_shards > 1:
      ds = ds.shard(shard_info.num_shards, shard_info.index)
    if shuffle:
      ds = ds.shuffle(max(1, min(count or SHUFFLE_BUFFER, SHUFFLE_BUFFER)), seed=seed)
    return ds


class BeirSource(TextExamplesSource):
  """(query, relevant passage) pairs of a BEIR folder's qrels (score > 0). `folder` may be
  a function, called each time the data is read (the built-in folder is written then)."""

  def __init__(self, folder: Folder, splits: Sequence[str]):
    self._folder = folder
    self._cache: Dict[Tuple[str, str], List[Tuple[str, str]]] = {}
    super().__init__(PAIR_FEATURES, splits)

  @property
  def folder(self) -> str:
    return self._folder() if callable(self._folder) else str(self._folder)

  def _examples(self, split: str) -> Tuple[ExamplesFn, Optional[int]]:
    key = (self.folder, split)
    if key not in self._cache:
      data = beir.load_beir(key[0], split)
      self._cache[key] = [(data.queries[q], data.corpus[d].full_text)
                          for q, d in data.positive_pairs()]
    pairs = self._cache[key]
    return (lambda: iter(pairs)), len(pairs)


class MsMarcoLocalSource(TextExamplesSource):
  """An MS MARCO passage folder: pairs of a split's qrels, or triples (train: the triples
  file; validation: dev pairs, each with another dev query's positive as its negative)."""

  def __init__(self, folder: pathlib.Path, triples: bool):
    self.folder, self.triples = folder, triples
    super().__init__(TRIPLE_FEATURES if triples else PAIR_FEATURES, MSMARCO_SPLITS)

  def _examples(self, split: str) -> Tuple[ExamplesFn, Optional[int]]:
    if split not in MSMARCO_SPLITS:
      raise ValueError(f"MS MARCO splits are {MSMARCO_SPLITS} ('validation' is dev), got "
                       f"{split!r}.")
    if self.triples and split == "train":
      msmarco.triples(self.folder)  # finds the files now: a missing one fails here
      return (lambda: msmarco.triples(self.folder)), None
    msmarco.pairs(self.folder, split)  # likewise
    if self.triples:
      return (lambda: other_query_negatives(msmarco.pairs(self.folder, split))), None
    return (lambda: msmarco.pairs(self.folder, split)), None


def other_query_negatives(pairs: Iterable[Tuple[str, str]]) -> List[Tuple[str, str, str]]:
  """(query, positive) pairs -> (query, positive, negative) where the negative is the
  positive of the pair half the list away, moved on until its query differs."""
  pairs = list(pairs)
  n = len(pairs)
  out = []
  for i, (query, positive) in enumerate(pairs):
    j = next((k % n for k in range(i + n // 2, i + n // 2 + n) if pairs[k % n][0] != query),
             None)
    if j is None:
      raise ValueError("Negatives from other queries need pairs of at least two queries; "
                       f"got {n} pair(s) of one query.")
    out.append((query, positive, pairs[j][1]))
  return out


def _tfds_pairs(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """TFDS beir/msmarco records -> {'inputs': query, 'targets': passage}, score > 0 only."""
  dataset = dataset.filter(lambda ex: ex["score"] > 0)
  return dataset.map(lambda ex: {"inputs": ex["query"], "targets": ex["passage"]},
                     num_parallel_calls=tf.data.AUTOTUNE)


class MsMarcoSource(downstream_tasks.LocalFirstSource):
  """`<local dir>/msmarco/` when it exists, else (pairs only) TFDS `beir/msmarco`."""
  folder_name = MSMARCO_FOLDER

  def __init__(self, triples: bool):
    self.triples = triples
    self.task_name = MSMARCO_NEGATIVES_TASK if triples else MSMARCO_TASK
    self._tfds = None if triples else PreparedTfdsSource(
        MSMARCO_TFDS, splits={s: s for s in MSMARCO_SPLITS})
    self._local: Dict[str, MsMarcoLocalSource] = {}
    super().__init__(splits=MSMARCO_SPLITS)

  def _open_local(self, folder: pathlib.Path) -> seqio.DataSource:
    if str(folder) not in self._local:
      self._local[str(folder)] = MsMarcoLocalSource(folder, self.triples)
    return self._local[str(folder)]

  def _no_data_message(self) -> str:
    directory = downstream_tasks.local_data()[0] or "<dir>"
    files = (f"{msmarco.TEXT_TRIPLES} (query<TAB>positive<TAB>negative) or "
             f"{msmarco.ID_TRIPLES} with collection.tsv and queries.train.tsv; for "
             "validation also queries.dev.tsv and qrels.dev.tsv" if self.triples else
             "collection.tsv, queries.train.tsv, queries.dev.tsv, qrels.train.tsv, "
             "qrels.dev.tsv")
    tfds = ("TFDS has no MS MARCO triples" if self.triples else
            f"or prepare TFDS {MSMARCO_TFDS} (`tfds build beir/msmarco`)")
    return (f"{self.task_name}: no MS MARCO data. Put the official files ({files}) in "
            f"{directory}/{MSMARCO_FOLDER}/ and set DECAL_LOCAL_DATA_DIR (or gin "
            f"downstream_tasks.local_data.directory) to {directory}; {tfds}.")

  def _local_files_hint(self, split: str) -> str:
    del split
    return self._no_data_message()

  def _from_tfds(self, ds: tf.data.Dataset) -> tf.data.Dataset:
    return _tfds_pairs(ds)


# ------------------------------------------------------------------------------ registration
def _register(name: str, source: seqio.DataSource, features: Sequence[str]) -> seqio.Task:
  """Registers (or replaces) a retrieval task: texts -> ids of the model's vocabulary + EOS."""
  vocabulary = vocabularies.deferred_vocabulary()
  output_features = {f: seqio.Feature(vocabulary, add_eos=True, required=True)
                     for f in features}
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name, source=source, output_features=output_features, metric_fns=[],
      metric_objs=[InCorpusRetrieval()],
      preprocessors=[seqio.preprocessors.tokenize,
                     functools.partial(text_to_text.trim_and_count, task_name=name),
                     seqio.preprocessors.append_eos_after_trim])


_BEIR_FOLDERS: Dict[str, Folder] = {}


def beir_task_name(name: str) -> str:
  """'trec-covid' -> 'decal_beir_trec_covid' (seqio names allow letters, digits, _ and .)."""
  return BEIR_PREFIX + re.sub(r"[^\w.]", "_", name)


def _task_splits(folder: pathlib.Path) -> List[str]:
  present = beir.qrels_splits(folder)
  if not present:
    raise beir.MissingRetrievalFileError(
        f"{folder / beir.QRELS_DIR}: no qrels/<split>.tsv file; {beir.BEIR_LAYOUT}.")
  splits = sorted({"validation" if s == "dev" else s for s in present})
  return [s for s in SPLITS if s in splits] + [s for s in splits if s not in SPLITS]


def register_beir_task(name: str, folder: Folder) -> seqio.Task:
  """Registers (or replaces) `decal_beir_<name>` over a BEIR folder: one (query, passage)
  example per qrels pair with score > 0. A path is checked now and gives the task its qrels
  splits; a function returning the path is called when data is read (splits SPLITS)."""
  task_name = beir_task_name(name)
  if callable(folder):
    splits = list(SPLITS)
  else:
    folder = str(pathlib.Path(folder).expanduser())
    beir.check_beir_folder(pathlib.Path(folder))
    splits = _task_splits(pathlib.Path(folder))
  _BEIR_FOLDERS[task_name] = folder
  return _register(task_name, BeirSource(folder, splits), PAIR_FEATURES)


def beir_task_names() -> List[str]:
  """The registered BEIR tasks (`decal_beir_<name>`), sorted."""
  return sorted(_BEIR_FOLDERS)


def beir_folder(task_name: str) -> str:
  """The BEIR folder of a registered `decal_beir_*` task (the built-in one is written on
  first call)."""
  if task_name not in _BEIR_FOLDERS:
    raise ValueError(
        f"{task_name!r} is not a registered BEIR task; registered: {sorted(_BEIR_FOLDERS)}. "
        "Register a folder with retrieval_tasks.register_beir_task(name, folder), gin "
        "`retrieval_tasks.beir_tasks.folders = {name: folder}`, or put it in "
        f"<local dir>/{BEIR_FOLDER}/<name>/; or pass the folder itself (BEIR_FOLDER).")
  folder = _BEIR_FOLDERS[task_name]
  return folder() if callable(folder) else folder


def register_local_beir_tasks() -> List[str]:
  """Registers `decal_beir_<name>` for every folder `<local dir>/beir/<name>/` (a folder
  that is not in the BEIR layout is skipped with a warning); returns the task names."""
  directory = downstream_tasks.local_data()[0]
  root = pathlib.Path(directory).expanduser() / BEIR_FOLDER if directory else None
  if root is None or not root.is_dir():
    return []
  names = []
  for folder in sorted(p for p in root.iterdir() if p.is_dir()):
    try:
      names.append(register_beir_task(folder.name, folder).name)
    except beir.BadRetrievalFileError as e:
      logging.warning("Not registering %s as a BEIR task: %s", folder, e)
  return names


@gin.configurable
def beir_tasks(folders: Optional[Mapping[str, str]] = None) -> List[str]:
  """Registers `decal_beir_<name>` for each {name: BEIR folder}; returns the task names.
  Bound in gin, it runs when the config is finalized (see the module docstring)."""
  return [register_beir_task(name, folder).name for name, folder in (folders or {}).items()]


@gin.config.register_finalize_hook
def _register_from_gin(unused_config) -> None:
  """When gin finalizes: the BEIR folders bound to `beir_tasks.folders`, and those under the
  local directory (which gin may have just bound)."""
  beir_tasks()
  register_local_beir_tasks()


def register_all() -> None:
  _register(MSMARCO_TASK, MsMarcoSource(triples=False), PAIR_FEATURES)
  _register(MSMARCO_NEGATIVES_TASK, MsMarcoSource(triples=True), TRIPLE_FEATURES)
  register_beir_task("builtin", beir.builtin_beir_folder)
  register_local_beir_tasks()


register_all()
