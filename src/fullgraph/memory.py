"""One memory pool for PyTorch and the external libraries.

    with fullgraph.memory.torch_pool():        # CuPy, Numba and Warp allocate from PyTorch
        out = my_cupy_op(x)

``torch_pool`` routes the libraries' device allocations through PyTorch's caching
allocator: memory freed by one library is reused by the others without a cudaFree, the
pool's statistics (``torch.cuda.memory_allocated``) see everything, and allocations made
during a CUDA graph capture come from the graph's private pool, so they are capturable.
It is reversible (close the handle, or leave the ``with`` block), nests, and is
thread-safe. ``use_rmm`` applies the other recipe: every library, PyTorch included, on
one RAPIDS Memory Manager pool (once, before PyTorch touches CUDA).
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from collections.abc import Callable

import torch

from .extern import LIBRARIES

POOLED = ("cupy", "numba", "warp")

_lock = threading.Lock()
_routes: dict[str, list] = {}  # library -> [restore function, nesting count]


def _torch_block(nbytes: int, device: int, stream: int | None = None) -> torch.Tensor:
    """``nbytes`` from PyTorch's pool on ``device``, ordered on the CUDA stream with handle
    ``stream`` (PyTorch's current stream when None, the legacy default stream when 0)."""
    if stream is None:
        ordered_on = torch.cuda.current_stream(device)
    elif stream == 0:
        ordered_on = torch.cuda.default_stream(device)
    else:
        ordered_on = torch.cuda.ExternalStream(stream, device=device)
    with torch.cuda.device(device), torch.cuda.stream(ordered_on):
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=f"cuda:{device}")


def _route_cupy() -> Callable[[], None]:
    cupy = LIBRARIES["cupy"].load()
    previous = cupy.cuda.get_allocator()

    def allocate(nbytes: int):
        device = cupy.cuda.Device().id
        block = _torch_block(nbytes, device, cupy.cuda.get_current_stream(device).ptr)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(block.data_ptr(), nbytes, block, device), 0)

    cupy.cuda.set_allocator(allocate)
    return lambda: cupy.cuda.set_allocator(previous)


def _route_numba() -> Callable[[], None]:
    cuda = LIBRARIES["numba"].load()
    from numba.cuda.cudadrv import driver

    class TorchMemoryManager(cuda.GetIpcHandleMixin, cuda.HostOnlyCUDAMemoryManager):
        """Numba's external-memory-manager plugin drawing on PyTorch's caching allocator."""

        def initialize(self):  # abstract in the plugin interface; PyTorch's allocator needs no set-up
            super().initialize()

        def memalloc(self, size):
            block = _torch_block(size, self.context.device.id)  # Numba has no allocation stream
            address = block.data_ptr()
            nv_binding = getattr(driver, "USE_NV_BINDING", True)  # numba-cuda >= 0.2x: always
            pointer = driver.binding.CUdeviceptr(address) if nv_binding else ctypes.c_uint64(address)
            return cuda.MemoryPointer(self.context, pointer, size, finalizer=lambda: block)

        def get_memory_info(self):
            free, total = torch.cuda.mem_get_info(self.context.device.id)
            return cuda.MemoryInfo(free=free, total=total)

        @property
        def interface_version(self):
            return 1

    previous_class = driver._memory_manager
    context = cuda.current_context()
    previous = context.memory_manager
    cuda.set_memory_manager(TorchMemoryManager)
    context.memory_manager = TorchMemoryManager(context=context)
    context.memory_manager.initialize()

    def restore():
        if previous_class is not None:
            cuda.set_memory_manager(previous_class)
        context.memory_manager = previous

    return restore


class _WarpTorchAllocator:
    """Warp's allocator protocol over PyTorch tensors: each allocation is a uint8 tensor
    from the caching allocator, kept by address until Warp frees it."""

    def __init__(self, warp):
        self.warp = warp
        self.blocks: dict[int, torch.Tensor] = {}

    def allocate(self, size_in_bytes: int) -> int:
        if size_in_bytes == 0:
            return 0
        device = torch.cuda.current_device()  # Warp sets the CUDA context before allocating
        block = _torch_block(size_in_bytes, device, self.warp.get_stream(f"cuda:{device}").cuda_stream)
        self.blocks[block.data_ptr()] = block
        return block.data_ptr()

    def deallocate(self, ptr: int, size_in_bytes: int) -> None:
        self.blocks.pop(ptr, None)


_warp_allocator: _WarpTorchAllocator | None = None


def torch_block(ptr: int) -> torch.Tensor | None:
    """The PyTorch tensor owning the routed Warp allocation at ``ptr`` (None if not routed):
    Warp arrays handed back to PyTorch become views of it, so PyTorch tracks their memory
    (torch.compile's CUDA graphs must see every block of their pool as a tensor)."""
    allocator = _warp_allocator
    return None if allocator is None else allocator.blocks.get(ptr)


def _route_warp() -> Callable[[], None]:
    global _warp_allocator
    warp = LIBRARIES["warp"].load()
    _warp_allocator = _WarpTorchAllocator(warp)
    warp.set_cuda_allocator(_warp_allocator)

    def restore():
        global _warp_allocator
        warp.set_cuda_allocator(None)
        _warp_allocator = None

    return restore


_ROUTERS = {"cupy": _route_cupy, "numba": _route_numba, "warp": _route_warp}


def installed() -> tuple[str, ...]:
    """The libraries of ``POOLED`` that are importable here."""
    return tuple(name for name in POOLED if importlib.util.find_spec(LIBRARIES[name].module.split(".")[0]))


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
                _routes[name] = [_ROUTERS[name](), 1]
    return TorchPool(libraries)


def routed() -> tuple[str, ...]:
    """The libraries whose allocations currently come from PyTorch's pool."""
    with _lock:
        return tuple(_routes)


def use_rmm(pool: bool = True, initial_pool_size: int | None = None) -> None:
    """The document's recipe: PyTorch, CuPy, Numba and Warp all allocate from one RMM pool.

    Call once at start-up, before PyTorch allocates CUDA memory (PyTorch cannot swap its
    allocator afterwards); it cannot be undone. ``initial_pool_size`` in bytes (RMM's
    default when None). Raises RuntimeError without CUDA or after PyTorch allocated,
    ImportError naming the package when RMM is missing.
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
