"""Farthest-point sampling by shape: how each cloud is cut, the median time of fullgraph.fps
per backend ("cuda": one thread-block cluster a cloud; "triton": parts exchanging through L2)
over CUDA-event timings and the time per sample (the latency floor of the loop); small shapes
are checked against the torch loop. ``--sweep``: the shapes again on the cuda kernel with each
block size (the Triton kernel's MIN_SLICE and POINTS_PER_WARP were swept in session 12's run Y:
benchmarks/results/h100-torch2.11/session12/fps-shapes-run-Y.log).

    python benchmarks/fps_shapes.py [--sweep] > fps-shapes.log     (needs a CUDA device)
"""

from __future__ import annotations

import sys

import torch

import fullgraph
from fullgraph.bench.timing import time_call
from fullgraph.ops import sampling, sampling_cuda

SHAPES = [(32, 1024, 512), (128, 2048, 512), (64, 4096, 1024), (16, 16384, 4096), (1, 16384, 4096),
          (4, 65536, 2048), (1, 100_000, 4096), (1, 1_000_000, 8192), (2, 1_000_000, 8192)]  # clouds, points, samples


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    clusters = sampling_cuda.available("cuda")
    for batch, size, count in SHAPES:
        measure(batch, size, count, "triton")
        if clusters and size <= sampling_cuda.max_points():
            measure(batch, size, count, "cuda")
    if "--sweep" in sys.argv:
        for threads in sampling_cuda.THREAD_CHOICES if clusters else ():
            sampling_cuda.THREAD_CHOICES = (threads,)
            for batch, size, count in SHAPES:
                if sampling_cuda.threads_for(size) is not None:
                    print(f"cuda, {threads} threads a block:", end=" ")
                    measure(batch, size, count, "cuda")


def measure(batch: int, size: int, count: int, backend: str) -> None:
    """Print the median time of one shape (clouds, points, samples) on ``backend`` and how it was cut."""
    x = torch.rand(batch, size, 3, device="cuda", generator=torch.Generator("cuda").manual_seed(size))
    if backend == "cuda":
        threads = sampling_cuda.threads_for(size)
        cut = f"clusters of {-(-size // (threads * sampling_cuda.POINTS_PER_THREAD))} x {threads} threads"
    else:
        parts, length, block = sampling._slices(batch, size, 3, sampling._programs(x.device))
        cut = f"parts {parts} x {length} " + ("resident" if block == length else f"streamed by {block}")

    def run(backend=backend):
        return fullgraph.fps(x, n_samples=count, random_start=False, backend=backend)
    ms = time_call(run, x.device, warmup=2, runs=7).median_ms
    check = f" same as torch: {bool(torch.equal(run(), run('torch')))}" if batch * size <= 100_000 else ""
    print(f"{backend} {batch}x{size}->{count}: {cut}: {ms:.2f} ms, {1000 * ms / count:.2f} us/sample{check}",
          flush=True)


if __name__ == "__main__":
    main()
