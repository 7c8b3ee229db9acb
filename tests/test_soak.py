"""Soak: many calls of each neighbour op (forward and backward) leave memory where it was.

CI makes 1,000 calls per op (a CPU call with its backward takes ~10 ms here); the recorded
soak sets FULLGRAPH_SOAK_CALLS=10000 (docs/contributing.md).
"""

from __future__ import annotations

import os

import pytest
import torch

import fullgraph
from conftest import DEVICES

CALLS = int(os.environ.get("FULLGRAPH_SOAK_CALLS", "1000"))
WARMUP = max(50, CALLS // 20)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _memory(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return _rss_bytes()


OPS = {
    "knn": lambda q, r, f: fullgraph.knn(q, r, 4)[0].nan_to_num(posinf=0).sum(),
    "radius": lambda q, r, f: fullgraph.radius(q, r, 0.3, 6)[0].nan_to_num(posinf=0).sum(),
    "knn_aggregate": lambda q, r, f: fullgraph.knn_aggregate(q, r, f, 4).sum(),
    "radius_aggregate": lambda q, r, f: fullgraph.radius_aggregate(q, r, f, 0.3).sum(),
}


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_many_calls_leave_memory_where_it_was(device, op):
    generator = torch.Generator().manual_seed(3)
    query = torch.rand(24, 3, generator=generator).to(device).requires_grad_()
    ref = torch.rand(40, 3, generator=generator).to(device).requires_grad_()
    features = torch.randn(40, 2, generator=generator).to(device).requires_grad_()

    def call():
        OPS[op](query, ref, features).backward()

    for _ in range(WARMUP):  # caches, the allocator's pools
        call()
    before = _memory(device)
    for _ in range(CALLS - WARMUP):
        call()
    grown = _memory(device) - before
    # CPU: RSS moves by the allocator's whims (a few MB); a leak of a tensor per call shows
    # over 10,000 calls (>= 10 MB). CUDA: the caching allocator's count is exact.
    assert grown <= (8 * 2**20 if device == "cpu" else 0), f"{op} on {device}: grew by {grown} bytes"
