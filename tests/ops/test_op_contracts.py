"""Every torch.ops.fullgraph.* operator checks its own contract when called directly: wrong
rank, dtype, device or out-of-range arguments raise a clear error before any kernel runs."""

from __future__ import annotations

import pytest
import torch

import fullgraph  # noqa: F401  (registers the ops)
from fullgraph.ops import ddpm

ops = torch.ops.fullgraph
g = torch.Generator().manual_seed(0)
# Where Triton runs here: the GPU, or the interpreter on CPU tensors (conftest sets it).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
Q, R, F = torch.rand(2, 5, 3, generator=g), torch.rand(2, 9, 3, generator=g), torch.rand(2, 9, 4, generator=g)
LISTS = ops.knn(Q, R, 3, None, None, "torch")
OUT = ops.knn_aggregate(Q, R, F, 3, 0.2, None, None, "torch")[0]


@pytest.mark.parametrize("call, error, message", [
    (lambda: ops.knn(Q[0], R[0], 4, None, None, "cpu"), ValueError, "query: expected shape [B, M, D], got 2"),
    (lambda: ops.knn(Q, R.double(), 4, None, None, "torch"), TypeError, "ref: expected torch.float32 like query"),
    (lambda: ops.knn(Q.long(), R.long(), 4, None, None, "torch"), TypeError, "query: expected a floating-point"),
    (lambda: ops.knn(Q, R[..., :2], 4, None, None, "torch"), ValueError, "ref: expected D = 3 coordinates"),
    (lambda: ops.knn(Q, R[:1], 4, None, None, "torch"), ValueError, "ref: expected batch size 2"),
    (lambda: ops.knn(Q, R, 0, None, None, "torch"), ValueError, "k: expected an int >= 1, got 0"),
    (lambda: ops.knn(Q, R, 4, torch.tensor([5, 6]), None, "torch"), ValueError,
     "query_lengths: expected values in [0, 5], got values in [5, 6]"),
    (lambda: ops.knn(Q, R, 4, torch.tensor([5]), None, "torch"), ValueError, "query_lengths: expected shape (2,)"),
    (lambda: ops.knn(Q, R, 4, None, torch.tensor([1.0, 2.0]), "torch"), TypeError, "ref_lengths: expected an int64"),
    (lambda: ops.knn(Q, R, 4, None, None, "warp"), ValueError, '"warp" provides radius and radius_aggregate, not knn'),
    (lambda: ops.knn(Q, R, 4, None, None, "gpu"), ValueError, "backend: expected one of"),
    (lambda: ops.knn(Q.double().to(TRITON_DEVICE), R.double().to(TRITON_DEVICE), 4, None, None, "triton"),
     (TypeError, ImportError), 'backend="triton"'),
    (lambda: ops.radius(Q, R, -1.0, 4, None, None, "torch"), ValueError, "radius: expected a finite float >= 0.0"),
    (lambda: ops.farthest_points(Q, None, torch.zeros(3, dtype=torch.int64), 2, "torch"), ValueError,
     "start: expected [2] int64 indices"),
    (lambda: ops.farthest_points(Q, torch.tensor([5, 9]), torch.zeros(2, dtype=torch.int64), 2, "torch"), ValueError,
     "lengths: expected values in [0, 5]"),
    (lambda: ops.knn_edges(R[0], Q[0], 2, torch.zeros(9, dtype=torch.int64), None, False, "torch"), ValueError,
     "batch_x, batch_y: pass both batch vectors or neither"),
    (lambda: ops.knn_graph_edges(R[0], 0, None, "torch"), ValueError, "k: expected an int >= 1, got 0"),
    (lambda: ops.knn_graph_edges(R, 2, None, "torch"), ValueError, "x: expected shape [N, D]"),
    (lambda: ops.knn_graph_edges(R[0], 2, torch.zeros(8, dtype=torch.int64), "torch"), ValueError,
     "batch: expected shape (9,)"),
    (lambda: ops.radius(Q, R, 0.3, 0, None, None, "cpu"), ValueError, "max_neighbors: expected an int >= 1, got 0"),
    (lambda: ops.knn_aggregate(Q, R, F[:, :8], 3, 0.2, None, None, "torch"), ValueError,
     "features: expected one row per reference point"),
    (lambda: ops.knn_aggregate(Q, R, F, 3, 0.0, None, None, "torch"), ValueError, "sigma: expected a finite float > 0"),
    (lambda: ops.knn_aggregate(Q, R, F.double(), 3, 0.2, None, None, "torch"), TypeError,
     "features: expected torch.float32 like ref"),
    (lambda: ops.knn_aggregate(Q, R, F, 3, 0.2, None, None, "cuml"), ValueError, 'backend: "cuml" needs CUDA'),
    (lambda: ops.radius_aggregate(Q, R, F[0], 0.3, 0.2, None, None, "torch"), ValueError,
     "features: expected shape [B, N, C]"),
    (lambda: ops.radius_aggregate(Q, R, F, float("nan"), 0.2, None, None, "cpu"), ValueError, "radius: expected"),
    (lambda: ops.distances_backward(LISTS[0][:, :2], Q, R, LISTS[1], LISTS[0], "torch"), ValueError,
     "grad_dists: expected (2, 5, 3)"),
    (lambda: ops.distances_backward(LISTS[0], Q, R, LISTS[1].int(), LISTS[0], "torch"), TypeError,
     "idx: expected [B, M, k] int64"),
    (lambda: ops.distances_backward(LISTS[0], Q, R, LISTS[1] + 9, LISTS[0], "torch"), ValueError,
     "idx: expected indices in [-1, 9)"),
    (lambda: ops.distances_backward(LISTS[0], Q[:, :4], R, LISTS[1], LISTS[0], "torch"), ValueError,
     "idx: expected lists for the queries (2, 4)"),
    (lambda: ops.knn_aggregate_backward(OUT[:, :2], F, OUT, *LISTS, 0.2, "torch"), ValueError,
     "grad_out: expected (2, 5, 4)"),
    (lambda: ops.knn_aggregate_backward(OUT, F, OUT, *LISTS, -0.2, "torch"), ValueError, "sigma: expected"),
    (lambda: ops.radius_aggregate_backward(OUT[..., :2], Q, R, F, OUT, 0.3, 0.2, None, None, "torch"), ValueError,
     "grad_out: expected [B, M, C] = [2, 5, 4]"),
    (lambda: ops.radius_aggregate_backward(OUT, Q, R, F, OUT, 0.3, 0.2, None, None, "warp"), ValueError,
     'backend: "warp" needs CUDA'),
])
def test_neighbour_ops_check_their_inputs(call, error, message):
    with pytest.raises(error) as raised:
        call()
    assert message in str(raised.value)


def test_ddpm_op_checks_its_inputs():
    x = torch.randn(1, 4, 2, generator=g)
    alphas = ddpm.squaredcos_cap_v2(10)
    with pytest.raises(ValueError, match="noise: expected the shape of sample"):
        ops.ddpm_step(x, x, torch.tensor(3), alphas, x[:, :2], True, "torch")
    with pytest.raises(TypeError, match="timestep: expected a 0-d int64 tensor"):
        ops.ddpm_step(x, x, torch.tensor(3.0), alphas, x, True, "torch")
    with pytest.raises(ValueError, match="backend: expected one of"):
        ops.ddpm_step(x, x, torch.tensor(3), alphas, x, True, "cuda")
    x, t, alphas = x.double().to(TRITON_DEVICE), torch.tensor(3, device=TRITON_DEVICE), alphas.to(TRITON_DEVICE)
    with pytest.raises(TypeError, match='sample: backend="triton" computes in float32'):
        ops.ddpm_step(x, x, t, alphas.double(), x, True, "triton")
