"""PyG's point-cloud pooling functions (``torch_geometric.nn.pool``: knn, knn_graph, radius,
radius_graph, fps, nearest, voxel_grid; ``torch_geometric.nn.unpool.knn_interpolate``) on
fullgraph's operators, with PyG's signatures, defaults and return types; and
:func:`install`, which gives PyG itself fullgraph's operators.

PyG (2.7+) calls pyg-lib's operators ``torch.ops.pyg.knn`` / ``radius`` / ``fps`` /
``nearest`` / ``grid_cluster`` from its pool functions and from models such as
``DynamicEdgeConv``, ``XConv`` and ``GravNetConv``. ``install()`` registers those operators
(pyg-lib's schemas) on fullgraph's, so PyG's models run on them, compile with
``fullgraph=True`` (the operators declare their data-dependent sizes) and need no pyg-lib.
Differences are those of :mod:`fullgraph.compat.torch_cluster` (the nearest neighbours are
kept, ties to the smaller index).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import List, Optional, Union

import torch
from torch import Tensor

from . import torch_cluster as _tc

__all__ = ["fps", "index2ptr", "install", "knn", "knn_graph", "knn_interpolate", "nearest", "radius", "radius_graph",
           "voxel_grid"]

knn = _tc.knn
knn_graph = _tc.knn_graph
nearest = _tc.nearest


def radius(x: Tensor, y: Tensor, r: float, batch_x: Optional[Tensor] = None, batch_y: Optional[Tensor] = None,
           max_num_neighbors: int = 32, num_workers: int = 1, batch_size: Optional[int] = None) -> Tensor:
    """For each point of ``y``, the (at most ``max_num_neighbors`` nearest) points of ``x``
    within ``r``: edge_index [2, E], row 0 into y, row 1 into x."""
    return _tc.radius(x, y, r, batch_x, batch_y, max_num_neighbors, num_workers, batch_size)


def radius_graph(x: Tensor, r: float, batch: Optional[Tensor] = None, loop: bool = False,
                 max_num_neighbors: int = 32, flow: str = "source_to_target", num_workers: int = 1,
                 batch_size: Optional[int] = None) -> Tensor:
    """Edges between points of x within ``r`` (PyG's ``radius_graph``)."""
    return _tc.radius_graph(x, r, batch, loop, max_num_neighbors, flow, num_workers, batch_size)


def fps(x: Tensor, batch: Optional[Tensor] = None, ratio: float = 0.5, random_start: bool = True,
        batch_size: Optional[int] = None) -> Tensor:
    """Farthest-point sampling, ceil(ratio * n) samples per item (PyG's ``fps``)."""
    return _tc.fps(x, batch, float(ratio), random_start, batch_size)


def _per_dim(name: str, value, dim: int, pos: Tensor) -> Tensor:
    tensor = value if isinstance(value, Tensor) else torch.tensor(value, dtype=pos.dtype, device=pos.device)
    tensor = tensor.to(device=pos.device, dtype=pos.dtype).reshape(-1)
    if tensor.numel() not in (1, dim):
        raise ValueError(f"{name}: expected a float or {dim} of them (one per dimension), got {value!r}")
    return tensor.expand(dim)


def voxel_grid(pos: Tensor, size: Union[float, List[float], Tensor], batch: Optional[Tensor] = None,
               start: Optional[Union[float, List[float], Tensor]] = None,
               end: Optional[Union[float, List[float], Tensor]] = None) -> Tensor:
    """The voxel id of each point of pos [N, D] (or [N]) in a grid of edge ``size`` from
    ``start`` to ``end`` (default: the points' extent), the batch item one more coordinate
    of size 1, numbered as PyG does. Integer positions are computed in float64."""
    pos = pos.unsqueeze(-1) if pos.dim() == 1 else pos
    if not pos.is_floating_point():
        pos = pos.to(torch.float64)
    dim = pos.shape[1]
    return torch.ops.fullgraph.voxel_grid(
        pos, _per_dim("size", size, dim, pos), batch,
        None if start is None else _per_dim("start", start, dim, pos),
        None if end is None else _per_dim("end", end, dim, pos))


def knn_interpolate(x: Tensor, pos_x: Tensor, pos_y: Tensor, batch_x: Optional[Tensor] = None,
                    batch_y: Optional[Tensor] = None, k: int = 3, num_workers: int = 1) -> Tensor:
    """Features of x [N, C] at pos_y [M, D]: the inverse-squared-distance weighted mean of the
    k nearest points of pos_x [N, D] (of the same item). Returns [M, C].

    The neighbour lists stay padded [M, k] (no edge list, no scatter); the weights are
    computed without gradient, as PyG does."""
    batches = dict(batch_query=batch_y, batch_ref=batch_x) if batch_x is not None or batch_y is not None else {}
    if batches and (batch_x is None or batch_y is None):
        batch_x, batch_y = _tc._pair(pos_x, pos_y, batch_x, batch_y)
        batches = dict(batch_query=batch_y, batch_ref=batch_x)
    from ..ops.neighbors import api, knn_gather

    with torch.no_grad():
        _, idx = api.knn(pos_y.detach(), pos_x.detach(), k, **batches)
        squared = (knn_gather(pos_x.detach(), idx) - pos_y.detach()[:, None, :]).square().sum(-1)
        weights = torch.where(idx >= 0, 1.0 / squared.clamp(min=1e-16), 0.0)
    weights = weights.to(x.dtype)
    total = (knn_gather(x, idx) * weights[..., None]).sum(1)
    return total / weights.sum(1, keepdim=True)


# pyg-lib's operators, for PyG's own code.

_PYG_OPS = ("knn", "radius", "fps", "nearest", "grid_cluster")


def _batch_of(ptr: Optional[Tensor], rows: int, device) -> Optional[Tensor]:
    if ptr is None:
        return None
    ptr = ptr.to(device=device, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(ptr.numel() - 1, device=device), ptr[1:] - ptr[:-1],
                                   output_size=rows)


_BACKEND = ["auto"]  # the fullgraph backend install() gave PyG's operators, or "torch_cluster"
PEER = "torch_cluster"


def _peer():
    """torch_cluster's own operators (``torch.ops.torch_cluster``), where install() was given PEER."""
    if _BACKEND[0] != PEER:
        return None
    import torch_cluster  # noqa: F401  (registers torch.ops.torch_cluster)

    return torch.ops.torch_cluster


def _whole(ptr: Optional[Tensor], rows: int, device) -> Tensor:
    return torch.tensor([0, rows], device=device) if ptr is None else ptr


def _pyg_knn(x, y, ptr_x=None, ptr_y=None, k=1, cosine=False, num_workers=1):
    peer = _peer()
    if peer is not None:
        return peer.knn(x.contiguous(), y.contiguous(), ptr_x, ptr_y, k, cosine, num_workers)
    return _tc.knn(x, y, k, _batch_of(ptr_x, x.shape[0], x.device), _batch_of(ptr_y, y.shape[0], y.device), cosine,
                   backend=_BACKEND[0])


def _pyg_radius(x, y, ptr_x=None, ptr_y=None, r=1.0, max_num_neighbors=32, num_workers=1, ignore_same_index=False):
    peer = _peer()
    if peer is not None and not ignore_same_index:
        return peer.radius(x.contiguous(), y.contiguous(), ptr_x, ptr_y, r, max_num_neighbors, num_workers)
    return _tc.radius(x, y, r, _batch_of(ptr_x, x.shape[0], x.device), _batch_of(ptr_y, y.shape[0], y.device),
                      max_num_neighbors, 1, None, ignore_same_index, backend=_BACKEND[0])


def _pyg_fps(src, ptr, ratio=0.5, random_start=True):
    peer = _peer()
    if peer is not None:
        return peer.fps(src.contiguous(), ptr, torch.tensor(ratio, dtype=src.dtype, device=src.device), random_start)
    return _tc.fps(src, None, float(ratio), random_start, None, ptr, backend=_BACKEND[0])


def _pyg_nearest(x, y, ptr_x=None, ptr_y=None):
    peer = _peer()
    if peer is not None and x.is_cuda:  # (torch_cluster's nearest operator is CUDA-only)
        return peer.nearest(x.contiguous(), y.contiguous(), _whole(ptr_x, x.shape[0], x.device),
                            _whole(ptr_y, y.shape[0], y.device))
    if peer is not None:
        import torch_cluster

        return torch_cluster.nearest(x, y, _batch_of(ptr_x, x.shape[0], x.device),
                                     _batch_of(ptr_y, y.shape[0], y.device))
    return _tc.nearest(x, y, _batch_of(ptr_x, x.shape[0], x.device), _batch_of(ptr_y, y.shape[0], y.device))


def _pyg_grid_cluster(pos, size, start=None, end=None):
    return _tc.grid_cluster(pos, size, start, end)


def _dynamic_edges(x, *args, **kwargs):
    return x.new_empty((2, torch.library.get_ctx().new_dynamic_size()), dtype=torch.long)


_SCHEMAS = {
    "knn": ("(Tensor x, Tensor y, Tensor? ptr_x=None, Tensor? ptr_y=None, int k=1, bool cosine=False, "
            "int num_workers=1) -> Tensor", _pyg_knn, _dynamic_edges),
    "radius": ("(Tensor x, Tensor y, Tensor? ptr_x=None, Tensor? ptr_y=None, float r=1.0, "
               "int max_num_neighbors=32, int num_workers=1, bool ignore_same_index=False) -> Tensor",
               _pyg_radius, _dynamic_edges),
    "fps": ("(Tensor src, Tensor ptr, float ratio=0.5, bool random_start=True) -> Tensor", _pyg_fps,
            lambda src, *a, **k: src.new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.long)),
    "nearest": ("(Tensor x, Tensor y, Tensor? ptr_x=None, Tensor? ptr_y=None) -> Tensor", _pyg_nearest,
                lambda x, *a, **k: x.new_empty(x.shape[:1], dtype=torch.long)),
    "grid_cluster": ("(Tensor pos, Tensor size, Tensor? start=None, Tensor? end=None) -> Tensor",
                     _pyg_grid_cluster, lambda pos, *a, **k: pos.new_empty(pos.shape[:1], dtype=torch.long)),
}
_LIBRARIES: list = []


@torch.library.custom_op("fullgraph::index2ptr", mutates_args=())
def _index2ptr(index: Tensor) -> Tensor:
    """CSR boundaries [B + 1] of a sorted batch vector, B = max + 1 (PyG's ``index2ptr``)."""
    size = int(index.max()) + 1 if index.numel() > 0 else 0
    # (the conversion reads a strided index as if it were contiguous)
    return torch._convert_indices_from_coo_to_csr(index.contiguous(), size, out_int32=index.dtype != torch.int64)


@_index2ptr.register_fake
def _(index):
    dtype = torch.int64 if index.dtype == torch.int64 else torch.int32
    return index.new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=dtype)


def _batch_to_ptr(batch: Optional[Tensor], batch_size: Optional[int] = None) -> Optional[Tensor]:
    """PyG's pool functions' batch-to-boundaries step, without reading the item count back."""
    return None if batch is None else index2ptr(batch, batch_size)


def index2ptr(index: Tensor, size: Optional[int] = None) -> Tensor:
    """PyG's ``torch_geometric.index.index2ptr``; without ``size`` one operator, whose output
    length compiled code need not know (PyG's reads the item count back as an int)."""
    if size is not None:
        return torch._convert_indices_from_coo_to_csr(index.contiguous(), size, out_int32=index.dtype != torch.int64)
    return torch.ops.fullgraph.index2ptr(index)


def _has_op(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"pyg::{name}", "")
        return True
    except RuntimeError:
        return False


def install(backend: str = "auto") -> list[str]:
    """Give PyG fullgraph's operators (``backend``: the fullgraph backend its knn, radius and
    fps take, "torch" for the plain-PyTorch reference; PEER, "torch_cluster", routes them to
    torch_cluster's own kernels instead, the operators PyG called before 2.7, for comparison):
    define pyg-lib's ``torch.ops.pyg.knn`` / ``radius`` / ``fps`` / ``nearest`` /
    ``grid_cluster`` on them (where pyg-lib is installed, replace its CPU and CUDA kernels) and
    tell ``torch_geometric.typing`` they exist, so that ``torch_geometric.nn``'s pool functions,
    ``knn_interpolate``, ``DynamicEdgeConv``, ``XConv``, ``GravNetConv`` and the models built on
    them run on fullgraph. Idempotent; returns the operators it defined or replaced."""
    if backend == PEER and importlib.util.find_spec("torch_cluster") is None:
        raise ValueError(f"install: backend={PEER!r} needs torch_cluster installed; it is not")
    _BACKEND[0] = backend
    if not _LIBRARIES:
        fresh = torch.library.Library("pyg", "FRAGMENT")
        replaced = torch.library.Library("pyg", "IMPL")
        _LIBRARIES.extend([fresh, replaced])
        for name, (schema, kernel, fake) in _SCHEMAS.items():
            if _has_op(name):
                for key in ("CPU", "CUDA"):
                    replaced.impl(name, kernel, key)
            else:
                fresh.define(name + schema)
                fresh.impl(name, kernel, "CompositeExplicitAutograd")
                torch.library.register_fake(f"pyg::{name}", fake, lib=fresh)
    try:
        import torch_geometric.index
        import torch_geometric.typing as pyg_typing
    except ImportError:
        return list(_PYG_OPS)
    for flag in ("WITH_KNN", "WITH_RADIUS", "WITH_FPS", "WITH_NEAREST", "WITH_GRID_CLUSTER"):
        setattr(pyg_typing, flag, True)
    # PyG's batch-to-boundaries conversion reads the item count back as an int, which
    # compiled code cannot: every module that bound it gets the operator's form.
    original = torch_geometric.index.index2ptr
    if original is not index2ptr:
        for name, module in list(sys.modules.items()):
            if name.startswith("torch_geometric") and getattr(module, "index2ptr", None) is original:
                module.index2ptr = index2ptr
    import torch_geometric.nn.pool as pool

    if hasattr(pool, "_batch_to_ptr"):
        pool._batch_to_ptr = _batch_to_ptr
    return list(_PYG_OPS)
