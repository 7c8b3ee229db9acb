"""The ``take`` smallest values of every row, ascending, with their positions: the dense
backend's candidate selection (and, by the same C++ extension, its re-measure on CPUs:
``squared_distances``; the cpu backend's ``weighted_sums``; ``knn_reduce``'s CPU kernels,
``reduce.py``). On CPUs a C++ extension (``csrc/smallest.cpp``, built on first
use by ``fullgraph._extension``) bounds each row's take-th smallest value by group minima,
keeps only the entries under the bound and orders those, ties to the smaller position (4x
torch.topk on the 2-core development CPU: 8 x 2048 rows of 2,048 float32, 28 kept: 18 ms
against 79). float32 survivors are (value bits, position) words: with AVX-512 each word's rank
is counted against all of them in vectors (``csrc/ranking.h``; 16 x 256 rows of 256, 24 kept:
3.0 -> 1.1-1.5 ms, torch.topk 5.3), elsewhere they are sorted. Where the extension cannot be
built, torch.topk. A long row a tile at a time: ``smallest_after`` (only a tile's entries below
the least so far are kept).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from ...._extension import ExtensionBuildError, build
from ... import scaling
from . import threads

NAME = "fullgraph_cpu"
# -ffp-contract=off: every product and sum rounded on its own, as torch's element-wise kernels
# round them (the re-measure's bits), no fused multiply-adds from -mfma.
CFLAGS = ["-ffp-contract=off"]
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("smallest.cpp", "squared_distances.cpp", "weighted_sums.cpp", "knn_reduce.cpp")]
PREBUILT = Path(__file__).parent / "_native.so"  # where a wheel carries it (setup.py)


@functools.cache
def _built() -> bool:
    try:
        build(NAME, SOURCES, with_cuda=False, cflags=CFLAGS, prebuilt=PREBUILT,
              what="the CPU neighbour extension: candidate selection, exact re-measure, weighted sums, knn_reduce",
              instead="nothing: torch.topk selects and torch measures instead (slower)")
    except ExtensionBuildError as error:
        warnings.warn(str(error), RuntimeWarning, stacklevel=3)
        return False
    _register_fakes()
    # (csrc/cores.h judges shared cores for the operators a compiled graph calls, by threads.py's rule)
    torch.ops.fullgraph_cpu.judge_cores_by(threads.JUDGED_RUN_SECONDS, threads.CONTENDED_SHARE, threads.FREE_SHARE,
                                           threads.FREE_CALLS)
    return True


def _register_fakes() -> None:
    """Shapes of the operators that a compiled graph calls itself (``api``: tiny calls)."""
    @torch.library.register_fake(f"{NAME}::nearest_small")
    def _(query, ref, take, below, above):
        batch, rows, _ = query.shape
        return (query.new_empty((batch, rows, take)), query.new_empty((batch, rows, take), dtype=torch.int64),
                query.new_empty((batch, rows), dtype=torch.int64))

    @torch.library.register_fake(f"{NAME}::small_nearest")
    def _(query, ref, k, take, u, below, above):
        batch, rows, _ = query.shape
        return query.new_empty((batch, rows, k)), query.new_empty((batch, rows, k), dtype=torch.int64)


def available() -> bool:
    """Whether the C++ extension runs in this process (built or loaded on first call)."""
    return _built()


def smallest(values: torch.Tensor, take: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [..., take] of values [..., N] (take <= N): the smallest of each row,
    ascending (NaN last)."""
    if not isinstance(values, torch.Tensor) or values.dim() < 1:
        raise TypeError(f"values: expected a tensor of at least one dimension, got {type(values).__name__}"
                        + (f" of shape {tuple(values.shape)}" if isinstance(values, torch.Tensor) else ""))
    if isinstance(take, bool) or not isinstance(take, int) or not 0 <= take <= values.shape[-1]:
        raise ValueError(f"take: expected an int from 0 to {values.shape[-1]} (the rows' length), got {take!r}")
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64) and _built():
        return torch.ops.fullgraph_cpu.smallest(values, take)
    return torch.topk(values, take, dim=-1, largest=False, sorted=True)


def smallest_of_products(products: torch.Tensor, bias: torch.Tensor, take: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``smallest`` of bias[b, j] - 2 products[b, i, j] (products [B, M, N], bias [B, N]; take
    <= N): the dense backend's expanded values without writing them first (in C++ a row
    biased at a time, where torch.baddbmm copies the bias into every row before multiplying)."""
    if products.device.type == "cpu" and products.dtype in (torch.float32, torch.float64) and _built():
        return torch.ops.fullgraph_cpu.smallest_of_products(products, bias, take)
    return smallest(bias[:, None, :] - 2 * products, take)


def smallest_after(values: torch.Tensor, take: int, kept: tuple[torch.Tensor, torch.Tensor],
                   offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [..., take]: the smallest of each row of ``kept`` (values and
    positions [..., t], ascending, NaN last, every position below ``offset``) and of values
    [..., W] at positions offset + j together, ties to the smaller position: a long row's
    least, a tile at a time. In C++ only the entries below the kept take-th can enter (one
    pass over the tile); elsewhere ``smallest`` of the two side by side."""
    kept_values, kept_positions = kept
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64) and _built():
        return torch.ops.fullgraph_cpu.smallest_after(values, take, kept_values, kept_positions, offset)
    least, positions = smallest(values, min(take, values.shape[-1]))
    both = torch.cat([kept_values, least], -1)
    least, at = smallest(both, take)
    return least, torch.cat([kept_positions, positions + offset], -1).gather(-1, at)


def squared_distances(q: torch.Tensor, r: torch.Tensor, candidates: torch.Tensor,
                      floors: torch.Tensor | None = None, least: int = 0) -> torch.Tensor | None:
    """[B, M, C]: the squared distances from q [B, M, D] to the rows ``candidates`` [B, M, C]
    (int64, in [0, N)) of r [B, N, D], in ``pairs.squared_difference``'s order, bit for bit
    (``csrc/squared_distances.cpp``: each candidate row read once, nothing of [B, M, C, D]
    gathered); None where it does not run (not CPU float32/float64, D = 0, no extension).
    With ``floors`` [B, M, C] (ascending in a row, each under its candidate's squared
    distance) and ``least`` >= 1: a row's candidates from the first whose floor lies above the
    largest of its first ``least`` are left at +inf (none of them is among its least nearest)."""
    if (q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64) or q.shape[-1] == 0
            or not _built()):
        return None
    _check_measure(q, r, candidates)
    if floors is not None and least >= 1:
        return torch.ops.fullgraph_cpu.squared_distances_bounded(q, r, candidates, floors, least)
    return torch.ops.fullgraph_cpu.squared_distances(q, r, candidates)


def order_by_distance(d: torch.Tensor, positions: torch.Tensor,
                      keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pairs.order_by_distance`` of complete lists: d [B, M, C] (>= 0, not NaN) and their
    positions [B, M, C] (int64 >= 0, distinct in a row) ordered by (distance, position), the
    first ``keep`` (None: all C) of each row, contiguous [B, M, keep]; in one C++ pass a row
    where the extension runs."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= d.shape[-1]):
        raise ValueError(f"keep: expected an int from 0 to {d.shape[-1]} (the lists' length), got {keep!r}")
    if d.device.type == "cpu" and d.dtype in (torch.float32, torch.float64) and d.dim() == 3 and _built():
        return torch.ops.fullgraph_cpu.order_by_distance(d, positions, -1 if keep is None else keep)
    from ..pairs import order_by_distance

    values, order = order_by_distance(d, positions)
    return (values, order) if keep is None else (values[..., :keep].contiguous(), order[..., :keep].contiguous())


def plain_nearest(query: torch.Tensor, ref: torch.Tensor, k: int, take: int,
                  u: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The dense backend's kNN lists (dists, idx) [B, M, k] of plain points query [B, M, D] and
    ref [B, N, D] (CPU float32/float64 of one dtype, 1 <= k <= take <= N) in one C++ call: one
    product, the ``take`` least candidates, their exact re-measure and a certificate for unit
    roundoff ``u`` (``csrc/squared_distances.cpp``); None where a point is not plain (not finite,
    or an item would be scaled), a row is left unproven, or the extension does not run."""
    if (query.device.type != "cpu" or query.dtype not in (torch.float32, torch.float64) or query.dim() != 3
            or not _built()):
        return None
    _check_clouds(query, ref)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= take <= ref.shape[1]:
        raise ValueError(f"k, take: expected 1 <= k <= take <= {ref.shape[1]} (the references), got {k}, {take}")
    dists, idx, proven = torch.ops.fullgraph_cpu.plain_nearest(query, ref, k, take, u, scaling.SCALE_BELOW,
                                                               scaling.SCALE_ABOVE)
    return (dists, idx) if bool(proven) else None


def small_nearest_unchecked(query: torch.Tensor, ref: torch.Tensor, k: int, take: int):
    """(dists, idx) [B, M, k]: ``plain_nearest``'s lists of arguments its caller checked (the
    extension built), and where it refuses ``nearest_small``'s (every pair measured: the same
    lists); one C++ call of fixed output shapes, for a compiled graph. The product's unit
    roundoff is that of torch's float32 matmul precision when it runs (``certificate.roundoff``)."""
    return torch.ops.fullgraph_cpu.small_nearest(query, ref, k, take, 0.0, scaling.SCALE_BELOW, scaling.SCALE_ABOVE)


def squared_norms(x: torch.Tensor) -> torch.Tensor | None:
    """[B, L]: |x|^2 of each row of x [B, L, D] in any order of the sums (one C++ pass, no copy
    of x * x); None where it does not run (not CPU float32/float64, no extension)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.dim() != 3 or not _built():
        return None
    return torch.ops.fullgraph_cpu.squared_norms(x)


def _check_clouds(q: torch.Tensor, r: torch.Tensor) -> None:
    """q [B, M, D] and r [B, N, D] as the extension takes them, checked before it is entered
    (its own TORCH_CHECKs raise too, but a C++ exception crashed the process on one
    toolchain: torch 2.11's)."""
    if q.dim() != 3 or r.dim() != 3 or r.shape[0] != q.shape[0] or r.shape[2] != q.shape[2]:
        raise ValueError(f"r: expected [B, N, D] with q's B and D ({tuple(q.shape)}), got {tuple(r.shape)}")
    if r.dtype != q.dtype or r.device != q.device:
        raise TypeError(f"r: expected q's dtype and device ({q.dtype} on {q.device}), got {r.dtype} on {r.device}")


def _check_measure(q: torch.Tensor, r: torch.Tensor, candidates: torch.Tensor) -> None:
    """``squared_distances``' contract (see ``_check_clouds``)."""
    _check_clouds(q, r)
    if candidates.dtype != torch.int64 or candidates.device != q.device:
        raise TypeError(f"candidates: expected int64 on {q.device}, got {candidates.dtype} on {candidates.device}")
    if candidates.dim() != 3 or tuple(candidates.shape[:2]) != tuple(q.shape[:2]):
        raise ValueError(f"candidates: expected [B, M, C] with q's B and M ({tuple(q.shape)}), "
                         f"got {tuple(candidates.shape)}")
    if candidates.numel():
        low, high = (int(v) for v in torch.aminmax(candidates))
        if low < 0 or high >= r.shape[1]:
            raise ValueError(f"candidates: expected positions in [0, {r.shape[1]}) (r's rows), got {low} to {high}")


def squared_distances_all(q: torch.Tensor, r: torch.Tensor) -> torch.Tensor | None:
    """[B, M, N]: the squared distances of every pair of q [B, M, D] and r [B, N, D] in
    ``pairs.squared_difference``'s order, bit for bit (``csrc/squared_distances.cpp``, one
    pass); None where it does not run (not CPU float32/float64, D = 0, no extension)."""
    if (q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64) or q.shape[-1] == 0
            or not _built()):
        return None
    _check_clouds(q, r)
    return torch.ops.fullgraph_cpu.squared_distances_all(q, r)


def nearest_small(query: torch.Tensor, ref: torch.Tensor, take: int):
    """Plain kNN of small items, every pair measured, in one call (``csrc/squared_distances.cpp``):
    (dists, positions [B, M, take], counts [B, M]) of query [B, M, D] and ref [B, N, D]
    (CPU float32/float64, D >= 1), as the CPU backend's brute force gives them (its
    ``brute_force`` with no lengths and no radius); None where the extension does not run."""
    if (query.device.type != "cpu" or query.dtype not in (torch.float32, torch.float64) or query.shape[-1] == 0
            or not _built()):
        return None
    _check_clouds(query, ref)
    if isinstance(take, bool) or not isinstance(take, int) or not 0 <= take <= ref.shape[1]:
        raise ValueError(f"take: expected an int from 0 to {ref.shape[1]} (the references), got {take!r}")
    return nearest_small_unchecked(query, ref, take)


def nearest_small_unchecked(query: torch.Tensor, ref: torch.Tensor, take: int):
    """``nearest_small`` of arguments its caller checked, with the extension built."""
    return torch.ops.fullgraph_cpu.nearest_small(query, ref, take, scaling.SCALE_BELOW, scaling.SCALE_ABOVE)


def nearest_within(d: torch.Tensor, query_ok: torch.Tensor, ref_ok: torch.Tensor, within: torch.Tensor,
                   take: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of the distances d [B, M, N] (>= 0) of every pair of each item (CPU float32/float64,
    ``available()``): (values [B, M, take] ascending by (distance, position), NaN where fewer
    valid pairs at or within ``within`` [B] exist, positions [B, M, take] int64, counts
    [B, M] int64 of those pairs) - the reference's masking, count and selection
    (``reference.nearest``) in one pass a row."""
    batch, rows, columns = d.shape
    for name, mask, shape in (("query_ok", query_ok, (batch, rows)), ("ref_ok", ref_ok, (batch, columns))):
        if mask.dtype != torch.bool or tuple(mask.shape) != shape:
            raise ValueError(f"{name}: expected bool {list(shape)}, got {mask.dtype} {list(mask.shape)}")
    if within.dtype != d.dtype or tuple(within.shape) != (batch,):
        raise ValueError(f"within: expected [{batch}] of d's dtype, got {within.dtype} {list(within.shape)}")
    if isinstance(take, bool) or not isinstance(take, int) or not 0 <= take <= columns:
        raise ValueError(f"take: expected an int from 0 to {columns} (the rows' length), got {take!r}")
    return torch.ops.fullgraph_cpu.nearest_within(d, query_ok, ref_ok, within, take)


def _check_blocks(d: torch.Tensor, ok: torch.Tensor, features: torch.Tensor) -> None:
    batch, rows, columns = d.shape
    if ok.dtype != torch.bool or ok.shape != d.shape:
        raise ValueError(f"ok: expected bool {list(d.shape)}, got {ok.dtype} {list(ok.shape)}")
    if features.dtype != d.dtype or features.dim() != 3 or tuple(features.shape[:2]) != (batch, columns):
        raise ValueError(f"features: expected [{batch}, {columns}, C] {d.dtype}, got {features.dtype} "
                         f"{list(features.shape)}")


def weighted_sums(d: torch.Tensor, ok: torch.Tensor, features: torch.Tensor, sigma: float) -> torch.Tensor | None:
    """[B, M, C]: per query row of the distances d [B, M, N] (CPU float32/float64), the
    features [B, N, C] of the pairs marked ``ok`` weighted by exp(-(d - the row's least) /
    sigma), normalized (``pairs.aggregate_pairs`` over whole blocks; ``csrc/weighted_sums.cpp``);
    None where it does not run (see ``squared_distances_all``)."""
    if d.device.type != "cpu" or d.dtype not in (torch.float32, torch.float64) or not _built():
        return None
    _check_blocks(d, ok, features)
    return torch.ops.fullgraph_cpu.weighted_sums(d, ok, features, float(sigma))


def weighted_sums_backward(d, ok, features, query, ref, grad_out, out, sigma: float):
    """(grad_query [B, M, D], grad_ref [B, N, D], grad_features [B, N, C]) of ``weighted_sums``
    then d = |query - ref| (all of d's dtype; ``out`` its result, ``grad_out`` its gradient)."""
    _check_blocks(d, ok, features)
    batch, rows, columns = d.shape
    if query.dtype != d.dtype or tuple(query.shape[:2]) != (batch, rows) or ref.dtype != d.dtype \
            or tuple(ref.shape) != (batch, columns, query.shape[-1]):
        raise ValueError(f"query, ref: expected [{batch}, {rows}, D], [{batch}, {columns}, D] {d.dtype}, got "
                         f"{list(query.shape)}, {list(ref.shape)}")
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.dtype != d.dtype or tuple(t.shape) != (batch, rows, features.shape[-1]):
            raise ValueError(f"{name}: expected [{batch}, {rows}, {features.shape[-1]}] {d.dtype}, got {t.dtype} "
                             f"{list(t.shape)}")
    return torch.ops.fullgraph_cpu.weighted_sums_backward(d, ok, features, query, ref, grad_out, out, float(sigma))
