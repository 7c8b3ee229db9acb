"""The package's import structure: layers only import downwards, and no module imports
itself back through another (no cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

import fullgraph

ROOT = Path(fullgraph.__file__).parent
# Higher layers may import lower ones, never the reverse.
LAYERS = {
    "cli": 6, "doctor": 6, "bench": 5, "models": 4, "compat": 4, "diffusion": 4, "distributed": 4, "ops": 3,
    "extern": 2, "memory": 2, "graphs": 2, "numpy": 2, "backends": 2, "explain": 2,
    "libraries": 1, "_validate": 1, "_contract": 1, "_triton": 1, "_background": 1, "_extension": 1, "__init__": 7,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """fullgraph modules imported by the file (relative imports resolved)."""
    package = _module_name(path).split(".") if path.name == "__init__.py" else _module_name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if not module.startswith("fullgraph"):
                continue
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("fullgraph"))
    modules = {_module_name(p) for p in ROOT.rglob("*.py")} - {"fullgraph"}  # `from .. import x` names x only
    return {m for m in found if m in modules}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS["__init__"] if len(parts) == 1 else LAYERS[parts[1]]


def test_layers_import_downwards():
    upward = []
    for path in ROOT.rglob("*.py"):
        importer = _module_name(path)
        if importer == "fullgraph":
            continue
        for imported in _imports(path):
            if _layer(imported) > _layer(importer):
                upward.append(f"{importer} -> {imported}")
    assert not upward, upward


def test_no_import_cycles():
    graph = {_module_name(p): {m for m in _imports(p)} for p in ROOT.rglob("*.py")}
    # A package's __init__ re-exporting its modules is not a cycle through them.
    for name, imported in graph.items():
        graph[name] = {m for m in imported if not name.startswith(m + ".") and m != name}
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])
