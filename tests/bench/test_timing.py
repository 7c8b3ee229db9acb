"""Timing statistics stay within what was measured, even for few runs."""

from __future__ import annotations

import time

import torch

from fullgraph.bench.timing import time_call


def test_percentiles_lie_within_the_runs():
    delays = iter([0.0, 0.02] * 10)
    timing = time_call(lambda: time.sleep(next(delays)), torch.device("cpu"), warmup=0, runs=2)
    assert 0 <= timing.p10_ms <= timing.median_ms <= timing.p90_ms
