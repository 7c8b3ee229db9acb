"""Triton backend: exact neighbour search and a fused, flash-style radius aggregation,
both walking the uniform grid of ``grid.py``.

No kernel here synchronizes with the host, allocates outside PyTorch or reads a value
back, so the ops stay capturable in CUDA graphs. Every launch goes to the current stream.

Search. A program owns BLOCK_M consecutive sorted queries (neighbours in space) and the
box of cells they occupy (or, when they straddle distant cells, takes them one at a time).
It visits that box grown by rings of 1, 2, 3, 4, 6, 9, ... cells, reading the ranges of
many rows of cells along x at once (each a contiguous range of sorted references),
skipping the empty ones and packing the others one after another into tiles (far from the
data a ring's rows hold a reference or two each), and keeps each query's k best
candidates in registers as int64 keys ``(bits(d) << 32) | index``: non-negative float32
bit patterns order like the floats, so one integer comparison orders by distance and then
by index (ties go to the smaller index; keys are unique). A tile of candidates enters the
lists by one sort of the tile and one of the tile with the lists where some query wants
SEARCH_SORT_FROM of its candidates or more (early, while the lists fill), else one
candidate at a time (later, when a tile brings few). It stops once every query's k-th
distance is within the query's distance to the outside of the searched box (less a
rounding slack), or the box covers the grid: exact for any distribution; points far from
the rest only cost more rings. Radius search visits the box grown by the radius, once.

Radius aggregation. Like flash attention: a running minimum distance per query rescales
the running sums, so all references within the radius are aggregated in one pass without
a cap and without storing pairs. Its walks visit one box (no rings), so a tile of
consecutive sorted positions may cross from one row's range of cells into the next: what
lies between two ranges is outside the box, beyond the reach, and fails the distance test.
Its cells are sized from the radius (RADIUS_CELL_SIDE). The backward recomputes distances
from the saved per-query (minimum, weight sum) statistics, in one launch: query-major programs
(query gradient) beside reference-major ones walking the queries' grid (reference and
feature gradients), each side alone too small to fill the GPU; deterministic, no atomics.

kNN aggregation. The search's lists feed a kernel that gathers one neighbour's feature row
at a time (no [M, k, C] buffer). Its backward computes the distance gradients per query,
and each reference sums the contributions of its slots after a stable sort of the slots by
reference: deterministic, no float atomics.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .... import _triton
from ...._triton import cdiv, lazy, next_power_of_2
from ....backends import Backend
from .. import pairs
from . import grid

kernels = lazy(f"{__package__}.kernels")

MAX_K = 64
# (BLOCK_M, BLOCK_N, num_warps) of the search kernel. Few rows per program win: the
# insertion loop runs as long as the row with the most candidates needs.
SEARCH_BLOCKS = (2, 32, 1)  # swept on the H100: 13.4 ms against 17.8 for (4, 32, 1), 1M normal
# Radius searches (cap 32): one query a program.
RADIUS_SEARCH_BLOCKS = (1, 32, 1)
# Radius searches' cells: about this many references in a query's cell.
RADIUS_SEARCH_CELL_POINTS = 12
# A tile of which some row wants this many candidates or more is merged into the lists by sorting
# (tile and list at once), rather than one candidate at a time.
SEARCH_SORT_FROM = 3
# Triton's interpreter (CPU tensors) runs a sort as many numpy operations: there the
# per-candidate merge and SEARCH_BLOCKS for radius searches are twice as fast (200 x 2,000
# points, k = 16: 36 s against 82). tests/ops/neighbors/test_search.py runs the sorting merge
# there too, by setting this.
INTERPRETER_SORT_FROM = 1 << 30
# Ranges of cells read at once (two per row of cells along x).
SEGMENT_LANES = 128
# (BLOCK_M, BLOCK_N, num_warps) of the radius aggregation and its query-side gradient: a program
# owns BLOCK_M queries and walks the references BLOCK_N at a time, its tiles crossing from one row's
# range of cells into the next.
AGGREGATE_BLOCKS = (16, 32, 4)
# The radius aggregation's cells: RADIUS_CELL_SIDE radii a side, as long as a query's cell holds
# between 1 and RADIUS_CELL_POINTS references (its forward and backward walk whole cells around a
# block's box: smaller cells round the box up less, larger ones take fewer rows). Fixed references a
# cell, the best of 8 / 4 / 2 / 1.
RADIUS_CELL_SIDE, RADIUS_CELL_POINTS = 1.0, 8
# The gradient kernel's ((BLOCK_M, BLOCK_N) of its query side, (BLOCK_M, BLOCK_N) of its reference
# side, num_warps): the query side owns BLOCK_M queries and walks the references around them BLOCK_N
# at a time, the reference side owns BLOCK_N references and walks the queries BLOCK_M at a time; one
# launch, these warps.
GRAD_BLOCKS = ((16, 32), (32, 16), 2)
# tl.dot's input_precision in the radius aggregation's weight x feature products, and in its
# gradient kernels'.
AGGREGATE_PRECISION, GRAD_PRECISION = "ieee", "tf32x3"


def _lengths(query, ref, query_lengths, ref_lengths):
    batch, rows, columns = query.shape[0], query.shape[1], ref.shape[1]
    return pairs.full_lengths(query_lengths, batch, rows, query.device), pairs.full_lengths(
        ref_lengths, batch, columns, ref.device)


# Kernel scalars are float32: larger radii saturate here (every point is within them anyway).
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _reach(radius: float) -> float:
    """The radius the cell boxes cover: a little more, so that rounding never loses a pair."""
    return min(float(radius) * (1 + 1e-5) + 1e-30, _FLOAT32_MAX)


def _squared(radius: float) -> float:
    """The largest float32 t with sqrt(t) <= radius, both rounded to float32 as torch rounds
    them: the kernels' d^2 <= t is then exactly the test dist <= radius on the distances they
    return, one comparison for the list and the counts. (Any power-of-two scale of the points
    divides t by its square exactly, so the test holds in their units too.)"""
    limit = np.float32(min(float(radius), _FLOAT32_MAX))
    with np.errstate(over="ignore"):
        t = limit * limit
    if not np.isfinite(t):
        return _FLOAT32_MAX
    while t > 0 and np.sqrt(t) > limit:
        t = np.nextafter(t, np.float32(0))
    while np.isfinite(np.nextafter(t, np.float32(np.inf))) and np.sqrt(np.nextafter(t, np.float32(np.inf))) <= limit:
        t = np.nextafter(t, np.float32(np.inf))
    return float(t)


def nearest(query, ref, k, radius, query_lengths, ref_lengths, needed=None, skip_self=False, built=None):
    """``pairs.Kernels.nearest``; k <= MAX_K; query and ref contiguous. ``needed`` [B, M]
    bool: search only these queries (the other rows of the results are unspecified).
    ``skip_self``: query is ref, and no point is listed as its own neighbour. ``built``: the
    grid and sorted clouds when the caller has them (``grid.one_cell``), else built here.
    The counts are written for radius searches only (no kNN caller reads them)."""
    batch, rows, dim = query.shape
    columns = ref.shape[1]
    use_radius = math.isfinite(radius)
    # The grid first: its sort's temporaries are gone before the lists (12 B a slot) exist.
    if batch * rows:
        cell_points = RADIUS_SEARCH_CELL_POINTS if use_radius else grid.CELL_POINTS
        frame, queries, refs = built or grid.build(query, ref, *_lengths(query, ref, query_lengths, ref_lengths),
                                                   cell_points=cell_points)
    dists = torch.empty((batch, rows, k), dtype=query.dtype, device=query.device)
    idx = torch.empty((batch, rows, k), dtype=torch.int64, device=query.device)
    counts = torch.empty((batch, rows), dtype=torch.int64, device=query.device)
    if batch * rows == 0:
        return dists, idx, counts  # (all empty)
    interpreted = _triton.INTERPRETED and not query.is_cuda
    block_m, block_n, warps = RADIUS_SEARCH_BLOCKS if use_radius and not interpreted else SEARCH_BLOCKS
    kernels.search_kernel[(cdiv(rows, block_m), batch)](
        queries.points, queries.order, queries.bucket_start, refs.points, refs.order, refs.bucket_start, refs.within,
        frame.values, frame.shape, dists, idx, counts, counts if needed is None else needed.to(torch.uint8),
        rows, columns, frame.buckets, _squared(radius) if use_radius else 0.0, _reach(radius) if use_radius else 0.0,
        D=dim, K=k, KP=next_power_of_2(k), USE_RADIUS=use_radius, MASKED=needed is not None,
        SKIP_SELF=skip_self, BLOCK_M=block_m, BLOCK_N=block_n,
        LANES=SEGMENT_LANES, SORT_FROM=INTERPRETER_SORT_FROM if interpreted else SEARCH_SORT_FROM,
        num_warps=warps,
    )
    return dists, idx, counts


def _aggregate_setup(query, ref, features, query_lengths, ref_lengths, radius, sigma, saved_grid=None):
    """The sorted clouds, sorted features and the launch arguments they share; the grid from
    ``saved_grid`` (``grid.save``'s record of the same clouds) where given, else built."""
    if saved_grid is not None and saved_grid.numel():
        frame, queries, refs = grid.restore(saved_grid, query, ref)
    else:
        frame, queries, refs = grid.build(query, ref, *_lengths(query, ref, query_lengths, ref_lengths),
                                          cell_points=RADIUS_CELL_POINTS, side=RADIUS_CELL_SIDE * radius)
    channels = features.shape[-1]
    sorted_features = features.reshape(-1, channels)[refs.order].to(torch.float32)
    common = dict(buckets=frame.buckets, channels=channels, radius2=_squared(radius), reach=_reach(radius),
                  inv_sigma=1.0 / sigma)
    sizes = dict(D=query.shape[-1], CP=max(16, next_power_of_2(max(channels, 1))))
    return frame, queries, refs, sorted_features, common, sizes


def _row_stats(query, frame, queries, refs, sorted_features, common, sizes, out=None):
    """Per sorted query (minimum distance in the item's scaled units, weight sum); or, with
    ``out`` [B, M, C], the output into it and returned, the stats [B, M, 2] (caller's units)
    at the queries' original rows."""
    batch, rows = query.shape[:2]
    if out is None:
        row_min = torch.empty((batch * rows,), dtype=torch.float32, device=query.device)
        results = (row_min, row_min, torch.empty_like(row_min))  # (out, out_min, out_sum) of the kernel
    else:
        stats = torch.empty((batch, rows, 2), dtype=torch.float32, device=query.device)
        results = (out, stats, stats)  # out_sum unused
    block_m, block_n, warps = AGGREGATE_BLOCKS
    kernels.radius_aggregate_kernel[(cdiv(rows, block_m), batch)](
        queries.points, queries.order, queries.bucket_start, refs.points, refs.bucket_start, refs.within, sorted_features,
        frame.values, frame.shape, *results, rows, **common, **sizes,
        STATS_ONLY=out is None, BLOCK_M=block_m, BLOCK_N=block_n, LANES=SEGMENT_LANES, PRECISION=AGGREGATE_PRECISION,
        num_warps=warps,
    )
    return results[1:] if out is None else results[1]


def saved_grid_size(batch, rows, columns, channels, dim):
    """``pairs.Kernels.saved_grid_size``: the forward's grid record (``grid.save``), where it runs."""
    return 0 if batch * rows * channels == 0 else grid.saved_size(batch, rows, columns, dim)


def radius_aggregate(query, ref, features, radius, sigma, query_lengths, ref_lengths):
    """``pairs.Kernels.radius_aggregate`` (contiguous inputs): (out [B, M, C], stats [B, M, 2],
    the grid's record for the backward or None)."""
    out = torch.empty((*query.shape[:2], features.shape[-1]), dtype=features.dtype, device=query.device)
    if out.numel() == 0:
        return out, None, None
    setup = _aggregate_setup(query, ref, features, query_lengths, ref_lengths, radius, sigma)
    keep = saved_grid_size(*query.shape[:2], ref.shape[1], features.shape[-1], query.shape[-1]) > 0
    return out, _row_stats(query, *setup, out=out), grid.save(*setup[:3]) if keep else None


_ROWS_BLOCK = 64  # sorted queries a program of radius_grad_rows_kernel takes


def radius_aggregate_backward(grad_out, query, ref, features, out, radius, sigma, query_lengths, ref_lengths,
                              query_grad=True, ref_grad=True, stats=None, saved_grid=None):
    """(grad_query, grad_ref, grad_features) of contiguous inputs, deterministic: no atomics.
    Without query_grad the query-side kernel does not run (grad_query is zeros); without
    ref_grad the reference-side one sums the feature gradients only (grad_ref is zeros).
    ``stats``: the forward's (``radius_aggregate``), read in the sorted order instead of a
    second aggregation pass (the grid of the same clouds sorts them the same way);
    ``saved_grid``: the forward's grid record, which spares building the grid again."""
    batch, rows, dim = query.shape
    columns, channels = ref.shape[1], features.shape[-1]
    grad_query = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    grad_ref = torch.zeros(ref.shape, dtype=torch.float32, device=ref.device)
    grad_features = torch.zeros(features.shape, dtype=torch.float32, device=features.device)
    if batch * rows * columns * channels > 0:
        frame, queries, refs, sorted_features, common, sizes = _aggregate_setup(
            query, ref, features, query_lengths, ref_lengths, radius, sigma, saved_grid)
        if stats is None:
            row_min, row_sum = _row_stats(query, frame, queries, refs, sorted_features, common, sizes)
        else:
            row_min, row_sum = (torch.empty((batch * rows,), dtype=torch.float32, device=query.device)
                                for _ in range(2))
        sorted_grad = torch.empty((batch * rows, channels), dtype=torch.float32, device=query.device)
        delta = torch.empty((batch * rows,), dtype=torch.float32, device=query.device)
        kernels.radius_grad_rows_kernel[(cdiv(batch * rows, _ROWS_BLOCK),)](
            grad_out.contiguous(), out.contiguous(), stats.contiguous() if stats is not None else delta,
            queries.order, frame.values, sorted_grad, delta, row_min, row_sum, batch * rows, rows, channels,
            STATS=stats is not None, CP=sizes["CP"], BLOCK=_ROWS_BLOCK)
        terms = (sorted_features, sorted_grad, row_min, row_sum, delta, frame.values, frame.shape)
        sizes = dict(sizes, DP=next_power_of_2(dim))
        clouds = (queries.points, queries.order, queries.bucket_start, queries.within, refs.points, refs.order,
                  refs.bucket_start, refs.within)
        (query_m, query_n), (ref_m, ref_n), warps = GRAD_BLOCKS
        programs = cdiv(columns, ref_n) + (cdiv(rows, query_m) if query_grad else 0)
        kernels.radius_grad_kernel[(programs, batch)](
            *clouds, *terms, grad_query, grad_ref, grad_features, rows, columns, **common, PULLS=ref_grad, **sizes,
            QUERY_BLOCK_M=query_m, QUERY_BLOCK_N=query_n, REF_BLOCK_M=ref_m, REF_BLOCK_N=ref_n, LANES=SEGMENT_LANES,
            PRECISION=GRAD_PRECISION, num_warps=warps)
    return grad_query.to(query.dtype), grad_ref.to(ref.dtype), grad_features.to(features.dtype)


_KNN_BLOCK_M, _PAIR_BLOCK_R = 32, 64
# Pairs a reference row reads at once in pair_sum_kernel: its rows are a chain of dependent loads
# (slot, then weight and source row) a pair, latency-bound one at a time.
_PAIR_UNROLL = 4
_PAIR_KEYS_BLOCK = 1024


def _width(size: int) -> int:
    return max(16, next_power_of_2(max(size, 1)))


def knn_aggregate(query, ref, features, k, sigma, query_lengths, ref_lengths):
    """``pairs.Kernels.knn_aggregate`` (contiguous inputs): (out, dists, idx)."""
    dists, idx, _ = nearest(query, ref, k, math.inf, query_lengths, ref_lengths)
    batch, rows = query.shape[:2]
    columns, channels = ref.shape[1], features.shape[-1]
    out = torch.empty((batch, rows, channels), dtype=features.dtype, device=query.device)
    if out.numel() and k:
        kernels.knn_aggregate_kernel[(cdiv(batch * rows, _KNN_BLOCK_M),)](
            dists, idx, features, out, batch * rows, rows, columns, channels, 1.0 / sigma,
            K=k, KP=next_power_of_2(k), CP=_width(channels), BLOCK_M=_KNN_BLOCK_M)
    elif out.numel():
        out.zero_()
    return out, dists, idx


def sum_pairs_by_ref(idx, weights, source, columns, per_slot=False):
    """For neighbour lists idx [B, M, k] and per-slot weights [B*M*k]: per flat reference
    row (sum of weights * source row of the slot's query [B*M, W] (of the slot [B*M*k, W]
    when ``per_slot``), sum of weights), both float32 and deterministic: slots are sorted by
    reference (stably), then summed in order."""
    batch, rows, k = idx.shape
    refs = batch * columns
    # 32-bit keys where they fit: a radix sort of half the passes.
    key_dtype = torch.int32 if refs < 2**31 - 1 else torch.int64
    keys = torch.empty((idx.numel(),), dtype=key_dtype, device=idx.device)
    if keys.numel():
        kernels.pair_keys_kernel[(cdiv(keys.numel(), _PAIR_KEYS_BLOCK),)](
            idx, keys, keys.numel(), rows, columns, refs, K=k, BLOCK=_PAIR_KEYS_BLOCK)
    sorted_refs, order = torch.sort(keys, stable=True)
    starts = grid.lower_bounds(sorted_refs, refs + 1)[0]
    width = source.shape[-1]
    sums = torch.empty((refs, width), dtype=torch.float32, device=idx.device)
    totals = torch.empty((refs,), dtype=torch.float32, device=idx.device)
    if refs and width:  # (no columns: nothing to sum; Triton 3.6 also fails to compile a width of 0)
        kernels.pair_sum_kernel[(cdiv(refs, _PAIR_BLOCK_R),)](
            order, starts, weights, source, sums, totals, refs, width, K=k, WP=_width(width), BLOCK_R=_PAIR_BLOCK_R,
            PER_SLOT=per_slot, UNROLL=_PAIR_UNROLL)
    elif refs:
        sums.zero_()
        totals.zero_()
    return sums, totals


def knn_aggregate_backward(grad_out, features, out, dists, idx, sigma, dists_grad=True):
    """(grad_dists [B, M, k], grad_features [B, N, C]) of ``knn_aggregate``, deterministic;
    without ``dists_grad`` the kernel writes the weights alone (grad_dists zeros)."""
    batch, rows, k = idx.shape
    columns, channels = features.shape[1], features.shape[-1]
    written = batch * rows * k > 0 and channels > 0  # by the kernel, every slot; else zeros
    allocate = torch.empty if written else torch.zeros
    grad_dists = allocate((batch, rows, k), dtype=torch.float32, device=idx.device)
    weights = allocate((batch * rows * k,), dtype=torch.float32, device=idx.device)
    grad_out = grad_out.contiguous()
    if written:
        kernels.knn_grad_dists_kernel[(cdiv(batch * rows, _KNN_BLOCK_M),)](
            dists, idx, features, grad_out, out, grad_dists, weights, batch * rows, rows, columns, channels,
            1.0 / sigma, K=k, KP=next_power_of_2(k), CP=_width(channels), BLOCK_M=_KNN_BLOCK_M,
            DISTS=dists_grad)
    grad_features, _ = sum_pairs_by_ref(idx, weights, grad_out.reshape(batch * rows, channels), columns)
    return grad_dists.to(dists.dtype), grad_features.reshape(features.shape).to(features.dtype)


def distances_backward(grad_dists, query, ref, idx, dists):
    """(grad_query, grad_ref) of neighbour distances [B, M, k], deterministic: the query
    side sums each row's k slots, the reference side sums its slots in sorted order."""
    batch, rows, k = idx.shape
    columns, dim = ref.shape[1], ref.shape[-1]
    qi, rj, found = pairs.neighbor_pairs(idx, columns)
    flat_query = query.reshape(-1, dim).to(torch.float32)
    flat_ref = ref.reshape(-1, dim).to(torch.float32)
    if flat_query.shape[0] == 0 or flat_ref.shape[0] == 0:
        return torch.zeros_like(query), torch.zeros_like(ref)
    # Recomputed in float32: the saved distances may be rounded to bf16/fp16.
    offset = flat_query[qi] - flat_ref[rj]
    d = torch.where(found & torch.isfinite(dists.reshape(-1)), pairs.pair_distances(flat_query[qi], flat_ref[rj]),
                    math.inf)
    usable = (d > 0) & torch.isfinite(d)
    scale = torch.where(usable, grad_dists.reshape(-1).to(torch.float32) / torch.where(usable, d, 1.0), 0.0)
    grad_query = pairs.weighted(scale, offset).reshape(batch, rows, k, dim).sum(2)
    # Each reference sums its slots' own offsets: r * sum(scale) - sum(scale * q) would cancel
    # catastrophically for near-coincident points (scale ~ 1 / d).
    pulled, _ = sum_pairs_by_ref(idx, scale.contiguous(), offset.contiguous(), columns, per_slot=True)
    return grad_query.to(query.dtype), (-pulled).reshape(ref.shape).to(ref.dtype)


def nearest_but_self(points, k, lengths):
    """``pairs.Kernels.nearest_but_self`` with lists of k, not k + 1 (a 16-wide list, not
    32-wide, for knn_graph's k = 16): the search skips each point itself. Lists whose k-th
    distance is 0 may have k + 1 duplicates of smaller index ahead of the point (which then
    keeps k + 1 others): those rows are searched again with k + 1 slots."""
    dists, idx, _ = nearest(points, points, k, math.inf, lengths, lengths, skip_self=True)
    lists = torch.cat([idx, idx.new_full((*idx.shape[:2], 1), -1)], -1)
    crowded = dists[..., -1] == 0
    if bool(crowded.any()):  # the caller reads the edge count back anyway
        _, full, _ = nearest(points, points, k + 1, math.inf, lengths, lengths, needed=crowded)
        lists = torch.where(crowded[..., None], pairs.without_self(full), lists)
    return lists


class GridKernels(pairs.Kernels):
    saved_grid_size = staticmethod(saved_grid_size)
    nearest = staticmethod(nearest)
    nearest_but_self = staticmethod(nearest_but_self)
    distances_backward = staticmethod(distances_backward)
    knn_aggregate = staticmethod(knn_aggregate)
    knn_aggregate_backward = staticmethod(knn_aggregate_backward)
    radius_aggregate = staticmethod(radius_aggregate)
    radius_aggregate_backward = staticmethod(radius_aggregate_backward)


BACKEND = Backend(
    "triton", ops=("knn", "radius", "knn_aggregate", "radius_aggregate"), devices=_triton.devices(),
    dtypes=(torch.float16, torch.bfloat16, torch.float32), auto_devices=("cuda",), max_k=MAX_K,
    install=_triton.INSTALL, available=_triton.available, implementation=GridKernels(),
    note='computes in float32 (use backend="torch" for float64)',
)
