"""The neighbour operators alone on a GPU: search and the seed's aggregations, each as
called (host overhead included) and replayed from a CUDA graph (the GPU's work alone).

Search rows carry how many of 2,000 sampled queries get other neighbour lists than the
"torch" reference (must be 0). Floors: the grid search reads the points a few times (keys,
sort, gather: ~100 bytes per point) and evaluates about 27 * CELL_POINTS candidates per
query plus insertions; a brute-force search would evaluate M*N distances.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

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


def _cuvs_brute_force(query, ref, k):
    """cuVS's brute-force kNN as a user calls it, one batch item at a time (its index built
    from each item's references, then searched; it synchronizes before returning)."""
    from cuvs.neighbors import brute_force

    found = [brute_force.search(brute_force.build(r, metric="sqeuclidean"), q, k) for q, r in zip(query, ref)]
    return torch.stack([torch.as_tensor(neighbors, device=query.device) for _, neighbors in found])


def _feature_cases(shapes, generator, device):
    """kNN in feature space (D >= 4): cdist + topk (what users write), "auto", "dense", and
    the search dense competes with for "auto" ("triton" on CUDA, the k-d tree "cpu" on CPUs);
    where cuVS is installed, its brute force as called (RAPIDS; what cuML's NearestNeighbors runs)."""
    rival = "triton" if device.type == "cuda" else "cpu"
    for batch, m, n, dim, k in shapes:
        query = torch.randn(batch, m, dim, generator=generator, device=device)
        ref = torch.randn(batch, n, dim, generator=generator, device=device)
        label = f"knn B={batch} {m}x{n} D={dim} k={k}"
        plain = lambda query=query, ref=ref, k=k: torch.topk(torch.cdist(query, ref), k, largest=False)  # noqa: E731
        auto = lambda query=query, ref=ref, k=k: knn(query, ref, k)  # noqa: E731
        by_products = lambda query=query, ref=ref, k=k: knn(query, ref, k, backend="dense")  # noqa: E731
        rows = torch.randint(0, m, (min(m, SAMPLES),), generator=generator, device=device)

        def check(call=by_products, query=query, ref=ref, k=k, rows=rows):
            want = knn(query[:, rows], ref, k, backend="torch")[1]
            return {"mismatched_sampled_queries": int((call()[1][:, rows] != want).any(-1).sum())}

        yield Case(f"{label}: cdist + topk, as called", plain)
        yield Case(f"{label}: fullgraph auto, as called", auto)
        yield Case(f"{label}: fullgraph dense, as called", by_products, check=check)
        yield Case(f"{label}: fullgraph {rival}, as called",
                   lambda query=query, ref=ref, k=k: knn(query, ref, k, backend=rival))
        if device.type == "cuda" and importlib.util.find_spec("cuvs") is not None:  # the peer (issue 14)
            peer = lambda query=query, ref=ref, k=k: (None, _cuvs_brute_force(query, ref, k))  # noqa: E731
            yield Case(f"{label}: cuVS brute force, as called", peer, check=functools.partial(check, peer))
        if device.type == "cuda":
            yield Case(f"{label}: cdist + topk, graphed", replayed(plain, device))
            yield Case(f"{label}: fullgraph auto, graphed", replayed(auto, device))


def _neighbor_ops(params, device):
    generator = torch.Generator(device=device).manual_seed(0)
    if "features" in params:
        return list(_feature_cases(params["features"], generator, device))
    if device.type != "cuda":
        raise ValueError("neighbor-ops times the GPU kernels: run it with --device cuda (or --size small or feature-small)")
    return [*_search_cases(params["searches"], generator), *_aggregate_cases(device)]


_SEED_SEARCHES = [("knn", "normal", 27_000, 100_000, 7, None), ("radius", "uniform", 27_000, 100_000, 32, 0.0362)]
register(Workload(
    name="neighbor-ops",
    description="the neighbour operators alone, as called and replayed from a CUDA graph; feature sizes: kNN "
                "in D >= 4 beside cdist + topk",
    sizes={"seed": {"searches": _SEED_SEARCHES},
           "large": {"searches": _SEED_SEARCHES + [("knn", kind, 1_000_000, 1_000_000, 16, None)
                                                   for kind in ("normal", "uniform")]
                     + [("radius", "uniform", 1_000_000, 1_000_000, 32, 0.0168)]},
           # feature space: the shapes of DGCNN's EdgeConv, retrieval and kNN losses
           "feature": {"features": [(8, 4096, 4096, 64, 20), (32, 1024, 1024, 64, 20), (1, 20_000, 200_000, 16, 10),
                                    (1, 10_000, 1_000_000, 128, 10)]},
           "feature-small": {"features": [(8, 2048, 2048, 64, 20), (1, 5000, 50_000, 16, 10),
                                          (1, 2000, 100_000, 128, 10)]},
           # what a CPU runs by default: feature-space kNN at sizes of seconds there
           "small": {"features": [(2, 1024, 1024, 32, 8), (1, 2000, 20_000, 16, 10)]},
           # where "auto" should take dense over the search (ops/neighbors/dense/backend.py cites it)
           "crossover": {"features": [(8, 4096, 4096, 64, 20), (32, 1024, 1024, 64, 20), (8, 4096, 4096, 32, 20),
                                      (8, 4096, 4096, 16, 20), (8, 4096, 4096, 8, 20), (16, 256, 256, 64, 20),
                                      (1, 64, 1000, 32, 8), (4, 4096, 4096, 32, 64), (1, 20_000, 200_000, 16, 10),
                                      (1, 20_000, 200_000, 32, 10), (1, 10_000, 1_000_000, 128, 10)]}},
    build=_neighbor_ops,
))
