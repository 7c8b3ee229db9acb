"""The frames in three kernels (``frames``): both clouds' validity, largest coordinates and
sums, each item's scale, centre and float16 unit, both clouds scaled and centred.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from ....scaling_kernels import kernel_power_below, kernel_safe_scale

# ``frames``: rows of points a program holds (FRAMES_BLOCK values), up to FRAMES_MAX_DIM
# coordinates, and the programs a cloud takes at most over the batch (each walks its share).
# Beyond, torch builds the frames (H100, 2,000 x 50,000 D=2048 k=10: 10.6 -> 7.7 ms a call by
# Triton's frames to 2048).
FRAMES_BLOCK, FRAMES_MAX_DIM, FRAMES_PROGRAMS = 4096, 2048, 1024


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
