"""The Triton kernels of ``distributed``'s pruning passes (``distributed`` launches them)."""

from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _cell_of(points, offs, live, stride, column_stride, grid_lo, side, S0, S1, S2, D: tl.constexpr):
    """(flat cell int64, finite) of the rows ``offs`` of points: ``_Occupancy.cells``."""
    flat = tl.zeros(offs.shape, tl.int64)
    finite = live
    for d in tl.static_range(D):
        size = S0 if d == 0 else (S1 if d == 1 else S2)
        q = tl.load(points + offs * stride + d * column_stride, mask=live, other=0.0).to(tl.float64)
        finite &= tl.abs(q) < float("inf")  # false for NaN too
        index = tl.floor((q - tl.load(grid_lo + d)) / tl.load(side + d))
        index = tl.where(tl.abs(index) < float("inf"), index, 0.0)
        index = tl.minimum(tl.maximum(index, 0.0), size - 1.0)
        flat = flat * size + index.to(tl.int64)
    return flat, finite

@triton.jit
def _cells_kernel(points, stride, column_stride, rows, grid_lo, side, S0, S1, S2, flat_out, finite_out,
                  D: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < rows
    flat, finite = _cell_of(points, offs, live, stride, column_stride, grid_lo, side, S0, S1, S2, D)
    tl.store(flat_out + offs, flat, mask=live)
    tl.store(finite_out + offs, finite, mask=live)

@triton.jit
def _reaching_kernel(query, stride, column_stride, rows, box, limit, limit_stride, margin, out,
                     grid_lo, side, S0, S1, S2, steps, smallest,
                     D: tl.constexpr, OCCUPIED: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = not (gap_i (1 - margin) > limit_i): ``_reaching`` of one row a thread."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < rows
    gap2 = tl.zeros([BLOCK], tl.float64)
    undefined = offs < 0  # NaN anywhere in the gap: torch's maximum propagates it
    for d in tl.static_range(D):
        q = tl.load(query + offs * stride + d * column_stride, mask=live, other=0.0).to(tl.float64)
        below, above = tl.load(box + d) - q, q - tl.load(box + D + d)
        undefined |= (below != below) | (above != above)
        g = tl.maximum(tl.maximum(below, above), 0.0)
        gap2 += g * g
    gap = tl.sqrt(gap2)
    if OCCUPIED:
        flat, finite = _cell_of(query, offs, live, stride, column_stride, grid_lo, side, S0, S1, S2, D)
        apart = tl.maximum(tl.load(steps + flat, mask=live & finite, other=0) - 2, 0)
        gap = tl.maximum(gap, tl.where(finite, apart.to(tl.float64) * smallest, 0.0))
    bound = tl.load(limit + offs * limit_stride, mask=live, other=0.0).to(tl.float64)
    tl.store(out + offs, ~(~undefined & (gap * (1 - margin) > bound)), mask=live)
