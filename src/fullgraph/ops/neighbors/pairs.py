"""Pair maths shared by the neighbour backends, and ``Kernels``, the interface they implement.

Conventions (batched layout, after ``api`` added the batch dim): query [B, M, D], ref
[B, N, D], lengths [B] int64 (the valid prefix of each item). A point with a non-finite
coordinate, or beyond its item's length, is invalid: an invalid reference is never a
neighbour, an invalid query has none. Distances are ``sqrt(sum((q - r)**2))`` in float32
(float64 for float64 inputs), the sum in one stated order (``squared_difference``) so that
every backend measures the same bits, ties broken by index.

The aggregations work on *pairs*: flat query rows ``qi``, flat reference rows ``rj`` and
their distances ``d``, so that kNN lists and radius balls share one maths. A backend that
only searches (``nearest``, ``radius_pairs``) gets the aggregations and every backward from
``Kernels``; a backend with fused kernels overrides those methods.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ..scaling import magnitude, safe_scale

BLOCK_BYTES = 64 * 2**20
# GPUs have the memory for larger blocks, and each chunk costs a round of kernel launches.
CUDA_BLOCK_BYTES = 1024 * 2**20

Tensor = torch.Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rows_per_block(columns: int, row_width: int, device=None) -> int:
    """Query rows whose [rows, columns, row_width] float64 block fits the budget (>= 1)."""
    per_row = max(1, columns) * (row_width + 4) * 8
    budget = CUDA_BLOCK_BYTES if torch.device(device or "cpu").type == "cuda" else BLOCK_BYTES
    return max(1, budget // per_row)


def query_chunks(rows: int, columns: int, row_width: int, device=None) -> Iterator[slice]:
    """Slices of ``rows`` such that a [chunk, columns, row_width] float64 block fits the budget."""
    step = rows_per_block(columns, row_width, device)
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def full_lengths(lengths: Tensor | None, batch: int, size: int, device) -> Tensor:
    if lengths is None:
        return torch.full((batch,), size, dtype=torch.int64, device=device)
    return lengths.clamp(0, size)


def valid_points(points: Tensor, lengths: Tensor | None) -> Tensor:
    """[B, L] bool: inside the valid prefix and finite in every coordinate."""
    inside = _inside(points, lengths)
    if points.shape[-1] == 0:
        return inside
    # A NaN or infinite coordinate makes the largest |coordinate| NaN or inf: one reduction
    # (isfinite + all took 14x as long on a CPU).
    return inside & (magnitude(points) < math.inf)


def valid_points_and_largest(points: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
    """``valid_points`` [B, L] and each item's largest |coordinate| of them [B] (0 if none):
    one pass over the points for both (each pass is most of the operators' work on small
    CPU items: 64 x 128^2, D = 128, ~0.5 ms of a 16 ms kNN)."""
    inside = _inside(points, lengths)
    if points.shape[-1] == 0 or points.shape[1] == 0:
        return inside, points.new_zeros(points.shape[0])
    sizes = magnitude(points)
    valid = inside & (sizes < math.inf)
    return valid, torch.where(valid, sizes, 0).amax(-1)


def _inside(points: Tensor, lengths: Tensor | None) -> Tensor:
    """[B, L] bool: inside each item's valid prefix."""
    batch, size = points.shape[:2]
    lengths = full_lengths(lengths, batch, size, points.device)
    return torch.arange(size, device=points.device)[None, :] < lengths[:, None]


def no_neighbors(query: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """What ``Kernels.nearest`` returns when nothing is found: +inf, -1 and zero counts."""
    batch, rows = query.shape[:2]
    return (query.new_full((batch, rows, k), math.inf), query.new_full((batch, rows, k), -1, dtype=torch.int64),
            query.new_zeros((batch, rows), dtype=torch.int64))


# Up to this many coordinates, differences are summed one coordinate at a time (no
# [..., D] block is held); beyond, a [..., D] block of squares is summed by halving.
PER_COORDINATE_MAX_DIM = 4


def halving_sum(x: Tensor) -> Tensor:
    """x [..., D] (overwritten) -> [...]: its sum over the last dim in one fixed order of
    float additions, x[j] += x[j + h] for h the largest power of two below the width, until
    one is left (a sum of D zero-padded to a power of two, halved). ``torch.sum`` promises no
    order (it differs between devices and reduction configurations); Triton kernels repeat
    this one bit for bit (``triton_dense.squared_distances``)."""
    width = x.shape[-1]
    while width > 2:
        half = 1 << ((width - 1).bit_length() - 1)
        x[..., :width - half] += x[..., half:width]
        width = half
    return x[..., 0] + x[..., 1] if width == 2 else x[..., 0].clone()


def squared_difference(query: Tensor, ref: Tensor) -> Tensor:
    """sum_c (query_c - ref_c)^2 over the last dim, broadcasting. For D <=
    PER_COORDINATE_MAX_DIM one [...] pass per coordinate, summed in order; above, a
    [..., D] block of differences squared, summed by ``halving_sum``."""
    if query.shape[-1] > PER_COORDINATE_MAX_DIM:
        return halving_sum((query - ref).square_())
    total = (query[..., 0] - ref[..., 0]).square()
    for c in range(1, query.shape[-1]):
        total += (query[..., c] - ref[..., c]).square()
    return total


def norm_of_difference(query: Tensor, ref: Tensor) -> Tensor:
    """sqrt of ``squared_difference``: the one distance arithmetic of the neighbour backends
    (the reference's matrix and every re-measure give the same bits)."""
    return squared_difference(query, ref).sqrt_()


def pair_distances(query: Tensor, ref: Tensor) -> Tensor:
    """[...] distances between matching rows of query [..., D] and ref [..., D]
    (broadcasting), in the accumulation dtype: the arithmetic of the reference's distance
    matrix, scaled per pair (``safe_scale``) so that finite points give finite distances."""
    acc = accumulation_dtype(query.dtype)
    query, ref = query.to(acc), ref.to(acc)
    scale = safe_scale(torch.maximum(magnitude(query), magnitude(ref)))[..., None]
    return norm_of_difference(query / scale, ref / scale) * scale[..., 0]


def order_by_distance(d: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
    """Sort each row of candidate lists [..., c] (-1 = missing, with d = +inf) by
    (distance, index): ties to the smaller index, missing slots last. Distances are >= 0 or
    +inf (never NaN)."""
    if d.dtype == torch.float32 and d.shape[-1] > 0:
        # One sort of (distance bits, index) words: the bits of floats >= 0 order as the floats.
        index = torch.where(candidates >= 0, candidates, 2**32 - 1)
        order = torch.sort((d + 0.0).view(torch.int32).to(torch.int64) << 32 | index, dim=-1).indices  # -0 as +0
        return d.gather(-1, order), candidates.gather(-1, order)
    missing_last = torch.where(candidates >= 0, candidates, torch.iinfo(torch.int64).max)
    by_index = torch.argsort(missing_last, dim=-1)
    d, candidates = d.gather(-1, by_index), candidates.gather(-1, by_index)
    by_distance = torch.argsort(d, dim=-1, stable=True)
    return d.gather(-1, by_distance), candidates.gather(-1, by_distance)


def reranked(query: Tensor, ref: Tensor, k: int, candidates: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``Kernels.nearest``'s (dists, idx, counts) [B, M, k] from a library's candidate lists
    [B, M, c] (int64 rows of ref, -1 = none): each candidate measured again in the
    reference's arithmetic (differentiable) and the lists ordered by (distance, index), so
    they are the reference's wherever the true k nearest are among the candidates."""
    batch, rows, count = candidates.shape
    dim = query.shape[-1]
    found = candidates >= 0
    near = torch.gather(ref, 1, candidates.clamp_min(0).reshape(batch, -1, 1).expand(-1, -1, dim))
    d = pair_distances(query[:, :, None, :], near.reshape(batch, rows, count, dim))
    d, idx = order_by_distance(d.masked_fill(~found, math.inf), candidates)
    d, idx = d[..., :k], idx[..., :k]
    if count < k:
        d = torch.cat([d, d.new_full((batch, rows, k - count), math.inf)], dim=-1)
        idx = torch.cat([idx, idx.new_full((batch, rows, k - count), -1)], dim=-1)
    return d.to(query.dtype), idx, (idx >= 0).sum(-1)


def pair_weights(qi: Tensor, d: Tensor, sigma: float, rows: int) -> Tensor:
    """[P] normalized weights p_ij = softmax_j(-d_ij / sigma) within each query row; pairs
    at +inf weigh 0, and a row without a finite pair has no weight."""
    shift = d.new_full((rows,), math.inf).scatter_reduce(0, qi, d, "amin")
    shift = torch.where(torch.isfinite(shift), shift, 0)
    weights = torch.exp(-(d - shift[qi]) / sigma)  # a pair at +inf (a missing slot) weighs 0
    total = d.new_zeros(rows).index_add_(0, qi, weights)
    return weights / torch.where(total > 0, total, 1)[qi]


def weighted(weights: Tensor, rows: Tensor) -> Tensor:
    """weights [P] times rows [P, W], exactly 0 where a weight is 0: a pair that does not
    count (a missing slot, a pair outside the radius) must not carry a NaN or inf of its
    rows into sums that do not use them (0 * nan is nan)."""
    return torch.where((weights != 0)[:, None], weights[:, None] * rows, 0)


def aggregate_pairs(features: Tensor, qi: Tensor, rj: Tensor, d: Tensor, sigma: float, rows: int) -> Tensor:
    """[rows, C]: sum_j w_ij features[j] / sum_j w_ij with w = exp(-(d - min_j d) / sigma).

    Shifting by each row's smallest distance keeps the largest weight at 1, so nothing
    underflows to 0/0; a row with no pair gets 0.
    """
    weights = pair_weights(qi, d, sigma, rows)
    out = features.new_zeros((rows, features.shape[1]), dtype=d.dtype)
    out.index_add_(0, qi, weighted(weights, features[rj].to(d.dtype)))
    return out


def aggregate_pairs_backward(grad_out: Tensor, features: Tensor, out: Tensor, qi: Tensor, rj: Tensor, d: Tensor,
                             sigma: float, grad_features: Tensor) -> Tensor:
    """Gradients of ``aggregate_pairs``: returns grad_d [P] and adds into grad_features
    [N, C] (acc dtype), so that chunked callers accumulate without a buffer per chunk.

    With p the normalized weights and o the output row:
    d o_i / d F_j = p_ij,  d L / d d_ij = -(p_ij / sigma) * (g_i . F_j - g_i . o_i).
    """
    acc = d.dtype
    grad_out = grad_out.to(acc)
    weights = pair_weights(qi, d, sigma, grad_out.shape[0])
    grad_features.index_add_(0, rj, weighted(weights, grad_out[qi]))
    projected = (grad_out[qi] * features[rj].to(acc)).sum(-1)
    baseline = (grad_out * out.to(acc)).sum(-1)[qi]
    return torch.where(weights != 0, -(weights / sigma) * (projected - baseline), 0)


def distances_backward_pairs(grad_d: Tensor, query: Tensor, ref: Tensor, qi, rj, d: Tensor,
                             grad_query: Tensor, grad_ref: Tensor) -> None:
    """Chain d_ij = |q_i - r_j| back to positions, adding into grad_query [Mq, D] and
    grad_ref [Nr, D] (acc dtype).

    The gradient of a zero or infinite distance is 0 (the norm has no unique direction).
    """
    acc = d.dtype
    usable = (d > 0) & torch.isfinite(d)
    scale = torch.where(usable, grad_d.to(acc) / torch.where(usable, d, 1), 0)
    pull = weighted(scale, query[qi].to(acc) - ref[rj].to(acc))
    grad_query.index_add_(0, qi, pull)
    grad_ref.index_add_(0, rj, -pull)


def neighbor_pairs(idx: Tensor, columns: int) -> tuple[Tensor, Tensor, Tensor]:
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


def _flat(points: Tensor) -> Tensor:
    """[B, L, W] -> [B*L, W], with one zero row when empty: missing neighbour slots point
    at row 0 (with zero weight), so it must exist."""
    flat = points.reshape(points.shape[0] * points.shape[1], points.shape[-1])
    return flat if flat.shape[0] > 0 else points.new_zeros((1, points.shape[-1]))


def _unflat(flat: Tensor, like: Tensor) -> Tensor:
    """Inverse of ``_flat``: drop the padding row, take the shape and dtype of ``like``."""
    return flat[: like.shape[0] * like.shape[1]].reshape(like.shape).to(like.dtype)


def _knn_chunks(idx: Tensor, dists: Tensor, columns: int, width: int):
    """Bounded chunks of the [B*M] query rows of neighbour lists idx [B, M, k].

    Yields (rows, qi, rj, d, slots): qi local to the chunk, rj rows of the flat [B*N]
    reference, d the slots' distances (+inf where missing), slots the flat entries.
    """
    k = idx.shape[-1]
    qi, rj, found = neighbor_pairs(idx, columns)
    d = torch.where(found, dists.reshape(-1).to(accumulation_dtype(dists.dtype)), math.inf)
    for chunk in query_chunks(qi.numel() // max(k, 1), k, width, idx.device):
        slots = slice(chunk.start * k, chunk.stop * k)
        yield chunk, qi[slots] - chunk.start, rj[slots], d[slots], slots


def without_self(idx: torch.Tensor) -> torch.Tensor:
    """Lists idx [B, N, k] of a cloud's points among themselves, -1 where a point lists itself."""
    return torch.where(idx == torch.arange(idx.shape[1], device=idx.device)[:, None], -1, idx)


class Kernels:
    """What a neighbour backend implements, on contiguous batched inputs.

    ``nearest`` is required; the rest have pair-based defaults here: the aggregations and
    backward passes over the lists ``nearest`` returns, and radius aggregation over the
    pairs of ``radius_pairs``. Backends with fused kernels override them.
    """

    def saved_grid_size(self, batch: int, rows: int, columns: int, channels: int, dim: int) -> int:
        """Length of the int32 record of its search structure that ``radius_aggregate`` returns
        for its backward, for B, M, N, C, D (symbolic under ``torch.compile``); 0: none."""
        return 0

    def nearest(self, query, ref, k: int, radius: float, query_lengths, ref_lengths):
        """The k nearest valid references with distance <= radius (inf for plain kNN).

        Returns dists [B, M, k] (input dtype, +inf padded), idx [B, M, k] int64 (-1 padded)
        and counts [B, M] int64, the number of valid references within a finite radius (for
        plain kNN the callers read none, and a backend may leave them unset).
        """
        raise NotImplementedError

    def nearest_but_self(self, points, k: int, lengths):
        """torch_cluster's knn_graph lists: idx [B, N, k + 1] int64, each point's k + 1
        nearest valid points of its item with itself replaced by -1 (where it is among them)."""
        _, idx, _ = self.nearest(points, points, k + 1, math.inf, lengths, lengths)
        return without_self(idx)

    def radius_pairs(self, query, ref, radius: float, query_lengths, ref_lengths):
        """All valid pairs within the radius, in bounded chunks: yields (b, rows, qi, rj, d)
        with qi rows of ``query[b, rows]``, rj rows of ``ref[b]``, d [P] in the
        accumulation dtype."""
        raise NotImplementedError

    def distances_backward(self, grad_dists, query, ref, idx, dists):
        """(grad_query, grad_ref) of neighbour distances [B, M, k]."""
        qi, rj, found = neighbor_pairs(idx, ref.shape[1])
        acc = accumulation_dtype(query.dtype)
        flat_query, flat_ref = _flat(query), _flat(ref)
        # Recomputed in full precision: the saved distances may be rounded to bf16/fp16.
        exact = pair_distances(flat_query[qi], flat_ref[rj])
        d = torch.where(found & torch.isfinite(dists.reshape(-1)), exact, math.inf).to(acc)
        grad_query = torch.zeros(flat_query.shape, dtype=acc, device=query.device)
        grad_ref = torch.zeros(flat_ref.shape, dtype=acc, device=ref.device)
        distances_backward_pairs(grad_dists.reshape(-1), flat_query, flat_ref, qi, rj, d, grad_query, grad_ref)
        return _unflat(grad_query, query), _unflat(grad_ref, ref)

    def knn_aggregate(self, query, ref, features, k: int, sigma: float, query_lengths, ref_lengths):
        """(out [B, M, C], dists [B, M, k], idx [B, M, k]); the last two feed the backward."""
        dists, idx, _ = self.nearest(query, ref, k, math.inf, query_lengths, ref_lengths)
        acc = accumulation_dtype(query.dtype)
        flat_features = _flat(features)
        out = torch.empty((idx.shape[0] * idx.shape[1], features.shape[-1]), dtype=acc, device=query.device)
        for rows, qi, rj, d, _ in _knn_chunks(idx, dists, ref.shape[1], features.shape[-1]):
            out[rows] = aggregate_pairs(flat_features, qi, rj, d, sigma, rows.stop - rows.start)
        return out.reshape(*query.shape[:2], features.shape[-1]).to(features.dtype), dists, idx

    def knn_aggregate_backward(self, grad_out, features, out, dists, idx, sigma: float, dists_grad: bool = True):
        """(grad_dists [B, M, k], grad_features [B, N, C]) of the softmax-weighted sum;
        grad_dists is zeros without ``dists_grad``."""
        acc = accumulation_dtype(features.dtype)
        flat_features, flat_grad, flat_out = _flat(features), _flat(grad_out), _flat(out)
        grad_dists = torch.zeros(dists.numel(), dtype=acc, device=dists.device)
        grad_features = torch.zeros(flat_features.shape, dtype=acc, device=features.device)
        for rows, qi, rj, d, slots in _knn_chunks(idx, dists, features.shape[1], features.shape[-1]):
            grad_dists[slots] = aggregate_pairs_backward(
                flat_grad[rows], flat_features, flat_out[rows], qi, rj, d, sigma, grad_features)
        if not dists_grad:
            grad_dists.zero_()
        return grad_dists.reshape(dists.shape).to(dists.dtype), _unflat(grad_features, features)

    def radius_aggregate(self, query, ref, features, radius: float, sigma: float, query_lengths, ref_lengths):
        """(out [B, M, C], stats, saved_grid): the exp(-d / sigma)-weighted mean of the
        features within the radius, the per-query statistics [B, M, 2] float32 that this
        backend's backward takes (see ``registration.radius_aggregate_op``), or None where it
        recomputes them, and its search structure's record [saved_grid_size] int32 for the
        backward, or None where it keeps none."""
        acc = accumulation_dtype(query.dtype)
        out = torch.zeros((*query.shape[:2], features.shape[-1]), dtype=acc, device=query.device)
        for b, rows, qi, rj, d in self.radius_pairs(query, ref, radius, query_lengths, ref_lengths):
            block = out[b, rows]
            block += aggregate_pairs(features[b], qi, rj, d, sigma, block.shape[0])
        return out.to(features.dtype), None, None

    def radius_aggregate_backward(self, grad_out, query, ref, features, out, radius: float, sigma: float,
                                  query_lengths, ref_lengths, query_grad: bool = True, ref_grad: bool = True,
                                  stats=None, saved_grid=None):
        """(grad_query, grad_ref, grad_features), recomputing the pairs chunk by chunk. A
        backend may skip grad_query (grad_ref) where query_grad (ref_grad) is False and return
        zeros; here the pairs give all three at once."""
        acc = accumulation_dtype(query.dtype)
        grads = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in (query, ref, features)]
        grad_query, grad_ref, grad_features = grads
        for b, rows, qi, rj, d in self.radius_pairs(query, ref, radius, query_lengths, ref_lengths):
            grad_d = aggregate_pairs_backward(
                grad_out[b, rows], features[b], out[b, rows], qi, rj, d, sigma, grad_features[b])
            distances_backward_pairs(grad_d, query[b, rows], ref[b], qi, rj, d, grad_query[b, rows], grad_ref[b])
        return tuple(g.to(t.dtype) for g, t in zip(grads, (query, ref, features)))
