"""Feature-space kNN on the CPU: fullgraph.knn ("auto") against cdist + topk, the dense
backend against the "cpu" backend (its brute force up to ``cpu.BRUTE_FORCE_MAX_PAIRS`` pairs an
item, the k-d tree beyond) near their crossover (``dense.AUTO_MIN_DIM``), and small batched
items (``dense.CPU_BRUTE_FORCE``: the products, the brute force, cdist + topk and "auto",
interleaved). Normal clouds; medians of wall times after warm-up, all in one process.

    python benchmarks/dense_cpu.py > dense-cpu.log
    python benchmarks/dense_cpu.py --sweep   # the products / brute force crossover by D and pairs an item
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import fullgraph

VERSUS_CDIST = ((8, 2048, 2048, 64, 20), (32, 1024, 1024, 64, 20), (16, 256, 256, 64, 20), (64, 128, 128, 16, 10), (1, 5000, 50000, 16, 10),
                (1, 2000, 100000, 128, 10), (4, 512, 4096, 32, 50))
SMALL = ((16, 256, 256, 64, 20), (64, 128, 128, 16, 10), (64, 128, 128, 8, 10), (16, 256, 256, 32, 20),
         (4, 512, 512, 64, 20), (8, 512, 512, 64, 20), (4, 512, 512, 128, 20), (1, 1024, 1024, 16, 16))
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


SWEEP_DIMS = (3, 8, 16, 32, 64, 128)
SWEEP_ITEMS = ((64, 128, 128), (16, 256, 256), (4, 512, 512), (1, 1024, 1024), (2, 1024, 2048), (1, 2048, 2048))


def interleaved(calls, runs: int = 13, warmup: int = 3) -> list[float]:
    """Median ms of each call, the calls taking turns."""
    times = [[] for _ in calls]
    for run in range(runs):
        for call, spent in zip(calls, times):
            start = time.perf_counter()
            call()
            if run >= warmup:
                spent.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def sweep(k: int = 16) -> None:
    print("D B M N | products (dense) / brute force (cpu) / cdist+topk ms, interleaved", flush=True)
    for dim in SWEEP_DIMS:
        for batch, m, n in SWEEP_ITEMS:
            q, r = clouds(batch, m, n, dim)
            times = interleaved((lambda: fullgraph.knn(q, r, k, backend="dense"),
                                 lambda: fullgraph.knn(q, r, k, backend="cpu"),
                                 lambda: torch.topk(torch.cdist(q, r), k, largest=False)))
            print(f"{dim} {batch} {m} {n} | " + " / ".join(f"{t:.2f}" for t in times), flush=True)


def main() -> None:
    if "--sweep" in sys.argv[1:]:
        return sweep()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    print("B M N D k | cdist+topk ms | fullgraph.knn auto ms | indices equal to cdist + topk's (which is inexact)", flush=True)
    for batch, m, n, dim, k in VERSUS_CDIST:
        q, r = clouds(batch, m, n, dim)
        plain = wall_ms(lambda: torch.topk(torch.cdist(q, r), k, largest=False))
        ours = wall_ms(lambda: fullgraph.knn(q, r, k))
        same = torch.equal(fullgraph.knn(q, r, k)[1], torch.topk(torch.cdist(q, r), k, largest=False).indices)
        print(f"{batch} {m} {n} {dim} {k} | {plain:.1f} | {ours:.1f} | {same}", flush=True)
    print("B M N D k | dense ms | cpu backend ms (brute force or k-d tree)", flush=True)
    for batch, m, n, dim, k in CROSSOVER:
        q, r = clouds(batch, m, n, dim)
        dense = wall_ms(lambda: fullgraph.knn(q, r, k, backend="dense"), runs=3)
        tree = wall_ms(lambda: fullgraph.knn(q, r, k, backend="cpu"), runs=3)
        print(f"{batch} {m} {n} {dim} {k} | {dense:.1f} | {tree:.1f}", flush=True)
    print("B M N D k | products (dense) / brute force (cpu) / cdist+topk / auto ms, interleaved, medians of 25",
          flush=True)
    for batch, m, n, dim, k in SMALL:
        q, r = clouds(batch, m, n, dim)
        calls = (lambda: fullgraph.knn(q, r, k, backend="dense"), lambda: fullgraph.knn(q, r, k, backend="cpu"),
                 lambda: torch.topk(torch.cdist(q, r), k, largest=False), lambda: fullgraph.knn(q, r, k))
        times = interleaved(calls, runs=30, warmup=5)
        print(f"{batch} {m} {n} {dim} {k} | " + " / ".join(f"{t:.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
