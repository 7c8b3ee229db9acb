"""The "dense" backend: kNN as matrix products (BLAS, cuBLAS), exact by a certificate.

For feature-space points (D >= 4) a k-d tree degrades towards brute force and the
reference's broadcast differences move D times the memory; one matrix product per block of
queries is the fast formulation. Per batch item and block of queries:

1. both clouds are centred on the mean of the item's valid references (which shrinks the
   cancellation error below) and approximate squared distances come from one product,
   ``a_ij = |q_i|^2 + |r_j|^2 - 2 q_i . r_j`` (float32; float64 for float64 inputs);
2. the ``k + SLACK`` smallest per query (``topk``) are re-measured with the reference's
   arithmetic (``pairs.norm_of_difference`` on the same scaled points) and ordered by
   (distance, index);
3. a certificate checks that no reference outside the candidates can be nearer than, or tie
   with, the k-th: rows that fail it are searched again by the reference.

Error bound. With unit roundoff u (2^-24 in float32, 2^-53 in float64), a dot product of
length D in any summation order is within ``D u |q| |r| / (1 - D u)`` of the true value, and
the two norms and two additions add a few u of ``|q|^2 + |r|^2``, so
``|a_ij - d_ij^2| <= e_i = 2 (D + 4) u (|q_i| + R)^2`` with R the largest |r_j| of the item
(factor 2 as headroom). Every non-candidate j has ``a_ij >= t_i`` (the last candidate's
value), so its true squared distance is at least ``t_i - e_i``, and its distance as the
reference computes it (within ``(D + 2) u`` relatively) at least ``(t_i - e_i)(1 - 2(D + 2) u)``.
When the k-th exact candidate distance squared ``s_i`` is below that, the list is exactly the
reference's. Near-ties and duplicates wider than the slack fail the check and take the
reference's path (a host sync, which is why this backend cannot be captured in a CUDA
graph, and why "auto" takes it on CPUs only; on CUDA it is there to be asked for by name).
"""

from __future__ import annotations

import math

import torch

from ...backends import FLOATING, Backend
from ..scaling import safe_scale
from . import pairs, reference

SLACK = 8
BLOCK_BYTES = 256 * 2**20


def _roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff of the product: float32 products may run in TF32 or bf16 when the user
    allowed it (torch.set_float32_matmul_precision), and the bound must hold then too."""
    if dtype == torch.float64:
        return 2.0**-53
    return {"highest": 2.0**-24, "high": 2.0**-11}.get(torch.get_float32_matmul_precision(), 2.0**-8)


def _centred(points, valid, centre):
    """Points minus the centre, invalid rows zeroed (so no NaN enters the product)."""
    return torch.where(valid[:, None], points - centre, 0)


def _item(query, ref, query_ok, ref_ok, k, radius, acc):
    """dists [M, k], idx [M, k] of one batch item (rows of invalid queries are filled by the caller)."""
    rows, columns, dim = query.shape[0], ref.shape[0], query.shape[1]
    # Products of far-out (or tiny) coordinates would overflow (underflow): work in units
    # of a power of two (exact) where needed; the exact distances stay in the caller's units.
    scale = safe_scale(torch.maximum(reference.largest(query, query_ok), reference.largest(ref, ref_ok)).to(acc))
    q, r = query.to(acc) / scale, ref.to(acc) / scale
    measured_q, measured_r = q, r  # the reference's operands: the exact re-measure is its arithmetic
    all_valid = bool(ref_ok.all()) and bool(query_ok.all())
    if not all_valid:
        q, r = _centred(q, query_ok, 0), _centred(r, ref_ok, 0)
    r_norms = (r * r).sum(1)
    # Centring pays (two passes over the points) only when the cloud sits far from the
    # origin, where |q|^2 + |r|^2 would dwarf the differences (the bound grows with it).
    centre = r.sum(0) / max(1, int(ref_ok.sum()))
    if float((centre * centre).sum()) * columns > float(r_norms.sum()) / 4:
        q, r = _centred(q, query_ok, centre), _centred(r, ref_ok, centre)
        r_norms = (r * r).sum(1)
    reach = math.sqrt(float(r_norms.max())) if columns else 0.0
    gamma = 2 * (dim + 4) * _roundoff(acc)
    take = min(k + SLACK, columns)
    dists = torch.full((rows, k), math.inf, dtype=acc, device=query.device)
    idx = torch.full((rows, k), -1, dtype=torch.int64, device=query.device)
    failed = []
    step = max(1, BLOCK_BYTES // (max(columns, 1) * 4 * q.element_size()))
    for start in range(0, rows, step):
        block = slice(start, min(start + step, rows))
        q_block = q[block]
        # |q|^2 is constant along a row: the order needs only |r|^2 - 2 q.r (one pass less).
        approx = torch.addmm(r_norms[None, :], q_block, r.t(), alpha=-2)
        if not all_valid:
            approx.masked_fill_(~ref_ok[None, :], math.inf)
        values, candidates = torch.topk(approx, take, dim=1, largest=False, sorted=True)
        exact = pairs.norm_of_difference(measured_q[block][:, None, :], measured_r[candidates]) * scale
        keep = ref_ok[candidates] & (exact <= radius)
        d, candidates = pairs.order_by_distance(exact.masked_fill(~keep, math.inf), candidates.masked_fill(~keep, -1))
        width = min(k, take)
        dists[block, :width], idx[block, :width] = d[:, :width], candidates[:, :width]
        if take < columns:
            q_norms = (q_block * q_block).sum(1)
            bound = gamma * (q_norms.sqrt() + reach) ** 2
            outside = (values[:, -1] + q_norms - bound) * (1 - 2 * (dim + 2) * _roundoff(acc))
            # A last candidate at +inf: every valid reference is a candidate already.
            certified = ((d[:, k - 1] / scale) ** 2 < outside) | torch.isinf(values[:, -1])
            failed.append(start + (query_ok[block] & ~certified).nonzero()[:, 0])
    return dists, idx, torch.cat(failed) if failed else torch.zeros(0, dtype=torch.int64, device=query.device)


def nearest(query, ref, k, radius, query_lengths, ref_lengths):
    """``pairs.Kernels.nearest`` by matrix products (see the module docstring)."""
    batch, rows, _ = query.shape
    acc = pairs.accumulation_dtype(query.dtype)
    dists = torch.full((batch, rows, k), math.inf, dtype=acc, device=query.device)
    idx = torch.full((batch, rows, k), -1, dtype=torch.int64, device=query.device)
    query_ok = pairs.valid_points(query, query_lengths)
    ref_ok = pairs.valid_points(ref, ref_lengths)
    for b in range(batch):
        if rows == 0 or not bool(ref_ok[b].any()):
            continue
        d, i, failed = _item(query[b], ref[b], query_ok[b], ref_ok[b], k, radius, acc)
        if failed.numel():
            lengths = None if ref_lengths is None else ref_lengths[b:b + 1]
            exact_d, exact_i, _ = reference.nearest(query[b:b + 1, failed], ref[b:b + 1], k, radius, None, lengths)
            d[failed], i[failed] = exact_d[0].to(acc), exact_i[0]
        ok = query_ok[b][:, None]
        dists[b], idx[b] = d.masked_fill(~ok, math.inf), i.masked_fill(~ok, -1)
    return dists.to(query.dtype), idx, (idx >= 0).sum(-1)


class DenseKernels(pairs.Kernels):
    nearest = staticmethod(nearest)


# Where "auto" takes it over the k-d tree: measured on the 2-core development CPU, normal
# clouds (benchmarks/results/cpu-2core-torch2.13/dense-crossover.log), ms dense / tree:
#   M=5000, N=100000, k=10:  D=8 1342/354, D=10 1241/859, D=12 1234/2263, D=16 601/1904
#   B=8, M=N=2048, k=20:     D=8 120/243,  D=12 120/293,  D=64 267/831
# The tree wins up to D = 10 on large clouds; from D = 12 on the products win everywhere.
AUTO_MIN_DIM = 12

BACKEND = Backend(
    "dense", ops=("knn", "knn_aggregate"), devices=("cpu", "cuda"), dtypes=FLOATING, auto_devices=("cpu",),
    auto_when=lambda dim, k: dim is not None and dim >= AUTO_MIN_DIM, capturable=False,
    implementation=DenseKernels(),
)
