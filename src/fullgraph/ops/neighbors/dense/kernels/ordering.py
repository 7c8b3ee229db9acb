"""Packed keys and sorting networks the dense kernels share: the order-preserving bits of a
float, short (value, position) keys, bitonic compare-and-swap steps and merges.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from ...pairs import PER_COORDINATE_MAX_DIM

_SHORT_KEY_NONE = tl.constexpr(0x7FFFFFFF)  # above every ``_short_keys`` key (NaN has none)
_PER_COORDINATE = tl.constexpr(PER_COORDINATE_MAX_DIM)


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
def _row_of(x, at, WIDTH: tl.constexpr):
    """Row ``at`` of x [R * WIDTH] seen as [R, WIDTH] (integers): [WIDTH]."""
    ROWS: tl.constexpr = x.shape[0] // WIDTH
    return tl.sum(tl.where((tl.arange(0, ROWS) == at)[:, None], tl.reshape(x, (ROWS, WIDTH)), 0), 0)


@triton.jit
def _keys_out(keys, out_values_ptr, out_index_ptr, row, count):
    """The first ``count`` of the sorted ``_ordered_keys`` keys -> values and positions of row."""
    slots = tl.arange(0, keys.shape[0])
    tl.store(out_values_ptr + row * count + slots, _key_values(keys), mask=slots < count)
    tl.store(out_index_ptr + row * count + slots, keys & 0xFFFFFFFF, mask=slots < count)


def _ordered_floats(ordered: torch.Tensor) -> torch.Tensor:
    """int32 ``_ordered_bits`` back to the float32 values."""
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).view(torch.float32)
