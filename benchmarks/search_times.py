"""The grid search's headline times on one GPU: kNN 1M x 1M (k = 16, uniform, normal and 64
Gaussian clusters of sigma 0.01 in the unit cube, as ``fullgraph bench knn-sharded``'s),
radius 1M x 1M (cap 32, ~19 within r = 0.0168) and the seed projector's kNN (27,000 grid
queries x 100,000 normal points, k = 7), each replayed from a CUDA graph (the GPU's work
alone), and the seed's aggregations (forward): medians of 20 replays in ms, CUDA events.
``--sweep`` times them over search kernel settings (BLOCK_M, BLOCK_N, warps:
``triton_grid.SEARCH_BLOCKS``; ``SEARCH_SORT_FROM``), ``--cells`` over the grid's
``CELL_POINTS``, ``BUDGET`` and ``FINER`` (FINER 1: one cell a bucket, the grid before
sparse cells).

    python benchmarks/search_times.py [--sweep | --cells] > search.log     (needs a CUDA device)
"""

from __future__ import annotations

import sys

import torch
from replay_profile import graphed_ms

import fullgraph
from fullgraph.ops.neighbors import grid as cell_grid
from fullgraph.ops.neighbors import triton_grid

SWEEP = [((2, 32, 1), 3), ((2, 32, 1), 2), ((2, 32, 1), 6), ((4, 32, 1), 3), ((4, 32, 2), 3), ((8, 32, 2), 3),
         ((2, 64, 1), 3), ((4, 64, 2), 3), ((1, 32, 1), 3)]  # (SEARCH_BLOCKS, SEARCH_SORT_FROM), radius too
CELLS = [(8, 32, 1), (8, 32, 8), (8, 32, 64), (8, 16, 64), (8, 8, 64), (6, 32, 64), (12, 32, 64)]  # (CELL_POINTS, BUDGET, FINER)


def main(sweep: bool = False, cells: bool = False) -> None:
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
             lambda: fullgraph.radius_aggregate(grid, small_cloud, small_features, 0.1, sigma=0.1))]
    if cells:
        for cell_grid.CELL_POINTS, cell_grid.BUDGET, cell_grid.FINER in CELLS:
            print(f"CELL_POINTS {cell_grid.CELL_POINTS}, BUDGET {cell_grid.BUDGET}, FINER {cell_grid.FINER}: "
                  + "; ".join(f"{name} {graphed_ms(call):.3f}" for name, call in rows), flush=True)
        return
    if not sweep:
        print("; ".join(f"{name} {graphed_ms(call):.3f}" for name, call in rows))
    for blocks, sort_from in SWEEP if sweep else ():
        triton_grid.SEARCH_BLOCKS, triton_grid.SEARCH_SORT_FROM = blocks, sort_from
        triton_grid.RADIUS_SEARCH_BLOCKS = blocks
        print(f"SEARCH_BLOCKS (and radius) {blocks}, SEARCH_SORT_FROM {sort_from}: "
              + "; ".join(f"{name} {graphed_ms(call):.3f}" for name, call in rows), flush=True)


if __name__ == "__main__":
    main(sweep="--sweep" in sys.argv, cells="--cells" in sys.argv)
