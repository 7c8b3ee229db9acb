"""The neighbour operators over a point cloud sharded across ranks (torch.distributed).

Every rank passes its own shard of the queries [M_r, D] and of the references [N_r, D] (and
of the features [N_r, C], sharded with the references); each gets the results for its own
queries, with *global* reference indices: the references are numbered rank after rank
(rank r's first reference is number N_0 + ... + N_{r-1}). The results equal the single-device
operators on the concatenated cloud: the same indices (ties to the smaller global index)
and distances, aggregations to float rounding.

Algorithm: a ring. The reference shards travel around the ring (``batch_isend_irecv``, the
next shard in flight while the current one is searched); each rank searches its queries
against every shard with the single-device operator and merges the lists (by distance, then
global index). Another rank's shard is searched only for the queries that can reach its
bounding box, and only over its references inside those queries' box widened by their
search limit (``_near``): for shards that are regions of space, a thin layer of it. Where
the boxes leave many queries reaching (shards that interleave, as clusters split between
ranks do), an occupancy grid of the shard's cells (``_Occupancy``) prunes both further. On
CUDA the box and occupancy tests and the cells of points are one Triton pass each (float64
inside, no temporaries: 10^8 queries in ~3 ms on an H100).
Communication per rank: the other ranks' references, (W - 1) x max_r N_r x D elements, and
for gradients or features one ``all_to_all_single`` of the neighbours' rows (M_r x k rows
out and back). Gradients reach the ranks that own the references and features
(the rows' way back in reverse).

``partition(points, *values)`` redistributes shards of any shape into slabs of space (one
``all_to_all_single`` per tensor), the shape the ring scales with.

Host reads: the shard sizes (one ``all_gather``: the buffers' sizes depend on them) and the
rows each rank serves (the ``all_to_all_single`` split sizes), so these functions are not
captured in CUDA graphs, and under ``torch.compile`` they run eagerly: the public functions
are ``torch.compiler.disable``-d, one graph break each, so the code around them compiles.
Only torch.distributed collectives are used: NCCL on GPUs, gloo on CPUs.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import _triton, _validate
from ._triton import cdiv, lazy
from .ops.neighbors import api
from .ops.neighbors import registration
from .ops.neighbors.registration import MAX_PADDED_K

kernels = lazy(f"{__package__}.distributed_kernels")

_INDEX_LAST = torch.iinfo(torch.int64).max
_PACKED_NONE = (1 << 32) - 1  # "no index" in a merge key's low 32 bits


def process_group_backend() -> str:
    """The torch.distributed backend for this host's ranks (torchrun's ``LOCAL_WORLD_SIZE``):
    "nccl" where CUDA gives every local rank a GPU of its own (NCCL refuses two ranks on one
    GPU), else "gloo", with the shards on the CPU."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local else "gloo"


def _ranks(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fullgraph.distributed: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather(values: torch.Tensor, group) -> torch.Tensor:
    """[W, *values.shape]: every rank's ``values``."""
    world, _ = _ranks(group)
    out = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(out, values, group=group)
    return torch.stack(out)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The refusals one rank's check may raise, raised again on every rank.
_REFUSALS = {error.__name__: error for error in (TypeError, ValueError, ImportError)}


def _shard_numbers(query, ref, features) -> list[int]:
    """Check one rank's shards (raises TypeError / ValueError); returns [query D, ref D,
    dtype code, ref rows, feature channels or -1]."""
    for name, value in (("query", query), ("ref", ref)) + ((("features", features),) if features is not None else ()):
        _validate.floating(name, value)
        _validate.rank(name, value, (2,), "[points, D] (this rank's shard)")
    _validate.same_dtype_and_device("ref", ref, "query", query)
    if query.shape[1] == 0:
        raise ValueError(f"query: expected at least one coordinate (D >= 1), got shape {tuple(query.shape)}")
    if features is not None:
        _validate.same_dtype_and_device("features", features, "ref", ref)
        if features.shape[0] != ref.shape[0]:
            raise ValueError(f"features: expected one row per reference of this rank's shard ({ref.shape[0]}), "
                             f"got {features.shape[0]}")
    return [query.shape[1], ref.shape[1], _DTYPES.index(query.dtype), ref.shape[0],
            -1 if features is None else features.shape[1]]


def _agree(group, check, **tensors):
    """Every check of one call, agreed by every rank before any traffic of the call.

    ``check(local)`` checks this rank's other arguments (``local``: the tensors, DTensors
    unwrapped, shards already checked) and returns {name: int} that must be equal on every rank. One gather of every rank's
    outcome; a refusal on any rank is raised on every rank (same type and message, naming
    the rank), so no rank is left waiting in a collective. Returns (local tensors, mesh or
    None, group, the reference shard sizes rank by rank).
    """
    world, _ = _ranks(group)
    unwrapped = None
    try:
        unwrapped = _unwrap(group, **tensors)
        local = unwrapped[0]
        numbers = _shard_numbers(local["query"], local["ref"], local.get("features"))
        agreed = check(local)
        outcome = (None, None, numbers + list(agreed.values()))
    except tuple(_REFUSALS.values()) as error:
        outcome = (type(error).__name__, str(error), None)
    if unwrapped is not None:
        group = unwrapped[2]
    table = [None] * world
    dist.all_gather_object(table, outcome, group=group)
    for rank, (kind, message, _) in enumerate(table):
        if kind is not None:
            raise _REFUSALS[kind](f"{message} (rank {rank} of {world})")
    names = ["query D", "ref D", "dtype", None, "feature channels", *agreed]
    for column, name in enumerate(names):
        seen = [numbers[column] for *_, numbers in table]
        if name is not None and len(set(seen)) > 1:
            if name == "dtype":
                seen = [str(_DTYPES[code]).removeprefix("torch.") for code in seen]
            raise ValueError(f"{name}: expected the same on every rank of the group, got {seen} (rank by rank)")
    if table[0][2][0] != table[0][2][1]:
        raise ValueError(f"ref: expected the queries' D = {table[0][2][0]}, got D = {table[0][2][1]}")
    local, mesh, group = unwrapped
    return local, mesh, group, [numbers[3] for *_, numbers in table]


def _search_checks(op: str, backend, count_name: str, count, **reals):
    """check for ``_agree``: the list length ``count`` (an int >= 1), the ``reals`` (name:
    (value, strict): finite, > 0 when strict else >= 0) and that ``backend`` runs ``op`` on
    this rank's shards."""
    def check(local):
        agreed = {count_name: _validate.integer(count_name, count, minimum=1)} if count_name else {}
        for name, (value, strict) in reals.items():
            number = _validate.real(name, value, minimum=0.0, strict=strict)
            agreed[name] = int(torch.tensor(number, dtype=torch.float64).view(torch.int64))  # its bits
        query = local["query"]
        registration.BACKENDS.resolve(backend, op, query.device, query.dtype, query.shape[1],
                                      agreed.get(count_name, 1), k_argument=count_name or "k")
        return agreed
    return check


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def _unwrap(group, **tensors):
    """(local tensors, mesh or None, group): DTensor inputs sharded on the point dimension
    (``[Shard(0)]``) over one 1-D device mesh give their local shards and the mesh's group;
    plain tensors pass through. Mixing the two is refused."""
    dtensor = _dtensor_type()
    given = {name: dtensor is not None and isinstance(value, dtensor) for name, value in tensors.items()}
    if not any(given.values()):
        return tensors, None, group
    if not all(given.values()):
        raise TypeError(f"{', '.join(tensors)}: expected all DTensors or all plain tensors, got DTensors for "
                        f"{[name for name, is_d in given.items() if is_d]} only")
    from torch.distributed.tensor import Shard

    meshes = {id(value.device_mesh): value.device_mesh for value in tensors.values()}
    mesh = next(iter(meshes.values()))
    if len(meshes) > 1 or mesh.ndim != 1:
        raise ValueError(f"{', '.join(tensors)}: expected DTensors on one 1-D device mesh, got "
                         f"{len(meshes)} mesh(es) of {mesh.ndim} dimension(s)")
    for name, value in tensors.items():
        if tuple(value.placements) != (Shard(0),):
            raise ValueError(f"{name}: expected a DTensor sharded on the point dimension, placements "
                             f"[Shard(0)], got {list(value.placements)}")
    if group is not None:
        raise ValueError("group: the DTensors' device mesh names the group; pass group=None with DTensors")
    return {name: value.to_local() for name, value in tensors.items()}, mesh, mesh.get_group()


def _wrap(mesh, like, *outputs):
    """The outputs as DTensors sharded like the query DTensor ``like`` (rows = its points)."""
    if mesh is None:
        return outputs if len(outputs) > 1 else outputs[0]
    from torch.distributed.tensor import DTensor, Shard

    wrapped = []
    for out in outputs:
        shape = (like.shape[0], *out.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        wrapped.append(DTensor.from_local(out, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride))
    return tuple(wrapped) if len(wrapped) > 1 else wrapped[0]


# Points a program of the bound kernels tests.
_BOUND_BLOCK = 1024


def _kernels(tensor: torch.Tensor) -> bool:
    """Whether the pruning passes over ``tensor``'s rows run as Triton kernels (one pass, no
    float64 temporaries: ~15 ms of torch operators for 10^8 queries on an H100)."""
    return tensor.is_cuda and _triton.available()


# Query rows merged (or tested against a shard's box) at a time: the merge sorts [rows, 2 k] lists
# (a few int64 copies).
MERGE_ROWS = 1 << 22


def _merge_rows(best: tuple[torch.Tensor, ...], found: tuple[torch.Tensor, ...], keep: int):
    dists, idx = torch.cat([best[0], found[0]], -1), torch.cat([best[1], found[1]], -1)
    if dists.dtype == torch.float32 and idx.numel() and int(idx.max()) < _PACKED_NONE:
        # One sort of int64 keys (distance bits, then index; -1 as the largest index): the
        # bits of non-negative floats order as the floats (+ 0.0 turns -0.0 into 0.0).
        bits = (dists + 0.0).view(torch.int32).long() << 32
        keys = torch.sort(bits | torch.where(idx < 0, _PACKED_NONE, idx), dim=-1).values[:, :keep]
        found_idx = keys & _PACKED_NONE
        return ((keys >> 32).int().view(torch.float32),
                torch.where(found_idx == _PACKED_NONE, -1, found_idx))
    order = torch.where(idx < 0, _INDEX_LAST, idx).argsort(dim=-1, stable=True)
    dists, idx = dists.gather(-1, order), idx.gather(-1, order)
    order = dists.argsort(dim=-1, stable=True)[..., :keep]
    return dists.gather(-1, order), idx.gather(-1, order)


def _row_blocks(rows: int):
    """Slices of at most MERGE_ROWS rows covering ``rows``."""
    return (slice(start, start + MERGE_ROWS) for start in range(0, rows, MERGE_ROWS))


def _merge(best: tuple[torch.Tensor, ...], found: tuple[torch.Tensor, ...], keep: int):
    """The ``keep`` nearest of two lists (dists, idx) [M, *]: by distance, then global index
    (``found`` alone when ``best`` is empty: the operators' lists are in that order already)."""
    if best[0].shape[1] == 0:
        return found[0][:, :keep], found[1][:, :keep]
    rows, width = best[0].shape[0], min(keep, best[0].shape[1] + found[0].shape[1])
    if rows <= MERGE_ROWS:
        return _merge_rows(best, found, keep)
    dists, idx = best[0].new_empty((rows, width)), best[1].new_empty((rows, width))
    for block in _row_blocks(rows):
        dists[block], idx[block] = _merge_rows((best[0][block], best[1][block]),
                                               (found[0][block], found[1][block]), keep)
    return dists, idx


def _box(points: torch.Tensor) -> torch.Tensor:
    """[2, D] float64: the bounding box (lo, hi) of the finite coordinates of ``points`` [N, D]
    (non-finite points are nobody's neighbours); with none, (+inf, -inf), which nothing reaches."""
    if points.shape[0]:
        box = torch.stack(torch.aminmax(points, dim=0)).double()  # one pass where all are finite
        if bool(torch.isfinite(box).all()):
            return box
    coords, finite = points.double(), torch.isfinite(points)
    edge = coords.new_full((1, points.shape[1]), math.inf)  # keeps an empty min/max defined
    return torch.stack([torch.cat([torch.where(finite, coords, math.inf), edge]).amin(0),
                        torch.cat([torch.where(finite, coords, -math.inf), -edge]).amax(0)])


def _boxes(ref: torch.Tensor, group) -> torch.Tensor:
    """[W, 2, D] float64: every rank's ``_box`` of its references."""
    return _all_gather(_box(ref), group)


# Cells per axis (at most) of the occupancy grid over a remote shard of a 1- to 3-D cloud:
# a query skips the shard when it is farther from every occupied cell than its k-th distance
# (or radius), and the search keeps the shard's points near the reaching queries' cells
# only. A bounding box alone prunes slabs of space; clustered shards interleave (every
# rank's box spans the cloud) and need the cells. Small shards get fewer: about
# OCCUPANCY_POINTS points a cell of a uniform shard.
OCCUPANCY_CELLS = 64
OCCUPANCY_POINTS = 8
# The cells are made only where the box leaves more than this share of the queries reaching a shard:
# they cost passes over the shard and the queries.
OCCUPANCY_FROM = 0.1


class _Occupancy(NamedTuple):
    """The cells of a grid over a shard's bounding box that hold its finite points."""
    lo: torch.Tensor  # [D] float64, the grid's corner
    side: torch.Tensor  # [D] float64, the cells' sides (1 along an axis of zero extent)
    shape: tuple[int, ...]  # cells per axis
    steps: torch.Tensor  # [cells] int64: Chebyshev distance in cells to an occupied one (capped)

    def cells(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat cell [n] int64, finite [n] bool) of points [n, D]; points outside the box in
        its border cells (their distance to any cell is at least the border cell's). In
        blocks of rows (float64 temporaries)."""
        flat = torch.empty(points.shape[0], dtype=torch.int64, device=points.device)
        finite = torch.empty(points.shape[0], dtype=torch.bool, device=points.device)
        if _kernels(points) and points.shape[0]:
            kernels._cells_kernel[(cdiv(points.shape[0], _BOUND_BLOCK),)](
                points, *points.stride(), points.shape[0], self.lo, self.side, *self._sizes(), flat, finite,
                D=points.shape[1], BLOCK=_BOUND_BLOCK)
            return flat, finite
        upper = torch.tensor(self.shape, dtype=torch.float64, device=points.device) - 1
        for block in _row_blocks(points.shape[0]):
            coords = points[block].double()
            finite[block] = torch.isfinite(coords).all(1)
            index = ((coords - self.lo) / self.side).floor().nan_to_num(0.0, 0.0, 0.0)
            index = torch.minimum(index.clamp(min=0), upper).long()  # clamped before the cast: far points
            cell = index[:, 0]
            for axis in range(1, len(self.shape)):
                cell = cell * self.shape[axis] + index[:, axis]
            flat[block] = cell
        return flat, finite

    def distance_below(self, points: torch.Tensor) -> torch.Tensor:
        """[n] float64: a lower bound on the distance from each point to the shard's points
        (0 for non-finite points). Cells m apart (Chebyshev) hold points at least (m - 1)
        sides apart; one more cell of slack covers points binned across a cell's edge by
        rounding."""
        flat, finite = self.cells(points)
        cells_between = (self.steps[flat] - 2).clamp(min=0)
        return torch.where(finite, cells_between * self._smallest_side(), 0.0)

    def near(self, points: torch.Tensor, reach: float) -> torch.Tensor | None:
        """Per cell, bool [cells]: within ``reach`` of a cell holding one of ``points`` [n, D]
        (all finite); None where that is every cell."""
        dilation = 2 + math.ceil(reach / self._smallest_side())
        if dilation >= max(self.shape):
            return None
        held = torch.zeros(self.steps.shape, dtype=torch.bool, device=points.device)
        held[self.cells(points)[0]] = True
        return _dilated(held.reshape(self.shape), dilation).reshape(-1)

    def _sizes(self) -> tuple[int, int, int]:
        return tuple(self.shape) + (1,) * (3 - len(self.shape))

    def _smallest_side(self) -> float:
        return min(side for side, cells in zip(self.side.tolist(), self.shape) if cells > 1)


def _dilated(held: torch.Tensor, times: int) -> torch.Tensor:
    """The bool grid ``held`` [*shape] (1-3 axes) grown by ``times`` cells along every axis
    and diagonal (Chebyshev distance <= times)."""
    pool = (torch.nn.functional.max_pool1d, torch.nn.functional.max_pool2d,
            torch.nn.functional.max_pool3d)[held.dim() - 1]
    grown = held[None, None].float()
    for _ in range(times):
        grown = pool(grown, 3, stride=1, padding=1)
    return grown[0, 0] > 0


def _occupancy(points: torch.Tensor, box: torch.Tensor) -> _Occupancy | None:
    """The occupancy of a shard's ``points`` [N, D] over its ``box`` [2, D] (``_box``); None
    for D > 3, an empty shard or one of a single position (the box decides alone)."""
    lo, hi = box
    extent = (hi - lo).tolist()
    if points.shape[1] > 3 or not all(math.isfinite(e) for e in extent) or not any(e > 0 for e in extent):
        return None
    spread = sum(e > 0 for e in extent)
    per_axis = max(1, min(OCCUPANCY_CELLS, round((points.shape[0] / OCCUPANCY_POINTS) ** (1 / spread))))
    if per_axis == 1:
        return None
    shape = tuple(per_axis if e > 0 else 1 for e in extent)
    side = torch.tensor([e / per_axis if e > 0 else 1.0 for e in extent], dtype=torch.float64, device=points.device)
    grid = _Occupancy(lo, side, shape, torch.empty(0, dtype=torch.int64, device=points.device))
    held = torch.zeros(math.prod(shape), dtype=torch.bool, device=points.device)
    flat, finite = grid.cells(points)
    held[flat[finite]] = True
    cap = max(shape)
    steps = torch.where(held, 0, cap).reshape(shape)
    grown = held.reshape(shape)
    for distance in range(1, cap):
        reached = _dilated(grown, 1)
        steps = torch.where(reached & ~grown, distance, steps)
        grown = reached
    return grid._replace(steps=steps.reshape(-1))


# Relative margin on a query's distance to a box before a shard is skipped: the searched
# distances carry float rounding (float32: ~1e-7 relative), the box gap is float64.
_PRUNE_MARGIN = 1e-5


def _reaching(query: torch.Tensor, box: torch.Tensor, best, keep: int, radius: float | None,
              occupancy: _Occupancy | None = None) -> torch.Tensor:
    """[M] bool: the queries whose list can still change by searching a shard inside ``box``
    (its distance to the box, or where given to the shard's ``occupancy`` cells, is not
    beyond their radius, or for kNN their k-th distance so far). Conservative: non-finite
    values keep a query. In blocks of rows: the float64 temporaries of 10^8 queries at once
    took ~10 GB."""
    reaching = torch.ones(query.shape[0], dtype=torch.bool, device=query.device)
    if radius is None and best[0].shape[1] < keep:
        return reaching
    if _kernels(query):
        if query.shape[0]:
            limit = best[0][:, keep - 1] if radius is None else query.new_full((1,), radius, dtype=torch.float64)
            grid = occupancy or _Occupancy(box[0], box[0], (1,), limit.new_zeros(1, dtype=torch.int64))
            kernels._reaching_kernel[(cdiv(query.shape[0], _BOUND_BLOCK),)](
                query, *query.stride(), query.shape[0], box, limit, limit.stride(0) if radius is None else 0,
                _PRUNE_MARGIN, reaching, grid.lo, grid.side, *grid._sizes(), grid.steps,
                grid._smallest_side() if occupancy is not None else 0.0,
                D=query.shape[1], OCCUPIED=occupancy is not None, BLOCK=_BOUND_BLOCK)
        return reaching
    for block in _row_blocks(query.shape[0]):
        q = query[block].double()
        gap = torch.maximum(box[0] - q, q - box[1]).clamp(min=0).norm(dim=-1)
        if occupancy is not None:
            gap = torch.maximum(gap, occupancy.distance_below(q))
        limit = radius if radius is not None else best[0][block, keep - 1].double()
        reaching[block] = ~(gap * (1 - _PRUNE_MARGIN) > limit)
    return reaching


def _ring(query: torch.Tensor, ref: torch.Tensor, sizes: list[int], keep: int, search, group,
          radius: float | None = None):
    """Search the local queries against every rank's reference shard as the shards pass
    around the ring. ``search(query [1, M, D], ref [1, capacity, D], ref_lengths [1], limit)``
    returns (dists, idx, counts or None) of one shard, within the radius ``limit`` where it is
    not None (see ``_by_limit``); returns the merged (dists, idx, counts).

    The own shard is searched for every query; another rank's only for the queries that can
    reach its bounding box (``_reaching``: within ``radius`` for radius searches, within the
    k-th distance found so far for kNN). Shards that hold separate regions of space (domain
    decomposition) are thus searched for the queries near their border only; shards of
    random points are searched for all."""
    world, rank = _ranks(group)
    offsets = [sum(sizes[:r]) for r in range(world)]
    boxes = _boxes(ref, group) if world > 1 else None
    capacity = max(sizes)
    if ref.shape[0] == capacity:  # sent as it is: no copy of the largest shards (3 GB at 2.5 x 10^8 points)
        current = ref.contiguous()
    else:
        current = ref.new_zeros((capacity, ref.shape[1]))
        current[:ref.shape[0]] = ref
    owner = rank
    best = (query.new_full((query.shape[0], 0), float("inf")),
            torch.empty((query.shape[0], 0), dtype=torch.int64, device=query.device))
    counts = None
    for step in range(world):
        pending = []
        if step + 1 < world:
            incoming = torch.empty_like(current)
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, current, dist.get_global_rank(group, (rank + 1) % world) if group else
                           (rank + 1) % world, group),
                dist.P2POp(dist.irecv, incoming, dist.get_global_rank(group, (rank - 1) % world) if group else
                           (rank - 1) % world, group)])
        if step == 0:
            lengths = torch.tensor([ref.shape[0]], dtype=torch.int64, device=query.device)
            dists, idx, found = search(query[None], ref[None], lengths, None)
            best = _widen(_merge(best, (dists[0], _global(idx[0], offsets[owner])), keep), keep)
            counts = None if found is None else found[0]
        else:
            _search_remote(query, current[:sizes[owner]], boxes[owner], offsets[owner], best, counts, keep,
                           search, radius)
        for request in pending:
            request.wait()
        if pending:
            current, owner = incoming, (owner - 1) % world
    return best[0], best[1], counts


def _search_remote(query, shard, box, offset: int, best, counts, keep: int, search, radius: float | None):
    """One ring step past the first: search another rank's reference ``shard`` [n, D] (inside
    ``box``, its first global index ``offset``) for the queries that can reach it, and merge
    what it finds into ``best`` (dists, idx) [M, keep] and ``counts`` [M] in place."""
    reaching = _reaching(query, box, best, keep, radius).nonzero()[:, 0]
    occupancy = _occupancy(shard, box) if reaching.numel() > OCCUPANCY_FROM * query.shape[0] else None
    if occupancy is not None:
        subset = (best[0][reaching], best[1][reaching])
        reaching = reaching[_reaching(query[reaching], box, subset, keep, radius, occupancy)]
    kth = None if radius is not None else best[0][reaching, keep - 1]
    groups = _by_limit(reaching, kth)
    limits = [radius if radius is not None else limit for _, limit in groups]
    kept = None if not groups or None in limits else _near(shard, query[reaching], max(limits), occupancy)
    searched = shard if kept is None else shard[kept]
    lengths = torch.tensor([searched.shape[0]], dtype=torch.int64, device=query.device)
    for rows, limit in groups if searched.shape[0] else ():
        dists, idx, found = search(query[rows][None], searched[None], lengths, limit)
        idx = idx[0] if kept is None else torch.where(idx[0] >= 0, kept[idx[0].clamp(min=0)], -1)
        best[0][rows], best[1][rows] = _merge((best[0][rows], best[1][rows]), (dists[0], _global(idx, offset)), keep)
        if found is not None:
            counts[rows] += found[0]


def _near(ref: torch.Tensor, query: torch.Tensor, limit: float, occupancy: _Occupancy | None = None) -> torch.Tensor:
    """[n] int64 ascending: the rows of ``ref`` [N, D] inside the bounding box of the queries
    [M, D] (``_box``) widened by ``limit`` (with margin) on every side, and where
    ``occupancy`` (of ``ref``) is given, in cells near the queries' cells: a superset of the
    references within ``limit`` of any query. A search within ``limit`` over these alone
    finds what it finds over all of ``ref`` (the order kept, so ties still go to the
    smaller index): for shards that are regions of space, a thin layer of the other shard."""
    lo, hi = _box(query)
    scale = torch.maximum(lo.abs(), hi.abs()).nan_to_num(0.0, 0.0, 0.0)
    pad = limit * (1 + _PRUNE_MARGIN) + _PRUNE_MARGIN * scale
    low, high = _outward(lo - pad, hi + pad, ref.dtype)
    inside = ((ref >= low) & (ref <= high)).all(1)
    if occupancy is not None and bool(torch.isfinite(query).all()):
        cells = occupancy.near(query, limit * (1 + _PRUNE_MARGIN) + float(_PRUNE_MARGIN * scale.max()))
        if cells is not None:
            inside &= cells[occupancy.cells(ref)[0]]
    return inside.nonzero()[:, 0]


def _outward(low: torch.Tensor, high: torch.Tensor, dtype: torch.dtype):
    """float64 bounds [D] in ``dtype`` rounded outward (``low`` down, ``high`` up), so that
    comparing points of that dtype with them keeps every point within the float64 bounds
    without a float64 copy of the points. 16-bit dtypes keep float64 bounds."""
    if dtype not in (torch.float32, torch.float64):
        return low, high
    rounded = [bound.to(dtype) for bound in (low, high)]
    return (torch.where(rounded[0].double() > low, torch.nextafter(rounded[0], rounded[0].new_tensor(-math.inf)),
                        rounded[0]),
            torch.where(rounded[1].double() < high, torch.nextafter(rounded[1], rounded[1].new_tensor(math.inf)),
                        rounded[1]))


def _global(idx: torch.Tensor, offset: int) -> torch.Tensor:
    """The local indices ``idx`` [M, w] (a fresh search result, -1 padded at the end of its
    rows: changed in place, -1 kept) made global. In place, and the padding mended on the
    rows that have it only: at 10^8 queries x 16 each pass over the lists moves 12.8 GB."""
    if offset and idx.numel():
        padded = (idx[:, -1] < 0).nonzero()[:, 0]
        idx.add_(offset)
        idx[padded] = idx[padded].masked_fill(idx[padded] < offset, -1)
    return idx


def _by_limit(rows: torch.Tensor, kth: torch.Tensor | None):
    """(rows, limit) groups of the queries ``rows`` to search a shard for. kNN (``kth``: their
    k-th distance so far): only references within it can enter a list, so each group is
    searched within one radius, the group's largest k-th distance (with margin); the groups
    are the k-th distances' binary exponents, so no radius exceeds twice a member's need.
    A radius keeps a far query from growing its search across a shard of another region (a
    plain kNN there expands ring after ring to find k points). Lists not yet full (+inf)
    take a plain kNN (limit None), as do radius searches (their radius bounds them)."""
    if not rows.numel():
        return []
    if kth is None:
        return [(rows, None)]
    limit = kth.double() * (1 + _PRUNE_MARGIN)
    finite = torch.isfinite(limit)
    groups = [] if bool(finite.all()) else [(rows[~finite], None)]
    exponents = torch.frexp(limit[finite]).exponent
    for exponent in exponents.unique().tolist():
        chosen = exponents == exponent
        groups.append((rows[finite][chosen], float(limit[finite][chosen].max())))
    return groups


def _widen(lists, keep: int):
    """(dists, idx) [M, w] padded to [M, keep] with +inf / -1 (w <= keep)."""
    dists, idx = lists
    missing = keep - dists.shape[1]
    if missing <= 0:
        return dists, idx
    return (torch.cat([dists, dists.new_full((dists.shape[0], missing), math.inf)], 1),
            torch.cat([idx, idx.new_full((idx.shape[0], missing), -1)], 1))


class _FetchRows(torch.autograd.Function):
    """rows [len(idx), C] = the global rows ``idx`` (>= 0) of a table sharded over the ranks
    (``local``: this rank's rows; ``sizes``: every rank's row count). Backward sends the
    rows' gradients back to their owners."""

    @staticmethod
    def forward(ctx, local, idx, sizes, group):
        world, _ = _ranks(group)
        ends = torch.tensor(sizes, device=idx.device).cumsum(0)
        owner = torch.searchsorted(ends, idx, right=True)
        order = owner.argsort(stable=True)
        asked = torch.bincount(owner, minlength=world)
        served = torch.empty_like(asked)
        dist.all_to_all_single(served, asked, group=group)
        asked, served = asked.tolist(), served.tolist()
        local_index = (idx - (ends - torch.tensor(sizes, device=idx.device))[owner])[order]
        requests = local_index.new_empty(sum(served))
        dist.all_to_all_single(requests, local_index, served, asked, group=group)
        answers = local.new_empty((sum(asked), local.shape[1]))
        dist.all_to_all_single(answers, local[requests].contiguous(), asked, served, group=group)
        rows = torch.empty_like(answers)
        rows[order] = answers
        ctx.save_for_backward(order, requests)
        ctx.split, ctx.group, ctx.local_shape = (asked, served), group, local.shape
        return rows

    @staticmethod
    def backward(ctx, grad_rows):
        order, requests = ctx.saved_tensors
        asked, served = ctx.split
        returned = grad_rows.new_empty((sum(served), grad_rows.shape[1]))
        dist.all_to_all_single(returned, grad_rows[order].contiguous(), served, asked, group=ctx.group)
        grad = grad_rows.new_zeros(ctx.local_shape).index_add_(0, requests, returned)
        return grad, None, None, None


def _neighbour_rows(table: torch.Tensor, idx: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """[M, k, C]: the rows of the sharded ``table`` at global ``idx`` [M, k] (0 where idx = -1)."""
    valid = idx >= 0
    rows = _FetchRows.apply(table, idx[valid], sizes, group)
    return table.new_zeros((*idx.shape, table.shape[1])).index_put((valid,), rows)


def _differentiable(dists, idx, query, ref, sizes, group):
    """The searched distances, with gradients w.r.t. the local queries and every rank's
    references (the values stay the search's, bit for bit)."""
    if not (torch.is_grad_enabled() and (query.requires_grad or ref.requires_grad)):
        return dists
    neighbours = _neighbour_rows(ref, idx, sizes, group)
    measured = (query[:, None, :] - neighbours).norm(dim=-1)
    return torch.where(idx >= 0, dists + (measured - measured.detach()), dists)


def _within(q, r, lengths, radius, cap, backend):
    """The nearest ``cap`` references within ``radius`` (at most what the operator allows
    for the shard: all of its points when cap exceeds them)."""
    with torch.no_grad():
        return api.radius(q, r, radius, min(cap, max(r.shape[1], MAX_PADDED_K)), ref_lengths=lengths,
                          backend=backend)


def _radius_search(radius, cap, backend):
    """One shard's search for ``_ring`` (the limit is the radius itself)."""
    def search(q, r, lengths, limit):
        return _within(q, r, lengths, radius, cap, backend)
    return search


def _knn_search(k, backend):
    """One shard's search for ``_ring``: the k nearest, or within ``limit`` the k nearest."""
    def search(q, r, lengths, limit):
        if limit is not None:
            d, i, _ = _within(q, r, lengths, limit, k, backend)
            return d, i, None
        with torch.no_grad():
            return (*api.knn(q, r, k, ref_lengths=lengths, backend=backend), None)
    return search


@torch.compiler.disable
def knn(query, ref, k, *, group=None, backend="auto"):
    """The k nearest references of this rank's queries among every rank's references.

    Args:
        query: [M_r, D] this rank's queries. ref: [N_r, D] this rank's references (an empty
            shard is allowed), same dtype and device. Or both DTensors sharded on the points
            (``[Shard(0)]``) over one 1-D device mesh: the outputs are DTensors sharded like
            query. k: >= 1, the same on every rank.
        group: the process group (None: the default group, or the DTensors' mesh).
        backend: the single-device backend each shard is searched with (as in
            :func:`fullgraph.knn`).

    Returns:
        dists [M_r, k] ascending, +inf padded, differentiable w.r.t. query and every rank's
        ref; idx [M_r, k] int64 global reference indices (rank order), -1 padded.

    Every rank must call it (a collective). Every argument is checked on every rank before
    any traffic: a refusal on one rank (a bad k, shard, dtype or backend) is raised on all
    of them, the same error naming that rank.
    """
    like = query
    local, mesh, group, sizes = _agree(group, _search_checks("knn", backend, "k", k), query=query, ref=ref)
    query, ref = local["query"], local["ref"]
    dists, idx, _ = _ring(query.detach(), ref.detach(), sizes, k, _knn_search(k, backend), group)
    return _wrap(mesh, like, _differentiable(dists, idx, query, ref, sizes, group), idx)


@torch.compiler.disable
def radius(query, ref, radius, max_neighbors, *, group=None, backend="auto"):
    """The nearest ``max_neighbors`` references within ``radius`` of this rank's queries,
    among every rank's references; arguments and returns as :func:`knn` and
    :func:`fullgraph.radius` (counts [M_r]: all references within the radius, every rank's)."""
    like = query
    local, mesh, group, sizes = _agree(group, _search_checks("radius", backend, "max_neighbors", max_neighbors,
                                                             radius=(radius, False)), query=query, ref=ref)
    query, ref = local["query"], local["ref"]

    dists, idx, counts = _ring(query.detach(), ref.detach(), sizes, max_neighbors,
                               _radius_search(radius, max_neighbors, backend), group, radius)
    return _wrap(mesh, like, _differentiable(dists, idx, query, ref, sizes, group), idx, counts)


@torch.compiler.disable
def knn_aggregate(query, ref, features, k, *, sigma=0.1, group=None, backend="auto"):
    """:func:`fullgraph.knn_aggregate` over the sharded cloud: [M_r, C], the k nearest
    references' features (sharded with ref: [N_r, C]) softmax-weighted by -distance / sigma;
    differentiable w.r.t. query and every rank's ref and features. DTensors as in :func:`knn`."""
    like = query
    local, mesh, group, sizes = _agree(group, _search_checks("knn", backend, "k", k, sigma=(sigma, True)),
                                       query=query, ref=ref, features=features)
    query, ref, features = local["query"], local["ref"], local["features"]
    _, idx, _ = _ring(query.detach(), ref.detach(), sizes, k, _knn_search(k, backend), group)
    rows = _neighbour_rows(torch.cat([ref, features], -1), idx, sizes, group)
    neighbours, values = rows[..., :ref.shape[1]], rows[..., ref.shape[1]:]
    valid = idx >= 0
    measured = (query[:, None, :] - neighbours).norm(dim=-1)
    logits = torch.where(valid, -measured / sigma, float("-inf"))
    logits = torch.where(valid.any(-1, keepdim=True), logits, 0)  # a query without neighbours: weights 0 below
    weights = torch.where(valid, torch.softmax(logits, -1), 0)
    return _wrap(mesh, like, (weights[..., None] * values).sum(-2))


@torch.compiler.disable
def radius_aggregate(query, ref, features, radius, *, sigma=0.1, group=None, backend="auto"):
    """:func:`fullgraph.radius_aggregate` over the sharded cloud: [M_r, C], the features of
    **all** references within ``radius`` (every rank's), weighted by exp(-d / sigma) and
    normalized; differentiable w.r.t. query and every rank's ref and features. DTensors as
    in :func:`knn`.

    Two passes of the ring: the first counts each query's neighbours, the second lists all
    of them (the densest query's count, read back to the host, sizes the lists: memory
    M_r x that count); the rows of the pairs (query, neighbour) come by ``all_to_all_single``
    and are summed query by query (``torch.segment_reduce``: memory ~ the pairs' count).
    """
    like = query
    local, mesh, group, sizes = _agree(group, _search_checks("radius", backend, None, None, radius=(radius, False),
                                                             sigma=(sigma, True)),
                                       query=query, ref=ref, features=features)
    query, ref, features = local["query"], local["ref"], local["features"]
    _, _, counts = _ring(query.detach(), ref.detach(), sizes, 1, _radius_search(radius, 1, backend), group, radius)
    cap = max(1, int(counts.max()) if counts.numel() else 0)
    _, idx, _ = _ring(query.detach(), ref.detach(), sizes, cap, _radius_search(radius, cap, backend), group, radius)
    # The pairs (query, neighbour), query by query: the lists hold every neighbour (counts[i]
    # of them, then -1), and padded rows of features would take cap / mean count times more.
    pairs = idx[idx >= 0]
    lengths = counts.to(pairs.device)
    owner = torch.repeat_interleave(torch.arange(query.shape[0], device=pairs.device), lengths)
    del idx
    rows = _FetchRows.apply(torch.cat([ref, features], -1), pairs, sizes, group)
    neighbours, values = rows[:, :ref.shape[1]], rows[:, ref.shape[1]:]
    measured = (query[owner] - neighbours).norm(dim=-1)
    # The shift by each query's nearest distance cancels in the ratio (it keeps exp from underflowing).
    nearest = torch.segment_reduce(measured.detach(), "min", lengths=lengths, unsafe=True)
    weights = torch.exp((nearest[owner] - measured) / sigma)
    total = torch.segment_reduce(weights, "sum", lengths=lengths, unsafe=True)[:, None]
    summed = torch.segment_reduce(weights[:, None] * values, "sum", lengths=lengths, unsafe=True)
    return _wrap(mesh, like, summed / torch.where(total > 0, total, 1))


class Partitioned(NamedTuple):
    """A rank's shard after ``partition``: its points [N', D], the rows of each ``values``
    tensor that travelled with them, and origin [N'] int64, each point's global index before
    (rank-major numbering, as the indices of :func:`knn`)."""
    points: torch.Tensor
    values: tuple[torch.Tensor, ...]
    origin: torch.Tensor


# Coordinates each rank contributes to the choice of the cuts.
PARTITION_SAMPLE = 4096


def _evenly_spaced(n: int, count: int, device) -> torch.Tensor:
    """[count] int64 positions from 0 to n - 1 (n >= 1), in integers: a float32 linspace
    rounds n - 1 up to n from n ~ 2^24 on."""
    return torch.arange(count, device=device, dtype=torch.int64) * (n - 1) // max(count - 1, 1)


def _cuts(coordinate: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """[W - 1] cuts along one axis that split the whole cloud into W slabs of about equal
    counts: quantiles of every rank's evenly spaced sample, weighted by the rank's size."""
    world, _ = _ranks(group)
    sample = coordinate.new_full((PARTITION_SAMPLE,), math.nan, dtype=torch.float64)
    if coordinate.numel():
        sample = coordinate[_evenly_spaced(coordinate.numel(), PARTITION_SAMPLE, coordinate.device)].double()
    samples = _all_gather(sample, group)  # [W, S]
    weights = torch.tensor(sizes, dtype=torch.float64, device=coordinate.device)[:, None].expand_as(samples)
    finite = torch.isfinite(samples)
    values, weights = samples[finite], weights[finite]
    if not values.numel():
        return coordinate.new_zeros(world - 1, dtype=torch.float64)
    values, order = values.sort()
    total = weights[order].cumsum(0)
    targets = total[-1] * torch.arange(1, world, device=coordinate.device, dtype=torch.float64) / world
    return values[torch.searchsorted(total, targets).clamp(max=values.numel() - 1)]


def _exchange(tensor: torch.Tensor, order: torch.Tensor, sent: list[int], received: list[int], group):
    out = tensor.new_empty((sum(received), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor[order].contiguous(), received, sent, group=group)
    return out


@torch.compiler.disable
def partition(points, *values, group=None) -> Partitioned:
    """Redistribute a cloud sharded any way (random points, say) into regions of space: W
    slabs along the axis of largest extent, cut where each holds about N / W points, rank r
    receiving slab r. The neighbour functions of this module scale with shards that are
    regions (a rank searches another's shard only for its queries near that region); on
    shards of random points every rank searches every shard for every query.

    Args:
        points: [N_r, D] this rank's points (float). values: tensors [N_r, ...] whose rows
            travel with the points (features, labels, your own ids).
        group: the process group (None: the default group).

    Returns:
        Partitioned(points [N'_r, D], values, origin [N'_r] int64): the new shard, ordered as
        received (by source rank), and each point's global index before. Non-finite
        coordinates go to the last slab. Communication: one ``all_to_all_single`` per tensor
        (each point moves at most once) and small all-gathers (sizes, a sample of coordinates).
    """
    def check(local):
        for position, value in enumerate(values):
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != points.shape[0] \
                    or value.device != points.device:
                shape = f"shape {list(value.shape)} on {value.device}" if isinstance(value, torch.Tensor) else \
                    type(value).__name__
                raise ValueError(f"values[{position}]: expected a tensor with one row per point "
                                 f"({points.shape[0]}) on {points.device}, got {shape}")
        return {}

    world, rank = _ranks(group)
    _, _, group, sizes = _agree(group, check, query=points, ref=points)
    box = _boxes(points, group)  # [W, 2, D]
    extent = (box[:, 1].amax(0) - box[:, 0].amin(0)).nan_to_num(nan=-1.0)  # -inf - inf: every shard empty
    axis = int(extent.argmax())
    cuts = _cuts(points[:, axis], sizes, group)
    owner = torch.searchsorted(cuts, points[:, axis].double().contiguous(), right=True)
    owner = torch.where(torch.isfinite(points[:, axis]), owner, world - 1)
    order = owner.argsort(stable=True)
    sent = torch.bincount(owner, minlength=world)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    sent, received = sent.tolist(), received.tolist()
    origin = torch.arange(points.shape[0], device=points.device) + sum(sizes[:rank])
    moved = [_exchange(tensor, order, sent, received, group) for tensor in (points, origin, *values)]
    return Partitioned(moved[0], tuple(moved[2:]), moved[1])
