// Farthest-point sampling with one thread-block cluster per cloud (sm_90 and later).
//
// A cloud of N points is cut into up to kMaxCluster slices of blockDim.x * kPointsPerThread
// points, a block each, all blocks of a cloud in one cluster. Each block keeps its slice and
// the slice's squared distances to the samples so far in registers. For every sample it finds
// its candidate (the largest distance, ties to the smaller index) and posts it into the shared
// memory of every block of its cluster as 1 + D 64-bit words, each tagged with the step: the
// key (distance bits, index) and the coordinates. Each warp waits on its own block's shared
// memory until every block's words of the step have come and picks the same winner. Tagged
// words need no fence and no cluster barrier a sample (cluster.sync() costs a GPU-wide memory
// barrier and an L1 invalidation: ~0.4 us a sample on an H100, benchmarks/fps_cluster_probe.cu).
//
// The operator fullgraph_fps::farthest_points(points [B, N, D] float32, valid [B, N] bool (false:
// never taken), start [B] int64, count, threads) returns idx [B, count] int64 (-1 once a cloud
// has no point left). fullgraph/ops/sampling_cuda.py calls it.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <torch/library.h>

#include <cstdint>

namespace cg = cooperative_groups;

namespace {

constexpr int kPointsPerThread = 8;
constexpr int kMaxCluster = 8;  // the portable cluster size
constexpr int kMaxDim = 4;
constexpr int kMaxPoints = 1024 * kPointsPerThread * kMaxCluster;  // an index takes 16 bits of a key

// The largest 64-bit value among the warp's lanes: two single-instruction reductions (redux.sync),
// the high words first, then the low words of the lanes that hold the largest high word.
__device__ __forceinline__ unsigned long long warp_max(unsigned long long value) {
  const unsigned high = __reduce_max_sync(0xffffffffu, static_cast<unsigned>(value >> 32));
  const unsigned low = __reduce_max_sync(0xffffffffu, static_cast<unsigned>(value >> 32) == high
                                                          ? static_cast<unsigned>(value) : 0u);
  return static_cast<unsigned long long>(high) << 32 | low;
}

// Word layout: key = (distance bits + 1) << 32 | (0xffff - index) << 16 | tag (0: no candidate),
// coordinate d = bits << 32 | tag; tag = step & 0xffff, which differs from the step two before,
// the last one whose words the same buffer held.
template <int D>
__global__ void __launch_bounds__(1024) farthest_points_kernel(
    const float* __restrict__ points, const bool* __restrict__ valid, const int64_t* __restrict__ start,
    int64_t* __restrict__ out, int64_t size, int64_t count, int64_t slice) {
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const int parts = static_cast<int>(cluster.num_blocks());
  const int64_t cloud = blockIdx.x / parts;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __shared__ unsigned long long warp_keys[32];
  __shared__ float warp_centres[32][kMaxDim];
  // inbox[parity][word][block]: a block may post a step ahead of one still reading.
  __shared__ unsigned long long inbox[2][1 + kMaxDim][kMaxCluster];

  const float* base = points + cloud * size * D;
  int64_t* row = out + cloud * count;
  const int64_t lo = rank * slice;
  const int64_t end = lo + slice < size ? lo + slice : size;
  float x[kPointsPerThread][D];
  float gap[kPointsPerThread];  // squared distance to the samples so far; -1: never taken
#pragma unroll
  for (int j = 0; j < kPointsPerThread; ++j) {
    const int64_t i = lo + j * blockDim.x + threadIdx.x;
    const bool inside = i < end;
#pragma unroll
    for (int d = 0; d < D; ++d) x[j][d] = inside ? base[i * D + d] : 0.f;
    gap[j] = inside && valid[cloud * size + i] ? __int_as_float(0x7f800000) : -1.f;
  }
  int64_t current = start[cloud];
  if (current < 0 || current >= size) {  // no read out of bounds: a bad start leaves the row at -1
    if (rank == 0) {
      for (int64_t step = threadIdx.x; step < count; step += blockDim.x) row[step] = -1;
    }
    return;  // every block of the cluster reads the same start and leaves before the barrier
  }
  float centre[D];
#pragma unroll
  for (int d = 0; d < D; ++d) centre[d] = base[current * D + d];
  if (rank == 0 && threadIdx.x == 0) row[0] = current;
  for (int w = threadIdx.x; w < 2 * (1 + kMaxDim) * kMaxCluster; w += blockDim.x) (&inbox[0][0][0])[w] = ~0ull;
  cluster.sync();  // every block has started (and its inbox is set) before any posts into it

  const int words = (1 + D) * kMaxCluster;
  for (int64_t step = 1; step < count; ++step) {
    const unsigned long long tag = static_cast<unsigned long long>(step & 0xffff);
    float best_gap = -0.5f;  // below every distance, above "never taken"
    int best_j = 0;
    float best_centre[D];
#pragma unroll
    for (int d = 0; d < D; ++d) best_centre[d] = x[0][d];
#pragma unroll
    for (int j = 0; j < kPointsPerThread; ++j) {
      // The reference's arithmetic: float32 squares summed over d in order, no FMA.
      float total = 0.f;
#pragma unroll
      for (int d = 0; d < D; ++d) {
        const float diff = __fsub_rn(x[j][d], centre[d]);
        total = d == 0 ? __fmul_rn(diff, diff) : __fadd_rn(total, __fmul_rn(diff, diff));
      }
      gap[j] = fminf(gap[j], total);  // a point never taken keeps -1
      const bool better = gap[j] > best_gap;  // strictly: the earliest of a thread's ties
      best_gap = better ? gap[j] : best_gap;
      best_j = better ? j : best_j;
#pragma unroll
      for (int d = 0; d < D; ++d) best_centre[d] = better ? x[j][d] : best_centre[d];
    }
    const unsigned index = static_cast<unsigned>(lo + best_j * blockDim.x + threadIdx.x);
    const unsigned long long mine =
        best_gap >= 0.f ? (static_cast<unsigned long long>(__float_as_uint(best_gap) + 1u) << 32) |
                              (static_cast<unsigned long long>(0xffffu - index) << 16)
                        : 0ull;
    const unsigned long long warp_best = warp_max(mine);
    if (lane == __ffs(__ballot_sync(0xffffffffu, mine == warp_best)) - 1) {
      warp_keys[warp] = warp_best;
#pragma unroll
      for (int d = 0; d < D; ++d) warp_centres[warp][d] = best_centre[d];
    }
    __syncthreads();
    const int parity = static_cast<int>(step & 1);
    if (warp == 0) {  // the block's candidate, posted word by word to every block of the cluster
      const unsigned long long key = lane < warps ? warp_keys[lane] : 0ull;
      const unsigned long long top = warp_max(key);
      const int from = __ffs(__ballot_sync(0xffffffffu, lane < warps && key == top)) - 1;
      for (int w = lane; w < words; w += 32) {
        const int field = w / kMaxCluster, peer = w % kMaxCluster;
        if (peer < parts) {
          const unsigned long long word =
              field == 0 ? top : static_cast<unsigned long long>(__float_as_uint(warp_centres[from][field - 1])) << 32;
          unsigned long long* slot = &inbox[parity][field][rank];
          if (peer != static_cast<int>(rank)) slot = cluster.map_shared_rank(slot, peer);
          *static_cast<volatile unsigned long long*>(slot) = word | tag;
        }
      }
    }
    // Every warp waits for the cluster's words of this step in its own block's memory.
    const volatile unsigned long long* posted = &inbox[parity][0][0];
    unsigned long long low = 0, high = 0;  // words lane and lane + 32 (field-major, kMaxCluster a field)
    bool ready;
    do {
      const bool want_low = lane < words && lane % kMaxCluster < parts;
      const bool want_high = lane + 32 < words && lane % kMaxCluster < parts;
      low = want_low ? posted[lane] : tag;
      high = want_high ? posted[lane + 32] : tag;
      ready = __all_sync(0xffffffffu, (low & 0xffff) == tag && (high & 0xffff) == tag);
    } while (!ready);
    const unsigned long long key = lane < parts ? low : 0ull;  // lanes 0..7: the blocks' keys
    const unsigned long long top = warp_max(key);
    const int winner = __ffs(__ballot_sync(0xffffffffu, lane < parts && key == top)) - 1;
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int w = (1 + d) * kMaxCluster + winner;
      const unsigned long long word = __shfl_sync(0xffffffffu, w < 32 ? low : high, w % 32);
      centre[d] = __uint_as_float(static_cast<unsigned>(word >> 32));
    }
    if (rank == 0 && threadIdx.x == 0) {
      row[step] = (top >> 32) == 0 ? -1 : static_cast<int64_t>(0xffffu - ((top >> 16) & 0xffffu));
    }
  }
}

template <int D>
void launch(const at::Tensor& points, const at::Tensor& valid, const at::Tensor& start, at::Tensor& out,
            int64_t count, int64_t threads, int64_t parts) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(points.size(0) * parts));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(parts);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, farthest_points_kernel<D>, points.data_ptr<float>(),
                                    valid.data_ptr<bool>(), start.data_ptr<int64_t>(), out.data_ptr<int64_t>(),
                                    points.size(1), count, threads * kPointsPerThread));
}

at::Tensor farthest_points(const at::Tensor& points, const at::Tensor& valid, const at::Tensor& start, int64_t count,
                           int64_t threads) {
  TORCH_CHECK(points.is_cuda() && points.scalar_type() == at::kFloat && points.dim() == 3 && points.is_contiguous(),
              "points: expected a contiguous [B, N, D] float32 CUDA tensor, got ", points.scalar_type(), " of shape ",
              points.sizes(), " on ", points.device());
  const int64_t batch = points.size(0), size = points.size(1), dim = points.size(2);
  TORCH_CHECK(dim >= 1 && dim <= kMaxDim, "points: expected D from 1 to ", kMaxDim, ", got ", dim);
  TORCH_CHECK(valid.device() == points.device() && valid.scalar_type() == at::kBool && valid.is_contiguous() &&
                  valid.dim() == 2 && valid.size(0) == batch && valid.size(1) == size,
              "valid: expected a contiguous [", batch, ", ", size, "] bool tensor on ", points.device(), ", got ",
              valid.scalar_type(), " of shape ", valid.sizes(), " on ", valid.device());
  TORCH_CHECK(start.device() == points.device() && start.scalar_type() == at::kLong && start.dim() == 1 &&
                  start.size(0) == batch,
              "start: expected [", batch, "] int64 indices on ", points.device(), ", got ", start.scalar_type(),
              " of shape ", start.sizes(), " on ", start.device());
  TORCH_CHECK(count >= 1, "count: expected at least 1 sample, got ", count);
  TORCH_CHECK(threads >= 32 && threads <= 1024 && threads % 32 == 0,
              "threads: expected a multiple of 32 from 32 to 1024, got ", threads);
  const int64_t slice = threads * kPointsPerThread;
  const int64_t parts = size == 0 ? 1 : (size + slice - 1) / slice;
  TORCH_CHECK(size <= kMaxPoints, "points: expected at most ", kMaxPoints, " points a cloud, got ", size);
  TORCH_CHECK(parts <= kMaxCluster, "points: a cloud of ", size, " points needs ", parts, " blocks of ", slice,
              " points, more than a cluster's ", kMaxCluster, " (at most ", kMaxCluster * slice, " points with ",
              threads, " threads a block)");
  at::Tensor out = at::full({batch, count}, -1, points.options().dtype(at::kLong));
  if (batch == 0 || size == 0) return out;
  const c10::cuda::CUDAGuard guard(points.device());
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, points.device().index()));
  TORCH_CHECK(major >= 9, "points: thread-block clusters need a GPU of compute capability 9.0 or later, got ", major);
  const at::Tensor start_ = start.contiguous();
  switch (dim) {
    case 1: launch<1>(points, valid, start_, out, count, threads, parts); break;
    case 2: launch<2>(points, valid, start_, out, count, threads, parts); break;
    case 3: launch<3>(points, valid, start_, out, count, threads, parts); break;
    default: launch<4>(points, valid, start_, out, count, threads, parts); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(fullgraph_fps, m) {
  m.def("farthest_points(Tensor points, Tensor valid, Tensor start, int count, int threads) -> Tensor");
}

TORCH_LIBRARY_IMPL(fullgraph_fps, CUDA, m) { m.impl("farthest_points", &farthest_points); }
