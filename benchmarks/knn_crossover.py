"""Where "auto" should take the dense (matrix-product) kNN backend: per shape, the median
time of cdist + topk (what users write), "dense", and the search it competes with ("triton"
on CUDA, the k-d tree "cpu" on CPUs), plus the dense rows its certificate sent back.

    python benchmarks/knn_crossover.py --device cuda > crossover.log

The constants AUTO_MIN_DIM / CUDA_AUTO_MIN_DIM in ops/neighbors/dense.py cite its output.
"""

from __future__ import annotations

import argparse

import torch

import fullgraph
from fullgraph.bench.timing import time_call
from fullgraph.ops.neighbors import dense

CUDA_SHAPES = [  # B, M, N, D, k
    (8, 4096, 4096, 64, 20), (32, 1024, 1024, 64, 20), (8, 4096, 4096, 32, 20), (8, 4096, 4096, 16, 20),
    (8, 4096, 4096, 8, 20), (16, 256, 256, 64, 20), (1, 64, 1000, 32, 8), (4, 4096, 4096, 32, 64),
    (1, 20_000, 200_000, 16, 10), (1, 20_000, 200_000, 32, 10), (1, 10_000, 1_000_000, 128, 10),
]
CPU_SHAPES = [(8, 2048, 2048, 64, 20), (1, 5000, 50_000, 16, 10), (1, 2000, 100_000, 128, 10), (2, 256, 256, 64, 20)]


def _redone_rows(query, ref, k) -> int:
    """Rows the certificate could not prove, for one call."""
    counted = []
    original = dense._redo
    dense._redo = lambda q, r, k, radius, ql, rl, failed, *a: counted.append(int(failed.sum())) or original(
        q, r, k, radius, ql, rl, failed, *a)
    try:
        fullgraph.knn(query, ref, k, backend="dense")
    finally:
        dense._redo = original
    return sum(counted)


def _row(batch, m, n, dim, k, device, rival, runs, generator) -> str:
    """One shape's line of the log."""
    query = torch.randn(batch, m, dim, generator=generator, device=device)
    ref = torch.randn(batch, n, dim, generator=generator, device=device)
    calls = {
        "cdist+topk": lambda: torch.topk(torch.cdist(query, ref), k, largest=False),
        "dense": lambda: fullgraph.knn(query, ref, k, backend="dense"),
        rival: lambda: fullgraph.knn(query, ref, k, backend=rival),
    }
    times = {}
    for label, call in calls.items():
        try:
            first = time_call(call, device, 1, 1).median_ms  # slow rivals: fewer calls
            times[label] = f"{time_call(call, device, 1, runs if first < 100 else 3).median_ms:.3f}"
        except (torch.OutOfMemoryError, ValueError) as error:
            times[label] = type(error).__name__
    picked = fullgraph.ops.neighbors.registration.BACKENDS.resolve("auto", "knn", device, query.dtype, dim, k).name
    return (f"{batch} {m} {n} {dim} {k} | {times['cdist+topk']} | {times['dense']} | {times[rival]} | {picked} | "
            f"{_redone_rows(query, ref, k)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    rival = "triton" if device.type == "cuda" else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# fullgraph.knn on {name}, torch {torch.__version__}: medians of {args.runs} calls (ms), normal clouds")
    print(f"B M N D k | cdist+topk | dense | {rival} | auto picks | dense rows redone")
    for shape in CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES:
        print(_row(*shape, device, rival, args.runs, generator), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
