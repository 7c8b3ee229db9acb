"""On CUDA the Triton backend is capture-safe: manual graph capture, reduce-overhead, dynamic."""

from __future__ import annotations

import pytest
import torch

import fullgraph
from conftest import assert_compiled_model_trains, points

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _step(query, ref, features):
    out = fullgraph.knn_aggregate(query, ref, features, 7) + fullgraph.radius_aggregate(query, ref, features, 0.3)
    dists, idx, counts = fullgraph.radius(query, ref, 0.3, 8)
    return out.sum(-1) + dists.masked_fill(idx < 0, 0).sum(-1) + counts


def _data(generator, rows=500, columns=2000):
    query = points("uniform", rows, 3, generator).float().cuda()
    ref = points("uniform", columns, 3, generator).float().cuda()
    features = torch.randn(columns, 6, generator=generator).cuda()
    return query, ref, features


def test_manual_capture_replays_on_new_data(generator):
    static = [t.clone() for t in _data(generator)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            _step(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _step(*static)
    for _ in range(3):
        fresh = _data(generator)
        for target, source in zip(static, fresh):
            target.copy_(source)
        graph.replay()
        torch.testing.assert_close(static_out, _step(*fresh))


def test_reduce_overhead_train_step(generator):
    query, ref, features = _data(generator)
    torch.manual_seed(0)  # the weights: Adam's first steps (each weight by ~lr) may raise a loss
    model = fullgraph.models.RadiusProjector(radius=0.3, hidden_dim=16).cuda()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    target = torch.randn(query.shape[0], 1, device="cuda")
    assert_compiled_model_trains(model, compiled, query, ref, target, steps=20, tol=1e-4)


def test_dynamic_compile_once_on_cuda(generator):
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(_step, backend=counter, fullgraph=True, dynamic=True)
    for rows, columns in [(300, 1000), (411, 1777), (50, 3000)]:
        data = _data(generator, rows, columns)
        torch.testing.assert_close(compiled(*data), _step(*data))
    assert counter.frame_count == 1


def test_auto_picks_triton_on_cuda(monkeypatch, generator):
    from fullgraph.ops.neighbors.triton import backend as triton_backend

    calls = []
    kernels = triton_backend.BACKEND.implementation
    original = kernels.nearest
    monkeypatch.setattr(kernels, "nearest", lambda *a: calls.append(1) or original(*a))
    fullgraph.knn(*_data(generator)[:2], 4)
    assert calls


@pytest.mark.parametrize("k", [65, 128, 256])
def test_lists_longer_than_triton_capture(k, generator):
    """k above Triton's limit runs on the "torch" backend, which reads nothing back to the
    host: it captures (graphed and reduce-overhead) and replays on new data."""
    from conftest import assert_neighbors, oracle_distances, oracle_nearest

    def step(query, ref, features):
        dists, idx = fullgraph.knn(query, ref, k)
        return fullgraph.knn_aggregate(query, ref, features, k).sum(-1) + dists.masked_fill(idx < 0, 0).sum(-1)

    data = _data(generator, 300, 1500)
    dists, idx = fullgraph.knn(data[0], data[1], k)
    d = oracle_distances(data[0], data[1])
    expected_dists, expected_idx, _ = oracle_nearest(d, k)
    assert_neighbors(dists, idx, expected_dists, expected_idx, d, torch.float32)
    replayed = fullgraph.graphs.graphed(step)
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        fresh = _data(generator, 300, 1500)
        want = step(*fresh)
        torch.testing.assert_close(replayed(*fresh), want)
        torch.testing.assert_close(compiled(*fresh), want)


def test_an_uncapturable_path_is_refused_before_the_capture_breaks(generator):
    from fullgraph.graphs import GraphCaptureError

    query, ref, features = _data(generator, 50, 200)
    with pytest.raises(GraphCaptureError, match='backend="torch" runs radius_aggregate'):
        fullgraph.graphs.graphed(lambda q, r, f: fullgraph.radius_aggregate(q, r, f, 0.3, backend="torch"))(
            query, ref, features)
    assert torch.isfinite(torch.randn(3, device="cuda")).all()  # the process still works


def test_a_thousand_replays_on_fresh_data_equal_eager(generator):
    replayed = fullgraph.graphs.graphed(_step)
    data = [_data(generator, 200, 800) for _ in range(8)]
    for i in range(1000):
        fresh = data[i % len(data)]
        out = replayed(*fresh)
        if i % 97 == 0 or i >= 992:
            torch.testing.assert_close(out, _step(*fresh))
    assert replayed.captures == 1


@pytest.mark.parametrize("columns", [700, 9000])  # redone by the brute force; by the Triton search
def test_feature_space_knn_replays_with_rows_that_fail_the_certificate(columns, generator):
    """auto takes "dense" for D >= 4 on CUDA: the rows its certificate cannot prove (ties
    wider than the slack) are redone inside the graph, on every replay."""
    from fullgraph.ops.neighbors.dense import backend as dense

    def tied():
        pool = points("normal", 5, 32, generator).float().cuda()
        ref = pool[torch.randint(0, 5, (columns,), generator=generator).cuda()]
        query = torch.cat([pool[torch.randint(0, 5, (30,), generator=generator).cuda()] + 0.01,
                           points("normal", 30, 32, generator).float().cuda()])
        return query, ref

    for k in (6, 100):  # 100: beyond the Triton backend's own MAX_K
        assert fullgraph.ops.neighbors.registration.BACKENDS.resolve(
            "auto", "knn", torch.device("cuda"), torch.float32, 32, k) is dense.BACKEND
        replayed = fullgraph.graphs.graphed(lambda query, ref, k=k: fullgraph.knn(query, ref, k))
        for _ in range(3):
            query, ref = tied()
            got, want = replayed(query, ref), fullgraph.knn(query, ref, k, backend="torch")
            assert torch.equal(got[1], want[1])
            torch.testing.assert_close(got[0], want[0])
        assert replayed.captures == 1


def test_feature_space_captures_refuse_float64_and_take_every_list_length(generator):
    from fullgraph.graphs import GraphCaptureError

    query, ref = (points("normal", n, 16, generator).cuda() for n in (20, 300))
    with pytest.raises(GraphCaptureError, match=r'backend="dense" runs knn \(float64, D = 16, lists of 6\)'):
        fullgraph.graphs.graphed(lambda q, r: fullgraph.knn(q, r, 6, backend="dense"))(query, ref)
    assert torch.isfinite(torch.randn(3, device="cuda")).all()
    # (float32 lists of every length are captured: beyond 256 on the products path)
    got = fullgraph.graphs.graphed(lambda q, r: fullgraph.knn(q, r, 257, backend="dense"))(query.float(), ref.float())
    want = fullgraph.knn(query.float(), ref.float(), 257, backend="torch")
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_wide_points_capture_in_a_fresh_process_after_the_usual_warm_up():
    """Eagerly wide points (D > 128) take no cuBLAS product, a capture of the same call does:
    the eager warm-up makes cuBLAS's handle, which cannot be made while capturing (a fresh
    process, where nothing else made it)."""
    import subprocess
    import sys

    script = """
import torch, fullgraph
q, r = torch.randn(2, 300, 256, device="cuda"), torch.randn(2, 900, 256, device="cuda")
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    want = fullgraph.knn(q, r, 9)
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    got = fullgraph.knn(q, r, 9)
graph.replay()
assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("dim", [64, 256])
def test_small_eager_calls_replay_from_a_graph_once_their_signature_comes_back(dim, monkeypatch):
    """A small call seen REPLAY_AFTER times is captured once and replayed after, with new points
    and lengths each call, on the current stream: the reference's lists every time, each
    output a fresh tensor; a signature whose capture fails runs eagerly from then on."""
    from fullgraph import graphs
    from fullgraph.ops.neighbors.dense import backend as dense
    from fullgraph.ops.neighbors.dense import replays

    generator = torch.Generator(device="cuda").manual_seed(dim)
    captures = dense._REPLAYS.captures
    outputs = []
    for call in range(replays.REPLAY_AFTER + 2):
        query = torch.randn(6, 200, dim, device="cuda", generator=generator)
        ref = torch.randn(6, 300, dim, device="cuda", generator=generator)
        lengths = torch.tensor([200, 17, 0, 200, 3, 150], device="cuda").roll(call)
        got = fullgraph.knn(query, ref, 12, ref_lengths=lengths)
        want = fullgraph.knn(query, ref, 12, ref_lengths=lengths, backend="torch")
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
        outputs.append(got[1])
    assert dense._REPLAYS.captures == captures + 1
    assert len({t.data_ptr() for t in outputs}) == len(outputs)

    def refuse(*args, **kwargs):
        raise graphs.GraphCaptureError("refused")

    monkeypatch.setattr(graphs, "capture", refuse)
    query = torch.randn(2, 100, dim, device="cuda", generator=generator)
    for _ in range(replays.REPLAY_AFTER + 1):
        got = fullgraph.knn(query, query, 5)
        assert torch.equal(got[1], fullgraph.knn(query, query, 5, backend="torch")[1])
    assert any(key[0] == ((2, 100, dim), torch.float32) for key in dense._REPLAYS._refused)
