"""``smallest``: the least values of each row with their positions, ties to the smaller
position (a sort of packed keys in registers; beyond SORT_MAX columns a threshold from the
minima of classes of positions, ``_wide_smallest_kernel``, or ``torch.topk``).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from ...keys import KEY_NONE
from .ordering import _key_values, _keys_out, _least_descending, _ordered_keys

# The widest rows ``smallest`` sorts in registers, and the keys one program sorts.
SORT_MAX, SORT_KEYS = 2048, 4096


# Wider rows on GPUs, for up to WIDE_GROUPS least a row: ``_wide_smallest_kernel`` (a
# threshold from the minima of WIDE_GROUPS classes of positions, the values below it gathered,
# at most WIDE_CAP, and sorted), read in blocks of WIDE_BLOCK on WIDE_WARPS warps.
WIDE_GROUPS, WIDE_CAP, WIDE_BLOCK, WIDE_WARPS = 64, 256, 2048, 4


@triton.jit
def _smallest_kernel(values_ptr, needed_ptr, out_values_ptr, out_index_ptr, rows, width, count,
                     ROWS: tl.constexpr, WIDTH: tl.constexpr, LOG_WIDTH: tl.constexpr, LOG_KEEP: tl.constexpr,
                     NEEDED: tl.constexpr):
    """``smallest`` of ROWS rows: the 2^LOG_KEEP (>= count) least keys of each row by
    ``_least_descending`` (runs of that width sorted, then halved by pairwise minima), not a
    sort of the whole row: at 2048 columns a third of its steps, and 2.8 s of compile time
    for 32 kept against 6.7 (sm_90, Triton 3.9).
    NEEDED: a program none of whose rows needed marks stores +inf at positions 0, 1, ..."""
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
    if LOG_KEEP + 2 > LOG_WIDTH:  # most of the row kept: tl.sort of it all compiles faster
        keys = tl.sort(_ordered_keys(x, c[None, :]), dim=1)
        slot = c[None, :]
    else:
        keys = _least_descending(_ordered_keys(x, c[None, :]), LOG_WIDTH, LOG_KEEP)
        slot = (1 << LOG_KEEP) - 1 - tl.arange(0, 1 << LOG_KEEP)[None, :]  # descending: the least last
    keep = (r[:, None] < rows) & (slot < count)
    tl.store(out_values_ptr + r[:, None] * count + slot, _key_values(keys), mask=keep)
    tl.store(out_index_ptr + r[:, None] * count + slot, keys & 0xFFFFFFFF, mask=keep)


@triton.jit
def _wide_smallest_kernel(values_ptr, needed_ptr, scratch_ptr, out_values_ptr, out_index_ptr, width, count,
                          GROUPS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, KEYS: tl.constexpr,
                          NEEDED: tl.constexpr):
    """``smallest`` of a wide row a program (count <= GROUPS, KEYS >= count a power of two).
    The positions fall in GROUPS classes by their remainder; the count-th least of the
    classes' minima is at least the row's count-th least value (count distinct values lie
    at or below it), so only the values at or below it can be chosen: gathered into
    scratch (CAP a row; a few times count on most rows) and sorted there, or, past CAP
    (many ties), each piece of CAP of the row sorted and merged. NEEDED: a row not needed stores
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
        piece = tl.arange(0, CAP)  # (pieces of CAP, not BLOCK: a sort of 2048 keys compiled for 6 s more)
        for start in range(0, width, CAP):
            x = tl.load(base + start + piece, mask=start + piece < width, other=float("inf"))
            keys = tl.sort(tl.where((x <= threshold) & (start + piece < width), _ordered_keys(x, start + piece),
                                    KEY_NONE))
            head = tl.min(tl.reshape(tl.where(piece < KEYS, keys, KEY_NONE), (CAP // KEYS, KEYS)), 0)
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
            ROWS=per_program, WIDTH=padded, LOG_WIDTH=padded.bit_length() - 1,
            LOG_KEEP=triton.next_power_of_2(count).bit_length() - 1, NEEDED=needed is not None, num_warps=4)
    return out_values, out_index
