"""Feature-space kNN on the CPU: fullgraph.knn ("auto": the dense backend from D = 12, the k-d
tree below) against cdist + topk, and the dense backend against the k-d tree near their
crossover (``dense.AUTO_MIN_DIM``). Normal clouds; median of 5 wall times after one warm-up,
all in one process.

    python benchmarks/dense_cpu.py > dense-cpu.log
"""

from __future__ import annotations

import statistics
import time

import torch

import fullgraph

VERSUS_CDIST = ((8, 2048, 2048, 64, 20), (32, 1024, 1024, 64, 20), (16, 256, 256, 64, 20), (64, 128, 128, 16, 10), (1, 5000, 50000, 16, 10),
                (1, 2000, 100000, 128, 10), (4, 512, 4096, 32, 50))
CROSSOVER = ((1, 5000, 100000, 6, 10), (1, 5000, 100000, 8, 10), (1, 5000, 100000, 10, 10), (1, 5000, 100000, 12, 10), (8, 2048, 2048, 8, 20), (8, 2048, 2048, 12, 20),
             (1, 2000, 10000, 8, 10), (1, 2000, 10000, 12, 10))


def wall_ms(fn, runs: int = 5) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def clouds(batch, m, n, dim):
    generator = torch.Generator().manual_seed(m + n + dim)
    return torch.randn(batch, m, dim, generator=generator), torch.randn(batch, n, dim, generator=generator)


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    print("B M N D k | cdist+topk ms | fullgraph.knn auto ms | indices equal to cdist + topk's (which is inexact)", flush=True)
    for batch, m, n, dim, k in VERSUS_CDIST:
        q, r = clouds(batch, m, n, dim)
        plain = wall_ms(lambda: torch.topk(torch.cdist(q, r), k, largest=False))
        ours = wall_ms(lambda: fullgraph.knn(q, r, k))
        same = torch.equal(fullgraph.knn(q, r, k)[1], torch.topk(torch.cdist(q, r), k, largest=False).indices)
        print(f"{batch} {m} {n} {dim} {k} | {plain:.1f} | {ours:.1f} | {same}", flush=True)
    print("B M N D k | dense ms | kd-tree ms", flush=True)
    for batch, m, n, dim, k in CROSSOVER:
        q, r = clouds(batch, m, n, dim)
        dense = wall_ms(lambda: fullgraph.knn(q, r, k, backend="dense"), runs=3)
        tree = wall_ms(lambda: fullgraph.knn(q, r, k, backend="cpu"), runs=3)
        print(f"{batch} {m} {n} {dim} {k} | {dense:.1f} | {tree:.1f}", flush=True)


if __name__ == "__main__":
    main()
