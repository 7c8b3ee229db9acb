"""CPU backend: a k-d tree per batch item (scipy's cKDTree), queried on all cores.

The tree queries are fullgraph.extern ops (library="numpy": tensors reach SciPy without
copies). The tree proposes candidates in float64; distances are then recomputed with the
reference's arithmetic (``pairs.pair_distances``) so that radius membership, order and
ties agree with the reference, and exact ties at the k-th place are widened to every tied
reference so that the smaller index wins. Within one backend call each item's tree is
built once and shared by its queries (``_tree_scope``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import math
import threading
from collections.abc import Iterator

import numpy as np
import torch

from .... import extern
from ....backends import Backend
from .. import pairs, reference
from . import native as select

# Candidate searches use a radius a hair larger than asked (the exact test follows): more
# than the relative error of a float32 distance in D dimensions, (D + 2) * 2^-24, can be.
_trees = threading.local()


_HAVE_SCIPY = importlib.util.find_spec("scipy") is not None


def _spatial():
    from scipy import spatial  # present: the backend is only resolved with scipy installed

    return spatial


@contextlib.contextmanager
def _tree_scope():
    """Trees built inside are cached by the address of their points until the scope ends."""
    outer = getattr(_trees, "cache", None)
    _trees.cache = {}
    try:
        yield
    finally:
        _trees.cache = outer


# Queries a tree answers, as a fraction of its points, up to which it is built for a fast build
# (midpoint splits, nodes not shrunk to their points) rather than fast queries.
FAST_BUILD_QUERIES = 0.25


def _tree(points: np.ndarray, queries: int):
    """The k-d tree of ``points`` [N, D] (cached inside ``_tree_scope``), for ``queries`` queries."""
    cache = getattr(_trees, "cache", None)
    key = (points.__array_interface__["data"][0], points.shape)
    if cache is not None and key in cache:
        return cache[key][1]
    fast_build = queries <= FAST_BUILD_QUERIES * len(points)
    tree = _spatial().cKDTree(points, balanced_tree=not fast_build, compact_nodes=not fast_build)
    if cache is not None:
        cache[key] = (points, tree)  # holding the points keeps their address theirs
    return tree


# Queries from which a tree query runs on every core: below, starting and joining the threads costs
# more than they save.
PARALLEL_QUERIES = 4096


def _workers(points: np.ndarray) -> int:
    return -1 if len(points) >= PARALLEL_QUERIES else 1


# Batch items of up to this many query-reference pairs are searched by brute force, where the trees'
# per-item work costs more: every pair measured in C++ (``brute_force``).
BRUTE_FORCE_MAX_PAIRS = 2**22
# ... and radius_pairs (the aggregations) takes the reference's pairs up to this many.
PAIRS_BRUTE_FORCE_MAX_PAIRS = 2**18
# ... and radius_aggregate of items of up to this many pairs sums over whole blocks of measured
# pairs in C++ (``select.weighted_sums`` and its backward), where the pairs cost ~20 torch operators
# a chunk.
DENSE_AGGREGATE_MAX_PAIRS = 2**17
# Calls of at most TINY_MAX_WORK pair-coordinates (B M N D) are tiny: fixed costs outweigh the
# work, and "auto" answers them with the brute force's one C++ call (``tiny_knn``) ahead of the
# operator layers (1 x 10 x 10 D=64, 2-core CPU: 0.075 -> 0.03 ms; cdist + topk 0.015).
TINY_MAX_WORK = 2**16
# Without the C++ extension "auto" leaves items of up to this many pairs to the reference ("torch"),
# whose brute force beat the trees there.
AUTO_MIN_PAIRS = 2**17


def _auto(device_type, dtype, dim, k, size=None) -> bool:
    return size is None or size > AUTO_MIN_PAIRS or select.available()


@extern.op("fullgraph::kdtree_knn", "(Tensor ref, Tensor points, int k, float reach) -> Tensor",
           outputs=lambda ref, points, k, reach: [((points.shape[0], k), torch.int64)])
def _kdtree_knn(ref, points, k, reach):
    """[Q, k] rows of ``ref`` [N, D] nearest to ``points`` [Q, D] within ``reach`` (-1: none)."""
    _, local = _tree(ref, len(points)).query(points, k=k, distance_upper_bound=reach, workers=_workers(points))
    local = local.reshape(len(points), k)
    return np.where(local < len(ref), local, -1).astype(np.int64)


@extern.op("fullgraph::kdtree_ball_counts", "(Tensor ref, Tensor points, float radius) -> Tensor",
           outputs=lambda ref, points, radius: [((points.shape[0],), torch.int64)])
def _kdtree_ball_counts(ref, points, radius):
    """[Q] int64: how many rows of ``ref`` lie within ``radius`` of each point."""
    counts = _tree(ref, len(points)).query_ball_point(points, radius, return_length=True, workers=_workers(points))
    return counts.astype(np.int64)


@extern.op("fullgraph::kdtree_ball", "(Tensor ref, Tensor points, float radius, SymInt total) -> Tensor",
           outputs=lambda ref, points, radius, total: [((total,), torch.int64)])
def _kdtree_ball(ref, points, radius, total):
    """[total] int64: the rows of ``ref`` within ``radius`` of each point, point after point."""
    balls = _tree(ref, len(points)).query_ball_point(points, radius, workers=_workers(points))
    # One pass over the lists' items (an array a list cost ~2 us: 1,728 short lists 3.6-9 ms -> 1.6)
    return np.fromiter(itertools.chain.from_iterable(balls), dtype=np.int64)  # extern checks its length


def _slack(dim: int) -> float:
    return max(1e-6, 8 * (dim + 2) * 2.0**-24)


def _widened(radius: float, dim: int) -> float:
    return radius * (1 + _slack(dim)) + 1e-30 if math.isfinite(radius) else math.inf


def _counts_within(query_b, ref_b, query_ids, points, ref_ids, ref_points, radius):
    """[Q] int64: references whose distance, computed as the list computes it, is <= radius.
    The tree counts balls a hair inside and outside; only queries where the two differ
    (a reference near the sphere) have their shell measured exactly."""
    dim = points.shape[-1]
    outer = _kdtree_ball_counts(ref_points, points, _widened(radius, dim))
    counts = _kdtree_ball_counts(ref_points, points, max(0.0, radius * (1 - _slack(dim)) - 1e-30))
    unsure = (outer != counts).nonzero()[:, 0]
    if len(unsure):
        sizes = outer[unsure]
        members = _kdtree_ball(ref_points, points[unsure], _widened(radius, dim), int(sizes.sum()))
        rows = torch.repeat_interleave(torch.arange(len(unsure)), sizes)
        d = pairs.pair_distances(query_b[query_ids[unsure][rows]], ref_b[ref_ids[members]])
        counts[unsure] = torch.zeros(len(unsure), dtype=torch.int64).index_add_(0, rows, (d <= radius).long())
    return counts


def _items(query, ref, query_lengths, ref_lengths):
    """Per batch item: (b, query row ids, their float64 points, ref row ids, their float64 points)."""
    query_ok = pairs.valid_points(query, query_lengths)
    ref_ok = pairs.valid_points(ref, ref_lengths)
    query64, ref64 = query.detach().to(torch.float64), ref.detach().to(torch.float64)
    for b in range(query.shape[0]):
        query_ids, ref_ids = query_ok[b].nonzero()[:, 0], ref_ok[b].nonzero()[:, 0]
        if len(query_ids) and len(ref_ids):
            yield b, query_ids, query64[b, query_ids], ref_ids, ref64[b, ref_ids]


def _exact_distances(query_b, ref_b, query_ids, candidates):
    """Reference-arithmetic distances [Q, c] to candidate ref ids (-1 = none, gives inf)."""
    found = candidates >= 0
    rows = query_ids[:, None].expand_as(candidates)
    d = pairs.pair_distances(query_b[rows], ref_b[candidates.clamp_min(0)])
    return d.masked_fill(~found, math.inf)


def nearest(query, ref, k, radius, query_lengths, ref_lengths):
    """``pairs.Kernels.nearest`` on CPU tensors: small items by brute force, else the trees."""
    if _small(query, ref, BRUTE_FORCE_MAX_PAIRS):
        found = brute_force(query, ref, k, radius, query_lengths, ref_lengths)
        if found is not None:
            return found
    batch, rows, _ = query.shape
    acc = pairs.accumulation_dtype(query.dtype)
    dists = torch.full((batch, rows, k), math.inf, dtype=acc)
    idx = torch.full((batch, rows, k), -1, dtype=torch.int64)
    counts = torch.zeros((batch, rows), dtype=torch.int64)
    with _tree_scope():
        for b, query_ids, points, ref_ids, ref_points in _items(query, ref, query_lengths, ref_lengths):
            wanted = min(k + 1, len(ref_ids))
            local = _kdtree_knn(ref_points, points, wanted, _widened(radius, points.shape[-1]))
            candidates = torch.where(local >= 0, ref_ids[local.clamp_min(0)], -1)
            d = _exact_distances(query[b], ref[b], query_ids, candidates)
            outside = d > radius
            d, candidates = pairs.order_by_distance(d.masked_fill(outside, math.inf),
                                                        candidates.masked_fill(outside, -1))
            if wanted == k + 1:
                tied = (candidates[:, k] >= 0) & (d[:, k] == d[:, k - 1])
                for row in tied.nonzero()[:, 0].tolist():
                    d[row, :k], candidates[row, :k] = _widen_tie(
                        query[b], ref[b], query_ids[row : row + 1], points[row : row + 1], ref_ids, ref_points,
                        float(d[row, k]), k, radius)
            take = min(k, wanted)
            dists[b, query_ids, :take] = d[:, :take]
            idx[b, query_ids, :take] = candidates[:, :take]
            if math.isfinite(radius):
                counts[b, query_ids] = _counts_within(query[b], ref[b], query_ids, points, ref_ids, ref_points, radius)
    if not math.isfinite(radius):
        counts = (idx >= 0).sum(-1)
    return dists.to(query.dtype), idx, counts


def _small(query, ref, most: int) -> bool:
    """Whether a batch item's query-reference pairs are at most ``most``."""
    return query.shape[1] * ref.shape[1] <= most


def _measured(query, ref, radius, query_lengths, ref_lengths):
    """Every pair of small items measured (the reference's distances, bit for bit: the squares
    by ``select.squared_distances_all``, torch's square root), in blocks of whole items:
    yields (items, rows, d [g, m, N] in units of the item's scale, query_ok [g, m], ref_ok
    [g, N], within [g]: the radius in those units, scale [g, 1, 1]); yields None first where
    the extension does not run."""
    query_ok, query_largest = pairs.valid_points_and_largest(query, query_lengths)
    ref_ok, ref_largest = pairs.valid_points_and_largest(ref, ref_lengths)
    scale = reference.item_scales(query_largest, ref_largest, query.dtype)
    within = reference.radius_in_units(radius, scale)
    within = (torch.full_like(scale, math.inf) if within is None else within).reshape(-1)
    q, r = query.to(scale.dtype) / scale, ref.to(scale.dtype) / scale
    (batch, rows, _), columns = query.shape, ref.shape[1]
    for items, chunk in reference.item_blocks(batch, rows, columns, 0, query.device):
        squares = select.squared_distances_all(q[items, chunk], r[items])
        if squares is None:
            yield None
            return
        yield items, chunk, squares.sqrt_(), query_ok[items, chunk], ref_ok[items], within[items], scale[items]


def brute_force(query, ref, k, radius, query_lengths, ref_lengths):
    """``nearest`` by measuring every pair (``_measured``), then masking, counting and
    selection by ``select.nearest_within``; None without the extension."""
    acc = pairs.accumulation_dtype(query.dtype)
    (batch, rows, _), columns = query.shape, ref.shape[1]
    take = min(k, columns)
    if radius == math.inf and query_lengths is None and ref_lengths is None:
        found = _in_one_call(select.nearest_small, query, ref, k)  # (the same)
        if found is not None:
            return found
    dists = torch.full((batch, rows, k), math.inf, dtype=acc)
    idx = torch.full((batch, rows, k), -1, dtype=torch.int64)
    counts = torch.zeros((batch, rows), dtype=torch.int64)
    for block in _measured(query, ref, radius, query_lengths, ref_lengths):
        if block is None:
            return None
        items, chunk, d, query_ok, ref_ok, within, scale = block
        values, order, counts[items, chunk] = select.nearest_within(d, query_ok, ref_ok, within, take)
        dists[items, chunk, :take], idx[items, chunk, :take] = reference.found_lists(values, order, scale)
    return dists.to(query.dtype), idx, counts


def _padded(dists, idx, k):
    """Lists [B, M, take] widened to k slots with +inf / -1."""
    take = dists.shape[-1]
    if take == k:
        return dists, idx
    return (torch.nn.functional.pad(dists, (0, k - take), value=math.inf),
            torch.nn.functional.pad(idx, (0, k - take), value=-1))


TINY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def tiny(query, ref, query_lengths, ref_lengths) -> bool:
    """Whether clouds query [B, M, D] and ref [B, N, D] of one dtype make a tiny plain call:
    CPU floating, no lengths, at most TINY_MAX_WORK pair-coordinates, where "auto" takes
    this backend (``tiny_knn`` answers it)."""
    batch, rows, dim = query.shape
    return (query_lengths is None and ref_lengths is None and query.device.type == "cpu"
            and ref.device.type == "cpu" and query.dtype in TINY_DTYPES and dim >= 1
            and batch * rows * ref.shape[1] * dim <= TINY_MAX_WORK and BACKEND.available("cpu"))


def tiny_knn(query, ref, k):
    """(dists, idx) [B, M, k] of plain clouds query [B, M, D] and ref [B, N, D] (CPU floating
    of one dtype, D >= 1, no lengths, 1 <= k; the caller checked them) as ``nearest`` finds
    them, by the brute force's one C++ call (float16 / bfloat16 measured in float32); None where
    the extension does not run."""
    if not select.available():
        return None
    return tiny_lists(query, ref, k)


def tiny_lists(query, ref, k):
    """``tiny_knn`` where the extension is known to run: torch operators and the brute force's
    C++ operator alone, which torch.compile traces into a graph."""
    return _in_one_call(select.nearest_small_unchecked, query, ref, k)[:2]


def _in_one_call(nearest_small, query, ref, k):
    """(dists, idx [B, M, k], counts [B, M]) of plain clouds by the brute force's one C++ call
    ``nearest_small`` (checked or not), float16 / bfloat16 measured in float32 as the reference
    measures them; None where it does not run."""
    acc = pairs.accumulation_dtype(query.dtype)
    found = nearest_small(query.to(acc), ref.to(acc), min(k, ref.shape[1]))
    if found is None:
        return None
    dists, idx = _padded(*found[:2], k)
    return dists.to(query.dtype), idx, found[2]


def _pair_blocks(query, ref, radius, query_lengths, ref_lengths):
    """``_measured`` as (items, rows, distances [g, m, N], ok [g, m, N]: the valid pairs within
    the radius); None first without the extension."""
    for block in _measured(query, ref, radius, query_lengths, ref_lengths):
        if block is None:
            yield None
            return
        items, chunk, d, query_ok, ref_ok, within, scale = block
        ok = query_ok[..., None] & ref_ok[:, None, :] & (d <= within[:, None, None])
        yield items, chunk, d * scale, ok


def _widen_tie(query_b, ref_b, query_id, point, ref_ids, ref_points, tie_distance, k, radius):
    """Resolve a tie at the k-th place: every reference at the tied distance competes."""
    reach = _widened(tie_distance, point.shape[-1])
    members = _kdtree_ball(ref_points, point, reach, int(_kdtree_ball_counts(ref_points, point, reach).sum()))
    candidates = ref_ids[members][None, :]
    d = _exact_distances(query_b, ref_b, query_id, candidates)
    candidates = candidates.masked_fill(d > min(tie_distance, radius), -1)
    d, candidates = pairs.order_by_distance(d.masked_fill(candidates < 0, math.inf), candidates)
    padding = max(0, k - candidates.shape[1])
    d = torch.nn.functional.pad(d[0, :k], (0, padding), value=math.inf)
    return d, torch.nn.functional.pad(candidates[0, :k], (0, padding), value=-1)


def radius_pairs(query, ref, radius, query_lengths, ref_lengths) -> Iterator:
    """``pairs.Kernels.radius_pairs``; chunks bounded by pair count. Small items: the
    reference's pairs (its batched distance blocks cost less than a tree an item)."""
    if _small(query, ref, PAIRS_BRUTE_FORCE_MAX_PAIRS):
        yield from reference.radius_pairs(query, ref, radius, query_lengths, ref_lengths)
        return
    budget = max(1, pairs.BLOCK_BYTES // 64)
    reach = _widened(radius, query.shape[-1])
    with _tree_scope():
        for b, query_ids, points, ref_ids, ref_points in _items(query, ref, query_lengths, ref_lengths):
            sizes = _kdtree_ball_counts(ref_points, points, reach)
            ends = torch.cumsum(sizes, 0)
            start = 0
            while start < len(query_ids):
                limit = ends[start] - sizes[start] + budget
                stop = max(start + 1, int(torch.searchsorted(ends, limit, right=True)))
                lengths = sizes[start:stop]  # counted once above, not again per chunk
                members = _kdtree_ball(ref_points, points[start:stop], reach, int(lengths.sum()))
                qi = torch.repeat_interleave(query_ids[start:stop], lengths)
                rj = ref_ids[members]
                d = pairs.pair_distances(query[b][qi], ref[b][rj])
                keep = d <= radius
                yield b, slice(0, query.shape[1]), qi[keep], rj[keep], d[keep]
                start = stop


class KDTreeKernels(pairs.Kernels):
    nearest = staticmethod(nearest)
    radius_pairs = staticmethod(radius_pairs)

    def radius_aggregate(self, query, ref, features, radius, sigma, query_lengths, ref_lengths):
        """Small items over whole blocks of pairs (``select.weighted_sums``), else the pairs."""
        if _small(query, ref, DENSE_AGGREGATE_MAX_PAIRS) and select.available():
            acc = pairs.accumulation_dtype(query.dtype)
            out = torch.zeros((*query.shape[:2], features.shape[-1]), dtype=acc)
            for block in _pair_blocks(query, ref, radius, query_lengths, ref_lengths):
                if block is None:  # the measuring op does not run here
                    return super().radius_aggregate(query, ref, features, radius, sigma, query_lengths, ref_lengths)
                items, rows, d, ok = block
                out[items, rows] = select.weighted_sums(d, ok, features[items].to(acc), sigma)
            return out.to(features.dtype), None, None
        return super().radius_aggregate(query, ref, features, radius, sigma, query_lengths, ref_lengths)

    def radius_aggregate_backward(self, grad_out, query, ref, features, out, radius, sigma, query_lengths,
                                  ref_lengths, query_grad=True, ref_grad=True, stats=None, saved_grid=None):
        if _small(query, ref, DENSE_AGGREGATE_MAX_PAIRS) and select.available():
            acc = pairs.accumulation_dtype(query.dtype)
            grads = [torch.zeros(t.shape, dtype=acc) for t in (query, ref, features)]
            for block in _pair_blocks(query, ref, radius, query_lengths, ref_lengths):
                if block is None:
                    break
                items, rows, d, ok = block
                found = select.weighted_sums_backward(
                    d, ok, features[items].to(acc), query[items, rows].to(acc), ref[items].to(acc),
                    grad_out[items, rows].to(acc), out[items, rows].to(acc), sigma)
                grads[0][items, rows] += found[0]
                grads[1][items] += found[1]
                grads[2][items] += found[2]
            else:
                return tuple(g.to(t.dtype) for g, t in zip(grads, (query, ref, features)))
        return super().radius_aggregate_backward(grad_out, query, ref, features, out, radius, sigma, query_lengths,
                                                 ref_lengths, query_grad, ref_grad, stats, saved_grid)


BACKEND = Backend(
    "cpu", ops=("knn", "radius", "knn_aggregate", "radius_aggregate"), devices=("cpu",), auto_devices=("cpu",),
    install='scipy: pip install "fullgraph[cpu]"', available=lambda device: _HAVE_SCIPY, implementation=KDTreeKernels(),
    auto_when=_auto,
)
