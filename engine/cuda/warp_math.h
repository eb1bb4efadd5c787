// The arithmetic of the engine's CUDA kernels, shared by the kernels
// (kernels.cu) and a host emulation of them (Emulate*), so that the
// kernels' indexing and reduction order are tested on machines without a
// GPU (GpuKernelLogicTest), against the CPU reference.
//
// Attention for one (query token, head) is one warp of 32 lanes, in three
// phases: lane-strided scores (and each lane's max), the exponentials (and
// each lane's sum), then lanes over the head dimension accumulating V in
// position order. Between phases a butterfly combines the lanes' values;
// the emulation does it exactly as __shfl_xor_sync does.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "engine/cuda/kernels.h"

#ifdef __CUDACC__
#define TKV_HOST_DEVICE __host__ __device__
#else
#define TKV_HOST_DEVICE
#endif

namespace tierkv::engine::cuda {

constexpr int kWarp = 32;

// Rounds to bf16, to nearest even; NaN stays NaN (ToBf16 is this).
TKV_HOST_DEVICE inline uint16_t WarpToBf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

TKV_HOST_DEVICE inline float WarpFromBf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Element offset of (layer, K or V, kv head, token in page); KvLayout::Offset
// is this.
TKV_HOST_DEVICE inline size_t KvOffset(const KernelLayout& L, int layer, int kv, int head, int token) {
  int local = L.kv_heads / L.tp;
  int rank = head / local;
  int h = head % local;
  size_t rank_elems = static_cast<size_t>(L.layers) * 2 * local * L.page_tokens * L.head_dim;
  return rank * rank_elems +
         ((((static_cast<size_t>(layer) * 2 + kv) * local + h) * L.page_tokens + token) * L.head_dim);
}

TKV_HOST_DEVICE inline uint16_t* KvAt(const KernelLayout& L, char* const* pages, int layer, int kv, int head,
                                      size_t pos) {
  char* base = pages[pos / L.page_tokens];
  return reinterpret_cast<uint16_t*>(base) + KvOffset(L, layer, kv, head, static_cast<int>(pos % L.page_tokens));
}

// Element i of the chunk's [n][kv_heads][head_dim] K and V into the pages.
TKV_HOST_DEVICE inline void WriteKvElement(const KernelLayout& L, int layer, size_t begin, size_t i, const float* k,
                                           const float* v, char* const* pages) {
  int d = static_cast<int>(i % L.head_dim);
  int h = static_cast<int>(i / L.head_dim % L.kv_heads);
  size_t t = i / L.head_dim / L.kv_heads;
  KvAt(L, pages, layer, 0, h, begin + t)[d] = WarpToBf16(k[i]);
  KvAt(L, pages, layer, 1, h, begin + t)[d] = WarpToBf16(v[i]);
}

// One warp's work: block `block` of the attention grid (n * heads blocks).
struct WarpTask {
  KernelLayout L;
  char* const* pages;
  int layer, kh, hd;
  size_t pos;       // the query's absolute position; it sees 0..pos
  const float* q;   // its query vector
  float scale;
  float* s;         // its scores row
  float* out;       // its output vector
};

TKV_HOST_DEVICE inline WarpTask MakeWarpTask(const KernelLayout& L, int layer, size_t begin, int n, int heads,
                                             float scale, const float* q, char* const* pages, float* scores,
                                             float* out, unsigned block) {
  const int t = static_cast<int>(block) / heads, hh = static_cast<int>(block) % heads;
  const int hd = L.head_dim;
  WarpTask w{L, pages, layer, hh / (heads / L.kv_heads), hd, begin + t,
             q + (static_cast<size_t>(t) * heads + hh) * hd, scale,
             scores + static_cast<size_t>(block) * (begin + n),
             out + (static_cast<size_t>(t) * heads + hh) * hd};
  return w;
}

// Phase 1: scores of positions lane, lane + 32, ...; returns this lane's max.
TKV_HOST_DEVICE inline float ScoresPhase(const WarpTask& w, int lane) {
  float mx = -INFINITY;
  for (size_t j = lane; j <= w.pos; j += kWarp) {
    const uint16_t* kk = KvAt(w.L, w.pages, w.layer, 0, w.kh, j);
    float dot = 0.f;
    for (int d = 0; d < w.hd; ++d) dot += w.q[d] * WarpFromBf16(kk[d]);
    w.s[j] = dot * w.scale;
    mx = fmaxf(mx, w.s[j]);
  }
  return mx;
}

// Phase 2: exponentials against the warp's max; returns this lane's sum.
TKV_HOST_DEVICE inline float ExpPhase(const WarpTask& w, int lane, float mx) {
  float sum = 0.f;
  for (size_t j = lane; j <= w.pos; j += kWarp) {
    float e = expf(w.s[j] - mx);
    w.s[j] = e;
    sum += e;
  }
  return sum;
}

// Phase 3: output dimensions lane, lane + 32, ..., over every position.
TKV_HOST_DEVICE inline void OutputPhase(const WarpTask& w, int lane, float sum) {
  for (int d = lane; d < w.hd; d += kWarp) {
    float acc = 0.f;
    for (size_t j = 0; j <= w.pos; ++j) acc += w.s[j] / sum * WarpFromBf16(KvAt(w.L, w.pages, w.layer, 1, w.kh, j)[d]);
    w.out[d] = acc;
  }
}

// Host emulation of the two kernels, lane by lane.
template <typename Op>
void EmulateButterfly(float (&v)[kWarp], Op op) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    float next[kWarp];
    for (int l = 0; l < kWarp; ++l) next[l] = op(v[l], v[l ^ o]);
    for (int l = 0; l < kWarp; ++l) v[l] = next[l];
  }
}

inline void EmulateWriteKv(const KernelLayout& L, int layer, size_t begin, int n, const float* k, const float* v,
                           char* const* pages) {
  size_t total = static_cast<size_t>(n) * L.kv_heads * L.head_dim;
  for (size_t i = 0; i < total; ++i) WriteKvElement(L, layer, begin, i, k, v, pages);
}

inline void EmulateAttention(const KernelLayout& L, int layer, size_t begin, int n, int heads, float scale,
                             const float* q, char* const* pages, float* scores, float* out) {
  for (unsigned b = 0; b < static_cast<unsigned>(n * heads); ++b) {
    WarpTask w = MakeWarpTask(L, layer, begin, n, heads, scale, q, pages, scores, out, b);
    float mx[kWarp], sum[kWarp];
    for (int l = 0; l < kWarp; ++l) mx[l] = ScoresPhase(w, l);
    EmulateButterfly(mx, [](float a, float b) { return fmaxf(a, b); });
    for (int l = 0; l < kWarp; ++l) sum[l] = ExpPhase(w, l, mx[l]);
    EmulateButterfly(sum, [](float a, float b) { return a + b; });
    for (int l = 0; l < kWarp; ++l) OutputPhase(w, l, sum[l]);
  }
}

}  // namespace tierkv::engine::cuda
