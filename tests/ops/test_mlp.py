"""fullgraph.narrow_mlp: every backend against a float64 oracle (values and gradients),
gradcheck, opcheck, compile, determinism and bad input."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DEVICES, HAVE_TRITON

import fullgraph
from fullgraph.ops import mlp


def _cases():
    """(backend, device): "auto" as called runs PyTorch's layers without the operator."""
    triton_devices = [d for d in DEVICES if d == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"]
    return [(b, d) for b in ("torch", "auto") for d in DEVICES] + (
        [("triton", d) for d in triton_devices] if HAVE_TRITON else [])


def _layers(widths, generator, dtype=torch.float32, device="cpu", scale=1.0):
    """Weights and biases of Linear layers widths[0] -> widths[1] -> ..., nn.Linear-sized, never zero."""
    weights, biases = [], []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        bound = scale / max(fan_in, 1) ** 0.5
        weights.append(((torch.rand(fan_out, fan_in, generator=generator, dtype=torch.float64) * 2 - 1) * bound))
        biases.append(((torch.rand(fan_out, generator=generator, dtype=torch.float64) * 2 - 1) * bound))
    return [w.to(device, dtype) for w in weights], [b.to(device, dtype) for b in biases]


def _oracle(x, weights, biases, grad_out):
    """(out, grads of x, weights, biases) in float64 through torch's autograd of the reference."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, *weights, *biases)]
    count = len(weights)
    out = mlp.reference(leaves[0], leaves[1:1 + count], leaves[1 + count:])
    grads = torch.autograd.grad(out, leaves, grad_out.double().cpu())
    return out.detach(), grads


WIDTHS = [
    (3, 25, 25, 25),  # the projector's first MLP
    (25, 25, 25, 1),  # and its second
    (7, 5),  # one layer
    (1, 32, 2, 32, 3),  # widths at the limit, a narrow hidden layer, four layers
    (16, 16, 16, 16, 16, 16, 16, 16, 16),  # eight layers ("torch" only: "triton" takes four)
]


@pytest.mark.parametrize("backend, device", _cases())
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: "-".join(map(str, w)))
@pytest.mark.parametrize("rows", [1, 63, 200])
def test_matches_the_float64_oracle(backend, device, widths, rows, generator):
    if backend == "triton" and len(widths) - 1 > mlp.TRITON_MAX_LAYERS:
        pytest.skip("more layers than the Triton kernels take (test_triton_refuses_what_it_cannot_run)")
    weights, biases = _layers(widths, generator, device=device)
    x = (torch.randn(rows, widths[0], generator=generator, dtype=torch.float64) * 3).float().to(device)
    grad_out = torch.randn(rows, widths[-1], generator=generator, dtype=torch.float64).float().to(device)
    leaves = [t.requires_grad_() for t in (x, *weights, *biases)]
    out = fullgraph.narrow_mlp(leaves[0], leaves[1:len(widths)], leaves[len(widths):], backend=backend)
    grads = torch.autograd.grad(out, leaves, grad_out)
    want, want_grads = _oracle(x, weights, biases, grad_out)
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, want_grads):  # weight gradients sum over all rows
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-5 * rows)


@pytest.mark.parametrize("backend, device", _cases())
def test_batched_rows_bf16_and_no_input_gradient(backend, device, generator):
    """Leading dims [2, 3, 50] are rows; bf16 in and out (computed in float32 by Triton);
    x without requires_grad gets no gradient."""
    weights, biases = _layers((4, 25, 8), generator, dtype=torch.bfloat16, device=device)
    x = torch.randn(2, 3, 50, 4, generator=generator).to(device, torch.bfloat16)
    params = [t.requires_grad_() for t in (*weights, *biases)]
    out = fullgraph.narrow_mlp(x, params[:2], params[2:], backend=backend)
    assert out.shape == (2, 3, 50, 8) and out.dtype == torch.bfloat16
    grad_out = torch.randn(out.shape, generator=generator).to(device, torch.bfloat16)
    out.backward(grad_out)
    want, want_grads = _oracle(x, weights, biases, grad_out)
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)
    for param, expected in zip(params, want_grads[1:]):
        torch.testing.assert_close(param.grad.double().cpu(), expected, rtol=3e-2, atol=0.5)
    assert x.grad is None


@pytest.mark.parametrize("backend, device", _cases())
def test_relu_boundaries_and_non_finite_rows(backend, device, generator):
    """Pre-activations exactly 0 pass no gradient (torch's ReLU); a NaN row stays NaN and
    its neighbours stay exact."""
    weights = [torch.tensor([[1.0, -1.0], [0.5, 0.5]]), torch.tensor([[2.0, -3.0]])]
    biases = [torch.zeros(2), torch.tensor([0.25])]
    x = torch.tensor([[1.0, 1.0], [2.0, -2.0], [float("nan"), 1.0], [-1.0, 3.0]])
    leaves = [t.to(device).requires_grad_() for t in (x, *weights, *biases)]
    out = fullgraph.narrow_mlp(leaves[0], leaves[1:3], leaves[3:], backend=backend)
    grads = torch.autograd.grad(out.nansum(), leaves[0])[0]
    assert torch.isnan(out[2]).all()
    torch.testing.assert_close(out[[0, 1, 3]].cpu(), torch.tensor([[-2.75], [8.25], [-2.75]]))
    # row 0: h = (0, 1): only the second unit passes; row 3: h = (-4, 1)
    torch.testing.assert_close(grads[[0, 1, 3]].cpu(), torch.tensor([[-1.5, -1.5], [2.0, -2.0], [-1.5, -1.5]]))


@pytest.mark.parametrize("backend, device", _cases())
def test_empty_rows(backend, device, generator):
    weights, biases = _layers((3, 8, 2), generator, device=device)
    x = torch.empty(0, 3, device=device, requires_grad=True)
    params = [t.requires_grad_() for t in (*weights, *biases)]
    out = fullgraph.narrow_mlp(x, params[:2], params[2:], backend=backend)
    assert out.shape == (0, 2)
    out.sum().backward()
    assert x.grad.shape == (0, 3) and all((p.grad == 0).all() for p in params)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
@pytest.mark.parametrize("device", [d for d in DEVICES if d == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"])
def test_triton_gradients_are_deterministic(device, generator):
    weights, biases = _layers((3, 25, 25, 25), generator, device=device)
    x = torch.randn(3000 if device == "cuda" else 300, 3, generator=generator).to(device)
    params = [t.requires_grad_() for t in (*weights, *biases)]

    def grads():
        return torch.autograd.grad(fullgraph.narrow_mlp(x, params[:3], params[3:], backend="triton").square().sum(),
                                   params)

    first = grads()
    for again in (grads(), grads()):
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def test_gradcheck_float64(generator):
    weights, biases = _layers((3, 6, 4, 2), generator, dtype=torch.float64)
    x = torch.randn(9, 3, generator=generator, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (x, *weights, *biases)]
    assert torch.autograd.gradcheck(
        lambda x, *p: fullgraph.narrow_mlp(x, p[:3], p[3:], backend="torch"), tuple(leaves))


@pytest.mark.parametrize("backend, device", _cases())
def test_opcheck(backend, device, generator):
    weights, biases = _layers((3, 8, 2), generator, device=device)
    x = torch.randn(20, 3, generator=generator).to(device)
    torch.library.opcheck(torch.ops.fullgraph.narrow_mlp.default, (x, weights, biases, backend))
    grad_out = torch.randn(20, 2, generator=generator).to(device)
    torch.library.opcheck(torch.ops.fullgraph.narrow_mlp_backward.default, (grad_out, x, weights, biases, backend,
                                                                            True))


@pytest.mark.slow
def test_compiles_once_for_all_row_counts(generator):
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    layers = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def run(x):
        return fullgraph.narrow_mlp(x, [layers[0].weight, layers[2].weight], [layers[0].bias, layers[2].bias])

    compiled = torch.compile(run, backend=counter, fullgraph=True, dynamic=True)
    for rows in (10, 33, 70):
        x = torch.randn(rows, 3, generator=generator)
        torch.testing.assert_close(compiled(x), layers(x))
        compiled(x).sum().backward()
    assert counter.frame_count == 1


def test_compiled_auto_on_a_cpu_traces_the_layers_not_the_operator(generator):
    """Without the kernels (no CUDA), "auto" compiles to the layers themselves, which the
    compiler fuses and differentiates (the operator's backward recomputes the forward: a
    compiled projector train step 5-7 % slower than eager on the development CPU)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    weights, biases = _layers((3, 8, 2), generator)
    x = torch.randn(20, 3, generator=generator)
    compiled = torch.compile(lambda x: fullgraph.narrow_mlp(x, weights, biases), backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), fullgraph.narrow_mlp(x, weights, biases, backend="torch"))
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes}
    assert not any("fullgraph" in target for target in targets), targets


@pytest.mark.parametrize("change, error, message", [
    (lambda a: {**a, "x": a["x"].long()}, TypeError, "x: expected a floating-point tensor"),
    (lambda a: {**a, "weights": a["weights"][0]}, TypeError, "weights: expected a non-empty list"),
    (lambda a: {**a, "weights": []}, TypeError, "weights: expected a non-empty list"),
    (lambda a: {**a, "biases": a["biases"][:1]}, ValueError, r"biases: expected one per layer \(2\), got 1"),
    (lambda a: {**a, "weights": [a["weights"][0], a["weights"][1].T]}, ValueError,
     r"weights\[1\]: expected \[C_out, 8\]"),
    (lambda a: {**a, "weights": [a["weights"][0][None], a["weights"][1]]}, ValueError,
     r"weights\[0\]: expected shape \[C_out, C_in\]"),
    (lambda a: {**a, "biases": [a["biases"][0][:3], a["biases"][1]]}, ValueError, r"biases\[0\]: expected \[8\]"),
    (lambda a: {**a, "biases": [a["biases"][0].double(), a["biases"][1]]}, TypeError,
     r"biases\[0\]: expected torch.float32 like x"),
    (lambda a: {**a, "weights": [a["weights"][0]] * 9, "biases": [a["biases"][0]] * 9}, ValueError,
     "weights: expected at most 8 layers"),
    (lambda a: {**a, "backend": "warp"}, ValueError, "backend: expected one of"),
])
def test_bad_input(change, error, message, generator):
    weights, biases = _layers((3, 8, 2), generator)
    args = change({"x": torch.randn(5, 3, generator=generator), "weights": weights, "biases": biases,
                   "backend": "auto"})
    with pytest.raises(error, match=message):
        fullgraph.narrow_mlp(args["x"], args["weights"], args["biases"], backend=args["backend"])
    if isinstance(args["weights"], list) and args["weights"] and isinstance(args["biases"], list) \
            and args["backend"] != "warp":  # the registered op checks the same contract
        with pytest.raises(error, match=message):
            torch.ops.fullgraph.narrow_mlp(args["x"], args["weights"], args["biases"], "torch")


@pytest.mark.skipif(not HAVE_TRITON or (os.environ.get("TRITON_INTERPRET") != "1" and "cuda" not in DEVICES),
                    reason="needs Triton")
@pytest.mark.parametrize("widths", [(3, 33, 2), (3, 4, 4, 4, 4, 2)], ids=["wide", "five-layers"])
def test_triton_refuses_what_it_cannot_run(widths, generator):
    device = "cuda" if "cuda" in DEVICES else "cpu"
    weights, biases = _layers(widths, generator, device=device)
    x = torch.randn(5, 3, generator=generator).to(device)
    message = rf'weights: backend="triton" takes up to 4 layers of widths up to 32, got widths \[{", ".join(map(str, widths))}\]'
    with pytest.raises(ValueError, match=message):
        fullgraph.narrow_mlp(x, weights, biases, backend="triton")
    assert mlp.BACKENDS.resolve("auto", "narrow_mlp", x.device, x.dtype, max(widths), len(widths) - 1).name == "torch"
    torch.testing.assert_close(fullgraph.narrow_mlp(x, weights, biases), mlp.reference(x, weights, biases))
