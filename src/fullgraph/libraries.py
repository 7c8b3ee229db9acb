"""One adapter per external array library: how fullgraph loads it, converts tensors to its
arrays and back without copies, runs it on PyTorch's current stream, and routes its device
allocations through PyTorch's caching allocator.

``extern`` (operators from library functions) and ``memory`` (one pool) both use these
adapters; neither imports the other.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch


def torch_block(nbytes: int, device: int, stream: int | None = None) -> torch.Tensor:
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


@dataclass(frozen=True)
class Library:
    """One array library: where its arrays live, what to install, whether its kernels can be
    captured on PyTorch's stream by default ("safe") or not ("tag")."""

    name: str
    module: str
    device: str  # the torch device type its arrays live on
    package: str  # what to pip install
    cuda_graphs: str

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module.split(".")[0]) is not None

    def load(self):
        try:
            return importlib.import_module(self.module)
        except ImportError as error:
            raise ImportError(f"fullgraph.extern: library={self.name!r} needs {self.module}: "
                              f"pip install {self.package}") from error

    def to_array(self, module, tensor: torch.Tensor):
        return module.from_dlpack(tensor.detach().contiguous())

    def from_array(self, module, value) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        if any(step < 0 for step in getattr(value, "strides", None) or ()):
            # DLPack and torch describe no negative strides (torch.from_dlpack aborts on them).
            if not hasattr(module, "ascontiguousarray"):
                raise ValueError(f"its strides {value.strides} are negative: return a contiguous copy")
            value = module.ascontiguousarray(value)
        if hasattr(value, "__dlpack__"):
            return torch.from_dlpack(value)
        if hasattr(value, "__cuda_array_interface__"):
            return torch.as_tensor(value, device="cuda")
        return torch.as_tensor(value)

    @contextlib.contextmanager
    def on_stream(self, module, device: torch.device):
        """Run the library on PyTorch's current stream of ``device``; yields its handle on it."""
        yield torch.cuda.current_stream(device) if device.type == "cuda" else None

    def route_allocations(self) -> Callable[[], None]:
        """Send the library's device allocations to PyTorch's pool; returns the undo."""
        raise ValueError(f"{self.name}: its allocations cannot be routed through PyTorch's pool")


class _CuPy(Library):
    @contextlib.contextmanager
    def on_stream(self, module, device):
        stream = module.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device.index)
        with module.cuda.Device(device.index), stream:
            yield stream

    def route_allocations(self):
        cupy = self.load()
        previous = cupy.cuda.get_allocator()

        def allocate(nbytes: int):
            device = cupy.cuda.Device().id
            block = torch_block(nbytes, device, cupy.cuda.get_current_stream(device).ptr)
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(block.data_ptr(), nbytes, block, device), 0)

        cupy.cuda.set_allocator(allocate)
        return lambda: cupy.cuda.set_allocator(previous)


class _Numba(Library):
    def load(self):
        module = super().load()
        _numba_numpy_compat()
        return module

    def to_array(self, module, tensor):
        return module.as_cuda_array(tensor.detach().contiguous())

    @contextlib.contextmanager
    def on_stream(self, module, device):
        with module.gpus[device.index]:
            yield module.external_stream(torch.cuda.current_stream(device).cuda_stream)

    def route_allocations(self):
        cuda = self.load()
        from numba.cuda.cudadrv import driver

        class TorchMemoryManager(cuda.GetIpcHandleMixin, cuda.HostOnlyCUDAMemoryManager):
            """Numba's external-memory-manager plugin drawing on PyTorch's caching allocator."""

            def initialize(self):  # abstract in the plugin interface; PyTorch's allocator needs no set-up
                super().initialize()

            def memalloc(self, size):
                block = torch_block(size, self.context.device.id)  # Numba has no allocation stream
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


def _numba_numpy_compat() -> None:
    """numba-cuda <= 0.30.4 registers an overload of ``np.row_stack`` when it compiles its
    first kernel; NumPy 2.5 removed that alias of ``np.vstack``, so no kernel compiles
    (NVIDIA/numba-cuda#907, not to be fixed there). Restore the alias it expects."""
    import numpy

    if not hasattr(numpy, "row_stack"):
        numpy.row_stack = numpy.vstack


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
        block = torch_block(size_in_bytes, device, self.warp.get_stream(f"cuda:{device}").cuda_stream)
        self.blocks[block.data_ptr()] = block
        return block.data_ptr()

    def deallocate(self, ptr: int, size_in_bytes: int) -> None:
        self.blocks.pop(ptr, None)


class _Warp(Library):
    # The allocator routing Warp into PyTorch's pool, while routed (one per process).
    allocator: list = []

    def to_array(self, module, tensor):
        return module.from_torch(tensor.detach().contiguous())

    def from_array(self, module, value):
        if not isinstance(value, module.array):
            return super().from_array(module, value)
        tensor = module.to_torch(value)
        block = self.owning_block(value.ptr) if value.is_contiguous else None
        if block is None:
            return tensor
        return block[: tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)

    @staticmethod
    def owning_block(ptr: int) -> torch.Tensor | None:
        """The PyTorch tensor owning the routed Warp allocation at ``ptr`` (None if not
        routed): Warp arrays handed back to PyTorch become views of it, so PyTorch tracks
        their memory (torch.compile's CUDA graphs must see every block of their pool as a tensor)."""
        return _Warp.allocator[0].blocks.get(ptr) if _Warp.allocator else None

    @contextlib.contextmanager
    def on_stream(self, module, device):
        module.init()
        stream = module.stream_from_torch(torch.cuda.current_stream(device))
        # No sync_enter: waiting on Warp's previous stream would break a capture on PyTorch's.
        with module.ScopedDevice(stream.device), module.ScopedStream(stream, sync_enter=False):
            yield stream

    def route_allocations(self):
        warp = self.load()
        _Warp.allocator[:] = [_WarpTorchAllocator(warp)]
        warp.set_cuda_allocator(_Warp.allocator[0])

        def restore():
            warp.set_cuda_allocator(None)
            _Warp.allocator.clear()

        return restore


class _Jax(Library):
    def to_array(self, module, tensor):
        import jax.dlpack

        # A copy: JAX frees the arrays it imports whenever its own streams are done with them, so
        # a shared tensor would die at a different point on each call, which torch.compile's
        # CUDA graphs (recorded once, replayed after) refuse.
        return jax.dlpack.from_dlpack(tensor.detach().clone(memory_format=torch.contiguous_format))


LIBRARIES: dict[str, Library] = {library.name: library for library in (
    Library("numpy", "numpy", "cpu", "numpy", "safe"),
    _CuPy("cupy", "cupy", "cuda", "cupy-cuda12x (or cupy-cuda13x)", "safe"),
    _Numba("numba", "numba.cuda", "cuda", "numba-cuda", "safe"),
    _Warp("warp", "warp", "cuda", '"fullgraph[warp]" (warp-lang)', "safe"),
    # JAX runs on its own streams: its work cannot join a capture on PyTorch's stream.
    _Jax("jax", "jax", "cuda", '"jax[cuda12]"', "tag"),
)}
