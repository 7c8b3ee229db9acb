"""The neighbour operators alone on a GPU: search and the seed's aggregations, each as
called (host overhead included) and replayed from a CUDA graph (the GPU's work alone).

Search rows carry how many of 2,000 sampled queries get other neighbour lists than the
"torch" reference (must be 0). Floors: the grid search reads the points a few times (keys,
sort, gather: ~100 bytes per point) and evaluates about 27 * CELL_POINTS candidates per
query plus insertions; a brute-force search would evaluate M*N distances.
"""

from __future__ import annotations

import torch

from ... import ops  # noqa: F401  (registers torch.ops.fullgraph)
from ...ops.neighbors import knn, knn_aggregate, radius, radius_aggregate
from .base import Case, Workload, register, replayed, seed_point_clouds

SAMPLES = 2000


def _cloud(kind: str, count: int, generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(count, 3, generator=generator, device=generator.device)
    return torch.rand(count, 3, generator=generator, device=generator.device)


def _mismatches(call, op, query, ref, k, r, generator) -> dict:
    """Sampled queries whose neighbour lists differ from the torch reference's."""
    rows = torch.randint(0, query.shape[0], (SAMPLES,), generator=generator, device=query.device)
    result = call()
    if op == "knn":
        want = knn(query[rows], ref, k, backend="torch")[1]
    else:
        want = radius(query[rows], ref, r, k, backend="torch")[1]
    fields = {"mismatched_sampled_queries": int((result[1][rows] != want).any(-1).sum())}
    if op == "radius":
        fields["mean_neighbors_within_radius"] = float(result[2].float().mean())
    return fields


def _search_cases(searches, generator):
    for op, kind, m, n, k, r in searches:
        query, ref = _cloud(kind, m, generator), _cloud(kind, n, generator)
        if op == "knn":
            call = lambda query=query, ref=ref, k=k: knn(query, ref, k)  # noqa: E731
        else:
            call = lambda query=query, ref=ref, r=r, k=k: radius(query, ref, r, k)  # noqa: E731
        label = f"{op} {kind} {m}x{n} k={k}" + (f" r={r}" if r else "")
        check = lambda call=call, op=op, query=query, ref=ref, k=k, r=r: _mismatches(  # noqa: E731
            call, op, query, ref, k, r, generator)
        yield Case(f"{label}, as called", call, check=check)
        yield Case(f"{label}, graphed", replayed(call, query.device))


def _aggregate_cases(device):
    """The seed's aggregations (grid queries, normal cloud, 25 channels): forward and train."""
    for aggregate, cloud_size, param in ((knn_aggregate, 100_000, 7), (radius_aggregate, 25_000, 0.1)):
        cloud, grid, _ = seed_point_clouds(cloud_size, 30, 1, device)
        features = torch.randn(cloud_size, 25, device=device)
        inputs = [t.clone().requires_grad_(True) for t in (grid, cloud, features)]

        def forward(aggregate=aggregate, param=param):
            return aggregate(grid, cloud, features, param, sigma=0.1)

        def train(aggregate=aggregate, inputs=inputs, param=param):
            out = aggregate(*inputs, param, sigma=0.1)
            return torch.autograd.grad(out.square().sum(), inputs)

        label = f"{aggregate.__name__} seed {grid.shape[0]}x{cloud_size}"
        yield Case(f"{label}, as called", forward, train)
        yield Case(f"{label}, graphed", replayed(forward, device), replayed(train, device))


def _neighbor_ops(params, device):
    if device.type != "cuda":
        raise ValueError("neighbor-ops times the GPU kernels: run it with --device cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    return [*_search_cases(params["searches"], generator), *_aggregate_cases(device)]


_SEED_SEARCHES = [("knn", "normal", 27_000, 100_000, 7, None), ("radius", "uniform", 27_000, 100_000, 32, 0.0362)]
register(Workload(
    name="neighbor-ops",
    description="the neighbour operators alone (default backend), as called and replayed from a CUDA graph",
    sizes={"seed": {"searches": _SEED_SEARCHES},
           "large": {"searches": _SEED_SEARCHES + [("knn", kind, 1_000_000, 1_000_000, 16, None)
                                                   for kind in ("normal", "uniform")]
                     + [("radius", "uniform", 1_000_000, 1_000_000, 32, 0.0168)]}},
    build=_neighbor_ops,
))
