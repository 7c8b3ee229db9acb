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

import torch

import triton
import triton.language as tl

from .ordering import _SHORT_KEY_NONE, _least_descending, _merge_sorted, _ordered_floats, _short_keys
from .selection import SORT_KEYS, smallest

# Tiles of chunk_minima on both clouds (queries, references, coordinates a step, warps, pipeline
# stages) by precision ("fp16x3" keeps two accumulators: half the references of "fp16").
MINIMA_TILES = {"fp16": (128, 256, 32, 8, 3), "tf32": (128, 256, 32, 8, 3), "tf32x3": (128, 128, 64, 8, 2),
                "fp16x3": (128, 128, 32, 8, 3)}
MINIMA_OTHER_TILES = (128, 128, 32, 8, 3)


# Up to this many coordinates (padded to a power of two) a program holds its tile of queries and
# streams its share of the references, MINIMA_HELD_PROGRAMS_PER_SM programs an SM, in tiles
# (queries, references, warps, pipeline stages) by the padded D (measured: NOTES.md).
MINIMA_HELD_MAX_DIM = {"fp16": 128, "tf32": 64, "tf32x3": 128, "ieee": 64, "fp16x3": 0}  # by precision
MINIMA_HELD_PROGRAMS_PER_SM = 4
MINIMA_HELD_TILES = {16: (128, 128, 8, 3), 32: (128, 128, 8, 3), 64: (128, 128, 8, 3), 128: (128, 64, 8, 2)}


# ... with float16 operands where those tiles differ (NOTES.md).
MINIMA_HELD_HALF_TILES = {128: (128, 128, 8, 2)}


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


@triton.jit
def _low_operands_kernel(x_ptr, half_ptr, unit_ptr, low_ptr, low_norms_ptr, rest_norms_ptr, rows, dim,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows of x [B, L, D] (float32) and half [B, L, D] (float16): low = x unit - half rounded to
    float16, and the norms of low and of x unit - half - low (both differences exact), over
    unit."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = r < rows
    unit = tl.load(unit_ptr + tl.program_id(1))
    base = (tl.program_id(1).to(tl.int64) * rows + r[:, None]) * dim
    lows = tl.zeros((BLOCK_R,), tl.float32)
    rests = tl.zeros((BLOCK_R,), tl.float32)
    for start in range(0, dim, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        mask = inside[:, None] & (d[None, :] < dim)
        left = tl.load(x_ptr + base + d[None, :], mask=mask, other=0.0) * unit - \
            tl.load(half_ptr + base + d[None, :], mask=mask, other=0.0).to(tl.float32)
        low = left.to(tl.float16)
        tl.store(low_ptr + base + d[None, :], low, mask=mask)
        rest = left - low.to(tl.float32)
        lows += tl.sum(low.to(tl.float32) * low.to(tl.float32), 1)
        rests += tl.sum(rest * rest, 1)
    tl.store(low_norms_ptr + tl.program_id(1) * rows + r, tl.math.div_rn(tl.sqrt(lows), unit), mask=inside)
    tl.store(rest_norms_ptr + tl.program_id(1) * rows + r, tl.math.div_rn(tl.sqrt(rests), unit), mask=inside)


def low_operands(x: torch.Tensor, half: torch.Tensor, unit: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What ``half_operands`` left out of float32 x [B, L, D] (``half`` its float16 operands at
    ``unit`` [B]), rounded to float16 again: low [B, L, D] (x unit - half, so that qh.rh + qh.rl +
    ql.rh carries ~22 bits of q.r, "fp16x3"), and in x's units the norms [B, L] of low and of
    the rest it leaves out (a bound's inputs: ``dense._products``)."""
    x, half = x.contiguous(), half.contiguous()
    batch, rows, dim = x.shape
    low = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    # (zeros for rows of no coordinates, D = 0, which no program visits)
    low_norms, rest_norms = ((torch.empty if dim else torch.zeros)((batch, rows), dtype=torch.float32, device=x.device)
                             for _ in range(2))
    if low.numel():
        block_d = min(256, triton.next_power_of_2(dim))
        block_r = max(1, 4096 // block_d)
        _low_operands_kernel[(triton.cdiv(rows, block_r), batch)](
            x, half, unit.to(torch.float32).contiguous(), low, low_norms, rest_norms, rows, dim, BLOCK_R=block_r,
            BLOCK_D=block_d, num_warps=4)
    return low, low_norms, rest_norms


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


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """tl.dot in ``PRECISION`` ("fp16", "fp16x3": of float16 operands, every product exact)."""
    if PRECISION == "fp16" or PRECISION == "fp16x3":
        product = tl.dot(a, b)
    else:
        product = tl.dot(a, b, input_precision=PRECISION)
    return product


@triton.jit
def _twice(twice_ptr, item, PRECISION: tl.constexpr):
    """The factor of the products in ``r_norms - 2 q.r``: 2, or 2 / unit^2 for the item's
    float16 operands (``half_operands``: their products are unit^2 q.r; exact, powers of two)."""
    if PRECISION == "fp16" or PRECISION == "fp16x3":
        twice = tl.load(twice_ptr + item)
    else:
        twice = 2.0
    return twice


@triton.jit
def _tile_minima(q_base, r_base, ql_base, rl_base, r_norms_base, m, n, rows, columns, dim, twice,
                 CHUNK: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """[len(m), len(n) / CHUNK]: per chunk of the references n, the least
    ``r_norms - twice q.r`` of each query m (+inf past ``columns``). "fp16x3": q.r is
    qh.rh + (qh.rl + ql.rh), the float16 halves and lows (``low_operands``; ql_base, rl_base),
    the low terms summed apart (so the main sum's rounding stays that of D products)."""
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((m.shape[0], n.shape[0]), dtype=tl.float32)
    low = tl.zeros((m.shape[0], n.shape[0]), dtype=tl.float32)
    for start in range(0, dim, BLOCK_K):
        d = start + kk
        in_d = d[None, :] < dim
        q_at, q_in = m[:, None] * dim + d[None, :], (m[:, None] < rows) & in_d
        r_at, r_in = n[:, None].to(tl.int64) * dim + d[None, :], (n[:, None] < columns) & in_d
        q = tl.load(q_base + q_at, mask=q_in, other=0.0)
        r = tl.load(r_base + r_at, mask=r_in, other=0.0)
        acc += _dot(q, tl.trans(r), PRECISION)
        if PRECISION == "fp16x3":
            low = tl.dot(q, tl.trans(tl.load(rl_base + r_at, mask=r_in, other=0.0)), low)
            low = tl.dot(tl.load(ql_base + q_at, mask=q_in, other=0.0), tl.trans(r), low)
    norms = tl.load(r_norms_base + n, mask=n < columns, other=float("inf"))
    if PRECISION == "fp16x3":
        acc += low
    approx = norms[None, :] - twice * acc
    return tl.min(tl.reshape(approx, (m.shape[0], n.shape[0] // CHUNK, CHUNK)), axis=2)


@triton.jit
def _chunk_minima_kernel(q_ptr, r_ptr, ql_ptr, rl_ptr, r_norms_ptr, twice_ptr, needed_ptr, out_ptr, rows, columns,
                         dim, chunks, row_blocks,
                         CHUNK: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NEEDED: tl.constexpr):
    """out [B, M, chunks]: the chunk minima of a tile of queries against a tile of
    references a program, consecutive programs one tile of references against successive
    tiles of queries. NEEDED: a tile none of whose queries needed marks stores nothing; ql_ptr,
    rl_ptr: the low operands of "fp16x3" (``_tile_minima``)."""
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
    minima = _tile_minima(q_ptr + item * rows * dim, r_ptr + item * columns * dim, ql_ptr + item * rows * dim,
                          rl_ptr + item * columns * dim, r_norms_ptr + item * columns, m, n, rows, columns, dim,
                          _twice(twice_ptr, item, PRECISION), CHUNK, PRECISION, BLOCK_K)
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
        minima = _tile_minima(q_base, r_base, q_base, r_base, r_norms_ptr + item * columns, m, n, rows, columns,
                              dim, twice, CHUNK, PRECISION, BLOCK_K)
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


def _factors(precision: str, twice: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The kernels' per-item factor of the products [B] (only "fp16" and "fp16x3" read it)."""
    if precision in ("fp16", "fp16x3") and (twice is None or twice.dtype != torch.float32):
        raise ValueError(f"fp16 products need twice: float32 [B] 2 / unit^2 per item, got {twice!r}")
    return like if twice is None else twice.contiguous()


def chunk_minima(q: torch.Tensor, r: torch.Tensor, r_norms: torch.Tensor, chunk: int, precision: str,
                 needed: torch.Tensor | None = None, twice: torch.Tensor | None = None,
                 lows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [B, M, D], r [B, N, D] (float32, contiguous; float16 for "fp16" and "fp16x3"), r_norms
    [B, N] (|r|^2, +inf where invalid) -> [B, M, ceil(N / chunk)]: per chunk, the least
    ``r_norms - 2 q.r`` ("fp16": ``r_norms - twice[b] q.r``, ``half_operands`` with
    twice = 2 / unit^2; "fp16x3" adds the products of ``lows``, (ql [B, M, D], rl [B, N, D])
    float16, ``low_operands``: qh.rh + qh.rl + ql.rh). With ``needed`` [B, M] (bool) only tiles
    of queries holding a needed one are multiplied: the others' minima are unspecified (not
    written: storing +inf there cost ~3 ms at 10^4 x 10^6)."""
    q, r, r_norms, twice = q.contiguous(), r.contiguous(), r_norms.contiguous(), _factors(precision, twice, r_norms)
    if (precision == "fp16x3") != (lows is not None):
        raise ValueError(f"lows: the low operands of fp16x3 products only, got {type(lows).__name__} for {precision}")
    ql, rl = (t.contiguous() for t in lows) if lows is not None else (q, r)
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
            q, r, ql, rl, r_norms, twice, needed if needed is not None else r_norms, out, rows, columns, dim, chunks,
            row_blocks,
            CHUNK=chunk, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, held),
            NEEDED=needed is not None, num_warps=warps, num_stages=stages)
    return out


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
                 twice: torch.Tensor | None = None,
                 lows: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, M, D], q_norms [B, M] (|q|^2), r [B, N, D] (float32; float16 for "fp16",
    ``chunk_minima``), r_norms [B, N] (|r|^2, +inf where invalid) -> per query the ``count``
    chunks of ``chunk`` references (``chunk_size``) with the least ``r_norms - 2 q.r``
    (``chunk_minima``'s ``twice``) over their members, ascending, ties
    to the smaller chunk (among equal sums below): the minima plus q_norms, each sum rounded
    to float32 [B, M, count], and the chunks [B, M, count] (int64). ``count`` is at most the
    number of chunks. On the fused path (``least_chunk_keys``) the sums (and the order) are
    rounded down to 32 - log2(chunks) bits, at least 20 (relative 2^-11): lower bounds, which
    is all the certificate in ``backend.py`` needs of them. ``needed`` [B, M] (bool): the other
    rows' lists are unspecified (only tiles of queries holding a needed one are multiplied).
    "fp16x3" (with ``lows``, ``chunk_minima``) on the stored minima only."""
    if count > FUSED_MAX_KEYS or chunk != FUSED_CHUNK or precision == "fp16x3":
        values, chosen = smallest(chunk_minima(q, r, r_norms, chunk, precision, needed, twice, lows), count,
                                  needed=needed)
        return values + q_norms[..., None], chosen
    out, position_bits = least_chunk_keys(q, q_norms, r, r_norms, count, precision, twice, needed)
    return _ordered_floats(out & -(1 << position_bits)), (out & ((1 << position_bits) - 1)).to(torch.int64)
