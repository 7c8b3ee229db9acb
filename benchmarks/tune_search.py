"""Sweep the grid's cell size and the Triton kernels' block sizes on a GPU.

    python benchmarks/tune_search.py

Search: the seed's kNN (27k grid queries x 100k normal references, k=7) and 1M x 1M (k=16,
normal and uniform). Aggregation: radius_aggregate forward + backward at the seed's size.
Every configuration must give the same neighbours as the first. Times are CUDA-graph
replays (the GPU's work alone).
"""

from __future__ import annotations

import itertools

import torch

import fullgraph
from fullgraph.bench.timing import graphed, time_call
from fullgraph.bench.workloads import seed_point_clouds
from fullgraph.ops.neighbors import grid
from fullgraph.ops.neighbors import triton_grid as triton_backend

device = torch.device("cuda")
cloud, queries, _ = seed_point_clouds(100_000, 30, 1, "cuda")
big = {kind: (make(1_000_000, 3, device="cuda"), make(1_000_000, 3, device="cuda"))
       for kind, make in (("normal", torch.randn), ("uniform", torch.rand))}
cases = {"seed k=7": (queries, cloud, 7), **{f"1M {kind} k=16": (*big[kind], 16) for kind in big}}
wanted = {name: fullgraph.knn(*case)[1] for name, case in cases.items()}

for cell_points, blocks in itertools.product((4, 8, 16), ((4, 32, 1), (8, 32, 1), (4, 16, 1), (2, 32, 1))):
    grid.CELL_POINTS, triton_backend.SEARCH_BLOCKS = cell_points, blocks
    times = []
    for name, (q, r, k) in cases.items():
        assert torch.equal(fullgraph.knn(q, r, k)[1], wanted[name]), (name, cell_points, blocks)
        replay = graphed(lambda q=q, r=r, k=k: fullgraph.knn(q, r, k), device)
        times.append(f"{name} {time_call(replay, device, warmup=2, runs=10).median_ms:.3f} ms")
    print("search", cell_points, blocks, *times, sep=" | ", flush=True)
grid.CELL_POINTS, triton_backend.SEARCH_BLOCKS = 8, (4, 32, 1)

cloud, queries, _ = seed_point_clouds(25_000, 30, 1, "cuda")
features = torch.randn(25_000, 25, device="cuda", requires_grad=True)
cloud.requires_grad_(True)
queries.requires_grad_(True)


def train_step():
    out = fullgraph.radius_aggregate(queries, cloud, features, 0.1, sigma=0.1)
    torch.autograd.grad(out.square().sum(), (queries, cloud, features))


for cell_points, blocks in itertools.product((4, 8, 16, 32), ((32, 32, 4), (16, 32, 4), (32, 16, 4), (16, 16, 2), (64, 32, 4))):
    grid.CELL_POINTS, triton_backend.AGGREGATE_BLOCKS = cell_points, blocks
    forward = time_call(graphed(lambda: fullgraph.radius_aggregate(queries, cloud, features, 0.1, sigma=0.1), device),
                        device, warmup=2, runs=20).median_ms
    both = time_call(graphed(train_step, device), device, warmup=2, runs=20).median_ms
    print("aggregate", cell_points, blocks, f"forward {forward:.3f} ms", f"forward+backward {both:.3f} ms", sep=" | ",
          flush=True)
