"""Run a workload's variants in one process and collect JSON-ready rows."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess

import torch

from .timing import PeakMemory, first_call_seconds, time_call, time_side_by_side, warm_up_seconds
from .workloads import BASELINE, WORKLOADS


def environment(device: torch.device) -> dict:
    """Device name and software versions recorded with every row."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"
    triton = None
    if importlib.util.find_spec("triton") is not None:
        import triton

        triton = triton.__version__
    ranks = {}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ranks = {"ranks": torch.distributed.get_world_size()}
    # (first_call_s then counts the kernels' compilation, which a user's first call leaves to the background)
    foreground = {"background_compile": False} if os.environ.get("FULLGRAPH_BACKGROUND_COMPILE") == "0" else {}
    return {
        "device": name,
        **ranks,
        **foreground,
        "torch": torch.__version__,
        "triton": triton,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": _commit(),
    }


def _commit() -> str | None:
    """The git commit measured; FULLGRAPH_COMMIT names it where the tree has no .git."""
    if os.environ.get("FULLGRAPH_COMMIT"):
        return os.environ["FULLGRAPH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(__file__))
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _graph_counts(case) -> dict:
    """graphs and graph breaks torch.compile makes of an eager variant's declared call."""
    from ..explain import explain

    fn, args = case.explain
    with torch.no_grad():
        found = explain(fn, *args, generated_code=False)
    return {"graphs": found.graphs, "graph_breaks": len(found.breaks)}


def run_workload(name: str, size: str, device: torch.device, warmup: int, runs: int, on_step=None,
                 explain: bool = False, on_row=None, variants: tuple[str, ...] = ()) -> list[dict]:
    """Time every variant's forward and train step; ``on_step(description)`` reports progress and
    ``on_row(row)`` each finished row; ``explain``: add the graph and break counts of the variants
    that declare a call to explain; ``variants``: run only those whose name contains one of
    these words (case-insensitive), and the baseline the ratios need."""
    workload = WORKLOADS[name]
    params = workload.sizes[size]
    # Every variant compiles the same forward code on its own module: a cache entry each.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    env = environment(device)
    rows = []
    cases = workload.build(params, device)
    names = [case.variant for case in cases]
    if variants and not any(selected(n, variants, "") for n in names):  # before anything runs
        raise ValueError(f"--variants: no variant contains {' or '.join(map(repr, variants))}; "
                         f"its variants are {', '.join(map(repr, names))}")
    chosen = [case for case in cases if selected(case.variant, variants, workload.baseline)]
    pending = []  # (row, forward, case) of the group being gathered, timed side by side when it ends
    for i, case in enumerate(chosen):
        grouped = case.group is not None and not workload.collective
        # torch.compile caches per code object: variants that run the same model code
        # (an implementation switch) would otherwise reuse, or be guarded out of, the
        # previous variant's graphs. Each variant compiles from scratch (a group's once).
        if not (grouped and i and chosen[i - 1].group == case.group):
            torch._dynamo.reset()
        for phase, fn in (("forward", case.forward), ("train", case.train_step)):
            if fn is None:
                continue
            if on_step:
                on_step(f"{case.variant} / {phase}")
            row = {"workload": name, "size": size, "params": params, "variant": case.variant, "phase": phase, **env}
            try:
                row["first_call_s"] = first_call_seconds(fn, device)
                warm_up = warm_up_seconds(fn, device)
                if warm_up is not None:
                    row["warm_up_s"] = warm_up
                if grouped and phase == "forward":
                    with PeakMemory(device) as memory:
                        for _ in range(max(1, warmup)):
                            fn()
                    row["peak_memory_bytes"] = memory.bytes
                    pending.append((row, fn, case))
                    continue
                with PeakMemory(device) as memory:
                    timing = time_call(fn, device, warmup, runs, collective=workload.collective)
                _timed(row, timing, memory.bytes)
                _checked(row, case, phase, explain)
            except Exception as error:  # a failing variant is reported, not fatal
                row["error"] = _error(error)
            rows.append(row)
            if on_row:
                on_row(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if pending and (i + 1 == len(chosen) or chosen[i + 1].group != case.group):
            _side_by_side(pending, device, runs, explain, rows, on_step, on_row)
            pending = []
    _add_ratios(rows, WORKLOADS[name].baseline)
    return rows


def _timed(row: dict, timing, peak_memory_bytes) -> None:
    row.update(median_ms=timing.median_ms, p10_ms=timing.p10_ms, p90_ms=timing.p90_ms, runs=timing.runs,
               noisy=timing.noisy, peak_memory_bytes=peak_memory_bytes)
    if timing.threads is not None:
        row["threads"] = timing.threads


def _checked(row: dict, case, phase: str, explain: bool) -> None:
    if phase == "forward" and case.check is not None:
        row.update(case.check())
    if phase == "forward" and explain and case.explain is not None:
        row.update(_graph_counts(case))


def _error(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


def _side_by_side(pending, device, runs: int, explain: bool, rows: list, on_step, on_row) -> None:
    """Time a group's forward calls in turns (``time_side_by_side``) and finish their rows."""
    if on_step:
        on_step(f"{len(pending)} variants side by side")
    try:
        # (each call warmed up as its row was gathered)
        threads = torch.get_num_threads() if device.type == "cpu" else None
        timings = time_side_by_side([fn for _, fn, _ in pending], 0, runs, threads, device)
    except Exception as error:
        timings = [error] * len(pending)
    for (row, _, case), timing in zip(pending, timings):
        try:
            if isinstance(timing, Exception):
                raise timing
            _timed(row, timing, row.pop("peak_memory_bytes"))
            _checked(row, case, "forward", explain)
        except Exception as error:  # a failing variant is reported, not fatal
            row["error"] = _error(error)
        rows.append(row)
        if on_row:
            on_row(row)


def selected(variant: str, words: tuple[str, ...], baseline: str) -> bool:
    """Whether ``variant`` runs when the user asked for ``words`` (none: every variant)."""
    return not words or variant == baseline or any(w.lower() in variant.lower() for w in words)


def _add_ratios(rows: list[dict], baseline_variant: str = BASELINE) -> None:
    """speedup = baseline median / variant median, per phase (> 1 is faster than eager)."""
    baseline = {r["phase"]: r.get("median_ms") for r in rows if r["variant"] == baseline_variant}
    for row in rows:
        base = baseline.get(row["phase"])
        row["baseline"] = baseline_variant
        row["speedup_vs_eager"] = base / row["median_ms"] if base and row.get("median_ms") else None
