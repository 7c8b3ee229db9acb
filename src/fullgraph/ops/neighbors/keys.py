"""Packed (distance, index) keys, the currency of both GPU neighbour backends' selections.

A key is one int64: the distance's float32 bits (non-negative floats order as their bits) in
the high word and the reference's index in the low one, so sorting keys orders by distance,
then index: ties go to the smaller index with no second pass. Kernels only (Triton at the top).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The key of "no candidate": larger than every real (distance, index) key.
KEY_NONE = tl.constexpr(0x7FFFFFFFFFFFFFFF)


@triton.jit
def smallest_keys(x, WIDTH: tl.constexpr):
    """The WIDTH smallest keys of each row of x [BM, N] (N a multiple of WIDTH), ascending."""
    x = tl.reshape(tl.sort(x, 1), (x.shape[0], x.shape[1] // WIDTH, WIDTH))
    return tl.sum(tl.where((tl.arange(0, x.shape[1]) == 0)[None, :, None], x, 0), 1)


@triton.jit
def insert_keys(best, threshold, keys, slots, SORT_FROM: tl.constexpr):
    """Merge candidate keys [BM, BN] into the k best [BM, KP] (KP - k slots hold -1, which
    the row maximum, the threshold, never sees). A tile of which some row wants SORT_FROM
    candidates or more is merged by sorting it with the list (when BN >= KP); fewer, one
    candidate at a time."""
    none = tl.full(keys.shape, KEY_NONE, tl.int64)
    wanted = keys < threshold[:, None]
    pending = tl.max(tl.sum(wanted.to(tl.int32), 1), 0)
    KP: tl.constexpr = best.shape[1]
    if keys.shape[1] >= KP:
        if pending >= SORT_FROM:
            candidates = smallest_keys(tl.where(wanted, keys, none), KP)
            best = smallest_keys(tl.reshape(tl.join(best, candidates), (best.shape[0], 2 * KP)), KP)
            threshold = tl.max(best, 1)
            pending = pending * 0
    while pending > 0:
        smallest = tl.min(tl.where(wanted, keys, none), 1)
        worst_slot = tl.argmax(best, 1)
        replace = (slots[None, :] == worst_slot[:, None]) & (smallest < threshold)[:, None]
        best = tl.where(replace, smallest[:, None], best)
        threshold = tl.max(best, 1)
        keys = tl.where(keys == smallest[:, None], none, keys)
        wanted = keys < threshold[:, None]
        pending = tl.max(tl.sum(wanted.to(tl.int32), 1), 0)
    return best, threshold
