"""Fine-tune -> index -> search -> score, end to end, on a BEIR folder the test writes.

A tiny DeCAL "pretraining checkpoint" (a t5.Transformer's weights) initialises the dual
encoder through runs/retrieval_finetune.gin; `python -m decal_jax.retrieve` then indexes
the corpus and scores the test queries. References: the run file scored by pytrec_eval,
the index contents against the encoder run directly, and the held-out in-batch accuracy
of the trained model against chance (one over the number of candidates).
"""
import json
import math
import pathlib

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import pytrec_eval

from decal_jax import partitioning
from decal_jax.runtime import checkpoints, gin_utils, train_state, trainer
from decal_jax.data.pipeline import DatasetConfig
from decal_jax.networks import t5
from decal_jax.retrieval import beir, index, index_files, ir_metrics, kernels
from decal_jax.runtime import retrieval_eval as pipeline

TOPICS = ["apple orchard harvest", "volcano lava eruption", "violin concerto orchestra",
          "glacier ice melting", "rocket launch orbit", "honey bee colony",
          "desert sand dune", "coral reef fish", "chess opening gambit", "bread yeast dough",
          "tidal wave coast", "comet tail sun"]


def _write_fixture(folder: pathlib.Path):
  corpus, queries = {}, {}
  qrels = {"train": {}, "validation": {}, "test": {}}
  for t, topic in enumerate(TOPICS):
    words = topic.split()
    for j in range(3):
      corpus[f"d{t}-{j}"] = beir.Passage(
          title=words[j].title(),
          text=f"This passage is about the {topic}: the {words[j]} and the {words[-1]} "
               f"matter here, number {j}.")
    split = "test" if t % 3 == 0 else ("validation" if t % 3 == 1 else "train")
    for k, query in enumerate([f"what about {topic}", f"{words[0]} {words[1]}"]):
      qid = f"q{t}-{k}"
      queries[qid] = query
      qrels[split][qid] = {f"d{t}-{j}": 1 for j in range(3)}
  corpus["empty"] = beir.Passage(title="", text="")  # an empty passage is kept
  beir.write_beir(str(folder), corpus, queries, qrels)
  return corpus, queries, qrels


def _pretrained_checkpoint(directory: pathlib.Path):
  gin_utils.parse(["models/decal_tiny.gin"], [], [])
  config = gin.query_parameter("%MODEL").scoped_configurable_fn().module.config
  gin.clear_config()
  model = t5.Transformer(config)
  ones = jnp.ones((1, 16), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), ones, ones, ones, enable_dropout=False)["params"]
  ckpt = checkpoints.Checkpointer(str(directory))
  ckpt.save(1, {"params": params, "step": jnp.int32(1)}, {"batches_consumed": 1}, force=True)
  ckpt.close()


def test_fine_tune_index_search_and_score(tmp_path, capsys):
  from decal_jax.tasks import retrieval_tasks
  folder = tmp_path / "beir_fixture"
  corpus, queries, qrels = _write_fixture(folder)
  retrieval_tasks.register_beir_task("fixture", str(folder))
  _pretrained_checkpoint(tmp_path / "pretrained")
  model_dir = tmp_path / "dual"
  common = ["models/decal_tiny.gin", "models/dual_encoder.gin"]
  gin_utils.parse(common + ["runs/retrieval_finetune.gin"], [], [
      f"MODEL_DIR = '{model_dir}'", f"INITIAL_CHECKPOINT_PATH = '{tmp_path / 'pretrained'}'",
      "MIXTURE_OR_TASK_NAME = 'decal_beir_fixture'", "TRAIN_STEPS = 30", "BATCH_SIZE = 8",
      "TASK_FEATURE_LENGTHS = {'inputs': 16, 'targets': 48}", "LEARNING_RATE = 0.01",
      "EVAL_PERIOD = 30", "EVAL_BATCHES = 2", "LOG_PERIOD = 10", "CHECKPOINT_PERIOD = 30",
      "PROJECTION_DIM = 32"])
  result = gin.get_configurable(trainer.train)()
  gin.clear_config()
  out = capsys.readouterr().out
  assert "parameters restored" in out and "unused: decoder/" in out  # decoder dropped
  # Validation in-batch top-1 among 8 candidates: chance is 1 / 8. (Not the loss: at T5X
  # Retrieval's logit scale 100 a few confident misses on held-out queries dominate it.)
  assert result["num_queries"] > 0 and result["accuracy"] > 1 / 8
  assert math.isfinite(result["loss"])

  from decal_jax import retrieve
  args = [f"--gin_file={f}" for f in common + ["runs/retrieve.gin"]] + [
      f"--gin.MODEL_DIR='{model_dir}'", f"--gin.BEIR_FOLDER='{folder}'", "--gin.TOP_K=10",
      "--gin.QUERY_LENGTH=16", "--gin.PASSAGE_LENGTH=48", "--gin.PROJECTION_DIM=32"]
  retrieve.main(args)
  gin.clear_config()
  stem = model_dir / "retrieval" / "beir_fixture.test.step30"
  scores = json.loads(pathlib.Path(f"{stem}.metrics.json").read_text())
  run = ir_metrics.read_trec_run(f"{stem}.trec")
  test_qrels = qrels["test"]
  assert set(run) == set(test_qrels) and all(len(docs) == 10 for docs in run.values())
  ref = pytrec_eval.RelevanceEvaluator(test_qrels, {"ndcg_cut.10", "recall.100"}).evaluate(run)
  assert scores["ndcg@10"] == pytest.approx(np.mean([r["ndcg_cut_10"] for r in ref.values()]))
  assert scores["recall@100"] == pytest.approx(np.mean([r["recall_100"] for r in ref.values()]))
  assert scores["num_docs"] == len(corpus)
  # what computed it, in every metrics file: exact search on JAX, pytrec_eval (installed here)
  assert (scores["search"], scores["backend"], scores["metrics_implementation"]) == (
      "exact", "jax", "pytrec_eval")

  # Approximate search through an uncompressed residual index, probing every centroid and
  # reranking every candidate, ranks as the exact search did.
  retrieve.main(args + ["--gin.SEARCH='approximate'", "--gin.RESIDUAL_BITS=None",
                        "--gin.NPROBE=100000", "--gin.CANDIDATES=100000"])
  gin.clear_config()
  approx_stem = f"{stem}.approximate-numpy-bnone-nprobe100000-query32-candidates100000"
  approximate = ir_metrics.read_trec_run(f"{approx_stem}.trec")
  assert {q: ir_metrics.rank(d) for q, d in approximate.items()} == {
      q: ir_metrics.rank(d) for q, d in run.items()}
  approx_metrics = json.loads(pathlib.Path(f"{approx_stem}.metrics.json").read_text())
  assert (approx_metrics["search"], approx_metrics["backend"]) == ("approximate", "numpy")
  if kernels.AVAILABLE:  # gin SEARCH_BACKEND: the compiled stages, in files of their own
    retrieve.main(args + ["--gin.SEARCH='approximate'", "--gin.RESIDUAL_BITS=None",
                          "--gin.NPROBE=100000", "--gin.CANDIDATES=100000",
                          "--gin.SEARCH_BACKEND='compiled'"])
    gin.clear_config()
    compiled_stem = approx_stem.replace("approximate-numpy-", "approximate-compiled-")
    compiled = ir_metrics.read_trec_run(f"{compiled_stem}.trec")
    assert {q: ir_metrics.rank(d) for q, d in compiled.items()} == {
        q: ir_metrics.rank(d) for q, d in run.items()}
    assert json.loads(pathlib.Path(f"{compiled_stem}.metrics.json").read_text())[
        "backend"] == "compiled"
    assert json.loads(pathlib.Path(f"{approx_stem}.metrics.json").read_text()) == (
        approx_metrics)  # kept
  assert json.loads(pathlib.Path(f"{stem}.metrics.json").read_text()) == scores  # kept
  assert (model_dir / "index" / "beir_fixture.step30.residual-bnone" / "meta.json").exists()

  # 2-bit codes of either quantizer (gin QUANTIZER): each its own index and result files.
  for quantizer, suffix in (("rotated-lloyd", ""), ("quantile", "-quantile")):
    retrieve.main(args + ["--gin.SEARCH='approximate'", f"--gin.QUANTIZER='{quantizer}'"])
    gin.clear_config()
    metrics = json.loads(pathlib.Path(f"{stem}.approximate-numpy-b2-nprobe16-query32-"
                                      f"candidatesdefault{suffix}.metrics.json").read_text())
    assert (metrics["quantizer"], metrics["residual_bits"]) == (quantizer, 2)
    meta = json.loads((model_dir / "index" / f"beir_fixture.step30.residual-b2{suffix}" /
                       "meta.json").read_text())
    assert meta["codec"]["quantizer"] == quantizer
  # gin CENTROID_PROBE: the default 2-bit index is rebuilt, its centroid search two-level.
  retrieve.main(args + ["--gin.SEARCH='approximate'", "--gin.CENTROID_PROBE=1"])
  gin.clear_config()
  meta = json.loads((model_dir / "index" / "beir_fixture.step30.residual-b2" /
                     "meta.json").read_text())
  assert meta["codec"]["centroid_probe"] == 1

  # Index shards of 8 passages (sharded.py), searched by merging their top-k lists, rank as
  # the single index does; so do uncompressed residual shards sharing one codec. Their
  # results go to files of their own: the single index's stay as they were.
  shards = model_dir / "index" / "beir_fixture.step30.shards"
  single = {p.name: p.read_bytes() for p in (model_dir / "retrieval").glob("*.step30*")}
  for extra, results in (([], f"{stem}.shards"), (
      ["--gin.SEARCH='approximate'", "--gin.RESIDUAL_BITS=None", "--gin.NPROBE=100000",
       "--gin.CANDIDATES=100000"],
      f"{stem}.shards.approximate-numpy-bnone-nprobe100000-query32-candidates100000")):
    retrieve.main(args + ["--gin.SHARD_DOCS=8"] + extra)
    gin.clear_config()
    sharded_run = ir_metrics.read_trec_run(f"{results}.trec")
    assert {q: ir_metrics.rank(d) for q, d in sharded_run.items()} == {
        q: ir_metrics.rank(d) for q, d in run.items()}
  assert {name: (model_dir / "retrieval" / name).read_bytes() for name in single} == single
  manifest = json.loads((shards / "manifest.json").read_text())
  assert [s["num_docs"] for s in manifest["shards"]] == [8, 8, 8, 8, len(corpus) - 32]
  assert (model_dir / "index" / "beir_fixture.step30.shards.residual-bnone" /
          "manifest.json").exists()

  # The stored index holds ceil(n / 4) unit vectors per passage (DeCAL 4x), equal to the
  # encoder's output for that passage alone.
  idx_dir = model_dir / "index" / "beir_fixture.step30"
  gin_utils.parse(common, [], ["PROJECTION_DIM = 32"])
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  gin.clear_config()
  lengths = {"inputs": 16, "targets": 48}
  params, step = train_state.restore_params(model, str(model_dir),
                                            DatasetConfig("unused", lengths),
                                            partitioning.Partitioner())
  config = pipeline.index_config(model, 48, str(model_dir), step)
  opened = index.Index.open(str(idx_dir), expected_config=config)
  for doc in ("d0-1", "empty"):
    i = opened.doc_ids.index(doc)
    ids = pipeline.tokenize([corpus[doc].full_text], model.input_vocabulary, 48)[0]
    stored = np.asarray(opened.doc_vectors(i), np.float32)
    assert stored.shape == (math.ceil(len(ids) / 4), 32)
    encoded = model.encode(params, np.array([ids]), "passage")
    np.testing.assert_allclose(stored, np.asarray(encoded.vectors)[0, :len(stored)],
                               atol=2e-3)  # stored as float16
    np.testing.assert_allclose(np.linalg.norm(stored, axis=-1), 1.0, atol=2e-3)

  # Searching with another encoder config (passages at 2x) is refused, naming the key.
  with pytest.raises(index_files.IndexConfigMismatchError, match="passage_compression_ratio"):
    retrieve.main(args + ["--gin.PASSAGE_COMPRESSION_RATIO=2"])
  gin.clear_config()
