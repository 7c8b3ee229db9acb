"""The ring's remote step of ``fullgraph.distributed.knn`` on one GPU: two slab shards of a
uniform cloud (x in [0, 0.5) and [0.5, 1)), the first searched against itself, then against
the second for the queries that can reach it (``_reaching``), over the whole second shard or
only its references near those queries (``_near``). Times in ms (CUDA events, medians).

    python benchmarks/sharded_remote_step.py [points per shard, default 5e7]     (needs a CUDA device)
"""

from __future__ import annotations

import sys

import torch

from fullgraph import distributed

K = 16


def timed(call, runs: int = 3) -> tuple[float, object]:
    times, result = [], None
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], result


def main(count: int = 50_000_000) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    own = torch.rand(count, 3, device="cuda", generator=generator) * torch.tensor([0.5, 1, 1], device="cuda")
    other = torch.rand(count, 3, device="cuda", generator=generator) * torch.tensor([0.5, 1, 1], device="cuda") \
        + torch.tensor([0.5, 0, 0], device="cuda")
    search = distributed._knn_search(K, "auto")
    lengths = torch.tensor([count], device="cuda")
    local_ms, (dists, idx, _) = timed(lambda: search(own[None], own[None], lengths, None), runs=1)
    best = (dists[0], idx[0])
    box = torch.stack([other.double().amin(0), other.double().amax(0)])

    def remote(prune: bool):
        reaching = distributed._reaching(own, box, best, K, None).nonzero()[:, 0]
        groups = distributed._by_limit(reaching, best[0][reaching, K - 1])
        kept = distributed._near(other, own[reaching], max(limit for _, limit in groups)) if prune else None
        shard = other if kept is None else other[kept]
        size = lengths.new_tensor([shard.shape[0]])
        for rows, limit in groups:
            search(own[rows][None], shard[None], size, limit)
        return reaching.numel(), shard.shape[0]

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {count:,} points a shard, k = {K}")
    print(f"local search (queries against their own shard): {local_ms:.1f} ms")
    for prune in (False, True):
        ms, (reaching, refs) = timed(lambda: remote(prune))
        print(f"remote step, {'references near the queries' if prune else 'whole shard'}: {ms:.1f} ms "
              f"({reaching:,} queries reach the shard; {refs:,} references searched)")


if __name__ == "__main__":
    main(int(float(sys.argv[1])) if len(sys.argv) > 1 else 50_000_000)
