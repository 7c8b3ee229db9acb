"""Timing statistics stay within what was measured, even for few runs."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from fullgraph import _background
from fullgraph.bench.timing import Timing, time_call, warm_up_seconds


def test_percentiles_lie_within_the_runs():
    delays = itertools.cycle([0.0, 0.02])
    timing = time_call(lambda: time.sleep(next(delays)), torch.device("cpu"), warmup=0, runs=2)
    assert 0 <= timing.p10_ms <= timing.median_ms <= timing.p90_ms


def test_cpu_times_come_from_torch_utils_benchmark_at_a_fixed_thread_count():
    calls = []
    timing = time_call(lambda: calls.append(1), torch.device("cpu"), warmup=0, runs=5)
    assert timing.runs >= 5 and timing.threads == torch.get_num_threads()
    assert len(calls) > 100  # blocks of many calls each: sized adaptively, not one call per sample
    assert not timing.noisy or timing.p90_ms > 2 * timing.p10_ms


def test_a_busy_machine_is_flagged():
    """Calls that take 1 ms or 8 ms in turn (as when another process takes the core): the spread
    exceeds 2x and the row says so; steady calls are not flagged. Timed call by call (the
    collective path), since CPU blocks of several calls would average the two apart."""
    delays = itertools.cycle([0.001, 0.008])
    noisy = time_call(lambda: time.sleep(next(delays)), torch.device("cpu"), warmup=0, runs=12,
                      collective=True)
    assert noisy.runs == 12 and noisy.noisy and noisy.p90_ms > 2 * noisy.p10_ms
    steady = Timing(median_ms=1.0, p10_ms=0.95, p90_ms=1.1, runs=10)
    assert not steady.noisy


def test_the_table_stays_whole_in_80_columns():
    from rich.console import Console

    from fullgraph.bench import report

    base = {"workload": "diffusion-policy", "size": "seed", "params": {"batch": 1, "steps": 100},
            "device": "x86_64 CPU, 2 cores", "threads": 2, "torch": "2.13.0", "phase": "forward",
            "peak_memory_bytes": 20 * 2**20, "first_call_s": 14.58, "speedup_vs_eager": 10.4, "baseline": "eager"}
    rows = [dict(base, variant="fullgraph graphed loop, compiled matmul-conv bf16 U-Net", median_ms=48.443,
                 p10_ms=48.2, p90_ms=48.9),
            dict(base, variant="document compiled+graphs", median_ms=204.581, p10_ms=90.0, p90_ms=230.0, noisy=True),
            {key: base[key] for key in ("workload", "size", "params", "device", "threads", "torch", "phase")}
            | {"variant": "plain compiled", "error": "InductorError: TypeError: cannot determine truth value of "
                                                     "Relational: 3*s37*s40 < 5 " + "x" * 80}]
    console = Console(width=80, record=True)
    console.print(report.table(rows))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for cell in ("48.443", "204.581", "1.01x", "2.56x!", "10.4", "14.58", "2 threads", "compiled+graphs"):
        assert cell in text, cell
    assert "machine was busy" in text
    assert "failed (1)" in text and "failed (1): plain compiled / forward: InductorError" in text
    assert "x" * 40 in text.replace("\n", "").replace(" ", "")  # the whole message, wrapped, not cut


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_queued_calls_hide_the_host_latency_behind_the_gpu():
    def call():  # ~3 ms on the host, then ~5+ ms on the GPU
        time.sleep(0.003)
        torch.cuda._sleep(10_000_000)

    queued = time_call(call, torch.device("cuda"), warmup=2, runs=10)
    waited = time_call(call, torch.device("cuda"), warmup=2, runs=10, queued=False)
    assert waited.median_ms > queued.median_ms + 2.0


def test_kernels_compiling_in_the_background_are_waited_for_before_timing():
    """After a first call that left a kernel compiling in the background, calls are repeated as
    compiles finish until one meets no new kernel (a path's kernels are met one after another);
    with nothing compiling there is nothing to wait for."""
    assert warm_up_seconds(lambda: None, torch.device("cpu")) is None
    calls = []

    def finish(marker):
        with _background._lock:
            _background._running.pop(marker, None)

    def call():  # the first two calls each meet a kernel that compiles for 0.05 s
        calls.append(len(calls))
        if len(calls) <= 2:
            marker = f"kernel {len(calls)}"
            with _background._lock:
                _background._running[marker] = None
            threading.Timer(0.05, finish, (marker,)).start()

    call()
    waited = warm_up_seconds(call, torch.device("cpu"), limit_s=30)
    assert calls == [0, 1, 2] and 0.1 <= waited < 30 and not _background.pending()


def test_the_warm_up_wait_is_a_column_where_rows_have_one():
    from fullgraph.bench import report

    row = {"workload": "w", "size": "s", "params": {}, "variant": "v", "phase": "forward", "device": "d",
           "torch": "t", "triton": None, "commit": "c", "median_ms": 1.0, "p10_ms": 1.0, "p90_ms": 1.0,
           "speedup_vs_eager": None, "peak_memory_bytes": None, "first_call_s": 0.5}
    text = report.markdown([row, {**row, "variant": "u", "warm_up_s": 12.5}])
    assert "warm-up s |" in text and "| 12.50 |" in text
    assert "warm-up" not in report.markdown([row])


def test_calls_side_by_side_are_timed_in_turns_and_keep_their_own_times():
    from fullgraph.bench import timing as timing_module

    order = []
    fast = lambda: order.append("fast")  # noqa: E731
    slow = lambda: (order.append("slow"), time.sleep(0.002))  # noqa: E731
    found = timing_module.time_side_by_side([fast, slow], warmup=1, runs=6, threads=1)
    assert min(t.runs for t in found) >= 6 and found[1].median_ms > 1.5 > found[0].median_ms
    # each round times a block of every call before the next round starts
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert switches >= 2 * timing_module.SIDE_BY_SIDE_ROUNDS - 1


def test_a_cpu_group_gets_one_row_a_variant_in_its_order():
    from fullgraph.bench import runner
    from fullgraph.bench.workloads import base

    calls = {"a": 0, "b": 0}

    def counted(name):
        return lambda: calls.__setitem__(name, calls[name] + 1)

    cases = [base.Case("baseline", counted("a")), base.Case("g: one", counted("a"), group="g"),
             base.Case("g: two", counted("b"), group="g")]
    base.register(base.Workload("side-by-side-test", "grouped cases", {"tiny": {}}, lambda params, device: cases,
                                baseline="baseline"))
    try:
        rows = runner.run_workload("side-by-side-test", "tiny", torch.device("cpu"), warmup=1, runs=5)
    finally:
        del base.WORKLOADS["side-by-side-test"]
    assert [r["variant"] for r in rows] == ["baseline", "g: one", "g: two"]
    assert all(r["runs"] >= 5 and r["median_ms"] > 0 and "error" not in r for r in rows)
    assert calls["b"] > 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_calls_side_by_side_keep_their_own_times():
    from fullgraph.bench import timing as timing_module

    short = lambda: torch.cuda._sleep(1_000_000)  # noqa: E731
    long = lambda: torch.cuda._sleep(10_000_000)  # noqa: E731
    found = timing_module.time_side_by_side([short, long], warmup=1, runs=10, threads=None,
                                            device=torch.device("cuda"))
    assert min(t.runs for t in found) >= 10 and found[1].median_ms > 5 * found[0].median_ms
