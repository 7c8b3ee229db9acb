"""Just-in-time builds: the cache name changes with whatever changes the binary, and a build
already in the cache loads without a message."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fullgraph import _extension


def test_the_cache_key_follows_sources_flags_and_the_torch_built_for(tmp_path, monkeypatch):
    source = tmp_path / "op.cpp"
    source.write_text("int f() { return 1; }\n")
    key = _extension.cache_key([source], ["-O3"])
    assert key == _extension.cache_key([source], ["-O3"]) and len(key) == 10
    assert key != _extension.cache_key([source], ["-O2"])
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert key != _extension.cache_key([source], ["-O3"])
    monkeypatch.undo()
    source.write_text("int f() { return 2; }\n")
    assert key != _extension.cache_key([source], ["-O3"])


@pytest.mark.slow
def test_a_cached_build_loads_without_a_message():
    code = ("import torch, fullgraph; from fullgraph.ops.neighbors.cpu import native; "
            "print(native.available())")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    if first.stdout.strip() != "True":
        pytest.skip("the CPU extension cannot be built here: " + first.stderr[-300:])
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert again.stdout.strip() == "True" and "fullgraph: building" not in again.stderr, again.stderr
