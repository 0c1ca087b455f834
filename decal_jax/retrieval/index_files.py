"""The on-disk pieces every index kind shares (the exact `index`, the `residual` index and
`sharded` shards): the errors for a refused or damaged index, the encoder config's canonical
JSON and fingerprint, .npy headers written and checked, JSON files, and the completeness
check of an index directory. Every check names the file, what it should hold and the fix."""
import glob
import hashlib
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

_NPY_ALIGN = 64  # the .npy format pads its header so the data starts on a 64-byte boundary


class IndexConfigMismatchError(ValueError):
  """The index was built with another encoder config than the one searching it."""


class DamagedIndexError(ValueError):
  """An index file that does not hold what the index's meta.json says (truncated, cut,
  replaced or unreadable); the message names the file, what it should hold and the fix."""


# ------------------------------------------------------------------------------- config
def canonical_config(config: Mapping[str, Any]) -> str:
  """The config as canonical JSON (sorted keys, no spaces; tuples become lists)."""
  try:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))
  except TypeError as e:
    raise TypeError(f"The index config must be JSON-serialisable ({e}). Pass plain dicts, "
                    "lists, strings and numbers (e.g. dataclasses.asdict(config)).") from None


def config_fingerprint(config: Mapping[str, Any]) -> str:
  """sha256 (hex) of the canonical JSON of `config`."""
  return hashlib.sha256(canonical_config(config).encode("utf-8")).hexdigest()


def config_differences(built: Any, wanted: Any, prefix: str = "") -> List[str]:
  """'key: built=..., expected=...' for each differing (dotted) key."""
  if isinstance(built, dict) and isinstance(wanted, dict):
    lines = []
    for key in sorted(set(built) | set(wanted)):
      name = f"{prefix}.{key}" if prefix else str(key)
      if key not in built:
        lines.append(f"{name}: missing in the index, expected={wanted[key]!r}")
      elif key not in wanted:
        lines.append(f"{name}: built={built[key]!r}, missing in the expected config")
      else:
        lines.extend(config_differences(built[key], wanted[key], name))
    return lines
  return [] if built == wanted else [f"{prefix or '<config>'}: built={built!r}, "
                                     f"expected={wanted!r}"]


# ------------------------------------------------------------------------------- files
def npy_header(shape: Tuple[int, ...], dtype: np.dtype, size: Optional[int] = None) -> bytes:
  """A version 1.0 .npy header for a C-order array, padded with spaces to `size` bytes
  (default: the smallest multiple of 64 that holds it)."""
  text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
               "shape": tuple(shape)})
  prefix_len = len(np.lib.format.magic(1, 0)) + 2  # magic string + uint16 header length
  if size is None:
    size = -(-(prefix_len + len(text) + 1) // _NPY_ALIGN) * _NPY_ALIGN
  padding = size - prefix_len - len(text) - 1
  if padding < 0 or size - prefix_len > 65535:
    raise ValueError(f"An .npy header for shape {shape} does not fit in {size} bytes.")
  body = (text + " " * padding + "\n").encode("latin1")
  return np.lib.format.magic(1, 0) + len(body).to_bytes(2, "little") + body


def write_json(path: str, value: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=1, ensure_ascii=False)
    f.flush()
    os.fsync(f.fileno())


def read_meta(directory: str, files: Sequence[str]) -> Tuple[str, Dict[str, Any], List[str]]:
  """(absolute directory, meta.json, doc_ids.json) of a complete index directory, or a
  clear error (`check_complete`; DamagedIndexError for a file that is not JSON)."""
  directory = os.path.abspath(directory)
  check_complete(directory, files)
  return directory, read_json(directory, "meta.json"), read_json(directory, "doc_ids.json")


def read_json(directory: str, name: str) -> Any:
  try:
    with open(os.path.join(directory, name), encoding="utf-8") as f:
      return json.load(f)
  except ValueError as e:  # not JSON (cut short), or not UTF-8
    raise damaged(directory, name, f"it does not read as JSON ({e})",
                  "what the build wrote") from None


def damaged(directory: str, name: str, problem: str, should: str) -> DamagedIndexError:
  """The error for an index file that does not hold what it should, with the fix."""
  return DamagedIndexError(
      f"{os.path.join(directory, name)} is damaged: {problem}; it should hold {should}. The "
      f"index cannot be searched: delete the folder {directory} and build it again "
      "(`python -m decal_jax.retrieve` rebuilds a damaged index by itself).")


def npy_layout(path: str) -> Tuple[Tuple[int, ...], np.dtype, int]:
  """(shape, dtype, bytes the file must have) from a .npy file's header."""
  with open(path, "rb") as f:
    version = np.lib.format.read_magic(f)
    read = {(1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if read is None:
      raise ValueError(f".npy format version {version}")
    shape, _, dtype = read(f)
    return tuple(shape), dtype, f.tell() + int(np.prod(shape)) * dtype.itemsize


def check_npy(directory: str, name: str, shape: Optional[Tuple[int, ...]] = None,
              dtype: Optional[str] = None, rows: Optional[int] = None) -> None:
  """Refuses (DamagedIndexError) a .npy file of the index whose header does not read, whose
  size is not what its header says (truncated: memory-mapping it would fail at every
  search), or whose shape / dtype / first dimension (`rows`) differ from meta.json's."""
  path = os.path.join(directory, name)
  wanted = " ".join(filter(None, [f"{dtype}" if dtype else "",
                                  f"[{', '.join(map(str, shape))}]" if shape else
                                  f"[{rows}, ...]" if rows is not None else "",
                                  "as meta.json says"]))
  try:
    found_shape, found_dtype, size = npy_layout(path)
  except (ValueError, OSError, EOFError) as e:
    raise damaged(directory, name, f"its .npy header does not read ({e})", wanted) from None
  actual = os.path.getsize(path)
  if actual != size:
    raise damaged(directory, name, f"it has {actual:,} bytes, its header (shape "
                  f"{list(found_shape)}, {found_dtype}) needs {size:,} (cut short)"
                  if actual < size else f"it has {actual:,} bytes, {actual - size:,} more than "
                  f"its header (shape {list(found_shape)}, {found_dtype}) needs", wanted)
  if ((shape is not None and found_shape != tuple(shape))
      or (rows is not None and (not found_shape or found_shape[0] != rows))
      or (dtype is not None and found_dtype != np.dtype(dtype))):
    raise damaged(directory, name, f"it holds {found_dtype} [{', '.join(map(str, found_shape))}]",
                  wanted)


def check_complete(directory: str, files: Sequence[str]) -> None:
  """A clear error for a missing, interrupted or partial index directory."""
  if not os.path.isdir(directory):
    leftovers = glob.glob(glob.escape(directory) + ".tmp-*")
    hint = (f" {leftovers[0]} is left from an interrupted build: delete it and build again."
            if leftovers else " Build it first with build_index(directory, ...).")
    raise FileNotFoundError(f"No index at {directory}.{hint}")
  missing = [name for name in files if not os.path.exists(os.path.join(directory, name))]
  if missing:
    raise FileNotFoundError(f"{directory} is not a complete index (missing: "
                            f"{', '.join(missing)}). Rebuild it with build_index(..., "
                            "overwrite=True).")
