"""The grid search's headline times on one GPU: kNN 1M x 1M (k = 16, uniform, normal and 64
Gaussian clusters of sigma 0.01 in the unit cube, as ``fullgraph bench knn-sharded``'s),
radius 1M x 1M (cap 32, ~19 within r = 0.0168) and the seed projector's kNN (27,000 grid
queries x 100,000 normal points, k = 7), each replayed from a CUDA graph (the GPU's work
alone), the seed's aggregations (forward) and the radius aggregation's backward (all three
gradients, from the forward's stats and grid as the train step runs it): medians of 20
replays in ms, CUDA events.
``--sweep`` times them over search kernel settings (BLOCK_M, BLOCK_N, warps:
``triton_grid.SEARCH_BLOCKS``; ``SEARCH_SORT_FROM``), ``--cells`` over the grid's
``CELL_POINTS``, ``BUDGET`` and ``FINER`` (FINER 1: one cell a bucket, the grid before
sparse cells), ``--radius`` the radius search over ``RADIUS_SEARCH_CELL_POINTS`` and
``RADIUS_SEARCH_BLOCKS``, ``--grad`` the radius aggregation's backward over
``triton_grid.GRAD_BLOCKS``, ``--shells`` the normal cloud's kNN by shells of the queries'
|q| (in sigmas; each shell alone against all references, so each gets cells sized for its own
density) and its farthest queries alone.

    python benchmarks/search_times.py [--sweep | --cells | --radius | --grad | --shells] > search.log     (needs a CUDA device)
"""

from __future__ import annotations

import sys

import torch
from replay_profile import graphed_ms

import fullgraph
from fullgraph.ops.neighbors.triton import grid as cell_grid
from fullgraph.ops.neighbors.triton import backend as triton_grid

SWEEP = [((2, 32, 1), 3), ((2, 32, 1), 2), ((2, 32, 1), 6), ((4, 32, 1), 3), ((4, 32, 2), 3), ((8, 32, 2), 3),
         ((2, 64, 1), 3), ((4, 64, 2), 3), ((1, 32, 1), 3)]  # (SEARCH_BLOCKS, SEARCH_SORT_FROM), radius too
GRAD = [((16, 32), (32, 16), 2), ((16, 32), (64, 32), 4), ((16, 16), (32, 16), 2), ((32, 32), (32, 16), 2),
        ((16, 64), (32, 16), 2), ((32, 16), (32, 16), 2), ((16, 32), (16, 16), 2), ((16, 32), (32, 8), 2),
        ((16, 32), (32, 16), 1), ((16, 32), (16, 16), 1), ((8, 32), (32, 16), 2), ((16, 32), (16, 32), 2)]
RADIUS = [(points, blocks) for points in (8, 10, 12, 16, 24) for blocks in ((1, 32, 1), (1, 64, 1), (1, 64, 2))]
# (CELL_POINTS, BUDGET, FINER)
CELLS = [(8, 32, 64), (6, 32, 64), (10, 32, 64), (12, 32, 64), (16, 32, 64), (8, 64, 64), (8, 32, 16)]


def radius_backward(query, ref, features, radius, sigma):
    """A call of the radius aggregation's backward for the three gradients, as the train
    step's (from the forward's stats and saved grid), on [1, M, 3] / [1, N, 3] / [1, N, C]."""
    out, stats, saved = triton_grid.radius_aggregate(query, ref, features, radius, sigma, None, None)
    grad_out = torch.randn_like(out)
    return lambda: triton_grid.radius_aggregate_backward(grad_out, query, ref, features, out, radius, sigma, None, None,
                                                         stats=stats, saved_grid=saved)


SHELLS = ((0, 1), (1, 1.5), (1.5, 2), (2, 2.5), (2.5, 3), (3, 3.5), (3.5, 10))


def by_shells(normal: torch.Tensor, k: int = 16) -> None:
    """kNN of subsets of ``normal``'s points against all of it: by shell of |q|, then the farthest."""
    size = normal.norm(dim=1)
    for low, high in SHELLS:
        query = normal[(size >= low) & (size < high)].contiguous()
        ms = graphed_ms(lambda: fullgraph.knn(query, normal, k))
        print(f"shell {low}-{high} sigma: {query.shape[0]} queries {ms:.3f} ms", flush=True)
    order = size.argsort(descending=True)
    for count in (100, 1000, 10000, 100000):
        query = normal[order[:count]].contiguous()
        print(f"farthest {count} (beyond {size[order[count - 1]].item():.2f} sigma): "
              f"{graphed_ms(lambda: fullgraph.knn(query, normal, k)):.3f} ms", flush=True)


def main(sweep: bool = False, cells: bool = False, grad: bool = False, radius: bool = False,
         shells: bool = False) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    uniform = torch.rand(1_000_000, 3, device="cuda", generator=generator)
    normal = torch.randn(1_000_000, 3, device="cuda", generator=generator)
    centres = torch.rand(64, 3, device="cuda", generator=generator)
    clustered = centres[torch.randint(64, (1_000_000,), device="cuda", generator=generator)] + 0.01 * torch.randn(
        1_000_000, 3, device="cuda", generator=generator)
    axis = torch.linspace(-1, 1, 30, device="cuda")
    grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
    cloud = torch.randn(100_000, 3, device="cuda", generator=generator)
    features = torch.randn(100_000, 25, device="cuda", generator=generator)
    small_cloud, small_features = cloud[:25_000], features[:25_000]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: graphed medians, ms")
    rows = [("knn 1M x 1M uniform, k = 16", lambda: fullgraph.knn(uniform, uniform, 16)),
            ("knn 1M x 1M normal, k = 16", lambda: fullgraph.knn(normal, normal, 16)),
            ("knn 1M x 1M clustered, k = 16", lambda: fullgraph.knn(clustered, clustered, 16)),
            ("radius 1M x 1M uniform, r = 0.0168, cap 32", lambda: fullgraph.radius(uniform, uniform, 0.0168, 32)),
            ("knn seed: 27,000 grid x 100,000 normal, k = 7", lambda: fullgraph.knn(grid, cloud, 7)),
            ("knn_aggregate seed", lambda: fullgraph.knn_aggregate(grid, cloud, features, 7, sigma=0.1)),
            ("radius_aggregate seed (25,000 points, r = 0.1)",
             lambda: fullgraph.radius_aggregate(grid, small_cloud, small_features, 0.1, sigma=0.1)),
            ("radius_aggregate seed backward", radius_backward(grid[None], small_cloud[None], small_features[None],
                                                               0.1, 0.1))]
    if shells:
        print(f"{rows[1][0]} {graphed_ms(rows[1][1]):.3f}")
        by_shells(normal)
        return
    if radius:
        for triton_grid.RADIUS_SEARCH_CELL_POINTS, triton_grid.RADIUS_SEARCH_BLOCKS in RADIUS:
            print(f"RADIUS_SEARCH_CELL_POINTS {triton_grid.RADIUS_SEARCH_CELL_POINTS}, RADIUS_SEARCH_BLOCKS "
                  f"{triton_grid.RADIUS_SEARCH_BLOCKS}: {rows[3][0]} {graphed_ms(rows[3][1]):.3f}", flush=True)
        return
    if grad:
        for triton_grid.GRAD_BLOCKS in GRAD:
            print(f"GRAD_BLOCKS {triton_grid.GRAD_BLOCKS}: {rows[-1][0]} {graphed_ms(rows[-1][1], runs=50):.3f}",
                  flush=True)
        return
    if cells:
        for cell_grid.CELL_POINTS, cell_grid.BUDGET, cell_grid.FINER in CELLS:
            print(f"CELL_POINTS {cell_grid.CELL_POINTS}, BUDGET {cell_grid.BUDGET}, FINER {cell_grid.FINER}: "
                  + "; ".join(f"{name} {graphed_ms(call):.3f}" for name, call in rows[:-1]), flush=True)
        return  # (not the backward: its saved grid's size is the default BUDGET's)
    if not sweep:
        print("; ".join(f"{name} {graphed_ms(call):.3f}" for name, call in rows))
    for blocks, sort_from in SWEEP if sweep else ():
        triton_grid.SEARCH_BLOCKS, triton_grid.SEARCH_SORT_FROM = blocks, sort_from
        triton_grid.RADIUS_SEARCH_BLOCKS = blocks
        print(f"SEARCH_BLOCKS (and radius) {blocks}, SEARCH_SORT_FROM {sort_from}: "
              + "; ".join(f"{name} {graphed_ms(call):.3f}" for name, call in rows), flush=True)


if __name__ == "__main__":
    main(**{flag: f"--{flag}" in sys.argv for flag in ("sweep", "cells", "grad", "radius", "shells")})
