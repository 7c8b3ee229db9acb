"""Plain-PyTorch reference for the neighbour operators, memory-bounded.

Every backend is tested against these functions. They work on any device, process the
queries in chunks so that no block holds more than ``BLOCK_BYTES``, and never build the
full M x N distance matrix of a large problem.

Conventions shared by all backends (batched layout, after ``api`` added the batch dim):
    query: [B, M, D], ref: [B, N, D], lengths: [B] int64 (valid prefix of each item).
A point with a non-finite coordinate, or beyond its item's length, is invalid: an invalid
reference is never a neighbour, an invalid query has none. Distances are computed as
``sqrt(sum((q - r)**2))`` in float32 (float64 for float64 inputs), ties broken by index.
The aggregation helpers work on *pairs*: flat query rows ``qi``, flat reference rows
``rj`` and their distances ``d``, so that kNN lists and radius balls share one maths.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

BLOCK_BYTES = 64 * 2**20
# GPUs have the memory for larger blocks, and each chunk costs a round of kernel launches.
CUDA_BLOCK_BYTES = 1024 * 2**20


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def query_chunks(rows: int, columns: int, row_width: int, device=None) -> Iterator[slice]:
    """Slices of ``rows`` such that a [chunk, columns, row_width] float64 block fits the budget."""
    per_row = max(1, columns) * (row_width + 4) * 8
    budget = CUDA_BLOCK_BYTES if torch.device(device or "cpu").type == "cuda" else BLOCK_BYTES
    step = max(1, budget // per_row)
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def full_lengths(lengths: torch.Tensor | None, batch: int, size: int, device) -> torch.Tensor:
    if lengths is None:
        return torch.full((batch,), size, dtype=torch.int64, device=device)
    return lengths.clamp(0, size)


def valid_points(points: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """[B, L] bool: inside the valid prefix and finite in every coordinate."""
    batch, size = points.shape[:2]
    lengths = full_lengths(lengths, batch, size, points.device)
    inside = torch.arange(size, device=points.device)[None, :] < lengths[:, None]
    return inside & torch.isfinite(points).all(dim=-1)


def pairwise_distances(query: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[m, n] distances between query [m, D] and ref [n, D] in the accumulation dtype."""
    acc = accumulation_dtype(query.dtype)
    return torch.linalg.vector_norm(query.to(acc)[:, None, :] - ref.to(acc)[None, :, :], dim=-1)


def pair_distances(query: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[P] distances between matching rows of query [P, D] and ref [P, D]; same arithmetic."""
    acc = accumulation_dtype(query.dtype)
    return torch.linalg.vector_norm(query.to(acc) - ref.to(acc), dim=-1)


def nearest(
    query: torch.Tensor,
    ref: torch.Tensor,
    k: int,
    radius: float,
    query_lengths: torch.Tensor | None,
    ref_lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k nearest valid references with distance <= radius (inf for plain kNN).

    Returns dists [B, M, k] (input dtype, +inf padded), idx [B, M, k] int64 (-1 padded)
    and counts [B, M] int64, the number of valid references within the radius.
    """
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


def order_by_distance(d: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row of candidate lists [..., c] (-1 = missing, with d = +inf) by
    (distance, index): ties to the smaller index, missing slots last."""
    missing_last = torch.where(candidates >= 0, candidates, torch.iinfo(torch.int64).max)
    by_index = torch.argsort(missing_last, dim=-1)
    d, candidates = d.gather(-1, by_index), candidates.gather(-1, by_index)
    by_distance = torch.argsort(d, dim=-1, stable=True)
    return d.gather(-1, by_distance), candidates.gather(-1, by_distance)


def radius_pairs(
    query: torch.Tensor,
    ref: torch.Tensor,
    radius: float,
    query_lengths: torch.Tensor | None,
    ref_lengths: torch.Tensor | None,
) -> Iterator[tuple[int, slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """All valid pairs within the radius, chunk by chunk of queries.

    Yields (b, rows, qi, rj, d): qi indexes rows of ``query[b, rows]``, rj rows of
    ``ref[b]``, d [P] their distances in the accumulation dtype.
    """
    for b, chunk, d, ok in distance_blocks(query, ref, radius, query_lengths, ref_lengths):
        qi, rj = ok.nonzero(as_tuple=True)
        yield b, chunk, qi, rj, d[qi, rj]


def aggregate_pairs(
    features: torch.Tensor, qi: torch.Tensor, rj: torch.Tensor, d: torch.Tensor, sigma: float, rows: int
) -> torch.Tensor:
    """[rows, C]: sum_j w_ij features[j] / sum_j w_ij with w = exp(-(d - min_j d) / sigma).

    Shifting by each row's smallest distance keeps the largest weight at 1, so nothing
    underflows to 0/0; a row with no pair gets 0.
    """
    weights = pair_weights(qi, d, sigma, rows)
    out = features.new_zeros((rows, features.shape[1]), dtype=d.dtype)
    out.index_add_(0, qi, weights[:, None] * features[rj].to(d.dtype))
    return out


def pair_weights(qi: torch.Tensor, d: torch.Tensor, sigma: float, rows: int) -> torch.Tensor:
    """[P] normalized weights p_ij = softmax_j(-d_ij / sigma) within each query row; pairs
    at +inf weigh 0, and a row without a finite pair has no weight."""
    shift = d.new_full((rows,), math.inf).scatter_reduce(0, qi, d, "amin")
    shift = torch.where(torch.isfinite(shift), shift, 0)
    weights = torch.exp(-(d - shift[qi]) / sigma)  # a pair at +inf (a missing slot) weighs 0
    total = d.new_zeros(rows).index_add_(0, qi, weights)
    return weights / torch.where(total > 0, total, 1)[qi]


def aggregate_pairs_backward(
    grad_out: torch.Tensor,
    features: torch.Tensor,
    out: torch.Tensor,
    qi: torch.Tensor,
    rj: torch.Tensor,
    d: torch.Tensor,
    sigma: float,
    grad_features: torch.Tensor,
) -> torch.Tensor:
    """Gradients of ``aggregate_pairs``: returns grad_d [P] and adds into grad_features
    [N, C] (acc dtype), so that chunked callers accumulate without a buffer per chunk.

    With p the normalized weights and o the output row:
    d o_i / d F_j = p_ij,  d L / d d_ij = -(p_ij / sigma) * (g_i . F_j - g_i . o_i).
    """
    acc = d.dtype
    grad_out = grad_out.to(acc)
    weights = pair_weights(qi, d, sigma, grad_out.shape[0])
    grad_features.index_add_(0, rj, weights[:, None] * grad_out[qi])
    projected = (grad_out[qi] * features[rj].to(acc)).sum(-1)
    baseline = (grad_out * out.to(acc)).sum(-1)[qi]
    return -(weights / sigma) * (projected - baseline)


def distances_backward_pairs(
    grad_d: torch.Tensor, query: torch.Tensor, ref: torch.Tensor, qi, rj, d: torch.Tensor,
    grad_query: torch.Tensor, grad_ref: torch.Tensor,
) -> None:
    """Chain d_ij = |q_i - r_j| back to positions, adding into grad_query [Mq, D] and
    grad_ref [Nr, D] (acc dtype).

    The gradient of a zero or infinite distance is 0 (the norm has no unique direction).
    """
    acc = d.dtype
    usable = (d > 0) & torch.isfinite(d)
    scale = torch.where(usable, grad_d.to(acc) / torch.where(usable, d, 1), 0)
    pull = scale[:, None] * (query[qi].to(acc) - ref[rj].to(acc))
    grad_query.index_add_(0, qi, pull)
    grad_ref.index_add_(0, rj, -pull)


def neighbor_pairs(idx: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every slot of neighbour lists idx [B, M, k] as a pair over flat rows, without a
    host synchronization: (qi [B*M*k] rows of the flat [B*M] queries, rj rows of the flat
    [B*N] references (0 for a missing slot), found [B*M*k] bool)."""
    batch, rows, k = idx.shape
    flat = idx.reshape(-1)
    slot = torch.arange(flat.numel(), device=idx.device)
    qi = slot // k
    found = flat >= 0
    rj = torch.where(found, flat + (qi // rows) * columns, 0)
    return qi, rj, found
