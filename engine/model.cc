#include "engine/model.h"

#include <cblas.h>

#include <cmath>
#include <cstring>
#include <random>

#include "engine/cuda/warp_math.h"
#include "engine/device.h"

namespace tierkv::engine {

size_t KvLayout::PageBytes() const {
  return static_cast<size_t>(layers) * 2 * kv_heads * page_tokens * head_dim * kElem;
}

// The layout and the rounding have one definition, shared with the CUDA
// kernels (engine/cuda/warp_math.h), so a page means the same bytes on
// either side.
size_t KvLayout::Offset(int layer, int kv, int head, int token) const {
  return cuda::KvOffset(kernel(), layer, kv, head, token);
}

uint16_t ToBf16(float f) { return cuda::WarpToBf16(f); }

float FromBf16(uint16_t h) { return cuda::WarpFromBf16(h); }

namespace {

std::vector<float> RandomMatrix(std::mt19937_64& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> m(n);
  for (float& x : m) x = dist(rng);
  return m;
}

void RmsNorm(const float* x, const float* w, float* out, int n) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  float inv = 1.f / std::sqrt(static_cast<float>(ss / n) + 1e-6f);
  for (int i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// C[m, n] = A[m, k] * B[k, n], row-major.
void MatMul(const float* a, const float* b, float* c, int m, int k, int n) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.f, a, k, b, n, 0.f, c, n);
}

}  // namespace

Model::Model(ModelConfig config) : config_(config) {
  // One BLAS thread: the reduction order, and so every bit of the result,
  // must not depend on how the work was split.
  openblas_set_num_threads(1);
  const ModelConfig& c = config_;
  std::mt19937_64 rng(c.seed);
  float s = 1.f / std::sqrt(static_cast<float>(c.hidden));
  embed_ = RandomMatrix(rng, static_cast<size_t>(c.vocab) * c.hidden, 1.f);
  final_norm_.assign(c.hidden, 1.f);
  for (int l = 0; l < c.layers; ++l) {
    Layer L;
    L.attn_norm.assign(c.hidden, 1.f);
    L.ffn_norm.assign(c.hidden, 1.f);
    L.wq = RandomMatrix(rng, static_cast<size_t>(c.hidden) * c.heads * c.head_dim, s);
    L.wk = RandomMatrix(rng, static_cast<size_t>(c.hidden) * c.kv_heads * c.head_dim, s);
    L.wv = RandomMatrix(rng, static_cast<size_t>(c.hidden) * c.kv_heads * c.head_dim, s);
    L.wo = RandomMatrix(rng, static_cast<size_t>(c.heads) * c.head_dim * c.hidden, s);
    L.w_gate = RandomMatrix(rng, static_cast<size_t>(c.hidden) * c.ffn, s);
    L.w_up = RandomMatrix(rng, static_cast<size_t>(c.hidden) * c.ffn, s);
    L.w_down = RandomMatrix(rng, static_cast<size_t>(c.ffn) * c.hidden, 1.f / std::sqrt(static_cast<float>(c.ffn)));
    layers_.push_back(std::move(L));
  }
  for (int i = 0; i < c.head_dim / 2; ++i) {
    inv_freq_.push_back(1.f / std::pow(c.rope_theta, 2.f * i / c.head_dim));
  }
}

KvLayout Model::Layout(int page_tokens, int tp) const {
  return {config_.layers, config_.kv_heads, config_.head_dim, page_tokens, tp};
}

absl::StatusOr<std::vector<float>> Model::Prefill(absl::Span<const int32_t> tokens, size_t start,
                                                  const KvLayout& layout, const std::function<char*(size_t)>& page,
                                                  Device& device,
                                                  const std::function<void(size_t pages_done)>& on_chunk) const {
  std::vector<float> last(config_.hidden, 0.f);
  const size_t p = layout.page_tokens;
  for (size_t begin = start; begin < tokens.size(); begin += p - begin % p) {
    size_t end = std::min(tokens.size(), begin - begin % p + p);
    if (absl::Status s = Chunk(tokens, begin, end, layout, page, device, &last); !s.ok()) return s;
    if (on_chunk) on_chunk(end == tokens.size() ? (end + p - 1) / p : end / p);
  }
  std::vector<float> normed(config_.hidden);
  RmsNorm(last.data(), final_norm_.data(), normed.data(), config_.hidden);
  std::vector<float> logits(config_.vocab);
  // logits = embed * normed (tied output projection).
  cblas_sgemv(CblasRowMajor, CblasNoTrans, config_.vocab, config_.hidden, 1.f, embed_.data(),
              config_.hidden, normed.data(), 1, 0.f, logits.data(), 1);
  return logits;
}

absl::Status Model::Chunk(absl::Span<const int32_t> tokens, size_t begin, size_t end, const KvLayout& layout,
                          const std::function<char*(size_t)>& page, Device& device,
                          std::vector<float>* last_hidden) const {
  const ModelConfig& c = config_;
  const int n = static_cast<int>(end - begin);
  const int hd = c.head_dim, H = c.heads, KH = c.kv_heads, D = c.hidden;
  const size_t P = layout.page_tokens;
  std::vector<float> x(static_cast<size_t>(n) * D), h(x.size());
  for (int t = 0; t < n; ++t) {
    int tok = std::clamp(tokens[begin + t], 0, c.vocab - 1);
    std::memcpy(&x[static_cast<size_t>(t) * D], &embed_[static_cast<size_t>(tok) * D], D * sizeof(float));
  }
  std::vector<float> q(static_cast<size_t>(n) * H * hd), k(static_cast<size_t>(n) * KH * hd),
      v(k.size()), attn(q.size()), o(x.size()), gate(static_cast<size_t>(n) * c.ffn), up(gate.size());
  std::vector<char*> pages;
  for (size_t i = 0; i <= (end - 1) / P; ++i) pages.push_back(page(i));
  for (int l = 0; l < c.layers; ++l) {
    const Layer& L = layers_[l];
    for (int t = 0; t < n; ++t) RmsNorm(&x[t * D], L.attn_norm.data(), &h[t * D], D);
    MatMul(h.data(), L.wq.data(), q.data(), n, D, H * hd);
    MatMul(h.data(), L.wk.data(), k.data(), n, D, KH * hd);
    MatMul(h.data(), L.wv.data(), v.data(), n, D, KH * hd);
    // RoPE at absolute positions; the device stores K and V as bf16.
    for (int t = 0; t < n; ++t) {
      size_t pos = begin + t;
      auto rope = [&](float* vec) {
        for (int i = 0; i < hd / 2; ++i) {
          float ang = static_cast<float>(pos) * inv_freq_[i];
          float cs = std::cos(ang), sn = std::sin(ang);
          float a = vec[i], b = vec[i + hd / 2];
          vec[i] = a * cs - b * sn;
          vec[i + hd / 2] = a * sn + b * cs;
        }
      };
      for (int hh = 0; hh < H; ++hh) rope(&q[(static_cast<size_t>(t) * H + hh) * hd]);
      for (int hh = 0; hh < KH; ++hh) rope(&k[(static_cast<size_t>(t) * KH + hh) * hd]);
    }
    AttentionChunk chunk{.layout = &layout,
                         .layer = l,
                         .begin = begin,
                         .tokens = n,
                         .heads = H,
                         .q = q.data(),
                         .k = k.data(),
                         .v = v.data(),
                         .pages = &pages,
                         .out = attn.data()};
    if (absl::Status s = device.Attention(chunk); !s.ok()) return s;
    MatMul(attn.data(), L.wo.data(), o.data(), n, H * hd, D);
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    // SwiGLU feed-forward.
    for (int t = 0; t < n; ++t) RmsNorm(&x[t * D], L.ffn_norm.data(), &h[t * D], D);
    MatMul(h.data(), L.w_gate.data(), gate.data(), n, D, c.ffn);
    MatMul(h.data(), L.w_up.data(), up.data(), n, D, c.ffn);
    for (size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    MatMul(gate.data(), L.w_down.data(), o.data(), n, c.ffn, D);
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
  }
  std::memcpy(last_hidden->data(), &x[static_cast<size_t>(n - 1) * D], D * sizeof(float));
  return absl::OkStatus();
}

}  // namespace tierkv::engine
