"""The residual codec of the compressed multi-vector index (ColBERTv2's), apart from the
index and search that use it (residual.py, sharded.py).

k-means centroids over a sample of the corpus's vectors; each vector is stored as the id of
its nearest centroid (L2) and its residual (vector - centroid) quantised to b bits per
dimension. Two quantizers (`QUANTIZERS`):

  'quantile' (ColBERTv2's): per dimension j, the 2^b - 1 bucket cutoffs are the sample
    residuals' quantiles at i / 2^b (i = 1 .. 2^b - 1) and the 2^b bucket weights (the
    decoded values) the mean of the sample residuals in each bucket (the quantile at
    (i + 0.5) / 2^b for a bucket the sample leaves empty);
  'rotated-lloyd' (the default): the residuals are first turned by a random orthogonal
    rotation R (`random_rotation(d, seed)`), which spreads their variance evenly over the
    dimensions (a small model's vectors put most of it in a few, and leave some dimensions
    constant: 2 bits there are wasted), then the quantile buckets are refined by
    `LLOYD_ITERATIONS` Lloyd-Max steps (each cutoff the midpoint of its neighbouring weights,
    each weight its bucket's mean), which minimise each dimension's squared error. On three
    SciFact C = 4 fine-tunes, 2-bit codes lost 0.0045 +- 0.0014 NDCG@10 against
    uncompressed ones, where 'quantile' lost 0.0124 +- 0.0008
    (docs/results/retrieval_scale_cpu.md).

A residual value r decodes to the weight of the bucket holding it (the number of cutoffs
<= r). So decoding is centroid + weights[j, bucket] (rotated back: centroid + w R^T), and a
value inside the sample's range is off by at most its bucket's width (in the rotated
coordinates); when the sample's vectors all have unit norm (as the encoders' do), the decoded
vector is scaled back to unit norm. Search never rotates back: it scores the rotated
decoded vectors against rotated queries (`decode_rotated`, `rotate`; q.x = qR.xR). b is 1,
2, 4 or 8 (8 / b codes per byte, so d must be a multiple of 8 / b), or None: the vectors are
kept as they are (the source index's dtype), with their centroid ids for the candidate step.

k-means runs in faiss when `faiss-cpu` is installed (the `[ann]` extra), else in numpy
(`kmeans_numpy`, Lloyd's iterations from a random sample of points): same results up to the
clustering's own randomness, the numpy one slower on large samples. On a GPU or TPU (jax's
default backend is not the CPU) the nearest-centroid search, of k-means and of encoding,
runs there instead (`_nearest_on_device`: the same |c|^2 - 2 x.c, in float32 at full
precision), and k-means is Lloyd's with those assignments ('jax'): the 16M vectors x 32,768
centroids of a 1M-passage index are about 140 TFLOP of matmul, minutes on CPU cores.
On CPU cores with faiss, `centroid_probe` > 0 makes that search two-level
(`probed_search_index`: a faiss IndexIVFFlat over the centroids in coarse_lists(k)
coarse cells; the nearest of the centroids in the `centroid_probe` nearest cells), for
k-means and encoding alike: 32,768 centroids at probe 8 cost 256 + 8 x 128 distances per
vector instead of 32,768, and some vectors get a near rather than the nearest centroid
(their residual is coded all the same).
"""
import functools
import json
import logging
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from decal_jax import fileio
from decal_jax.retrieval import index as exact

BITS = (1, 2, 4, 8, None)
QUANTIZERS = ("quantile", "rotated-lloyd")
DEFAULT_QUANTIZER = "rotated-lloyd"
LLOYD_ITERATIONS = 10  # converged after about 5 on SciFact's residuals

# ------------------------------------------------------------------------------- k-means
def default_num_centroids(num_vectors: int) -> int:
  """ColBERTv2's choice: the power of two at or below 16 * sqrt(num_vectors)."""
  return 1 << int(np.floor(np.log2(16 * np.sqrt(max(num_vectors, 1)))))


def on_accelerator() -> bool:
  """Whether jax computes on a GPU / TPU here (then the centroid search runs there)."""
  import jax
  return jax.default_backend() != "cpu"


class CentroidSearch:
  """The L2-nearest centroid of vectors against one centroid table `[k, d]`, its search
  structure built once (encoding calls it once per chunk of the corpus). On jax's device
  when `device` (default: when that is a GPU / TPU), else faiss's exhaustive search when
  installed, else numpy; all rank by |c|^2 - 2 x.c. `probe` > 0 (CPU, faiss): the nearest of
  the centroids in the `probe` nearest coarse cells (`probed_search_index`)."""

  def __init__(self, centroids: np.ndarray, device: Optional[bool] = None, probe: int = 0):
    self.centroids = np.ascontiguousarray(centroids, np.float32)  # [k, d]
    self.device = on_accelerator() if device is None else device
    self.squared = np.sum(self.centroids ** 2, axis=1)  # [k]
    faiss = None if self.device else _faiss()
    k, d = self.centroids.shape
    if faiss is not None and 0 < probe < coarse_lists(k):
      self.index = probed_search_index(d, k, probe, self.centroids)
    elif faiss is not None:
      self.index = faiss.IndexFlatL2(d)
    else:
      self.index = None
    if self.index is not None:
      self.index.add(self.centroids)

  def __call__(self, vectors: np.ndarray, chunk: int = 8192) -> np.ndarray:
    """`[n, d]` -> int64 `[n]`."""
    if self.device:
      return _nearest_on_device(vectors, self.centroids)
    out = np.empty(len(vectors), np.int64)
    for start in range(0, len(vectors), chunk):
      x = np.ascontiguousarray(vectors[start:start + chunk], np.float32)  # [c, d]
      if self.index is not None:
        out[start:start + chunk] = self.index.search(x, 1)[1][:, 0]
      else:
        out[start:start + chunk] = np.argmin(self.squared[None, :] - 2 * x @ self.centroids.T,
                                             axis=1)
    return out


def nearest_centroids(vectors: np.ndarray, centroids: np.ndarray, chunk: int = 8192,
                      device: Optional[bool] = None, probe: int = 0) -> np.ndarray:
  """The L2-nearest centroid of each vector, `CentroidSearch` built for this one call:
  `[n, d]`, `[k, d]` -> int64 `[n]`."""
  return CentroidSearch(centroids, device, probe)(vectors, chunk)


def _faiss():
  try:
    import faiss
    return faiss
  except ImportError:
    return None


def coarse_lists(k: int) -> int:
  """The coarse cells of a probed centroid search: the power of two at or above sqrt(k)."""
  return 1 << int(np.ceil(np.log2(np.sqrt(max(k, 1)))))


def probed_search_index(dim: int, k: int, probe: int, train: np.ndarray, seed: int = 0):
  """An empty faiss IndexIVFFlat for searching `k` centroids two-level (add them next):
  its coarse quantizer, coarse_lists(k) cells by k-means on `train` `[n, d]` (the
  centroids, or sample vectors before there are any), probes the `probe` nearest cells."""
  faiss = _faiss()
  ivf = faiss.IndexIVFFlat(faiss.IndexFlatL2(dim), dim, coarse_lists(k))
  ivf.cp.seed, ivf.cp.min_points_per_centroid = seed, 1
  ivf.train(np.ascontiguousarray(train, np.float32))
  ivf.nprobe = probe
  return ivf


def _nearest_on_device(vectors: np.ndarray, centroids: np.ndarray) -> np.ndarray:
  """nearest_centroids on jax's default device, in chunks of a fixed row count (one
  compilation; about 256 MiB of scores each), the last one padded."""
  import jax.numpy as jnp
  c = jnp.asarray(centroids)  # [k, d]
  squared = jnp.sum(c * c, axis=1)  # [k]
  rows = max(256, min(65536, (1 << 26) // len(centroids)))
  out = np.empty(len(vectors), np.int64)
  for start in range(0, len(vectors), rows):
    x = np.asarray(vectors[start:start + rows], np.float32)  # [<= rows, d]
    padded = np.pad(x, ((0, rows - len(x)), (0, 0)))  # [rows, d]
    out[start:start + len(x)] = np.asarray(_nearest_chunk()(padded, c, squared))[:len(x)]
  return out


@functools.lru_cache(maxsize=None)
def _nearest_chunk():
  """The jitted chunk search (compiled once per shape, across k-means iterations):
  `[rows, d]`, `[k, d]`, `[k]` -> `[rows]`."""
  import jax
  import jax.numpy as jnp

  def nearest(x, c, squared):
    scores = squared[None, :] - 2 * jnp.dot(x, c.T, precision=jax.lax.Precision.HIGHEST)
    return jnp.argmin(scores, axis=1)  # [rows]
  return jax.jit(nearest)


def kmeans_numpy(sample: np.ndarray, k: int, iterations: int, seed: int,
                 device: Optional[bool] = None, probe: int = 0) -> np.ndarray:
  """Lloyd's k-means from k distinct random sample points; an empty cluster keeps its
  centroid. `[n, d]` -> `[k, d]` float32. Assignments as `nearest_centroids(device=,
  probe=)`."""
  rng = np.random.default_rng(seed)
  sample = np.asarray(sample, np.float32)
  centroids = sample[rng.choice(len(sample), size=k, replace=False)].copy()  # [k, d]
  for _ in range(iterations):
    assigned = nearest_centroids(sample, centroids, device=device, probe=probe)  # [n]
    counts = np.bincount(assigned, minlength=k)  # [k]
    sums = np.zeros_like(centroids)
    np.add.at(sums, assigned, sample)
    filled = counts > 0
    centroids[filled] = sums[filled] / counts[filled, None]
  return centroids


def kmeans(sample: np.ndarray, k: int, iterations: int = 10, seed: int = 0,
           backend: str = "auto", probe: int = 0) -> Tuple[np.ndarray, str]:
  """(centroids `[k, d]` float32, the backend that ran: 'jax', 'faiss' or 'numpy').
  backend: 'auto' ('jax' on a GPU / TPU, else faiss when installed, else numpy), 'jax'
  (Lloyd's with the assignments on jax's device), 'faiss' or 'numpy'. probe > 0: the
  CPU backends assign two-level (nearest_centroids; faiss: its assignment index is
  probed_search_index, coarse cells from a sample of the points)."""
  if backend not in ("auto", "jax", "faiss", "numpy"):
    raise ValueError("kmeans backend must be 'auto', 'jax', 'faiss' or 'numpy', got "
                     f"{backend!r}.")
  if backend == "jax" or (backend == "auto" and on_accelerator()):
    return kmeans_numpy(sample, k, iterations, seed, device=True), "jax"
  faiss = _faiss() if backend != "numpy" else None
  if faiss is None and backend == "faiss":
    raise ImportError("kmeans backend 'faiss' needs faiss-cpu: pip install "
                      "'decal_jax[ann]' (or use backend 'auto' / 'numpy').")
  if faiss is not None:
    sample = np.ascontiguousarray(sample, np.float32)
    model = faiss.Kmeans(sample.shape[1], k, niter=iterations, seed=seed, verbose=False,
                         min_points_per_centroid=1, max_points_per_centroid=1 << 30)
    if 0 < probe < coarse_lists(k):
      coarse = np.random.default_rng(seed).choice(len(sample), min(len(sample), 64 * (
          coarse_lists(k))), replace=False)
      model.index = probed_search_index(sample.shape[1], k, probe, sample[coarse], seed)
    model.train(sample)
    return np.asarray(model.centroids, np.float32), "faiss"
  return kmeans_numpy(sample, k, iterations, seed, device=False, probe=probe), "numpy"


# ------------------------------------------------------------------------------- codec
def pack_buckets(buckets: np.ndarray, bits: int) -> np.ndarray:
  """Bucket ids `[n, d]` (each < 2^bits) -> bytes `[n, d * bits / 8]`, 8 / bits per byte,
  the first of each group in the lowest bits."""
  per_byte = 8 // bits
  groups = buckets.astype(np.uint8).reshape(len(buckets), buckets.shape[1] // per_byte,
                                            per_byte)  # [n, d/per, per]
  shifts = (bits * np.arange(per_byte)).astype(np.uint8)  # [per]
  return np.bitwise_or.reduce(groups << shifts, axis=2).astype(np.uint8)


def unpack_buckets(packed: np.ndarray, bits: int) -> np.ndarray:
  """The inverse of `pack_buckets`: `[n, d * bits / 8]` -> bucket ids uint8 `[n, d]`."""
  per_byte = 8 // bits
  shifts = (bits * np.arange(per_byte)).astype(np.uint8)  # [per]
  parts = (packed[:, :, None] >> shifts) & np.uint8((1 << bits) - 1)  # [n, d/per, per]
  return parts.reshape(len(packed), packed.shape[1] * per_byte)


class Codec:
  """Centroids and, for b bits, per-dimension bucket cutoffs and weights (module doc)."""

  def __init__(self, centroids: np.ndarray, bits: Optional[int],
               cutoffs: Optional[np.ndarray] = None, weights: Optional[np.ndarray] = None,
               normalize: bool = False, rotation: Optional[np.ndarray] = None,
               centroid_probe: int = 0):
    self.centroids = np.asarray(centroids, np.float32)  # [k, d], unrotated
    self.bits = bits
    self.cutoffs = cutoffs  # [d, 2^b - 1] or None
    self.weights = weights  # [d, 2^b] or None
    self.normalize = normalize  # decoded vectors scaled to unit norm (b bits only)
    self.rotation = None if rotation is None else np.asarray(rotation, np.float32)  # [d, d]
    self.centroid_probe = centroid_probe  # > 0: encoding's centroid search is two-level

  @classmethod
  def train(cls, sample: np.ndarray, bits: Optional[int], num_centroids: int,
            iterations: int = 10, seed: int = 0, backend: str = "auto",
            centroids: Optional[np.ndarray] = None,
            quantizer: str = DEFAULT_QUANTIZER, probe: int = 0) -> Tuple["Codec", str]:
    """(the codec learned from sample `[n, d]`, the k-means backend that ran); given
    `centroids` (e.g. another bit width's), only the buckets are learned. Decoding
    normalises when every sample vector has unit norm (to 1e-3), as the encoders' are.
    quantizer: one of QUANTIZERS (module doc); the rotation is drawn from `seed`. probe:
    k-means's and encoding's centroid search is two-level (nearest_centroids)."""
    check_bits(bits, sample.shape[1])
    if quantizer not in QUANTIZERS:
      raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {quantizer!r}.")
    if centroids is None:
      centroids, used = kmeans(sample, num_centroids, iterations, seed, backend, probe)
    else:
      centroids, used = np.asarray(centroids, np.float32), "given"
    if bits is None:
      return cls(centroids, None, centroid_probe=probe), used
    rotation = random_rotation(sample.shape[1], seed) if quantizer == "rotated-lloyd" else None
    codec = cls(centroids, bits, rotation=rotation, centroid_probe=probe)
    nearest = codec.centroid_search(sample)  # [n]
    residuals = codec.rotate(sample - centroids[nearest])  # [n, d]
    codec.cutoffs, codec.weights = bucket_table(
        residuals, bits, LLOYD_ITERATIONS if quantizer == "rotated-lloyd" else 0)
    codec.normalize = bool(np.all(np.abs(np.linalg.norm(sample, axis=1) - 1) < 1e-3))
    return codec, used

  @functools.cached_property
  def centroid_search(self) -> CentroidSearch:
    """The nearest-centroid search of encoding (two-level when centroid_probe > 0)."""
    return CentroidSearch(self.centroids, probe=self.centroid_probe)

  @property
  def quantizer(self) -> Optional[str]:
    """The quantizer it was trained with (None: uncompressed)."""
    return None if self.bits is None else "quantile" if self.rotation is None else "rotated-lloyd"

  def rotate(self, vectors: np.ndarray) -> np.ndarray:
    """`[..., d]` into the residual codes' coordinates (x R; unchanged without rotation):
    dot products are kept, so queries turned alike score decoded vectors as before."""
    return vectors if self.rotation is None else np.asarray(vectors, np.float32) @ self.rotation

  @property
  def dim(self) -> int:
    return int(self.centroids.shape[1])

  @property
  def code_dtype(self) -> np.dtype:
    return np.dtype(np.uint16 if len(self.centroids) <= 1 << 16 else np.uint32)

  def buckets(self, residuals: np.ndarray) -> np.ndarray:
    """Residuals `[n, d]` -> bucket ids uint8 `[n, d]` (cutoffs <= the value, per dim)."""
    return _buckets(self.cutoffs, residuals)

  def encode(self, vectors: np.ndarray, codes: Optional[np.ndarray] = None
             ) -> Tuple[np.ndarray, np.ndarray]:
    """Vectors `[n, d]` -> (centroid ids `[n]`, packed residual codes `[n, d * b / 8]`, or
    the vectors themselves when bits is None). codes: their nearest centroids, if known."""
    codes = self.centroid_search(vectors) if codes is None else np.asarray(codes, np.int64)
    if self.bits is None:
      return codes.astype(self.code_dtype), vectors
    residuals = self.rotate(np.asarray(vectors, np.float32) - self.centroids[codes])  # [n, d]
    return codes.astype(self.code_dtype), pack_buckets(self.buckets(residuals), self.bits)

  def decode(self, codes: np.ndarray, payload: np.ndarray) -> np.ndarray:
    """(centroid ids `[n]`, payload as `encode` returns) -> vectors float32 `[n, d]`."""
    out = self.decode_rotated(codes, payload)  # [n, d]
    return out if self.rotation is None else out @ self.rotation.T

  def decode_rotated(self, codes: np.ndarray, payload: np.ndarray) -> np.ndarray:
    """`decode` in the rotated coordinates (x R), what search scores against `rotate`d
    queries: no rotation back."""
    if self.bits is None:
      return np.asarray(payload, np.float32)
    packed = np.asarray(payload)  # [n, d * b / 8]
    positions = 256 * np.arange(packed.shape[1], dtype=np.int32)  # [d * b / 8]
    residuals = np.take(self.byte_table.reshape(-1, 8 // self.bits), packed + positions,
                        axis=0)  # [n, d * b / 8, 8 / b]: one lookup per byte
    out = self.rotated_centroids[np.asarray(codes, np.int64)] + residuals.reshape(
        len(packed), self.dim)  # [n, d]
    if self.normalize:
      out /= np.maximum(np.sqrt(np.einsum("nd,nd->n", out, out)), 1e-12)[:, None]
    return out

  @functools.cached_property
  def rotated_centroids(self) -> np.ndarray:
    """The centroids in the rotated coordinates `[k, d]`."""
    return self.rotate(self.centroids)

  @functools.cached_property
  def byte_table(self) -> np.ndarray:
    """The decoded residual values of every packed byte at every byte position, so that
    decoding is one lookup per byte: `[d * b / 8, 256, 8 / b]` float32."""
    per_byte = 8 // self.bits
    values = np.arange(256, dtype=np.uint8)[:, None]  # [256, 1]
    buckets = unpack_buckets(values, self.bits)  # [256, 8 / b]
    dims = np.arange(self.dim).reshape(-1, per_byte)  # [d * b / 8, 8 / b]
    return self.weights[dims[:, None, :], buckets[None, :, :]]  # [d*b/8, 256, 8/b]

  def bytes_per_vector(self, source_itemsize: int) -> int:
    """Stored bytes of one vector: its centroid id plus its residual codes (or values)."""
    payload = self.dim * source_itemsize if self.bits is None else self.dim * self.bits // 8
    return self.code_dtype.itemsize + payload


def _buckets(cutoffs: np.ndarray, residuals: np.ndarray) -> np.ndarray:
  """Per dimension j, the number of cutoffs[j] <= each value: `[d, 2^b - 1]`, `[n, d]` ->
  uint8 `[n, d]`."""
  out = np.empty(residuals.shape, np.uint8)
  for j in range(residuals.shape[1]):
    out[:, j] = np.searchsorted(cutoffs[j], residuals[:, j], side="right")
  return out


def bucket_table(residuals: np.ndarray, bits: int,
                 lloyd_iterations: int = 0) -> Tuple[np.ndarray, np.ndarray]:
  """Per dimension, the 2^b - 1 cutoffs (the sample residuals' quantiles at i / 2^b) and the
  2^b weights: the mean of the sample residuals in each bucket (the value that minimises the
  bucket's squared error; the quantile at (i + 0.5) / 2^b for a bucket the sample leaves
  empty); then `lloyd_iterations` Lloyd-Max steps: cutoffs to the midpoints of adjacent
  weights, weights to their new buckets' means (an emptied bucket keeps its weight).
  `[n, d]` -> (float32 `[d, 2^b - 1]`, float32 `[d, 2^b]`)."""
  levels = 1 << bits
  cutoffs = np.quantile(residuals, np.arange(1, levels) / levels, axis=0).T  # [d, 2^b-1]
  weights = np.quantile(residuals, (np.arange(levels) + 0.5) / levels, axis=0).T  # [d, 2^b]
  for step in range(lloyd_iterations + 1):
    if step:
      cutoffs = (weights[:, 1:] + weights[:, :-1]) / 2  # [d, 2^b - 1]
    buckets = _buckets(cutoffs, residuals).astype(np.int64)  # [n, d]
    flat = buckets + levels * np.arange(residuals.shape[1])[None, :]  # [n, d] (dim, bucket)
    counts = np.bincount(flat.ravel(), minlength=weights.size).reshape(weights.shape)
    sums = np.bincount(flat.ravel(), residuals.ravel(), weights.size).reshape(weights.shape)
    filled = counts > 0
    weights[filled] = sums[filled] / counts[filled]
  return cutoffs.astype(np.float32), weights.astype(np.float32)


def random_rotation(dim: int, seed: int) -> np.ndarray:
  """A random orthogonal `[dim, dim]` float32 matrix (Haar: QR of a Gaussian matrix, the
  columns' signs fixed by R's diagonal), the same for the same (dim, seed)."""
  gaussian = np.random.default_rng([seed, dim]).standard_normal((dim, dim))
  q, r = np.linalg.qr(gaussian)
  return (q * np.sign(np.diag(r))[None, :]).astype(np.float32)


def check_bits(bits: Optional[int], dim: int) -> None:
  if bits not in BITS:
    raise ValueError(f"residual bits must be one of {BITS} (None = uncompressed), got "
                     f"{bits!r}.")
  if bits is not None and dim % (8 // bits):
    raise ValueError(f"{bits}-bit residuals pack {8 // bits} dimensions per byte, so the "
                     f"dimension must be a multiple of {8 // bits}; it is {dim}. Choose "
                     "other bits (8 or None fit any dimension).")


# ------------------------------------------------------------------------------- training
def _centroid_count(requested: Optional[int], num_vectors: int, sample_size: int) -> int:
  """The centroids k-means can train: `requested` (None: the default) clamped to the
  sample's vectors, with a WARNING naming both counts when a requested one is (the
  default exceeds a tiny index's vectors, and is clamped quietly)."""
  if requested is None or requested <= sample_size:
    return min(requested or default_num_centroids(num_vectors), sample_size)
  logging.warning(
      "num_centroids = %d is more than the %d vector(s) k-means trains on (the index has %d"
      " vector(s); each centroid needs one); using %d centroids. Ask for at most %d, or "
      "None for the default.", requested, sample_size, num_vectors, sample_size, sample_size)
  return sample_size


def train_codec(source: exact.Index, bits: Optional[int], num_centroids: Optional[int] = None,
                sample_vectors: int = 1 << 16, kmeans_iterations: int = 10, seed: int = 0,
                kmeans_backend: str = "auto", centroids: Optional[np.ndarray] = None,
                quantizer: str = DEFAULT_QUANTIZER,
                centroid_probe: int = 0) -> Tuple[Codec, Dict[str, Any]]:
  """(the codec trained on a sample of `source`'s vectors, its settings incl.
  'kmeans_backend', and 'centroid_probe' when > 0); `source` needs only num_vectors, dim
  and vectors[sorted rows]."""
  check_bits(bits, source.dim)
  rng = np.random.default_rng(seed)
  sample_size = min(sample_vectors, source.num_vectors)
  rows = np.sort(rng.choice(source.num_vectors, size=sample_size, replace=False))
  sample = np.asarray(source.vectors[rows], np.float32)  # [sample, d]
  k = len(centroids) if centroids is not None else _centroid_count(
      num_centroids, source.num_vectors, sample_size)
  codec, backend = Codec.train(sample, bits, k, kmeans_iterations, seed, kmeans_backend,
                               centroids, quantizer, centroid_probe)
  return codec, {"bits": bits, "num_centroids": k, "sample_vectors": sample_size,
                 "kmeans_iterations": kmeans_iterations, "seed": seed,
                 "normalize": codec.normalize, "quantizer": codec.quantizer,
                 "kmeans_backend": backend,
                 **({"centroid_probe": centroid_probe} if centroid_probe else {})}


def quantizer_setting(bits: Optional[int], quantizer: str = DEFAULT_QUANTIZER) -> Optional[str]:
  """The 'quantizer' a codec of these bits records (None when uncompressed): compared with
  an index's to decide whether it was built by this codec."""
  return None if bits is None else quantizer


def save_codec(directory: str, codec: Codec, settings: Mapping[str, Any]) -> None:
  """Writes the codec (centroids, cutoffs, weights) and its settings to `directory`, whole."""
  with fileio.atomic_directory(directory) as folder:
    np.save(os.path.join(folder, "centroids.npy"), codec.centroids)
    save_tables(str(folder), codec)
    exact.write_json(os.path.join(folder, "codec.json"), dict(settings))


def save_tables(folder: str, codec: Codec) -> None:
  """The b-bit codec's cutoffs.npy, weights.npy and (rotated) rotation.npy in `folder`."""
  if codec.bits is not None:
    np.save(os.path.join(folder, "cutoffs.npy"), codec.cutoffs)
    np.save(os.path.join(folder, "weights.npy"), codec.weights)
  if codec.rotation is not None:
    np.save(os.path.join(folder, "rotation.npy"), codec.rotation)


def load_tables(folder: str, centroids: np.ndarray, settings: Mapping[str, Any]) -> Codec:
  """The codec whose centroids and `save_tables` files are these (settings: its 'bits',
  'normalize', 'quantizer'; an index from before the quantizer setting is 'quantile')."""
  bits = settings["bits"]

  def load(name: str, wanted: bool) -> Optional[np.ndarray]:
    if wanted and not os.path.exists(os.path.join(folder, name)):
      raise FileNotFoundError(f"{folder} lacks {name}, which its codec settings (bits "
                              f"{bits}, quantizer {settings.get('quantizer')!r}) need: the "
                              "index was changed after its build. Rebuild it.")
    return np.load(os.path.join(folder, name)) if wanted else None
  return Codec(centroids, bits, load("cutoffs.npy", bits is not None),
               load("weights.npy", bits is not None), settings.get("normalize", False),
               load("rotation.npy", settings.get("quantizer") == "rotated-lloyd"),
               settings.get("centroid_probe", 0))


def load_codec(directory: str) -> Tuple[Codec, Dict[str, Any]]:
  """(codec, settings) as `save_codec` wrote them."""
  with open(os.path.join(directory, "codec.json"), encoding="utf-8") as f:
    settings = json.load(f)
  return load_tables(directory, np.load(os.path.join(directory, "centroids.npy")),
                     settings), settings
