// Where a step of the cluster FPS kernel (src/fullgraph/ops/csrc/farthest_points.cu) goes: the
// same loop (D = 3, every point valid) with its cluster barrier swapped, timed with CUDA events.
//
//   nvcc -O3 -arch=sm_90a -o /tmp/probe benchmarks/fps_cluster_probe.cu && /tmp/probe
//
// Modes: 0 cluster.sync() (arrive.release + wait.acquire, as the library), 1 the posting lanes
// fence (fence.acq_rel.cluster) and every thread arrives relaxed, 2 __syncthreads() only (wrong
// for clusters of more than one block: the in-block floor), 3 mode 1 with the
// candidates' coordinates read back from global memory instead of posted.
#include <cooperative_groups.h>
#include <cstdio>
#include <vector>
#include <algorithm>

namespace cg = cooperative_groups;
constexpr int P = 8;

struct Candidate { unsigned long long key; float c[4]; };

__device__ __forceinline__ unsigned long long warp_max(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) { unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o); v = w > v ? w : v; }
  return v;
}

template <int MODE>
__global__ void __launch_bounds__(1024) probe(const float* points, long long* out, int size, int count, int slice) {
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank(), parts = cluster.num_blocks();
  const int cloud = blockIdx.x / parts;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __shared__ unsigned long long warp_keys[32];
  __shared__ float warp_c[32][3];
  __shared__ Candidate inbox[2][8];
  const float* base = points + (long long)cloud * size * 3;
  const int lo = rank * slice, end = min(lo + slice, size);
  float x[P][3], gap[P];
  for (int j = 0; j < P; ++j) {
    int i = lo + j * blockDim.x + threadIdx.x; bool in = i < end;
    for (int d = 0; d < 3; ++d) x[j][d] = in ? base[i * 3 + d] : 0.f;
    gap[j] = in ? __int_as_float(0x7f800000) : -1.f;
  }
  float c[3] = {base[0], base[1], base[2]};
  cluster.sync();
  for (int step = 1; step < count; ++step) {
    unsigned long long best = 0; float bc[3] = {0, 0, 0};
#pragma unroll
    for (int j = 0; j < P; ++j) {
      if (gap[j] >= 0.f) {
        float t = 0.f;
#pragma unroll
        for (int d = 0; d < 3; ++d) { float df = __fsub_rn(x[j][d], c[d]); t = d == 0 ? __fmul_rn(df, df) : __fadd_rn(t, __fmul_rn(df, df)); }
        gap[j] = fminf(gap[j], t);
        unsigned idx = lo + j * blockDim.x + threadIdx.x;
        unsigned long long key = ((unsigned long long)(__float_as_uint(gap[j]) + 1u) << 32) | (0xffffffffu - idx);
        if (key > best) { best = key; bc[0] = x[j][0]; bc[1] = x[j][1]; bc[2] = x[j][2]; }
      }
    }
    unsigned long long mine = best; best = warp_max(best);
    if (lane == __ffs(__ballot_sync(0xffffffffu, mine == best)) - 1) { warp_keys[warp] = best; warp_c[warp][0] = bc[0]; warp_c[warp][1] = bc[1]; warp_c[warp][2] = bc[2]; }
    __syncthreads();
    if (warp == 0) {
      unsigned long long key = lane < warps ? warp_keys[lane] : 0ull, top = warp_max(key);
      int from = __ffs(__ballot_sync(0xffffffffu, lane < warps && key == top)) - 1;
      if (lane < (int)parts) {
        Candidate* slot = MODE == 2 ? &inbox[step & 1][lane] : cluster.map_shared_rank(&inbox[step & 1][rank], lane);
        slot->key = top; slot->c[0] = warp_c[from][0]; slot->c[1] = warp_c[from][1]; slot->c[2] = warp_c[from][2];
        if (MODE == 1 || MODE == 3) asm volatile("fence.acq_rel.cluster;" ::: "memory");
      }
    }
    if (MODE == 0) cluster.sync();
    else if (MODE == 2) __syncthreads();
    else {
      asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
      asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    }
    best = 0;
    for (unsigned r = 0; r < parts; ++r) {
      const Candidate& p = inbox[step & 1][r];
      if (p.key > best) { best = p.key; if (MODE != 3) { c[0] = p.c[0]; c[1] = p.c[1]; c[2] = p.c[2]; } }
    }
    unsigned index = 0xffffffffu - (unsigned)(best & 0xffffffffu);
    if (MODE == 3) { c[0] = base[index * 3]; c[1] = base[index * 3 + 1]; c[2] = base[index * 3 + 2]; }
    if (rank == 0 && threadIdx.x == 0) out[(long long)cloud * count + step] = index;
  }
}

template <int MODE>
float run(const float* pts, long long* out, int clouds, int size, int count, int threads) {
  int slice = threads * P, parts = (size + slice - 1) / slice;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(clouds * parts); cfg.blockDim = dim3(threads);
  cudaLaunchAttribute a; a.id = cudaLaunchAttributeClusterDimension; a.val.clusterDim.x = parts; a.val.clusterDim.y = 1; a.val.clusterDim.z = 1;
  cfg.attrs = &a; cfg.numAttrs = 1;
  cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e);
  std::vector<float> t;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(s);
    cudaLaunchKernelEx(&cfg, probe<MODE>, pts, out, size, count, slice);
    cudaEventRecord(e); cudaEventSynchronize(e);
    float ms; cudaEventElapsedTime(&ms, s, e); t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) printf("error %s\n", cudaGetErrorString(err));
  return t[3];
}

int main() {
  const int shapes[][4] = {{32, 1024, 512, 128}, {32, 1024, 512, 256}, {16, 16384, 4096, 256}, {16, 16384, 4096, 512},
                           {16, 16384, 4096, 1024}, {1, 16384, 4096, 256}, {128, 2048, 1024, 256}};
  float* pts; long long* out;
  cudaMalloc(&pts, 16LL * 16384 * 3 * 4 * 8); cudaMalloc(&out, 128LL * 4096 * 8);
  std::vector<float> h(16LL * 16384 * 3 * 8);
  for (size_t i = 0; i < h.size(); ++i) h[i] = (float)((i * 2654435761u) % 1000003) / 1000003.f;
  cudaMemcpy(pts, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  for (auto& sh : shapes) {
    int clouds = sh[0], size = sh[1], count = sh[2], threads = sh[3];
    float m0 = run<0>(pts, out, clouds, size, count, threads), m1 = run<1>(pts, out, clouds, size, count, threads);
    float m2 = run<2>(pts, out, clouds, size, count, threads), m3 = run<3>(pts, out, clouds, size, count, threads);
    printf("%dx%d->%d, %d threads (%d blocks a cloud): cluster.sync %.3f ms (%.2f us/step), fence+relaxed %.3f (%.2f), "
           "syncthreads only %.3f (%.2f), relaxed + global centre %.3f (%.2f)\n", clouds, size, count, threads,
           (size + threads * P - 1) / (threads * P), m0, 1000 * m0 / count, m1, 1000 * m1 / count, m2, 1000 * m2 / count,
           m3, 1000 * m3 / count);
  }
  return 0;
}
