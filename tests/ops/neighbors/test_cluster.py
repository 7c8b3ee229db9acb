"""The torch_cluster / PyG / PyTorch3D vocabulary: batch vectors, graph builders, ball query."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fullgraph
from conftest import DEVICES, backend_cases, oracle_distances, oracle_nearest, points


def _flat_clouds(generator, sizes=(7, 0, 12, 5), dim=3):
    """Concatenated clouds with a sorted batch vector (an empty item included)."""
    points = torch.rand(sum(sizes), dim, generator=generator, dtype=torch.float64)
    batch = torch.cat([torch.full((n,), b, dtype=torch.int64) for b, n in enumerate(sizes)])
    return points, batch


def _oracle_lists(query, batch_query, ref, batch_ref, k, radius=math.inf):
    """Per query: global indices of its k nearest refs of the same item (float64)."""
    out = []
    for row in range(query.shape[0]):
        same = (batch_ref == batch_query[row]).nonzero()[:, 0]
        d = oracle_distances(query[row:row + 1], ref[same])
        _, idx, _ = oracle_nearest(d, k, radius)
        out.append([int(same[j]) for j in idx[0] if j >= 0])
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_batch_vectors_equal_per_item_searches(device, generator):
    ref, batch_ref = _flat_clouds(generator)
    query, batch_query = _flat_clouds(generator, sizes=(3, 4, 6, 2))
    features = torch.randn(ref.shape[0], 2, generator=generator, dtype=torch.float64)
    moved = [t.to(device) for t in (query, ref, features, batch_query, batch_ref)]
    kw = dict(batch_query=moved[3], batch_ref=moved[4])
    dists, idx = fullgraph.knn(moved[0], moved[1], 4, **kw)
    want = _oracle_lists(query, batch_query, ref, batch_ref, 4)
    assert [[int(j) for j in row if j >= 0] for row in idx.cpu()] == want
    dists, idx, counts = fullgraph.radius(moved[0], moved[1], 0.5, 3, **kw)
    assert [[int(j) for j in row if j >= 0] for row in idx.cpu()] == _oracle_lists(
        query, batch_query, ref, batch_ref, 3, 0.5)
    # Aggregations equal the padded call on each item alone.
    out = fullgraph.knn_aggregate(moved[0], moved[1], moved[2], 3, **kw)
    for item in range(4):
        rows, cols = batch_query == item, batch_ref == item
        if rows.any():
            alone = fullgraph.knn_aggregate(query[rows].to(device), ref[cols].to(device), features[cols].to(device), 3)
            torch.testing.assert_close(out[rows.to(device)], alone)
    assert fullgraph.radius_aggregate(moved[0], moved[1], moved[2], 0.5, **kw).shape == (query.shape[0], 2)


def test_batch_vectors_are_checked():
    x = torch.rand(6, 3)
    with pytest.raises(ValueError, match="batch_ref: expected a sorted batch vector"):
        fullgraph.knn(x, x, 2, batch_query=torch.tensor([0, 0, 0, 1, 1, 1]), batch_ref=torch.tensor([1, 0, 0, 1, 1, 1]))
    with pytest.raises(TypeError, match="batch_query: expected an int64 batch vector, got torch.int32"):
        fullgraph.knn(x, x, 2, batch_query=torch.zeros(6, dtype=torch.int32), batch_ref=torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"batch_query: expected shape \(6,\)"):
        fullgraph.knn(x, x, 2, batch_query=torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="pass batch vectors or lengths, not both"):
        fullgraph.knn(x[None], x[None], 2, batch_query=torch.zeros(6, dtype=torch.int64),
                      query_lengths=torch.tensor([6]))


def _oracle_graph(x, batch, k, loop):
    """torch_cluster.knn_graph's edges (source_to_target: [neighbour, point]) from float64 lists."""
    edges = set()
    for i, row in enumerate(_oracle_lists(x, batch, x, batch, k if loop else k + 1)):
        for j in row:
            if loop or j != i:
                edges.add((j, i))
    return edges


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loop", [False, True])
def test_knn_graph_like_torch_cluster(device, loop, generator):
    x, batch = _flat_clouds(generator)
    edge_index = fullgraph.knn_graph(x.to(device), 3, batch.to(device), loop=loop)
    assert edge_index.dtype == torch.int64 and edge_index.shape[0] == 2
    assert set(map(tuple, edge_index.t().tolist())) == _oracle_graph(x, batch, 3, loop)
    flipped = fullgraph.knn_graph(x.to(device), 3, batch.to(device), loop=loop, flow="target_to_source")
    assert torch.equal(flipped, edge_index.flip(0))


@pytest.mark.parametrize("backend, device", backend_cases())
@pytest.mark.parametrize("distribution", ["duplicates", "grid", "uniform"])
def test_knn_graph_lists_edges_in_order_with_crowded_duplicates(backend, device, distribution, generator):
    """Edges by point, then distance, equal to the k + 1 nearest without the point itself,
    also where more than k + 1 copies of a point precede it (it then keeps k + 1 others)."""
    x = points(distribution, 40, 3, generator).float()
    x[10:17] = x[3]  # eight copies of point 3: copies 5..8 have k + 1 = 4 copies of smaller index ahead
    batch = torch.tensor([0] * 25 + [2] * 15)
    edge_index = fullgraph.knn_graph(x.to(device), 3, batch.to(device), backend=backend)
    want = [(j, i) for i, row in enumerate(_oracle_lists(x.double(), batch, x.double(), batch, 4))
            for j in row if j != i]
    assert list(map(tuple, edge_index.t().tolist())) == want
    assert sum(1 for j, i in want if i == 16) == 4  # a crowded copy keeps k + 1 edges


@pytest.mark.parametrize("device", DEVICES)
def test_radius_graph_and_bipartite_edges(device, generator):
    x, batch = _flat_clouds(generator)
    edge_index = fullgraph.radius_graph(x.to(device), 0.45, batch.to(device), max_num_neighbors=4)
    want = set()
    for i, row in enumerate(_oracle_lists(x, batch, x, batch, 5, 0.45)):
        want |= {(j, i) for j in row if j != i}
    assert set(map(tuple, edge_index.t().tolist())) == want
    # torch_cluster.knn(x, y, k): neighbours in x of each point of y, rows index y.
    y, batch_y = _flat_clouds(generator, sizes=(2, 3, 1, 4))
    edges = fullgraph.knn_edges(x.to(device), y.to(device), 2, batch.to(device), batch_y.to(device))
    lists = _oracle_lists(y, batch_y, x, batch, 2)
    assert set(map(tuple, edges.t().tolist())) == {(i, j) for i, row in enumerate(lists) for j in row}
    edges = fullgraph.radius_edges(x.to(device), y.to(device), 0.4, batch.to(device), batch_y.to(device),
                                   max_num_neighbors=8)
    lists = _oracle_lists(y, batch_y, x, batch, 8, 0.4)
    assert set(map(tuple, edges.t().tolist())) == {(i, j) for i, row in enumerate(lists) for j in row}


@pytest.mark.slow
def test_graph_builders_compile_without_a_graph_break(generator):
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def build(x, batch):
        return fullgraph.knn_graph(x, 4, batch), fullgraph.radius_graph(x, 0.3, batch)

    compiled = torch.compile(build, backend=counter, fullgraph=True, dynamic=True)
    for sizes in ((7, 9), (20, 3, 11), (5, 6)):
        x, batch = _flat_clouds(generator, sizes)
        x = x.float()
        for got, want in zip(compiled(x, batch), build(x, batch)):
            assert torch.equal(got, want)
    assert counter.frame_count == 1


def _naive_ball_query(p1, p2, K, radius):
    """PyTorch3D's definition: the first K indices of p2 within the radius, float64."""
    d = oracle_distances(p1, p2)
    idx = np.full((p1.shape[0], K), -1)
    for i in range(p1.shape[0]):
        inside = np.nonzero(d[i] <= radius)[0][:K]
        idx[i, :len(inside)] = inside
    return idx


@pytest.mark.parametrize("device", DEVICES)
def test_ball_query_first_and_nearest(device, generator):
    p1 = torch.rand(2, 30, 3, generator=generator, dtype=torch.float64)
    p2 = torch.rand(2, 60, 3, generator=generator, dtype=torch.float64)
    lengths2 = torch.tensor([60, 41])
    dists, idx, nn = fullgraph.ball_query(p1.to(device), p2.to(device), lengths2=lengths2.to(device), K=5,
                                          radius=0.3)
    for b in range(2):
        want = _naive_ball_query(p1[b], p2[b, :int(lengths2[b])], 5, 0.3)
        np.testing.assert_array_equal(idx[b].cpu().numpy(), want)
    found = idx >= 0
    torch.testing.assert_close(nn[found].cpu(), p2[torch.nonzero(found)[:, 0].cpu(), idx[found].cpu()])
    true = ((p1[:, :, None] - nn.cpu()) ** 2).sum(-1)
    torch.testing.assert_close(dists.cpu(), torch.where(found.cpu(), true, 0))
    near_d, near_idx, _ = fullgraph.ball_query(p1.to(device), p2.to(device), lengths2=lengths2.to(device), K=5,
                                               radius=0.3, order="nearest")
    _, want_idx, _ = fullgraph.radius(p1, p2, 0.3, 5, ref_lengths=lengths2, backend="torch")
    assert torch.equal(near_idx.cpu(), want_idx)


def test_ball_query_with_no_points_to_search():
    dists, idx, nn = fullgraph.ball_query(torch.rand(1, 5, 3), torch.rand(1, 0, 3), K=4)
    assert bool((idx == -1).all()) and bool((dists == 0).all()) and nn.shape == (1, 5, 4, 3)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["first", "nearest"])
def test_ball_query_compiles_with_a_symbolic_radius(order, generator):
    p1, p2 = torch.rand(1, 5, 3, generator=generator), torch.rand(1, 40, 3, generator=generator)
    compiled = torch.compile(lambda a, b, r: fullgraph.ball_query(a, b, K=4, radius=r, order=order)[1],
                             fullgraph=True, dynamic=True)
    for radius in (0.3, 0.5):
        assert torch.equal(compiled(p1, p2, radius), fullgraph.ball_query(p1, p2, K=4, radius=radius, order=order)[1])


def test_ball_query_gradients_and_errors(generator):
    p1 = torch.rand(1, 6, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    p2 = torch.rand(1, 15, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: fullgraph.ball_query(a, b, K=4, radius=0.6)[0], (p1, p2))
    with pytest.raises(ValueError, match="K: expected an int >= 1, got 0"):
        fullgraph.ball_query(p1, p2, K=0)
    with pytest.raises(ValueError, match="order: expected one of"):
        fullgraph.ball_query(p1, p2, order="random")
    with pytest.raises(ValueError, match="radius: expected a finite float >= 0"):
        fullgraph.ball_query(p1, p2, radius=-1.0)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["knn", "radius", "knn_aggregate", "radius_aggregate", "fps_ratio", "fps_batch",
                                  "fps_random"])
def test_batch_vector_forms_compile_once_for_all_sizes(form, generator):
    from torch._dynamo.testing import CompileCounter

    calls = {
        "knn": lambda x, f, b: fullgraph.knn(x, x, 3, batch_query=b, batch_ref=b),
        "radius": lambda x, f, b: fullgraph.radius(x, x, 0.4, 5, batch_query=b, batch_ref=b),
        "knn_aggregate": lambda x, f, b: fullgraph.knn_aggregate(x, x, f, 3, batch_query=b, batch_ref=b),
        "radius_aggregate": lambda x, f, b: fullgraph.radius_aggregate(x, x, f, 0.4, batch_query=b, batch_ref=b),
        "fps_ratio": lambda x, f, b: fullgraph.fps(x, 0.5, random_start=False),
        "fps_batch": lambda x, f, b: fullgraph.fps(x, 0.3, batch=b, random_start=False),
        "fps_random": lambda x, f, b: fullgraph.fps(x, 0.3, batch=b)[:0],  # random starts: compiled RNG differs
    }
    call = calls[form]
    counter = CompileCounter()
    compiled = torch.compile(call, backend=counter, fullgraph=True, dynamic=True)
    for sizes in ((7, 9), (20, 3, 11), (5, 6, 8, 2)):
        x, batch = _flat_clouds(generator, sizes)
        features = torch.randn(x.shape[0], 2, generator=generator, dtype=torch.float64)
        got, want = compiled(x, features, batch), call(x, features, batch)
        for a, b in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want))):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counter.frame_count == 1


def test_batch_vector_forms_have_gradients(generator):
    x, batch = _flat_clouds(generator, (5, 0, 6))
    y, batch_y = _flat_clouds(generator, (3, 2, 4))
    features = torch.randn(x.shape[0], 2, generator=generator, dtype=torch.float64)
    kw = dict(batch_query=batch_y, batch_ref=batch)
    for call in (lambda q, r, f: fullgraph.knn(q, r, 3, **kw)[0].nan_to_num(posinf=0.0),
                 lambda q, r, f: fullgraph.knn_aggregate(q, r, f, 3, sigma=0.3, **kw),
                 lambda q, r, f: fullgraph.radius_aggregate(q, r, f, 0.6, sigma=0.3, **kw)):
        inputs = [t.clone().requires_grad_() for t in (y, x, features)]
        assert torch.autograd.gradcheck(call, inputs)


def test_radius_graph_caps_the_others_of_tied_points():
    x = torch.full((4, 2), -1.0)  # four identical points: the point itself need not be among the tied nearest
    edges = fullgraph.radius_graph(x, r=100.0, max_num_neighbors=1)
    assert torch.unique(edges[1], return_counts=True)[1].tolist() == [1, 1, 1, 1]
    assert bool((edges[0] != edges[1]).all())


@pytest.mark.parametrize("loop", [False, True])
def test_a_cap_beyond_the_points_means_no_cap(loop, generator):
    x = torch.rand(300, 3, generator=generator)
    want = fullgraph.radius_graph(x, 0.3, loop=loop, max_num_neighbors=300)
    for cap in (1024, 5000, 2**62):
        assert torch.equal(fullgraph.radius_graph(x, 0.3, loop=loop, max_num_neighbors=cap), want)
    small = x[:10]
    assert fullgraph.radius_graph(small, 10.0, loop=loop, max_num_neighbors=1024).shape[1] == (100 if loop else 90)
    assert torch.equal(fullgraph.knn_graph(x, 5000, loop=loop), fullgraph.knn_graph(x, 300 if loop else 299, loop=loop))
