"""fullgraph.distributed on CPU with gloo: 2 and 4 processes, each holding a shard of one cloud;
results and gradients against the single-process operators on the whole cloud."""

from __future__ import annotations

import datetime
import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fullgraph
from conftest import DEVICES, HAVE_TRITON
from fullgraph import _triton, distributed

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _cloud(generator, count):
    """Clustered 3-D points (neighbourhoods cross the shard boundaries), with exact duplicates."""
    centres = torch.randn(5, 3, generator=generator, dtype=torch.float64) * 2
    points = centres[torch.randint(5, (count,), generator=generator)] + 0.3 * torch.randn(count, 3, generator=generator,
                                                                                         dtype=torch.float64)
    points[count // 3] = points[count // 2]
    return points


def _shards(total, world, generator):
    """Unequal shard sizes summing to total, rank 1 empty (and rank 3 tiny) where they exist."""
    weights = torch.rand(world, generator=generator) + 0.2
    if world > 1:
        weights[1] = 0
    sizes = (weights / weights.sum() * total).floor().long()
    sizes[0] += total - int(sizes.sum())
    return sizes.tolist()


def _local(tensor, sizes, rank):
    start = sum(sizes[:rank])
    return tensor[start:start + sizes[rank]]


def _check_knn_and_gradients(rank, world, backend, spatial=False):
    """spatial: the shards are slabs along x (domain decomposition), so the ring skips most
    shards for most queries (``_reaching``); the results must not change."""
    generator = torch.Generator().manual_seed(7)
    query, ref = _cloud(generator, 90), _cloud(generator, 130)
    if spatial:
        query, ref = query[query[:, 0].argsort()], ref[ref[:, 0].argsort()]
    features = torch.randn(130, 4, generator=generator, dtype=torch.float64)
    weights = torch.rand(90, 6, generator=generator, dtype=torch.float64)
    q_sizes, r_sizes = _shards(90, world, generator), _shards(130, world, generator)[::-1]

    whole_q, whole_r = query.clone().requires_grad_(), ref.clone().requires_grad_()
    want_d, want_i = fullgraph.knn(whole_q, whole_r, 6, backend=backend)
    torch.where(want_i >= 0, want_d * weights, 0).sum().backward()

    local_q = _local(query, q_sizes, rank).clone().requires_grad_()
    local_r = _local(ref, r_sizes, rank).clone().requires_grad_()
    dists, idx = distributed.knn(local_q, local_r, 6, backend=backend)
    assert torch.equal(idx, _local(want_i, q_sizes, rank))
    assert torch.equal(dists.detach(), _local(want_d, q_sizes, rank).detach())
    # under torch.compile: a graph break around the collective, the code around it compiled
    compiled = torch.compile(lambda q, r: distributed.knn(q * 1.0, r, 6, backend=backend)[0].sum(-1) + 1)
    torch.testing.assert_close(compiled(local_q.detach(), local_r.detach()), dists.detach().sum(-1) + 1)
    torch.where(idx >= 0, dists * _local(weights, q_sizes, rank), 0).sum().backward()
    torch.testing.assert_close(local_q.grad, _local(whole_q.grad, q_sizes, rank))
    torch.testing.assert_close(local_r.grad, _local(whole_r.grad, r_sizes, rank))

    # radius: the nearest 4 within 0.5, counts over every shard
    want = fullgraph.radius(query, ref, 0.5, 4, backend=backend)
    got = distributed.radius(_local(query, q_sizes, rank), _local(ref, r_sizes, rank), 0.5, 4, backend=backend)
    for g, w in zip(got, want):
        assert torch.equal(g, _local(w, q_sizes, rank))

    # the aggregations: values and gradients for queries, references and features
    shards = ((query, q_sizes), (ref, r_sizes), (features, r_sizes))
    _check_aggregate(rank, shards, lambda q, r, f: fullgraph.knn_aggregate(q, r, f, 5, sigma=0.4, backend=backend),
                     lambda q, r, f: distributed.knn_aggregate(q, r, f, 5, sigma=0.4, backend=backend))
    # radius_aggregate: every neighbour within 0.6, whatever shard holds it
    _check_aggregate(rank, shards,
                     lambda q, r, f: fullgraph.radius_aggregate(q, r, f, 0.6, sigma=0.3, backend=backend),
                     lambda q, r, f: distributed.radius_aggregate(q, r, f, 0.6, sigma=0.3, backend=backend))


def _check_aggregate(rank, shards, whole_op, sharded_op):
    """The sharded aggregation equals the whole-cloud one in value and in every input's gradient.
    shards: ((tensor, shard sizes) for query, ref, features)."""
    whole = [t.clone().requires_grad_() for t, _ in shards]
    want = whole_op(*whole)
    want.sum().backward()
    mine = [_local(t, sizes, rank).clone().requires_grad_() for t, sizes in shards]
    got = sharded_op(*mine)
    torch.testing.assert_close(got, _local(want, shards[0][1], rank).detach())
    got.sum().backward()
    for local, full, (_, sizes) in zip(mine, whole, shards):
        torch.testing.assert_close(local.grad, _local(full.grad, sizes, rank))


def _check_bad_shards(rank, world):
    """A shard that does not fit the others raises the same error on every rank (no hang)."""
    query = torch.rand(10, 3)
    ref = torch.rand(12, 4 if rank == 1 else 3)
    with pytest.raises(ValueError, match=r"ref D: expected the same on every rank of the group, got \[3, 4"):
        distributed.knn(query, ref, 2)
    ref = torch.rand(12, 3, dtype=torch.float64 if rank == 0 else torch.float32)
    with pytest.raises(ValueError, match="dtype: expected the same on every rank"):
        distributed.knn(query.to(ref.dtype), ref, 2)
    with pytest.raises(ValueError, match=r"k: expected the same on every rank of the group, got \[2, 3"):
        distributed.knn(query, torch.rand(12, 3), 2 + min(rank, 1))
    with pytest.raises(ValueError, match="features: expected one row per reference"):
        distributed.knn_aggregate(query, torch.rand(12, 3), torch.rand(11, 2), 2)
    # a group of one rank is the single-device operator
    alone = dist.new_group([0])
    if rank == 0:
        ref = torch.rand(12, 3)
        got = distributed.knn(query, ref, 3, group=alone)
        want = fullgraph.knn(query, ref, 3)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def _check_one_rank_refusing(rank, world):
    """A bad argument on one rank only (the last): every rank raises the same error within a
    second, and the next valid call works (nothing left pending)."""
    import time

    query, ref, features = torch.rand(10, 3), torch.rand(12, 3), torch.rand(12, 2)
    last = rank == world - 1

    def bad(value, good):
        return value if last else good

    calls = [
        (ValueError, lambda: distributed.knn(query, ref, bad(0, 2))),
        (TypeError, lambda: distributed.knn(bad(query.int(), query), ref, 2)),
        (ValueError, lambda: distributed.knn(bad(query[None], query), ref, 2)),
        (ValueError, lambda: distributed.radius(query, ref, bad(-1.0, 0.5), 4)),
        (ValueError, lambda: distributed.knn_aggregate(query, ref, features, 2, sigma=bad(-0.1, 0.1))),
        (ValueError, lambda: distributed.knn_aggregate(query, ref, bad(features[:5], features), 2)),
        (TypeError, lambda: distributed.radius_aggregate(query, ref, bad(features.double(), features), 0.5)),
        (TypeError, lambda: distributed.partition(bad(ref.int(), ref))),
        (ValueError, lambda: distributed.knn(query, ref, 2, backend=bad("no-such-backend", "auto"))),
        (ValueError, lambda: distributed.knn(query[:, :0], ref[:, :0], 2)),  # D = 0 on every rank
    ]
    for error, call in calls:
        dist.barrier()
        began = time.monotonic()
        with pytest.raises(error) as raised:
            call()
        assert time.monotonic() - began < 1.0
        messages = [None] * world
        dist.all_gather_object(messages, str(raised.value))
        assert len(set(messages)) == 1, messages
        dists, idx = distributed.knn(query, ref, 3)  # the next call works
        assert idx.shape == (10, 3)


def _check_dtensors(rank, world):
    """DTensors sharded on the points (torch.chunk's uneven shards) in, DTensors out, gradients too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(3)
    query, ref = _cloud(generator, 61), _cloud(generator, 131)
    whole_q, whole_r = query.clone().requires_grad_(), ref.clone().requires_grad_()
    want_d, want_i = fullgraph.knn(whole_q, whole_r, 5, backend="torch")
    torch.where(want_i >= 0, want_d, 0).sum().backward()

    sharded_q = distribute_tensor(query, mesh, [Shard(0)]).requires_grad_()
    sharded_r = distribute_tensor(ref, mesh, [Shard(0)]).requires_grad_()
    dists, idx = distributed.knn(sharded_q, sharded_r, 5, backend="torch")
    assert tuple(idx.placements) == (Shard(0),) and idx.shape == (61, 5)
    assert torch.equal(idx.full_tensor(), want_i) and torch.equal(dists.full_tensor().detach(), want_d.detach())
    torch.where(idx.to_local() >= 0, dists.to_local(), 0).sum().backward()
    torch.testing.assert_close(sharded_q.grad.full_tensor(), whole_q.grad)
    torch.testing.assert_close(sharded_r.grad.full_tensor(), whole_r.grad)
    with pytest.raises(TypeError, match="expected all DTensors or all plain tensors"):
        distributed.knn(sharded_q, ref, 5)
    with pytest.raises(ValueError, match=r"expected a DTensor sharded on the point dimension"):
        distributed.knn(sharded_q, distribute_tensor(ref, mesh, [Replicate()]), 5)


def _gathered(tensor):
    """Every rank's tensor (uneven first dimensions), concatenated in rank order."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, tensor)
    return torch.cat(parts)


def _check_partition(rank, world):
    """Random shards in, slabs out: every point arrives once with its rows, the slabs are in
    rank order along the widest axis and about equal, and kNN over them equals one device."""
    generator = torch.Generator().manual_seed(11)
    cloud = torch.rand(300, 3, generator=generator, dtype=torch.float64) * torch.tensor([1.0, 5.0, 2.0])
    cloud[7, 1] = float("nan")  # a non-finite coordinate goes to the last slab
    labels = torch.arange(300) * 10
    sizes = _shards(300, world, generator)
    part = distributed.partition(_local(cloud, sizes, rank), _local(labels, sizes, rank), _local(cloud * 2, sizes, rank))
    origins = _gathered(part.origin)
    assert sorted(origins.tolist()) == list(range(300))
    assert torch.equal(part.points.nan_to_num(), cloud[part.origin].nan_to_num())
    assert torch.equal(part.values[0], labels[part.origin])
    assert torch.equal(part.values[1].nan_to_num(), (cloud * 2)[part.origin].nan_to_num())
    assert (7 in part.origin.tolist()) == (rank == world - 1)
    finite = part.points[:, 1][torch.isfinite(part.points[:, 1])]
    ends = _gathered(torch.stack([finite.min(), finite.max()])[None])
    assert bool((ends[:-1, 1] <= ends[1:, 0]).all()), ends  # slabs along y (the widest), in rank order
    assert 300 / world / 2 <= part.points.shape[0] <= 300 / world * 2
    dists, idx = distributed.knn(part.points, part.points, 5, backend="cpu")
    want_d, want_i = fullgraph.knn(cloud, cloud, 5, backend="cpu")
    assert torch.equal(torch.where(idx >= 0, origins[idx.clamp(min=0)], -1), want_i[part.origin])
    assert torch.equal(dists, want_d[part.origin])
    with pytest.raises(ValueError, match=r"values\[0\]: expected a tensor with one row per point .* \(rank 1 of"):
        distributed.partition(part.points, part.origin[:1] if rank == 1 else part.origin)


def _worker(rank, world, port, scenario):
    torch.set_num_threads(1)
    # Ranks compile at different speeds under load; a refusal must not rely on the timeout at all.
    timeout = 20 if scenario == "refusing" else 240
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        for part in scenario.split("+"):  # (one group for several: each spawn costs its imports)
            if part == "bad":
                _check_bad_shards(rank, world)
            elif part == "refusing":
                _check_one_rank_refusing(rank, world)
            elif part == "dtensor":
                _check_dtensors(rank, world)
            elif part == "partition":
                _check_partition(rank, world)
            else:
                _check_knn_and_gradients(rank, world, part.removesuffix("-spatial"), part.endswith("-spatial"))
            dist.barrier()  # every rank done before any tears the group down (a teardown race aborted one in CI)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("world, scenario", [(2, "torch+bad+dtensor"), (4, "cpu"), (3, "cpu-spatial+partition"),
                                             (2, "refusing"), (3, "refusing")])
def test_sharded_operators_equal_the_whole_cloud(world, scenario):
    mp.spawn(_worker, args=(world, _free_port(), scenario), nprocs=world, join=True)


def test_the_package_attribute_and_the_backend_for_this_host(monkeypatch):
    """`fullgraph.distributed` without importing it first; NCCL only where every local rank has a GPU."""
    import subprocess
    import sys

    code = "import fullgraph; print(fullgraph.distributed.knn.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "fullgraph.distributed", out.stderr
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(torch.cuda.device_count() + 1))
    assert distributed.process_group_backend() == "gloo"


def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.knn(torch.rand(4, 3), torch.rand(5, 3), 2)


@pytest.mark.slow
def test_the_torchrun_example_runs_as_written():
    """README "More than one GPU": the example, launched as the README says (gloo on this CPU)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), "examples/knn_sharded.py"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("equal to one device: True") == 2, out.stdout


@pytest.mark.slow
def test_the_sharded_benchmark_under_torchrun(tmp_path, capsys):
    """`torchrun --nproc-per-node N -m fullgraph.cli bench knn-sharded` with 1 and 2 ranks: rank 0
    reports every row; `fullgraph report` of the two runs adds the scaling table."""
    import json
    import subprocess
    import sys

    from fullgraph.cli import main

    paths = []
    for ranks in (1, 2):
        paths.append(tmp_path / f"rows-{ranks}.json")
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                              "--master-port", str(_free_port()), "-m", "fullgraph.cli", "bench", "knn-sharded",
                              "--size", "tiny", "--runs", "1", "--warmup", "0", "--json", str(paths[-1])],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.count("knn-sharded (tiny)") == 1
    rows = json.loads(paths[-1].read_text())
    assert len(rows) == 7 and all("error" not in r and r["ranks"] == 2 for r in rows), rows
    assert {r["variant"] for r in rows} == {"distributed.knn, uniform", "distributed.knn, clustered",
                                            "distributed.radius, uniform", "partition + knn, uniform"}
    assert rows[0]["received_bytes_per_rank"] == 2000 * 12
    plot = tmp_path / "scaling.png"
    assert main(["report", *map(str, paths), "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert "**scaling** of knn-sharded (tiny)" in printed and "| distributed.knn, clustered | train |" in printed
    assert plot.read_bytes()[:4] == b"\x89PNG" and f"wrote {plot}" in printed


def test_merging_in_row_blocks_gives_the_same_lists(monkeypatch, generator):
    """The ring's merge of two lists (by distance, then global index; ties and -1 padding)
    is the same whole and in blocks of rows (as for shards of 100M queries)."""
    def lists(offset):
        dists = torch.randint(0, 4, (50, 6), generator=generator).double().sort(-1).values  # many ties
        idx = torch.randint(0, 1000, (50, 6), generator=generator) + offset
        dists[:5, 3:], idx[:5, 3:] = float("inf"), -1
        return dists, idx
    best, found = lists(0), lists(1000)
    best[0][10:12, 0], found[0][12:14, -1] = -0.0, math.inf  # a -0.0 distance; overflowed distances
    whole = distributed._merge(best, found, 8)
    monkeypatch.setattr(distributed, "MERGE_ROWS", 7)
    blocks = distributed._merge(best, found, 8)
    for got, want in zip(blocks, whole):
        assert torch.equal(got, want)
    # float32 lists merge as one sort of packed keys: the same lists
    packed = distributed._merge((best[0].float(), best[1]), (found[0].float(), found[1]), 8)
    assert torch.equal(packed[0], whole[0].float()) and torch.equal(packed[1], whole[1])
    assert whole[0].shape == (50, 8) and bool((whole[0][:, 1:] >= whole[0][:, :-1]).all())
    empty = (best[0][:, :0], best[1][:, :0])
    assert all(torch.equal(a, b) for a, b in zip(distributed._merge(empty, found, 4), (found[0][:, :4], found[1][:, :4])))


def test_a_shard_is_searched_only_for_the_queries_that_can_reach_it(monkeypatch):
    query = torch.tensor([[0.0, 0.0], [5.0, 0.0], [float("nan"), 0.0], [9.0, 9.0]])
    box = torch.tensor([[4.0, -1.0], [6.0, 1.0]], dtype=torch.float64)  # lo, hi
    best = (torch.tensor([[1.0, 3.9], [0.5, 0.7], [1.0, 2.0], [1.0, 3.0]]), torch.zeros(4, 2, dtype=torch.int64))
    # kNN: within the k-th distance so far (4.0 from the box is beyond 3.9; inside; NaN kept; far)
    assert distributed._reaching(query, box, best, 2, None).tolist() == [False, True, True, False]
    # a list not yet full takes every shard
    assert distributed._reaching(query, box, best, 3, None).tolist() == [True] * 4
    # radius: the radius, not the lists, decides (counts need every reference within it)
    assert distributed._reaching(query, box, best, 2, 4.0).tolist() == [True, True, True, False]
    # a query exactly at the k-th distance from the box is kept (a tie may go to that shard)
    assert distributed._reaching(query[:1], box, (torch.tensor([[4.0]]), best[1][:1, :1]), 1, None).tolist() == [True]
    # an empty shard's box (+inf, -inf) is reached by nobody
    empty = torch.tensor([[float("inf")] * 2, [float("-inf")] * 2], dtype=torch.float64)
    assert distributed._reaching(query, empty, best, 2, 100.0).tolist() == [False, False, True, False]
    # the same in blocks of rows (as for shards of 10^8 queries)
    monkeypatch.setattr(distributed, "MERGE_ROWS", 3)
    assert distributed._reaching(query, box, best, 2, None).tolist() == [False, True, True, False]
    assert distributed._reaching(query, box, best, 2, 4.0).tolist() == [True, True, True, False]



@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", [device for device in DEVICES if device in _triton.devices()])
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_the_pruning_kernels_decide_as_the_torch_passes(monkeypatch, device, dim, generator):
    """On CUDA the box and occupancy tests (``_reaching``) and the cells of points run as one
    Triton pass each: the same decisions and cells as the torch passes, on clustered shards,
    queries inside, between, far outside (1e30), on the box's faces, non-finite, a column
    view (strided rows), float64 and bfloat16 queries, radius and k-th distance limits."""
    centres = torch.rand(4, dim, generator=generator, dtype=torch.float64)
    shard = (centres[torch.randint(4, (3000,), generator=generator)]
             + 0.01 * torch.randn(3000, dim, generator=generator, dtype=torch.float64)).float()
    box = distributed._box(shard)
    faces = torch.cat([box.float(), box.float() + torch.tensor([1e-3] + [0.0] * (dim - 1))])
    queries = torch.cat([torch.rand(700, dim, generator=generator) * 3 - 1, faces,
                         torch.full((1, dim), 1e30), torch.full((1, dim), -math.inf),
                         torch.full((1, dim), math.nan), torch.full((1, dim), math.inf)])
    queries[:40, 1:] = box[:, 1:].mean(0).float()  # beside the box along x, at their k-th distance (ties)
    queries[:40, 0] = (box[1, 0] + torch.rand(40, generator=generator, dtype=torch.float64)).float()
    kth = torch.rand(len(queries), 3, generator=generator).sort(-1).values * 0.05
    kth[:40, 2] = (queries[:40, 0].double() - box[1, 0]).float()
    wide = torch.cat([queries, torch.rand(len(queries), 2, generator=generator)], 1)
    kth[40:45, 2] = math.inf
    occupancy = distributed._occupancy(shard, box)
    cases = [(queries, None), (wide[:, :dim], None), (queries.double(), None), (queries.bfloat16(), None),
             (queries, 0.2), (queries, 0.0)]

    def decide(use_kernels):
        monkeypatch.setattr(distributed, "_kernels", lambda tensor: use_kernels)
        answers = [distributed._reaching(q.to(device), box.to(device), (kth.to(device), None), 3, radius, grid)
                   for q, radius in cases for grid in (None, _on(occupancy, device))]
        return [a.cpu() for a in answers], [c.cpu() for c in _on(occupancy, device).cells(queries.to(device))]

    (torch_reaching, torch_cells), (kernel_reaching, kernel_cells) = decide(False), decide(True)
    for got, want in zip(kernel_reaching, torch_reaching):
        assert torch.equal(got, want)
    assert all(torch.equal(got, want) for got, want in zip(kernel_cells, torch_cells))
    assert 0 < int(torch_reaching[0].sum()) < len(queries)  # both outcomes are tested
    assert int(torch_reaching[1].sum()) < int(torch_reaching[0].sum())  # the cells prune more



def test_local_indices_become_global_in_place_padding_kept():
    idx = torch.tensor([[0, 2, -1], [1, -1, -1], [3, 4, 5], [-1, -1, -1]])
    assert distributed._global(idx, 10) is idx
    assert idx.tolist() == [[10, 12, -1], [11, -1, -1], [13, 14, 15], [-1, -1, -1]]
    assert distributed._global(idx[:, :0], 10).shape == (4, 0)


def test_the_box_of_finite_points():
    points = torch.tensor([[0.0, 5.0], [2.0, -1.0], [math.nan, 9.0], [math.inf, 0.0]])
    assert distributed._box(points[:2]).tolist() == [[0.0, -1.0], [2.0, 5.0]]
    assert distributed._box(points).tolist() == [[0.0, -1.0], [2.0, 9.0]]  # the finite coordinates
    assert distributed._box(points[:0]).tolist() == [[math.inf] * 2, [-math.inf] * 2]
    assert distributed._box(points[:2].bfloat16()).dtype == torch.float64

def _on(occupancy, device):
    return occupancy._replace(lo=occupancy.lo.to(device), side=occupancy.side.to(device),
                              steps=occupancy.steps.to(device))


def test_queries_search_a_shard_within_their_k_th_distance_grouped_by_its_magnitude():
    rows = torch.arange(6)
    kth = torch.tensor([0.3, 0.26, 5.0, float("inf"), 0.0, 7.5])
    groups = distributed._by_limit(rows, kth)
    assert [g.tolist() for g, limit in groups if limit is None] == [[3]]  # a list not yet full: plain kNN
    for members, limit in groups:
        if limit is not None:
            assert bool((limit >= kth[members].double() * (1 + distributed._PRUNE_MARGIN)).all())
            assert limit <= 2 * float(kth[members].min()) * (1 + distributed._PRUNE_MARGIN) or limit == 0
    assert sorted(torch.cat([g for g, _ in groups]).tolist()) == rows.tolist()
    assert distributed._by_limit(rows[:0], kth[:0]) == [] and distributed._by_limit(rows, None) == [(rows, None)]


def test_another_shard_is_searched_over_its_references_near_the_reaching_queries(generator):
    """_near: the references inside the reaching queries' box widened by the limit, a superset
    of every reference within the limit of a query, in ascending order; non-finite queries
    add nothing; a slab's queries near its border keep a thin layer of the next slab."""
    ref = torch.rand(20000, 3, generator=generator) + torch.tensor([1.0, 0.0, 0.0])  # the slab x in [1, 2)
    query = torch.rand(500, 3, generator=generator) * torch.tensor([0.02, 1.0, 1.0]) + torch.tensor([0.98, 0, 0])
    limit = 0.015
    kept = distributed._near(ref, query, limit)
    within = (torch.cdist(query.double(), ref.double()) <= limit).any(0).nonzero()[:, 0]
    assert set(within.tolist()) <= set(kept.tolist()) and len(within) > 0
    assert bool((kept[1:] > kept[:-1]).all()) and len(kept) < 0.03 * len(ref)
    odd = torch.tensor([[float("nan"), 0.5, 0.5], [float("inf"), 0.5, 0.5]])
    assert distributed._near(ref, torch.cat([query, odd]), limit).equal(kept)
    assert distributed._near(ref, odd, limit).numel() == 0 and distributed._near(ref, query[:0], 1.0).numel() == 0


def test_partition_samples_stay_inside_large_shards():
    """The coordinates sampled for the slab cuts: 0 .. n - 1 exactly, also past 2^24 points
    (a float32 linspace reached n at 2 x 10^8 and indexed out of bounds on the GPU)."""
    for n, count in ((1, 5), (7, 7), (200_000_000, 1024), (2**31 + 5, 33)):
        positions = distributed._evenly_spaced(n, count, "cpu")
        assert positions[0] == 0 and positions[-1] == n - 1 and positions.dtype == torch.int64
        assert bool((positions[1:] >= positions[:-1]).all())


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_the_occupancy_bound_never_exceeds_the_distance_to_the_shard(dim, generator):
    """A query skips a remote shard when the shard's occupied cells are all farther than its
    k-th distance: the bound must be below the true distance to every shard point (clustered
    shards, queries inside, between and far outside the box, non-finite queries at 0), and
    the references kept for a search within ``limit`` must include all within it."""
    centres = torch.rand(5, dim, generator=generator, dtype=torch.float64)
    shard = (centres[torch.randint(5, (4000,), generator=generator)]
             + 0.01 * torch.randn(4000, dim, generator=generator, dtype=torch.float64)).float()
    shard[:3] = float("nan")  # not anybody's neighbours: no cell of their own
    queries = torch.cat([torch.rand(2000, dim, generator=generator) * 3 - 1,
                         torch.full((1, dim), 1e30), torch.full((1, dim), float("nan"))])
    occupancy = distributed._occupancy(shard, distributed._box(shard))
    assert occupancy is not None and max(occupancy.shape) > 4
    true = torch.cdist(queries[:-1].double(), shard[3:].double()).amin(1)
    bound = occupancy.distance_below(queries)
    assert bool((bound[:-1] <= true).all()) and bound[-1] == 0
    # it prunes: in 3-D most random points are far from five small clusters
    assert bool((bound > 0).float().mean() > (0.5 if dim == 3 else 0.02))
    limit = 0.05
    around = (centres[:1] + 0.03 * torch.randn(50, dim, generator=generator, dtype=torch.float64)).float()
    near_any = (torch.cdist(shard[3:].double(), around.double()) <= limit).any(1).nonzero()[:, 0] + 3
    kept = distributed._near(shard, around, limit, occupancy)
    assert set(near_any.tolist()) <= set(kept.tolist())
    assert kept.numel() < shard.shape[0] - 3  # and it filters
    # too few points for cells: the box decides alone
    assert distributed._occupancy(shard[3:10], distributed._box(shard[3:10])) is None
