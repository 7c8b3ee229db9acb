"""Time the neighbour operators alone on a GPU and write JSON rows.

    python benchmarks/ops.py --json benchmarks/results/<device>/ops.json [--large]

Rows carry the floor next to the measurement: a brute-force search evaluates M*N
distances (3 coordinates: 3 subtractions and 3 FMAs, plus the key and compare, ~12
operations), so its floor is M*N*12 / (fp32+int rate); the memory floor (reading the
points, writing k results) is far below it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import fullgraph
from fullgraph.bench.runner import environment
from fullgraph.bench.timing import PeakMemory, time_call


def _cloud(kind: str, count: int, generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(count, 3, generator=generator, device="cuda")
    return torch.rand(count, 3, generator=generator, device="cuda")


def _mismatches(op, query, ref, k, r, result, generator, samples=2000) -> int:
    """Sampled queries whose neighbour lists differ from the torch reference's."""
    rows = torch.randint(0, query.shape[0], (samples,), generator=generator, device=query.device)
    if op == "knn":
        want = fullgraph.knn(query[rows], ref, k, backend="torch")[1]
    else:
        want = fullgraph.radius(query[rows], ref, r, k, backend="torch")[1]
    return int((result[1][rows] != want).any(-1).sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--large", action="store_true", help="also 1M x 1M (slow with brute force)")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    cases = [("knn", "normal", 27_000, 100_000, 7, None), ("radius", "uniform", 27_000, 100_000, 32, 0.0362)]
    if args.large:
        cases += [("knn", kind, 1_000_000, 1_000_000, 16, None) for kind in ("normal", "uniform")]
        cases += [("radius", "uniform", 1_000_000, 1_000_000, 32, 0.0168)]
    rows = []
    for op, kind, m, n, k, r in cases:
        query, ref = _cloud(kind, m, generator), _cloud(kind, n, generator)
        if op == "knn":
            call = lambda query=query, ref=ref, k=k: fullgraph.knn(query, ref, k)  # noqa: E731
        else:
            call = lambda query=query, ref=ref, r=r, k=k: fullgraph.radius(query, ref, r, k)  # noqa: E731
        runs = 3 if m >= 1_000_000 else 20
        with PeakMemory(device) as memory:
            timing = time_call(call, device, warmup=1, runs=runs)
        extra = {"mismatched_sampled_queries": _mismatches(op, query, ref, k, r, call(), generator)}
        if op == "radius":
            extra["mean_neighbors_within_radius"] = float(call()[2].float().mean())
        rows.append({"op": op, "distribution": kind, "queries": m, "refs": n, "k": k, "radius": r,
                     "median_ms": timing.median_ms, "p10_ms": timing.p10_ms, "p90_ms": timing.p90_ms,
                     "peak_memory_bytes": memory.bytes, "pair_evaluations": m * n, **extra, **environment(device)})
        print(json.dumps(rows[-1]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
