// Eviction: LRU order across shards, leased and pinned objects last,
// prefix-aware policies, and the background evictor (headroom off the
// request path, back-off, the inline last resort, concurrent puts).
#include "tests/unit/object_index_fixture.h"

#include <future>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "tests/support/wait.h"

namespace tierkv::master {
namespace {

using ::tierkv::testing::StatusIs;
using ::tierkv::testing::StaysFalse;
using ::tierkv::testing::WaitFor;

TEST_F(IndexTest, EvictsLeastRecentlyUsedAboveHighWatermark) {
  // 100 pages of 1 KiB; the watermarks 95 %/90 %.
  Mount("seg-a", 100 * 1024);
  for (int i = 0; i < 95; ++i) {
    ASSERT_OK(Put(absl::StrCat("k", i), 1024));
    clock_.Advance(absl::Seconds(1));
  }
  // Touch the oldest ten: they become most recent.
  std::vector<std::string> touched;
  for (int i = 0; i < 10; ++i) touched.push_back(absl::StrCat("k", i));
  index_->GetReplicas(touched);
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  ASSERT_OK(Put("trigger", 1024));  // 96 % > 95 %: evict down to 90 %
  EXPECT_LE(registry_->used(), 90u * 1024);
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(Present(absl::StrCat("k", i))) << i;
  for (int i = 10; i < 16; ++i) EXPECT_FALSE(Present(absl::StrCat("k", i))) << i;
  EXPECT_TRUE(Present("k20"));
  EXPECT_TRUE(Present("trigger"));
  EXPECT_GT(index_->Stats().evictions, 0u);
  EXPECT_OK(index_->CheckInvariants());
}

// Puts 20 ms apart, all within one second and spread over the index's
// shards: eviction takes them oldest first across shards, not round-robin
// among equals (as with the one-second ticks the index had).
TEST_F(IndexTest, EvictionOrdersPutsWithinOneSecondAcrossShards) {
  Mount("seg-a", 100 * 1024);
  for (int i = 0; i < 40; ++i) {
    ASSERT_OK(Put(absl::StrCat("k", i), 1024));
    clock_.Advance(absl::Milliseconds(20));
  }
  clock_.Advance(options_.lease_ttl);  // the puts' leases end, the ticks stay apart
  for (int evicted = 1; evicted <= 10; ++evicted) {
    index_->EvictTo(registry_->used() - 1024);
    for (int i = 0; i < 40; ++i) {
      EXPECT_EQ(Present(absl::StrCat("k", i)), i >= evicted) << "after " << evicted << " evictions, k" << i;
    }
  }
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, LeasedAndPinnedObjectsGoLast) {
  Mount("seg-a", 20 * 1024);  // headroom: no watermark eviction while filling
  ASSERT_OK(Put("pinned", 1024, {.soft_pin = true}));
  ASSERT_OK(Put("leased", 1024));
  for (int i = 0; i < 8; ++i) ASSERT_OK(Put(absl::StrCat("k", i), 1024));
  clock_.Advance(absl::Seconds(10));
  index_->GetReplicas({"leased"});  // a live lease
  // Ask for nearly everything back.
  index_->EvictTo(1024);
  EXPECT_TRUE(Present("leased"));   // leased objects are never evicted
  EXPECT_FALSE(Present("pinned"));  // pinned goes, but only after all unpinned ones
  for (int i = 0; i < 8; ++i) EXPECT_FALSE(Present(absl::StrCat("k", i)));
  // A pinned object survives while unpinned candidates remain.
  clock_.Advance(options_.lease_ttl);
  ASSERT_OK(Put("pin2", 1024, {.soft_pin = true}));
  ASSERT_OK(Put("plain", 1024));
  clock_.Advance(absl::Seconds(10));
  index_->EvictTo(1024);
  EXPECT_TRUE(Present("pin2"));
  EXPECT_FALSE(Present("plain"));
  EXPECT_FALSE(Present("leased"));
  EXPECT_OK(index_->CheckInvariants());
}

// Soft-pinned objects wait for every unpinned one that can go, however
// many leased ones sit ahead of it at the tails of the lists.
TEST_F(IndexTest, APinnedObjectOutlastsAnUnpinnedOneBehindManyLeasedOnes) {
  Mount("seg-a", 32 << 20);  // headroom: no watermark eviction while filling
  ASSERT_OK(Put("pinned", 1024, {.soft_pin = true}));
  ASSERT_OK(Put("victim", 1024));
  // Far more leased objects than the evictor looks at in the rounds it
  // allows itself without progress (32 per round, two rounds per shard).
  const int leased = 8 * 32 * 2 * options_.shards;
  for (int i = 0; i < leased; ++i) ASSERT_OK(Put(absl::StrCat("leased", i), 1024));
  clock_.Advance(absl::Seconds(1));
  for (int i = 0; i < leased; ++i) ASSERT_OK(index_->GetReplicas({absl::StrCat("leased", i)})[0].status);
  clock_.Advance(absl::Seconds(1));
  ASSERT_OK(Put("plain", 1024));  // newer than every leased object's last read
  // The first pass spends the leased objects' second chance and takes the victim.
  index_->EvictTo(registry_->used() - 1024);
  ASSERT_FALSE(Present("victim"));
  // Now the leased objects are the oldest, unreferenced, and cannot go:
  // the plain one must, not the pinned one.
  index_->EvictTo(registry_->used() - 1024);
  EXPECT_FALSE(Present("plain"));
  EXPECT_TRUE(Present("pinned"));
  for (int i = 0; i < leased; ++i) ASSERT_TRUE(Present(absl::StrCat("leased", i))) << i;
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, HardPinnedObjectsAreNeverEvictedAndSurviveARestart) {
  Mount("seg-a", 8 * 1024);
  ASSERT_OK(Put("hard", 1024, {.hard_pin = true}));
  ASSERT_OK(Put("soft", 1024, {.soft_pin = true}));
  for (int i = 0; i < 4; ++i) ASSERT_OK(Put(absl::StrCat("k", i), 1024));
  clock_.Advance(absl::Seconds(10));
  index_->EvictTo(0);  // everything that may go, goes
  EXPECT_TRUE(Present("hard"));
  EXPECT_FALSE(Present("soft"));
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(Present(absl::StrCat("k", i)));
  EXPECT_TRUE(index_->Describe("hard")->hard_pin);
  EXPECT_EQ(index_->Stats().pinned, 1u);
  // Filled with hard pins, the store refuses a put rather than evict one.
  for (int i = 0; i < 6; ++i) ASSERT_OK(Put(absl::StrCat("h", i), 1024, {.hard_pin = true}));
  EXPECT_THAT(Put("more", 2048), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_OK(index_->CheckInvariants());

  // The pin is persisted: a restarted index keeps it out of eviction too.
  std::unique_ptr<ObjectIndex> old_index = std::move(index_);
  std::unique_ptr<SegmentRegistry> old_registry = std::move(registry_);
  registry_ = std::make_unique<SegmentRegistry>();
  registry_->Recover({"seg-a", "seg-a", 8 * 1024, "inc", ""}, clock_.Now());
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  ASSERT_OK(index_->Recover().status());
  Mount("seg-a", 8 * 1024);
  clock_.Advance(absl::Seconds(10));
  index_->EvictTo(0);
  EXPECT_TRUE(Present("hard"));
  EXPECT_TRUE(index_->Describe("hard")->hard_pin);
  EXPECT_EQ(index_->Stats().pinned, 7u);
  // Remove still takes it out.
  EXPECT_OK(index_->Remove({"hard"}, false)[0]);
  EXPECT_FALSE(Present("hard"));
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, NoLiveSegmentIsUnavailableAndEvictsNothing) {
  // A restarted master: the segment is known but awaits its daemon's re-mount.
  registry_->Recover({"seg-a", "seg-a", 1 << 20, "inc", ""}, clock_.Now());
  EXPECT_THAT(index_->PutStart({{"k", 4096}})[0].status, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(index_->Stats().evictions, 0u);
}

TEST_F(IndexTest, PrefixAwareEvictionTakesLeavesBeforeAncestors) {
  Mount("seg-a", 64 * 1024);
  // Chain c0 <- c1 <- c2 <- c3, written oldest first, so plain LRU would
  // evict c0 first and strand c1..c3.
  std::string parent;
  for (int i = 0; i < 4; ++i) {
    std::string key = absl::StrCat("c", i);
    ASSERT_OK(Put(key, 1024, {.parent_key = parent}));
    parent = key;
    clock_.Advance(absl::Seconds(1));
  }
  ASSERT_OK(Put("young-leaf", 1024));
  EXPECT_EQ(index_->Describe("c0")->children, 1u);
  EXPECT_EQ(index_->Describe("c3")->children, 0u);
  uint64_t used = registry_->used();
  index_->EvictTo(used - 1024);  // one object
  EXPECT_FALSE(Present("c3"));   // the deepest leaf, though c0 is older
  EXPECT_TRUE(Present("c0") && Present("c1") && Present("c2") && Present("young-leaf"));
  index_->EvictTo(used - 3 * 1024);
  EXPECT_EQ(index_->PrefixMatch({"c0", "c1", "c2", "c3"}), 1u);  // still a usable prefix
  EXPECT_OK(index_->CheckInvariants());
}

// A chain a0 <- a1 read at t=1, then pages put later. Leaf-first order
// must still be LRU order: once a1 leaves, a0 (last read at t=1) goes
// before z0 (put at t=4). Run returns whether a0 and z0 survive the
// eviction after a1's.
class IndexPolicyTest : public IndexTest {
 protected:
  void EvictOne() { index_->EvictTo(registry_->used() - 1024); }
  std::pair<bool, bool> Run(EvictionPolicy policy) {
    IndexOptions o;
    o.shards = 1;  // one candidate list, so the order is exact
    o.eviction = policy;
    Build(o);
    Mount("seg-a", 64 * 1024);
    EXPECT_OK(Put("a0", 1024));
    EXPECT_OK(Put("a1", 1024, {.parent_key = "a0"}));
    clock_.Advance(absl::Seconds(1));
    EXPECT_EQ(index_->PrefixMatch({"a0", "a1"}), 2u);  // reads the chain: both referenced
    clock_.Advance(absl::Seconds(1));
    EXPECT_OK(Put("y0", 1024));
    clock_.Advance(absl::Seconds(1));
    EXPECT_OK(Put("y1", 1024));
    EvictOne();  // a1 had its second chance; y0 goes
    EXPECT_FALSE(Present("y0"));
    clock_.Advance(absl::Seconds(1));
    EXPECT_OK(Put("z0", 1024));
    EvictOne();  // y1
    EvictOne();  // a1, read at t=1; a0 becomes a leaf
    EXPECT_FALSE(Present("a1"));
    EvictOne();
    EXPECT_OK(index_->CheckInvariants());
    return {Present("a0"), Present("z0")};
  }
};

TEST_F(IndexPolicyTest, AParentThatBecomesALeafKeepsItsChainsRecency) {
  // The default: a0 was read no later than a1, so it is next.
  EXPECT_EQ(Run(EvictionPolicy::kChain), std::make_pair(false, true));
  // The first leaf-first design kept a0's reference bit from the read that
  // a1's own second chance had already used, sent a0 round again and
  // evicted z0, the more recent page.
  EXPECT_EQ(Run(EvictionPolicy::kPrefix), std::make_pair(true, false));
}

TEST_F(IndexPolicyTest, LruIgnoresParentKeys) {
  IndexOptions o;
  o.shards = 1;
  o.eviction = EvictionPolicy::kLru;
  Build(o);
  Mount("seg-a", 64 * 1024);
  ASSERT_OK(Put("c0", 1024));
  clock_.Advance(absl::Seconds(1));
  ASSERT_OK(Put("c1", 1024, {.parent_key = "c0"}));
  EXPECT_EQ(index_->Describe("c0")->children, 0u);
  index_->EvictTo(registry_->used() - 1024);
  EXPECT_FALSE(Present("c0"));  // the oldest, though c1 extends it
  EXPECT_TRUE(Present("c1"));
  EXPECT_OK(index_->CheckInvariants());
}

TEST(EvictionPolicyTest, NamesRoundTrip) {
  for (auto p : {EvictionPolicy::kLru, EvictionPolicy::kPrefix, EvictionPolicy::kChain}) {
    auto parsed = ParseEvictionPolicy(EvictionPolicyName(p));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, p);
  }
  EXPECT_THAT(ParseEvictionPolicy("lfu").status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

// Records which threads eviction ran on.
class EvictionWatcher final : public IndexListener {
 public:
  void OnStored(absl::string_view, absl::string_view, uint64_t) override {}
  void OnRemoved(absl::string_view) override {
    std::lock_guard<std::mutex> lock(mu_);
    threads_.insert(std::this_thread::get_id());
  }
  std::set<std::thread::id> threads() {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_;
  }

 private:
  std::mutex mu_;
  std::set<std::thread::id> threads_;
};

// With the background evictor running, a PutStart past the high watermark
// only wakes it: every eviction runs on the evictor's thread, which brings
// usage back to the low watermark, and the next puts find that headroom
// without evicting.
TEST_F(IndexTest, BackgroundEvictorKeepsHeadroomOffTheRequestPath) {
  EvictionWatcher watcher;
  IndexOptions o;
  o.high_watermark = 0.5;
  o.low_watermark = 0.3;
  o.listener = &watcher;
  Build(o);
  Mount("seg-a", 100 * 1024);
  std::thread evictor = StartEvictor();
  ASSERT_TRUE(index_->EvictorRunning());
  // 51 KiB: the last put crosses the high watermark (50 KiB).
  for (int i = 0; i < 51; ++i) ASSERT_OK(Put(absl::StrCat("k", i), 1024)) << i;
  EXPECT_OK(WaitFor("the evictor to bring usage back to the low watermark", absl::Seconds(10),
                    [&] { return registry_->used() <= 30 * 1024; }));
  EXPECT_LE(registry_->used(), 30u * 1024);
  std::set<std::thread::id> ran = watcher.threads();
  EXPECT_FALSE(ran.empty());
  EXPECT_FALSE(ran.contains(std::this_thread::get_id())) << "a PutStart evicted inline";
  const uint64_t evictions = index_->Stats().evictions;
  ASSERT_OK(Put("in-headroom", 1024));
  EXPECT_EQ(index_->Stats().evictions, evictions);
  index_->StopEvictor();
  evictor.join();
  EXPECT_FALSE(index_->EvictorRunning());
  EXPECT_OK(index_->CheckInvariants());
  index_.reset();  // before the watcher it reports to
}

// Above the high watermark with nothing evictable (every object leased),
// puts keep waking the evictor; it backs off instead of running a whole
// pass for each of them.
TEST_F(IndexTest, AnEvictorThatFindsNothingToEvictBacksOff) {
  IndexOptions o;
  o.high_watermark = 0.5;
  o.low_watermark = 0.3;
  Build(o);
  Mount("seg-a", 100 * 1024);
  std::vector<std::string> keys;
  for (int i = 0; i < 45; ++i) {
    keys.push_back(absl::StrCat("k", i));
    ASSERT_OK(Put(keys.back(), 1024));
  }
  for (const LookupOut& r : index_->GetReplicas(keys)) ASSERT_OK(r.status);  // all leased (the clock stands still)
  // Puts still being written take it past the high watermark (50 KiB).
  for (int i = 0; i < 10; ++i) ASSERT_OK(index_->PutStart({{absl::StrCat("p", i), 1024}})[0].status);
  ASSERT_GT(registry_->used(), 50u * 1024);
  std::thread evictor = StartEvictor();
  ASSERT_TRUE(index_->EvictorRunning());
  // About 300 puts over 300 ms (one each poll), each past the high
  // watermark; the passes they cause must stay few throughout.
  auto a_pass_per_put = [&] {
    (void)index_->PutStart({{"k0", 1024}});  // exists: refused, but still a wake
    return index_->Stats().evictor_passes > 12;
  };
  EXPECT_OK(StaysFalse("a fruitless evictor pass per put", absl::Milliseconds(300), a_pass_per_put));
  index_->StopEvictor();
  evictor.join();
  const IndexStats st = index_->Stats();
  EXPECT_EQ(st.evictions, 0u);
  EXPECT_GE(st.evictor_passes, 1u);
  EXPECT_LE(st.evictor_passes, 12u) << "a fruitless pass per put";
  EXPECT_OK(index_->CheckInvariants());
}

// The last resort: with the evictor running but no watermark crossed (a
// high watermark of 1), a PutStart into a full store still evicts inline
// for itself rather than failing.
TEST_F(IndexTest, AFullStoreStillEvictsInlineForThePut) {
  EvictionWatcher watcher;
  IndexOptions o;
  o.high_watermark = 1.0;
  o.low_watermark = 0.9;
  o.listener = &watcher;
  Build(o);
  Mount("seg-a", 8 * 1024);
  std::thread evictor = StartEvictor();
  for (int i = 0; i < 8; ++i) ASSERT_OK(Put(absl::StrCat("k", i), 1024)) << i;
  EXPECT_EQ(registry_->used(), 8u * 1024);
  ASSERT_OK(Put("one-more", 1024));
  EXPECT_TRUE(watcher.threads().contains(std::this_thread::get_id()));
  EXPECT_EQ(index_->Stats().objects, 8u);  // one made room
  index_->StopEvictor();
  evictor.join();
  EXPECT_OK(index_->CheckInvariants());
  index_.reset();
}

// Puts from several writers into a full store, faster than the evictor
// keeps headroom: each finds room by evicting inline, and none is refused
// while committed objects could go, even when another writer's PutStart
// takes the room it just freed. Nor does a pass that reached its target
// go on to soft-pinned objects because other puts filled the room again.
TEST_F(IndexTest, ConcurrentPutsIntoAFullStoreAreNeverRefusedWhileObjectsCanBeEvicted) {
  IndexOptions o;
  o.high_watermark = 0.95;
  o.low_watermark = 0.9;
  Build(o);
  Mount("seg-a", 256 * 1024);
  PutItem pinned;
  pinned.soft_pin = true;
  for (int i = 0; i < 8; ++i) ASSERT_OK(Put(absl::StrCat("pinned/", i), 1024, pinned));
  std::thread evictor = StartEvictor();
  ASSERT_TRUE(index_->EvictorRunning());
  constexpr int kWriters = 4, kRounds = 300, kBatch = 16;  // 16 KiB in flight each
  std::atomic<int> refused{0};
  std::mutex mu;
  std::string first_refusal;
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      for (int r = 0; r < kRounds; ++r) {
        std::vector<PutItem> items;
        std::vector<std::string> keys;
        for (int i = 0; i < kBatch; ++i) {
          keys.push_back(absl::StrCat("w", w, "/", r, "/", i));
          items.push_back({keys.back(), 1024});
        }
        std::vector<std::string> commit;
        std::vector<PutStartOut> started = index_->PutStart(items);
        for (size_t i = 0; i < started.size(); ++i) {
          if (started[i].status.ok()) {
            commit.push_back(keys[i]);
          } else if (refused.fetch_add(1) == 0) {
            std::lock_guard<std::mutex> lock(mu);
            first_refusal = started[i].status.ToString();
          }
        }
        for (const absl::Status& s : index_->PutEnd(commit)) EXPECT_OK(s);
      }
    });
  }
  for (std::thread& t : writers) t.join();
  index_->StopEvictor();
  evictor.join();
  EXPECT_EQ(refused.load(), 0) << "first: " << first_refusal;
  EXPECT_GT(index_->Stats().evictions, 0u);
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(Present(absl::StrCat("pinned/", i))) << "pinned/" << i << " was evicted";
  EXPECT_OK(index_->CheckInvariants());
}

// StopEvictor before RunEvictor starts makes it return at once.
TEST_F(IndexTest, StoppedEvictorDoesNotStart) {
  index_->StopEvictor();
  index_->RunEvictor();
  EXPECT_FALSE(index_->EvictorRunning());
}

// Stats (what every /metrics scrape reads) visits no object and takes no
// shard lock: it answers while a request holds one.
TEST_F(IndexTest, StatsTakesNoShardLock) {
  class Blocking final : public IndexListener {
   public:
    void OnStored(absl::string_view, absl::string_view, uint64_t) override {
      entered.set_value();
      release_seen.wait();
    }
    void OnRemoved(absl::string_view) override {}
    std::promise<void> entered, release;
    std::shared_future<void> release_seen = release.get_future().share();
  } listener;
  IndexOptions o;
  o.listener = &listener;
  Build(o);
  Mount("seg-a", 1 << 20);
  ASSERT_OK(index_->PutStart({{"k", 100}})[0].status);
  std::thread writer([this] { index_->PutEnd({"k"}); });  // holds k's shard lock in OnStored
  listener.entered.get_future().wait();
  std::future<IndexStats> stats = std::async(std::launch::async, [this] { return index_->Stats(); });
  const bool answered = stats.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  listener.release.set_value();
  writer.join();
  EXPECT_TRUE(answered) << "Stats waited for a shard lock";
  EXPECT_EQ(stats.get().pending, 0u);
  index_.reset();
}

}  // namespace
}  // namespace tierkv::master
