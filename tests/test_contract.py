"""One error contract: every public function refuses bad input with the same exception type
and message eagerly and under torch.compile(fullgraph=True, dynamic=True)."""

from __future__ import annotations

import pytest
import torch

import fullgraph
from fullgraph.ops.ddpm import squaredcos_cap_v2

g = torch.Generator().manual_seed(0)
X, X3 = torch.rand(30, 3, generator=g), torch.rand(2, 30, 3, generator=g)
S, T, PREV, ALPHAS = torch.randn(2, 4, generator=g), torch.tensor(50), torch.tensor(40), squaredcos_cap_v2(100)
W, B, GAMMA, BETA, XC = (torch.rand(8, 4, 3, generator=g), torch.rand(8, generator=g), torch.rand(8, generator=g),
                         torch.rand(8, generator=g), torch.rand(2, 4, 16, generator=g))
INPUT, WEIGHTS, BIAS, H, C = (torch.rand(4, 5, generator=g), torch.rand(18, 11, generator=g), torch.rand(18, generator=g),
                              torch.rand(4, 6, generator=g), torch.rand(4, 6, generator=g))

CASES = {
    "knn k=0": lambda x: fullgraph.knn(x, x, 0),
    "knn int points": lambda x: fullgraph.knn(x.int(), x.int(), 2),
    "radius < 0": lambda x: fullgraph.radius(x, x, -1.0, 4),
    "knn_aggregate features": lambda x: fullgraph.knn_aggregate(x, x, x[:4], 3),
    "fps ratio > 1": lambda x: fullgraph.fps(x, 2.0),
    "fps n_samples 0": lambda x: fullgraph.fps(X3, n_samples=0),
    "fps random_start": lambda x: fullgraph.fps(X3, n_samples=3, random_start="no"),
    "fps both": lambda x: fullgraph.fps(x, 0.5, n_samples=3),
    "ball_query K=0": lambda x: fullgraph.ball_query(X3, X3, K=0),
    "ball_query radius": lambda x: fullgraph.ball_query(X3, X3, radius=-1.0),
    "ball_query order": lambda x: fullgraph.ball_query(X3, X3, order="zz"),
    "ball_query 2-D": lambda x: fullgraph.ball_query(x, x),
    "knn_graph k=0": lambda x: fullgraph.knn_graph(x, 0),
    "knn_graph flow": lambda x: fullgraph.knn_graph(x, 3, flow="zz"),
    "radius_graph cap": lambda x: fullgraph.radius_graph(x, 0.2, max_num_neighbors=0),
    "radius_graph r": lambda x: fullgraph.radius_graph(x, -1.0),
    "knn_edges k": lambda x: fullgraph.knn_edges(x, x, 0),
    "knn_gather idx >= N": lambda x: fullgraph.knn_gather(x, torch.full((4, 2), 30)),
    "knn_gather idx < -1": lambda x: fullgraph.knn_gather(x, torch.full((4, 2), -5)),
    "knn_gather int32": lambda x: fullgraph.knn_gather(x, torch.zeros(4, 2, dtype=torch.int32)),
    "voxel_grid size": lambda x: fullgraph.voxel_grid(x, -1.0),
    "voxel_grid end < start": lambda x: fullgraph.voxel_grid(x, 0.1, None, 1.0, 0.0),
    "kmeans_assign width": lambda x: fullgraph.kmeans_assign(x, torch.rand(4, 2)),
    "kmeans_assign int": lambda x: fullgraph.kmeans_assign(x.int(), torch.rand(4, 3)),
    "ddpm shape": lambda x: fullgraph.ddpm_step(S[:1], S, T, ALPHAS, S),
    "ddpm timestep int32": lambda x: fullgraph.ddpm_step(S, S, T.int(), ALPHAS, S),
    "ddpm noise None": lambda x: fullgraph.ddpm_step(S, S, T, ALPHAS, None),
    "ddim prediction_type": lambda x: fullgraph.ddim_step(S, S, T, PREV, ALPHAS, prediction_type="v"),
    "ddim eta < 0": lambda x: fullgraph.ddim_step(S, S, T, PREV, ALPHAS, eta=-1.0),
    "ddim prev None": lambda x: fullgraph.ddim_step(S, S, T, None, ALPHAS),
    "ddim noise for eta": lambda x: fullgraph.ddim_step(S, S, T, PREV, ALPHAS, eta=0.5),
    "conv block groups": lambda x: fullgraph.conv_groupnorm_mish(XC, W, B, GAMMA, BETA, 3),
    "conv block channels": lambda x: fullgraph.conv_groupnorm_mish(XC[:, :3], W, B, GAMMA, BETA, 2),
    "narrow_mlp widths": lambda x: fullgraph.narrow_mlp(x, [torch.rand(5, 4)], [torch.rand(5)]),
    "lltm weights": lambda x: fullgraph.lltm(INPUT, WEIGHTS[:, :10], BIAS, H, C),
    "lltm backend": lambda x: fullgraph.lltm(INPUT, WEIGHTS, BIAS, H, C, backend="zz"),
}


def _raised(fn, *args) -> BaseException:
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001 - the exception itself is what the test compares
        return error
    raise AssertionError("no exception")


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_the_same_refusal_compiled_or_not(name):
    call = CASES[name]
    eager = _raised(call, X)
    assert type(eager) in (TypeError, ValueError), repr(eager)
    torch._dynamo.reset()
    compiled = _raised(torch.compile(call, fullgraph=True, dynamic=True), X)
    assert (type(compiled), str(compiled)) == (type(eager), str(eager))


@pytest.mark.slow
def test_valid_calls_with_keyword_arguments_compile_unchanged():
    """Arguments given by keyword (None among them) reach the check as given: nothing is refused."""
    x = torch.randn(2, 4, 16, generator=g)
    shift = torch.rand(2, 8, generator=g)
    call = lambda x: fullgraph.conv_groupnorm_mish(x, W, B, GAMMA, BETA, 2, eps=1e-5, scale=None, shift=shift)  # noqa: E731
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(call, fullgraph=True, dynamic=True)(x), call(x))
