"""knn_reduce's backward on CUDA at EdgeConv's size (B=8, 4,096 points, k=20 lists from
fullgraph.knn on 64 features, C=64): graphed ms of the whole backward by the pair-sum
kernel's tiles with the extremes (``triton_grid.EXTREMES_PAIR_BLOCKS``), beside the pair sum
of stored per-slot shares (the previous formulation's second half) and torch's index_add.

    python benchmarks/reduce_backward.py [--batch 8 --points 4096 --k 20 --channels 64]
"""

from __future__ import annotations

import argparse
import itertools

import torch

import fullgraph
from fullgraph.bench.timing import time_call
from fullgraph.ops.neighbors import reduce, triton_grid

SWEEP = {"block_r": (16, 32, 64), "unroll": (2, 4), "warps": (2, 4)}


def graphed_ms(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_call(graph.replay, torch.device("cuda"), warmup=3, runs=50).median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--points", type=int, default=4096)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--channels", type=int, default=64)
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.batch, args.points, 64, device="cuda", generator=generator)
    _, idx = fullgraph.knn(x, x, args.k)
    values = torch.randn(args.batch, args.points, args.channels, device="cuda", generator=generator)
    *_, slots = reduce.knn_reduce_op(values, idx)
    grads = [torch.randn_like(values) for _ in range(3)]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, vars(args), flush=True)
    want = reduce._backward_torch(*grads, idx, slots, args.points)
    shares = reduce._per_slot(*grads, slots, args.k).reshape(-1, args.channels).contiguous()
    ones = torch.ones(idx.numel(), device="cuda")
    stored = graphed_ms(lambda: triton_grid.sum_pairs_by_ref(idx, ones, shares, args.points, per_slot=True))
    print(f"stored shares' pair sum {stored:.3f} ms; torch index_add backward "
          f"{graphed_ms(lambda: reduce._backward_torch(*grads, idx, slots, args.points)):.3f} ms", flush=True)
    default = triton_grid.EXTREMES_PAIR_BLOCKS
    for setting in itertools.product(*SWEEP.values()):
        triton_grid.EXTREMES_PAIR_BLOCKS = setting
        got = reduce._backward_triton(*grads, idx, slots, args.points)
        error = (got - want).abs().max().item()
        print(dict(zip(SWEEP, setting)), f"{graphed_ms(lambda: reduce._backward_triton(*grads, idx, slots, args.points)):.3f}"
              f" ms (largest difference from torch {error:.2e})", flush=True)
    triton_grid.EXTREMES_PAIR_BLOCKS = default


if __name__ == "__main__":
    main()
