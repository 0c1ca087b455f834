"""The residual codec against a numpy re-derivation (nearest centroid, per-dimension quantile
buckets), its error and size per bit width, and approximate search against exact search."""
import json
import os
import types

import numpy as np
import pytest

from decal_jax.retrieval import index as index_lib
from decal_jax.retrieval import codec as codec_lib
from decal_jax.retrieval import kernels, residual, residual_search, topk
from decal_jax.retrieval.residual import ResidualConfig
from decal_jax.runtime import retrieval_eval as pipeline

DIM = 16
CONFIG = {"passage_ratio": 4, "dim": DIM}
FINGERPRINT = {"num_docs": 120, "sha256": "a" * 64}
NO_NUMBA = "numba is not installed (the [ann] extra)"
# the approximate search's stages in numpy, and compiled (kernels.py) where numba is
BACKENDS = ["numpy", pytest.param("compiled", marks=pytest.mark.skipif(
    not kernels.AVAILABLE, reason=NO_NUMBA))]


def _clustered(rng, n: int, num_clusters: int = 12, noise: float = 0.25) -> np.ndarray:
  """n unit vectors `[n, DIM]` around `num_clusters` random directions."""
  centers = rng.standard_normal((num_clusters, DIM))
  x = centers[rng.integers(0, num_clusters, n)] + noise * rng.standard_normal((n, DIM))
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _corpus(seed: int = 0, num_docs: int = 120):
  """Per-document vectors, 0..11 rows each (document 3 has none)."""
  rng = np.random.default_rng(seed)
  counts = rng.integers(1, 12, size=num_docs)
  counts[3] = 0
  flat = _clustered(rng, int(counts.sum()))
  return np.split(flat, np.cumsum(counts)[:-1])


def _exact(path, docs, dtype="float32", fingerprint=FINGERPRINT) -> index_lib.Index:
  batches = [np.arange(i, min(i + 16, len(docs)))[:, None] for i in range(0, len(docs), 16)]

  def encode(rows):  # row -> that document's vectors, padded
    m = max(max(len(docs[r]) for r in rows[:, 0]), 1)
    vectors, valid = np.zeros((len(rows), m, DIM), np.float32), np.zeros((len(rows), m), bool)
    for i, r in enumerate(rows[:, 0]):
      vectors[i, :len(docs[r])], valid[i, :len(docs[r])] = docs[r], True
    return vectors, valid
  return index_lib.build_index(str(path), [f"doc{i}" for i in range(len(docs))], batches,
                               encode, CONFIG, dtype=dtype, progress=False,
                               corpus_fingerprint=fingerprint, overwrite=True)


# ------------------------------------------------------------------------------- codec
def _numpy_codec(x, centroids, bits, rotation=None, lloyd=0):
  """Re-derivation: nearest centroid by explicit distances; the residuals turned by
  `rotation` (if any); per-dimension quantile cutoffs, each bucket decoded to the mean of the
  residuals in it, then `lloyd` rounds of (cutoffs = midpoints of adjacent means, means of
  the new buckets); rotated back; unit-norm decoding when every vector has unit norm.
  Returns (nearest, decoded, the rotated residuals' decoded values, their buckets' widths)."""
  distances = np.linalg.norm(x[:, None, :] - centroids[None], axis=-1)  # [n, k]
  nearest = np.argmin(distances, axis=1)
  rotation = np.eye(DIM) if rotation is None else rotation
  residuals = (x - centroids[nearest]) @ rotation
  levels = 2 ** bits
  values, widths = np.empty_like(x), np.empty_like(x)  # each value's decoding, bucket width
  for j in range(DIM):
    column = residuals[:, j]
    cuts = np.quantile(column, np.arange(1, levels) / levels)
    means = [np.quantile(column, (b + 0.5) / levels) for b in range(levels)]
    for round_ in range(lloyd + 1):
      if round_:
        cuts = [(means[b] + means[b + 1]) / 2 for b in range(levels - 1)]
      bucket = np.array([np.sum(np.asarray(cuts) <= r) for r in column])
      means = [column[bucket == b].mean() if np.any(bucket == b) else means[b]
               for b in range(levels)]
    edges = np.concatenate([[column.min()], cuts, [column.max()]])
    values[:, j] = np.array(means)[bucket]
    widths[:, j] = edges[bucket + 1] - edges[bucket]
  decoded = centroids[nearest] + values @ rotation.T
  if np.allclose(np.linalg.norm(x, axis=1), 1, atol=1e-3):
    decoded /= np.linalg.norm(decoded, axis=1, keepdims=True)
  return nearest, decoded, residuals, values, widths


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("scale", [1.0, 2.0])
@pytest.mark.parametrize("quantizer", codec_lib.QUANTIZERS)
def test_codec_round_trip_equals_numpy_rederivation(bits, scale, quantizer):
  x = scale * _clustered(np.random.default_rng(bits), 600)
  codec, backend = codec_lib.Codec.train(x, bits, num_centroids=12, seed=0, backend="numpy",
                                         quantizer=quantizer)
  assert backend == "numpy" and codec.centroids.shape == (12, DIM)
  assert codec.normalize == (scale == 1.0)  # unit vectors decode to unit vectors
  assert codec.quantizer == quantizer and (codec.rotation is None) == (quantizer == "quantile")
  codes, packed = codec.encode(x)
  assert packed.shape == (600, DIM * bits // 8) and packed.dtype == np.uint8
  lloyd = codec_lib.LLOYD_ITERATIONS if quantizer == "rotated-lloyd" else 0
  nearest, expected, residuals, values, widths = _numpy_codec(
      x.astype(np.float64), codec.centroids.astype(np.float64), bits,
      None if codec.rotation is None else codec.rotation.astype(np.float64), lloyd)
  np.testing.assert_array_equal(codes, nearest)
  decoded = codec.decode(codes, packed)
  np.testing.assert_allclose(decoded, expected, atol=1e-5)
  # every value (the sample is the data) is within its bucket's width
  assert np.all(np.abs(values - residuals) <= widths + 1e-5)
  if scale == 1.0:
    np.testing.assert_allclose(np.linalg.norm(decoded, axis=1), 1, atol=1e-5)
  # search's coordinates: a rotated query scores the rotated decoding as q.decoded
  q = np.random.default_rng(3).standard_normal((5, DIM)).astype(np.float32)
  np.testing.assert_allclose(codec.decode_rotated(codes, packed) @ codec.rotate(q).T,
                             decoded @ q.T, atol=1e-5)
  # encoding with the codes given (another index's) gives the same payload
  np.testing.assert_array_equal(codec.encode(x, codes)[1], packed)


def test_the_rotation_is_orthogonal_and_fixed_by_the_seed():
  r = codec_lib.random_rotation(DIM, 7).astype(np.float64)
  np.testing.assert_allclose(r @ r.T, np.eye(DIM), atol=1e-6)
  np.testing.assert_array_equal(codec_lib.random_rotation(DIM, 7), r.astype(np.float32))
  assert not np.allclose(codec_lib.random_rotation(DIM, 8), r, atol=0.1)


def test_rotation_and_lloyd_max_lower_the_error_on_anisotropic_vectors():
  """A small model's vectors put most variance in a few dimensions and leave some constant
  (the SciFact C = 4 index: 8 of 128 constant, 90 % of the variance in 41): there, at 2 bits,
  Lloyd-Max lowers the per-dimension squared error and the rotation lowers it further."""
  rng = np.random.default_rng(0)
  scales = np.concatenate([np.geomspace(1.0, 0.02, DIM - 4), np.zeros(4)])  # [DIM]
  x = rng.standard_normal((4000, DIM)) * scales + 0.3 * _clustered(rng, 4000)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  errors = {}
  for quantizer in codec_lib.QUANTIZERS:
    codec, _ = codec_lib.Codec.train(x, 2, num_centroids=32, seed=0, backend="numpy",
                                     quantizer=quantizer)
    errors[quantizer] = float(np.mean((codec.decode(*codec.encode(x)) - x) ** 2))
  residuals = x - codec.centroids[codec_lib.nearest_centroids(x, codec.centroids)]
  plain = codec_lib.bucket_table(residuals, 2)
  refined = codec_lib.bucket_table(residuals, 2, lloyd_iterations=10)

  def mse(table):
    cutoffs, weights = table
    buckets = codec_lib._buckets(cutoffs, residuals)
    return np.mean((np.take_along_axis(weights.T, buckets.astype(np.int64), 0) - residuals) ** 2)
  assert mse(refined) < mse(plain)
  assert errors["rotated-lloyd"] < 0.9 * errors["quantile"], errors


def test_error_shrinks_with_bits_and_none_is_lossless():
  x = _clustered(np.random.default_rng(5), 2000)
  errors = {}
  for bits in codec_lib.BITS:
    codec, _ = codec_lib.Codec.train(x, bits, num_centroids=16, seed=1, backend="numpy")
    errors[bits] = float(np.mean((codec.decode(*codec.encode(x)) - x) ** 2))
  assert errors[None] == 0.0
  assert errors[1] > errors[2] > errors[4] > errors[8]
  assert errors[8] < errors[1] / 300  # 256 buckets vs 2 (measured: about 1 / 660)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack_round_trip(bits):
  buckets = np.random.default_rng(0).integers(0, 2 ** bits, (7, 24)).astype(np.uint8)
  packed = codec_lib.pack_buckets(buckets, bits)
  assert packed.shape == (7, 24 * bits // 8)
  np.testing.assert_array_equal(codec_lib.unpack_buckets(packed, bits), buckets)
  # the first value of a byte sits in its lowest bits
  assert packed[0, 0] & (2 ** bits - 1) == buckets[0, 0]


def test_kmeans_backends_find_separated_clusters():
  rng = np.random.default_rng(3)
  centers = 10 * np.eye(DIM, dtype=np.float32)[:6]  # 6 clusters far apart
  x = centers[np.repeat(np.arange(6), 50)] + 0.1 * rng.standard_normal((300, DIM))
  for backend in ("numpy", "jax", "faiss"):  # jax: Lloyd's with the device's assignments
    if backend == "faiss":
      pytest.importorskip("faiss")
    found, used = codec_lib.kmeans(x.astype(np.float32), 6, iterations=20, seed=0,
                                   backend=backend)
    assert used == backend
    # each true center has a found centroid within the noise, and vice versa
    distances = np.linalg.norm(found[:, None] - centers[None], axis=-1)  # [6, 6]
    assert distances.min(axis=0).max() < 0.1 and distances.min(axis=1).max() < 0.1
  with pytest.raises(ValueError, match="multiple of 4"):
    codec_lib.Codec.train(x[:, :6], 2, 2)


def test_the_device_centroid_search_finds_the_nearest_centroid_in_every_chunk():
  """nearest_centroids on jax's device (what a GPU runs; forced here on the CPU) against a
  float64 numpy search: every vector's chosen centroid is at the minimum distance, across
  several fixed-size chunks and a padded last one; 'auto' keeps the host search on a CPU."""
  rng = np.random.default_rng(5)
  centroids = rng.standard_normal((4096, 16)).astype(np.float32)  # chunks of 16,384 rows
  vectors = rng.standard_normal((20000, 16)).astype(np.float32)
  got = codec_lib.nearest_centroids(vectors, centroids, device=True)
  x, c = vectors.astype(np.float64), centroids.astype(np.float64)
  dist = (x ** 2).sum(1)[:, None] - 2 * x @ c.T + (c ** 2).sum(1)[None]  # [n, k]
  chosen = dist[np.arange(len(x)), got]
  np.testing.assert_allclose(chosen, dist.min(axis=1), rtol=0, atol=1e-4)
  assert np.mean(got == dist.argmin(axis=1)) > 0.999  # ties aside, the same centroid
  assert not codec_lib.on_accelerator()  # so 'auto' below is the host search
  np.testing.assert_array_equal(codec_lib.nearest_centroids(vectors[:500], centroids),
                                codec_lib.nearest_centroids(vectors[:500], centroids,
                                                            device=False))


def test_the_probed_centroid_search_is_two_level_and_exhaustive_when_probing_every_cell():
  """codec.nearest_centroids(probe=p) on CPU with faiss, against a float64 numpy search:
  probing every coarse cell finds the nearest centroid of every vector; probing 8 of 64
  finds it for nearly all clustered vectors, and a miss is a centroid no nearer than the
  nearest; probing 1 already misses some (the search really is two-level)."""
  pytest.importorskip("faiss")
  rng = np.random.default_rng(6)
  centroids = rng.standard_normal((4096, 32)).astype(np.float32)
  vectors = (centroids[rng.integers(0, 4096, 20000)] +
             0.3 * rng.standard_normal((20000, 32))).astype(np.float32)
  x, c = vectors.astype(np.float64), centroids.astype(np.float64)
  dist = (x ** 2).sum(1)[:, None] - 2 * x @ c.T + (c ** 2).sum(1)[None]  # [n, k]
  cells = codec_lib.coarse_lists(len(centroids))
  assert cells == 64  # the power of two at or above sqrt(4096)
  every = codec_lib.nearest_centroids(vectors, centroids, device=False, probe=cells)
  np.testing.assert_allclose(dist[np.arange(len(x)), every], dist.min(axis=1), atol=1e-4)
  agreement = {}
  for probe in (1, 8):
    got = codec_lib.nearest_centroids(vectors, centroids, device=False, probe=probe)
    assert np.all(dist[np.arange(len(x)), got] >= dist.min(axis=1) - 1e-4)
    agreement[probe] = np.mean(np.isclose(dist[np.arange(len(x)), got], dist.min(axis=1),
                                          atol=1e-4))
  assert agreement[8] > 0.995 and agreement[1] < 0.95, agreement


def test_a_probed_codec_records_its_probe_and_codes_like_the_exhaustive_one(tmp_path):
  """An index built with centroid_probe: k-means and encoding searched two-level, the probe
  in its codec settings and in the codec it loads; its vectors decode as closely as the
  exhaustive build's (a near centroid's residual is coded all the same)."""
  pytest.importorskip("faiss")
  docs = _corpus(num_docs=300)
  exact = _exact(tmp_path / "exact", docs)
  built = {probe: residual.build_residual_index(
      str(tmp_path / f"res{probe}"), exact, ResidualConfig(
          4, num_centroids=256, sample_vectors=2000, kmeans_backend="faiss",
          centroid_probe=probe)) for probe in (0, 2)}
  assert built[2].meta["codec"]["centroid_probe"] == 2
  assert "centroid_probe" not in built[0].meta["codec"]  # older indexes read the same
  assert residual.ResidualIndex.open(str(tmp_path / "res2")).codec.centroid_probe == 2
  error = {}
  for probe, index in built.items():
    decoded = np.concatenate([index.doc_vectors(d) for d in range(len(docs))])
    truth = np.concatenate([exact.doc_vectors(d) for d in range(len(docs))])
    error[probe] = np.mean(np.sum((decoded - truth) ** 2, axis=1))
  assert error[2] < 1.25 * error[0], error


@pytest.mark.parametrize("bits", codec_lib.BITS)
def test_index_files_and_bytes_per_vector(tmp_path, bits):
  docs = _corpus()
  exact = _exact(tmp_path / "exact", docs, dtype="float16")
  built = residual.build_residual_index(str(tmp_path / "res"), exact, ResidualConfig(
      bits, num_centroids=12, sample_vectors=400, kmeans_backend="numpy"))
  n = exact.num_vectors
  payload = DIM * 2 if bits is None else DIM * bits // 8  # float16 vectors or packed codes
  assert built.meta["bytes_per_vector"] == 2 + payload  # uint16 centroid id
  assert built.nbytes == n * (2 + payload) == built.meta["bytes"]
  assert isinstance(built.codes, np.memmap) and isinstance(built.residuals, np.memmap)
  assert built.meta["fingerprint"] == exact.fingerprint
  assert built.meta["corpus"] == FINGERPRINT and built.meta["codec"]["sample_vectors"] == 400
  # the inverted lists hold each (centroid, doc) pair once, docs sorted within a list
  pairs = {(int(c), d) for d in range(len(docs)) for c in
           built.codes[built.offsets[d]:built.offsets[d + 1]]}
  listed = [(c, int(d)) for c in range(12)
            for d in built.ivf[built.ivf_offsets[c]:built.ivf_offsets[c + 1]]]
  assert sorted(listed) == sorted(pairs) and len(listed) == len(pairs)
  tolerance = {None: 0.0, 8: 2e-2}.get(bits, 1.0)  # None keeps the float16 vectors as they are
  np.testing.assert_allclose(built.doc_vectors(0), exact.doc_vectors(0), atol=tolerance)
  assert built.doc_vectors(3).shape == (0, DIM)
  assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
  with pytest.raises(FileExistsError, match="overwrite=True"):
    residual.build_residual_index(str(tmp_path / "res"), exact, ResidualConfig(bits, 12))
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "a.txt").write_text("keep")
  with pytest.raises(FileExistsError, match="is not an index"):
    residual.build_residual_index(str(tmp_path / "notes"), exact, ResidualConfig(bits),
                                  overwrite=True)


# ------------------------------------------------------------------------------- search
def _queries(seed: int = 9, num: int = 6):
  rng = np.random.default_rng(seed)
  vectors = _clustered(rng, num * 5).reshape(num, 5, DIM)  # [q, mq, d]
  valid = rng.random((num, 5)) < 0.8
  valid[:, 0] = True
  return vectors, valid


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_approximate_equals_exact_when_probing_every_centroid(tmp_path, dtype, backend):
  docs = _corpus(seed=1)
  exact = _exact(tmp_path / "exact", docs, dtype=dtype)
  approx = residual.build_residual_index(str(tmp_path / "res"), exact, ResidualConfig(
      None, num_centroids=10, kmeans_backend="numpy"))
  queries, valid = _queries()
  want_scores, want_ids = exact.search(queries, valid, top_k=30)
  scores, ids = approx.search(queries, valid, top_k=30, nprobe=10, candidates=len(docs),
                               backend=backend)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(scores, want_scores, rtol=1e-5)
  # the default candidate count covers a corpus this small (4 x top_k >= 120 docs)
  assert residual_search.default_candidates(30, len(docs)) >= len(docs)
  np.testing.assert_array_equal(approx.search(queries, valid, top_k=30, nprobe=10,
                                              backend=backend)[1], want_ids)
  # one query at a time ranks as the batch does
  np.testing.assert_array_equal(approx.search(queries, valid, top_k=30, nprobe=10,
                                              query_batch_size=1, backend=backend)[1],
                                want_ids)
  # with fewer probes the result is a subset of the candidates, still exactly scored
  few_scores, few_ids = approx.search(queries, valid, top_k=30, nprobe=1, candidates=8,
                                      query_cells=0, backend=backend)
  reference = dict(zip(want_ids[0].tolist(), want_scores[0].tolist()))
  for s, i in zip(few_scores[0], few_ids[0]):
    if i >= 0 and i in reference:
      assert s == pytest.approx(reference[i], rel=1e-5)
  assert (few_ids[0] >= 0).sum() <= 8
  run = approx.search_run([f"q{i}" for i in range(6)], queries, valid, top_k=5, nprobe=10,
                          candidates=len(docs), backend=backend)
  assert list(run["q2"]) == [f"doc{i}" for i in want_ids[2, :5]]


def _data(fingerprint):
  return types.SimpleNamespace(corpus_fingerprint=fingerprint, folder="/corpus")


def test_corpus_or_settings_change_rebuilds_and_config_change_is_refused(tmp_path, capsys):
  docs = _corpus()
  exact = _exact(tmp_path / "exact", docs)
  path = str(tmp_path / "exact.residual-b2")
  twelve = ResidualConfig(2, 12)
  first = pipeline.build_or_open_residual(path, _data(FINGERPRINT), exact, twelve)
  created = first.meta["created"]
  again = pipeline.build_or_open_residual(path, _data(FINGERPRINT), exact, twelve)
  assert again.meta["created"] == created and "Reusing the residual index" in capsys.readouterr().out
  changed = {"num_docs": 119, "sha256": "b" * 64}
  exact = _exact(tmp_path / "exact", docs[:119], fingerprint=changed)
  rebuilt = pipeline.build_or_open_residual(path, _data(changed), exact, ResidualConfig(2, 12))
  out = capsys.readouterr().out
  assert "WARNING: the corpus changed" in out and "120 -> 119 documents" in out
  assert rebuilt.meta["corpus"] == changed and rebuilt.num_docs == 119
  assert rebuilt.corpus_change(FINGERPRINT) == "119 -> 120 documents"
  more = pipeline.build_or_open_residual(path, _data(changed), exact, ResidualConfig(2, 8))
  assert "num_centroids 12 -> 8" in capsys.readouterr().out and more.num_centroids == 8
  # an index of the codec before 'rotated-lloyd' (no quantizer recorded) is rebuilt
  del more
  residual.build_residual_index(path, exact, ResidualConfig(2, 8, quantizer="quantile"),
                                overwrite=True)
  with open(os.path.join(path, "meta.json")) as f:
    meta = json.load(f)
  del meta["codec"]["quantizer"]
  index_lib.write_json(os.path.join(path, "meta.json"), meta)
  assert residual.ResidualIndex.open(path).codec.quantizer == "quantile"
  latest = pipeline.build_or_open_residual(path, _data(changed), exact, ResidualConfig(2, 8))
  assert "quantizer None -> 'rotated-lloyd'" in capsys.readouterr().out
  assert latest.codec.quantizer == "rotated-lloyd"
  with open(os.path.join(path, "meta.json")) as f:
    assert json.load(f)["config"] == CONFIG
  exact.meta["config"] = {**CONFIG, "passage_ratio": 8}
  exact.meta["fingerprint"] = index_lib.config_fingerprint(exact.meta["config"])
  with pytest.raises(index_lib.IndexConfigMismatchError, match="passage_ratio: built=4"):
    pipeline.build_or_open_residual(path, _data(changed), exact, ResidualConfig(2, 8))


def _numpy_approximate(approx, docs, q, nprobe, candidates, k, query_cells=0, keep=None):
  """Re-derivation of one query's approximate search, document by document: probe the nprobe
  centroids nearest (L2) to each unit query vector and, with every vector, the query_cells
  centroids of largest sum over the query vectors of max(q.c, 0); candidates = docs with a
  vector assigned (L2) to a centroid some query vector probed; centroid interaction = the
  sum over query vectors of the best q.c among the doc's vectors' centroids; keep the `keep`
  best (residual_search.refined_keep); refined centroid interaction = the same, a vector
  scoring its decoded value's dot product when it lies in a cell that query vector probed;
  keep the candidates best; rerank those by exact MaxSim over their decoded vectors."""
  centroids = approx.codec.centroids
  dots = q @ centroids.T  # [mq, k]
  unit = q / np.linalg.norm(q, axis=1, keepdims=True)
  distances = np.linalg.norm(unit[:, None] - centroids[None], axis=-1)  # [mq, k]
  shared = set(np.argsort(-np.maximum(dots, 0).sum(axis=0), kind="stable")[:query_cells])
  probed = [set(np.argsort(row, kind="stable")[:nprobe]) | shared for row in distances]
  union = set().union(*probed)
  plain, full = {}, {}
  for d, vectors in enumerate(docs):
    if len(vectors) == 0:
      continue
    cells = np.argmin(np.linalg.norm(vectors[:, None] - centroids[None], axis=-1), axis=1)
    if any(c in union for c in cells):
      plain[d] = sum(max(row[c] for c in cells) for row in dots)
      decoded = approx.doc_vectors(d)  # [count, dim]
      full[d] = sum(max(float(qv @ v) if c in p else row[c] for c, v in zip(cells, decoded))
                    for qv, row, p in zip(q, dots, probed))
  kept = sorted(plain, key=lambda d: (-plain[d], d))[:keep or residual_search.refined_keep(
      candidates)]
  kept = sorted(kept, key=lambda d: (-full[d], d))[:candidates]
  exact = {d: float(np.sum(np.max(q @ approx.doc_vectors(d).T, axis=1))) for d in kept}
  return sorted(exact, key=lambda d: (-exact[d], d))[:k], plain, full


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits,query_cells", [(2, 0), (None, 0), (2, 3)])
def test_approximate_search_equals_numpy_rederivation(tmp_path, monkeypatch, bits,
                                                      query_cells, backend):
  """Each backend against the re-derivation, with REFINED_KEEP lowered to 0 so that the
  plain interaction keeps 4 x candidates (16 of the candidates): every cut applies."""
  monkeypatch.setattr(residual_search, "REFINED_KEEP", 0)
  docs = _corpus(seed=4)
  exact = _exact(tmp_path / "exact", docs)
  approx = residual.build_residual_index(str(tmp_path / "res"), exact, ResidualConfig(
      bits, num_centroids=12, kmeans_backend="numpy"))
  queries, valid = _queries(seed=11)
  scores, ids = approx.search(queries, valid, top_k=4, nprobe=2, candidates=4,
                              query_cells=query_cells, backend=backend)
  for i in range(len(queries)):
    q = queries[i][valid[i]]
    want, plain, full = _numpy_approximate(approx, docs, q, nprobe=2, candidates=4, k=4,
                                           query_cells=query_cells, keep=16)
    assert len(plain) > 16  # every cut applies
    assert ids[i].tolist() == want
    # the numpy stages' scores of every candidate, against the re-derivation
    centroid_scores = (q @ approx.codec.centroids.T)[None]  # [1, mq, k]
    probed = residual_search.probe(approx, q[None], centroid_scores, 2, query_cells)
    cand = residual_search.candidates_of(approx, probed[0])
    assert cand.tolist() == sorted(plain)
    rotated = approx.codec.rotate(q)[None]
    for refine, want_scores in ((False, plain), (True, full)):
      got = residual_search.centroid_interaction(approx, rotated, centroid_scores, probed,
                                                 [cand], refine)[0][0]
      np.testing.assert_allclose(got, [want_scores[d] for d in cand], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(residual_search.rerank(approx, q, np.array(want)), scores[i],
                               rtol=1e-5)
    if backend == "compiled":  # the kernels' stage scores, against the same re-derivation
      _check_kernels(approx, centroid_scores[0], probed[0], rotated[0], plain, full)


def _check_kernels(approx, centroid_scores, probed, rotated, plain, full):
  """kernels.candidates_of and maxsim's three modes against the re-derivation's scores."""
  arrays = approx.kernel_arrays
  scores_t = kernels.padded(centroid_scores.T)  # [K, 8], zero past mq
  seen = np.zeros(-(-approx.num_docs // 64), np.uint64)
  found = kernels.candidates_of(np.unique(probed), arrays.ivf_offsets, arrays.ivf, seen)
  assert sorted(found.tolist()) == sorted(plain) and not seen.any()  # each once; bitmap reset
  docs = np.array(sorted(plain))[::-1].copy()  # any order
  in_probe = np.zeros(scores_t.shape, bool)  # [K, 8]
  in_probe[probed.T, np.arange(len(probed))] = True
  exact = {d: float(np.sum(np.max(rotated @ approx.scoring_vectors(
      np.arange(approx.offsets[d], approx.offsets[d + 1])).T, axis=1))) for d in docs}
  for mode, want in ((kernels.PLAIN, plain), (kernels.REFINED, full), (kernels.EXACT, exact)):
    got = kernels.maxsim(docs, arrays.offsets, arrays.codes, scores_t, in_probe, rotated, mode,
                         *arrays.coding)
    np.testing.assert_allclose(got, [want[d] for d in docs], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not kernels.AVAILABLE, reason=NO_NUMBA)
@pytest.mark.parametrize("bits,dtype", [(2, "float32"), (4, "float16"), (None, "float16")])
@pytest.mark.parametrize("refined_keep", [None, 0])
def test_the_two_backends_rank_alike(tmp_path, monkeypatch, bits, dtype, refined_keep):
  """'numpy' and 'compiled' at the same settings: the same top-k ids, in the same order,
  and scores within float32 rounding. The compiled sums run in another order: each dot
  product of unit vectors (d terms, each |q_i x_i| summing to <= 1) rounds by at most
  d x eps, the decoding's unit-norm scaling by a few eps more, and a MaxSim adds at most mq
  of them, each <= 1: mq x (d + 8) x eps bounds the difference (1.4e-5 here, eps = 2^-23).
  refined_keep 0: the plain interaction keeps 4 x candidates, so every cut applies."""
  if refined_keep is not None:
    monkeypatch.setattr(residual_search, "REFINED_KEEP", refined_keep)
  docs = _corpus(seed=7, num_docs=300)
  approx = residual.build_residual_index(str(tmp_path / "res"), _exact(
      tmp_path / "exact", docs, dtype=dtype), ResidualConfig(bits, 16, kmeans_backend="numpy"))
  queries, valid = _queries(seed=5, num=12)
  settings = dict(top_k=10, nprobe=2, candidates=12, query_cells=2)
  numpy_scores, numpy_ids = approx.search(queries, valid, backend="numpy", **settings)
  scores, ids = approx.search(queries, valid, backend="compiled", **settings)
  np.testing.assert_array_equal(ids, numpy_ids)
  assert (ids >= 0).all()
  tolerance = queries.shape[1] * (DIM + 8) * np.finfo(np.float32).eps
  np.testing.assert_allclose(scores, numpy_scores, rtol=0, atol=tolerance)


@pytest.mark.skipif(not kernels.AVAILABLE, reason=NO_NUMBA)
def test_the_float16_decoder_converts_every_bit_pattern_as_numpy_does():
  halves = np.arange(1 << 16, dtype=np.uint16).reshape(-1, 64)  # [1024, 64], all patterns
  got = np.empty(halves.shape, np.float32)
  for row in range(len(halves)):
    kernels.decode_half(halves, row, 0, None, None, False, got[row])
  np.testing.assert_array_equal(got, halves.view(np.float16).astype(np.float32))  # NaN == NaN


@pytest.mark.skipif(not kernels.AVAILABLE, reason=NO_NUMBA)
@pytest.mark.parametrize("bits,dtype", [(1, "float32"), (4, "float32"), (8, "float16"),
                                        (None, "float16")])
def test_compiled_exact_maxsim_equals_the_numpy_rerank(tmp_path, bits, dtype):
  docs = _corpus(seed=6)
  approx = residual.build_residual_index(str(tmp_path / "res"), _exact(
      tmp_path / "exact", docs, dtype=dtype), ResidualConfig(bits, 8, kmeans_backend="numpy"))
  queries, valid = _queries(seed=2)
  hits = np.flatnonzero([len(d) > 0 for d in docs])
  for q in (query[v] for query, v in zip(queries, valid)):
    scores, ids = approx.search(q[None], np.ones((1, len(q)), bool), top_k=len(hits),
                                nprobe=8, candidates=len(docs), backend="compiled")
    np.testing.assert_array_equal(np.sort(ids[0]), hits)  # every doc with a vector
    np.testing.assert_allclose(scores[0], residual_search.rerank(approx, q, ids[0]),
                               rtol=1e-5, atol=1e-6)


def test_the_backend_is_explicit_and_compiled_without_numba_names_the_extra(tmp_path,
                                                                             monkeypatch):
  approx = residual.build_residual_index(str(tmp_path / "res"), _exact(
      tmp_path / "exact", _corpus()), ResidualConfig(2, 8, kmeans_backend="numpy"))
  queries, valid = _queries()
  with pytest.raises(ValueError, match="backend must be one of"):
    approx.search(queries, valid, backend="numba")
  monkeypatch.setattr(kernels, "AVAILABLE", False)
  with pytest.raises(ImportError, match=r"pip install 'decal_jax\[ann\]'"):
    approx.search(queries, valid, backend="compiled")
  assert residual_search.DEFAULT_BACKEND == "numpy"
  approx.search(queries, valid, top_k=3)  # the default: numpy, whether numba is or not


@pytest.mark.parametrize("width,k,block", [(32768, 8, 64), (1030, 5, 16), (1000, 3, 64),
                                          (5, 7, 64)])
def test_top_columns_are_the_k_largest_of_each_row(width, k, block):
  """Against a full sort, with the largest values planted where blocks are tested hardest:
  all k in one block, one in the columns after the last whole block."""
  rng = np.random.default_rng(width + k)
  x = rng.normal(size=(23, width)).astype(np.float32)
  if width >= 3 * block:
    x[0, 2 * block:2 * block + k] = 10 + np.arange(k)  # one block holds all k
  x[1, -1] = 20.0  # the partial block (1030 = 64 x 16 + 6) or the last column
  got = topk.top_columns(x, k, block)
  want = np.argsort(-x, axis=-1, kind="stable")[:, :k]
  assert got.shape == want.shape
  assert [sorted(row) for row in got.tolist()] == [sorted(row) for row in want.tolist()]


def test_query_cells_find_a_pooled_vector_no_single_query_vector_is_near(tmp_path):
  """Hand-worked: a passage's one vector pools four words, v = (e1 + e2 + e3 + e4) / 2, in
  its own cell; the query is the four words e1..e4, each nearest to its own word's cell
  (distance 0 against |e_i - v| = 1). One probe per query vector misses the passage; the
  query's best cell by summed similarity (4 x 0.5 = 2 at v, 1 at each e_i) finds it, and it
  ranks first with MaxSim 2 against 1 for each single-word passage."""
  eye = np.eye(DIM, dtype=np.float32)
  pooled = eye[:4].sum(axis=0, keepdims=True) / 2  # [1, DIM], unit
  docs = [eye[i:i + 1] for i in range(4)] + [pooled] + [eye[i:i + 1] for i in range(4, DIM)]
  exact = _exact(tmp_path / "exact", docs)
  centroids = np.concatenate([eye, pooled])  # [DIM + 1, DIM]: each doc in its own cell
  approx = residual.build_residual_index(str(tmp_path / "res"), exact, ResidualConfig(None),
                                         reuse=residual.Reuse(centroids=centroids))
  queries, valid = eye[None, :4], np.ones((1, 4), bool)  # [1, 4, DIM]
  _, missed = approx.search(queries, valid, top_k=3, nprobe=1, query_cells=0)
  assert 4 not in missed[0] and sorted(missed[0][:3]) == [0, 1, 2]
  scores, found = approx.search(queries, valid, top_k=3, nprobe=1, query_cells=1)
  assert found[0, 0] == 4 and scores[0, 0] == pytest.approx(2.0)
  assert residual_search.probe(approx, queries, queries @ centroids.T, 1, 1)[0, :, 1].tolist(
      ) == [DIM] * 4
  with pytest.raises(ValueError, match="query_cells >= 0"):
    approx.search(queries, valid, nprobe=1, query_cells=-1)


def test_a_rotated_index_without_its_rotation_names_the_file(tmp_path):
  exact = _exact(tmp_path / "exact", _corpus(seed=3))
  built = residual.build_residual_index(str(tmp_path / "res"), exact, ResidualConfig(
      2, num_centroids=8, kmeans_backend="numpy"))
  assert built.codec.quantizer == "rotated-lloyd" and built.meta["codec"]["quantizer"] == (
      "rotated-lloyd")
  reopened = residual.ResidualIndex.open(str(tmp_path / "res"))
  np.testing.assert_array_equal(reopened.codec.rotation, built.codec.rotation)
  (tmp_path / "res" / "rotation.npy").unlink()
  with pytest.raises(FileNotFoundError, match="rotation.npy.*Rebuild it"):
    residual.ResidualIndex.open(str(tmp_path / "res"))


def test_codes_reuse_gives_the_same_index(tmp_path):
  docs = _corpus(seed=2)
  exact = _exact(tmp_path / "exact", docs)
  first = residual.build_residual_index(str(tmp_path / "a"), exact, ResidualConfig(
      4, num_centroids=12, kmeans_backend="numpy"))
  again = residual.build_residual_index(str(tmp_path / "b"), exact, ResidualConfig(4),
                                        reuse=residual.Reuse(first.codec.centroids,
                                                             np.asarray(first.codes)))
  np.testing.assert_array_equal(np.asarray(again.codes), np.asarray(first.codes))
  np.testing.assert_array_equal(np.asarray(again.residuals), np.asarray(first.residuals))
  with pytest.raises(ValueError, match="one id per source vector"):
    residual.build_residual_index(str(tmp_path / "c"), exact, ResidualConfig(4),
                                  reuse=residual.Reuse(first.codec.centroids,
                                                       np.asarray(first.codes)[:-1]))


def test_the_refined_interaction_scores_refined_keep_documents():
  # REFINED_KEEP (8,192), never below 4 x candidates: the same widths for both backends
  assert [residual_search.refined_keep(c) for c in (4, 200, 2048, 4096)] == [
      8192, 8192, 8192, 16384]
