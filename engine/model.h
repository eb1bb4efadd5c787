// Model: a small decoder-only transformer (RMSNorm, RoPE, grouped-query
// attention, SwiGLU) with deterministic random weights, on the CPU with
// OpenBLAS. It exists to make real KV tensors and to prove that a prefix
// restored from the cache gives the same logits as recomputing it.
//
// Attention runs on a Device (engine/device.h: the CPU reference, or a CUDA
// kernel over a GPU pool); the projections and the feed-forward run here.
// Attention always reads K and V from the paged KV pool in bf16, including
// the tokens of the current chunk, and prefill runs in page-aligned chunks:
// so a page computed now and a page restored from any tier are the same
// bytes, and the logits are bit-identical either way.
//
// Page layout (KvLayout): [rank][layer][K|V][local kv head][token][head dim]
// in bf16, so each tensor-parallel rank's slice is contiguous and can be
// stored as its own key.
//
// Thread-compatible: const methods may run concurrently, each with its own
// device.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/cuda/kernels.h"

namespace tierkv::engine {

class Device;

struct ModelConfig {
  int layers = 2;
  int hidden = 128;
  int heads = 4;
  int kv_heads = 2;
  int head_dim = 32;
  int ffn = 256;
  int vocab = 512;
  uint64_t seed = 7;
  float rope_theta = 10000.f;
};

// Where each byte of a page's KV lives.
struct KvLayout {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int page_tokens = 0;
  int tp = 1;  // tensor-parallel ranks; kv_heads must divide evenly

  static constexpr size_t kElem = 2;  // bf16
  size_t PageBytes() const;
  size_t RankBytes() const { return PageBytes() / tp; }
  size_t BytesPerToken() const { return PageBytes() / page_tokens; }
  // Element offset of (layer, k_or_v, kv head, token in page, dim 0).
  size_t Offset(int layer, int kv, int head, int token) const;
  // The same layout in the kernels' plain form (engine/cuda/kernels.h).
  cuda::KernelLayout kernel() const { return {layers, kv_heads, head_dim, page_tokens, tp}; }
};

uint16_t ToBf16(float f);
float FromBf16(uint16_t h);

class Model {
 public:
  explicit Model(ModelConfig config);

  const ModelConfig& config() const { return config_; }
  KvLayout Layout(int page_tokens, int tp) const;

  // Runs tokens [start, tokens.size()) of a sequence. KV of positions below
  // `start` must already be in the pages; KV of the new positions is
  // written into them. `page(i)` returns page i's memory (layout above).
  // Page addresses are the device's (L1). `start` must be a multiple of the
  // page size. Returns the last token's logits, or the device's error.
  // `on_chunk`, when set, is called after each page-sized chunk with the
  // number of pages whose KV is now complete (the last, partial page
  // counts once the last chunk ran); the device may still be writing them.
  absl::StatusOr<std::vector<float>> Prefill(absl::Span<const int32_t> tokens, size_t start, const KvLayout& layout,
                                             const std::function<char*(size_t page)>& page, Device& device,
                                             const std::function<void(size_t pages_done)>& on_chunk = {}) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down;
  };
  absl::Status Chunk(absl::Span<const int32_t> tokens, size_t begin, size_t end, const KvLayout& layout,
                     const std::function<char*(size_t)>& page, Device& device, std::vector<float>* last_hidden) const;

  ModelConfig config_;
  std::vector<float> embed_;  // [vocab, hidden]; also the output projection
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
};

}  // namespace tierkv::engine
