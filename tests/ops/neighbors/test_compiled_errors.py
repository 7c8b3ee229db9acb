"""Under torch.compile(fullgraph=True) bad input raises the documented ValueError / TypeError
(from the operators, when the graph runs), not a compiler error."""

from __future__ import annotations

import pytest
import torch

import fullgraph

Q, R, F = torch.rand(2, 5, 3), torch.rand(2, 9, 3), torch.rand(2, 9, 2)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=True)


@pytest.mark.slow
@pytest.mark.parametrize("call, args, error, message", [
    (lambda q, r: fullgraph.knn(q, r, 3), (Q, R[..., :2]), ValueError, "ref: expected D = 3 coordinates like query"),
    (lambda q, r: fullgraph.knn(q, r, 3, ref_lengths=torch.tensor([-4, 99])), (Q, R), ValueError,
     "ref_lengths: expected values in [0, 9], got values in [-4, 99]"),
    (lambda q, r: fullgraph.knn(q, r, 0), (Q, R), ValueError, "k: expected an int >= 1, got 0"),
    (lambda q, r: fullgraph.knn(q, r, 3, backend="warp"), (Q, R), ValueError,
     '"warp" provides radius and radius_aggregate, not knn'),
    (lambda q, r: fullgraph.radius(q, r, -1.0, 4), (Q, R), ValueError, "radius: expected a finite float >= 0.0"),
    (lambda q, r: fullgraph.knn(q, r, 3), (Q, R.double()), TypeError, "ref: expected torch.float32 like query"),
    (lambda q, r: fullgraph.knn_aggregate(q, r, F[:, :4], 3), (Q, R), ValueError,
     "features: expected one row per reference point"),
])
def test_compiled_calls_raise_the_documented_errors(call, args, error, message):
    with pytest.raises(error) as raised:
        _compiled(call)(*args)
    assert message in str(raised.value)
