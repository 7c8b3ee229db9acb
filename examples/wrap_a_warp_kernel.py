"""A Warp kernel as a compiled, differentiable PyTorch operator (README: "Wrap your own kernel").

Run: python examples/wrap_a_warp_kernel.py   (needs CUDA and warp-lang: pip install "fullgraph[warp]")
The block between the markers is the README's, line for line (tests/test_docs.py checks).
"""

# --- README ---
import torch, warp as wp, fullgraph

@wp.kernel
def soft_clip(x: wp.array(dtype=float), scale: float, y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = scale * wp.tanh(x[i] / scale)

spec = lambda x, *rest: [(x.shape, x.dtype)]    # each output's shape and dtype, from the inputs

@fullgraph.extern.op("demo::soft_clip_backward", "(Tensor x, float scale, Tensor grad) -> Tensor", outputs=spec, library="warp")
def soft_clip_backward(x, scale, grad):         # Warp's adjoint launch: dL/dx from dL/dy
    x_grad = wp.zeros_like(x)
    wp.launch(soft_clip, dim=x.shape, inputs=[x, scale], outputs=[wp.empty_like(x)],
              adj_inputs=[x_grad, None], adj_outputs=[grad], adjoint=True)
    return x_grad

@fullgraph.extern.op("demo::soft_clip", "(Tensor x, float scale) -> Tensor", outputs=spec, library="warp",
                     backward=lambda ctx, grad: (soft_clip_backward(*ctx.inputs, grad), None))
def soft_clip_op(x, scale):                     # x arrives as a wp.array; Warp runs on PyTorch's stream
    y = wp.empty_like(x)
    wp.launch(soft_clip, dim=x.shape, inputs=[x, scale], outputs=[y])
    return y

loss = torch.compile(lambda x: soft_clip_op(x * 3, 2.0).square().sum(), fullgraph=True, dynamic=True)
# --- README ---

if __name__ == "__main__":
    for size in (10_000, 777):  # one compiled graph for both sizes
        x = torch.randn(size, device="cuda", requires_grad=True)
        loss(x).backward()
        tanh = torch.tanh(x.detach() * 3 / 2)
        torch.testing.assert_close(x.grad, 2 * (2 * tanh) * 3 * (1 - tanh**2))
    fullgraph.extern.check(soft_clip_op, x.detach(), 2.0)
    print("soft_clip: compiled, differentiable, checked")
