"""The "cuda" backend of farthest-point sampling: a C++/CUDA extension
(``csrc/farthest_points.cu``: the build a wheel carries, ``_fps.so``, else compiled on first
use) that runs each cloud on one thread-block cluster (compute capability 9.0 and later).

A cloud is cut into up to 8 slices of 8 points a thread, a block each, in registers. For every
sample each warp posts its candidate (distance and index in one 64-bit word) into the shared
memory of every block of the cluster with st.async, counted on that block's mbarrier, and every
warp reduces the cluster's candidates itself: no block or cluster barrier a sample (0.55-0.7
us a sample on an H100, where the Triton kernel's parts exchange theirs through L2 at about
1.5 us). The winner's coordinates come from a copy of the cloud in shared memory where it fits.
The kernel chooses the blocks a cloud so that all clouds' clusters run at once where it can,
and it also finds the valid points and the power of two the coordinates are scaled by (a
cluster barrier before the loop), so a call is one launch and capture-safe. Clouds of at most
``MAX_POINTS`` points of D <= 4; the Triton kernel takes larger ones.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .... import backends
from ...._extension import ExtensionBuildError, build, carried, loaded_library, missing_tools

SOURCE = Path(__file__).parent / "csrc" / "farthest_points.cu"
PREBUILT = Path(__file__).parent / "_fps.so"  # where a wheel built with nvcc carries it (setup.py)
MAX_POINTS = 65_536  # kMaxPoints: an index takes 16 bits of the kernel's keys
MAX_CLUSTER = 8  # kMaxCluster: the portable cluster size
MAX_DIM = 4


def max_points() -> int:
    """The largest cloud one cluster holds."""
    return MAX_POINTS


_BUILD_FAILED = []  # set once a build failed here: "auto" then takes the Triton kernel


@functools.cache
def _capable(device_type: str) -> bool:
    return (device_type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
            and (carried(PREBUILT) or not missing_tools(with_cuda=True)))


def available(device_type: str) -> bool:
    """A GPU with thread-block clusters, and the kernel in the package or nvcc and a C++
    compiler to build it (not failed before in this process)."""
    return not _BUILD_FAILED and _capable(device_type)


# Under torch.compile "auto" resolves while tracing: the answer is a constant of the trace (the
# mark torch.compiler.assume_constant_result sets, as ops/lltm/api.py does for its backend).
available._dynamo_marked_constant = True


@functools.cache
def _load() -> None:
    try:
        build("fullgraph_fps", [SOURCE], with_cuda=True, what="fullgraph.fps: the CUDA extension",
              instead='use backend="triton"', prebuilt=PREBUILT)
    except ExtensionBuildError:
        _BUILD_FAILED.append(True)
        raise
    # The library's operator's shape, so that an exported program can hold it (api.decompositions).
    torch.library.register_fake("fullgraph_fps::farthest_points", _shape)


def _shape(x, lengths, start, count, cluster=0, shared_copy=True):
    return x.new_empty((x.shape[0], count), dtype=torch.int64)


def library() -> Path:
    """The file of the loaded extension (loading it, or building it, first): a C++ program that
    runs an AOTInductor package holding ``fullgraph_fps::farthest_points`` loads it
    (docs/deploy.md)."""
    _load()
    return loaded_library("_fps", "fullgraph_fps")


def farthest_points(x: torch.Tensor, lengths: torch.Tensor | None, start: torch.Tensor | None,
                    count: int, *, cluster: int = 0, shared_copy: bool = True) -> torch.Tensor:
    """idx [B, count] int64 of clouds x [B, N, D] (lengths [B] or None; -1 beyond an item's
    valid points) from the samples ``start`` [B] (None: each item's first valid point). The
    kernel finds the valid points and scales them itself: one launch. ``cluster`` (1 to 8
    blocks a cloud; 0: the kernel chooses) and ``shared_copy`` (False: winners' coordinates
    from global memory) are for tests and benchmarks."""
    batch, size, dim = x.shape
    if dim > MAX_DIM or size > MAX_POINTS:
        raise ValueError(f'x: backend="cuda" takes clouds of at most {MAX_POINTS} points of D <= {MAX_DIM}, '
                         f'got {size} points of D = {dim}; use backend="triton"')
    if not 0 <= cluster <= MAX_CLUSTER or (cluster and -(-size // cluster) > 8 * 1024):
        raise ValueError(f"cluster: expected 0 (choose) or 1 to {MAX_CLUSTER} blocks of at most 8,192 points, "
                         f"got {cluster} for {size} points")
    _load()
    contiguous = [None if t is None else t.contiguous() for t in (lengths, start)]
    return torch.ops.fullgraph_fps.farthest_points(x.float().contiguous(), *contiguous, count, cluster, shared_copy)


BACKEND = backends.Backend(
    "cuda", ops=("farthest_points",), devices=("cuda",), auto_devices=("cuda",),
    dtypes=(torch.float16, torch.bfloat16, torch.float32), dims=tuple(range(1, MAX_DIM + 1)),
    install="a GPU of compute capability 9.0 or later, and a wheel built with nvcc (or nvcc and a C++ compiler "
            "with ninja, to build the kernel)",
    available=available, implementation=farthest_points, note='computes in float32 (use backend="torch" for float64)',
    auto_when=lambda device_type, dtype, dim, points, size=None: points <= max_points(),
)
