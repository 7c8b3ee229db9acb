"""fullgraph.conv_groupnorm_mish: the fused Conv1d -> GroupNorm -> Mish block against a float64
reference, its backward (gradcheck), opcheck, one compiled graph across sizes, errors."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DEVICES, HAVE_TRITON

import fullgraph
from fullgraph.ops import conv_block


@pytest.fixture(autouse=True)
def _no_tf32(monkeypatch):
    """float32 products as torch's Conv1d makes them with TF32 off: the kernel follows
    torch.backends.cudnn.allow_tf32 (on by default: 10-bit products, 1e-2 relative on GPUs)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def _cases():
    """(backend, device): Triton on CUDA, and on CPU tensors through its interpreter."""
    triton_devices = [d for d in DEVICES if d == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"]
    return [("torch", d) for d in DEVICES] + ([("triton", d) for d in triton_devices] if HAVE_TRITON else [])


def _block(generator, batch, c_in, c_out, length, kernel, scale=1.0, dtype=torch.float64, device="cpu"):
    """(x, weight, bias, gamma, beta), drawn in float64 then cast."""
    def draw(*shape, shift=0.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale + shift).to(dtype=dtype,
                                                                                                    device=device)
    return (draw(batch, c_in, length), draw(c_out, c_in, kernel) / (c_in * kernel) ** 0.5, draw(c_out),
            draw(c_out, shift=1.0), draw(c_out))


SHAPES = [  # batch, C_in, C_out, T, kernel, groups
    (2, 5, 16, 7, 3, 4),
    (1, 32, 64, 16, 5, 8),  # Diffusion Policy's sizes, scaled down
    (2, 3, 32, 70, 5, 8),  # several time tiles
    (1, 2, 16, 1, 5, 2),  # one time step: the taps reach outside on both sides
    (3, 4, 8, 5, 1, 8),  # kernel 1, a channel per group
    (1, 6, 24, 9, 3, 1),  # one group, C_out not a multiple of the channel tile
    (1, 3, 16, 300, 3, 1),  # a group of 4,800 elements: read in blocks, one pass per statistic
]


@pytest.mark.parametrize("backend, device", _cases())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [1.0, 300.0])  # 300: large activations, Mish's linear and saturated tails
def test_matches_the_float64_reference(backend, device, shape, scale, generator):
    batch, c_in, c_out, length, kernel, groups = shape
    tensors = _block(generator, batch, c_in, c_out, length, kernel, scale)
    want = conv_block.reference(*tensors, groups, 1e-5)
    dtype = torch.float64 if backend == "torch" else torch.float32
    got = fullgraph.conv_groupnorm_mish(*(t.to(dtype=dtype, device=device) for t in tensors), groups, backend=backend)
    assert got.dtype == dtype and got.shape == (batch, c_out, length)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    # float32: gamma * normalized + beta rounds at the size of its terms (~scale), not of the result
    torch.testing.assert_close(got.cpu().double(), want, rtol=tolerance, atol=tolerance * scale)


@pytest.mark.parametrize("backend, device", [c for c in _cases() if c[0] == "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_against_float64(backend, device, dtype, generator):
    tensors = _block(generator, 2, 16, 32, 16, 5)
    want = conv_block.reference(*tensors, 8, 1e-5)
    got = fullgraph.conv_groupnorm_mish(*(t.to(dtype=dtype, device=device) for t in tensors), 8, backend=backend)
    assert got.dtype == dtype
    # the inputs round to dtype before the product (80 terms); normalized outputs are O(1)
    tolerance = 5e-2 if dtype == torch.bfloat16 else 8e-3
    torch.testing.assert_close(got.cpu().double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("backend, device", _cases())
def test_a_constant_group_is_normalized_by_eps(backend, device):
    """Zero variance: (y - mean) / sqrt(0 + eps) = 0, so the output is mish(beta)."""
    x = torch.full((1, 2, 6), 3.0, device=device)
    weight, bias = torch.zeros(4, 2, 3, device=device), torch.full((4,), 2.0, device=device)
    gamma, beta = torch.ones(4, device=device), torch.tensor([-1.0, 0.0, 1.0, 25.0], device=device)
    got = fullgraph.conv_groupnorm_mish(x, weight, bias, gamma, beta, 2, backend=backend)
    torch.testing.assert_close(got.cpu(), torch.nn.functional.mish(beta.cpu())[None, :, None].expand(1, 4, 6))


def _epilogue(generator, batch, c_out, length, dtype=torch.float64, device="cpu"):
    """(scale, shift, residual): scale and shift as the columns of one FiLM tensor (strided views)."""
    film = torch.randn(batch, 2 * c_out, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)
    residual = torch.randn(batch, c_out, length, generator=generator, dtype=torch.float64).to(dtype=dtype,
                                                                                              device=device)
    return film[:, :c_out], film[:, c_out:], residual


@pytest.mark.parametrize("backend, device", _cases())
@pytest.mark.parametrize("parts", [(True, True, False), (False, False, True), (True, True, True), (False, True, False)])
def test_the_epilogue_matches_the_reference(backend, device, parts, generator):
    """FiLM's scale and shift (strided [B, C_out] views) and a residual, each optional."""
    tensors = _block(generator, 2, 6, 16, 9, 3)
    extra = [e if keep else None for e, keep in zip(_epilogue(generator, 2, 16, 9), parts)]
    want = conv_block.reference(*tensors, 4, 1e-5, *extra)
    dtype = torch.float64 if backend == "torch" else torch.float32
    moved = [None if e is None else e.to(dtype=dtype, device=device) for e in extra]
    got = fullgraph.conv_groupnorm_mish(*(t.to(dtype=dtype, device=device) for t in tensors), 4, scale=moved[0],
                                        shift=moved[1], residual=moved[2], backend=backend)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got.cpu().double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("one_kernel", [True, False])
def test_split_products_sum_to_the_same_block(splits, one_kernel, generator):
    """Chunks of the (channel, tap) pairs in separate programs, summed where the group is
    normalized: by the product kernel's last program of the group, or by a second kernel;
    x a strided view."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no Triton device here")
    tensors = _block(generator, 2, 40, 32, 11, 5)
    extra = _epilogue(generator, 2, 32, 11)
    want = conv_block.reference(*tensors, 8, 1e-5, *extra)
    moved = [t.to(dtype=torch.float32, device=device) for t in (*tensors, *extra)]
    x = moved[0].transpose(1, 2).contiguous().transpose(1, 2)  # [B, C, T] with the channels innermost
    residual = moved[7].transpose(0, 1).contiguous().transpose(0, 1)
    got = conv_block._triton_block(x, *moved[1:5], 8, 1e-5, *moved[5:7], residual, splits=splits,
                                   one_kernel=one_kernel)
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-5, atol=2e-5)


def _residual_conv(generator, batch, c_res, c_out, length, dtype=torch.float64, device="cpu"):
    """(residual [B, C_res, T] with the time steps innermost-but-strided, weight [C_out, C_res], bias)."""
    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)
    residual = draw(batch, length, c_res).transpose(1, 2)
    return residual, draw(c_out, c_res) / c_res ** 0.5, draw(c_out)


@pytest.mark.parametrize("backend, device", _cases())
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_residual_convolution_matches_the_reference(backend, device, with_bias, generator):
    """The skip path's 1x1 convolution in the epilogue (a residual block whose channel count
    changes), with FiLM: equal to conv1d of the residual added after Mish."""
    tensors = _block(generator, 2, 6, 16, 9, 3)
    scale, shift, _ = _epilogue(generator, 2, 16, 9)
    residual, residual_weight, residual_bias = _residual_conv(generator, 2, 5, 16, 9)
    residual_bias = residual_bias if with_bias else None
    want = conv_block.reference(*tensors, 4, 1e-5, scale, shift, residual, residual_weight, residual_bias)
    dtype = torch.float64 if backend == "torch" else torch.float32
    move = lambda t: None if t is None else t.to(dtype=dtype, device=device)  # noqa: E731
    got = fullgraph.conv_groupnorm_mish(*map(move, tensors), 4, scale=move(scale), shift=move(shift),
                                        residual=move(residual), residual_weight=move(residual_weight),
                                        residual_bias=move(residual_bias), backend=backend)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got.cpu().double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("one_kernel", [True, False])
def test_the_residual_convolution_in_several_chunks(splits, one_kernel, generator):
    """More residual channels than a chunk of pairs: the 1x1 product in several programs
    (3 chunks of 128 for 300 channels at 3 splits), their partials summed after Mish."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no Triton device here")
    tensors = _block(generator, 2, 40, 32, 11, 5)
    residual = _residual_conv(generator, 2, 300, 32, 11)
    want = conv_block.reference(*tensors, 8, 1e-5, None, None, *residual)
    moved = [t.to(dtype=torch.float32, device=device) for t in (*tensors, *residual)]
    got = conv_block._triton_block(*moved[:5], 8, 1e-5, None, None, *moved[5:], splits=splits, one_kernel=one_kernel)
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
def test_launches_leave_their_arrival_counters_zeroed(monkeypatch, generator):
    """The one-kernel form counts arrivals on a rotating slice of a per-device buffer and
    zeroes it again; many launches wrap around the buffer and every result stays right."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no Triton device here")
    monkeypatch.setattr(conv_block, "COUNTER_SLOTS", 20)
    monkeypatch.setattr(conv_block, "_COUNTERS", {})
    tensors = _block(generator, 2, 8, 32, 6, 3)
    want = conv_block.reference(*tensors, 8, 1e-5)
    moved = [t.to(dtype=torch.float32, device=device) for t in tensors]
    for splits in (1, 3, 2, 1, 3):  # 16 counters a launch: each launch starts a new round of the buffer
        got = conv_block._triton_block(*moved, 8, 1e-5, splits=splits, one_kernel=True)
        torch.testing.assert_close(got.cpu().double(), want, rtol=2e-5, atol=2e-5)
    (buffer, _), = conv_block._COUNTERS.values()
    assert buffer.shape == (20,) and not buffer.any()
    big = _block(generator, 3, 8, 64, 6, 3)  # 3 x 8 groups > 20 slots: fresh zeros
    got = conv_block._triton_block(*(t.to(dtype=torch.float32, device=device) for t in big), 8, 1e-5,
                                   one_kernel=True)
    torch.testing.assert_close(got.cpu().double(), conv_block.reference(*big, 8, 1e-5), rtol=2e-5, atol=2e-5)


def test_auto_takes_the_fused_kernel_for_few_columns_on_cuda():
    """The measured rule (AUTO_MAX_COLUMNS): Triton on CUDA up to 128 columns B * T, PyTorch
    beyond and off CUDA (resolved without touching a GPU)."""
    def chosen(device, columns, dtype=torch.bfloat16):
        return conv_block.BACKENDS.resolve("auto", "conv_groupnorm_mish", torch.device(device), dtype, columns,
                                           argument="x").name

    assert chosen("cpu", 16) == "torch"
    assert chosen("cuda", conv_block.AUTO_MAX_COLUMNS + 1) == "torch"
    assert chosen("cuda", 16, torch.float64) == "torch"  # the kernel computes in float32
    assert chosen("cuda", conv_block.AUTO_MAX_COLUMNS) == ("triton" if HAVE_TRITON else "torch")


def test_gradcheck_of_the_written_backward(generator):
    tensors = [t.requires_grad_() for t in _block(generator, 2, 3, 8, 5, 3)]
    assert torch.autograd.gradcheck(lambda *a: fullgraph.conv_groupnorm_mish(*a, 4, backend="torch"), tensors)


def test_gradcheck_with_the_epilogue(generator):
    tensors = [t.requires_grad_() for t in (*_block(generator, 2, 3, 8, 5, 3), *_epilogue(generator, 2, 8, 5))]

    def block(x, weight, bias, gamma, beta, scale, shift, residual):
        return fullgraph.conv_groupnorm_mish(x, weight, bias, gamma, beta, 4, scale=scale, shift=shift,
                                             residual=residual, backend="torch")

    assert torch.autograd.gradcheck(block, tensors)


def test_gradcheck_with_the_residual_convolution(generator):
    tensors = [t.requires_grad_() for t in (*_block(generator, 2, 3, 8, 5, 3), *_residual_conv(generator, 2, 4, 8, 5))]

    def block(x, weight, bias, gamma, beta, residual, residual_weight, residual_bias):
        return fullgraph.conv_groupnorm_mish(x, weight, bias, gamma, beta, 4, residual=residual,
                                             residual_weight=residual_weight, residual_bias=residual_bias,
                                             backend="torch")

    assert torch.autograd.gradcheck(block, tensors)


@pytest.mark.parametrize("backend, device", _cases())
def test_gradients_equal_the_reference_autograd(backend, device, generator):
    dtype = torch.float64 if backend == "torch" else torch.float32
    tensors = [t.to(dtype=dtype, device=device) for t in _block(generator, 2, 6, 16, 9, 3)]
    grad_out = torch.randn(2, 16, 9, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)
    mine = [t.clone().requires_grad_() for t in tensors]
    theirs = [t.clone().requires_grad_() for t in tensors]
    got = torch.autograd.grad(fullgraph.conv_groupnorm_mish(*mine, 4, backend=backend), mine, grad_out)
    want = torch.autograd.grad(conv_block.reference(*theirs, 4, 1e-5), theirs, grad_out)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-4
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("backend, device", _cases())
@pytest.mark.interpreted(keep=0)
def test_opcheck(backend, device, generator):
    dtype = torch.float64 if backend == "torch" else torch.float32
    tensors = [t.to(dtype=dtype, device=device).requires_grad_() for t in _block(generator, 2, 4, 8, 6, 3)]
    torch.library.opcheck(torch.ops.fullgraph.conv_groupnorm_mish.default, (*tensors, 2, 1e-5, backend))
    extra = [t.to(dtype=dtype, device=device).requires_grad_() for t in _epilogue(generator, 2, 8, 6)]
    torch.library.opcheck(torch.ops.fullgraph.conv_groupnorm_mish.default, (*tensors, 2, 1e-5, backend, *extra))
    residual = [t.to(dtype=dtype, device=device).requires_grad_() for t in _residual_conv(generator, 2, 3, 8, 6)]
    torch.library.opcheck(torch.ops.fullgraph.conv_groupnorm_mish.default,
                          (*tensors, 2, 1e-5, backend, *extra[:2], *residual))


def test_compiles_once_across_sizes(generator):
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    block = torch.compile(lambda *a: fullgraph.conv_groupnorm_mish(*a, 4), backend=counter, fullgraph=True,
                          dynamic=True)
    for batch, length in [(2, 10), (5, 17), (6, 13)]:  # no size equal to a weight dimension (duck sizing)
        tensors = [t.requires_grad_() for t in _block(generator, batch, 4, 8, length, 3)]
        got = block(*tensors)
        torch.testing.assert_close(got, conv_block.reference(*tensors, 4, 1e-5))
        got.sum().backward()
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend, device", _cases())
def test_the_traced_form_computes_the_same_block_exported_and_compiled(backend, device, generator):
    """conv_block.decompositions() puts the triton_op form in an exported program, which
    computes the block as the operator does; compiled, Inductor traces into it."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    tensors = [t.to(dtype=dtype, device=device) for t in _block(generator, 1, 6, 16, 9, 3)]
    scale, shift, residual = (t.to(dtype=dtype, device=device) for t in _epilogue(generator, 1, 16, 9))

    class Block(torch.nn.Module):
        def forward(self, *args):
            return fullgraph.conv_groupnorm_mish(*args, 4, scale=scale, shift=shift, residual=residual,
                                                 backend=backend)

    want = conv_block.reference(*tensors, 4, 1e-5, scale, shift, residual)
    program = torch.export.export(Block(), tuple(tensors)).run_decompositions(conv_block.decompositions())
    targets = {str(node.target) for node in program.graph.nodes}
    assert "fullgraph.conv_groupnorm_mish_traced.default" in targets and "fullgraph.conv_groupnorm_mish.default" \
        not in targets
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(program.module()(*tensors), want, rtol=tolerance, atol=tolerance)
    traced = torch.compile(lambda *a: torch.ops.fullgraph.conv_groupnorm_mish_traced(
        *a, 4, 1e-5, backend, scale, shift, residual), fullgraph=True)
    for _ in range(2):  # twice: a launch leaves no state the next one needs
        torch.testing.assert_close(traced(*tensors), want, rtol=tolerance, atol=tolerance)


def test_bad_input_is_named(generator):
    x, weight, bias, gamma, beta = _block(generator, 2, 4, 8, 6, 3, dtype=torch.float32)
    cases = [
        ((x.long(), weight, bias, gamma, beta, 2), TypeError, "x: expected a floating-point tensor"),
        ((x, weight.double(), bias, gamma, beta, 2), TypeError, "weight: expected torch.float32 like x"),
        ((x[0], weight, bias, gamma, beta, 2), ValueError, r"x: expected shape \[B, C_in, T\]"),
        ((x[:, :3], weight, bias, gamma, beta, 2), ValueError, r"weight: expected \[C_out, C_in = 3, kernel\]"),
        ((x, weight[..., :2], bias, gamma, beta, 2), ValueError, "weight: expected an odd kernel size"),
        ((x, weight, bias[:5], gamma, beta, 2), ValueError, r"bias: expected \[C_out\] = \[8\], got \[5\]"),
        ((x, weight, bias, gamma, beta, 3), ValueError, "groups: expected a divisor of C_out = 8, got 3"),
        ((x[..., :0], weight, bias, gamma, beta, 2), ValueError, "x: expected at least one time step"),
    ]
    scale, shift, residual = _epilogue(generator, 2, 8, 6, dtype=torch.float32)
    source, residual_weight, residual_bias = _residual_conv(generator, 2, 3, 8, 6, dtype=torch.float32)
    epilogues = [
        ((scale[:1], None, None), ValueError, r"scale: expected \[B, C_out\] = \[2, 8\], got \[1, 8\]"),
        ((None, shift.double(), None), TypeError, "shift: expected torch.float32 like x"),
        ((None, None, residual[..., :5]), ValueError, r"residual: expected \[B, C_out, T\] = \[2, 8, 6\]"),
        ((None, None, None, residual_weight), ValueError, "residual_weight: given without a residual"),
        ((None, None, source, residual_weight[:, :, None]), ValueError,
         r"residual_weight: expected shape \[C_out, C_res\]"),
        ((None, None, source, residual_weight[:5]), ValueError, r"residual_weight: expected \[C_out = 8, C_res\]"),
        ((None, None, source[:, :2], residual_weight), ValueError,
         r"residual: expected \[B, C_res, T\] = \[2, 3, 6\], got \[2, 2, 6\]"),
        ((None, None, residual, None, residual_bias), ValueError, "residual_bias: given without a residual_weight"),
        ((None, None, source, residual_weight, residual_bias[:4]), ValueError,
         r"residual_bias: expected \[C_out\] = \[8\], got \[4\]"),
        ((None, None, source, residual_weight.double()), TypeError, "residual_weight: expected torch.float32 like x"),
    ]
    for args, error, message in cases + [((x, weight, bias, gamma, beta, 2, *e), error, m) for e, error, m in epilogues]:
        tensors, extra = args[:6], (*args[6:], None, None, None, None, None)[:5]
        with pytest.raises(error, match=message):
            fullgraph.conv_groupnorm_mish(*tensors, scale=extra[0], shift=extra[1], residual=extra[2],
                                          residual_weight=extra[3], residual_bias=extra[4])
        with pytest.raises(error, match=message):  # the operator checks its own contract
            torch.ops.fullgraph.conv_groupnorm_mish(*tensors, 1e-5, "torch", *extra)
    with pytest.raises(ValueError, match="eps: expected"):
        fullgraph.conv_groupnorm_mish(x, weight, bias, gamma, beta, 2, eps=0.0)
    if HAVE_TRITON:
        triton_device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors: Triton's interpreter
        with pytest.raises(TypeError, match='x: backend="triton" computes in float32'):
            fullgraph.conv_groupnorm_mish(*(t.to(triton_device, torch.float64) for t in (x, weight, bias, gamma, beta)),
                                          2, backend="triton")
