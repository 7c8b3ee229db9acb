"""knn_reduce: the maximum, minimum and sum of each query's neighbours' rows, and their
gradients, against the gathered rows; the Triton kernels (interpreted on CPUs) against torch."""

from __future__ import annotations

import pytest
import torch

import fullgraph
from fullgraph import _triton
from fullgraph.ops.neighbors import reduce

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def _lists(batch, rows, columns, k, generator, device):
    """Random lists [B, M, k] with padding (-1) and one query without any neighbour."""
    idx = torch.randint(0, columns, (batch, rows, k), generator=generator)
    idx[torch.rand(idx.shape, generator=generator) < 0.2] = -1
    idx[0, 1] = -1
    return idx.to(device)


def _expected(values, idx):
    """The reductions from the gathered rows (rows without a neighbour: zeros)."""
    gathered = fullgraph.knn_gather(values, idx)
    ok = (idx >= 0)[..., None]
    some = ok.any(-2)
    top = gathered.masked_fill(~ok, -torch.inf).amax(-2).masked_fill(~some, 0)
    bottom = gathered.masked_fill(~ok, torch.inf).amin(-2).masked_fill(~some, 0)
    return top, bottom, gathered.masked_fill(~ok, 0).sum(-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_reductions_equal_the_gathered_rows(device, dtype):
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(2, 50, 7, generator=generator, dtype=torch.float64).to(device, dtype)
    idx = _lists(2, 30, 50, 6, generator, device)
    for got, want in zip(fullgraph.knn_reduce(values, idx), _expected(values, idx)):
        torch.testing.assert_close(got, want, atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=1e-2)
    top, bottom, total = fullgraph.knn_reduce(values[0], idx[0])  # unbatched
    torch.testing.assert_close(top, _expected(values, idx)[0][0])


@pytest.mark.parametrize("device", [device for device in DEVICES if device in _triton.devices()])
@pytest.mark.parametrize("channels", [20, 70])
def test_triton_kernels_equal_torch(device, channels):
    """The Triton pass and the deterministic backward against torch, NaN and ties included;
    channels beyond one 64-bit word of the backward's slot masks."""
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(2, 40, channels, generator=generator).to(device)
    values[1, 3, 4] = float("nan")
    values[0, 5] = values[0, 6]  # equal rows: the first slot holding an extreme takes its gradient
    idx = _lists(2, 33, 40, 5, generator, device)
    idx[0, 2, :2] = torch.tensor([6, 5])
    idx[1, :, 0] = 3  # every query of item 1 sees the NaN row
    got, want = reduce._reduce_triton(values, idx), reduce._reduce_torch(values, idx)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, equal_nan=True)
    assert torch.equal(got[3], want[3])
    grads = [torch.randn(2, 33, channels, generator=generator).to(device) for _ in range(3)]
    torch.testing.assert_close(reduce._backward_triton(*grads, idx, want[3], 40),
                               reduce._backward_torch(*grads, idx, want[3], 40))


@pytest.mark.skipif(not reduce.select.available(), reason="needs the C++ extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_kernels_equal_torch(dtype):
    """The C++ forward and backward against torch: padding, a query without neighbours, NaN,
    equal rows (the first slot holding an extreme), channels beyond one block of 16."""
    generator = torch.Generator().manual_seed(4)
    values = torch.randn(2, 40, 37, generator=generator, dtype=dtype)
    values[1, 3, 4] = float("nan")
    values[0, 5] = values[0, 6]
    idx = _lists(2, 33, 40, 7, generator, "cpu")
    idx[0, 2, :2] = torch.tensor([6, 5])
    idx[1, :, 0] = 3
    got, want = torch.ops.fullgraph_cpu.knn_reduce(values, idx), reduce._reduce_torch(values, idx)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, equal_nan=True)
    assert torch.equal(got[3], want[3])
    grads = [torch.randn(2, 33, 37, generator=generator, dtype=dtype) for _ in range(3)]
    torch.testing.assert_close(torch.ops.fullgraph_cpu.knn_reduce_backward(*grads, idx, want[3], 40),
                               reduce._backward_torch(*grads, idx, want[3], 40))


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_and_compile(device):
    generator = torch.Generator().manual_seed(2)
    values = torch.randn(2, 12, 3, generator=generator, dtype=torch.float64).to(device).requires_grad_()
    idx = _lists(2, 9, 12, 4, generator, device)
    torch.autograd.gradcheck(lambda v: fullgraph.knn_reduce(v, idx), (values,))
    compiled = torch.compile(lambda v, i: [r.sum() for r in fullgraph.knn_reduce(v, i)], fullgraph=True,
                             dynamic=True)
    got = compiled(values, idx)
    want = [r.sum() for r in fullgraph.knn_reduce(values, idx)]
    torch.testing.assert_close(torch.stack(got), torch.stack(want))
    got_grad, = torch.autograd.grad(sum(got), values)
    want_grad, = torch.autograd.grad(sum(want), values)
    torch.testing.assert_close(got_grad, want_grad)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_captures_in_a_cuda_graph():
    values = torch.randn(3, 200, 16, device="cuda")
    _, idx = fullgraph.knn(values, values, 8)
    step = fullgraph.graphs.graphed(lambda v: fullgraph.knn_reduce(v, idx))
    for got, want in zip(step(values), _expected(values, idx)):
        torch.testing.assert_close(got, want)


def test_bad_input_names_the_argument():
    values, idx = torch.randn(2, 5, 3), torch.zeros(2, 4, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="values: expected a floating-point tensor, got torch.int64"):
        fullgraph.knn_reduce(values.long(), idx)
    with pytest.raises(TypeError, match="idx: expected int64 neighbour lists, got torch.int32"):
        fullgraph.knn_reduce(values, idx.int())
    with pytest.raises(ValueError, match=r"idx: expected indices in \[-1, 5\), got values in \[0, 5\]"):
        fullgraph.knn_reduce(values, idx + 5 * (idx == 0) * torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"idx: expected batch size 2 like values, got shape \(3, 4, 2\)"):
        fullgraph.knn_reduce(values, torch.zeros(3, 4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"idx: expected shape \[B, M, k\] like values \[B, N, C\], got 2 dim"):
        fullgraph.knn_reduce(values, idx[0])
    with pytest.raises(ValueError, match="grad_sum: expected shape"):
        torch.ops.fullgraph.knn_reduce_backward(torch.zeros(2, 4, 3), torch.zeros(2, 4, 3), torch.zeros(2, 3, 3),
                                                idx, torch.zeros(2, 2, 4, 3, dtype=torch.int16), 5)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(2, 12, 5, generator=generator).to(device).requires_grad_()
    idx = _lists(2, 9, 12, 4, generator, device)
    torch.library.opcheck(torch.ops.fullgraph.knn_reduce.default, (values, idx))
    _, _, _, slots = torch.ops.fullgraph.knn_reduce(values, idx)
    grads = [torch.randn(2, 9, 5, generator=generator).to(device) for _ in range(3)]
    torch.library.opcheck(torch.ops.fullgraph.knn_reduce_backward.default, (*grads, idx, slots, 12))
