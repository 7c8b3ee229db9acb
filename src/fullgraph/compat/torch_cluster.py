"""torch_cluster's functions on fullgraph's operators: ``from fullgraph.compat.torch_cluster
import knn, radius_graph, ...`` in place of ``from torch_cluster import ...``.

Same signatures, defaults and return types, and like torch_cluster's they compile with
``torch.jit.script``. Differences (each follows torch_cluster's own tests):

- radius keeps points closer than ``r`` (d < r, as torch_cluster and pyg-lib; fullgraph's own
  operators include d = r).
- lists hold the *nearest* neighbours (ties to the smaller index); torch_cluster's radius
  keeps ``max_num_neighbors`` picked in search order. Without ``loop`` a point has at most
  ``k`` / ``max_num_neighbors`` others (torch_cluster 1.6.3 may return one more).
- a batch vector given for one side only puts every point of the other side in item 0
  (torch_cluster asserts when the items number more than one).
- ``num_workers`` and ``batch_size`` are accepted and not needed (the backends pick their
  threads; item counts come from the batch vectors).
- ``fps`` never samples a point with a non-finite coordinate.
"""

from typing import List, Optional, Union

import torch
from torch import Tensor


__all__ = ["fps", "grid_cluster", "knn", "knn_graph", "nearest", "radius", "radius_graph"]

def _as_2d(x: Tensor) -> Tensor:
    return x.view(-1, 1) if x.dim() == 1 else x


def _pair(x: Tensor, y: Tensor, batch_x: Optional[Tensor], batch_y: Optional[Tensor]):
    """Both batch vectors or neither: a missing one puts its side in item 0."""
    if batch_x is not None and batch_y is None:
        batch_y = torch.zeros(y.shape[0], dtype=torch.long, device=y.device)
    if batch_y is not None and batch_x is None:
        batch_x = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    return batch_x, batch_y


def _check_flow(flow: str):
    if flow != "source_to_target" and flow != "target_to_source":
        raise ValueError("flow: expected 'source_to_target' or 'target_to_source', got '{}'".format(flow))


def _empty(x: Tensor) -> Tensor:
    return torch.empty((2, 0), dtype=torch.long, device=x.device)


def knn(x: Tensor, y: Tensor, k: int, batch_x: Optional[Tensor] = None, batch_y: Optional[Tensor] = None,
        cosine: bool = False, num_workers: int = 1, batch_size: Optional[int] = None, backend: str = "auto") -> Tensor:
    """For each point of ``y`` [M, F], its ``k`` nearest points in ``x`` [N, F] (cosine
    distance with ``cosine``). Returns edge_index [2, E] int64: row 0 into y, row 1 into x.
    ``backend``: fullgraph's (see ``fullgraph.knn``; not a torch_cluster argument)."""
    if x.numel() == 0 or y.numel() == 0:
        return _empty(x)
    x, y = _as_2d(x), _as_2d(y)
    if cosine:  # on unit vectors the Euclidean order is the cosine order
        x = torch.nn.functional.normalize(x, dim=-1)
        y = torch.nn.functional.normalize(y, dim=-1)
    batch_x, batch_y = _pair(x, y, batch_x, batch_y)
    return torch.ops.fullgraph.knn_edges(x, y, k, batch_x, batch_y, False, backend)


def knn_graph(x: Tensor, k: int, batch: Optional[Tensor] = None, loop: bool = False,
              flow: str = "source_to_target", cosine: bool = False, num_workers: int = 1,
              batch_size: Optional[int] = None) -> Tensor:
    """The graph of each point's ``k`` nearest points of x [N, F] (itself too with
    ``loop``). ``flow="source_to_target"``: edges (neighbour, point)."""
    _check_flow(flow)
    if x.numel() == 0:
        return _empty(x)
    x = _as_2d(x)
    if cosine:
        x = torch.nn.functional.normalize(x, dim=-1)
    if loop:
        edges = torch.ops.fullgraph.knn_edges(x, x, k, batch, batch, False, "auto")
    else:
        edges = torch.ops.fullgraph.knn_graph_edges(x, k, batch, "auto")
    return edges.flip(0) if flow == "source_to_target" else edges


def radius(x: Tensor, y: Tensor, r: float, batch_x: Optional[Tensor] = None, batch_y: Optional[Tensor] = None,
           max_num_neighbors: int = 32, num_workers: int = 1, batch_size: Optional[int] = None,
           ignore_same_index: bool = False, backend: str = "auto") -> Tensor:
    """For each point of ``y``, the (at most ``max_num_neighbors`` nearest) points of ``x``
    closer than ``r``; ``ignore_same_index`` leaves out x[i] for y[i]. Returns
    edge_index [2, E]: row 0 into y, row 1 into x."""
    if x.numel() == 0 or y.numel() == 0:
        return _empty(x)
    x, y = _as_2d(x), _as_2d(y)
    batch_x, batch_y = _pair(x, y, batch_x, batch_y)
    cap = max_num_neighbors + 1 if ignore_same_index and max_num_neighbors > 0 else max_num_neighbors
    edges = torch.ops.fullgraph.radius_edges(x, y, float(r), batch_x, batch_y, cap, ignore_same_index, backend)
    # The peers' rule is d < r (fullgraph's, d <= r): the lists hold the nearest first, so
    # leaving out the points at exactly r keeps every nearer one.
    gap = (x[edges[1]].to(torch.float64) - y[edges[0]].to(torch.float64)).square().sum(-1)
    return edges[:, gap < float(r) * float(r)]


def radius_graph(x: Tensor, r: float, batch: Optional[Tensor] = None, loop: bool = False,
                 max_num_neighbors: int = 32, flow: str = "source_to_target", num_workers: int = 1,
                 batch_size: Optional[int] = None) -> Tensor:
    """Edges between points of x [N, F] within ``r``, at most ``max_num_neighbors`` per
    point besides itself. ``flow`` as in :func:`knn_graph`."""
    _check_flow(flow)
    edges = radius(x, x, r, batch, batch, max_num_neighbors, num_workers, batch_size, not loop)
    return edges.flip(0) if flow == "source_to_target" else edges


def _ratio(src: Tensor, ratio: Optional[Union[Tensor, float]]) -> Tensor:
    if ratio is None:
        r = torch.tensor(0.5, dtype=src.dtype, device=src.device)
    elif isinstance(ratio, float):
        r = torch.tensor(ratio, dtype=src.dtype, device=src.device)
    else:
        r = ratio.to(src.device)
    if not r.is_floating_point():
        raise TypeError("ratio: expected a float or a floating tensor, got a {} tensor".format(r.dtype))
    return r


def fps(src: Tensor, batch: Optional[Tensor] = None, ratio: Optional[Union[Tensor, float]] = None,
        random_start: bool = True, batch_size: Optional[int] = None,
        ptr: Optional[Union[Tensor, List[int]]] = None, backend: str = "auto") -> Tensor:
    """Farthest-point sampling: ceil(ratio * n) samples of each item (``ratio`` a float, a
    0-d tensor or one value per item; default 0.5; computed in src's dtype, as torch_cluster
    does), items given by a sorted ``batch`` vector or by CSR boundaries ``ptr``. Returns the
    1-D int64 indices into src, item after item; the first sample is random with
    ``random_start``, else the item's first."""
    src = _as_2d(src)
    r = _ratio(src, ratio)
    bounds: Optional[Tensor] = None
    if ptr is not None:
        if isinstance(ptr, Tensor):
            bounds = ptr
        else:
            bounds = torch.tensor(ptr, dtype=torch.long, device=src.device)
        batch = None
    draw: Optional[Tensor] = None
    if random_start:
        draw = torch.rand(src.shape[0], device=src.device)
    return torch.ops.fullgraph.fps_flat(src, batch, bounds, r, None, draw, backend)


def nearest(x: Tensor, y: Tensor, batch_x: Optional[Tensor] = None, batch_y: Optional[Tensor] = None) -> Tensor:
    """For each point of x [N, F], the index of its nearest point in y [M, F] (of the same
    item). Raises ValueError for unsorted batch vectors or items present on one side only."""
    x, y = _as_2d(x), _as_2d(y)
    batch_x, batch_y = _pair(x, y, batch_x, batch_y)
    return torch.ops.fullgraph.nearest(x, y, batch_x, batch_y)


@torch.library.custom_op("fullgraph::nearest", mutates_args=())
def _nearest(x: Tensor, y: Tensor, batch_x: Optional[Tensor], batch_y: Optional[Tensor]) -> Tensor:
    """[N] int64: the nearest point of y of the same item for each point of x."""
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"y: expected {x.shape[1]} features like x, got {y.shape[1]}")
    for name, batch in (("batch_x", batch_x), ("batch_y", batch_y)):
        if batch is not None and bool((batch[1:] < batch[:-1]).any()):
            raise ValueError(f"'{name}' is not sorted")
    if batch_x is not None and batch_y is not None:
        if not torch.equal(_items(batch_x), _items(batch_y)):
            raise ValueError("Some batch indices occur in 'batch_x' that do not occur in 'batch_y'")
    if x.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=x.device)
    if y.shape[0] == 0:
        raise ValueError("y: expected at least one point to be nearest to, got none")
    return torch.ops.fullgraph.knn_flat(x, y, 1, batch_x, batch_y, "auto")[1][:, 0].clone()


@_nearest.register_fake
def _(x, y, batch_x, batch_y):
    return x.new_empty(x.shape[:1], dtype=torch.long)


def _items(batch: Tensor) -> Tensor:
    """The distinct ids of a sorted batch vector."""
    first = torch.ones(batch.shape[:1], dtype=torch.bool, device=batch.device)
    first[1:] = batch[1:] != batch[:-1]
    return batch[first]


def grid_cluster(pos: Tensor, size: Tensor, start: Optional[Tensor] = None, end: Optional[Tensor] = None) -> Tensor:
    """The voxel of each point of pos [N, D] (or [N]) in a grid of cells ``size`` [D] from
    ``start`` to ``end`` (default: the points' minimum and maximum), numbered as
    torch_cluster does. Integer coordinates are computed in float64 (exact below 2**53)."""
    pos = _as_2d(pos)
    dtype = pos.dtype if pos.is_floating_point() else torch.float64
    size = size.to(dtype).reshape(-1).expand(pos.shape[1])
    if start is not None:
        start = start.to(dtype).reshape(-1).expand(pos.shape[1])
    if end is not None:
        end = end.to(dtype).reshape(-1).expand(pos.shape[1])
    return torch.ops.fullgraph.voxel_grid(pos.to(dtype), size, None, start, end)
