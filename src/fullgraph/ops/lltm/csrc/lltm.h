// The LLTM cell (seed 001): gate maths shared by the CPU and CUDA kernels.
//
// gates [B, 3S] = [old_h, input] @ weights^T + bias, split into input gate, output gate and
// candidate cell. new_cell = old_cell + elu(candidate) * sigmoid(input gate);
// new_h = tanh(new_cell) * sigmoid(output gate). Computed in float (double for double).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <tuple>

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

// The gate pre-activations [B, 3S], in ATen on the inputs' device and stream.
inline at::Tensor gate_preactivations(const at::Tensor& input, const at::Tensor& weights, const at::Tensor& bias,
                                      const at::Tensor& old_h) {
  return at::addmm(bias, at::cat({old_h, input}, 1), weights.t());
}

}  // namespace fullgraph_lltm
