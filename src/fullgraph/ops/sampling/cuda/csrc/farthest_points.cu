// Farthest-point sampling with one thread-block cluster per cloud (sm_90 and later). A cloud of N
// points is cut into up to kMaxCluster slices of blockDim.x * kPointsPerThread points, a block each,
// all blocks of a cloud in one cluster. Each block keeps its slice and the slice's squared distances
// to the samples so far in registers. For every sample each warp finds its candidate (the largest
// distance, ties to the smaller index: two redux.sync) and posts it as one 64-bit key into the
// shared memory of every block of its cluster with st.async, which counts the key's bytes on the
// receiving block's mbarrier.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <optional>

namespace cg = cooperative_groups;

namespace {

constexpr int kPointsPerThread = 8;
constexpr int kMaxCluster = 8;  // the portable cluster size
constexpr int kMaxDim = 4;
constexpr int kMaxPoints = 1 << 16;  // an index takes 16 bits of a key
constexpr int kMaxKeys = 128;        // keys a block receives a sample, at most
constexpr int kSharedCloudBytes = 200 * 1024;
constexpr int kMaxPointsPerBlock = 4096;  // above it, the shared copy is not worth halving the blocks

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

// This block's ``local`` and ``barrier`` as block ``peer`` of the cluster addresses them.
__device__ __forceinline__ unsigned cluster_address(const void* local, unsigned peer) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(local)), "r"(peer));
  return remote;
}

// Write ``word`` at the cluster address ``slot``; its 8 bytes count on the barrier at ``barrier``.
__device__ __forceinline__ void post(unsigned slot, unsigned barrier, unsigned long long word) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.u64 [%0], %1, [%2];" ::"r"(slot), "l"(word),
               "r"(barrier)
               : "memory");
}

// Arrive once on ``barrier`` and expect ``bytes`` more in its current phase.
__device__ __forceinline__ void expect_bytes(unsigned long long* barrier, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void wait_phase(unsigned long long* barrier, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(barrier)), "r"(parity)
        : "memory");
  } while (!done);
}

// The warp's largest key (high, low) as (high, low) words: high = distance bits + 1 (0: no
// candidate), low = 0xffff - index (the larger, the smaller the index).
__device__ __forceinline__ unsigned long long warp_max(unsigned high, unsigned low) {
  const unsigned top_high = __reduce_max_sync(0xffffffffu, high);
  const unsigned top_low = __reduce_max_sync(0xffffffffu, high == top_high ? low : 0u);
  return static_cast<unsigned long long>(top_high) << 32 | top_low;
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

template <int D>
__global__ void __launch_bounds__(1024) farthest_points_kernel(
    const float* __restrict__ points, const int64_t* __restrict__ lengths, const int64_t* __restrict__ start,
    int64_t* __restrict__ out, int64_t size, int64_t count, int64_t slice, bool shared_copy) {
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const int parts = static_cast<int>(cluster.num_blocks());
  const int64_t cloud = blockIdx.x / parts;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  extern __shared__ float cloud_copy[];  // [N * D] where shared_copy
  __shared__ unsigned warp_summary[3][32];            // largest magnitude bits, valid points, first valid
  __shared__ unsigned block_summary[3][kMaxCluster];  // the same for each block of the cluster
  __shared__ unsigned long long warp_keys[32];        // where blocks post one key: their warps' keys
  // inbox[step & 1][rank * posters + poster]: a block may post a step ahead of one still reading.
  __shared__ unsigned long long inbox[2][kMaxKeys];
  __shared__ unsigned long long arrived[2];  // mbarriers: the keys of step s came (s & 1)

  const float* base = points + cloud * size * D;
  int64_t* row = out + cloud * count;
  int64_t length = lengths == nullptr ? size : lengths[cloud];
  length = length < 0 ? 0 : (length > size ? size : length);
  const int64_t lo = rank * slice;
  const int64_t end = lo + slice < length ? lo + slice : length;
  if (shared_copy) {  // the raw copy first (scaled after the barriers below if need be)
    const int64_t elements = size * D;
    if ((reinterpret_cast<uintptr_t>(base) & 15) == 0) {
      const float4* source = reinterpret_cast<const float4*>(base);
      float4* target = reinterpret_cast<float4*>(cloud_copy);
#pragma unroll 4
      for (int64_t i = threadIdx.x; i < elements / 4; i += blockDim.x) target[i] = source[i];
      for (int64_t i = elements / 4 * 4 + threadIdx.x; i < elements; i += blockDim.x) cloud_copy[i] = base[i];
    } else {
#pragma unroll 4
      for (int64_t i = threadIdx.x; i < elements; i += blockDim.x) cloud_copy[i] = base[i];
    }
  }
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
  const int posters = warps * parts <= kMaxKeys ? warps : 1;  // keys a block posts a sample
  const unsigned step_bytes = static_cast<unsigned>(parts * posters * sizeof(unsigned long long));
  if (threadIdx.x == 0) {
    for (int b = 0; b < 2; ++b) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&arrived[b])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    expect_bytes(&arrived[1], step_bytes);  // step 1
    expect_bytes(&arrived[0], step_bytes);  // step 2
  }
  cluster.sync();  // every block has started (and armed its barriers) before any writes into another's memory
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
  if (shared_copy) {
    if (scale != 1.f) {
      __syncthreads();
      for (int64_t i = threadIdx.x; i < size * D; i += blockDim.x) cloud_copy[i] = __fdiv_rn(cloud_copy[i], scale);
    }
    __syncthreads();
  }
  const int64_t current = start == nullptr ? static_cast<int64_t>(first_valid) : start[cloud];
  const int taken = static_cast<int>(valid_points < static_cast<unsigned>(count) ? valid_points : count);
  const bool none = current < 0 || current >= size || taken == 0;  // no read out of bounds: a row of -1
  if (rank == 0) {
    for (int64_t i = (none ? 0 : taken) + threadIdx.x; i < count; i += blockDim.x) row[i] = -1;
  }
  if (none) return;  // the cluster agrees, and no block writes into another after the barrier above
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

  // Lane p < parts of a poster posts to block p: its slot there and that block's barrier (the
  // second buffer's lie at fixed offsets from the first's).
  const int poster = posters == 1 ? 0 : warp;
  const unsigned peer = static_cast<unsigned>(lane < parts ? lane : 0);
  const unsigned remote_slot = cluster_address(&inbox[0][rank * posters + poster], peer);
  const unsigned remote_barrier = cluster_address(&arrived[0], peer);
  const int keys = parts * posters;
  for (int step = 1; step < taken; ++step) {
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
    }
    // The thread's largest gap, ties to the smaller j: a tree over neighbouring pairs.
    float best_gap[kPointsPerThread];
    int best_j[kPointsPerThread];
#pragma unroll
    for (int j = 0; j < kPointsPerThread; ++j) {
      best_gap[j] = gap[j];
      best_j[j] = j;
    }
#pragma unroll
    for (int width = 1; width < kPointsPerThread; width *= 2) {
#pragma unroll
      for (int j = 0; j < kPointsPerThread; j += 2 * width) {
        const bool right = best_gap[j + width] > best_gap[j];  // strictly: the left holds the smaller indices
        best_gap[j] = right ? best_gap[j + width] : best_gap[j];
        best_j[j] = right ? best_j[j + width] : best_j[j];
      }
    }
    const unsigned index = static_cast<unsigned>(lo + best_j[0] * blockDim.x + threadIdx.x);
    unsigned long long key = warp_max(best_gap[0] >= 0.f ? __float_as_uint(best_gap[0]) + 1u : 0u, 0xffffu - index);
    const int buffer = static_cast<int>(step & 1);
    if (posters == 1) {  // the block's key first
      if (lane == 0) warp_keys[warp] = key;
      __syncthreads();
      if (warp == 0) {
        const unsigned long long mine = lane < warps ? warp_keys[lane] : 0ull;
        key = warp_max(static_cast<unsigned>(mine >> 32), static_cast<unsigned>(mine));
      }
    }
    if (warp == poster && lane < parts) {
      post(remote_slot + buffer * sizeof(inbox[0]), remote_barrier + buffer * sizeof(arrived[0]), key);
    }
    wait_phase(&arrived[buffer], static_cast<unsigned>((step - 1) >> 1) & 1u);
    if (threadIdx.x == 0 && step + 2 < taken) expect_bytes(&arrived[buffer], step_bytes);
    unsigned long long received = 0;
#pragma unroll
    for (int k = lane; k < kMaxKeys; k += 32) received = k < keys ? max(received, inbox[buffer][k]) : received;
    const unsigned winner = 0xffffu - static_cast<unsigned>(
                                          warp_max(static_cast<unsigned>(received >> 32), static_cast<unsigned>(received)));
#pragma unroll
    for (int d = 0; d < D; ++d) {
      centre[d] = shared_copy ? cloud_copy[winner * D + d] : __fdiv_rn(base[winner * D + d], scale);
    }
    if (rank == 0 && threadIdx.x == 0) row[step] = winner;
  }
  cluster.sync();  // no block leaves while another may still write into its shared memory
}

struct Cut {
  int cluster, threads;
  bool shared_copy;
};

// How many clusters of the kernel run at once (cached: a host query each launch would cost more
// than small clouds take).
template <int D>
int active_clusters(int cluster, int threads, size_t shared_bytes) {
  static std::mutex lock;
  static std::map<std::tuple<int, int, int, size_t>, int> known;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_tuple(device, cluster, threads, shared_bytes);
  const std::lock_guard<std::mutex> guard(lock);
  const auto found = known.find(key);
  if (found != known.end()) return found->second;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(cluster));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = shared_bytes;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim = {static_cast<unsigned>(cluster), 1, 1};
  config.attrs = &attribute;
  config.numAttrs = 1;
  int active = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&active, farthest_points_kernel<D>, &config));
  known.emplace(key, active);
  return active;
}

int threads_for(int64_t size, int cluster) {
  const int64_t per_block = (size + cluster - 1) / cluster;
  const int64_t threads = (per_block + kPointsPerThread - 1) / kPointsPerThread;
  return static_cast<int>(threads <= 32 ? 32 : (threads + 31) / 32 * 32);
}

// How to cut B clouds of N points: with a copy of the cloud in shared memory where it fits, in
// the largest cluster of at most kMaxPointsPerBlock points a block (from N / 1024 blocks down)
// that lets all B clusters run at once; otherwise without the copy, in the fewest blocks of
// 128, 256, 512 or 1024 threads a cloud (the GPU may then put two blocks on one SM).
template <int D>
Cut choose(int64_t batch, int64_t size, int cluster, bool shared_copy) {
  const int64_t cloud_bytes = size * D * static_cast<int64_t>(sizeof(float));
  shared_copy = shared_copy && cloud_bytes <= kSharedCloudBytes;
  if (cluster > 0) return {cluster, threads_for(size, cluster), shared_copy};
  if (shared_copy) {
    const int most = static_cast<int>(std::min<int64_t>(kMaxCluster, std::max<int64_t>(1, (size + 1023) / 1024)));
    for (int blocks = most; blocks >= 1; --blocks) {
      const int threads = threads_for(size, blocks);
      if (threads * kPointsPerThread > kMaxPointsPerBlock) break;
      if (active_clusters<D>(blocks, threads, static_cast<size_t>(cloud_bytes)) >= batch) {
        return {blocks, threads, true};
      }
    }
  }
  for (int threads = 128;; threads *= 2) {
    const int blocks = static_cast<int>((size + threads * kPointsPerThread - 1) / (threads * kPointsPerThread));
    if (blocks <= kMaxCluster || threads == 1024) return {std::max(blocks, 1), threads, false};
  }
}

template <int D>
void launch(const at::Tensor& x, const int64_t* lengths, const int64_t* start, at::Tensor& out, int64_t count,
            int64_t cluster, bool shared_copy) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(farthest_points_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kSharedCloudBytes));
  const Cut cut = choose<D>(x.size(0), x.size(1), static_cast<int>(cluster), shared_copy);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(x.size(0) * cut.cluster));
  config.blockDim = dim3(static_cast<unsigned>(cut.threads));
  config.dynamicSmemBytes = cut.shared_copy ? static_cast<size_t>(x.size(1) * D * sizeof(float)) : 0;
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim = {static_cast<unsigned>(cut.cluster), 1, 1};
  config.attrs = &attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, farthest_points_kernel<D>, x.data_ptr<float>(), lengths, start,
                                    out.data_ptr<int64_t>(), x.size(1), count,
                                    static_cast<int64_t>(cut.threads) * kPointsPerThread, cut.shared_copy));
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
                           const std::optional<at::Tensor>& start, int64_t count, int64_t cluster,
                           bool shared_copy) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.is_contiguous(),
              "x: expected a contiguous [B, N, D] float32 CUDA tensor, got ", x.scalar_type(), " of shape ", x.sizes(),
              " on ", x.device());
  const int64_t batch = x.size(0), size = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim >= 1 && dim <= kMaxDim, "x: expected D from 1 to ", kMaxDim, ", got ", dim);
  TORCH_CHECK(size <= kMaxPoints, "x: expected at most ", kMaxPoints, " points a cloud, got ", size);
  const int64_t* lengths_ = indices(lengths, "lengths", x);
  const int64_t* start_ = indices(start, "start", x);
  TORCH_CHECK(count >= 1, "count: expected at least 1 sample, got ", count);
  TORCH_CHECK(cluster >= 0 && cluster <= kMaxCluster && (cluster == 0 || (size + cluster - 1) / cluster <=
                                                                              1024 * kPointsPerThread),
              "cluster: expected 0 (choose) or 1 to ", kMaxCluster, " blocks of at most ", 1024 * kPointsPerThread,
              " points, got ", cluster, " for ", size, " points");
  if (batch == 0 || size == 0) return at::full({batch, count}, -1, x.options().dtype(at::kLong));
  at::Tensor out = at::empty({batch, count}, x.options().dtype(at::kLong));  // the kernel writes every entry
  const c10::cuda::CUDAGuard guard(x.device());
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.device().index()));
  TORCH_CHECK(major >= 9, "x: thread-block clusters need a GPU of compute capability 9.0 or later, got ", major);
  switch (dim) {
    case 1: launch<1>(x, lengths_, start_, out, count, cluster, shared_copy); break;
    case 2: launch<2>(x, lengths_, start_, out, count, cluster, shared_copy); break;
    case 3: launch<3>(x, lengths_, start_, out, count, cluster, shared_copy); break;
    default: launch<4>(x, lengths_, start_, out, count, cluster, shared_copy); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(fullgraph_fps, m) {
  m.def("farthest_points(Tensor x, Tensor? lengths, Tensor? start, int count, int cluster=0, bool shared_copy=True) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(fullgraph_fps, CUDA, m) { m.impl("farthest_points", &farthest_points); }
