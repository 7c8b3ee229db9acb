"""A uniform grid (cell list) over the first three coordinates, built on the GPU.

Per batch item, the box around the valid references is cut into cubic cells of side h,
first sized as if the cloud were uniform, then resized once so that the cell of a typical
query holds about ``CELL_POINTS`` references. Points outside the box (queries) are clamped
into its border cells, which keeps every search exact. References and queries are sorted
by (item, cell) key with one ``torch.sort``, so the points of a row of cells along x are
one contiguous range. Invalid points (beyond the item's length, or not finite) sort to the
end of their item and are never visited.

Sparse cells. The first cell of a range is found through a table of static size, the
item's ``buckets`` (``BUDGET`` per ``CELL_POINTS`` references): a bucket is 2^shift
consecutive cells (shift per item, 0 while the cells fit the table, at most
log2(``FINER``)), ``bucket_start`` marks where each bucket's points begin, and a binary
search over the points' offsets within their bucket (``within``, one byte a point) finds
the cell. So a clustered cloud, whose clusters are hundreds of times denser than its box's
mean, gets cells sized for its clusters (up to FINER times more cells than buckets) while
memory stays O(points); a uniform one keeps one cell a bucket and one load a lookup.

Nothing reads a value back to the host: the table's size is a static budget derived from
the shapes, and each item's grid (origin, cell side, cells per axis, shift) stays in device
tensors. Points with more than three coordinates get a grid of one cell, which turns the
search kernels into tiled brute force.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...._triton import tl, triton

CELL_POINTS = 8
# Buckets per item, in units of CELL_POINTS references (room for cells BUDGET / 8 times finer per
# axis than a uniform cloud needs, one a bucket), and how many times more cells than buckets an item
# may have (clustered clouds): FINER, or as few as FINER_LEAST where that keeps the sort's keys 32
# bits.
BUDGET = 32
FINER, FINER_LEAST = 64, 8
# lower_bounds, two ways. Small counts: a binary search a bound, one launch (values a program,
# warps; a chain of dependent loads, so one value a thread). From HISTOGRAM_FROM bounds the running
# sum of the values' histogram (one atomic add a run of equal values in a block): four launches but
# no search; the two cross near 1.2 x 2^19 bounds (NOTES.md).
LOWER_BOUNDS_BLOCK = (256, 8)
HISTOGRAM_BLOCK, HISTOGRAM_FROM = 1024, 1 << 19
# Layout of one item's row of ``Frame.values``.
_BLOCK = 1024
VALUE_COLUMNS = 12  # of Frame.values
SCALE_COLUMN = 9  # of Frame.values: the item's scale
SHIFT_COLUMN = 10  # of Frame.values: log2 of the cells a bucket holds


@dataclass(frozen=True)
class Frame:
    """The grid of every batch item: values [B, 12] float32 (origin xyz, extent xyz, cell
    side, its inverse, the rounding slack of a distance to a cell face, the scale, the shift),
    shape [B, 4] int32 (cells along x, y, z, then 1); ``buckets``, the static size of each
    item's lookup table, and ``space``, the static bound on its cells (a multiple of it).

    Scale: a power of two (``ops.scaling.safe_scale`` of the item's largest finite coordinate; 1 in
    the usual range). ``build`` returns the sorted points and the frame in units of it, so that
    squared distances of far-out or tiny coordinates neither overflow nor underflow; kernels
    bring radii, sigma and distances to those units with it (exactly: a power of two)."""

    values: torch.Tensor
    shape: torch.Tensor
    buckets: int
    space: int
    grid_dims: int


@dataclass(frozen=True)
class SortedPoints:
    """Points of a [B, L, D] cloud in (item, cell) order.

    points: [B*L, D] float32, sorted; order: [B*L] int64, sorted position -> flat row b*L + j;
    bucket_start: [B*(buckets+1) + 1] int32, the first sorted position of slot
    b*(buckets+1) + bucket, where slot ``buckets`` of each item holds its invalid points (so
    it also ends its live ones); within: [B*L] int8, each point's cell's offset in its bucket
    (cell mod 2^shift; 0 for invalid points).
    """

    points: torch.Tensor
    order: torch.Tensor
    bucket_start: torch.Tensor
    within: torch.Tensor


if triton is not None:
    from ...scaling import kernel_safe_scale

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


def cell_budget(refs: int, grid_dims: int) -> int:
    """Static number of buckets per item for ``refs`` references: room for cells
    ``BUDGET / 2^grid_dims`` times finer than a uniform cloud needs, one a bucket. (Integer
    arithmetic, so that a symbolic size under ``torch.compile`` gives a symbolic budget.)"""
    return 1 if grid_dims == 0 else BUDGET * torch.sym_max(1, -(-refs // CELL_POINTS))


def _keys_fit_32_bits(batch: int, space: int) -> bool:
    return 2 * (batch * (space + 1) + 1) < 2**31


def cell_space(batch: int, buckets: int) -> int:
    """Static bound on an item's cells: FINER times its ``buckets``, or fewer (down to
    FINER_LEAST) where more would take the sort's keys (``sort_both``) past 32 bits."""
    finer = FINER
    if _keys_fit_32_bits(batch, buckets * FINER_LEAST):
        while not _keys_fit_32_bits(batch, buckets * finer):
            finer //= 2
    return buckets * finer


def frame(ref: torch.Tensor, ref_lengths: torch.Tensor, query: torch.Tensor, query_lengths: torch.Tensor) -> Frame:
    """The grid of each item of ref [B, N, D] (lengths [B] int64) over the box of its valid
    points, with cells sized for a uniform cloud, and the scale of both clouds (unscaled)."""
    batch, columns, dim = ref.shape
    grid_dims = dim if dim <= 3 else 0
    buckets = cell_budget(columns, grid_dims)
    values = torch.zeros((batch, VALUE_COLUMNS), dtype=torch.float32, device=ref.device)
    shape = torch.empty((batch, 4), dtype=torch.int32, device=ref.device)  # the kernel writes all but column 11
    if batch:
        blocks, query_blocks = (max(1, triton.cdiv(points.shape[1], _BLOCK)) for points in (ref, query))
        bounds = torch.empty((batch, blocks + query_blocks, 8), dtype=torch.float32, device=ref.device)
        _bounds_kernel[(blocks + query_blocks, batch)](ref, ref_lengths, columns, blocks, query, query_lengths,
                                                       query.shape[1], bounds, D=dim, G=grid_dims, BLOCK=_BLOCK)
        _frame_kernel[(batch,)](bounds, blocks, query_blocks, values, shape, buckets, float(CELL_POINTS),
                                G=grid_dims)
    return Frame(values, shape, buckets, cell_space(batch, buckets), grid_dims)


def refine(grid: Frame, query, query_lengths, ref, ref_lengths, cell_points: float = CELL_POINTS,
           side: float = 0.0) -> None:
    """Resize ``grid``'s cells (in place; from ``frame``'s, at most one a bucket) so that a
    query's cell holds about ``cell_points`` references: a cloud denser than its box's average
    (a normal cloud's core, clusters) gets finer cells, up to ``grid.space``. With ``side`` > 0
    (the caller's units), cells of about that side, as long as a query's cell holds between 1
    and ``cell_points`` references."""
    (batch, rows, dim), columns = query.shape, ref.shape[1]
    per_cell = torch.zeros((batch * (grid.buckets + 1),), dtype=torch.int32, device=ref.device)
    load = torch.zeros((batch, 2), dtype=torch.int64, device=ref.device)
    sizes = dict(D=dim, G=grid.grid_dims, BLOCK=_BLOCK)
    _count_kernel[(triton.cdiv(columns, _BLOCK), batch)](
        ref, ref_lengths, grid.values, grid.shape, per_cell, columns, grid.buckets, **sizes)
    _load_kernel[(triton.cdiv(rows, _BLOCK), batch)](
        query, query_lengths, grid.values, grid.shape, per_cell, load, rows, grid.buckets, **sizes)
    _refine_kernel[(batch,)](grid.values, grid.shape, load, grid.buckets, grid.space, float(cell_points),
                             float(side), G=grid.grid_dims)


def _both_keys(query, query_lengths, ref, ref_lengths, grid: Frame) -> torch.Tensor:
    """``_cell_keys_kernel``'s keys of both clouds [B*M + B*N]: int32, int64 for huge grids."""
    (batch, rows, dim), columns = query.shape, ref.shape[1]
    keys = torch.empty((batch * (rows + columns),), device=query.device,
                       dtype=torch.int32 if _keys_fit_32_bits(batch, grid.space) else torch.int64)
    if keys.numel():
        query_programs = triton.cdiv(rows, _BLOCK)
        _cell_keys_kernel[(query_programs + triton.cdiv(columns, _BLOCK), batch)](
            query, query_lengths, rows, query_programs, ref, ref_lengths, columns, grid.values, grid.shape, keys,
            grid.space, D=dim, G=grid.grid_dims, BLOCK=_BLOCK)
    return keys


def cell_keys(points: torch.Tensor, lengths: torch.Tensor, grid: Frame) -> torch.Tensor:
    """[B*L] keys b * (space + 1) + cell of points [B, L, D] (contiguous; lengths [B] int64;
    int32, int64 for huge grids); invalid points get their item's slot ``space``."""
    return _both_keys(points, lengths, points[:, :0], lengths, grid)


def sort_both(query, query_lengths, ref, ref_lengths, grid: Frame) -> tuple[SortedPoints, SortedPoints]:
    """Sort query [B, M, D] and ref [B, N, D] (contiguous; lengths [B] int64) into ``grid``'s
    (unscaled) cells with one sort: keys (item, cell) slots, the references' offset past
    every query's, stable, so that each cloud keeps its own points' order within a cell and
    the sorted queries come first; then each cloud's bucket starts. The sorted points are
    float32 in units of their item's scale."""
    (batch, rows, _), columns = query.shape, ref.shape[1]
    count = batch * (grid.buckets + 1) + 1
    slot_dtype = torch.int32 if count < 2**31 else torch.int64
    queries_total, total = batch * rows, batch * (rows + columns)
    orders = torch.empty((total,), dtype=torch.int64, device=query.device)
    slots_of = torch.empty((total,), dtype=slot_dtype, device=query.device)
    within = torch.empty((total,), dtype=torch.int8, device=query.device)
    if total:
        sorted_keys, order = torch.sort(_both_keys(query, query_lengths, ref, ref_lengths, grid), stable=True)
        _split_kernel[(triton.cdiv(total, _BLOCK),)](
            sorted_keys, order, grid.values, orders, slots_of, within, total, queries_total,
            batch * (grid.space + 1), grid.space, grid.buckets, BLOCK=_BLOCK)
    starts = lower_bounds(slots_of, count, queries_total).to(torch.int32)
    query_order, ref_order = orders[:queries_total], orders[queries_total:]
    query_points, ref_points = _moved(query, query_order, ref, ref_order, grid)
    return (SortedPoints(query_points, query_order, starts[0], within[:queries_total]),
            SortedPoints(ref_points, ref_order, starts[1], within[queries_total:]))


def lower_bounds(values: torch.Tensor, count: int, split: int | None = None) -> torch.Tensor:
    """[parts, count]: for each c < count, the first position holding a value >= c of the
    ascending non-negative integer ``values`` [T] (``torch.searchsorted`` of arange(count)),
    or with ``split``, of values[:split] and of values[split:] (positions within each part).
    int32 where positions fit, else int64; each part's row contiguous."""
    total = values.shape[0]
    parts = 1 if split is None else 2
    split = total if split is None else split
    dtype = torch.int32 if total < 2**31 else torch.int64
    if parts * count < HISTOGRAM_FROM:
        bounds = torch.empty((parts, count), dtype=dtype, device=values.device)
        if count:
            block, warps = LOWER_BOUNDS_BLOCK
            _lower_bounds_kernel[(triton.cdiv(count, block), parts)](
                values, bounds, split, total, count, max(split, total - split).bit_length(), BLOCK=block,
                num_warps=warps)
        return bounds
    # One flat running sum for both parts (torch's along the rows of a [2, 4M] tensor took 6 ms).
    counts = torch.zeros((parts * (count + 1),), dtype=dtype, device=values.device)
    if total:
        _histogram_kernel[(triton.cdiv(total, HISTOGRAM_BLOCK),)](values, counts, split, total, count, parts,
                                                                BLOCK=HISTOGRAM_BLOCK)
    return torch.cumsum(counts, 0, dtype=dtype).view(parts, count + 1)[:, :count]


def _moved(query: torch.Tensor, query_order: torch.Tensor, ref: torch.Tensor, ref_order: torch.Tensor,
           grid: Frame) -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, M, D] in ``query_order`` (sorted position -> flat row) and ref [B, N, D] in
    ``ref_order``, float32, in units of their item's scale (``grid``'s scale column, in
    either units): [B*M, D], [B*N, D]."""
    (batch, rows, dim), columns = query.shape, ref.shape[1]
    moved = [torch.empty((batch * size, dim), dtype=torch.float32, device=query.device) for size in (rows, columns)]
    block = _BLOCK // 8
    programs = triton.cdiv(batch * rows, block) + triton.cdiv(batch * columns, block)
    if programs and dim:
        _sorted_points_kernel[(programs,)](
            query, query_order, batch * rows, rows, ref, ref_order, batch * columns, columns, grid.values, *moved,
            D=dim, DP=triton.next_power_of_2(dim), BLOCK=block)
    return tuple(moved)


def build(query, ref, query_lengths, ref_lengths, cell_points: float = CELL_POINTS, side: float = 0.0):
    """(frame, sorted queries, sorted references) of contiguous query [B, M, D], ref [B, N, D]
    (lengths [B] int64 within [0, M] / [0, N]: ``pairs.full_lengths``), in units of each
    item's scale (``Frame``); a typical query's cell holds about ``cell_points`` references
    (or see ``refine`` for ``side``)."""
    batch, rows = query.shape[:2]
    columns = ref.shape[1]
    grid = frame(ref, ref_lengths, query, query_lengths)
    if grid.grid_dims and batch * rows * columns:
        refine(grid, query, query_lengths, ref, ref_lengths, cell_points, side)
    queries, refs = sort_both(query, query_lengths, ref, ref_lengths, grid)
    if batch:
        _to_scaled_units_kernel[(batch,)](grid.values)
    return grid, queries, refs


def saved_size(batch: int, rows: int, columns: int, dim: int) -> int:
    """Length of ``save``'s record of a ``build`` over query [B, M, D] and ref [B, N, D]; 0
    where its orders would not fit int32 (then nothing is saved). Symbolic sizes welcome."""
    if batch * torch.sym_max(rows, columns) >= 2**31:
        return 0
    slots = batch * (cell_budget(columns, dim if dim <= 3 else 0) + 1) + 1
    return batch * (VALUE_COLUMNS + 4) + batch * (rows + columns) + 2 * slots + _words(batch * rows) + _words(
        batch * columns)


def _words(size: int) -> int:
    """int32 words that hold ``size`` bytes."""
    return -(-size // 4)


def _packed(within: torch.Tensor) -> torch.Tensor:
    """int8 [T] as int32 [_words(T)] (zero-padded)."""
    padded = within.new_zeros((4 * _words(within.shape[0]),))
    padded[:within.shape[0]] = within
    return padded.view(torch.int32)


def save(grid: Frame, queries: SortedPoints, refs: SortedPoints) -> torch.Tensor:
    """``build``'s result as one int32 record [saved_size]: the frame (values' bits, shape),
    then both clouds' orders, bucket starts and offsets within buckets. ``restore`` takes it
    back without sorting."""
    return torch.cat([grid.values.reshape(-1).view(torch.int32), grid.shape.reshape(-1),
                      queries.order.to(torch.int32), refs.order.to(torch.int32), queries.bucket_start.to(torch.int32),
                      refs.bucket_start.to(torch.int32), _packed(queries.within), _packed(refs.within)])


def restore(record: torch.Tensor, query: torch.Tensor, ref: torch.Tensor) -> tuple[Frame, SortedPoints, SortedPoints]:
    """``build(query, ref, ...)`` again from ``save``'s record of it: the sorted clouds are
    gathered in the saved orders (no bounds, no sort)."""
    batch, rows, dim = query.shape
    columns = ref.shape[1]
    grid_dims = dim if dim <= 3 else 0
    buckets = cell_budget(columns, grid_dims)
    slots = batch * (buckets + 1) + 1
    values, shape, query_order, ref_order, query_start, ref_start, query_within, ref_within = torch.split(
        record, [batch * VALUE_COLUMNS, batch * 4, batch * rows, batch * columns, slots, slots,
                 _words(batch * rows), _words(batch * columns)])
    grid = Frame(values.view(torch.float32).reshape(batch, VALUE_COLUMNS), shape.reshape(batch, 4), buckets,
                 cell_space(batch, buckets), grid_dims)
    query_order, ref_order = query_order.to(torch.int64), ref_order.to(torch.int64)  # offsets beyond int32 downstream
    query_points, ref_points = _moved(query, query_order, ref, ref_order, grid)
    return (grid,
            SortedPoints(query_points, query_order, query_start, query_within.view(torch.int8)[:batch * rows]),
            SortedPoints(ref_points, ref_order, ref_start, ref_within.view(torch.int8)[:batch * columns]))


def one_cell(query: torch.Tensor, ref: torch.Tensor, query_ok: torch.Tensor, ref_ok: torch.Tensor,
             scale: torch.Tensor) -> tuple[Frame, SortedPoints, SortedPoints]:
    """``build`` for points of more than three coordinates (a grid of one cell per item) from
    what a caller already holds: both clouds in units of their item's scale (float32 [B, L, D],
    contiguous), their valid rows [B, L] and the scale [B, 1]. The valid rows go first, in
    their order (a running count, not two sorts), and no pass looks for bounds."""
    batch = query.shape[0]
    scale = scale.reshape(batch, 1).to(torch.float32)
    side = torch.tensor(1.00001, dtype=torch.float32)  # the frame kernel's one cell: a unit side, as sized there
    zeros = scale.new_zeros((batch, 6))
    values = torch.cat([zeros, side / scale, (1 / side) * scale, (1e-6 * side) / scale, scale, zeros[:, :2]], 1)
    shape = torch.ones((batch, 4), dtype=torch.int32, device=query.device)
    return Frame(values, shape, 1, 1, 0), _valid_first(query, query_ok), _valid_first(ref, ref_ok)


def _valid_first(points: torch.Tensor, valid: torch.Tensor) -> SortedPoints:
    """points [B, L, D] (float32, scaled) in the order of a one-cell grid: each item's valid
    rows first, then its invalid ones, each in their order."""
    batch, rows, dim = points.shape
    device = points.device
    before = torch.cumsum(valid, 1, dtype=torch.int64)  # valid rows up to and with each row
    count = before[:, -1:] if rows else torch.zeros((batch, 1), dtype=torch.int64, device=device)
    row = torch.arange(rows, device=device)
    start = torch.arange(batch, device=device)[:, None] * rows
    position = start + torch.where(valid, before - 1, count + row - before)
    order = torch.empty(batch * rows, dtype=torch.int64, device=device)
    order.scatter_(0, position.reshape(-1), torch.arange(batch * rows, device=device))
    bucket_start = torch.cat([torch.cat([start, start + count], 1).reshape(-1),
                              torch.full((1,), batch * rows, dtype=torch.int64, device=device)]).to(torch.int32)
    within = torch.zeros((batch * rows,), dtype=torch.int8, device=device)  # one cell: shift 0
    return SortedPoints(points.reshape(-1, dim).index_select(0, order), order, bucket_start, within)
