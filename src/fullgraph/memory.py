"""One memory pool for PyTorch and the external libraries.

    with fullgraph.memory.torch_pool():        # CuPy, Numba and Warp allocate from PyTorch
        out = my_cupy_op(x)

``torch_pool`` routes the libraries' device allocations through PyTorch's caching
allocator: memory freed by one library is reused by the others without a cudaFree, the
pool's statistics (``torch.cuda.memory_allocated``) see everything, and allocations made
during a CUDA graph capture come from the graph's private pool, so they are capturable.
It is reversible (close the handle, or leave the ``with`` block), nests, and is
thread-safe. ``use_rmm`` applies the other recipe: every library, PyTorch included, on
one RAPIDS Memory Manager pool (once, before PyTorch touches CUDA). CUDA graphs cannot
be captured in such a process (RMM gives a graph no private pool): ``use_rmm`` makes every
capture, ``torch.compile(mode="reduce-overhead")`` included, raise ``GraphCaptureError``
saying so; ``torch_pool`` is the recipe to use with CUDA graphs.
"""

from __future__ import annotations

import threading

import torch

from .graphs import GraphCaptureError
from .libraries import LIBRARIES

POOLED = ("cupy", "numba", "warp")

_lock = threading.Lock()
_routes: dict[str, list] = {}  # library -> [restore function, nesting count]


def installed() -> tuple[str, ...]:
    """The libraries of ``POOLED`` that are importable here."""
    return tuple(name for name in POOLED if LIBRARIES[name].installed())


class TorchPool:
    """Handle returned by ``torch_pool``: ``close()`` (or leaving ``with``) undoes the routing."""

    def __init__(self, libraries: tuple[str, ...]):
        self.libraries = libraries
        self._open = True

    def close(self) -> None:
        with _lock:
            if not self._open:
                return
            self._open = False
            for name in self.libraries:
                route = _routes[name]
                route[1] -= 1
                if route[1] == 0:
                    route[0]()
                    del _routes[name]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def torch_pool(*libraries: str) -> TorchPool:
    """Route the device allocations of ``libraries`` (default: every installed one of
    "cupy", "numba", "warp") through PyTorch's caching allocator.

    Memory a library allocates is ordered on its current stream; inside fullgraph.extern
    ops that is PyTorch's current stream. Warp's HashGrid and other native structures
    allocate in C++ and stay outside. Raises ValueError for unknown names, ImportError
    (naming the package) for a library asked for by name that is missing, RuntimeError
    without CUDA.
    """
    for name in libraries:
        if name not in POOLED:
            raise ValueError(f"libraries: expected names from {POOLED}, got {name!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("fullgraph.memory.torch_pool needs CUDA: no CUDA device is available")
    libraries = tuple(dict.fromkeys(libraries or installed()))
    with _lock:
        for name in libraries:
            if name in _routes:
                _routes[name][1] += 1
            else:
                _routes[name] = [LIBRARIES[name].route_allocations(), 1]
    return TorchPool(libraries)


def routed() -> tuple[str, ...]:
    """The libraries whose allocations currently come from PyTorch's pool."""
    with _lock:
        return tuple(_routes)


def use_rmm(pool: bool = True, initial_pool_size: int | None = None) -> None:
    """The tutorial's recipe: PyTorch, CuPy, Numba and Warp all allocate from one RMM pool.

    Call once at start-up, before PyTorch allocates CUDA memory (PyTorch cannot swap its
    allocator afterwards); it cannot be undone. ``initial_pool_size`` in bytes (RMM's
    default when None). Raises RuntimeError without CUDA or after PyTorch allocated,
    ImportError naming the package when RMM is missing. Afterwards CUDA graph captures
    raise GraphCaptureError (see ``refuse_cuda_graphs``).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("fullgraph.memory.use_rmm needs CUDA: no CUDA device is available")
    if torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 0:
        raise RuntimeError(
            "fullgraph.memory.use_rmm must run before PyTorch allocates CUDA memory (PyTorch already holds "
            f"{torch.cuda.memory_reserved()} bytes and cannot swap its allocator): call it first thing, "
            "or use fullgraph.memory.torch_pool() to share PyTorch's pool instead")
    try:
        import rmm
        from rmm.allocators.torch import rmm_torch_allocator
    except ImportError as error:
        raise ImportError('fullgraph.memory.use_rmm needs RMM: pip install "fullgraph[rapids]" '
                          "(rmm-cu12, from RAPIDS)") from error
    rmm.reinitialize(pool_allocator=pool, initial_pool_size=initial_pool_size)
    torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    refuse_cuda_graphs()
    present = installed()
    if "cupy" in present:
        from rmm.allocators.cupy import rmm_cupy_allocator

        LIBRARIES["cupy"].load().cuda.set_allocator(rmm_cupy_allocator)
    if "numba" in present:
        from rmm.allocators.numba import RMMNumbaManager

        LIBRARIES["numba"].load().set_memory_manager(RMMNumbaManager)
    if "warp" in present:
        warp = LIBRARIES["warp"].load()
        warp.set_cuda_allocator(warp.utils.AllocatorRmm())


RMM_GRAPHS = (
    "fullgraph.memory.use_rmm() made RMM PyTorch's allocator, and RMM gives a CUDA graph no private memory pool: "
    "capturing fails (torch.cuda.graph: cudaErrorStreamCaptureInvalidated; torch.compile(mode=\"reduce-overhead\"): "
    "'pluggable does not yet support checkPoolLiveAllocations'; measured with rmm-cu13 26.10, torch 2.11). "
    "Use torch.compile's default mode in this process, or, for CUDA graphs, share PyTorch's pool with the "
    "libraries instead of RMM: fullgraph.memory.torch_pool()")


def refuse_cuda_graphs() -> None:
    """Make every CUDA graph capture in this process raise GraphCaptureError(RMM_GRAPHS)
    before it starts: ``with torch.cuda.graph(...)`` (refused before it switches streams),
    ``CUDAGraph.capture_begin`` (fullgraph.graphs, torch.compile's plain cudagraphify) and the
    CUDA-graph trees of
    ``torch.compile(mode="reduce-overhead")``. ``use_rmm`` calls it; it cannot be undone."""
    from torch._inductor import cudagraph_trees

    def refuse(*args, **kwargs):
        raise GraphCaptureError(RMM_GRAPHS)

    torch.cuda.graph.__enter__ = refuse
    torch.cuda.CUDAGraph.capture_begin = refuse
    cudagraph_trees.cudagraphify_impl = refuse
