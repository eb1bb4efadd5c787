// The engine's L1 pool on a GPU (built with CUDA). Without a GPU each test
// skips saying why; the same paths run on the CPU through
// EngineDeviceTest's device that the host cannot read.
#include <cmath>
#include <cstring>
#include <random>

#include "engine/device.h"
#include "engine/engine.h"
#include "tests/support/status_matchers.h"
#include "transport/memory.h"

namespace tierkv::engine {
namespace {

std::shared_ptr<Device> GpuOrSkip() {
  absl::StatusOr<std::unique_ptr<Device>> d = NewDevice("cuda:0");
  if (!d.ok()) return nullptr;
  return std::shared_ptr<Device>(std::move(*d));
}

#define REQUIRE_GPU(d)                                                                     \
  std::shared_ptr<Device> d = GpuOrSkip();                                                 \
  if (d == nullptr) GTEST_SKIP() << NewDevice("cuda:0").status().message() << "; needs a GPU"

std::vector<int32_t> Tokens(size_t n, int seed) {
  std::vector<int32_t> t(n);
  uint64_t x = seed;
  for (auto& v : t) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<int32_t>((x >> 33) % 512);
  }
  return t;
}

std::vector<float> Random(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(CudaEngineTest, KernelsMatchTheHostReference) {
  REQUIRE_GPU(gpu);
  for (int tp : {1, 2}) {
    KvLayout layout{2, 2, 32, 16, tp};
    const size_t pb = layout.PageBytes();
    const int heads = 4, n = 11;
    const size_t begin = 32;  // two pages already hold K/V
    const size_t npages = (begin + n - 1) / 16 + 1;
    std::mt19937 rng(tp);
    // Host pages, with random bf16 K/V in the earlier ones.
    std::vector<char> host(npages * pb, 0);
    for (size_t i = 0; i < 2 * pb / 2; ++i) {
      reinterpret_cast<uint16_t*>(host.data())[i] = ToBf16(std::normal_distribution<float>(0, 1)(rng));
    }
    ASSERT_OK_AND_ASSIGN(char* dev, gpu->Allocate(npages * pb));
    ASSERT_OK(gpu->CopyIn(dev, host.data(), npages * pb));
    std::vector<char*> host_pages, dev_pages;
    for (size_t i = 0; i < npages; ++i) {
      host_pages.push_back(host.data() + i * pb);
      dev_pages.push_back(dev + i * pb);
    }
    std::vector<float> q = Random(n * heads * 32, rng), k = Random(n * 2 * 32, rng), v = Random(n * 2 * 32, rng);
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<float> want(q.size()), got(q.size());
      AttentionChunk c{&layout, layer, begin, n, heads, q.data(), k.data(), v.data(), &host_pages, want.data()};
      HostAttention(c);
      c.pages = &dev_pages;
      c.out = got.data();
      ASSERT_OK(gpu->Attention(c));
      for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4) << "tp " << tp << " element " << i;
    }
    // The K/V the kernel wrote are the host's bytes exactly.
    std::vector<char> back(npages * pb);
    ASSERT_OK(gpu->CopyOut(back.data(), dev, back.size()));
    ASSERT_OK(gpu->Sync());
    EXPECT_EQ(std::memcmp(back.data(), host.data(), back.size()), 0) << "tp " << tp;
    gpu->Free(dev, npages * pb);
  }
}

TEST(CudaEngineTest, PagesRoundTripBetweenL1AndPinnedL2) {
  REQUIRE_GPU(gpu);
  constexpr size_t kPage = 64 << 10, kPages = 64;
  auto l2 = transport::SharedRegion::Create(kPages * kPage, {});
  ASSERT_OK(l2.status());
  char* host = (*l2)->data();
  ASSERT_OK(gpu->RegisterHost(host, kPages * kPage));
  std::mt19937_64 rng(5);
  for (size_t i = 0; i < kPages * kPage / 8; ++i) reinterpret_cast<uint64_t*>(host)[i] = rng();
  std::vector<char> want(host, host + kPages * kPage);
  ASSERT_OK_AND_ASSIGN(char* l1, gpu->Allocate(kPages * kPage));
  // In as one batch, out in reverse page order into the same pool.
  for (size_t p = 0; p < kPages; ++p) ASSERT_OK(gpu->CopyIn(l1 + p * kPage, host + p * kPage, kPage));
  ASSERT_OK(gpu->Sync());
  std::memset(host, 0, kPages * kPage);
  for (size_t p = kPages; p-- > 0;) ASSERT_OK(gpu->CopyOut(host + p * kPage, l1 + p * kPage, kPage));
  ASSERT_OK(gpu->Sync());
  EXPECT_EQ(std::memcmp(host, want.data(), want.size()), 0);
  gpu->Free(l1, kPages * kPage);
  gpu->UnregisterHost(host);
}

// Copies are issued in batches whose members run in no set order; the
// device must still apply them in the order they were asked for.
TEST(CudaEngineTest, CopiesTakeEffectInTheOrderIssued) {
  REQUIRE_GPU(gpu);
  constexpr size_t kPage = 4096;
  std::vector<char> first(kPage, 'a'), second(kPage, 'b'), out1(kPage), out2(kPage);  // pageable
  ASSERT_OK_AND_ASSIGN(char* l1, gpu->Allocate(kPage));
  ASSERT_OK(gpu->CopyIn(l1, first.data(), kPage));
  ASSERT_OK(gpu->CopyIn(l1, second.data(), kPage));  // the later copy to one page wins
  ASSERT_OK(gpu->CopyOut(out1.data(), l1, kPage));   // sees both
  ASSERT_OK(gpu->CopyIn(l1, first.data(), kPage));   // after the copy out read it
  ASSERT_OK(gpu->CopyOut(out2.data(), l1, kPage));
  ASSERT_OK(gpu->Sync());
  EXPECT_EQ(out1, second);
  EXPECT_EQ(out2, first);
  gpu->Free(l1, kPage);

  // More small pages than one batch holds, each with its own bytes.
  constexpr size_t kSmall = 256, kMany = 5000;
  std::vector<char> in(kSmall * kMany), back(kSmall * kMany);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<char>(i * 7 + i / kSmall);
  ASSERT_OK_AND_ASSIGN(char* many, gpu->Allocate(in.size()));
  for (size_t p = 0; p < kMany; ++p) ASSERT_OK(gpu->CopyIn(many + p * kSmall, in.data() + p * kSmall, kSmall));
  for (size_t p = 0; p < kMany; ++p) ASSERT_OK(gpu->CopyOut(back.data() + p * kSmall, many + p * kSmall, kSmall));
  ASSERT_OK(gpu->Sync());
  EXPECT_EQ(back, in);
  gpu->Free(many, in.size());

  // A page copied out leaves before a later kernel writes K/V into it.
  KvLayout layout{2, 2, 32, 16, 1};
  const size_t pb = layout.PageBytes();
  std::vector<char> before(pb), after(pb), written(pb);
  for (size_t i = 0; i < pb; ++i) before[i] = static_cast<char>(i * 13 + 1);
  ASSERT_OK_AND_ASSIGN(char* page, gpu->Allocate(pb));
  ASSERT_OK(gpu->CopyIn(page, before.data(), pb));
  ASSERT_OK(gpu->Sync());
  ASSERT_OK(gpu->CopyOut(after.data(), page, pb));
  std::mt19937 rng(9);
  const int heads = 4, n = 16;
  std::vector<float> q = Random(n * heads * 32, rng), k = Random(n * 2 * 32, rng), v = Random(n * 2 * 32, rng);
  std::vector<float> out(q.size());
  std::vector<char*> pages{page};
  AttentionChunk c{&layout, 0, 0, n, heads, q.data(), k.data(), v.data(), &pages, out.data()};
  ASSERT_OK(gpu->Attention(c));
  ASSERT_OK(gpu->CopyOut(written.data(), page, pb));
  ASSERT_OK(gpu->Sync());
  EXPECT_EQ(after, before);
  EXPECT_NE(written, before);  // the kernel did write the page
  gpu->Free(page, pb);
}

EngineConfig SmallModel(std::shared_ptr<Device> d) {
  EngineConfig c;
  c.page_tokens = 16;
  c.l1_pages = 64;
  c.l2_pages = 256;
  c.device = std::move(d);
  return c;
}

float MaxAbs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

TEST(CudaEngineTest, RestoredPrefixGivesBitIdenticalLogitsWithL1OnTheGpu) {
  REQUIRE_GPU(gpu);
  for (size_t len : {150u, 201u, 333u}) {
    std::vector<int32_t> prompt = Tokens(len, static_cast<int>(len));
    InferenceEngine fresh(SmallModel(gpu), nullptr);
    RequestResult ref = fresh.Serve(prompt);
    ASSERT_OK(ref.status);
    ASSERT_EQ(ref.cached_tokens, 0u);

    InMemoryL3 store;
    InferenceEngine writer(SmallModel(gpu), &store);
    ASSERT_OK(writer.Serve(prompt).status);
    InferenceEngine reader(SmallModel(gpu), &store);
    RequestResult from_l3 = reader.Serve(prompt);
    ASSERT_OK(from_l3.status);
    EXPECT_EQ(from_l3.cached_tokens, (len - 1) / 16 * 16);
    EXPECT_EQ(from_l3.logits, ref.logits) << "L3 restore, length " << len;

    EngineConfig small = SmallModel(gpu);
    small.l1_pages = 24;
    InferenceEngine l2eng(small, nullptr);
    l2eng.Serve(prompt);
    l2eng.Serve(Tokens(300, 99));
    RequestResult from_l2 = l2eng.Serve(prompt);
    ASSERT_OK(from_l2.status);
    EXPECT_GT(from_l2.l2_tokens, 0u) << len;
    EXPECT_EQ(from_l2.logits, ref.logits) << "L2 restore, length " << len;

    // The GPU's attention is not the CPU's bit for bit (another exp, another
    // summation order), but it computes the same function.
    InferenceEngine cpu(SmallModel(nullptr), nullptr);
    std::vector<float> cpu_logits = cpu.Serve(prompt).logits;
    ASSERT_EQ(cpu_logits.size(), ref.logits.size());
    float tol = 1e-2f * MaxAbs(cpu_logits);
    for (size_t i = 0; i < cpu_logits.size(); ++i) ASSERT_NEAR(ref.logits[i], cpu_logits[i], tol) << i;
  }
}

}  // namespace
}  // namespace tierkv::engine
