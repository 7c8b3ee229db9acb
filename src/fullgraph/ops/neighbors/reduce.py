"""``knn_reduce``: per query, the elementwise maximum, minimum and sum of its neighbours'
rows, without the [M, k, C] tensor of gathered rows (DGCNN's max aggregation, PointNet++'s
pooling, EdgeConv's batch-norm sums).

On CUDA one Triton pass reads each neighbour's row once and keeps the three reductions and
the slots of the extremes in registers; the backward sends each query's gradients to the
slots (the sum's to every slot, the maximum's and minimum's to the slot that held them, the
first such slot on ties, as ``torch.max`` does) and sums them per row of ``values`` in slot
order after a stable sort of the slots by row: deterministic, no atomics (float32 sums;
float64 gradients go through torch's index_add). On CPUs a C++
kernel does both in one pass each (``csrc/knn_reduce.cpp``, float32 and float64, vectorized
16 channels at a time; 2 x 1024 queries x 20 slots x 64 channels on the 2-core development
CPU: forward 1.1 ms, backward 0.65 ms (5.4 and 2.8 before the compiler was
let vectorize them), against 7.1 and 18.1 ms from torch's gathered rows); elsewhere torch does
the same from the gathered rows.
"""

from __future__ import annotations

import torch

from ... import _triton, _validate
from ..._triton import cdiv, lazy, next_power_of_2
from .cpu import native as select
from .triton.backend import sum_pairs_by_ref

kernels = lazy(f"{__package__}.reduce_kernels")

Tensor = torch.Tensor
# Slots are stored as int16: lists up to this long.
MAX_K = 2**15 - 1
_BLOCK_M = 32


def _flat(columns: int, idx: Tensor) -> Tensor:
    """Flat rows b * N + j of the lists idx [B, M, k] (-1 kept)."""
    offsets = (torch.arange(idx.shape[0], device=idx.device) * columns).view(-1, 1, 1)
    return torch.where(idx >= 0, idx + offsets, -1)


def _uses_triton(values: Tensor) -> bool:
    return values.is_cuda and _triton.available()


def _uses_cpp(values: Tensor) -> bool:
    return values.is_cpu and values.dtype in (torch.float32, torch.float64) and select.available()


def _reduce_torch(values: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    batch, rows, k = idx.shape
    channels = values.shape[-1]
    flat = _flat(values.shape[1], idx)
    ok = (flat >= 0)[..., None]
    gathered = values.reshape(-1, channels)[flat.clamp(min=0).reshape(-1)].reshape(batch, rows, k, channels)
    if values.is_cpu and bool(ok.all()):  # (a host read only on CPUs) no padding: nothing to mask
        (top, top_slot), (bottom, bottom_slot) = gathered.max(2), gathered.min(2)
        total = gathered.sum(2)
    else:
        some = ok.any(2)
        top, top_slot = gathered.masked_fill(~ok, -torch.inf).max(2)
        bottom, bottom_slot = gathered.masked_fill(~ok, torch.inf).min(2)
        top, bottom = top.masked_fill(~some, 0), bottom.masked_fill(~some, 0)
        total = gathered.masked_fill(~ok, 0).sum(2)
    return top, bottom, total, torch.stack([top_slot, bottom_slot]).to(torch.int16)


def _reduce_triton(values: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    batch, rows, k = idx.shape
    columns, channels = values.shape[1:]
    out = [values.new_empty((batch, rows, channels)) for _ in range(3)]
    slots = torch.zeros((2, batch, rows, channels), dtype=torch.int16, device=values.device)
    if batch * rows * channels:
        acc = kernels.tl.float64 if values.dtype == torch.float64 else kernels.tl.float32
        kernels._reduce_kernel[(cdiv(batch * rows, _BLOCK_M),)](
            values, idx, *out, slots, batch * rows, rows, columns, channels, K=k,
            CP=max(16, next_power_of_2(channels)), BLOCK_M=_BLOCK_M, ACC=acc)
    return (*out, slots)


@torch.library.custom_op("fullgraph::knn_reduce", mutates_args=())
def knn_reduce_op(values: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """values [B, N, C], idx [B, M, k] int64 (-1: none) -> maximum, minimum, sum [B, M, C]
    and the extremes' slots [2, B, M, C] int16 (for the backward)."""
    _check(values, idx)
    values, idx = values.contiguous(), idx.contiguous()
    if _uses_cpp(values):
        return tuple(torch.ops.fullgraph_cpu.knn_reduce(values, idx))
    return (_reduce_triton if _uses_triton(values) else _reduce_torch)(values, idx)


@knn_reduce_op.register_fake
def _(values, idx):
    shape = (*idx.shape[:2], values.shape[-1])
    return (values.new_empty(shape), values.new_empty(shape), values.new_empty(shape),
            values.new_empty((2, *shape), dtype=torch.int16))


@torch.library.custom_op("fullgraph::knn_reduce_backward", mutates_args=())
def knn_reduce_backward_op(grad_max: Tensor, grad_min: Tensor, grad_sum: Tensor, idx: Tensor, slots: Tensor,
                           columns: int) -> Tensor:
    """The gradient [B, N, C] of ``values`` from the gradients [B, M, C] of the three
    reductions of ``knn_reduce`` (its lists idx and the extremes' slots)."""
    _validate.tensor("idx", idx)
    if idx.dtype != torch.int64 or idx.dim() != 3:
        raise ValueError(f"idx: expected int64 lists [B, M, k], got {idx.dtype} of shape {tuple(idx.shape)}")
    batch, rows, k = idx.shape
    channels = grad_sum.shape[-1]
    for name, grad in (("grad_max", grad_max), ("grad_min", grad_min), ("grad_sum", grad_sum)):
        _validate.floating(name, grad)
        if grad.shape != (batch, rows, channels):
            raise ValueError(f"{name}: expected shape {(batch, rows, channels)}, got {tuple(grad.shape)}")
    if slots.shape != (2, batch, rows, channels) or slots.dtype != torch.int16:
        raise ValueError(f"slots: expected int16 of shape {(2, batch, rows, channels)}, got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    if _uses_cpp(grad_sum) and grad_max.dtype == grad_min.dtype == grad_sum.dtype:
        return torch.ops.fullgraph_cpu.knn_reduce_backward(grad_max, grad_min, grad_sum, idx, slots, columns)
    # (The Triton sums are float32: float64 gradients take torch's float64 index_add.)
    triton_sums = _uses_triton(grad_sum) and torch.float64 not in (grad_max.dtype, grad_min.dtype, grad_sum.dtype)
    return (_backward_triton if triton_sums else _backward_torch)(grad_max, grad_min, grad_sum, idx, slots, columns)


def _per_slot(grad_max, grad_min, grad_sum, slots, k) -> Tensor:
    """[B, M, k, C]: each slot's share of the three reductions' gradients."""
    position = torch.arange(k, device=slots.device).view(1, 1, k, 1)
    return (grad_sum[:, :, None, :] + torch.where(slots[0, :, :, None] == position, grad_max[:, :, None, :], 0)
            + torch.where(slots[1, :, :, None] == position, grad_min[:, :, None, :], 0))


def _backward_torch(grad_max, grad_min, grad_sum, idx, slots, columns) -> Tensor:
    batch, rows, k = idx.shape
    channels = grad_sum.shape[-1]
    flat = _flat(columns, idx)
    per_slot = _per_slot(grad_max, grad_min, grad_sum, slots, k).masked_fill((flat < 0)[..., None], 0)
    out = grad_sum.new_zeros((batch * columns, channels))
    return out.index_add_(0, flat.clamp(min=0).reshape(-1), per_slot.reshape(-1, channels)).reshape(
        batch, columns, channels)


def _backward_triton(grad_max, grad_min, grad_sum, idx, slots, columns) -> Tensor:
    batch, rows, k = idx.shape
    channels = grad_sum.shape[-1]
    per_slot = torch.empty((idx.numel(), channels), dtype=torch.float32, device=idx.device)
    if per_slot.numel():
        kernels._per_slot_kernel[(cdiv(batch * rows, _BLOCK_M),)](
            grad_max.contiguous(), grad_min.contiguous(), grad_sum.contiguous(), slots.contiguous(), per_slot,
            batch * rows, channels, K=k, CP=max(16, next_power_of_2(channels)), BLOCK_M=_BLOCK_M)
    ones = torch.ones(idx.numel(), dtype=torch.float32, device=idx.device)
    sums, _ = sum_pairs_by_ref(idx, ones, per_slot, columns, per_slot=True)
    return sums.reshape(batch, columns, channels).to(grad_sum.dtype)


@knn_reduce_backward_op.register_fake
def _(grad_max, grad_min, grad_sum, idx, slots, columns):
    return grad_sum.new_empty((idx.shape[0], columns, grad_sum.shape[-1]))


def _setup(ctx, inputs, output):
    values, idx = inputs
    ctx.columns = values.shape[1]
    ctx.save_for_backward(idx, output[3])


def _backward(ctx, grad_max, grad_min, grad_sum, _grad_slots):
    idx, slots = ctx.saved_tensors
    like = grad_max if grad_max is not None else grad_min if grad_min is not None else grad_sum
    zeros = [g if g is not None else torch.zeros_like(like) for g in (grad_max, grad_min, grad_sum)]
    return knn_reduce_backward_op(*zeros, idx, slots, ctx.columns), None


knn_reduce_op.register_autograd(_backward, setup_context=_setup)


def _check(values: Tensor, idx: Tensor) -> None:
    _validate.floating("values", values)
    _validate.tensor("idx", idx)
    if idx.dtype != torch.int64:
        raise TypeError(f"idx: expected int64 neighbour lists, got {idx.dtype}")
    _validate.rank("values", values, (3,), "[B, N, C]")
    _validate.rank("idx", idx, (3,), "[B, M, k] like values [B, N, C]")
    if idx.device != values.device:
        raise ValueError(f"idx: expected a tensor on {values.device} like values, got {idx.device}")
    if idx.shape[0] != values.shape[0]:
        raise ValueError(f"idx: expected batch size {values.shape[0]} like values, got shape {tuple(idx.shape)}")
    if idx.shape[-1] > MAX_K:
        raise ValueError(f"idx: expected lists of at most {MAX_K} slots, got shape {tuple(idx.shape)}")
    if idx.numel() and _validate.values_readable(idx.device):
        low, high = int(idx.min()), int(idx.max())
        if low < -1 or high >= values.shape[1]:
            raise ValueError(f"idx: expected indices in [-1, {values.shape[1]}), got values in [{low}, {high}]")


def knn_reduce(values: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per query, the elementwise maximum, minimum and sum of its neighbours' rows of ``values``.

    Args:
        values: [N, C] or [B, N, C] floating rows (features or points).
        idx: [M, k] or [B, M, k] int64 neighbour lists from ``knn`` / ``radius`` (-1 = none),
            batched like ``values``.

    Returns:
        (maximum, minimum, sum), each [M, C] or [B, M, C]: over the valid slots (a query
        without any gets zeros; NaN propagates). Differentiable w.r.t. ``values``: the
        extremes' gradients reach the first slot holding them; deterministic. Never stores
        the [M, k, C] rows; compiles (``torch.ops.fullgraph.knn_reduce``) and captures.

    Raises:
        TypeError: non-floating values, idx not int64 (naming the argument).
        ValueError: ranks, batch sizes or devices that differ, indices outside [-1, N)
            (checked eagerly; naming the argument).

    Example:
        >>> x = torch.randn(100, 8)
        >>> _, idx = fullgraph.knn(x, x, 4)
        >>> top, bottom, total = fullgraph.knn_reduce(x, idx)
        >>> torch.equal(top, fullgraph.knn_gather(x, idx).amax(1))
        True
    """
    _validate.tensor("values", values)
    _validate.tensor("idx", idx)
    unbatched = values.dim() == 2 and idx.dim() == 2
    if unbatched:
        values, idx = values[None], idx[None]
    top, bottom, total, _ = knn_reduce_op(values, idx)
    return (top[0], bottom[0], total[0]) if unbatched else (top, bottom, total)
