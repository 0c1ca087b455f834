"""tools/bench_serve.py's index choice: the server's command line and the offline Searcher's
arguments come from the same settings (the server's own parser reads the command back), the
newest index of the chosen corpus and kind is picked, and a missing BEIR folder fails with a
clear message. No server is started and nothing is timed."""
import json
import pathlib

import pytest

from decal_jax.runtime import search_server
from tools import bench_serve, serve_clients


def _model_dir(tmp_path: pathlib.Path) -> pathlib.Path:
  """A MODEL_DIR/index/ holding exact and residual indexes of two checkpoints and two
  corpora (meta.json only), and a half-written one that must be ignored."""
  model_dir = tmp_path / "model"
  for name in ("decal_beir_builtin.step1", "decal_beir_builtin.step2",
               "decal_beir_builtin.step2.residual-b2", "scifact.step1.residual-b2",
               "scifact.step2", "scifact.step2.residual-b2", "scifact.step2.residual-b4",
               "scifact.step3.residual-b2.tmp-1"):
    (model_dir / "index" / name).mkdir(parents=True)
    (model_dir / "index" / name / "meta.json").write_text(json.dumps({}))
  return model_dir


def _folder(tmp_path: pathlib.Path) -> str:
  folder = tmp_path / "scifact"
  folder.mkdir()
  (folder / "corpus.jsonl").write_text('{"_id": "d1", "title": "", "text": "apple"}\n')
  return str(folder)


def test_server_command_and_searcher_search_the_same_index(tmp_path):
  model_dir, folder = _model_dir(tmp_path), _folder(tmp_path)
  args = bench_serve.parser().parse_args(
      ["--beir_folder", folder, "--search", "approximate", "--nprobe", "4", "--candidates",
       "64", "--search_backend", "compiled", "--query_length", "12", "--max_batch", "8"])
  index_dir = str(model_dir / "index" / "scifact.step2.residual-b2")
  kwargs = serve_clients.IndexChoice.from_args(args).searcher_kwargs(str(model_dir))
  assert kwargs == {"index_dir": index_dir, "corpus": folder, "nprobe": 4, "query_cells": 32,
                    "candidates": 64, "backend": "compiled"}
  command = serve_clients.server_command(str(model_dir), args)
  assert command[1:3] == ["-m", "decal_jax.serve"]
  served, rest = search_server.parser().parse_known_args(command[3:])
  assert (served.model_dir, served.index_dir, served.corpus) == (str(model_dir), index_dir,
                                                                 folder)
  assert (served.nprobe, served.query_cells, served.candidates, served.search_backend) == (
      4, 32, 64, "compiled")
  assert (served.query_length, served.max_batch) == (12, 8)
  assert rest == ["--gin_file=models/decal_tiny.gin", "--gin_file=models/dual_encoder.gin",
                  "--gin_bindings=PASSAGE_COMPRESSION_RATIO = 4"]
  assert serve_clients.IndexChoice.from_args(args).gin_bindings() == [
      f"BEIR_FOLDER = {folder!r}", "SEARCH = 'approximate'", "NPROBE = 4", "QUERY_CELLS = 32",
      "CANDIDATES = 64", "SEARCH_BACKEND = 'compiled'"]


def test_exact_search_gets_the_exact_index_and_no_approximate_flags(tmp_path):
  model_dir, folder = _model_dir(tmp_path), _folder(tmp_path)
  args = bench_serve.parser().parse_args(["--beir_folder", folder, "--nprobe", "4"])
  kwargs = serve_clients.IndexChoice.from_args(args).searcher_kwargs(str(model_dir))
  assert kwargs == {"index_dir": str(model_dir / "index" / "scifact.step2"), "corpus": folder}
  command = serve_clients.server_command(str(model_dir), args)
  assert not [c for c in command if c.startswith(("--nprobe", "--candidates", "--search_b"))]
  assert f"--index_dir={model_dir / 'index' / 'scifact.step2'}" in command
  builtin = serve_clients.IndexChoice(search="approximate")
  assert builtin.index_dir(str(model_dir)) == str(
      model_dir / "index" / "decal_beir_builtin.step2.residual-b2")
  assert builtin.gin_bindings()[:2] == ["BEIR_TASK = 'decal_beir_builtin'",
                                       "SEARCH = 'approximate'"]


def test_a_missing_index_or_beir_folder_fails_clearly(tmp_path):
  args = bench_serve.parser().parse_args(["--beir_folder", str(tmp_path / "nowhere")])
  with pytest.raises(SystemExit, match="no corpus.jsonl there.*shared/data"):
    bench_serve.main(["--beir_folder", str(tmp_path / "nowhere")])
  with pytest.raises(SystemExit, match="no corpus.jsonl"):
    serve_clients.IndexChoice.from_args(args)
  with pytest.raises(SystemExit, match="no exact index of decal_beir_builtin"):
    serve_clients.IndexChoice().index_dir(str(tmp_path))
