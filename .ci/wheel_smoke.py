"""The installed wheel as a new user has it (.ci/wheel_check runs this with a fresh virtual
environment's Python, from an empty folder outside the checkout):

1. `import decal_jax` comes from the environment's site-packages, not from the checkout;
2. the console scripts installed are pyproject.toml's [project.scripts], and each answers
   `--help` with exit status 0;
3. the gin files ship: the package's gin folder holds every gin file of the checkout's
   gin/ but the lab's gin/experiments/, and `decal-train --help --gin_file=runs/...` finds
   one and lists what it leaves required;
4. the built-in tasks register: `decal-list-tasks` names every task the shipped run files name;
5. the README's main command runs a few steps in this folder (a fresh DECAL_CACHE_DIR here,
   so the built-in vocabulary is built as on a new machine): its checkpoint, its held-out
   line and its decoded example.

Standard library only (it runs before anything else is known to work). Exit status 0 when
all hold; otherwise the first that failed, with the command's output.

  python .ci/wheel_smoke.py --checkout /path/to/checkout [--steps 2]
"""
import argparse
import importlib.metadata
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
import tomllib

STARTED = time.perf_counter()


def say(message: str) -> None:
  print(f"[wheel smoke, Python {sys.version.split()[0]}, {time.perf_counter() - STARTED:5.1f} s] "
        f"{message}", flush=True)


def fail(message: str, output: str = "") -> None:
  sys.exit(f"wheel smoke FAILED (Python {sys.version.split()[0]}): {message}"
           + (f"\n--- output ---\n{output[-6000:]}" if output else ""))


def under(path: pathlib.Path, folder: pathlib.Path) -> bool:
  return path == folder or folder in path.parents


def run(args, timeout: float = 600, env=None) -> subprocess.CompletedProcess:
  return subprocess.run([str(a) for a in args], capture_output=True, text=True,
                        timeout=timeout, env=env)


def readme_main_command(checkout: pathlib.Path):
  """The README's main job as it stands (the `python -m decal_jax.train ...` after the
  install of its first bash block), split into arguments."""
  in_code = False
  for line in (checkout / "README.md").read_text(encoding="utf-8").splitlines():
    in_code = in_code != line.startswith("```")
    if in_code and "python -m decal_jax.train" in line:
      return shlex.split(line[line.index("python -m decal_jax.train"):])
  fail("README.md has no `python -m decal_jax.train` command in a code block")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--checkout", required=True, type=pathlib.Path)
  parser.add_argument("--steps", type=int, default=2)
  args = parser.parse_args()
  checkout = args.checkout.resolve()
  here = pathlib.Path.cwd().resolve()
  if under(here, checkout):
    fail(f"run from a folder outside the checkout, not {here}")
  bindir = pathlib.Path(sys.executable).parent

  # 1. The package, from site-packages.
  import decal_jax
  package = pathlib.Path(decal_jax.__file__).resolve().parent
  if under(package, checkout) or "site-packages" not in package.parts:
    fail(f"decal_jax imported from {package}, not from the environment's site-packages")
  version = importlib.metadata.version("decal_jax")
  if version != decal_jax.__version__:
    fail(f"metadata version {version} != decal_jax.__version__ {decal_jax.__version__}")
  say(f"import decal_jax: {version} from {package}")

  # 2. The console scripts: those pyproject declares, each answering --help.
  with open(checkout / "pyproject.toml", "rb") as f:
    declared = tomllib.load(f)["project"]["scripts"]
  installed = {ep.name: ep.value
               for ep in importlib.metadata.distribution("decal_jax").entry_points
               if ep.group == "console_scripts"}
  if installed != declared:
    fail(f"console scripts installed {sorted(installed)} != pyproject's {sorted(declared)}")
  times = {}
  for name in sorted(declared):
    start = time.perf_counter()
    proc = run([bindir / name, "--help"], timeout=120)
    times[name] = time.perf_counter() - start
    if proc.returncode != 0 or "usage" not in (proc.stdout + proc.stderr).lower():
      fail(f"`{name} --help` exited {proc.returncode}", proc.stdout + proc.stderr)
  slowest = max(times, key=times.get)
  say(f"{len(times)} console scripts answer --help (slowest: {slowest}, {times[slowest]:.1f} s)")

  # 3. The gin files ship, and the entry points find them.
  gin_dir = package / "gin"
  shipped = {p.relative_to(gin_dir).as_posix() for p in gin_dir.rglob("*.gin")}
  source = checkout / "gin"
  expected = {p.relative_to(source).as_posix() for p in source.rglob("*.gin")
              if p.relative_to(source).parts[0] != "experiments"}
  if shipped != expected:
    fail(f"gin files: missing from the wheel {sorted(expected - shipped)}, not in the "
         f"checkout {sorted(shipped - expected)}")
  proc = run([bindir / "decal-train", "--help", "--gin_file=runs/pretrain_builtin.gin"])
  if proc.returncode != 0 or not re.search(r"leave %gin.REQUIRED.*: MODEL_DIR", proc.stdout):
    fail("`decal-train --help --gin_file=runs/pretrain_builtin.gin` did not list MODEL_DIR "
         "as required", proc.stdout + proc.stderr)
  say(f"{len(shipped)} gin files shipped; decal-train finds runs/pretrain_builtin.gin")

  # 4. The built-in tasks register.
  proc = run([bindir / "decal-list-tasks"])
  listed = {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}
  named = {m for p in (gin_dir / "runs").glob("*.gin")
           for m in re.findall(r"^MIXTURE_OR_TASK_NAME = '([^']+)'", p.read_text(), re.M)}
  if proc.returncode != 0 or not named or not named <= listed:
    fail(f"decal-list-tasks lacks {sorted(named - listed)} (named by the shipped run files)",
         proc.stdout + proc.stderr)
  say(f"decal-list-tasks: {len(listed)} tasks, the {len(named)} the run files name among them")

  # 5. The README's main command, a few steps, in this folder.
  command = readme_main_command(checkout)
  steps = args.steps
  command = [sys.executable, *command[1:]] + [
      f"--gin.TRAIN_STEPS={steps}", f"--gin.EVAL_PERIOD={steps}",
      f"--gin.CHECKPOINT_PERIOD={steps}", "--gin.EVAL_BATCHES=1", "--gin.LOG_PERIOD=1"]
  env = dict(os.environ, DECAL_CACHE_DIR=str(here / "decal_cache"))
  start = time.perf_counter()
  proc = run(command, env=env, timeout=900)
  output = proc.stdout + proc.stderr
  model_dir = re.search(r"--gin.MODEL_DIR='([^']+)'", " ".join(command)).group(1)
  checkpoint = here / model_dir / f"checkpoint_{steps}"
  if proc.returncode != 0 or not checkpoint.is_dir():
    fail(f"the README's main command ({steps} steps) exited {proc.returncode}"
         + ("" if checkpoint.is_dir() else f", no {checkpoint}"), output)
  for expected_line in (f"Held-out (validation) at step {steps}: loss", "prediction: "):
    if expected_line not in output:
      fail(f"the README's main command printed no {expected_line!r}", output)
  warnings = [line for line in output.splitlines() if re.search(r"Warning\b|WARNING", line)]
  say(f"README's main command, {steps} steps: {time.perf_counter() - start:.0f} s, "
      f"{checkpoint.relative_to(here)} written, {len(warnings)} warning line(s) on the console"
      + "".join(f"\n    {line[:200]}" for line in warnings))
  say("passed")


if __name__ == "__main__":
  main()
