"""Farthest-point sampling: torch_cluster's ``fps`` and PyTorch3D's ``sample_farthest_points``.

Each sample is the point farthest from those taken so far (squared Euclidean distance in
float32, float64 for float64 inputs; ties to the smaller index); the first is the item's
first valid point (``random_start=False``) or one drawn uniformly among its valid points.
Points beyond an item's length or with a non-finite coordinate are never taken.

The padded form (x [B, N, D], lengths) reads nothing back to the host, so it compiles and runs
inside CUDA graphs: one operator, ``fullgraph::farthest_points``, whose backends are a C++/CUDA
kernel on thread-block clusters ("cuda", cuda/backend.py: clouds of up to 65,536 points), the
Triton kernel below ("triton": any size) and K iterations of a few batched tensor operations
("torch", any device). The flat form with a batch vector reads the item sizes once (its
output length depends on them), like torch_cluster.
"""

from __future__ import annotations

import math
import numbers

import torch

from ... import _contract, _triton, _validate, backends
from ..._triton import cdiv, lazy, next_power_of_2
from ..neighbors.batching import Padded, check_batch
from ..neighbors.pairs import accumulation_dtype, valid_points, valid_points_and_largest
from ..scaling import safe_scale
from .cuda.backend import BACKEND as CUDA_BACKEND
from .cuda.backend import library  # noqa: F401  (public: sampling.library)

kernels = lazy(f"{__package__}.kernels")


def _starts(x, valid, random_start: bool, generator) -> torch.Tensor:
    """[B] int64: each item's first sample, uniform among its valid points or its first valid one."""
    batch, size = valid.shape
    if size == 0:
        return torch.zeros(batch, dtype=torch.int64, device=x.device)
    if random_start:
        draw = (torch.rand((batch, size), device=x.device) if generator is None  # (no symbolic sizes with one)
                else torch.rand((batch, size), generator=generator, device=x.device))
        return torch.where(valid, draw, -1.0).argmax(1)
    return valid.to(torch.int8).argmax(1)


def _prepared(x: torch.Tensor, lengths: torch.Tensor | None):
    """(points, valid): x in its accumulation dtype, scaled per item by a power of two
    (exact) into the unit ball so no squared distance overflows, 0 at invalid points; valid
    [B, N] bool."""
    valid, largest = valid_points_and_largest(x, lengths)
    acc = accumulation_dtype(x.dtype)
    return torch.where(valid[..., None], x.to(acc) / safe_scale(largest.to(acc))[:, None, None], 0), valid


def _on_prepared(loop):
    """A backend's implementation (x, lengths, start or None, count) -> idx from a loop over
    prepared clouds (points, valid, start, count) -> idx: the shared steps before and after."""
    def run(x, lengths, start, count):
        points, valid = _prepared(x, lengths)
        idx = loop(points, valid, _starts(x, valid, False, None) if start is None else start, count)
        taken = valid.sum(1, keepdim=True)
        return torch.where(torch.arange(count, device=x.device)[None, :] < taken, idx, -1)
    return run


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


# The loop on a GPU: each cloud is cut into `parts` slices, a program each (grid [B, parts]).
# A slice of at most RESIDENT_ELEMENTS coordinates (N x D rounded up to powers of two) stays
# in its program's registers for every sample; a larger one is read from L2 in chunks of a
# quarter of that (a chunk's running best takes registers too), its distances to the samples
# kept in a scratch buffer. One part per cloud finds each next sample alone. Several parts
# (up to one program per SM; slices of at least MIN_SLICE points) exchange their candidates
# through 64-bit words (distance, step tag, offset): each part publishes its word and waits
# for its cloud's other words of the same step, so one launch runs every sample (a cloud of
# 10^6 points does not run on one SM).
# Waiting needs every program resident at once: where it cannot be (more programs than SMs,
# or Triton's interpreter, which runs programs one after another), a launch per sample takes
# the place of the wait.
RESIDENT_ELEMENTS = 32768
MIN_SLICE = 1024
MAX_PARTS = 256  # a part's number is 8 bits of the key its cloud's winner is chosen by
POINTS_PER_WARP = 256  # a program's warps: its block over this, 1 to 16
INTERPRETED_PROGRAMS = 8  # the "SM count" under the interpreter: small clouds take several parts in the tests


def _programs(device: torch.device) -> int:
    """How many programs run at once: one per SM."""
    if _triton.INTERPRETED:
        return INTERPRETED_PROGRAMS
    return _triton.multiprocessors(device)


def _slices(batch: int, size: int, dim: int, programs: int) -> tuple[int, int, int]:
    """(parts per cloud, slice length, block): as many parts as the programs allow, of at
    least MIN_SLICE points (one part: the whole cloud); block: the points a program holds at
    once (the slice length where it stays resident)."""
    whole = next_power_of_2(max(size, 1))
    wanted = min(MAX_PARTS, max(1, programs // batch))
    length = min(whole, max(MIN_SLICE, next_power_of_2(cdiv(size, wanted))))
    length = min(length, 1 << 24)  # a part's offset is 24 bits of its word
    block = min(length, max(1, RESIDENT_ELEMENTS // next_power_of_2(dim)))
    if block < length:
        block = max(1, block // 4)
    return cdiv(max(size, 1), length), length, block


def _triton_loop(points: torch.Tensor, valid: torch.Tensor, start: torch.Tensor, count: int) -> torch.Tensor:
    """The same loop in float32 (see RESIDENT_ELEMENTS for how a cloud is split)."""
    batch, size, dim = points.shape
    idx = torch.zeros((batch, count), dtype=torch.int64, device=points.device)
    if batch == 0 or size == 0:
        return idx
    programs = _programs(points.device)
    parts, length, block = _slices(batch, size, dim, programs)
    gaps = torch.where(valid, math.inf, -1.0).to(torch.float32)
    slots = torch.full((2, batch, parts), -1, dtype=torch.int64, device=points.device)
    launch = kernels._fps_kernel[(batch, parts)]
    settings = dict(D=dim, DP=next_power_of_2(dim), BLOCK=block, PARTS=parts,
                    PARTS_P=next_power_of_2(parts), RESIDENT=block == length,
                    COLUMNS=block == length and dim <= 4, num_warps=max(1, min(16, block // POINTS_PER_WARP)),
                    enable_fp_fusion=False)
    arguments = (points.contiguous(), gaps, start, idx, slots, batch, size, count)
    if parts == 1 or (batch * parts <= programs and not _triton.INTERPRETED):
        launch(*arguments, 0, count, length, **settings)
    else:
        for step in range(count):
            launch(*arguments, step, step + 1, length, **settings)
    return idx


BACKENDS = backends.family(
    "farthest_points",
    CUDA_BACKEND,
    backends.Backend("triton", ops=("farthest_points",), devices=_triton.devices(), auto_devices=("cuda",),
                     dtypes=(torch.float16, torch.bfloat16, torch.float32), install=_triton.INSTALL,
                     available=_triton.available, implementation=_on_prepared(_triton_loop),
                     note='computes in float32 (use backend="torch" for float64)'),
    backends.Backend("torch", ops=("farthest_points",), devices=(backends.ANY_DEVICE,),
                     auto_devices=(backends.ANY_DEVICE,), implementation=_on_prepared(_torch_loop)),
)


def _check(x, lengths, start, count) -> None:
    _validate.floating("x", x)
    _validate.rank("x", x, (3,), "[B, N, D]")
    _validate.integer("count", count, minimum=1)
    batch, size, _ = x.shape
    if lengths is not None:
        _validate.lengths("lengths", lengths, batch, size, x.device)
    if start is None:
        return
    _validate.tensor("start", start)
    if start.dtype != torch.int64 or tuple(start.shape) != (batch,) or start.device != x.device:
        raise ValueError(f"start: expected [{batch}] int64 indices on {x.device}, got {start.dtype} of shape "
                         f"{tuple(start.shape)} on {start.device}")


@torch.library.custom_op("fullgraph::farthest_points", mutates_args=())
def farthest_points_op(x: torch.Tensor, lengths: torch.Tensor | None, start: torch.Tensor | None, count: int,
                       backend: str) -> torch.Tensor:
    """idx [B, count] int64 of padded clouds x [B, N, D] from the samples ``start`` [B] (None:
    each item's first valid point; -1 beyond an item's valid points). An operator, so that
    torch.compile sees one call instead of unrolling ``count`` iterations."""
    _check(x, lengths, start, count)
    run = BACKENDS.resolve(backend, "farthest_points", x.device, x.dtype, x.shape[2], x.shape[1], "x").implementation
    return run(x, lengths, start, count)


@farthest_points_op.register_fake
def _(x, lengths, start, count, backend):
    return x.new_empty((x.shape[0], count), dtype=torch.int64)


def decompositions() -> dict:
    """{``fullgraph::farthest_points``: the CUDA extension's ``fullgraph_fps::farthest_points``
    where a call's backend is "cuda"}, for ``ExportedProgram.run_decompositions``: such a
    program, and its AOTInductor package, hold the C++ library's operator, which a C++ program
    runs once it loaded that library (``library()``; docs/deploy.md).
    Calls on the other backends stay fullgraph's operator."""
    return {torch.ops.fullgraph.farthest_points.default: _on_the_library}


def _on_the_library(x, lengths, start, count, backend):
    if backend != "cuda":
        return NotImplemented  # (the table leaves the call as it is)
    return CUDA_BACKEND.implementation(x, lengths, start, count)


def farthest_points(x: torch.Tensor, lengths: torch.Tensor | None, count: int, random_start: bool,
                    generator: torch.Generator | None, backend: str = "auto") -> torch.Tensor:
    """idx [B, count] int64 of padded clouds x [B, N, D] (-1 beyond an item's valid points)."""
    chosen = BACKENDS.resolve(backend, "farthest_points", x.device, x.dtype, x.shape[2], x.shape[1], "x").name
    start = _starts(x, valid_points(x, lengths), True, generator) if random_start else None
    return torch.ops.fullgraph.farthest_points(x, lengths, start, count, chosen)


def _check_fps(x, ratio=None, *, n_samples=None, batch=None, lengths=None, random_start=True, generator=None,
               backend="auto") -> None:
    _validate.floating("x", x)
    _validate.rank("x", x, (2, 3), "[N, D] (with a batch vector) or [B, N, D] (with lengths)")
    if (ratio is None) == (n_samples is None):
        raise ValueError(f"ratio, n_samples: expected exactly one of them, got ratio={ratio!r}, "
                         f"n_samples={n_samples!r}")
    if ratio is not None:
        ratio = _validate.real("ratio", ratio, minimum=0.0, strict=True)
        if ratio > 1:
            raise ValueError(f"ratio: expected a fraction in (0, 1], got {ratio}")
    if n_samples is not None:
        _validate.integer("n_samples", n_samples, minimum=1)
    if not isinstance(random_start, bool):
        raise TypeError(f"random_start: expected a bool, got {_validate._describe(random_start)}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
    BACKENDS.resolve(backend, "farthest_points", x.device, x.dtype, x.shape[-1], x.shape[-2], "x")
    if x.dim() == 3:
        if batch is not None:
            raise ValueError("batch: only for flat clouds [N, D]; padded clouds [B, N, D] take lengths")
        size = x.shape[1]
        count = n_samples if n_samples is not None else max(1, math.ceil(ratio * size))
        if count > max(size, 1):
            raise ValueError(f"n_samples: expected at most N = {size} points per cloud, got {count}")
        if lengths is not None:
            _validate.lengths("lengths", lengths, x.shape[0], size, x.device)
        return
    if lengths is not None:
        raise ValueError("lengths: only for padded clouds [B, N, D]; flat clouds [N, D] take a batch vector")
    if batch is not None:
        check_batch("batch", batch, x)


@_contract.checked(_check_fps)
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
        backend: "auto", "cuda" (float32, a GPU of compute capability >= 9.0: a C++/CUDA
            kernel built on first use, one thread-block cluster per cloud of up to 65,536
            points of D <= 4; see cuda/backend.py), "triton" (CUDA, float32: one launch, a
            program per cloud or per part of a large one, the parts exchanging candidates
            through L2; see ``RESIDENT_ELEMENTS``) or "torch" (a loop of batched PyTorch
            operations, any device and dtype). "auto" takes "cuda" where it is built or can
            be and the cloud fits a cluster, else Triton on CUDA.

    Example:
        >>> x = torch.rand(1000, 3)
        >>> fullgraph.fps(x, 0.25, random_start=False).shape
        torch.Size([250])
    """
    if x.dim() == 3:
        count = n_samples if n_samples is not None else max(1, math.ceil(ratio * x.shape[1]))
        return farthest_points(x, lengths, count, random_start, generator, backend)
    draw = None
    if random_start:  # (rand's generator overload takes no symbolic size)
        draw = (torch.rand(x.shape[0], device=x.device) if generator is None
                else torch.rand(x.shape[0], generator=generator, device=x.device))
    rate = None if ratio is None else torch.tensor(float(ratio), dtype=torch.float64, device=x.device)
    return torch.ops.fullgraph.fps_flat(x, batch, None, rate, n_samples, draw, backend)


@torch.library.custom_op("fullgraph::fps_flat", mutates_args=())
def fps_flat(x: torch.Tensor, batch: torch.Tensor | None, ptr: torch.Tensor | None, ratio: torch.Tensor | None,
             n_samples: int | None, draw: torch.Tensor | None, backend: str) -> torch.Tensor:
    """Indices [S] into the flat cloud x [N, D] of the samples of each item (items from a
    sorted ``batch`` vector [N] or CSR boundaries ``ptr`` [B + 1]; neither: one item), item
    after item: ceil(n_b * ratio) of item b (``ratio`` [] or [B], computed in its dtype) or
    min(n_b, n_samples). ``draw`` [N] (None: each item's first valid point) picks each
    item's start, its largest value among the item's valid points. An operator: S depends on
    the item sizes (its fake declares a data-dependent size), so compiled code holds one call."""
    if ptr is not None:
        if ptr.dim() != 1 or ptr.numel() < 1:
            raise ValueError(f"ptr: expected [B + 1] item boundaries, got shape {tuple(ptr.shape)}")
        ptr = ptr.to(device=x.device, dtype=torch.int64)
        first, last, descending = _validate.read(ptr[0], ptr[-1], (ptr[1:] < ptr[:-1]).any())
        if first != 0 or last != x.shape[0] or descending:
            raise ValueError(f"ptr: expected ascending boundaries from 0 to N = {x.shape[0]}, got {ptr.tolist()}")
        batch = torch.repeat_interleave(torch.arange(ptr.numel() - 1, device=x.device), ptr[1:] - ptr[:-1],
                                        output_size=x.shape[0])
    elif batch is not None:
        check_batch("batch", batch, x)
    layout = Padded.of(batch, x.shape[0], x.device)
    if ratio is not None:
        if ratio.numel() not in (1, layout.items):
            raise ValueError(f"ratio: expected one value or one per item ({layout.items}), got {ratio.numel()}")
        if not ratio.dtype.is_floating_point or bool(((ratio <= 0) | (ratio > 1) | ratio.isnan()).any()):
            raise ValueError(f"ratio: expected fractions in (0, 1], got {ratio.tolist()}")
        wanted = (layout.lengths.to(ratio.dtype) * ratio.reshape(-1)).ceil().to(torch.int64)
    else:
        wanted = layout.lengths.clamp(max=n_samples)
    count = int(wanted.max()) if layout.items else 0  # the one host read: the output length depends on it
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=x.device)
    padded = layout.pad(x)
    start = None
    if draw is not None:
        valid = valid_points(padded, layout.lengths)
        start = torch.where(valid, layout.pad(draw[:, None].to(torch.float32))[..., 0], -1.0).argmax(1)
    chosen = BACKENDS.resolve(backend, "farthest_points", x.device, x.dtype, x.shape[1], layout.width, "x").name
    idx = torch.ops.fullgraph.farthest_points(padded, layout.lengths, start, count, chosen)
    keep = torch.arange(count, device=x.device)[None, :] < wanted[:, None]
    rows = layout.global_index(idx, torch.arange(layout.items, device=x.device))
    return rows[keep & (rows >= 0)]


@fps_flat.register_fake
def _(x, batch, ptr, ratio, n_samples, draw, backend):
    return x.new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.int64)


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
        consecutive: ``torch.unique(cluster, return_inverse=True)`` relabels them. The
        values are checked where they can be read (eagerly and in compiled code: one host
        read); inside a CUDA graph capture nothing is read back.

    Example:
        >>> pos = torch.tensor([[0.0, 0.0], [0.4, 0.1], [1.2, 0.0]])
        >>> fullgraph.voxel_grid(pos, 0.5).tolist()
        [0, 0, 2]
    """
    _validate.floating("pos", pos)
    _validate.rank("pos", pos, (2,), "[N, D]")
    dim = pos.shape[1]

    def per_dim(name, value):
        if isinstance(value, torch.Tensor):
            if not (value.dtype.is_floating_point or value.dtype in _INTEGERS) or value.device != pos.device:
                raise TypeError(f"{name}: expected a real tensor on {pos.device}, got {_validate._describe(value)}")
        elif not (isinstance(value, numbers.Real) and not isinstance(value, bool)) and not (
                isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                                                         for v in value)):
            raise TypeError(f"{name}: expected a float, a sequence of {dim} floats or a tensor, got "
                            f"{_validate._describe(value)}")
        tensor = torch.as_tensor(value, device=pos.device).to(pos.dtype).reshape(-1)
        if tensor.numel() not in (1, dim):
            raise ValueError(f"{name}: expected a float or {dim} of them (one per dimension), got {value!r}")
        return tensor.expand(dim)

    size = per_dim("size", size)
    start = per_dim("start", start) if start is not None else None
    end = per_dim("end", end) if end is not None else None
    if batch is not None:
        check_batch("batch", batch, pos)
    return torch.ops.fullgraph.voxel_grid(pos, size, batch, start, end)


_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@torch.library.custom_op("fullgraph::voxel_grid", mutates_args=())
def voxel_grid_op(pos: torch.Tensor, size: torch.Tensor, batch: torch.Tensor | None, start: torch.Tensor | None,
                  end: torch.Tensor | None) -> torch.Tensor:
    """cluster [N] int64 (see ``voxel_grid``); the value checks run here, where the values
    are readable (eagerly and in compiled code, not inside a CUDA graph capture)."""
    if _validate.values_readable(pos.device):
        for name, value in (("size", size), ("start", start), ("end", end)):
            if value is not None and not bool(torch.isfinite(value).all()):
                raise ValueError(f"{name}: expected finite values, got {value.tolist()}")
        if not bool((size > 0).all()):
            raise ValueError(f"size: expected voxel edges > 0, got {size.tolist()}")
        if start is not None and end is not None and not bool((end >= start).all()):
            raise ValueError(f"end: expected >= start in every dimension, got start {start.tolist()}, "
                             f"end {end.tolist()}")
        if pos.shape[0] and not bool(torch.isfinite(pos).all()):
            raise ValueError("pos: expected finite coordinates (a voxel of NaN has no meaning)")
    if pos.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=pos.device)
    low = start if start is not None else pos.amin(0)
    high = end if end is not None else pos.amax(0)
    counts = torch.floor((high - low) / size).to(torch.int64) + 1
    strides = torch.cat([counts.new_ones(1), torch.cumprod(counts, 0)])
    cluster = (torch.floor((pos - low) / size).to(torch.int64) * strides[:-1]).sum(1)
    if batch is None:
        return cluster
    # The item is one more coordinate with voxels of size 1 (PyG's layout), in integers: in the
    # points' dtype a bfloat16 item id would round from 256 on.
    first = batch.new_zeros(()) if start is not None else batch.amin()
    return cluster + (batch - first) * strides[-1]


@voxel_grid_op.register_fake
def _(pos, size, batch, start, end):
    return pos.new_empty(pos.shape[:1], dtype=torch.int64)
