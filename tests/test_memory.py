"""fullgraph.memory: external libraries drawing on PyTorch's pool; the RMM recipe's checks."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from fullgraph import memory

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_bad_library_names_and_no_cuda():
    with pytest.raises(ValueError, match=r"libraries: expected names from \('cupy', 'numba', 'warp'\), got 'jax'"):
        memory.torch_pool("jax")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torch_pool needs CUDA"):
            memory.torch_pool()
        with pytest.raises(RuntimeError, match="use_rmm needs CUDA"):
            memory.use_rmm()


@needs_cuda
def test_use_rmm_after_torch_allocated_is_refused():
    torch.empty(1, device="cuda")
    with pytest.raises(RuntimeError, match="must run before PyTorch allocates CUDA memory"):
        memory.use_rmm()


def _allocate(name: str, nbytes: int):
    """Allocate ``nbytes`` on the GPU with library ``name``; return the object holding it."""
    if name == "cupy":
        import cupy

        return cupy.empty(nbytes, dtype=cupy.uint8)
    if name == "numba":
        from numba import cuda

        return cuda.device_array(nbytes, dtype="uint8")
    import warp

    return warp.empty(nbytes, dtype=warp.uint8, device="cuda")


@needs_cuda
@pytest.mark.parametrize("name", memory.POOLED)
def test_library_allocations_come_from_torch_and_the_routing_reverts(name):
    if importlib.util.find_spec(memory.LIBRARIES[name].module.split(".")[0]) is None:
        pytest.skip(f"{name} is not installed")
    nbytes = 64 * 2**20
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with memory.torch_pool(name) as pool:
        assert name in memory.routed()
        with memory.torch_pool(name):  # nested: the outer routing survives the inner one
            pass
        assert name in memory.routed()
        block = _allocate(name, nbytes)
        assert torch.cuda.memory_allocated() - before >= nbytes
        del block
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before < nbytes
    assert name not in memory.routed()
    pool.close()  # closing twice is harmless
    block = _allocate(name, nbytes)
    assert torch.cuda.memory_allocated() - before < nbytes  # the library's own allocator again
    del block


@needs_cuda
def test_routing_from_many_threads():
    names = memory.installed()
    if not names:
        pytest.skip("no pooled library installed")
    errors = []

    def worker():
        try:
            for _ in range(20):
                with memory.torch_pool(*names):
                    assert set(names) <= set(memory.routed())
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and memory.routed() == ()


@needs_cuda
def test_a_warp_op_that_allocates_runs_in_compiled_cuda_graphs_with_the_torch_pool():
    pytest.importorskip("warp")
    from fullgraph.bench.workloads.extern_pool import allocating_ops as _allocating_ops

    soft_clip = _allocating_ops()["warp"]
    compiled = torch.compile(lambda t: soft_clip(t * 2) + 1, fullgraph=True, mode="reduce-overhead")
    with memory.torch_pool("warp"):
        for _ in range(4):
            x = torch.randn(4096, device="cuda")
            torch.testing.assert_close(compiled(x), 2 * torch.tanh(x) + 1)


def _restorable_capture_entries(monkeypatch):
    """Let the test undo refuse_cuda_graphs (in a user's process it is permanent)."""
    from torch._inductor import cudagraph_trees

    monkeypatch.setattr(torch.cuda.graph, "__enter__", torch.cuda.graph.__enter__)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", torch.cuda.CUDAGraph.capture_begin)
    monkeypatch.setattr(cudagraph_trees, "cudagraphify_impl", cudagraph_trees.cudagraphify_impl)


def test_refused_cuda_graphs_name_rmm_and_the_alternative(monkeypatch):
    from torch._inductor import cudagraph_trees

    from fullgraph.graphs import GraphCaptureError

    _restorable_capture_entries(monkeypatch)
    memory.refuse_cuda_graphs()
    for entry in (lambda: torch.cuda.graph.__enter__(None), lambda: torch.cuda.CUDAGraph.capture_begin(None),
                  lambda: cudagraph_trees.cudagraphify_impl(None, [], ())):
        with pytest.raises(GraphCaptureError, match=r"use_rmm\(\) made RMM .* fullgraph.memory.torch_pool\(\)"):
            entry()


def _rmm_process(case: str) -> str:
    """Run ``case`` in a fresh process that called use_rmm first; return its last output line."""
    import subprocess
    import sys

    script = f"""
import torch, fullgraph
from fullgraph import memory, graphs
memory.use_rmm()
x = torch.randn(1 << 16, device="cuda")
def f(x):
    return (x * 2 + 1).sin()
try:
    {case}
    print("ran")
except graphs.GraphCaptureError as error:
    print("refused:", str(error).splitlines()[0])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@needs_cuda
@pytest.mark.skipif(importlib.util.find_spec("rmm") is None, reason="RMM is not installed")
@pytest.mark.parametrize("case, refused", [
    ("torch.testing.assert_close(f(x), torch.compile(f)(x))", False),
    ("[torch.compile(f, mode='reduce-overhead')(x) for _ in range(3)]", True),
    ("graphs.graphed(f)(x)", True),
    ("g = torch.cuda.CUDAGraph()\n    with torch.cuda.graph(g): f(x)", True),
])
def test_cuda_graphs_in_an_rmm_process_are_refused_by_name(case, refused):
    line = _rmm_process(case)
    assert line.startswith("refused: fullgraph.memory.use_rmm() made RMM") if refused else line == "ran", line
