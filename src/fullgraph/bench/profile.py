"""``fullgraph profile``: where one call of each variant of a workload spends its time, from
``torch.profiler`` (kernels and operators by self time, on the GPU and on the host)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from .runner import selected
from .workloads.base import WORKLOADS


def _synchronized(fn: Callable[[], object], device: torch.device) -> None:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_call(fn: Callable[[], object], device: torch.device, warmup: int = 2, rows: int = 12) -> str:
    """The profiler's table of one call of ``fn`` after ``warmup`` calls (compilation and
    capture happen there), sorted by self time on ``device``."""
    for _ in range(warmup):
        _synchronized(fn, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        _synchronized(fn, device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return profiler.key_averages().table(sort_by=key, row_limit=rows)


def profile_workload(name: str, size: str, device: torch.device, variants: tuple[str, ...] = (),
                     warmup: int = 2, rows: int = 12):
    """Yields (variant, phase, table) for each selected variant of workload ``name`` at ``size``."""
    workload = WORKLOADS[name]
    for case in workload.build(workload.sizes[size], device):
        if not selected(case.variant, variants, workload.baseline):
            continue
        for phase, fn in (("forward", case.forward), ("train", case.train_step)):
            if fn is not None:
                yield case.variant, phase, profile_call(fn, device, warmup, rows)
