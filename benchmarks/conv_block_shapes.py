"""The fused Conv1d -> GroupNorm -> Mish block (``fullgraph.conv_groupnorm_mish``, "triton")
against the compiled matrix-product block (``MatmulConv1d`` + GroupNorm + Mish under
torch.compile) on every block shape of Diffusion Policy's U-Net at the seed size, bf16,
batch 1: microseconds a block, from CUDA graphs of ``CALLS`` calls (no host time), over a
few settings (one kernel or two, output channels a program, pairs a product step, programs
per SM, fewest pair blocks a program, programmatic dependent launch); and each shape's floor (its weights read once at 3.35 TB/s).

    python benchmarks/conv_block_shapes.py [--seed-only] > blocks.log     (needs a CUDA device)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from replay_profile import graphed_ms

from fullgraph.models import ConditionalUnet1D
from fullgraph.models.unet1d import Conv1dBlock, MatmulConv1d
from fullgraph.ops import conv_block

CALLS = 20
SETTINGS = [  # (ONE_KERNEL, BLOCK_C, MAX_BLOCK_K, PROGRAMS_PER_SM, MIN_SPLIT_BLOCKS, PDL)
    (False, 32, 64, 4, 2, False), (True, 32, 64, 4, 2, False), (True, 32, 64, 4, 2, True)]
# Larger batches (training, batched inference), on two shapes, against the eager reference too.
BATCHES = [(8, (256, 256, 16)), (8, (1024, 1024, 4)), (64, (256, 256, 16)), (64, (1024, 1024, 4)),
           (256, (256, 256, 16)), (256, (1024, 1024, 4))]


def block_shapes(batch: int = 1) -> dict[tuple[int, int, int], int]:
    """(C_in, C_out, T) -> how many of the seed U-Net's Conv1dBlocks have it."""
    unet = ConditionalUnet1D().cuda().eval()
    shapes: dict[tuple[int, int, int], int] = {}

    def record(module, inputs, output):
        key = (inputs[0].shape[1], output.shape[1], output.shape[2])
        shapes[key] = shapes.get(key, 0) + 1

    for module in unet.modules():
        if isinstance(module, Conv1dBlock):
            module.register_forward_hook(record)
    with torch.no_grad():
        unet(torch.randn(batch, unet.horizon, unet.action_dim, device="cuda"), 10,
             torch.randn(batch, unet.global_cond_dim, device="cuda"))
    return shapes


def graphed_us(call) -> float:
    """Microseconds a call, from a CUDA graph of CALLS calls."""
    return graphed_ms(call, CALLS, runs=50) * 1000


def measure(batch: int, c_in: int, c_out: int, length: int, settings, eager: bool = False) -> tuple[dict, float]:
    """Microseconds of one block (FiLM in its epilogue) per variant; the largest difference
    of the fused outputs to the compiled block's."""
    torch._dynamo.reset()  # one compiled block per shape, not recompilations of one
    block = Conv1dBlock(c_in, c_out, 5).cuda().to(torch.bfloat16)
    conv, norm = block[0], block[1]
    x = torch.randn(batch, c_in, length, device="cuda", dtype=torch.bfloat16)
    film = torch.randn(batch, 2 * c_out, device="cuda", dtype=torch.bfloat16)
    scale, shift = film[:, :c_out], film[:, c_out:]
    matmul = MatmulConv1d(conv)
    compiled = torch.compile(lambda x: F.mish(norm(matmul(x))) * scale[:, :, None] + shift[:, :, None],
                             fullgraph=True)
    want = compiled(x).float()
    row, error = {}, 0.0
    if eager:
        row["eager reference"] = graphed_us(lambda: conv_block.reference(x, conv.weight, conv.bias, norm.weight,
                                                                         norm.bias, 8, 1e-5, scale, shift))
    row["compiled matmul-conv"] = graphed_us(lambda: compiled(x))
    for setting in settings:
        (conv_block.ONE_KERNEL, conv_block.BLOCK_C, conv_block.MAX_BLOCK_K, conv_block.PROGRAMS_PER_SM,
         conv_block.MIN_SPLIT_BLOCKS, conv_block.PDL) = setting
        run = lambda: conv_block._triton_block(x, conv.weight, conv.bias, norm.weight, norm.bias, 8, 1e-5,  # noqa: E731
                                               scale, shift)
        error = max(error, float((run().float() - want).abs().max()))
        row["fused {}k c{} k{} {}/SM min{}{}".format(1 if setting[0] else 2, *setting[1:5],
                                                    " PDL" if setting[5] else "")] = graphed_us(run)
    return row, error


def main(batches: bool = True) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, microseconds a block")
    torch.manual_seed(0)
    total = {}
    with torch.no_grad():
        for (c_in, c_out, length), count in sorted(block_shapes().items()):
            row, error = measure(1, c_in, c_out, length, SETTINGS)
            floor = c_out * c_in * 5 * 2 / 3.35e12 * 1e6
            print(f"batch 1 C_in {c_in:5d} C_out {c_out:5d} T {length:3d} x{count}: floor {floor:5.2f} us; "
                  + "; ".join(f"{k} {v:6.2f}" for k, v in row.items()) + f"; max diff {error:.3g}")
            for k, v in row.items():
                total[k] = total.get(k, 0.0) + v * count
        print("all blocks of one U-Net step: " + "; ".join(f"{k} {v:.1f} us" for k, v in total.items()))
        for batch, (c_in, c_out, length) in BATCHES if batches else ():
            row, error = measure(batch, c_in, c_out, length, SETTINGS[-1:], eager=True)
            print(f"batch {batch} C_in {c_in:5d} C_out {c_out:5d} T {length:3d}: "
                  + "; ".join(f"{k} {v:7.2f}" for k, v in row.items()) + f"; max diff {error:.3g}")
    # The FiLM encoders as one product, [1, 1284] x [1284, 14336]: cuBLAS with K as is, and padded.
    for padded in (1284, 1288, 1344) if batches else ():
        weight = torch.randn(14336, padded, device="cuda", dtype=torch.bfloat16)
        cond = torch.randn(1, padded, device="cuda", dtype=torch.bfloat16)
        print(f"FiLM product, K = {padded}: {graphed_us(lambda: F.linear(cond, weight)):.2f} us "
              f"(floor {weight.numel() * 2 / 3.35e12 * 1e6:.1f})")


if __name__ == "__main__":
    main(batches="--seed-only" not in sys.argv)
