"""Diffusion Policy's Conv1d -> GroupNorm -> Mish block as one operator:
``fullgraph.conv_groupnorm_mish`` (``torch.ops.fullgraph.conv_groupnorm_mish``), with the
residual block's epilogue (FiLM's per-channel scale and shift, a residual or the 1x1
convolution of one) folded in.

The "triton" backend is one kernel. The convolution ("same" padding, odd kernel) is a matrix
product over (input channel, tap) pairs read straight from x (strided; no padded or unfolded
copy): a program per tile of output channels, tile of (batch item, step) columns and chunk of
the pairs (split-K: at batch 1 the weights are most of the bytes, and enough programs to fill
the GPU must share each channel tile's rows); each writes its float32 partial product and
counts its arrival on the (batch item, group) counters it covers. The program that arrives
last at a group sums the group's partials and the bias, takes the mean and then the mean
squared deviation (two passes over values in registers, exact divisions: no cancellation),
normalizes, applies the affine, Mish and the epilogue, writes x's dtype, and zeroes the
counter again, so the per-device counters (``_arrival_counters``) never need a fill kernel.
A residual's 1x1 convolution is more chunks of the same kind (its channels the pairs), whose
partials the last program adds after Mish.
On sm_90 and later the kernel is a programmatic dependent launch: its first weights load,
and the next kernel may launch, before it waits for the kernel before it. ``ONE_KERNEL =
False`` normalizes in a second kernel instead (kept for measurement).

The "torch" backend is ``F.conv1d``, ``F.group_norm``, ``F.mish``: the reference. "auto"
takes "triton" on CUDA for few columns (``AUTO_MAX_COLUMNS``, measured), "torch" elsewhere.
The backward is written with PyTorch operations (the convolution's through
``aten.convolution_backward``), recomputing the convolution: no fused backward kernel.

For packages, ``fullgraph::conv_groupnorm_mish_traced`` is the same block as a
``torch.library.triton_op`` (``decompositions()`` maps the operator to it): Inductor traces
into it and an AOTInductor package carries its kernels (NOTES.md: why the operator itself is not).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _contract, _triton, _validate, backends
from .._triton import cdiv, lazy, next_power_of_2

kernels = lazy(f"{__package__}.conv_block_kernels")


# Elements of a group the normalization holds at once; larger groups are re-read per pass.
GROUP_BLOCK = 4096
# Split-K: aim for this many programs per SM, each with at least MIN_SPLIT_BLOCKS blocks of pairs.
PROGRAMS_PER_SM = 4
MIN_SPLIT_BLOCKS = 2
MAX_SPLITS = 32
# The widest block of (channel, tap) pairs a product step takes, and output channels a program.
MAX_BLOCK_K = 64
BLOCK_C = 32
# Normalize in the product kernel (its last program to finish a group does it; counted on zeroed
# counters) rather than in a second kernel.
ONE_KERNEL = True
# Arrival counters kept per device, zeroed once: each launch counts on its own slice and leaves
# it zeroed, so no launch needs a fill kernel. A launch that needs more takes fresh zeros.
COUNTER_SLOTS = 1 << 16
# Launch the product kernel as a programmatic dependent launch where the GPU has it (sm_90 on).
PDL = True
_COUNTERS: dict[torch.device, list] = {}


def epilogue(result, scale, shift, residual, residual_weight=None, residual_bias=None):
    """result * scale[:, :, None] + shift[:, :, None] + residual, for the ones given; with
    ``residual_weight`` [C_out, C_res], the residual [B, C_res, T] through that 1x1 convolution."""
    if scale is not None:
        result = result * scale[:, :, None]
    if shift is not None:
        result = result + shift[:, :, None]
    if residual_weight is not None:
        residual = F.conv1d(residual, residual_weight[:, :, None], residual_bias)
    return result if residual is None else result + residual


def reference(x, weight, bias, gamma, beta, groups: int, eps: float, scale=None, shift=None, residual=None,
              residual_weight=None, residual_bias=None):
    """The block in PyTorch: Conv1d ("same" padding), GroupNorm, Mish, then the epilogue."""
    block = F.mish(F.group_norm(F.conv1d(x, weight, bias, padding=weight.shape[-1] // 2), groups, gamma, beta, eps))
    return epilogue(block, scale, shift, residual, residual_weight, residual_bias)


def _arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """``count`` zeroed int32 counters for one launch of the one-kernel form, which leaves them
    zeroed: a rotating slice of the device's COUNTER_SLOTS (created outside a CUDA-graph
    capture; while one captures without it, or for more, fresh zeros: a fill in the graph).
    Launches that run at the same time (other streams, a graph replayed beside eager calls)
    take different slices unless COUNTER_SLOTS / count launches come between them."""
    state = _COUNTERS.get(device)
    if state is None and count <= COUNTER_SLOTS and _validate.values_readable(device):
        state = _COUNTERS[device] = [torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device), 0]
    if state is None or count > COUNTER_SLOTS:
        return torch.zeros(count, dtype=torch.int32, device=device)
    buffer, start = state
    start = 0 if start + count > COUNTER_SLOTS else start
    state[1] = start + count
    return buffer[start:start + count]


def _splits(programs: int, taps: int, block_k: int, device: torch.device) -> int:
    """Chunks of the (channel, tap) pairs: enough programs for PROGRAMS_PER_SM on every SM."""
    if device.type != "cuda":
        return 1
    wanted = PROGRAMS_PER_SM * _triton.multiprocessors(device) // programs
    return max(1, min(wanted, MAX_SPLITS, taps // (MIN_SPLIT_BLOCKS * block_k)))


def _triton_block(x, weight, bias, gamma, beta, groups: int, eps: float, scale=None, shift=None, residual=None,
                  residual_weight=None, residual_bias=None, splits: int | None = None, one_kernel: bool | None = None):
    batch, c_in, length = x.shape
    c_out, _, kernel = weight.shape
    out = torch.empty((batch, c_out, length), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    taps = c_in * kernel
    block_c = BLOCK_C if c_out >= BLOCK_C else 16
    block_n = min(64, max(16, next_power_of_2(batch * length)))
    block_k = min(MAX_BLOCK_K, max(16, next_power_of_2(taps)))
    column_tiles, channel_tiles = cdiv(batch * length, block_n), cdiv(c_out, block_c)
    if splits is None:
        splits = _splits(column_tiles * channel_tiles, taps, block_k, x.device)
    chunk = cdiv(cdiv(taps, splits), block_k) * block_k
    splits = cdiv(taps, chunk)  # no empty chunk
    c_residual = 0 if residual_weight is None else residual_weight.shape[1]
    residual_splits = cdiv(c_residual, chunk)  # the residual's 1x1 convolution, in chunks as long
    if residual_weight is not None and residual_bias is None:
        residual_bias = torch.zeros(c_out, dtype=x.dtype, device=x.device)
    partial = torch.empty((splits + residual_splits, batch, c_out, length), dtype=torch.float32, device=x.device)
    one_kernel = ONE_KERNEL if one_kernel is None else one_kernel
    traced = _triton.tracing(x)
    if not one_kernel:
        counters = partial
    elif traced:  # a program Inductor compiles holds no device state: zeros of its own
        counters = torch.zeros(batch * groups, dtype=torch.int32, device=x.device)
    else:
        counters = _arrival_counters(x.device, batch * groups)
    per_group = c_out // groups
    size = per_group * length
    block = min(GROUP_BLOCK, next_power_of_2(size))
    finish = dict(scale=out if scale is None else scale, shift=out if shift is None else shift,
                  residual=out if residual is None else residual,
                  residual_bias=bias if residual_bias is None else residual_bias, out=out, per_group=per_group,
                  eps=float(eps),
                  **_strides("scale", scale, 2), **_strides("shift", shift, 2), **_strides("residual", residual, 3),
                  HAS_SCALE=scale is not None, HAS_SHIFT=shift is not None,
                  HAS_RESIDUAL=residual is not None and residual_weight is None, SPLITS=splits,
                  RESIDUAL_SPLITS=residual_splits, BLOCK=block, ONE_BLOCK=size <= block)
    # A traced launch (Inductor, AOTInductor) takes no launch_pdl: a plain launch there.
    pdl = PDL and not traced and x.is_cuda and not _triton.INTERPRETED \
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    precision = "tf32" if x.dtype == torch.float32 and torch.backends.cudnn.allow_tf32 and x.is_cuda else "ieee"
    # Traced (the triton_op form under Inductor) through wrap_triton; called, plain launches.
    conv, norm = kernels._conv_kernel, kernels._norm_kernel
    if traced:
        conv, norm = _triton.traced(conv), _triton.traced(norm)
    conv[(column_tiles, channel_tiles, splits + residual_splits)](
        x, weight.reshape(c_out, taps), partial, counters, bias, gamma, beta,
        residual_weight=out if residual_weight is None else residual_weight, batch=batch, c_in=c_in, c_out=c_out,
        c_residual=c_residual, length=length, taps_total=taps, chunk=chunk, groups=groups, **_strides("x", x, 3),
        KERNEL=kernel, PAD=kernel // 2, BLOCK_C=block_c, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        # Triton 3.6's interpreter (CPU tests) returns garbage from a bfloat16 tl.dot: products in float32 there.
        UPCAST=_triton.INTERPRETED and x.dtype == torch.bfloat16, PDL=pdl, FINALIZE=one_kernel, num_warps=4,
        **({"launch_pdl": True} if pdl else {}), **finish)
    if not one_kernel:
        norm[(batch * groups,)](
            partial, bias, gamma, beta, batch=batch, groups=groups, c_out=c_out, length=length,
            num_warps=4 if block <= 2048 else 8, **finish)
    return out


def _strides(name: str, tensor, rank: int) -> dict:
    """The kernels' ``{name}_stride_b``, ``_c`` (and ``_t``) arguments; zeros for an absent tensor."""
    strides = (0,) * rank if tensor is None else tensor.stride()
    return {f"{name}_stride_{axis}": stride for axis, stride in zip("bct", strides)}


# "auto" takes the fused kernel on CUDA up to this many (batch item, step) columns, the PyTorch
# reference beyond.
AUTO_MAX_COLUMNS = 128


def _few_columns(device_type: str, dtype: torch.dtype, columns, k: int, size=None) -> bool:
    return columns is None or columns <= AUTO_MAX_COLUMNS


# Backends of the family; "dim" in their rules is the B * T columns of the block.
BACKENDS = backends.family(
    "conv_groupnorm_mish",
    backends.Backend("triton", ops=("conv_groupnorm_mish",), devices=_triton.devices(), auto_devices=("cuda",),
                     dtypes=(torch.float16, torch.bfloat16, torch.float32), install=_triton.INSTALL,
                     available=_triton.available, implementation=_triton_block, auto_when=_few_columns,
                     note='computes in float32 (use backend="torch" for float64)'),
    backends.Backend("torch", ops=("conv_groupnorm_mish",), devices=(backends.ANY_DEVICE,),
                     auto_devices=(backends.ANY_DEVICE,), implementation=reference),
)


def _check(x, weight, bias, gamma, beta, groups, eps, scale=None, shift=None, residual=None, residual_weight=None,
           residual_bias=None) -> None:
    for name, value in (("x", x), ("weight", weight), ("bias", bias), ("gamma", gamma), ("beta", beta),
                        ("scale", scale), ("shift", shift), ("residual", residual),
                        ("residual_weight", residual_weight), ("residual_bias", residual_bias)):
        if value is None and name not in ("x", "weight", "bias", "gamma", "beta"):
            continue
        _validate.floating(name, value)
        if name != "x":
            _validate.same_dtype_and_device(name, value, "x", x)
    _validate.rank("x", x, (3,), "[B, C_in, T]")
    if x.shape[2] < 1:
        raise ValueError(f"x: expected at least one time step, got shape {list(x.shape)}")
    _validate.rank("weight", weight, (3,), "[C_out, C_in, kernel]")
    c_out, c_in, kernel = weight.shape
    if x.shape[1] < 1 or c_out < 1:
        raise ValueError(f"x, weight: expected at least one input and one output channel, got x {list(x.shape)}, "
                         f"weight {list(weight.shape)}")
    if c_in != x.shape[1]:
        raise ValueError(f"weight: expected [C_out, C_in = {x.shape[1]}, kernel] for x {list(x.shape)}, got "
                         f"{list(weight.shape)}")
    if kernel % 2 == 0:
        raise ValueError(f"weight: expected an odd kernel size (same padding), got {kernel}")
    for name, value in (("bias", bias), ("gamma", gamma), ("beta", beta)):
        if tuple(value.shape) != (c_out,):
            raise ValueError(f"{name}: expected [C_out] = [{c_out}], got {list(value.shape)}")
    batch, length = x.shape[0], x.shape[2]
    residual_layout, residual_shape = "[B, C_out, T]", (batch, c_out, length)
    if residual_weight is not None:
        if residual is None:
            raise ValueError("residual_weight: given without a residual (the 1x1 convolution's input)")
        _validate.rank("residual_weight", residual_weight, (2,), "[C_out, C_res]")
        if residual_weight.shape[0] != c_out:
            raise ValueError(f"residual_weight: expected [C_out = {c_out}, C_res], got {list(residual_weight.shape)}")
        residual_layout, residual_shape = "[B, C_res, T]", (batch, residual_weight.shape[1], length)
    elif residual_bias is not None:
        raise ValueError("residual_bias: given without a residual_weight")
    for name, value, layout, shape in (("scale", scale, "[B, C_out]", (batch, c_out)),
                                       ("shift", shift, "[B, C_out]", (batch, c_out)),
                                       ("residual", residual, residual_layout, residual_shape),
                                       ("residual_bias", residual_bias, "[C_out]", (c_out,))):
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name}: expected {layout} = {list(shape)}, got {list(value.shape)}")
    groups = _validate.integer("groups", groups, minimum=1)
    if c_out % groups:
        raise ValueError(f"groups: expected a divisor of C_out = {c_out}, got {groups}")
    _validate.real("eps", eps, minimum=0.0, strict=True)


def _forward(x, weight, bias, gamma, beta, groups, eps, backend, scale, shift, residual, residual_weight,
             residual_bias):
    _check(x, weight, bias, gamma, beta, groups, eps, scale, shift, residual, residual_weight, residual_bias)
    run = BACKENDS.resolve(backend, "conv_groupnorm_mish", x.device, x.dtype, x.shape[0] * x.shape[2],
                           argument="x").implementation
    return run(x, weight.contiguous(), bias.contiguous(), gamma.contiguous(), beta.contiguous(), groups, eps, scale,
               shift, residual, None if residual_weight is None else residual_weight.contiguous(),
               None if residual_bias is None else residual_bias.contiguous())


@torch.library.custom_op("fullgraph::conv_groupnorm_mish", mutates_args=())
def conv_groupnorm_mish_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gamma: torch.Tensor,
                           beta: torch.Tensor, groups: int, eps: float, backend: str,
                           scale: torch.Tensor | None = None, shift: torch.Tensor | None = None,
                           residual: torch.Tensor | None = None, residual_weight: torch.Tensor | None = None,
                           residual_bias: torch.Tensor | None = None) -> torch.Tensor:
    return _forward(x, weight, bias, gamma, beta, groups, eps, backend, scale, shift, residual, residual_weight,
                    residual_bias)


@conv_groupnorm_mish_op.register_fake
def _(x, weight, bias, gamma, beta, groups, eps, backend, scale=None, shift=None, residual=None, residual_weight=None,
      residual_bias=None):
    return x.new_empty((x.shape[0], weight.shape[0], x.shape[2]))


@_triton.op("fullgraph::conv_groupnorm_mish_traced")
def conv_groupnorm_mish_traced_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gamma: torch.Tensor,
                                  beta: torch.Tensor, groups: int, eps: float, backend: str,
                                  scale: torch.Tensor | None = None, shift: torch.Tensor | None = None,
                                  residual: torch.Tensor | None = None, residual_weight: torch.Tensor | None = None,
                                  residual_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The block as a ``torch.library.triton_op``: Inductor traces into it, so an AOTInductor
    package holds its kernel. Traced, a launch counts arrivals on zeros of its own (a fill) and
    is no programmatic dependent launch: the public operator stays opaque to torch.compile."""
    return _forward(x, weight, bias, gamma, beta, groups, eps, backend, scale, shift, residual, residual_weight,
                    residual_bias)


def decompositions() -> dict:
    """{``fullgraph::conv_groupnorm_mish``: its triton_op form}, for
    ``ExportedProgram.run_decompositions``: an AOTInductor package of the program carries the
    blocks' Triton kernels and runs without Python (docs/deploy.md)."""
    return {torch.ops.fullgraph.conv_groupnorm_mish.default: torch.ops.fullgraph.conv_groupnorm_mish_traced.default}


def _setup(ctx, inputs, output):
    x, weight, bias, gamma, beta, groups, eps, _, scale, shift, residual, residual_weight, residual_bias = inputs
    ctx.groups, ctx.eps = groups, eps
    ctx.epilogue = (scale is not None, shift is not None, residual is not None, residual_bias is not None)
    ctx.save_for_backward(x, weight, bias, gamma, beta, scale, residual, residual_weight)


def _backward(ctx, grad):
    """The block's gradients from its forward recomputed in PyTorch (float32, or float64)."""
    x, weight, bias, gamma, beta, scale, residual, residual_weight = ctx.saved_tensors
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc, wc, gc, grad = x.to(compute), weight.to(compute), gamma.to(compute), grad.to(compute)
    pad = weight.shape[-1] // 2
    y = F.conv1d(xc, wc, bias.to(compute), padding=pad)
    batch, channels, length = y.shape
    grouped = y.reshape(batch, ctx.groups, -1)
    mean = grouped.mean(-1, keepdim=True)
    inverse = torch.rsqrt(grouped.var(-1, unbiased=False, keepdim=True) + ctx.eps)
    normalized = ((grouped - mean) * inverse).reshape_as(y)
    z = normalized * gc[:, None] + beta.to(compute)[:, None]
    squashed = torch.tanh(F.softplus(z))
    has_scale, has_shift, has_residual, has_residual_bias = ctx.epilogue
    d_scale = (grad * z * squashed).sum(2) if has_scale else None
    d_shift = grad.sum(2) if has_shift else None
    d_residual = grad if has_residual else None
    d_residual_weight = d_residual_bias = None
    if residual_weight is not None:  # the residual through its 1x1 convolution
        d_residual = torch.einsum("bot,oc->bct", grad, residual_weight.to(compute))
        d_residual_weight = torch.einsum("bot,bct->oc", grad, residual.to(compute))
        d_residual_bias = grad.sum((0, 2)) if has_residual_bias else None
    d_mish = grad * scale.to(compute)[:, :, None] if has_scale else grad
    d_z = d_mish * (squashed + z * torch.sigmoid(z) * (1 - squashed * squashed))
    d_gamma, d_beta = (d_z * normalized).sum((0, 2)), d_z.sum((0, 2))
    d_norm = (d_z * gc[:, None]).reshape(batch, ctx.groups, -1)
    flat = normalized.reshape(batch, ctx.groups, -1)
    d_y = inverse * (d_norm - d_norm.mean(-1, keepdim=True) - flat * (d_norm * flat).mean(-1, keepdim=True))
    d_x, d_weight, d_bias = torch.ops.aten.convolution_backward(
        d_y.reshape_as(y), xc, wc, [channels], [1], [pad], [1], False, [0], 1, list(ctx.needs_input_grad[:3]))
    grads = (d_x, d_weight, d_bias, d_gamma, d_beta, None, None, None, d_scale, d_shift, d_residual, d_residual_weight,
             d_residual_bias)
    return tuple(g.to(x.dtype) if g is not None and need else None for g, need in zip(grads, ctx.needs_input_grad))


conv_groupnorm_mish_op.register_autograd(_backward, setup_context=_setup)


def _check_block(x, weight, bias, gamma, beta, groups, *, eps=1e-5, scale=None, shift=None, residual=None,
                 residual_weight=None, residual_bias=None, backend="auto") -> None:
    _check(x, weight, bias, gamma, beta, groups, eps, scale, shift, residual, residual_weight, residual_bias)
    BACKENDS.resolve(backend, "conv_groupnorm_mish", x.device, x.dtype, x.shape[0] * x.shape[2], argument="x")


@_contract.checked(_check_block)
def conv_groupnorm_mish(x, weight, bias, gamma, beta, groups: int, *, eps: float = 1e-5, scale=None, shift=None,
                        residual=None, residual_weight=None, residual_bias=None, backend: str = "auto"):
    """Conv1d ("same" padding) -> GroupNorm(groups) -> Mish in one operator, then the
    residual block's epilogue: ``mish(...) * scale + shift + residual`` for those given, the
    residual optionally through a 1x1 convolution (the skip path of a residual block whose
    channel count changes).

    Args:
        x: [B, C_in, T] floating. weight: [C_out, C_in, kernel] (odd kernel), bias: [C_out],
            gamma, beta: [C_out] (GroupNorm's affine); one dtype and device.
        groups: GroupNorm's groups, a divisor of C_out. eps: GroupNorm's epsilon, > 0.
        scale, shift: optional [B, C_out] (FiLM's per-channel scale and shift; any strides).
        residual: optional [B, C_out, T], added last; with ``residual_weight`` [C_out, C_res]
            (and optional ``residual_bias`` [C_out]), [B, C_res, T], and what is added is
            ``conv1d(residual, residual_weight[:, :, None], residual_bias)``.
        backend: "torch" (F.conv1d, F.group_norm, F.mish), "triton" (the fused kernel, float32
            arithmetic, CUDA; see the module docstring) or "auto" ("triton" on CUDA up to
            AUTO_MAX_COLUMNS = 128 columns B * T, where it was measured faster; else "torch").

    Returns:
        [B, C_out, T] in x's dtype; differentiable in every tensor.

    Example:
        >>> import torch, fullgraph
        >>> x, w = torch.randn(2, 4, 16), torch.randn(8, 4, 5)
        >>> ones, zeros = torch.ones(8), torch.zeros(8)
        >>> fullgraph.conv_groupnorm_mish(x, w, zeros, ones, zeros, groups=2, scale=torch.rand(2, 8)).shape
        torch.Size([2, 8, 16])
    """
    backend = BACKENDS.resolve(backend, "conv_groupnorm_mish", x.device, x.dtype, x.shape[0] * x.shape[2],
                               argument="x").name
    return torch.ops.fullgraph.conv_groupnorm_mish(x, weight, bias, gamma, beta, groups, eps, backend, scale, shift,
                                                   residual, residual_weight, residual_bias)
