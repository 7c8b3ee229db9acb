// fullgraph_cpu::knn_reduce(values [B, N, C], idx [B, M, K] int64) -> (max, min, sum [B, M, C],
// slots [2, B, M, C] int16) and knn_reduce_backward(grad_max, grad_min, grad_sum, idx, slots, N) ->
// [B, N, C]: ops/neighbors/reduce.py's knn_reduce on CPUs.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

constexpr int64_t kGrainRows = 64;      // query rows a forward task takes at least
constexpr int64_t kChannelBlock = 16;   // channels a backward task owns

void check_lists(const at::Tensor& idx, int64_t batch, int64_t columns) {
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 3 && idx.size(0) == batch,
              "idx: expected int64 lists [B, M, K] with B = ", batch, ", got ", idx.scalar_type(), " ", idx.sizes());
  TORCH_CHECK(idx.size(2) <= std::numeric_limits<int16_t>::max(), "idx: at most 32767 slots, got ", idx.size(2));
  if (idx.numel()) {
    TORCH_CHECK(idx.min().item<int64_t>() >= -1 && idx.max().item<int64_t>() < columns,
                "idx: expected values in [-1, ", columns, ")");
  }
}

template <typename T>
void reduce_rows(const T* values, const int64_t* idx, T* top, T* bottom, T* total, int16_t* top_slot,
                 int16_t* bottom_slot, int64_t rows, int64_t columns, int64_t k, int64_t channels, int64_t begin,
                 int64_t end) {
  constexpr int64_t W = 16;  // channels held in local arrays (registers) while the slots stream by
  for (int64_t q = begin; q < end; ++q) {
    const int64_t item = q / rows;
    const int64_t* list = idx + q * k;
    bool any = false;
    for (int64_t r = 0; r < k; ++r) any = any || list[r] >= 0;
    for (int64_t first = 0; first < channels; first += W) {
      const int64_t width = std::min(W, channels - first);
      T hi[W], lo[W], sum[W];
      int32_t hi_slot[W] = {}, lo_slot[W] = {};  // int32: as many lanes as float32
      for (int64_t c = 0; c < W; ++c) {
        hi[c] = -std::numeric_limits<T>::infinity();
        lo[c] = std::numeric_limits<T>::infinity();
        sum[c] = T(0);
      }
      for (int64_t r = 0; r < k; ++r) {
        const int64_t j = list[r];
        if (j < 0) continue;
        const T* row = values + (item * columns + j) * channels + first;
        const int32_t slot = static_cast<int32_t>(r);
        T x[W];
        for (int64_t c = 0; c < W; ++c) x[c] = c < width ? row[c] : T(0);
        for (int64_t c = 0; c < W; ++c) {  // selects and bitwise logic, not branches: vectorized
          const bool nan = x[c] != x[c];
          const bool higher = ((x[c] > hi[c]) | nan) & (hi[c] == hi[c]);
          const bool lower = ((x[c] < lo[c]) | nan) & (lo[c] == lo[c]);
          hi[c] = higher ? x[c] : hi[c];
          hi_slot[c] = higher ? slot : hi_slot[c];
          lo[c] = lower ? x[c] : lo[c];
          lo_slot[c] = lower ? slot : lo_slot[c];
          sum[c] += x[c];
        }
      }
      const int64_t at = q * channels + first;
      for (int64_t c = 0; c < width; ++c) {
        top[at + c] = any ? hi[c] : T(0);
        bottom[at + c] = any ? lo[c] : T(0);
        total[at + c] = sum[c];
        top_slot[at + c] = static_cast<int16_t>(hi_slot[c]);
        bottom_slot[at + c] = static_cast<int16_t>(lo_slot[c]);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> knn_reduce(const at::Tensor& values,
                                                                      const at::Tensor& idx) {
  TORCH_CHECK(values.device().is_cpu() && (values.scalar_type() == at::kFloat || values.scalar_type() == at::kDouble) &&
                  values.dim() == 3,
              "values: expected a float32 or float64 CPU tensor [B, N, C], got ", values.scalar_type(), " ",
              values.sizes());
  const int64_t batch = values.size(0), columns = values.size(1), channels = values.size(2);
  check_lists(idx, batch, columns);
  const int64_t rows = idx.size(1), k = idx.size(2);
  const at::Tensor points = values.contiguous(), lists = idx.contiguous();
  at::Tensor top = at::empty({batch, rows, channels}, values.options());
  at::Tensor bottom = at::empty_like(top), total = at::empty_like(top);
  at::Tensor slots = at::empty({2, batch, rows, channels}, values.options().dtype(at::kShort));
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "knn_reduce", [&] {
    const scalar_t* v = points.data_ptr<scalar_t>();
    const int64_t* l = lists.data_ptr<int64_t>();
    scalar_t *hi = top.data_ptr<scalar_t>(), *lo = bottom.data_ptr<scalar_t>(), *sum = total.data_ptr<scalar_t>();
    int16_t* s = slots.data_ptr<int16_t>();
    at::parallel_for(0, batch * rows, kGrainRows, [&](int64_t begin, int64_t end) {
      reduce_rows(v, l, hi, lo, sum, s, s + batch * rows * channels, rows, columns, k, channels, begin, end);
    });
  });
  return {top, bottom, total, slots};
}

at::Tensor knn_reduce_backward(const at::Tensor& grad_max, const at::Tensor& grad_min, const at::Tensor& grad_sum,
                               const at::Tensor& idx, const at::Tensor& slots, int64_t columns) {
  TORCH_CHECK(grad_sum.device().is_cpu() && grad_sum.dim() == 3 &&
                  (grad_sum.scalar_type() == at::kFloat || grad_sum.scalar_type() == at::kDouble),
              "grad_sum: expected a float32 or float64 CPU tensor [B, M, C], got ", grad_sum.scalar_type(), " ",
              grad_sum.sizes());
  TORCH_CHECK(grad_max.sizes() == grad_sum.sizes() && grad_min.sizes() == grad_sum.sizes() &&
                  grad_max.scalar_type() == grad_sum.scalar_type() && grad_min.scalar_type() == grad_sum.scalar_type(),
              "grad_max, grad_min: expected grad_sum's dtype and shape ", grad_sum.sizes());
  const int64_t batch = grad_sum.size(0), rows = grad_sum.size(1), channels = grad_sum.size(2);
  check_lists(idx, batch, columns);
  TORCH_CHECK(idx.size(1) == rows, "idx: expected ", rows, " lists, got ", idx.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kShort && slots.dim() == 4 && slots.size(0) == 2 && slots.size(1) == batch &&
                  slots.size(2) == rows && slots.size(3) == channels,
              "slots: expected int16 [2, B, M, C], got ", slots.scalar_type(), " ", slots.sizes());
  const int64_t k = idx.size(2);
  const at::Tensor g_max = grad_max.contiguous(), g_min = grad_min.contiguous(), g_sum = grad_sum.contiguous();
  const at::Tensor lists = idx.contiguous(), held = slots.contiguous();
  at::Tensor out = at::zeros({batch, columns, channels}, grad_sum.options());
  const int64_t blocks = (channels + kChannelBlock - 1) / kChannelBlock;
  AT_DISPATCH_FLOATING_TYPES(grad_sum.scalar_type(), "knn_reduce_backward", [&] {
    const scalar_t *gmax = g_max.data_ptr<scalar_t>(), *gmin = g_min.data_ptr<scalar_t>(),
                   *gsum = g_sum.data_ptr<scalar_t>();
    const int64_t* l = lists.data_ptr<int64_t>();
    const int16_t* top_slot = held.data_ptr<int16_t>();
    const int16_t* bottom_slot = top_slot + batch * rows * channels;
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t item = task / blocks, first = (task % blocks) * kChannelBlock;
        const int64_t last = std::min(channels, first + kChannelBlock);
        const int64_t width = last - first;
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t q = item * rows + i, at = q * channels + first;
          // The query's gradients and slots in local arrays, the slots widened to int32 (as
          // many lanes as float32): the channel loop below then vectorizes.
          scalar_t s[kChannelBlock], h[kChannelBlock], b[kChannelBlock];
          int32_t hs[kChannelBlock], bs[kChannelBlock];
          for (int64_t c = 0; c < width; ++c) {
            s[c] = gsum[at + c], h[c] = gmax[at + c], b[c] = gmin[at + c];
            hs[c] = top_slot[at + c], bs[c] = bottom_slot[at + c];
          }
          for (int64_t r = 0; r < k; ++r) {
            const int64_t j = l[q * k + r];
            if (j < 0) continue;
            scalar_t* row = o + (item * columns + j) * channels + first;
            const int32_t slot = static_cast<int32_t>(r);
            for (int64_t c = 0; c < width; ++c) {
              row[c] += s[c] + (hs[c] == slot ? h[c] : scalar_t(0)) + (bs[c] == slot ? b[c] : scalar_t(0));
            }
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fullgraph_cpu, m) {
  m.def("knn_reduce(Tensor values, Tensor idx) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("knn_reduce_backward(Tensor grad_max, Tensor grad_min, Tensor grad_sum, Tensor idx, Tensor slots, "
        "int columns) -> Tensor");
}

TORCH_LIBRARY_IMPL(fullgraph_cpu, CPU, m) {
  m.impl("knn_reduce", &knn_reduce);
  m.impl("knn_reduce_backward", &knn_reduce_backward);
}
