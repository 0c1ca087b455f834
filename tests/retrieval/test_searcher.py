"""The text-query Searcher (runtime/searcher.py) against `python -m decal_jax.retrieve`.

A tiny dual encoder is fine-tuned for two steps on the BEIR fixture of
test_retrieval_e2e.py and its corpus indexed by the retrieve command; the Searcher, opened
on the same MODEL_DIR, must return the command's TREC run for the same queries (ids and
scores: the same documents in the same order, the scores to float32 rounding, since the
Searcher pads a batch of queries to its height and the command to the full batch, and XLA
sums in another order at another height), for exact, residual and sharded indexes, and
refuse an index of another encoder config or another corpus. `build_model_dir` is shared
with tests/test_serve.py.
"""
import pathlib
import types

import gin
import numpy as np
import pytest

import tolerances
from decal_jax.retrieval import beir, index_files, ir_metrics
from decal_jax.runtime import gin_utils, searcher as searcher_lib, trainer

COMMON = ["models/decal_tiny.gin", "models/dual_encoder.gin"]
BINDINGS = ["PROJECTION_DIM = 32"]
QUERY_LENGTH = 16
TOP_K = 10
EXACT_STEM = "beir_fixture.test.step2"
APPROX = ["--gin.SEARCH='approximate'", "--gin.RESIDUAL_BITS=None", "--gin.NPROBE=100000",
          "--gin.CANDIDATES=100000"]
APPROX_STEM = f"{EXACT_STEM}.approximate-numpy-bnone-nprobe100000-query32-candidates100000"


def _e2e():
  """test_retrieval_e2e.py (its fixture writer and pretrained checkpoint), by path."""
  import importlib.util
  path = pathlib.Path(__file__).resolve().parent / "test_retrieval_e2e.py"
  spec = importlib.util.spec_from_file_location("_searcher_e2e_helpers", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def build_model_dir(root: pathlib.Path):
  """A dual encoder fine-tuned 2 steps on the BEIR fixture, its exact index built by the
  retrieve command; -> namespace(model_dir, folder, corpus, queries, retrieve_args)."""
  from decal_jax import retrieve
  from decal_jax.tasks import retrieval_tasks
  e2e = _e2e()
  folder = root / "beir_fixture"
  corpus, queries, _ = e2e._write_fixture(folder)
  retrieval_tasks.register_beir_task("fixture", str(folder))
  e2e._pretrained_checkpoint(root / "pretrained")
  model_dir = root / "dual"
  gin_utils.parse(COMMON + ["runs/retrieval_finetune.gin"], [], BINDINGS + [
      f"MODEL_DIR = '{model_dir}'", f"INITIAL_CHECKPOINT_PATH = '{root / 'pretrained'}'",
      "MIXTURE_OR_TASK_NAME = 'decal_beir_fixture'", "TRAIN_STEPS = 2", "BATCH_SIZE = 8",
      "TASK_FEATURE_LENGTHS = {'inputs': 16, 'targets': 48}", "LEARNING_RATE = 0.01",
      "EVAL_PERIOD = 2", "EVAL_BATCHES = 1", "LOG_PERIOD = 2", "CHECKPOINT_PERIOD = 2"])
  gin.get_configurable(trainer.train)()
  gin.clear_config()
  args = [f"--gin_file={f}" for f in COMMON + ["runs/retrieve.gin"]] + [
      f"--gin.MODEL_DIR='{model_dir}'", f"--gin.BEIR_FOLDER='{folder}'",
      f"--gin.TOP_K={TOP_K}", f"--gin.QUERY_LENGTH={QUERY_LENGTH}", "--gin.PASSAGE_LENGTH=48",
      "--gin.PROJECTION_DIM=32"]
  retrieve.main(args)
  gin.clear_config()
  return types.SimpleNamespace(model_dir=model_dir, folder=folder, corpus=corpus,
                               queries=queries, retrieve_args=args)


def open_searcher(built, **kwargs) -> searcher_lib.Searcher:
  kwargs.setdefault("bindings", BINDINGS)
  return searcher_lib.Searcher.open(str(built.model_dir), gin_files=COMMON,
                                    query_length=QUERY_LENGTH, **kwargs)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  return build_model_dir(tmp_path_factory.mktemp("searcher"))


def _test_queries(built):
  data = beir.load_beir(built.folder, "test")
  return list(data.queries), [data.queries[q] for q in data.queries]


def _as_run(qids, results):
  return {q: dict(zip(r.doc_ids, r.scores)) for q, r in zip(qids, results)}


def _ranked(run):
  return {q: [(d, docs[d]) for d in ir_metrics.rank(docs)] for q, docs in run.items()}


def _same_run(got, expected, searcher):
  """The same documents in the same order for every query, scores equal to the rounding of
  two float32 runs of the query encoder (its stack, the projection, MaxSim's sums)."""
  ranked_got, ranked_expected = _ranked(got), _ranked(expected)
  assert {q: [d for d, _ in r] for q, r in ranked_got.items()} == {
      q: [d for d, _ in r] for q, r in ranked_expected.items()}
  encoder = searcher.model.module.config.encoder
  reductions = tolerances.stack_reductions(encoder, QUERY_LENGTH, encoder.num_encoder_layers)
  for q, ranked in ranked_expected.items():
    want = np.array([score for _, score in ranked])
    np.testing.assert_allclose([score for _, score in ranked_got[q]], want, rtol=0,
                               atol=tolerances.network_atol(want, reductions + [
                                   encoder.emb_dim, QUERY_LENGTH]))


def test_results_equal_the_retrieve_commands_run(built):
  searcher = open_searcher(built, corpus=str(built.folder))
  qids, texts = _test_queries(built)
  expected = ir_metrics.read_trec_run(str(built.model_dir / "retrieval" / f"{EXACT_STEM}.trec"))
  results = searcher.search(texts, k=TOP_K, texts=True)
  _same_run(_as_run(qids, results), expected, searcher)
  assert [r.query for r in results] == texts
  assert results[0].texts == [built.corpus[d].full_text for d in results[0].doc_ids]
  one = searcher.search(texts[:1], k=3)  # a batch of one: the same top 3
  assert one[0].doc_ids == results[0].doc_ids[:3]
  assert one[0].scores == pytest.approx(results[0].scores[:3], rel=1e-6)
  assert searcher.search([], k=3) == []
  info = searcher.info()
  assert (info["index_kind"], info["search"], info["num_docs"]) == ("exact", "exact",
                                                                    len(built.corpus))
  assert info["passage_compression_ratio"] >= 1 and info["corpus_fingerprint"]["num_docs"]
  with pytest.raises(ValueError, match="k = 0"):
    searcher.search(texts, k=0)


def test_residual_and_sharded_indexes_equal_their_runs(built):
  from decal_jax import retrieve
  retrieve.main(built.retrieve_args + APPROX)
  gin.clear_config()
  retrieve.main(built.retrieve_args + ["--gin.SHARD_DOCS=8"])
  gin.clear_config()
  qids, texts = _test_queries(built)
  runs = built.model_dir / "retrieval"
  with pytest.raises(ValueError, match="indexes of checkpoint 2"):
    open_searcher(built)  # three indexes now: which one is for the caller to say
  for folder, stem, kind, extra in (
      ("beir_fixture.step2.residual-bnone", APPROX_STEM, "residual",
       dict(nprobe=100000, candidates=100000)),
      ("beir_fixture.step2.shards", f"{EXACT_STEM}.shards", "sharded-exact", {})):
    searcher = open_searcher(built, index_dir=str(built.model_dir / "index" / folder), **extra)
    assert searcher.kind == kind
    expected = ir_metrics.read_trec_run(str(runs / f"{stem}.trec"))
    _same_run(_as_run(qids, searcher.search(texts, k=TOP_K)), expected, searcher)


def test_an_index_of_another_encoder_or_corpus_is_refused(built, tmp_path):
  with pytest.raises(index_files.IndexConfigMismatchError, match="passage_compression_ratio"):
    open_searcher(built, bindings=BINDINGS + ["PASSAGE_COMPRESSION_RATIO = 2"],
                  index_dir=str(built.model_dir / "index" / "beir_fixture.step2"))
  corpus = dict(built.corpus)
  corpus["d0-0"] = beir.Passage(title="Apple", text="An edited passage.")
  beir.write_beir(str(tmp_path / "edited"), corpus, built.queries, {"test": {"q0-0": {"d0-0": 1}}})
  with pytest.raises(searcher_lib.CorpusMismatchError, match="ids, titles or texts differ"):
    open_searcher(built, corpus=str(tmp_path / "edited"),
                  index_dir=str(built.model_dir / "index" / "beir_fixture.step2"))
  with pytest.raises(ValueError, match="texts=True needs the corpus"):
    open_searcher(built, index_dir=str(built.model_dir / "index" / "beir_fixture.step2")
                  ).search(["x"], texts=True)
