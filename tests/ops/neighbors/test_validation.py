"""Every bad input gets a clear error, before any kernel runs."""

from __future__ import annotations

import math

import pytest
import torch

import fullgraph

Q, R, F = torch.rand(5, 3), torch.rand(9, 3), torch.rand(9, 2)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: fullgraph.knn(Q, R.double(), 2), TypeError, "ref: expected torch.float32 like query, got torch.float64"),
        (lambda: fullgraph.knn(Q.long(), R.long(), 2), TypeError, "query: expected a floating-point tensor, got torch.int64"),
        (lambda: fullgraph.knn(Q.tolist(), R, 2), TypeError, "query: expected a torch.Tensor, got list"),
        (lambda: fullgraph.knn(Q, R[:, :2], 2), ValueError, "ref: expected D = 3 coordinates like query, got shape (9, 2)"),
        (lambda: fullgraph.knn(Q, R[None], 2), ValueError, "ref: expected shape [N, D] like query, got 3 dimensions"),
        (lambda: fullgraph.knn(Q[0], R, 2), ValueError, "query: expected shape [M, D] or [B, M, D], got 1 dimensions (3,)"),
        (lambda: fullgraph.knn(Q[:, :0], R[:, :0], 2), ValueError, "query: expected at least one coordinate"),
        (lambda: fullgraph.knn(Q, R, 0), ValueError, "k: expected an int >= 1, got 0"),
        (lambda: fullgraph.knn(Q, R, 2.0), TypeError, "k: expected an int, got float 2.0"),
        (lambda: fullgraph.knn(Q, R, True), TypeError, "k: expected an int, got bool"),
        (lambda: fullgraph.knn(Q, R, 2, backend="gpu"), ValueError, "backend: expected one of"),
        (lambda: fullgraph.knn(Q[None], R[None].expand(2, 9, 3), 2), ValueError, "ref: expected batch size 1"),
        (lambda: fullgraph.knn(Q, R, 2, query_lengths=torch.tensor([5])), ValueError, "query_lengths: only for batched"),
        (lambda: fullgraph.knn(Q[None], R[None], 2, ref_lengths=torch.tensor([10])), ValueError,
         "ref_lengths: expected values in [0, 9], got values in [10, 10]"),
        (lambda: fullgraph.knn(Q[None], R[None], 2, ref_lengths=torch.tensor([-1])), ValueError, "ref_lengths: expected values in"),
        (lambda: fullgraph.knn(Q[None], R[None], 2, query_lengths=torch.tensor([2, 3])), ValueError,
         "query_lengths: expected shape (1,), got (2,)"),
        (lambda: fullgraph.knn(Q[None], R[None], 2, query_lengths=torch.tensor([2.0])), TypeError,
         "query_lengths: expected an int64 tensor, got torch.float32"),
        (lambda: fullgraph.radius(Q, R, -0.1, 4), ValueError, "radius: expected a finite float >= 0.0, got -0.1"),
        (lambda: fullgraph.radius(Q, R, math.inf, 4), ValueError, "radius: expected a finite float >= 0.0, got inf"),
        (lambda: fullgraph.radius(Q, R, math.nan, 4), ValueError, "radius: expected a finite float"),
        (lambda: fullgraph.radius(Q, R, 0.1, 0), ValueError, "max_neighbors: expected an int >= 1, got 0"),
        (lambda: fullgraph.knn_aggregate(Q, R, F, 2, sigma=0.0), ValueError, "sigma: expected a finite float > 0.0, got 0.0"),
        (lambda: fullgraph.knn_aggregate(Q, R, F, 2, sigma=-1), ValueError, "sigma: expected a finite float > 0.0"),
        (lambda: fullgraph.radius_aggregate(Q, R, F[:8], 0.1), ValueError,
         "features: expected one row per reference point, (9,), got shape (8, 2)"),
        (lambda: fullgraph.radius_aggregate(Q, R, F[:, 0], 0.1), ValueError, "features: expected shape [N, C]"),
        (lambda: fullgraph.knn_aggregate(Q, R, F.double(), 2), TypeError, "features: expected torch.float32 like ref"),
        (lambda: fullgraph.knn_aggregate(Q, R, F.int(), 2), TypeError, "features: expected a floating-point tensor"),
    ],
)
def test_bad_input(call, error, message):
    with pytest.raises(error) as caught:
        call()
    assert message in str(caught.value)


def test_mixed_devices():
    meta = torch.rand(9, 3, device="meta")
    with pytest.raises(ValueError, match="ref: expected a tensor on cpu like query, got meta"):
        fullgraph.knn(Q, meta, 2)


def test_cpu_backend_needs_cpu_tensors():
    with pytest.raises(ValueError, match='backend: "cpu" needs CPU tensors, got tensors on meta'):
        fullgraph.knn(torch.rand(5, 3, device="meta"), torch.rand(9, 3, device="meta"), 2, backend="cpu")
