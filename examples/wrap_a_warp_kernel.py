"""A Warp kernel as a compiled, differentiable PyTorch operator (README: "Wrap your own kernel").

Run: python examples/wrap_a_warp_kernel.py   (needs CUDA and warp-lang: pip install "fullgraph[warp]")
"""

import torch
import warp as wp

import fullgraph


@wp.kernel
def soft_clip(x: wp.array(dtype=float), scale: float, y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = scale * wp.tanh(x[i] / scale)


@fullgraph.extern.op("demo::soft_clip_backward", "(Tensor grad, Tensor x, float scale) -> Tensor",
                     outputs=lambda grad, x, scale: [(x.shape, x.dtype)], library="warp")
def soft_clip_backward(grad, x, scale):  # Warp's adjoint launch: dL/dx from dL/dy
    x_grad = wp.zeros_like(x)
    wp.launch(soft_clip, dim=x.shape, inputs=[x, scale], outputs=[wp.empty_like(x)],
              adj_inputs=[x_grad, None], adj_outputs=[grad], adjoint=True)
    return x_grad


@fullgraph.extern.op("demo::soft_clip", "(Tensor x, float scale) -> Tensor",
                     outputs=lambda x, scale: [(x.shape, x.dtype)], library="warp",
                     backward=lambda ctx, grad: (soft_clip_backward(grad, ctx.saved_tensors[0], ctx.inputs[1]), None))
def soft_clip_op(x, scale):  # x arrives as a wp.array; Warp runs on PyTorch's current stream
    y = wp.empty_like(x)
    wp.launch(soft_clip, dim=x.shape, inputs=[x, scale], outputs=[y])
    return y


loss = torch.compile(lambda x: soft_clip_op(x * 3, 2.0).square().sum(), fullgraph=True, dynamic=True)

if __name__ == "__main__":
    x = torch.randn(10_000, device="cuda", requires_grad=True)
    loss(x).backward()
    y = 2 * torch.tanh(x.detach() * 3 / 2)
    torch.testing.assert_close(x.grad, 2 * y * 3 * (1 - torch.tanh(x.detach() * 3 / 2) ** 2))
    fullgraph.extern.check(soft_clip_op, x.detach(), 2.0)
    print("soft_clip: compiled, differentiable, checked")
