"""Every pair of a small item measured in the reference's arithmetic in one kernel, each
query's k best kept (``brute_force``): exact by construction.
"""

from __future__ import annotations

import math

import torch

import triton
import triton.language as tl

from ...keys import KEY_NONE, insert_keys
from ...pairs import PER_COORDINATE_MAX_DIM
from .members import _bit_reversed

@triton.jit
def _brute_force_kernel(q_ptr, r_ptr, r_ok_ptr, needed_ptr, scale_ptr, out_dist, out_idx, rows, columns, radius,
                        dim, DP: tl.constexpr, LOG_DP: tl.constexpr, K: tl.constexpr,
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
                              radius, b, m, dim, DP, LOG_DP, K, KP, BLOCK_N, SORT_FROM, NEEDED, SCALED)


@triton.jit
def _brute_force_rows(q_ptr, r_ptr, r_ok_ptr, needed_ptr, scale_ptr, out_dist, out_idx, rows, columns, radius, b,
                      m, dim, DP: tl.constexpr, LOG_DP: tl.constexpr, K: tl.constexpr,
                      KP: tl.constexpr, BLOCK_N: tl.constexpr, SORT_FROM: tl.constexpr, NEEDED: tl.constexpr,
                      SCALED: tl.constexpr):
    """``_brute_force_kernel``'s lists of the queries m of item b."""
    BLOCK_M: tl.constexpr = m.shape[0]
    d = _bit_reversed(LOG_DP)  # (D > PER_COORDINATE_MAX_DIM here: halved)
    q = tl.load(q_ptr + (b * rows + m)[:, None] * dim + d[None, :], mask=(m[:, None] < rows) & (d[None, :] < dim),
                other=0.0)
    slots = tl.arange(0, KP)
    best = tl.where(slots[None, :] < K, tl.full((BLOCK_M, KP), KEY_NONE, tl.int64),
                    tl.full((BLOCK_M, KP), -1, tl.int64))
    threshold = tl.max(best, 1)
    for start in range(0, columns, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < columns
        r = tl.load(r_ptr + (b * columns + n)[:, None] * dim + d[None, :],
                    mask=inside[:, None] & (d[None, :] < dim), other=0.0)
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


# Brute force (every pair measured as the reference measures it): the widest points it takes (a
# variant a power of two: D a runtime argument), the k it keeps in registers, and its tiles
# (queries, and references per DP / 64).
BRUTE_FORCE_MAX_DIM, BRUTE_FORCE_MAX_K = 2048, 64
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
            scale.contiguous() if scale is not None else q, dists, idx, rows, columns, radius, dim, DP=padded,
            LOG_DP=padded.bit_length() - 1, K=k, KP=triton.next_power_of_2(k), BLOCK_M=BRUTE_FORCE_BLOCK_M,
            BLOCK_N=block_n, GROUPS=groups, SORT_FROM=sort_from, NEEDED=needed is not None, SCALED=scale is not None,
            num_warps=BRUTE_FORCE_WARPS, enable_fp_fusion=False)
    return dists, idx
