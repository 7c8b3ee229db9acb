"""cuML backend for knn and knn_aggregate: RAPIDS cuML's NearestNeighbors, as in the tutorial.

cuML proposes ``k + CANDIDATE_SLACK`` candidates per query (its distances come from the
|q|^2 + |r|^2 - 2 q.r expansion, which may misorder near-equal ones); fullgraph measures
them again with the reference arithmetic and orders them by (distance, index), so results
follow the reference unless more than the slack's worth of references tie at the k-th
place. The candidate search is a fullgraph.extern op (library="cupy") declared
``cuda_graphs="tag"``: cuML allocates through RMM and synchronizes, so torch.compile keeps
it out of its CUDA graphs. The re-ranking is torch; the aggregation and the gradients are the pair-based ones of
``pairs.Kernels``. The backend is not capturable: inside torch.ops.fullgraph.knn the op's
tag is hidden from torch.compile, so a CUDA graph capture of it is refused with an error.
"""

from __future__ import annotations

import importlib.util

import torch

from ... import extern
from ...backends import Backend
from . import pairs

CANDIDATE_SLACK = 8


@extern.op("fullgraph::cuml_knn_candidates",
           "(Tensor query, Tensor ref, Tensor query_ok, Tensor ref_ok, int count) -> Tensor",
           outputs=lambda query, ref, query_ok, ref_ok, count: [((*query.shape[:2], count), torch.int64)],
           library="cupy", cuda_graphs="tag")
def _candidates(query, ref, query_ok, ref_ok, count):
    """[B, M, count] int64 candidate references per valid query (-1 where none)."""
    import cupy
    from cuml.neighbors import NearestNeighbors

    out = cupy.full((*query.shape[:2], count), -1, dtype=cupy.int64)
    for b in range(query.shape[0]):
        queries, refs = cupy.flatnonzero(query_ok[b]), cupy.flatnonzero(ref_ok[b])
        take = min(count, int(refs.size))
        if queries.size == 0 or take == 0:
            continue
        model = NearestNeighbors(n_neighbors=take, algorithm="brute", output_type="cupy")
        _, local = model.fit(ref[b][refs]).kneighbors(query[b][queries])
        out[b, queries[:, None], cupy.arange(take)[None, :]] = refs[local.astype(cupy.int64)]
    return out


def nearest(query, ref, k, radius, query_lengths, ref_lengths):
    """``pairs.Kernels.nearest`` for plain kNN (radius = inf)."""
    count = min(k + CANDIDATE_SLACK, ref.shape[1])
    query_ok = pairs.valid_points(query, query_lengths)
    ref_ok = pairs.valid_points(ref, ref_lengths)
    candidates = _candidates(query.detach().float(), ref.detach().float(), query_ok, ref_ok, count)
    return pairs.reranked(query, ref, k, candidates)


class CumlKernels(pairs.Kernels):
    nearest = staticmethod(nearest)


_HAVE_CUML = importlib.util.find_spec("cuml") is not None
BACKEND = Backend(
    "cuml", ops=("knn", "knn_aggregate"), devices=("cuda",), dtypes=(torch.float32, torch.float64),
    capturable=False, install='cuml: pip install "fullgraph[rapids]" (RAPIDS cuML)', available=lambda device: _HAVE_CUML,
    implementation=CumlKernels(),
)
