"""Compare NumPy formulations of the k-means steps on a GPU (seed 002's size).

    python benchmarks/kmeans_steps.py [--points 20000000] [--log out.txt]

Each formulation is compiled through fullgraph.numpy.jit and timed as called and replayed
from a CUDA graph; the profiler lists its kernels. Floors on an H100 (~3 TB/s): the
assignment reads 160 MB of points and writes 160 MB of int64 labels (~0.107 ms); a Lloyd
iteration needs at least the same (the update can be accumulated while assigning).

What it showed (H100, torch 2.11): ``** 2`` compiles to a general pow (0.235 ms against
0.106 with ``diff * diff``); ``member.T @ x`` runs a [2, n] @ [n, 2] GEMM of 1.5 ms; a masked
sum over n into k * d outputs runs one program per output (14 ms) unless the rows are summed
in blocks first (the shipped step: ~0.31 ms graphed).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from fullgraph.bench.timing import graphed, time_call
from fullgraph.numpy import jit
from fullgraph.ops import kmeans as kmeans_ops


def _d2(x, c):
    return ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)


@jit
def document_assign(x, means):
    return np.argmin(np.linalg.norm(x - means[:, None], axis=2), axis=0)


@jit
def update_gemm(x, c):
    d2 = _d2(x, c)
    labels = np.argmin(d2, axis=1)
    clusters = np.cumsum(np.ones_like(c[:, 0]), axis=0) - 1
    member = (labels[:, None] == clusters[None, :]) * np.ones_like(x[:, :1])
    return labels, member.T @ x, member.sum(0), np.min(d2, axis=1)


@jit
def update_kn(x, c, clusters):
    """[k, n] distances (the document's layout), cluster ids passed in."""
    d2 = ((x - c[:, None]) ** 2).sum(2)
    labels = np.argmin(d2, axis=0)
    member = labels[None, :] == clusters[:, None]
    sums = np.where(member[:, :, None], x[None], 0).sum(1)
    return labels, sums, member.sum(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=20_000_000)
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    half = args.points // 2
    x = torch.cat([torch.randn(half, 2, device=device, generator=generator) + 5,
                   torch.randn(half, 2, device=device, generator=generator) + 10])
    c = torch.tensor([[5.0, 5.0], [10.0, 10.0]], device=device)
    clusters = torch.arange(2, device=device)
    want = update_gemm(x, c)
    cases = {
        "assign (fullgraph)": lambda: kmeans_ops.kmeans_assign(x, c),
        "assign (document, on CUDA tensors)": lambda: document_assign(x, c),
        "lloyd: member.T @ x": lambda: update_gemm(x, c),
        "lloyd: [k, n] masked sum": lambda: update_kn(x, c, clusters),
        "lloyd: shipped (blocked sums)": lambda: kmeans_ops.lloyd_step(x, c),
    }
    for name, call in cases.items():
        out = call()
        if name.startswith("lloyd"):
            agree = bool((out[0] == want[0]).all()) and torch.equal(out[2].long(), want[2].long())
        else:
            agree = bool((out == want[0]).all())
        eager = time_call(call, device, warmup=5, runs=50).median_ms
        replay = graphed(call, device)
        graph = time_call(replay, device, warmup=5, runs=50).median_ms
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                replay()
            torch.cuda.synchronize()
        kernels = sorted(((e.key, e.device_time_total / 5 / 1e3) for e in prof.key_averages() if e.device_time_total > 0),
                         key=lambda kv: -kv[1])
        listing = "; ".join(f"{k[:50]} {t:.3f}" for k, t in kernels[:6])
        print(f"{name:40s} agree={agree} eager {eager:.3f} ms graphed {graph:.3f} ms | {listing}", flush=True)


if __name__ == "__main__":
    main()
