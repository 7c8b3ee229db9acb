"""Timing and memory measurement: CUDA events on GPUs, ``torch.utils.benchmark`` on CPUs."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_PROC = Path("/proc/self")
# Blocks of calls on CPUs last at least this long (torch.utils.benchmark sizes them).
CPU_MIN_RUN_S = 0.2
# A row whose 90th percentile exceeds its 10th by more than this factor is flagged: the
# machine was busy (another process on a core, frequency changes) and the median may mislead.
NOISY_SPREAD = 2.0


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int
    threads: int | None = None  # CPU: the intra-op threads the calls ran with

    @property
    def noisy(self) -> bool:
        return self.p90_ms > NOISY_SPREAD * self.p10_ms


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cuda_times(fn, runs: int, queued: bool) -> list[float]:
    """Per-call times (ms) between CUDA events around each call. ``queued``: the calls follow
    one another without waiting, as a training loop's steps do, and the events are read at the
    end, so the host's work for a call overlaps the GPU's for the one before (a call's GPU time
    where the host keeps ahead); else each call starts on an idle GPU and its time includes the
    host's latency up to its launch."""
    events = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if not queued:
            end.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _cpu_times(fn, runs: int, threads: int) -> list[float]:
    """Per-call times (ms), one per block: ``torch.utils.benchmark`` sizes the blocks
    (adaptively, so that each lasts long enough to time) at a fixed thread count."""
    from torch.utils import benchmark

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    first = timer.blocked_autorange(min_run_time=CPU_MIN_RUN_S)
    times = list(first.times)
    while len(times) < runs:
        times += timer.timeit(first.number_per_run).times
    return [t * 1e3 for t in times]


def _wall_times(fn, runs: int) -> list[float]:
    """Per-call wall times (ms) of exactly ``runs`` calls."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def time_call(fn, device: torch.device, warmup: int, runs: int, collective: bool = False,
              queued: bool = True) -> Timing:
    """Per-call times of ``fn()`` after ``warmup`` calls: median and 10th/90th percentiles of
    ``runs`` samples (at least; on CPUs each sample is a block's mean per call).
    ``collective``: every rank of a process group calls ``fn`` in step, so exactly ``runs``
    calls are timed (CPU blocks are sized per process, which would leave ranks waiting).
    ``queued`` (CUDA): calls back to back, as a loop runs them; False: each call waits for the
    one before to finish (its time then includes the host's launch latency)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    threads = torch.get_num_threads() if device.type == "cpu" else None
    if device.type == "cuda":
        times = _cuda_times(fn, runs, queued)
    else:
        times = _wall_times(fn, runs) if collective else _cpu_times(fn, runs, threads)
    return _timing(times, threads)


# Side by side (``time_side_by_side``): the calls of a group timed in this many rounds, each a
# block of every call in turn, so that a busy spell of the machine falls on all of them alike.
SIDE_BY_SIDE_ROUNDS = 5


def time_side_by_side(fns: list, warmup: int, runs: int, threads: int | None,
                      device: torch.device = torch.device("cpu")) -> list[Timing]:
    """``time_call``'s timings of several calls taken in turns: SIDE_BY_SIDE_ROUNDS rounds
    time a block of each call in order until every call has ``runs`` samples. On CPUs each
    call's block size is found once (``torch.utils.benchmark``) and a sample is a block's mean;
    on GPUs a sample is one call between CUDA events, queued. On a shared 2-core machine the
    ratios of calls timed minutes apart varied by 1.5x; taken in turns they move together (as
    host-bound GPU calls do when the host is busy)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    synchronize(device)
    per_round = max(1, -(-runs // SIDE_BY_SIDE_ROUNDS))
    times: list[list[float]] = [[] for _ in fns]
    if device.type == "cuda":
        for _ in range(SIDE_BY_SIDE_ROUNDS):
            for fn, found in zip(fns, times):
                found += _cuda_times(fn, per_round, queued=True)
        return [_timing(found, None) for found in times]
    from torch.utils import benchmark

    timers = [benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads) for fn in fns]
    numbers = [timer.blocked_autorange(min_run_time=CPU_MIN_RUN_S / SIDE_BY_SIDE_ROUNDS).number_per_run
               for timer in timers]
    for _ in range(SIDE_BY_SIDE_ROUNDS):
        for timer, number, found in zip(timers, numbers, times):
            found += [timer.timeit(number).times[0] * 1e3 for _ in range(per_round)]
    return [_timing(found, threads) for found in times]


def _timing(times: list[float], threads: int | None) -> Timing:
    deciles = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return Timing(statistics.median(times), deciles[0], deciles[-1], len(times), threads)


def first_call_seconds(fn, device: torch.device) -> float:
    """Wall time of the first call, compilation included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


# The longest a variant's kernels are waited for while they compile in the background.
WARM_UP_LIMIT_S = 900.0


def warm_up_seconds(fn, device: torch.device, limit_s: float = WARM_UP_LIMIT_S) -> float | None:
    """After the first call: seconds until a call runs with every kernel of its path compiled,
    calling ``fn`` again while kernels compile in the background (``fullgraph._background``: the
    calls meanwhile take a path of torch's operators, the "warm-up window", which the timed
    calls after this leave out); None where nothing compiled in the background. Each call
    may meet its path's next kernel, so it ends at the first call that left none compiling."""
    from .. import _background

    if not _background.pending():
        return None
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        while _background.pending() and time.perf_counter() - start < limit_s:
            time.sleep(0.05)
        fn()
        synchronize(device)
        if not _background.pending():
            break
    return time.perf_counter() - start


class PeakMemory:
    """Peak memory above the level at entry, in bytes: the CUDA allocator's peak on GPUs,
    the process's resident high-water mark on Linux CPUs (None where unavailable)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: int | None = None

    def __enter__(self):
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = _resident_kib("VmRSS")
            try:  # "5" resets the kernel's high-water mark of this process (Linux).
                (_PROC / "clear_refs").write_text("5")
            except OSError:
                self._base = None
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self._base is not None:
            peak = _resident_kib("VmHWM")
            self.bytes = None if peak is None else max(0, peak - self._base) * 1024
        return False


def _resident_kib(field: str) -> int | None:
    try:
        for line in (_PROC / "status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None
