"""The ring's remote step of ``fullgraph.distributed.knn`` on one GPU, as rank 0 of two sees
it: its shard of ``fullgraph bench knn-sharded``'s cloud (uniform slab or clustered) searched
against itself, then ``distributed._search_remote`` against rank 1's shard. Prints the step's
time split by its parts (each part synchronized; ms) and its kernels (torch.profiler).

    python benchmarks/sharded_remote_step.py [points per shard, default 5e7] [uniform|clustered]
    (needs a CUDA device)
"""

from __future__ import annotations

import collections
import functools
import sys
import time

import torch

from fullgraph import distributed
from fullgraph.bench.workloads.knn_sharded import _shard

K = 16
PARTS = ("_reaching", "_occupancy", "_by_limit", "_near", "_merge")


def _timing_parts(spent: dict):
    """Wrap the remote step's parts to add their synchronized wall time to ``spent``; returns
    the wrapper, ``timed(name, call)``, for other calls (the shard search)."""
    def timed(name, call):
        @functools.wraps(call)
        def wrapper(*args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = call(*args, **kwargs)
            torch.cuda.synchronize()
            spent[name] += (time.perf_counter() - start) * 1e3
            return result
        return wrapper
    for name in PARTS:
        setattr(distributed, name, timed(name, getattr(distributed, name)))
    return timed


def main(count: int = 50_000_000, distribution: str = "uniform") -> None:
    own, other = (_shard(distribution, count, rank, 2, "cuda") for rank in (0, 1))
    box = distributed._box(other)
    spent = collections.defaultdict(float)
    search = _timing_parts(spent)("search", distributed._knn_search(K, "auto"))

    def searched(query):
        dists, idx, _ = search(query[None], query[None], torch.tensor([query.shape[0]], device="cuda"), None)
        return dists[0], idx[0]

    def step(query, ref, best):
        """ms of one remote step from the lists ``best`` (changed in place)."""
        spent.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        distributed._search_remote(query, ref, box, query.shape[0], best, None, K, search, None)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    step(own[:100_000], other[:100_000], searched(own[:100_000]))  # compiles the kernels
    spent.clear()
    local = searched(own)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {distribution}, "
          f"{count:,} points a shard, k = {K}; local search {spent['search']:.1f} ms")
    for _ in range(3):
        total = step(own, other, (local[0].clone(), local[1].clone()))
        parts = ", ".join(f"{name} {ms:.1f}" for name, ms in spent.items())
        print(f"remote step {total:.1f} ms: {parts}")
    best = (local[0].clone(), local[1].clone())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        step(own, other, best)
    print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main(int(float(sys.argv[1])) if len(sys.argv) > 1 else 50_000_000, *sys.argv[2:3])
