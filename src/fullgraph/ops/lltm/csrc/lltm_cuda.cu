// CUDA kernels of fullgraph_lltm::forward / backward: the gate maths fused into one
// kernel each way, launched on PyTorch's current stream (so they run inside CUDA graphs).
#include "lltm.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace fullgraph_lltm {
namespace {

constexpr int kThreads = 256;

template <typename scalar_t>
__global__ void forward_kernel(const scalar_t* __restrict__ gates, const scalar_t* __restrict__ old_cell,
                               scalar_t* __restrict__ new_h, scalar_t* __restrict__ new_cell, int64_t count,
                               int64_t state) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const scalar_t* row = gates + (i / state) * 3 * state;
  const int64_t j = i % state;
  opmath_t h, c;
  cell_forward<opmath_t>(row[j], row[state + j], row[2 * state + j], old_cell[i], &h, &c);
  new_h[i] = h;
  new_cell[i] = c;
}

template <typename scalar_t>
__global__ void backward_kernel(const scalar_t* __restrict__ grad_h, const scalar_t* __restrict__ grad_cell,
                                const scalar_t* __restrict__ gates, const scalar_t* __restrict__ new_cell,
                                scalar_t* __restrict__ d_gates, scalar_t* __restrict__ d_old_cell, int64_t count,
                                int64_t state) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int64_t row_start = (i / state) * 3 * state, j = i % state;
  const scalar_t* row = gates + row_start;
  opmath_t di, dout, dc, dcell;
  cell_backward<opmath_t>(grad_h[i], grad_cell[i], new_cell[i], row[j], row[state + j], row[2 * state + j], &di, &dout,
                          &dc, &dcell);
  d_gates[row_start + j] = di;
  d_gates[row_start + state + j] = dout;
  d_gates[row_start + 2 * state + j] = dc;
  d_old_cell[i] = dcell;
}

unsigned int blocks_for(int64_t count) { return static_cast<unsigned int>((count + kThreads - 1) / kThreads); }

Forward forward_cuda(const at::Tensor& input, const at::Tensor& weights, const at::Tensor& bias,
                     const at::Tensor& old_h, const at::Tensor& old_cell) {
  check_forward(input, weights, bias, old_h, old_cell);
  const c10::cuda::CUDAGuard guard(old_cell.device());
  const auto gates = gate_preactivations(input, weights, bias, old_h).contiguous();
  const auto cell = old_cell.contiguous();
  auto new_h = at::empty_like(cell), new_cell = at::empty_like(cell);
  const int64_t count = cell.numel(), state = cell.size(1);
  if (count == 0) return {new_h, new_cell, gates};
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gates.scalar_type(), "lltm_forward_cuda", [&] {
    forward_kernel<scalar_t><<<blocks_for(count), kThreads, 0, stream>>>(
        gates.const_data_ptr<scalar_t>(), cell.const_data_ptr<scalar_t>(), new_h.mutable_data_ptr<scalar_t>(),
        new_cell.mutable_data_ptr<scalar_t>(), count, state);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {new_h, new_cell, gates};
}

Backward backward_cuda(const at::Tensor& grad_h, const at::Tensor& grad_cell, const at::Tensor& gates,
                       const at::Tensor& new_cell) {
  check_backward(grad_h, grad_cell, gates, new_cell);
  const c10::cuda::CUDAGuard guard(new_cell.device());
  const auto gh = grad_h.contiguous(), gc = grad_cell.contiguous(), g = gates.contiguous();
  const auto nc = new_cell.contiguous();
  auto d_gates = at::empty_like(g), d_old_cell = at::empty_like(nc);
  const int64_t count = nc.numel(), state = nc.size(1);
  if (count > 0) {
    const auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "lltm_backward_cuda", [&] {
      backward_kernel<scalar_t><<<blocks_for(count), kThreads, 0, stream>>>(
          gh.const_data_ptr<scalar_t>(), gc.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
          nc.const_data_ptr<scalar_t>(), d_gates.mutable_data_ptr<scalar_t>(),
          d_old_cell.mutable_data_ptr<scalar_t>(), count, state);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {d_gates, d_old_cell};
}

}  // namespace
}  // namespace fullgraph_lltm

TORCH_LIBRARY_IMPL(fullgraph_lltm, CUDA, m) {
  m.impl("forward", &fullgraph_lltm::forward_cuda);
  m.impl("backward", &fullgraph_lltm::backward_cuda);
}
