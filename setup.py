"""The package layout and the long description; the rest of the metadata (PEP 621) is in
pyproject.toml."""
import pathlib
import re
import sys
from typing import Optional

import setuptools

if sys.version_info >= (3, 11):
  import tomllib
else:  # pyproject's build requirements add tomli there
  import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parent
# A Markdown link or image to a path of the repository: no URL scheme, not only an #anchor.
RELATIVE_LINK = re.compile(r"(!?)\[([^\]]*)\]\((?![a-zA-Z][a-zA-Z0-9+.-]*:|#)([^)\s]+)\)")

# `tasks/` (seqio registrations) and `gin/` (the gin files, folders only) live at the repo root
# and install as decal_jax.tasks and decal_jax/gin (found through the package: gin_utils.GIN_DIR).
# gin/experiments/ belongs to the lab (tools/ablate, tools/retention_table): not in the wheel.
GIN_FOLDERS = ["decal_jax.gin"] + ["decal_jax.gin." + name
                                   for name in setuptools.find_namespace_packages(where="gin")
                                   if not name.startswith("experiments")]


def source_url() -> Optional[str]:
  """pyproject's [project.urls] Source: the repository README's links point into (none
  declared yet)."""
  with open(ROOT / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["project"].get("urls", {}).get("Source")


def _unlinked(text: str, target: str) -> str:
  """A link to a repository file with no URL to give it: its text and the file's path."""
  path = target.split("#")[0]
  return f"`{path}`" if path.endswith(text) else f"{text} (`{path}`)"


def long_description(readme: str, source: Optional[str]) -> str:
  """README.md for the package index, where its links relative to the repository would not
  resolve: each becomes `source`/blob/main/PATH (an image `source`/raw/main/PATH, so the
  index shows it); with no source URL, a link becomes text naming the path and an image is
  left out."""
  def rewrite(match):
    bang, text, target = match.groups()
    if source is None:
      return "" if bang else _unlinked(text, target)
    return f"{bang}[{text}]({source.rstrip('/')}/{'raw' if bang else 'blob'}/main/{target})"
  return RELATIVE_LINK.sub(rewrite, readme)


if __name__ == "__main__":  # as setuptools runs it (a test imports the functions above)
  setuptools.setup(
      packages=sorted(set(setuptools.find_packages(include=["decal_jax", "decal_jax.*"]))
                      | {"decal_jax.tasks"} | set(GIN_FOLDERS)),
      package_dir={"decal_jax.tasks": "tasks", "decal_jax.gin": "gin"},
      package_data={folder: ["*.gin"] for folder in GIN_FOLDERS},
      long_description=long_description((ROOT / "README.md").read_text(encoding="utf-8"),
                                        source_url()),
      long_description_content_type="text/markdown",
  )
