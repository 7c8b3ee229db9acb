"""Radius search of small batched clouds on the CPU: fullgraph.radius ("auto") against the
plain PyTorch a user would write (cdist, the pairs beyond the radius masked, topk), in
interleaved calls of one process (medians of 25 after 5 warm-ups); then radius_aggregate against
its plain PyTorch (cdist, a masked softmax, one batched product).

    python benchmarks/radius_cpu.py > radius-cpu.log
"""

from __future__ import annotations

import statistics
import time

import torch

import fullgraph

SHAPES = ((64, 128, 128, 0.3, 16), (16, 256, 256, 0.2, 32), (8, 1024, 1024, 0.1, 32), (1, 2000, 2000, 0.1, 32))


def plain(query, ref, radius, cap):
    d = torch.cdist(query, ref)
    values, idx = torch.topk(d.masked_fill(d > radius, float("inf")), cap, largest=False)
    return values, idx.masked_fill(values.isinf(), -1)


def plain_aggregate(query, ref, features, radius, sigma):
    """radius_aggregate as a user writes it: cdist, a softmax of -d / sigma over the pairs
    within the radius, one batched product with the features."""
    d = torch.cdist(query, ref)
    inside = d <= radius
    shift = torch.where(inside, d, float("inf")).amin(-1, keepdim=True)
    weights = torch.where(inside, torch.exp((shift - d) / sigma), 0)
    total = weights.sum(-1, keepdim=True)
    return torch.bmm(weights, features) / torch.where(total > 0, total, 1)


def interleaved(calls: dict, runs: int = 30, warmup: int = 5) -> dict:
    times = {name: [] for name in calls}
    for _ in range(runs):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t[warmup:]) for name, t in times.items()}


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; uniform 3-D clouds", flush=True)
    print("B M N radius cap | cdist + mask + topk ms | fullgraph.radius ms | plain aggregate ms | "
          "radius_aggregate ms", flush=True)
    generator = torch.Generator().manual_seed(0)
    for batch, m, n, radius, cap in SHAPES:
        q, r = torch.rand(batch, m, 3, generator=generator), torch.rand(batch, n, 3, generator=generator)
        f = torch.randn(batch, n, 8, generator=generator)
        ms = interleaved({"plain": lambda: plain(q, r, radius, cap), "ours": lambda: fullgraph.radius(q, r, radius, cap),
                          "plain aggregate": lambda: plain_aggregate(q, r, f, radius, radius / 2),
                          "aggregate": lambda: fullgraph.radius_aggregate(q, r, f, radius, sigma=radius / 2)})
        print(f"{batch} {m} {n} {radius} {cap} | {ms['plain']:.2f} | {ms['ours']:.2f} | {ms['plain aggregate']:.2f} | "
              f"{ms['aggregate']:.2f}", flush=True)


if __name__ == "__main__":
    main()
