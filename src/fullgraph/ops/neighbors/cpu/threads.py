"""Threads of the neighbour operators' CPU calls when other processes share the cores.

torch's intra-op threads meet at the end of every parallel operator; with more runnable
threads than cores one of them is often descheduled there while the others spin for it, and a
call made of dozens of operators slows down many times (2-core CPU, three busy processes
beside: 16 x 256^2 D=64 k=16 4.5 -> 37-61 ms on 2 threads, 17-25 on 1; 2 x 64 x 300 D=16 0.5
-> 18-36 ms on 2). Each call of at least JUDGED_MIN_SECONDS measures the cores it got (the
process's CPU time over the wall time): below CONTENDED_SHARE of a core per thread the
following calls run on one thread, until FREE_CALLS calls in a row got a whole core again.
Outside those calls torch's own setting stands (``torch.set_num_threads``).
"""

from __future__ import annotations

import time

import torch

# Calls this short are not judged (timer resolution, and single-threaded anyway).
JUDGED_MIN_SECONDS = 2e-3
# ... and the runs of calls the C++ operators judge together (``csrc/cores.h``): the process's CPU
# time counts another thread's share only at scheduler ticks (~4 ms), so runs of 2 ms of calls
# of ~0.1-1 ms on quiet cores read ~1 core on 2 threads and were judged shared.
JUDGED_RUN_SECONDS = 2e-2
# Cores per thread below which the cores are shared (quiet 2-core CPU: 0.9-1.4 per thread on 2
# threads; three busy processes beside: 0.3-0.4), and above which one thread had its core.
CONTENDED_SHARE, FREE_SHARE, FREE_CALLS = 0.5, 0.9, 3


class _Cores:
    """What the last calls found: ``shared`` (run on one thread) and the calls in a row since
    that got a whole core."""

    shared = False
    free_calls = 0


_CORES = _Cores()
_clocks = (time.perf_counter, time.process_time)  # (wall, the process's CPU time)


def shared() -> bool:
    """Whether the CPU calls now run on one thread (the last judged calls found the cores shared)."""
    return _CORES.shared


def _judge(share: float, threads: int) -> None:
    if _CORES.shared:
        _CORES.free_calls = _CORES.free_calls + 1 if share >= FREE_SHARE else 0
        if _CORES.free_calls >= FREE_CALLS:
            _CORES.shared, _CORES.free_calls = False, 0
    elif threads > 1 and share < CONTENDED_SHARE * threads:
        _CORES.shared, _CORES.free_calls = True, 0


class fitted:
    """``with fitted(like):`` the block (one operator call on tensors like ``like``) on the
    threads the cores allow: CPU tensors only; torch's thread count restored after. (A class,
    not a generator: tiny calls pay its cost on every call.)"""

    __slots__ = ("threads", "narrowed", "wall", "cpu")

    def __init__(self, like: torch.Tensor):
        threads = torch.get_num_threads()
        self.threads = None if like.device.type != "cpu" or (threads == 1 and not _CORES.shared) else threads

    def __enter__(self) -> None:
        if self.threads is None:
            return
        self.narrowed = _CORES.shared
        if self.narrowed:
            torch.set_num_threads(1)
        self.wall, self.cpu = _clocks[0](), _clocks[1]()

    def __exit__(self, *exception) -> None:
        if self.threads is None:
            return
        wall, cpu = _clocks[0]() - self.wall, _clocks[1]() - self.cpu
        if self.narrowed:
            torch.set_num_threads(self.threads)
        if wall >= JUDGED_MIN_SECONDS:
            _judge(cpu / wall, 1 if self.narrowed else self.threads)
