"""Sweep the Triton search kernel's block sizes on a GPU: 27k grid queries x 100k normal refs."""

from __future__ import annotations

import torch

import fullgraph
from fullgraph.bench.timing import time_call
from fullgraph.bench.workloads import seed_point_clouds
from fullgraph.ops.neighbors import triton as triton_backend

cloud, grid, _ = seed_point_clouds(100_000, 30, 1, "cuda")
want = fullgraph.knn(grid, cloud, 7)[1]
for config in [(8, 64, 1), (4, 64, 1), (8, 32, 1), (4, 128, 1), (8, 128, 1), (2, 128, 1), (4, 32, 1)]:
    triton_backend.SEARCH_BLOCKS = config
    assert torch.equal(fullgraph.knn(grid, cloud, 7)[1], want)
    timing = time_call(lambda: fullgraph.knn(grid, cloud, 7), torch.device("cuda"), warmup=2, runs=10)
    print(config, f"{timing.median_ms:.2f} ms", flush=True)
