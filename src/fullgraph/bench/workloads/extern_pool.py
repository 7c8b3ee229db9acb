"""fullgraph.memory: extern ops that allocate in their own library (CuPy, Warp), with and
without PyTorch's pool, and inside a CUDA graph."""

from __future__ import annotations

import functools
import importlib.util

import torch

from ... import extern, graphs, memory
from .base import Case, Workload, outside_torch_pool, register


@functools.cache
def allocating_ops():
    """Two extern ops that allocate their result in their own library, as user code does:
    a CuPy softplus and a Warp soft clip (the README's example kernel)."""
    spec = lambda x: [(x.shape, x.dtype)]  # noqa: E731

    @extern.op("fullgraph_bench::cupy_softplus", "(Tensor x) -> Tensor", outputs=spec, library="cupy")
    def cupy_softplus(x):
        import cupy

        return cupy.logaddexp(x, 0)

    @extern.op("fullgraph_bench::warp_soft_clip", "(Tensor x) -> Tensor", outputs=spec, library="warp")
    def warp_soft_clip(x):
        import warp as wp

        y = wp.empty_like(x)
        wp.launch(_warp_soft_clip_kernel(), dim=x.shape, inputs=[x, 2.0], outputs=[y])
        return y

    return {"cupy": cupy_softplus, "warp": warp_soft_clip}


@functools.cache
def _warp_soft_clip_kernel():
    import warp as wp

    @wp.kernel
    def soft_clip(x: wp.array(dtype=float), scale: float, y: wp.array(dtype=float)):
        i = wp.tid()
        y[i] = scale * wp.tanh(x[i] / scale)

    return soft_clip


def _library_pool(library: str, device: torch.device) -> dict:
    """Bytes the library's own pool holds after the run (memory PyTorch cannot reuse),
    and the device memory outside PyTorch's pool."""
    torch.cuda.synchronize(device)
    if library == "cupy":
        import cupy

        held = cupy.get_default_memory_pool().total_bytes()
    else:
        import warp

        held = warp.get_mempool_used_mem_current(f"cuda:{device.index or 0}")
    return {"library_pool_bytes": held, **outside_torch_pool(device)}


def _extern_pool(params, device):
    """Per library: its own allocator, PyTorch's pool (fullgraph.memory.torch_pool), and
    PyTorch's pool inside a CUDA graph (capturable only then)."""
    if device.type != "cuda":
        raise ValueError("extern-pool measures GPU memory pools: run it with --device cuda")
    x = torch.randn(params["n"], device=device)
    cases = []
    for library, extern_op in allocating_ops().items():
        if importlib.util.find_spec(library) is None:
            continue

        def own(extern_op=extern_op):
            return extern_op(x)

        def pooled(extern_op=extern_op, library=library):
            with memory.torch_pool(library):
                return extern_op(x)

        def graphed_pooled(replay=graphs.graphed(extern_op), library=library):
            with memory.torch_pool(library):  # the capture (first call) and the replays
                return replay(x)

        check = functools.partial(_library_pool, library, device)
        cases += [Case(f"{library}, own allocator", own, check=check),
                  Case(f"{library}, torch pool", pooled, check=check),
                  Case(f"{library}, torch pool, CUDA graph", graphed_pooled, check=check)]
    return cases


register(Workload(
    name="extern-pool",
    description="fullgraph.memory: extern ops that allocate in CuPy / Warp, with and without PyTorch's pool",
    sizes={"seed": {"n": 2**24}, "small": {"n": 2**20}, "tiny": {"n": 2**12}},
    build=_extern_pool,
))
