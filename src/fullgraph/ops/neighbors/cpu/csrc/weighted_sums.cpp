// fullgraph_cpu::weighted_sums(d [B, M, N], ok [B, M, N] bool, features [B, N, C], sigma) -> [B, M, C]
//   and weighted_sums_backward(...): radius_aggregate over whole distance blocks of small items
// (the "cpu" backend, cpu/backend.py): per query row, the features of the pairs that
// count (ok) weighted by exp(-(d - the row's least d) / sigma) and normalized, as
// pairs.aggregate_pairs computes them from gathered pairs; a row without a pair gets 0. The
// pairs' gathers and index_adds cost ~20 torch operators a chunk; here a row is one pass.
// Pairs that do not count are never read (their features may be anything, NaN included).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kGrainPairs = 1 << 14;  // pairs a task handles before rows are split across threads

// The row's normalized weights into ``weights`` [N] (0 where the pair does not count);
// false when no pair counts.
template <typename T>
bool row_weights(const T* d, const bool* ok, int64_t columns, T sigma, T* weights) {
  T shift = std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < columns; ++j) {
    if (ok[j] && d[j] < shift) shift = d[j];
  }
  if (!(shift < std::numeric_limits<T>::infinity())) {
    for (int64_t j = 0; j < columns; ++j) weights[j] = 0;
    return false;
  }
  T total = 0;
  for (int64_t j = 0; j < columns; ++j) {
    weights[j] = ok[j] ? std::exp(-(d[j] - shift) / sigma) : T(0);
    total += weights[j];
  }
  for (int64_t j = 0; j < columns; ++j) weights[j] /= total;
  return true;
}

void check_blocks(const at::Tensor& d, const at::Tensor& ok, const at::Tensor& features) {
  TORCH_CHECK(d.device().is_cpu() && (d.scalar_type() == at::kFloat || d.scalar_type() == at::kDouble) && d.dim() == 3,
              "d: expected a float32 or float64 CPU tensor [B, M, N], got ", d.scalar_type(), " of shape ", d.sizes());
  TORCH_CHECK(ok.scalar_type() == at::kBool && ok.sizes() == d.sizes(), "ok: expected bool of d's shape ", d.sizes(),
              ", got ", ok.scalar_type(), " ", ok.sizes());
  TORCH_CHECK(features.scalar_type() == d.scalar_type() && features.dim() == 3 && features.size(0) == d.size(0) &&
                  features.size(1) == d.size(2),
              "features: expected [B, N, C] of d's dtype with d's B and N (", d.sizes(), "), got ",
              features.scalar_type(), " ", features.sizes());
}

at::Tensor weighted_sums(const at::Tensor& d, const at::Tensor& ok, const at::Tensor& features, double sigma) {
  check_blocks(d, ok, features);
  const int64_t batch = d.size(0), rows = d.size(1), columns = d.size(2), channels = features.size(2);
  const at::Tensor distances = d.contiguous(), counts = ok.contiguous(), values = features.contiguous();
  at::Tensor out = at::zeros({batch, rows, channels}, d.options());
  AT_DISPATCH_FLOATING_TYPES(d.scalar_type(), "weighted_sums", [&] {
    const scalar_t* dist = distances.data_ptr<scalar_t>();
    const bool* pair_ok = counts.data_ptr<bool>();
    const scalar_t* feature = values.data_ptr<scalar_t>();
    scalar_t* target = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, kGrainPairs / std::max<int64_t>(columns, 1));
    at::parallel_for(0, batch * rows, grain, [&](int64_t first, int64_t last) {
      std::vector<scalar_t> weights(columns);
      for (int64_t row = first; row < last; ++row) {
        if (!row_weights(dist + row * columns, pair_ok + row * columns, columns, static_cast<scalar_t>(sigma),
                         weights.data())) {
          continue;
        }
        const scalar_t* item = feature + (row / rows) * columns * channels;
        scalar_t* sums = target + row * channels;
        for (int64_t j = 0; j < columns; ++j) {
          if (weights[j] == 0) continue;
          for (int64_t c = 0; c < channels; ++c) sums[c] += weights[j] * item[j * channels + c];
        }
      }
    });
  });
  return out;
}

// (grad_query [B, M, D], grad_ref [B, N, D], grad_features [B, N, C]) of weighted_sums
// followed by d = |q - r|: with p the weights, o the output row and g its gradient,
// dL/dF_j = sum_i p_ij g_i, dL/dd_ij = -(p_ij / sigma)(g_i . F_j - g_i . o_i), and a
// distance's gradient goes to q_i and -r_j along (q_i - r_j) / d_ij (none for d = 0).
// Rows first (grad_query, and the per-pair factors kept), then columns (grad_ref,
// grad_features): each sum in a fixed order whatever the threads.
std::tuple<at::Tensor, at::Tensor, at::Tensor> weighted_sums_backward(
    const at::Tensor& d, const at::Tensor& ok, const at::Tensor& features, const at::Tensor& query,
    const at::Tensor& ref, const at::Tensor& grad_out, const at::Tensor& out, double sigma) {
  check_blocks(d, ok, features);
  const int64_t batch = d.size(0), rows = d.size(1), columns = d.size(2), channels = features.size(2);
  TORCH_CHECK(query.scalar_type() == d.scalar_type() && query.dim() == 3 && query.size(0) == batch &&
                  query.size(1) == rows && ref.scalar_type() == d.scalar_type() && ref.dim() == 3 &&
                  ref.size(0) == batch && ref.size(1) == columns && ref.size(2) == query.size(2),
              "query, ref: expected [B, M, D], [B, N, D] of d's dtype, got ", query.sizes(), ", ", ref.sizes());
  TORCH_CHECK(grad_out.sizes() == out.sizes() && out.dim() == 3 && out.size(0) == batch && out.size(1) == rows &&
                  out.size(2) == channels && grad_out.scalar_type() == d.scalar_type() &&
                  out.scalar_type() == d.scalar_type(),
              "grad_out, out: expected [B, M, C] of d's dtype, got ", grad_out.sizes(), ", ", out.sizes());
  const int64_t dim = query.size(2);
  const at::Tensor distances = d.contiguous(), counts = ok.contiguous(), values = features.contiguous(),
                   points = query.contiguous(), cloud = ref.contiguous(), upstream = grad_out.contiguous(),
                   outputs = out.contiguous();
  at::Tensor grad_query = at::zeros_like(points), grad_ref = at::zeros_like(cloud),
             grad_features = at::zeros_like(values);
  at::Tensor weights = at::empty_like(distances), factors = at::empty_like(distances);
  AT_DISPATCH_FLOATING_TYPES(d.scalar_type(), "weighted_sums_backward", [&] {
    const scalar_t* dist = distances.data_ptr<scalar_t>();
    const bool* pair_ok = counts.data_ptr<bool>();
    const scalar_t* feature = values.data_ptr<scalar_t>();
    const scalar_t* q = points.data_ptr<scalar_t>();
    const scalar_t* r = cloud.data_ptr<scalar_t>();
    const scalar_t* g = upstream.data_ptr<scalar_t>();
    const scalar_t* o = outputs.data_ptr<scalar_t>();
    scalar_t* p = weights.data_ptr<scalar_t>();
    scalar_t* s = factors.data_ptr<scalar_t>();
    scalar_t* gq = grad_query.data_ptr<scalar_t>();
    scalar_t* gr = grad_ref.data_ptr<scalar_t>();
    scalar_t* gf = grad_features.data_ptr<scalar_t>();
    const scalar_t inv_sigma = static_cast<scalar_t>(1.0 / sigma);
    const int64_t row_grain = std::max<int64_t>(1, kGrainPairs / std::max<int64_t>(columns, 1));
    at::parallel_for(0, batch * rows, row_grain, [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        scalar_t* pr = p + row * columns;
        scalar_t* sr = s + row * columns;
        const bool any = row_weights(dist + row * columns, pair_ok + row * columns, columns,
                                     static_cast<scalar_t>(sigma), pr);
        const scalar_t* gi = g + row * channels;
        scalar_t baseline = 0;
        for (int64_t c = 0; c < channels; ++c) baseline += gi[c] * o[row * channels + c];
        const scalar_t* item_features = feature + (row / rows) * columns * channels;
        const scalar_t* item_ref = r + (row / rows) * columns * dim;
        const scalar_t* qi = q + row * dim;
        for (int64_t j = 0; j < columns; ++j) {
          sr[j] = 0;
          const scalar_t dij = dist[row * columns + j];
          if (!any || pr[j] == 0 || !(dij > 0) || !std::isfinite(dij)) continue;
          scalar_t projected = 0;
          for (int64_t c = 0; c < channels; ++c) projected += gi[c] * item_features[j * channels + c];
          sr[j] = -(pr[j] * inv_sigma) * (projected - baseline) / dij;
          for (int64_t k = 0; k < dim; ++k) gq[row * dim + k] += sr[j] * (qi[k] - item_ref[j * dim + k]);
        }
      }
    });
    const int64_t column_grain = std::max<int64_t>(1, kGrainPairs / std::max<int64_t>(rows, 1));
    at::parallel_for(0, batch * columns, column_grain, [&](int64_t first, int64_t last) {
      for (int64_t column = first; column < last; ++column) {
        const int64_t item = column / columns, j = column % columns;
        const scalar_t* rj = r + column * dim;
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t row = item * rows + i;
          const scalar_t pij = p[row * columns + j], sij = s[row * columns + j];
          if (pij != 0) {
            for (int64_t c = 0; c < channels; ++c) gf[column * channels + c] += pij * g[row * channels + c];
          }
          if (sij != 0) {
            for (int64_t k = 0; k < dim; ++k) gr[column * dim + k] -= sij * (q[row * dim + k] - rj[k]);
          }
        }
      }
    });
  });
  return {grad_query, grad_ref, grad_features};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fullgraph_cpu, m) {
  m.def("weighted_sums(Tensor d, Tensor ok, Tensor features, float sigma) -> Tensor");
  m.def("weighted_sums_backward(Tensor d, Tensor ok, Tensor features, Tensor query, Tensor ref, Tensor grad_out, "
        "Tensor out, float sigma) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fullgraph_cpu, CPU, m) {
  m.impl("weighted_sums", &weighted_sums);
  m.impl("weighted_sums_backward", &weighted_sums_backward);
}
