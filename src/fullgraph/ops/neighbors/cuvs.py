"""cuVS backend for knn and knn_aggregate: RAPIDS cuVS's brute-force kNN (what cuML's
NearestNeighbors runs), on PyTorch's stream.

cuVS proposes ``k + CANDIDATE_SLACK`` candidates per query from squared distances expanded
as |q|^2 + |r|^2 - 2 q.r in float32 (which may misorder near-equal ones, and loses the
distances where |q|^2 dwarfs them); fullgraph measures them again in the reference's
arithmetic and orders them by (distance, index) (``pairs.reranked``). The lists are then
exact where dense's certificate proves them (``dense.beyond_expansion``: no reference
outside the candidates can be nearer than, or tie with, the k-th), and the rows it cannot
prove (ties wider than the slack, far-off clouds) are searched again by the reference: the
results are the reference's, as from every backend. The candidate search is a fullgraph.extern op
(library="cupy") declared ``cuda_graphs="tag"``: cuVS allocates its temporaries through
RMM's own resource, so torch.compile keeps it out of its CUDA graphs and a capture of the
op is refused with an error. Batch items are searched one after another, each over its
valid references only (an item of at most ``k + CANDIDATE_SLACK`` takes them all).
"""

from __future__ import annotations

import importlib.util
import math

import torch

from ... import extern
from ...backends import Backend
from . import dense, pairs, reference

CANDIDATE_SLACK = 8


@extern.op("fullgraph::cuvs_knn_candidates",
           "(Tensor query, Tensor ref, Tensor query_ok, Tensor ref_ok, int count) -> (Tensor, Tensor)",
           outputs=lambda query, ref, query_ok, ref_ok, count: [((*query.shape[:2], count), torch.int64),
                                                                ((*query.shape[:2], count), torch.float32)],
           library="cupy", cuda_graphs="tag")
def _candidates(query, ref, query_ok, ref_ok, count):
    """float32 query [B, M, D], ref [B, N, D] -> [B, M, count] candidate references per valid
    query (int64, -1 where none) and their squared distances as cuVS expands them (+inf where
    none; the last is +inf where every valid reference is a candidate)."""
    import cupy
    from cuvs.common import Resources
    from cuvs.neighbors import brute_force

    resources = Resources(stream=extern.current_stream().ptr)
    out = cupy.full((*query.shape[:2], count), -1, dtype=cupy.int64)
    values = cupy.full((*query.shape[:2], count), math.inf, dtype=cupy.float32)
    for b in range(query.shape[0]):
        queries, refs = cupy.flatnonzero(query_ok[b]), cupy.flatnonzero(ref_ok[b])
        if queries.size == 0 or refs.size == 0:
            continue
        if refs.size <= count:  # every valid reference is a candidate: nothing to search
            out[b, queries, :refs.size] = refs
            continue
        every_query, every_ref = queries.size == query.shape[1], refs.size == ref.shape[1]
        points = ref[b] if every_ref else cupy.ascontiguousarray(ref[b][refs])
        asked = query[b] if every_query else cupy.ascontiguousarray(query[b][queries])
        neighbors = cupy.empty((asked.shape[0], count), dtype=cupy.int64)
        distances = cupy.empty((asked.shape[0], count), dtype=cupy.float32)
        index = brute_force.build(points, metric="sqeuclidean", resources=resources)
        brute_force.search(index, asked, count, neighbors=neighbors, distances=distances, resources=resources)
        out[b, queries] = neighbors if every_ref else refs[neighbors]
        values[b, queries] = distances
    return out, values


def nearest(query, ref, k, radius, query_lengths, ref_lengths):
    """``pairs.Kernels.nearest`` for plain kNN (radius = inf): the candidates re-ranked, the
    rows the certificate cannot prove searched again by the reference (one host read)."""
    count = min(k + CANDIDATE_SLACK, ref.shape[1])
    query_ok = pairs.valid_points(query, query_lengths)
    ref_ok = pairs.valid_points(ref, ref_lengths)
    # Centred on the mean valid reference (|q|^2 no longer dwarfs the distances of a cloud far
    # from the origin), then in float32 for cuVS: the rounding of both steps moves a squared
    # distance by at most 2 u (|q| + R)^2, within the bound's factor 2; measured again unrounded.
    centre = (torch.where(ref_ok[..., None], ref.detach(), 0).sum(1, keepdim=True)
              / ref_ok.sum(1).clamp(min=1)[:, None, None])
    q32, r32 = (query.detach() - centre).float(), (ref.detach() - centre).float()
    candidates, values = _candidates(q32, r32, query_ok, ref_ok, count)
    dists, idx, counts = pairs.reranked(query, ref, k, candidates)
    reach = torch.where(ref_ok, r32.norm(dim=-1), 0).amax(1, keepdim=True)
    floor = dense.beyond_expansion(values[..., -1], q32.norm(dim=-1), reach, query.shape[-1], 2.0**-24)
    kth = dists[..., k - 1].detach().float()
    unproven = query_ok & ~((kth * kth < floor) | torch.isinf(values[..., -1]))
    if bool(unproven.any()):
        for b, rows in enumerate(unproven):
            rows = rows.nonzero()[:, 0]
            if rows.numel():
                lengths = None if ref_lengths is None else ref_lengths[b:b + 1]
                d, i, c = reference.nearest(query[b:b + 1, rows], ref[b:b + 1], k, math.inf, None, lengths)
                dists[b, rows], idx[b, rows], counts[b, rows] = d[0].to(dists.dtype), i[0], c[0]
    return dists, idx, counts


class CuvsKernels(pairs.Kernels):
    nearest = staticmethod(nearest)


_HAVE_CUVS = importlib.util.find_spec("cuvs") is not None
BACKEND = Backend(
    "cuvs", ops=("knn", "knn_aggregate"), devices=("cuda",), dtypes=(torch.float32, torch.float64),
    capturable=False, install='cuvs: pip install "fullgraph[cuvs]" (RAPIDS cuVS, CUDA 13)',
    available=lambda device: _HAVE_CUVS, implementation=CuvsKernels(),
)
