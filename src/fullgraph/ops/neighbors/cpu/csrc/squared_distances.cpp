// fullgraph_cpu::squared_distances(q [B, M, D], r [B, N, D], candidates [B, M, C] int64)
//   -> [B, M, C]: sum_d (q[b, i, d] - r[b, candidates[b, i, j], d])^2 in the reference's order
// (pairs.squared_difference: coordinate by coordinate up to D = 4, above that the squares
// summed by halving, pairs.halving_sum), float32 or float64, bit for bit.
//
// The dense kNN backend's re-measure on CPUs: torch gathered the candidates' rows ([B, M, C, D],
// ~30 MB for 16 x 256 queries of D = 64 and 28 candidates), subtracted, squared and summed them in
// four passes over memory; here each candidate's row is read once from the (cached) cloud.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cores.h"
#include "ranking.h"
#include "rows.h"

// Built with -ffp-contract=off (cpu/native.py): every product and sum is rounded on
// its own, as torch's element-wise kernels round them; -mfma would otherwise let the compiler
// fuse them.

namespace {

constexpr int64_t kPerCoordinateMaxDim = 4;  // pairs.PER_COORDINATE_MAX_DIM
constexpr int64_t kGrainPairs = 4096;        // candidate pairs a task measures before rows are split across threads
// ... of kGrainCoordinates / 4096 coordinates: a task's pairs shrink with D beyond it (1 x 200^2 D=160,
// 16 candidates a row: one task of 200 rows, 0.27 ms, where two threads share it now).
constexpr int64_t kGrainCoordinates = kGrainPairs * 16;

int64_t pair_grain(int64_t pairs_a_row, int64_t dim) {
  return std::max<int64_t>(1, kGrainCoordinates / (std::max<int64_t>(pairs_a_row, 1) * std::max<int64_t>(dim, 16)));
}
// The vectors' bytes: 64 where the build has AVX-512 (_extension.vector_flags), else 32.
#ifdef __AVX512F__
constexpr int64_t kVectorBytes = 64;
#else
constexpr int64_t kVectorBytes = 32;
#endif

// One pair. Above kPerCoordinateMaxDim the squares and each halving step in explicit vectors
// (each lane the same rounding as the scalar loop: the same bits; a step's two ranges never
// overlap, its length being at most its half): as scalar loops GCC left them 3x slower (D = 256).
template <typename T>
T squared_distance_in_steps(const T* q, const T* r, int64_t dim, T* squares) {
  if (dim <= kPerCoordinateMaxDim) {
    T total = (q[0] - r[0]) * (q[0] - r[0]);
    for (int64_t d = 1; d < dim; ++d) {
      const T diff = q[d] - r[d];
      total += diff * diff;
    }
    return total;
  }
  typedef T vec __attribute__((vector_size(kVectorBytes), aligned(sizeof(T))));  // unaligned loads and stores
  constexpr int64_t kWidth = kVectorBytes / sizeof(T);
  int64_t d = 0;
  for (; d + kWidth <= dim; d += kWidth) {
    const vec diff = *reinterpret_cast<const vec*>(q + d) - *reinterpret_cast<const vec*>(r + d);
    *reinterpret_cast<vec*>(squares + d) = diff * diff;
  }
  for (; d < dim; ++d) {
    const T diff = q[d] - r[d];
    squares[d] = diff * diff;
  }
  int64_t width = dim;
  while (width > 2) {
    int64_t half = 1;
    while (half * 2 < width) half *= 2;  // the largest power of two below the width
    const int64_t count = width - half;
    int64_t i = 0;
    for (; i + kWidth <= count; i += kWidth) {
      *reinterpret_cast<vec*>(squares + i) += *reinterpret_cast<const vec*>(squares + half + i);
    }
    for (; i < count; ++i) squares[i] += squares[i + half];
    width = half;
  }
  return width == 2 ? squares[0] + squares[1] : squares[0];
}

// The halving is a binary tree over the squares padded with zeros to a power of two P (x + 0 is
// x: the padding changes no sum): its root adds the sums of the even and the odd vectors of
// kWidth lanes, each of those the same over the next bit, and its leaves pair vector j with
// j + P / (2 kWidth) as the first step does. Evaluated depth first, in registers, the vectors
// beyond dim skipped (a partial one read masked), then the last vector halved by lane shuffles:
// the same roundings as the steps through memory, 1.5-3.5x faster at P <= kTreeMaxBytes, and from
// D = 5 (2-core CPU, 264 candidates of 1,000 queries: D=8 3.1 -> 1.1 ms, D=32 4.5 -> 1.4).
template <typename T, int64_t C, int R>
struct SquaresTree {
  typedef T vec __attribute__((vector_size(kVectorBytes), aligned(sizeof(T))));
  static constexpr int64_t kWidth = kVectorBytes / sizeof(T);
  // out[i]: the halving's sum of the squares of the vectors first, first + stride, ... (C of them)
  // of q - r[i], for R rows at once (each vector of q loaded once for all R).
  __attribute__((always_inline)) static inline void sum(const T* q, const T* const* r, int64_t first,
                                                        int64_t stride, int64_t dim, vec* out) {
    if constexpr (C == 1) {
      const int64_t d = first * kWidth;
      if (d + kWidth <= dim) {
        const vec near = *reinterpret_cast<const vec*>(q + d);
        for (int i = 0; i < R; ++i) {
          const vec diff = near - *reinterpret_cast<const vec*>(r[i] + d);
          out[i] = diff * diff;
        }
        return;
      }
#ifdef __AVX512F__
      if constexpr (kVectorBytes == 64) {  // the lanes past dim read as 0: 0 - 0, squared 0
        const __mmask16 inside = static_cast<__mmask16>((1u << (dim - d)) - 1);
        if constexpr (std::is_same_v<T, float>) {
          const vec near = reinterpret_cast<vec>(_mm512_maskz_loadu_ps(inside, q + d));
          for (int i = 0; i < R; ++i) {
            const vec diff = near - reinterpret_cast<vec>(_mm512_maskz_loadu_ps(inside, r[i] + d));
            out[i] = diff * diff;
          }
        } else {
          const __mmask8 lanes = static_cast<__mmask8>(inside);
          const vec near = reinterpret_cast<vec>(_mm512_maskz_loadu_pd(lanes, q + d));
          for (int i = 0; i < R; ++i) {
            const vec diff = near - reinterpret_cast<vec>(_mm512_maskz_loadu_pd(lanes, r[i] + d));
            out[i] = diff * diff;
          }
        }
        return;
      }
#endif
      for (int i = 0; i < R; ++i) {
        vec tail = {};
        for (int64_t j = 0; d + j < dim; ++j) {
          const T diff = q[d + j] - r[i][d + j];
          tail[j] = diff * diff;
        }
        out[i] = tail;
      }
    } else {
      SquaresTree<T, C / 2, R>::sum(q, r, first, 2 * stride, dim, out);
      if ((first + stride) * kWidth >= dim) return;  // the rest: padding
      vec odd[R];
      SquaresTree<T, C / 2, R>::sum(q, r, first + stride, 2 * stride, dim, odd);
      for (int i = 0; i < R; ++i) out[i] += odd[i];
    }
  }
};

// lanes i += lanes i + H of a vector v of W lanes of T (the upper lanes are not read after).
template <typename T, typename V, int64_t W, int64_t H, size_t... I>
inline V fold_lanes(V v, std::index_sequence<I...>) {
#if defined(__clang__)
  return v + __builtin_shufflevector(v, v, static_cast<int>((I + H) % W)...);
#else  // (GCC < 12 has no __builtin_shufflevector)
  typedef std::conditional_t<sizeof(T) == 4, int32_t, int64_t> index;
  typedef index mask __attribute__((vector_size(sizeof(V))));
  return v + __builtin_shuffle(v, mask{static_cast<index>((I + H) % W)...});
#endif
}

constexpr int64_t kTreeMaxBytes = 2048;  // beyond, candidate rows stream from memory: no gain measured
// Rows a query goes through the tree with at once, its vectors loaded once for all (1 thread, ns a
// pair at D=512: one 55, two 37-41, four 67: spilled registers).
constexpr int kRowsAtOnce = 2;

// Whether squared_distance sums D = dim in SquaresTree's registers (vectors of them), or 0.
template <typename T>
int64_t tree_vectors(int64_t dim) {
  int64_t padded = 1;
  while (padded < dim) padded *= 2;
  if (dim <= kPerCoordinateMaxDim || padded * int64_t(sizeof(T)) > kTreeMaxBytes) return 0;
  return std::max<int64_t>(padded / int64_t(kVectorBytes / sizeof(T)), 1);
}

// out[i] = the squared distance from q to r[i] for R rows, in SquaresTree (``vectors``: tree_vectors).
template <typename T, int R>
void squared_distances_in_tree(const T* q, const T* const* r, int64_t dim, int64_t vectors, T* out) {
  typedef T vec __attribute__((vector_size(kVectorBytes), aligned(sizeof(T))));
  constexpr int64_t kWidth = kVectorBytes / sizeof(T);
  vec v[R];
  switch (vectors) {
    case 1: SquaresTree<T, 1, R>::sum(q, r, 0, 1, dim, v); break;
    case 2: SquaresTree<T, 2, R>::sum(q, r, 0, 1, dim, v); break;
    case 4: SquaresTree<T, 4, R>::sum(q, r, 0, 1, dim, v); break;
    case 8: SquaresTree<T, 8, R>::sum(q, r, 0, 1, dim, v); break;
    case 16: SquaresTree<T, 16, R>::sum(q, r, 0, 1, dim, v); break;
    case 32: SquaresTree<T, 32, R>::sum(q, r, 0, 1, dim, v); break;
    default: SquaresTree<T, 64, R>::sum(q, r, 0, 1, dim, v); break;
  }
  for (int i = 0; i < R; ++i) {
    vec x = v[i];
    if constexpr (kWidth == 16) x = fold_lanes<T, vec, 16, 8>(x, std::make_index_sequence<16>{});
    if constexpr (kWidth >= 8) x = fold_lanes<T, vec, kWidth, 4>(x, std::make_index_sequence<kWidth>{});
    x = fold_lanes<T, vec, kWidth, 2>(x, std::make_index_sequence<kWidth>{});
    out[i] = x[0] + x[1];
  }
}

template <typename T>
T squared_distance(const T* q, const T* r, int64_t dim, T* squares) {
  const int64_t vectors = tree_vectors<T>(dim);
  if (vectors == 0) return squared_distance_in_steps(q, r, dim, squares);
  T out;
  squared_distances_in_tree<T, 1>(q, &r, dim, vectors, &out);
  return out;
}

void check_clouds(const at::Tensor& q, const at::Tensor& r) {
  TORCH_CHECK(q.device().is_cpu() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble) && q.dim() == 3,
              "q: expected a float32 or float64 CPU tensor [B, M, D], got ", q.scalar_type(), " of shape ", q.sizes(),
              " on ", q.device());
  TORCH_CHECK(r.device().is_cpu() && r.scalar_type() == q.scalar_type() && r.dim() == 3 && r.size(0) == q.size(0) &&
                  r.size(2) == q.size(2),
              "r: expected a CPU tensor [B, N, D] of q's dtype with q's B and D (", q.sizes(), ", ", q.scalar_type(),
              "), got ", r.scalar_type(), " of shape ", r.sizes(), " on ", r.device());
  TORCH_CHECK(q.size(2) > 0, "q: expected at least one coordinate, got shape ", q.sizes());
}

// A few float32 ulps: a floor above (1 + kFloorMargin) times a squared distance keeps the
// square roots of both apart, whatever the sqrt's last-bit rounding.
constexpr double kFloorMargin = 1.0 / (1 << 18);

// [B, M, take]: from each query to ``take`` rows of its item's cloud, the rows
// position[row * take + j]. With ``floors`` ([B, M, take], ascending in a row: floors under
// those squared distances) and ``least`` >= 1, a row's rows from the first whose floor lies
// above the least first ``least`` measured are not measured (+inf): they cannot be among the
// row's ``least`` nearest.
at::Tensor measure(const at::Tensor& q, const at::Tensor& r, const int64_t* position, int64_t take,
                   const at::Tensor& floors = at::Tensor(), int64_t least = 0) {
  const int64_t batch = q.size(0), rows = q.size(1), dim = q.size(2), columns = r.size(1);
  const at::Tensor queries = q.contiguous(), cloud = r.contiguous();
  at::Tensor out = at::empty({batch, rows, take}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "squared_distances", [&] {
    const scalar_t* query = queries.data_ptr<scalar_t>();
    const scalar_t* ref = cloud.data_ptr<scalar_t>();
    scalar_t* target = out.data_ptr<scalar_t>();
    const scalar_t* floor = floors.defined() ? floors.data_ptr<scalar_t>() : nullptr;
    const int64_t grain = pair_grain(take, dim);
    const int64_t vectors = tree_vectors<scalar_t>(dim);
    at::parallel_for(0, batch * rows, grain, [&](int64_t first, int64_t last) {
      std::vector<scalar_t> squares(dim);
      for (int64_t row = first; row < last; ++row) {
        const scalar_t* item = ref + (row / rows) * columns * dim;
        const scalar_t* near = query + row * dim;
        const int64_t* at = position + row * take;
        scalar_t* found = target + row * take;
        scalar_t largest = 0;  // of the first ``least``
        const auto outside = [&](int64_t j) {
          return floor != nullptr && j >= least && floor[row * take + j] > largest * scalar_t(1 + kFloorMargin);
        };
        for (int64_t j = 0; j < take;) {
          if (outside(j)) {
            std::fill(found + j, found + take, std::numeric_limits<scalar_t>::infinity());
            break;
          }
          // kRowsAtOnce rows at once (q's loads shared) where no floor waits for another's distance
          // (floors ascend: the last one's decides)
          const auto together = [&](int64_t count) {
            return vectors > 0 && j + count <= take && (j + count <= least || (j >= least && !outside(j + count - 1)));
          };
          int64_t count = 1;
          if (together(kRowsAtOnce)) {
            const scalar_t* some[kRowsAtOnce];
            for (int i = 0; i < kRowsAtOnce; ++i) some[i] = item + at[j + i] * dim;
            squared_distances_in_tree<scalar_t, kRowsAtOnce>(near, some, dim, vectors, found + j);
            count = kRowsAtOnce;
          } else {
            found[j] = squared_distance(near, item + at[j] * dim, dim, squares.data());
          }
          for (const int64_t next = j + count; j < next; ++j) {
            if (j < least) largest = j == 0 || found[j] > largest || found[j] != found[j] ? found[j] : largest;
          }
        }
      }
    });
  });
  return out;
}

// Every pair, kLanes references at a time: each lane repeats squared_distance's operations in its
// order (so the same bits), on the block's coordinates transposed ([D][kLanes]) in explicit 32- or
// 64-byte vectors (GCC's vector extension; 1M pairs of D = 64 on one core).
constexpr int64_t kLanes = 16;
// The transposed references of a call up to this size stay in a per-thread buffer between calls:
// fresh pages cost more than a small call's work (1 x 50 x 400 D=200: 0.09 of 0.5 ms zeroing them).
constexpr int64_t kKeptLanesBytes = 4 << 20;

template <typename T>
void squared_distances_of_block(const T* __restrict__ q, const T* __restrict__ block, int64_t dim,
                                 T* __restrict__ squares, T* __restrict__ out) {
  typedef T vec __attribute__((vector_size(kVectorBytes), aligned(sizeof(T))));  // unaligned loads and stores
  constexpr int64_t kVectors = kLanes / (kVectorBytes / sizeof(T));
  const vec* lanes = reinterpret_cast<const vec*>(block);
  vec* sums = reinterpret_cast<vec*>(dim <= kPerCoordinateMaxDim ? out : squares);
  if (dim <= kPerCoordinateMaxDim) {
    for (int64_t v = 0; v < kVectors; ++v) {
      const vec diff = q[0] - lanes[v];
      sums[v] = diff * diff;
    }
    for (int64_t d = 1; d < dim; ++d) {
      for (int64_t v = 0; v < kVectors; ++v) {
        const vec diff = q[d] - lanes[d * kVectors + v];
        sums[v] += diff * diff;
      }
    }
    return;
  }
  // The halving's first two steps fused with the squares, in registers (the same roundings:
  // each square, then the sums in the halving's order): stores bound this loop.
  int64_t first = 1;  // the first step's half: the largest power of two below dim
  while (first * 2 < dim) first *= 2;
  const auto first_step = [&](int64_t d, int64_t v) {
    const vec diff = q[d] - lanes[d * kVectors + v];
    if (d >= dim - first) return diff * diff;
    const vec other = q[d + first] - lanes[(d + first) * kVectors + v];
    return diff * diff + other * other;
  };
  int64_t width = first / 2;  // the second step's half (a power of two: every pair full)
  for (int64_t d = 0; d < width; ++d) {
    for (int64_t v = 0; v < kVectors; ++v) sums[d * kVectors + v] = first_step(d, v) + first_step(d + width, v);
  }
  while (width > 2) {
    int64_t half = 1;
    while (half * 2 < width) half *= 2;
    for (int64_t d = 0; d < width - half; ++d) {
      for (int64_t v = 0; v < kVectors; ++v) sums[d * kVectors + v] += sums[(d + half) * kVectors + v];
    }
    width = half;
  }
  vec* result = reinterpret_cast<vec*>(out);
  for (int64_t v = 0; v < kVectors; ++v) result[v] = width == 2 ? sums[v] + sums[kVectors + v] : sums[v];
}

// From this many coordinates (and up to the tree's kTreeMaxBytes) every pair is measured
// kRowsAtOnce references at a time in SquaresTree's registers, not kLanes at a time through the lanes' squares
// in memory (1 thread, 300^2 pairs, ns a pair lanes / tree: D=128 7.2 / 9.4, 256 16.7 / 16.3,
// 512 31.5 / 25.6).
constexpr int64_t kTreeAllMinDim = 257;

at::Tensor measure_all(const at::Tensor& q, const at::Tensor& r) {
  const int64_t batch = q.size(0), rows = q.size(1), dim = q.size(2), columns = r.size(1);
  const int64_t blocks = (columns + kLanes - 1) / kLanes;
  const at::Tensor queries = q.contiguous(), cloud = r.contiguous();
  at::Tensor out = at::empty({batch, rows, columns}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "squared_distances_all", [&] {
    const scalar_t* query = queries.data_ptr<scalar_t>();
    const scalar_t* ref = cloud.data_ptr<scalar_t>();
    const int64_t vectors = tree_vectors<scalar_t>(dim);
    if (vectors > 0 && dim >= kTreeAllMinDim) {
      scalar_t* target = out.data_ptr<scalar_t>();
      at::parallel_for(0, batch * rows, pair_grain(columns, dim), [&](int64_t first, int64_t last) {
        for (int64_t row = first; row < last; ++row) {
          const scalar_t* item = ref + (row / rows) * columns * dim;
          scalar_t* found = target + row * columns;
          int64_t j = 0;
          for (; j + kRowsAtOnce <= columns; j += kRowsAtOnce) {
            const scalar_t* some[kRowsAtOnce];
            for (int i = 0; i < kRowsAtOnce; ++i) some[i] = item + (j + i) * dim;
            squared_distances_in_tree<scalar_t, kRowsAtOnce>(query + row * dim, some, dim, vectors, found + j);
          }
          for (; j < columns; ++j) {
            const scalar_t* one = item + j * dim;
            squared_distances_in_tree<scalar_t, 1>(query + row * dim, &one, dim, vectors, found + j);
          }
        }
      });
      return;
    }
    // [B, blocks, D, kLanes]: each block of kLanes references transposed, missing lanes 0.
    const int64_t count = batch * blocks * dim * kLanes;
    at::Tensor transposed;
    scalar_t* lanes;
    if (count * int64_t(sizeof(scalar_t)) <= kKeptLanesBytes) {
      thread_local std::vector<scalar_t> kept;
      kept.assign(count, scalar_t(0));
      lanes = kept.data();
    } else {
      transposed = at::zeros({count}, q.options());
      lanes = transposed.data_ptr<scalar_t>();
    }
    scalar_t* target = out.data_ptr<scalar_t>();
    for (int64_t item = 0; item < batch; ++item) {
      for (int64_t column = 0; column < columns; ++column) {
        scalar_t* block = lanes + (item * blocks + column / kLanes) * dim * kLanes + column % kLanes;
        for (int64_t d = 0; d < dim; ++d) block[d * kLanes] = ref[(item * columns + column) * dim + d];
      }
    }
    const int64_t grain = pair_grain(columns, dim);
    at::parallel_for(0, batch * rows, grain, [&](int64_t first, int64_t last) {
      std::vector<scalar_t> squares(dim * kLanes);
      scalar_t measured[kLanes];
      for (int64_t row = first; row < last; ++row) {
        const scalar_t* item = lanes + (row / rows) * blocks * dim * kLanes;
        scalar_t* found = target + row * columns;
        for (int64_t b = 0; b < blocks; ++b) {
          squared_distances_of_block(query + row * dim, item + b * dim * kLanes, dim, squares.data(), measured);
          const int64_t count = std::min(kLanes, columns - b * kLanes);
          for (int64_t j = 0; j < count; ++j) found[b * kLanes + j] = measured[j];
        }
      }
    });
  });
  return out;
}

void check_candidates(const at::Tensor& q, const at::Tensor& candidates) {
  TORCH_CHECK(candidates.device().is_cpu() && candidates.scalar_type() == at::kLong && candidates.dim() == 3 &&
                  candidates.size(0) == q.size(0) && candidates.size(1) == q.size(1),
              "candidates: expected an int64 CPU tensor [B, M, C] with q's B and M (", q.sizes(), "), got ",
              candidates.scalar_type(), " of shape ", candidates.sizes(), " on ", candidates.device());
}

// The candidates, contiguous, once every position is known to lie in [0, columns).
at::Tensor checked_positions(const at::Tensor& candidates, int64_t columns) {
  const at::Tensor positions = candidates.contiguous();
  if (positions.numel() > 0) {
    const auto [low, high] = at::aminmax(positions);
    TORCH_CHECK(low.item<int64_t>() >= 0 && high.item<int64_t>() < columns,
                "candidates: expected positions in [0, ", columns, ") (r's rows), got ", low.item<int64_t>(), " to ",
                high.item<int64_t>());
  }
  return positions;
}

at::Tensor squared_distances(const at::Tensor& q, const at::Tensor& r, const at::Tensor& candidates) {
  check_clouds(q, r);
  check_candidates(q, candidates);
  const at::Tensor positions = checked_positions(candidates, r.size(1));
  return measure(q, r, positions.data_ptr<int64_t>(), positions.size(2));
}

// squared_distances_bounded(q, r, candidates [B, M, C], floors [B, M, C], least) -> [B, M, C]:
// squared_distances, but in each row the candidates from the first whose floor (ascending: a
// floor under its squared distance) lies above the largest of the first ``least`` are left at
// +inf: none of them is among the row's ``least`` nearest (the dense backend's candidates past
// the k-th by more than the products' error are not re-measured).
at::Tensor squared_distances_bounded(const at::Tensor& q, const at::Tensor& r, const at::Tensor& candidates,
                                     const at::Tensor& floors, int64_t least) {
  check_clouds(q, r);
  check_candidates(q, candidates);
  TORCH_CHECK(floors.device().is_cpu() && floors.scalar_type() == q.scalar_type() &&
                  floors.sizes() == candidates.sizes(),
              "floors: expected a CPU tensor of q's dtype and candidates' shape ", candidates.sizes(), ", got ",
              floors.scalar_type(), " of shape ", floors.sizes());
  TORCH_CHECK(least >= 1, "least: expected >= 1, got ", least);
  const at::Tensor positions = checked_positions(candidates, r.size(1));
  return measure(q, r, positions.data_ptr<int64_t>(), positions.size(2), floors.contiguous(), least);
}

// order_by_distance(distances [B, M, C] >= 0, positions [B, M, C] int64 >= 0, distinct in a row,
// keep = -1) -> the first ``keep`` (-1: C) of both ordered by (distance, position) in each row,
// [B, M, keep], as pairs.order_by_distance orders
// complete lists: the dense backend's re-measured kNN lists on CPUs (torch's keys, sort and
// gathers took ~8 operators of tens of microseconds each).
std::tuple<at::Tensor, at::Tensor> order_by_distance(const at::Tensor& distances, const at::Tensor& positions,
                                                     int64_t keep) {
  TORCH_CHECK(distances.device().is_cpu() && (distances.scalar_type() == at::kFloat ||
                                              distances.scalar_type() == at::kDouble) && distances.dim() == 3,
              "distances: expected a float32 or float64 CPU tensor [B, M, C], got ", distances.scalar_type(),
              " of shape ", distances.sizes());
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong &&
                  positions.sizes() == distances.sizes(),
              "positions: expected int64 of distances' shape ", distances.sizes(), ", got ", positions.scalar_type(),
              " of shape ", positions.sizes());
  const int64_t take = distances.size(2), count = distances.size(0) * distances.size(1);
  if (keep < 0) keep = take;
  TORCH_CHECK(keep <= take, "keep: expected at most ", take, " (the lists' length), got ", keep);
  const at::Tensor source = distances.contiguous(), source_at = positions.contiguous();
  // (the first ``keep`` of each ordered row written to new lists: no copy of the inputs first)
  at::Tensor values = at::empty({distances.size(0), distances.size(1), keep}, distances.options());
  at::Tensor order = at::empty({distances.size(0), distances.size(1), keep}, positions.options());
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "order_by_distance", [&] {
    const scalar_t* given = source.data_ptr<scalar_t>();
    const int64_t* given_at = source_at.data_ptr<int64_t>();
    scalar_t* found = values.data_ptr<scalar_t>();
    int64_t* found_at = order.data_ptr<int64_t>();
    const int64_t grain = std::max<int64_t>(1, kGrainPairs / std::max<int64_t>(take, 1));
    at::parallel_for(0, count, grain, [&](int64_t first, int64_t last) {
      std::vector<uint64_t> words(take + 8);
      std::vector<std::pair<scalar_t, int64_t>> pairs(take);
      for (int64_t row = first; row < last; ++row) {
        const scalar_t* value = given + row * take;
        const int64_t* at = given_at + row * take;
        scalar_t* kept = found + row * keep;
        int64_t* kept_at = found_at + row * keep;
        bool in_words = std::is_same_v<scalar_t, float>;
        for (int64_t j = 0; j < take; ++j) in_words &= at[j] >= 0 && at[j] <= UINT32_MAX;
        if (in_words) {  // distances >= 0: their bits order as they do
          for (int64_t j = 0; j < take; ++j) {
            words[j] = fullgraph_ranking::word(static_cast<float>(value[j]), static_cast<uint32_t>(at[j]));
          }
          fullgraph_ranking::rank_words(words.data(), take, keep, [&](int rank, uint64_t word) {
            kept[rank] = static_cast<scalar_t>(fullgraph_ranking::value_of(word));
            kept_at[rank] = static_cast<int64_t>(word & 0xFFFFFFFFu);
            return false;
          });
          continue;
        }
        for (int64_t j = 0; j < take; ++j) pairs[j] = {value[j], at[j]};
        std::partial_sort(pairs.begin(), pairs.begin() + keep, pairs.end());
        for (int64_t j = 0; j < keep; ++j) {
          kept[j] = pairs[j].first;
          kept_at[j] = pairs[j].second;
        }
      }
    });
  });
  return {values, order};
}

// squared_norms(x [B, L, D]) -> [B, L]: sum_d x[b, i, d]^2, in vectors (the dense backend's
// frames, whose certificate takes any order of the sums): one pass, where torch's x * x wrote a
// copy of the cloud before summing it.
at::Tensor squared_norms(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) && x.dim() == 3,
              "x: expected a float32 or float64 CPU tensor [B, L, D], got ", x.scalar_type(), " of shape ", x.sizes());
  const at::Tensor points = x.contiguous();
  const int64_t count = x.size(0) * x.size(1), dim = x.size(2);
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "squared_norms", [&] {
    typedef scalar_t vec __attribute__((vector_size(kVectorBytes), aligned(sizeof(scalar_t))));
    constexpr int64_t kWidth = kVectorBytes / sizeof(scalar_t);
    const scalar_t* source = points.data_ptr<scalar_t>();
    scalar_t* target = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, kGrainPairs * 16 / std::max<int64_t>(dim, 1));
    at::parallel_for(0, count, grain, [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        const scalar_t* point = source + row * dim;
        vec sums = {};
        int64_t d = 0;
        for (; d + kWidth <= dim; d += kWidth) {
          const vec v = *reinterpret_cast<const vec*>(point + d);
          sums += v * v;
        }
        scalar_t total = 0;
        for (int64_t lane = 0; lane < kWidth; ++lane) total += sums[lane];
        for (; d < dim; ++d) total += point[d] * point[d];
        target[row] = total;
      }
    });
  });
  return out;
}

// squared_distances_all(q [B, M, D], r [B, N, D]) -> [B, M, N]: every pair of each item, in the
// same order: the CPU backend's brute force of small items (cpu.brute_force) measures with
// this, one pass, where torch took ~10 operators.
at::Tensor squared_distances_all(const at::Tensor& q, const at::Tensor& r) {
  check_clouds(q, r);
  return measure_all(q, r);
}

// nearest_small(query [B, M, D], ref [B, N, D], take, below, above) -> (dists [B, M, take],
// positions [B, M, take] int64, counts [B, M] int64): plain kNN of small items, every pair
// measured, as the CPU backend's brute force computes it (cpu.brute_force) in one call: a
// point is valid where every coordinate is finite, each item divided by the power of two of
// its largest valid |coordinate| where that lies outside [below, above] (scaling.safe_scale),
// the pairs measured (squared_distances_all) and rooted, masked, counted and selected by
// fullgraph_cpu::nearest_within, and multiplied back; +inf / -1 where fewer valid pairs. Tiny
// calls spent ~0.35 ms in the ~25 torch operators around the two kernels (~0.07 ms).
std::tuple<at::Tensor, at::Tensor, at::Tensor> nearest_small(const at::Tensor& query, const at::Tensor& ref,
                                                             int64_t take, double below, double above) {
  check_clouds(query, ref);
  const fullgraph_cpu_cores::Fitted call;
  const int64_t batch = query.size(0), rows = query.size(1), columns = ref.size(1), dim = query.size(2);
  TORCH_CHECK(take >= 0 && take <= columns, "take: expected 0 to ", columns, " (the rows' length), got ", take);
  const at::Tensor q = query.contiguous(), r = ref.contiguous();
  // (no tensors beyond the distances and the lists: a tiny call's allocations and operator
  // calls cost more than its arithmetic)
  std::unique_ptr<bool[]> query_ok(new bool[batch * rows]), ref_ok(new bool[batch * columns]);
  std::vector<double> scale(batch, 1.0);
  bool unscaled = true;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "nearest_small", [&] {
    const auto mark = [dim](const scalar_t* points, int64_t count, bool* ok, scalar_t& largest) {
      for (int64_t i = 0; i < count; ++i) {
        scalar_t size = 0;
        bool finite = true;
        for (int64_t d = 0; d < dim; ++d) {
          finite &= std::isfinite(points[i * dim + d]);
          size = std::max(size, std::abs(points[i * dim + d]));
        }
        ok[i] = finite;
        if (finite) largest = std::max(largest, size);
      }
    };
    for (int64_t item = 0; item < batch; ++item) {
      scalar_t largest = 0;
      mark(q.data_ptr<scalar_t>() + item * rows * dim, rows, query_ok.get() + item * rows, largest);
      mark(r.data_ptr<scalar_t>() + item * columns * dim, columns, ref_ok.get() + item * columns, largest);
      if ((largest > above || largest < below) && largest > 0) {
        int exponent;
        std::frexp(largest, &exponent);  // largest = m 2^exponent, 0.5 <= m < 1
        scale[item] = std::ldexp(1.0, exponent - 1);
        unscaled &= scale[item] == 1.0;
      }
    }
  });
  at::Tensor d;
  if (unscaled) {  // (x / 1 == x: the usual items need no scaled copies)
    d = measure_all(q, r);
  } else {
    const at::Tensor factor = at::tensor(at::ArrayRef<double>(scale), q.options().dtype(at::kDouble))
                                  .to(q.scalar_type()).view({batch, 1, 1});
    d = measure_all(q / factor, r / factor);
  }
  d.sqrt_();
  at::Tensor values = at::empty({batch, rows, take}, q.options());
  at::Tensor positions = at::empty({batch, rows, take}, q.options().dtype(at::kLong));
  at::Tensor counts = at::empty({batch, rows}, q.options().dtype(at::kLong));
  // Missing slots (NaN) become +inf / -1 and found distances are multiplied back (scaled items),
  // in one pass where four torch operators took most of a tiny call.
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "nearest_small_lists", [&] {
    scalar_t* value = values.data_ptr<scalar_t>();
    int64_t* position = positions.data_ptr<int64_t>();
    fullgraph_cpu_rows::nearest_rows<scalar_t>(d.data_ptr<scalar_t>(), query_ok.get(), ref_ok.get(), nullptr, batch,
                                               rows, columns, take, value, position, counts.data_ptr<int64_t>());
    const int64_t per_item = rows * take;
    for (int64_t item = 0; item < batch; ++item) {
      const scalar_t factor = static_cast<scalar_t>(scale[item]);
      for (int64_t j = item * per_item; j < (item + 1) * per_item; ++j) {
        if (value[j] != value[j]) {
          value[j] = std::numeric_limits<scalar_t>::infinity();
          position[j] = -1;
        } else if (!unscaled) {
          value[j] *= factor;
        }
      }
    }
  });
  return {values, positions, counts};
}

// The product's unit roundoff as torch is set now (certificate.roundoff's, for a compiled graph,
// which cannot ask torch's setting where it runs): float32 products may run in TF32 or bf16 where
// the user allowed it; settings that disagree read as the loosest.
double product_roundoff(at::ScalarType dtype) {
  if (dtype == at::kDouble) return std::ldexp(1.0, -53);
  try {
    switch (at::globalContext().float32MatmulPrecision()) {
      case at::Float32MatmulPrecision::HIGHEST: return std::ldexp(1.0, -24);
      case at::Float32MatmulPrecision::HIGH: return std::ldexp(1.0, -11);
      default: return std::ldexp(1.0, -8);
    }
  } catch (const c10::Error&) {
    return std::ldexp(1.0, -8);
  }
}

// plain_nearest(query [B, M, D], ref [B, N, D], k, take, u, below, above) -> (dists [B, M, k],
// positions [B, M, k] int64, proven): the dense backend's kNN of a small call on plain points
// (dense._plain_on_cpu) in one call: |q|^2 and |r|^2; where every norm is finite and each item's
// largest lies in [D below^2, above^2] (no item would be scaled), one product q r^T, per query
// the ``take`` least |r|^2 - 2 q.r (smallest_of_products), a floor under the squared distance of
// every reference not among them (the expansion's error bound, u the product's unit roundoff, 0:
// as torch is set, product_roundoff: dense/certificate.py), the candidates re-measured in the
// reference's arithmetic up to the first whose floor lies past the k-th (measure), rooted and
// ordered (order_by_distance).
// proven (a 0-d bool) is false where the call is not such, or a row's k-th squared distance is
// not below its floor: the lists are then empty and the caller takes the usual path. A small
// call spent ~0.15 ms in the ~20 torch operators this replaces.
std::tuple<at::Tensor, at::Tensor, at::Tensor> plain_nearest(const at::Tensor& query, const at::Tensor& ref, int64_t k,
                                                             int64_t take, double u, double below, double above) {
  check_clouds(query, ref);
  if (u <= 0) u = product_roundoff(query.scalar_type());
  const int64_t batch = query.size(0), rows = query.size(1), columns = ref.size(1), dim = query.size(2);
  TORCH_CHECK(k >= 1 && k <= take && take <= columns, "take: expected k <= take <= ", columns,
              " (the references), k >= 1, got k = ", k, ", take = ", take);
  const at::Tensor q = query.contiguous(), r = ref.contiguous();
  const at::Tensor none = at::empty({0}, q.options());
  const auto refused = [&] {
    return std::make_tuple(none, none.to(at::kLong), at::zeros({}, q.options().dtype(at::kBool)));
  };
  const at::Tensor q_norms = squared_norms(q), r_norms = squared_norms(r);
  bool plain = true;
  double reach = 0;  // the largest |r| of any item
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "plain_nearest_norms", [&] {
    const scalar_t* q_norm = q_norms.data_ptr<scalar_t>();
    const scalar_t* r_norm = r_norms.data_ptr<scalar_t>();
    double r_top = 0;
    for (int64_t item = 0; item < batch && plain; ++item) {
      double top = 0;
      for (int64_t i = item * rows; i < (item + 1) * rows; ++i) {
        plain &= std::isfinite(q_norm[i]);
        top = std::max<double>(top, q_norm[i]);
      }
      for (int64_t j = item * columns; j < (item + 1) * columns; ++j) {
        plain &= std::isfinite(r_norm[j]);
        top = std::max<double>(top, r_norm[j]);
        r_top = std::max<double>(r_top, r_norm[j]);
      }
      // (finite norms: finite points; a largest norm in range, times sqrt(D) below: no item scaled)
      plain &= top >= dim * below * below && top <= above * above;
    }
    reach = std::sqrt(r_top);
  });
  if (!plain) return refused();
  auto [values, candidates] = fullgraph_cpu_rows::smallest_of_products(at::bmm(q, r.transpose(1, 2)), r_norms, take);
  at::Tensor floors = at::empty_like(values);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "plain_nearest_floors", [&] {
    const scalar_t* value = values.data_ptr<scalar_t>();
    const scalar_t* q_norm = q_norms.data_ptr<scalar_t>();
    scalar_t* floor = floors.data_ptr<scalar_t>();
    const double error = 2.0 * (dim + 4) * u, shrink = 1.0 - 2.0 * (dim + 2) * u;
    for (int64_t row = 0; row < batch * rows; ++row) {
      const double spread = std::sqrt(static_cast<double>(q_norm[row])) + reach;
      for (int64_t j = row * take; j < (row + 1) * take; ++j) {
        floor[j] = static_cast<scalar_t>((value[j] + static_cast<double>(q_norm[row]) - error * spread * spread) *
                                         shrink);
      }
    }
  });
  // (the candidates past the k-th by more than the products' error are not re-measured: +inf)
  at::Tensor squares = measure(q, r, candidates.data_ptr<int64_t>(), take, floors, k);
  squares.sqrt_();
  auto [dists, positions] = order_by_distance(squares, candidates, k);
  bool proven = true;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "plain_nearest_check", [&] {
    // The k-th squared distance x from the ordered k-th distance d = sqrt(x) (rounded to nearest):
    // x (1 + 8u') <= fl(d d) (1 + 16u') after the roundings of d, d d and the product (u' the
    // dtype's own unit roundoff, at most u).
    const scalar_t* dist = dists.data_ptr<scalar_t>();
    const scalar_t* floor = floors.data_ptr<scalar_t>();
    const scalar_t grow = static_cast<scalar_t>(1 + 16 * u);
    for (int64_t row = 0; row < batch * rows && proven; ++row) {
      const scalar_t kth = dist[row * k + k - 1];
      proven = kth * kth * grow < floor[row * take + take - 1];
    }
  });
  if (!proven) return refused();
  return std::make_tuple(dists, positions, at::ones({}, q.options().dtype(at::kBool)));
}

// small_nearest(query, ref, k, take, u, below, above) -> (dists, positions [B, M, k]):
// plain_nearest's lists, and where it refuses nearest_small's (every pair measured; the same
// lists): one operator of fixed output shapes, for a compiled graph (dense.plain_in_one_call).
std::tuple<at::Tensor, at::Tensor> small_nearest(const at::Tensor& query, const at::Tensor& ref, int64_t k,
                                                 int64_t take, double u, double below, double above) {
  const fullgraph_cpu_cores::Fitted call;
  auto [dists, positions, proven] = plain_nearest(query, ref, k, take, u, below, above);
  if (proven.item<bool>()) return std::make_tuple(dists, positions);
  auto [values, order, counts] = nearest_small(query, ref, k, below, above);
  return std::make_tuple(values, order);
}

// judge_cores_by(min_seconds, contended, free, free_calls): threads.py's constants for cores.h.
void judge_cores_by(double min_seconds, double contended, double free, int64_t free_calls) {
  fullgraph_cpu_cores::Judge& j = fullgraph_cpu_cores::judge();
  std::lock_guard<std::mutex> guard(j.lock);
  j.min_seconds = min_seconds, j.contended = contended, j.free = free, j.free_calls = free_calls;
}

// cores_shared(wall, cpu, threads) -> whether cores.h judges the cores shared, after a sample of
// a call of ``wall`` and ``cpu`` seconds on ``threads`` (none where wall is 0).
bool cores_shared(double wall, double cpu, int64_t threads) {
  return fullgraph_cpu_cores::sample(wall, cpu, threads == 1, threads);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fullgraph_cpu, m) {
  m.def("judge_cores_by(float min_seconds, float contended, float free, int free_calls) -> ()");
  m.def("cores_shared(float wall, float cpu, int threads) -> bool");
  m.def("nearest_small(Tensor query, Tensor ref, int take, float below, float above) -> (Tensor, Tensor, Tensor)");
  m.def("squared_distances(Tensor q, Tensor r, Tensor candidates) -> Tensor");
  m.def("squared_distances_all(Tensor q, Tensor r) -> Tensor");
  m.def("order_by_distance(Tensor distances, Tensor positions, int keep=-1) -> (Tensor, Tensor)");
  m.def("squared_norms(Tensor x) -> Tensor");
  m.def("squared_distances_bounded(Tensor q, Tensor r, Tensor candidates, Tensor floors, int least) -> Tensor");
  m.def("plain_nearest(Tensor query, Tensor ref, int k, int take, float u, float below, float above) -> (Tensor, Tensor, Tensor)");
  m.def("small_nearest(Tensor query, Tensor ref, int k, int take, float u, float below, float above) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fullgraph_cpu, CompositeExplicitAutograd, m) {
  m.impl("judge_cores_by", &judge_cores_by);
  m.impl("cores_shared", &cores_shared);
}

TORCH_LIBRARY_IMPL(fullgraph_cpu, CPU, m) {
  m.impl("squared_distances", &squared_distances);
  m.impl("squared_distances_all", &squared_distances_all);
  m.impl("nearest_small", &nearest_small);
  m.impl("order_by_distance", &order_by_distance);
  m.impl("squared_norms", &squared_norms);
  m.impl("squared_distances_bounded", &squared_distances_bounded);
  m.impl("plain_nearest", &plain_nearest);
  m.impl("small_nearest", &small_nearest);
}
