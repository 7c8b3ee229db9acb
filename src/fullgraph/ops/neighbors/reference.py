"""The "torch" backend: plain PyTorch, memory-bounded, on any device and dtype.

The twin every other backend is tested against. It processes the queries in chunks so
that no block holds more than ``pairs.BLOCK_BYTES`` (``CUDA_BLOCK_BYTES`` on CUDA) and
never builds the full M x N distance matrix of a large problem; it reads values back to
the host (``.any()`` in tie repair, ``nonzero`` for radius pairs), so it cannot be
captured in a CUDA graph. The aggregations and backward passes are the pair-based ones of
``pairs.Kernels``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ...backends import ANY_DEVICE, Backend
from .pairs import Kernels, accumulation_dtype, query_chunks, valid_points


def pairwise_distances(query: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[m, n] distances between query [m, D] and ref [n, D] in the accumulation dtype."""
    acc = accumulation_dtype(query.dtype)
    return torch.linalg.vector_norm(query.to(acc)[:, None, :] - ref.to(acc)[None, :, :], dim=-1)


def nearest(
    query: torch.Tensor,
    ref: torch.Tensor,
    k: int,
    radius: float,
    query_lengths: torch.Tensor | None,
    ref_lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pairs.Kernels.nearest``: dists [B, M, k], idx [B, M, k], counts [B, M]."""
    batch, rows, _ = query.shape
    columns = ref.shape[1]
    acc = accumulation_dtype(query.dtype)
    dists = torch.full((batch, rows, k), math.inf, dtype=acc, device=query.device)
    idx = torch.full((batch, rows, k), -1, dtype=torch.int64, device=query.device)
    counts = torch.zeros((batch, rows), dtype=torch.int64, device=query.device)
    take = min(k, columns)
    for b, chunk, d, ok in distance_blocks(query, ref, radius, query_lengths, ref_lengths):
        # NaN sorts after +inf, so excluded pairs land last even behind overflowed ones.
        values, order = smallest(d.masked_fill(~ok, math.nan), take)
        found = ok.gather(1, order)
        dists[b, chunk, :take] = values.masked_fill(~found, math.inf)
        idx[b, chunk, :take] = order.masked_fill(~found, -1)
        counts[b, chunk] = ok.sum(dim=1)
    return dists.to(query.dtype), idx, counts


def distance_blocks(query, ref, radius, query_lengths, ref_lengths):
    """Bounded blocks of the distance matrix: yields (b, rows, d [m, N], ok [m, N]) where
    ok marks valid pairs within the radius."""
    batch, rows, dim = query.shape
    query_ok = valid_points(query, query_lengths)
    ref_ok = valid_points(ref, ref_lengths)
    for b in range(batch):
        for chunk in query_chunks(rows, ref.shape[1], dim, query.device):
            d = pairwise_distances(query[b, chunk], ref[b])
            yield b, chunk, d, query_ok[b, chunk, None] & ref_ok[b, None, :] & (d <= radius)


def smallest(d: torch.Tensor, take: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``take`` smallest entries of each row of d [m, n], ordered by (value, column).

    NaN counts as largest. topk is much faster than a full sort but picks arbitrarily
    among values tied at the cut; rows where more columns equal the cut value than were
    taken are redone with a stable sort, so that ties always go to the smaller column.
    """
    if take == 0:
        return d[:, :0], torch.zeros((d.shape[0], 0), dtype=torch.int64, device=d.device)
    values, order = torch.topk(d, take, dim=1, largest=False, sorted=True)
    cut = values[:, -1:]
    ambiguous = (d == cut).sum(1) > (values == cut).sum(1)
    order = order.sort(dim=1).values
    values, permutation = d.gather(1, order).sort(dim=1, stable=True)
    order = order.gather(1, permutation)
    if ambiguous.any():
        rows = ambiguous.nonzero()[:, 0]
        tied_values, tied_order = torch.sort(d[rows], dim=1, stable=True)
        values[rows], order[rows] = tied_values[:, :take], tied_order[:, :take]
    return values, order


def radius_pairs(
    query: torch.Tensor,
    ref: torch.Tensor,
    radius: float,
    query_lengths: torch.Tensor | None,
    ref_lengths: torch.Tensor | None,
) -> Iterator[tuple[int, slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``pairs.Kernels.radius_pairs``, chunk by chunk of queries."""
    for b, chunk, d, ok in distance_blocks(query, ref, radius, query_lengths, ref_lengths):
        qi, rj = ok.nonzero(as_tuple=True)
        yield b, chunk, qi, rj, d[qi, rj]


class ReferenceKernels(Kernels):
    nearest = staticmethod(nearest)
    radius_pairs = staticmethod(radius_pairs)


BACKEND = Backend(
    "torch", ops=("knn", "radius", "knn_aggregate", "radius_aggregate"), devices=(ANY_DEVICE,),
    auto_devices=(ANY_DEVICE,), capturable=False, implementation=ReferenceKernels(),
)
