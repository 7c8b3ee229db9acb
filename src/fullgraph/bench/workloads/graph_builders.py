"""torch_cluster's graph builders on one uniform 3-D cloud: ``knn_graph`` (k = 16) and
``radius_graph`` (r giving about 20 neighbours a point, at most 32), eager and compiled
(``fullgraph=True``; the edge count is data-dependent, so neither can be captured in a CUDA
graph), against the plain PyTorch a user writes without a tree: cdist on blocks of rows,
then topk (radius: distances beyond r set to inf first). At 10^6 points the plain variant
(10^12 distances, seconds a call) is left out; every size checks the edges of SAMPLES
points against it."""

from __future__ import annotations

import math

import torch

from ...ops.neighbors import knn_graph, radius_graph
from .base import Case, Workload, register

PLAIN = "plain cdist + topk, blocked"
BLOCK_BYTES = 1 << 30  # one block of the plain variant's distance matrix
NEIGHBOURS = 20  # radius_graph: the expected neighbours per point (uniform density) give r
SAMPLES = 2000


def _radius(points: int) -> float:
    """r of a ball holding NEIGHBOURS points of a uniform cloud of ``points`` in the unit cube."""
    return (3 * NEIGHBOURS / (4 * math.pi * points)) ** (1 / 3)


def _plain(x: torch.Tensor, k: int, r: float | None, points: torch.Tensor | None = None,
           mode: str = "use_mm_for_euclid_dist_if_necessary") -> torch.Tensor:
    """edge_index [2, E] (neighbour, point) without self loops of ``points`` (default: all),
    as knn_graph / radius_graph build them; ``mode``: cdist's compute_mode (its default
    computes large blocks by matrix products, which can swap near-tied neighbours)."""
    points = torch.arange(x.shape[0], device=x.device) if points is None else points
    rows_per_block = max(1, BLOCK_BYTES // (4 * x.shape[0]))
    edges = []
    for first in range(0, points.shape[0], rows_per_block):
        rows = points[first:first + rows_per_block]
        d = torch.cdist(x[rows], x, compute_mode=mode)
        d[torch.arange(rows.shape[0], device=x.device), rows] = math.inf
        if r is not None:
            d = d.masked_fill(d > r, math.inf)
        dist, idx = d.topk(k, largest=False)
        found = dist.isfinite()
        edges.append(torch.stack([idx[found], rows[:, None].expand_as(idx)[found]]))
    return torch.cat(edges, 1)


def _same_edges(got: torch.Tensor, x: torch.Tensor, k: int, r: float | None) -> dict:
    """Whether the edges into SAMPLES random points are the plain variant's (in any order,
    distances from differences)."""
    generator = torch.Generator().manual_seed(1)
    points = torch.randperm(x.shape[0], generator=generator)[:SAMPLES].to(x.device)
    want = _plain(x, k, r, points, "donot_use_mm_for_euclid_dist")
    got = got[:, torch.isin(got[1], points)]

    def keys(e):
        return (e[1] * e.new_tensor(1 << 32) + e[0]).sort().values
    return {"edges": int(got.shape[1]), "sampled_points": int(points.shape[0]),
            "same_edges_as_plain": got.shape == want.shape and bool(torch.equal(keys(got), keys(want)))}


def _builder(name: str):
    def build(params, device):
        generator = torch.Generator().manual_seed(0)
        x = torch.rand(params["points"], 3, generator=generator).to(device)
        k, r = (16, None) if name == "knn" else (32, _radius(params["points"]))
        if name == "knn":
            def run(x):
                return knn_graph(x, k)
        else:
            def run(x):
                return radius_graph(x, r, max_num_neighbors=k)
        compiled = torch.compile(run, fullgraph=True, dynamic=True)
        plain = [Case(PLAIN, lambda: _plain(x, k, r))] if params["plain"] else []
        return plain + [
            Case(f"fullgraph.{name}_graph", lambda: run(x), check=lambda: _same_edges(run(x), x, k, r)),
            Case(f"fullgraph.{name}_graph, compiled", lambda: compiled(x),
                 check=lambda: _same_edges(compiled(x), x, k, r))]
    return build


for _name in ("knn", "radius"):
    register(Workload(
        name=f"{_name}-graph",
        description=f"torch_cluster's {_name}_graph on a uniform 3-D cloud: fullgraph's grid search against "
                    "blocked cdist + topk",
        sizes={"seed": {"points": 1_000_000, "plain": False}, "small": {"points": 100_000, "plain": True},
               "tiny": {"points": 2000, "plain": True}},
        build=_builder(_name),
        notes=["floor: the grid search (sort the points into cells, ~100 bytes a point) and the edge list "
               "(16 bytes an edge, ~20 edges a point): ~0.4 GB at 1M points, ~0.15 ms at 3 TB/s; the plain "
               "variant evaluates all N^2 distances"],
        baseline=PLAIN,
    ))
