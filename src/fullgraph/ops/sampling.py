"""Farthest-point sampling: torch_cluster's ``fps`` and PyTorch3D's ``sample_farthest_points``.

Each sample is the point farthest from those taken so far (squared Euclidean distance in
float32, float64 for float64 inputs; ties to the smaller index); the first is the item's
first valid point (``random_start=False``) or one drawn uniformly among its valid points.
Points beyond an item's length or with a non-finite coordinate are never taken.

The padded form (x [B, N, D], lengths) reads nothing back to the host: K iterations of a few
batched tensor operations, so it compiles and runs inside CUDA graphs (replayed, the K
iterations cost no launches). The flat form with a batch vector reads the item sizes once
(its output length depends on them), like torch_cluster.
"""

from __future__ import annotations

import math

import torch

from .. import _triton, _validate, backends
from .._triton import tl, triton
from .neighbors.batching import Padded, check_batch
from .neighbors.pairs import accumulation_dtype, valid_points
from .scaling import magnitude, safe_scale


def _starts(x, valid, random_start: bool, generator) -> torch.Tensor:
    """[B] int64: each item's first sample, uniform among its valid points or its first valid one."""
    batch, size = valid.shape
    if size == 0:
        return torch.zeros(batch, dtype=torch.int64, device=x.device)
    if random_start:
        draw = torch.rand((batch, size), generator=generator, device=x.device)
        return torch.where(valid, draw, -1.0).argmax(1)
    return valid.to(torch.int8).argmax(1)


def _prepared(x: torch.Tensor, lengths: torch.Tensor | None):
    """(points, valid): x in its accumulation dtype, scaled per item by a power of two
    (exact) into the unit ball so no squared distance overflows, 0 at invalid points; valid
    [B, N] bool."""
    valid = valid_points(x, lengths)
    acc = accumulation_dtype(x.dtype)
    batch, size = valid.shape
    largest = torch.where(valid, magnitude(x).to(acc), 0).amax(1) if size else x.new_zeros(batch, dtype=acc)
    return torch.where(valid[..., None], x.to(acc) / safe_scale(largest)[:, None, None], 0), valid


def _torch_loop(points: torch.Tensor, valid: torch.Tensor, start: torch.Tensor, count: int) -> torch.Tensor:
    """The reference: ``count`` iterations of a few batched tensor operations."""
    batch, size = valid.shape
    idx = torch.empty((batch, count), dtype=torch.int64, device=points.device)
    gap = torch.where(valid, math.inf, -1.0).to(points.dtype)  # squared distance to the nearest sample; -1: never taken
    items = torch.arange(batch, device=points.device)
    current = start
    for i in range(count):
        idx[:, i] = current
        if i + 1 == count or size == 0:
            break
        # Invalid points hold -1 below every distance: the minimum keeps them out.
        gap = torch.minimum(gap, (points - points[items, current][:, None, :]).square().sum(-1))
        current = gap.argmax(1)  # the first of the largest: ties go to the smaller index
    return idx


# Three ways to run the loop on a GPU, by cloud size (N x D, rounded up to powers of two):
# - resident: at most RESIDENT_ELEMENTS coordinates stay in one program's registers for
#   every iteration (one launch);
# - streamed: up to SPLIT_MIN_POINTS points, one program per cloud reads its cloud from L2 in
#   chunks of CHUNK points each iteration, the distances to the samples in a scratch buffer
#   (one launch);
# - split: larger clouds are cut into slices of SLICE points, a program each, one launch per
#   sample: each launch first reduces the slices' candidates of the last one (a single cloud
#   of 10^6 points must not run on one SM).
RESIDENT_ELEMENTS = 16384
CHUNK = 1024
SPLIT_MIN_POINTS = 1 << 16
SLICE = 8192

if triton is not None:

    @triton.jit
    def _distances(base, current, chunk_offs, size, gaps, dims, D: tl.constexpr):
        """Update the scratch distances of points ``chunk_offs`` with the sample ``current``;
        returns them (-1: invalid, never taken)."""
        inside = chunk_offs < size
        chunk = tl.load(base + chunk_offs[:, None] * D + dims[None, :], mask=inside[:, None] & (dims < D)[None, :],
                        other=0.0)
        centre = tl.load(base + current * D + dims, mask=dims < D, other=0.0)
        gap = tl.load(gaps + chunk_offs, mask=inside, other=-1.0)
        diff = chunk - centre[None, :]
        gap = tl.where(gap >= 0, tl.minimum(gap, tl.sum(diff * diff, 1)), -1.0)
        tl.store(gaps + chunk_offs, gap, mask=inside)
        return gap

    @triton.jit
    def _first_of_largest(values, at, none):
        """The smallest ``at`` among the largest ``values`` (``none`` for lanes out of play)."""
        top = tl.max(values, 0)
        return top, tl.min(tl.where(values == top, at, none), 0)

    @triton.jit
    def _fps_kernel(points, valid, start, out, gap_buffer, size, count, D: tl.constexpr, DP: tl.constexpr,
                    BLOCK: tl.constexpr, RESIDENT: tl.constexpr):
        """One program per cloud: out[b, :count], the samples from start[b], ties to the smaller index."""
        b = tl.program_id(0).to(tl.int64)
        base = points + b * size * D
        dims = tl.arange(0, DP)
        current = tl.load(start + b)
        lanes = tl.arange(0, BLOCK)
        if RESIDENT:
            inside = lanes < size
            block = tl.load(base + lanes[:, None] * D + dims[None, :], mask=inside[:, None] & (dims < D)[None, :],
                            other=0.0)
            ok = tl.load(valid + b * size + lanes, mask=inside, other=0) != 0
            gap = tl.where(ok, float("inf"), -1.0)
            for i in range(count):
                tl.store(out + b * count + i, current)
                centre = tl.load(base + current * D + dims, mask=dims < D, other=0.0)
                diff = block - centre[None, :]
                gap = tl.where(ok, tl.minimum(gap, tl.sum(diff * diff, 1)), -1.0)
                current = tl.argmax(gap, 0, tie_break_left=True).to(tl.int64)
        else:
            for i in range(count):
                tl.store(out + b * count + i, current)
                best = tl.full((BLOCK,), -2.0, tl.float32)
                best_at = tl.zeros((BLOCK,), tl.int64)
                for first in range(0, size, BLOCK):
                    gap = _distances(base, current, first + lanes, size, gap_buffer + b * size, dims, D)
                    better = gap > best  # strictly: each lane keeps its earliest maximum
                    best = tl.where(better, gap, best)
                    best_at = tl.where(better, first + lanes, best_at)
                _, current = _first_of_largest(best, best_at, size)
                tl.debug_barrier()

    @triton.jit(do_not_specialize=["step"])
    def _fps_split_kernel(points, start, out, gap_buffer, partial_gap, partial_at, batch, size, count, step,
                          slices, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, SLICE_LEN: tl.constexpr,
                          SLICES_P: tl.constexpr):
        """Sample ``step`` of cloud b = program_id(0): program_id(1) takes one slice of it.
        partial_* [2, B, slices]: each slice's candidate (largest distance, first index), by
        the parity of the step that wrote it."""
        b = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        base = points + b * size * D
        dims = tl.arange(0, DP)
        if step == 0:
            current = tl.load(start + b)
        else:
            parts = tl.arange(0, SLICES_P)
            read = ((step + 1) % 2 * batch + b) * slices + parts
            _, current = _first_of_largest(tl.load(partial_gap + read, mask=parts < slices, other=-3.0),
                                           tl.load(partial_at + read, mask=parts < slices, other=size), size)
        if part == 0:
            tl.store(out + b * count + step, current)
        if step + 1 < count:
            lanes = tl.arange(0, BLOCK)
            best = tl.full((BLOCK,), -2.0, tl.float32)
            best_at = tl.zeros((BLOCK,), tl.int64)
            for first in range(part * SLICE_LEN, tl.minimum(part * SLICE_LEN + SLICE_LEN, size), BLOCK):
                gap = _distances(base, current, first + lanes, size, gap_buffer + b * size, dims, D)
                better = gap > best
                best = tl.where(better, gap, best)
                best_at = tl.where(better, first + lanes, best_at)
            top, at = _first_of_largest(best, best_at, size)
            write = (step % 2 * batch + b) * slices + part
            tl.store(partial_gap + write, top)
            tl.store(partial_at + write, at)


def _resident(size: int, dim: int) -> bool:
    return triton.next_power_of_2(max(size, 1)) * triton.next_power_of_2(dim) <= RESIDENT_ELEMENTS


def _triton_loop(points: torch.Tensor, valid: torch.Tensor, start: torch.Tensor, count: int) -> torch.Tensor:
    """The same loop in float32, resident, streamed or split (see RESIDENT_ELEMENTS)."""
    batch, size, dim = points.shape
    idx = torch.empty((batch, count), dtype=torch.int64, device=points.device)
    if batch == 0:
        return idx
    points, dp = points.contiguous(), triton.next_power_of_2(dim)
    if _resident(size, dim):
        block = triton.next_power_of_2(max(size, 1))
        _fps_kernel[(batch,)](points, valid.to(torch.uint8), start, idx, idx, size, count, D=dim, DP=dp, BLOCK=block,
                              RESIDENT=True, num_warps=max(1, min(16, block // 256)))
        return idx
    gaps = torch.where(valid, math.inf, -1.0).to(torch.float32)
    if size <= SPLIT_MIN_POINTS:
        _fps_kernel[(batch,)](points, valid, start, idx, gaps, size, count, D=dim, DP=dp, BLOCK=CHUNK, RESIDENT=False,
                              num_warps=4)
        return idx
    slices = triton.cdiv(size, SLICE)
    partial_gap = torch.empty((2, batch, slices), dtype=torch.float32, device=points.device)
    partial_at = torch.empty((2, batch, slices), dtype=torch.int64, device=points.device)
    for step in range(count):
        _fps_split_kernel[(batch, slices)](points, start, idx, gaps, partial_gap, partial_at, batch, size, count,
                                           step, slices, D=dim, DP=dp, BLOCK=CHUNK, SLICE_LEN=SLICE,
                                           SLICES_P=triton.next_power_of_2(slices), num_warps=4)
    return idx


BACKENDS = backends.family(
    "farthest_points",
    backends.Backend("triton", ops=("farthest_points",), devices=_triton.devices(), auto_devices=("cuda",),
                     dtypes=(torch.float16, torch.bfloat16, torch.float32), install=_triton.INSTALL,
                     available=_triton.available, implementation=_triton_loop,
                     note='computes in float32 (use backend="torch" for float64)'),
    backends.Backend("torch", ops=("farthest_points",), devices=(backends.ANY_DEVICE,),
                     auto_devices=(backends.ANY_DEVICE,), implementation=_torch_loop),
)


def _check(x, lengths, start, count) -> None:
    _validate.floating("x", x)
    _validate.rank("x", x, (3,), "[B, N, D]")
    _validate.integer("count", count, minimum=1)
    batch, size, _ = x.shape
    if lengths is not None:
        _validate.lengths("lengths", lengths, batch, size, x.device)
    _validate.tensor("start", start)
    if start.dtype != torch.int64 or tuple(start.shape) != (batch,) or start.device != x.device:
        raise ValueError(f"start: expected [{batch}] int64 indices on {x.device}, got {start.dtype} of shape "
                         f"{tuple(start.shape)} on {start.device}")


@torch.library.custom_op("fullgraph::farthest_points", mutates_args=())
def farthest_points_op(x: torch.Tensor, lengths: torch.Tensor | None, start: torch.Tensor, count: int,
                       backend: str) -> torch.Tensor:
    """idx [B, count] int64 of padded clouds x [B, N, D] from the samples ``start`` [B] (-1
    beyond an item's valid points). An operator, so that torch.compile sees one call instead
    of unrolling ``count`` iterations."""
    _check(x, lengths, start, count)
    run = BACKENDS.resolve(backend, "farthest_points", x.device, x.dtype, argument="x").implementation
    points, valid = _prepared(x, lengths)
    idx = run(points, valid, start, count)
    taken = valid.sum(1, keepdim=True)
    return torch.where(torch.arange(count, device=x.device)[None, :] < taken, idx, -1)


@farthest_points_op.register_fake
def _(x, lengths, start, count, backend):
    return x.new_empty((x.shape[0], count), dtype=torch.int64)


def farthest_points(x: torch.Tensor, lengths: torch.Tensor | None, count: int, random_start: bool,
                    generator: torch.Generator | None, backend: str = "auto") -> torch.Tensor:
    """idx [B, count] int64 of padded clouds x [B, N, D] (-1 beyond an item's valid points)."""
    chosen = BACKENDS.resolve(backend, "farthest_points", x.device, x.dtype, argument="x").name
    start = _starts(x, valid_points(x, lengths), random_start, generator)
    return torch.ops.fullgraph.farthest_points(x, lengths, start, count, chosen)


def fps(x, ratio=None, *, n_samples=None, batch=None, lengths=None, random_start=True, generator=None,
        backend: str = "auto"):
    """Farthest-point sampling of one or many point clouds.

    Two forms:

    - torch_cluster's: ``fps(x, ratio, batch=batch)`` with x [N, D] and a sorted int64 batch
      vector [N] (None: one cloud) returns the 1-D int64 indices into x of
      ``ceil(ratio * n_b)`` samples of each item b (``n_samples=`` instead: that many, at
      most n_b), item after item. One host read of the item sizes.
    - PyTorch3D's: ``fps(x, n_samples=K, lengths=lengths)`` with x [B, N, D] (lengths [B]
      int64, the valid prefixes) returns idx [B, K] int64, -1 beyond an item's valid
      points; ``ratio`` instead gives K = ceil(ratio * N). No host read: capture-safe.

    Args:
        ratio: fraction in (0, 1]. n_samples: int >= 1 (at most N in the padded form).
        random_start: draw each item's first sample uniformly among its valid points (from
            ``generator``, on x's device); else its first valid point.
        backend: "auto", "triton" (CUDA, float32: a program per cloud, or per slice of a
            large cloud with a launch per sample; see ``RESIDENT_ELEMENTS``) or
            "torch" (a loop of batched PyTorch operations, any device and dtype). "auto"
            takes Triton on CUDA.

    Example:
        >>> x = torch.rand(1000, 3)
        >>> fullgraph.fps(x, 0.25, random_start=False).shape
        torch.Size([250])
    """
    _validate.floating("x", x)
    _validate.rank("x", x, (2, 3), "[N, D] (with a batch vector) or [B, N, D] (with lengths)")
    if (ratio is None) == (n_samples is None):
        raise ValueError(f"ratio, n_samples: expected exactly one of them, got ratio={ratio!r}, "
                         f"n_samples={n_samples!r}")
    if ratio is not None:
        ratio = _validate.real("ratio", ratio, minimum=0.0, strict=True)
        if ratio > 1:
            raise ValueError(f"ratio: expected a fraction in (0, 1], got {ratio}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
    if x.dim() == 3:
        if batch is not None:
            raise ValueError("batch: only for flat clouds [N, D]; padded clouds [B, N, D] take lengths")
        size = x.shape[1]
        count = _validate.integer("n_samples", n_samples, minimum=1) if n_samples is not None else max(
            1, math.ceil(ratio * size))
        if count > max(size, 1):
            raise ValueError(f"n_samples: expected at most N = {size} points per cloud, got {count}")
        if lengths is not None:
            _validate.lengths("lengths", lengths, x.shape[0], size, x.device)
        return farthest_points(x, lengths, count, random_start, generator, backend)
    if lengths is not None:
        raise ValueError("lengths: only for padded clouds [B, N, D]; flat clouds [N, D] take a batch vector")
    if batch is not None:
        check_batch("batch", batch, x)
    if n_samples is not None:
        _validate.integer("n_samples", n_samples, minimum=1)
    layout = Padded.of(batch, x.shape[0], x.device)
    sizes = layout.lengths.tolist()  # the one host read: the output length depends on it
    wanted = [min(n, n_samples) if n_samples is not None else math.ceil(ratio * n) for n in sizes]
    if not sizes or max(wanted) == 0:
        return torch.zeros(0, dtype=torch.int64, device=x.device)
    idx = farthest_points(layout.pad(x), layout.lengths, max(wanted), random_start, generator, backend)
    keep = torch.arange(idx.shape[1], device=x.device)[None, :] < torch.tensor(wanted, device=x.device)[:, None]
    rows = layout.global_index(idx, torch.arange(layout.items, device=x.device))
    return rows[keep & (rows >= 0)]


def voxel_grid(pos, size, batch=None, start=None, end=None):
    """Voxel of every point: torch_cluster's ``grid_cluster`` / PyG's ``voxel_grid``.

    Args:
        pos: [N, D] floating points. size: the voxel edge, a float or one per dimension
            (a sequence or [D] tensor). batch: [N] sorted int64 item ids (a voxel never
            spans two items). start, end: the grid's corners (float or per dimension;
            default: the points' minimum and maximum).

    Returns:
        cluster [N] int64: sum_d floor((pos_d - start_d) / size_d) * prod_{e < d} n_e, with
        n_e = floor((end_e - start_e) / size_e) + 1 voxels along dimension e (the batch
        item is one more dimension of size 1), as torch_cluster numbers them. Ids are not
        consecutive: ``torch.unique(cluster, return_inverse=True)`` relabels them. No host
        read: capture-safe.

    Example:
        >>> pos = torch.tensor([[0.0, 0.0], [0.4, 0.1], [1.2, 0.0]])
        >>> fullgraph.voxel_grid(pos, 0.5).tolist()
        [0, 0, 2]
    """
    _validate.floating("pos", pos)
    _validate.rank("pos", pos, (2,), "[N, D]")
    dim = pos.shape[1]
    readable = _validate.values_readable(pos.device)

    def per_dim(name, value):
        tensor = torch.as_tensor(value, dtype=pos.dtype, device=pos.device).reshape(-1)
        if tensor.numel() not in (1, dim):
            raise ValueError(f"{name}: expected a float or {dim} of them (one per dimension), got {value!r}")
        if readable and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{name}: expected finite values, got {value!r}")
        return tensor.expand(dim)

    size = per_dim("size", size)
    if readable and not bool((size > 0).all()):
        raise ValueError(f"size: expected voxel edges > 0, got {size.tolist()}")
    if readable and pos.shape[0] and not bool(torch.isfinite(pos).all()):
        raise ValueError("pos: expected finite coordinates (a voxel of NaN has no meaning)")
    if batch is not None:
        check_batch("batch", batch, pos)
    # PyG's layout: the item id is one more coordinate, with voxels of size 1.
    items = batch if batch is not None else torch.zeros(pos.shape[0], dtype=torch.int64, device=pos.device)
    pos = torch.cat([pos, items[:, None].to(pos.dtype)], 1)
    size = torch.cat([size, size.new_ones(1)])
    zero, empty = pos.new_zeros(1), pos.new_zeros(dim + 1)
    last_item = items.amax()[None].to(pos.dtype) if items.numel() else zero
    start = torch.cat([per_dim("start", start), zero]) if start is not None else (pos.amin(0) if pos.shape[0] else empty)
    end = torch.cat([per_dim("end", end), last_item]) if end is not None else (pos.amax(0) if pos.shape[0] else empty)
    counts = torch.floor((end - start) / size).to(torch.int64) + 1
    strides = torch.cat([counts.new_ones(1), torch.cumprod(counts, 0)[:-1]])
    return (torch.floor((pos - start) / size).to(torch.int64) * strides).sum(1)
