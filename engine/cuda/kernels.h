// Launchers for the engine's CUDA kernels (kernels.cu). Plain types only,
// so that this header compiles in C++ and CUDA translation units alike.
//
// Both kernels read and write pages in KvLayout's byte layout and round to
// bf16 exactly as ToBf16 does; attention uses a fixed reduction order per
// (token, head), so its result depends only on its inputs.
#pragma once

#include <cstddef>

namespace tierkv::engine::cuda {

struct KernelLayout {
  int layers, kv_heads, head_dim, page_tokens, tp;
};

// Each returns a cudaError_t (0 on success); `stream` is a cudaStream_t.
// pages: a device array of page addresses for pages 0 .. (begin + n - 1) / P.
// k, v: device [n][kv_heads][head_dim] floats.
int LaunchWriteKv(const KernelLayout& layout, int layer, size_t begin, int n, const float* k, const float* v,
                  char* const* pages, void* stream);
// q, out: device [n][heads][head_dim] floats; scores: device scratch of
// n * heads * (begin + n) floats.
int LaunchAttention(const KernelLayout& layout, int layer, size_t begin, int n, int heads, const float* q,
                    char* const* pages, float* scores, float* out, void* stream);

}  // namespace tierkv::engine::cuda
