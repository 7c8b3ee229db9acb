"""The Triton kernels of ``narrow_mlp`` (``mlp`` launches them)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _weights(w, fan_in, fan_out, cols):
    """nn.Linear's weight [fan_out, fan_in] as float32 [WP, WP], zero-padded."""
    mask = (cols < fan_out)[:, None] & (cols < fan_in)[None, :]
    return tl.load(w + cols[:, None] * fan_in + cols[None, :], mask=mask, other=0.0).to(tl.float32)

@triton.jit
def _bias(b, fan_out, cols):
    return tl.load(b + cols, mask=cols < fan_out, other=0.0).to(tl.float32)

@triton.jit
def _layer(a, weights, bias, RELU: tl.constexpr, PRECISION: tl.constexpr):
    """a [BLOCK, WP] -> a @ W^T + b (ReLU'd if RELU; NaN kept, as torch.relu)."""
    h = tl.dot(a, tl.trans(weights), input_precision=PRECISION) + bias[None, :]
    if RELU:
        h = tl.where(h < 0, 0.0, h)
    return h

@triton.jit
def _inputs(a0, w0, w1, w2, b0, b1, b2, LAYERS: tl.constexpr, PRECISION: tl.constexpr):
    """The inputs (a1, a2, a3) of layers 1-3 (a0 where there is no such layer)."""
    a1, a2, a3 = a0, a0, a0
    if LAYERS > 1:
        a1 = _layer(a0, w0, b0, True, PRECISION)
    if LAYERS > 2:
        a2 = _layer(a1, w1, b1, True, PRECISION)
    if LAYERS > 3:
        a3 = _layer(a2, w2, b2, True, PRECISION)
    return a1, a2, a3

@triton.jit
def _load_rows(base, offs, rows, width: tl.constexpr, cols):
    mask = (offs < rows)[:, None] & (cols < width)[None, :]
    return tl.load(base + offs[:, None] * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)

@triton.jit
def _parameters(w0, w1, w2, w3, b0, b1, b2, b3, c0, c1, c2, c3, c4, cols, LAYERS: tl.constexpr):
    """Every layer's weight and bias as float32 blocks (the first layer's where none)."""
    weights0, bias0 = _weights(w0, c0, c1, cols), _bias(b0, c1, cols)
    weights1, weights2, weights3, bias1, bias2, bias3 = weights0, weights0, weights0, bias0, bias0, bias0
    if LAYERS > 1:
        weights1, bias1 = _weights(w1, c1, c2, cols), _bias(b1, c2, cols)
    if LAYERS > 2:
        weights2, bias2 = _weights(w2, c2, c3, cols), _bias(b2, c3, cols)
    if LAYERS > 3:
        weights3, bias3 = _weights(w3, c3, c4, cols), _bias(b3, c4, cols)
    return weights0, weights1, weights2, weights3, bias0, bias1, bias2, bias3

@triton.jit
def _forward_kernel(x, w0, w1, w2, w3, b0, b1, b2, b3, out, rows, c0, c1, c2, c3, c4,
                    IN: tl.constexpr, OUT: tl.constexpr, LAYERS: tl.constexpr, WP: tl.constexpr,
                    BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """out = the MLP of x's rows; layer l maps c_l to c_(l+1) columns (c0 = IN)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, WP)
    weights0, weights1, weights2, weights3, bias0, bias1, bias2, bias3 = _parameters(
        w0, w1, w2, w3, b0, b1, b2, b3, c0, c1, c2, c3, c4, cols, LAYERS)
    a0 = _load_rows(x, offs, rows, IN, cols)
    a1, a2, a3 = _inputs(a0, weights0, weights1, weights2, bias0, bias1, bias2, LAYERS, PRECISION)
    top, weights, bias = a0, weights0, bias0
    if LAYERS == 2:
        top, weights, bias = a1, weights1, bias1
    if LAYERS == 3:
        top, weights, bias = a2, weights2, bias2
    if LAYERS == 4:
        top, weights, bias = a3, weights3, bias3
    result = _layer(top, weights, bias, False, PRECISION)
    mask = (offs < rows)[:, None] & (cols < OUT)[None, :]
    tl.store(out + offs[:, None] * OUT + cols[None, :], result.to(out.dtype.element_ty), mask=mask)

@triton.jit
def _through(delta, weights, below, PRECISION: tl.constexpr):
    """dL/d(pre-activation below) from delta = dL/d(output of the layer of ``weights``),
    whose input is ``below`` = ReLU(pre-activation): torch's threshold_backward."""
    return tl.where(below <= 0, 0.0, tl.dot(delta, weights, input_precision=PRECISION))

@triton.jit
def _accumulate(acc_w, acc_b, delta, a, PRECISION: tl.constexpr):
    return acc_w + tl.dot(tl.trans(delta), a, input_precision=PRECISION), acc_b + tl.sum(delta, 0)

@triton.jit
def _backward_kernel(x, w0, w1, w2, w3, b0, b1, b2, b3, grad_out, grad_x, partials, rows, blocks,
                     c0, c1, c2, c3, c4, IN: tl.constexpr, OUT: tl.constexpr, LAYERS: tl.constexpr,
                     WP: tl.constexpr, BLOCK: tl.constexpr, GRAD_X: tl.constexpr, PRECISION: tl.constexpr):
    """Program p sums, over row blocks p, p + programs, ..., every layer's dL/dW [WP, WP]
    and dL/db [WP] in registers, then writes them to partials[p]; it writes dL/dx of its
    rows. Up to four layers, one accumulator and one activation each, unrolled."""
    pid = tl.program_id(0)
    cols = tl.arange(0, WP)
    zero_w = tl.zeros((WP, WP), dtype=tl.float32)
    zero_b = tl.zeros((WP,), dtype=tl.float32)
    acc_w0, acc_w1, acc_w2, acc_w3 = zero_w, zero_w, zero_w, zero_w
    acc_b0, acc_b1, acc_b2, acc_b3 = zero_b, zero_b, zero_b, zero_b
    weights0, weights1, weights2, weights3, bias0, bias1, bias2, bias3 = _parameters(
        w0, w1, w2, w3, b0, b1, b2, b3, c0, c1, c2, c3, c4, cols, LAYERS)
    for block in range(pid, blocks, tl.num_programs(0)):
        offs = tl.arange(0, BLOCK).to(tl.int64) + block * BLOCK
        a0 = _load_rows(x, offs, rows, IN, cols)
        a1, a2, a3 = _inputs(a0, weights0, weights1, weights2, bias0, bias1, bias2, LAYERS, PRECISION)
        delta = _load_rows(grad_out, offs, rows, OUT, cols)  # dL/d(output of the top layer)
        if LAYERS > 3:
            acc_w3, acc_b3 = _accumulate(acc_w3, acc_b3, delta, a3, PRECISION)
            delta = _through(delta, weights3, a3, PRECISION)
        if LAYERS > 2:
            acc_w2, acc_b2 = _accumulate(acc_w2, acc_b2, delta, a2, PRECISION)
            delta = _through(delta, weights2, a2, PRECISION)
        if LAYERS > 1:
            acc_w1, acc_b1 = _accumulate(acc_w1, acc_b1, delta, a1, PRECISION)
            delta = _through(delta, weights1, a1, PRECISION)
        acc_w0, acc_b0 = _accumulate(acc_w0, acc_b0, delta, a0, PRECISION)
        if GRAD_X:
            g = tl.dot(delta, weights0, input_precision=PRECISION)
            mask = (offs < rows)[:, None] & (cols < IN)[None, :]
            tl.store(grad_x + offs[:, None] * IN + cols[None, :], g.to(grad_x.dtype.element_ty), mask=mask)
    part = partials + pid.to(tl.int64) * LAYERS * (WP * WP + WP)
    _store_partial(part, 0, acc_w0, acc_b0, cols, WP)
    if LAYERS > 1:
        _store_partial(part, 1, acc_w1, acc_b1, cols, WP)
    if LAYERS > 2:
        _store_partial(part, 2, acc_w2, acc_b2, cols, WP)
    if LAYERS > 3:
        _store_partial(part, 3, acc_w3, acc_b3, cols, WP)

@triton.jit
def _store_partial(part, layer: tl.constexpr, acc_w, acc_b, cols, WP: tl.constexpr):
    slot = part + layer * (WP * WP + WP)
    tl.store(slot + cols[:, None] * WP + cols[None, :], acc_w)
    tl.store(slot + WP * WP + cols, acc_b)

@triton.jit
def _sum_kernel(partials, programs, gw0, gw1, gw2, gw3, gb0, gb1, gb2, gb3, c0, c1, c2, c3, c4,
                LAYERS: tl.constexpr, WP: tl.constexpr, CHUNK: tl.constexpr):
    """One row of one layer's gradients a program: row r < WP of dL/dW (row WP: dL/db)
    summed over the backward programs' partials [programs, LAYERS, WP * WP + WP], CHUNK
    programs at a time in a fixed order, into the layer's [C_l+1, C_l] weight or [C_l+1]
    bias gradient (widths c0..c4)."""
    layer = tl.program_id(0) // (WP + 1)
    row = tl.program_id(0) % (WP + 1)
    cols = tl.arange(0, WP)
    chunk = tl.arange(0, CHUNK)
    column = partials + layer * (WP * WP + WP) + row * WP + cols
    total = tl.zeros((WP,), dtype=tl.float32)
    for first in range(0, programs, CHUNK):
        p = (first + chunk).to(tl.int64)
        total += tl.sum(tl.load(column[None, :] + p[:, None] * (LAYERS * (WP * WP + WP)),
                                mask=(p < programs)[:, None], other=0.0), 0)
    if layer == 0:
        _store_sum(total, row, gw0, gb0, c0, c1, cols, WP)
    if layer == 1:
        _store_sum(total, row, gw1, gb1, c1, c2, cols, WP)
    if layer == 2:
        _store_sum(total, row, gw2, gb2, c2, c3, cols, WP)
    if layer == 3:
        _store_sum(total, row, gw3, gb3, c3, c4, cols, WP)

@triton.jit
def _store_sum(total, row, gw, gb, fan_in, fan_out, cols, WP: tl.constexpr):
    if row < WP:
        stored = tl.where(row < fan_out, fan_in, 0)  # columns of the row: none past fan_out
        tl.store(gw + row * fan_in + cols, total.to(gw.dtype.element_ty), mask=cols < stored)
    else:
        tl.store(gb + cols, total.to(gb.dtype.element_ty), mask=cols < fan_out)
