// Farthest-point sampling with one thread-block cluster per cloud (sm_90 and later).
//
// A cloud of N points is cut into up to kMaxCluster slices of blockDim.x * kPointsPerThread
// points, a block each, all blocks of a cloud in one cluster. Each block keeps its slice and
// the slice's squared distances to the samples so far in registers. For every sample it finds
// its candidate (the largest distance, ties to the smaller index, packed into one 64-bit key),
// writes it with the candidate's coordinates into the shared memory of every block of its
// cluster, and passes the cluster's hardware barrier; then every block picks the same winner
// from its own shared memory. No global memory is touched between samples except the output.
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

struct Candidate {
  unsigned long long key;  // (squared distance bits + 1) << 32 | (2^32 - 1 - index); 0: none
  float centre[kMaxDim];
};

__device__ __forceinline__ unsigned long long warp_max(unsigned long long value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = other > value ? other : value;
  }
  return value;
}

template <int D>
__global__ void __launch_bounds__(1024) farthest_points_kernel(
    const float* __restrict__ points, const bool* __restrict__ valid, const int64_t* __restrict__ start,
    int64_t* __restrict__ out, int64_t size, int64_t count, int64_t slice) {
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const unsigned parts = cluster.num_blocks();
  const int64_t cloud = blockIdx.x / parts;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __shared__ unsigned long long warp_keys[32];
  __shared__ float warp_centres[32][kMaxDim];
  __shared__ Candidate inbox[2][kMaxCluster];  // by the parity of the step: a block may be one step ahead

  const float* base = points + cloud * size * D;
  int64_t* row = out + cloud * count;
  const int64_t lo = rank * slice;
  const int64_t end = lo + slice < size ? lo + slice : size;
  float x[kPointsPerThread][D];
  float gap[kPointsPerThread];
#pragma unroll
  for (int j = 0; j < kPointsPerThread; ++j) {
    const int64_t i = lo + j * blockDim.x + threadIdx.x;
    const bool inside = i < end;
#pragma unroll
    for (int d = 0; d < D; ++d) x[j][d] = inside ? base[i * D + d] : 0.f;
    gap[j] = inside && valid[cloud * size + i] ? __int_as_float(0x7f800000) : -1.f;  // +inf; -1: never taken
  }
  int64_t current = start[cloud];
  if (current < 0 || current >= size) {  // no read out of bounds: a bad start leaves the row at -1
    if (rank == 0) {
      for (int64_t step = threadIdx.x; step < count; step += blockDim.x) row[step] = -1;
    }
    return;  // every block of the cluster reads the same start and leaves before any barrier
  }
  float centre[D];
#pragma unroll
  for (int d = 0; d < D; ++d) centre[d] = base[current * D + d];
  if (rank == 0 && threadIdx.x == 0) row[0] = current;
  cluster.sync();  // every block of the cluster has started before any writes into another's memory

  for (int64_t step = 1; step < count; ++step) {
    unsigned long long best = 0;
    float best_centre[D];
#pragma unroll
    for (int d = 0; d < D; ++d) best_centre[d] = 0.f;
#pragma unroll
    for (int j = 0; j < kPointsPerThread; ++j) {
      if (gap[j] >= 0.f) {
        // The reference's arithmetic: float32 squares summed over d in order, no FMA.
        float total = 0.f;
#pragma unroll
        for (int d = 0; d < D; ++d) {
          const float diff = __fsub_rn(x[j][d], centre[d]);
          total = d == 0 ? __fmul_rn(diff, diff) : __fadd_rn(total, __fmul_rn(diff, diff));
        }
        gap[j] = fminf(gap[j], total);
        const unsigned index = static_cast<unsigned>(lo + j * blockDim.x + threadIdx.x);
        const unsigned long long key =
            (static_cast<unsigned long long>(__float_as_uint(gap[j]) + 1u) << 32) | (0xffffffffu - index);
        if (key > best) {
          best = key;
#pragma unroll
          for (int d = 0; d < D; ++d) best_centre[d] = x[j][d];
        }
      }
    }
    const unsigned long long mine = best;
    best = warp_max(best);
    const unsigned holders = __ballot_sync(0xffffffffu, mine == best);
    if (lane == __ffs(holders) - 1) {
      warp_keys[warp] = best;
#pragma unroll
      for (int d = 0; d < D; ++d) warp_centres[warp][d] = best_centre[d];
    }
    __syncthreads();
    if (warp == 0) {
      const unsigned long long key = lane < warps ? warp_keys[lane] : 0ull;
      const unsigned long long top = warp_max(key);
      const int from = __ffs(__ballot_sync(0xffffffffu, lane < warps && key == top)) - 1;
      if (lane < static_cast<int>(parts)) {  // lane r posts the block's candidate to block r
        Candidate* slot = cluster.map_shared_rank(&inbox[step & 1][rank], lane);
        slot->key = top;
#pragma unroll
        for (int d = 0; d < D; ++d) slot->centre[d] = warp_centres[from][d];
      }
    }
    cluster.sync();
    best = 0;
    for (unsigned r = 0; r < parts; ++r) {
      const Candidate& posted = inbox[step & 1][r];
      if (posted.key > best) {
        best = posted.key;
#pragma unroll
        for (int d = 0; d < D; ++d) centre[d] = posted.centre[d];
      }
    }
    if (rank == 0 && threadIdx.x == 0) {
      row[step] = best == 0 ? -1 : static_cast<int64_t>(0xffffffffu - static_cast<unsigned>(best & 0xffffffffu));
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
