#include <cuda_runtime.h>

#include "engine/cuda/kernels.h"
#include "engine/cuda/warp_math.h"

namespace tierkv::engine::cuda {
namespace {

// One thread per element of the chunk's K and V.
__global__ void WriteKvKernel(KernelLayout L, int layer, size_t begin, int n, const float* k, const float* v,
                              char* const* pages) {
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < static_cast<size_t>(n) * L.kv_heads * L.head_dim) WriteKvElement(L, layer, begin, i, k, v, pages);
}

// One warp per (query token, head); see warp_math.h for the phases.
__global__ void AttentionKernel(KernelLayout L, int layer, size_t begin, int n, int heads, float scale,
                                const float* q, char* const* pages, float* scores, float* out) {
  const int lane = threadIdx.x;
  WarpTask w = MakeWarpTask(L, layer, begin, n, heads, scale, q, pages, scores, out, blockIdx.x);
  float mx = ScoresPhase(w, lane);
  for (int o = kWarp / 2; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = ExpPhase(w, lane, mx);
  for (int o = kWarp / 2; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  __syncwarp();  // every lane's exponentials are visible to every lane
  OutputPhase(w, lane, sum);
}

}  // namespace

int LaunchWriteKv(const KernelLayout& layout, int layer, size_t begin, int n, const float* k, const float* v,
                  char* const* pages, void* stream) {
  size_t total = static_cast<size_t>(n) * layout.kv_heads * layout.head_dim;
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  unsigned blocks = static_cast<unsigned>((total + threads - 1) / threads);
  WriteKvKernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(layout, layer, begin, n, k, v, pages);
  return cudaGetLastError();
}

int LaunchAttention(const KernelLayout& layout, int layer, size_t begin, int n, int heads, const float* q,
                    char* const* pages, float* scores, float* out, void* stream) {
  if (n == 0) return cudaSuccess;
  float scale = 1.f / sqrtf(static_cast<float>(layout.head_dim));
  AttentionKernel<<<static_cast<unsigned>(n) * heads, kWarp, 0, static_cast<cudaStream_t>(stream)>>>(
      layout, layer, begin, n, heads, scale, q, pages, scores, out);
  return cudaGetLastError();
}

}  // namespace tierkv::engine::cuda
