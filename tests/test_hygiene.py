"""The repository is the product: no development history in tracked files, results as data."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# Development-stage numbers and run ids: "session" or "run(s)" followed by a number or a
# two-letter id, and "-run-" plus such an id in a file name.
HISTORY = re.compile(r"\b[Ss]essions? ?\d+|\bruns? [A-Z]{2}\b|-run-[A-Z]{1,2}\b")


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
    assert HISTORY.search("graphed 0.42 ms (session %d)" % 31) and HISTORY.search("H100, run %s: 0.5 ms" % "XB")
    assert HISTORY.search("runs CC and CD") and HISTORY.search("tests-dense-run-YA.log")
    assert HISTORY.search("whole steps, sessions %d-%d" % (27, 28))
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

