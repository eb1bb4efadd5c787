#include <sys/mman.h>

#include <map>
#include <numeric>

#include "engine/cuda/warp_math.h"
#include "engine/device.h"
#include "engine/engine.h"
#include "engine/radix_tree.h"
#include "engine/trace.h"
#include "tests/support/status_matchers.h"
#include "tests/unit/engine_fixture.h"

namespace tierkv::engine {
namespace {

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(RadixTreeTest, InsertMatchSplitRemove) {
  constexpr int P = 4;
  RadixTree tree(P);
  KeySpace space{"m", "bf16", "p4"};
  std::vector<int32_t> a = Tokens(4 * P, 1);
  auto keys_a = PageKeys(a, P, space);
  EXPECT_TRUE(tree.Match(a).empty());
  auto added = tree.Insert(a, keys_a, 0);
  ASSERT_EQ(added.size(), 4u);
  EXPECT_EQ(tree.nodes(), 1u);  // one run of four pages
  EXPECT_EQ(tree.Match(a).size(), 4u);
  // A prompt sharing two pages then diverging splits the run.
  std::vector<int32_t> b(a.begin(), a.begin() + 2 * P);
  b = Concat(b, Tokens(2 * P, 2));
  auto hit = tree.Match(b);
  ASSERT_EQ(hit.size(), 2u);
  EXPECT_EQ(hit[1], added[1]);
  auto keys_b = PageKeys(b, P, space);
  auto added_b = tree.Insert(b, keys_b, 2);
  ASSERT_EQ(added_b.size(), 2u);
  EXPECT_EQ(tree.nodes(), 3u);  // [p0 p1] -> {[a2 a3], [b2 b3]}
  EXPECT_EQ(tree.Match(a).size(), 4u);
  EXPECT_EQ(tree.Match(b).size(), 4u);
  EXPECT_EQ(added_b[0]->parent, added[1]);
  EXPECT_EQ(added[1]->tree_children, 2);
  // Shared pages have equal keys; diverged ones do not.
  EXPECT_EQ(keys_a[1], keys_b[1]);
  EXPECT_FALSE(keys_a[2] == keys_b[2]);
  // A partial page never matches.
  std::vector<int32_t> partial(a.begin(), a.begin() + 3 * P + 2);
  EXPECT_EQ(tree.Match(partial).size(), 3u);
  // Removal goes leaf first; a page with children stays.
  tree.Remove(added[1]);
  EXPECT_EQ(tree.size(), 6u);
  tree.Remove(added_b[1]);
  tree.Remove(added_b[0]);
  EXPECT_EQ(tree.Match(b).size(), 2u);
  EXPECT_EQ(tree.size(), 4u);
}

TEST(PageKeyTest, ChainedAndNamespaced) {
  auto t = Tokens(64, 3);
  KeySpace a{"model-a", "bf16", "p16-tp1"}, b{"model-b", "bf16", "p16-tp1"}, c{"model-a", "fp16", "p16-tp1"};
  auto ka = PageKeys(t, 16, a);
  EXPECT_EQ(ka.size(), 4u);
  EXPECT_EQ(ka, PageKeys(t, 16, a));  // deterministic
  EXPECT_FALSE(ka[0] == PageKeys(t, 16, b)[0]);
  EXPECT_FALSE(ka[0] == PageKeys(t, 16, c)[0]);
  auto t2 = t;
  t2[5] ^= 1;  // a change in page 0 changes every later key
  auto k2 = PageKeys(t2, 16, a);
  for (size_t i = 0; i < 4; ++i) EXPECT_FALSE(ka[i] == k2[i]);
  EXPECT_EQ(ka[0].Hex().size(), 32u);
  EXPECT_EQ(RankKey(ka[0], 1, 2), ka[0].Hex() + "-r1");
}

// Synthetic mode (pages from their keys, compute from a cost model).
EngineConfig Synthetic(size_t l1_pages = 256, size_t l2_pages = 1024) {
  EngineConfig c;
  c.synthetic = true;
  c.page_tokens = 16;
  c.l1_pages = l1_pages;
  c.l2_pages = l2_pages;
  c.tokens_per_s = 1e6;
  return c;
}


TEST(EngineTest, RestoredPrefixGivesBitIdenticalLogits) {
  for (size_t len : {150u, 201u, 333u}) {
    std::vector<int32_t> prompt = Tokens(len, static_cast<int>(len));
    // Reference: nothing cached.
    InferenceEngine fresh(SmallModel(), nullptr);
    RequestResult ref = fresh.Serve(prompt);
    ASSERT_EQ(ref.cached_tokens, 0u);

    // From L3: a second engine (empty L1/L2) sharing the store.
    InMemoryL3 store;
    InferenceEngine writer(SmallModel(), &store);
    writer.Serve(prompt);
    InferenceEngine reader(SmallModel(), &store);
    RequestResult from_l3 = reader.Serve(prompt);
    EXPECT_GT(from_l3.l3_tokens, 0u) << len;
    EXPECT_EQ(from_l3.cached_tokens, (len - 1) / 16 * 16);
    EXPECT_EQ(from_l3.logits, ref.logits) << "L3 restore, length " << len;

    // From L2: push the prompt's pages out of a small L1 with another prompt.
    EngineConfig small = SmallModel();
    small.l1_pages = 24;
    InferenceEngine l2eng(small, nullptr);
    l2eng.Serve(prompt);
    l2eng.Serve(Tokens(300, 99));
    RequestResult from_l2 = l2eng.Serve(prompt);
    EXPECT_GT(from_l2.l2_tokens, 0u) << len;
    EXPECT_EQ(from_l2.logits, ref.logits) << "L2 restore, length " << len;

    // And the logits are not trivially equal: another prompt differs.
    EXPECT_NE(fresh.Serve(Tokens(len, 12345)).logits, ref.logits);
  }
}

TEST(EngineTest, LeafFirstEvictionKeepsThePrefixInL1) {
  InferenceEngine e(Synthetic(12, 64), nullptr);
  auto a = Tokens(10 * 16 + 1, 1);
  e.Serve(a);
  e.Serve(Tokens(6 * 16 + 1, 2));  // needs 7 L1 pages: evicts a's deepest pages
  RequestResult again = e.Serve(a);
  EXPECT_EQ(again.cached_tokens, 10u * 16);
  // The front of a stayed in L1; only its tail came back from L2.
  EXPECT_GE(again.l1_tokens, 4u * 16);
  EXPECT_GT(again.l2_tokens, 0u);
  EXPECT_EQ(again.l1_tokens + again.l2_tokens, 10u * 16);
}

TEST(EngineTest, L2EvictionLeavesPagesFindableInL3) {
  InMemoryL3 store;
  InferenceEngine e(Synthetic(8, 8), &store);
  auto a = Tokens(6 * 16 + 1, 1);
  e.Serve(a);
  for (int i = 0; i < 4; ++i) e.Serve(Tokens(6 * 16 + 1, 10 + i));  // churn both tiers
  RequestResult again = e.Serve(a);
  EXPECT_EQ(again.cached_tokens, 6u * 16);
  EXPECT_GT(again.l3_tokens, 0u);
  EXPECT_GT(e.cache_stats().l2_evictions, 0u);
}

TEST(EngineTest, PagesWrittenAgainAfterTheStoreEvictedThemAreCounted) {
  InMemoryL3 store;
  InferenceEngine e(Synthetic(8, 8), &store);
  auto a = Tokens(6 * 16 + 1, 1);
  e.Serve(a);
  for (int i = 0; i < 4; ++i) e.Serve(Tokens(6 * 16 + 1, 10 + i));  // a leaves L1 and L2
  EXPECT_EQ(e.cache_stats().l3_reput_pages, 0u);
  // The store evicts a's last three pages; serving a again writes them again.
  std::vector<PageKey> keys = PageKeys(absl::MakeConstSpan(a).subspan(0, 6 * 16), 16, e.key_space());
  for (size_t i = 3; i < 6; ++i) store.Drop(RankKey(keys[i], 0, 1));
  RequestResult again = e.Serve(a);
  EXPECT_EQ(again.l3_tokens, 3u * 16);
  EXPECT_EQ(e.cache_stats().l3_reput_pages, 3u);
  EXPECT_EQ(e.cache_stats().l3_reput_bytes, 3u * e.cache().config().page_bytes);
}

TEST(EngineTest, WritePolicies) {
  auto a = Tokens(4 * 16 + 1, 5);
  EngineConfig c = Synthetic();
  {
    InMemoryL3 store;
    c.write = WritePolicy::kWriteThrough;
    InferenceEngine e(c, &store);
    e.Serve(a);
    EXPECT_EQ(store.size(), 4u);
  }
  {
    InMemoryL3 store;
    c.write = WritePolicy::kWriteThroughSelective;
    c.selective_hits = 2;
    InferenceEngine e(c, &store);
    e.Serve(a);
    EXPECT_EQ(store.size(), 0u);
    e.Serve(a);
    EXPECT_EQ(store.size(), 0u);  // one hit so far
    e.Serve(a);
    EXPECT_EQ(store.size(), 4u);  // second hit: offloaded
  }
  {
    InMemoryL3 store;
    c.write = WritePolicy::kWriteBack;
    c.l1_pages = 6;
    c.l2_pages = 6;
    InferenceEngine e(c, &store);
    e.Serve(a);
    EXPECT_EQ(store.size(), 0u);
    e.Serve(Tokens(4 * 16 + 1, 6));  // pushes a's pages out of L2
    EXPECT_GT(store.size(), 0u);
  }
}

TEST(EngineTest, PrefetchPoliciesAreBoundedAndAnUnavailableStoreMeansRecompute) {
  auto a = Tokens(8 * 16 + 1, 7);
  for (PrefetchPolicy p : {PrefetchPolicy::kBestEffort, PrefetchPolicy::kWaitComplete, PrefetchPolicy::kTimeout}) {
    InMemoryL3 store;
    EngineConfig c = Synthetic();
    c.prefetch = p;
    InferenceEngine writer(c, &store);
    writer.Serve(a);
    InferenceEngine reader(c, &store);
    RequestResult r = reader.Serve(a);
    EXPECT_EQ(r.l3_tokens, 8u * 16);
    store.SetUnavailable(true);
    InferenceEngine cold(c, &store);
    RequestResult miss = cold.Serve(a);
    EXPECT_EQ(miss.cached_tokens, 0u);  // recomputed, not failed
    EXPECT_TRUE(miss.store_error);
  }
}

// Against a slow store (20 ms a page, 8 pages): wait_complete waits for all
// of it; timeout stops at its bound with the pages that arrived by then;
// best_effort waits only as long as recomputing would take (8 pages at a
// million tokens/s: well under a page's time), so it takes none.
TEST(EngineTest, PrefetchFromASlowStoreStopsAtEachPolicysBound) {
  auto a = Tokens(8 * 16 + 1, 11);
  struct Case {
    PrefetchPolicy policy;
    size_t pages;         // that arrive in time
    double max_fetch_s;   // the policy's bound, with room for a loaded machine
  };
  for (const Case& k : {Case{PrefetchPolicy::kWaitComplete, 8, 10.0}, Case{PrefetchPolicy::kTimeout, 2, 0.045 + 0.5},
                        Case{PrefetchPolicy::kBestEffort, 0, 0.001 + 0.5}}) {
    InMemoryL3 store;
    EngineConfig c = Synthetic();
    c.prefetch = k.policy;
    c.prefetch_timeout = absl::Milliseconds(45);
    InferenceEngine writer(c, &store);
    writer.Serve(a);
    store.SetLatency(absl::Milliseconds(20));
    InferenceEngine reader(c, &store);
    RequestResult r = reader.Serve(a);
    EXPECT_EQ(r.l3_tokens, k.pages * 16) << static_cast<int>(k.policy);
    EXPECT_LT(r.fetch_s, k.max_fetch_s) << static_cast<int>(k.policy);
    if (k.policy == PrefetchPolicy::kWaitComplete) {
      EXPECT_GE(r.fetch_s, 0.16);
    }
    if (k.policy == PrefetchPolicy::kTimeout) {
      EXPECT_GE(r.fetch_s, 0.04);
    }
    EXPECT_EQ(r.corrupt_pages, 0u);
  }
}

// A store whose pages vanish between PrefixMatch and the read (evicted, or
// a lease that ran out): the engine's "lost".
class VanishingL3 final : public L3Store {
 public:
  explicit VanishingL3(InMemoryL3* inner) : inner_(inner) {}
  absl::StatusOr<size_t> PrefixMatch(const std::vector<std::string>& keys) override {
    absl::StatusOr<size_t> n = inner_->PrefixMatch(keys);
    if (n.ok() && *n > 1) inner_->Drop(keys[1]);
    return n;
  }
  std::vector<absl::Status> Get(const std::vector<std::string>& keys, const std::vector<absl::Span<char>>& outs,
                                absl::Duration timeout) override {
    return inner_->Get(keys, outs, timeout);
  }
  std::vector<absl::Status> Put(const std::vector<L3Put>& items) override { return inner_->Put(items); }

 private:
  InMemoryL3* inner_;
};

// Token counters per tier and why each lookup's prefix ended, in the
// engine's /metrics: tokens asked of the cache, hit per tier, and the
// reason (complete, first_miss, lost, timeout, store_error).
TEST(EngineTest, LookupsCountTokensAndWhyThePrefixEnded) {
  auto a = Tokens(8 * 16 + 1, 21);
  InMemoryL3 store;
  EngineConfig c = Synthetic();
  c.prefetch = PrefetchPolicy::kTimeout;
  c.prefetch_timeout = absl::Milliseconds(45);
  InferenceEngine writer(c, &store);
  writer.Serve(a);
  InferenceEngine reader(c, &store);
  RequestResult r = reader.Serve(a);
  EXPECT_EQ(r.lookup_tokens, 8u * 16);
  EXPECT_EQ(r.l3_tokens, 8u * 16);
  EXPECT_EQ(r.stop, StopReason::kComplete);
  // Four more pages than anyone stored: the first miss ends it.
  RequestResult longer = reader.Serve(Concat(std::vector<int32_t>(a.begin(), a.end() - 1), Tokens(4 * 16 + 1, 22)));
  EXPECT_EQ(longer.lookup_tokens, 12u * 16);
  EXPECT_EQ(longer.l1_tokens, 8u * 16);
  EXPECT_EQ(longer.stop, StopReason::kFirstMiss);
  {
    VanishingL3 vanishing(&store);
    InferenceEngine e(c, &vanishing);
    RequestResult lost = e.Serve(a);
    EXPECT_EQ(lost.l3_tokens, 1u * 16);
    EXPECT_EQ(lost.stop, StopReason::kLost);
  }
  {
    InMemoryL3 slow;
    InferenceEngine w(c, &slow);
    w.Serve(a);
    slow.SetLatency(absl::Milliseconds(20));
    InferenceEngine e(c, &slow);
    RequestResult late = e.Serve(a);
    EXPECT_LT(late.l3_tokens, 8u * 16);
    EXPECT_EQ(late.stop, StopReason::kTimeout);
    slow.SetUnavailable(true);
    InferenceEngine cold(c, &slow);
    EXPECT_EQ(cold.Serve(a).stop, StopReason::kStoreError);
  }
  std::string m = reader.metrics().Serialize();
  EXPECT_THAT(m, ::testing::HasSubstr("tierkv_engine_lookup_tokens_total 320"));
  EXPECT_THAT(m, ::testing::HasSubstr(R"(tierkv_engine_lookup_stops_total{reason="complete"} 1)"));
  EXPECT_THAT(m, ::testing::HasSubstr(R"(tierkv_engine_lookup_stops_total{reason="first_miss"} 1)"));
  EXPECT_THAT(m, ::testing::HasSubstr(R"(tierkv_engine_lookup_stops_total{reason="lost"} 0)"));
  EXPECT_THAT(m, ::testing::HasSubstr(R"(tierkv_engine_hit_tokens_total{tier="l3"} 128)"));
  EXPECT_THAT(m, ::testing::HasSubstr(R"(tierkv_engine_hit_tokens_total{tier="l1"} 128)"));
  EXPECT_EQ(reader.cache_stats().stops[static_cast<int>(StopReason::kFirstMiss)], 1u);
  EXPECT_EQ(reader.cache_stats().lookup_pages, 20u);
}

TEST(EngineTest, TensorParallelPagesAreOneKeyPerRank) {
  InMemoryL3 store;
  EngineConfig c = SmallModel();
  c.tp = 2;
  InferenceEngine e(c, &store);
  auto a = Tokens(3 * 16 + 1, 8);
  RequestResult first = e.Serve(a);
  EXPECT_EQ(store.size(), 6u);  // 3 pages x 2 ranks
  InferenceEngine other(c, &store);
  RequestResult second = other.Serve(a);
  EXPECT_EQ(second.l3_tokens, 3u * 16);
  EXPECT_EQ(second.logits, first.logits);
  // A page missing one rank is not a hit.
  auto keys = PageKeys(a, 16, other.key_space());
  store.Drop(RankKey(keys[1], 1, 2));
  InferenceEngine third(c, &store);
  EXPECT_EQ(third.Serve(a).l3_tokens, 1u * 16);
}

// A device whose L1 the host cannot touch, like a GPU's: L1 addresses
// point into PROT_NONE reservations, and the device works on a shadow copy
// behind them. Any direct host access to an L1 page faults the test. It
// logs the order of operations, and can be told to fail.
class ShadowDevice final : public Device {
 public:
  ~ShadowDevice() override {
    for (auto& [base, a] : allocs_) {
      munmap(base, a.bytes);
      munmap(a.shadow, a.bytes);
    }
  }
  std::string name() const override { return "shadow"; }
  bool host_addressable() const override { return false; }
  absl::StatusOr<char*> Allocate(size_t bytes) override {
    void* r = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    void* s = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED || s == MAP_FAILED) return absl::ResourceExhaustedError("mmap");
    allocs_[static_cast<char*>(r)] = {static_cast<char*>(s), bytes};
    return static_cast<char*>(r);
  }
  void Free(char* p, size_t) override {
    auto it = allocs_.find(p);
    ASSERT_NE(it, allocs_.end());
    munmap(p, it->second.bytes);
    munmap(it->second.shadow, it->second.bytes);
    allocs_.erase(it);
  }
  absl::Status RegisterHost(char* p, size_t bytes) override {
    registered_.emplace_back(p, bytes);
    return absl::OkStatus();
  }
  void UnregisterHost(char*) override {}
  absl::Status CopyIn(char* l1, const char* host, size_t bytes) override {
    log_ += 'I';
    EXPECT_EQ(Translate(host), nullptr) << "a copy in from L1";
    std::memcpy(Need(l1), host, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyOut(char* host, const char* l1, size_t bytes) override {
    log_ += 'O';
    EXPECT_EQ(Translate(host), nullptr) << "a copy out to L1";
    if (!Registered(host)) ++unregistered_copy_outs_;
    std::memcpy(host, Need(l1), bytes);
    return absl::OkStatus();
  }
  absl::Status Attention(const AttentionChunk& c) override {
    log_ += 'A';
    if (fail_attention_ > 0 && --fail_attention_ == 0) return absl::UnavailableError("shadow: injected failure");
    std::vector<char*> pages;
    for (char* p : *c.pages) pages.push_back(Need(p));
    AttentionChunk shadow = c;
    shadow.pages = &pages;
    HostAttention(shadow);
    if (corrupt_) c.out[c.tokens * c.heads * c.layout->head_dim - 1] += 0.01f;
    return absl::OkStatus();
  }
  absl::Status Sync() override {
    log_ += 'S';
    return absl::OkStatus();
  }

  std::string TakeLog() { return std::exchange(log_, ""); }
  // Copies out to host memory that was not registered (pinned).
  size_t unregistered_copy_outs() const { return unregistered_copy_outs_; }
  void FailAttention(int nth) { fail_attention_ = nth; }
  // Every attention output's last element comes out slightly wrong.
  void Corrupt() { corrupt_ = true; }

 private:
  struct Alloc {
    char* shadow;
    size_t bytes;
  };
  char* Translate(const char* p) {
    auto it = allocs_.upper_bound(const_cast<char*>(p));
    if (it == allocs_.begin()) return nullptr;
    --it;
    if (p >= it->first + it->second.bytes) return nullptr;
    return it->second.shadow + (p - it->first);
  }
  char* Need(const char* l1) {
    char* t = Translate(l1);
    EXPECT_NE(t, nullptr) << "not an L1 address";
    return t;
  }
  bool Registered(const char* p) const {
    for (auto [base, bytes] : registered_) {
      if (p >= base && p < base + bytes) return true;
    }
    return false;
  }
  std::map<char*, Alloc> allocs_;
  std::vector<std::pair<char*, size_t>> registered_;
  std::string log_;
  int fail_attention_ = 0;
  bool corrupt_ = false;
  size_t unregistered_copy_outs_ = 0;
};

EngineConfig OnDevice(EngineConfig c, std::shared_ptr<Device> d) {
  c.device = std::move(d);
  return c;
}

TEST(EngineDeviceTest, L1OnADeviceTheHostCannotReadGivesTheSameLogits) {
  auto shadow = std::make_shared<ShadowDevice>();
  for (size_t len : {150u, 333u}) {
    std::vector<int32_t> prompt = Tokens(len, static_cast<int>(len));
    InferenceEngine host(SmallModel(), nullptr);
    RequestResult ref = host.Serve(prompt);
    // Computed on the device, restored from L3 into it, and from L2.
    InMemoryL3 store;
    InferenceEngine writer(OnDevice(SmallModel(), shadow), &store);
    RequestResult computed = writer.Serve(prompt);
    ASSERT_TRUE(computed.status.ok()) << computed.status;
    EXPECT_EQ(computed.logits, ref.logits);
    InferenceEngine reader(OnDevice(SmallModel(), shadow), &store);
    RequestResult from_l3 = reader.Serve(prompt);
    EXPECT_EQ(from_l3.cached_tokens, (len - 1) / 16 * 16);
    EXPECT_EQ(from_l3.logits, ref.logits) << "L3 restore, length " << len;
    EngineConfig small = OnDevice(SmallModel(), shadow);
    small.l1_pages = 24;
    InferenceEngine l2eng(small, nullptr);
    l2eng.Serve(prompt);
    l2eng.Serve(Tokens(300, 99));
    RequestResult from_l2 = l2eng.Serve(prompt);
    EXPECT_GT(from_l2.l2_tokens, 0u);
    EXPECT_EQ(from_l2.logits, ref.logits) << "L2 restore, length " << len;
  }
}

TEST(EngineDeviceTest, RestoresAreOneBatchIssuedBeforeComputeAndStoresOneSync) {
  auto shadow = std::make_shared<ShadowDevice>();
  InMemoryL3 store;
  EngineConfig c = OnDevice(SmallModel(), shadow);
  InferenceEngine writer(OnDevice(SmallModel(), std::make_shared<ShadowDevice>()), &store);
  auto prompt = Tokens(8 * 16 + 1, 3);  // 8 whole pages, the last token's page computed
  writer.Serve(prompt);
  InferenceEngine reader(c, &store);
  shadow->TakeLog();
  RequestResult r = reader.Serve(prompt);
  ASSERT_EQ(r.l3_tokens, 8u * 16);
  // 8 pages copied up with no wait between them or before the first
  // attention (the host computes layer 0's projections meanwhile); one
  // chunk of 2 layers; Commit's sync (the partial last page is not
  // cached, so nothing is copied out); the end-of-request sync.
  EXPECT_EQ(shadow->TakeLog(), "IIIIIIII" "AA" "S" "S");
  EXPECT_EQ(reader.cache_stats().l1_loads, 8u);
  EXPECT_EQ(reader.cache_stats().l1_stores, 0u);
  // A fresh prompt of 3 whole pages: 3 chunks x 2 layers, 3 pages stored
  // to L2 as one batch and one sync.
  r = reader.Serve(Tokens(3 * 16, 4));
  EXPECT_EQ(shadow->TakeLog(), "AAAAAA" "OOO" "S" "S");
  EXPECT_EQ(reader.cache_stats().l1_stores, 3u);
  // They landed in the L2 pool, which the cache registered for DMA.
  EXPECT_EQ(shadow->unregistered_copy_outs(), 0u);
  // Operators see the same counts, and where L1 lives.
  std::string m = reader.metrics().Serialize();
  EXPECT_NE(m.find("tierkv_engine_page_copies_total{direction=\"l2_to_l1\"} 8\n"), std::string::npos) << m;
  EXPECT_NE(m.find("tierkv_engine_page_copies_total{direction=\"l1_to_l2\"} 3\n"), std::string::npos) << m;
  EXPECT_NE(m.find("tierkv_engine_l1_device{device=\"shadow\"} 1\n"), std::string::npos) << m;
}

TEST(EngineDeviceTest, SyntheticPagesAreStagedIntoTheDevice) {
  auto shadow = std::make_shared<ShadowDevice>();
  InMemoryL3 store;
  EngineConfig c = OnDevice(Synthetic(8, 16), shadow);
  InferenceEngine e(c, &store);
  auto a = Tokens(6 * 16 + 1, 1);
  ASSERT_TRUE(e.Serve(a).status.ok());
  // Every page went through the device and back to L2, and the store
  // verifies them on the way back in (the synthetic content check).
  InferenceEngine other(c, &store);
  RequestResult r = other.Serve(a);
  EXPECT_EQ(r.l3_tokens, 6u * 16);
  EXPECT_EQ(other.cache_stats().l3_errors, 0u);
}

TEST(EngineDeviceTest, ADeviceFailureFailsTheRequestAndCachesNothing) {
  auto shadow = std::make_shared<ShadowDevice>();
  InMemoryL3 store;
  InferenceEngine e(OnDevice(SmallModel(), shadow), &store);
  auto a = Tokens(5 * 16 + 1, 21);
  shadow->FailAttention(3);  // the second chunk's first layer
  RequestResult failed = e.Serve(a);
  EXPECT_EQ(failed.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(failed.status.message().find("injected"), std::string::npos) << failed.status;
  EXPECT_TRUE(failed.logits.empty());
  EXPECT_EQ(store.size(), 0u);
  EXPECT_NE(e.metrics().Serialize().find("tierkv_engine_failed_requests_total 1\n"), std::string::npos);
  EXPECT_EQ(e.cache().tree_pages(), 0u);
  EXPECT_EQ(e.cache().l1_used(), 0u);
  // The engine goes on serving, and computes the prompt from scratch.
  RequestResult again = e.Serve(a);
  ASSERT_TRUE(again.status.ok()) << again.status;
  EXPECT_EQ(again.cached_tokens, 0u);
  InferenceEngine host(SmallModel(), nullptr);
  EXPECT_EQ(again.logits, host.Serve(a).logits);
}

TEST(EngineDeviceTest, TheSelfCheckCatchesADeviceThatComputesWrongOrFails) {
  EXPECT_OK(CheckDevice(*NewCpuDevice()));
  ShadowDevice good;
  EXPECT_OK(CheckDevice(good));
  ShadowDevice wrong;
  wrong.Corrupt();
  absl::Status s = CheckDevice(wrong);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("attention output"), std::string::npos) << s;
  ShadowDevice failing;
  failing.FailAttention(1);
  s = CheckDevice(failing);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("injected"), std::string::npos) << s;
}

TEST(EngineDeviceTest, DeviceNames) {
  EXPECT_EQ(NewDevice("cpu").value()->name(), "cpu");
  EXPECT_EQ(NewDevice("gpu0").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NewDevice("cuda:x").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<Device>> gpu = NewDevice("cuda:0");
  absl::StatusOr<std::unique_ptr<Device>> any = NewDevice("auto");
  ASSERT_TRUE(any.ok()) << any.status();
  if (gpu.ok()) {
    EXPECT_EQ((*any)->name(), "cuda:0");
  } else {
    // No GPU here: the reason is given, and auto keeps L1 in host memory.
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_FALSE(gpu.status().message().empty());
    EXPECT_EQ((*any)->name(), "cpu");
    std::cout << "no GPU L1 here: " << gpu.status().message() << "\n";
  }
}

// The CUDA kernels' arithmetic (engine/cuda/warp_math.h), run lane by lane
// on the host: the same indexing, strides and butterflies as on a GPU,
// checked against the reference here, where no GPU exists.
TEST(GpuKernelLogicTest, WarpEmulationMatchesTheHostReference) {
  struct Case {
    int tp, head_dim;
    size_t begin;
    int n;
  };
  for (Case k : {Case{1, 32, 0, 16}, Case{2, 32, 32, 11}, Case{1, 64, 96, 16}, Case{2, 16, 48, 5}}) {
    KvLayout layout{2, 2, k.head_dim, 16, k.tp};
    const size_t pb = layout.PageBytes();
    const int heads = 4;
    const size_t npages = (k.begin + k.n - 1) / 16 + 1;
    uint64_t x = k.begin * 31 + k.head_dim;
    auto next = [&x] {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) / (1 << 23);
    };
    std::vector<char> host(npages * pb, 0);
    for (size_t i = 0; i < k.begin * pb / 16 / 2; ++i) reinterpret_cast<uint16_t*>(host.data())[i] = ToBf16(next());
    std::vector<char> emulated = host;
    std::vector<char*> host_pages, emu_pages;
    for (size_t i = 0; i < npages; ++i) {
      host_pages.push_back(host.data() + i * pb);
      emu_pages.push_back(emulated.data() + i * pb);
    }
    std::vector<float> q(k.n * heads * k.head_dim), kk(k.n * 2 * k.head_dim), vv(kk.size());
    for (auto* vec : {&q, &kk, &vv}) {
      for (float& f : *vec) f = 2 * next();
    }
    const cuda::KernelLayout kl = layout.kernel();
    const float scale = 1.f / std::sqrt(static_cast<float>(k.head_dim));
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<float> want(q.size()), got(q.size(), NAN), scores(k.n * heads * (k.begin + k.n));
      HostAttention({&layout, layer, k.begin, k.n, heads, q.data(), kk.data(), vv.data(), &host_pages, want.data()});
      cuda::EmulateWriteKv(kl, layer, k.begin, k.n, kk.data(), vv.data(), emu_pages.data());
      cuda::EmulateAttention(kl, layer, k.begin, k.n, heads, scale, q.data(), emu_pages.data(), scores.data(),
                             got.data());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 1e-5f * (1 + std::fabs(want[i])))
            << "tp " << k.tp << " head_dim " << k.head_dim << " begin " << k.begin << " layer " << layer << " at " << i;
      }
    }
    // The pages hold the same bytes: K/V written where the CPU writes them.
    EXPECT_EQ(std::memcmp(host.data(), emulated.data(), host.size()), 0) << "tp " << k.tp << " begin " << k.begin;
  }
}

TEST(TraceTest, ParsesLinesAndMapsBlocksToTokens) {
  auto r = ParseTraceLine(R"({"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [1, 2]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->hash_ids.size(), 2u);
  auto t = PromptTokens(*r, 512);
  EXPECT_EQ(t.size(), 1000u);
  TraceRequest other = *r;
  other.hash_ids = {1, 3};
  auto t2 = PromptTokens(other, 512);
  EXPECT_TRUE(std::equal(t.begin(), t.begin() + 512, t2.begin()));
  EXPECT_FALSE(std::equal(t.begin() + 512, t.end(), t2.begin() + 512));
  for (const char* bad : {"", "[]", "{\"input_length\": -1, \"hash_ids\": []}",
                          "{\"input_length\": 2000, \"hash_ids\": [1]}", "{\"input_length\": 5}",
                          "{\"input_length\": 5, \"hash_ids\": [\"x\"]}"}) {
    EXPECT_FALSE(ParseTraceLine(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace tierkv::engine
