"""Files that are written whole or not at all.

`atomic_write` is the one way the library writes a result file: into a temporary file in
the target's own folder (so the final rename never crosses a file system), then
`os.replace` over the target. A reader sees the old file or the new one, never a part; a
failure (an exception, Ctrl-C) removes the temporary file and leaves the target as it was.
`atomic_directory` does the same for a folder of files built together; a build killed
outright (`kill -9`, a lost machine) leaves its `<name>.tmp-<random>` folder, which the next
build of the same folder removes (`remove_stale_temporaries`). `read_utf8` reads a user's
text file whole, naming the file and line of any bytes that are not UTF-8.

Every one of them also takes a URL (`gs://bucket/run`, or any scheme etils.epath reads):
`as_path` gives a local path as a `pathlib.Path` and a URL as an `etils.epath.Path`. An
object store writes an object whole when its upload completes, so `atomic_write` uploads the
finished file in one request; `atomic_directory` builds the folder locally and uploads it
when complete (a crash during the upload can leave part of it: object stores have no folder
rename). `local_mirror` gives a local copy of a remote folder for what must be memory-mapped
(retrieval indexes). Remote storage goes through gcsfs (fsspec) when it is installed
(`pip install 'decal_jax[gcs]'`), else through epath's TensorFlow backend; the environment
variable STORAGE_EMULATOR_HOST points gcsfs, and Orbax's TensorStore, at a GCS emulator
(docs/t5x.md, "Remote paths").
"""
import contextlib
import fcntl
import importlib.util
import io
import json
import logging
import os
import pathlib
import re
import shutil
import socket
import tempfile
import time
from typing import IO, Any, Dict, Iterator, List, Optional, Union

from decal_jax import settings

PathLike = Union[str, os.PathLike]
log = logging.getLogger(__name__)  # decal_jax.* warnings: console.py routes them in the CLI
OWNER_FILE = ".tmp-owner"  # in a folder being built: flock-ed by the building process
UNOWNED_STALE_S = 600  # a temporary folder without an owner file (a build from before it,
# or one killed within microseconds of starting) is stale once unchanged this long


class NotUtf8Error(ValueError):
  """A text file with bytes that are not UTF-8 (the message names file and line)."""


def read_utf8(path: PathLike) -> str:
  """The whole of a UTF-8 text file; NotUtf8Error names the line of a bad byte."""
  raw = as_path(path).read_bytes()
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw[:e.start].count(b"\n") + 1
    raise NotUtf8Error(f"{path}:{line}: not UTF-8 ({e.reason}); re-save the file as "
                       "UTF-8.") from None


@contextlib.contextmanager
def atomic_write(path: PathLike, mode: str = "w",
                 encoding: str = "utf-8") -> Iterator[IO]:
  """Opens a temporary file beside `path` for writing; renames it over `path` on success.

  `mode` is 'w' (text, `encoding`) or 'wb' (bytes). Parent folders are created. The file
  gets mode 0o644 (mkstemp's 0o600 would hide results from other users of a shared disk).
  """
  if mode not in ("w", "wb"):
    raise ValueError(f"atomic_write writes whole files: mode must be 'w' or 'wb', not {mode!r}")
  if is_url(path):
    buffer = io.BytesIO() if mode == "wb" else io.StringIO()
    yield buffer  # uploaded once complete: an object appears whole or not at all
    data = buffer.getvalue()
    as_path(path).write_bytes(data if mode == "wb" else data.encode(encoding))
    return
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
  try:
    with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding})) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise


def write_text_atomic(path: PathLike, text: str) -> None:
  """Writes `text` (UTF-8) to `path` whole or not at all."""
  with atomic_write(path, "w") as f:
    f.write(text)


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
  """Writes `data` to `path` whole or not at all."""
  with atomic_write(path, "wb") as f:
    f.write(data)


@contextlib.contextmanager
def atomic_directory(path: PathLike, replace: bool = True) -> Iterator[pathlib.Path]:
  """Yields an empty temporary folder beside `path`; on success renames it to `path`.

  replace: an existing folder at `path` is moved aside, replaced, then deleted; with
  replace=False the final rename fails (OSError) if a non-empty folder is there, e.g. one
  another process finished meanwhile. The temporary folder is named
  `<name>.tmp-<random>`, so a crash that skips the cleanup leaves a name that says what it
  is; a failure inside the `with` body deletes it and leaves `path` as it was. The folder
  gets mode 0o755 (mkdtemp's 0o700 would outlive the rename). A URL's folder is built in a
  local temporary folder and uploaded when complete (`upload_tree`).
  """
  if is_url(path):
    with tempfile.TemporaryDirectory(prefix="decal_jax-upload-") as tmp:
      yield pathlib.Path(tmp)
      upload_tree(tmp, path, replace)
    return
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  remove_stale_temporaries(path)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{path.name}.tmp-"))
  owner = _own(tmp)
  try:
    yield tmp
    tmp.chmod(0o755)
    (tmp / OWNER_FILE).unlink()  # still locked through `owner` until the rename is done
    if replace:
      _replace_directory(tmp, path)
    else:
      tmp.rename(path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    os.close(owner)


def _temporary_name(path: pathlib.Path) -> "re.Pattern":
  """The names `atomic_directory` gives its temporary folders for `path` (mkdtemp's)."""
  return re.compile(re.escape(path.name) + r"\.tmp-[a-z0-9_]{8}")


def _own(tmp: pathlib.Path) -> int:
  """Marks `tmp` as being built by this process: a lock (released by the kernel however the
  process ends) on its owner file, which also names the process for a person."""
  fd = os.open(tmp / OWNER_FILE, os.O_RDWR | os.O_CREAT, 0o644)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.time()}).encode())
  return fd


def remove_stale_temporaries(path: PathLike) -> List[pathlib.Path]:
  """Deletes the temporary folders `atomic_directory` left beside `path` in builds that
  were killed outright (only names of its own pattern, `<name>.tmp-<8 characters>`): those
  whose owner file no process holds locked, and those without one (from before the owner
  file, or killed as they began) unchanged for UNOWNED_STALE_S. A folder a running build
  holds is kept. Each removal is named in a WARNING; returns the folders removed."""
  path = pathlib.Path(path)
  if not path.parent.is_dir():
    return []
  pattern, removed = _temporary_name(path), []
  for folder in sorted(path.parent.iterdir()):
    if not pattern.fullmatch(folder.name) or not folder.is_dir() or folder.is_symlink():
      continue
    why = _stale_because(folder)
    if why:
      log.warning("Removed %s, the temporary folder of a build of %s that was killed "
                  "before it finished (%s).", folder, path, why)
      removed.append(folder)
  return removed


def _stale_because(folder: pathlib.Path) -> Optional[str]:
  """Why `folder` is stale, having deleted it ('' or None: kept, a build still holds it)."""
  try:
    fd = os.open(folder / OWNER_FILE, os.O_RDONLY)
  except FileNotFoundError:
    age = time.time() - folder.stat().st_mtime
    if age < UNOWNED_STALE_S:
      return None
    shutil.rmtree(folder, ignore_errors=True)
    return f"no owner file, unchanged for {age / 60:.0f} minutes"
  except OSError:
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:  # held: its build is running
    os.close(fd)
    return None
  try:
    owner = _describe_owner(os.read(fd, 4096))
    shutil.rmtree(folder, ignore_errors=True)
  finally:
    os.close(fd)
  return f"{owner} no longer holds it"


def _describe_owner(record: bytes) -> str:
  try:
    owner = json.loads(record)
    return f"pid {owner['pid']} on {owner['host']}"
  except (ValueError, KeyError, TypeError):
    return "no process"


def _replace_directory(new: pathlib.Path, path: pathlib.Path) -> None:
  """Renames `new` to `path`; an old `path` is renamed aside first and deleted after."""
  if not path.exists():
    new.rename(path)
    return
  old = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{path.name}.old-"))
  old.rmdir()
  path.rename(old)
  new.rename(path)
  shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------- remote paths
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"  # google-cloud-storage's and gcsfs's own name
_remote = {"ready": False}


class RemoteStorageError(RuntimeError):
  """A URL that this installation cannot reach as it is set up (the message says why)."""


def is_url(path: PathLike) -> bool:
  """Whether `path` is a URL (`gs://bucket/run`, `s3://...`), not a local path."""
  return bool(URL.match(os.fspath(path)))


def as_path(path: PathLike) -> Any:
  """A local path as a `pathlib.Path`; a URL as an `etils.epath.Path` (the same methods:
  exists, is_dir, iterdir, open, read_text, write_bytes, `/`)."""
  if not is_url(path):
    return pathlib.Path(path)
  _prepare_remote()
  from etils import epath
  return epath.Path(os.fspath(path))


def resolved(path: PathLike) -> Any:
  """`as_path`, a local path also with `~` expanded and made absolute (Orbax's need)."""
  return as_path(path) if is_url(path) else pathlib.Path(path).expanduser().absolute()


def join(folder: PathLike, *names: str) -> str:
  """`folder/name/...` as a string, for a local folder or a URL."""
  return os.fspath(as_path(folder).joinpath(*names))


def _prepare_remote() -> None:
  """Once per process, before the first remote path: remote storage through gcsfs when it
  is installed (epath's TensorFlow backend otherwise), and, with STORAGE_EMULATOR_HOST set,
  gcsfs and TensorStore (Orbax's arrays) pointed at that emulator, unauthenticated."""
  if _remote["ready"]:
    return
  has_gcsfs = importlib.util.find_spec("gcsfs") is not None
  emulator = os.environ.get(EMULATOR_VARIABLE, "")
  if emulator and not has_gcsfs:
    raise RemoteStorageError(
        f"{EMULATOR_VARIABLE}={emulator} is set but gcsfs is not installed: TensorFlow's GCS "
        "client (epath's other backend) always talks to storage.googleapis.com and cannot be "
        "pointed at an emulator. Install it: pip install 'decal_jax[gcs]'.")
  if emulator:
    _point_at_emulator(emulator if "://" in emulator else f"http://{emulator}")
  if has_gcsfs:
    os.environ.setdefault("EPATH_USE_TF", "false")  # epath: gs:// through fsspec (gcsfs)
    from etils.epath import gpath
    getattr(gpath._is_tf_installed, "cache_clear", lambda: None)()  # read again: the above
  _remote["ready"] = True


def _point_at_emulator(url: str) -> None:
  """gcsfs reads STORAGE_EMULATOR_HOST itself; TensorStore reads its own variable; neither
  needs credentials there (gcsfs anonymous, TensorStore a fixed test token), and gcsfs's
  bucket-type probe (a gRPC call an emulator does not answer) is off."""
  os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
  os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
  os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
  import fsspec
  fsspec.config.conf.setdefault("gcs", {}).setdefault("token", "anon")


def upload_file(local: PathLike, url: PathLike) -> None:
  """Copies the local file `local` to `url` (one object, written whole)."""
  with open(local, "rb") as source, as_path(url).open("wb") as target:
    shutil.copyfileobj(source, target, 1 << 24)


def download_file(url: PathLike, local: PathLike) -> None:
  """Copies the object (or file) at `url` to the local file `local`."""
  pathlib.Path(local).parent.mkdir(parents=True, exist_ok=True)
  with as_path(url).open("rb") as source, open(local, "wb") as target:
    shutil.copyfileobj(source, target, 1 << 24)


def upload_tree(local: PathLike, url: PathLike, replace: bool = True) -> None:
  """Copies the local folder `local` to the folder `url`. An existing one is deleted first
  (replace=True) or, when it holds anything, refused with FileExistsError."""
  target = as_path(url)
  if target.exists():
    if not replace and any(target.iterdir()):
      raise FileExistsError(f"{url} already exists and holds files; it was left as it is.")
    target.rmtree()
  for file in sorted(pathlib.Path(local).rglob("*")):
    if file.is_file():
      upload_file(file, target / file.relative_to(local).as_posix())


def download_tree(url: PathLike, local: PathLike) -> None:
  """Copies the folder `url` into the local folder `local`."""
  for name, _ in remote_listing(url).items():
    download_file(as_path(url) / name, pathlib.Path(local) / name)


def remote_listing(url: PathLike) -> Dict[str, int]:
  """{relative name: size} of every file under the folder `url` ({} when there is none)."""
  root, out = as_path(url), {}
  if not root.is_dir():
    return out
  folders = [root]
  while folders:  # epath refuses `**` on GCS: one listing per folder
    for path in folders.pop().iterdir():
      if path.is_dir():
        folders.append(path)
      else:
        out[os.fspath(path)[len(os.fspath(root)) + 1:]] = path.stat().length
  return out


def _local_listing(folder: pathlib.Path) -> Dict[str, Any]:
  return {file.relative_to(folder).as_posix(): (file.stat().st_size, file.stat().st_mtime_ns)
          for file in folder.rglob("*") if file.is_file()} if folder.is_dir() else {}


def mirror_folder(url: PathLike) -> pathlib.Path:
  """Where `local_mirror` keeps its copy of `url`: DECAL_CACHE_DIR/remote/<scheme>/<rest>."""
  scheme, rest = os.fspath(url).split("://", 1)
  cache = pathlib.Path(settings.get("DECAL_CACHE_DIR")).expanduser()
  return cache / "remote" / scheme / rest.strip("/")


@contextlib.contextmanager
def local_mirror(folder: PathLike) -> Iterator[str]:
  """A local folder standing for `folder`, for files that must be local (memory-mapped
  retrieval indexes): `folder` itself when it is local. For a URL: its copy under
  DECAL_CACHE_DIR/remote/ (`mirror_folder`), replaced by the remote folder's files (none:
  emptied) when their names or sizes differ from the copy's; after the block, a copy the
  block changed (built or rebuilt) is uploaded in place of the remote folder."""
  if not is_url(folder):
    yield os.fspath(folder)
    return
  local = mirror_folder(folder)
  remote = remote_listing(folder)
  if _sizes(local) != remote:  # the bucket is the truth: a copy it lacks is stale
    shutil.rmtree(local, ignore_errors=True)
    download_tree(folder, local)
  before = _local_listing(local)
  yield os.fspath(local)
  if local.is_dir() and _local_listing(local) != before:
    upload_tree(local, folder, replace=True)


def _sizes(folder: pathlib.Path) -> Dict[str, int]:
  return {name: size for name, (size, _) in _local_listing(folder).items()}
