"""Farthest-point sampling by shape: how each cloud is cut into parts, the median time of
fullgraph.fps (Triton) over CUDA-event timings and the time per sample (the latency floor of
the loop); small shapes are checked against the torch loop. ``--sweep``: the issue's two
shapes again with other slice sizes (sampling.MIN_SLICE) and warps (POINTS_PER_WARP).

    python benchmarks/fps_shapes.py [--sweep] > fps-shapes.log     (needs a CUDA device)
"""

from __future__ import annotations

import sys

import torch

import fullgraph
from fullgraph.bench.timing import time_call
from fullgraph.ops import sampling

SHAPES = [(32, 1024, 512), (128, 2048, 512), (64, 4096, 1024), (16, 16384, 4096), (1, 16384, 4096),
          (4, 65536, 2048), (1, 100_000, 4096), (1, 1_000_000, 8192), (2, 1_000_000, 8192)]  # clouds, points, samples


SWEEP = [(16, 16384, 4096), (1, 1_000_000, 8192)]


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for batch, size, count in SHAPES:
        measure(batch, size, count)
    if "--sweep" in sys.argv:
        for min_slice in (1024, 2048, 4096, 8192):
            for per_warp in (128, 256, 512):
                sampling.MIN_SLICE, sampling.POINTS_PER_WARP = min_slice, per_warp
                print(f"MIN_SLICE {min_slice}, POINTS_PER_WARP {per_warp}:", end=" ")
                for shape in SWEEP:
                    measure(*shape)


def measure(batch: int, size: int, count: int) -> None:
    """Print the median time of one shape (clouds, points, samples) and how it was cut."""
    x = torch.rand(batch, size, 3, device="cuda", generator=torch.Generator("cuda").manual_seed(size))
    parts, length, block = sampling._slices(batch, size, 3, sampling._programs(x.device))

    def run(backend="triton"):
        return fullgraph.fps(x, n_samples=count, random_start=False, backend=backend)
    ms = time_call(run, x.device, warmup=2, runs=7).median_ms
    check = f" same as torch: {bool(torch.equal(run(), run('torch')))}" if batch * size <= 100_000 else ""
    path = "resident" if block == length else f"streamed by {block}"
    print(f"{batch}x{size}->{count}: parts {parts} x {length} {path}: {ms:.2f} ms, "
          f"{1000 * ms / count:.2f} us/sample{check}", flush=True)


if __name__ == "__main__":
    main()
