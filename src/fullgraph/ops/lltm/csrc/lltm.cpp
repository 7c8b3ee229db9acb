// fullgraph_lltm::forward / backward: the kernels' operator schemas and their CPU kernels.
#include "lltm.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <type_traits>

namespace fullgraph_lltm {
namespace {

constexpr int64_t kGrainElements = 16384;  // elements per task before a batch row range is split

int64_t grain_rows(int64_t state) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(state, 1)); }

template <typename V>
V vec_sigmoid(const V& z) {
  const V one(typename V::value_type(1));
  return one / (one + z.neg().exp());
}

// One batch row, vectorized (at::vec, SLEEF's exp/expm1/tanh) for float and double; the
// scalar tail and float16/bfloat16 (computed in float) go through cell_forward.
template <typename scalar_t>
void forward_row(const scalar_t* gates, const scalar_t* old_cell, scalar_t* new_h, scalar_t* new_cell, int64_t state) {
  using opmath_t = at::opmath_type<scalar_t>;
  int64_t j = 0;
  if constexpr (std::is_same_v<scalar_t, opmath_t>) {
    using V = at::vec::Vectorized<scalar_t>;
    const V zero(scalar_t(0));
    for (; j + V::size() <= state; j += V::size()) {
      const V gate_i = V::loadu(gates + j), gate_o = V::loadu(gates + state + j);
      const V gate_c = V::loadu(gates + 2 * state + j);
      const V candidate = V::blendv(gate_c.expm1(), gate_c, gate_c > zero);
      const V cell = V::loadu(old_cell + j) + candidate * vec_sigmoid(gate_i);
      cell.store(new_cell + j);
      (cell.tanh() * vec_sigmoid(gate_o)).store(new_h + j);
    }
  }
  for (; j < state; ++j) {
    opmath_t h, c;
    cell_forward<opmath_t>(gates[j], gates[state + j], gates[2 * state + j], old_cell[j], &h, &c);
    new_h[j] = h;
    new_cell[j] = c;
  }
}

template <typename scalar_t>
void backward_row(const scalar_t* grad_h, const scalar_t* grad_cell, const scalar_t* gates, const scalar_t* new_cell,
                  scalar_t* d_gates, scalar_t* d_old_cell, int64_t state) {
  using opmath_t = at::opmath_type<scalar_t>;
  int64_t j = 0;
  if constexpr (std::is_same_v<scalar_t, opmath_t>) {
    using V = at::vec::Vectorized<scalar_t>;
    const V one(scalar_t(1)), zero(scalar_t(0));
    for (; j + V::size() <= state; j += V::size()) {
      const V gate_i = V::loadu(gates + j), gate_o = V::loadu(gates + state + j);
      const V gate_c = V::loadu(gates + 2 * state + j), g_h = V::loadu(grad_h + j);
      const V input_gate = vec_sigmoid(gate_i), output_gate = vec_sigmoid(gate_o);
      const V tanh_cell = V::loadu(new_cell + j).tanh();
      const V d_new_cell = (one - tanh_cell * tanh_cell) * output_gate * g_h + V::loadu(grad_cell + j);
      const V exp_c = gate_c.exp();
      const V candidate = V::blendv(exp_c - one, gate_c, gate_c > zero);
      d_new_cell.store(d_old_cell + j);
      (candidate * d_new_cell * input_gate * (one - input_gate)).store(d_gates + j);
      (tanh_cell * g_h * output_gate * (one - output_gate)).store(d_gates + state + j);
      (input_gate * d_new_cell * V::blendv(exp_c, one, gate_c > zero)).store(d_gates + 2 * state + j);
    }
  }
  for (; j < state; ++j) {
    opmath_t di, dout, dc, dcell;
    cell_backward<opmath_t>(grad_h[j], grad_cell[j], new_cell[j], gates[j], gates[state + j], gates[2 * state + j],
                            &di, &dout, &dc, &dcell);
    d_gates[j] = di;
    d_gates[state + j] = dout;
    d_gates[2 * state + j] = dc;
    d_old_cell[j] = dcell;
  }
}

Forward forward_cpu(const at::Tensor& input, const at::Tensor& weights, const at::Tensor& bias,
                    const at::Tensor& old_h, const at::Tensor& old_cell) {
  check_forward(input, weights, bias, old_h, old_cell);
  // weights @ X^T, then transposed with the bias added: on CPUs this product is several
  // times faster than X @ weights^T (addmm with a transposed right operand).
  const auto gates = at::add(at::mm(weights, at::cat({old_h, input}, 1).t()).t(), bias).contiguous();
  const auto cell = old_cell.contiguous();
  auto new_h = at::empty_like(cell), new_cell = at::empty_like(cell);
  const int64_t batch = cell.size(0), state = cell.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gates.scalar_type(), "lltm_forward_cpu", [&] {
    const scalar_t* g = gates.const_data_ptr<scalar_t>();
    const scalar_t* c = cell.const_data_ptr<scalar_t>();
    scalar_t* h_out = new_h.mutable_data_ptr<scalar_t>();
    scalar_t* c_out = new_cell.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, batch, grain_rows(state), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        forward_row(g + b * 3 * state, c + b * state, h_out + b * state, c_out + b * state, state);
      }
    });
  });
  return {new_h, new_cell, gates};
}

Backward backward_cpu(const at::Tensor& grad_h, const at::Tensor& grad_cell, const at::Tensor& gates,
                      const at::Tensor& new_cell) {
  check_backward(grad_h, grad_cell, gates, new_cell);
  const auto gh = grad_h.contiguous(), gc = grad_cell.contiguous(), g = gates.contiguous();
  const auto nc = new_cell.contiguous();
  auto d_gates = at::empty_like(g), d_old_cell = at::empty_like(nc);
  const int64_t batch = nc.size(0), state = nc.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "lltm_backward_cpu", [&] {
    const scalar_t *gh_p = gh.const_data_ptr<scalar_t>(), *gc_p = gc.const_data_ptr<scalar_t>();
    const scalar_t *g_p = g.const_data_ptr<scalar_t>(), *nc_p = nc.const_data_ptr<scalar_t>();
    scalar_t* dg_p = d_gates.mutable_data_ptr<scalar_t>();
    scalar_t* doc_p = d_old_cell.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, batch, grain_rows(state), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t row = b * state;
        backward_row(gh_p + row, gc_p + row, g_p + 3 * row, nc_p + row, dg_p + 3 * row, doc_p + row, state);
      }
    });
  });
  return {d_gates, d_old_cell};
}

}  // namespace
}  // namespace fullgraph_lltm

// The kernels' own operators. The public torch.ops.fullgraph.lltm_forward / lltm_backward
// (api.py) check their inputs in Python and call these; the checks here guard direct calls.
TORCH_LIBRARY(fullgraph_lltm, m) {
  m.def("forward(Tensor input, Tensor weights, Tensor bias, Tensor old_h, Tensor old_cell) "
        "-> (Tensor new_h, Tensor new_cell, Tensor gates)");
  // The fused pointwise part of the backward; the matrix products are left to the caller
  // (autograd computes only the gradients that are needed).
  m.def("backward(Tensor grad_h, Tensor grad_cell, Tensor gates, Tensor new_cell) "
        "-> (Tensor d_gates, Tensor d_old_cell)");
}

TORCH_LIBRARY_IMPL(fullgraph_lltm, CPU, m) {
  m.impl("forward", &fullgraph_lltm::forward_cpu);
  m.impl("backward", &fullgraph_lltm::backward_cpu);
}
