"""The "cuda" backend of farthest-point sampling: a C++/CUDA extension
(``csrc/farthest_points.cu``, compiled on first use) that runs each cloud on one thread-block
cluster (compute capability 9.0 and later).

A cloud is cut into up to ``MAX_CLUSTER`` slices of ``POINTS_PER_THREAD`` points a thread, a
block each, in registers. For every sample the blocks post their candidates (distance,
index, coordinates) into each other's shared memory and pass the cluster's hardware barrier
once, where the Triton kernel's parts exchange theirs through L2 (about 1 us a sample). One
launch, no host read: capture-safe; the kernel also finds the valid points and the power of
two the coordinates are scaled by (a cluster barrier before the loop), so the call is one
launch. Clouds of at most ``max_points()`` points of D <= 4; the Triton kernel takes larger ones.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .. import backends
from .._extension import ExtensionBuildError, build, missing_tools

SOURCE = Path(__file__).parent / "csrc" / "farthest_points.cu"
THREAD_CHOICES = (128, 256, 512, 1024)  # a block's threads: the fewest whose cluster holds the cloud
POINTS_PER_THREAD = 8  # kPointsPerThread in the kernel
MAX_CLUSTER = 8  # kMaxCluster: the portable cluster size
MAX_DIM = 4


def max_points() -> int:
    """The largest cloud one cluster holds."""
    return max(THREAD_CHOICES) * POINTS_PER_THREAD * MAX_CLUSTER


def threads_for(size: int) -> int | None:
    """A block's threads for clouds of ``size`` points (None: more than a cluster holds)."""
    for threads in THREAD_CHOICES:
        if -(-size // (threads * POINTS_PER_THREAD)) <= MAX_CLUSTER:
            return threads
    return None


_BUILD_FAILED = []  # set once a build failed here: "auto" then takes the Triton kernel


@functools.cache
def _capable(device_type: str) -> bool:
    return (device_type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
            and not missing_tools(with_cuda=True))


def available(device_type: str) -> bool:
    """A GPU with thread-block clusters, and nvcc and a C++ compiler to build the kernel (not
    failed before in this process)."""
    return not _BUILD_FAILED and _capable(device_type)


# Under torch.compile "auto" resolves while tracing: the answer is a constant of the trace (the
# mark torch.compiler.assume_constant_result sets, as ops/lltm/api.py does for its backend).
available._dynamo_marked_constant = True


@functools.cache
def _load() -> None:
    try:
        build("fullgraph_fps", [SOURCE], with_cuda=True, what="fullgraph.fps: the CUDA extension",
              instead='use backend="triton"')
    except ExtensionBuildError:
        _BUILD_FAILED.append(True)
        raise


def farthest_points(x: torch.Tensor, lengths: torch.Tensor | None, start: torch.Tensor | None,
                    count: int) -> torch.Tensor:
    """idx [B, count] int64 of clouds x [B, N, D] (lengths [B] or None; -1 beyond an item's
    valid points) from the samples ``start`` [B] (None: each item's first valid point). The
    kernel finds the valid points and scales them itself: one launch."""
    batch, size, dim = x.shape
    threads = threads_for(size)
    if dim > MAX_DIM or threads is None:
        raise ValueError(f'x: backend="cuda" takes clouds of at most {max_points()} points of D <= {MAX_DIM}, '
                         f'got {size} points of D = {dim}; use backend="triton"')
    _load()
    contiguous = [None if t is None else t.contiguous() for t in (lengths, start)]
    return torch.ops.fullgraph_fps.farthest_points(x.float().contiguous(), *contiguous, count, threads)


BACKEND = backends.Backend(
    "cuda", ops=("farthest_points",), devices=("cuda",), auto_devices=("cuda",),
    dtypes=(torch.float16, torch.bfloat16, torch.float32), dims=tuple(range(1, MAX_DIM + 1)),
    install="a GPU of compute capability 9.0 or later, nvcc and a C++ compiler with ninja (to build the kernel)",
    available=available, implementation=farthest_points, note='computes in float32 (use backend="torch" for float64)',
    auto_when=lambda device_type, dtype, dim, size: size <= max_points(),
)
