// Selections of smallest.cpp that squared_distances.cpp calls without the dispatcher's round trip:
// the brute force's rows (nearest_within; nearest_small) and the products' candidates
// (smallest_of_products; plain_nearest).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace fullgraph_cpu_rows {

// Of the distances d [B, M, N] (>= 0) of every pair of each item, the valid pairs (query_ok
// [B, M], ref_ok [B, N]) at or within within[b] (nullptr: +inf) counted into counts [B, M] and
// the ``take`` nearest written to values / positions [B, M, take] by (distance, position),
// NaN-valued where fewer (positions there unspecified). float and double.
template <typename T>
void nearest_rows(const T* d, const bool* query_ok, const bool* ref_ok, const T* within, int64_t batch, int64_t rows,
                  int64_t columns, int64_t take, T* values, int64_t* positions, int64_t* counts);

// fullgraph_cpu::smallest_of_products (smallest.cpp), its arguments checked.
std::tuple<at::Tensor, at::Tensor> smallest_of_products(const at::Tensor& products, const at::Tensor& bias,
                                                        int64_t take);

}  // namespace fullgraph_cpu_rows
