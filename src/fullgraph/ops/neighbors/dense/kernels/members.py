"""The chosen chunks' members: their squared distances summed from differences (no
cancellation), the nearest re-measured in the reference's arithmetic, and the certified
lists written in one kernel a query (``certified_lists``).
"""

from __future__ import annotations

import math

import torch

import triton
import triton.language as tl

from ...keys import KEY_NONE
from ...pairs import PER_COORDINATE_MAX_DIM
from .ordering import _PER_COORDINATE, _SHORT_KEY_NONE, _key_values, _ordered_float, _ordered_keys, _row_of
from .products import FUSED_CHUNK

# (The fused lists holding their tile of queries were slower: NOTES.md.)
BLOCK_MEMBERS = 128


# ``squared_distances`` and ``nearest_members``: up to this many coordinates (WIDE_STEP 2^WIDE_LEVELS;
# MEASURE_BLOCK values a program; wider points take torch's gather and ops).
MEASURE_MAX_DIM, MEASURE_BLOCK = 4096, 4096
# From this many coordinates ``squared_distances`` and ``nearest_members`` re-measure WIDE_STEP
# coordinates at a time, one kernel for every width (``_stepped_squares``): a tile of the whole
# padded row compiled a variant a width, 4-30 s each on the H200 at D = 256-768 (a new width's
# first call), for the same time a call (10^4 x 2 x 10^5 D=256 k=10 5.8 ms, 10^4 x 10^5 D=768
# 9.0 -> 9.8).
WIDE_MIN_DIM, WIDE_LOG_STEP, WIDE_LEVELS = 129, 5, 7
WIDE_STEP = 1 << WIDE_LOG_STEP
_WIDE_LOG_STEP, _WIDE_LEVELS = tl.constexpr(WIDE_LOG_STEP), tl.constexpr(WIDE_LEVELS)
# ... and ``certified_lists`` from this many: its stepped kernel took twice the time of a call at
# D = 300 (4 x 3000^2 k=24, H200: 2.16 against 1.17 ms, cdist + topk 1.43), so up to there it keeps
# a variant a width (50 s to compile at D = 300 unrolled, ~1.5 s looped: MEMBERS_LOOPED_MIN_DIM).
CERTIFIED_WIDE_MIN_DIM = 1025


def _log_steps(dim: int) -> int:
    """log2 of the WIDE_STEP steps of D zero-padded to a power of two (``_stepped_squares``)."""
    return max(0, (triton.next_power_of_2(dim) // WIDE_STEP).bit_length() - 1)


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
def _squared_distances_kernel(q_ptr, r_ptr, refs_ptr, out_ptr, take, dim, log_steps, BLOCK_C: tl.constexpr,
                              DP: tl.constexpr, LOG_DP: tl.constexpr):
    """out [Q, take] = sum_d (q[i] - r[refs[i, c]])_d^2: each difference and square rounded
    as torch rounds them, summed as ``pairs.halving_sum`` sums (zero-padded to DP = 2^LOG_DP
    coordinates, halved LOG_DP times; DP = 0: any D, ``_stepped_squares``). Launched without
    contraction into fused multiply-adds, which would round differently."""
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    refs = tl.load(refs_ptr + i * take + c, mask=c < take, other=0)
    if DP == 0:
        squares = _stepped_squares(q_ptr + i * dim, r_ptr + refs * dim, c < take, dim, log_steps, _WIDE_LOG_STEP,
                                   _WIDE_LEVELS)
    else:
        d = tl.arange(0, DP)
        q = tl.load(q_ptr + i * dim + d, mask=d < dim, other=0.0)
        r = tl.load(r_ptr + refs[:, None] * dim + d[None, :], mask=(c[:, None] < take) & (d[None, :] < dim),
                    other=0.0)
        squares = _reference_squares(q, r, DP, LOG_DP)  # (D > 4: halved)
    tl.store(out_ptr + i * take + c, squares, mask=c < take)


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
def _stepped_squares(q_row, rows, ok, dim, log_steps, LOG_STEP: tl.constexpr, LEVELS: tl.constexpr):
    """[C]: ``_reference_squares`` of q (at q_row) against the rows at the pointers rows [C]
    (``ok``: loaded) for any D <= STEP 2^LEVELS, STEP coordinates at a time: D zero-padded to
    2^log_steps steps. ``pairs.halving_sum`` first joins coordinate c and c + half, i.e.
    step s and s + steps / 2, coordinate by coordinate, down to one step, then halves that
    step. The steps visited in bit-reversed order put each of those joins between
    neighbours: partial sums of a binary counter (LEVELS of them). Same pairs, same bits."""
    C: tl.constexpr = rows.shape[0]
    STEP: tl.constexpr = tl.constexpr(1) << LOG_STEP
    d = tl.arange(0, STEP)
    p0 = tl.zeros((C, STEP), tl.float32)
    p1, p2, p3, p4, p5, p6 = p0, p0, p0, p0, p0, p0
    total = p0
    for i in range(0, 1 << log_steps):
        step = i * 0
        for bit in tl.static_range(LEVELS):
            step |= tl.where(bit < log_steps, ((i >> bit) & 1) << tl.maximum(log_steps - 1 - bit, 0), 0)
        at = step * STEP + d
        inside = at < dim
        q = tl.load(q_row + at, mask=inside, other=0.0)
        r = tl.load(rows[:, None] + at[None, :], mask=ok[:, None] & inside[None, :], other=0.0)
        diff = q[None, :] - r
        total = diff * diff
        # the counter: a set bit joins its level's partial sum and carries on, a clear one keeps it
        # (branches, uniform across the program; selects at every level were slower: H200, the
        # certified lists at 4 x 3000^2 D=300 k=24, 2.37 against 2.16 ms)
        if (i & 1) == 0:
            p0 = total
        else:
            total = p0 + total
            if (i & 2) == 0:
                p1 = total
            else:
                total = p1 + total
                if (i & 4) == 0:
                    p2 = total
                else:
                    total = p2 + total
                    if (i & 8) == 0:
                        p3 = total
                    else:
                        total = p3 + total
                        if (i & 16) == 0:
                            p4 = total
                        else:
                            total = p4 + total
                            if (i & 32) == 0:
                                p5 = total
                            else:
                                total = p5 + total
                                if (i & 64) == 0:
                                    p6 = total
                                else:
                                    total = p6 + total
    x = total  # (the last step's carry joined every level)
    for level in tl.static_range(LOG_STEP):
        x = tl.sum(tl.reshape(x, (C, 2, STEP >> (level + 1))), 1)
    return tl.reshape(x, (C,))


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
def _key_floor(keys, bound, q_abs, reach, dim, POSITION_BITS: tl.constexpr):
    """A floor under the squared distances, as the reference measures them, of every
    reference of the chunks of ``_short_keys`` keys (NaN for ``_SHORT_KEY_NONE``): each
    has a product value v with v + |q|^2 at least the key's sum rounded down, less 2^-23
    of it (see dense._chosen_chunks; the products err by ``bound``), then
    dense.beyond_expansion for a query of norm q_abs among references of norm <= reach."""
    least = _ordered_float(keys & -(1 << POSITION_BITS))
    least = tl.where(least >= 0, least * (1 - 2.0**-22), least * (1 + 2.0**-22)) - 2 * bound
    return ((least - 2 * (dim + 4) * 2.0**-24 * (q_abs + reach) * (q_abs + reach))
            * (1 - 2 * (dim + 2) * 2.0**-24))


@triton.jit
def _key_ceiling(key, bound, q_abs, reach, dim, POSITION_BITS: tl.constexpr):
    """``_key_floor``'s mirror: a ceiling over the squared distance, as the reference
    measures it, of the nearest reference of the chunk of a ``_short_keys`` key (not
    ``_SHORT_KEY_NONE``), whose sum lies below the next rounded key."""
    most = _ordered_float((key & -(1 << POSITION_BITS)) + (1 << POSITION_BITS))
    most = tl.where(most >= 0, most * (1 + 2.0**-22), most * (1 - 2.0**-22)) + 2 * bound
    return ((most + 2 * (dim + 4) * 2.0**-24 * (q_abs + reach) * (q_abs + reach))
            * (1 + 2 * (dim + 2) * 2.0**-24))


@triton.jit
def _measured_block(keys, b, slot, q, q_row, r_base, ok_base, chosen, members, columns, dim, log_steps, dp,
                    DIM: tl.constexpr, LOG_DP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
                    POSITION_BITS: tl.constexpr, BY_QUAD: tl.constexpr):
    """``_measured_members``' keys [BLOCKS, BLOCK_C] with block b of the slots measured in the
    reference's arithmetic."""
    BLOCKS: tl.constexpr = keys.shape[0]
    ref, inside = _member_refs(chosen, members, columns, _row_of(slot, b, BLOCK_C), CHUNK, POSITION_BITS)
    if DIM == 0:
        d2 = _stepped_squares(q_row, r_base + ref * dim, inside, dim, log_steps, _WIDE_LOG_STEP, _WIDE_LEVELS)
    elif BY_QUAD:
        d2 = _quad_squares(q_row, r_base + ref * DIM, inside, DIM, LOG_DP)
    else:
        r = tl.load(r_base + ref[:, None] * DIM + dp[None, :], mask=inside[:, None] & (dp[None, :] < DIM), other=0.0)
        d2 = _reference_squares(q, r, DIM, LOG_DP)
    valid = inside & (tl.load(ok_base + ref, mask=inside, other=0) != 0)
    found = (tl.sqrt_rn(d2).to(tl.int32, bitcast=True).to(tl.int64) << 32) | ref.to(tl.int64)
    found = tl.where(valid & (d2 == d2), found, KEY_NONE)
    return tl.where((tl.arange(0, BLOCKS) == b)[:, None], found[None, :], keys)


@triton.jit
def _measured_members(q_row, r_base, ok_base, chosen, columns, n_chosen, take, dim, log_steps, DIM: tl.constexpr,
                      LOG_DP: tl.constexpr, CHUNK: tl.constexpr, WP: tl.constexpr, SEL: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, POSITION_BITS: tl.constexpr,
                      BY_QUAD: tl.constexpr, LOOPED: tl.constexpr):
    """One query (its row of q at ``q_row``): its members (``_member_refs``) measured by
    summed differences, the ``take`` least (by (value, member)) measured again in the
    reference's arithmetic (BY_QUAD: ``_quad_squares``, BLOCK_C four threads each; DIM 0: any
    D = dim, ``_stepped_squares``; LOOPED: BLOCK_C members at a time in a loop over the slots
    in use, not unrolled) -> their
    (distance, index) keys, ascending [SEL or WP] (none: ``KEY_NONE``), and the take-th
    least first measure (+inf where every member was)."""
    members = n_chosen * CHUNK
    j = tl.arange(0, WP)
    if SEL < WP:
        ref, inside = _member_refs(chosen, members, columns, j, CHUNK, POSITION_BITS)
        total = tl.zeros((WP,), tl.float32)
        for start in range(0, dim, BLOCK_K):
            d = start + tl.arange(0, BLOCK_K)
            qd = tl.load(q_row + d, mask=d < dim, other=0.0)
            rd = tl.load(r_base + ref[:, None] * dim + d[None, :], mask=inside[:, None] & (d[None, :] < dim),
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
    if DIM > 0:
        q = tl.load(q_row + dp, mask=dp < DIM, other=0.0)
    else:
        q = dp.to(tl.float32)  # (unused: ``_stepped_squares`` loads its steps)
    BLOCKS: tl.constexpr = slot.shape[0] // BLOCK_C
    keys = tl.full((BLOCKS, BLOCK_C), KEY_NONE, tl.int64)
    if LOOPED:  # only the blocks of slots in use
        used = tl.minimum(take, SEL) if SEL < WP else members
        for b in range(0, tl.cdiv(used, BLOCK_C)):
            keys = _measured_block(keys, b, slot, q, q_row, r_base, ok_base, chosen, members, columns, dim, log_steps,
                                   dp, DIM, LOG_DP, CHUNK, BLOCK_C, POSITION_BITS, BY_QUAD)
    else:
        for b in tl.static_range(BLOCKS):
            keys = _measured_block(keys, b, slot, q, q_row, r_base, ok_base, chosen, members, columns, dim, log_steps,
                                   dp, DIM, LOG_DP, CHUNK, BLOCK_C, POSITION_BITS, BY_QUAD)
    return tl.sort(tl.reshape(keys, (BLOCKS * BLOCK_C,)), 0), last


@triton.jit
def _nearest_members_kernel(q_ptr, r_ptr, ok_ptr, chosen_ptr, needed_ptr, out_d, out_i, out_last, rows, columns,
                            n_chosen, take, count, dim, log_steps, DIM: tl.constexpr, LOG_DP: tl.constexpr,
                            CHUNK: tl.constexpr, WP: tl.constexpr, SEL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                            BY_QUAD: tl.constexpr, LOOPED: tl.constexpr, NEEDED: tl.constexpr):
    """One query: ``_measured_members`` of its chosen chunks (chosen < 0: none), the
    ``count`` nearest stored by (distance, index), and the take-th least first measure
    -> out_last."""
    row = tl.program_id(0).to(tl.int64)
    if NEEDED:
        if tl.load(needed_ptr + row) == 0:
            return
    item = row // rows
    width = DIM if DIM > 0 else dim
    keys, last = _measured_members(q_ptr + row * width, r_ptr + item * columns * width, ok_ptr + item * columns,
                                   chosen_ptr + row * n_chosen, columns, n_chosen, take, width, log_steps, DIM,
                                   LOG_DP, CHUNK, WP, SEL, BLOCK_K, BLOCK_C, 0, BY_QUAD, LOOPED)
    tl.store(out_last + row, last)
    at = tl.arange(0, keys.shape[0])
    hit = keys != KEY_NONE
    tl.store(out_d + row * count + at, tl.where(hit, _key_values(keys), float("inf")), mask=at < count)
    tl.store(out_i + row * count + at, tl.where(hit, keys & 0xFFFFFFFF, -1), mask=at < count)


@triton.jit
def _certified_lists_kernel(q_ptr, r_ptr, ok_ptr, query_ok_ptr, keys_ptr, q_norms_ptr, reach_ptr, scale_ptr,
                            q_lo_ptr, r_lo_ptr, out_d, out_i, out_unproven, rows, first_row, total_rows, columns,
                            n_chosen, n_keys, take, count, error, radius, n_rows, dim, log_steps, DIM: tl.constexpr,
                            LOG_DP: tl.constexpr, CHUNK: tl.constexpr, WP: tl.constexpr, SEL: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BY_QUAD: tl.constexpr,
                            LOOPED: tl.constexpr, POSITION_BITS: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr,
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
    width = DIM if DIM > 0 else dim
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
                               _key_ceiling(kth_key, bound, q_abs, reach, width, POSITION_BITS), float("inf"))
            floors = _key_floor(chosen, bound, q_abs, reach, width, POSITION_BITS)
            measured = tl.minimum(tl.min(tl.where((c >= count) & (floors > ceiling), c, n_chosen)), n_chosen)
            keys, last = _measured_members(q_ptr + row * width, r_ptr + item * columns * width,
                                           ok_ptr + item * columns, keys_ptr + row * n_keys, columns, measured,
                                           take, width, log_steps, DIM, LOG_DP, CHUNK, WP, SEL, BLOCK_K, BLOCK_C, POSITION_BITS,
                                           BY_QUAD, LOOPED)
            # Every reference of an unmeasured chunk lies at or above the next key's floor.
            top = tl.load(keys_ptr + row * n_keys + measured, mask=n_keys > measured, other=0)
            beyond = _key_floor(top, bound, q_abs, reach, width, POSITION_BITS)
            limit = tl.minimum(tl.where(n_keys > measured, beyond, float("inf")),
                               last * (1 - 4 * (width + 2) * 2.0**-24))
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


def measures(q: torch.Tensor) -> bool:
    """Whether ``squared_distances`` takes points like q: float32 with D in (4, MEASURE_MAX_DIM]
    (at most 4 coordinates the reference sums one at a time)."""
    return triton is not None and q.dtype == torch.float32 and PER_COORDINATE_MAX_DIM < q.shape[-1] <= MEASURE_MAX_DIM


def squared_distances(q: torch.Tensor, r: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """q [B, m, D], r [B, N, D] (float32; ``measures``), candidates [B, m, c] (rows of r,
    >= 0) -> [B, m, c]: the reference's squared distances (``pairs.squared_difference``) bit
    for bit, in one pass instead of a gather, the squares [B, m, c, D] and their sum."""
    batch, rows, take = candidates.shape
    dim = q.shape[-1]
    out = torch.empty((batch, rows, take), dtype=q.dtype, device=q.device)
    if out.numel():
        refs = candidates + (torch.arange(batch, device=q.device) * r.shape[1])[:, None, None]
        padded = 0 if dim >= WIDE_MIN_DIM else triton.next_power_of_2(dim)
        block_c = min(32, triton.next_power_of_2(take), MEASURE_BLOCK // (padded or WIDE_STEP * 16))
        _squared_distances_kernel[(batch * rows, triton.cdiv(take, block_c))](
            q.contiguous(), r.contiguous(), refs.contiguous(), out, take, dim, _log_steps(dim), BLOCK_C=block_c,
            DP=padded, LOG_DP=max(padded.bit_length() - 1, 0), num_warps=4, enable_fp_fusion=False)
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
# From this many coordinates the members of a variant a width are re-measured in a loop over the
# blocks of slots in use, not every block unrolled (a 1024-wide tile a member, 64 slots at D = 768:
# 85 s to compile for sm_90 on one core, 4 s looped). (``_stepped_squares``' few blocks stay unrolled.)
MEMBERS_LOOPED_MIN_DIM = MEMBERS_BY_QUAD_MAX_DIM + 1


def ranks_members(members: int, take: int, dim: int) -> bool:
    """Whether ``nearest_members`` takes ``members`` members a query, ``take`` re-measured, of
    D = dim (float32 points; the caller checks)."""
    return triton is not None and members <= MEMBERS_MAX and take <= MEMBERS_TAKE_MAX and dim <= MEASURE_MAX_DIM


# ``nearest_members`` of candidate lists (every member re-measured, none measured first: chunk 1,
# take = members): up to CANDIDATES_MAX a query (CANDIDATES_WIDE_MAX from WIDE_MIN_DIM coordinates,
# whose 32 unrolled steps a program compile for minutes at 2,048 keys), a warp a
# CANDIDATES_PER_WARP of them (their keys sorted in registers), where torch's gather, re-measure and
# sort of [B, M, take] took ~1.5 ms more a call (4 x 3000^2 D=64 k=256: NOTES.md).
CANDIDATES_MAX, CANDIDATES_WIDE_MAX, CANDIDATES_PER_WARP = 2048, 512, 256


def orders_candidates(take: int, dim: int) -> bool:
    """Whether ``nearest_members`` re-measures and orders lists of ``take`` candidates (chunk
    1, every member re-measured) of D = dim (float32 points; the caller checks)."""
    most = CANDIDATES_MAX if dim < WIDE_MIN_DIM else CANDIDATES_WIDE_MAX
    return triton is not None and take <= most and dim <= MEASURE_MAX_DIM


def _members_settings(members: int, take: int, dim: int, wide_from: int = WIDE_MIN_DIM) -> dict:
    """``_measured_members``' settings for ``members`` members a query, ``take`` re-measured,
    of D = dim."""
    width = triton.next_power_of_2(max(members, 2))
    selected = min(triton.next_power_of_2(max(take, 2)), width)
    warps = MEMBERS_WARPS if members <= MEMBERS_MAX else max(MEMBERS_WARPS, width // CANDIDATES_PER_WARP)
    tile = 1024 * warps  # values a program holds at once: 32 a thread
    wide = dim >= wide_from
    if wide:  # (WIDE_STEP coordinates at a time: ``_stepped_squares``)
        padded, by_quad, block_c = 1, False, min(selected, tile // (4 * WIDE_STEP))
    else:
        padded = triton.next_power_of_2(dim)
        by_quad = MEMBERS_BY_QUAD and PER_COORDINATE_MAX_DIM < dim <= MEMBERS_BY_QUAD_MAX_DIM
        block_c = min(selected, max(8, 2 * tile // padded) if by_quad else max(1, tile // padded))
    return dict(dim=dim, log_steps=_log_steps(dim), DIM=0 if wide else dim, LOG_DP=padded.bit_length() - 1,
                WP=width, SEL=selected,
                BLOCK_K=max(1, min(32, tile // width)), BLOCK_C=block_c, BY_QUAD=by_quad,
                LOOPED=not wide and not by_quad and dim >= MEMBERS_LOOPED_MIN_DIM,
                num_warps=warps, enable_fp_fusion=False)


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
        **_members_settings(n_chosen * FUSED_CHUNK, take, dim, CERTIFIED_WIDE_MIN_DIM))
