"""A residual-compressed multi-vector index: its build and its files; the codec (k-means
centroids, b-bit residual buckets) is codec.py's, approximate search residual_search.py's.

Layout of a residual index directory (built whole in `<directory>.tmp-<random>`, then renamed):

    centroids.npy  [num_centroids, d] float32
    cutoffs.npy    [d, 2^b - 1] float32   and  weights.npy [d, 2^b] float32 (b given)
    codes.npy      [num_vectors] uint16 (uint32 past 65,536 centroids): each vector's centroid
    residuals.npy  [num_vectors, d * b / 8] uint8 packed buckets; with b = None the vectors
                   [num_vectors, d] themselves (memory-mapped, as is codes.npy)
    offsets.npy    [num_docs + 1] int64, doc_ids.json: as in the exact index
    ivf.npy        the inverted lists: doc indices grouped by centroid (each doc once per
                   centroid it has a vector in); ivf_offsets.npy [num_centroids + 1] int64
    meta.json      the exact index's encoder config, fingerprint and corpus fingerprint (so
                   the same config and corpus checks apply), the codec settings, sizes

The build's settings are one `ResidualConfig`; what an earlier build trained (centroids and
codes, or a whole codec) can be reused (`Reuse`) instead of training again.
"""
import dataclasses
import datetime
import functools
import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import tqdm

from decal_jax import fileio
from decal_jax.retrieval import codec as codec_lib
from decal_jax.retrieval import index as exact
from decal_jax.retrieval import index_files
from decal_jax.retrieval import kernels, residual_search
from decal_jax.retrieval.codec import Codec, check_bits

FORMAT_VERSION = 1
ENCODE_CHUNK_VECTORS = 1 << 16  # vectors read, encoded and written at a time: 32 MiB of
# float32 at d = 128, bounded memory whatever the corpus size
_FILES = ("centroids.npy", "codes.npy", "residuals.npy", "offsets.npy", "doc_ids.json",
          "ivf.npy", "ivf_offsets.npy", "meta.json")


# ------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class ResidualConfig:
  """How a residual index is built (its codec's training). bits: 1, 2, 4, 8 or None (the
  vectors kept uncompressed); num_centroids: None for `codec.default_num_centroids`, at
  most the sample's size; sample_vectors: the corpus vectors (drawn without replacement
  with `seed`) that train k-means and the bucket quantiles; kmeans_backend: codec.kmeans's;
  quantizer: one of codec.QUANTIZERS; centroid_probe > 0: k-means's and encoding's
  centroid search is two-level on CPU cores with faiss (codec.nearest_centroids), for
  large centroid counts; 0: exhaustive."""
  bits: Optional[int] = 2
  num_centroids: Optional[int] = None
  sample_vectors: int = 1 << 16
  kmeans_iterations: int = 10
  seed: int = 0
  kmeans_backend: str = "auto"
  quantizer: str = codec_lib.DEFAULT_QUANTIZER
  centroid_probe: int = 0

  def __post_init__(self):
    check_settings(dataclasses.asdict(self))


def check_settings(settings: Mapping[str, Any], names: Optional[Mapping[str, str]] = None
                   ) -> None:
  """Refuses ResidualConfig settings (field: value) out of range, each named as `names`
  gives it (the gin macros of a run) or as `ResidualConfig.<field>`: before any build."""
  names = names or {}

  def name(field: str) -> str:
    return names.get(field, f"ResidualConfig.{field}")
  if "bits" in settings and settings["bits"] not in codec_lib.BITS:
    raise ValueError(f"{name('bits')} = {settings['bits']!r}: must be one of "
                     f"{', '.join(map(str, codec_lib.BITS))} (None: uncompressed).")
  if settings.get("num_centroids") is not None:
    residual_search.check_count(name("num_centroids"), settings["num_centroids"], 1,
                           " or None (codec.default_num_centroids)")
  for field, least in (("sample_vectors", 1), ("kmeans_iterations", 1), ("centroid_probe", 0)):
    if field in settings:
      residual_search.check_count(name(field), settings[field], least)
  if "quantizer" in settings and settings["quantizer"] not in codec_lib.QUANTIZERS:
    raise ValueError(f"{name('quantizer')} = {settings['quantizer']!r}: must be one of "
                     f"{', '.join(map(repr, codec_lib.QUANTIZERS))}.")


@dataclasses.dataclass(frozen=True, eq=False)
class Reuse:
  """What an earlier build trained, used instead of training it again. centroids: those of
  another index of the same corpus (e.g. another bit width's), skipping k-means; codes:
  with them, each source vector's nearest centroid (that index's codes), skipping the
  assignment; codec (with the settings it was trained with): used as it is, training
  nothing (the shards of a sharded index share one, sharded.py)."""
  centroids: Optional[np.ndarray] = None
  codes: Optional[np.ndarray] = None
  codec: Optional[Codec] = None
  codec_settings: Optional[Mapping[str, Any]] = None


def train(source, config: ResidualConfig, centroids: Optional[np.ndarray] = None
          ) -> Tuple[Codec, Dict[str, Any]]:
  """The codec `config` trains on a sample of `source`'s vectors, and its settings
  (codec.train_codec; source needs only num_vectors, dim and vectors[sorted rows])."""
  return codec_lib.train_codec(source, config.bits, config.num_centroids,
                               config.sample_vectors, config.kmeans_iterations, config.seed,
                               config.kmeans_backend, centroids, config.quantizer,
                               config.centroid_probe)


# ------------------------------------------------------------------------------- build
def build_residual_index(directory: str, source: exact.Index,
                         config: ResidualConfig = ResidualConfig(), *,
                         reuse: Reuse = Reuse(), overwrite: bool = False,
                         progress: bool = False) -> "ResidualIndex":
  """Compresses the exact index `source` into a residual index at `directory` as `config`
  says (training what `reuse` does not give); returns it opened."""
  directory = os.path.abspath(directory)
  _check_build(directory, source, reuse, overwrite)
  if reuse.codec is None:
    codec, settings = train(source, config, reuse.centroids)
  else:
    codec = reuse.codec
    check_bits(codec.bits, source.dim)
    settings = dict(reuse.codec_settings or {
        "bits": codec.bits, "num_centroids": len(codec.centroids),
        "normalize": codec.normalize, "quantizer": codec.quantizer})
  backend = settings.pop("kmeans_backend", "given")
  with fileio.atomic_directory(directory) as folder:
    tmp = str(folder)
    codes = _write_codes(tmp, source, codec, progress, reuse.codes)
    _write_inverted_lists(tmp, codes, source.offsets, len(codec.centroids))
    np.save(os.path.join(tmp, "centroids.npy"), codec.centroids)
    codec_lib.save_tables(tmp, codec)
    np.save(os.path.join(tmp, "offsets.npy"), source.offsets)
    index_files.write_json(os.path.join(tmp, "doc_ids.json"), source.doc_ids)
    meta = _meta(source, codec, settings, backend)
    index_files.write_json(os.path.join(tmp, "meta.json"), meta)  # last: marks completion
  return ResidualIndex.open(directory)


def _check_build(directory: str, source: exact.Index, reuse: Reuse, overwrite: bool) -> None:
  """Refuses a build with nothing to cluster, over a directory not to replace, or with
  codes that do not fit the source."""
  if source.num_vectors == 0:
    raise ValueError(f"The index in {source.directory} holds no vector: nothing to cluster. "
                     "Search it exactly.")
  if os.path.exists(directory):
    if not overwrite:
      raise FileExistsError(f"{directory} already exists. Pass overwrite=True to replace it.")
    if os.listdir(directory) and not os.path.exists(os.path.join(directory, "meta.json")):
      raise FileExistsError(f"{directory} exists and is not an index (no meta.json); "
                            "overwrite=True only replaces an index. Choose another directory.")
  codes = reuse.codes
  if codes is not None and (reuse.centroids is None or len(codes) != source.num_vectors):
    raise ValueError(f"codes ({len(codes)}) must come with their centroids and hold one id "
                     f"per source vector ({source.num_vectors}). Pass another index of this "
                     "corpus's codec.centroids and codes together, or neither.")


def _meta(source: exact.Index, codec: Codec, settings: Dict[str, Any], backend: str
          ) -> Dict[str, Any]:
  """meta.json: the source's config and fingerprints, the codec settings, the sizes."""
  per_vector = codec.bytes_per_vector(source.dtype.itemsize)
  meta = {key: source.meta[key] for key in ("config", "fingerprint", "corpus", "dim",
                                             "num_docs", "num_vectors") if key in source.meta}
  meta.update(codec=settings, kmeans_backend=backend, source_dtype=source.dtype.name,
              format_version=FORMAT_VERSION, bytes_per_vector=per_vector,
              bytes=per_vector * source.num_vectors,
              centroid_bytes=int(codec.centroids.nbytes),
              created=datetime.datetime.now(datetime.timezone.utc).isoformat())
  return meta


def _write_codes(tmp: str, source: exact.Index, codec: Codec, progress: bool,
                 known: Optional[np.ndarray] = None) -> np.ndarray:
  """Writes codes.npy and residuals.npy ENCODE_CHUNK_VECTORS at a time (known: the codes,
  if given); returns the codes (memory-mapped)."""
  chunk = ENCODE_CHUNK_VECTORS
  n, d = source.num_vectors, source.dim
  codes = np.lib.format.open_memmap(os.path.join(tmp, "codes.npy"), "w+",
                                    codec.code_dtype, (n,))
  shape, dtype = ((n, d), source.dtype) if codec.bits is None else (
      (n, d * codec.bits // 8), np.uint8)
  payload = np.lib.format.open_memmap(os.path.join(tmp, "residuals.npy"), "w+", dtype, shape)
  for start in tqdm.trange(0, n, chunk, desc="compress", unit="chunk", disable=not progress):
    codes[start:start + chunk], payload[start:start + chunk] = codec.encode(
        np.asarray(source.vectors[start:start + chunk]),
        None if known is None else known[start:start + chunk])
  payload.flush()
  codes.flush()
  del payload
  return codes


def _write_inverted_lists(tmp: str, codes: np.ndarray, offsets: np.ndarray, k: int) -> None:
  """ivf.npy: for each centroid in turn, the (sorted, distinct) docs with a vector in it."""
  num_docs = len(offsets) - 1
  owners = np.repeat(np.arange(num_docs, dtype=np.int64), np.diff(offsets))  # [vectors]
  pairs = np.unique(np.asarray(codes, np.int64) * num_docs + owners)  # centroid-major
  cells, docs = np.divmod(pairs, num_docs)
  np.save(os.path.join(tmp, "ivf.npy"), docs.astype(np.int32))
  np.save(os.path.join(tmp, "ivf_offsets.npy"),
          np.searchsorted(cells, np.arange(k + 1)).astype(np.int64))


# ------------------------------------------------------------------------------- open
def _check_files(directory: str, meta: Mapping[str, Any]) -> None:
  """Refuses (index_files.DamagedIndexError) a .npy file that is cut short or whose rows differ
  from meta.json's counts, before anything is memory-mapped."""
  rows = {"codes.npy": meta["num_vectors"], "residuals.npy": meta["num_vectors"],
          "offsets.npy": meta["num_docs"] + 1}
  names = sorted(n for n in os.listdir(directory) if n.endswith(".npy"))
  for name in names:
    index_files.check_npy(directory, name, rows=rows.get(name))


class ResidualIndex(exact.StoredIndex):
  """An opened residual index: the codec, memory-mapped codes and residuals, the inverted
  lists, and approximate search (residual_search.py)."""

  def __init__(self, directory: str, codec: Codec, arrays: Dict[str, np.ndarray],
               doc_ids: Sequence[str], meta: Dict[str, Any]):
    self.directory = directory
    self.codec = codec
    self.codes = arrays["codes"]  # [num_vectors]
    self.residuals = arrays["residuals"]  # [num_vectors, d * b / 8] or [num_vectors, d]
    self.offsets = arrays["offsets"]  # [num_docs + 1]
    self.ivf = arrays["ivf"]  # doc indices, grouped by centroid
    self.ivf_offsets = arrays["ivf_offsets"]  # [num_centroids + 1]
    self.doc_ids = list(doc_ids)
    self.meta = meta

  @classmethod
  def open(cls, directory: str, expected_config: Optional[Mapping[str, Any]] = None
           ) -> "ResidualIndex":
    """Opens the residual index in `directory`; with `expected_config`, refuses one built
    with a different encoder config (IndexConfigMismatchError)."""
    directory, meta, doc_ids = index_files.read_meta(directory, _FILES)
    _check_files(directory, meta)

    def load(name: str, mmap: bool = False) -> np.ndarray:
      return np.load(os.path.join(directory, name), mmap_mode="r" if mmap else None)
    codec = codec_lib.load_tables(directory, load("centroids.npy"), meta["codec"])
    arrays = {"codes": load("codes.npy", True), "residuals": load("residuals.npy", True),
              "offsets": load("offsets.npy"), "ivf": load("ivf.npy"),
              "ivf_offsets": load("ivf_offsets.npy")}
    if (len(arrays["codes"]) != meta["num_vectors"] or len(doc_ids) != meta["num_docs"]
        or int(arrays["offsets"][-1]) != meta["num_vectors"]):
      raise ValueError(f"The residual index in {directory} is inconsistent with its "
                       "meta.json: its files were changed after the build; rebuild it.")
    return cls(directory, codec, arrays, doc_ids, meta).checked(expected_config)

  def settings_change(self, settings: Mapping[str, Any]) -> str:
    """'' when the codec was built with these settings (keys of meta['codec'] given);
    else the differing keys, in words."""
    built = self.meta["codec"]
    return ", ".join(f"{key} {built.get(key)!r} -> {value!r}" for key, value in
                     sorted(settings.items()) if built.get(key) != value)

  # ----------------------------------------------------------------------------- sizes
  @property
  def dim(self) -> int:
    return self.codec.dim

  @property
  def num_vectors(self) -> int:
    return int(len(self.codes))

  @property
  def num_centroids(self) -> int:
    return int(len(self.codec.centroids))

  @property
  def nbytes(self) -> int:
    """Bytes of the codes and residuals (what scales with the corpus)."""
    return int(self.codes.nbytes + self.residuals.nbytes)

  def vectors(self, rows: np.ndarray) -> np.ndarray:
    """The decompressed vectors of the given rows: `[len(rows), d]` float32."""
    return self.codec.decode(self.codes[rows], self.residuals[rows])

  def scoring_vectors(self, rows: np.ndarray) -> np.ndarray:
    """`vectors(rows)` in the codec's rotated coordinates (`codec.rotate`): what search
    scores against queries rotated alike, without turning every vector back."""
    return self.codec.decode_rotated(self.codes[rows], self.residuals[rows])

  def doc_vectors(self, i: int) -> np.ndarray:
    """Document i's decompressed vectors `[count, d]` (possibly 0 rows)."""
    return self.vectors(np.arange(self.offsets[i], self.offsets[i + 1]))

  # ----------------------------------------------------------------------------- search
  def search(self, query_vectors: np.ndarray, query_valid: np.ndarray, top_k: int = 100,
             nprobe: int = residual_search.DEFAULT_NPROBE, candidates: Optional[int] = None,
             query_batch_size: int = 64, query_cells: int = residual_search.DEFAULT_QUERY_CELLS,
             backend: str = residual_search.DEFAULT_BACKEND) -> Tuple[np.ndarray, np.ndarray]:
    """Approximate MaxSim top-k (residual_search.py's stages): (scores float32 `[q, k]`, doc
    indices int32 `[q, k]`), best first, ties by doc index, k = min(top_k, num_docs); a
    query with fewer than k candidates is padded with index -1 and score -inf. nprobe and
    query_cells (0 for none): the cells probed per query vector and per query (stage 1).
    candidates: the documents decompressed and reranked exactly per query (None:
    `residual_search.default_candidates`; the plain interaction keeps
    `residual_search.refined_keep` of them for the refined one). query_batch_size: queries
    searched together (fewer past residual_search's batch limits). backend: 'numpy' or
    'compiled' (the same stages and widths; 'compiled' needs numba, the `[ann]` extra)."""
    return residual_search.search(self, query_vectors, query_valid, top_k, nprobe,
                                  candidates, query_batch_size, query_cells, backend)

  @functools.cached_property
  def squared_norms(self) -> np.ndarray:
    """|c|^2 of every centroid, `[K]` (stage 1's probe)."""
    return np.sum(self.codec.centroids.astype(np.float32) ** 2, axis=1)

  @functools.cached_property
  def kernel_arrays(self) -> kernels.Arrays:
    """What the compiled backend's kernels read (arrays only, kernels.py)."""
    codec = self.codec
    table = None if codec.bits is None else codec.byte_table
    coding = kernels.decoding(np.asarray(self.residuals), table, codec.rotated_centroids,
                              codec.normalize)
    return kernels.Arrays(self.offsets, np.asarray(self.codes), self.ivf, self.ivf_offsets,
                          coding)
