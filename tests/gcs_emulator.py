"""Runs gcp-storage-emulator with what of GCS's object API it leaves out and TensorStore
(Orbax's arrays) and an exclusive create rely on:

- the generation of a downloaded object (`x-goog-generation`, sent by GCS with every media
  download: TensorStore refuses a read without it, "Malformed StorageGeneration");
- the generation preconditions: a download with `ifGenerationNotMatch` equal to the
  object's generation answers 304 Not Modified (how OCDBT re-reads its manifest), and a
  download or upload with `ifGenerationMatch` other than the object's (0: no object)
  answers 412 Precondition Failed (OCDBT's manifest updates, gcsfs's `xb` open).

  python tests/gcs_emulator.py --port PORT --bucket NAME
"""
import argparse
import logging
from http import HTTPStatus

from gcp_storage_emulator import server as server_lib
from gcp_storage_emulator.handlers import objects

DOWNLOAD, INSERT = objects.download, objects.insert  # the emulator's own handlers


def _generation(storage, bucket: str, name: str) -> str:
  """The object's generation, '0' when there is none (GCS's meaning of 0)."""
  try:
    return str(storage.get_file_obj(bucket, name)["generation"])
  except Exception:  # the emulator's NotFound
    return "0"


def _failed_precondition(request, response, generation: str) -> bool:
  """Answers 412 / 304 (and returns True) when the request's precondition does not hold."""
  wanted = request.query.get("ifGenerationMatch", [None])[0]
  if wanted is not None and wanted != generation:
    response.status = HTTPStatus.PRECONDITION_FAILED
    response.json({"error": {"code": 412, "message": "Precondition Failed"}})
    return True
  unwanted = request.query.get("ifGenerationNotMatch", [None])[0]
  if unwanted is not None and unwanted == generation:
    response.status = HTTPStatus.NOT_MODIFIED
    return True
  return False


def _download(request, response, storage, *args, **kwargs):
  bucket, name = request.params["bucket_name"], request.params["object_id"]
  generation = _generation(storage, bucket, name)
  if generation != "0" and _failed_precondition(request, response, generation):
    return None
  if generation != "0":
    response["x-goog-generation"] = generation
  return DOWNLOAD(request, response, storage, *args, **kwargs)


def _insert(request, response, storage, *args, **kwargs):
  name = request.query.get("name", [None])[0]
  if name is not None:
    generation = _generation(storage, request.params["bucket_name"], name)
    if _failed_precondition(request, response, generation):
      return None
  return INSERT(request, response, storage, *args, **kwargs)


def _patch() -> None:
  replacements = {DOWNLOAD: _download, INSERT: _insert}
  objects.download = _download  # also what `objects.get` calls for ?alt=media
  for _, methods in server_lib.HANDLERS:
    for method, handler in list(methods.items()):
      if handler in replacements:
        methods[method] = replacements[handler]


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--bucket", required=True)
  args = parser.parse_args()
  logging.basicConfig(level=logging.CRITICAL)
  _patch()
  server_lib.create_server(args.host, args.port, in_memory=True,
                           default_bucket=args.bucket).run()


if __name__ == "__main__":
  main()
