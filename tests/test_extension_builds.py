"""Just-in-time builds: the cache name changes with whatever changes the binary, and a build
already in the cache loads without a message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_a_build_for_another_torch_is_not_loaded(tmp_path):
    """A library built into the package for another torch (or Python, or CPU) is refused with
    the reason, before anything is loaded: the caller builds just in time instead."""
    import json

    library = tmp_path / "_native.so"
    library.write_bytes(b"not a library")  # never loaded: the build info is read first
    library.with_suffix(".json").write_text(json.dumps({**_extension.build_info(), "torch": "1.0.0"}))
    assert _extension.prebuilt_problem(library) == f"it was built for torch 1.0.0, this is {torch.__version__}"
    with pytest.warns(RuntimeWarning, match="not loading the build in the package .*building just in time"):
        assert not _extension.load_prebuilt(library, "a test extension")
    library.with_suffix(".json").unlink()
    assert "has no build info" in _extension.prebuilt_problem(library)


@pytest.mark.wheel
def test_a_wheel_carries_its_native_code(tmp_path):
    """`FULLGRAPH_BUILD_EXT=1 pip wheel` builds the C++ extensions into the wheel; installed
    where no compiler is found and nothing is cached, the operators load them, build nothing,
    warn of nothing, and answer their first call within 2 s (after torch._dynamo's import,
    which torch.library's dispatch of any custom operator makes on its first call)."""
    import os

    if _extension.missing_tools(with_cuda=False):
        pytest.skip("no C++ compiler here to build the wheel with")
    root = Path(__file__).parents[1]
    env = {**os.environ, "FULLGRAPH_BUILD_EXT": "1", "FULLGRAPH_BUILD_CUDA": "0"}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w",
                            str(tmp_path / "dist"), str(root)], env=env, capture_output=True, text=True, timeout=1500)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("fullgraph-*.whl"))
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                                str(tmp_path / "site"), str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    code = (
        "import time, warnings, torch\n"
        "warnings.simplefilter('error')\n"
        "import fullgraph, torch._dynamo\n"
        "from fullgraph.ops.neighbors.cpu import native\n"
        "assert fullgraph.__file__.startswith(%r), fullgraph.__file__\n"
        "x, f = torch.rand(2000, 3), torch.rand(2000, 8)\n"
        "for name, call in [('knn', lambda: fullgraph.knn(x, x, 8, backend='cpu')),\n"
        "                   ('knn_reduce', lambda: fullgraph.knn_reduce(f, fullgraph.knn(x, x, 8)[1])),\n"
        "                   ('lltm', lambda: fullgraph.lltm(torch.rand(4, 5), torch.rand(18, 11), torch.rand(18),\n"
        "                                                   torch.rand(4, 6), torch.rand(4, 6), backend='cpu'))]:\n"
        "    began = time.perf_counter(); call(); took = time.perf_counter() - began\n"
        "    print(name, round(took, 3)); assert took <= 2.0, (name, took)\n"
        "assert native.available()\n"
    ) % str(tmp_path / "site")
    run_env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "CXX": "no-such-compiler",
               "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty-cache")}
    out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "fullgraph: building" not in out.stderr, out.stdout + out.stderr[-3000:]
