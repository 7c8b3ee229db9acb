"""The repository is the product: no development history in tracked files, results as data."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# Development-stage numbers and run ids: "session 12", "run AB", "runs CC and CD", "-run-XY".
HISTORY = re.compile(r"\b[Ss]ession ?\d+|\bruns? [A-Z]{2}\b|-run-[A-Z]{1,2}\b")


def _tracked() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in names.splitlines() if (ROOT / name).is_file()]


def test_no_stage_numbers_or_run_ids_in_tracked_files():
    found = []
    for path in _tracked():
        if path.suffix in (".png", ".so") or path == Path(__file__):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
                  for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]
    assert not found, "\n".join(found[:20])


def test_the_pattern_catches_history_and_spares_prose():
    assert HISTORY.search("graphed 0.42 ms (session 31)") and HISTORY.search("H100, run XB: 0.5 ms")
    assert HISTORY.search("runs CC and CD") and HISTORY.search("tests-dense-run-YA.log")
    assert not HISTORY.search("each call runs on a CUDA device") and not HISTORY.search("a run of equal values")
    assert not HISTORY.search("fullgraph bench --runs N")


def test_results_are_latest_rows_per_device_and_workload():
    results = ROOT / "benchmarks" / "results"
    files = [p for p in results.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 60
    for path in files:
        assert path.suffix in (".json", ".png") and path.parent.parent == results, path
        if path.suffix == ".json":
            rows = json.loads(path.read_text())
            assert rows and all(r["workload"] == path.stem and r["commit"] and r["device"] for r in rows), path


def _imports(path: Path, package: str, modules: set[str]) -> set[str]:
    """The fullgraph modules ``path`` imports at its top level (deferred imports not counted):
    ``from X import y`` depends on the module X.y where y is one, else on X."""
    import ast

    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def test_the_package_s_imports_have_no_cycle():
    """A package's __init__ may import its submodules; no module imports, through others, one
    that imports it (kernel modules are reached through ``_triton.lazy``, not imported)."""
    src = ROOT / "src"
    files = {}
    for path in (src / "fullgraph").rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = (path, ".".join(parts[:-1]))  # (the package relative imports start from)
    modules = set(files)
    graph = {name: _imports(path, package, modules) - {name} for name, (path, package) in files.items()}
    # importing a package's submodule runs the package's __init__ first: not an edge of the submodule's own
    graph = {name: {dep for dep in deps if not name.startswith(dep + ".")} for name, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(name, trail):
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail + [name, dep]))
            if dep not in state:
                visit(dep, trail + [name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert len(graph) > 80 and sum(map(len, graph.values())) > 150
