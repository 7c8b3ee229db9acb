"""Public neighbour functions: validation, backend choice, docstrings.

Eagerly, every check runs here, before any kernel. While torch.compile traces, they are
left to the operators, which run the same checks when the compiled graph runs: an
exception raised during tracing would reach the caller as a compiler error instead of the
documented ValueError / TypeError (the messages then show the batched shapes [B, M, D]).
"""

from __future__ import annotations

import torch
from torch.utils import _python_dispatch

from ... import _contract, _validate
from .batching import Padded, check_batch
from . import registration
from .cpu import backend as cpu
from .dense import backend as dense
from .registration import check_clouds, check_features, check_scalar_tensor, check_sigma, pairs_per_item


def _checking() -> bool:
    return not torch.compiler.is_compiling()


def direct(*tensors) -> bool:
    """Whether an eager call may run an operator's function itself: plain tensors (None
    allowed) that need no gradient, with no tracing, mode or function transform active. The
    operator's Python layers (custom op, autograd, dispatch) cost ~0.07 ms a call, the most of
    a tiny CPU call (2 x 64 x 300 D=16: 0.19 -> 0.12 ms, cdist + topk 0.10-0.13); the function
    is the same, its checks and errors too."""
    present = [t for t in tensors if t is not None]
    if (torch.compiler.is_compiling() or any(type(t) is not torch.Tensor for t in present)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in present))):
        return False
    return _plain_context()


_TRANSFORMS = getattr(torch._C, "_are_functorch_transforms_active", None)  # (absent: not known, so none assumed)


def _plain_context() -> bool:
    """No JIT tracing, function transform, torch function mode or dispatch mode active."""
    return not (torch._C._is_tracing() or _TRANSFORMS is None or _TRANSFORMS()
                or torch._C._is_torch_function_mode_enabled() or _python_dispatch._get_current_dispatch_mode())


def _knn_in_one_call(query, ref, k, backend, query_lengths, ref_lengths):
    """``knn``'s lists of a small eager CPU call: "auto" on plain floating clouds, no lengths,
    k within the limit, where "auto" answers in one C++ call: at most ``cpu.TINY_MAX_WORK``
    pair-coordinates or items it leaves to the brute force (``dense.left_to_brute_force``), or
    dense's products of a small call (``_one_call``); that call, past the checks and operator
    layers (~0.025-0.05 ms: 2 x 64 x 300 D=16 k=4 0.115 -> 0.091 ms, cdist + topk 0.113, 2-core
    CPU). None where the call is not such (the usual path then checks it, errors included).
    Written for its host time (a call of 1 x 10 x 10 D=64 is ~0.01 ms of arithmetic). While
    torch.compile traces: ``_one_call_in_graph``."""
    if torch.compiler.is_compiling():
        return _one_call_in_graph(query, ref, k, backend, query_lengths, ref_lengths)
    plain = _plain_cpu_call(query, ref, k, backend, query_lengths, ref_lengths)
    if plain is None or not _plain_context():
        return None
    (query, ref), batched = plain
    if cpu.tiny(query, ref, None, None):  # (too short to judge the cores: ``threads``)
        found = cpu.tiny_knn(query, ref, k)
    else:
        with registration.threads.fitted(query):
            found = _one_call(query, ref, k, dense.brute_force_limits())
    return found if found is None or batched else (found[0][0], found[1][0])


def _plain_cpu_call(query, ref, k, backend, query_lengths, ref_lengths):
    """For ``knn``'s arguments of a call "auto" may answer in one C++ call (plain CPU clouds
    [B, M, D] / [B, N, D] or [M, D] / [N, D] of one dtype of ``cpu.TINY_DTYPES``, D >= 1, no
    lengths, no gradient, k from 1 to the limit, the extension built): ((query, ref) batched,
    whether they were); None otherwise. Its cheap checks first: eager calls spend host time here."""
    if (backend != "auto" or query_lengths is not None or ref_lengths is not None or type(query) is not torch.Tensor
            or type(ref) is not torch.Tensor or isinstance(k, bool) or not isinstance(k, (int, torch.SymInt))
            or k < 1):
        return None
    shape, ref_shape = query.shape, ref.shape
    batched = len(shape) == 3
    if (len(ref_shape) != len(shape) or not (batched or len(shape) == 2) or ref.dtype != query.dtype
            or shape[:-2] != ref_shape[:-2] or ref_shape[-1] != shape[-1] or shape[-1] < 1
            or k > max(ref_shape[-2], registration.MAX_PADDED_K)
            or query.device.type != "cpu" or ref.device.type != "cpu" or query.dtype not in cpu.TINY_DTYPES
            or (torch.is_grad_enabled() and (query.requires_grad or ref.requires_grad)) or not _extension_runs()):
        return None
    return ((query, ref) if batched else (query[None], ref[None])), batched


def _one_call(query, ref, k, brute_force_limits):
    """(dists, idx) [B, M, k] of plain CPU clouds query [B, M, D] and ref [B, N, D] (one
    floating dtype, k checked, the extension built) by the one C++ call "auto" answers them
    with (``dense.left_to_brute_force`` by ``brute_force_limits``: the brute force's, else
    dense's products of a small call); None where it answers otherwise."""
    dim, pairs = query.shape[-1], query.shape[1] * ref.shape[1]
    if dense.left_to_brute_force(dim, k, pairs, brute_force_limits):
        # (within cpu.BRUTE_FORCE_MAX_PAIRS: the brute force in one call)
        return cpu.tiny_lists(query, ref, k) if _tree_backend_runs() else None
    if dense.products_on_cpu(dim, pairs):
        return dense.plain_in_one_call(query, ref, k)
    return None


def _constant_to_compile(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing torch._dynamo (seconds on
    a small CPU, which eager calls never need): the mark it sets (tests check it still does)."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_to_compile
def _extension_runs() -> bool:
    """Whether the CPU C++ extension runs here (loaded, its operators' shapes registered for
    tracing); a constant to torch.compile."""
    return cpu.select.available()


@_constant_to_compile
def _tree_backend_runs() -> bool:
    """Whether the "cpu" backend runs here (scipy); a constant to torch.compile."""
    return cpu.BACKEND.available("cpu")


@_constant_to_compile
def _brute_force_limits() -> tuple:
    """The CPU_BRUTE_FORCE row of the threads torch uses; a constant to torch.compile (a graph
    keeps the row of the threads it was compiled with)."""
    return dense.brute_force_limits()


def _one_call_in_graph(query, ref, k, backend, query_lengths, ref_lengths):
    """``knn``'s lists while torch.compile traces (not torch.export: exported graphs hold the
    public operator), where "auto" answers a CPU call in one C++ call: that operator itself in
    the graph, the brute force's (``cpu.tiny_lists``) or the products' (``dense.plain_in_one_call``),
    the sizes guarded (a call past them compiles again, to the public operator); None
    elsewhere. In a compiled graph the public operator's layers cost ~0.07 ms, most of a small
    call (2-core CPU, 2 x 64 x 300 D=16 k=4: 0.185 -> 0.118 ms; cdist + topk compiled 0.115)."""
    plain = None if torch.compiler.is_exporting() else _plain_cpu_call(query, ref, k, backend, query_lengths,
                                                                           ref_lengths)
    if plain is None or query.shape[-2] < 1 or ref.shape[-2] < 1:
        return None
    (query, ref), batched = plain
    found = _one_call(query, ref, k, _brute_force_limits())
    return found if found is None or batched else (found[0][0], found[1][0])


def _points(query, ref, query_lengths, ref_lengths):
    """Check the point clouds; return them batched [B, M, D], [B, N, D] and whether to unbatch."""
    if _checking():
        check_clouds(query, ref, query_lengths, ref_lengths, batched_only=False)
    unbatched = query.dim() == 2
    return (query[None], ref[None], unbatched) if unbatched else (query, ref, unbatched)


def _backend(choice, query: torch.Tensor, ref: torch.Tensor, op: str, k: int = 1) -> str:
    """The name of the backend for ``op`` on batched ``query`` and ``ref``; raises its refusal
    (while tracing, the choice goes to the operator, which resolves it when it runs)."""
    return _resolved(choice, query, ref, op, k).name if _checking() else choice


def _resolved(choice, query: torch.Tensor, ref: torch.Tensor, op: str, k: int = 1):
    return registration.BACKENDS.resolve(choice, op, query.device, query.dtype, query.shape[-1], k,
                                         k_argument="max_neighbors" if op == "radius" else "k",
                                         size=pairs_per_item(query, ref))


def _integer(name, value):
    return _validate.integer(name, value, minimum=1) if _checking() else value


def _real(name, value, strict: bool):
    return _validate.real(name, value, minimum=0.0, strict=strict) if _checking() else value


def _scalar(name, value, strict: bool):
    """(number, tensor or None) for the operators: a radius or sigma given as a Python number
    is checked here and is a constant of a compiled graph (a new value recompiles); a 0-d
    tensor goes to the operator, which reads it when it runs, so new values do not
    recompile (0.0 stands in for the number)."""
    if isinstance(value, torch.Tensor):
        if _checking():
            check_scalar_tensor(name, value)
        return 0.0, value
    return _real(name, value, strict), None


def _aggregate_inputs(query, ref, features, sigma, query_lengths, ref_lengths, backend, op, k=1):
    """Checks shared by the aggregations; returns batched tensors, sigma as (number, tensor
    or None) and the resolved backend."""
    batched_query, batched_ref, unbatched = _points(query, ref, query_lengths, ref_lengths)
    if _checking():
        check_features(features, ref)
    sigma = _scalar("sigma", sigma, strict=True)
    if _checking() and sigma[1] is None:
        check_sigma(sigma[0], query.dtype)
    features = features[None] if unbatched else features
    return batched_query, batched_ref, features, sigma, _backend(backend, batched_query, batched_ref, op, k), unbatched


def _unbatch(tensors, unbatched: bool):
    return tuple(t[0] for t in tensors) if unbatched else tuple(tensors)


def batch_vectors(query, ref, batch_query, batch_ref, query_lengths, ref_lengths):
    """For flat clouds with PyG batch vectors: (padded query, padded ref, query layout,
    ref layout); see ``batching``."""
    _flat_inputs(query, ref, query_lengths, ref_lengths)
    for name, batch, points in (("batch_query", batch_query, query), ("batch_ref", batch_ref, ref)):
        if batch is not None:
            check_batch(name, batch, points)
    queries = Padded.of(batch_query, query.shape[0], query.device)
    refs = Padded.of(batch_ref, ref.shape[0], ref.device, items=queries.items)
    if refs.items > queries.items:
        queries = Padded.of(batch_query, query.shape[0], query.device, items=refs.items)
    return queries.pad(query), refs.pad(ref), queries, refs


def _flat_inputs(query, ref, query_lengths, ref_lengths):
    """Checks of the batch-vector form that need no values (the operator checks the rest)."""
    if query_lengths is not None or ref_lengths is not None:
        raise ValueError("batch_query, batch_ref: pass batch vectors or lengths, not both")
    _validate.floating("query", query)
    _validate.rank("query", query, (2,), "[M, D] (batch vectors mark the items of flat clouds)")
    _validate.floating("ref", ref)
    _validate.rank("ref", ref, (2,), "[N, D] (batch vectors mark the items of flat clouds)")


def _aggregate_batch_vectors(op, query, ref, features, size, sigma, batch_query, batch_ref, query_lengths,
                             ref_lengths, backend):
    """``op`` ("knn_aggregate" or "radius_aggregate", ``size`` its k or radius) of flat clouds
    with batch vectors: one operator (``flat.aggregate_flat``)."""
    _flat_inputs(query, ref, query_lengths, ref_lengths)
    check_features(features, ref)
    size = (_integer("k", size), None) if op == "knn_aggregate" else _scalar("radius", size, strict=False)
    sigma = _scalar("sigma", sigma, strict=True)
    return torch.ops.fullgraph.aggregate_flat(op, query, ref, features, float(size[0]), sigma[0], batch_query,
                                              batch_ref, backend, size[1], sigma[1])


def _query_items(batch_query, queries: Padded):
    return batch_query if batch_query is not None else torch.zeros(queries.slots.shape, dtype=torch.int64,
                                                                    device=queries.slots.device)


def knn(query, ref, k, *, query_lengths=None, ref_lengths=None, batch_query=None, batch_ref=None, backend="auto"):
    """The k nearest reference points of every query point.

    Args:
        query: [M, D] or [B, M, D] float16/bfloat16/float32/float64, any device.
        ref: [N, D] or [B, N, D], same dtype and device as ``query``.
        k: number of neighbours, >= 1; may exceed N (missing slots are padded), up to
            max(N, 1024).
        query_lengths, ref_lengths: [B] int64, the valid prefix of each padded batch
            item (batched inputs only); padded queries get no neighbours.
        batch_query, batch_ref: instead, PyG batch vectors: [M] / [N] sorted int64 item ids
            of flat clouds [M, D] / [N, D] (either may be None: one item). Indices are then
            rows of the flat ``ref``. One host read of the item sizes (not capturable).
        backend: "auto" (the fastest exact backend for the device and shape: on CUDA
            "dense" for D >= 4 and "triton" below; on CPUs "cpu" for few dimensions and
            "dense" from D = 10 or for small items), "torch" (the reference), "cpu" (scipy's
            k-d tree and C++), "dense" (matrix products with an exactness certificate; tensor
            cores on CUDA), "triton" (CUDA grid search), "cuml" (CUDA, RAPIDS cuML candidates
            re-ranked exactly; knn and knn_aggregate) or "warp" (CUDA, float32, D = 3, NVIDIA
            Warp HashGrid; radius and radius_aggregate).

    Returns:
        dists: [..., M, k] Euclidean distances, ascending, in the input dtype, +inf where
            fewer than k valid references exist. Differentiable w.r.t. query and ref (the
            gradient of a zero distance is 0).
        idx: [..., M, k] int64 indices into ``ref`` (per batch item), -1 where missing.
            Ties go to the smaller index. Mind the padding when gathering: ``ref[idx]``
            with idx = -1 silently picks the last point; ``knn_gather`` fills it instead.

    Points with a non-finite coordinate are never neighbours and have none.

    Raises:
        TypeError: non-tensor or non-floating inputs, mixed dtypes, k not an int.
        ValueError: wrong ranks, mismatched D or batch, mixed devices, k < 1, bad lengths.

    Example:
        >>> ref = torch.randn(1000, 3)
        >>> dists, idx = fullgraph.knn(torch.randn(10, 3), ref, k=4)
        >>> dists.shape, idx.shape
        (torch.Size([10, 4]), torch.Size([10, 4]))
    """
    if batch_query is not None or batch_ref is not None:
        _flat_inputs(query, ref, query_lengths, ref_lengths)
        return torch.ops.fullgraph.knn_flat(query, ref, _integer("k", k), batch_query, batch_ref, backend)
    found = _knn_in_one_call(query, ref, k, backend, query_lengths, ref_lengths)
    if found is not None:
        return found
    query, ref, unbatched = _points(query, ref, query_lengths, ref_lengths)
    k = _integer("k", k)
    if direct(query, ref, query_lengths, ref_lengths):
        chosen = _resolved(backend, query, ref, "knn", k)
        return _unbatch(registration.knn_checked(query, ref, k, query_lengths, ref_lengths, chosen), unbatched)
    backend = _backend(backend, query, ref, "knn", k)
    dists, idx = torch.ops.fullgraph.knn(query, ref, k, query_lengths, ref_lengths, backend)
    return _unbatch((dists, idx), unbatched)


def radius(query, ref, radius, max_neighbors, *, query_lengths=None, ref_lengths=None, batch_query=None,
           batch_ref=None, backend="auto"):
    """The nearest ``max_neighbors`` reference points within ``radius`` of every query.

    Args:
        query: [M, D] or [B, M, D] floating, any device.
        ref: [N, D] or [B, N, D], same dtype and device.
        radius: finite float >= 0, inclusive (distance <= radius), in coordinate units; or a
            0-d floating tensor, read when the operator runs (under torch.compile new values
            then do not recompile; a CUDA tensor costs a wait for the GPU and cannot be
            captured in a CUDA graph).
        max_neighbors: the cap, >= 1, up to max(N, 1024). The *nearest* ones are kept, never
            the first found.
        query_lengths, ref_lengths, batch_query, batch_ref, backend: as in :func:`knn`.

    Returns:
        dists: [..., M, max_neighbors] ascending, +inf padded; differentiable.
        idx: [..., M, max_neighbors] int64, -1 padded; ties to the smaller index.
        counts: [..., M] int64, the number of references within the radius before the cap
            (counts > max_neighbors means the list was truncated).

    Raises:
        TypeError, ValueError: as in :func:`knn`; radius negative or non-finite.

    Example:
        >>> ref = torch.rand(1000, 3)
        >>> dists, idx, counts = fullgraph.radius(torch.rand(10, 3), ref, 0.1, max_neighbors=16)
        >>> bool((counts >= (idx >= 0).sum(-1)).all())
        True
    """
    if batch_query is not None or batch_ref is not None:
        return _radiusbatch_vectors(query, ref, radius, max_neighbors, batch_query, batch_ref, query_lengths,
                                     ref_lengths, backend)
    query, ref, unbatched = _points(query, ref, query_lengths, ref_lengths)
    radius, radius_tensor = _scalar("radius", radius, strict=False)
    max_neighbors = _integer("max_neighbors", max_neighbors)
    backend = _backend(backend, query, ref, "radius", max_neighbors)
    search = (registration.radius_lists if direct(query, ref, query_lengths, ref_lengths, radius_tensor)
              else torch.ops.fullgraph.radius)
    result = search(query, ref, radius, max_neighbors, query_lengths, ref_lengths, backend, radius_tensor)
    return _unbatch(result, unbatched)


def _check_aggregate(query, ref, features, *args, query_lengths=None, ref_lengths=None, batch_query=None,
                     batch_ref=None, **options) -> None:
    """The aggregations' cloud and feature checks, on the tensors as given (the operators
    see them batched: their messages would name other shapes)."""
    if batch_query is None and batch_ref is None:
        check_clouds(query, ref, query_lengths, ref_lengths, batched_only=False)
        check_features(features, ref)


@_contract.checked(_check_aggregate)
def knn_aggregate(query, ref, features, k, *, sigma=0.1, query_lengths=None, ref_lengths=None, batch_query=None,
                  batch_ref=None, backend="auto"):
    """Features of the k nearest references, softmax-weighted by distance.

    ``out[m] = sum_j softmax_j(-d_mj / sigma) * features[idx_mj]`` over the k nearest
    valid references (fewer if fewer exist; a query with none gets 0).

    Args:
        query: [M, D] or [B, M, D] floating; ref: [N, D] or [B, N, D].
        features: [N, C] or [B, N, C], same dtype and device as ref.
        k: >= 1. sigma: temperature in coordinate units, > 0 (a number, or a 0-d tensor as
            ``radius`` in :func:`radius`).
        query_lengths, ref_lengths, batch_query, batch_ref, backend: as in :func:`knn`.

    Returns:
        [..., M, C] in the input dtype, differentiable w.r.t. query, ref and features.

    Example:
        >>> ref, feats = torch.randn(500, 3), torch.randn(500, 8)
        >>> fullgraph.knn_aggregate(torch.randn(20, 3), ref, feats, k=7).shape
        torch.Size([20, 8])
    """
    if batch_query is not None or batch_ref is not None:
        return _aggregate_batch_vectors("knn_aggregate", query, ref, features, k, sigma, batch_query, batch_ref,
                                        query_lengths, ref_lengths, backend)
    k = _integer("k", k)
    query, ref, features, sigma, backend, unbatched = _aggregate_inputs(
        query, ref, features, sigma, query_lengths, ref_lengths, backend, "knn_aggregate", k)
    out, _, _ = torch.ops.fullgraph.knn_aggregate(
        query, ref, features, k, sigma[0], query_lengths, ref_lengths, backend, sigma[1]
    )
    return out[0] if unbatched else out


@_contract.checked(_check_aggregate)
def radius_aggregate(query, ref, features, radius, *, sigma=0.1, query_lengths=None, ref_lengths=None,
                     batch_query=None, batch_ref=None, backend="auto"):
    """Features of **all** references within ``radius``, weighted by exp(-d / sigma).

    ``out[m] = sum_{d_mj <= radius} w_mj features[j] / sum w_mj`` with
    ``w_mj = exp(-(d_mj - min_j d_mj) / sigma)`` (the shift cancels; it keeps the sum
    from underflowing). No cap on the neighbour count; a query with none gets 0.

    Args:
        query: [M, D] or [B, M, D] floating; ref: [N, D] or [B, N, D].
        features: [N, C] or [B, N, C], same dtype and device as ref.
        radius: finite float >= 0 (inclusive). sigma: > 0, coordinate units. Either may be a
            0-d tensor, as ``radius`` in :func:`radius`.
        query_lengths, ref_lengths, batch_query, batch_ref, backend: as in :func:`knn`.

    Returns:
        [..., M, C] in the input dtype, differentiable w.r.t. query, ref and features.

    Example:
        >>> ref, feats = torch.rand(500, 3), torch.randn(500, 8)
        >>> fullgraph.radius_aggregate(torch.rand(20, 3), ref, feats, radius=0.2).shape
        torch.Size([20, 8])
    """
    if batch_query is not None or batch_ref is not None:
        return _aggregate_batch_vectors("radius_aggregate", query, ref, features, radius, sigma, batch_query,
                                        batch_ref, query_lengths, ref_lengths, backend)
    query, ref, features, sigma, backend, unbatched = _aggregate_inputs(
        query, ref, features, sigma, query_lengths, ref_lengths, backend, "radius_aggregate")
    radius = _scalar("radius", radius, strict=False)
    out, _, _ = torch.ops.fullgraph.radius_aggregate(
        query, ref, features, radius[0], sigma[0], query_lengths, ref_lengths, backend, radius[1], sigma[1]
    )
    return out[0] if unbatched else out


def _check_gather(values, idx, *, fill=0.0) -> None:
    _validate.tensor("values", values)
    _validate.tensor("idx", idx)
    if idx.dtype != torch.int64:
        raise TypeError(f"idx: expected int64 neighbour lists, got {idx.dtype}")
    _validate.rank("values", values, (2, 3), "[N, C] or [B, N, C]")
    _validate.rank("idx", idx, (values.dim(),), "[M, k] like values [N, C]" if values.dim() == 2 else
                   "[B, M, k] like values [B, N, C]")
    if idx.device != values.device:
        raise ValueError(f"idx: expected a tensor on {values.device} like values, got {idx.device}")
    if values.dim() == 3 and idx.shape[0] != values.shape[0]:
        raise ValueError(f"idx: expected batch size {values.shape[0]} like values, got shape {tuple(idx.shape)}")
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        raise TypeError(f"fill: expected a float, got {_validate._describe(fill)}")


def _rows_at(idx: torch.Tensor, rows: int) -> torch.Tensor:
    """idx with padding (-1) as row 0, after checking, where the values are readable, that
    every index is in [-1, rows) (one read back)."""
    if idx.numel() and _validate.values_readable(idx.device):
        low, high = torch.stack([idx.min(), idx.max()]).tolist()
        if low < -1 or high >= rows:
            raise ValueError(f"idx: expected indices in [-1, {rows}), got values in [{low}, {high}]")
    return idx.clamp(min=0)


@torch.library.custom_op("fullgraph::gather_rows", mutates_args=())
def gather_rows(idx: torch.Tensor, rows: int) -> torch.Tensor:
    """``_rows_at`` as an operator: compiled CPU code checks the indices when it runs."""
    return _rows_at(idx, rows)


@gather_rows.register_fake
def _(idx, rows):
    return torch.empty_like(idx)


@_contract.checked(_check_gather)
def knn_gather(values, idx, *, fill: float = 0.0):
    """Rows of ``values`` at neighbour lists ``idx``, with padded slots (-1) set to ``fill``.

    ``values[idx]`` would silently read the last row for every padded slot; this does not.

    Args:
        values: [N, C] or [B, N, C] per-reference rows (features or points), any dtype.
        idx: [M, k] or [B, M, k] int64 from ``knn`` / ``radius`` (-1 = no neighbour), on
            the device of ``values``; batched like ``values``.
        fill: the value of padded slots.

    Returns:
        [M, k, C] or [B, M, k, C]; differentiable w.r.t. ``values``.

    Raises:
        TypeError: non-tensors, idx not int64.
        ValueError: ranks or batch sizes that do not match, devices that differ, indices
            outside [-1, N) (read back to check: eagerly, and compiled on CPUs; compiled CUDA
            code and CUDA graphs do not read them back).

    Example:
        >>> ref, feats = torch.rand(50, 3), torch.randn(50, 4)
        >>> _, idx, _ = fullgraph.radius(torch.rand(6, 3), ref, 0.05, max_neighbors=8)
        >>> fullgraph.knn_gather(feats, idx).shape
        torch.Size([6, 8, 4])
    """
    unbatched = values.dim() == 2
    values, idx = (values[None], idx[None]) if unbatched else (values, idx)
    batch, rows, channels = values.shape
    if rows == 0:  # nothing to gather: every slot is padding
        out = values.new_full((*idx.shape, channels), fill)
        return out[0] if unbatched else out
    offsets = (torch.arange(batch, device=idx.device) * rows).view(batch, 1, 1)
    if not torch.compiler.is_dynamo_compiling():
        at = _rows_at(idx, rows)
    elif idx.device.type == "cpu":  # compiled: checked when it runs (no synchronization on a CPU)
        at = torch.ops.fullgraph.gather_rows(idx, rows)
    else:  # compiled CUDA code: fused by Inductor, nothing read back
        at = idx.clamp(min=0)
    out = values.reshape(batch * rows, channels)[(at + offsets).reshape(-1)]
    out = out.reshape(*idx.shape, channels).masked_fill((idx < 0)[..., None], fill)
    return out[0] if unbatched else out


def _radiusbatch_vectors(query, ref, r, max_neighbors, batch_query, batch_ref, query_lengths, ref_lengths, backend):
    """``radius`` of flat clouds with batch vectors: one operator (``flat.radius_flat``)."""
    _flat_inputs(query, ref, query_lengths, ref_lengths)
    r, r_tensor = _scalar("radius", r, strict=False)
    return torch.ops.fullgraph.radius_flat(query, ref, r, _integer("max_neighbors", max_neighbors), batch_query,
                                           batch_ref, backend, r_tensor)
