"""What one replayed CUDA graph spends its time on: the kernels of a replay (count, time,
share), the replay's time against the sum of its kernels (the gaps), and a stated floor;
and ``graphed_ms``, a call's time from a graph of it. Shared by the scripts in this folder."""

from __future__ import annotations

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from fullgraph.bench.timing import time_call

REPLAYS = 20


def graphed_ms(call, calls: int = 1, runs: int = 20) -> float:
    """Milliseconds a call takes, from a CUDA graph of ``calls`` calls (warmed up first; the
    median of ``runs`` replays): the GPU's work alone, no host time."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    return time_call(graph.replay, torch.device("cuda"), warmup=3, runs=runs).median_ms / calls


def report(run, title: str, floor: str, sequence: bool = False) -> None:
    """Print the profile of ``run()`` (a replay, already warmed up) under ``title``; with
    ``sequence``, also the kernels of the last replay in the order they ran (start, gap
    before, duration, name), to attribute each to the code that launched it."""
    per_step = time_call(run, torch.device("cuda"), warmup=0, runs=50).median_ms
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernel_us = sum(e.device_time_total for e in kernels) / REPLAYS
    launches = sum(e.count for e in kernels) / REPLAYS
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {title}")
    print(f"one replay: {per_step * 1000:.1f} us (CUDA events, median of 50 replays)")
    print(f"kernels per replay: {launches:.0f}, their time summed: {kernel_us:.1f} us; "
          f"gaps and launch latency inside the graph: {per_step * 1000 - kernel_us:.1f} us")
    print(f"floor: {floor}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    if sequence:
        _print_sequence(prof, round(launches))


def _print_sequence(prof, per_replay: int) -> None:
    """The last ``per_replay`` device activities of the profile, in order."""
    activities = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                        key=lambda e: e.time_range.start)[-per_replay:]
    if not activities:
        return
    origin = previous_end = activities[0].time_range.start
    print(f"the last replay's {len(activities)} kernels in order (us: start, gap before, duration):")
    for event in activities:
        start, end = event.time_range.start, event.time_range.end
        print(f"{start - origin:8.1f} {start - previous_end:6.1f} {end - start:7.1f}  {event.name[:110]}")
        previous_end = end
