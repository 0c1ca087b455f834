"""The layering of docs/ARCHITECTURE.md, read from the source: every import between the
library's modules (top-level or inside a function) goes down the table below, the library
never imports the lab (tools/), and no two modules import each other, directly or round a
longer loop. A function-local import that dodges a cycle is a cycle here too."""
import ast
import pathlib
from typing import Dict, Iterator, Optional, Set, Tuple

import paths

REPO = paths.REPO
FOUNDATION = {"fileio", "partitioning", "settings", "losses", "metrics", "text_metrics",
              "decoding"}
ENTRY_POINTS = {"train", "eval", "infer", "retrieve", "serve"}
BELOW_MODELS = {"foundation", "layers", "compress", "networks", "retrieval", "data"}
MAY_IMPORT: Dict[str, Set[str]] = {  # room -> the rooms its modules may import
    "foundation": {"foundation"},
    "layers": {"foundation"},
    "compress": {"foundation", "layers"},
    "networks": {"foundation", "layers", "compress"},
    "data": {"foundation"},
    "retrieval": {"foundation", "data"},
    "tasks": {"foundation", "data", "retrieval"},
    "models": {"foundation", "layers", "compress", "networks", "retrieval"},
    "interop": {"foundation", "layers", "compress", "networks", "data"},
    "runtime": BELOW_MODELS | {"models", "tasks", "interop"},
    "commands": BELOW_MODELS | {"models", "tasks", "interop", "runtime"},
    "entry": {"runtime"},
    "lab": BELOW_MODELS | {"models", "tasks", "interop", "runtime", "commands", "entry", "lab"},
}


def _module_name(path: pathlib.Path) -> str:
  """decal_jax/runtime/trainer.py -> decal_jax.runtime.trainer; tasks/x.py -> decal_jax.tasks.x."""
  parts = list(path.relative_to(REPO).with_suffix("").parts)
  if parts[0] == "tasks":
    parts = ["decal_jax"] + parts
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _sources() -> Dict[str, pathlib.Path]:
  files = [*(REPO / "decal_jax").rglob("*.py"), *(REPO / "tasks").glob("*.py"),
           *(REPO / "tools").glob("*.py")]
  return {_module_name(p): p for p in files}


def room(module: str) -> Optional[str]:
  """The room a module of ours lives in; None for a module that is not ours."""
  parts = module.split(".")
  if parts[0] == "tools":
    return "lab"
  if parts[0] != "decal_jax":
    return None
  if len(parts) == 1 or parts[1] in FOUNDATION:  # decal_jax/__init__.py: the version only
    return "foundation"
  if parts[1] in ENTRY_POINTS:
    return "entry"
  return parts[1]


def _imported(tree: ast.AST, modules: Set[str]) -> Iterator[Tuple[str, int]]:
  """(module of ours, line) for each import in a file; `from package import name` counts as
  the submodule when `name` is one, else as the package."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, node.lineno
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        yield (full if full in modules else node.module), node.lineno


def import_graph() -> Dict[str, Dict[str, int]]:
  """module -> {imported module of ours: first line}."""
  sources = _sources()
  graph: Dict[str, Dict[str, int]] = {}
  for module, path in sources.items():
    edges = graph.setdefault(module, {})
    for target, line in _imported(ast.parse(path.read_text()), set(sources)):
      while target not in sources and "." in target:  # `import decal_jax.data.x as y`
        target = target.rsplit(".", 1)[0]
      if target in sources and target != module:
        edges.setdefault(target, line)
  return graph


def _is_package_init(module: str) -> bool:
  return _sources()[module].name == "__init__.py"


def test_every_import_goes_down_the_rooms():
  graph = import_graph()
  forbidden = []
  for module, edges in graph.items():
    source = room(module)
    for target, line in edges.items():
      target_room = room(target)
      if target_room == source or target_room in MAY_IMPORT[source]:
        continue
      forbidden.append(f"{_sources()[module].relative_to(REPO)}:{line} ({source}) imports "
                       f"{target} ({target_room})")
  assert not forbidden, "imports against docs/ARCHITECTURE.md's rules:\n" + "\n".join(forbidden)


def _cycles(graph: Dict[str, Dict[str, int]]) -> Iterator[list]:
  """Tarjan's strongly connected components of more than one module."""
  index: Dict[str, int] = {}
  low: Dict[str, int] = {}
  stack, on_stack = [], set()

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, {}):
      if w not in index:
        yield from visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        yield sorted(component)
  for v in sorted(graph):
    if v not in index:
      yield from visit(v)


def test_no_import_cycles():
  graph = import_graph()
  # A package's __init__ that re-exports its modules is imported *through*, not a module
  # of its own: drop the edges from an __init__ to its own submodules.
  graph = {m: {t: l for t, l in e.items() if not (_is_package_init(m) and t.startswith(m + "."))}
           for m, e in graph.items()}
  cycles = list(_cycles(graph))
  assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_rules_catch_a_forbidden_edge_and_a_cycle():
  """The checks themselves, on a hand-made graph: data -> runtime is against the table, and
  a -> b -> c -> a is a loop of three."""
  assert "runtime" not in MAY_IMPORT[room("decal_jax.data.pipeline")]
  assert room("decal_jax.runtime.trainer") == "runtime" and room("tools.gpu_suite") == "lab"
  assert room("decal_jax.fileio") == "foundation" and room("decal_jax.train") == "entry"
  loop = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
  assert list(_cycles(loop)) == [["a", "b", "c"]]


def test_the_top_level_is_rooms_and_a_handful_of_modules():
  """At most 12 modules at decal_jax/'s top level besides its room folders (issue 42)."""
  modules = sorted(p.stem for p in (REPO / "decal_jax").glob("*.py") if p.stem != "__init__")
  assert set(modules) <= FOUNDATION | ENTRY_POINTS and len(modules) <= 12, modules
  rooms = sorted(p.name for p in (REPO / "decal_jax").iterdir()
                 if (p / "__init__.py").exists())
  assert set(rooms) <= set(MAY_IMPORT), rooms
