"""gs:// paths end to end, against a GCS emulator the test starts (gcp-storage-emulator on a
free loopback port): train with MODEL_DIR in a bucket, resume it from the bucket, then eval,
infer, retrieve and export_t5x, each writing to gs://; every object is listed through
google-cloud-storage's own client (not through the library's route to the bucket).

The library reaches the emulator through STORAGE_EMULATOR_HOST alone (`fileio`: gcsfs for
files, TensorStore for Orbax's arrays). TensorFlow's own GCS client cannot be pointed at an
emulator (it always calls https://www.googleapis.com), so the files TensorFlow writes itself
(TensorBoard events, the tf.data position) are written locally and uploaded by the library:
their objects in the bucket are what this test checks.
"""
import json
import os
import subprocess
import sys
import time

import pytest

import paths
import processes

pytest.importorskip("gcp_storage_emulator", reason="the GCS emulator is not installed: pip "
                    "install 'decal_jax[test]' (gcp-storage-emulator)")
pytest.importorskip("gcsfs", reason="gcsfs (the library's route to gs://) is not installed: "
                    "pip install 'decal_jax[gcs]'")
storage = pytest.importorskip("google.cloud.storage", reason="google-cloud-storage (the "
                              "test's own view of the bucket) is not installed")

REPO = paths.REPO
BUCKET = "decal-test"
SMALL = ["--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 12}", "--gin.BATCH_SIZE=4"]
UNREACHABLE = "127.0.0.1:9"  # credential look-ups (GCE metadata) stay on loopback, and fail


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  """(client, environment for the subprocesses) of a running emulator with one bucket."""
  port = processes.free_port()
  log = open(tmp_path_factory.mktemp("emulator") / "emulator.log", "w")
  proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "gcs_emulator.py"), "--port",
                           str(port), "--bucket", BUCKET], stdout=log, stderr=subprocess.STDOUT)
  host = f"http://127.0.0.1:{port}"
  env = dict(os.environ, STORAGE_EMULATOR_HOST=host, TF_CPP_MIN_LOG_LEVEL="3",
             GCE_METADATA_HOST=UNREACHABLE, GCE_METADATA_IP=UNREACHABLE,
             GCE_METADATA_ROOT=UNREACHABLE)
  try:
    client = _client(host, proc)
    yield client, env
  finally:
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def _client(host: str, proc: subprocess.Popen):
  from google.auth.credentials import AnonymousCredentials
  os.environ["STORAGE_EMULATOR_HOST"] = host  # read by the client as it is made
  try:
    client = storage.Client(project="test", credentials=AnonymousCredentials())
  finally:
    del os.environ["STORAGE_EMULATOR_HOST"]
  deadline = time.time() + 60
  while True:
    try:
      client.get_bucket(BUCKET)
      return client
    except Exception:  # not listening yet
      if proc.poll() is not None or time.time() > deadline:
        raise
      time.sleep(0.2)


def _objects(client, prefix: str) -> dict:
  """{name below prefix: size} of the bucket's objects under `prefix`."""
  return {blob.name[len(prefix):]: blob.size
          for blob in client.list_blobs(BUCKET, prefix=prefix)}


def _run(env, module: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
  proc = subprocess.run([sys.executable, "-m", f"decal_jax.{module}", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  if check and proc.returncode != 0:
    raise AssertionError(f"{module} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
  return proc


def _train(env, model_dir: str, steps: int, *extra: str, check: bool = True):
  return _run(env, "train", "--gin_file=runs/pretrain_builtin.gin",
              f"--gin.MODEL_DIR='{model_dir}'", f"--gin.TRAIN_STEPS={steps}",
              "--gin.EVAL_BATCHES=1", "--gin.CHECKPOINT_PERIOD=2", "--gin.LOG_PERIOD=1",
              "--gin.KEEP_CHECKPOINTS=5", *SMALL, *extra, check=check)


@pytest.fixture(scope="module")
def trained(emulator):
  """Two steps into gs://decal-test/run, then resumed from the bucket to step 3."""
  client, env = emulator
  model_dir = f"gs://{BUCKET}/run"
  first = _train(env, model_dir, 2)
  after_first = _objects(client, "run/")
  second = _train(env, model_dir, 3)
  return client, env, model_dir, first, after_first, second


def test_train_writes_every_run_file_into_the_bucket(trained):
  client, _, _, first, after_first, _ = trained
  names = set(after_first)
  for name in ("config.gin", "model-info.txt", "vocabulary.json",
               "checkpoint_2/commit_success.txt", "checkpoint_2/state/_METADATA",
               "checkpoint_2/data/metadata", "checkpoint_2/architecture/metadata"):
    assert name in names, sorted(names)
  assert any(n.startswith("checkpoint_2/dataset/process_0-of-1.") for n in names), sorted(names)
  assert any(n.startswith("train/events.out.tfevents.") and after_first[n] > 0
             for n in names), sorted(names)
  assert any(n.startswith("training_eval/") for n in names), sorted(names)
  assert ".lock" not in names  # released at the end
  assert not os.path.exists(REPO / "gs:"), "a local ./gs:/ folder was made"
  config = client.bucket(BUCKET).blob("run/config.gin").download_as_text()
  assert "decal_builtin_span_corruption" in config
  assert "Held-out (validation) at step 2" in first.stdout


def test_resume_continues_from_the_step_stored_in_the_bucket(trained):
  client, _, _, _, after_first, second = trained
  assert "Resuming from step 2 in gs://decal-test/run" in second.stdout, second.stdout
  after = _objects(client, "run/")
  assert "checkpoint_3/commit_success.txt" in after and "checkpoint_2/state/_METADATA" in after
  events = [n for n in after if n.startswith("train/events.out.tfevents.")]
  assert len(events) == 2  # one event file per run, both in the bucket
  data = json.loads(client.bucket(BUCKET).blob("run/checkpoint_3/data/metadata")
                    .download_as_text())
  assert data["batches_consumed"] == 3  # two stored batches continued by one more


def test_eval_and_infer_read_the_bucket_and_write_their_files_there(trained):
  client, env, model_dir, *_ = trained
  proc = _run(env, "eval", "--gin_file=runs/eval_builtin.gin", f"--gin.MODEL_DIR='{model_dir}'",
              "--gin.EVAL_BATCHES=1", *SMALL)
  assert "accuracy" in proc.stdout and "step 3" in proc.stdout, proc.stdout
  proc = _run(env, "infer", "--gin_file=runs/infer_builtin.gin", f"--gin.MODEL_DIR='{model_dir}'",
              "--gin.INFER_INPUTS=['The <extra_id_0> statement wraps a block.']",
              "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}")
  assert "output:" in proc.stdout
  names = set(_objects(client, "run/"))
  assert any(n.startswith("training_eval/") and "events" in n for n in names), sorted(names)
  assert not os.path.exists(REPO / "gs:")


def test_export_t5x_writes_a_t5x_checkpoint_into_the_bucket(trained):
  client, env, model_dir, *_ = trained
  proc = _run(env, "commands.export_t5x", "--checkpoint", f"{model_dir}/checkpoint_3",
              "--out", f"gs://{BUCKET}/t5x")
  assert "written" in proc.stdout
  names = _objects(client, "t5x/")
  assert "checkpoint_3/checkpoint" in names and names["checkpoint_3/checkpoint"] > 0, names
  assert any(n.endswith("/.zarray") for n in names), names


def test_retrieve_indexes_from_the_bucket_and_writes_index_and_results_there(trained):
  """A dual encoder fine-tuned into the bucket from the pretrained run there
  (INITIAL_CHECKPOINT_PATH on gs://); retrieve builds its index in the local mirror
  (DECAL_CACHE_DIR/remote/gs/...) and uploads it; a second retrieve reuses it."""
  client, env, pretrained, *_ = trained
  model_dir = f"gs://{BUCKET}/de"
  proc = _run(env, "train", "--gin_file=runs/retrieval_builtin.gin",
       f"--gin.MODEL_DIR='{model_dir}'", f"--gin.INITIAL_CHECKPOINT_PATH='{pretrained}'",
       "--gin.ALLOW_PARTIAL_RESTORE=True",
       "--gin.TRAIN_STEPS=1", "--gin.EVAL_BATCHES=1", "--gin.BATCH_SIZE=4",
       "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 32}")
  assert f"Starting from {pretrained}" in proc.stdout, proc.stdout
  args = ["--gin_file=runs/retrieve_builtin.gin", f"--gin.MODEL_DIR='{model_dir}'",
          "--gin.PASSAGE_LENGTH=32", "--gin.TOP_K=10", "--gin.BATCH_SIZE=32"]
  first = _run(env, "retrieve", *args)
  names = _objects(client, "de/")
  index = [n for n in names if n.startswith("index/") and n.endswith("/meta.json")]
  assert index, sorted(names)
  results = [n for n in names if n.startswith("retrieval/") and n.endswith(".metrics.json")]
  assert results and any(n.endswith(".trec") for n in names), sorted(names)
  scores = json.loads(client.bucket(BUCKET).blob(f"de/{results[0]}").download_as_text())
  assert scores["step"] == 1 and "ndcg@10" in scores
  assert "NDCG@10" in first.stdout
  second = _run(env, "retrieve", *args)
  assert "Reusing the index at" in second.stdout
  assert not os.path.exists(REPO / "gs:")
