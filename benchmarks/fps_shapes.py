"""Farthest-point sampling by shape: how each cloud is cut, the median time of fullgraph.fps
per backend ("cuda": one thread-block cluster a cloud, cut as the kernel chooses; "triton":
parts exchanging through L2) over CUDA-event timings and the time per sample (the latency
floor of the loop); small shapes are checked against the torch loop; for the seed shape, the
parts of a call (the kernel alone, its fixed cost at 2 samples, the eager call with its host
time, a CUDA-graph replay). ``--sweep``: the cuda
kernel's shapes again in clusters of each size, with and without the cloud's copy in shared
memory (the Triton kernel's MIN_SLICE and POINTS_PER_WARP were swept in session 12's run Y:
benchmarks/results/h100-torch2.11/session12/fps-shapes-run-Y.log).

    python benchmarks/fps_shapes.py [--sweep] > fps-shapes.log     (needs a CUDA device)
"""

from __future__ import annotations

import sys

import torch

import fullgraph
from fullgraph.bench.timing import time_call
from fullgraph.ops.sampling import api as sampling
from fullgraph.ops.sampling.cuda import backend as sampling_cuda

SHAPES = [(32, 1024, 512), (128, 2048, 512), (64, 4096, 1024), (16, 16384, 4096), (1, 16384, 4096), (32, 16384, 4096),
          (4, 65536, 2048), (1, 100_000, 4096), (1, 1_000_000, 8192), (2, 1_000_000, 8192)]  # clouds, points, samples


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    clusters = sampling_cuda.available("cuda")
    for batch, size, count in SHAPES:
        measure(batch, size, count, "triton")
        if clusters and size <= sampling_cuda.max_points():
            measure(batch, size, count, "cuda")
    if clusters:
        call_parts(16, 16384, 4096)
    if "--sweep" in sys.argv:
        for batch, size, count in SHAPES if clusters else ():
            for cluster in range(1, sampling_cuda.MAX_CLUSTER + 1):
                if size <= sampling_cuda.max_points() and -(-size // cluster) <= 8 * 1024:
                    for shared_copy in (True, False):
                        measure(batch, size, count, "cuda", cluster=cluster, shared_copy=shared_copy)


def call_parts(batch: int, size: int, count: int) -> None:
    """Print where the time of one fullgraph.fps call on the cuda backend goes."""
    from fullgraph import graphs

    x = torch.rand(batch, size, 3, device="cuda", generator=torch.Generator("cuda").manual_seed(size))
    eager = lambda: fullgraph.fps(x, n_samples=count, random_start=False, backend="cuda")  # noqa: E731
    graph, _ = graphs.capture(eager, x.device)
    parts = {"kernel (the extension's operator)": lambda: sampling_cuda.farthest_points(x, None, None, count),
             "fixed cost (2 samples)": lambda: sampling_cuda.farthest_points(x, None, None, 2),
             "eager fullgraph.fps": eager, "CUDA-graph replay": graph.replay}
    for label, run in parts.items():
        print(f"{batch}x{size}->{count} {label}: {time_call(run, x.device, warmup=3, runs=41).median_ms:.3f} ms",
              flush=True)


def measure(batch: int, size: int, count: int, backend: str, **cut) -> None:
    """Print the median time of one shape (clouds, points, samples) on ``backend`` and how it was cut
    (``cut``: the cuda kernel's cluster and shared_copy; none: as it chooses)."""
    x = torch.rand(batch, size, 3, device="cuda", generator=torch.Generator("cuda").manual_seed(size))
    if backend == "cuda":
        label = ", ".join(f"{k} {v}" for k, v in cut.items()) or "cut as the kernel chooses"

        def run():
            return sampling_cuda.farthest_points(x, None, None, count, **cut)
    else:
        parts, length, block = sampling._slices(batch, size, 3, sampling._programs(x.device))
        label = f"parts {parts} x {length} " + ("resident" if block == length else f"streamed by {block}")

        def run():
            return fullgraph.fps(x, n_samples=count, random_start=False, backend=backend)
    ms = time_call(run, x.device, warmup=2, runs=7).median_ms
    want = fullgraph.fps(x, n_samples=count, random_start=False, backend="torch") if batch * size <= 100_000 else None
    check = "" if want is None else f" same as torch: {bool(torch.equal(run(), want))}"
    print(f"{backend} {batch}x{size}->{count}: {label}: {ms:.2f} ms, {1000 * ms / count:.2f} us/sample{check}",
          flush=True)


if __name__ == "__main__":
    main()
