"""Feature-space kNN on CUDA: the "dense" backend against cdist + topk, the Triton search and
the reference, eager and graphed, with the rows its certificate sends back (normal clouds,
shifted by 1000, clustered), then a torch.profiler table of one call per small shape.

    python benchmarks/dense_profile.py > dense.log     (needs a CUDA device)

CUDA-event medians after warm-up, all in one process.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import fullgraph
from fullgraph.bench.timing import time_call
from fullgraph.ops.neighbors import dense

SHAPES = ((16, 256, 256, 64, 20), (32, 1024, 1024, 64, 20), (8, 4096, 4096, 64, 20), (1, 10000, 1000000, 128, 10),
          (1, 20000, 200000, 16, 10))
FAILED: list[tuple[int, int]] = []


def median_ms(fn, runs=30) -> float:
    return time_call(fn, torch.device("cuda"), warmup=3, runs=runs).median_ms


def graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _count_failed_rows():
    redo = dense._redo

    def counting(*args):
        failed = args[8]
        if not torch.cuda.is_current_stream_capturing():
            FAILED.append((int(failed.sum()), failed.numel()))
        return redo(*args)

    dense._redo = counting


def main() -> None:
    _count_failed_rows()
    generator = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for batch, rows, columns, dim, k in SHAPES:
        q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
        r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
        runs = 10 if rows * columns > 1e8 else 30
        row = {"cdist+topk": median_ms(lambda: torch.topk(torch.cdist(q, r), k, largest=False), runs)}
        for backend in ("dense", "triton", "torch"):
            too_slow = batch * rows * columns * (dim if backend == "torch" else 3) > 3e9
            if backend != "dense" and too_slow:
                continue
            row[backend] = median_ms(lambda: fullgraph.knn(q, r, k, backend=backend), runs)
        FAILED.clear()
        clusters = torch.randn(batch, 50, dim, device="cuda", generator=generator)
        clustered = clusters[:, torch.randint(0, 50, (columns,), device="cuda", generator=generator)]
        clustered = clustered + 0.1 * torch.randn(batch, columns, dim, device="cuda", generator=generator)
        for query, ref in ((q, r), (q + 1000, r + 1000), (clustered[:, :rows], clustered)):
            fullgraph.knn(query, ref, k, backend="dense")
        row["failed rows (normal, +1000, clustered)"] = list(FAILED)
        for name, fn in (("dense graphed", lambda: fullgraph.knn(q, r, k, backend="dense")),
                         ("cdist+topk graphed", lambda: torch.topk(torch.cdist(q, r), k, largest=False))):
            try:
                row[name] = median_ms(graphed(fn), runs)
            except torch.OutOfMemoryError:
                row[name] = "out of memory"
        cells = (f"{n} {v:.3f} ms" if isinstance(v, float) else f"{n} {v}" for n, v in row.items())
        print(f"B={batch} M={rows} N={columns} D={dim} k={k}: " + ", ".join(cells), flush=True)
        if batch * rows * columns <= 2e8:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fullgraph.knn(q, r, k, backend="dense")
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
            print(table, flush=True)


if __name__ == "__main__":
    main()
