"""pyg-lib's point-cloud operators (``pyg_lib.ops``: knn, radius, fps, nearest, grid_cluster)
on fullgraph's, with pyg-lib's argument order (items as CSR boundaries ``ptr``):
``from fullgraph.compat import pyg_lib`` in place of ``import pyg_lib``, then
``pyg_lib.ops.knn(x, y, k, ptr_x, ptr_y)``. The same functions back ``torch.ops.pyg`` once
``fullgraph.compat.pyg.install()`` has run; differences as in :mod:`fullgraph.compat.torch_cluster`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

from torch import Tensor

from . import pyg as _pyg


def knn(x: Tensor, y: Tensor, k: int = 1, ptr_x: Optional[Tensor] = None, ptr_y: Optional[Tensor] = None,
        cosine: bool = False, num_workers: int = 1) -> Tensor:
    """For each point of y, its k nearest points of x (of the same item): edge_index [2, E]."""
    return _pyg._pyg_knn(x, y, ptr_x, ptr_y, k, cosine, num_workers)


def radius(x: Tensor, y: Tensor, r: float = 1.0, ptr_x: Optional[Tensor] = None, ptr_y: Optional[Tensor] = None,
           max_num_neighbors: int = 32, num_workers: int = 1, ignore_same_index: bool = False) -> Tensor:
    """For each point of y, the (nearest, at most max_num_neighbors) points of x closer than r."""
    return _pyg._pyg_radius(x, y, ptr_x, ptr_y, r, max_num_neighbors, num_workers, ignore_same_index)


def fps(src: Tensor, ptr: Tensor, ratio: float = 0.5, random_start: bool = True) -> Tensor:
    """Farthest-point sampling, ceil(ratio * n) samples of each item, item after item."""
    return _pyg._pyg_fps(src, ptr, ratio, random_start)


def nearest(x: Tensor, y: Tensor, ptr_x: Optional[Tensor] = None, ptr_y: Optional[Tensor] = None) -> Tensor:
    """For each point of x, the index of its nearest point of y (of the same item)."""
    return _pyg._pyg_nearest(x, y, ptr_x, ptr_y)


def grid_cluster(pos: Tensor, size: Tensor, start: Optional[Tensor] = None, end: Optional[Tensor] = None) -> Tensor:
    """The voxel id of each point of pos [N, D] in a grid of cells ``size`` [D]."""
    return _pyg._pyg_grid_cluster(pos, size, start, end)


ops = SimpleNamespace(knn=knn, radius=radius, fps=fps, nearest=nearest, grid_cluster=grid_cluster)
__all__ = ["fps", "grid_cluster", "knn", "nearest", "ops", "radius"]
