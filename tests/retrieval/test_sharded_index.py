"""Sharded indexing: a 2-process `jax.distributed` build against a 1-process one (bitwise)
and against a numpy re-derivation of the encoder, after both processes restored a
checkpoint written by one process; merged search against a numpy brute
force and a single index; resume after a crash between chunks; a changed corpus or a
replaced shard.

The encoder is a tiny jitted DeCAL-like pooling (embedding lookup, masked mean over windows
of 2 tokens, L2 norm), so the 2 subprocesses compile little. Run as a script, this file
is one process of the 2-process run:
  python tests/retrieval/test_sharded_index.py MODEL_DIR INDEX_DIR PORT PROCESS_ID
"""
import json
import os
import pathlib
import subprocess
import sys
import zlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DIM, RATIO, VOCAB, BATCH = 8, 2, 61, 4
CHUNK_DOCS = 5
CONFIG = {"encoder": "tiny pooling", "dim": DIM, "ratio": RATIO}
WORDS = ("apple volcano violin glacier rocket honey desert coral chess bread tide comet "
         "orbit lava dune reef").split()


def _table() -> np.ndarray:
  return np.random.default_rng(7).standard_normal((VOCAB, DIM)).astype(np.float32)


def _corpus(num_docs: int = 37):
  """Doc ids and texts of 1..9 words (doc 4 empty: EOS only)."""
  rng = np.random.default_rng(3)
  texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 10)))) for _ in range(num_docs)]
  texts[4] = ""
  return [f"doc{i:02d}" for i in range(num_docs)], texts


def _token_ids(text: str):
  return [2 + zlib.crc32(w.encode()) % (VOCAB - 2) for w in text.split()] + [1]  # then EOS


def _batches(texts):
  """Rows in order, BATCH at a time, padded to BATCH rows and a power-of-two width."""
  ids = [_token_ids(t) for t in texts]
  for start in range(0, len(ids), BATCH):
    rows = list(range(start, min(start + BATCH, len(ids))))
    width = max(8, 1 << (max(len(ids[r]) for r in rows) - 1).bit_length())
    tokens = np.zeros((BATCH, width), np.int32)
    for i, r in enumerate(rows):
      tokens[i, :len(ids[r])] = ids[r]
    yield rows, tokens


def _encoder():
  import jax
  import jax.numpy as jnp
  table = jnp.asarray(_table())

  @jax.jit
  def encode(tokens):  # [b, n] -> vectors [b, n / RATIO, DIM], valid [b, n / RATIO]
    mask = (tokens > 0).astype(jnp.float32)  # [b, n]
    x = table[tokens] * mask[..., None]  # [b, n, DIM]
    b, n = tokens.shape
    sums = x.reshape(b, n // RATIO, RATIO, DIM).sum(axis=2)  # [b, m, DIM]
    counts = mask.reshape(b, n // RATIO, RATIO).sum(axis=2)  # [b, m]
    means = sums / jnp.maximum(counts, 1)[..., None]
    norm = jnp.linalg.norm(means, axis=-1, keepdims=True)
    return means / jnp.maximum(norm, 1e-6), counts > 0

  def run(tokens):
    vectors, valid = encode(tokens)
    return np.asarray(vectors), np.asarray(valid)
  return run


def _numpy_vectors(text: str) -> np.ndarray:
  """The re-derivation: each window of RATIO tokens -> the unit mean of its embeddings."""
  ids = _token_ids(text)
  table = _table().astype(np.float64)
  windows = [ids[i:i + RATIO] for i in range(0, len(ids), RATIO)]
  means = np.stack([table[w].mean(axis=0) for w in windows])  # [m, DIM]
  return means / np.linalg.norm(means, axis=1, keepdims=True)


def _build(directory, num_docs=37, encode=None, config=CONFIG, **kwargs):
  from decal_jax.retrieval import sharded
  doc_ids, texts = _corpus(num_docs)
  return sharded.build_sharded_index(str(directory), doc_ids, texts, _batches,
                                     encode or _encoder(), config, chunk_docs=CHUNK_DOCS,
                                     dtype="float32", progress=False, **kwargs)


def _counting(encode, fail_after=None):
  """encode, counting the real rows it sees (nonzero first token); raising after
  `fail_after` calls (a crash)."""
  def run(tokens):
    if fail_after is not None and run.calls == fail_after:
      raise KeyboardInterrupt("simulated crash")
    run.calls += 1
    run.rows += int((tokens[:, 0] > 0).sum())
    return encode(tokens)
  run.calls, run.rows = 0, 0
  return run


def _by_document(idx):
  """{doc id: its stored vectors' bytes}."""
  return {d: idx.doc_vectors(i).tobytes() for i, d in enumerate(idx.doc_ids)}


def _shard_files(directory):
  return {p.relative_to(directory).as_posix(): p.read_bytes()
          for p in sorted(pathlib.Path(directory).glob("shard-*/*")) if p.name != "meta.json"}


# ------------------------------------------------------------------------------- 2 processes
def _worker(model_dir: str, directory: str, port: str, process_id: str) -> None:
  """Process `process_id` of 2, as a 2-process `python -m decal_jax.retrieve` runs: joins
  the job (the trainer's start-up), restores the params that the test saved from one
  process onto a mesh over both processes' devices and takes host copies of them
  (as `pipeline.host_params` does, without importing the input pipeline), then builds
  its shards."""
  from decal_jax import partitioning
  partitioning.initialize_distributed(f"localhost:{port}", 2, int(process_id),
                                      initialization_timeout=60)
  import jax
  from jax.experimental import multihost_utils
  from decal_jax.runtime import checkpoints
  mesh_sharding = jax.sharding.NamedSharding(partitioning.Partitioner().mesh,
                                             jax.sharding.PartitionSpec())
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=mesh_sharding)
              for k, v in _saved_params().items()}
  ckpt = checkpoints.Checkpointer(model_dir)
  params = multihost_utils.process_allgather(ckpt.restore_params(1, abstract), tiled=True)
  ckpt.close()
  encode = _counting(_encoder())
  idx = _build(directory, encode=encode)
  print("RESULT " + json.dumps({
      "process": jax.process_index(), "count": jax.process_count(),
      "rows_encoded": encode.rows, "num_docs": idx.num_docs,
      "params": {k: np.asarray(v).tolist() for k, v in params.items()}}), flush=True)


def _saved_params():
  """A checkpoint's params (what the worker restores)."""
  rng = np.random.default_rng(5)
  return {"kernel": rng.standard_normal((3, 4)).astype(np.float32),
          "scale": rng.standard_normal(4).astype(np.float32)}


def _two_processes(*args: str):
  """Runs this file as processes 0 and 1 (with `args`); their RESULT records, stdouts."""
  import processes  # tests/: not on a worker's path
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
  port = processes.free_port()
  procs = [subprocess.Popen([sys.executable, __file__, *args, str(port), str(i)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  finished = processes.communicate_all(procs, timeout=120)
  errors = "\n".join(err[-3000:] for _, err in finished)
  if any(p.returncode for p in procs) and "distributed" in errors.lower() and (
      "unavailable" in errors.lower() or "deadline" in errors.lower()):
    pytest.skip(f"jax.distributed could not start 2 local processes here: {errors[-500:]}")
  for proc, (_, err) in zip(procs, finished):
    assert proc.returncode == 0, err[-4000:]
  return [json.loads(next(l for l in out.splitlines() if l.startswith("RESULT"))[7:])
          for out, _ in finished], [out for out, _ in finished]


def test_two_processes_build_the_index_one_process_builds(tmp_path):
  import jax.numpy as jnp
  from decal_jax.runtime import checkpoints
  ckpt = checkpoints.Checkpointer(str(tmp_path / "model"))  # written by this one process
  ckpt.save(1, {"params": {k: jnp.asarray(v) for k, v in _saved_params().items()},
                "step": jnp.int32(1)}, {"batches_consumed": 0}, force=True)
  ckpt.close()
  results, outputs = _two_processes(str(tmp_path / "model"), str(tmp_path / "two"))
  for restored in results:  # each process holds the whole of every parameter
    for name, value in _saved_params().items():
      np.testing.assert_array_equal(np.asarray(restored["params"][name], np.float32), value)
  # 37 docs in chunks of 5 -> 8 chunks: process 0 encodes chunks 0-3 (20 docs), process 1
  # chunks 4-7 (17 docs), each its own block.
  assert [(r["process"], r["count"], r["rows_encoded"]) for r in results] == [
      (0, 2, 20), (1, 2, 17)]
  assert "process 1 of 2 builds shards 4..7 (17 passages)" in outputs[1]
  two = _build(tmp_path / "one")  # this process alone: process 0 of 1
  from decal_jax.retrieval import sharded
  joined = sharded.ShardedIndex.open(str(tmp_path / "two"), expected_config=CONFIG)
  assert joined.num_docs == two.num_docs == 37 and len(joined.shards) == 8
  # The same index, bitwise, sorted by document (and shard file by shard file).
  one_docs, two_docs = _by_document(two), _by_document(joined)
  assert sorted(one_docs) == sorted(two_docs)
  assert all(one_docs[d] == two_docs[d] for d in one_docs)
  assert _shard_files(tmp_path / "one") == _shard_files(tmp_path / "two")
  manifests = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("one", "two")]
  for m in manifests:
    m.pop("created")
  assert manifests[0] == manifests[1]
  # Against the numpy re-derivation of the encoder, document by document.
  doc_ids, texts = _corpus()
  for doc, text in zip(doc_ids, texts):
    stored = joined.doc_vectors(joined.doc_ids.index(doc))
    np.testing.assert_allclose(stored, _numpy_vectors(text), atol=1e-5, err_msg=doc)


# ------------------------------------------------------------------------------- search
def _queries(num: int = 5):
  rng = np.random.default_rng(11)
  vectors = rng.standard_normal((num, 3, DIM)).astype(np.float32)  # [q, mq, d]
  valid = np.ones((num, 3), bool)
  valid[1, 2] = False
  return vectors, valid


def test_merged_search_equals_brute_force_and_one_index(tmp_path):
  from decal_jax.retrieval import index as index_lib
  from decal_jax.retrieval import codec as codec_lib
  from decal_jax.retrieval import residual, sharded
  idx = _build(tmp_path / "sharded")
  queries, valid = _queries()
  scores, ids = idx.search(queries, valid, top_k=12)
  # numpy brute force (float64): MaxSim of every document, best 12
  doc_ids, texts = _corpus()
  for q in range(len(queries)):
    qv = queries[q][valid[q]].astype(np.float64)
    want = {d: (qv @ _numpy_vectors(t).T).max(axis=1).sum() for d, t in zip(doc_ids, texts)}
    best = sorted(want, key=lambda d: (-round(want[d], 6), d))[:12]  # ties: lower index
    assert [idx.doc_ids[i] for i in ids[q]] == best
    np.testing.assert_allclose(scores[q], [want[d] for d in best], atol=1e-4)
  # one index of the same documents in the same order: the same top-k, ties included
  single = index_lib.build_index(str(tmp_path / "single"), idx.doc_ids,
                                 [b for _, b in _batches_in(idx.doc_ids)], _encoder(), CONFIG,
                                 dtype="float32", progress=False)
  single_scores, single_ids = single.search(queries, valid, top_k=12)
  np.testing.assert_array_equal(ids, single_ids)
  np.testing.assert_allclose(scores, single_scores, atol=1e-6)
  # residual shards with one codec: uncompressed, every centroid probed -> exact ranking
  raw = sharded.build_sharded_residual(str(tmp_path / "raw"), idx,
                                       residual.ResidualConfig(None, 6))
  raw_scores, raw_ids = raw.search(queries, valid, top_k=12, nprobe=6, candidates=100)
  np.testing.assert_array_equal(raw_ids, ids)
  np.testing.assert_allclose(raw_scores, scores, atol=1e-5)
  coded = sharded.build_sharded_residual(str(tmp_path / "b2"), idx,
                                         residual.ResidualConfig(2, 6))
  shared, _ = codec_lib.load_codec(str(tmp_path / "b2" / "codec"))
  for shard in coded.shards:  # every shard holds the one codec
    np.testing.assert_array_equal(shard.codec.centroids, shared.centroids)
    np.testing.assert_array_equal(shard.codec.weights, shared.weights)
  assert coded.meta["kind"] == "residual" and coded.nbytes < idx.nbytes
  run = coded.search_run([f"q{i}" for i in range(5)], queries, valid, top_k=5, nprobe=6,
                         candidates=100)
  assert all(len(docs) == 5 for docs in run.values())


def _batches_in(doc_ids):
  """Token batches of these documents, in this order (for a single index of them)."""
  texts = dict(zip(*_corpus()))
  for rows, tokens in _batches([texts[d] for d in doc_ids]):
    yield rows, tokens[:len(rows)]


def test_merge_top_k_orders_by_score_then_index_padding_last():
  from decal_jax.retrieval import sharded
  scores = np.array([[0.5, 0.9, -np.inf, 0.5, 0.1]], np.float32)
  ids = np.array([[7, 3, -1, 2, 9]])
  best_scores, best_ids = sharded.merge_top_k(scores, ids, 5)
  assert best_ids.tolist() == [[3, 2, 7, 9, -1]]
  assert best_scores.tolist() == [[np.float32(0.9), 0.5, 0.5, np.float32(0.1), -np.inf]]


# ------------------------------------------------------------------------------- resume
def test_an_interrupted_build_resumes_from_the_last_finished_chunk(tmp_path):
  directory = tmp_path / "index"
  crashing = _counting(_encoder(), fail_after=5)  # chunks hold 2 batches: dies in chunk 2
  with pytest.raises(KeyboardInterrupt, match="simulated crash"):
    _build(directory, encode=crashing)
  assert sorted(p.name for p in directory.iterdir()) == ["shard-00000", "shard-00001"]
  (directory / "shard-00002.tmp-killed").mkdir()  # what a hard kill (no cleanup) leaves
  from decal_jax.retrieval import sharded
  with pytest.raises(FileNotFoundError, match="run the same build again"):
    sharded.ShardedIndex.open(str(directory))
  resumed = _counting(_encoder())
  idx = _build(directory, encode=resumed)
  assert resumed.rows == 37 - 2 * CHUNK_DOCS  # the finished chunks were not re-encoded
  assert not list(directory.glob("*.tmp-*"))
  whole = _build(tmp_path / "whole")  # uninterrupted
  assert _by_document(idx) == _by_document(whole)
  assert _shard_files(directory) == _shard_files(tmp_path / "whole")
  again = _counting(_encoder())
  _build(directory, encode=again)  # finished: nothing is encoded
  assert again.rows == 0


# ------------------------------------------------------------------------------- corpus change
def test_a_changed_corpus_rebuilds_its_chunks_and_a_replaced_shard_is_refused(tmp_path):
  from decal_jax.retrieval import index as index_lib
  from decal_jax.retrieval import sharded
  directory = tmp_path / "index"
  _build(directory, num_docs=37)
  # The corpus shrinks to 33 documents and document 7 (chunk 1) is edited.
  doc_ids, texts = _corpus(33)
  texts[7] = "comet orbit comet"
  encode = _counting(_encoder())
  idx = sharded.build_sharded_index(str(directory), doc_ids, texts, _batches, encode, CONFIG,
                                    chunk_docs=CHUNK_DOCS, dtype="float32", progress=False,
                                    corpus_fingerprint={"num_docs": 33, "sha256": "x"})
  # chunk 1 (edited) and chunk 6 (33 docs: now 30..32) re-encoded; chunk 7 deleted
  assert encode.rows == CHUNK_DOCS + 3
  assert sorted(p.name for p in directory.iterdir()) == [
      "manifest.json"] + [f"shard-{j:05d}" for j in range(7)]
  assert idx.meta["corpus"] == {"num_docs": 33, "sha256": "x"}
  np.testing.assert_allclose(idx.doc_vectors(idx.doc_ids.index("doc07")),
                             _numpy_vectors("comet orbit comet"), atol=1e-5)
  assert idx.corpus_change({"num_docs": 37, "sha256": "x"}) == "33 -> 37 documents"
  # another encoder config is refused, not mixed in
  with pytest.raises(index_lib.IndexConfigMismatchError, match="ratio: built=2, expected=4"):
    _build(directory, num_docs=33, config=dict(CONFIG, ratio=4))
  # a shard replaced behind the manifest's back (another corpus's chunk) is refused
  assert (directory / "manifest.json").exists()  # the refused build left the index as it was
  _build(tmp_path / "other", num_docs=33)  # chunk 1 without the edit
  import shutil
  shutil.rmtree(directory / "shard-00001")
  shutil.copytree(tmp_path / "other" / "shard-00001", directory / "shard-00001")
  with pytest.raises(sharded.ShardMismatchError, match=r"shard-00001 .*\(corpus: manifest"):
    sharded.ShardedIndex.open(str(directory))


if __name__ == "__main__":
  _worker(*sys.argv[1:])
