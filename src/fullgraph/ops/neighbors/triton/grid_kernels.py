"""The Triton kernels that build the grid of cells (``grid`` launches them)."""

from __future__ import annotations

import triton
import triton.language as tl

from .grid import SCALE_COLUMN, SHIFT_COLUMN, VALUE_COLUMNS

from ...scaling_kernels import kernel_safe_scale

# Columns of ``Frame.values``: origin (x, y, z), extent (x, y, z), then these.
SIDE, INV_SIDE, SLACK, SCALE = tl.constexpr(6), tl.constexpr(7), tl.constexpr(8), tl.constexpr(SCALE_COLUMN)
SHIFT = tl.constexpr(SHIFT_COLUMN)
VALUES = tl.constexpr(VALUE_COLUMNS)
# Blocks' bounds the frame kernel reduces at once (one at a time was slower: NOTES.md).
_FRAME_CHUNK = tl.constexpr(512)

@triton.jit
def _bounds_kernel(ref, ref_lengths, columns, ref_blocks, query, query_lengths, rows, bounds,
                   D: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
    """Per block of BLOCK rows of item b, references' blocks first, then the queries':
    min and max of each grid axis over the valid points, their largest |coordinate| and
    their number, into bounds[b, block] = (lo xyz, largest, hi xyz, count)."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    out = bounds + (b * tl.num_programs(0) + pid) * 8
    if pid < ref_blocks:
        _block_bounds(ref, ref_lengths, out, b, pid, columns, D, G, BLOCK)
    else:
        _block_bounds(query, query_lengths, out, b, pid - ref_blocks, rows, D, G, BLOCK)

@triton.jit
def _block_bounds(points, lengths, out, b, program, rows, D: tl.constexpr, G: tl.constexpr,
                  BLOCK: tl.constexpr):
    offs = program * BLOCK + tl.arange(0, BLOCK)
    largest = _largest(points, b, offs, rows, D)
    valid = (offs < tl.load(lengths + b)) & (largest != float("inf"))
    largest = tl.where(valid, largest, 0.0)
    dims = tl.arange(0, 4)
    block = tl.load(points + (b * rows + offs)[:, None] * D + dims[None, :],
                    mask=valid[:, None] & (dims < G)[None, :], other=0.0).to(tl.float32)
    low = tl.min(tl.where(valid[:, None], block, float("inf")), 0)
    low = tl.where(dims == 3, tl.max(largest, 0), low)
    high = tl.max(tl.where(valid[:, None], block, -float("inf")), 0)
    tl.store(out + dims, low)
    tl.store(out + 4 + dims, tl.where(dims == 3, tl.sum(valid.to(tl.float32), 0), high))

@triton.jit
def _frame_kernel(bounds, blocks, query_blocks, values, shape, buckets, cell_points, G: tl.constexpr):
    """Cells over the box of each item's valid references, cell_points per cell (at most
    one a bucket), and the item's scale (from the largest coordinate of both clouds), from
    ``_bounds_kernel``'s bounds."""
    b = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, 4)
    chunk = tl.arange(0, _FRAME_CHUNK)
    low = tl.full((4,), float("inf"), tl.float32)
    high = tl.full((4,), -float("inf"), tl.float32)
    n = tl.zeros((), tl.float32)
    largest = tl.zeros((), tl.float32)
    for start in range(0, blocks, _FRAME_CHUNK):  # _FRAME_CHUNK blocks' bounds at a time
        inside = start + chunk < blocks
        rows = bounds + (b * (blocks + query_blocks) + start + chunk) * 8
        low = tl.minimum(low, tl.min(tl.load(rows[:, None] + dims[None, :], mask=inside[:, None],
                                             other=float("inf")), 0))
        top = tl.load(rows[:, None] + 4 + dims[None, :], mask=inside[:, None], other=-float("inf"))
        high = tl.maximum(high, tl.max(top, 0))
        n += tl.sum(tl.where(inside, tl.load(rows + 7, mask=inside, other=0.0), 0.0), 0)
        largest = tl.maximum(largest, tl.max(tl.load(rows + 3, mask=inside, other=0.0), 0))
    for start in range(0, query_blocks, _FRAME_CHUNK):
        inside = start + chunk < query_blocks
        rows = bounds + (b * (blocks + query_blocks) + blocks + start + chunk) * 8
        largest = tl.maximum(largest, tl.max(tl.load(rows + 3, mask=inside, other=0.0), 0))
    tl.store(values + b * VALUES + SCALE, kernel_safe_scale(largest))
    on = (dims < G) & (dims * 0 + n > 0)  # an item without valid references gets one cell
    low = tl.where(on, low, 0.0)
    extent = tl.minimum(tl.where(on, high - low, 0.0), 1e38)
    target = tl.maximum(n / cell_points, 1.0)
    # Cubic cells of side h with prod(extent / h) = target over the axes longer than h;
    # flat axes get one cell. G + 1 rounds settle which axes are longer.
    longer = on & (extent > 0)
    side = 1.0
    for _ in tl.static_range(G + 1):
        count = tl.sum(longer.to(tl.float32), 0)
        log_volume = tl.sum(tl.where(longer, tl.log(tl.where(longer, extent, 1.0)), 0.0), 0)
        side = tl.where(count > 0, tl.exp((log_volume - tl.log(target)) / tl.maximum(count, 1.0)), 1.0)
        longer = longer & (extent >= side)
    _store_frame(values, shape, b, dims, low, extent, side * 1.00001, buckets, buckets, G)

@triton.jit
def _to_scaled_units_kernel(values):
    """Origin, extent, side and slack of item b's frame divided by its scale (exactly)."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, 16)
    row = values + b * VALUES
    scale = tl.load(row + SCALE)
    v = tl.load(row + cols, mask=cols < SCALE, other=0.0)
    v = tl.where(cols == INV_SIDE, v * scale, v / scale)
    tl.store(row + cols, v, mask=cols < SCALE)

@triton.jit
def _sorted_points_kernel(query, query_order, query_total, rows, ref, ref_order, ref_total, columns, values,
                          query_out, ref_out, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr):
    """Both clouds in their sorted orders, one launch: query_out[i] = query[query_order[i]]
    / scale of its item, float32 (the queries' programs first), the same for ref_out."""
    pid = tl.program_id(0)
    query_programs = tl.cdiv(query_total, BLOCK)
    if pid < query_programs:
        _move_rows(query, query_order, values, query_out, pid, query_total, rows, D, DP, BLOCK)
    else:
        _move_rows(ref, ref_order, values, ref_out, pid - query_programs, ref_total, columns, D, DP, BLOCK)

@triton.jit
def _move_rows(points, order, values, out, program, total, rows, D: tl.constexpr, DP: tl.constexpr,
               BLOCK: tl.constexpr):
    offs = program.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < total
    source = tl.load(order + offs, mask=live, other=0)
    scale = tl.load(values + (source // rows) * VALUES + SCALE, mask=live, other=1.0)
    cols = tl.arange(0, DP)
    mask = live[:, None] & (cols < D)[None, :]
    block = tl.load(points + source[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offs[:, None] * D + cols[None, :], block / scale[:, None], mask=mask)

@triton.jit
def _refine_kernel(values, shape, loads, buckets, space, cell_points, side, G: tl.constexpr):
    """Rescale each item's cells so that a query's cell holds about cell_points references
    (or, for side > 0, cells of about that side holding between 1 and cell_points), given
    the mean load (references in a live query's cell) under the current cells; at most
    ``space`` cells."""
    b = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, 4)
    row = values + b * VALUES
    low = tl.load(row + dims, mask=dims < 3, other=0.0)
    extent = tl.load(row + 3 + dims, mask=dims < 3, other=0.0)
    split = tl.sum(((dims < G) & (tl.load(shape + b * 4 + dims) > 1)).to(tl.float32), 0)
    load = tl.load(loads + 2 * b).to(tl.float32) / tl.maximum(tl.load(loads + 2 * b + 1).to(tl.float32), 1.0)
    most = tl.exp(tl.log(cell_points / tl.maximum(load, 1e-30)) / tl.maximum(split, 1.0))
    fewest = tl.exp(tl.log(1.0 / tl.maximum(load, 1e-30)) / tl.maximum(split, 1.0))
    wanted = tl.minimum(tl.maximum(side / tl.load(row + SIDE), fewest), most)
    ratio = tl.where((split > 0) & (load > 0), tl.where(side > 0, wanted, most), 1.0)
    ratio = tl.minimum(tl.maximum(ratio, 1.0 / 16), 16.0)
    _store_frame(values, shape, b, dims, low, extent, tl.load(row + SIDE) * ratio, space, buckets, G)

@triton.jit
def _store_frame(values, shape, b, dims, low, extent, side, limit, buckets, G: tl.constexpr):
    """Item b's frame with cells of about ``side`` (larger where more than ``limit`` cells
    would cover the extent), and the shift that fits them into ``buckets``."""
    on = dims < G
    per_axis = tl.where(on, tl.minimum(tl.floor(extent / side), limit - 1.0) + 1.0, 1.0).to(tl.int64)
    total = _product(per_axis, dims)
    while total > limit:  # over the budget: grow the cells to fit it
        side = side * tl.exp(tl.log(total.to(tl.float32) / limit) / G) * 1.001
        per_axis = tl.where(on, tl.minimum(tl.floor(extent / side), limit - 1.0) + 1.0, 1.0).to(tl.int64)
        total = _product(per_axis, dims)
    shift = tl.zeros((), tl.int32)
    while ((tl.zeros((), tl.int64) + buckets) << shift) < total:  # (buckets may come as the constant 1)
        shift += 1
    slack = 1e-6 * (tl.max(tl.abs(low), 0) + tl.max(extent, 0) + side)
    row = values + b * VALUES
    tl.store(row + dims, low, mask=dims < 3)
    tl.store(row + 3 + dims, extent, mask=dims < 3)
    tl.store(row + SIDE, side)
    tl.store(row + INV_SIDE, 1.0 / side)
    tl.store(row + SLACK, slack)
    tl.store(row + SHIFT, shift.to(tl.float32))
    tl.store(shape + b * 4 + dims, per_axis.to(tl.int32))

@triton.jit
def _component(v, dims, i):
    return tl.sum(tl.where(dims == i, v, 0), 0)

@triton.jit
def _product(v, dims):
    return (tl.sum(tl.where(dims == 0, v, 0), 0) * tl.sum(tl.where(dims == 1, v, 0), 0)
            * tl.sum(tl.where(dims == 2, v, 0), 0))

@triton.jit
def _largest(points, b, offs, rows, D: tl.constexpr):
    """The largest |coordinate| of the rows ``offs`` of item b [BLOCK] float32: +inf for a
    row with a non-finite coordinate (NaN included)."""
    base = points + (b * rows + offs) * D
    largest = tl.zeros(offs.shape, dtype=tl.float32)
    if D <= 4:
        for dim in tl.static_range(D):
            c = tl.abs(tl.load(base + dim, mask=offs < rows, other=0.0).to(tl.float32))
            largest = tl.where(c == c, tl.maximum(largest, c), float("inf"))
    else:
        # Tiles of whole rows (coalesced; one coordinate at a time read each row D times).
        cols = tl.arange(0, 8)
        for start in range(0, D, 8):
            d = start + cols
            c = tl.load(base[:, None] + d[None, :], mask=(offs < rows)[:, None] & (d < D)[None, :],
                        other=0.0).to(tl.float32)
            c = tl.where(c == c, tl.abs(c), float("inf"))
            largest = tl.maximum(largest, tl.max(c, 1))
    return largest

@triton.jit
def _point_cells(points, lengths, values, shape, b, offs, rows, D: tl.constexpr, G: tl.constexpr):
    """(cell within the item [BLOCK] int64, valid [BLOCK]) of the rows ``offs`` of item b."""
    inside = offs < rows
    base = points + (b * rows + offs) * D
    valid = (offs < tl.load(lengths + b)) & (_largest(points, b, offs, rows, D) != float("inf"))
    cell = tl.zeros(offs.shape, dtype=tl.int64)
    stride = 1
    for dim in tl.static_range(G):
        c = tl.load(base + dim, mask=inside, other=0.0).to(tl.float32)
        axis = tl.load(shape + b * 4 + dim)
        scaled = (c - tl.load(values + b * VALUES + dim)) * tl.load(values + b * VALUES + INV_SIDE)
        at = tl.minimum(tl.maximum(tl.floor(scaled), 0.0), (axis - 1).to(tl.float32))
        cell += at.to(tl.int64) * stride
        stride = stride * axis
    return cell, valid

@triton.jit
def _cell_keys_kernel(query, query_lengths, rows, query_programs, ref, ref_lengths, columns, values, shape, keys,
                      space, D: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
    """``sort_both``'s keys, one launch: keys[b * rows + i] = the slot b * (space + 1) +
    cell of query i of item b (invalid points: cell ``space``), then at B * rows + b *
    columns + j reference j's slot + B * (space + 1), so that every query sorts first."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    batch = tl.num_programs(1).to(tl.int64)
    if pid < query_programs:
        _store_cell_keys(query, query_lengths, values, shape, keys, b, pid, rows, space, 0, D, G, BLOCK)
    else:
        _store_cell_keys(ref, ref_lengths, values, shape, keys + batch * rows, b, pid - query_programs, columns,
                         space, batch * (space + 1), D, G, BLOCK)

@triton.jit
def _store_cell_keys(points, lengths, values, shape, keys, b, program, rows, space, first,
                     D: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
    offs = program * BLOCK + tl.arange(0, BLOCK)
    cell, valid = _point_cells(points, lengths, values, shape, b, offs, rows, D, G)
    key = first + b * (space + 1) + tl.where(valid, cell, space)
    tl.store(keys + b * rows + offs, key.to(keys.dtype.element_ty), mask=offs < rows)

@triton.jit
def _split_kernel(sorted_keys, order, values, orders, slots, within_of, total, query_total, ref_first, space,
                  buckets, BLOCK: tl.constexpr):
    """``sort_both``'s sorted keys (``_cell_keys_kernel``'s: the queries', then the
    references') to each sorted point's row within its cloud, its bucket slot b *
    (buckets + 1) + (cell >> shift) and its cell's offset within the bucket."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < total
    is_ref = offs >= query_total
    slot = tl.load(sorted_keys + offs, mask=live, other=0).to(tl.int64) - tl.where(is_ref, ref_first, 0)
    b = slot // (space + 1)
    cell = slot - b * (space + 1)
    shift = tl.load(values + b * VALUES + SHIFT, mask=live, other=0.0).to(tl.int64)
    invalid = cell == space
    bucket = b * (buckets + 1) + tl.where(invalid, buckets, cell >> shift)
    tl.store(orders + offs, tl.load(order + offs, mask=live, other=0) - tl.where(is_ref, query_total, 0),
             mask=live)
    tl.store(slots + offs, bucket.to(slots.dtype.element_ty), mask=live)
    tl.store(within_of + offs, tl.where(invalid, 0, cell & ((1 << shift) - 1)).to(tl.int8), mask=live)

@triton.jit
def _lower_bounds_kernel(values, bounds, split, total, count, steps, BLOCK: tl.constexpr):
    """bounds[part, c] = the first position within part (0: values[:split], 1: the rest)
    of the sorted ``values`` holding a value >= c, for c < count: one binary search of
    ``steps`` halvings a value."""
    part = tl.program_id(1)
    c = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    base = tl.where(part == 0, 0, split).to(tl.int64)
    size = tl.zeros((BLOCK,), tl.int64) + tl.where(part == 0, split, total - split)
    lo = tl.zeros((BLOCK,), tl.int64)
    for _ in range(steps):
        half = size // 2
        searching = size > 0
        below = searching & (tl.load(values + base + lo + half, mask=searching, other=0) < c)
        lo = tl.where(below, lo + half + 1, lo)
        size = tl.where(below, size - half - 1, half)
    tl.store(bounds + part.to(tl.int64) * count + c, lo.to(bounds.dtype.element_ty), mask=c < count)

@triton.jit
def _max(a, b):
    return tl.maximum(a, b)

@triton.jit
def _histogram_kernel(values, counts, split, total, count, parts, BLOCK: tl.constexpr):
    """counts [parts, count + 1]: counts[part, min(v + 1, count)] += the values v of part
    (0: values[:split], 1: the rest; each ascending), one atomic add a run of equal values
    in the block; and counts[1, 0] -= split, so that the running sum of the flattened
    counts restarts at 0 in part 1."""
    if parts == 2:  # (parts may come as the constant 1)
        if tl.program_id(0) == 0:
            tl.atomic_add(counts + count + 1, tl.zeros((), counts.dtype.element_ty) - split)
    lane = tl.arange(0, BLOCK)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + lane
    live = offs < total
    value = tl.load(values + offs, mask=live, other=0).to(tl.int64)
    part = (offs >= split).to(tl.int64)
    before = tl.load(values + offs - 1, mask=live & (lane > 0), other=0).to(tl.int64)
    after = tl.load(values + offs + 1, mask=offs + 1 < total, other=0).to(tl.int64)
    starts = (lane == 0) | (offs == split) | (before != value)
    ends = (lane == BLOCK - 1) | (offs + 1 == split) | (offs + 1 >= total) | (after != value)
    run = lane - tl.associative_scan(tl.where(starts, lane, 0), 0, _max) + 1
    slot = tl.minimum(value + 1, count)
    tl.atomic_add(counts + part * (count + 1) + slot, run.to(counts.dtype.element_ty), mask=live & ends)

@triton.jit
def _count_kernel(points, lengths, values, shape, per_cell, rows, cells,
                  D: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
    """per_cell[b * (cells + 1) + cell] += valid points in the cell (integer atomics: exact),
    for frames of at most ``cells`` cells an item."""
    b = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cell, valid = _point_cells(points, lengths, values, shape, b, offs, rows, D, G)
    tl.atomic_add(per_cell + b * (cells + 1) + cell, tl.full(offs.shape, 1, tl.int32), mask=valid)

@triton.jit
def _load_kernel(points, lengths, values, shape, per_cell, load, rows, cells,
                 D: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
    """load[b] += (references in the cells of item b's valid queries, their number)."""
    b = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cell, valid = _point_cells(points, lengths, values, shape, b, offs, rows, D, G)
    seen = tl.load(per_cell + b * (cells + 1) + cell, mask=valid, other=0).to(tl.int64)
    tl.atomic_add(load + 2 * b, tl.sum(seen, 0))
    tl.atomic_add(load + 2 * b + 1, tl.sum(valid.to(tl.int64), 0))
