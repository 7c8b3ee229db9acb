// Farthest-point sampling with one thread-block cluster per cloud (sm_90 and later).
//
// A cloud of N points is cut into up to kMaxCluster slices of blockDim.x * kPointsPerThread
// points, a block each, all blocks of a cloud in one cluster. Each block keeps its slice and
// the slice's squared distances to the samples so far in registers. For every sample it finds
// its candidate (the largest distance, ties to the smaller index) and posts it into the shared
// memory of every block of its cluster as 1 + D 64-bit words, each tagged with the step: the
// key (distance bits, index) and the coordinates. One warp of each block waits on its own
// block's shared memory until every block's words of the step have come and picks the winner. Tagged
// words need no fence and no cluster barrier a sample (cluster.sync() costs a GPU-wide memory
// barrier and an L1 invalidation: ~0.4 us a sample on an H100, benchmarks/fps_cluster_probe.cu).
//
// Before the loop the blocks of a cloud agree (one cluster barrier) on what the Python
// reference computes with ~30 small kernels: which points are valid (inside the item's length,
// every coordinate finite), how many, the first of them, and the power of two the coordinates
// are divided by (scaling.safe_scale of their largest magnitude), so one launch is the call.
//
// The operator fullgraph_fps::farthest_points(x [B, N, D] float32, lengths [B] int64 or None,
// start [B] int64 or None (the first valid point), count, threads) returns idx [B, count] int64:
// -1 once an item has no valid point left, and a row of -1 for a start outside [0, N).
// fullgraph/ops/sampling_cuda.py calls it.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace cg = cooperative_groups;

namespace {

constexpr int kPointsPerThread = 8;
constexpr int kMaxCluster = 8;  // the portable cluster size
constexpr int kMaxDim = 4;
constexpr int kMaxPoints = 1024 * kPointsPerThread * kMaxCluster;  // an index takes 16 bits of a key

// The first lane holding the warp's largest 64-bit value: one reduction of the high words
// (redux.sync) and a ballot; the low words are reduced too only where high words tie.
__device__ __forceinline__ int warp_argmax(unsigned long long value) {
  const unsigned mine = static_cast<unsigned>(value >> 32);
  const unsigned high = __reduce_max_sync(0xffffffffu, mine);
  unsigned holders = __ballot_sync(0xffffffffu, mine == high);
  if (__popc(holders) > 1) {
    const unsigned low = __reduce_max_sync(0xffffffffu, mine == high ? static_cast<unsigned>(value) : 0u);
    holders = __ballot_sync(0xffffffffu, mine == high && static_cast<unsigned>(value) == low);
  }
  return __ffs(holders) - 1;
}

// Write a 64-bit word into the shared memory of block ``peer`` of the cluster, at the place of
// ``local`` in this block's (a plain store when the peer is this block).
__device__ __forceinline__ void post(unsigned long long* local, unsigned peer, unsigned rank, unsigned long long word) {
  if (peer == rank) {
    *static_cast<volatile unsigned long long*>(local) = word;
    return;
  }
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(local))), "r"(peer));
  asm volatile("st.relaxed.cluster.shared::cluster.u64 [%0], %1;" ::"r"(remote), "l"(word) : "memory");
}

// The power of two scaling.safe_scale divides coordinates of largest magnitude ``largest`` by.
__device__ __forceinline__ float safe_scale(float largest) {
  if (largest > 0.f && (largest > 0x1p40f || largest < 0x1p-30f)) {
    int exponent;
    frexpf(largest, &exponent);  // largest = m 2^exponent, 0.5 <= m < 1
    return ldexpf(1.f, exponent - 1);
  }
  return 1.f;
}

// Word layout of a posted candidate: key = (distance bits + 1) << 32 | (0xffff - index) << 16 |
// tag (a key without distance: no candidate), coordinate d = bits << 32 | tag; tag = step &
// 0xffff, which differs from the step two before, the last one whose words the buffer held.
template <int D>
__global__ void __launch_bounds__(1024) farthest_points_kernel(
    const float* __restrict__ points, const int64_t* __restrict__ lengths, const int64_t* __restrict__ start,
    int64_t* __restrict__ out, int64_t size, int64_t count, int64_t slice) {
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const int parts = static_cast<int>(cluster.num_blocks());
  const int64_t cloud = blockIdx.x / parts;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __shared__ unsigned long long warp_keys[32];
  __shared__ float warp_centres[32][kMaxDim];
  __shared__ float winning_centre[kMaxDim];  // the step's sample, as warp 0 found it
  __shared__ unsigned long long winning_key;
  __shared__ unsigned warp_summary[3][32];               // largest magnitude bits, valid points, first valid
  __shared__ unsigned block_summary[3][kMaxCluster];     // the same for each block of the cluster
  // inbox[parity][word][block]: a block may post a step ahead of one still reading.
  __shared__ unsigned long long inbox[2][1 + kMaxDim][kMaxCluster];

  const float* base = points + cloud * size * D;
  int64_t* row = out + cloud * count;
  int64_t length = lengths == nullptr ? size : lengths[cloud];
  length = length < 0 ? 0 : (length > size ? size : length);
  const int64_t lo = rank * slice;
  const int64_t end = lo + slice < length ? lo + slice : length;
  float x[kPointsPerThread][D];
  float gap[kPointsPerThread];  // squared distance to the samples so far; -1: never taken
  float largest = 0.f;
  unsigned valid = 0, first = 0xffffffffu;
#pragma unroll
  for (int j = 0; j < kPointsPerThread; ++j) {
    const int64_t i = lo + j * blockDim.x + threadIdx.x;
    bool taken = i < end;
    float magnitude = 0.f;
#pragma unroll
    for (int d = 0; d < D; ++d) {
      x[j][d] = i < end ? base[i * D + d] : 0.f;
      taken = taken && isfinite(x[j][d]);
      magnitude = fmaxf(magnitude, fabsf(x[j][d]));
    }
    gap[j] = taken ? __int_as_float(0x7f800000) : -1.f;  // +inf
    largest = taken ? fmaxf(largest, magnitude) : largest;
    valid += taken;
    first = taken && static_cast<unsigned>(i) < first ? static_cast<unsigned>(i) : first;
  }
  // The cloud's largest magnitude, valid points and first valid point: warp, block, cluster.
  const unsigned summary[3] = {__reduce_max_sync(0xffffffffu, __float_as_uint(largest)),
                               __reduce_add_sync(0xffffffffu, valid), __reduce_min_sync(0xffffffffu, first)};
  if (lane == 0) {
    for (int f = 0; f < 3; ++f) warp_summary[f][warp] = summary[f];
  }
  for (int w = threadIdx.x; w < 2 * (1 + kMaxDim) * kMaxCluster; w += blockDim.x) (&inbox[0][0][0])[w] = ~0ull;
  cluster.sync();  // every block has started before any writes into another's memory
  if (warp == 0) {
    const bool in = lane < warps;
    const unsigned block[3] = {__reduce_max_sync(0xffffffffu, in ? warp_summary[0][lane] : 0u),
                               __reduce_add_sync(0xffffffffu, in ? warp_summary[1][lane] : 0u),
                               __reduce_min_sync(0xffffffffu, in ? warp_summary[2][lane] : 0xffffffffu)};
    if (lane < parts) {
      for (int f = 0; f < 3; ++f) {
        unsigned* slot = &block_summary[f][rank];
        if (lane != static_cast<int>(rank)) slot = cluster.map_shared_rank(slot, lane);
        *slot = block[f];
      }
    }
  }
  cluster.sync();
  unsigned magnitude_bits = 0, valid_points = 0, first_valid = 0xffffffffu;
  for (int r = 0; r < parts; ++r) {
    magnitude_bits = max(magnitude_bits, block_summary[0][r]);
    valid_points += block_summary[1][r];
    first_valid = min(first_valid, block_summary[2][r]);
  }
  const float scale = safe_scale(__uint_as_float(magnitude_bits));
#pragma unroll
  for (int j = 0; j < kPointsPerThread; ++j) {
#pragma unroll
    for (int d = 0; d < D; ++d) x[j][d] = __fdiv_rn(x[j][d], scale);  // exact: a power of two
  }
  const int64_t current = start == nullptr ? static_cast<int64_t>(first_valid) : start[cloud];
  const int64_t taken = valid_points < static_cast<unsigned>(count) ? valid_points : count;
  if (current < 0 || current >= size || taken == 0) {  // no read out of bounds: the row stays -1
    return;  // the cluster agrees on both, and no block writes into another after the barrier above
  }
  // The start's coordinates (0 for a point that is not valid, as the reference masks them).
  float centre[D];
  bool finite = current < length;
#pragma unroll
  for (int d = 0; d < D; ++d) {
    centre[d] = base[current * D + d];
    finite = finite && isfinite(centre[d]);
  }
#pragma unroll
  for (int d = 0; d < D; ++d) centre[d] = finite ? __fdiv_rn(centre[d], scale) : 0.f;
  if (rank == 0 && threadIdx.x == 0) row[0] = current;

  const int words = (1 + D) * kMaxCluster;
  for (int64_t step = 1; step < taken; ++step) {
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
    if (lane == warp_argmax(mine)) {
      warp_keys[warp] = mine;
#pragma unroll
      for (int d = 0; d < D; ++d) warp_centres[warp][d] = best_centre[d];
    }
    __syncthreads();
    const int parity = static_cast<int>(step & 1);
    if (warp == 0) {  // the block's candidate, posted word by word to every block of the cluster
      const unsigned long long key = lane < warps ? warp_keys[lane] : 0ull;
      const int from = warp_argmax(key);
      const unsigned long long top = __shfl_sync(0xffffffffu, key, from);
      for (int w = lane; w < words; w += 32) {
        const int field = w / kMaxCluster, peer = w % kMaxCluster;
        if (peer < parts) {
          const unsigned long long word =
              field == 0 ? top : static_cast<unsigned long long>(__float_as_uint(warp_centres[from][field - 1])) << 32;
          post(&inbox[parity][field][rank], peer, rank, word | tag);
        }
      }
    }
    // Warp 0 waits for the cluster's words of this step in its own block's memory (lane w: word
    // w and w + 32, field-major) and hands the winner's coordinates to the block; the other
    // warps wait at the barrier, taking no issue slots or shared-memory bandwidth.
    if (warp == 0) {
      const volatile unsigned long long* posted = &inbox[parity][0][0];
      unsigned long long low = 0, high = 0;
      bool ready;
      do {
        low = lane < words && lane % kMaxCluster < parts ? posted[lane] : tag;
        high = lane + 32 < words && lane % kMaxCluster < parts ? posted[lane + 32] : tag;
        ready = __all_sync(0xffffffffu, (low & 0xffff) == tag && (high & 0xffff) == tag);
      } while (!ready);
      const unsigned long long key = lane < parts ? low : 0ull;  // lanes 0..7: the blocks' keys
      const int winner = warp_argmax(key);
#pragma unroll
      for (int d = 0; d < D; ++d) {
        const int w = (1 + d) * kMaxCluster + winner;
        const unsigned long long word = __shfl_sync(0xffffffffu, w < 32 ? low : high, w % 32);
        if (lane == 0) winning_centre[d] = __uint_as_float(static_cast<unsigned>(word >> 32));
      }
      if (lane == winner) winning_key = key;
    }
    __syncthreads();
#pragma unroll
    for (int d = 0; d < D; ++d) centre[d] = winning_centre[d];
    const unsigned long long top = winning_key;
    if (rank == 0 && threadIdx.x == 0) row[step] = static_cast<int64_t>(0xffffu - ((top >> 16) & 0xffffu));
  }
}

template <int D>
void launch(const at::Tensor& x, const int64_t* lengths, const int64_t* start, at::Tensor& out, int64_t count,
            int64_t threads, int64_t parts) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(x.size(0) * parts));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(parts);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, farthest_points_kernel<D>, x.data_ptr<float>(), lengths, start,
                                    out.data_ptr<int64_t>(), x.size(1), count, threads * kPointsPerThread));
}

const int64_t* indices(const std::optional<at::Tensor>& tensor, const char* name, const at::Tensor& x) {
  if (!tensor.has_value()) return nullptr;
  TORCH_CHECK(tensor->device() == x.device() && tensor->scalar_type() == at::kLong && tensor->dim() == 1 &&
                  tensor->size(0) == x.size(0) && tensor->is_contiguous(),
              name, ": expected a contiguous [", x.size(0), "] int64 tensor on ", x.device(), ", got ",
              tensor->scalar_type(), " of shape ", tensor->sizes(), " on ", tensor->device());
  return tensor->data_ptr<int64_t>();
}

at::Tensor farthest_points(const at::Tensor& x, const std::optional<at::Tensor>& lengths,
                           const std::optional<at::Tensor>& start, int64_t count, int64_t threads) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.is_contiguous(),
              "x: expected a contiguous [B, N, D] float32 CUDA tensor, got ", x.scalar_type(), " of shape ", x.sizes(),
              " on ", x.device());
  const int64_t batch = x.size(0), size = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim >= 1 && dim <= kMaxDim, "x: expected D from 1 to ", kMaxDim, ", got ", dim);
  const int64_t* lengths_ = indices(lengths, "lengths", x);
  const int64_t* start_ = indices(start, "start", x);
  TORCH_CHECK(count >= 1, "count: expected at least 1 sample, got ", count);
  TORCH_CHECK(threads >= 32 && threads <= 1024 && threads % 32 == 0,
              "threads: expected a multiple of 32 from 32 to 1024, got ", threads);
  const int64_t slice = threads * kPointsPerThread;
  const int64_t parts = size == 0 ? 1 : (size + slice - 1) / slice;
  TORCH_CHECK(size <= kMaxPoints, "x: expected at most ", kMaxPoints, " points a cloud, got ", size);
  TORCH_CHECK(parts <= kMaxCluster, "x: a cloud of ", size, " points needs ", parts, " blocks of ", slice,
              " points, more than a cluster's ", kMaxCluster, " (at most ", kMaxCluster * slice, " points with ",
              threads, " threads a block)");
  at::Tensor out = at::full({batch, count}, -1, x.options().dtype(at::kLong));
  if (batch == 0 || size == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.device().index()));
  TORCH_CHECK(major >= 9, "x: thread-block clusters need a GPU of compute capability 9.0 or later, got ", major);
  switch (dim) {
    case 1: launch<1>(x, lengths_, start_, out, count, threads, parts); break;
    case 2: launch<2>(x, lengths_, start_, out, count, threads, parts); break;
    case 3: launch<3>(x, lengths_, start_, out, count, threads, parts); break;
    default: launch<4>(x, lengths_, start_, out, count, threads, parts); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(fullgraph_fps, m) {
  m.def("farthest_points(Tensor x, Tensor? lengths, Tensor? start, int count, int threads) -> Tensor");
}

TORCH_LIBRARY_IMPL(fullgraph_fps, CUDA, m) { m.impl("farthest_points", &farthest_points); }
