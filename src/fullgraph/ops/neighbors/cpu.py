"""CPU backend: a k-d tree per batch item (scipy's cKDTree), queried on all cores.

The tree proposes candidates in float64; distances are then recomputed with the
reference's arithmetic (``reference.pair_distances``) so that radius membership,
order and ties agree with the reference, and exact ties at the k-th place are widened
to every tied reference so that the smaller index wins.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from . import reference

# Candidate searches use a radius a hair larger than asked; the exact test follows.
_SLACK = 1e-6


def _spatial():
    try:
        from scipy import spatial
    except ImportError as error:  # pragma: no cover - scipy is a test dependency
        raise ImportError(
            'backend="cpu" needs scipy: pip install "fullgraph[cpu]" (or pip install scipy)'
        ) from error
    return spatial


def _widened(radius: float) -> float:
    return radius * (1 + _SLACK) + 1e-30 if math.isfinite(radius) else math.inf


def _items(query, ref, query_lengths, ref_lengths):
    """Per batch item: (b, query row ids, valid query points, ref row ids, cKDTree or None)."""
    spatial = _spatial()
    query_ok = reference.valid_points(query, query_lengths).numpy()
    ref_ok = reference.valid_points(ref, ref_lengths).numpy()
    query64 = query.detach().to(torch.float64).numpy()
    ref64 = ref.detach().to(torch.float64).numpy()
    for b in range(query.shape[0]):
        query_ids = np.flatnonzero(query_ok[b])
        ref_ids = np.flatnonzero(ref_ok[b])
        if len(query_ids) == 0 or len(ref_ids) == 0:
            continue
        tree = spatial.cKDTree(ref64[b, ref_ids])
        yield b, query_ids, query64[b, query_ids], ref_ids, tree


def _exact_distances(query_b, ref_b, query_ids, candidates):
    """Reference-arithmetic distances [Q, c] to candidate ref ids (-1 = none, gives inf)."""
    found = candidates >= 0
    safe = torch.from_numpy(np.where(found, candidates, 0))
    rows = torch.from_numpy(query_ids)[:, None].expand_as(safe)
    d = reference.pair_distances(query_b[rows], ref_b[safe])
    return d.masked_fill(~torch.from_numpy(found), math.inf).numpy()


def _order(d: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Row-wise permutation sorting by (distance, index), missing (-1) last."""
    index_key = np.where(candidates >= 0, candidates, np.iinfo(np.int64).max)
    return np.lexsort((index_key, d), axis=-1)


def nearest(query, ref, k, radius, query_lengths, ref_lengths):
    """Same contract as ``reference.nearest``."""
    batch, rows, _ = query.shape
    dists = np.full((batch, rows, k), np.inf, dtype=np.float64)
    idx = np.full((batch, rows, k), -1, dtype=np.int64)
    counts = np.zeros((batch, rows), dtype=np.int64)
    reach = _widened(radius)
    for b, query_ids, points, ref_ids, tree in _items(query, ref, query_lengths, ref_lengths):
        wanted = min(k + 1, len(ref_ids))
        _, local = tree.query(points, k=wanted, distance_upper_bound=reach, workers=-1)
        local = local.reshape(len(query_ids), wanted)
        candidates = np.where(local < len(ref_ids), ref_ids[np.minimum(local, len(ref_ids) - 1)], -1)
        d = _exact_distances(query[b], ref[b], query_ids, candidates)
        outside = d > radius
        d[outside], candidates[outside] = np.inf, -1
        order = _order(d, candidates)
        d = np.take_along_axis(d, order, -1)
        candidates = np.take_along_axis(candidates, order, -1)
        tied = np.zeros(len(query_ids), dtype=bool)
        if wanted == k + 1:
            tied = (candidates[:, k] >= 0) & (d[:, k] == d[:, k - 1])
        for row in np.flatnonzero(tied):
            d[row, :k], candidates[row, :k] = _widen_tie(query[b], ref[b], query_ids[row],
                                                          points[row], ref_ids, tree, d[row, k], k, radius)
        take = min(k, wanted)
        dists[b, query_ids, :take] = d[:, :take]
        idx[b, query_ids, :take] = candidates[:, :take]
        if math.isfinite(radius):
            counts[b, query_ids] = tree.query_ball_point(points, radius, return_length=True, workers=-1)
    counts_t = torch.from_numpy(counts)
    if not math.isfinite(radius):
        counts_t = (torch.from_numpy(idx) >= 0).sum(-1)
    return torch.from_numpy(dists).to(query.dtype), torch.from_numpy(idx), counts_t


def _widen_tie(query_b, ref_b, query_id, point, ref_ids, tree, tie_distance, k, radius):
    """Resolve a tie at the k-th place: every reference at the tied distance competes."""
    members = np.asarray(tree.query_ball_point(point, _widened(float(tie_distance))), dtype=np.int64)
    candidates = ref_ids[members][None, :]
    d = _exact_distances(query_b, ref_b, np.array([query_id]), candidates)
    candidates = np.where(d <= min(float(tie_distance), radius), candidates, -1)
    d = np.where(candidates >= 0, d, np.inf)
    order = _order(d, candidates)[0, :k]
    return d[0, order], candidates[0, order]


def radius_pairs(query, ref, radius, query_lengths, ref_lengths) -> Iterator:
    """Same contract as ``reference.radius_pairs``; chunks bounded by pair count."""
    budget = max(1, reference.BLOCK_BYTES // 64)
    reach = _widened(radius)
    for b, query_ids, points, ref_ids, tree in _items(query, ref, query_lengths, ref_lengths):
        sizes = tree.query_ball_point(points, reach, return_length=True, workers=-1)
        ends = np.cumsum(sizes)
        start = 0
        while start < len(query_ids):
            stop = max(start + 1, int(np.searchsorted(ends, ends[start] - sizes[start] + budget, "right")))
            balls = tree.query_ball_point(points[start:stop], reach, workers=-1)
            lengths = np.fromiter((len(ball) for ball in balls), dtype=np.int64, count=len(balls))
            qi = np.repeat(query_ids[start:stop], lengths)
            rj = ref_ids[np.concatenate([np.asarray(ball, dtype=np.int64) for ball in balls])] \
                if lengths.sum() else np.zeros(0, dtype=np.int64)
            qi_t, rj_t = torch.from_numpy(qi), torch.from_numpy(rj)
            d = reference.pair_distances(query[b][qi_t], ref[b][rj_t])
            keep = d <= radius
            yield b, slice(0, query.shape[1]), qi_t[keep], rj_t[keep], d[keep]
            start = stop
