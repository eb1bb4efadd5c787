#include "engine/device.h"

#include <cmath>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "transport/memory.h"

#ifdef TIERKV_HAVE_CUDA
#include "engine/cuda/cuda_device.h"
#include "transport/cuda/cuda_backend.h"
#endif

namespace tierkv::engine {

void HostAttention(const AttentionChunk& c) {
  const KvLayout& layout = *c.layout;
  const int hd = layout.head_dim, H = c.heads, KH = layout.kv_heads, n = c.tokens;
  const size_t P = layout.page_tokens;
  auto kv_at = [&](int which, int head, size_t pos) {
    char* base = (*c.pages)[pos / P];
    return reinterpret_cast<uint16_t*>(base) + layout.Offset(c.layer, which, head, static_cast<int>(pos % P));
  };
  for (int t = 0; t < n; ++t) {
    for (int hh = 0; hh < KH; ++hh) {
      uint16_t* kd = kv_at(0, hh, c.begin + t);
      uint16_t* vd = kv_at(1, hh, c.begin + t);
      const size_t row = (static_cast<size_t>(t) * KH + hh) * hd;
      for (int d = 0; d < hd; ++d) {
        kd[d] = ToBf16(c.k[row + d]);
        vd[d] = ToBf16(c.v[row + d]);
      }
    }
  }
  // Causal attention over the pages, in a fixed order.
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  std::vector<float> scores;
  for (int t = 0; t < n; ++t) {
    size_t pos = c.begin + t;
    scores.resize(pos + 1);
    for (int hh = 0; hh < H; ++hh) {
      int kh = hh / (H / KH);
      const float* qv = &c.q[(static_cast<size_t>(t) * H + hh) * hd];
      float mx = -INFINITY;
      for (size_t j = 0; j <= pos; ++j) {
        const uint16_t* kk = kv_at(0, kh, j);
        float dot = 0;
        for (int d = 0; d < hd; ++d) dot += qv[d] * FromBf16(kk[d]);
        scores[j] = dot * scale;
        mx = std::max(mx, scores[j]);
      }
      float sum = 0;
      for (size_t j = 0; j <= pos; ++j) sum += scores[j] = std::exp(scores[j] - mx);
      float* out = &c.out[(static_cast<size_t>(t) * H + hh) * hd];
      std::fill(out, out + hd, 0.f);
      for (size_t j = 0; j <= pos; ++j) {
        const uint16_t* vv = kv_at(1, kh, j);
        float w = scores[j] / sum;
        for (int d = 0; d < hd; ++d) out[d] += w * FromBf16(vv[d]);
      }
    }
  }
}

absl::Status CheckDevice(Device& device) {
  const KvLayout layout{1, 2, 32, 16, 1};
  const size_t pb = layout.PageBytes();
  const int heads = 4, n = 8;
  const size_t begin = 16;
  // Deterministic inputs in [-1, 1); the first page already holds K/V.
  uint64_t x = 0x9e3779b97f4a7c15ull;
  auto next = [&x] {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) / (1 << 23);
  };
  std::vector<char> host(2 * pb, 0);
  for (size_t i = 0; i < pb / 2; ++i) reinterpret_cast<uint16_t*>(host.data())[i] = ToBf16(next());
  std::vector<float> q(n * heads * 32), k(n * 2 * 32), v(k.size());
  for (auto* vec : {&q, &k, &v}) {
    for (float& f : *vec) f = next();
  }
  absl::StatusOr<char*> l1 = device.Allocate(2 * pb);
  if (!l1.ok()) return l1.status();
  std::vector<char*> dev_pages{*l1, *l1 + pb}, host_pages{host.data(), host.data() + pb};
  std::vector<float> got(q.size()), want(q.size());
  std::vector<char> back(2 * pb);
  absl::Status s = device.CopyIn(*l1, host.data(), 2 * pb);
  if (s.ok()) s = device.Attention({&layout, 0, begin, n, heads, q.data(), k.data(), v.data(), &dev_pages, got.data()});
  if (s.ok()) s = device.CopyOut(back.data(), *l1, 2 * pb);
  if (s.ok()) s = device.Sync();
  device.Free(*l1, 2 * pb);
  if (!s.ok()) return s;
  HostAttention({&layout, 0, begin, n, heads, q.data(), k.data(), v.data(), &host_pages, want.data()});
  if (std::memcmp(back.data(), host.data(), back.size()) != 0) {
    return absl::InternalError(absl::StrCat(device.name(), ": K/V pages written by the device differ from the reference"));
  }
  for (size_t i = 0; i < want.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= 1e-3f)) {
      return absl::InternalError(absl::StrCat(device.name(), ": attention output ", i, " is ", got[i],
                                              ", the reference says ", want[i]));
    }
  }
  return absl::OkStatus();
}

namespace {

class CpuDevice final : public Device {
 public:
  std::string name() const override { return "cpu"; }
  bool host_addressable() const override { return true; }
  absl::StatusOr<char*> Allocate(size_t bytes) override {
    // Reserved, not touched, until pages are used.
    auto region = transport::SharedRegion::Create(std::max<size_t>(1, bytes), {});
    if (!region.ok()) return region.status();
    char* p = (*region)->data();
    regions_.push_back(std::move(*region));
    return p;
  }
  void Free(char* p, size_t) override {
    std::erase_if(regions_, [p](const auto& r) { return r->data() == p; });
  }
  int MemoryFd(const char* p) const override {
    for (const auto& r : regions_) {
      if (r->data() == p) return r->fd();
    }
    return -1;
  }
  absl::Status RegisterHost(char*, size_t) override { return absl::OkStatus(); }
  void UnregisterHost(char*) override {}
  absl::Status CopyIn(char* l1, const char* host, size_t bytes) override {
    std::memcpy(l1, host, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyOut(char* host, const char* l1, size_t bytes) override {
    std::memcpy(host, l1, bytes);
    return absl::OkStatus();
  }
  absl::Status Attention(const AttentionChunk& chunk) override {
    HostAttention(chunk);
    return absl::OkStatus();
  }
  absl::Status Sync() override { return absl::OkStatus(); }

 private:
  std::vector<std::unique_ptr<transport::SharedRegion>> regions_;
};

}  // namespace

std::unique_ptr<Device> NewCpuDevice() { return std::make_unique<CpuDevice>(); }

absl::StatusOr<std::unique_ptr<Device>> NewDevice(const std::string& name) {
  if (name == "cpu") return NewCpuDevice();
  if (name == "auto") {
#ifdef TIERKV_HAVE_CUDA
    if (absl::StatusOr<int> gpus = transport::cuda::DeviceCount(); gpus.ok() && *gpus > 0) {
      absl::StatusOr<std::unique_ptr<Device>> d = NewDevice("cuda:0");
      if (d.ok()) return d;
      TKV_LOG(WARNING) << "L1 stays in host memory: " << d.status().message();
    } else {
      TKV_LOG(DEBUG) << "L1 stays in host memory: " << gpus.status().message();
    }
#endif
    return NewCpuDevice();
  }
  int ordinal = -1;
  if (!absl::StartsWith(name, "cuda:") || !absl::SimpleAtoi(name.substr(5), &ordinal) || ordinal < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device '", name, "' is not cpu, auto or cuda:<n>"));
  }
#ifdef TIERKV_HAVE_CUDA
  absl::StatusOr<std::unique_ptr<Device>> d = cuda::NewCudaDevice(ordinal);
  if (!d.ok()) return d.status();
  if (absl::Status s = CheckDevice(**d); !s.ok()) {
    return absl::UnavailableError(absl::StrCat(name, " failed its self-check: ", s.message()));
  }
  return d;
#else
  return absl::UnavailableError(absl::StrCat("device ", name, ": this build has no CUDA (nvcc was not found at configure time)"));
#endif
}

}  // namespace tierkv::engine
