"""The LLTM extension (seed 001): against the float64 reference, gradcheck, opcheck,
torch.compile, errors. The first test in a process builds the extension (cached)."""

from __future__ import annotations

import pytest
import torch
from conftest import CPP_CHECKS_CRASH, CRASH_REASON, DEVICES, TOLERANCES

import fullgraph
from fullgraph.ops.lltm import api, build


def _inputs(generator, batch=5, features=7, state=6, dtype=torch.float64, device="cpu", scale=1.0):
    """(input, weights, bias, old_h, old_cell); ``scale`` widens the gates (saturation)."""
    def draw(*shape):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype=dtype, device=device)
    return draw(batch, features), draw(3 * state, features + state), draw(3 * state), draw(batch, state), \
        draw(batch, state)


@pytest.fixture(scope="module", autouse=True)
def extension():
    if build.missing_tools(with_cuda=False):
        pytest.skip(f"cannot build the extension here: {build.missing_tools(False)}")
    build.load()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(5, 7, 6), (1, 1, 1), (0, 3, 4), (16, 32, 128), (3, 2, 300)])
@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: saturated sigmoids and tanh, ELU far in its tail
def test_extension_matches_the_float64_reference(device, shape, scale, generator):
    tensors = _inputs(generator, *shape, device=device, scale=scale)
    got = fullgraph.lltm(*tensors, backend=device)
    want = fullgraph.lltm(*tensors, backend="torch")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_against_float64(device, dtype, generator):
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("float16 matrix products on CPU are not what users run")
    tensors = _inputs(generator, 16, 32, 128)
    want = fullgraph.lltm(*tensors, backend="torch")
    got = fullgraph.lltm(*(t.to(device=device, dtype=dtype) for t in tensors), backend=device)
    rtol, atol = TOLERANCES[dtype]
    reduced = 40 if dtype != torch.float32 else 1  # the 160-term matrix product rounds in dtype
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double().cpu(), w, rtol=rtol * reduced, atol=atol * reduced)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device, generator):
    tensors = [t.requires_grad_() for t in _inputs(generator, 3, 4, 5, device=device)]
    assert torch.autograd.gradcheck(lambda *a: fullgraph.lltm(*a, backend=device), tensors)


@pytest.mark.parametrize("device", DEVICES)
def test_gradgradcheck(device, generator):
    """create_graph=True: the gradients are themselves differentiable (they were silently
    constants of the inputs before: the fused backward operator has no derivative)."""
    tensors = [t.requires_grad_() for t in _inputs(generator, 3, 4, 5, device=device)]
    assert torch.autograd.gradgradcheck(lambda *a: fullgraph.lltm(*a, backend=device), tensors)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_of_one_output_only(device, generator):
    tensors = [t.requires_grad_() for t in _inputs(generator, device=device)]
    fullgraph.lltm(*tensors, backend=device)[0].sum().backward()
    got = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    fullgraph.lltm(*tensors, backend="torch")[0].sum().backward()
    for g, t in zip(got, tensors):
        torch.testing.assert_close(g, t.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_of_the_parameters_alone(device, generator):
    input, weights, bias, old_h, old_cell = _inputs(generator, device=device)
    grads = {}
    for backend in (device, "torch"):
        w, b = weights.clone().requires_grad_(), bias.clone().requires_grad_()
        new_h, new_cell = fullgraph.lltm(input, w, b, old_h, old_cell, backend=backend)
        grads[backend] = torch.autograd.grad((new_h * new_cell).sum(), [w, b])
    for got, want in zip(grads[device], grads["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, generator):
    input, weights, bias, old_h, old_cell = _inputs(generator, device=device)
    forward_args = [t.clone().requires_grad_() for t in (input, weights, bias, old_h, old_cell)]
    torch.library.opcheck(torch.ops.fullgraph.lltm_forward.default, forward_args)
    new_h, new_cell, gates = torch.ops.fullgraph.lltm_forward(input, weights, bias, old_h, old_cell)
    grads = torch.randn_like(new_h), torch.randn_like(new_cell)
    torch.library.opcheck(torch.ops.fullgraph.lltm_backward.default, (*grads, gates, new_cell))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_training_step_is_one_graph_for_all_batch_sizes(device, generator):
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    cell = fullgraph.models.LLTM(8, 16, backend=device).to(device)
    optimizer = torch.optim.SGD(cell.parameters(), lr=0.1)
    counter = CompileCounter()

    def loss_of(x, h, c, target):
        for _ in range(3):  # three steps of the recurrence
            h, c = cell(x, (h, c))
        return ((h - target) ** 2).mean()

    compiled = torch.compile(loss_of, backend=counter, fullgraph=True, dynamic=True)
    inductor = torch.compile(loss_of, fullgraph=True, dynamic=True)
    for batch in (4, 7, 11):
        x, h, c, target = (torch.randn(batch, n, generator=generator).to(device) for n in (8, 16, 16, 16))
        torch.testing.assert_close(inductor(x, h, c, target), loss_of(x, h, c, target))
        losses = []
        for _ in range(4):
            optimizer.zero_grad()
            loss = compiled(x, h, c, target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
    assert counter.frame_count == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reduce_overhead_training_step_replays_cuda_graphs(generator):
    torch.manual_seed(0)
    cell = fullgraph.models.LLTM(32, 128, backend="cuda").cuda()
    reference = fullgraph.models.LLTM(32, 128, backend="torch").cuda()
    reference.load_state_dict(cell.state_dict())
    compiled = torch.compile(cell, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # later calls replay the captured graphs on new data
        x, h, c = (torch.randn(16, n, generator=generator).cuda() for n in (32, 128, 128))
        for model in (compiled, reference):
            model.zero_grad(set_to_none=True)
            new_h, new_c = model(x, (h, c))
            (new_h * new_c).sum().backward()
        for got, want in zip(cell.parameters(), reference.parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_and_backward_capture_in_one_cuda_graph(generator):
    cell = fullgraph.models.LLTM(32, 128, backend="cuda").cuda()
    x, h, c = (torch.randn(16, n, generator=generator).cuda() for n in (32, 128, 128))

    def gradients():
        new_h, new_c = cell(x, (h, c))
        return torch.autograd.grad((new_h * new_c).sum(), [cell.weights, cell.bias])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gradients()  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = gradients()
    for _ in range(3):  # replays on new data equal eager calls
        for tensor in (x, h, c):
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
        graph.replay()
        for got, want in zip(static, gradients()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_model_has_the_document_layout():
    cell = fullgraph.models.LLTM(32, 128)
    assert cell.weights.shape == (384, 160) and cell.bias.shape == (384,)
    assert float(cell.weights.abs().max()) <= 1 / 128 ** 0.5


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "input": a["input"].long()}, "input: expected a floating-point tensor"),
    (lambda a: {**a, "weights": a["weights"][:, :-1]}, "weights: expected [3 S, F + S] = [18, 13]"),
    (lambda a: {**a, "bias": a["bias"][None]}, "bias: expected [3 S] = [18]"),
    (lambda a: {**a, "old_cell": a["old_cell"][:2]}, "old_cell: expected [B, S] = [5, 6]"),
    (lambda a: {**a, "old_h": a["old_h"].float()}, "old_h: expected torch.float64 like input"),
    (lambda a: {**a, "input": a["input"][0]}, "input: expected shape [B, F]"),
    (lambda a: {**a, "backend": "extension"}, "backend: expected one of"),
    (lambda a: {**a, "backend": "cuda"}, 'backend: "cuda" needs CUDA tensors, got tensors on cpu'),
])
def test_bad_input(change, message, generator):
    names = ("input", "weights", "bias", "old_h", "old_cell")
    arguments = change(dict(zip(names, _inputs(generator))))
    with pytest.raises((TypeError, ValueError)) as error:
        fullgraph.lltm(**arguments)
    assert message in str(error.value)


def test_auto_takes_the_extension_on_cuda_only(recwarn):
    """On CPUs plain PyTorch measured faster at every size (ops/NOTES.md), and saying a
    compiler is missing there would be beside the point."""
    assert api.BACKENDS.resolve("auto", "lltm", torch.device("cpu"), torch.float32).name == "torch"
    assert api._backend("auto", "cpu", torch.float32) == "torch"
    assert not [w for w in recwarn if "fullgraph.lltm" in str(w.message)]
    if api._buildable("cuda"):
        assert api.BACKENDS.resolve("auto", "lltm", torch.device("cuda"), torch.float32).name == "cuda"


def test_the_backend_choice_carries_the_compilers_constant_mark():
    """api._backend is marked by hand (importing the compiler up front costs seconds): the
    mark must be what torch.compiler.assume_constant_result puts on a function."""
    def probe():
        return 0

    torch.compiler.assume_constant_result(probe)
    assert vars(probe) and all(getattr(api._backend, key, None) == value for key, value in vars(probe).items())


def test_a_missing_compiler_is_named_where_no_build_is_cached(monkeypatch, tmp_path, extension):
    with_cuda = build.load()  # the variant this process loaded (one per process: both register the operators)
    if build.prebuilt_library() is not None:
        pytest.skip("the extension was built into the package: no cache is read")
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert any("no-such-compiler" in tool for tool in build.missing_tools(with_cuda=with_cuda))
    build._compile(with_cuda=with_cuda)  # the build in the cache loads without a compiler
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: it would have to compile
    with pytest.raises(build.ExtensionBuildError, match="a C\\+\\+ compiler .*backend=\"torch\""):
        build._compile(with_cuda=with_cuda)


# The kernels' own operators (torch.ops.fullgraph_lltm.*) check with TORCH_CHECK; where a C++
# exception crashes the process (CPP_CHECKS_CRASH) only the public operators' Python checks run.


def _forward_change(index, value):
    def change(tensors):
        tensors = list(tensors)
        tensors[index] = value(tensors[index])
        return tensors
    return change


FORWARD_CHANGES = [  # (change, error, public operator's message, kernel operator's message)
    (_forward_change(1, lambda w: w[:-1]), ValueError, "weights: expected [3 S, F + S] = [18, 13] for input [B, F] = "
     "[5, 7] and state size S = 6, got [17, 13]", "weights: expected [3 S, F + S] = [18, 13], got [17, 13]"),
    (_forward_change(2, lambda b: b[:5]), ValueError, "bias: expected [3 S] = [18]", "bias: expected [3 S] = [18], got [5]"),
    (_forward_change(3, lambda h: h[:, :5]), ValueError, "old_cell: expected [B, S] = [5, 5]",
     "old_cell: expected [B, S] = [5, 5], got [5, 6]"),
    (_forward_change(4, lambda c: c[:3]), ValueError, "old_cell: expected [B, S] = [5, 6]",
     "old_cell: expected [B, S] = [5, 6], got [3, 6]"),
    (_forward_change(0, lambda x: x[0]), ValueError, "input: expected shape [B, F], got 1 dimensions",
     "input: expected 2 dimensions"),
    (_forward_change(4, lambda c: c.float()), TypeError, "old_cell: expected torch.float64 like input, got torch.float32",
     "old_cell: expected Double like input, got Float"),
    (_forward_change(0, lambda x: x.long()), TypeError, "input: expected a floating-point tensor, got torch.int64",
     "input: expected a floating-point tensor, got Long"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("namespace", ["fullgraph", "fullgraph_lltm"])
@pytest.mark.parametrize("change, error, python_message, kernel_message", FORWARD_CHANGES)
def test_the_forward_operators_check_their_inputs(device, namespace, change, error, python_message, kernel_message,
                                                  generator):
    """torch.ops.fullgraph.lltm_forward called directly (checked in Python, before the
    extension) and the kernel's own torch.ops.fullgraph_lltm.forward (a TORCH_CHECK on every
    precondition)."""
    if namespace == "fullgraph_lltm" and CPP_CHECKS_CRASH:
        pytest.skip(CRASH_REASON)
    forward = torch.ops.fullgraph.lltm_forward if namespace == "fullgraph" else torch.ops.fullgraph_lltm.forward
    tensors = change(_inputs(generator, device=device))
    with pytest.raises(error) as raised:
        forward(*tensors)
    assert (python_message if namespace == "fullgraph" else kernel_message) in str(raised.value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("namespace", ["fullgraph", "fullgraph_lltm"])
def test_the_backward_operator_checks_its_inputs(device, namespace, generator):
    if namespace == "fullgraph_lltm" and CPP_CHECKS_CRASH:
        pytest.skip(CRASH_REASON)
    backward = torch.ops.fullgraph.lltm_backward if namespace == "fullgraph" else torch.ops.fullgraph_lltm.backward
    _, new_cell, gates = torch.ops.fullgraph.lltm_forward(*_inputs(generator, device=device))
    grad = torch.ones_like(new_cell)
    python = namespace == "fullgraph"
    with pytest.raises(TypeError, match="grad_cell: expected torch.float64 like new_cell, got torch.float32" if python
                       else "grad_cell: expected Double like new_cell, got Float"):
        backward(grad, grad.float(), gates, new_cell)
    with pytest.raises(ValueError, match=r"gates: expected \[B, 3 S\] = \[5, 18\]"):
        backward(grad, grad, gates[:, :-1], new_cell)
    with pytest.raises(ValueError, match=r"grad_h: expected \[B, S\] = \[5, 6\]"):
        backward(grad[:4], grad, gates, new_cell)
    with pytest.raises(ValueError, match="new_cell: expected (shape \\[B, S\\]|2 dimensions)"):
        backward(grad, grad, gates, new_cell[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_operators_name_a_tensor_on_another_device(generator):
    tensors = list(_inputs(generator, device="cuda"))
    tensors[3] = tensors[3].cpu()
    with pytest.raises(ValueError, match="old_h: expected a tensor on cuda:0 like input, got cpu"):
        torch.ops.fullgraph.lltm_forward(*tensors)
