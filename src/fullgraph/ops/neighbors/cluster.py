"""torch_cluster's graph builders, with its names, argument order and keyword names.

``knn_edges(x, y, k, batch_x, batch_y)`` and ``radius_edges(x, y, r, ...)`` are
``torch_cluster.knn`` / ``torch_cluster.radius``: for each point of ``y`` (the queries) its
neighbours in ``x`` (the references), as ``edge_index`` [2, E] = (row into y, column into x).
Mind the order: ``fullgraph.knn(query, ref, k)`` takes the queries first, these take them
second, like torch_cluster; both type-check on [*, 3], so a ported call must keep its order.
``knn_graph`` / ``radius_graph`` build the graph of one cloud with torch_cluster's ``loop``
and ``flow`` conventions.

Differences from torch_cluster: lists hold the *nearest* neighbours (ties to the smaller
index), where torch_cluster's radius keeps the first ``max_num_neighbors`` it finds; edges
come ordered by query, then distance. ``knn_graph`` without loops has its own operator
(``knn_graph_edges``: one cloud, so a backend can skip each point while searching instead of
searching k + 1 - on the Triton grid a 16-wide list instead of a 32-wide one for k = 16).
E depends on the data: each builder is an operator (``torch.ops.fullgraph.knn_edges``,
``knn_graph_edges``, ``radius_edges``) whose fake declares a data-dependent size, so
``torch.compile(fullgraph=True)`` holds without a graph break; they read sizes back to the
host, so they cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from ... import _contract, _validate
from . import api
from .batching import check_batch
from .registration import check_list_width, kernels

Tensor = torch.Tensor
OptionalTensor = torch.Tensor | None
FLOWS = ("source_to_target", "target_to_source")


def _edges(idx: Tensor, queries: int, drop_self: bool) -> Tensor:
    """edge_index [2, E] (query row, neighbour) of the found slots of lists idx [M, k],
    without the edges (i, i) when ``drop_self``: then lists were searched one wider and keep
    at most k - 1 others (the extra slot holds the point itself only when it is among the
    tied nearest)."""
    rows = torch.arange(queries, device=idx.device)[:, None]
    found = idx >= 0
    if drop_self:
        found = found & (idx != rows)
        found = found & (found.cumsum(1) < max(idx.shape[1], 1))
    slots = found.flatten().nonzero().squeeze(1)  # the one host read: E depends on the data
    return torch.stack([slots.div(max(idx.shape[1], 1), rounding_mode="floor"), idx.flatten()[slots]])


def _lists(x, y, k, r, batch_x, batch_y, backend, name="k") -> Tensor:
    """Neighbour lists [len(y), min(k, N)] into x (global rows), kNN when r is None: no
    list holds more than the N points of x, so a larger k (torch_cluster's "no cap") gives
    the same edges."""
    _validate.floating("x", x)
    _validate.rank("x", x, (2,), "[N, D]")
    _validate.floating("y", y)
    _validate.rank("y", y, (2,), "[M, D]")
    k = min(_validate.integer(name, k, minimum=1), max(x.shape[0], 1))
    if (batch_x is None) != (batch_y is None) and x.shape[0] and y.shape[0]:
        raise ValueError("batch_x, batch_y: pass both batch vectors or neither")
    batches = dict(batch_query=batch_y, batch_ref=batch_x) if batch_x is not None else {}
    if r is None:
        return api.knn(y, x, k, backend=backend, **batches)[1]
    return api.radius(y, x, r, k, backend=backend, **batches)[1]


def _fake_edges(*args):
    return args[0].new_empty((2, torch.library.get_ctx().new_dynamic_size()), dtype=torch.int64)


@torch.library.custom_op("fullgraph::knn_edges", mutates_args=())
def _knn_edges(x: Tensor, y: Tensor, k: int, batch_x: OptionalTensor, batch_y: OptionalTensor, drop_self: bool,
               backend: str) -> Tensor:
    return _edges(_lists(x, y, k, None, batch_x, batch_y, backend), y.shape[0], drop_self)


@torch.library.custom_op("fullgraph::radius_edges", mutates_args=())
def _radius_edges(x: Tensor, y: Tensor, r: float, batch_x: OptionalTensor, batch_y: OptionalTensor,
                  max_num_neighbors: int, drop_self: bool, backend: str) -> Tensor:
    lists = _lists(x, y, max_num_neighbors, r, batch_x, batch_y, backend, "max_num_neighbors")
    return _edges(lists, y.shape[0], drop_self)


@torch.library.custom_op("fullgraph::knn_graph_edges", mutates_args=())
def _knn_graph_edges(x: Tensor, k: int, batch: OptionalTensor, backend: str) -> Tensor:
    """knn_graph's edges without loops: (point, neighbour) of each point's k + 1 nearest in
    its item but itself. One cloud, so "itself" is unambiguous and a backend may skip it
    while searching (the Triton grid searches k, not k + 1)."""
    _validate.floating("x", x)
    _validate.rank("x", x, (2,), "[N, D]")
    k = min(_validate.integer("k", k, minimum=1), max(x.shape[0] - 1, 1))  # no point has more than N - 1 others
    if batch is not None:
        check_batch("batch", batch, x)
        points, _, layout, _ = api.batch_vectors(x, x, batch, batch, None, None)
        lengths = layout.lengths
    else:
        points, lengths = x[None], None
    check_list_width("k", k + 1, points.shape[1])
    lists = kernels(backend, "knn", points, x.shape[1], k + 1).nearest_but_self(points.contiguous(), k, lengths)
    lists = layout.global_index(layout.unpad(lists), batch) if batch is not None else lists[0]
    return _edges(lists, x.shape[0], drop_self=False)


_knn_edges.register_fake(_fake_edges)
_knn_graph_edges.register_fake(_fake_edges)
_radius_edges.register_fake(_fake_edges)


def knn_edges(x, y, k, batch_x=None, batch_y=None, *, backend="auto"):
    """``torch_cluster.knn``: for each point of ``y``, its ``k`` nearest points in ``x``.

    Args:
        x: [N, D] the points searched (references). y: [M, D] the queries.
        k: >= 1. batch_x, batch_y: sorted int64 item ids [N] / [M] (both or neither).

    Returns:
        edge_index [2, E] int64: row 0 indexes ``y``, row 1 ``x``; missing neighbours (items
        with fewer than k points) have no edge.
    """
    return torch.ops.fullgraph.knn_edges(x, y, k, batch_x, batch_y, False, backend)


def radius_edges(x, y, r, batch_x=None, batch_y=None, max_num_neighbors=32, *, backend="auto"):
    """``torch_cluster.radius``: for each point of ``y``, the points of ``x`` within ``r``
    (inclusive), at most ``max_num_neighbors`` (the nearest ones). Returns edge_index [2, E]
    (row 0 into ``y``, row 1 into ``x``)."""
    return torch.ops.fullgraph.radius_edges(x, y, r, batch_x, batch_y, max_num_neighbors, False, backend)


def _oriented(edge_index: Tensor, flow: str) -> Tensor:
    """source_to_target: [neighbour, point] (PyG's message direction); else [point, neighbour]."""
    return edge_index.flip(0) if flow == "source_to_target" else edge_index


def _check_graph(count_name: str, count, loop, flow) -> None:
    _validate.integer(count_name, count, minimum=1)
    _validate.choice("flow", flow, FLOWS)
    if not isinstance(loop, bool):
        raise TypeError(f"loop: expected a bool, got {_validate._describe(loop)}")


def _check_knn_graph(x, k, batch=None, loop=False, flow="source_to_target", *, backend="auto") -> None:
    _check_graph("k", k, loop, flow)


def _check_radius_graph(x, r, batch=None, loop=False, max_num_neighbors=32, flow="source_to_target", *,
                        backend="auto") -> None:
    _check_graph("max_num_neighbors", max_num_neighbors, loop, flow)


@_contract.checked(_check_knn_graph)
def knn_graph(x, k, batch=None, loop=False, flow="source_to_target", *, backend="auto"):
    """``torch_cluster.knn_graph``: the k-nearest-neighbour graph of the points x [N, D].

    Without ``loop`` each point's k + 1 nearest are searched and itself dropped (so a point
    with an exact duplicate of smaller index may keep k + 1 others, as in torch_cluster).
    ``flow="source_to_target"`` returns edges (neighbour j, point i), the message-passing
    direction PyG uses; "target_to_source" returns (i, j). Returns edge_index [2, E].
    """
    if loop:
        edges = torch.ops.fullgraph.knn_edges(x, x, k, batch, batch, False, backend)
    else:
        edges = torch.ops.fullgraph.knn_graph_edges(x, k, batch, backend)
    return _oriented(edges, flow)


@_contract.checked(_check_radius_graph)
def radius_graph(x, r, batch=None, loop=False, max_num_neighbors=32, flow="source_to_target", *, backend="auto"):
    """``torch_cluster.radius_graph``: edges between points of x [N, D] within ``r``, at most
    ``max_num_neighbors`` per point (the nearest; without ``loop`` one more is searched and
    the point itself dropped). ``flow`` as in :func:`knn_graph`. Returns edge_index [2, E]."""
    cap = max_num_neighbors if loop else min(max_num_neighbors, _validate.INT64_MAX - 1) + 1
    return _oriented(torch.ops.fullgraph.radius_edges(x, x, r, batch, batch, cap, not loop, backend), flow)
