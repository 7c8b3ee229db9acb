"""The "dense" backend: kNN as matrix products (BLAS, cuBLAS), exact by a certificate.

For feature-space points (D >= 4) a k-d tree degrades towards brute force, the grid of the
Triton backend to one cell, and the reference's broadcast differences move D times the
memory; one batched matrix product per block of queries is the fast formulation. Per block
of queries, for every batch item at once:

1. both clouds are scaled by the item's power of two (``ops.scaling.safe_scale``) and
   centred on the mean of its valid references (which shrinks the cancellation error
   below; on GPUs three Triton kernels, ``triton_dense.frames``, where torch took two
   dozen kernels); approximate squared distances come from one product,
   ``a_ij = |q_i|^2 + |r_j|^2 - 2 q_i . r_j`` (float32; float64 for float64 inputs);
2. the ``k + CANDIDATE_SLACK`` smallest per query (``select.smallest``: torch.topk on GPUs, a C++
   selection on CPUs) are re-measured with the reference's
   arithmetic (``pairs.norm_of_difference`` on the same scaled points: its squares summed
   in one fixed order, ``pairs.halving_sum``, which a Triton pass repeats on GPUs) and
   ordered by (distance, index);
3. a certificate checks that no reference outside the candidates can be nearer than, or tie
   with, the k-th: rows that fail it are searched again exactly.

Error bound. With unit roundoff u (2^-24 in float32, 2^-53 in float64), a dot product of length
D in any summation order is within ``D u |q| |r| / (1 - D u)`` of the true value, and the two
norms and two additions add a few u of ``|q|^2 + |r|^2``, so
``|a_ij - d_ij^2| <= e_i = 2 (D + 4) u (|q_i| + R)^2`` with R the largest |r_j| of the item
(factor 2 as headroom, which also holds the centring's rounding: each centred coordinate rounded
once moves a distance by u (|q_i| + R) at most; float64 products of float32 clouds take it
apart, ``_floor``). Every non-candidate j has ``a_ij >= t_i`` (the last candidate's value), so
its true squared distance is at least ``t_i - e_i``, and its distance as the reference computes
it (within ``(D + 2) u`` relatively) at least ``(t_i - e_i)(1 - 2(D + 2) u)``. When the k-th
exact candidate distance squared ``s_i`` is below that, the list is exactly the reference's.
Near-ties and duplicates wider than the slack fail the check.

On GPUs (float16/bfloat16/float32), small items of few coordinates outside a CUDA graph
capture (``Plan.path`` "every pair") skip all of this: one kernel measures every pair in the
reference's arithmetic and keeps each query's k best, exact by construction. Otherwise steps
1-2 never store a block's M x N values: the
products run on tensor cores (``triton_dense``) and per query only the least value of each
chunk of ``triton_dense.chunk_size`` consecutive references counts (for small k and up to
2^14 references, one kernel keeps the least k + CHUNK_SLACK + 1 of them in registers;
beyond, every chunk's minimum is stored and selected from). The k + CHUNK_SLACK chunks with the least minima are
chosen; the squared distances to their members are summed
from differences (relative error below (D + 2) u, no cancellation), and the k + CANDIDATE_SLACK
nearest members re-measured in the reference's arithmetic (where they fit in registers,
all of it in one kernel a query, ``triton_dense.nearest_members``). Exactness: the k
nearest lie in chosen chunks up to the products' error (each of the k chosen minima is a
distinct reference at or below the k-th least minimum), and the certificate of step 3
takes the least of two floors: every reference of an unchosen chunk has a product value at least the
least unchosen minimum (so a squared distance at least it + |q|^2 - e_i), every unmeasured
member a member distance at least the last one measured. The products' error there is
split in two: each product's input rounding, at most eps |q_d r_d| (``triton_dense.product_error``)
and so eps |q| |r| in all (Cauchy-Schwarz), plus the float32 sums and norms of step 3. The
products are three TF32 products (each operand split in two TF32 parts, eps = 2^-18),
whatever torch.set_float32_matmul_precision says: with one TF32 product (eps ~ 2^-9) the
certificate failed on 0.5-2% of normal rows and every clustered row on the H100.

Where one kernel a query measures every member of the fused lists, it also certifies the
row and writes its list, scaled and within the radius, into the output
(``triton_dense.certified_lists``, ``_fused_lists``): two kernels a pass. It measures the
chosen chunks only up to the first past the k-th whose floor (the unchosen chunks' floor
above, from its own key) lies above a ceiling over the k-th chunk's nearest member: those
left hold none of the k nearest, and that key is the floor the certificate takes. On wide points
(the stored minima from D = HALF_FIRST_MIN_DIM, the fused lists from
FUSED_HALF_FIRST_MIN_DIM) the products run first on both clouds rounded to float16
beforehand (times a power of two per item that keeps them in range, ``Frames.halves``):
each product of rounded operands q', r' is exact (11 bits by 11), and q.r - q'.r' =
q_lo.r + q'.r_lo, at most |q_lo| R + |q'| max |r_lo| by Cauchy-Schwarz with the norms of
what the rounding left out (``_products``), ~2^-11 of |q| R where one TF32 product's input
rounding bounds 2^-9. The valid rows that bound leaves unproven go through steps 1-3 again
in three TF32 products, only the tiles of queries holding one multiplied, with more chunks
chosen from D = WIDE_SLACK_MIN_DIM on the stored minima (``_block_on_tensor_cores``); there,
from D = HALF_SECOND_MIN_DIM, in three float16 products instead: the halves and
what they left out rounded to float16 again, qh.rh + (qh.rl + ql.rh), the low terms summed
apart ("fp16x3", ``Frames.lows`` bounds what they leave out).

Long lists on GPUs (``Plan.path`` "products", PRODUCTS_MIN_K).
Steps 1-3 as on CPUs, the products on cuBLAS's tensor cores: each centred operand split into
two TF32 parts (``frames.tf32_split``), high x high + high x low + low x high (within
``product_error("tf32x3")`` of q.r before the float32 sums; the cross terms first, the main
product added in the epilogue of its own), the candidates by torch.topk. The rows it leaves
unproven go again in float64 products and norms, with REDO_GROWTH times the candidates a pass
until every row is proven (``_redo``; inside a capture the first of them only,
``_first_failed_again``, then ``plan.redo``).

Wide points in a capture. From CAPTURE_AGAIN_MIN_DIM coordinates the rows the tensor cores leave
unproven go first through steps 1-3 as on CPUs, up to a fixed number a batch item, with cuBLAS's
float32 products and torch.topk (``_first_failed_again``): the Triton search that redoes what
is left is a scalar brute force, whose cost grows with D. Small eager calls on GPUs whose signature
comes back replay the capture path from a CUDA graph (``replays``).

Failed rows. Inside a CUDA graph capture (float16/bfloat16/float32, k <= CAPTURE_MAX_K;
lists longer than REDO_MAX_K on the products path at any size) the rows not proven take
the brute force restricted to them on small items (``Plan.redo``), else the Triton search
restricted to them, for k + CANDIDATE_SLACK neighbours re-measured in the reference's
arithmetic (the programs of either without such a row return at once;
``_lists_in_capture``, and the products path's ``_in_blocks``, float64 products first),
and no host read. Otherwise one host read: on GPUs the stored products of steps 1-3 redo them
first, then the Triton search (CUDA) or the reference (CPUs, float64) what still fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading

import torch

from .... import _background, _triton
from ...._triton import lazy
from ....backends import FLOATING, Backend
from .. import pairs, reference
from ..cpu import backend as cpu_backend
from ..cpu import native as select
from ..triton import backend as triton_grid
from ..triton import grid
from .certificate import beyond_expansion, roundoff
from .frames import Frames, tf32_split
from .replays import Replays

triton_dense = lazy(f"{__package__}.kernels")
log = logging.getLogger(__name__)

# Candidates beyond k re-measured in the reference's arithmetic: a margin for the certificate.
CANDIDATE_SLACK = 8
# Chunks chosen beyond k on GPUs (see "On GPUs"): a margin for the certificate (with
# triton_dense.products.FUSED_CHUNK 2: see there).
CHUNK_SLACK = 6
# The GPU path's products: three TF32 products carry float32's significand. One TF32 product (u =
# 2^-10) fails the certificate on 0.5-2 % of normal rows (D = 16-128, measured; with operands
# rounded beforehand and their residuals bounded, none: HALF_FIRST_MIN_DIM). Three bfloat16 products
# (each operand in two bfloat16 parts, eps 2^-14) were faster but sent back ~20 times the rows of
# clustered clouds.
TENSOR_CORE_PRECISION = "tf32x3"
# The first products of the stored minima (wide clouds) for points of at least HALF_FIRST_MIN_DIM
# coordinates: one product of operands rounded to float16 beforehand (each product exact, the
# rounding's residuals bounded per query: ``_products``); the valid rows they leave unproven go
# again in TENSOR_CORE_PRECISION, only their tiles multiplied.
HALF_FIRST_MIN_DIM = 64
# ... and on the fused lists (``_fused_lists``: both passes four kernels in all).
FUSED_HALF_FIRST_MIN_DIM = 64
# The products of one block of queries, at most. On CPUs narrow points want blocks near the caches
# (writing the products is the cost) and wide ones tall blocks (BLAS is the cost).
BLOCK_BYTES = {"cpu": 32 * 2**20, "cuda": 2**30}
CPU_WIDE_BLOCK_BYTES, CPU_WIDE_DIM = 512 * 2**20, 32  # from D = 32 on
# Items of up to this many products' bytes share a block (fewer operators).
CPU_GROUP_BYTES = 16 * 2**20
# Candidate rows gathered at a time for the exact re-measure on CPUs: cache-sized pieces, the
# same bits as one gather and several times faster (NOTES.md).
CPU_REMEASURE_BYTES = 2 * 2**20
# The longest lists the Triton search's redo gets CANDIDATE_SLACK more for, whose small eager
# calls are replayed from CUDA graphs (``replays``), and up to which a capture keeps the pair limit
# PRODUCTS_CAPTURE_MAX_PAIRS; beyond, a capture takes the products path at any size (``plan``),
# whose float64 pass leaves the search few rows (it keeps a row's list in registers).
REDO_MAX_K = 256
# Outside a capture, unproven rows on GPUs are redone with this many times the candidates a pass
# (``_redo``): the scalar search they went to instead took ~0.1-1 ms a row at D >= 256 (2,000 x
# 50,000 D=1024 k=256, Gaussian: 180 ms against cdist + topk's 6.5).
REDO_GROWTH = 4
# Candidate rows gathered at a time for the exact re-measure in torch on GPUs (``_in_torch``).
CUDA_REMEASURE_BYTES = 256 * 2**20
# Up to this many members a query, every member is measured in the reference's arithmetic (no first
# measure and selection of the k + CANDIDATE_SLACK least).
MEASURED_ALL_MAX = 64


def _gather_rows(points, rows, out=None):
    """points [B, N, D] at rows [B, ...] (>= 0) -> [B, ..., D]: index_select of the flattened
    rows (on CPUs 5x advanced indexing, 16 x 256 x 28 rows of D = 64: 1.4 ms against 7.8,
    and a gather with an expanded index was 3x slower still), into ``out`` when given."""
    batch, size, dim = points.shape
    offsets = (torch.arange(batch, device=points.device) * size).reshape(-1, *[1] * (rows.dim() - 1))
    flat = (rows + offsets).reshape(-1)
    if out is None:
        return points.reshape(-1, dim).index_select(0, flat).reshape(*rows.shape, dim)
    torch.index_select(points.reshape(-1, dim), 0, flat, out=out.view(-1, dim))
    return out


# Set while a call is answered by torch's own operators alone (``_in_torch``).
_TORCH_ONLY = threading.local()


def _torch_only() -> bool:
    return getattr(_TORCH_ONLY, "on", False)


def _remeasure(q, r, candidates, floors=None, least=0):
    """Distances [B, m, c] from q [B, m, D] to the rows ``candidates`` [B, m, c] of r [B, N, D],
    in the reference's arithmetic. On CPUs, ``floors`` [B, m, c] and ``least``: a row's
    candidates whose floor lies above its first ``least`` may be left unmeasured (+inf)."""
    if q.is_cuda and not _torch_only():
        if triton_dense.measures(q):
            # gathered, squared and summed in one Triton pass, as the reference sums.
            return triton_dense.squared_distances(q, r, candidates).sqrt_()
        return pairs.norm_of_difference(q[:, :, None, :], _gather_rows(r, candidates))
    measured = select.squared_distances(q, r, candidates, floors, least)
    if measured is not None:  # each candidate row read once (C++)
        return measured.sqrt_()
    # Without the extension (or Triton), pieces gathered into one reused buffer (on CPUs
    # cache-sized: fresh pieces of a few MiB each cost page faults, 16 x 256 queries x 28
    # candidates of D = 64, 55% of a call). Above
    # PER_COORDINATE_MAX_DIM the reference's squares and halving sum run in place there:
    # (r - q)^2 is (q - r)^2 bit for bit.
    batch, rows, take = candidates.shape
    dim = q.shape[-1]
    piece = CUDA_REMEASURE_BYTES if q.is_cuda else CPU_REMEASURE_BYTES
    step = max(1, piece // max(1, batch * take * dim * q.element_size()))
    buffer = torch.empty(batch * min(step, rows) * take * dim, dtype=q.dtype, device=q.device)
    out = torch.empty((batch, rows, take), dtype=q.dtype, device=q.device)
    for s in range(0, rows, step):
        piece = candidates[:, s:s + step]
        gathered = _gather_rows(r, piece, out=buffer[:piece.numel() * dim].view(*piece.shape, dim))
        near = q[:, s:s + step, None, :]
        if dim > pairs.PER_COORDINATE_MAX_DIM:
            out[:, s:s + step] = pairs.halving_sum(gathered.sub_(near).square_())
        else:
            out[:, s:s + step] = pairs.squared_difference(near, gathered)
    return out.sqrt_()


def _in_torch_sqrt(q, r, d, i):
    """Lists d, i [B, m, c] that a Triton kernel measured: on CPU tensors (Triton's
    interpreter, whose sqrt is numpy's, correctly rounded, where torch's CPU sqrt may differ by
    an ulp) re-measured by torch and ordered again; as they are on GPUs."""
    if q.is_cuda:
        return d, i
    return pairs.order_by_distance(_remeasure(q, r, i.clamp(min=0)).masked_fill_(i < 0, math.inf), i)


def _within(d, i, scale, radius):
    """Lists d, i [B, m, c] (ascending, in units of ``scale`` [B, 1]) with the entries beyond
    ``radius`` dropped (+inf, -1)."""
    if radius == math.inf:
        return d, i
    keep = d * scale[..., None] <= radius
    return d.masked_fill(~keep, math.inf), i.masked_fill(~keep, -1)


def _exact_lists(q, frames: Frames, candidates, ref_ok, radius, inside=None, needed=None, floors=None, least=0):
    """The ``candidates`` [B, m, c] (reference positions; ``inside`` [B, m, c] marks the real
    ones) of the queries q [B, m, D] re-measured in the reference's arithmetic, the valid
    references within ``radius`` kept, ordered by (distance, index): distances [B, m, c] in
    the frames' units (+inf where dropped), positions (-1 there). On GPUs one Triton kernel
    (``triton_dense.nearest_members``) where it takes them, which skips the rows ``needed``
    [B, m] leaves out (unspecified then). On CPUs, candidates whose ``floors`` [B, m, c] lie
    above a row's first ``least`` distances may be left out (``_remeasure``)."""
    take, dim = candidates.shape[-1], q.shape[-1]
    if q.is_cuda and q.dtype == torch.float32 and not _torch_only() and triton_dense.orders_candidates(take, dim):
        chosen = candidates if inside is None else candidates.masked_fill(~inside, -1)
        d, i, _ = triton_dense.nearest_members(q, frames.r, ref_ok, chosen, 1, take, take, needed)
        return _within(d, i, frames.scale, radius)
    exact = _remeasure(q, frames.r, candidates, floors, least)
    if not q.is_cuda and radius == math.inf and inside is None and bool(ref_ok.all()):
        return select.order_by_distance(exact, candidates)  # nothing to drop (one C++ pass)
    keep = ref_ok.gather(1, candidates.reshape(ref_ok.shape[0], -1)).reshape(candidates.shape)
    keep &= exact * frames.scale[..., None] <= radius
    if inside is not None:
        keep &= inside
    return pairs.order_by_distance(exact.masked_fill(~keep, math.inf), candidates.masked_fill(~keep, -1))


@contextlib.contextmanager
def _cublas_products(precision: str):
    """cuBLAS's float32 products in ``precision`` ("tf32" or "ieee") within the block, the
    caller's setting restored after (torch's per-backend setting where it has one: the legacy
    flag beside it would make ``torch.get_float32_matmul_precision`` refuse to answer)."""
    matmul = torch.backends.cuda.matmul
    name = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"
    previous = getattr(matmul, name)
    setattr(matmul, name, precision if name == "fp32_precision" else precision == "tf32")
    try:
        yield
    finally:
        setattr(matmul, name, previous)


def _block(frames: Frames, rows, ref_ok, k, radius, take, precision: str = ""):
    """dists, idx [B, m, min(k, take)] of the queries ``rows`` (a slice or positions) and which of them the
    certificate leaves unproven [B, m]. ``precision``: the products' on CUDA, "ieee" (float32's
    own), "tf32x3" or "float64" (``_least_products``); "": as torch is set."""
    qc = frames.qc[:, rows]
    dim, columns = qc.shape[-1], frames.rc.shape[1]
    with _cublas_products(precision) if precision in ("ieee", "tf32") else contextlib.nullcontext():
        values, candidates = _least_products(qc, frames, take, precision)
    q_norms = frames.q_norms[:, rows]
    q_abs = q_norms.sqrt()
    if precision == "float64":
        q_norms = qc.double().square().sum(-1)
    if qc.is_cuda:  # (the candidates in no order: ``_least_products``)
        last = values.amax(-1)
        d, candidates = _exact_lists(frames.q[:, rows], frames, candidates, ref_ok, radius)
        outside = _floor(last + q_norms, q_abs, frames.reach, dim, precision)
    else:  # the candidates past the k-th by more than the products' error are not re-measured
        last = values[..., -1]
        floors = _floor(values + q_norms[..., None], q_abs[..., None], frames.reach[..., None], dim, precision)
        d, candidates = _exact_lists(frames.q[:, rows], frames, candidates, ref_ok, radius, floors=floors, least=k)
        outside = floors[..., -1]
    if take == columns:
        return d[..., :k] * frames.scale[..., None], candidates[..., :k], torch.zeros_like(d[..., 0], dtype=torch.bool)
    # A last candidate at +inf: every valid reference is a candidate already.
    certified = (d[..., k - 1] ** 2 < outside) | torch.isinf(last)
    return d[..., :k] * frames.scale[..., None], candidates[..., :k], ~certified


def _floor(value, q_abs, reach, dim: int, precision: str):
    """``beyond_expansion`` for expanded values ``value`` from ``_least_products`` in
    ``precision``: "tf32x3" within ``product_error`` of q.r before the sums (each term within
    it of q_d r_d: Cauchy-Schwarz), "float64" the float64 products and norms
    followed by the reference's float32 rounding, otherwise as torch is set."""
    if precision == "tf32x3":
        value = value - 2 * triton_dense.product_error("tf32x3") * q_abs * reach
        return beyond_expansion(value, q_abs, reach, dim, 2.0**-24)
    if precision == "float64":
        # The float64 expansion is exact to ~2^-53, but of the float32 centred clouds, each
        # coordinate q - centre rounded once: qc - rc lies within 2^-24 (|qc| + |rc|) of q - r,
        # which the float32 bounds' factor 2 covers and this one must take apart (a far
        # cloud's centred norms ~10^4 its distances: ~10^-3 of a squared distance).
        apart = beyond_expansion(value, q_abs, reach, dim, 2.0**-53).clamp(min=0).sqrt()
        apart = (apart - 2.0**-23 * (q_abs + reach)).clamp(min=0)
        # (back in float32: its rounding, 2^-24 at most, within the factor 2 of the reference's)
        return (apart * apart * (1 - 2 * (dim + 2) * 2.0**-24)).float()
    u = 2.0**-24 if precision == "ieee" and value.dtype == torch.float32 else roundoff(value.dtype)
    return beyond_expansion(value, q_abs, reach, dim, u)


# On CPUs the products of a block of queries are made a tile of this many references at a time
# in one reused buffer (a few MiB: its values stay in the caches), each tile's entries below the
# least so far merged with them (``select.smallest_after``), for lists of up to CPU_TILE_MAX_TAKE
# candidates: each merge re-selects the list, which costs more than whole rows' products beyond
# (2 cores, ms tiles / whole rows: 1 x 2000 x 20000 D=64 k=16 44 / 94, k=100 106 / 128, k=256 192 /
# 117; 3 x 500 x 5000 D=64 k=56 26 / 27, k=100 26 / 22, k=256 55 / 34, k=1024 201 / 68).
CPU_REFERENCE_TILE, CPU_TILE_MAX_TAKE = 2048, 128


_WORKSPACE = threading.local()
# The largest buffer a thread keeps (larger blocks' products cost more than their pages).
WORKSPACE_KEPT_BYTES = 64 * 2**20


def _workspace(count: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU buffer of ``count`` values of ``dtype``, kept per thread from call to call up
    to WORKSPACE_KEPT_BYTES: a block's products rewritten in place. Fresh ones cost their page
    faults each time (1 x 2000 x 20000 D=8, blocks of 32 MiB: 20-70 ms a call, the products ~8)."""
    size = count * dtype.itemsize
    if size > WORKSPACE_KEPT_BYTES:
        return torch.empty(count, dtype=dtype)
    held = getattr(_WORKSPACE, "bytes", None)
    if held is None or held.numel() < size:
        held = _WORKSPACE.bytes = torch.empty(size, dtype=torch.uint8)
    return held[:size].view(dtype)


def _least_products(qc, frames: Frames, take: int, precision: str = ""):
    """(values, positions) [B, m, take]: the take least of |r|^2 - 2 q.r (|q|^2 is constant
    along a row: the order needs no more) over the references of ``frames`` for the queries
    qc [B, m, D], ascending (NaN last) on CPUs, in no order on GPUs (``_least``). ``precision``
    "tf32x3": each operand's two TF32 parts multiplied (``frames.tf32_split``; on cuBLAS's
    tensor cores), "float64": in float64, the norms too. On CPUs the take least of all references are the take least of the tiles'."""
    rc, r_norms = frames.rc, frames.r_norms
    columns = rc.shape[1]
    if precision == "tf32x3":
        # |r|^2 - 2 (high x low + low x high) first, then the main product added in its epilogue:
        # each sum's rounding bounded as one product of D terms (``_floor``)
        high, low = tf32_split(qc)
        dim, parts = qc.shape[-1], frames.tf32_references()
        with _cublas_products("tf32"):
            products = torch.baddbmm(r_norms[:, None, :], torch.cat([high, low], -1),
                                     parts[..., dim:].transpose(1, 2), alpha=-2)
            products.baddbmm_(high, parts[..., :dim].transpose(1, 2), alpha=-2)
        return _least(products, take)
    if precision == "float64":
        qc, rc = qc.double(), rc.double()
        r_norms = rc.square().sum(-1).masked_fill_(torch.isinf(r_norms), math.inf)
        return _least(torch.baddbmm(r_norms[:, None, :], qc, rc.transpose(1, 2), alpha=-2), take)
    if qc.is_cuda:
        return _least(torch.baddbmm(r_norms[:, None, :], qc, rc.transpose(1, 2), alpha=-2), take)
    batch, rows, _ = qc.shape
    if columns <= 2 * CPU_REFERENCE_TILE or qc.shape[-1] < CPU_WIDE_DIM or take > CPU_TILE_MAX_TAKE:
        products = _workspace(batch * rows * columns, qc.dtype).view(batch, rows, columns)
        return select.smallest_of_products(torch.bmm(qc, rc.transpose(1, 2), out=products), r_norms, take)
    buffer = _workspace(batch * rows * CPU_REFERENCE_TILE, qc.dtype)
    least = None
    for start in range(0, columns, CPU_REFERENCE_TILE):
        stop = min(start + CPU_REFERENCE_TILE, columns)
        tile = buffer[:batch * rows * (stop - start)].view(batch, rows, stop - start)
        torch.baddbmm(r_norms[:, None, start:stop], qc, rc[:, start:stop].transpose(1, 2), alpha=-2, out=tile)
        least = (select.smallest(tile, min(take, stop)) if least is None
                 else select.smallest_after(tile, min(take, stop), least, start))
    return least


def _least(values, take: int):
    """``_least_products``' (values, positions) of the take least of each row of values; on GPUs
    in no order (torch.topk unsorted; the lists are ordered once re-measured: 12,000 rows of
    3,000, take 264, H200: 1.03 -> 0.75 ms)."""
    if values.is_cuda:
        return torch.topk(values, take, dim=-1, largest=False, sorted=False)
    return select.smallest(values, take)


def _operands(frames: Frames, rows: slice, precision: str):
    """The products' operands in ``precision`` (the queries ``rows``, a view; the references),
    the factor of their products per item [B] (None: 2) and the low operands of "fp16x3"
    (None elsewhere): "fp16", ``Frames.halves``; "fp16x3", those and ``Frames.lows``;
    otherwise the centred clouds."""
    if precision in ("fp16", "fp16x3"):
        qh, rh, _, _, twice = frames.halves()
        if precision == "fp16":
            return qh[:, rows], rh, twice, None
        ql, rl, _, _ = frames.lows()
        return qh[:, rows], rh, twice, (ql[:, rows], rl)
    return frames.qc[:, rows], frames.rc, None, None


def _products(frames: Frames, rows: slice, precision: str, q_abs):
    """The operands of the products in ``precision`` (the queries ``rows``, the references),
    the factor of their products per item [B] (None: 2) and a bound [B, m] on each query's
    |q.r - the product| over the references, before the float32 sums (step 3 bounds those),
    for queries of norm ``q_abs`` [B, m]. "fp16": the operands rounded to float16 beforehand
    (``Frames.halves``), so that every product is exact and q.r - q'.r' = q_lo.r + q'.r_lo
    (Cauchy-Schwarz on the norms left out; a margin of 2^-10 for their float32 sums).
    "fp16x3": the same form, of ``Frames.lows``' bound, and the low operands (q, r): None
    elsewhere. Otherwise each product's input rounding, ε |q_d r_d|
    (``triton_dense.product_error``), summed: ε |q| |r|."""
    q, r, twice, lows = _operands(frames, rows, precision)
    if precision in ("fp16", "fp16x3"):
        q_lo, r_lo = frames.halves()[2:4] if precision == "fp16" else frames.lows()[2:]
        q_lo = q_lo[:, rows]
        error = (q_lo * frames.reach + (q_abs + q_lo) * r_lo) * (1 + 2.0**-10)
    else:
        error = triton_dense.product_error(precision) * q_abs * frames.reach
    return q.contiguous(), r, twice, error, lows


def _chosen_chunks(frames: Frames, rows: slice, k, precision: str, chunk: int, slack: int, needed=None):
    """Step 1 on GPUs (module docstring, "On GPUs"), never storing the block's M x N products:
    per query the k + ``slack`` chunks with the least minima on tensor cores in
    ``precision`` (chunk numbers [B, m, c]), the chunk size, and ``beyond`` [B, m]: a floor
    under the squared distances, as the reference measures them, of every reference in no
    chosen chunk (+inf: none is left). ``needed`` [B, m]: only tiles of queries holding a
    needed one are multiplied (the others' chunks are unspecified); ``chunk``: references a
    chunk (``Plan``)."""
    dim, columns = frames.qc.shape[-1], frames.rc.shape[1]
    chunks = -(-columns // chunk)
    n_chosen = min(k + slack, chunks)
    q_norms = frames.q_norms[:, rows]
    q_abs = q_norms.sqrt()
    q, r, twice, error, lows = _products(frames, rows, precision, q_abs)
    values, chosen = triton_dense.least_chunks(q, q_norms, r, frames.r_norms, min(n_chosen + 1, chunks), chunk,
                                               precision, needed, twice, lows)
    if values.shape[-1] == n_chosen:
        return chosen, chunk, torch.full_like(q_abs, math.inf)
    # Every reference of an unchosen chunk has a product value v with fl(v + |q|^2) >= the
    # least unchosen sum as least_chunks returns it (rounded down on its fused path), so
    # v + |q|^2 >= that sum less 2^-23 of its magnitude (one rounding of the sum, 2^-24; the
    # product below rounds by 2^-24 at most, hence 2^-22 there).
    last = values[..., -1]
    least = torch.where(last >= 0, last * (1 - 2.0**-22), last * (1 + 2.0**-22))
    beyond = beyond_expansion(least - 2 * error, q_abs, frames.reach, dim, 2.0**-24)
    return chosen[..., :n_chosen], chunk, beyond


def _tensor_core_lists(frames: Frames, rows: slice, ref_ok, k, radius, precision, chunk, slack, needed=None):
    """Steps 1-3 on GPUs, the products in ``precision``: the chosen chunks' members measured
    from differences (relative error below (D + 2) u, no cancellation), the k + CANDIDATE_SLACK nearest
    by that re-measured in the reference's arithmetic (in one kernel,
    ``triton_dense.nearest_members``, where it takes them). Returns ``_exact_lists``' lists
    [B, m, >= k] and ``limit`` [B, m]: a row whose k-th squared distance lies below it is
    exactly the reference's (+inf: every member of every chunk was re-measured). Rows that
    ``needed`` [B, m] (when given) leaves out come back unspecified; ``chunk``, ``slack``:
    references a chunk and chunks chosen beyond k."""
    chosen, chunk, beyond = _chosen_chunks(frames, rows, k, precision, chunk, slack, needed)
    q, dim = frames.q[:, rows].contiguous(), frames.q.shape[-1]
    members = chosen.shape[-1] * chunk
    take = _measured(members, k)
    # Every unmeasured member of a chosen chunk has a first measure >= the last one re-measured.
    shrink = 1 - 4 * (dim + 2) * 2.0**-24
    if triton_dense.ranks_members(members, take, dim):
        d, i, last = triton_dense.nearest_members(q, frames.r, ref_ok, chosen, chunk, take, k, needed)
        d, i = _within(*_in_torch_sqrt(q, frames.r, d, i), frames.scale, radius)
        return d, i, torch.minimum(beyond, last * shrink)
    measured, position = triton_dense.smallest(
        triton_dense.member_distances(q, frames.r, frames.r_norms, chosen, chunk, needed), take, needed=needed)
    candidates = chosen.gather(2, position // chunk) * chunk + position % chunk
    columns = frames.r.shape[1]
    d, i = _exact_lists(q, frames, candidates.clamp(max=columns - 1), ref_ok, radius, candidates < columns,
                        needed)
    if take < members:
        beyond = torch.minimum(beyond, measured[..., -1] * shrink)
    return d, i, beyond


def _measured(members: int, k: int) -> int:
    """Members a query re-measures in the reference's arithmetic (see MEASURED_ALL_MAX)."""
    return members if members <= MEASURED_ALL_MAX else min(k + CANDIDATE_SLACK, members)


def _proven_lists(frames: Frames, rows: slice, ref_ok, k, radius, precision, chunk, slack, needed=None):
    """``_tensor_core_lists`` [B, m, <= k] and the rows the certificate leaves unproven."""
    d, i, limit = _tensor_core_lists(frames, rows, ref_ok, k, radius, precision, chunk, slack, needed)
    kth = d[..., min(k, d.shape[-1]) - 1]
    return d[..., :k], i[..., :k], ~((kth ** 2 < limit) | torch.isinf(limit))


# From this many coordinates the second pass chooses as many chunks a row as the wide rows'
# selection takes (``triton_dense.selection.WIDE_GROUPS`` least, one of them the floor): its rows are those
# the first bound left unproven, a clustered cloud's nearly all, and at D = 128 tf32x3 with k +
# CHUNK_SLACK chunks left some of them unproven still (near-ties), which the capture sends to the
# Triton search over every reference.
WIDE_SLACK_MIN_DIM = 128
# From this many coordinates the stored minima's second products ("fp16x3": float16 halves and
# lows, ``Frames.lows``) take float16 tensor cores, at twice TF32's rate, where "tf32x3" takes three
# TF32 products; both carry ~22 bits of q.r, and the main sum's rounding bounds both. H100, ms
# eager: 2,000 x 50,000 D=1024 k=50 7.00 -> 5.70, D=2048 k=10 12.7 -> 10.6; D=256 and 768 0-3% slower.
HALF_SECOND_MIN_DIM = 1024


# Items of up to SMALL_ITEM_MAX_PAIRS query-reference pairs and SMALL_ITEM_MAX_DIM coordinates
# are measured pair by pair on GPUs outside a capture (one kernel, ``triton_dense.brute_force``)
# instead of by the products' candidates and certificate (~8 launches): eagerly the host's
# launches cost more than the brute force; inside a capture the products win everywhere.
SMALL_ITEM_MAX_PAIRS, SMALL_ITEM_MAX_DIM = 2**16, 64
# On GPUs, lists of at least PRODUCTS_MIN_K on calls of up to PRODUCTS_MAX_PAIRS query-reference
# pairs (PRODUCTS_CAPTURE_MAX_PAIRS inside a capture) take the products path on cuBLAS's tensor
# cores in "tf32x3" (``_least_products``) and torch.topk: the chosen chunks' members grow with k
# (H100, ms as called with no replay / graphed, 4 x 3000^2 D=64 k=256: chunks 6.5 / 6.7, products
# 2.4 / 2.3; at k = 64 and 96 even: NOTES.md). Beyond those pairs torch.topk over every pair costs more than the chunks (2,000 x
# 50,000 D=128 k=256 graphed: 4.7 against 2.7). Wide points stay on the chunks: "tf32x3" products
# cost more there than the float16 first products save (D=1024 k=50: 8.7 against 6.7). One
# float32 product ("ieee") was 5 % faster at D <= 300 and 13 % slower at D = 1024.
PRODUCTS_MIN_K, PRODUCTS_MAX_PAIRS, PRODUCTS_CAPTURE_MAX_PAIRS = 128, 2**28, 2**26
PRODUCTS_PRECISION = "tf32x3"
# Rows unproven inside a capture are redone by the brute force on items of up to this many
# references (of D <= 256; wider points: as many coordinates summed a row, fewer references;
# programs without such a row return at once), by the Triton search on larger ones (per row the
# brute force's scalar sums cost more there).
BRUTE_FORCE_REDO_MAX_COLUMNS = 2**13


def _redone_by_every_pair(dim: int, k: int, columns: int) -> bool:
    """Whether a capture redoes its unproven rows by the brute force (BRUTE_FORCE_REDO_MAX_COLUMNS)."""
    padded = max(256, 1 << max(0, dim - 1).bit_length())
    return triton_dense.brute_force_takes(dim, k) and columns * padded <= BRUTE_FORCE_REDO_MAX_COLUMNS * 256


@dataclasses.dataclass(frozen=True)
class Plan:
    """How "dense" answers one call, decided once from the device, dtype, B, M, N, D, k and
    whether a CUDA graph capture is running, then handed down (``plan``; logged at DEBUG by
    ``logging.getLogger("fullgraph.ops.neighbors.dense.backend")``).

    path: "every pair" (small items on GPUs outside a capture: one kernel measures every
    pair), "tensor cores" (GPUs: chunk minima, chosen chunks, certificate) or "products"
    (CPUs and float64: BLAS products, candidates, certificate; on GPUs long lists,
    first "tf32x3"). capture: the path runs inside a
    capture and redoes unproven rows with no host read. redo: what searches the rows the
    certificate leaves unproven ("every pair", "search": the Triton search,
    "reference"; on tensor cores outside a capture the stored products try them first).
    The tensor-core fields (0 / "" / False elsewhere): first, the first products' precision;
    chunk, chunks, chosen: references a chunk, chunks an item, chunks chosen a query; take,
    members (fused) or candidates (otherwise) re-measured a query; fused, one kernel a query
    measures every member and writes the certified lists; whole, the kernels write every row
    (fused and k <= N: nothing filled first); halved, the fused first pass offers half the
    list; second, second_chunk, second_slack: the second pass's precision, chunk and chunks
    beyond k; width,
    values a query holds at once (block sizes); triton_frames: the frames built by Triton.
    """

    path: str
    capture: bool
    redo: str
    take: int
    width: int
    first: str = ""
    chunk: int = 0
    chunks: int = 0
    chosen: int = 0
    fused: bool = False
    whole: bool = False
    halved: bool = False
    second: str = ""
    second_chunk: int = 0
    second_slack: int = 0
    triton_frames: bool = False


def plan(query, ref, k) -> Plan:
    """The ``Plan`` for lists of k from query [B, M, D] to ref [B, N, D]."""
    rows, columns, dim = query.shape[1], ref.shape[1], query.shape[-1]
    capturing, tensor_cores = _capturing(query), _on_tensor_cores(query)
    capture = tensor_cores and capturing and _capturable("knn", query.dtype, dim, k)
    if capture:
        redo = "every pair" if _redone_by_every_pair(dim, k, columns) else "search"
    else:
        redo = "search" if query.is_cuda and _capturable("knn", query.dtype, dim, k) else "reference"
    if not tensor_cores:
        return Plan("products", False, redo, take=min(k + CANDIDATE_SLACK, columns), width=columns)
    if (not capturing and dim <= SMALL_ITEM_MAX_DIM and triton_dense.brute_force_takes(dim, k)
            and rows * columns <= SMALL_ITEM_MAX_PAIRS):
        return Plan("every pair", False, redo, take=k, width=columns,
                    triton_frames=dim <= triton_dense.clouds.FRAMES_MAX_DIM)
    most_pairs = PRODUCTS_CAPTURE_MAX_PAIRS if capturing else PRODUCTS_MAX_PAIRS
    if k >= PRODUCTS_MIN_K and (query.shape[0] * rows * columns <= most_pairs or (capture and k > REDO_MAX_K)):
        return Plan("products", capture, redo, take=min(k + CANDIDATE_SLACK, columns), width=columns,
                    first=PRODUCTS_PRECISION, triton_frames=dim <= triton_dense.clouds.FRAMES_MAX_DIM)
    chunk = triton_dense.chunk_size(columns, k + CHUNK_SLACK + 1)
    chunks = -(-columns // chunk)
    chosen = min(k + CHUNK_SLACK, chunks)
    take = _measured(chosen * chunk, k)
    stored = chunk != triton_dense.products.FUSED_CHUNK
    fused = not stored and triton_dense.ranks_members(chosen * chunk, take, dim)
    second_slack = (max(CHUNK_SLACK, triton_dense.selection.WIDE_GROUPS - 1 - k) if dim >= WIDE_SLACK_MIN_DIM
                    else CHUNK_SLACK)
    first = "fp16" if dim >= (HALF_FIRST_MIN_DIM if stored else FUSED_HALF_FIRST_MIN_DIM) else TENSOR_CORE_PRECISION
    second = "fp16x3" if first == "fp16" and stored and dim >= HALF_SECOND_MIN_DIM else TENSOR_CORE_PRECISION
    return Plan(
        "tensor cores", capture, redo, take=take, width=max(chunks, (k + second_slack) * chunk), first=first,
        chunk=chunk, chunks=chunks, chosen=chosen, fused=fused, whole=fused and k <= columns,
        halved=(fused and triton_dense.products.FUSED_TILE_HALF and chunks > chosen
                and columns >= triton_dense.products.FUSED_TILE_HALF_MIN_COLUMNS),
        second=second, second_chunk=triton_dense.chunk_size(columns, k + second_slack + 1),
        second_slack=second_slack,
        triton_frames=dim <= triton_dense.clouds.FRAMES_MAX_DIM)


def _fused_lists(plan: Plan, frames: Frames, rows: slice, query_ok, ref_ok, k, radius, dists, idx, unproven):
    """Steps 1-3 on the fused lists (chunks of ``triton_dense.products.FUSED_CHUNK``) where one kernel
    a query measures every member: two kernels (``least_chunk_keys``, ``certified_lists``)
    write the block's lists, in the frames' scale and within ``radius``, and its unproven
    valid rows straight into dists / idx [B, M, k] and unproven [B, M]; products in
    ``plan.first`` and the rows they leave unproven again in TENSOR_CORE_PRECISION (two more
    kernels, only their tiles multiplied). Where the first pass's tiles offer half the list
    (``plan.halved``; the greatest they offer a floor under the unchosen chunks,
    ``least_chunk_keys(floor=True)``), a second pass follows it always."""
    q_norms, q = frames.q_norms[:, rows], frames.q[:, rows]
    on_gpu = q.is_cuda
    passes = [(plan.first, plan.halved)]
    if plan.first != TENSOR_CORE_PRECISION or plan.halved:
        passes.append((TENSOR_CORE_PRECISION, False))
    for again, (precision, floor) in enumerate(passes):
        q_op, r_op, twice, _ = _operands(frames, rows, precision)
        if precision == "fp16":  # (the kernel bounds the error as ``_products`` does)
            _, _, q_lo, r_lo, _ = frames.halves()
            error = (q_lo[:, rows], r_lo)
        else:
            error = triton_dense.product_error(precision)
        keys, position_bits = triton_dense.least_chunk_keys(
            q_op, q_norms, r_op, frames.r_norms, min(plan.chosen + 1, plan.chunks), precision, twice,
            unproven[:, rows] if again else None, floor)
        triton_dense.certified_lists(q, frames.r, ref_ok, query_ok, keys, position_bits, plan.chosen, plan.take,
                                     q_norms, frames.reach, frames.scale, error, radius if on_gpu else math.inf,
                                     dists, idx, unproven, rows.start, bool(again))
    if not on_gpu:  # Triton's interpreter: distances in torch's sqrt (``_in_torch_sqrt``)
        scale = frames.scale[..., None]
        d, i = _within(*_in_torch_sqrt(q, frames.r, dists[:, rows] / scale, idx[:, rows]), frames.scale, radius)
        dists[:, rows], idx[:, rows] = d * scale, i


def _block_on_tensor_cores(plan: Plan, frames: Frames, rows: slice, query_ok, ref_ok, k, radius, dists, idx,
                           unproven):
    """``_block`` on GPUs, into dists / idx [B, M, k] and unproven [B, M] at ``rows``:
    ``_fused_lists`` where the plan takes them; else products in ``plan.first``, and the
    valid rows they leave unproven again in ``plan.second`` (only their tiles multiplied,
    ``plan.second_slack`` chunks beyond k chosen)."""
    if plan.fused:
        return _fused_lists(plan, frames, rows, query_ok, ref_ok, k, radius, dists, idx, unproven)
    d, i, still = _proven_lists(frames, rows, ref_ok, k, radius, plan.first, plan.chunk, CHUNK_SLACK)
    if plan.first != TENSOR_CORE_PRECISION:
        again = still & query_ok[:, rows]
        found_d, found_i, left = _proven_lists(frames, rows, ref_ok, k, radius, plan.second, plan.second_chunk,
                                               plan.second_slack, again)
        redo = again[..., None]
        d, i, still = torch.where(redo, found_d, d), torch.where(redo, found_i, i), again & left
    dists[:, rows, :d.shape[-1]], idx[:, rows, :d.shape[-1]] = d * frames.scale[..., None], i
    unproven[:, rows] = still


def _lists_in_capture(plan: Plan, query, ref, frames, k, radius, query_lengths, ref_lengths, dists, idx):
    """The tensor-core path inside a CUDA graph capture, with no host read: the rows the
    certificate leaves unproven take the brute force's lists or the Triton search's
    re-measured in the reference's arithmetic (``plan.redo``; the programs of either without
    such a row return at once)."""
    batch, rows, _ = query.shape
    query_ok, ref_ok = frames.query_ok, frames.ref_ok
    # (where the kernels write every row, only valid rows are flagged: nothing to clear first)
    unproven = (torch.empty if plan.whole else torch.zeros)((batch, rows), dtype=torch.bool, device=query.device)
    step = max(1, BLOCK_BYTES["cuda"] // (batch * plan.width * frames.q.element_size()))
    for start in range(0, rows, step):
        _block_on_tensor_cores(plan, frames, slice(start, min(start + step, rows)), query_ok, ref_ok, k, radius, dists,
                               idx, unproven)
    if not plan.whole:
        unproven &= query_ok
    if plan.redo == "search" and query.shape[-1] >= CAPTURE_AGAIN_MIN_DIM:
        _first_failed_again(frames, k, radius, unproven, dists, idx)
    if plan.redo == "every pair":
        return _every_pair(frames, ref_ok, k, radius, dists, idx, needed=unproven)
    _by_search(query, ref, frames, k, radius, query_lengths, ref_lengths, unproven, dists, idx)


def _grid(frames: Frames):
    """The Triton search's one-cell grid (points of D > 3) from the frames, or None (D <= 3:
    the search builds its grid)."""
    if frames.q.shape[-1] <= 3 or frames.q.dtype != torch.float32:
        return None
    return grid.one_cell(frames.q.contiguous(), frames.r.contiguous(), frames.query_ok, frames.ref_ok, frames.scale)


def _capturing(query) -> bool:
    return query.is_cuda and torch.cuda.is_current_stream_capturing()


def _on_tensor_cores(query) -> bool:
    return query.is_cuda and query.dtype != torch.float64 and _triton.available()


def _every_pair(frames: Frames, ref_ok, k, radius, dists, idx, needed=None) -> None:
    """Every pair measured (``triton_dense.brute_force``): the lists into dists / idx (only
    the rows ``needed`` [B, M] marks, when given), on GPUs by the kernel itself."""
    sort_from = triton_grid.SEARCH_SORT_FROM if frames.q.is_cuda else triton_grid.INTERPRETER_SORT_FROM
    if frames.q.is_cuda:
        triton_dense.brute_force(frames.q, frames.r, ref_ok, k, sort_from, needed=needed, scale=frames.scale,
                                 radius=radius, out=(dists, idx))
        return
    found, position = triton_dense.brute_force(frames.q, frames.r, ref_ok, k, sort_from, needed=needed)
    found, position = _in_torch_sqrt(frames.q, frames.r, found, position)
    found = found * frames.scale[..., None]
    keep = found <= radius
    found, position = found.masked_fill_(~keep, math.inf), position.masked_fill_(~keep, -1)
    if needed is not None:
        found, position = torch.where(needed[..., None], found, dists), torch.where(needed[..., None], position, idx)
    dists.copy_(found)
    idx.copy_(position)


def _redo(plan: Plan, query, ref, frames, k, radius, query_lengths, ref_lengths, failed, dists, idx):
    """Search the ``failed`` [B, M] rows again exactly, in place (host reads; a capture takes
    ``_lists_in_capture``): on GPUs by the stored products when the chunks missed, then in
    float64 products with REDO_GROWTH times the candidates a pass until every row is proven
    (all references candidates at last: near-ties of wide points, duplicates); elsewhere by
    ``plan.redo``."""
    if not bool(failed.any()):
        return
    if plan.path == "tensor cores" or plan.first:  # (the GPUs' products path has a precision)
        columns = ref.shape[1]
        take = min(k + CANDIDATE_SLACK, columns)
        # the tensor cores' chunks missed: the products; the products missed: the same in float64
        precision = "float64" if plan.path == "products" else ""
        budget = max(1, BLOCK_BYTES["cuda"] // (columns * 8))
        while True:
            counts, rows_of = _failed_rows(failed)
            for b, rows in enumerate(rows_of):
                for start in range(0, counts[b], budget):
                    some = rows[start:start + budget]
                    d, i, still = _block(frames.items(slice(b, b + 1)), some, frames.ref_ok[b:b + 1], k, radius,
                                         take, precision)
                    dists[b, some, :d.shape[-1]], idx[b, some, :d.shape[-1]], failed[b, some] = d[0], i[0], still[0]
            if take == columns or not bool(failed.any()):
                return
            take, precision = min(take * REDO_GROWTH, columns), "float64"
    if plan.redo == "search":
        return _by_search(query, ref, frames, k, radius, query_lengths, ref_lengths, failed, dists, idx)
    counts, rows_of = _failed_rows(failed)
    for b, rows in enumerate(rows_of):
        if counts[b]:
            lengths = None if ref_lengths is None else ref_lengths[b:b + 1]
            d, i, _ = reference.nearest(query[b:b + 1, rows], ref[b:b + 1], k, radius, None, lengths)
            dists[b, rows], idx[b, rows] = d[0].to(dists.dtype), i[0]


def _failed_rows(failed):
    """(counts, rows) of failed [B, M]: each item's count of failed rows (a list) and their
    positions [count] (two host reads for all items, not one an item)."""
    counts = failed.sum(1).tolist()
    return counts, failed.nonzero()[:, 1].split(counts)


# Inside a capture, from this many coordinates the rows the tensor cores leave unproven on items
# the Triton search redoes are measured again in float32 products first, up to this share of an
# item's queries (the first failed ones; at least CAPTURE_AGAIN_MIN_ROWS), with no host read: one
# failed row cost the search over D = 256 about as much as a whole call, and this pass costs
# what it measures whether or not a row failed (NOTES.md).
CAPTURE_AGAIN_MIN_DIM = 129
CAPTURE_AGAIN_SHARE, CAPTURE_AGAIN_MIN_ROWS = 1 / 128, 64


def _first_failed_again(frames: Frames, k, radius, failed, dists, idx, precision: str = "ieee") -> None:
    """With no host read, the first ``failed`` [B, M] rows of each item (a fixed number,
    CAPTURE_AGAIN_SHARE of M) go through ``_block`` again in ``precision``'s products; those
    it proves are written into dists / idx and cleared in ``failed``."""
    batch, rows = failed.shape
    count = min(rows, max(CAPTURE_AGAIN_MIN_ROWS, math.ceil(rows * CAPTURE_AGAIN_SHARE)))
    # the failed rows first, in order (a stable sort of the flags)
    chosen = torch.sort(failed.to(torch.uint8), dim=1, descending=True, stable=True)[1][:, :count]
    taken = Frames.of({**vars(frames), **{name: getattr(frames, name).gather(1, _expand(chosen, getattr(frames, name)))
                                          for name in ("q", "qc", "q_norms")}})
    d, i, still = _block(taken, slice(None), frames.ref_ok, k, radius, min(k + CANDIDATE_SLACK, frames.r.shape[1]),
                         precision)
    proven = failed.gather(1, chosen) & ~still
    width = d.shape[-1]
    at = chosen[..., None].expand(-1, -1, width)
    dists[..., :width].scatter_(1, at, torch.where(proven[..., None], d, dists[..., :width].gather(1, at)))
    idx[..., :width].scatter_(1, at, torch.where(proven[..., None], i, idx[..., :width].gather(1, at)))
    failed.scatter_(1, chosen, failed.gather(1, chosen) & ~proven)


def _expand(positions, like):
    """positions [B, m] as a gather index for ``like`` [B, M, ...]."""
    return positions.reshape(*positions.shape, *[1] * (like.dim() - 2)).expand(-1, -1, *like.shape[2:])


def _by_search(query, ref, frames, k, radius, query_lengths, ref_lengths, failed, dists, idx):
    """The Triton search over the ``failed`` rows (its programs without one return at once),
    for k + CANDIDATE_SLACK neighbours re-measured in the reference's arithmetic: its own
    sums over D may differ from the reference's in the last bit, and so order near-ties
    differently."""
    take = max(k, min(k + CANDIDATE_SLACK, REDO_MAX_K))
    _, found, _ = triton_grid.nearest(query, ref, take, radius, query_lengths, ref_lengths, needed=failed,
                                      built=_grid(frames))
    d, i = _exact_lists(frames.q, frames, found.clamp(min=0), frames.ref_ok, radius, found >= 0, needed=failed)
    d = d[..., :k] * frames.scale[..., None]
    dists.copy_(torch.where(failed[..., None], d.to(dists.dtype), dists))
    idx.copy_(torch.where(failed[..., None], i[..., :k], idx))


def _in_blocks(plan: Plan, query, ref, frames, k, radius, query_lengths, ref_lengths, dists, idx):
    """Steps 1-3 a block of queries at a time, then the failed rows redone (``_redo``; inside a
    capture, ``_by_search``)."""
    batch, rows, _ = query.shape
    query_ok, ref_ok = frames.query_ok, frames.ref_ok
    columns = ref.shape[1]
    failed = torch.zeros((batch, rows), dtype=torch.bool, device=query.device)
    budget = BLOCK_BYTES.get(query.device.type, BLOCK_BYTES["cpu"])
    if not query.is_cuda and query.shape[-1] >= CPU_WIDE_DIM:
        budget = CPU_WIDE_BLOCK_BYTES
    # On CUDA every item at once (fewer launches); on CPUs items of up to CPU_GROUP_BYTES of
    # products together (fewer operators for small clouds), larger ones one at a time, whose
    # products stay nearer the caches.
    per_item = rows * columns * frames.q.element_size()
    together = batch if query.is_cuda else max(1, min(batch, CPU_GROUP_BYTES // per_item))
    on_tensor_cores = plan.path == "tensor cores"
    for start_item in range(0, batch, together):
        items = slice(start_item, start_item + together)
        part = frames.items(items)
        step = max(1, budget // (part.q.shape[0] * plan.width * frames.q.element_size()))
        for start in range(0, rows, step):
            block = slice(start, min(start + step, rows))
            if on_tensor_cores:
                _block_on_tensor_cores(plan, part, block, query_ok[items], ref_ok[items], k, radius, dists[items],
                                       idx[items], failed[items])
                continue
            d, i, failed[items, block] = _block(part, block, ref_ok[items], k, radius, plan.take, plan.first)
            dists[items, block, :d.shape[-1]], idx[items, block, :d.shape[-1]] = d, i
    failed &= query_ok
    if plan.capture:  # (the search's programs without a failed row return at once)
        if plan.first:
            _first_failed_again(frames, k, radius, failed, dists, idx, "float64")
        return _by_search(query, ref, frames, k, radius, query_lengths, ref_lengths, failed, dists, idx)
    _redo(plan, query, ref, frames, k, radius, query_lengths, ref_lengths, failed, dists, idx)


def nearest(query, ref, k, radius, query_lengths, ref_lengths):
    """``pairs.Kernels.nearest`` by matrix products (see the module docstring). An eager GPU
    call whose Triton kernels are not compiled yet is answered by ``_in_torch`` while they
    compile in the background (``_background``); a capture compiles them where it stands."""
    batch, rows, _ = query.shape
    shape, device = (batch, rows, k), query.device
    if batch * rows * ref.shape[1] == 0:
        return (torch.full(shape, math.inf, dtype=query.dtype, device=device), torch.full(shape, -1, device=device),
                torch.zeros((batch, rows), dtype=torch.int64, device=device))
    if not query.is_cuda:  # (tensor cores on CPU tensors: Triton's interpreter, the tests')
        if not _on_tensor_cores(query):
            found = None
            if lists_of_most(k, ref.shape[1]):
                found = cpu_backend.brute_force(query, ref, k, radius, query_lengths, ref_lengths)
            if found is None:
                found = _plain_on_cpu(query, ref, k, radius, query_lengths, ref_lengths)
            if found is not None:
                return found
        return _planned(plan(query, ref, k), query, ref, k, radius, query_lengths, ref_lengths)
    if _capturing(query):
        return _planned(plan(query, ref, k), query, ref, k, radius, query_lengths, ref_lengths)
    if _on_tensor_cores(query) and k <= REDO_MAX_K and not _background.pending():
        replayed = _REPLAYS(query, ref, k, radius, query_lengths, ref_lengths)
        if replayed is not None:
            return replayed
    try:
        with _background.deferring():
            return _planned(plan(query, ref, k), query, ref, k, radius, query_lengths, ref_lengths)
    except _background.Compiling:
        return _in_torch(query, ref, k, radius, query_lengths, ref_lengths)


# On CPUs lists of at least 1 / CPU_MOST_SHARE of the references (k + CANDIDATE_SLACK) are the brute
# force's (every pair measured exactly): the products select little there and their candidates
# are measured exactly anyway (2 cores, ms brute force / products / cdist + topk: 16 x 128 x 16 D=64
# k=16 0.57 / 1.65; 1 x 300^2 D=512 k=256 3.1 / 5.4 / 3.1, k=150 2.9 / 3.3 / 2.4; 1 x 128^2 D=256
# k=100 0.34 / 0.58 / 0.71; 1 x 1000^2 D=128 k=800 23 / 39 / 31, D=512 k=600 38 / 58 / 32). At a
# third the products hold at wide points (1 x 300^2 D=512 k=100 2.8 / 2.7; 4 x 64^2 D=512 k=16
# 0.79 / 0.33-0.49).
CPU_MOST_SHARE = 2


def lists_of_most(k, columns) -> bool:
    """Whether CPU lists of ``k`` of ``columns`` references go to the brute force (CPU_MOST_SHARE)."""
    return CPU_MOST_SHARE * (k + CANDIDATE_SLACK) >= columns


# CPU calls of at most this many query-reference pairs (all items) whose points are plain (finite,
# in scaling's unscaled range, no lengths) go by one product of the uncentred clouds first
# (``_plain_on_cpu``): the frames' centring and scaling are ~60 of the ~100 torch operators a
# call takes, most of a small call (1 x 64 x 256 D=1024 k=8, 2-core CPU: NOTES.md).
PLAIN_CPU_MAX_PAIRS = 2**22
# ... with k + CANDIDATE_SLACK candidates a query, and k / PLAIN_SLACK_SHARE from k = 128: one row
# whose k-th distance lies within the products' error of the last candidate's refuses the whole
# call to the usual path, and long lists of wide points crowd (1 x 500 x 2000 D=768 k=256: refused
# at k + 8, proven at k + 16; 1 x 500 x 5000 D=256 k=1024 refused in one draw of two, ~36 ms
# against ~100 by the usual path); the re-measure stops at the k-th's floor, so more cost little.
PLAIN_SLACK_SHARE = 16


def _plain_take(k) -> int:
    """The plain path's candidates a query for lists of ``k``."""
    return k + max(CANDIDATE_SLACK, k // PLAIN_SLACK_SHARE)


def _plain_on_cpu(query, ref, k, radius, query_lengths, ref_lengths):
    """``nearest``'s kNN of a small CPU call on plain points in one C++ call
    (``select.plain_nearest``): steps 1-3 of the module docstring without centring (the bound
    takes the uncentred norms); None where the call is not such or any row is left unproven
    (the usual path then answers all of it)."""
    batch, rows, _ = query.shape
    take = _plain_take(k)
    if (radius != math.inf or query_lengths is not None or ref_lengths is not None or take >= ref.shape[1]
            or batch * rows * ref.shape[1] > PLAIN_CPU_MAX_PAIRS):
        return None
    # (float16 / bfloat16 in float32, as the usual path's frames hold them)
    acc = pairs.accumulation_dtype(query.dtype)
    found = select.plain_nearest(query.to(acc), ref.to(acc), k, take, roundoff(acc))
    # (plain kNN's callers read no counts: ``pairs.Kernels.nearest``)
    return None if found is None else (found[0].to(query.dtype), found[1],
                                       torch.empty((batch, rows), dtype=torch.int64))


# Eager calls and compiled graphs take ``plain_in_one_call`` up to this many pair-coordinates
# (B M N D): where it refuses (points not plain, a row unproven) it measures every pair, a few
# ms at most on 2 cores; beyond, the public operator's ~0.05-0.07 ms is a small part of a call.
PLAIN_ONE_CALL_MAX_WORK = 2**22


def plain_in_one_call(query, ref, k):
    """``nearest``'s plain kNN lists (dists, idx) [B, M, k] of CPU clouds query [B, M, D] and ref
    [B, N, D] (no lengths, no radius, the arguments checked) in one C++ call past the public
    operator (``api``: small eager calls, and the graphs torch.compile traces), where
    ``nearest`` answers in one: lists of most references (``lists_of_most``) by the brute force's, small
    calls by ``_plain_on_cpu``'s, every pair measured in the same call where that one refuses
    (``select.small_nearest_unchecked``, one output shape). None where ``nearest`` takes another
    path or the call is larger. The operator's layers cost ~0.05 ms eagerly and ~0.07 ms in a
    compiled graph, a third of such a call (2-core CPU, compiled 1 x 50 x 400 D=200 k=8: 0.26 ->
    0.2 ms; cdist + topk compiled 0.21)."""
    if _on_tensor_cores(query):
        return None
    batch, rows, dim = query.shape
    columns = ref.shape[1]
    if lists_of_most(k, columns):
        return cpu_backend.tiny_lists(query, ref, k)
    if batch * rows * columns * dim > PLAIN_ONE_CALL_MAX_WORK:
        return None
    acc = pairs.accumulation_dtype(query.dtype)
    dists, idx = select.small_nearest_unchecked(query.to(acc), ref.to(acc), k, _plain_take(k))
    return dists.to(query.dtype), idx


def _in_torch(query, ref, k, radius, query_lengths, ref_lengths):
    """The products path (``Plan.path`` "products", "tf32x3") in torch's own operators alone,
    its unproven rows redone in float64 (``_redo``): no kernel to compile, the same lists."""
    columns = ref.shape[1]
    chosen = Plan("products", False, "reference", take=min(k + CANDIDATE_SLACK, columns), width=columns,
                  first=PRODUCTS_PRECISION)
    _TORCH_ONLY.on = True
    try:
        return _planned(chosen, query, ref, k, radius, query_lengths, ref_lengths)
    finally:
        _TORCH_ONLY.on = False


def _planned(chosen: Plan, query, ref, k, radius, query_lengths, ref_lengths):
    """``nearest`` as ``chosen`` says."""
    batch, rows, _ = query.shape
    acc = pairs.accumulation_dtype(query.dtype)
    shape, device = (batch, rows, k), query.device
    if query.is_cuda and not _capturing(query) and (query.shape[-1] >= CAPTURE_AGAIN_MIN_DIM or k >= PRODUCTS_MIN_K):
        # A capture of this call takes cuBLAS, whose handle cannot be created while capturing:
        # made here, in the eager calls that warm a capture up.
        torch.cuda.current_blas_handle()
    if log.isEnabledFor(logging.DEBUG):
        log.debug("knn %s x %s, k = %d: %s", tuple(query.shape), tuple(ref.shape), k, chosen)
    whole = chosen.whole  # (invalid queries' rows too)
    dists = torch.empty(shape, dtype=acc, device=device) if whole else torch.full(shape, math.inf, dtype=acc,
                                                                                   device=device)
    idx = torch.empty(shape, dtype=torch.int64, device=device) if whole else torch.full(shape, -1, device=device)
    if chosen.triton_frames:
        frames = Frames.of(triton_dense.frames(query, ref, query_lengths, ref_lengths, halves=chosen.first == "fp16"))
    else:
        frames = Frames(query, ref, query_lengths, ref_lengths, acc)
    if chosen.path == "every pair":
        _every_pair(frames, frames.ref_ok, k, radius, dists, idx)
    elif chosen.capture and chosen.path == "tensor cores":
        _lists_in_capture(chosen, query, ref, frames, k, radius, query_lengths, ref_lengths, dists, idx)
    else:
        _in_blocks(chosen, query, ref, frames, k, radius, query_lengths, ref_lengths, dists, idx)
    if not whole:
        ok = frames.query_ok[..., None]
        dists, idx = dists.masked_fill(~ok, math.inf), idx.masked_fill(~ok, -1)
    # (plain kNN's callers read no counts: ``pairs.Kernels.nearest``)
    counts = (idx >= 0).sum(-1) if radius < math.inf else torch.empty((batch, rows), dtype=torch.int64, device=device)
    return dists.to(query.dtype), idx, counts


# Small eager calls whose signature comes back, replayed from CUDA graphs (``replays``).
_REPLAYS = Replays(nearest)


class DenseKernels(pairs.Kernels):
    nearest = staticmethod(nearest)


# Where "auto" takes it.
AUTO_MIN_DIM = 10
# Below D = 10, small items too: the tree's per-item work (its queries' threads, the exact
# re-measure and ordering in torch) outweighs the products up to about these query-reference pairs
# per item.
CPU_AUTO_MAX_PAIRS = 2**22
CPU_AUTO_WIDE_DIM, CPU_AUTO_WIDE_MAX_PAIRS = 6, 2**26
# Items of up to these query-reference pairs, by D, are left to the "cpu" backend's brute force
# (every pair measured in C++, 16 references at a time in vectors; bit for bit the reference's
# lists), where the C++ extension built; by the threads torch uses (the table of the nearest
# measured count, in ratio). Beyond D = 32 on 2 threads small calls of plain points take one C++
# call here (``_plain_on_cpu``), faster than the brute force (1.1-1.8x at D = 48-64), and so do
# items of more than 2^16 pairs at D = 4-16 (1.2-1.8x: NOTES.md).
CPU_BRUTE_FORCE = {  # threads: ((largest D, largest pairs per item), ...)
    2: ((32, 2**16),),
    16: ((32, 2**22), (64, 2**21), (128, 2**20)),
}


# Lists of at least CPU_LONG_LISTS_K on items of up to CPU_LONG_LISTS_MAX_PAIRS pairs and
# CPU_LONG_LISTS_MAX_DIM coordinates go to the brute force too: selecting the k + slack least
# and re-measuring them costs more there than measuring every pair exactly (NOTES.md).
CPU_LONG_LISTS_K, CPU_LONG_LISTS_MAX_PAIRS, CPU_LONG_LISTS_MAX_DIM = 48, 2**18, 64


def brute_force_limits() -> tuple[tuple[int, int], ...]:
    """CPU_BRUTE_FORCE's row for the measured thread count nearest (in ratio) to torch's."""
    threads = max(1, torch.get_num_threads())
    return CPU_BRUTE_FORCE[min(CPU_BRUTE_FORCE, key=lambda measured: abs(math.log(threads / measured)))]
# CUDA, over the Triton search (a one-cell grid, a scalar brute force above D = 3): NOTES.md.
CUDA_AUTO_MIN_DIM = 4


def _auto(device_type, dtype, dim, k, size=None) -> bool:
    """``Backend.auto_when``: size is the query-reference pairs per batch item (None: unknown)."""
    if dim is None:
        return False
    if device_type == "cuda":
        # (beyond CAPTURE_MAX_K only outside a capture: the op resolves "auto" when it runs)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        return dim >= CUDA_AUTO_MIN_DIM and _capturable("knn", dtype, dim, k if capturing else min(k, CAPTURE_MAX_K))
    if size is not None and left_to_brute_force(dim, k, size, brute_force_limits()):
        return not select.available()
    return products_on_cpu(dim, size)


def products_on_cpu(dim, size) -> bool:
    """Whether "auto" takes this backend for a CPU call of D = ``dim`` and ``size``
    query-reference pairs per item (None: unknown) that it leaves to no brute force."""
    limit = CPU_AUTO_WIDE_MAX_PAIRS if dim >= CPU_AUTO_WIDE_DIM else CPU_AUTO_MAX_PAIRS
    return dim >= AUTO_MIN_DIM or (size is not None and size <= limit)


def left_to_brute_force(dim, k, size, limits) -> bool:
    """Whether "auto" leaves a CPU call of D = ``dim``, lists of ``k`` (None: unknown) and
    ``size`` query-reference pairs per item to the "cpu" backend's brute force where the C++
    extension runs, by the CPU_BRUTE_FORCE row ``limits`` (``brute_force_limits``). (The
    rows first: a compiled graph guards on each comparison made, and a model's D is fixed.)"""
    for most_dim, most in limits:
        if dim <= most_dim and size <= most:
            return True
    if size * dim <= cpu_backend.TINY_MAX_WORK:
        return True
    return (k is not None and k >= CPU_LONG_LISTS_K and size <= CPU_LONG_LISTS_MAX_PAIRS
            and dim <= CPU_LONG_LISTS_MAX_DIM)


# The longest lists a capture takes (beyond, "auto" takes another backend while a capture runs):
# the Triton search that redoes what the float64 pass leaves keeps a row's list in registers
# (measured up to k = 1,024 on the H100; such a list needs N >= k beyond registration.MAX_PADDED_K).
CAPTURE_MAX_K = 1024


def _capturable(op, dtype, dim, k) -> bool:
    """Failed rows are redone without a host read on CUDA in float16/bfloat16/float32, lists of
    up to CAPTURE_MAX_K (see the module docstring)."""
    return dtype != torch.float64 and k <= CAPTURE_MAX_K and _triton.available()


BACKEND = Backend(
    "dense", ops=("knn", "knn_aggregate"), devices=("cpu", "cuda"), dtypes=FLOATING, auto_devices=("cpu", "cuda"),
    auto_when=_auto, capturable=_capturable, implementation=DenseKernels(),
)
