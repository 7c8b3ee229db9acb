"""The Triton kernels of ``conv_groupnorm_mish`` (``conv_block`` launches them)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _partial_sum(partial, bias, offset, index, live, channel, split_stride, FIRST: tl.constexpr,
                 COUNT: tl.constexpr):
    """A product at flat indices of a group: bias plus partials FIRST .. FIRST + COUNT - 1."""
    y = tl.load(bias + channel, mask=live, other=0.0).to(tl.float32)
    for s in tl.static_range(FIRST, FIRST + COUNT):  # .cg: written by other programs of this launch
        y += tl.load(partial + s * split_stride + offset + index, mask=live, other=0.0, cache_modifier=".cg")
    return y

@triton.jit
def _group_values(partial, bias, offset, index, live, channel, split_stride, SPLITS: tl.constexpr):
    """The conv output at flat indices of a group: the partials' sum plus the bias."""
    return _partial_sum(partial, bias, offset, index, live, channel, split_stride, 0, SPLITS)

@triton.jit
def _finish(y, mean, inverse, index, live, channel, step, b, gamma, beta, scale, shift, residual, residual_bias,
            partial, out, offset, split_stride, scale_strides, shift_strides, residual_strides,
            HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr,
            RESIDUAL_SPLITS: tl.constexpr):
    """out = mish(gamma (y - mean) inverse + beta) * scale + shift + residual, the residual
    either read, or its 1x1 convolution's partials (after the SPLITS of the block's) summed."""
    z = (y - mean) * inverse * tl.load(gamma + channel, mask=live, other=0.0).to(tl.float32) \
        + tl.load(beta + channel, mask=live, other=0.0).to(tl.float32)
    # mish(z) = z tanh(softplus(z)); with n = e^z, tanh(log(1 + n)) = n (n + 2) / (n (n + 2) + 2),
    # free of cancellation for z far below 0, and 1 from z = 20 on (PyTorch's threshold).
    n = tl.exp(tl.minimum(z, 20.0))
    result = z * tl.where(z >= 20.0, 1.0, n * (n + 2.0) / (n * (n + 2.0) + 2.0))
    if HAS_SCALE:
        result *= tl.load(scale + b * scale_strides[0] + channel * scale_strides[1], mask=live,
                          other=0.0).to(tl.float32)
    if HAS_SHIFT:
        result += tl.load(shift + b * shift_strides[0] + channel * shift_strides[1], mask=live,
                          other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        at = b * residual_strides[0] + channel * residual_strides[1] + step * residual_strides[2]
        result += tl.load(residual + at, mask=live, other=0.0).to(tl.float32)
    if RESIDUAL_SPLITS > 0:
        result += _partial_sum(partial, residual_bias, offset, index, live, channel, split_stride, SPLITS,
                               RESIDUAL_SPLITS)
    tl.store(out + offset + index, result.to(out.dtype.element_ty), mask=live)

@triton.jit
def _normalize_group(partial, bias, gamma, beta, scale, shift, residual, residual_bias, out, b, group, c_out,
                     length, per_group, eps, split_stride, scale_strides, shift_strides, residual_strides,
                     HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     SPLITS: tl.constexpr, RESIDUAL_SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                     ONE_BLOCK: tl.constexpr):
    """A (batch item, group), flat over its channels and steps: its mean, then its mean
    squared deviation (exact divisions), then every element's output (``_finish``)."""
    eps = tl.cast(eps, tl.float32)  # Inductor's launches (a traced triton_op) pass floats as float64
    c0 = group * per_group
    offset = (b * c_out + c0).to(tl.int64) * length
    size = per_group * length
    count = size.to(tl.float32)
    if ONE_BLOCK:
        index = tl.arange(0, BLOCK)
        live = index < size
        channel, step = c0 + index // length, index % length
        y = _group_values(partial, bias, offset, index, live, channel, split_stride, SPLITS)
        mean = tl.div_rn(tl.sum(tl.where(live, y, 0.0), 0), count)
        deviation = tl.where(live, y - mean, 0.0)
        inverse = 1.0 / tl.sqrt_rn(tl.div_rn(tl.sum(deviation * deviation, 0), count) + eps)
        _finish(y, mean, inverse, index, live, channel, step, b, gamma, beta, scale, shift, residual,
                residual_bias, partial, out, offset, split_stride, scale_strides, shift_strides,
                residual_strides, HAS_SCALE, HAS_SHIFT, HAS_RESIDUAL, SPLITS, RESIDUAL_SPLITS)
    else:
        total = tl.zeros((BLOCK,), tl.float32)
        for first in range(0, size, BLOCK):
            index = first + tl.arange(0, BLOCK)
            live = index < size
            y = _group_values(partial, bias, offset, index, live, c0 + index // length, split_stride, SPLITS)
            total += tl.where(live, y, 0.0)
        mean = tl.div_rn(tl.sum(total, 0), count)
        total = tl.zeros((BLOCK,), tl.float32)
        for first in range(0, size, BLOCK):
            index = first + tl.arange(0, BLOCK)
            live = index < size
            y = _group_values(partial, bias, offset, index, live, c0 + index // length, split_stride, SPLITS)
            deviation = tl.where(live, y - mean, 0.0)
            total += deviation * deviation
        inverse = 1.0 / tl.sqrt_rn(tl.div_rn(tl.sum(total, 0), count) + eps)
        for first in range(0, size, BLOCK):
            index = first + tl.arange(0, BLOCK)
            live = index < size
            channel, step = c0 + index // length, index % length
            y = _group_values(partial, bias, offset, index, live, channel, split_stride, SPLITS)
            _finish(y, mean, inverse, index, live, channel, step, b, gamma, beta, scale, shift, residual,
                    residual_bias, partial, out, offset, split_stride, scale_strides, shift_strides,
                    residual_strides, HAS_SCALE, HAS_SHIFT, HAS_RESIDUAL, SPLITS, RESIDUAL_SPLITS)

@triton.jit
def _product(x, w, start, end, taps_total, x_strides, b, steps, columns, total, length, channels, c_out,
             KERNEL: tl.constexpr, PAD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    """sum over (i, j) pairs start .. end - 1 of w[c, i, j] x[b, i, t + j - PAD]: [BLOCK_C, BLOCK_N]
    float32 for the program's channels and (b, t) columns."""
    weight_rows, weight_live = w + channels[:, None] * taps_total, channels[:, None] < c_out
    rows = start + tl.arange(0, BLOCK_K)  # (input channel, tap) pairs, channel-major
    # The weights depend on no earlier kernel: launched as a programmatic dependent launch
    # (PDL), the first block loads while the kernel before finishes; then wait for it.
    weights = tl.load(weight_rows + rows[None, :], mask=weight_live & (rows[None, :] < end), other=0.0)
    if PDL:
        # The next kernel may launch now and load its own weights; its wait still holds it
        # until this whole grid has finished and its writes are visible.
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros((BLOCK_C, BLOCK_N), tl.float32)
    for first in range(start, end, BLOCK_K):
        rows = first + tl.arange(0, BLOCK_K)
        source = steps[None, :] + (rows % KERNEL)[:, None] - PAD
        inside = (rows[:, None] < end) & (columns[None, :] < total) & (source >= 0) & (source < length)
        at = b[None, :] * x_strides[0] + (rows // KERNEL)[:, None] * x_strides[1] + source * x_strides[2]
        window = tl.load(x + at, mask=inside, other=0.0)
        following = rows + BLOCK_K
        upcoming = tl.load(weight_rows + following[None, :], mask=weight_live & (following[None, :] < end),
                           other=0.0)
        if UPCAST:
            weights, window = weights.to(tl.float32), window.to(tl.float32)
        acc += tl.dot(weights, window, input_precision=PRECISION)
        weights = upcoming
    return acc

@triton.jit
def _conv_kernel(x, w, partial, counters, bias, gamma, beta, scale, shift, residual, residual_weight,
                 residual_bias, out, batch, c_in, c_out, c_residual, length, taps_total, chunk, groups, per_group,
                 eps, x_stride_b, x_stride_c, x_stride_t, scale_stride_b, scale_stride_c, shift_stride_b,
                 shift_stride_c, residual_stride_b, residual_stride_c, residual_stride_t, KERNEL: tl.constexpr,
                 PAD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, FINALIZE: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 SPLITS: tl.constexpr, RESIDUAL_SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                 ONE_BLOCK: tl.constexpr):
    """partial[s, b, c, t] = sum over the s-th chunk of (i, j) pairs of w[c, i, j] x[b, i, t + j - PAD],
    a program per tile of output channels, tile of (b, t) columns (a tile spans batch items,
    so small batches share each weight load) and chunk; chunks SPLITS on are the residual's
    1x1 convolution (residual_weight [c, i] by residual [b, i, t]). With FINALIZE, the
    program that completes a (batch item, group) normalizes it. Strides come one by one
    (``wrap_triton`` takes no tuples)."""
    x_strides = (x_stride_b, x_stride_c, x_stride_t)
    scale_strides, shift_strides = (scale_stride_b, scale_stride_c), (shift_stride_b, shift_stride_c)
    residual_strides = (residual_stride_b, residual_stride_c, residual_stride_t)
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    total = batch * length
    b = (columns // length).to(tl.int64)
    steps = columns % length
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(2)
    if RESIDUAL_SPLITS == 0:
        start = split * chunk
        acc = _product(x, w, start, tl.minimum(start + chunk, taps_total), taps_total, x_strides, b, steps,
                       columns, total, length, channels, c_out, KERNEL, PAD, BLOCK_C, BLOCK_N, BLOCK_K,
                       PRECISION, UPCAST, PDL)
    elif split < SPLITS:
        start = split * chunk
        acc = _product(x, w, start, tl.minimum(start + chunk, taps_total), taps_total, x_strides, b, steps,
                       columns, total, length, channels, c_out, KERNEL, PAD, BLOCK_C, BLOCK_N, BLOCK_K,
                       PRECISION, UPCAST, PDL)
    else:
        start = (split - SPLITS) * chunk
        acc = _product(residual, residual_weight, start, tl.minimum(start + chunk, c_residual), c_residual,
                       residual_strides, b, steps, columns, total, length, channels, c_out, 1, 0, BLOCK_C,
                       BLOCK_N, BLOCK_K, PRECISION, UPCAST, PDL)
    live = (channels[:, None] < c_out) & (columns[None, :] < total)
    split_stride = batch * c_out * length
    at = split * split_stride + (b[None, :] * c_out + channels[:, None]) * length + steps[None, :]
    tl.store(partial + at, acc, mask=live)
    if FINALIZE:
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        low_c, low_n = tl.program_id(1) * BLOCK_C, tl.program_id(0) * BLOCK_N
        for item in range(low_n // length, (tl.minimum(low_n + BLOCK_N, total) - 1) // length + 1):
            column_tiles = ((item + 1) * length - 1) // BLOCK_N - (item * length) // BLOCK_N + 1
            for group in range(low_c // per_group, (tl.minimum(low_c + BLOCK_C, c_out) - 1) // per_group + 1):
                channel_tiles = ((group + 1) * per_group - 1) // BLOCK_C - (group * per_group) // BLOCK_C + 1
                counter = counters + item * groups + group
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == channel_tiles * column_tiles * (SPLITS + RESIDUAL_SPLITS) - 1:
                    tl.store(counter, 0)  # zero again for the next launch
                    _normalize_group(partial, bias, gamma, beta, scale, shift, residual, residual_bias, out,
                                     item, group, c_out, length, per_group, eps, split_stride, scale_strides,
                                     shift_strides, residual_strides, HAS_SCALE, HAS_SHIFT, HAS_RESIDUAL, SPLITS,
                                     RESIDUAL_SPLITS, BLOCK, ONE_BLOCK)

@triton.jit
def _norm_kernel(partial, bias, gamma, beta, scale, shift, residual, residual_bias, out, batch, groups, c_out,
                 length, per_group, eps, scale_stride_b, scale_stride_c, shift_stride_b, shift_stride_c,
                 residual_stride_b, residual_stride_c, residual_stride_t, HAS_SCALE: tl.constexpr,
                 HAS_SHIFT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr,
                 RESIDUAL_SPLITS: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """The two-kernel form's second kernel: a program per (batch item, group)."""
    scale_strides, shift_strides = (scale_stride_b, scale_stride_c), (shift_stride_b, shift_stride_c)
    residual_strides = (residual_stride_b, residual_stride_c, residual_stride_t)
    b = (tl.program_id(0) // groups).to(tl.int64)
    _normalize_group(partial, bias, gamma, beta, scale, shift, residual, residual_bias, out, b,
                     tl.program_id(0) % groups, c_out, length, per_group, eps, batch * c_out * length,
                     scale_strides, shift_strides, residual_strides, HAS_SCALE, HAS_SHIFT, HAS_RESIDUAL, SPLITS,
                     RESIDUAL_SPLITS, BLOCK, ONE_BLOCK)
