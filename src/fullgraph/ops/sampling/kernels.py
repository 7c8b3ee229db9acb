"""The Triton kernels of farthest point sampling (``api`` launches them)."""

from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _distances(base, current, chunk_offs, end, gaps, dims, D: tl.constexpr):
    """Update the scratch distances of points ``chunk_offs`` (< end) with the sample
    ``current``; returns them (-1: invalid, never taken; -2: beyond end)."""
    inside = chunk_offs < end
    chunk = tl.load(base + chunk_offs[:, None] * D + dims[None, :], mask=inside[:, None] & (dims < D)[None, :],
                    other=0.0)
    centre = tl.load(base + current * D + dims, mask=dims < D, other=0.0)
    gap = tl.load(gaps + chunk_offs, mask=inside, other=-2.0)
    diff = chunk - centre[None, :]
    gap = tl.where(gap >= 0, tl.minimum(gap, tl.sum(diff * diff, 1)), gap)
    tl.store(gaps + chunk_offs, gap, mask=inside)
    return gap

@triton.jit
def _column(base, offs, inside, d: tl.constexpr, D: tl.constexpr):
    """Coordinate d of points ``offs`` (0 where d >= D: never read)."""
    if d < D:
        column = tl.load(base + offs * D + d, mask=inside, other=0.0)
    else:
        column = 0.0
    return column

@triton.jit
def _square_distances(x0, x1, x2, x3, base, current, D: tl.constexpr):
    """Squared distances of the columns x0..x3 (the first D of them) to point ``current``,
    summed over the coordinates in order like the reference (compiled without FMA)."""
    d = x0 - tl.load(base + current * D)
    total = d * d
    if D > 1:
        d = x1 - tl.load(base + current * D + 1)
        total = total + d * d
    if D > 2:
        d = x2 - tl.load(base + current * D + 2)
        total = total + d * d
    if D > 3:
        d = x3 - tl.load(base + current * D + 3)
        total = total + d * d
    return total

@triton.jit
def _first_of_largest(values, at, none):
    """The smallest ``at`` among the largest ``values`` (``none`` for lanes out of play)."""
    top = tl.max(values, 0)
    return top, tl.min(tl.where(values == top, at, none), 0)

@triton.jit
def _winner(slots, b, batch, step, slice_len, size, PARTS: tl.constexpr, PARTS_P: tl.constexpr):
    """The sample after ``step`` of cloud b: the first of the largest candidates its parts
    published in ``slots``, once every part has (their words carry the step's low byte)."""
    parts = tl.arange(0, PARTS_P)
    words = slots + ((step % 2) * batch + b) * PARTS + parts
    tag = step & 0xFF
    word = tl.load(words, mask=parts < PARTS, other=-1, volatile=True)
    while tl.sum(tl.where((parts < PARTS) & (((word >> 24) & 0xFF) != tag), 1, 0), 0) > 0:
        word = tl.load(words, mask=parts < PARTS, other=-1, volatile=True)
    # One reduction: the largest (distance key, then the earliest part and offset) wins.
    order = ((255 - parts).to(tl.int64) << 24) | (0xFFFFFF - (word & 0xFFFFFF))
    best = tl.max(tl.where(parts < PARTS, ((word >> 32) << 32) | order, -1), 0)
    return (255 - ((best >> 24) & 0xFF)) * slice_len + (0xFFFFFF - (best & 0xFFFFFF))

@triton.jit(do_not_specialize=["first_step", "last_step"])
def _fps_kernel(points, gaps, start, out, slots, batch, size, count, first_step, last_step, slice_len,
                D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
                PARTS_P: tl.constexpr, RESIDENT: tl.constexpr, COLUMNS: tl.constexpr):
    """Samples first_step..last_step - 1 of cloud b = program_id(0), whose points
    [part * slice_len, +slice_len) part = program_id(1) searches. gaps [B, N]: squared
    distances to the samples so far (-1: never taken); slots [2, B, PARTS] int64: each
    part's candidate by the parity of its step (distance bits + 1 or 0 for none, step & 255,
    offset in the part). COLUMNS: a resident slice of D <= 4 held as one tensor per
    coordinate, so a step needs no exchange between threads before its reduction."""
    b = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    base = points + b * size * D
    own = gaps + b * size
    lo = part.to(tl.int64) * slice_len
    end = tl.minimum(lo + slice_len, size)
    dims = tl.arange(0, DP)
    lanes = tl.arange(0, BLOCK)
    if RESIDENT:
        inside = lo + lanes < end
        if COLUMNS:
            x0 = _column(base, lo + lanes, inside, 0, D)
            x1 = _column(base, lo + lanes, inside, 1, D)
            x2 = _column(base, lo + lanes, inside, 2, D)
            x3 = _column(base, lo + lanes, inside, 3, D)
        else:
            block = tl.load(base + (lo + lanes)[:, None] * D + dims[None, :],
                            mask=inside[:, None] & (dims < D)[None, :], other=0.0)
        gap = tl.load(own + lo + lanes, mask=inside, other=-2.0)
    if first_step == 0:
        current = tl.load(start + b)
    else:
        current = _winner(slots, b, batch, first_step - 1, slice_len, size, PARTS, PARTS_P)
    for step in range(first_step, last_step):
        tl.store(out + b * count + step, current, mask=part == 0)
        if step + 1 < count:
            if RESIDENT:
                if COLUMNS:
                    distances = _square_distances(x0, x1, x2, x3, base, current, D)
                else:
                    diff = block - tl.load(base + current * D + dims, mask=dims < D, other=0.0)[None, :]
                    distances = tl.sum(diff * diff, 1)
                gap = tl.where(gap >= 0, tl.minimum(gap, distances), gap)
                top, offset = tl.max(gap, 0, return_indices=True, return_indices_tie_break_left=True)
            else:
                best = tl.full((BLOCK,), -3.0, tl.float32)
                best_at = tl.zeros((BLOCK,), tl.int64)
                for first in range(lo, end, BLOCK):
                    chunk_gap = _distances(base, current, first + lanes, end, own, dims, D)
                    better = chunk_gap > best  # strictly: each lane keeps its earliest maximum
                    best = tl.where(better, chunk_gap, best)
                    best_at = tl.where(better, first + lanes - lo, best_at)
                top, offset = _first_of_largest(best, best_at, slice_len)
                tl.debug_barrier()  # the scratch distances written, before any thread reads them again
            if PARTS == 1 and step + 1 < last_step:
                current = offset.to(tl.int64)
            else:
                key = tl.where(top >= 0, top.to(tl.int32, bitcast=True) + 1, 0).to(tl.int64)
                word = (key << 32) | (tl.cast(step & 0xFF, tl.int64) << 24) | offset.to(tl.int64)
                tl.store(slots + ((step % 2) * batch + b) * PARTS + part, word)
                if step + 1 < last_step:
                    current = _winner(slots, b, batch, step, slice_len, size, PARTS, PARTS_P)
    if RESIDENT:
        tl.store(own + lo + lanes, gap, mask=inside)
