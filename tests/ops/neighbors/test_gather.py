"""knn_gather: rows at neighbour lists, padded slots filled, not the last row."""

from __future__ import annotations

import pytest
import torch

import fullgraph


def test_matches_indexing_and_fills_padding(generator):
    values = torch.randn(2, 30, 5, generator=generator, dtype=torch.float64)
    query = torch.rand(2, 7, 3, generator=generator)
    ref = torch.rand(2, 30, 3, generator=generator)
    _, idx, _ = fullgraph.radius(query, ref, 0.3, 12)
    assert (idx < 0).any() and (idx >= 0).any()
    out = fullgraph.knn_gather(values, idx, fill=-7.0)
    for b in range(2):
        found = idx[b] >= 0
        torch.testing.assert_close(out[b][found], values[b][idx[b][found]])
        assert (out[b][~found] == -7.0).all()
    torch.testing.assert_close(fullgraph.knn_gather(values[0], idx[0]), fullgraph.knn_gather(values, idx)[0].masked_fill(
        (idx[0] < 0)[..., None], 0.0))


@pytest.mark.parametrize("values, idx", [(torch.rand(0, 4), torch.full((5, 3), -1)),
                                         (torch.rand(2, 0, 4), torch.full((2, 5, 3), -1))])
def test_no_rows_to_gather_from(values, idx):
    """N = 0 references (an empty cloud): every slot is padding."""
    out = fullgraph.knn_gather(values, idx, fill=2.5)
    assert out.shape == (*idx.shape, 4) and bool((out == 2.5).all())


def test_gradient_flows_to_the_gathered_rows_only(generator):
    values = torch.randn(9, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 3, -1], [8, -1, -1]])
    assert torch.autograd.gradcheck(lambda v: fullgraph.knn_gather(v, idx), (values,))
    fullgraph.knn_gather(values, idx).sum().backward()
    assert values.grad[8].sum() == 2 and values.grad[1].abs().sum() == 0  # row 8: one real slot, no padding


@pytest.mark.parametrize("values, idx, error, message", [
    (torch.rand(9, 2), torch.zeros(3, 2, dtype=torch.int32), TypeError, "idx: expected int64"),
    (torch.rand(9, 2), torch.zeros(3, 2, 1, dtype=torch.int64), ValueError, "idx: expected shape [M, k]"),
    (torch.rand(2, 9, 2), torch.zeros(3, 4, 1, dtype=torch.int64), ValueError, "idx: expected batch size 2"),
    (torch.rand(9, 2), torch.full((3, 2), 9), ValueError, "idx: expected indices in [-1, 9), got values in [9, 9]"),
    ([1.0], torch.zeros(3, 2, dtype=torch.int64), TypeError, "values: expected a torch.Tensor"),
])
def test_bad_input(values, idx, error, message):
    with pytest.raises(error) as raised:
        fullgraph.knn_gather(values, idx)
    assert message in str(raised.value)


@pytest.mark.slow
def test_compiles_in_one_graph(generator):
    values, ref = torch.randn(40, 3, generator=generator), torch.rand(40, 3, generator=generator)

    def step(query):
        _, idx = fullgraph.knn(query, ref, 4)
        return fullgraph.knn_gather(values, idx).sum(1)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    query = torch.rand(11, 3, generator=generator)
    torch.testing.assert_close(compiled(query), step(query))
