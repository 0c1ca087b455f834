"""The wheel works outside a checkout: built from the tree, installed into a fresh venv that
reuses this test venv's packages (a .pth file: `--system-site-packages` does not chain from a
venv), it ships every gin file and every tool, and runs the README's main job (shortened)
and a tool from an empty directory through their console scripts."""
import email
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

import paths

REPO = paths.REPO
# Not copied from the checkout's root: git, venvs, caches, run outputs, earlier builds.
NOT_SOURCES = {".git", ".ci-venv", ".ci-cache", ".venv", "venv", "build", "dist", "runs", "tmp",
               "data", "tests", "decal_jax.egg-info"}


# A Markdown link or image, its target captured.
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _not_sources(folder, names):
  return [n for n in names if n == "__pycache__" or (folder == str(REPO) and n in NOT_SOURCES)]


def _clean_env():
  """This environment without PYTHONPATH (which would import the checkout's decal_jax)."""
  return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _check(command, **kwargs):
  proc = subprocess.run(command, capture_output=True, text=True, env=_clean_env(), timeout=600,
                        **kwargs)
  assert proc.returncode == 0, f"{command} failed:\n{proc.stdout}\n{proc.stderr}"
  return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """The wheel `pip wheel --no-deps` builds from a copy of the tree (no build/ in the checkout)."""
  source = tmp_path_factory.mktemp("source") / "decal_jax"
  shutil.copytree(REPO, source, symlinks=True, ignore=_not_sources)
  out = tmp_path_factory.mktemp("dist")
  _check([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out),
          str(source)])
  (path,) = out.glob("decal_jax-*.whl")
  return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
  """A fresh venv with the wheel installed; the dependencies come from this test venv."""
  root = tmp_path_factory.mktemp("venv")
  _check([sys.executable, "-m", "venv", "--without-pip", str(root)])
  python = root / "bin" / "python"
  own = _check([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
  ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
  pathlib.Path(own.stdout.strip(), "test_venv.pth").write_text("\n".join(sorted(ours)) + "\n")
  _check([str(python), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)])
  return root


def test_the_wheel_ships_every_gin_file(wheel):
  shipped = {name[len("decal_jax/gin/"):] for name in zipfile.ZipFile(wheel).namelist()
             if name.startswith("decal_jax/gin/") and name.endswith(".gin")}
  in_tree = {p.relative_to(REPO / "gin").as_posix() for p in (REPO / "gin").rglob("*.gin")}
  lab = {name for name in in_tree if name.startswith("experiments/")}  # tools/ablate's
  assert lab and shipped == in_tree - lab and "runs/pretrain_builtin.gin" in shipped


def test_the_wheel_carries_the_library_not_the_lab(wheel):
  """tools/ (benchmarks, results tables, the GPU suite and their helpers) stays in the
  checkout; the wheel holds decal_jax/ only, its rooms and its user commands."""
  names = zipfile.ZipFile(wheel).namelist()
  assert not [n for n in names if n.startswith("tools/")]
  modules = {n for n in names if n.startswith("decal_jax/") and n.endswith(".py")}
  assert {"decal_jax/runtime/trainer.py", "decal_jax/interop/hf_import.py",
          "decal_jax/commands/make_vocab.py", "decal_jax/train.py"} <= modules
  assert not [n for n in modules if "benchmarking" in n or "gpu_suite" in n or "bench_" in n]


def _setup_script():
  """setup.py's functions, without setuptools running (its setup() call runs as __main__)."""
  spec = importlib.util.spec_from_file_location("setup_script", REPO / "setup.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _absolute(target):
  return re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None


def _anchors(markdown):
  """GitHub's anchors of a Markdown file's headings."""
  return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
          for title in re.findall(r"^#+ (.+)$", markdown, re.M)}


def test_every_relative_readme_link_names_a_file_and_becomes_its_repository_url():
  """On a package index the README's links relative to the repository would not resolve:
  the long description points each at the file in the Source repository (blob/, an image
  raw/), in order, every other character unchanged; each link's file (and #anchor) exists."""
  setup, readme = _setup_script(), (REPO / "README.md").read_text(encoding="utf-8")
  targets = MARKDOWN_LINK.findall(readme)
  relative = [t for t in targets if not _absolute(t)]
  assert len(relative) >= 20
  for target in relative:
    path, _, anchor = target.partition("#")
    assert (REPO / path).is_file(), target
    assert not anchor or anchor in _anchors((REPO / path).read_text(encoding="utf-8")), target
  url = "https://github.com/owner/repo"
  out = setup.long_description(readme, url)
  images = {t for t in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", readme)}
  assert MARKDOWN_LINK.findall(out) == [
      t if _absolute(t) else f"{url}/{'raw' if t in images else 'blob'}/main/{t}"
      for t in targets]
  assert MARKDOWN_LINK.sub("", out) == MARKDOWN_LINK.sub("", readme)


def test_the_wheels_long_description_is_the_readme_with_no_relative_link(wheel):
  """What the index shows (METADATA's body): the README, whose repository links point into
  pyproject's [project.urls] Source, or, while none is declared, name their file's path."""
  (name,) = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA")]
  metadata = email.message_from_bytes(zipfile.ZipFile(wheel).read(name))
  body = metadata.get_payload()
  assert metadata["Description-Content-Type"] == "text/markdown"
  assert body.startswith("# decal_jax\n") and "pip install -e ." in body
  assert [t for t in MARKDOWN_LINK.findall(body) if not _absolute(t)] == []
  source = _setup_script().source_url()
  readme = (REPO / "README.md").read_text(encoding="utf-8")
  for image, target in re.findall(r"(!?)\[[^\]]*\]\(([^)\s]+)\)", readme):
    if _absolute(target):
      continue
    if source:
      assert f"({source.rstrip('/')}/{'raw' if image else 'blob'}/main/{target})" in body
    elif not image:
      assert f"`{target.split('#')[0]}`" in body


def test_tensorflow_text_still_requires_tensorflow_so_not_tensorflow_cpu():
  """Why pyproject asks for `tensorflow` where T5X asks for `tensorflow-cpu` (docs/t5x.md,
  Install): seqio requires tensorflow-text, and tensorflow-text requires `tensorflow` by
  that name outside any extra, so tensorflow-cpu would install beside it, not instead. When
  this fails, the switch to tensorflow-cpu has become possible."""
  from importlib import metadata
  from packaging.requirements import Requirement

  def needs(dist):
    rows = [Requirement(line) for line in metadata.requires(dist)]
    return {r.name for r in rows if r.marker is None or r.marker.evaluate({"extra": ""})}
  assert "tensorflow-text" in needs("seqio")
  assert "tensorflow" in needs("tensorflow-text")
  assert "tensorflow-cpu" not in needs("tensorflow-text")


def test_the_commands_run_from_the_wheel_as_console_scripts(venv, tmp_path):
  commands = sorted(p.stem for p in (REPO / "decal_jax" / "commands").glob("[a-z]*.py"))
  scripts = sorted(p.name[len("decal-"):].replace("-", "_")
                   for p in (venv / "bin").glob("decal-*"))
  assert set(scripts) == set(commands) | {"train", "eval", "infer", "retrieve", "serve"}
  proc = _check([str(venv / "bin" / "decal-prepare-jsonl"), "--help"], cwd=tmp_path)
  assert "usage:" in proc.stdout


def test_the_main_job_runs_from_the_wheel_outside_the_checkout(venv, tmp_path):
  where = _check([str(venv / "bin" / "python"), "-c",
                  "import decal_jax, decal_jax.tasks as t, decal_jax.runtime.gin_utils as g; "
                  "print(decal_jax.__file__, t.__file__, g.GIN_DIR, sep='\\n')"], cwd=tmp_path)
  assert all(line.startswith(str(venv)) for line in where.stdout.split()), where.stdout
  proc = _check([str(venv / "bin" / "decal-train"), "--gin_file=runs/pretrain_builtin.gin",
                 "--gin.MODEL_DIR='m'", "--gin.TRAIN_STEPS=2", "--gin.EVAL_BATCHES=1",
                 "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 12}",
                 "--gin.BATCH_SIZE=4"], cwd=tmp_path)
  assert (tmp_path / "m" / "checkpoint_2").is_dir()
  assert "Held-out (validation) at step 2" in proc.stdout


def test_a_command_script_runs_the_command_its_name_gives_and_exits_by_int_only(monkeypatch):
  """decal-<name> runs decal_jax.commands.<name>.main; results a tool returns for in-process
  callers (rows, dicts) are not exit statuses (sys.exit(dict) would print it and exit 1)."""
  import types
  from decal_jax import commands
  calls = []
  fake = types.ModuleType("decal_jax.commands.fake_tool")
  monkeypatch.setitem(sys.modules, "decal_jax.commands.fake_tool", fake)
  monkeypatch.setattr(sys, "argv", ["/venv/bin/decal-fake-tool", "--x"])
  for returned, status in (([{"row": 1}], 0), ({"parts": {}}, 0), (None, 0), (3, 3),
                           (True, 0)):
    fake.main = lambda r=returned: calls.append(sys.argv[1:]) or r
    assert commands.script() == status
  assert calls == [["--x"]] * 5
  monkeypatch.setattr(sys, "argv", ["/usr/bin/python3"])
  with pytest.raises(SystemExit, match="python -m decal_jax.commands"):
    commands.script()
