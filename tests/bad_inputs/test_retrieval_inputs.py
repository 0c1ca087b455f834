"""Bad retrieval input: an index of an edited corpus is rebuilt, never reused; empty queries
are scored with a warning that names them; approximate results name their search backend,
and the compiled one without numba is refused, naming the extra."""
import json
import logging
import pathlib

import gin
import jax
import jax.numpy as jnp
import pytest

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax.runtime import checkpoints, gin_utils
from decal_jax.retrieval import (beir, index, index_files, ir_metrics, kernels, residual,
                                 residual_search)

from retrieval.test_retrieval_e2e import _write_fixture
from retrieval.test_retrieval_index import _build, _ragged_corpus


# ---------------------------------------------------------------- retrieval
RETRIEVAL_GIN = ["models/decal_tiny.gin", "models/dual_encoder.gin"]


def _dual_encoder_checkpoint(model_dir: pathlib.Path) -> None:
  """A freshly initialised tiny dual encoder saved as MODEL_DIR's step 1 (no training:
  retrieval only needs a checkpoint to read)."""
  gin_utils.parse(RETRIEVAL_GIN, [], ["PROJECTION_DIM = 32"])
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  gin.clear_config()
  shapes = model.input_shapes({"inputs": 16, "targets": 48})
  params = model.get_initial_variables(jax.random.PRNGKey(0), shapes)["params"]
  ckpt = checkpoints.Checkpointer(str(model_dir))
  ckpt.save(1, {"params": params, "step": jnp.int32(1)}, {"batches_consumed": 0}, force=True)
  ckpt.close()


def _retrieve(model_dir: pathlib.Path, folder: pathlib.Path, *bindings: str) -> None:
  from decal_jax import retrieve
  retrieve.main([f"--gin_file={f}" for f in RETRIEVAL_GIN + ["runs/retrieve.gin"]] + [
      f"--gin.MODEL_DIR='{model_dir}'", f"--gin.BEIR_FOLDER='{folder}'", "--gin.TOP_K=10",
      "--gin.QUERY_LENGTH=16", "--gin.PASSAGE_LENGTH=48", "--gin.PROJECTION_DIM=32",
      *bindings])
  gin.clear_config()


def test_retrieval_index_of_an_edited_corpus_is_rebuilt_not_reused(tmp_path, capsys):
  folder = tmp_path / "beir_fixture"
  corpus, _, _ = _write_fixture(folder)
  model_dir = tmp_path / "dual"
  _dual_encoder_checkpoint(model_dir)
  _retrieve(model_dir, folder)
  capsys.readouterr()

  # Edit corpus.jsonl in place: drop the passages of the train topics (judged only in
  # qrels/train.tsv, so the test split stays valid).
  corpus_file = folder / "corpus.jsonl"
  lines = corpus_file.read_text(encoding="utf-8").splitlines(keepends=True)
  kept = [line for line in lines if json.loads(line)["_id"] in
          {d for d in corpus if not d.startswith(("d2-", "d5-", "d8-", "d11-"))}]
  corpus_file.write_text("".join(kept), encoding="utf-8")
  _retrieve(model_dir, folder)
  out = capsys.readouterr().out
  assert "Reusing the index" not in out
  assert (f"WARNING: the corpus {corpus_file} changed since the index at "
          f"{model_dir / 'index' / 'beir_fixture.step1'} was built "
          f"({len(corpus)} -> {len(kept)} documents); rebuilding the index.") in out

  # The index on disk is the new corpus's; the metrics and run equal a fresh run's.
  rebuilt = index.Index.open(str(model_dir / "index" / "beir_fixture.step1"))
  assert sorted(rebuilt.doc_ids) == sorted(json.loads(line)["_id"] for line in kept)
  assert rebuilt.meta["corpus"] == beir.load_beir(folder, "test").corpus_fingerprint
  stem = model_dir / "retrieval" / "beir_fixture.test.step1"
  after_edit = {ext: pathlib.Path(f"{stem}.{ext}").read_text() for ext in ("metrics.json", "trec")}
  assert json.loads(after_edit["metrics.json"])["num_docs"] == len(kept)
  _retrieve(model_dir, folder,
            f"--gin.retrieval_eval.evaluate_retrieval.index_dir='{tmp_path / 'fresh_index'}'")
  assert "Reusing the index" not in capsys.readouterr().out  # a fresh build
  assert after_edit == {ext: pathlib.Path(f"{stem}.{ext}").read_text()
                        for ext in ("metrics.json", "trec")}


def test_results_of_the_previous_corpus_are_kept_when_the_index_is_rebuilt(tmp_path, capsys):
  """The TREC run and metrics of a corpus since edited were overwritten without a word by
  the rebuilt index's; now they are renamed with the old corpus's fingerprint, and said so."""
  folder = tmp_path / "beir_fixture"
  corpus, _, _ = _write_fixture(folder)
  model_dir = tmp_path / "dual"
  _dual_encoder_checkpoint(model_dir)
  _retrieve(model_dir, folder)
  stem = model_dir / "retrieval" / "beir_fixture.test.step1"
  first = {ext: pathlib.Path(f"{stem}.{ext}").read_bytes() for ext in ("metrics.json", "trec")}
  old = beir.load_beir(folder, "test").corpus_fingerprint
  assert json.loads(first["metrics.json"])["corpus_fingerprint"] == old
  _retrieve(model_dir, folder)  # the same corpus: a rerun overwrites, nothing renamed
  assert "were computed on another corpus" not in capsys.readouterr().out
  assert _result_files(stem.parent) == ["beir_fixture.test.step1.metrics.json",
                                         "beir_fixture.test.step1.trec"]

  corpus_file = folder / "corpus.jsonl"
  lines = corpus_file.read_text(encoding="utf-8").splitlines(keepends=True)
  corpus_file.write_text("".join(lines[:-3]), encoding="utf-8")  # three passages fewer
  new = beir.load_beir(folder, "test").corpus_fingerprint
  _retrieve(model_dir, folder)
  out = capsys.readouterr().out
  kept = stem.parent / f"beir_fixture.test.step1.corpus-{old['sha256'][:12]}"
  assert (f"WARNING: the results {stem}.trec / .metrics.json were computed on another corpus "
          f"({len(corpus)} documents, sha256 {old['sha256'][:12]}...) than this run's "
          f"({len(corpus) - 3} documents, sha256 {new['sha256'][:12]}...); kept them as "
          f"{kept}.trec / .metrics.json.") in out
  assert {ext: pathlib.Path(f"{kept}.{ext}").read_bytes() for ext in first} == first
  assert json.loads(pathlib.Path(f"{stem}.metrics.json").read_text())["num_docs"] == \
      len(corpus) - 3
  assert _result_files(stem.parent) == sorted(  # nothing else written, nothing lost
      [f"{kept.name}.metrics.json", f"{kept.name}.trec", f"{stem.name}.metrics.json",
       f"{stem.name}.trec"])


def _result_files(folder):
  """The result files in MODEL_DIR/retrieval (not TensorBoard's events)."""
  return sorted(p.name for p in folder.iterdir() if not p.name.startswith("events.out"))


def test_retrieval_index_tells_a_corpus_edit_that_keeps_the_count(tmp_path):
  passages = {f"doc-{i}": beir.Passage("", f"text {i}") for i in range(23)}

  def fingerprint(docs):
    digest = beir.CorpusDigest()
    for doc_id, passage in docs.items():
      digest.add(doc_id, passage)
    return digest.fingerprint()

  built = _build(tmp_path / "idx", _ragged_corpus(),
                 corpus_fingerprint=fingerprint(passages))
  assert built.corpus_change(fingerprint(passages)) == ""
  edited = dict(passages, **{"doc-3": beir.Passage("A title", "text 3")})
  assert built.corpus_change(fingerprint(edited)) == (
      "the same 23 documents, but their ids, titles or texts differ")
  renamed = {("doc-x" if d == "doc-3" else d): p for d, p in passages.items()}
  assert built.corpus_change(fingerprint(renamed)) != ""
  older = _build(tmp_path / "old", _ragged_corpus())  # built before corpora were fingerprinted
  assert "no corpus fingerprint" in older.corpus_change(fingerprint(passages))


def test_empty_queries_are_scored_with_a_warning_naming_them(tmp_path, caplog):
  folder = tmp_path / "set"
  corpus, queries, qrels = _write_fixture(folder)
  empty = sorted(qrels["test"])[:6]  # six of the test split's eight queries
  beir.write_beir(folder, corpus, dict(queries, **{q: "" for q in empty}), qrels,
                  overwrite=True)
  files = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
  with caplog.at_level(logging.WARNING):
    data = beir.load_beir(folder, "test")
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warnings == [
      f"{folder / 'queries.jsonl'}: 6 query(ies) judged in split 'test' have empty text "
      f"(ids: {', '.join(empty[:5])} and 1 more); each is scored as EOS alone and counted in "
      f"NDCG / Recall. Give them text, or remove them from {folder / 'qrels' / 'test.tsv'}."]
  assert data.empty_queries == 6 and all(data.queries[q] == "" for q in empty)  # kept
  assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == files
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert beir.load_beir(folder, "validation").empty_queries == 0
  assert not caplog.records


def test_approximate_results_name_their_backend_and_compiled_needs_numba(tmp_path,
                                                                         monkeypatch):
  """Each backend writes its own results files, its name in them and in the metrics; both
  rank alike (every cell probed, every passage reranked, uncompressed vectors); 'compiled'
  without numba is refused before anything is encoded."""
  folder = tmp_path / "beir_fixture"
  _write_fixture(folder)
  model_dir = tmp_path / "dual"
  _dual_encoder_checkpoint(model_dir)
  approximate = ("--gin.SEARCH='approximate'", "--gin.RESIDUAL_BITS=None",
                 "--gin.NPROBE=100000", "--gin.CANDIDATES=100000")
  ranks = {}
  for backend in ["numpy"] + (["compiled"] if kernels.AVAILABLE else []):
    _retrieve(model_dir, folder, *approximate, f"--gin.SEARCH_BACKEND='{backend}'")
    stem = (model_dir / "retrieval" / f"beir_fixture.test.step1.approximate-{backend}-bnone-"
            "nprobe100000-query32-candidates100000")
    assert json.loads(pathlib.Path(f"{stem}.metrics.json").read_text())["backend"] == backend
    run = ir_metrics.read_trec_run(f"{stem}.trec")
    ranks[backend] = {q: ir_metrics.rank(docs) for q, docs in run.items()}
  assert all(r == ranks["numpy"] for r in ranks.values())
  monkeypatch.setattr(kernels, "AVAILABLE", False)
  with pytest.raises(ImportError, match=r"pip install 'decal_jax\[ann\]'"):
    _retrieve(model_dir, folder, *approximate, "--gin.SEARCH_BACKEND='compiled'")
  gin.clear_config()


# ---------------------------------------------------------------- issue 48: a damaged index,
# bad approximate-search settings, an empty corpus
def _results(model_dir: pathlib.Path) -> dict:
  stem = model_dir / "retrieval" / "beir_fixture.test.step1"
  return {ext: pathlib.Path(f"{stem}.{ext}").read_text() for ext in ("metrics.json", "trec")}


def test_a_truncated_index_file_is_named_and_the_run_rebuilds_the_index(tmp_path, capsys):
  """A cut vectors.npy failed every later search with `mmap length is greater than file
  size`; its size is now checked against its header and meta.json when opened."""
  folder = tmp_path / "beir_fixture"
  _write_fixture(folder)
  model_dir = tmp_path / "dual"
  _dual_encoder_checkpoint(model_dir)
  _retrieve(model_dir, folder)
  first = _results(model_dir)
  directory = model_dir / "index" / "beir_fixture.step1"
  meta = json.loads((directory / "meta.json").read_text())
  vectors = directory / "vectors.npy"
  vectors.write_bytes(vectors.read_bytes()[:vectors.stat().st_size // 2])
  capsys.readouterr()

  with pytest.raises(index_files.DamagedIndexError) as err:
    index.Index.open(str(directory))
  message = str(err.value)
  assert message.startswith(f"{vectors} is damaged: it has ") and "(cut short)" in message
  assert (f"it should hold {meta['dtype']} [{meta['num_vectors']}, {meta['dim']}] as meta.json "
          f"says. The index cannot be searched: delete the folder {directory} and build it "
          "again") in message

  _retrieve(model_dir, folder)  # the run rebuilds it, saying why
  out = capsys.readouterr().out
  assert f"WARNING: {vectors} is damaged: it has " in out
  assert f"Rebuilding the index at {directory}." in out and "Reusing the index" not in out
  assert _results(model_dir) == first
  assert index.Index.open(str(directory)).num_vectors == meta["num_vectors"]
  assert sorted(p.name for p in directory.parent.iterdir()) == ["beir_fixture.step1"]


@pytest.mark.parametrize("binding,message", [
    ("--gin.NPROBE=0", "NPROBE (retrieval_eval.evaluate_retrieval.nprobe) = 0: must be a "
                       "whole number >= 1."),
    ("--gin.QUERY_CELLS=-1", "QUERY_CELLS (retrieval_eval.evaluate_retrieval.query_cells) = "
                             "-1: must be a whole number >= 0."),
    ("--gin.CANDIDATES=0", "CANDIDATES (retrieval_eval.evaluate_retrieval.candidates) = 0: "
                           "must be a whole number >= 1 or None"),
    ("--gin.RESIDUAL_BITS=3", "RESIDUAL_BITS (retrieval_eval.evaluate_retrieval.residual_bits)"
                              " = 3: must be one of 1, 2, 4, 8, None"),
    ("--gin.QUANTIZER='lloyd'", "QUANTIZER (retrieval_eval.evaluate_retrieval.quantizer) = "
                                "'lloyd': must be one of 'quantile', 'rotated-lloyd'.")])
def test_bad_approximate_search_settings_are_refused_before_the_index_is_built(
    tmp_path, binding, message):
  """NPROBE=0 was reported by its position in an API tuple after the compressed index was
  built."""
  folder = tmp_path / "beir_fixture"
  _write_fixture(folder)
  model_dir = tmp_path / "dual"
  _dual_encoder_checkpoint(model_dir)
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  with pytest.raises(ValueError) as err:
    _retrieve(model_dir, folder, "--gin.SEARCH='approximate'", binding)
  gin.clear_config()
  assert message in str(err.value)
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_the_search_settings_own_checks_name_the_setting():
  with pytest.raises(ValueError, match=r"ResidualConfig.bits = 3: must be one of"):
    residual.ResidualConfig(bits=3)
  with pytest.raises(ValueError, match=r"ResidualConfig.centroid_probe = -1: must be a whole"):
    residual.ResidualConfig(centroid_probe=-1)
  with pytest.raises(ValueError, match=r"^nprobe = 0: must be a whole number >= 1.$"):
    residual_search.check_settings(10, 0, 32, None)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_an_empty_corpus_is_named_as_empty_not_as_a_missing_document(tmp_path, content):
  """It was reported as a qrels row (line 2) naming a document the corpus lacks."""
  folder = tmp_path / "set"
  _write_fixture(folder)
  corpus_file = folder / "corpus.jsonl"
  corpus_file.write_bytes(content)
  before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
  with pytest.raises(beir.BadRetrievalFileError) as err:
    beir.load_beir(folder, "test")
  message = str(err.value)
  assert message.startswith(f"{corpus_file}: the corpus is empty (no document: ")
  assert ("an empty file" if not content else f"{len(content)} bytes of blank lines") in message
  assert 'Fill it with one JSON object per line, {"_id", "title", "text"}' in message
  assert "qrels" not in message
  assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_more_centroids_than_vectors_are_clamped_with_a_warning_and_recorded(tmp_path,
                                                                            caplog):
  """NUM_CENTROIDS=100000 on a small index was clamped silently to its vector count while
  the run's settings said 100000; the clamp is now a WARNING and the metrics record the
  count used."""
  folder = tmp_path / "beir_fixture"
  _write_fixture(folder)
  model_dir = tmp_path / "dual"
  _dual_encoder_checkpoint(model_dir)
  with caplog.at_level(logging.WARNING):
    _retrieve(model_dir, folder, "--gin.SEARCH='approximate'", "--gin.RESIDUAL_BITS=None",
              "--gin.NUM_CENTROIDS=100000")
  vectors = index.Index.open(str(model_dir / "index" / "beir_fixture.step1")).num_vectors
  warnings = [r.getMessage() for r in caplog.records if "num_centroids" in r.getMessage()]
  assert warnings == [
      f"num_centroids = 100000 is more than the {vectors} vector(s) k-means trains on (the "
      f"index has {vectors} vector(s); each centroid needs one); using {vectors} centroids. "
      f"Ask for at most {vectors}, or None for the default."]
  metrics_file, = (model_dir / "retrieval").glob("*.approximate-*.metrics.json")
  assert json.loads(metrics_file.read_text())["num_centroids"] == vectors
