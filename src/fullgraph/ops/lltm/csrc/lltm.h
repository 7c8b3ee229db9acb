// The LLTM cell (PyTorch's LLTM extension tutorial): gate maths shared by the CPU and CUDA kernels.
//
// gates [B, 3S] = [old_h, input] @ weights^T + bias, split into input gate, output gate and
// candidate cell. new_cell = old_cell + elu(candidate) * sigmoid(input gate);
// new_h = tanh(new_cell) * sigmoid(output gate). Computed in float (double for double).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#if defined(__CUDACC__)
#define LLTM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LLTM_HOST_DEVICE inline
#endif

namespace fullgraph_lltm {

using Forward = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // new_h, new_cell, gates
using Backward = std::tuple<at::Tensor, at::Tensor>;  // d_gates, d_old_cell

// float and double overloads: CUDA's global ones on the device, <cmath>'s on the host.
#if defined(__CUDA_ARCH__)
#define LLTM_MATH(name) \
  template <typename T>   \
  __device__ __forceinline__ T name##_(T z) { return ::name(z); }
#else
#define LLTM_MATH(name) \
  template <typename T>   \
  inline T name##_(T z) { return std::name(z); }
#endif
LLTM_MATH(exp)
LLTM_MATH(expm1)
LLTM_MATH(tanh)
#undef LLTM_MATH

template <typename T>
LLTM_HOST_DEVICE T sigmoid(T z) {
  return T(1) / (T(1) + exp_(-z));
}

template <typename T>
LLTM_HOST_DEVICE T elu(T z) {
  return z > T(0) ? z : expm1_(z);
}

template <typename T>
LLTM_HOST_DEVICE T d_elu(T z) {
  return z > T(0) ? T(1) : exp_(z);
}

// One element of the forward: the state column j of one batch row.
template <typename T>
LLTM_HOST_DEVICE void cell_forward(T input_gate, T output_gate, T candidate, T old_cell, T* new_h, T* new_cell) {
  const T cell = old_cell + elu(candidate) * sigmoid(input_gate);
  *new_cell = cell;
  *new_h = tanh_(cell) * sigmoid(output_gate);
}

// One element of the backward: gradients of the three gate pre-activations and of old_cell.
template <typename T>
LLTM_HOST_DEVICE void cell_backward(T grad_h, T grad_cell, T new_cell, T gate_i, T gate_o, T gate_c,
                                    T* d_gate_i, T* d_gate_o, T* d_gate_c, T* d_old_cell) {
  const T input_gate = sigmoid(gate_i), output_gate = sigmoid(gate_o);
  const T tanh_cell = tanh_(new_cell);
  const T d_new_cell = (T(1) - tanh_cell * tanh_cell) * output_gate * grad_h + grad_cell;
  *d_old_cell = d_new_cell;
  *d_gate_i = elu(gate_c) * d_new_cell * input_gate * (T(1) - input_gate);
  *d_gate_o = tanh_cell * grad_h * output_gate * (T(1) - output_gate);
  *d_gate_c = input_gate * d_new_cell * d_elu(gate_c);
}

// Preconditions of the kernels' operators (torch.ops.fullgraph_lltm.*): every shape, dtype
// and device is checked before a kernel runs, so no call reads out of bounds.
// TORCH_CHECK_TYPE / _VALUE reach Python as TypeError / ValueError.
// "[5, 6]": shapes are formatted here rather than by streaming an IntArrayRef, which crashed
// the process inside a failing check on the test GPU (torch 2.11, nvcc 13).
inline std::string shape_text(at::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "]";
}

inline void check_like(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name,
                       int64_t dims) {
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()), name, ": expected a floating-point tensor, got ",
                   t.scalar_type());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, ": expected ", like.scalar_type(), " like ",
                   like_name, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == like.device(), name, ": expected a tensor on ", like.device(), " like ", like_name,
                    ", got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == dims, name, ": expected ", dims, " dimensions, got shape ", shape_text(t.sizes()));
}

inline void check_shape(const at::Tensor& t, const char* name, std::vector<int64_t> expected, const char* layout) {
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(expected), name, ": expected ", layout, " = ", shape_text(expected),
                    ", got ", shape_text(t.sizes()));
}

inline void check_forward(const at::Tensor& input, const at::Tensor& weights, const at::Tensor& bias,
                          const at::Tensor& old_h, const at::Tensor& old_cell) {
  check_like(input, "input", input, "input", 2);
  check_like(old_h, "old_h", input, "input", 2);
  check_like(old_cell, "old_cell", input, "input", 2);
  check_like(weights, "weights", input, "input", 2);
  check_like(bias, "bias", input, "input", 1);
  const int64_t batch = input.size(0), features = input.size(1), state = old_h.size(1);
  check_shape(old_h, "old_h", {batch, state}, "[B, S]");
  check_shape(old_cell, "old_cell", {batch, state}, "[B, S]");
  check_shape(weights, "weights", {3 * state, features + state}, "[3 S, F + S]");
  check_shape(bias, "bias", {3 * state}, "[3 S]");
}

inline void check_backward(const at::Tensor& grad_h, const at::Tensor& grad_cell, const at::Tensor& gates,
                           const at::Tensor& new_cell) {
  check_like(new_cell, "new_cell", new_cell, "new_cell", 2);
  check_like(gates, "gates", new_cell, "new_cell", 2);
  check_like(grad_h, "grad_h", new_cell, "new_cell", 2);
  check_like(grad_cell, "grad_cell", new_cell, "new_cell", 2);
  const int64_t batch = new_cell.size(0), state = new_cell.size(1);
  check_shape(gates, "gates", {batch, 3 * state}, "[B, 3 S]");
  check_shape(grad_h, "grad_h", {batch, state}, "[B, S]");
  check_shape(grad_cell, "grad_cell", {batch, state}, "[B, S]");
}

// The gate pre-activations [B, 3S], in ATen on the inputs' device and stream.
inline at::Tensor gate_preactivations(const at::Tensor& input, const at::Tensor& weights, const at::Tensor& bias,
                                      const at::Tensor& old_h) {
  return at::addmm(bias, at::cat({old_h, input}, 1), weights.t());
}

}  // namespace fullgraph_lltm
