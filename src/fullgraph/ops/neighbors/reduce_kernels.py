"""The Triton kernels of ``knn_reduce`` (``reduce`` launches them)."""

from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _reduce_kernel(values, idx, out_max, out_min, out_sum, slots, total_rows, rows, columns, channels,
                   K: tl.constexpr, CP: tl.constexpr, BLOCK_M: tl.constexpr, ACC: tl.constexpr):
    """For flat query rows i: the maximum, minimum (and their first slots) and sum over
    the valid slots of lists idx [B*M, K] of rows of values [B*N, C]; 0 without any."""
    offs = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, CP)
    live = offs < total_rows
    in_c = cols[None, :] < channels
    base = (offs // rows) * columns
    top = tl.full((BLOCK_M, CP), float("-inf"), ACC)
    bottom = tl.full((BLOCK_M, CP), float("inf"), ACC)
    total = tl.zeros((BLOCK_M, CP), ACC)
    top_slot = tl.zeros((BLOCK_M, CP), tl.int32)
    bottom_slot = tl.zeros((BLOCK_M, CP), tl.int32)
    found = tl.zeros((BLOCK_M,), tl.int32)
    for r in range(K):
        j = tl.load(idx + offs * K + r, mask=live, other=-1)
        ok = j >= 0
        v = tl.load(values + (base + j)[:, None] * channels + cols[None, :], mask=ok[:, None] & in_c,
                    other=0.0).to(ACC)
        # NaN wins both extremes and stays (torch.amax's rule)
        higher = ok[:, None] & ((v > top) | (v != v)) & (top == top)
        lower = ok[:, None] & ((v < bottom) | (v != v)) & (bottom == bottom)
        top, top_slot = tl.where(higher, v, top), tl.where(higher, r, top_slot)
        bottom, bottom_slot = tl.where(lower, v, bottom), tl.where(lower, r, bottom_slot)
        total += v
        found += ok.to(tl.int32)
    some = (found > 0)[:, None]
    where = offs[:, None] * channels + cols[None, :]
    keep = live[:, None] & in_c
    tl.store(out_max + where, tl.where(some, top, 0.0).to(out_max.dtype.element_ty), mask=keep)
    tl.store(out_min + where, tl.where(some, bottom, 0.0).to(out_min.dtype.element_ty), mask=keep)
    tl.store(out_sum + where, total.to(out_sum.dtype.element_ty), mask=keep)
    tl.store(slots + where, top_slot.to(tl.int16), mask=keep)
    tl.store(slots + total_rows * channels + where, bottom_slot.to(tl.int16), mask=keep)


@triton.jit
def _per_slot_kernel(grad_max, grad_min, grad_sum, slots, out, total_rows, channels, K: tl.constexpr,
                     CP: tl.constexpr, BLOCK_M: tl.constexpr):
    """out[i * K + r] = grad_sum[i] + grad_max[i] where r held the maximum + grad_min[i]
    where it held the minimum, per channel, float32 [B*M*K, C]."""
    offs = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, CP)
    keep = (offs < total_rows)[:, None] & (cols[None, :] < channels)
    where = offs[:, None] * channels + cols[None, :]
    g_sum = tl.load(grad_sum + where, mask=keep, other=0.0).to(tl.float32)
    g_max = tl.load(grad_max + where, mask=keep, other=0.0).to(tl.float32)
    g_min = tl.load(grad_min + where, mask=keep, other=0.0).to(tl.float32)
    top = tl.load(slots + where, mask=keep, other=-1).to(tl.int32)
    bottom = tl.load(slots + total_rows * channels + where, mask=keep, other=-1).to(tl.int32)
    for r in range(K):
        share = g_sum + tl.where(top == r, g_max, 0.0) + tl.where(bottom == r, g_min, 0.0)
        tl.store(out + (offs[:, None] * K + r) * channels + cols[None, :], share, mask=keep)
