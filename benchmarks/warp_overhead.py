"""Where the Warp backend's eager call spends its time (seed size of the radius projector).

    python benchmarks/warp_overhead.py      # CUDA, warp-lang installed

Prints CUDA-event medians of radius_aggregate forward for the Warp and Triton backends,
eager and replayed from a CUDA graph (the GPU's work alone), then a cProfile of eager
Warp calls (host time by function).
"""

from __future__ import annotations

import cProfile
import pstats

import torch

import fullgraph
from fullgraph.bench.timing import graphed, time_call
from fullgraph.bench.workloads import seed_point_clouds


def main() -> None:
    device = torch.device("cuda")
    cloud, grid, _ = seed_point_clouds(25_000, 30, 1, device)
    features = torch.randn(cloud.shape[0], 25, device=device)
    for backend in ("warp", "triton"):
        def call(backend=backend):
            return fullgraph.radius_aggregate(grid, cloud, features, 0.1, sigma=0.1, backend=backend)

        eager = time_call(call, device, warmup=10, runs=100)
        replayed = time_call(graphed(call, device), device, warmup=10, runs=100)
        print(f"{backend}: eager {eager.median_ms:.3f} ms, graphed {replayed.median_ms:.3f} ms")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        fullgraph.radius_aggregate(grid, cloud, features, 0.1, sigma=0.1, backend="warp")
    torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
