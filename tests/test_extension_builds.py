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


# Every operator's first call from the wheel, in seconds at most (k-means' NumPy steps run in
# NumPy itself where no C++ compiler is found: nothing is traced).
FIRST_CALL_S = 2.0


def _wheel(tmp_path, cuda: bool) -> Path:
    """The wheel: FULLGRAPH_WHEEL's (CI builds the CPU one once, .ci/run), else built here (with
    the CUDA kernels where ``cuda``)."""
    import os

    if os.environ.get("FULLGRAPH_WHEEL"):
        return Path(os.environ["FULLGRAPH_WHEEL"])
    if _extension.missing_tools(with_cuda=cuda):
        pytest.skip("no compiler here to build the wheel with: " + ", ".join(_extension.missing_tools(with_cuda=cuda)))
    env = {**os.environ, "FULLGRAPH_BUILD_EXT": "1", "FULLGRAPH_BUILD_CUDA": "1" if cuda else "0"}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w",
                            str(tmp_path / "dist"), str(Path(__file__).parents[1])], env=env, capture_output=True,
                           text=True, timeout=1500)
    assert built.returncode == 0, built.stderr[-3000:]
    return next((tmp_path / "dist").glob("fullgraph-*.whl"))


@pytest.mark.wheel
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_wheel_carries_its_native_code(tmp_path, device):
    """`FULLGRAPH_BUILD_EXT=1 pip wheel` builds the C++ extensions into the wheel (and, with nvcc,
    the CUDA kernels of LLTM and fps); installed in a fresh virtual environment (torch from the
    running interpreter's packages) with no compiler on PATH and nothing cached, every public operator's first
    call (tests/wheel/smoke.py; on "cuda" the C++/CUDA operators on the GPU) builds nothing,
    raises and warns nothing, and returns within FIRST_CALL_S."""
    import json
    import os
    import site as site_module

    cuda = device == "cuda"
    if cuda and not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("the CUDA wheel's fps kernel needs a GPU of compute capability >= 9.0")
    wheel = _wheel(tmp_path, cuda)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python*/site-packages"))
    # torch from this interpreter's packages (a venv's too), after the wheel's own
    (site / "torch_from_outside.pth").write_text("\n".join(site_module.getsitepackages()) + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                                str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    env = {"HOME": os.environ.get("HOME", str(tmp_path)), "PATH": str(venv / "bin"), "CXX": "no-such-compiler",
           "CUDA_HOME": str(tmp_path / "no-cuda-toolkit"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty-cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty-inductor-cache")}
    out = subprocess.run([str(venv / "bin" / "python"), str(Path(__file__).parent / "wheel" / "smoke.py"),
                          *(["cuda"] if cuda else [])], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "fullgraph: building" not in out.stderr, out.stdout + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["fullgraph"].startswith(str(site)), report["fullgraph"]
    assert report["problems"] == {} and report["native"]
    slow = {name: took for name, took in report["seconds"].items() if took > FIRST_CALL_S}
    assert not slow, report["seconds"]
    assert "fullgraph:" not in out.stderr, out.stderr[-3000:]
    print(device, json.dumps(report["seconds"]))
