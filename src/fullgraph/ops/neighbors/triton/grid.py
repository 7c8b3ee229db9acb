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

from ...._triton import cdiv, lazy, next_power_of_2

kernels = lazy(f"{__package__}.grid_kernels")

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
        blocks, query_blocks = (max(1, cdiv(points.shape[1], _BLOCK)) for points in (ref, query))
        bounds = torch.empty((batch, blocks + query_blocks, 8), dtype=torch.float32, device=ref.device)
        kernels._bounds_kernel[(blocks + query_blocks, batch)](ref, ref_lengths, columns, blocks, query, query_lengths,
                                                       query.shape[1], bounds, D=dim, G=grid_dims, BLOCK=_BLOCK)
        kernels._frame_kernel[(batch,)](bounds, blocks, query_blocks, values, shape, buckets, float(CELL_POINTS),
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
    kernels._count_kernel[(cdiv(columns, _BLOCK), batch)](
        ref, ref_lengths, grid.values, grid.shape, per_cell, columns, grid.buckets, **sizes)
    kernels._load_kernel[(cdiv(rows, _BLOCK), batch)](
        query, query_lengths, grid.values, grid.shape, per_cell, load, rows, grid.buckets, **sizes)
    kernels._refine_kernel[(batch,)](grid.values, grid.shape, load, grid.buckets, grid.space, float(cell_points),
                             float(side), G=grid.grid_dims)


def _both_keys(query, query_lengths, ref, ref_lengths, grid: Frame) -> torch.Tensor:
    """``_cell_keys_kernel``'s keys of both clouds [B*M + B*N]: int32, int64 for huge grids."""
    (batch, rows, dim), columns = query.shape, ref.shape[1]
    keys = torch.empty((batch * (rows + columns),), device=query.device,
                       dtype=torch.int32 if _keys_fit_32_bits(batch, grid.space) else torch.int64)
    if keys.numel():
        query_programs = cdiv(rows, _BLOCK)
        kernels._cell_keys_kernel[(query_programs + cdiv(columns, _BLOCK), batch)](
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
        kernels._split_kernel[(cdiv(total, _BLOCK),)](
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
            kernels._lower_bounds_kernel[(cdiv(count, block), parts)](
                values, bounds, split, total, count, max(split, total - split).bit_length(), BLOCK=block,
                num_warps=warps)
        return bounds
    # One flat running sum for both parts (torch's along the rows of a [2, 4M] tensor took 6 ms).
    counts = torch.zeros((parts * (count + 1),), dtype=dtype, device=values.device)
    if total:
        kernels._histogram_kernel[(cdiv(total, HISTOGRAM_BLOCK),)](values, counts, split, total, count, parts,
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
    programs = cdiv(batch * rows, block) + cdiv(batch * columns, block)
    if programs and dim:
        kernels._sorted_points_kernel[(programs,)](
            query, query_order, batch * rows, rows, ref, ref_order, batch * columns, columns, grid.values, *moved,
            D=dim, DP=next_power_of_2(dim), BLOCK=block)
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
        kernels._to_scaled_units_kernel[(batch,)](grid.values)
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
