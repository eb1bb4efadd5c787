#include "engine/eviction_sim.h"

#include "tests/support/status_matchers.h"

namespace tierkv::engine {
namespace {

using ::tierkv::testing::StatusIs;

// One 512-token page per hash id: `ids` whole pages, all of which may hit
// (a partial trailing block holds the last token).
TraceRequest Pages(std::vector<int64_t> ids) {
  TraceRequest r;
  r.input_length = static_cast<int64_t>(ids.size()) * kTraceBlockTokens + 1;
  ids.push_back(1000000 + static_cast<int64_t>(ids.size()) * 7919 + ids.front());
  r.hash_ids = std::move(ids);
  return r;
}

TEST(EvictionSimTest, BuildsPagesWithParents) {
  PageTrace t = BuildPageTrace({Pages({1, 2}), Pages({1, 3}), Pages({1, 2})}, kTraceBlockTokens);
  ASSERT_EQ(t.unique_pages, 3u);  // 1, 1-2, 1-3
  EXPECT_EQ(t.parent[0], -1);
  EXPECT_EQ(t.parent[1], 0);
  EXPECT_EQ(t.parent[2], 0);
  ASSERT_EQ(t.requests.size(), 3u);
  EXPECT_EQ(t.requests[2].usable, 2u);
  EXPECT_EQ(t.pages[t.requests[2].first + 1], 1u);
}

// A chain read long ago (A-B) and then left alone must go before a page
// put since (E). The first prefix-aware CLOCK got this wrong: when B left,
// A rejoined the candidates with the reference bit of its old read and
// was sent round again, so E was evicted in its place.
TEST(EvictionSimTest, AParentRejoinsWithItsChainsRecency) {
  std::vector<TraceRequest> trace = {Pages({1, 2}), Pages({1, 2}), Pages({3}), Pages({4}),
                                     Pages({5}),    Pages({6}),    Pages({7}), Pages({5})};
  PageTrace t = BuildPageTrace(trace, kTraceBlockTokens);
  const uint64_t reread = 2 * kTraceBlockTokens;  // request 2 hits A and B
  for (const std::string& p : {"leaf-lru", "chain", "lru", "belady"}) {
    auto r = Simulate(t, p, 3);
    ASSERT_TRUE(r.ok()) << p;
    EXPECT_EQ(r->hit_tokens, reread + kTraceBlockTokens) << p << " keeps E";
  }
  auto prefix = Simulate(t, "prefix", 3);
  ASSERT_TRUE(prefix.ok());
  EXPECT_EQ(prefix->hit_tokens, reread) << "the stale reference bit evicts E";
}

// Multi-turn chat in miniature: conversation A (pages 1, 1-2) begins, then
// B (3); A continues (reads both, puts 1-2-4); C and D begin; B continues.
// A continuation chooses by when a conversation began, so B, the younger,
// is the better keep. Under `inherit` A's new page takes the place of the
// leaf it extends, so all of A goes before B; every order that lets the
// read refresh A (lru, clock, chain, leaf-lru) evicts B instead.
TEST(EvictionSimTest, AnExtendedChainKeepsThePlaceOfItsFirstPut) {
  std::vector<TraceRequest> trace = {Pages({1, 2}), Pages({3}), Pages({1, 2, 4}),
                                     Pages({5}),    Pages({6}), Pages({3})};
  PageTrace t = BuildPageTrace(trace, kTraceBlockTokens);
  const uint64_t continued = 2 * kTraceBlockTokens;  // request 3 hits 1 and 1-2
  for (const std::string& p : {"inherit", "birth", "belady"}) {
    auto r = Simulate(t, p, 4);
    ASSERT_TRUE(r.ok()) << p;
    EXPECT_EQ(r->hit_tokens, continued + kTraceBlockTokens) << p << " keeps B";
  }
  for (const std::string& p : {"lru", "clock", "chain", "leaf-lru"}) {
    auto r = Simulate(t, p, 4);
    ASSERT_TRUE(r.ok()) << p;
    EXPECT_EQ(r->hit_tokens, continued) << p << " keeps the refreshed A and evicts B";
  }
}

TEST(EvictionSimTest, BeladyBoundsEveryPolicyAndRoomForAllIsTheBound) {
  auto trace = ReadTrace("data/multiturn_trace.jsonl", 0, 1500);
  ASSERT_TRUE(trace.ok()) << trace.status();
  PageTrace t = BuildPageTrace(*trace, 64);
  for (double share : {0.05, 0.2}) {
    size_t cap = static_cast<size_t>(share * t.unique_pages);
    auto best = Simulate(t, "belady", cap);
    ASSERT_TRUE(best.ok());
    for (const std::string& p : SimPolicies()) {
      auto r = Simulate(t, p, cap);
      ASSERT_TRUE(r.ok()) << p;
      EXPECT_LE(r->hit_tokens, best->hit_tokens) << p << " at " << share;
      EXPECT_LE(r->reputs, r->evictions) << p;
    }
  }
  auto all = Simulate(t, "lru", t.unique_pages);
  auto min = Simulate(t, "belady", t.unique_pages);
  ASSERT_TRUE(all.ok() && min.ok());
  EXPECT_EQ(all->evictions, 0u);
  EXPECT_EQ(all->puts, t.unique_pages);
  EXPECT_EQ(all->hit_tokens, min->hit_tokens);
}

TEST(EvictionSimTest, CapacitiesAndPoliciesAreChecked) {
  auto caps = ParseCapacities("0.05, 0.1,0.5");
  ASSERT_TRUE(caps.ok());
  EXPECT_EQ(*caps, (std::vector<double>{0.05, 0.1, 0.5}));
  EXPECT_THAT(ParseCapacities("0.1,x").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseCapacities("0").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseCapacities("").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  PageTrace t = BuildPageTrace({Pages({1})}, kTraceBlockTokens);
  EXPECT_THAT(Simulate(t, "fifo", 1).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace tierkv::engine
