"""Kernel modules import Triton at their top and load on first use: ``import fullgraph``
needs no Triton, and without Triton the CPU paths still run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fullgraph import _triton


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_importing_fullgraph_imports_no_kernel_module():
    out = _run("""
        import sys
        import fullgraph
        kernels = sorted(name for name in sys.modules if name.startswith("fullgraph") and name.endswith("kernels"))
        print(kernels, "triton" in sys.modules)
    """)
    assert out.strip() == "[] False"


@pytest.mark.slow
def test_without_triton_the_cpu_paths_run():
    out = _run("""
        import sys
        sys.modules["triton"] = None          # as if it were not installed
        import torch, fullgraph
        q, r = torch.randn(2, 40, 16), torch.randn(2, 90, 16)
        want = fullgraph.knn(q, r, 5, backend="torch")[1]
        assert torch.equal(fullgraph.knn(q, r, 5, backend="dense")[1], want)
        assert torch.equal(fullgraph.knn(q, r, 5)[1], want)
        print(fullgraph.fps(torch.randn(300, 3), 0.1).shape[0], fullgraph.ddpm_step.__name__)
        try:
            fullgraph.knn(*(t.cuda() if torch.cuda.is_available() else t for t in (q, r)), 5, backend="triton")
        except ImportError as error:
            print("refused:", error)
    """)
    assert out.startswith("30 ddpm_step") and "refused: backend=\"triton\" needs triton" in out


def test_lazy_modules_read_and_write_through():
    module = _triton.lazy("json")
    assert module.dumps([1]) == "[1]"
    module.probe = 3
    import json

    assert json.probe == 3
    del module.probe
    assert not hasattr(json, "probe")


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 64, 65, 1000])
def test_launch_arithmetic_matches_triton_s(n):
    triton = pytest.importorskip("triton")
    assert _triton.next_power_of_2(n) == triton.next_power_of_2(n)
    assert all(_triton.cdiv(n, b) == triton.cdiv(n, b) for b in (1, 2, 7, 64))
