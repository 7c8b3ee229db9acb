"""cuVS backend for knn and knn_aggregate: RAPIDS cuVS's brute-force kNN (what cuML's
NearestNeighbors runs), on PyTorch's stream.

cuVS proposes ``k + CANDIDATE_SLACK`` candidates per query from squared distances expanded
as |q|^2 + |r|^2 - 2 q.r (which may misorder near-equal ones); fullgraph measures them
again in the reference's arithmetic and orders them by (distance, index)
(``pairs.reranked``), so results follow the reference unless more than the slack's worth
of references tie at the k-th place. The candidate search is a fullgraph.extern op
(library="cupy") declared ``cuda_graphs="tag"``: cuVS allocates its temporaries through
RMM's own resource, so torch.compile keeps it out of its CUDA graphs and a capture of the
op is refused with an error. Batch items are searched one after another, each over its
valid references only.
"""

from __future__ import annotations

import importlib.util

import torch

from ... import extern
from ...backends import Backend
from . import pairs

CANDIDATE_SLACK = 8


@extern.op("fullgraph::cuvs_knn_candidates",
           "(Tensor query, Tensor ref, Tensor query_ok, Tensor ref_ok, int count) -> Tensor",
           outputs=lambda query, ref, query_ok, ref_ok, count: [((*query.shape[:2], count), torch.int64)],
           library="cupy", cuda_graphs="tag")
def _candidates(query, ref, query_ok, ref_ok, count):
    """[B, M, count] int64 candidate references per valid query (-1 where none)."""
    import cupy
    from cuvs.common import Resources
    from cuvs.neighbors import brute_force

    resources = Resources(stream=cupy.cuda.get_current_stream().ptr)  # PyTorch's (extern's cupy adapter)
    out = cupy.full((*query.shape[:2], count), -1, dtype=cupy.int64)
    for b in range(query.shape[0]):
        queries, refs = cupy.flatnonzero(query_ok[b]), cupy.flatnonzero(ref_ok[b])
        take = min(count, int(refs.size))
        if queries.size == 0 or take == 0:
            continue
        every_query, every_ref = queries.size == query.shape[1], refs.size == ref.shape[1]
        points = ref[b] if every_ref else cupy.ascontiguousarray(ref[b][refs])
        asked = query[b] if every_query else cupy.ascontiguousarray(query[b][queries])
        neighbors = cupy.empty((asked.shape[0], take), dtype=cupy.int64)
        distances = cupy.empty((asked.shape[0], take), dtype=cupy.float32)
        index = brute_force.build(points, metric="sqeuclidean", resources=resources)
        brute_force.search(index, asked, take, neighbors=neighbors, distances=distances, resources=resources)
        found = neighbors if every_ref else refs[neighbors]
        if every_query:
            out[b, :, :take] = found
        else:
            out[b, queries, :take] = found
    return out


def nearest(query, ref, k, radius, query_lengths, ref_lengths):
    """``pairs.Kernels.nearest`` for plain kNN (radius = inf)."""
    count = min(k + CANDIDATE_SLACK, ref.shape[1])
    query_ok = pairs.valid_points(query, query_lengths)
    ref_ok = pairs.valid_points(ref, ref_lengths)
    # cuVS takes float32 and float16; float64 points are proposed in float32 and re-measured in float64.
    candidates = _candidates(query.detach().float(), ref.detach().float(), query_ok, ref_ok, count)
    return pairs.reranked(query, ref, k, candidates)


class CuvsKernels(pairs.Kernels):
    nearest = staticmethod(nearest)


_HAVE_CUVS = importlib.util.find_spec("cuvs") is not None
BACKEND = Backend(
    "cuvs", ops=("knn", "knn_aggregate"), devices=("cuda",), dtypes=(torch.float32, torch.float64),
    capturable=False, install='cuvs: pip install "fullgraph[cuvs]" (RAPIDS cuVS, CUDA 13)',
    available=lambda device: _HAVE_CUVS, implementation=CuvsKernels(),
)
