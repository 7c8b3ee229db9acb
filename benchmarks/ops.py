"""Time the neighbour operators alone on a GPU and write JSON rows.

    python benchmarks/ops.py --json benchmarks/results/<device>/ops.json [--large] [--profile]

Each case is timed as called (eager: host overhead included) and replayed from a CUDA
graph (the GPU's work alone). Search rows carry how many of 2,000 sampled queries differ
from the torch reference (must be 0).

Floors. The grid search reads the points a few times (keys, sort, gather: ~100 bytes
per point) and evaluates about 27 * CELL_POINTS candidates per query (plus insertions);
a brute-force search would evaluate M*N distances.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import fullgraph
from fullgraph.bench.runner import environment
from fullgraph.bench.timing import PeakMemory, graphed, time_call
from fullgraph.bench.workloads import seed_point_clouds


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


def _search_cases(large: bool, generator):
    """(name, fields, call, check) of the search ops."""
    cases = [("knn", "normal", 27_000, 100_000, 7, None), ("radius", "uniform", 27_000, 100_000, 32, 0.0362)]
    if large:
        cases += [("knn", kind, 1_000_000, 1_000_000, 16, None) for kind in ("normal", "uniform")]
        cases += [("radius", "uniform", 1_000_000, 1_000_000, 32, 0.0168)]
    for op, kind, m, n, k, r in cases:
        query, ref = _cloud(kind, m, generator), _cloud(kind, n, generator)
        if op == "knn":
            call = lambda query=query, ref=ref, k=k: fullgraph.knn(query, ref, k)  # noqa: E731
        else:
            call = lambda query=query, ref=ref, r=r, k=k: fullgraph.radius(query, ref, r, k)  # noqa: E731

        def check(call=call, op=op, query=query, ref=ref, k=k, r=r):
            extra = {"mismatched_sampled_queries": _mismatches(op, query, ref, k, r, call(), generator)}
            if op == "radius":
                extra["mean_neighbors_within_radius"] = float(call()[2].float().mean())
            return extra

        fields = {"op": op, "distribution": kind, "queries": m, "refs": n, "k": k, "radius": r}
        yield fields, call, check


def _aggregate_cases():
    """The seed's aggregations (grid queries, normal cloud, 25 channels): forward and train."""
    for op, cloud_size, param in (("knn_aggregate", 100_000, 7), ("radius_aggregate", 25_000, 0.1)):
        cloud, grid, _ = seed_point_clouds(cloud_size, 30, 1, "cuda")
        features = torch.randn(cloud_size, 25, device="cuda")
        inputs = [t.clone().requires_grad_(True) for t in (grid, cloud, features)]
        aggregate = getattr(fullgraph, op)

        def train(aggregate=aggregate, inputs=inputs, param=param):
            out = aggregate(*inputs, param, sigma=0.1)
            torch.autograd.grad(out.square().sum(), inputs)

        fields = {"distribution": "seed", "queries": grid.shape[0], "refs": cloud_size,
                  "k" if op == "knn_aggregate" else "radius": param}
        yield {"op": op + " forward", **fields}, lambda a=aggregate, p=param: a(grid, cloud, features, p, sigma=0.1), None
        yield {"op": op + " train", **fields}, train, None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--large", action="store_true", help="also 1M x 1M")
    parser.add_argument("--profile", action="store_true", help="print a kernel profile of each case")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for fields, call, check in [*_search_cases(args.large, generator), *_aggregate_cases()]:
        runs = 5 if fields["queries"] >= 1_000_000 else 50
        with PeakMemory(device) as memory:
            eager = time_call(call, device, warmup=2, runs=runs)
        replay = graphed(call, device)
        graph = time_call(replay, device, warmup=2, runs=runs)
        if args.profile:
            with torch.profiler.profile() as profile:
                replay()
                call()
                torch.cuda.synchronize()
            print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        rows.append({**fields, "median_ms": eager.median_ms, "graphed_median_ms": graph.median_ms,
                     "graphed_p10_ms": graph.p10_ms, "graphed_p90_ms": graph.p90_ms,
                     "peak_memory_bytes": memory.bytes, **(check() if check else {}), **environment(device)})
        print(json.dumps(rows[-1]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
