"""Triton backend: exact tiled neighbour search and a fused, flash-style radius aggregation.

No kernel here synchronizes with the host, allocates outside PyTorch or reads a value
back, so the ops stay capturable in CUDA graphs. Every launch goes to the current stream
(Triton launches on torch's current stream).

Search. Each program owns BLOCK_M queries of one batch item and streams all references
in tiles of BLOCK_N, keeping its k best candidates in registers. A candidate is the
int64 key ``(bits(d^2) << 32) | index``: non-negative float32 bit patterns order like
the floats, so one integer comparison orders by distance and then by index, which makes
ties go to the smaller index and every key unique. Floor: M*N distance evaluations
(3 FMAs per coordinate); insertions are rare once the k-th distance has settled.

Radius aggregation. Like flash attention: a running minimum distance per query rescales
the running sums, so all references within the radius are aggregated in one pass without
a cap and without storing pairs; the backward recomputes distances from the saved per-query
(minimum, weight sum) statistics, in one query-major kernel (query gradient) and one
reference-major kernel (reference and feature gradients): deterministic, no atomics.
"""

from __future__ import annotations

import math

import torch

from .reference import full_lengths

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the backend reports this when asked for
    triton = None

MAX_K = 64
# (BLOCK_M, BLOCK_N, num_warps) of the search kernel. Few rows per program win: the
# insertion loop runs as long as the row with the most candidates needs.
SEARCH_BLOCKS = (4, 64, 1)  # swept by benchmarks/tune_search.py on the H100: 3.75 ms vs 9.4 ms for (32, 64, 4)


def available() -> bool:
    return triton is not None


if triton is not None:
    # The key of "no candidate": larger than every real (distance, index) key.
    _KEY_NONE = tl.constexpr(0x7FFFFFFFFFFFFFFF)

    @triton.jit
    def _load_points(base, offs, count, stride, D: tl.constexpr, dim: tl.constexpr):
        """Column ``dim`` of a [count, D] block as float32 (0 outside)."""
        return tl.load(base + offs * stride + dim, mask=offs < count, other=0.0).to(tl.float32)

    @triton.jit
    def _tile_d2(q_base, r_base, offs_m, offs_n, rows, columns, stride_qm, stride_rn, D: tl.constexpr):
        """Squared distances [BLOCK_M, BLOCK_N] and per-point finiteness of both sides."""
        d2 = tl.zeros((offs_m.shape[0], offs_n.shape[0]), dtype=tl.float32)
        q_bad = tl.zeros((offs_m.shape[0],), dtype=tl.int1)
        r_bad = tl.zeros((offs_n.shape[0],), dtype=tl.int1)
        for dim in tl.static_range(D):
            qc = _load_points(q_base, offs_m, rows, stride_qm, D, dim)
            rc = _load_points(r_base, offs_n, columns, stride_rn, D, dim)
            q_bad = q_bad | (qc != qc) | (tl.abs(qc) == float("inf"))
            r_bad = r_bad | (rc != rc) | (tl.abs(rc) == float("inf"))
            diff = qc[:, None] - rc[None, :]
            d2 += diff * diff
        return d2, q_bad, r_bad

    @triton.jit
    def _nearest_kernel(
        query, ref, query_len, ref_len, out_dist, out_idx, out_count,
        rows, columns, radius2, stride_qb, stride_qm, stride_rb, stride_rn,
        D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, USE_RADIUS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        q_len = tl.load(query_len + b)
        r_len = tl.load(ref_len + b)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.arange(0, KP)
        none = tl.full((BLOCK_M, BLOCK_N), _KEY_NONE, tl.int64)
        # Padding slots (>= K) hold -1 so that the row maximum only sees real slots.
        best = tl.where(slots[None, :] < K, tl.full((BLOCK_M, KP), _KEY_NONE, tl.int64),
                        tl.full((BLOCK_M, KP), -1, tl.int64))
        threshold = tl.max(best, 1)
        count = tl.zeros((BLOCK_M,), dtype=tl.int64)
        q_base = query + b * stride_qb
        r_base = ref + b * stride_rb
        for start in range(0, r_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            d2, q_bad, r_bad = _tile_d2(q_base, r_base, offs_m, offs_n, q_len, r_len, stride_qm, stride_rn, D)
            ok = (offs_m < q_len)[:, None] & (offs_n < r_len)[None, :] & ~q_bad[:, None] & ~r_bad[None, :]
            if USE_RADIUS:
                ok = ok & (d2 <= radius2)
                count += tl.sum(ok.to(tl.int64), 1)
            keys = (d2.to(tl.int32, bitcast=True).to(tl.int64) << 32) | offs_n[None, :].to(tl.int64)
            keys = tl.where(ok, keys, none)
            wanted = keys < threshold[:, None]
            pending = tl.max(tl.sum(wanted.to(tl.int32), 1), 0)
            while pending > 0:
                smallest = tl.min(tl.where(wanted, keys, none), 1)
                worst_slot = tl.argmax(best, 1)
                replace = (slots[None, :] == worst_slot[:, None]) & (smallest < threshold)[:, None]
                best = tl.where(replace, smallest[:, None], best)
                threshold = tl.max(best, 1)
                keys = tl.where(keys == smallest[:, None], none, keys)
                wanted = keys < threshold[:, None]
                pending = tl.max(tl.sum(wanted.to(tl.int32), 1), 0)
        best = tl.where(slots[None, :] < K, best, tl.full((BLOCK_M, KP), _KEY_NONE, tl.int64))
        best = tl.sort(best, 1)
        found = best != _KEY_NONE
        index = tl.where(found, best & 0xFFFFFFFF, -1)
        dist = tl.where(found, tl.sqrt((best >> 32).to(tl.int32).to(tl.float32, bitcast=True)), float("inf"))
        out_offs = (b * rows + offs_m)[:, None] * K + slots[None, :]
        mask = (offs_m < rows)[:, None] & (slots[None, :] < K)
        tl.store(out_dist + out_offs, dist.to(out_dist.dtype.element_ty), mask=mask)
        tl.store(out_idx + out_offs, index, mask=mask)
        if USE_RADIUS:
            tl.store(out_count + b * rows + offs_m, count, mask=offs_m < rows)

    @triton.jit
    def _load_block(base, offs, count, stride, width, WIDTH_P: tl.constexpr):
        """A [len(offs), WIDTH_P] float32 block of a row-major [count, width] array, 0-padded."""
        cols = tl.arange(0, WIDTH_P)
        mask = (offs < count)[:, None] & (cols < width)[None, :]
        return tl.load(base + offs[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _radius_weights(d2, ok, row_min, row_sum, inv_sigma):
        """Normalized weights p [BM, BN] and distances d of the pairs within the radius."""
        d = tl.sqrt(d2)
        total = tl.where(row_sum > 0, row_sum, 1.0)
        p = tl.where(ok, tl.exp(tl.where(ok, row_min[:, None] - d, 0.0) * inv_sigma) / total[:, None], 0.0)
        return p, d

    @triton.jit
    def _radius_aggregate_kernel(
        query, ref, features, query_len, ref_len, out, out_min, out_sum,
        rows, columns, channels, radius2, inv_sigma, stride_qb, stride_rb, stride_fb,
        D: tl.constexpr, CP: tl.constexpr, STATS_ONLY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        q_len = tl.load(query_len + b)
        r_len = tl.load(ref_len + b)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_min = tl.full((BLOCK_M,), float("inf"), tl.float32)
        row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, CP), dtype=tl.float32)
        for start in range(0, r_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            d2, ok, r_bad = _radius_tile(query, ref, b, offs_m, offs_n, q_len, r_len, radius2, stride_qb, stride_rb, D)
            # Most tiles hold no pair within the radius: skip their exponentials and features.
            if tl.max(ok.to(tl.int32)) > 0:
                d = tl.sqrt(d2)
                new_min = tl.minimum(row_min, tl.min(tl.where(ok, d, float("inf")), 1))
                # Rescale what was summed against the old minimum; nothing was summed while it
                # was inf. The inner selects keep inf - inf (NaN) out of the exponentials.
                seen = row_min < float("inf")
                alpha = tl.where(seen, tl.exp(tl.where(seen, new_min - row_min, 0.0) * inv_sigma), 0.0)
                w = tl.where(ok, tl.exp(tl.where(ok, new_min[:, None] - d, 0.0) * inv_sigma), 0.0)
                row_sum = row_sum * alpha + tl.sum(w, 1)
                if not STATS_ONLY:
                    f = _load_block(features + b * stride_fb, offs_n, r_len, channels, channels, CP)
                    f = tl.where(r_bad[:, None], 0.0, f)
                    acc = acc * alpha[:, None] + tl.dot(w, f, input_precision="ieee")
                row_min = new_min
        stat_offs = b * rows + offs_m
        tl.store(out_min + stat_offs, row_min, mask=offs_m < rows)
        tl.store(out_sum + stat_offs, row_sum, mask=offs_m < rows)
        if not STATS_ONLY:
            result = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
            cols = tl.arange(0, CP)
            mask = (offs_m < rows)[:, None] & (cols < channels)[None, :]
            tl.store(out + stat_offs[:, None] * channels + cols[None, :], result.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _radius_tile(query, ref, b, offs_m, offs_n, q_len, r_len, radius2, stride_qb, stride_rb, D: tl.constexpr):
        """Squared distances [BM, BN], the pairs within the radius, and the bad references."""
        d2, q_bad, r_bad = _tile_d2(query + b * stride_qb, ref + b * stride_rb, offs_m, offs_n, q_len, r_len, D, D, D)
        ok = (offs_m < q_len)[:, None] & (offs_n < r_len)[None, :] & ~q_bad[:, None] & ~r_bad[None, :]
        return d2, ok & (d2 <= radius2), r_bad

    @triton.jit
    def _radius_pair_terms(d2, ok, r_bad, query, ref, features, grad_out, row_min_ptr, row_sum_ptr, delta_ptr, b,
                           offs_m, offs_n,
                           q_len, r_len, rows, channels, radius2, inv_sigma, stride_qb, stride_rb, stride_fb,
                           D: tl.constexpr, DP: tl.constexpr, CP: tl.constexpr):
        """For a [BM, BN] tile with pairs ``ok`` at squared distances d2: weights p, the
        distance-gradient factor c = dL/dd / d, and the loaded blocks (q [BM, DP],
        r [BN, DP], f [BN, CP], g [BM, CP])."""
        stat = b * rows + offs_m
        row_min = tl.load(row_min_ptr + stat, mask=offs_m < rows, other=0.0)
        row_sum = tl.load(row_sum_ptr + stat, mask=offs_m < rows, other=0.0)
        delta = tl.load(delta_ptr + stat, mask=offs_m < rows, other=0.0)
        p, d = _radius_weights(d2, ok, row_min, row_sum, inv_sigma)
        g = _load_block(grad_out + b * rows * channels, offs_m, rows, channels, channels, CP)
        f = _load_block(features + b * stride_fb, offs_n, r_len, channels, channels, CP)
        f = tl.where(r_bad[:, None], 0.0, f)
        projected = tl.dot(g, tl.trans(f), input_precision="ieee")
        grad_d = -(p * inv_sigma) * (projected - delta[:, None])
        c = tl.where(ok & (d > 0), grad_d / tl.where(d > 0, d, 1.0), 0.0)
        q = _load_block(query + b * stride_qb, offs_m, q_len, D, D, DP)
        r = _load_block(ref + b * stride_rb, offs_n, r_len, D, D, DP)
        return p, c, q, r, f, g

    @triton.jit
    def _radius_grad_query_kernel(
        query, ref, features, grad_out, row_min, row_sum, delta, query_len, ref_len, grad_query,
        rows, columns, channels, radius2, inv_sigma, stride_qb, stride_rb, stride_fb,
        D: tl.constexpr, DP: tl.constexpr, CP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        q_len = tl.load(query_len + b)
        r_len = tl.load(ref_len + b)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, DP), dtype=tl.float32)
        for start in range(0, r_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            d2, ok, r_bad = _radius_tile(query, ref, b, offs_m, offs_n, q_len, r_len, radius2, stride_qb, stride_rb, D)
            if tl.max(ok.to(tl.int32)) > 0:
                p, c, q, r, f, g = _radius_pair_terms(
                    d2, ok, r_bad, query, ref, features, grad_out, row_min, row_sum, delta, b, offs_m, offs_n, q_len,
                    r_len, rows, channels, radius2, inv_sigma, stride_qb, stride_rb, stride_fb, D, DP, CP)
                # sum_j c_ij (q_i - r_j)
                acc += q * tl.sum(c, 1)[:, None] - tl.dot(c, r, input_precision="ieee")
        cols = tl.arange(0, DP)
        mask = (offs_m < rows)[:, None] & (cols < D)[None, :]
        tl.store(grad_query + (b * rows + offs_m)[:, None] * D + cols[None, :], acc, mask=mask)

    @triton.jit
    def _radius_grad_ref_kernel(
        query, ref, features, grad_out, row_min, row_sum, delta, query_len, ref_len, grad_ref, grad_features,
        rows, columns, channels, radius2, inv_sigma, stride_qb, stride_rb, stride_fb,
        D: tl.constexpr, DP: tl.constexpr, CP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        q_len = tl.load(query_len + b)
        r_len = tl.load(ref_len + b)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        acc_r = tl.zeros((BLOCK_N, DP), dtype=tl.float32)
        acc_f = tl.zeros((BLOCK_N, CP), dtype=tl.float32)
        for start in range(0, q_len, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            d2, ok, r_bad = _radius_tile(query, ref, b, offs_m, offs_n, q_len, r_len, radius2, stride_qb, stride_rb, D)
            if tl.max(ok.to(tl.int32)) > 0:
                p, c, q, r, f, g = _radius_pair_terms(
                    d2, ok, r_bad, query, ref, features, grad_out, row_min, row_sum, delta, b, offs_m, offs_n, q_len,
                    r_len, rows, channels, radius2, inv_sigma, stride_qb, stride_rb, stride_fb, D, DP, CP)
                acc_f += tl.dot(tl.trans(p), g, input_precision="ieee")
                # -sum_i c_ij (q_i - r_j)
                acc_r += r * tl.sum(c, 0)[:, None] - tl.dot(tl.trans(c), q, input_precision="ieee")
        base = b * columns + offs_n
        cols = tl.arange(0, DP)
        tl.store(grad_ref + base[:, None] * D + cols[None, :], acc_r,
                 mask=(offs_n < columns)[:, None] & (cols < D)[None, :])
        cols = tl.arange(0, CP)
        tl.store(grad_features + base[:, None] * channels + cols[None, :], acc_f,
                 mask=(offs_n < columns)[:, None] & (cols < channels)[None, :])


def nearest(query, ref, k, radius, query_lengths, ref_lengths):
    """Same contract as ``reference.nearest``; k <= MAX_K; query and ref contiguous."""
    batch, rows, dim = query.shape
    columns = ref.shape[1]
    if k > MAX_K:
        raise ValueError(f'k: backend="triton" supports k <= {MAX_K}, got {k}; use backend="torch"')
    dists = torch.empty((batch, rows, k), dtype=query.dtype, device=query.device)
    idx = torch.empty((batch, rows, k), dtype=torch.int64, device=query.device)
    use_radius = math.isfinite(radius)
    counts = torch.zeros((batch, rows), dtype=torch.int64, device=query.device)
    if batch * rows == 0:
        return dists, idx, counts
    block_m, block_n, warps = SEARCH_BLOCKS
    grid = (triton.cdiv(rows, block_m), batch)
    _nearest_kernel[grid](
        query, ref, full_lengths(query_lengths, batch, rows, query.device), full_lengths(ref_lengths, batch, columns, ref.device),
        dists, idx, counts, rows, columns, float(radius) ** 2 if use_radius else 0.0,
        rows * dim, dim, columns * dim, dim,
        D=dim, K=k, KP=triton.next_power_of_2(k), USE_RADIUS=use_radius, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps,
    )
    if not use_radius:
        counts = (idx >= 0).sum(-1)
    return dists, idx, counts


_AGGREGATE_BLOCK_M, _AGGREGATE_BLOCK_N = 32, 32


def _aggregate_launch(query, ref, features, query_lengths, ref_lengths, radius, sigma):
    batch, rows, dim = query.shape
    columns, channels = ref.shape[1], features.shape[-1]
    common = dict(
        rows=rows, columns=columns, channels=channels, radius2=float(radius) ** 2, inv_sigma=1.0 / sigma,
        stride_qb=rows * dim, stride_rb=columns * dim, stride_fb=columns * channels,
    )
    lengths = (full_lengths(query_lengths, batch, rows, query.device), full_lengths(ref_lengths, batch, columns, ref.device))
    sizes = dict(D=dim, CP=max(16, triton.next_power_of_2(max(channels, 1))))
    return lengths, common, sizes


def _row_stats(query, ref, features, lengths, common, sizes, out=None):
    """Per-query (minimum distance, weight sum) and, unless ``out`` is None, the output."""
    batch, rows = query.shape[:2]
    row_min = torch.empty((batch, rows), dtype=torch.float32, device=query.device)
    row_sum = torch.empty_like(row_min)
    grid = (triton.cdiv(rows, _AGGREGATE_BLOCK_M), batch)
    _radius_aggregate_kernel[grid](
        query, ref, features, *lengths, row_min if out is None else out, row_min, row_sum, **common, **sizes,
        STATS_ONLY=out is None, BLOCK_M=_AGGREGATE_BLOCK_M, BLOCK_N=_AGGREGATE_BLOCK_N,
    )
    return row_min, row_sum


def radius_aggregate(query, ref, features, radius, sigma, query_lengths, ref_lengths):
    """Same contract as the pair-based aggregation in ``ops`` (contiguous inputs): out [B, M, C]."""
    out = torch.zeros((*query.shape[:2], features.shape[-1]), dtype=features.dtype, device=query.device)
    if out.numel() == 0:
        return out
    lengths, common, sizes = _aggregate_launch(query, ref, features, query_lengths, ref_lengths, radius, sigma)
    _row_stats(query, ref, features, lengths, common, sizes, out=out)
    return out


def radius_aggregate_backward(grad_out, query, ref, features, out, radius, sigma, query_lengths, ref_lengths):
    """(grad_query, grad_ref, grad_features) of contiguous inputs, deterministic: no atomics."""
    batch, rows, dim = query.shape
    columns = ref.shape[1]
    grad_query = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    grad_ref = torch.zeros(ref.shape, dtype=torch.float32, device=ref.device)
    grad_features = torch.zeros(features.shape, dtype=torch.float32, device=features.device)
    if batch * rows * columns * features.shape[-1] > 0:
        lengths, common, sizes = _aggregate_launch(query, ref, features, query_lengths, ref_lengths, radius, sigma)
        row_min, row_sum = _row_stats(query, ref, features, lengths, common, sizes)
        grad_out = grad_out.contiguous().to(torch.float32)
        delta = (grad_out * out.to(torch.float32)).sum(-1).contiguous()
        tensors = (query, ref, features, grad_out, row_min, row_sum, delta, *lengths)
        sizes = dict(sizes, DP=max(16, triton.next_power_of_2(dim)))
        blocks = dict(BLOCK_M=_AGGREGATE_BLOCK_M, BLOCK_N=_AGGREGATE_BLOCK_N)
        _radius_grad_query_kernel[(triton.cdiv(rows, _AGGREGATE_BLOCK_M), batch)](
            *tensors, grad_query, **common, **sizes, **blocks)
        _radius_grad_ref_kernel[(triton.cdiv(columns, _AGGREGATE_BLOCK_N), batch)](
            *tensors, grad_ref, grad_features, **common, **sizes, **blocks)
    return grad_query.to(query.dtype), grad_ref.to(ref.dtype), grad_features.to(features.dtype)
