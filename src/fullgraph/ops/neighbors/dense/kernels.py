"""Triton kernels of the "dense" backend on GPUs: the products on tensor cores, reduced to
per-chunk minima so that no M x N matrix is stored.

``least_chunks``: for every query i, the chunks c of ``chunk`` consecutive references with
the least ``min_{j in c} |r_j|^2 - 2 q_i . r_j`` (products by ``tl.dot`` in TF32, in three
TF32 products that carry float32's significand, "tf32x3", or of float16 operands, "fp16":
both clouds times a power of two per item, ``half_operands``, every product exact). Up to
FUSED_MAX_KEYS chunks a query on up to FUSED_MAX_COLUMNS references, one kernel does it
all: each program walks its
share of the references a tile at a time and merges the tile's chunk minima into a sorted
list per query (a bitonic merge of packed (value, chunk) int32 keys in registers, the value
plus |q_i|^2, about the squared distance, rounded down to the bits the chunk number leaves:
20 or more); the shares' lists are merged
the same way. Longer lists and wider clouds store every chunk minimum
(``chunk_minima``) and select from them (``smallest``).
``member_distances``: the squared distances from each query to every reference of the chunks
chosen for it, summed from the differences (no cancellation: within (D + 2) u of the truth,
relatively). ``smallest``: the least values of each row with their positions, ties to the
smaller position (a sort of packed (value, position) keys in registers; beyond SORT_MAX
columns, a threshold from the minima of classes of positions and a sort of the values under
it, ``_wide_smallest_kernel``, or ``torch.topk``). ``backend.py`` says why the k nearest lie in the chosen chunks and
how that is certified.
"""

from __future__ import annotations

import math

import torch

import triton
import triton.language as tl

from ...scaling_kernels import kernel_power_below, kernel_safe_scale
from ..keys import KEY_NONE, insert_keys
from ..pairs import PER_COORDINATE_MAX_DIM

# Tiles of chunk_minima on both clouds (queries, references, coordinates a step, warps, pipeline
# stages) by precision.
MINIMA_TILES = {"fp16": (128, 256, 32, 8, 3), "tf32": (128, 256, 32, 8, 3), "tf32x3": (128, 128, 64, 8, 2)}
MINIMA_OTHER_TILES = (128, 128, 32, 8, 3)
# Up to this many coordinates (padded to a power of two) a program holds its tile of queries and
# streams its share of the references, MINIMA_HELD_PROGRAMS_PER_SM programs an SM, in tiles
# (queries, references, warps, pipeline stages) by the padded D (measured: NOTES.md).
MINIMA_HELD_MAX_DIM = {"fp16": 128, "tf32": 64, "tf32x3": 128, "ieee": 64}  # by precision
MINIMA_HELD_PROGRAMS_PER_SM = 4
MINIMA_HELD_TILES = {16: (128, 128, 8, 3), 32: (128, 128, 8, 3), 64: (128, 128, 8, 3), 128: (128, 64, 8, 2)}
# ... with float16 operands where those tiles differ (NOTES.md).
MINIMA_HELD_HALF_TILES = {128: (128, 128, 8, 2)}
# (The fused lists holding their tile of queries were slower: NOTES.md.)
BLOCK_MEMBERS = 128
# The widest rows ``smallest`` sorts in registers, and the keys one program sorts.
SORT_MAX, SORT_KEYS = 2048, 4096
# Wider rows on GPUs, for up to WIDE_GROUPS least a row: ``_wide_smallest_kernel`` (a
# threshold from the minima of WIDE_GROUPS classes of positions, the values below it gathered,
# at most WIDE_CAP, and sorted), read in blocks of WIDE_BLOCK on WIDE_WARPS warps.
WIDE_GROUPS, WIDE_CAP, WIDE_BLOCK, WIDE_WARPS = 64, 256, 2048, 4
# The fused path (``least_chunks`` up to FUSED_MAX_KEYS chunks a query): chunks of FUSED_CHUNK
# references (short chunks: fewer members to measure), tiles of FUSED_BLOCK_M queries; a tile of
# references holds at least as many chunks as the list. Chunks of 2 with dense.CHUNK_SLACK 6
# were faster than 4 with 4 (NOTES.md).
FUSED_CHUNK, FUSED_BLOCK_M, FUSED_BLOCK_N, FUSED_NUM_WARPS, FUSED_MAX_KEYS = 2, 64, 128, 4, 64
# ... and up to this many references, by the lists' width (keys, a power of two >= 16): beyond.
FUSED_MAX_COLUMNS = {16: 2**14, 32: 2**14, 64: 2**14}
# Where the list's last key is a floor only (``least_chunk_keys(floor=True)``: the first products of
# the fused lists), each tile of references may offer half the list's keys, the greatest it offers
# (at or below every key it leaves out) lowering that floor: a shorter sort a tile. A query whose
# nearest crowd into one tile (references ordered in space) gets a low floor and goes to the second
# products, which offer the whole list.
FUSED_TILE_HALF, FUSED_TILE_HALF_MIN_COLUMNS = True, 1024
# ``squared_distances``: up to this many coordinates (held in registers, MEASURE_BLOCK values
# a program; wider points take torch's gather and ops).
MEASURE_MAX_DIM, MEASURE_BLOCK = 1024, 4096
# ``frames``: rows of points a program holds (FRAMES_BLOCK values), up to FRAMES_MAX_DIM
# coordinates, and the programs a cloud takes at most over the batch (each walks its share).
FRAMES_BLOCK, FRAMES_MAX_DIM, FRAMES_PROGRAMS = 4096, 1024, 1024
# Programs to aim for per multiprocessor: a few queries against many references split the
# references into shares.
FUSED_PROGRAMS_PER_SM = 4


def product_error(precision: str) -> float:
    """The largest relative error of one product q_d r_d on the tensor cores in ``precision``,
    before the float32 accumulation: "tf32" rounds (or truncates) each operand to 10 bits,
    2 x 2^-10 + 2^-20; "tf32x3" splits each into two TF32 parts and drops low x low, every
    term below 2^-20, 4 x 2^-20 in all."""
    return {"ieee": 0.0, "tf32x3": 2.0**-18, "tf32": 2.0**-9 + 2.0**-20}[precision]


def half_unit(largest: torch.Tensor) -> torch.Tensor:
    """[B] the power of two ``half_operands`` multiplies an item's centred clouds by, from
    their largest |coordinate| before centring ``largest`` [B] (finite, >= 0): a centred
    coordinate is at most twice that, below 2^15 after (float16's largest is 65,504)."""
    _, exponent = torch.frexp(largest)  # largest < 2^exponent
    return torch.ldexp(torch.ones_like(largest), 14 - exponent)


def half_operands(x: torch.Tensor, unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x [B, L, D] times ``unit`` [B] (``half_unit``) rounded to float16 (to nearest
    even, as Triton's frames round), and the norm [B, L] of what that left out, in x's
    units (the difference is exact): operands the tensor cores multiply exactly, each
    coordinate within 2^-11 of itself (or of 2^-25 / unit, float16's subnormals)."""
    half = (x * unit[:, None, None]).to(torch.float16)
    return half, (x - half.to(torch.float32) / unit[:, None, None]).norm(dim=-1)


def _list_width(count: int) -> int:
    """Keys a fused list of ``count`` chunks holds: a power of two, at least 16."""
    return 1 << max(4, (count - 1).bit_length())


def chunk_size(columns: int, count: int) -> int:
    """References per chunk when ``count`` chunks a query are kept: FUSED_CHUNK on the fused
    path; otherwise fewer, longer chunks for large clouds keep the stored minima
    (M x N / chunk) and their selection small."""
    keys = _list_width(count)
    if keys <= FUSED_MAX_KEYS and columns <= FUSED_MAX_COLUMNS.get(keys, 0):
        return FUSED_CHUNK
    return 16 if columns <= 2**16 else 32 if columns <= 2**18 else 64



_SHORT_KEY_NONE = tl.constexpr(0x7FFFFFFF)  # above every ``_short_keys`` key (NaN has none)
_PER_COORDINATE = tl.constexpr(PER_COORDINATE_MAX_DIM)

@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """tl.dot in ``PRECISION`` ("fp16": of float16 operands, every product exact)."""
    if PRECISION == "fp16":
        product = tl.dot(a, b)
    else:
        product = tl.dot(a, b, input_precision=PRECISION)
    return product

@triton.jit
def _twice(twice_ptr, item, PRECISION: tl.constexpr):
    """The factor of the products in ``r_norms - 2 q.r``: 2, or 2 / unit^2 for the item's
    float16 operands (``half_operands``: their products are unit^2 q.r; exact, powers of two)."""
    if PRECISION == "fp16":
        twice = tl.load(twice_ptr + item)
    else:
        twice = 2.0
    return twice

@triton.jit
def _tile_minima(q_base, r_base, r_norms_base, m, n, rows, columns, dim, twice, CHUNK: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """[len(m), len(n) / CHUNK]: per chunk of the references n, the least
    ``r_norms - twice q.r`` of each query m (+inf past ``columns``)."""
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((m.shape[0], n.shape[0]), dtype=tl.float32)
    for start in range(0, dim, BLOCK_K):
        d = start + kk
        in_d = d[None, :] < dim
        q = tl.load(q_base + m[:, None] * dim + d[None, :], mask=(m[:, None] < rows) & in_d, other=0.0)
        r = tl.load(r_base + n[:, None].to(tl.int64) * dim + d[None, :], mask=(n[:, None] < columns) & in_d,
                    other=0.0)
        acc += _dot(q, tl.trans(r), PRECISION)
    norms = tl.load(r_norms_base + n, mask=n < columns, other=float("inf"))
    approx = norms[None, :] - twice * acc
    return tl.min(tl.reshape(approx, (m.shape[0], n.shape[0] // CHUNK, CHUNK)), axis=2)

@triton.jit
def _chunk_minima_kernel(q_ptr, r_ptr, r_norms_ptr, twice_ptr, needed_ptr, out_ptr, rows, columns, dim, chunks,
                         row_blocks,
                         CHUNK: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NEEDED: tl.constexpr):
    """out [B, M, chunks]: the chunk minima of a tile of queries against a tile of
    references a program, consecutive programs one tile of references against successive
    tiles of queries. NEEDED: a tile none of whose queries needed marks stores nothing."""
    item = tl.program_id(1).to(tl.int64)
    row_block, column_block = tl.program_id(0) % row_blocks, tl.program_id(0) // row_blocks
    m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    n = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    c = column_block * (BLOCK_N // CHUNK) + tl.arange(0, BLOCK_N // CHUNK)
    where = out_ptr + item * rows * chunks + m[:, None] * chunks + c[None, :]
    inside = (m[:, None] < rows) & (c[None, :] < chunks)
    if NEEDED:
        if tl.max(tl.load(needed_ptr + item * rows + m, mask=m < rows, other=0).to(tl.int32)) == 0:
            return
    minima = _tile_minima(q_ptr + item * rows * dim, r_ptr + item * columns * dim, r_norms_ptr + item * columns,
                          m, n, rows, columns, dim, _twice(twice_ptr, item, PRECISION), CHUNK, PRECISION, BLOCK_K)
    tl.store(where, minima, mask=inside)

@triton.jit
def _held_tile_minima(q, r_base, r_norms_base, n, columns, dim, twice, CHUNK: tl.constexpr,
                      PRECISION: tl.constexpr):
    """``_tile_minima`` of held queries q [len(m), DP] (DP >= D coordinates, zero past D)."""
    d = tl.arange(0, q.shape[1])
    r = tl.load(r_base + n[:, None].to(tl.int64) * dim + d[None, :], mask=(n[:, None] < columns) & (d[None, :] < dim),
                other=0.0)
    norms = tl.load(r_norms_base + n, mask=n < columns, other=float("inf"))
    approx = norms[None, :] - twice * _dot(q, tl.trans(r), PRECISION)
    return tl.min(tl.reshape(approx, (q.shape[0], n.shape[0] // CHUNK, CHUNK)), axis=2)

@triton.jit
def _held_queries(q_base, m, rows, dim, DP: tl.constexpr):
    """[len(m), DP]: the queries m, zero past D."""
    d = tl.arange(0, DP)
    return tl.load(q_base + m[:, None] * dim + d[None, :], mask=(m[:, None] < rows) & (d[None, :] < dim), other=0.0)

@triton.jit
def _held_minima_kernel(q_ptr, r_ptr, r_norms_ptr, twice_ptr, needed_ptr, out_ptr, rows, columns, dim, chunks,
                        share,
                        CHUNK: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, DP: tl.constexpr, NEEDED: tl.constexpr):
    """``_chunk_minima_kernel`` with a tile of queries held (all its DP >= D coordinates)
    against the tiles of references [part * share, (part + 1) * share): each tile of
    references one product, the queries read once."""
    item = tl.program_id(2).to(tl.int64)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    first = tl.program_id(1) * share
    stop = tl.minimum(first + share, columns)
    if NEEDED:
        if tl.max(tl.load(needed_ptr + item * rows + m, mask=m < rows, other=0).to(tl.int32)) == 0:
            return
    q = _held_queries(q_ptr + item * rows * dim, m, rows, dim, DP)
    twice = _twice(twice_ptr, item, PRECISION)
    for start in range(first, stop, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        c = start // CHUNK + tl.arange(0, BLOCK_N // CHUNK)
        minima = _held_tile_minima(q, r_ptr + item * columns * dim, r_norms_ptr + item * columns, n, columns, dim,
                                   twice, CHUNK, PRECISION)
        tl.store(out_ptr + (item * rows + m[:, None]) * chunks + c[None, :], minima,
                 mask=(m[:, None] < rows) & (c[None, :] < chunks))

@triton.jit
def _ordered_bits(values):
    """float32 values (no NaN) -> int32 in the same order: the float's bits made monotonic
    (negatives: flip the magnitude bits; -0.0 as 0.0). ``_ordered_floats`` undoes it."""
    bits = tl.where(values == 0.0, 0.0, values).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)

@triton.jit
def _ordered_keys(values, positions):
    """float32 values (no NaN) and int positions -> int64 keys ordered as (value, position)."""
    return (_ordered_bits(values).to(tl.int64) << 32) | positions.to(tl.int64)

@triton.jit
def _ordered_float(bits):
    """``_ordered_bits`` undone: int32 -> float32."""
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

@triton.jit
def _key_values(keys):
    """``_ordered_keys`` keys -> their float32 values."""
    return _ordered_float((keys >> 32).to(tl.int32))

@triton.jit
def _short_keys(values, positions, POSITION_BITS: tl.constexpr):
    """float32 values (no NaN) and positions < 2^POSITION_BITS -> int32 keys ordered as
    (value rounded down to 32 - POSITION_BITS bits, position): ``_ordered_keys`` in half
    the width, for the fused lists (int64 compare-and-swap steps cost twice)."""
    return (_ordered_bits(values) & -(1 << POSITION_BITS)) | positions.to(tl.int32)

@triton.jit
def _compare_swap(x, STRIDE: tl.constexpr, BLOCK: tl.constexpr, FLIP: tl.constexpr):
    """One step of a bitonic network along the rows of x [R, W] (integers): the elements
    STRIDE apart put in order, ascending in even blocks of BLOCK elements and descending in
    odd ones (FLIP: the other way). The partner of a key is its pair's sum less the key (a
    sum may wrap, the difference does not). Not ``tl.sort``: this network was as fast on
    the H100 (4.38 against 4.61 ms graphed at 8 x 4096^2), and
    Triton's interpreter runs sums fast, the xor reductions of ``tl.sort`` one element at
    a time."""
    R: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    y = tl.reshape(x, (R, W // (2 * STRIDE), 2, STRIDE))
    group = tl.reshape(tl.arange(0, W // (2 * STRIDE)), (1, W // (2 * STRIDE), 1, 1))
    descending = ((group * (2 * STRIDE) // BLOCK) % 2 == 1) != FLIP
    right = tl.reshape(tl.arange(0, 2), (1, 1, 2, 1)) == 1
    partner = tl.sum(y, 2, keep_dims=True) - y
    return tl.reshape(tl.where((y > partner) != (right != descending), partner, y), (R, W))

@triton.jit
def _least_descending(keys, LOG_NEW: tl.constexpr, LOG_WIDTH: tl.constexpr):
    """The 2^LOG_WIDTH least keys of each row of keys [R, 2^LOG_NEW] (LOG_WIDTH <=
    LOG_NEW), descending: runs of that width sorted, alternately descending and ascending
    (a bitonic sort's first stages), then while more than one run is left, each pair's
    elementwise minima (a descending run against an ascending one: its least half, a
    bitonic sequence) sorted into the next alternating runs. (A whole sort of the row
    before its least: 47 against 40 steps of 32 keys at 64 new, H100.)"""
    WIDTH: tl.constexpr = 1 << LOG_WIDTH
    for stage in tl.static_range(1, LOG_WIDTH + 1):
        for step in tl.static_range(stage):
            keys = _compare_swap(keys, 1 << (stage - 1 - step), 1 << stage, True)
    for level in tl.static_range(LOG_NEW - LOG_WIDTH):
        pairs = tl.reshape(keys, (keys.shape[0], keys.shape[1] // (2 * WIDTH), 2, WIDTH))
        keys = tl.reshape(tl.min(pairs, 2), (keys.shape[0], keys.shape[1] // 2))
        for step in tl.static_range(LOG_WIDTH):
            keys = _compare_swap(keys, WIDTH >> (step + 1), WIDTH, True)
    return keys

@triton.jit
def _merge_sorted(best, new, LOG_WIDTH: tl.constexpr):
    """The WIDTH least keys of best (ascending) and new (descending) [R, WIDTH], ascending:
    their elementwise minimum is a bitonic sequence holding them, sorted by LOG_WIDTH
    compare-and-swap steps."""
    x = tl.minimum(best, new)
    for step in tl.static_range(LOG_WIDTH):
        x = _compare_swap(x, best.shape[1] >> (step + 1), 2 * best.shape[1], False)
    return x

@triton.jit
def _chunk_candidates_kernel(q_ptr, q_norms_ptr, r_ptr, r_norms_ptr, twice_ptr, needed_ptr, out_ptr,
                             floors_ptr, rows, columns, dim, chunks, share, parts, width,
                             CHUNK: tl.constexpr, PRECISION: tl.constexpr, KEYS: tl.constexpr,
                             LOG_KEYS: tl.constexpr, LOG_KEEP: tl.constexpr, LOG_NEW: tl.constexpr,
                             POSITION_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, NEEDED: tl.constexpr):
    """Per query of the tile, the KEYS least (chunk minimum + |q|^2, chunk) ``_short_keys``
    over the references [part * share, (part + 1) * share), ascending -> the first
    ``width`` of them into out [B, M, parts, width]. LOG_KEEP < LOG_KEYS: a tile's
    2^LOG_KEEP least only enter the list, and the greatest of them (at or below every key
    the tile leaves out) lowers a floor: one share (parts 1) folds it into the list's last
    key, several store it into floors [B, M, parts] (the merge folds them). NEEDED: a
    tile none of whose queries needed marks stores nothing."""
    item = tl.program_id(2).to(tl.int64)
    part = tl.program_id(1)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if NEEDED:
        if tl.max(tl.load(needed_ptr + item * rows + m, mask=m < rows, other=0).to(tl.int32)) == 0:
            return
    q_base, r_base = q_ptr + item * rows * dim, r_ptr + item * columns * dim
    # Keyed on about the squared distance, not |r|^2 - 2 q.r ~ -|q|^2 near the query: the
    # keys' bits then resolve the distances themselves.
    q_norms = tl.load(q_norms_ptr + item * rows + m, mask=m < rows, other=0.0)
    best = tl.full((BLOCK_M, KEYS), _SHORT_KEY_NONE, tl.int32)
    floor = tl.full((BLOCK_M,), _SHORT_KEY_NONE, tl.int32)
    twice = _twice(twice_ptr, item, PRECISION)
    first = part * share
    for start in range(first, tl.minimum(first + share, columns), BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        minima = _tile_minima(q_base, r_base, r_norms_ptr + item * columns, m, n, rows, columns, dim, twice, CHUNK,
                              PRECISION, BLOCK_K)
        c = start // CHUNK + tl.arange(0, BLOCK_N // CHUNK)
        keys = tl.where((c < chunks)[None, :], _short_keys(minima + q_norms[:, None], c[None, :], POSITION_BITS),
                        _SHORT_KEY_NONE)
        new = _least_descending(keys, LOG_NEW, LOG_KEEP)
        if LOG_KEEP < LOG_KEYS:  # (descending: the missing keys first, as none)
            floor = tl.minimum(floor, tl.max(new, 1))
            runs = tl.reshape(new, (BLOCK_M, 1, 1 << LOG_KEEP))
            last = tl.reshape(tl.arange(0, 1 << (LOG_KEYS - LOG_KEEP)), (1, 1 << (LOG_KEYS - LOG_KEEP), 1))
            new = tl.reshape(tl.where(last == (1 << (LOG_KEYS - LOG_KEEP)) - 1, runs, _SHORT_KEY_NONE),
                             (BLOCK_M, KEYS))
        best = _merge_sorted(best, new, LOG_KEYS)
    slots = tl.arange(0, KEYS)
    if LOG_KEEP < LOG_KEYS:
        if parts == 1:
            best = tl.where(slots[None, :] == width - 1, tl.minimum(best, floor[:, None]), best)
        else:
            tl.store(floors_ptr + (item * rows + m) * parts + part, floor, mask=m < rows)
    tl.store(out_ptr + ((item * rows + m[:, None]) * parts + part) * width + slots[None, :], best,
             mask=(m[:, None] < rows) & (slots[None, :] < width))

@triton.jit
def _merge_parts_kernel(lists_ptr, floors_ptr, out_ptr, total_rows, parts, count, KEYS: tl.constexpr,
                        LOG_KEYS: tl.constexpr, FLOORS: tl.constexpr, BLOCK_M: tl.constexpr):
    """lists [rows, parts, KEYS] (each ascending) -> out [rows, count]: the least ``count``
    keys of each row's lists, ascending (a list read backwards is descending); FLOORS:
    the last lowered to the least of floors [rows, parts]."""
    m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    slots = tl.arange(0, KEYS)
    inside = m[:, None] < total_rows
    best = tl.load(lists_ptr + m[:, None] * parts * KEYS + slots[None, :], mask=inside, other=_SHORT_KEY_NONE)
    for part in range(1, parts):
        backwards = tl.load(lists_ptr + (m[:, None] * parts + part) * KEYS + (KEYS - 1 - slots)[None, :],
                            mask=inside, other=_SHORT_KEY_NONE)
        best = _merge_sorted(best, backwards, LOG_KEYS)
    if FLOORS:
        floors = tl.load(floors_ptr + m[:, None] * parts + tl.arange(0, 2)[None, :],
                         mask=inside & (tl.arange(0, 2)[None, :] < parts), other=_SHORT_KEY_NONE)
        for part in range(2, parts):
            floors = tl.minimum(floors, tl.load(floors_ptr + m[:, None] * parts + part, mask=inside,
                                                other=_SHORT_KEY_NONE))
        best = tl.where(slots[None, :] == count - 1, tl.minimum(best, tl.min(floors, 1)[:, None]), best)
    tl.store(out_ptr + m[:, None] * count + slots[None, :], best, mask=inside & (slots[None, :] < count))

@triton.jit
def _member_distances_kernel(q_ptr, r_ptr, r_norms_ptr, chosen_ptr, needed_ptr, out_ptr, rows, columns, dim,
                             n_chosen, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                             NEEDED: tl.constexpr):
    item = tl.program_id(2).to(tl.int64)
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    members = n_chosen * CHUNK
    query = item * rows + row
    if NEEDED:  # (rows not needed: +inf, nothing read)
        if tl.load(needed_ptr + query) == 0:
            tl.store(out_ptr + query * members + j, tl.full((BLOCK,), float("inf"), tl.float32),
                     mask=j < members)
            return
    chunk = tl.load(chosen_ptr + query * n_chosen + j // CHUNK, mask=j < members, other=0)
    ref = chunk * CHUNK + j % CHUNK
    ok = (j < members) & (ref < columns)
    norms = tl.load(r_norms_ptr + item * columns + ref, mask=ok, other=float("inf"))
    kk = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, dim, BLOCK_K):
        d = start + kk
        q = tl.load(q_ptr + query * dim + d, mask=d < dim, other=0.0)
        r = tl.load(r_ptr + (item * columns + ref[:, None]) * dim + d[None, :],
                    mask=ok[:, None] & (d[None, :] < dim), other=0.0)
        diff = q[None, :] - r
        total += tl.sum(diff * diff, axis=1)
    # +inf norms mark invalid references (past a length, or NaN rows); an invalid query (a
    # NaN coordinate) measures +inf too: ``smallest`` wants no NaN (it would order them
    # after the padding, whose positions lie past the members).
    total = tl.where((norms == float("inf")) | (total != total), float("inf"), total)
    tl.store(out_ptr + query * members + j, total, mask=j < members)


@triton.jit
def _squared_distances_kernel(q_ptr, r_ptr, refs_ptr, out_ptr, take, dim, BLOCK_C: tl.constexpr,
                              DP: tl.constexpr, LOG_DP: tl.constexpr):
    """out [Q, take] = sum_d (q[i] - r[refs[i, c]])_d^2: each difference and square rounded
    as torch rounds them, summed as ``pairs.halving_sum`` sums (zero-padded to DP = 2^LOG_DP
    coordinates, halved LOG_DP times). Launched without contraction into fused
    multiply-adds, which would round differently."""
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    refs = tl.load(refs_ptr + i * take + c, mask=c < take, other=0)
    d = tl.arange(0, DP)
    q = tl.load(q_ptr + i * dim + d, mask=d < dim, other=0.0)
    r = tl.load(r_ptr + refs[:, None] * dim + d[None, :], mask=(c[:, None] < take) & (d[None, :] < dim),
                other=0.0)
    tl.store(out_ptr + i * take + c, _reference_squares(q, r, DP, LOG_DP), mask=c < take)  # (D > 4: halved)

@triton.jit
def _bit_reversed(LOG_DP: tl.constexpr):
    """[2^LOG_DP]: position p -> the coordinate reverse(p) (its LOG_DP bits reversed).
    Coordinates loaded in this order put each halving sum's pairs (d, d + half) side by
    side: a halving is a sum over the fastest axis (in the brute force's [M, N, D] tiles
    half the shared-memory barriers of summing the halves, PTX for sm_90). Same pairs,
    same bits."""
    p = tl.arange(0, 1 << LOG_DP)
    reversed_bits = tl.zeros_like(p)
    for bit in tl.static_range(LOG_DP):
        reversed_bits = reversed_bits | (((p >> bit) & 1) << (LOG_DP - 1 - bit))
    return reversed_bits

@triton.jit
def _reference_squares(q, r, DIM: tl.constexpr, LOG_DP: tl.constexpr):
    """[C]: sum_d (q - r_c)_d^2 of q [DP] against the rows of r [C, DP] (zero past DIM),
    summed as ``pairs.squared_difference`` sums: up to PER_COORDINATE_MAX_DIM coordinates
    one after another, else halved LOG_DP times (``pairs.halving_sum``). Kernels using it
    are launched without contraction into fused multiply-adds."""
    C: tl.constexpr = r.shape[0]
    DP: tl.constexpr = r.shape[1]
    diff = q[None, :] - r
    x = diff * diff
    if DIM <= _PER_COORDINATE:
        d = tl.arange(0, DP)[None, :]
        total = tl.sum(tl.where(d == 0, x, 0.0), 1)  # (one square and zeros: exact)
        for c in tl.static_range(1, DIM):
            total += tl.sum(tl.where(d == c, x, 0.0), 1)
    else:
        for level in tl.static_range(LOG_DP):
            x = tl.sum(tl.reshape(x, (C, 2, DP >> (level + 1))), 1)
        total = tl.reshape(x, (C,))
    return total

@triton.jit
def _quad_squares(q_row, rows, ok, DIM: tl.constexpr, LOG_DP: tl.constexpr):
    """[C]: ``_reference_squares`` of q (at q_row) against the rows at the pointers rows
    [C] (``ok``: loaded; D > PER_COORDINATE_MAX_DIM, padded to 16 at least: halvings of
    zeros first, exact), four threads a row: x[l, c, h, j] the square of coordinate
    16 h + 4 l + j, loaded 16 bytes a thread (a row's four threads read 64 contiguous
    bytes); the halvings of h in registers, of l across the four, of j in registers. (q
    loaded in the rows' shape, so that both keep this layout.)"""
    C: tl.constexpr = rows.shape[0]
    H: tl.constexpr = ((1 << LOG_DP) + 15) // 16
    d = (tl.arange(0, 4)[:, None, None, None] * 4 + tl.arange(0, H)[None, None, :, None] * 16
         + tl.arange(0, 4)[None, None, None, :])
    at = rows[None, :, None, None] + d
    if DIM == 16 * H:  # (no mask along the row: 16-byte loads)
        r = tl.load(at, mask=tl.broadcast_to(ok[None, :, None, None], at.shape), other=0.0)
        q = tl.load(tl.broadcast_to(q_row + d, at.shape))
    else:
        inside = tl.broadcast_to(d < DIM, at.shape)
        r = tl.load(at, mask=ok[None, :, None, None] & inside, other=0.0)
        q = tl.load(tl.broadcast_to(q_row + d, at.shape), mask=inside, other=0.0)
    diff = q - r
    x = diff * diff
    for level in tl.static_range(LOG_DP - 4):
        x = tl.sum(tl.reshape(x, (4, C, 2, H >> (level + 1), 4)), 2)
    x = tl.sum(tl.sum(tl.reshape(x, (2, 2, C, 4)), 0), 0)
    return tl.sum(tl.sum(tl.reshape(x, (C, 2, 2)), 1), 1)

@triton.jit
def _row_of(x, at, WIDTH: tl.constexpr):
    """Row ``at`` of x [R * WIDTH] seen as [R, WIDTH] (integers): [WIDTH]."""
    ROWS: tl.constexpr = x.shape[0] // WIDTH
    return tl.sum(tl.where((tl.arange(0, ROWS) == at)[:, None], tl.reshape(x, (ROWS, WIDTH)), 0), 0)

@triton.jit
def _member_refs(chosen, members, columns, slot, CHUNK: tl.constexpr, POSITION_BITS: tl.constexpr):
    """The references of a query's member slots (member s: the (s % CHUNK)-th of chunk
    chosen[s // CHUNK]; none past ``members`` or where the chunk is -1; POSITION_BITS > 0:
    chosen holds ``_short_keys``, the chunk in their low bits) and which of them are
    inside the cloud (their rows may be read; valid where ``ok`` too: read apart, so
    that the rows' loads wait for one load less)."""
    chunk = tl.load(chosen + slot // CHUNK, mask=slot < members, other=-1)
    if POSITION_BITS > 0:
        chunk = tl.where(slot < members, chunk & ((1 << POSITION_BITS) - 1), -1)
    ref = chunk * CHUNK + slot % CHUNK
    return ref, (chunk >= 0) & (ref < columns)

@triton.jit
def _key_floor(keys, bound, q_abs, reach, DIM: tl.constexpr, POSITION_BITS: tl.constexpr):
    """A floor under the squared distances, as the reference measures them, of every
    reference of the chunks of ``_short_keys`` keys (NaN for ``_SHORT_KEY_NONE``): each
    has a product value v with v + |q|^2 at least the key's sum rounded down, less 2^-23
    of it (see dense._chosen_chunks; the products err by ``bound``), then
    dense.beyond_expansion for a query of norm q_abs among references of norm <= reach."""
    least = _ordered_float(keys & -(1 << POSITION_BITS))
    least = tl.where(least >= 0, least * (1 - 2.0**-22), least * (1 + 2.0**-22)) - 2 * bound
    return ((least - 2 * (DIM + 4) * 2.0**-24 * (q_abs + reach) * (q_abs + reach))
            * (1 - 2 * (DIM + 2) * 2.0**-24))

@triton.jit
def _key_ceiling(key, bound, q_abs, reach, DIM: tl.constexpr, POSITION_BITS: tl.constexpr):
    """``_key_floor``'s mirror: a ceiling over the squared distance, as the reference
    measures it, of the nearest reference of the chunk of a ``_short_keys`` key (not
    ``_SHORT_KEY_NONE``), whose sum lies below the next rounded key."""
    most = _ordered_float((key & -(1 << POSITION_BITS)) + (1 << POSITION_BITS))
    most = tl.where(most >= 0, most * (1 + 2.0**-22), most * (1 - 2.0**-22)) + 2 * bound
    return ((most + 2 * (DIM + 4) * 2.0**-24 * (q_abs + reach) * (q_abs + reach))
            * (1 + 2 * (DIM + 2) * 2.0**-24))

@triton.jit
def _measured_members(q_row, r_base, ok_base, chosen, columns, n_chosen, take, DIM: tl.constexpr,
                      LOG_DP: tl.constexpr, CHUNK: tl.constexpr, WP: tl.constexpr, SEL: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, POSITION_BITS: tl.constexpr,
                      BY_QUAD: tl.constexpr):
    """One query (its row of q at ``q_row``): its members (``_member_refs``) measured by
    summed differences, the ``take`` least (by (value, member)) measured again in the
    reference's arithmetic (BY_QUAD: ``_quad_squares``, BLOCK_C four threads each) -> their
    (distance, index) keys, ascending [SEL or WP] (none: ``KEY_NONE``), and the take-th
    least first measure (+inf where every member was)."""
    members = n_chosen * CHUNK
    j = tl.arange(0, WP)
    if SEL < WP:
        ref, inside = _member_refs(chosen, members, columns, j, CHUNK, POSITION_BITS)
        total = tl.zeros((WP,), tl.float32)
        for start in range(0, DIM, BLOCK_K):
            d = start + tl.arange(0, BLOCK_K)
            qd = tl.load(q_row + d, mask=d < DIM, other=0.0)
            rd = tl.load(r_base + ref[:, None] * DIM + d[None, :], mask=inside[:, None] & (d[None, :] < DIM),
                         other=0.0)
            diff = qd[None, :] - rd
            total += tl.sum(diff * diff, 1)
        valid = inside & (tl.load(ok_base + ref, mask=inside, other=0) != 0)
        total = tl.where(valid & (total == total), total, float("inf"))
        first = _row_of(tl.sort(_ordered_keys(total, j), 0), 0, SEL)
        last = _key_values(tl.sum(tl.where(tl.arange(0, SEL) == take - 1, first, 0)))
        slot = tl.where(tl.arange(0, SEL) < take, (first & 0xFFFFFFFF).to(tl.int32), WP)
    else:
        last = tl.full((), float("inf"), tl.float32)
        slot = j
    dp = tl.arange(0, 1 << LOG_DP)
    q = tl.load(q_row + dp, mask=dp < DIM, other=0.0)
    BLOCKS: tl.constexpr = slot.shape[0] // BLOCK_C
    keys = tl.full((BLOCKS, BLOCK_C), KEY_NONE, tl.int64)
    for b in tl.static_range(BLOCKS):
        ref, inside = _member_refs(chosen, members, columns, _row_of(slot, b, BLOCK_C), CHUNK, POSITION_BITS)
        if BY_QUAD:
            d2 = _quad_squares(q_row, r_base + ref * DIM, inside, DIM, LOG_DP)
        else:
            r = tl.load(r_base + ref[:, None] * DIM + dp[None, :], mask=inside[:, None] & (dp[None, :] < DIM),
                        other=0.0)
            d2 = _reference_squares(q, r, DIM, LOG_DP)
        valid = inside & (tl.load(ok_base + ref, mask=inside, other=0) != 0)
        found = (tl.sqrt_rn(d2).to(tl.int32, bitcast=True).to(tl.int64) << 32) | ref.to(tl.int64)
        found = tl.where(valid & (d2 == d2), found, KEY_NONE)
        keys = tl.where((tl.arange(0, BLOCKS) == b)[:, None], found[None, :], keys)
    return tl.sort(tl.reshape(keys, (BLOCKS * BLOCK_C,)), 0), last

@triton.jit
def _nearest_members_kernel(q_ptr, r_ptr, ok_ptr, chosen_ptr, needed_ptr, out_d, out_i, out_last, rows, columns,
                            n_chosen, take, count, DIM: tl.constexpr, LOG_DP: tl.constexpr, CHUNK: tl.constexpr,
                            WP: tl.constexpr, SEL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                            BY_QUAD: tl.constexpr, NEEDED: tl.constexpr):
    """One query: ``_measured_members`` of its chosen chunks (chosen < 0: none), the
    ``count`` nearest stored by (distance, index), and the take-th least first measure
    -> out_last."""
    row = tl.program_id(0).to(tl.int64)
    if NEEDED:
        if tl.load(needed_ptr + row) == 0:
            return
    item = row // rows
    keys, last = _measured_members(q_ptr + row * DIM, r_ptr + item * columns * DIM, ok_ptr + item * columns,
                                   chosen_ptr + row * n_chosen, columns, n_chosen, take, DIM, LOG_DP, CHUNK,
                                   WP, SEL, BLOCK_K, BLOCK_C, 0, BY_QUAD)
    tl.store(out_last + row, last)
    at = tl.arange(0, keys.shape[0])
    hit = keys != KEY_NONE
    tl.store(out_d + row * count + at, tl.where(hit, _key_values(keys), float("inf")), mask=at < count)
    tl.store(out_i + row * count + at, tl.where(hit, keys & 0xFFFFFFFF, -1), mask=at < count)

@triton.jit
def _certified_lists_kernel(q_ptr, r_ptr, ok_ptr, query_ok_ptr, keys_ptr, q_norms_ptr, reach_ptr, scale_ptr,
                            q_lo_ptr, r_lo_ptr, out_d, out_i, out_unproven, rows, first_row, total_rows, columns,
                            n_chosen, n_keys, take, count, error, radius, n_rows, DIM: tl.constexpr,
                            LOG_DP: tl.constexpr, CHUNK: tl.constexpr, WP: tl.constexpr, SEL: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BY_QUAD: tl.constexpr,
                            POSITION_BITS: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr,
                            NEEDED: tl.constexpr):
    """ROWS queries (of n_rows) of a block of ``rows`` (row ``first_row`` on of ``total_rows``), each: the
    members of its first n_chosen ``least_chunk_keys`` (of n_keys) measured
    (``_measured_members``), the certificate of ``backend.py`` (the floor under every
    unchosen chunk from the next key, the products' ``error`` per unit of |q| R, the
    last first measure) and the ``count`` nearest, times the item's scale, within
    ``radius``, stored into the lists [B, total_rows, count] with the row's flag
    unproven (valid queries only; an invalid one's list stays empty). HALF: products of
    float16 operands (``half_operands``), whose error is bounded per query by the norms
    left out, q_lo [B, m] and r_lo [B, 1] (``dense._products``). NEEDED: only the rows
    flagged unproven already are done (a program of ROWS without one does nothing)."""
    for i in range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + i
        item = row // rows
        out_row = item * total_rows + first_row + row % rows
        go = row < n_rows
        if NEEDED:
            go = go & (tl.load(out_unproven + out_row, mask=go, other=0) != 0)
        if go:
            q_abs = tl.sqrt(tl.load(q_norms_ptr + row))
            reach = tl.load(reach_ptr + item)
            if HALF:
                q_lo = tl.load(q_lo_ptr + row)
                bound = (q_lo * reach + (q_abs + q_lo) * tl.load(r_lo_ptr + item)) * (1 + 2.0**-10)
            else:
                bound = error * q_abs * reach
            # The chosen chunks past the k-th whose floor lies above the k-th's ceiling hold
            # none of the k nearest: only the chunks before the first of them are measured, and
            # its key bounds the rest (the certificate checks it).
            c = tl.arange(0, WP // CHUNK)
            chosen = tl.load(keys_ptr + row * n_keys + c, mask=c < n_chosen, other=_SHORT_KEY_NONE)
            kth_key = tl.sum(tl.where(c == count - 1, chosen, 0))
            ceiling = tl.where((count <= n_chosen) & (kth_key != _SHORT_KEY_NONE),
                               _key_ceiling(kth_key, bound, q_abs, reach, DIM, POSITION_BITS), float("inf"))
            floors = _key_floor(chosen, bound, q_abs, reach, DIM, POSITION_BITS)
            measured = tl.minimum(tl.min(tl.where((c >= count) & (floors > ceiling), c, n_chosen)), n_chosen)
            keys, last = _measured_members(q_ptr + row * DIM, r_ptr + item * columns * DIM,
                                           ok_ptr + item * columns, keys_ptr + row * n_keys, columns, measured,
                                           take, DIM, LOG_DP, CHUNK, WP, SEL, BLOCK_K, BLOCK_C, POSITION_BITS,
                                           BY_QUAD)
            # Every reference of an unmeasured chunk lies at or above the next key's floor.
            top = tl.load(keys_ptr + row * n_keys + measured, mask=n_keys > measured, other=0)
            beyond = _key_floor(top, bound, q_abs, reach, DIM, POSITION_BITS)
            limit = tl.minimum(tl.where(n_keys > measured, beyond, float("inf")),
                               last * (1 - 4 * (DIM + 2) * 2.0**-24))
            at = tl.arange(0, keys.shape[0])
            hit = keys != KEY_NONE
            d = tl.where(hit, _key_values(keys), float("inf"))
            kth = tl.sum(tl.where(at == count - 1, d, 0.0))
            kth = tl.where(count <= keys.shape[0], kth, float("inf"))
            valid = tl.load(query_ok_ptr + out_row) != 0
            proven = (kth * kth < limit) | (limit == float("inf"))
            tl.store(out_unproven + out_row, (valid & ~proven).to(tl.int8))
            d = d * tl.load(scale_ptr + item)
            keep = hit & (d <= radius) & valid
            tl.store(out_d + out_row * count + at, tl.where(keep, d, float("inf")), mask=at < count)
            tl.store(out_i + out_row * count + at, tl.where(keep, keys & 0xFFFFFFFF, -1), mask=at < count)

@triton.jit
def _brute_force_kernel(q_ptr, r_ptr, r_ok_ptr, needed_ptr, scale_ptr, out_dist, out_idx, rows, columns, radius,
                        DIM: tl.constexpr, DP: tl.constexpr, LOG_DP: tl.constexpr, K: tl.constexpr,
                        KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                        SORT_FROM: tl.constexpr, NEEDED: tl.constexpr, SCALED: tl.constexpr):
    """The k nearest valid references of GROUPS blocks of BLOCK_M queries of item b,
    measured as ``_squared_distances_kernel`` measures (the reference's arithmetic) and
    kept as (distance, index) keys like the grid search's; launched without contraction.
    NEEDED: a block none of whose queries needed marks is skipped, and only needed rows
    are stored. SCALED: distances times scale[b], those beyond ``radius`` dropped."""
    b = tl.program_id(1).to(tl.int64)
    for group in range(GROUPS):
        first = (tl.program_id(0) * GROUPS + group) * BLOCK_M
        m = first + tl.arange(0, BLOCK_M)
        go = first < rows
        if NEEDED:
            go = go & (tl.max(tl.load(needed_ptr + b * rows + m, mask=m < rows, other=0).to(tl.int32)) != 0)
        if go:
            _brute_force_rows(q_ptr, r_ptr, r_ok_ptr, needed_ptr, scale_ptr, out_dist, out_idx, rows, columns,
                              radius, b, m, DIM, DP, LOG_DP, K, KP, BLOCK_N, SORT_FROM, NEEDED, SCALED)

@triton.jit
def _brute_force_rows(q_ptr, r_ptr, r_ok_ptr, needed_ptr, scale_ptr, out_dist, out_idx, rows, columns, radius, b,
                      m, DIM: tl.constexpr, DP: tl.constexpr, LOG_DP: tl.constexpr, K: tl.constexpr,
                      KP: tl.constexpr, BLOCK_N: tl.constexpr, SORT_FROM: tl.constexpr, NEEDED: tl.constexpr,
                      SCALED: tl.constexpr):
    """``_brute_force_kernel``'s lists of the queries m of item b."""
    BLOCK_M: tl.constexpr = m.shape[0]
    d = _bit_reversed(LOG_DP)  # (D > PER_COORDINATE_MAX_DIM here: halved)
    q = tl.load(q_ptr + (b * rows + m)[:, None] * DIM + d[None, :], mask=(m[:, None] < rows) & (d[None, :] < DIM),
                other=0.0)
    slots = tl.arange(0, KP)
    best = tl.where(slots[None, :] < K, tl.full((BLOCK_M, KP), KEY_NONE, tl.int64),
                    tl.full((BLOCK_M, KP), -1, tl.int64))
    threshold = tl.max(best, 1)
    for start in range(0, columns, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < columns
        r = tl.load(r_ptr + (b * columns + n)[:, None] * DIM + d[None, :],
                    mask=inside[:, None] & (d[None, :] < DIM), other=0.0)
        diff = q[:, None, :] - r[None, :, :]
        x = diff * diff
        for level in tl.static_range(LOG_DP):  # (d, d + half) side by side: see _bit_reversed
            x = tl.sum(tl.reshape(x, (BLOCK_M, BLOCK_N, DP >> (level + 1), 2)), 3)
        d2 = tl.reshape(x, (BLOCK_M, BLOCK_N))
        ok = inside & (tl.load(r_ok_ptr + b * columns + n, mask=inside, other=0) != 0)
        keys = (tl.sqrt_rn(d2).to(tl.int32, bitcast=True).to(tl.int64) << 32) | n.to(tl.int64)
        keys = tl.where(ok[None, :] & (d2 == d2), keys, KEY_NONE)
        best, threshold = insert_keys(best, threshold, keys, slots, SORT_FROM)
    best = tl.sort(tl.where(best < 0, KEY_NONE, best), 1)
    dist = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    found = best != KEY_NONE
    if SCALED:
        dist = dist * tl.load(scale_ptr + b)
        found = found & (dist <= radius)
    where = (b * rows + m)[:, None] * K + slots[None, :]
    keep = (m[:, None] < rows) & (slots[None, :] < K)
    if NEEDED:
        keep = keep & (tl.load(needed_ptr + b * rows + m, mask=m < rows, other=0) != 0)[:, None]
    tl.store(out_dist + where, tl.where(found, dist, float("inf")), mask=keep)
    tl.store(out_idx + where, tl.where(found, best & 0xFFFFFFFF, -1), mask=keep)

@triton.jit
def _cloud_stats(points_ptr, lengths_ptr, ok_ptr, largest_ptr, sums_ptr, counts_ptr, b, program, rows, dim,
                 share, LENGTHS: tl.constexpr, SUMS: tl.constexpr, BLOCK_R: tl.constexpr, DP: tl.constexpr):
    """Rows [program * share, (program + 1) * share) of item b of points [B, L, D]: valid
    (inside its length, LENGTHS: lengths [B], every coordinate finite) -> ok [B, L] (int8), the largest
    |coordinate| of the valid ones -> largest_ptr and (SUMS) their coordinates' sums
    -> sums_ptr [D], their number -> counts_ptr."""
    d = tl.arange(0, DP)
    if LENGTHS:
        length = tl.load(lengths_ptr + b)
    else:
        length = rows
    largest = tl.full((), 0.0, tl.float32)
    total = tl.zeros((DP,), tl.float32)
    count = tl.full((), 0, tl.int32)
    first = program * share
    for start in range(first, tl.minimum(first + share, rows), BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        inside = r < rows
        x = tl.load(points_ptr + (b * rows + r[:, None]) * dim + d[None, :],
                    mask=inside[:, None] & (d[None, :] < dim), other=0.0).to(tl.float32)
        size = tl.abs(x)
        finite = tl.min(((x == x) & (size < float("inf"))).to(tl.int32), 1) == 1
        ok = inside & (r < length) & finite
        tl.store(ok_ptr + b * rows + r, ok.to(tl.int8), mask=inside)
        largest = tl.maximum(largest, tl.max(tl.where(ok, tl.max(size, 1), 0.0), 0))
        if SUMS:
            total += tl.sum(tl.where(ok[:, None], x, 0.0), 0)
            count += tl.sum(ok.to(tl.int32), 0)
    tl.store(largest_ptr, largest)
    if SUMS:
        tl.store(sums_ptr + d, total, mask=d < dim)
        tl.store(counts_ptr, count)

@triton.jit
def _row_stats_kernel(query_ptr, ref_ptr, q_lengths_ptr, r_lengths_ptr, q_ok_ptr, r_ok_ptr, largest_ptr,
                      sums_ptr, counts_ptr, q_rows, r_rows, dim, q_programs, r_programs, q_share, r_share,
                      Q_LENGTHS: tl.constexpr, R_LENGTHS: tl.constexpr, BLOCK_R: tl.constexpr, DP: tl.constexpr):
    """``_cloud_stats`` of both clouds of item b, the queries' programs first: largest
    [B, q_programs + r_programs], the references' sums [B, r_programs, D] and counts
    [B, r_programs]."""
    b = tl.program_id(1).to(tl.int64)
    program = tl.program_id(0)
    out = largest_ptr + b * (q_programs + r_programs) + program
    if program < q_programs:
        _cloud_stats(query_ptr, q_lengths_ptr, q_ok_ptr, out, sums_ptr, counts_ptr, b, program, q_rows, dim,
                     q_share, Q_LENGTHS, False, BLOCK_R, DP)
    else:
        at = b * r_programs + program - q_programs
        _cloud_stats(ref_ptr, r_lengths_ptr, r_ok_ptr, out, sums_ptr + at * dim, counts_ptr + at, b,
                     program - q_programs, r_rows, dim, r_share, R_LENGTHS, True, BLOCK_R, DP)

@triton.jit
def _frame_constants_kernel(largest_ptr, sums_ptr, counts_ptr, scale_ptr, top_ptr, centre_ptr, unit_ptr,
                            twice_ptr, reach_ptr, r_lo_ptr, programs, r_programs, dim, BLOCK_P: tl.constexpr,
                            DP: tl.constexpr):
    """Item b's constants from ``_row_stats_kernel``'s values: the largest |coordinate|
    of both clouds, its power of two (``scaling.kernel_safe_scale``) -> scale [B] and the
    largest over it -> top [B], the mean valid reference over the scale -> centre [B, D],
    ``half_unit`` of top -> unit [B] and 2 / unit^2 -> twice [B]; reach [B] and r_lo [B] zeroed for the maxima of
    ``_centred_kernel``."""
    b = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, DP)
    top = tl.full((), 0.0, tl.float32)
    for start in range(0, programs, BLOCK_P):
        values = tl.load(largest_ptr + b * programs + start + p, mask=start + p < programs, other=0.0)
        top = tl.maximum(top, tl.max(values, 0))
    total = tl.zeros((DP,), tl.float32)
    count = tl.full((), 0, tl.int32)
    for start in range(0, r_programs, BLOCK_P):
        at = start + p
        inside = at < r_programs
        total += tl.sum(tl.load(sums_ptr + (b * r_programs + at[:, None]) * dim + d[None, :],
                                mask=inside[:, None] & (d[None, :] < dim), other=0.0), 0)
        count += tl.sum(tl.load(counts_ptr + b * r_programs + at, mask=inside, other=0), 0)
    scale = kernel_safe_scale(top)
    largest = tl.math.div_rn(top, scale)
    centre = tl.math.div_rn(tl.math.div_rn(total, scale), tl.maximum(count, 1).to(tl.float32))
    # largest = m 2^e (1/2 <= m < 1): 2^(14 - e) = 2^13 / 2^(e - 1); 2^14 for 0, as frexp
    power = kernel_power_below(tl.where(largest > 0, largest, 1.0))
    unit = tl.where(largest > 0, tl.math.div_rn(8192.0, power), 16384.0)
    tl.store(scale_ptr + b, scale)
    tl.store(top_ptr + b, largest)
    tl.store(centre_ptr + b * dim + d, centre, mask=d < dim)
    tl.store(unit_ptr + b, unit)
    tl.store(twice_ptr + b, tl.math.div_rn(2.0, unit * unit))  # (powers of two: exact)
    tl.store(reach_ptr + b, 0.0)
    tl.store(r_lo_ptr + b, 0.0)

@triton.jit
def _centred_rows(points_ptr, ok_ptr, scale, centre, unit, scaled_ptr, centred_ptr, half_ptr, residuals_ptr,
                  norms_ptr, reach_ptr, r_lo_ptr, b, program, rows, dim, share, REF: tl.constexpr,
                  HALVES: tl.constexpr, BLOCK_R: tl.constexpr, DP: tl.constexpr):
    """Rows [program * share, (program + 1) * share) of item b of points [B, L, D] ->
    scaled = points / scale (exact: a power of two), centred = scaled - centre (0 on
    invalid rows); with HALVES, ``half_operands``: centred times unit in float16 and the
    norm of what that left out (queries: [B, L]; REF: its largest -> r_lo [B], an atomic
    maximum); |centred|^2 [B, L] (REF: +inf on invalid rows, the square root of the
    largest valid one -> reach [B], an atomic maximum)."""
    d = tl.arange(0, DP)
    reach = tl.full((), 0.0, tl.float32)
    left_most = tl.full((), 0.0, tl.float32)
    first = program * share
    for start in range(first, tl.minimum(first + share, rows), BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        inside = r < rows
        where = (b * rows + r[:, None]) * dim + d[None, :]
        mask = inside[:, None] & (d[None, :] < dim)
        x = tl.load(points_ptr + where, mask=mask, other=0.0).to(tl.float32)
        scaled = tl.math.div_rn(x, scale)
        ok = tl.load(ok_ptr + b * rows + r, mask=inside, other=0) != 0
        centred = tl.where(ok[:, None], scaled - centre[None, :], 0.0)
        tl.store(scaled_ptr + where, scaled, mask=mask)
        tl.store(centred_ptr + where, centred, mask=mask)
        if HALVES:
            half = (centred * unit).to(tl.float16)
            tl.store(half_ptr + where, half, mask=mask)
            left = centred - tl.math.div_rn(half.to(tl.float32), unit)  # (both exact)
            residual = tl.sqrt(tl.sum(left * left, 1))
            if REF:
                left_most = tl.maximum(left_most, tl.max(tl.where(inside, residual, 0.0), 0))
            else:
                tl.store(residuals_ptr + b * rows + r, residual, mask=inside)
        norms = tl.sum(centred * centred, 1)
        if REF:
            tl.store(norms_ptr + b * rows + r, tl.where(ok, norms, float("inf")), mask=inside)
            reach = tl.maximum(reach, tl.max(tl.where(ok, norms, 0.0), 0))
        else:
            tl.store(norms_ptr + b * rows + r, norms, mask=inside)
    if REF:  # (sqrt_rn is monotonic: the root of the largest is the largest root)
        tl.atomic_max(reach_ptr + b, tl.sqrt_rn(reach))
        if HALVES:
            tl.atomic_max(r_lo_ptr + b, left_most)

@triton.jit
def _centred_kernel(query_ptr, ref_ptr, q_ok_ptr, r_ok_ptr, scale_ptr, centre_ptr, unit_ptr, q_ptr, r_ptr,
                    qc_ptr, rc_ptr, qh_ptr, rh_ptr, q_lo_ptr, q_norms_ptr, r_norms_ptr, reach_ptr, r_lo_ptr,
                    q_rows, r_rows, dim, q_programs, q_share, r_share, HALVES: tl.constexpr,
                    BLOCK_R: tl.constexpr, DP: tl.constexpr):
    """``_centred_rows`` of both clouds of item b (the queries' programs first) in the
    constants of ``_frame_constants_kernel``."""
    b = tl.program_id(1).to(tl.int64)
    program = tl.program_id(0)
    d = tl.arange(0, DP)
    scale, unit = tl.load(scale_ptr + b), tl.load(unit_ptr + b)
    centre = tl.load(centre_ptr + b * dim + d, mask=d < dim, other=0.0)
    if program < q_programs:
        _centred_rows(query_ptr, q_ok_ptr, scale, centre, unit, q_ptr, qc_ptr, qh_ptr, q_lo_ptr, q_norms_ptr,
                      reach_ptr, r_lo_ptr, b, program, q_rows, dim, q_share, False, HALVES, BLOCK_R, DP)
    else:
        _centred_rows(ref_ptr, r_ok_ptr, scale, centre, unit, r_ptr, rc_ptr, rh_ptr, q_lo_ptr, r_norms_ptr,
                      reach_ptr, r_lo_ptr, b, program - q_programs, r_rows, dim, r_share, True, HALVES, BLOCK_R,
                      DP)

@triton.jit
def _smallest_kernel(values_ptr, needed_ptr, out_values_ptr, out_index_ptr, rows, width, count,
                     ROWS: tl.constexpr, WIDTH: tl.constexpr, NEEDED: tl.constexpr):
    """``smallest`` of ROWS rows. NEEDED: a program none of whose rows needed marks stores
    +inf at positions 0, 1, ..."""
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    c = tl.arange(0, WIDTH)
    inside = (r[:, None] < rows) & (c[None, :] < width)
    if NEEDED:
        if tl.max(tl.load(needed_ptr + r, mask=r < rows, other=0).to(tl.int32)) == 0:
            keep = (r[:, None] < rows) & (c[None, :] < count)
            tl.store(out_values_ptr + r[:, None] * count + c[None, :],
                     tl.full((ROWS, WIDTH), float("inf"), tl.float32), mask=keep)
            tl.store(out_index_ptr + r[:, None] * count + c[None, :], tl.zeros((ROWS, WIDTH), tl.int64) + c[None, :],
                     mask=keep)
            return
    x = tl.load(values_ptr + r[:, None] * width + c[None, :], mask=inside, other=float("inf"))
    keys = tl.sort(_ordered_keys(x, c[None, :]), dim=1)
    keep = (r[:, None] < rows) & (c[None, :] < count)
    tl.store(out_values_ptr + r[:, None] * count + c[None, :], _key_values(keys), mask=keep)
    tl.store(out_index_ptr + r[:, None] * count + c[None, :], keys & 0xFFFFFFFF, mask=keep)


@triton.jit
def _keys_out(keys, out_values_ptr, out_index_ptr, row, count):
    """The first ``count`` of the sorted ``_ordered_keys`` keys -> values and positions of row."""
    slots = tl.arange(0, keys.shape[0])
    tl.store(out_values_ptr + row * count + slots, _key_values(keys), mask=slots < count)
    tl.store(out_index_ptr + row * count + slots, keys & 0xFFFFFFFF, mask=slots < count)

@triton.jit
def _wide_smallest_kernel(values_ptr, needed_ptr, scratch_ptr, out_values_ptr, out_index_ptr, width, count,
                          GROUPS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, KEYS: tl.constexpr,
                          NEEDED: tl.constexpr):
    """``smallest`` of a wide row a program (count <= GROUPS, KEYS >= count a power of two).
    The positions fall in GROUPS classes by their remainder; the count-th least of the
    classes' minima is at least the row's count-th least value (count distinct values lie
    at or below it), so only the values at or below it can be chosen: gathered into
    scratch (CAP a row; a few times count on most rows) and sorted there, or, past CAP
    (many ties), each block of the row sorted and merged. NEEDED: a row not needed stores
    +inf at positions 0, 1, ..."""
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, KEYS)
    if NEEDED:
        if tl.load(needed_ptr + row) == 0:
            tl.store(out_values_ptr + row * count + slots, tl.full((KEYS,), float("inf"), tl.float32),
                     mask=slots < count)
            tl.store(out_index_ptr + row * count + slots, slots.to(tl.int64), mask=slots < count)
            return
    base = values_ptr + row * width
    lanes = tl.arange(0, BLOCK)
    least = tl.full((BLOCK,), float("inf"), tl.float32)
    for start in range(0, width, BLOCK):
        least = tl.minimum(least, tl.load(base + start + lanes, mask=start + lanes < width, other=float("inf")))
    classes = tl.sort(tl.min(tl.reshape(least, (BLOCK // GROUPS, GROUPS)), 0))
    threshold = tl.max(tl.where(tl.arange(0, GROUPS) < count, classes, -float("inf")))
    scratch = scratch_ptr + row * CAP
    taken = 0
    for start in range(0, width, BLOCK):
        x = tl.load(base + start + lanes, mask=start + lanes < width, other=float("inf"))
        keep = (x <= threshold) & (start + lanes < width)
        kept = tl.sum(keep.to(tl.int32))
        if kept > 0:
            at = taken + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(scratch + at, _ordered_keys(x, start + lanes), mask=keep & (at < CAP))
            taken += kept
    if taken <= CAP:
        tl.debug_barrier()  # (the gathered keys, stored by other threads)
        at = tl.arange(0, CAP)
        _keys_out(tl.sort(tl.load(scratch + at, mask=at < taken, other=KEY_NONE)), out_values_ptr,
                  out_index_ptr, row, count)
    else:
        best = tl.full((KEYS,), KEY_NONE, tl.int64)
        for start in range(0, width, BLOCK):
            x = tl.load(base + start + lanes, mask=start + lanes < width, other=float("inf"))
            keys = tl.sort(tl.where((x <= threshold) & (start + lanes < width), _ordered_keys(x, start + lanes),
                                    KEY_NONE))
            head = tl.min(tl.reshape(tl.where(lanes < KEYS, keys, KEY_NONE), (BLOCK // KEYS, KEYS)), 0)
            best = tl.sort(tl.minimum(best, tl.flip(head, 0)))
        _keys_out(best, out_values_ptr, out_index_ptr, row, count)


def _wide_smallest(values: torch.Tensor, count: int, needed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``smallest`` of rows wider than SORT_MAX by ``_wide_smallest_kernel`` (count <= WIDE_GROUPS)."""
    width = values.shape[-1]
    rows = values.numel() // width
    out_values = torch.empty((*values.shape[:-1], count), dtype=torch.float32, device=values.device)
    out_index = torch.empty((*values.shape[:-1], count), dtype=torch.int64, device=values.device)
    if rows and count:
        scratch = torch.empty((rows, WIDE_CAP), dtype=torch.int64, device=values.device)
        _wide_smallest_kernel[(rows,)](
            values.contiguous(), needed.contiguous() if needed is not None else values, scratch, out_values, out_index,
            width, count, GROUPS=WIDE_GROUPS, BLOCK=WIDE_BLOCK, CAP=WIDE_CAP,
            KEYS=max(16, triton.next_power_of_2(count)), NEEDED=needed is not None, num_warps=WIDE_WARPS)
    return out_values, out_index


def smallest(values: torch.Tensor, count: int, in_registers: bool | None = None,
             needed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., W] float32 (no NaN) -> the ``count`` least per row, ascending, and their
    positions (int64), ties to the smaller position: ``torch.topk(largest=False)`` with a
    defined tie order. ``in_registers`` (default: on GPUs up to SORT_MAX columns) sorts in
    Triton; otherwise on GPUs ``_wide_smallest`` (up to WIDE_GROUPS least) or ``torch.topk``,
    on CPUs a stable sort (Triton is interpreted there and its sort takes seconds).
    ``needed`` (bool, the rows' shape): the rows it leaves out may come back unsorted (+inf
    at positions 0, 1, ... where a Triton kernel skips them)."""
    width = values.shape[-1]
    if in_registers is None:
        in_registers = values.is_cuda and width <= SORT_MAX
    if not in_registers:
        if values.is_cuda and count <= WIDE_GROUPS:
            return _wide_smallest(values, count, needed)
        if values.is_cuda:
            return torch.topk(values, count, dim=-1, largest=False, sorted=True)
        found, position = torch.sort(values, dim=-1, stable=True)
        return found[..., :count], position[..., :count]
    rows = values.numel() // max(width, 1)
    out_values = torch.empty((*values.shape[:-1], count), dtype=torch.float32, device=values.device)
    out_index = torch.empty((*values.shape[:-1], count), dtype=torch.int64, device=values.device)
    if rows and count:
        padded = triton.next_power_of_2(width)
        per_program = max(1, SORT_KEYS // padded)
        _smallest_kernel[(triton.cdiv(rows, per_program),)](
            values.contiguous(), needed if needed is not None else values, out_values, out_index, rows, width, count,
            ROWS=per_program, WIDTH=padded, NEEDED=needed is not None, num_warps=4)
    return out_values, out_index


def _factors(precision: str, twice: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The kernels' per-item factor of the products [B] (only "fp16" reads it)."""
    if precision == "fp16" and (twice is None or twice.dtype != torch.float32):
        raise ValueError(f"fp16 products need twice: float32 [B] 2 / unit^2 per item, got {twice!r}")
    return like if twice is None else twice.contiguous()


def chunk_minima(q: torch.Tensor, r: torch.Tensor, r_norms: torch.Tensor, chunk: int, precision: str,
                 needed: torch.Tensor | None = None, twice: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, M, D], r [B, N, D] (float32, contiguous; float16 for "fp16"), r_norms [B, N]
    (|r|^2, +inf where invalid) -> [B, M, ceil(N / chunk)]: per chunk, the least
    ``r_norms - 2 q.r`` ("fp16": ``r_norms - twice[b] q.r``, ``half_operands`` with
    twice = 2 / unit^2). With ``needed`` [B, M] (bool) only tiles of queries holding a needed
    one are multiplied: the others' minima are unspecified (not written: storing +inf there
    cost ~3 ms at 10^4 x 10^6)."""
    q, r, r_norms, twice = q.contiguous(), r.contiguous(), r_norms.contiguous(), _factors(precision, twice, r_norms)
    batch, rows, dim = q.shape
    columns = r.shape[1]
    chunks = triton.cdiv(columns, chunk)
    out = torch.empty((batch, rows, chunks), dtype=torch.float32, device=q.device)
    held = triton.next_power_of_2(max(dim, 16))
    if out.numel() and held <= MINIMA_HELD_MAX_DIM[precision]:
        block_m, block_n, warps, stages = (MINIMA_HELD_HALF_TILES if precision == "fp16" else {}).get(
            held, MINIMA_HELD_TILES[held])
        block_n = max(block_n, chunk)
        processors = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        row_blocks = triton.cdiv(rows, block_m)
        parts = max(1, min(triton.cdiv(MINIMA_HELD_PROGRAMS_PER_SM * processors, batch * row_blocks),
                           triton.cdiv(columns, block_n)))
        share = triton.cdiv(triton.cdiv(columns, parts), block_n) * block_n
        _held_minima_kernel[(row_blocks, triton.cdiv(columns, share), batch)](
            q, r, r_norms, twice, needed if needed is not None else r_norms, out, rows, columns, dim, chunks, share,
            CHUNK=chunk, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, DP=held, NEEDED=needed is not None,
            num_warps=warps, num_stages=stages)
    elif out.numel():
        block_m, block_n, block_k, warps, stages = MINIMA_TILES.get(precision, MINIMA_OTHER_TILES)
        block_n = max(block_n, chunk)
        row_blocks, column_blocks = triton.cdiv(rows, block_m), triton.cdiv(columns, block_n)
        _chunk_minima_kernel[(row_blocks * column_blocks, batch)](
            q, r, r_norms, twice, needed if needed is not None else r_norms, out, rows, columns, dim, chunks,
            row_blocks,
            CHUNK=chunk, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, held),
            NEEDED=needed is not None, num_warps=warps, num_stages=stages)
    return out


def member_distances(q: torch.Tensor, r: torch.Tensor, r_norms: torch.Tensor, chosen: torch.Tensor,
                     chunk: int, needed: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, M, D], r [B, N, D] (float32, contiguous), chosen [B, M, C] chunk numbers ->
    [B, M, C * chunk]: squared distances to every reference of the chosen chunks (member
    ``c * chunk + s`` is reference ``chosen[c] * chunk + s``; +inf past N or where r_norms is,
    and on the rows ``needed`` [B, M] (bool, when given) leaves out)."""
    q, r, r_norms = q.contiguous(), r.contiguous(), r_norms.contiguous()
    batch, rows, dim = q.shape
    n_chosen = chosen.shape[-1]
    out = torch.empty((batch, rows, n_chosen * chunk), dtype=torch.float32, device=q.device)
    if out.numel():
        grid = (rows, triton.cdiv(n_chosen * chunk, BLOCK_MEMBERS), batch)
        _member_distances_kernel[grid](q, r, r_norms, chosen.contiguous(), needed if needed is not None else r_norms,
                                       out, rows, r.shape[1], dim, n_chosen, CHUNK=chunk, BLOCK=BLOCK_MEMBERS,
                                       BLOCK_K=32, NEEDED=needed is not None, num_warps=4)
    return out


def _ordered_floats(ordered: torch.Tensor) -> torch.Tensor:
    """int32 ``_ordered_bits`` back to the float32 values."""
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).view(torch.float32)


def _shares(batch: int, rows: int, columns: int, block_n: int, device: torch.device) -> int:
    """Shares of the references: enough programs to fill the device, each share at least
    8 tiles (Triton's interpreter: one multiprocessor). (Rounded down, one share at 8 x 4096^2
    D=64: 369 us of candidates against 322 and a merge of 18, H100.)"""
    processors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    programs = batch * triton.cdiv(rows, FUSED_BLOCK_M)
    return max(1, min(triton.cdiv(FUSED_PROGRAMS_PER_SM * processors, programs), triton.cdiv(columns, 8 * block_n)))



def least_chunk_keys(q: torch.Tensor, q_norms: torch.Tensor, r: torch.Tensor, r_norms: torch.Tensor, count: int,
                     precision: str, twice: torch.Tensor | None = None, needed: torch.Tensor | None = None,
                     floor: bool = False) -> tuple[torch.Tensor, int]:
    """The fused path of ``least_chunks`` (chunks of FUSED_CHUNK, ``count`` <= FUSED_MAX_KEYS)
    before decoding: the ``_short_keys`` [B, M, count] (int32, ascending) and their position
    bits (the chunk: key & (2^bits - 1); the sum, rounded down: the rest). ``needed`` [B, M]
    (bool): only tiles of queries holding a needed one are multiplied (the others' keys are
    unspecified). ``floor``: the last key need only be at or below every chunk the others
    leave out (not itself a chunk's: the caller measures count - 1 chunks, the last bounds
    the rest), so each tile of references offers only half the list (FUSED_TILE_HALF), the
    greatest it offers lowering the last key."""
    q, q_norms, r, r_norms = q.contiguous(), q_norms.contiguous(), r.contiguous(), r_norms.contiguous()
    twice = _factors(precision, twice, r_norms)
    batch, rows, dim = q.shape
    columns = r.shape[1]
    keys = _list_width(count)
    block_n = max(FUSED_BLOCK_N, keys * FUSED_CHUNK)
    parts = _shares(batch, rows, columns, block_n, q.device)
    share = triton.cdiv(triton.cdiv(columns, parts), block_n) * block_n
    parts = triton.cdiv(columns, share)
    out = torch.empty((batch, rows, count), dtype=torch.int32, device=q.device)
    # (one share: its lists are the keys, no merge)
    lists = out if parts == 1 else torch.empty((batch, rows, parts, keys), dtype=torch.int32, device=q.device)
    halved = floor and FUSED_TILE_HALF and keys > 1
    floors = torch.empty((batch, rows, parts) if halved and parts > 1 else (1,), dtype=torch.int32, device=q.device)
    chunks = triton.cdiv(columns, FUSED_CHUNK)
    position_bits = max(1, (chunks - 1).bit_length())
    if out.numel():
        grid = (triton.cdiv(rows, FUSED_BLOCK_M), parts, batch)
        block_k = 16 if dim <= 16 else 32
        _chunk_candidates_kernel[grid](
            q, q_norms, r, r_norms, twice, needed.contiguous() if needed is not None else r_norms, lists, floors,
            rows, columns, dim, chunks, share, parts, lists.shape[-1], CHUNK=FUSED_CHUNK, PRECISION=precision,
            KEYS=keys, NEEDED=needed is not None, LOG_KEYS=keys.bit_length() - 1,
            LOG_KEEP=keys.bit_length() - 1 - halved,
            LOG_NEW=(block_n // FUSED_CHUNK).bit_length() - 1, POSITION_BITS=position_bits, BLOCK_M=FUSED_BLOCK_M,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=FUSED_NUM_WARPS)
        if parts == 1:
            return out, position_bits
        merge_rows = max(1, SORT_KEYS // keys)
        _merge_parts_kernel[(triton.cdiv(batch * rows, merge_rows),)](
            lists, floors, out, batch * rows, parts, count, KEYS=keys, LOG_KEYS=keys.bit_length() - 1, FLOORS=halved,
            BLOCK_M=merge_rows, num_warps=4)
    return out, position_bits


def least_chunks(q: torch.Tensor, q_norms: torch.Tensor, r: torch.Tensor, r_norms: torch.Tensor, count: int,
                 chunk: int, precision: str, needed: torch.Tensor | None = None,
                 twice: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, M, D], q_norms [B, M] (|q|^2), r [B, N, D] (float32; float16 for "fp16",
    ``chunk_minima``), r_norms [B, N] (|r|^2, +inf where invalid) -> per query the ``count``
    chunks of ``chunk`` references (``chunk_size``) with the least ``r_norms - 2 q.r``
    (``chunk_minima``'s ``twice``) over their members, ascending, ties
    to the smaller chunk (among equal sums below): the minima plus q_norms, each sum rounded
    to float32 [B, M, count], and the chunks [B, M, count] (int64). ``count`` is at most the
    number of chunks. On the fused path (``least_chunk_keys``) the sums (and the order) are
    rounded down to 32 - log2(chunks) bits, at least 20 (relative 2^-11): lower bounds, which
    is all the certificate in ``backend.py`` needs of them. ``needed`` [B, M] (bool): the other
    rows' lists are unspecified (only tiles of queries holding a needed one are multiplied)."""
    if count > FUSED_MAX_KEYS or chunk != FUSED_CHUNK:
        values, chosen = smallest(chunk_minima(q, r, r_norms, chunk, precision, needed, twice), count, needed=needed)
        return values + q_norms[..., None], chosen
    out, position_bits = least_chunk_keys(q, q_norms, r, r_norms, count, precision, twice, needed)
    return _ordered_floats(out & -(1 << position_bits)), (out & ((1 << position_bits) - 1)).to(torch.int64)


def measures(q: torch.Tensor) -> bool:
    """Whether ``squared_distances`` takes points like q: float32 with D in (4, MEASURE_MAX_DIM]
    (at most 4 coordinates the reference sums one at a time)."""
    return triton is not None and q.dtype == torch.float32 and PER_COORDINATE_MAX_DIM < q.shape[-1] <= MEASURE_MAX_DIM


# Brute force (every pair measured as the reference measures it): the widest points it takes,
# the k it keeps in registers, and its tiles (queries, and references per DP / 64).
BRUTE_FORCE_MAX_DIM, BRUTE_FORCE_MAX_K = 256, 64
BRUTE_FORCE_BLOCK_M, BRUTE_FORCE_TILE, BRUTE_FORCE_WARPS = 4, 8192, 4
# Blocks of queries a program walks where only ``needed`` rows are searched (the redo of a capture:
# nearly always none).
BRUTE_FORCE_REDO_GROUPS = 8


def brute_force_takes(dim: int, k: int) -> bool:
    """Whether ``brute_force`` takes points of D = dim and lists of k."""
    return PER_COORDINATE_MAX_DIM < dim <= BRUTE_FORCE_MAX_DIM and k <= BRUTE_FORCE_MAX_K


def brute_force(q: torch.Tensor, r: torch.Tensor, ref_ok: torch.Tensor, k: int, sort_from: int,
                needed: torch.Tensor | None = None, scale: torch.Tensor | None = None, radius: float = math.inf,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, M, D], r [B, N, D] (float32, D in (4, BRUTE_FORCE_MAX_DIM]), ref_ok [B, N] bool,
    k <= BRUTE_FORCE_MAX_K -> each query's k nearest valid references: distances [B, M, k]
    (float32, the reference's bits, times ``scale`` [B, 1] where given, none beyond
    ``radius``; +inf past the valid ones) and positions (-1 there), ascending, ties to the
    smaller position; into ``out`` (contiguous [B, M, k] float32 and int64) where given. One
    kernel, no host read; a tile enters the lists by sorting where some query wants
    ``sort_from`` of its candidates (the grid search's ``SEARCH_SORT_FROM``). ``needed``
    [B, M] (bool): only its rows are searched and written (the others: +inf / -1 in fresh
    lists, untouched in ``out``)."""
    batch, rows, dim = q.shape
    columns = r.shape[1]
    if out is None:
        dists = torch.empty((batch, rows, k), dtype=torch.float32, device=q.device)
        idx = torch.empty((batch, rows, k), dtype=torch.int64, device=q.device)
        if needed is not None:  # (rows not searched: empty lists)
            dists.fill_(math.inf), idx.fill_(-1)
    else:
        dists, idx = out
    if dists.numel():
        padded = triton.next_power_of_2(dim)
        block_n = max(1, min(64, BRUTE_FORCE_TILE // (BRUTE_FORCE_BLOCK_M * padded)))
        groups = 1 if needed is None else BRUTE_FORCE_REDO_GROUPS
        _brute_force_kernel[(triton.cdiv(rows, BRUTE_FORCE_BLOCK_M * groups), batch)](
            q.contiguous(), r.contiguous(), ref_ok.contiguous().view(torch.uint8),
            needed if needed is not None else ref_ok,
            scale.contiguous() if scale is not None else q, dists, idx, rows, columns, radius, DIM=dim, DP=padded,
            LOG_DP=padded.bit_length() - 1, K=k, KP=triton.next_power_of_2(k), BLOCK_M=BRUTE_FORCE_BLOCK_M,
            BLOCK_N=block_n, GROUPS=groups, SORT_FROM=sort_from, NEEDED=needed is not None, SCALED=scale is not None,
            num_warps=BRUTE_FORCE_WARPS, enable_fp_fusion=False)
    return dists, idx


def squared_distances(q: torch.Tensor, r: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """q [B, m, D], r [B, N, D] (float32; ``measures``), candidates [B, m, c] (rows of r,
    >= 0) -> [B, m, c]: the reference's squared distances (``pairs.squared_difference``) bit
    for bit, in one pass instead of a gather, the squares [B, m, c, D] and their sum."""
    batch, rows, take = candidates.shape
    dim = q.shape[-1]
    out = torch.empty((batch, rows, take), dtype=q.dtype, device=q.device)
    if out.numel():
        refs = candidates + (torch.arange(batch, device=q.device) * r.shape[1])[:, None, None]
        padded = triton.next_power_of_2(dim)
        block_c = max(1, min(32, triton.next_power_of_2(take), MEASURE_BLOCK // padded))
        _squared_distances_kernel[(batch * rows, triton.cdiv(take, block_c))](
            q.contiguous(), r.contiguous(), refs.contiguous(), out, take, dim, BLOCK_C=block_c, DP=padded,
            LOG_DP=padded.bit_length() - 1, num_warps=4, enable_fp_fusion=False)
    return out


# ``nearest_members``: the most members a query (in registers: measured, sorted), the longest lists
# it re-measures, and the warps of a query's program.
MEMBERS_MAX, MEMBERS_TAKE_MAX, MEMBERS_WARPS = 256, 64, 1
# The re-measure by four threads a member (``_quad_squares``: each 16 bytes of its row at a time, a
# member's four reading 64 contiguous bytes; the halvings in registers but two across the four)
# instead of tiles of members by coordinates (halved across threads: shuffles and layout changes
# through shared memory). A member a thread (16-byte loads from 32 rows at once) was as fast as the
# tiles.
MEMBERS_BY_QUAD, MEMBERS_BY_QUAD_MAX_DIM = True, 128
# (A member a thread took 164 registers at D = 64, four 66. Capped at 96 registers, a member a
# thread was barely faster).


def ranks_members(members: int, take: int, dim: int) -> bool:
    """Whether ``nearest_members`` takes ``members`` members a query, ``take`` re-measured, of
    D = dim (float32 points; the caller checks)."""
    return triton is not None and members <= MEMBERS_MAX and take <= MEMBERS_TAKE_MAX and dim <= MEASURE_MAX_DIM


def _members_settings(members: int, take: int, dim: int) -> dict:
    """``_measured_members``' settings for ``members`` members a query, ``take`` re-measured,
    of D = dim."""
    width = triton.next_power_of_2(max(members, 2))
    selected = min(triton.next_power_of_2(max(take, 2)), width)
    padded = triton.next_power_of_2(dim)
    tile = 1024 * MEMBERS_WARPS  # values a program holds at once: 32 a thread
    by_quad = MEMBERS_BY_QUAD and PER_COORDINATE_MAX_DIM < dim <= MEMBERS_BY_QUAD_MAX_DIM
    block_c = min(selected, max(8, 2 * tile // padded) if by_quad else max(1, tile // padded))
    return dict(DIM=dim, LOG_DP=padded.bit_length() - 1, WP=width, SEL=selected,
                BLOCK_K=max(1, min(32, tile // width)), BLOCK_C=block_c, BY_QUAD=by_quad,
                num_warps=MEMBERS_WARPS, enable_fp_fusion=False)


def nearest_members(q: torch.Tensor, r: torch.Tensor, ref_ok: torch.Tensor, chosen: torch.Tensor, chunk: int,
                    take: int, count: int, needed: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, M, D], r [B, N, D] (float32), ref_ok [B, N] bool, chosen [B, M, C] chunk numbers
    (-1: none; ``chunk`` 1: references) -> the ``count`` nearest valid members of each query's
    chunks: distances [B, M, count] in the reference's arithmetic (+inf where none), positions
    (-1 there), ascending, ties to the smaller position; and last [B, M]: the take-th least
    squared distance by the first measure (summed differences, within (D + 2) u of the
    truth, relatively), at or below the first measure of every member not re-measured (+inf
    where every member was). Only the ``take`` least by the first measure are re-measured,
    in one kernel a query (``ranks_members``). Rows ``needed`` marks not (when given) are
    left unwritten."""
    batch, rows, dim = q.shape
    n_chosen = chosen.shape[-1]
    # (padded: lists longer than the members measured keep their tails)
    dists = torch.full((batch, rows, count), math.inf, dtype=torch.float32, device=q.device)
    idx = torch.full((batch, rows, count), -1, dtype=torch.int64, device=q.device)
    last = torch.empty((batch, rows), dtype=torch.float32, device=q.device)
    if dists.numel():
        _nearest_members_kernel[(batch * rows,)](
            q.contiguous(), r.contiguous(), ref_ok.contiguous().view(torch.uint8), chosen.contiguous(),
            needed if needed is not None else ref_ok, dists, idx, last, rows, r.shape[1], n_chosen, take, count,
            CHUNK=chunk, NEEDED=needed is not None, **_members_settings(n_chosen * chunk, take, dim))
    return dists, idx, last


# Rows a program of the second pass holds (``certified_lists(again=True)``): where none is unproven, an
# empty second pass costs ~1 us (NOTES.md).
CERTIFIED_AGAIN_ROWS = 8


def certified_lists(q: torch.Tensor, r: torch.Tensor, ref_ok: torch.Tensor, query_ok: torch.Tensor,
                    keys: torch.Tensor, position_bits: int, n_chosen: int, take: int, q_norms: torch.Tensor,
                    reach: torch.Tensor, scale: torch.Tensor, error: float | tuple[torch.Tensor, torch.Tensor],
                    radius: float, dists: torch.Tensor, idx: torch.Tensor, unproven: torch.Tensor,
                    first_row: int = 0, again: bool = False) -> None:
    """The fused lists finished in one kernel a query: q [B, m, D] (a block of queries, rows
    ``first_row`` on), r [B, N, D] (float32, the frames' scaled clouds), ref_ok [B, N],
    query_ok [B, M] bool, the block's ``least_chunk_keys`` [B, m, n_keys] of chunks of
    FUSED_CHUNK and their ``position_bits``, of which the first ``n_chosen`` are measured
    (``nearest_members``, ``take`` re-measured), q_norms [B, m] (|qc|^2 of the centred
    queries), the references' reach [B, 1] and ``scale`` [B, 1], the products' ``error``
    (``product_error``; for float16 operands the norms they left out, q_lo [B, m] and r_lo
    [B, 1]) -> into dists / idx [B, M, k] (float32, int64; columns past the members keep what
    they held) the k nearest, times the scale, within ``radius``, and into unproven [B, M]
    (bool) the valid queries the certificate of ``backend.py`` leaves unproven (``again``: only
    the rows unproven already are done). No host read; nothing but these outputs is written."""
    batch, rows, dim = q.shape
    n_keys, count = keys.shape[-1], dists.shape[-1]
    if batch * rows == 0:
        return
    half = not isinstance(error, float)
    q_lo, r_lo = (t.contiguous() for t in error) if half else (q_norms, q_norms)
    per_program = CERTIFIED_AGAIN_ROWS if again else 1
    _certified_lists_kernel[(triton.cdiv(batch * rows, per_program),)](
        q.contiguous(), r.contiguous(), ref_ok.contiguous().view(torch.uint8), query_ok.contiguous().view(torch.uint8),
        keys.contiguous(), q_norms.contiguous(), reach.contiguous(), scale.contiguous(), q_lo, r_lo, dists, idx,
        unproven.view(torch.int8), rows, first_row, dists.shape[1], r.shape[1], n_chosen, n_keys, take, count,
        0.0 if half else error, radius, batch * rows, CHUNK=FUSED_CHUNK, POSITION_BITS=position_bits,
        ROWS=per_program, HALF=half, NEEDED=again,
        **_members_settings(n_chosen * FUSED_CHUNK, take, dim))


def _frame_shares(rows: int, block: int, batch: int) -> tuple[int, int]:
    """Programs a cloud's item takes in ``frames`` (at most FRAMES_PROGRAMS over the batch) and
    the rows each walks, a multiple of ``block``."""
    blocks = max(1, triton.cdiv(rows, block))
    programs = min(blocks, max(1, triton.cdiv(FRAMES_PROGRAMS, batch)))
    return programs, triton.cdiv(blocks, programs) * block


def frames(query: torch.Tensor, ref: torch.Tensor, query_lengths: torch.Tensor | None,
           ref_lengths: torch.Tensor | None, halves: bool = False) -> dict:
    """The dense backend's frames (``frames.Frames``) in three kernels instead of torch's two
    dozen: query [B, M, D], ref [B, N, D] (float32, float16 or bfloat16, D <= FRAMES_MAX_DIM),
    lengths [B] int64 (or None: every row) -> valid rows (``query_ok``, ``ref_ok``), the item's power-of-two
    ``scale`` [B, 1], both clouds divided by it (``q``, ``r``, float32), centred on the mean
    valid reference and zero on invalid rows (``qc``, ``rc``), the squared norms of the
    centred rows ``q_norms`` [B, M] and ``r_norms`` [B, N] (+inf where invalid), the
    references' ``reach`` [B, 1] (the largest valid norm) and ``largest`` [B], the largest
    |coordinate| of both clouds over the scale. With ``halves``, ``half_operands`` of both
    centred clouds too: ``unit`` [B], ``qh``, ``rh`` (float16), the norms of what they left
    out, per query ``q_lo`` [B, M] and the largest per item ``r_lo`` [B, 1], and the
    products' factor ``twice`` [B] (2 / unit^2)."""
    (batch, rows, dim), columns = query.shape, ref.shape[1]
    query, ref = query.contiguous(), ref.contiguous()
    padded = triton.next_power_of_2(dim)
    block = max(1, FRAMES_BLOCK // padded)
    (q_programs, q_share), (r_programs, r_share) = (_frame_shares(n, block, batch) for n in (rows, columns))
    floats = dict(dtype=torch.float32, device=query.device)
    query_ok = torch.empty((batch, rows), dtype=torch.int8, device=query.device)
    ref_ok = torch.empty((batch, columns), dtype=torch.int8, device=query.device)
    largest = torch.empty((batch, q_programs + r_programs), **floats)
    sums = torch.empty((batch, r_programs, dim), **floats)
    counts = torch.empty((batch, r_programs), dtype=torch.int32, device=query.device)
    scale, top, unit, twice, reach, r_lo = (torch.empty(batch, **floats) for _ in range(6))
    centre = torch.empty((batch, dim), **floats)
    q, qc, r, rc = (torch.empty(points.shape, **floats) for points in (query, query, ref, ref))
    qh, rh = (torch.empty(points.shape if halves else (1,), dtype=torch.float16, device=query.device)
              for points in (query, ref))
    q_lo = torch.empty((batch, rows) if halves else (1,), **floats)
    q_norms, r_norms = torch.empty((batch, rows), **floats), torch.empty((batch, columns), **floats)
    if batch:
        _row_stats_kernel[(q_programs + r_programs, batch)](
            query, ref, query if query_lengths is None else query_lengths.contiguous(),
            ref if ref_lengths is None else ref_lengths.contiguous(), query_ok, ref_ok, largest, sums, counts, rows,
            columns, dim, q_programs, r_programs, q_share, r_share, Q_LENGTHS=query_lengths is not None,
            R_LENGTHS=ref_lengths is not None, BLOCK_R=block, DP=padded, num_warps=4)
        _frame_constants_kernel[(batch,)](largest, sums, counts, scale, top, centre, unit, twice, reach, r_lo,
                                          q_programs + r_programs, r_programs, dim, BLOCK_P=block, DP=padded,
                                          num_warps=4)
        _centred_kernel[(q_programs + r_programs, batch)](
            query, ref, query_ok, ref_ok, scale, centre, unit, q, r, qc, rc, qh, rh, q_lo, q_norms, r_norms, reach,
            r_lo, rows, columns, dim, q_programs, q_share, r_share, HALVES=halves, BLOCK_R=block, DP=padded,
            num_warps=4)
    out = dict(query_ok=query_ok.view(torch.bool), ref_ok=ref_ok.view(torch.bool), scale=scale[:, None],
               largest=top, q=q, r=r, qc=qc, rc=rc, q_norms=q_norms, r_norms=r_norms, reach=reach[:, None])
    if halves:
        out.update(unit=unit, qh=qh, rh=rh, q_lo=q_lo, r_lo=r_lo[:, None], twice=twice)
    return out
