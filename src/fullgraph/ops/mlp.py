"""Narrow MLPs (Linear -> ReLU -> ... -> Linear, every width at most MAX_WIDTH) over many
rows, each pass in one kernel: ``fullgraph.narrow_mlp``.

Point-cloud models run small MLPs on every point (the projector's 3 -> 25 -> 25 -> 25 on
100,000 points). Layer by layer, each is a thin matrix product (for widths such as 25, not
multiples of 4, cuBLAS takes SIMT kernels and split-K reductions), a bias and a ReLU, and
the backward as many again, each moving the [N, width] activations through memory: the two
projector MLPs' products alone took ~225 us of the seed kNN train step (~1,040 us) on the
H100 (torch.profiler). The "triton" backend keeps a block of rows in registers through
every layer: the forward reads x and writes the output once; the backward (up to four
layers) recomputes the activations from x (none are saved), writes dL/dx, and each program
sums its rows' weight and bias gradients in registers and writes them once to its own slot
of a partial buffer, which one more kernel sums in a fixed order (deterministic, no atomics).

Floor (H100, ~3.35 TB/s): the projector's 10^5 x (3 -> 25 -> 25 -> 25) MLP reads 1.2 MB and
writes 10 MB, ~3.5 us forward; the backward reads x and dL/dout (11 MB), ~3.5 us; the
arithmetic (widths padded to WP = 32: 3L - 1 products of [32, 32] x [32, 32] a block of 32 rows
backward) runs on tensor cores.

Products are float32 on tensor cores as three TF32 products (``tf32x3``: each operand
split into a TF32 head and tail; accuracy of float32 products, ~1e-6 relative), summed in
float32. A row holding a non-finite value may come out NaN where PyTorch gives +-inf (the
split of inf is NaN); rows never mix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _contract, _triton, _validate, backends
from .._triton import cdiv, lazy, next_power_of_2

kernels = lazy(f"{__package__}.mlp_kernels")

MAX_WIDTH = 32  # wider layers' dot operands outgrow shared memory (4 x 64 wide: ~230 KB)
MAX_LAYERS = 8
TRITON_MAX_LAYERS = 4  # the backward kernel holds one accumulator a layer, unrolled
# Rows a program takes at once, and its warps: forward, backward.
BLOCK, NUM_WARPS = 64, 4
BACKWARD_BLOCK, BACKWARD_NUM_WARPS = 32, 2
# tl.dot's input_precision: "tf32x3" (tensor cores) or "ieee" (float32 FMAs).
PRECISION = "tf32x3"
# Backward programs per SM: each owns a run of row blocks (fewer partial sums to reduce).
BACKWARD_PROGRAMS_PER_SM = 4
# Backward programs' partial sums the summing kernel reads at once.
SUM_CHUNK = 64

Tensor = torch.Tensor


def reference(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor]) -> Tensor:
    """The MLP in PyTorch: F.linear and ReLU, in x's dtype."""
    for layer, (weight, bias) in enumerate(zip(weights, biases)):
        x = torch.nn.functional.linear(x, weight, bias)
        if layer < len(weights) - 1:
            x = torch.relu(x)
    return x


def _reference_backward(grad_out, x, weights, biases, need_x: bool) -> list[Tensor]:
    """[dL/dx (zeros unless need_x), dL/dW..., dL/db...] of ``reference``, in PyTorch."""
    inputs = [x]  # each layer's input
    for layer in range(len(weights) - 1):
        inputs.append(torch.relu(torch.nn.functional.linear(inputs[-1], weights[layer], biases[layer])))
    delta = grad_out  # dL/d(output of the layer below)
    grad_w, grad_b = [], []
    for layer in reversed(range(len(weights))):
        rows = inputs[layer].reshape(-1, weights[layer].shape[1])
        flat = delta.reshape(-1, weights[layer].shape[0])
        grad_w.insert(0, flat.T @ rows)
        grad_b.insert(0, flat.sum(0))
        delta = delta @ weights[layer]
        if layer > 0:
            delta = torch.where(inputs[layer] <= 0, 0.0, delta)  # through the ReLU, as threshold_backward
    return [delta if need_x else torch.zeros_like(x), *grad_w, *grad_b]


def _width(weights: Sequence[Tensor], x: Tensor) -> int:
    return max([x.shape[-1], *(w.shape[0] for w in weights)])


def _layer_arguments(x, weights, biases) -> tuple[list, list, int]:
    """The kernels' per-layer arguments: (four weights then four biases, widths c0..c4, the
    padded width WP); the first layer's tensors and width 0 where there is no layer."""
    tensors = [*_four([w.contiguous() for w in weights]), *_four([b.contiguous() for b in biases])]
    widths = [x.shape[-1], *(w.shape[0] for w in weights)]
    wp = max(16, next_power_of_2(max(widths)))
    return tensors, (widths + [0] * TRITON_MAX_LAYERS)[:TRITON_MAX_LAYERS + 1], wp


def _check_triton_widths(x, weights) -> None:
    if not _fits_triton(x.device.type, x.dtype, _width(weights, x), len(weights)):
        raise ValueError(f'weights: backend="triton" takes up to {TRITON_MAX_LAYERS} layers of widths up to '
                         f"{MAX_WIDTH}, got widths {[x.shape[-1], *(w.shape[0] for w in weights)]}")


def _triton_forward(x, weights, biases):
    _check_triton_widths(x, weights)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    out = torch.empty((*x.shape[:-1], weights[-1].shape[0]), dtype=x.dtype, device=x.device)
    if rows and out.numel():
        w_and_b, widths, wp = _layer_arguments(x, weights, biases)
        kernels._forward_kernel[(cdiv(rows, BLOCK),)](
            x.contiguous(), *w_and_b, out, rows, *widths, IN=x.shape[-1], OUT=out.shape[-1], LAYERS=len(weights),
            WP=wp, BLOCK=BLOCK, PRECISION=PRECISION, num_warps=NUM_WARPS)
    elif out.numel():  # no input columns: each row is the last layer of the biases alone
        out.copy_(reference(x.new_zeros((*x.shape[:-1], 0)), weights, biases))
    return out


def _programs(blocks: int, device: torch.device) -> int:
    per_sm = _triton.multiprocessors(device) * BACKWARD_PROGRAMS_PER_SM if device.type == "cuda" else 4
    return max(1, min(blocks, per_sm))


def _triton_backward(grad_out, x, weights, biases, need_x: bool) -> list[Tensor]:
    _check_triton_widths(x, weights)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or grad_out.numel() == 0:
        return _reference_backward(grad_out, x, weights, biases, need_x)
    layers = len(weights)
    w_and_b, widths, wp = _layer_arguments(x, weights, biases)
    blocks = cdiv(rows, BACKWARD_BLOCK)
    programs = _programs(blocks, x.device)
    partials = torch.empty((programs, layers, wp * wp + wp), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x) if need_x else torch.zeros_like(x)
    kernels._backward_kernel[(programs,)](
        x.contiguous(), *w_and_b, grad_out.contiguous(), grad_x, partials, rows, blocks, *widths,
        IN=x.shape[-1], OUT=grad_out.shape[-1], LAYERS=layers, WP=wp, BLOCK=BACKWARD_BLOCK, GRAD_X=need_x,
        PRECISION=PRECISION, num_warps=BACKWARD_NUM_WARPS)
    grad_w = [torch.empty_like(weight) for weight in weights]
    grad_b = [torch.empty_like(bias) for bias in biases]
    kernels._sum_kernel[(layers * (wp + 1),)](partials, programs, *_four(grad_w), *_four(grad_b), *widths, LAYERS=layers,
                                      WP=wp, CHUNK=SUM_CHUNK)
    return [grad_x, *grad_w, *grad_b]


def _four(tensors: list[Tensor]) -> list[Tensor]:
    """The kernel's four per-layer pointers: the layers' tensors, then repeats of the first."""
    return (tensors + tensors[:1] * TRITON_MAX_LAYERS)[:TRITON_MAX_LAYERS]


def _fits_triton(device_type: str, dtype: torch.dtype, width, layers: int, size=None) -> bool:
    return (width is None or width <= MAX_WIDTH) and layers <= TRITON_MAX_LAYERS


BACKENDS = backends.family(
    "narrow_mlp",
    backends.Backend("triton", ops=("narrow_mlp",), devices=_triton.devices(), auto_devices=("cuda",),
                     dtypes=(torch.float16, torch.bfloat16, torch.float32), install=_triton.INSTALL,
                     available=_triton.available, implementation=(_triton_forward, _triton_backward),
                     auto_when=_fits_triton, note='computes in float32 (use backend="torch" for float64)'),
    backends.Backend("torch", ops=("narrow_mlp",), devices=(backends.ANY_DEVICE,),
                     auto_devices=(backends.ANY_DEVICE,), implementation=(reference, _reference_backward)),
)


def _check(x, weights, biases) -> None:
    _validate.floating("x", x)
    if x.dim() < 1:
        raise ValueError("x: expected [..., C_in] rows of features, got a 0-d tensor")
    for name, values in (("weights", weights), ("biases", biases)):
        if not isinstance(values, (list, tuple)) or not values:
            raise TypeError(f"{name}: expected a non-empty list of tensors, got {_validate._describe(values)}")
    if len(weights) > MAX_LAYERS:
        raise ValueError(f"weights: expected at most {MAX_LAYERS} layers, got {len(weights)}")
    if len(biases) != len(weights):
        raise ValueError(f"biases: expected one per layer ({len(weights)}), got {len(biases)}")
    width = x.shape[-1]
    for layer, (weight, bias) in enumerate(zip(weights, biases)):
        for name, value in ((f"weights[{layer}]", weight), (f"biases[{layer}]", bias)):
            _validate.floating(name, value)
            _validate.same_dtype_and_device(name, value, "x", x)
        _validate.rank(f"weights[{layer}]", weight, (2,), "[C_out, C_in] (nn.Linear's weight)")
        if weight.shape[1] != width:
            raise ValueError(f"weights[{layer}]: expected [C_out, {width}] (its input is "
                             f"{'x' if layer == 0 else f'layer {layer - 1}'}'s {width} columns), got {list(weight.shape)}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"biases[{layer}]: expected [{weight.shape[0]}] like weights[{layer}], got "
                             f"{list(bias.shape)}")
        width = weight.shape[0]


def _resolve(backend, x, weights, running: bool = True):
    """The backend for these tensors. "auto" is resolved where the op runs (``running``):
    there, outside a CUDA graph capture, it takes PyTorch's layers (see ``narrow_mlp``)."""
    if backend == "auto" and running and x.is_cuda and not _capturing(x):
        backend = "torch"
    return BACKENDS.resolve(backend, "narrow_mlp", x.device, x.dtype, _width(weights, x), len(weights), argument="x")


@torch.library.custom_op("fullgraph::narrow_mlp", mutates_args=())
def narrow_mlp_op(x: Tensor, weights: list[Tensor], biases: list[Tensor], backend: str) -> Tensor:
    _check(x, weights, biases)
    forward, _ = _resolve(backend, x, weights).implementation
    return forward(x, weights, biases)


@narrow_mlp_op.register_fake
def _(x, weights, biases, backend):
    return x.new_empty((*x.shape[:-1], weights[-1].shape[0]))


@torch.library.custom_op("fullgraph::narrow_mlp_backward", mutates_args=())
def narrow_mlp_backward_op(grad_out: Tensor, x: Tensor, weights: list[Tensor], biases: list[Tensor], backend: str,
                           need_x: bool) -> list[Tensor]:
    """[dL/dx (zeros unless need_x), dL/dW per layer..., dL/db per layer...]."""
    _check(x, weights, biases)
    _validate.floating("grad_out", grad_out)
    expected = (*x.shape[:-1], weights[-1].shape[0])
    if tuple(grad_out.shape) != expected or grad_out.device != x.device:
        raise ValueError(f"grad_out: expected {list(expected)} on {x.device}, got {list(grad_out.shape)} on "
                         f"{grad_out.device}")
    _, backward = _resolve(backend, x, weights).implementation
    return backward(grad_out.to(x.dtype), x, weights, biases, need_x)


@narrow_mlp_backward_op.register_fake
def _(grad_out, x, weights, biases, backend, need_x):
    return [torch.empty_like(x), *(torch.empty_like(w) for w in weights), *(torch.empty_like(b) for b in biases)]


def _setup(ctx, inputs, output):
    x, weights, biases, backend = inputs
    ctx.backend, ctx.layers = backend, len(weights)
    ctx.save_for_backward(x, *weights, *biases)


def _backward(ctx, grad):
    x, *params = ctx.saved_tensors
    weights, biases = params[:ctx.layers], params[ctx.layers:]
    grads = narrow_mlp_backward_op(grad, x, weights, biases, ctx.backend, ctx.needs_input_grad[0])
    return (grads[0] if ctx.needs_input_grad[0] else None, grads[1:1 + ctx.layers], grads[1 + ctx.layers:], None)


narrow_mlp_op.register_autograd(_backward, setup_context=_setup)


def _check_mlp(x, weights, biases, *, backend="auto") -> None:
    _check(x, weights, biases)
    _resolve(backend, x, weights, running=False)  # an explicit backend's refusal, before anything runs


@_contract.checked(_check_mlp)
def narrow_mlp(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor], *, backend: str = "auto") -> Tensor:
    """``Linear(weights[0], biases[0]) -> ReLU -> ... -> Linear(weights[-1], biases[-1])`` on
    every row of x, each pass (forward, backward) one kernel on the "triton" backend.

    Args:
        x: [..., C_0] floating. weights: L (1 to MAX_LAYERS = 8) tensors [C_l+1, C_l] (nn.Linear's
            ``weight``), biases: L tensors [C_l+1]; x's dtype and device.
        backend: "triton" (CUDA; up to 4 layers of widths C_l at most MAX_WIDTH = 32; float16, bfloat16 and
            float32 computed in float32, products as three TF32 products; see the module
            docstring), "torch" (``F.linear`` and ``relu``) or "auto": "triton" where the
            layers allow and the call is being captured into a CUDA graph (``mode="reduce-overhead"``,
            ``fullgraph.graphs``), else "torch". As called, one Triton launch costs the host more
            than the layers' few cuBLAS launches and the GPU waits on the host at these sizes
            (H100, 10^5 x (3, 25, 25, 25) forward + backward: eager 1.68 against 1.10 ms;
            graphed 0.12 against 0.25 ms),
            so eager calls run PyTorch's layers directly, and so do calls compiled for other
            devices. Under torch.compile on CUDA without CUDA graphs the operator runs
            PyTorch's layers inside it (one dispatch more than the layers compiled alone:
            compile with CUDA graphs for the kernels).

    Returns:
        [..., C_L] in x's dtype; differentiable in x, weights and biases (deterministic).

    Example:
        >>> import torch, fullgraph
        >>> layers = [torch.nn.Linear(3, 25), torch.nn.Linear(25, 25), torch.nn.Linear(25, 8)]
        >>> x = torch.randn(1000, 3)
        >>> fullgraph.narrow_mlp(x, [l.weight for l in layers], [l.bias for l in layers]).shape
        torch.Size([1000, 8])
    """
    if backend == "auto" and not (x.is_cuda and (torch.compiler.is_compiling() or _capturing(x))):
        # As called, or compiled for a device without the kernels: PyTorch's own layers (which
        # the compiler fuses and differentiates), without an operator's dispatch.
        return reference(x, weights, biases)
    return torch.ops.fullgraph.narrow_mlp(x, list(weights), list(biases), backend)


def _capturing(x: Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()
