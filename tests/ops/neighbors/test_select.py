"""The dense backend's candidate selection (ops/neighbors/cpu/native.py): the take smallest of
every row, ascending, ties to the smaller position, NaN last, as a stable sort gives them."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import CPP_CHECKS_CRASH, CRASH_REASON

import fullgraph
from fullgraph.ops.neighbors.cpu import native as select


def stable_smallest(values, take):
    ordered, positions = torch.sort(values, dim=-1, stable=True)  # NaN last, ties by position
    return ordered[..., :take], positions[..., :take]


def rows(kind, dtype, generator):
    if kind == "normal":
        return torch.randn(6, 40, 2048, generator=generator, dtype=dtype)
    if kind == "short":  # the rows of tiny batches, and some in descending order
        x = torch.randn(8, 64, 128, generator=generator, dtype=dtype)
        x[:, :8] = x[:, :8].sort(-1, descending=True).values
        return x
    if kind == "ties":  # five values only: long runs of equal values
        return torch.randint(0, 5, (4, 30, 300), generator=generator).to(dtype)
    if kind == "near-ties":  # equal in float32, distinct in float64
        base = 1 + torch.arange(300, dtype=torch.float64) * 1e-12
        return base[torch.randperm(300, generator=generator)].to(dtype).expand(5, 300).contiguous()
    if kind == "non-finite":
        x = torch.randn(4, 50, 200, generator=generator, dtype=dtype)
        x[0, :, ::3] = math.nan
        x[1] = math.inf
        x[2, 5] = math.nan
        x[2, 6] = -math.inf
        x[2, 7, 100:] = math.nan
        x[3, :, ::2] = math.inf
        x[3, :, 1] = -0.0
        x[3, :, 3] = 0.0
        return x
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["normal", "short", "ties", "near-ties", "non-finite"])
def test_equals_a_stable_sort(kind, dtype, generator):
    x = rows(kind, dtype, generator)
    for take in (0, 1, 3, 28, x.shape[-1] // 4, x.shape[-1] - 1, x.shape[-1]):
        got, positions = select.smallest(x, take)
        want, want_positions = stable_smallest(x, take)
        assert torch.equal(positions, want_positions), (kind, take)
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), (kind, take)
        assert got.dtype == x.dtype and positions.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_of_any_length_equal_a_stable_sort(dtype, generator):
    """Short rows of every length around the vectors' (the survivors ranked in vectors where
    few pass the bound; long lists bounded and placed by counting), with ties among the
    survivors, signed zeros, infinities and far values."""
    for width in (1, 2, 15, 16, 17, 31, 33, 100, 255, 256, 257, 513):
        x = torch.randn(3, 37, width, generator=generator, dtype=dtype)
        x[1] = torch.randint(-20, 20, (37, width), generator=generator).to(dtype) / 4  # ties, -0 and 0
        x[1, :, ::7] *= -0.0
        x[2, :, ::5] = -math.inf
        x[2, :, 1::9] = math.inf
        x[0, :4, -1] = 3e38  # one far value: the counted ranges of the others collapse into one
        for take in sorted({0, 1, min(3, width), min(24, width), width // 5 + 1, min(120, width), width // 2, width}):
            got, positions = select.smallest(x, take)
            want, want_positions = stable_smallest(x, take)
            assert torch.equal(positions, want_positions), (width, take)
            assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), (width, take)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["normal", "ties", "near-ties", "non-finite"])
@pytest.mark.parametrize("compiled", [True, False])
def test_tiles_merged_equal_a_stable_sort_of_the_row(kind, dtype, compiled, generator, monkeypatch):
    """``smallest_after`` a tile at a time (the first tile by ``smallest``) gives the whole
    row's smallest, NaN last: ties by position in C++; in its torch form (torch.topk orders
    ties as it likes) the same values at positions holding them."""
    if not compiled:
        monkeypatch.setattr(select, "_built", lambda: False)
    x = rows(kind, dtype, generator)
    width = x.shape[-1]
    for take, tile in ((1, 64), (3, 50), (28, 128), (width // 4, 97), (width, width // 3 + 1)):
        least = None
        for start in range(0, width, tile):
            stop = min(start + tile, width)
            piece = x[..., start:stop]
            least = (select.smallest(piece, min(take, stop)) if least is None
                     else select.smallest_after(piece, min(take, stop), least, start))
        want, want_positions = stable_smallest(x, take)
        assert torch.equal(least[0].nan_to_num(7.0), want.nan_to_num(7.0)), (kind, take, tile)
        if compiled:
            assert torch.equal(least[1], want_positions), (kind, take, tile)
        else:
            assert torch.equal(x.gather(-1, least[1]).nan_to_num(7.0), want.nan_to_num(7.0)), (kind, take, tile)


def test_any_leading_shape_and_rows_not_contiguous(generator):
    x = torch.randn(3, 2, 5, 500, generator=generator)[..., ::2]
    got, positions = select.smallest(x, 9)
    assert positions.shape == (3, 2, 5, 9) and torch.equal(positions, stable_smallest(x, 9)[1])
    one = torch.randn(1000, generator=generator)
    assert torch.equal(select.smallest(one, 10)[1], stable_smallest(one, 10)[1])


def test_other_dtypes_take_topk(generator):
    x = torch.randn(4, 64, generator=generator).to(torch.bfloat16)
    got, positions = select.smallest(x, 5)
    assert torch.equal(got, torch.topk(x, 5, largest=False).values)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"take: expected an int from 0 to 10 \(the rows' length\), got 11"):
        select.smallest(torch.rand(3, 10), 11)
    with pytest.raises(ValueError, match="take: expected an int"):
        select.smallest(torch.rand(3, 10), 2.0)
    with pytest.raises(TypeError, match="values: expected a tensor of at least one dimension"):
        select.smallest(torch.tensor(1.0), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dim", [1, 3, 4, 5, 17, 33, 64, 100, 256, 300, 513, 1024])
def test_squared_distances_have_the_references_bits(dim, dtype, generator):
    """The C++ re-measure equals pairs.squared_difference of the gathered rows bit for bit,
    on coordinates spanning 12 orders of magnitude (every rounding shows): the halving in
    steps and as a tree in registers (up to 2 KiB rows padded to a power of two), with and
    without a partial last vector."""
    from fullgraph.ops.neighbors import pairs

    magnitude = 10.0 ** torch.randint(-6, 6, (3, 40, dim), generator=generator)
    q = (torch.randn(3, 40, dim, generator=generator, dtype=torch.float64) * magnitude).to(dtype)
    r = (torch.randn(3, 50, dim, generator=generator, dtype=torch.float64) * magnitude[:, :1]).to(dtype)
    r[:, :5] = q[:, :5]  # exact duplicates: zero distances
    candidates = torch.randint(0, 50, (3, 40, 9), generator=generator)
    got = select.squared_distances(q, r, candidates)
    rows = torch.gather(r, 1, candidates.reshape(3, -1, 1).expand(-1, -1, dim)).reshape(3, 40, 9, dim)
    want = pairs.squared_difference(q[:, :, None, :], rows)
    assert got.dtype == dtype and torch.equal(got, want)


def test_squared_distances_refuse_positions_outside_the_cloud(generator):
    q, r = torch.randn(1, 4, 8, generator=generator), torch.randn(1, 6, 8, generator=generator)
    outside, positions = torch.full((1, 4, 2), 6), torch.zeros((1, 4, 2), dtype=torch.int64)
    with pytest.raises(ValueError, match=r"candidates: expected positions in \[0, 6\) \(r's rows\), got 6 to 6"):
        select.squared_distances(q, r, outside)
    with pytest.raises(ValueError, match=r"candidates: expected positions in \[0, 6\).*got -1 to 0"):
        select.squared_distances(q, r, positions - (torch.arange(8).reshape(1, 4, 2) == 3).long())
    with pytest.raises(TypeError, match=r"r: expected q's dtype and device \(torch.float32 on cpu\), got "
                                        r"torch.float64"):
        select.squared_distances(q, r.double(), positions)
    with pytest.raises(ValueError, match=r"r: expected \[B, N, D\] with q's B and D"):
        select.squared_distances(q, r[..., :3], positions)
    with pytest.raises(TypeError, match="candidates: expected int64 on cpu, got torch.int32"):
        select.squared_distances(q, r, positions.int())
    with pytest.raises(ValueError, match=r"candidates: expected \[B, M, C\] with q's B and M"):
        select.squared_distances(q, r, positions[:, :3])
    if CPP_CHECKS_CRASH:
        pytest.skip(CRASH_REASON)
    # The extension's own operator checks the same (a public torch.ops namespace).
    with pytest.raises(RuntimeError, match=r"candidates: expected positions in \[0, 6\)"):
        torch.ops.fullgraph_cpu.squared_distances(q, r, outside)
    with pytest.raises(RuntimeError, match="r: expected a CPU tensor"):
        torch.ops.fullgraph_cpu.squared_distances(q, r.double(), positions)


def test_the_brute_force_ops_check_their_contract(generator):
    """select.squared_distances_all and select.nearest_within refuse bad shapes and dtypes
    by name before the extension runs (and nearest_within's NaN-valued slots mark the
    missing neighbours)."""
    if not select.available():
        pytest.skip("the C++ extension did not build here")
    q, r = torch.randn(2, 4, 3, generator=generator), torch.randn(2, 6, 3, generator=generator)
    squares = select.squared_distances_all(q, r)
    assert squares.shape == (2, 4, 6)
    with pytest.raises(ValueError, match=r"r: expected \[B, N, D\] with q's B and D"):
        select.squared_distances_all(q, r[:1])
    with pytest.raises(TypeError, match="r: expected q's dtype"):
        select.squared_distances_all(q, r.double())
    d, query_ok, ref_ok = squares.sqrt(), torch.ones(2, 4, dtype=torch.bool), torch.ones(2, 6, dtype=torch.bool)
    ref_ok[1, 2:] = False
    values, positions, counts = select.nearest_within(d, query_ok, ref_ok, torch.full((2,), float("inf")), 3)
    assert counts.tolist() == [[6] * 4, [2] * 4] and bool(values[1, :, 2].isnan().all())
    assert torch.equal(values[0], d[0].sort(-1).values[:, :3])
    with pytest.raises(ValueError, match=r"ref_ok: expected bool \[2, 6\]"):
        select.nearest_within(d, query_ok, ref_ok[:, :5], torch.zeros(2), 3)
    with pytest.raises(ValueError, match=r"within: expected \[2\] of d's dtype"):
        select.nearest_within(d, query_ok, ref_ok, torch.zeros(2, dtype=torch.float64), 3)
    with pytest.raises(ValueError, match="take: expected an int from 0 to 6"):
        select.nearest_within(d, query_ok, ref_ok, torch.zeros(2), 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_products_biased_in_the_selection_equal_the_biased_products(dtype, generator):
    """smallest_of_products(p, bias) is smallest(bias - 2 p), each value rounded once."""
    p = torch.randn(3, 70, 300, generator=generator, dtype=dtype) * 10
    bias = torch.randn(3, 300, generator=generator, dtype=dtype) ** 2
    bias[1, ::4] = bias[1, 1::4]  # ties
    for take in (1, 24, 150, 300):
        got = select.smallest_of_products(p, bias, take)
        want = stable_smallest(bias[:, None, :] - 2 * p, take)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), take


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lists_ordered_in_cpp_equal_pairs_order_by_distance(dtype, generator):
    """select.order_by_distance orders complete lists as pairs.order_by_distance does: by
    distance, ties (duplicates, zeros) to the smaller position."""
    from fullgraph.ops.neighbors import pairs

    for width in (1, 7, 24, 100, 200):
        d = torch.randint(0, 6, (2, 30, width), generator=generator).to(dtype) / 3  # ties and zeros
        d[0] = torch.rand(30, width, generator=generator, dtype=dtype)
        positions = torch.stack([torch.randperm(1000, generator=generator)[:width] for _ in range(60)])
        positions = positions.reshape(2, 30, width)
        got = select.order_by_distance(d, positions)
        want = pairs.order_by_distance(d, positions)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), width
        for keep in {0, 1, width // 2, width}:  # the first ``keep`` alone, contiguous
            got = select.order_by_distance(d, positions, keep=keep)
            assert got[0].is_contiguous() and got[1].is_contiguous()
            assert torch.equal(got[0], want[0][..., :keep]) and torch.equal(got[1], want[1][..., :keep]), keep
    with pytest.raises(ValueError, match=r"keep: expected an int from 0 to 200 \(the lists' length\), got 201"):
        select.order_by_distance(d, positions, keep=201)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bounded_measures_leave_out_only_candidates_beyond_the_least(dtype, generator):
    """With floors, a row's candidates from the first whose floor lies above the largest of its
    first ``least`` squared distances stay +inf; every other one is measured, bit for bit."""
    q = torch.randn(2, 50, 33, generator=generator, dtype=dtype)
    r = torch.randn(2, 80, 33, generator=generator, dtype=dtype)
    r[:, 40:] = r[:, :40]  # duplicates: equal distances
    candidates = torch.stack([torch.randperm(80, generator=generator)[:20] for _ in range(100)]).reshape(2, 50, 20)
    exact = select.squared_distances(q, r, candidates)
    floors = exact.sort(-1).values * 0.999  # ascending, each under a distance
    for least in (1, 5, 20):
        got = select.squared_distances(q, r, candidates, floors, least)
        measured = torch.isfinite(got)
        assert torch.equal(got[measured], exact[measured])
        assert bool(measured[..., :least].all())
        largest = exact[..., :least].amax(-1, keepdim=True)
        first_left = (~measured).int().argmax(-1, keepdim=True)
        left = ~measured.all(-1, keepdim=True)
        assert bool((floors.gather(-1, first_left) > largest)[left].all())
        assert bool((floors <= largest * (1 + 2**-17))[measured & (torch.arange(20) >= least)].all())
        assert bool(left.any()) or least == 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dim", [3, 16, 200])
@pytest.mark.parametrize("case", ["normal", "duplicates", "near-ties", "non-finite", "far", "tiny"])
def test_plain_lists_in_one_call_are_the_references_or_refused(case, dim, dtype, generator):
    """``plain_nearest`` (the dense backend's small CPU calls in one C++ call): the reference's
    lists bit for bit where it answers; None where a point is not finite or an item would be
    scaled (far, tiny), and where a row is left unproven (references a few ulps apart: their
    distances tie within the products' error)."""
    if not select.available():
        pytest.skip("the C++ extension did not build here")
    query = torch.randn(2, 30, dim, generator=generator, dtype=dtype)
    ref = torch.randn(2, 60, dim, generator=generator, dtype=dtype)
    if case == "duplicates":  # (each reference twice: ties within the slack)
        ref[:, 1::2] = ref[:, 0::2]
        query[:, 0] = ref[:, 3]
    elif case == "near-ties":
        ref = torch.ones_like(ref) + torch.randint(0, 4, (2, 60, 1), generator=generator).to(dtype) * torch.finfo(dtype).eps
        query = torch.zeros_like(query)
    elif case == "non-finite":
        ref[1, 5, 0] = math.nan
    elif case == "far":
        query, ref = query * 1e30, ref * 1e30
    elif case == "tiny":
        query, ref = query * 1e-35, ref * 1e-35
    u = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    for k in (1, 5, 20):
        found = select.plain_nearest(query, ref, k, k + 8, u)
        if case in ("non-finite", "far", "tiny", "near-ties"):
            assert found is None, k
            continue
        want = fullgraph.knn(query, ref, k, backend="torch")
        assert torch.equal(found[0], want[0]) and torch.equal(found[1], want[1]), k
    with pytest.raises(ValueError, match=r"k, take: expected 1 <= k <= take <= 60 \(the references\), got 5, 61"):
        select.plain_nearest(query, ref, 5, 61, u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dim", [4, 12, 40])  # one coordinate at a time; halving sums
@pytest.mark.parametrize("case", ["normal", "non-finite", "far", "tiny", "duplicates", "offset", "near-ties",
                                  "no queries"])
def test_small_items_in_one_call_equal_the_reference(case, dim, dtype, generator):
    """``nearest_small`` (the CPU brute force of plain kNN in one C++ call): the reference's
    lists bit for bit, non-finite points left out, far and tiny items scaled, ties by index
    (duplicates, and distances a few ulps apart), clouds far from the origin, lists longer
    than the references padded by the backend."""
    if not select.available():
        pytest.skip("the C++ extension did not build here")
    query = torch.randn(3, 0 if case == "no queries" else 40, dim, generator=generator, dtype=dtype)
    ref = torch.randn(3, 30, dim, generator=generator, dtype=dtype)
    if case == "offset":
        query, ref = query + 1e3, ref + 1e3
    elif case == "near-ties":  # references a few ulps apart along one axis, queries at the origin
        ref = torch.zeros_like(ref)
        ref[..., 0] = 1 + torch.randint(0, 4, (3, 30), generator=generator).to(dtype) * torch.finfo(dtype).eps
        query = torch.zeros_like(query)
    if case == "non-finite":
        query[0, 3, 1], query[1, 0, 0], ref[0, 2, 3], ref[2, :, 0] = math.nan, math.inf, -math.inf, math.nan
    elif case == "far":
        query, ref = query * 1e30, ref * 1e30
    elif case == "tiny":
        query, ref = query * 1e-35, ref * 1e-35
    elif case == "duplicates":
        ref[:, 1::2] = ref[:, :1]
    for k in (1, 7, 30, 45):
        got = fullgraph.knn(query, ref, k, backend="cpu")
        want = fullgraph.knn(query, ref, k, backend="torch")
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), k
    dists, positions, counts = select.nearest_small(query, ref, 7)
    assert torch.equal(counts, (ref.isfinite().all(-1)[:, None, :] & query.isfinite().all(-1)[..., None]).sum(-1))
    with pytest.raises(ValueError, match="take: expected an int from 0 to 30"):
        select.nearest_small(query, ref, 31)


def test_calls_on_shared_cores_run_on_one_thread(monkeypatch, generator):
    """A CPU call that got less than CONTENDED_SHARE of a core per thread sends the following
    ones to one thread (torch's count restored after each), until FREE_CALLS got a whole core."""
    from fullgraph.ops.neighbors.cpu import backend as cpu_backend, threads

    query, ref = torch.randn(2, 30, 8, generator=generator), torch.randn(2, 40, 8, generator=generator)
    want = fullgraph.knn(query, ref, 4, backend="torch")
    monkeypatch.setattr(threads, "_CORES", threads._Cores())
    monkeypatch.setattr(cpu_backend, "TINY_MAX_WORK", 0)  # (tiny calls are never judged)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    share = [0.6]  # the process's CPU seconds per wall second in a call
    clock = {"wall": 0.0, "cpu": 0.0}

    def read(name, step):  # each reading 10 ms after the last
        clock[name] += step()
        return clock[name]

    monkeypatch.setattr(threads, "_clocks", (lambda: read("wall", lambda: 0.01),
                                             lambda: read("cpu", lambda: 0.01 * share[0])))

    def call():
        got = fullgraph.knn(query, ref, 4)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])

    call()  # on 2 threads, 0.3 of a core each: shared
    assert threads.shared() and set_to == []
    share[0] = 1.0
    for _ in range(threads.FREE_CALLS):
        call()
    assert set_to == [1, 2] * threads.FREE_CALLS and not threads.shared()
    share[0] = 0.1
    with threads.fitted(torch.empty(0, device="meta")):  # not a CPU call: never judged
        pass
    assert not threads.shared()


def test_operators_of_compiled_graphs_judge_shared_cores_themselves(generator):
    """The C++ operators a compiled graph calls directly (outside ``threads.fitted``) judge the
    cores by its rule and constants (``csrc/cores.h``): runs of calls of JUDGED_RUN_SECONDS
    together; below CONTENDED_SHARE of a core per thread the following calls run on one thread
    (torch's count restored after each), until FREE_CALLS runs got a whole core."""
    from fullgraph.ops.neighbors.cpu import threads

    if not select.available():
        pytest.skip("needs the C++ extension")
    judge, least = torch.ops.fullgraph_cpu.cores_shared, threads.JUDGED_RUN_SECONDS
    for _ in range(2 * threads.FREE_CALLS):  # (whatever earlier calls left, a busy host's among them: free)
        if not judge(least, least, 1):
            break
    assert not judge(0.0, 0.0, 2)
    for _ in range(3):  # a run shorter than JUDGED_RUN_SECONDS is not judged
        assert not judge(least / 4, least / 4 * 0.6, 2)
    assert judge(least / 4, least / 4 * 0.6, 2)  # 0.3 of a core a thread
    for _ in range(threads.FREE_CALLS - 1):
        assert judge(least, least * 0.95, 1)
    assert not judge(least, least * 0.95, 1)
    assert not judge(least, least * 1.5, 2)
    # A real call while shared (its own sample joins the next run: not counted here)
    assert judge(least, least * 0.6, 2)
    query, ref = torch.randn(2, 30, 8, generator=generator), torch.randn(2, 40, 8, generator=generator)
    before = torch.get_num_threads()
    got = select.nearest_small(query, ref, 5)
    assert torch.get_num_threads() == before and judge(0.0, 0.0, 2)
    want = fullgraph.knn(query, ref, 5, backend="torch")
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    for _ in range(2 * threads.FREE_CALLS):  # (the later tests' calls: free again)
        if not judge(least, least, 1):
            break
