"""The "torch" backend: plain PyTorch, memory-bounded, on any device and dtype.

The twin every other backend is tested against. It processes the queries in chunks so
that no block holds more than ``pairs.BLOCK_BYTES`` (``CUDA_BLOCK_BYTES`` on CUDA) and
never builds the full M x N distance matrix of a large problem. Its searches read nothing
back to the host, so knn, radius and knn_aggregate can be captured in CUDA graphs (on CUDA
it serves lists longer than Triton's); radius_aggregate gathers its pairs with ``nonzero``
(a host sync) and cannot. The aggregations and backward passes are the pair-based ones of
``pairs.Kernels``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ...backends import ANY_DEVICE, Backend
from ..scaling import safe_scale
from .pairs import (PER_COORDINATE_MAX_DIM, Kernels, accumulation_dtype, norm_of_difference, query_chunks,
                    rows_per_block, valid_points_and_largest)


def pairwise_distances(query: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., m, n] distances between query [..., m, D] and ref [..., n, D] in the
    accumulation dtype, in units of ``scale`` [..., 1, 1] (a power of two,
    ``ops.scaling.safe_scale``): times scale, exactly ``pairs.pair_distances``."""
    acc = accumulation_dtype(query.dtype)
    return norm_of_difference((query.to(acc) / scale)[..., :, None, :], (ref.to(acc) / scale)[..., None, :, :])


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
    for items, chunk, d, ok, scale in distance_blocks(query, ref, radius, query_lengths, ref_lengths):
        # Excluded pairs become NaN, which ranks after every distance (+inf included).
        group, height, _ = d.shape
        values, order = smallest(torch.where(ok, d, math.nan).reshape(group * height, columns), take)
        dists[items, chunk, :take], idx[items, chunk, :take] = found_lists(
            values.reshape(group, height, take), order.reshape(group, height, take), scale)
        counts[items, chunk] = ok.sum(dim=-1)
    return dists.to(query.dtype), idx, counts


def found_lists(values: torch.Tensor, order: torch.Tensor,
                scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dists, idx) of selected ``values`` [g, m, t] in units of ``scale`` [g, 1, 1] (NaN: no
    neighbour) and their columns ``order``: +inf / -1 where NaN."""
    found = ~torch.isnan(values)
    return torch.where(found, values * scale, math.inf), order.masked_fill(~found, -1)


def item_scales(query_largest, ref_largest, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, 1] each item's scale (``safe_scale`` of its largest valid |coordinate|, of the
    query's and the reference's clouds [B]: ``pairs.valid_points_and_largest``) in the
    accumulation dtype of ``dtype``. One scale per item (the pairs' own would cost a pass
    over [m, N, D]): far apart points stay finite; only in clouds that also hold points
    within ~1e-30 of each other do those underflow to distance 0 (ties, broken by index)."""
    acc = accumulation_dtype(dtype)
    return safe_scale(torch.maximum(query_largest, ref_largest).to(acc))[:, None, None]


def radius_in_units(radius: float, scale: torch.Tensor) -> torch.Tensor | None:
    """radius / scale [B, 1, 1] (None for an infinite radius): d * scale <= radius exactly
    when d <= radius / scale (both rounded to the accumulation dtype like d)."""
    # Comparisons and a scalar operand rather than math.isfinite / torch.tensor: under
    # dynamic=True the radius may be symbolic.
    return None if radius == math.inf else radius / scale


def distance_blocks(query, ref, radius, query_lengths, ref_lengths):
    """Bounded blocks of the distance matrices: yields (items, rows, d [g, m, N], ok [g, m, N],
    scale [g, 1, 1]) for the batch items ``items`` and query rows ``rows`` (slices), where d
    is in units of each item's ``scale`` (multiply to get distances: exact, a power of two)
    and ok marks valid pairs within the radius. Items small enough share a block (fewer
    operators: 64 clouds of 128 points took ~20 operators each, 44 against 11 ms)."""
    batch, rows, dim = query.shape
    query_ok, query_largest = valid_points_and_largest(query, query_lengths)
    ref_ok, ref_largest = valid_points_and_largest(ref, ref_lengths)
    scale = item_scales(query_largest, ref_largest, query.dtype)
    within = radius_in_units(radius, scale)
    width = dim if dim > PER_COORDINATE_MAX_DIM else 0  # the [m, N, D] block norm_of_difference holds
    for items, chunk in item_blocks(batch, rows, ref.shape[1], width, query.device):
        d = pairwise_distances(query[items, chunk], ref[items], scale[items])
        ok = query_ok[items, chunk, None] & ref_ok[items, None, :]
        yield items, chunk, d, ok if within is None else ok & (d <= within[items]), scale[items]


def item_blocks(batch: int, rows: int, columns: int, row_width: int, device) -> Iterator[tuple[slice, slice]]:
    """(items, rows) slices covering [batch, rows]: whole items together while their
    [rows, columns, row_width] float64 blocks fit the budget (``pairs.rows_per_block``),
    else one item at a time in chunks of rows (``pairs.query_chunks``)."""
    step = rows_per_block(columns, row_width, device)
    if rows <= step:
        together = max(1, step // max(1, rows))
        for start in range(0, batch, together):
            yield slice(start, min(start + together, batch)), slice(0, rows)
        return
    for b in range(batch):
        for chunk in query_chunks(rows, columns, row_width, device):
            yield slice(b, b + 1), chunk


def smallest(d: torch.Tensor, take: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``take`` smallest entries of each row of d [m, n] (>= 0 or NaN), ordered by
    (value, column), NaN counting as largest (the order among NaN entries is unspecified).

    ``topk`` alone picks arbitrarily among values tied at the cut. On CPUs, where a host
    read costs nothing, tied rows are repaired after it. Elsewhere nothing is read back (so
    it captures): float32 rows are ranked by one int64 key per entry, (bits of d) << 32 |
    column (non-negative float32 bit patterns order like the values, NaN's above +inf's,
    the column breaks ties); float64 rows keep topk's cut and take the tied entries by column.
    """
    rows, columns = d.shape
    if take == 0:
        return d[:, :0], torch.zeros((rows, 0), dtype=torch.int64, device=d.device)
    if d.device.type == "cpu":  # a host read costs nothing here: topk, then repair ties at the cut
        return _smallest_repairing_ties(d, take)
    column = torch.arange(columns, device=d.device)
    if d.dtype == torch.float32 and columns < 2**31:
        bits = d.masked_fill(torch.isnan(d), math.nan).view(torch.int32).to(torch.int64)
        _, order = torch.topk((bits << 32) | column, take, dim=1, largest=False, sorted=True)
        return d.gather(1, order), order
    values, _ = torch.topk(d, take, dim=1, largest=False, sorted=True)
    cut = values[:, -1:]
    cut_is_nan = torch.isnan(cut)
    below = (d < cut) | (cut_is_nan & ~torch.isnan(d))
    at = (d == cut) | (cut_is_nan & torch.isnan(d))
    chosen = below | (at & (at.cumsum(1) <= take - below.sum(1, keepdim=True)))
    _, order = torch.topk(torch.where(chosen, column, column + columns), take, dim=1, largest=False, sorted=True)
    values, by_value = d.gather(1, order).sort(dim=1, stable=True)
    return values, order.gather(1, by_value)


def _smallest_repairing_ties(d: torch.Tensor, take: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``smallest`` with one host read: topk, ordered by (value, column); rows where more
    columns equal the cut than were taken are redone with a stable sort."""
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
    for items, chunk, d, ok, scale in distance_blocks(query, ref, radius, query_lengths, ref_lengths):
        for i, b in enumerate(range(items.start, items.stop)):
            qi, rj = ok[i].nonzero(as_tuple=True)
            yield b, chunk, qi, rj, d[i, qi, rj] * scale[i, 0, 0]


class ReferenceKernels(Kernels):
    nearest = staticmethod(nearest)
    radius_pairs = staticmethod(radius_pairs)


BACKEND = Backend(
    "torch", ops=("knn", "radius", "knn_aggregate", "radius_aggregate"), devices=(ANY_DEVICE,),
    auto_devices=(ANY_DEVICE,), capturable=("knn", "radius", "knn_aggregate"), implementation=ReferenceKernels(),
)
