"""The linter's exceptions are few and each says why: `ruff check .` (CI) fails on a `# noqa`
that suppresses nothing (RUF100); here, every `# noqa` left names its codes and gives a
reason in parentheses, and no `# pylint:` comment remains (pylint is not run, so such a
comment would be an unchecked promise)."""
import re

import paths

SOURCES = [p for folder in ("decal_jax", "tasks", "tools", "tests")
           for p in (paths.REPO / folder).rglob("*.py") if p.name != "test_suppressions.py"]
NOQA = re.compile(r"#\s*noqa\b(?P<rest>.*)$")
JUSTIFIED = re.compile(r"^:\s*[A-Z]+[0-9]+(,\s*[A-Z]+[0-9]+)*\s+\(.+\)")


def _unjustified(lines):
  """(line number, line) of each `# noqa` without codes and a (reason)."""
  for number, line in enumerate(lines, 1):
    match = NOQA.search(line)
    if match and not JUSTIFIED.match(match.group("rest")):
      yield number, line.strip()


def test_every_noqa_names_its_codes_and_why():
  bad = [f"{p.relative_to(paths.REPO)}:{n}: {line}" for p in SOURCES
         for n, line in _unjustified(p.read_text().splitlines())]
  assert not bad, "a # noqa needs its codes and a (reason):\n" + "\n".join(bad)


def test_no_pylint_comments():
  bad = [f"{p.relative_to(paths.REPO)}:{n}" for p in SOURCES
         for n, line in enumerate(p.read_text().splitlines(), 1)
         if re.search(r"#\s*pylint:", line)]
  assert not bad, "pylint is not run: drop these comments (keep a reason as prose):\n" + (
      "\n".join(bad))


def test_the_check_tells_a_reason_from_none():
  lines = ["import x  # noqa: F401  (registers the tasks)", "import y  # noqa: F401",
           "import z  # noqa", "a = 1  # noqa: E731, F841  (two codes)"]
  assert [n for n, _ in _unjustified(lines)] == [2, 3]
