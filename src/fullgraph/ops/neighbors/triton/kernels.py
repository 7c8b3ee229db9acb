"""The Triton kernels of the "triton" neighbour backend (``backend.py`` launches them).

Search and the fused aggregations walk the uniform grid of ``grid.py``; see
``backend.py``'s docstring for the algorithms. Nothing here synchronizes with the host or
allocates: the kernels only read and write the tensors they are given.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..keys import KEY_NONE, insert_keys
from .grid_kernels import INV_SIDE, SCALE, SHIFT, SIDE, SLACK, VALUES

# A sorted position beyond every array (masked lanes of a packed tile).
_NOWHERE = tl.constexpr(1 << 62)
# A block's points are searched together when they lie within this many cells per axis: a few
# queries that share their candidates (search), or a wider block whose tiles feed matrix
# products (aggregation).
SEARCH_SPREAD, AGGREGATE_SPREAD = tl.constexpr(2), tl.constexpr(1 << 30)

@triton.jit
def _load_points(base, offs, count, stride, D: tl.constexpr, dim: tl.constexpr):
    """Column ``dim`` of a [count, D] block as float32 (0 outside)."""
    return tl.load(base + offs * stride + dim, mask=offs < count, other=0.0).to(tl.float32)

@triton.jit
def _tile_d2(q_base, r_base, offs_m, offs_n, rows, columns, D: tl.constexpr):
    """Squared distances [BLOCK_M, BLOCK_N] between rows of two [*, D] arrays, summed by
    explicit fused multiply-adds: the same bits whatever the block shape the compiler
    sees (a radius set to a distance the kNN returned must include that point)."""
    d2 = tl.zeros((offs_m.shape[0], offs_n.shape[0]), dtype=tl.float32)
    if D <= 4:
        for dim in tl.static_range(D):
            diff = _load_points(q_base, offs_m, rows, D, D, dim)[:, None] - _load_points(
                r_base, offs_n, columns, D, D, dim)[None, :]
            d2 = tl.fma(diff, diff, d2)
    else:  # a loop, not unrolled: feature-space D (up to hundreds) compiles in seconds
        for dim in range(D):
            diff = _load_points(q_base, offs_m, rows, D, D, dim)[:, None] - _load_points(
                r_base, offs_n, columns, D, D, dim)[None, :]
            d2 = tl.fma(diff, diff, d2)
    return d2

@triton.jit
def _load_block(base, offs, count, width, WIDTH_P: tl.constexpr):
    """A [len(offs), WIDTH_P] float32 block of a row-major [count, width] array, 0-padded."""
    cols = tl.arange(0, WIDTH_P)
    mask = (offs < count)[:, None] & (cols < width)[None, :]
    return tl.load(base + offs[:, None] * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)

@triton.jit
def _store_rows(base, order, offs, count, item, block, width, WIDTH_P: tl.constexpr):
    """Store a [len(offs), WIDTH_P] block of sorted rows at their original rows."""
    rows = tl.load(order + item + offs, mask=offs < count, other=0)
    cols = tl.arange(0, WIDTH_P)
    mask = (offs < count)[:, None] & (cols < width)[None, :]
    tl.store(base + rows[:, None] * width + cols[None, :], block.to(base.dtype.element_ty), mask=mask)

@triton.jit
def _component(v, dims, i):
    return tl.sum(tl.where(dims == i, v, 0), 0)

@triton.jit
def _cell_box(values, shape, b, points, offs, count, member, reach, D: tl.constexpr):
    """Cells [lo, hi] (int32 [4] each, x y z and a unit 4th axis) that hold everything
    within ``reach`` of the ``member`` points of rows ``offs < count`` of a sorted [*, D]
    array; the block of their coordinates and the frame."""
    dims = tl.arange(0, 4)
    origin = tl.load(values + b * VALUES + dims, mask=dims < 3, other=0.0)
    inv_side = tl.load(values + b * VALUES + INV_SIDE)
    axes = tl.load(shape + b * 4 + dims)
    block = _load_block(points, offs, count, tl.minimum(D, 3), 4)
    low = tl.min(tl.where(member[:, None], block, float("inf")), 0) - reach
    high = tl.max(tl.where(member[:, None], block, -float("inf")), 0) + reach
    top = (axes - 1).to(tl.float32)
    lo = tl.minimum(tl.maximum(tl.floor((low - origin) * inv_side), 0.0), top).to(tl.int32)
    hi = tl.minimum(tl.maximum(tl.floor((high - origin) * inv_side), 0.0), top).to(tl.int32)
    return lo, hi, block, origin, axes, dims

@triton.jit
def _groups(values, shape, b, points, offs, count, spread, D: tl.constexpr):
    """How a block's live points (offs < count) are searched: together when they lie
    within ``spread`` cells per axis, else one at a time (a block straddling distant cells,
    far from the data, would search everything between them). Returns (groups, together, live)."""
    live = offs < count
    lo, hi, _, _, _, _ = _cell_box(values, shape, b, points, offs, count, live, 0.0, D)
    together = tl.max(hi - lo, 0) <= spread
    return tl.where(together, 1, offs.shape[0]), together, live

@triton.jit
def _rows_in_box(lo, hi, dims):
    return (_component(hi, dims, 1) - _component(lo, dims, 1) + 1) * (
        _component(hi, dims, 2) - _component(lo, dims, 2) + 1)

@triton.jit
def _first_at(bucket_start, within, shift, cell, wanted):
    """The first sorted position of the points in cells >= ``cell`` (int64, of the item
    whose table starts at ``bucket_start``; lanes ``wanted``): the start of the cell's
    bucket, then, where a bucket holds 2^shift cells, a binary search of ``within``."""
    start = tl.load(bucket_start + (cell >> shift), mask=wanted, other=0)
    if shift > 0:
        target = (cell & ((1 << shift) - 1)).to(tl.int32)
        size = tl.where(wanted & (target > 0),
                        tl.load(bucket_start + (cell >> shift) + 1, mask=wanted, other=0) - start, 0)
        while tl.max(size, 0) > 0:
            half = size // 2
            below = (size > 0) & (tl.load(within + start + half, mask=size > 0, other=0).to(tl.int32) < target)
            start = tl.where(below, start + half + 1, start)
            size = tl.where(below, size - half - 1, half)
    return start

@triton.jit
def _row_segments(bucket_start, within, shift, axes, dims, lo, hi, prev_lo, prev_hi, first, LANES: tl.constexpr):
    """Sorted-position ranges [starts, ends) of the cells of box [lo, hi] outside box
    [prev_lo, prev_hi], for LANES // 2 rows along x from row ``first`` of the box: lane i
    takes the row's cells below the previous box (or the whole row when it misses that
    box), lane i + LANES // 2 those above it. ``pending`` marks the non-empty ranges.
    One vector load reads many rows: far from the data, most rows are empty."""
    lane = tl.arange(0, LANES)
    row = first + lane % (LANES // 2)
    above = lane >= LANES // 2
    lo_y, lo_z = _component(lo, dims, 1), _component(lo, dims, 2)
    span_y = _component(hi, dims, 1) - lo_y + 1
    y, z = lo_y + row % span_y, lo_z + row // span_y
    in_box = row < _rows_in_box(lo, hi, dims)
    inner = (y >= _component(prev_lo, dims, 1)) & (y <= _component(prev_hi, dims, 1)) & (
        z >= _component(prev_lo, dims, 2)) & (z <= _component(prev_hi, dims, 2))
    lo_x, hi_x = _component(lo, dims, 0), _component(hi, dims, 0)
    x0 = tl.where(above, _component(prev_hi, dims, 0) + 1, lo_x)
    x1 = tl.where(above | ~inner, hi_x, _component(prev_lo, dims, 0) - 1)
    wanted = in_box & (~above | inner)
    base = (z * _component(axes, dims, 1) + y).to(tl.int64) * _component(axes, dims, 0)
    starts = _first_at(bucket_start, within, shift, base + x0, wanted)
    ends = _first_at(bucket_start, within, shift, base + x1 + 1, wanted)
    return starts, ends, wanted & (ends > starts)

@triton.jit
def _next_start(starts, ends, pending, position, bound):
    """The first position at or after ``position`` in a pending range [starts, ends), or
    ``bound``. A walk that takes tiles of consecutive positions from there crosses from
    one range into the next (a row of cells holds fewer than a tile, and each tile is a
    step of a dependent chain); the positions between ranges lie in cells outside the
    box, too far to pass the distance test."""
    return tl.min(tl.where(pending & (ends > position), tl.maximum(starts, position), bound), 0)

@triton.jit
def _in_item_units(values, b, radius2, reach):
    """(radius^2, reach, scale) with the first two in units of item b's scale, the units of
    its sorted points (a power of two: exact). A radius^2 saturated at float32's maximum
    is recomputed from the reach in those units."""
    scale = tl.load(values + b * VALUES + SCALE)
    scaled_reach = reach / scale
    saturated = radius2 >= 3.4028234663852886e38
    return tl.where(saturated, scaled_reach * scaled_reach, radius2 / scale / scale), scaled_reach, scale

# ------------------------------------------------------------------ search

@triton.jit
def _search_tile(best, threshold, count, offs_n, end, q_base, offs_m, q_live, member, r_points, r_order, item_r,
                 radius2, slots, q_index, D: tl.constexpr, USE_RADIUS: tl.constexpr, SKIP_SELF: tl.constexpr,
                 SORT_FROM: tl.constexpr):
    """Enter the sorted references at positions ``offs_n`` (those < end) into the lists."""
    d2 = _tile_d2(q_base, r_points, offs_m, offs_n, q_live, end, D)
    ok = member[:, None] & (offs_n < end)[None, :]
    if USE_RADIUS:
        ok = ok & (d2 <= radius2)
        count += tl.sum(ok.to(tl.int64), 1)
    index = tl.load(r_order + offs_n, mask=offs_n < end, other=0) - item_r
    if SKIP_SELF:
        ok = ok & (index[None, :] != q_index[:, None])
    # Keyed by the distance as reported (sqrt rounded to nearest like torch.sqrt), not by d2:
    # two d2 one ulp apart can share a distance, and ties in the reported distance go to the
    # smaller index.
    keys = (tl.sqrt_rn(d2).to(tl.int32, bitcast=True).to(tl.int64) << 32) | index
    keys = tl.where(ok, keys, tl.full(keys.shape, KEY_NONE, tl.int64))
    best, threshold = insert_keys(best, threshold, keys, slots, SORT_FROM)
    return best, threshold, count

@triton.jit
def _search_segments(best, threshold, count, starts, ends, pending, q_base, offs_m, q_live, member, r_points,
                     r_order, item_r, radius2, slots, q_index, D: tl.constexpr, USE_RADIUS: tl.constexpr,
                     SKIP_SELF: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr,
                     SORT_FROM: tl.constexpr):
    """Search the sorted references [starts[i], ends[i]) of the lanes i still ``pending``
    (SKIP_SELF: not the reference of index q_index[i], the query itself). kNN packs the
    ranges one after another into tiles of BLOCK_N: far from the data, where the rings
    grow, a range holds a reference or two, and a tile each was mostly empty (1M x 1M
    normal 7.84 -> 5.60 ms, uniform 4.63 -> 4.32; H100). Radius
    searches, whose rows are long, take a range at a time (packed: 4.88 -> 5.77 ms)."""
    if USE_RADIUS:
        while tl.max(pending.to(tl.int32), 0) > 0:
            start, end, pending = _next_segment(starts, ends, pending)
            for s in range(start, end, BLOCK_N):
                best, threshold, count = _search_tile(
                    best, threshold, count, s + tl.arange(0, BLOCK_N), end, q_base, offs_m, q_live, member,
                    r_points, r_order, item_r, radius2, slots, q_index, D, USE_RADIUS, SKIP_SELF, SORT_FROM)
    else:
        lengths = tl.where(pending, ends - starts, 0)
        packed_ends = tl.cumsum(lengths, 0)
        to_sorted = starts.to(tl.int64) - (packed_ends - lengths)  # packed position -> sorted, per range
        total = tl.sum(lengths, 0)
        for tile in range(0, total, BLOCK_N):
            packed = tile + tl.arange(0, BLOCK_N)
            # The range of each packed position: the number of ranges that end at or before it.
            lane = tl.zeros((BLOCK_N,), tl.int32)
            for step in tl.static_range(16):
                if (LANES >> (step + 1)) > 0:
                    half = LANES >> (step + 1)
                    lane = tl.where(tl.gather(packed_ends, lane + (half - 1), 0) <= packed, lane + half, lane)
            end = tl.full((), _NOWHERE, tl.int64)
            best, threshold, count = _search_tile(
                best, threshold, count, tl.where(packed < total, tl.gather(to_sorted, lane, 0) + packed, end),
                end, q_base, offs_m, q_live, member, r_points, r_order, item_r, radius2, slots, q_index, D,
                USE_RADIUS, SKIP_SELF, SORT_FROM)
    return best, threshold, count

@triton.jit
def _next_segment(starts, ends, pending):
    """The first pending range (start, end) and the ranges still pending after it."""
    lanes = tl.arange(0, starts.shape[0])
    lane = tl.min(tl.where(pending, lanes, starts.shape[0]), 0)
    start = tl.sum(tl.where(lanes == lane, starts, 0), 0).to(tl.int64)
    end = tl.sum(tl.where(lanes == lane, ends, 0), 0).to(tl.int64)
    return start, end, pending & (lanes != lane)

@triton.jit
def _search_box(best, threshold, count, lo, hi, prev_lo, prev_hi, r_start, r_within, shift, axes, dims, q_base,
                offs_m, q_live, member, r_points, r_order, item_r, radius2, slots, q_index, D: tl.constexpr,
                USE_RADIUS: tl.constexpr, SKIP_SELF: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr,
                SORT_FROM: tl.constexpr):
    """Search the cells of box [lo, hi] outside box [prev_lo, prev_hi] (``_row_segments``,
    then ``_search_segments``)."""
    for first in range(0, _rows_in_box(lo, hi, dims), LANES // 2):
        starts, ends, pending = _row_segments(r_start, r_within, shift, axes, dims, lo, hi, prev_lo, prev_hi,
                                              first, LANES)
        best, threshold, count = _search_segments(
            best, threshold, count, starts, ends, pending, q_base, offs_m, q_live, member, r_points, r_order,
            item_r, radius2, slots, q_index, D, USE_RADIUS, SKIP_SELF, BLOCK_N, LANES, SORT_FROM)
    return best, threshold, count

@triton.jit
def search_kernel(
    q_points, q_order, q_start, r_points, r_order, r_start, r_within, values, shape,
    out_dist, out_idx, out_count, needed, rows, columns, buckets, radius2, reach,
    D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, USE_RADIUS: tl.constexpr, MASKED: tl.constexpr,
    SKIP_SELF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr,
    SORT_FROM: tl.constexpr,
):
    """The k nearest references of each query (within the radius if USE_RADIUS; SKIP_SELF:
    query and ref are one cloud, and a point is not its own neighbour); with USE_RADIUS,
    the count of references within the radius before the cap."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    item_q, item_r = b * rows, b * columns
    slot_base = b * (buckets + 1)
    q_live = tl.load(q_start + slot_base + buckets) - item_q
    shift = tl.load(values + b * VALUES + SHIFT).to(tl.int64)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    q_base = q_points + item_q * D
    groups, together, live = _groups(values, shape, b, q_base, offs_m, q_live, SEARCH_SPREAD, D)
    flat_rows = tl.load(q_order + item_q + offs_m, mask=offs_m < rows, other=0)
    if MASKED:  # only the queries flagged in needed [B*M] are searched (the others' rows are garbage)
        live = live & (tl.load(needed + flat_rows, mask=offs_m < rows, other=0) != 0)
    radius2, reach, scale = _in_item_units(values, b, radius2, reach)
    side = tl.load(values + b * VALUES + SIDE)
    slack = tl.load(values + b * VALUES + SLACK)
    slots = tl.arange(0, KP)
    # Padding slots (>= K) hold -1 so that the row maximum only sees real slots.
    best = tl.where(slots[None, :] < K, tl.full((BLOCK_M, KP), KEY_NONE, tl.int64),
                    tl.full((BLOCK_M, KP), -1, tl.int64))
    threshold = tl.max(best, 1)
    count = tl.zeros((BLOCK_M,), dtype=tl.int64)
    for group in range(0, groups):
        member = live & (together | (tl.arange(0, BLOCK_M) == group))
        clo, chi, block, origin, axes, dims = _cell_box(values, shape, b, q_base, offs_m, q_live, member, reach, D)
        # The box searched so far (none yet): radius search takes its box at once, kNN rings.
        prev_lo, prev_hi = axes, axes * 0 - 1
        searching = tl.max(member.to(tl.int32), 0)
        if USE_RADIUS:
            # A loop that runs once, the box set before it: faster than straight code (NOTES.md).
            lo, hi = clo, chi
            while searching > 0:
                best, threshold, count = _search_box(
                    best, threshold, count, lo, hi, prev_lo, prev_hi, r_start + slot_base, r_within, shift,
                    axes, dims, q_base, offs_m, q_live, member, r_points, r_order, item_r, radius2, slots,
                    flat_rows - item_q, D, USE_RADIUS, SKIP_SELF, BLOCK_N, LANES, SORT_FROM)
                searching = searching * 0
        else:
            ring = tl.zeros((), tl.int32) + 1
            while searching > 0:
                lo, hi = tl.maximum(clo - ring, 0), tl.minimum(chi + ring, axes - 1)
                best, threshold, count = _search_box(
                    best, threshold, count, lo, hi, prev_lo, prev_hi, r_start + slot_base, r_within, shift,
                    axes, dims, q_base, offs_m, q_live, member, r_points, r_order, item_r, radius2, slots,
                    flat_rows - item_q, D, USE_RADIUS, SKIP_SELF, BLOCK_N, LANES, SORT_FROM)
                # Distance from each query to the unsearched space (inf where the box
                # reaches the grid's end); the k-th distance must lie within it.
                below = tl.where((lo > 0)[None, :], block - (origin + lo.to(tl.float32) * side)[None, :],
                                 float("inf"))
                above = tl.where((hi < axes - 1)[None, :],
                                 (origin + (hi + 1).to(tl.float32) * side)[None, :] - block, float("inf"))
                margin = slack + 1e-6 * tl.max(tl.abs(block), 1)
                bound = tl.min(tl.minimum(below, above), 1) - margin
                kth = (threshold >> 32).to(tl.int32).to(tl.float32, bitcast=True)
                settled = (threshold != KEY_NONE) & (bound > 0) & (kth <= bound)
                done = ~member | (bound == float("inf")) | settled
                searching = 1 - tl.min(done.to(tl.int32), 0)
                prev_lo, prev_hi = lo, hi
                ring += tl.maximum(ring // 2, 1)  # far from the others, a query needs many rings: grow by half
    best = tl.sort(tl.where(best < 0, tl.full(best.shape, KEY_NONE, tl.int64), best), 1)  # the -1 slots
    found = best != KEY_NONE
    index = tl.where(found, best & 0xFFFFFFFF, -1)
    # The keys hold the distances (with the threshold of ``radius2``, dist <= radius exactly
    # for every listed neighbour).
    dist = tl.where(found, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True) * scale, float("inf"))
    out_offs = flat_rows[:, None] * K + slots[None, :]
    mask = (offs_m < rows)[:, None] & (slots[None, :] < K)
    tl.store(out_dist + out_offs, dist.to(out_dist.dtype.element_ty), mask=mask)
    tl.store(out_idx + out_offs, index, mask=mask)
    if USE_RADIUS:
        tl.store(out_count + flat_rows, count, mask=offs_m < rows)

# ------------------------------------------------------------- aggregation

@triton.jit
def _radius_weights(d2, ok, row_min, row_sum, inv_sigma):
    """Normalized weights p [BM, BN] and distances d of the pairs within the radius."""
    d = tl.sqrt(d2)
    total = tl.where(row_sum > 0, row_sum, 1.0)
    p = tl.where(ok, tl.exp(tl.where(ok, row_min[:, None] - d, 0.0) * inv_sigma) / total[:, None], 0.0)
    return p, d

@triton.jit
def radius_aggregate_kernel(
    q_points, q_order, q_start, r_points, r_start, r_within, features, values, shape, out, out_min, out_sum,
    rows, buckets, channels, radius2, reach, inv_sigma,
    D: tl.constexpr, CP: tl.constexpr, STATS_ONLY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LANES: tl.constexpr, PRECISION: tl.constexpr,
):
    """Per sorted query: minimum distance and weight sum (sorted, in the item's scaled
    units) or, unless STATS_ONLY, out and out_min = [B*M, 2] of (minimum distance in the
    caller's units, weight sum), both at the query's original row."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    item_q, slot_base = b * rows, b * (buckets + 1)
    q_live = tl.load(q_start + slot_base + buckets) - item_q
    shift = tl.load(values + b * VALUES + SHIFT).to(tl.int64)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    q_base = q_points + item_q * D
    groups, together, live = _groups(values, shape, b, q_base, offs_m, q_live, AGGREGATE_SPREAD, D)
    radius2, reach, scale = _in_item_units(values, b, radius2, reach)
    inv_sigma = inv_sigma * scale
    row_min = tl.full((BLOCK_M,), float("inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, CP), dtype=tl.float32)
    # Per output entry: how many non-finite feature values it would sum (set apart so
    # that 0 * nan in the product never reaches the queries that do not use them).
    poison = tl.zeros((BLOCK_M, CP), dtype=tl.float32)
    for group in range(0, groups):
        member = live & (together | (tl.arange(0, BLOCK_M) == group))
        lo, hi, _, _, axes, dims = _cell_box(values, shape, b, q_base, offs_m, q_live, member, reach, D)
        for first in range(0, _rows_in_box(lo, hi, dims), LANES // 2):
            # The previous box is empty: every row of this one is new.
            starts, ends, pending = _row_segments(r_start + slot_base, r_within, shift, axes, dims, lo, hi, axes,
                                                  axes * 0 - 1, first, LANES)
            end = tl.max(tl.where(pending, ends, 0), 0)
            s = _next_start(starts, ends, pending, 0, end)
            while s < end:
                offs_n = s + tl.arange(0, BLOCK_N)
                d2 = _tile_d2(q_base, r_points, offs_m, offs_n, q_live, end, D)
                ok = member[:, None] & (offs_n < end)[None, :] & (d2 <= radius2)
                if tl.max(ok.to(tl.int32)) > 0:
                    d = tl.sqrt(d2)
                    new_min = tl.minimum(row_min, tl.min(tl.where(ok, d, float("inf")), 1))
                    # Rescale what was summed against the old minimum; nothing was summed
                    # while it was inf. The inner selects keep inf - inf out of the exps.
                    seen = row_min < float("inf")
                    alpha = tl.where(seen, tl.exp(tl.where(seen, new_min - row_min, 0.0) * inv_sigma), 0.0)
                    w = tl.where(ok, tl.exp(tl.where(ok, new_min[:, None] - d, 0.0) * inv_sigma), 0.0)
                    row_sum = row_sum * alpha + tl.sum(w, 1)
                    if not STATS_ONLY:
                        f = _load_block(features, offs_n, end, channels, CP)
                        bad = (f != f) | (tl.abs(f) == float("inf"))
                        if tl.max(bad.to(tl.int32)) > 0:
                            f = tl.where(bad, 0.0, f)
                            poison += tl.dot((w > 0).to(tl.float16), bad.to(tl.float16))
                        acc = acc * alpha[:, None] + tl.dot(w, f, input_precision=PRECISION)
                    row_min = new_min
                s = _next_start(starts, ends, pending, s + BLOCK_N, end)
    if STATS_ONLY:
        tl.store(out_min + item_q + offs_m, row_min, mask=offs_m < rows)
        tl.store(out_sum + item_q + offs_m, row_sum, mask=offs_m < rows)
    else:
        result = tl.where(poison > 0, float("nan"), acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None])
        _store_rows(out, q_order, offs_m, rows, item_q, result, channels, CP)
        _store_rows(out_min, q_order, offs_m, rows, item_q, tl.join(row_min * scale, row_sum), 2, 2)

@triton.jit
def _radius_pair_terms(d2, ok, offs_m, q_count, offs_n, r_count, features, grad_out, row_min_ptr, row_sum_ptr,
                       delta_ptr, channels, inv_sigma, scale, CP: tl.constexpr, PRECISION: tl.constexpr):
    """For a [BM, BN] tile with pairs ``ok`` at squared distances d2 (in units of the
    item's ``scale``): weights p, the distance-gradient factor c = dL/dd / d, and the
    loaded blocks f [BN, CP] and g [BM, CP]. Query-side arrays are indexed by offs_m,
    reference-side ones by offs_n. With c in scaled units, c (q - r) is the gradient in
    the user's units (the scale cancels)."""
    row_min = tl.load(row_min_ptr + offs_m, mask=offs_m < q_count, other=0.0)
    row_sum = tl.load(row_sum_ptr + offs_m, mask=offs_m < q_count, other=0.0)
    delta = tl.load(delta_ptr + offs_m, mask=offs_m < q_count, other=0.0)
    p, d = _radius_weights(d2, ok, row_min, row_sum, inv_sigma * scale)
    g = _load_block(grad_out, offs_m, q_count, channels, CP)
    f = _load_block(features, offs_n, r_count, channels, CP)
    projected = tl.dot(g, tl.trans(f), input_precision=PRECISION)
    grad_d = -(p * inv_sigma) * (projected - delta[:, None])
    c = tl.where(ok & (d > 0), grad_d / tl.where(d > 0, d, 1.0), 0.0)
    return p, c, f, g

@triton.jit
def _pull(c, q_base, offs_m, q_count, r_base, offs_n, r_count, axis: tl.constexpr, D: tl.constexpr,
          dim: tl.constexpr):
    """Coordinate ``dim`` of sum over the other axis of c_ij (q_i - r_j); the columns are
    loaded one at a time (cached: _tile_d2 read them), not as [*, D] blocks."""
    diff = _load_points(q_base, offs_m, q_count, D, D, dim)[:, None] - _load_points(
        r_base, offs_n, r_count, D, D, dim)[None, :]
    return tl.sum(c * diff, axis)

@triton.jit
def _pulls(c, q_base, offs_m, q_count, r_base, offs_n, r_count, axis: tl.constexpr, D: tl.constexpr,
           DP: tl.constexpr):
    """sum over the other axis of c_ij (q_i - r_j), per coordinate: [BM, DP] (axis 1) or
    [BN, DP] (axis 0), DP >= D. Each pair's own offset: q_i sum_j c_ij - sum_j c_ij r_j
    would cancel to a few digits for near-coincident points (c ~ 1 / d)."""
    cols = tl.arange(0, DP)
    out = tl.where(cols[None, :] == 0, _pull(c, q_base, offs_m, q_count, r_base, offs_n, r_count, axis, D, 0)[
        :, None], 0.0)
    for dim in tl.static_range(1, D):
        out += tl.where(cols[None, :] == dim, _pull(c, q_base, offs_m, q_count, r_base, offs_n, r_count, axis,
                                                    D, dim)[:, None], 0.0)
    return out

@triton.jit
def radius_grad_rows_kernel(grad_out, out, stats, order, values, sorted_grad, delta, row_min, row_sum, total,
                            rows, channels, STATS: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr):
    """The radius gradients' per-query terms, at sorted position i of flat row order[i]:
    the row of grad_out [B*M, C] (float32), delta = grad_out . out of the row, and with
    STATS the forward's (minimum distance, weight sum) from stats [B*M, 2], the minimum
    brought to its item's scaled units (a power of two: exact)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < total
    source = tl.load(order + offs, mask=live, other=0)
    cols = tl.arange(0, CP)
    mask = live[:, None] & (cols < channels)[None, :]
    g = tl.load(grad_out + source[:, None] * channels + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    o = tl.load(out + source[:, None] * channels + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(sorted_grad + offs[:, None] * channels + cols[None, :], g, mask=mask)
    tl.store(delta + offs, tl.sum(g * o, 1), mask=live)
    if STATS:
        scale = tl.load(values + (source // rows) * VALUES + SCALE, mask=live, other=1.0)
        tl.store(row_min + offs, tl.load(stats + 2 * source, mask=live, other=0.0) / scale, mask=live)
        tl.store(row_sum + offs, tl.load(stats + 2 * source + 1, mask=live, other=0.0), mask=live)

@triton.jit
def _radius_grad_side(
    pid, b, q_points, q_order, q_start, q_within, r_points, r_order, r_start, r_within, features, grad_out,
    row_min, row_sum, delta, values, shape, grad_points, grad_features, rows, columns, buckets, channels, radius2,
    reach, inv_sigma,
    REF_SIDE: tl.constexpr, PULLS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program of radius_grad_kernel. REF_SIDE False: it owns BLOCK_M sorted queries
    and walks the reference cells around them, writing grad_points = dL/dquery; True: it
    owns BLOCK_N sorted references and walks the query cells, writing grad_points =
    dL/dref and grad_features. The owned side's per-row arrays are indexed within the
    item, the walked side's by sorted position."""
    slot_base = b * (buckets + 1)
    shift = tl.load(values + b * VALUES + SHIFT).to(tl.int64)
    if REF_SIDE:
        item = b * columns
        own_count, own_points, own_order, own_start = columns, r_points, r_order, r_start
        other_start, other_within = q_start, q_within
        own_offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        features, grad_rows = features + item * channels, 0
    else:
        item = b * rows
        own_count, own_points, own_order, own_start = rows, q_points, q_order, q_start
        other_start, other_within = r_start, r_within
        own_offs = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        grad_rows = item
    own_live = tl.load(own_start + slot_base + buckets) - item
    own_base = own_points + item * D
    groups, together, live = _groups(values, shape, b, own_base, own_offs, own_live, AGGREGATE_SPREAD, D)
    radius2, reach, scale = _in_item_units(values, b, radius2, reach)
    acc_points = tl.zeros((own_offs.shape[0], DP), dtype=tl.float32)
    acc_features = tl.zeros((own_offs.shape[0], CP), dtype=tl.float32)
    for group in range(0, groups):
        member = live & (together | (tl.arange(0, own_offs.shape[0]) == group))
        lo, hi, _, _, axes, dims = _cell_box(values, shape, b, own_base, own_offs, own_live, member, reach, D)
        for first in range(0, _rows_in_box(lo, hi, dims), LANES // 2):
            # The previous box is empty: every row of this one is new.
            starts, ends, pending = _row_segments(other_start + slot_base, other_within, shift, axes, dims, lo, hi,
                                                  axes, axes * 0 - 1, first, LANES)
            end = tl.max(tl.where(pending, ends, 0), 0)
            s = _next_start(starts, ends, pending, 0, end)
            while s < end:
                if REF_SIDE:
                    offs_m, q_base, q_count = s + tl.arange(0, BLOCK_M), q_points, end
                    offs_n, r_base, r_count = own_offs, own_base, own_live
                    ok = (offs_m < end)[:, None] & member[None, :]
                else:
                    offs_m, q_base, q_count = own_offs, own_base, own_live
                    offs_n, r_base, r_count = s + tl.arange(0, BLOCK_N), r_points, end
                    ok = member[:, None] & (offs_n < end)[None, :]
                d2 = _tile_d2(q_base, r_base, offs_m, offs_n, q_count, r_count, D)
                ok = ok & (d2 <= radius2)
                if tl.max(ok.to(tl.int32)) > 0:
                    p, c, f, g = _radius_pair_terms(
                        d2, ok, offs_m, q_count, offs_n, r_count, features,
                        grad_out + grad_rows * channels, row_min + grad_rows, row_sum + grad_rows,
                        delta + grad_rows, channels, inv_sigma, scale, CP, PRECISION)
                    if REF_SIDE:
                        acc_features += tl.dot(tl.trans(p), g, input_precision=PRECISION)
                        if PULLS:
                            acc_points -= _pulls(c, q_base, offs_m, q_count, r_base, offs_n, r_count, 0, D, DP)
                    else:
                        acc_points += _pulls(c, q_base, offs_m, q_count, r_base, offs_n, r_count, 1, D, DP)
                s = _next_start(starts, ends, pending, s + (BLOCK_M if REF_SIDE else BLOCK_N), end)
    _store_rows(grad_points, own_order, own_offs, own_count, item, acc_points, D, DP)
    if REF_SIDE:
        _store_rows(grad_features, own_order, own_offs, own_count, item, acc_features, channels, CP)


@triton.jit
def radius_grad_kernel(
    q_points, q_order, q_start, q_within, r_points, r_order, r_start, r_within, features, grad_out, row_min,
    row_sum, delta, values, shape, grad_query, grad_ref, grad_features, rows, columns, buckets, channels, radius2,
    reach, inv_sigma,
    PULLS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CP: tl.constexpr, QUERY_BLOCK_M: tl.constexpr,
    QUERY_BLOCK_N: tl.constexpr, REF_BLOCK_M: tl.constexpr, REF_BLOCK_N: tl.constexpr, LANES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The gradients of radius_aggregate, gathered (no atomics), both sides in one launch
    (each alone fills a fraction of the GPU): the first cdiv(columns, REF_BLOCK_N)
    programs of an item own references (dL/dref, dL/dfeatures), any after them own
    queries (dL/dquery; the grid leaves them out where it is not wanted). PULLS False:
    the feature gradients alone (dL/dref is not wanted; it stays 0)."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ref_programs = tl.cdiv(columns, REF_BLOCK_N)
    if pid < ref_programs:
        _radius_grad_side(
            pid, b, q_points, q_order, q_start, q_within, r_points, r_order, r_start, r_within, features, grad_out,
            row_min, row_sum, delta, values, shape, grad_ref, grad_features, rows, columns, buckets, channels,
            radius2, reach, inv_sigma, True, PULLS, D, DP, CP, REF_BLOCK_M, REF_BLOCK_N, LANES, PRECISION)
    else:
        _radius_grad_side(
            pid - ref_programs, b, q_points, q_order, q_start, q_within, r_points, r_order, r_start, r_within,
            features, grad_out, row_min, row_sum, delta, values, shape, grad_query, grad_features, rows, columns,
            buckets, channels, radius2, reach, inv_sigma, False, True, D, DP, CP, QUERY_BLOCK_M, QUERY_BLOCK_N,
            LANES, PRECISION)


@triton.jit
def _knn_weights(dists, offs, count, slots, inv_sigma, K: tl.constexpr):
    """Normalized weights p [BM, KP] = softmax_j(-d_ij / sigma) of flat query rows offs;
    missing neighbours (at +inf) weigh 0."""
    mask = (offs < count)[:, None] & (slots < K)[None, :]
    d = tl.load(dists + offs[:, None] * K + slots[None, :], mask=mask, other=float("inf")).to(tl.float32)
    finite = d < float("inf")
    shift = tl.min(tl.where(finite, d, float("inf")), 1)
    w = tl.where(finite, tl.exp(tl.where(finite, shift[:, None] - d, 0.0) * inv_sigma), 0.0)
    total = tl.sum(w, 1)
    return w / tl.where(total > 0, total, 1.0)[:, None]

@triton.jit
def _neighbour_features(p, neighbours, slots, j, features, offs, rows, columns, channels, cols):
    """Weight [BM] and feature row [BM, CP] (float32) of each query's j-th neighbour."""
    pick = slots[None, :] == j
    weight = tl.sum(tl.where(pick, p, 0.0), 1)
    row = (offs // rows).to(tl.int64) * columns + tl.sum(tl.where(pick, neighbours, 0), 1)
    f = tl.load(features + row[:, None] * channels + cols[None, :],
                mask=(weight > 0)[:, None] & (cols < channels)[None, :], other=0.0).to(tl.float32)
    return weight, f

@triton.jit
def knn_grad_dists_kernel(dists, idx, features, grad_out, out, grad_dists, weights, total_rows, rows, columns,
                           channels, inv_sigma, K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr,
                           BLOCK_M: tl.constexpr, DISTS: tl.constexpr):
    """dL/dd_ij = -(p_ij / sigma) (g_i . F_j - g_i . out_i) (zeros unless DISTS: the
    points are data), and the weights p_ij."""
    offs = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.arange(0, KP)
    p = _knn_weights(dists, offs, total_rows, slots, inv_sigma, K)
    mask = (offs < total_rows)[:, None] & (slots < K)[None, :]
    grad = tl.zeros((BLOCK_M, KP), dtype=tl.float32)
    if DISTS:
        neighbours = tl.load(idx + offs[:, None] * K + slots[None, :], mask=mask, other=-1)
        cols = tl.arange(0, CP)
        g = _load_block(grad_out, offs, total_rows, channels, CP)
        baseline = tl.sum(g * _load_block(out, offs, total_rows, channels, CP), 1)
        for j in range(K):
            weight, f = _neighbour_features(p, neighbours, slots, j, features, offs, rows, columns, channels, cols)
            grad_j = -(weight * inv_sigma) * (tl.sum(g * f, 1) - baseline)
            grad = tl.where(slots[None, :] == j, grad_j[:, None], grad)
    tl.store(grad_dists + offs[:, None] * K + slots[None, :], grad, mask=mask)
    tl.store(weights + offs[:, None] * K + slots[None, :], p, mask=mask)

@triton.jit
def pair_keys_kernel(idx, keys, total, rows, columns, refs, K: tl.constexpr, BLOCK: tl.constexpr):
    """keys[t] = the flat reference row b * columns + idx[t] of slot t of lists [B, M, K]
    (refs, past every row, for a missing slot), to sort the slots by reference."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < total
    neighbour = tl.load(idx + offs, mask=live, other=-1)
    key = tl.where(neighbour >= 0, (offs // K // rows) * columns + neighbour, refs)
    tl.store(keys + offs, key.to(keys.dtype.element_ty), mask=live)

@triton.jit
def pair_sum_kernel(order, starts, weights, source, out_sum, out_weight, total, width,
                     K: tl.constexpr, WP: tl.constexpr, BLOCK_R: tl.constexpr, PER_SLOT: tl.constexpr,
                     UNROLL: tl.constexpr):
    """For each reference row r: sum over its pairs t (sorted slots order[starts[r]:
    starts[r + 1]]) of weights[t] * source[t // K] (source[t] when PER_SLOT), and of
    weights[t]; in slot order, so the sums are the same run to run (no atomics). UNROLL
    pairs a row are read at once (their loads overlap), then added in order."""
    offs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    first = tl.load(starts + offs, mask=offs < total, other=0).to(tl.int64)
    count = tl.load(starts + offs + 1, mask=offs < total, other=0).to(tl.int64) - first
    cols = tl.arange(0, WP)
    lanes = tl.arange(0, UNROLL)
    acc = tl.zeros((BLOCK_R, WP), dtype=tl.float32)
    acc_weight = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for t in range(0, tl.max(count, 0), UNROLL):
        active = (t + lanes)[None, :] < count[:, None]
        pairs = tl.load(order + first[:, None] + t + lanes[None, :], mask=active, other=0)
        w = tl.load(weights + pairs, mask=active, other=0.0).to(tl.float32)
        rows = pairs if PER_SLOT else pairs // K
        for u in tl.static_range(UNROLL):
            pick = lanes[None, :] == u
            w_u = tl.sum(tl.where(pick, w, 0.0), 1)
            row = tl.sum(tl.where(pick, rows, 0), 1)
            v = tl.load(source + row[:, None] * width + cols[None, :],
                        mask=(t + u < count)[:, None] & (cols < width)[None, :], other=0.0).to(tl.float32)
            acc += w_u[:, None] * v
            acc_weight += w_u
    tl.store(out_sum + offs[:, None] * width + cols[None, :], acc,
             mask=(offs < total)[:, None] & (cols < width)[None, :])
    tl.store(out_weight + offs, acc_weight, mask=offs < total)

@triton.jit
def knn_aggregate_kernel(dists, idx, features, out, total_rows, rows, columns, channels, inv_sigma,
                          K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr, BLOCK_M: tl.constexpr):
    """out[i] = sum_j p_ij features[idx_ij] for flat query rows i, one neighbour's
    feature row at a time (nothing of size [M, k, C] is stored)."""
    offs = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.arange(0, KP)
    p = _knn_weights(dists, offs, total_rows, slots, inv_sigma, K)
    neighbours = tl.load(idx + offs[:, None] * K + slots[None, :],
                         mask=(offs < total_rows)[:, None] & (slots < K)[None, :], other=-1)
    cols = tl.arange(0, CP)
    acc = tl.zeros((BLOCK_M, CP), dtype=tl.float32)
    for j in range(K):
        weight, f = _neighbour_features(p, neighbours, slots, j, features, offs, rows, columns, channels, cols)
        acc += weight[:, None] * f
    cols_ok = (offs < total_rows)[:, None] & (cols < channels)[None, :]
    tl.store(out + offs[:, None] * channels + cols[None, :], acc.to(out.dtype.element_ty), mask=cols_ok)
