#include "engine/cuda/kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace tierkv::engine::cuda {
namespace {

constexpr int kWarp = 32;

// The same rounding as ToBf16 (round to nearest even; NaN stays NaN).
__device__ uint16_t ToBf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

__device__ float FromBf16(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }

// Element offset of (layer, K or V, kv head, token in page), as KvLayout::Offset.
__device__ size_t Offset(const KernelLayout& L, int layer, int kv, int head, int token) {
  int local = L.kv_heads / L.tp;
  int rank = head / local;
  int h = head % local;
  size_t rank_elems = static_cast<size_t>(L.layers) * 2 * local * L.page_tokens * L.head_dim;
  return rank * rank_elems +
         ((((static_cast<size_t>(layer) * 2 + kv) * local + h) * L.page_tokens + token) * L.head_dim);
}

__device__ uint16_t* KvAt(const KernelLayout& L, char* const* pages, int layer, int kv, int head, size_t pos) {
  char* base = pages[pos / L.page_tokens];
  return reinterpret_cast<uint16_t*>(base) + Offset(L, layer, kv, head, static_cast<int>(pos % L.page_tokens));
}

// One thread per element of the chunk's K and V.
__global__ void WriteKvKernel(KernelLayout L, int layer, size_t begin, int n, const float* k, const float* v,
                              char* const* pages) {
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t total = static_cast<size_t>(n) * L.kv_heads * L.head_dim;
  if (i >= total) return;
  int d = static_cast<int>(i % L.head_dim);
  int h = static_cast<int>(i / L.head_dim % L.kv_heads);
  int t = static_cast<int>(i / L.head_dim / L.kv_heads);
  KvAt(L, pages, layer, 0, h, begin + t)[d] = ToBf16(k[i]);
  KvAt(L, pages, layer, 1, h, begin + t)[d] = ToBf16(v[i]);
}

// One warp per (query token, head). Lane j-strided scores, a butterfly for
// the max and the sum (the same tree every time), then lanes over the head
// dimension accumulate V in position order.
__global__ void AttentionKernel(KernelLayout L, int layer, size_t begin, int n, int heads, float scale,
                                const float* q, char* const* pages, float* scores, float* out) {
  const int t = blockIdx.x / heads, hh = blockIdx.x % heads, lane = threadIdx.x;
  const int hd = L.head_dim;
  const int kh = hh / (heads / L.kv_heads);
  const size_t pos = begin + t;
  const size_t len = begin + n;
  const float* qv = q + (static_cast<size_t>(t) * heads + hh) * hd;
  float* s = scores + static_cast<size_t>(blockIdx.x) * len;
  float mx = -INFINITY;
  for (size_t j = lane; j <= pos; j += kWarp) {
    const uint16_t* kk = KvAt(L, pages, layer, 0, kh, j);
    float dot = 0.f;
    for (int d = 0; d < hd; ++d) dot += qv[d] * FromBf16(kk[d]);
    s[j] = dot * scale;
    mx = fmaxf(mx, s[j]);
  }
  for (int o = kWarp / 2; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
  for (size_t j = lane; j <= pos; j += kWarp) {
    float e = expf(s[j] - mx);
    s[j] = e;
    sum += e;
  }
  for (int o = kWarp / 2; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  __syncwarp();  // every lane's scores are visible to every lane
  float* ov = out + (static_cast<size_t>(t) * heads + hh) * hd;
  for (int d = lane; d < hd; d += kWarp) {
    float acc = 0.f;
    for (size_t j = 0; j <= pos; ++j) acc += s[j] / sum * FromBf16(KvAt(L, pages, layer, 1, kh, j)[d]);
    ov[d] = acc;
  }
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
