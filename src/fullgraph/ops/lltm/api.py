"""The LLTM cell's public function, its backends, and its operators.

``torch.ops.fullgraph.lltm_forward`` and ``lltm_backward`` are Python custom operators that
check their inputs (shapes, dtypes, devices, naming the argument) and then call the C++/CUDA
extension's kernels (``torch.ops.fullgraph_lltm.forward`` / ``backward``, csrc/, built or
loaded on first use: see build.py). The checks are in Python, before the extension is
entered, so a bad call raises the same TypeError/ValueError everywhere (a C++ exception out
of a JIT-built extension crashed the process on the test GPU's toolchain). Fakes and
autograd (the backward is the ``lltm_backward`` operator) are registered here. Backends:
"cpu" and "cuda" (those operators on the extension's C++ and CUDA kernels; C++/CUDA backends
are named by the device they run on in every family) and "torch" (``reference``).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from ... import _contract, _validate, backends
from . import reference
from .build import load, missing_tools, prebuilt_library


def _extension_for(device: torch.device) -> None:
    """Load the extension (once) and check it has kernels for ``device``."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"input: the LLTM extension has kernels for cpu and cuda tensors, got {device}")
    has_cuda = load()
    _kernel_fakes()
    if device.type == "cuda" and not has_cuda:
        raise ValueError('backend: "cuda" needs the extension\'s CUDA kernels, and it was built without them '
                         "(no GPU or no nvcc at build time)")


@functools.cache
def _kernel_fakes() -> None:
    """The extension's own operators' shapes, so that a program can hold them (``decompositions``)."""
    torch.library.register_fake("fullgraph_lltm::forward", _forward_shapes)
    torch.library.register_fake("fullgraph_lltm::backward", _backward_shapes)


def decompositions() -> dict:
    """{``fullgraph::lltm_forward``: the extension's ``fullgraph_lltm::forward``}, for
    ``ExportedProgram.run_decompositions``: a program whose only LLTM operator is the C++
    library's, which an AOTInductor package calls from a C++ program that loaded that library
    (``build.library()``; docs/deploy.md). Loads the extension."""
    _extension_for(torch.device("cpu"))
    return {torch.ops.fullgraph.lltm_forward.default: torch.ops.fullgraph_lltm.forward.default}


@torch.library.custom_op("fullgraph::lltm_forward", mutates_args=())
def lltm_forward(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
                 old_cell: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(new_h [B, S], new_cell [B, S], gates [B, 3 S]) from the extension's fused kernel."""
    _check(input, weights, bias, old_h, old_cell)
    _extension_for(input.device)
    return torch.ops.fullgraph_lltm.forward(input, weights, bias, old_h, old_cell)


@lltm_forward.register_fake
def _forward_shapes(input, weights, bias, old_h, old_cell):
    return torch.empty_like(old_cell), torch.empty_like(old_cell), old_cell.new_empty(old_cell.shape[0], weights.shape[0])


@torch.library.custom_op("fullgraph::lltm_backward", mutates_args=())
def lltm_backward(grad_h: Tensor, grad_cell: Tensor, gates: Tensor, new_cell: Tensor) -> tuple[Tensor, Tensor]:
    """(d_gates [B, 3 S], d_old_cell [B, S]): the fused pointwise part of the backward."""
    _check_backward(grad_h, grad_cell, gates, new_cell)
    _extension_for(new_cell.device)
    return torch.ops.fullgraph_lltm.backward(grad_h, grad_cell, gates, new_cell)


@lltm_backward.register_fake
def _backward_shapes(grad_h, grad_cell, gates, new_cell):
    return torch.empty_like(gates), torch.empty_like(new_cell)


def _setup_context(ctx, inputs, output):
    _, new_cell, gates = output
    ctx.save_for_backward(gates, new_cell, *inputs)
    ctx.mark_non_differentiable(gates)


def _double_differentiable(inputs, needs, grad_h, grad_cell):
    """The gradients as a differentiable graph (``create_graph=True``): the fused backward
    operator has no derivative of its own, so the reference's operations are replayed."""
    wanted = [t for t, need in zip(inputs, needs) if need]
    new_h, new_cell = reference.lltm(*inputs)
    grads = iter(torch.autograd.grad((new_h, new_cell), wanted, (grad_h, grad_cell), create_graph=True,
                                     allow_unused=True))
    return tuple(next(grads) if need else None for need in needs)


def _backward(ctx, grad_h, grad_cell, _grad_gates):
    """The fused pointwise backward (an operator), then only the matrix products whose
    gradients are needed."""
    gates, new_cell, input, weights, bias, old_h, old_cell = ctx.saved_tensors
    if torch.is_grad_enabled():  # backward(create_graph=True): gradients of gradients will be asked for
        return _double_differentiable((input, weights, bias, old_h, old_cell), ctx.needs_input_grad,
                                      torch.zeros_like(new_cell) if grad_h is None else grad_h,
                                      torch.zeros_like(new_cell) if grad_cell is None else grad_cell)
    d_gates, d_old_cell = torch.ops.fullgraph.lltm_backward(grad_h, grad_cell, gates, new_cell)
    needs_input, needs_weights, needs_bias, needs_old_h, _ = ctx.needs_input_grad
    d_input = d_weights = d_bias = d_old_h = None
    if needs_input or needs_old_h:
        d_x = d_gates @ weights
        d_old_h, d_input = d_x[:, : old_h.shape[1]], d_x[:, old_h.shape[1]:]
    if needs_weights:
        d_weights = d_gates.t() @ torch.cat([old_h, input], dim=1)
    if needs_bias:
        d_bias = d_gates.sum(0)
    return d_input, d_weights, d_bias, d_old_h, d_old_cell


lltm_forward.register_autograd(_backward, setup_context=_setup_context)


@functools.cache
def _buildable(device_type: str) -> bool:
    """Whether the extension is built, or can be built here with kernels for ``device_type``."""
    if device_type not in ("cpu", "cuda"):
        return False
    return prebuilt_library() is not None or not missing_tools(with_cuda=device_type == "cuda")


def _extension(input, weights, bias, old_h, old_cell):
    new_h, new_cell, _ = torch.ops.fullgraph.lltm_forward(input, weights, bias, old_h, old_cell)
    return new_h, new_cell


_INSTALL = 'a C++ compiler and ninja (pip install "fullgraph[ext]"){}, to build it; or use backend="torch"'
BACKENDS = backends.family(
    "lltm",
    backends.Backend("cuda", ops=("lltm",), devices=("cuda",), auto_devices=("cuda",), available=_buildable,
                     implementation=_extension, install=_INSTALL.format(", and nvcc")),
    # "auto" leaves CPUs to plain PyTorch: it was faster there at every size measured.
    backends.Backend("cpu", ops=("lltm",), devices=("cpu",), available=_buildable, implementation=_extension,
                     install=_INSTALL.format("")),
    backends.Backend("torch", ops=("lltm",), devices=(backends.ANY_DEVICE,), auto_devices=(backends.ANY_DEVICE,),
                     implementation=reference.lltm),
)


def _backend(choice: str, device_type: str, dtype: torch.dtype) -> str:
    """"torch", "cpu" or "cuda" for tensors on ``device_type``, the extension loaded for the latter."""
    backend = BACKENDS.resolve(choice, "lltm", torch.device(device_type), dtype, argument="input")
    if choice == "auto" and backend.name == "torch" and device_type in BACKENDS.get("cuda").auto_devices:
        missing = ", ".join(missing_tools(with_cuda=device_type == "cuda"))
        warnings.warn(f"fullgraph.lltm: using plain PyTorch; the extension needs {missing}", stacklevel=4)
    if backend.name != "torch":
        _extension_for(torch.device(device_type))
    return backend.name


# Under torch.compile _backend runs while tracing and its result is a constant: the mark
# torch.compiler.assume_constant_result sets, set here without importing the compiler
# (seconds) when the package is imported (tests/ops/test_lltm.py checks it is the same mark).
_backend._dynamo_marked_constant = True


def _check(input, weights, bias, old_h, old_cell) -> None:
    for name, value in (("input", input), ("weights", weights), ("bias", bias), ("old_h", old_h),
                        ("old_cell", old_cell)):
        _validate.floating(name, value)
        if name != "input":
            _validate.same_dtype_and_device(name, value, "input", input)
    _validate.rank("input", input, (2,), "[B, F]")
    _validate.rank("old_h", old_h, (2,), "[B, S]")
    batch, features, state = input.shape[0], input.shape[1], old_h.shape[1]
    expected = {"old_h": (batch, state), "old_cell": (batch, state), "weights": (3 * state, features + state),
                "bias": (3 * state,)}
    layouts = {"old_h": "[B, S]", "old_cell": "[B, S]", "weights": "[3 S, F + S]", "bias": "[3 S]"}
    for name, value in (("old_h", old_h), ("old_cell", old_cell), ("weights", weights), ("bias", bias)):
        if tuple(value.shape) != expected[name]:
            raise ValueError(f"{name}: expected {layouts[name]} = {list(expected[name])} for input [B, F] = "
                             f"{list(input.shape)} and state size S = {state}, got {list(value.shape)}")


def _check_backward(grad_h, grad_cell, gates, new_cell) -> None:
    for name, value in (("new_cell", new_cell), ("gates", gates), ("grad_h", grad_h), ("grad_cell", grad_cell)):
        _validate.floating(name, value)
        if name != "new_cell":
            _validate.same_dtype_and_device(name, value, "new_cell", new_cell)
    _validate.rank("new_cell", new_cell, (2,), "[B, S]")
    batch, state = new_cell.shape
    for name, value, expected, layout in (("gates", gates, (batch, 3 * state), "[B, 3 S]"),
                                          ("grad_h", grad_h, (batch, state), "[B, S]"),
                                          ("grad_cell", grad_cell, (batch, state), "[B, S]")):
        if tuple(value.shape) != expected:
            raise ValueError(f"{name}: expected {layout} = {list(expected)} for new_cell [B, S] = "
                             f"{list(new_cell.shape)}, got {list(value.shape)}")


def _check_lltm(input, weights, bias, old_h, old_cell, *, backend="auto") -> None:
    _check(input, weights, bias, old_h, old_cell)
    _validate.choice("backend", backend, BACKENDS.names)


@_contract.checked(_check_lltm, outputs=2)
def lltm(input, weights, bias, old_h, old_cell, *, backend: str = "auto"):
    """One step of the LLTM cell (PyTorch's LLTM extension tutorial): gates from [old_h, input] in one matrix product,
    sigmoid input and output gates, an ELU candidate cell and no forget gate.

    Args:
        input: [B, F] features. weights: [3 S, F + S] (rows: input gate, output gate,
            candidate; columns: old_h, then input). bias: [3 S]. old_h, old_cell: [B, S].
            All one floating dtype (float32/float64; float16/bfloat16 compute in float32)
            and one device.
        backend: "cuda" (the extension's CUDA kernel; CUDA tensors), "cpu" (its C++ kernel;
            CPU tensors), both built on first use, "torch" (plain PyTorch) or "auto" (on CUDA
            the extension where it can be built, else plain PyTorch with a warning; on CPUs
            plain PyTorch, measured faster there).

    Returns:
        (new_h, new_cell), each [B, S]; differentiable in every input.

    Raises:
        TypeError/ValueError: bad dtypes, devices or shapes (naming the argument).
        ExtensionBuildError: backend="cpu" or "cuda" and the extension cannot be built.

    Example:
        >>> import torch, fullgraph
        >>> x, h, c = torch.randn(4, 32), torch.zeros(4, 128), torch.zeros(4, 128)
        >>> w, b = torch.randn(3 * 128, 32 + 128) * 0.05, torch.zeros(3 * 128)
        >>> new_h, new_cell = fullgraph.lltm(x, w, b, h, c, backend="torch")
        >>> tuple(new_h.shape), tuple(new_cell.shape)
        ((4, 128), (4, 128))
    """
    return BACKENDS.get(_backend(backend, input.device.type, input.dtype)).implementation(
        input, weights, bias, old_h, old_cell)
