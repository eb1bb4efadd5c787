#include "master/object_index.h"
#include "master/internal/index_impl.h"
#include "master/replication.h"

#include <future>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "tests/support/status_matchers.h"

namespace tierkv::master {
namespace {

using ::tierkv::testing::IsOk;
using ::tierkv::testing::StatusIs;

// An object's replica list: one inline, more on the heap, back inline when
// one is left; copies and moves keep every replica.
TEST(ReplicaListTest, GrowsShrinksCopiesAndMoves) {
  auto ids = [](const ReplicaList& l) {
    std::vector<uint32_t> out;
    for (const Replica& r : l) out.push_back(r.segment_id);
    return out;
  };
  ReplicaList l;
  EXPECT_TRUE(l.empty());
  EXPECT_EQ(l.begin(), l.end());
  l.push_back({7, false, false, 4096});
  ASSERT_EQ(l.size(), 1u);
  EXPECT_EQ(l[0].offset, 4096u);
  for (uint32_t i = 8; i < 13; ++i) l.push_back({i, i % 2 == 0, false, i * 64ull});
  EXPECT_EQ(ids(l), (std::vector<uint32_t>{7, 8, 9, 10, 11, 12}));
  EXPECT_TRUE(l[1].ssd);
  EXPECT_EQ(l[5].offset, 12 * 64u);

  ReplicaList copy = l;
  ReplicaList moved = std::move(copy);
  EXPECT_TRUE(copy.empty());  // NOLINT(bugprone-use-after-move): a moved-from list is empty
  EXPECT_EQ(ids(moved), ids(l));

  // The erase-remove idiom the index uses.
  l.erase(std::remove_if(l.begin(), l.end(), [](const Replica& r) { return r.ssd; }), l.end());
  EXPECT_EQ(ids(l), (std::vector<uint32_t>{7, 9, 11}));
  l.erase(l.begin() + 1);
  EXPECT_EQ(ids(l), (std::vector<uint32_t>{7, 11}));
  Replica* next = l.erase(l.begin());
  ASSERT_EQ(l.size(), 1u);
  EXPECT_EQ(next, l.begin());
  EXPECT_EQ(l[0].segment_id, 11u);
  EXPECT_EQ(l[0].offset, 11 * 64u);
  l.erase(l.begin(), l.end());
  EXPECT_TRUE(l.empty());

  ReplicaList a = {{1, false, false, 64}, {2, false, true, 128}};
  ReplicaList b = {{3, false, false, 192}};
  b = a;
  EXPECT_EQ(ids(b), (std::vector<uint32_t>{1, 2}));
  EXPECT_TRUE(b[1].stage);
  a = ReplicaList{{4, false, false, 0}};
  EXPECT_EQ(ids(a), (std::vector<uint32_t>{4}));
  b = std::move(a);
  EXPECT_EQ(ids(b), (std::vector<uint32_t>{4}));
  b.assign(moved.begin(), moved.end());
  EXPECT_EQ(ids(b), (std::vector<uint32_t>{7, 8, 9, 10, 11, 12}));
  b.clear();
  EXPECT_TRUE(b.empty());
  static_assert(sizeof(Object) <= 112);
}

class IndexTest : public ::testing::Test {
 protected:
  void SetUp() override { Build(IndexOptions()); }

  void Build(IndexOptions options) {
    index_.reset();
    registry_ = std::make_unique<SegmentRegistry>();
    store_ = NewMemStore();
    options_ = options;
    index_ = std::make_unique<ObjectIndex>(options, registry_.get(), store_.get(), &clock_);
  }

  uint32_t Mount(const std::string& name, uint64_t capacity, const std::string& host = "") {
    bool restored;
    std::optional<uint32_t> replaced;
    auto id = registry_->Mount({name, host.empty() ? name : host, capacity, "inc", ""},
                               clock_.Now(), &restored, &replaced);
    EXPECT_TRUE(id.ok());
    return *id;
  }

  absl::Status Put(const std::string& key, uint64_t size, PutItem extra = {}) {
    extra.key = key;
    extra.size = size;
    auto started = index_->PutStart({extra});
    if (!started[0].status.ok()) return started[0].status;
    return index_->PutEnd({key})[0];
  }

  bool Present(const std::string& key) { return index_->Exists({key})[0]; }

  // The background evictor on a thread of the test's, returned once it
  // runs (or after 10 s without: the caller checks EvictorRunning).
  std::thread StartEvictor() {
    std::thread t([this] { index_->RunEvictor(); });
    const absl::Time up = absl::Now() + absl::Seconds(10);
    while (!index_->EvictorRunning() && absl::Now() < up) std::this_thread::yield();
    return t;
  }

  ManualClock clock_;
  IndexOptions options_;
  std::unique_ptr<SegmentRegistry> registry_;
  std::unique_ptr<IndexStore> store_;
  std::unique_ptr<ObjectIndex> index_;
};

// What the query stats learn from a lookup: each found key's size and its
// reuse distance (seconds since put or last read), read before this read
// counts as an access.
TEST_F(IndexTest, LookupsReportSizeAndSecondsSinceTheLastAccess) {
  Mount("seg-a", 1 << 20);
  ASSERT_OK(Put("a", 100));
  ASSERT_OK(Put("b", 200));
  clock_.Advance(absl::Seconds(7));
  std::vector<KeyHit> hits;
  EXPECT_EQ(index_->PrefixMatch({"a", "b", "c"}, &hits), 2u);
  ASSERT_EQ(hits.size(), 2u);  // one per matched key
  EXPECT_TRUE(hits[0].found);
  EXPECT_EQ(hits[0].size, 100u);
  EXPECT_EQ(hits[0].idle_s, 7u);
  EXPECT_EQ(hits[1].size, 200u);
  clock_.Advance(absl::Seconds(3));
  // The PrefixMatch was a read: 3 s since.
  LookupOut got = index_->GetReplicas({"b"})[0];
  ASSERT_OK(got.status);
  EXPECT_EQ(got.idle_s, 3u);
  hits.clear();
  EXPECT_EQ(index_->Exists({"x", "a"}, &hits), (std::vector<bool>{false, true}));
  ASSERT_EQ(hits.size(), 2u);  // one per key
  EXPECT_FALSE(hits[0].found);
  EXPECT_EQ(hits[1].size, 100u);
  EXPECT_EQ(hits[1].idle_s, 3u);
}

TEST_F(IndexTest, PutGetRemove) {
  Mount("seg-a", 1 << 20);
  auto started = index_->PutStart({{"k1", 1000}});
  ASSERT_OK(started[0].status);
  ASSERT_EQ(started[0].replicas.size(), 1u);
  EXPECT_EQ(started[0].replicas[0].segment, "seg-a");
  EXPECT_EQ(started[0].replicas[0].length, 1000u);
  // Pending objects are invisible.
  EXPECT_FALSE(Present("k1"));
  EXPECT_THAT(index_->GetReplicas({"k1"})[0].status, StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(index_->PutEnd({"k1"})[0]);
  ASSERT_OK(index_->PutEnd({"k1"})[0]);  // retried commit is fine
  EXPECT_TRUE(Present("k1"));
  LookupOut got = index_->GetReplicas({"k1"})[0];
  ASSERT_OK(got.status);
  EXPECT_EQ(got.size, 1000u);
  EXPECT_EQ(got.replicas[0].offset, started[0].replicas[0].offset);
  EXPECT_THAT(index_->PutStart({{"k1", 1000}})[0].status, StatusIs(absl::StatusCode::kAlreadyExists));
  // Leased: not removable without force.
  EXPECT_THAT(index_->Remove({"k1"}, false)[0], StatusIs(absl::StatusCode::kFailedPrecondition));
  clock_.Advance(options_.lease_ttl + absl::Milliseconds(1));
  EXPECT_OK(index_->Remove({"k1"}, false)[0]);
  EXPECT_THAT(index_->Remove({"k1"}, false)[0], StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(registry_->used(), 0u);
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, BadRequestsGetClearErrors) {
  Mount("seg-a", 1 << 20);
  auto out = index_->PutStart({{"", 10},
                               {std::string(5000, 'k'), 10},
                               {"zero", 0},
                               {"huge", 2 << 20},
                               {"many", 10, 99},
                               {std::string("bad tenant\0key", 14), 10},
                               {"fine", 10}});
  EXPECT_THAT(out[0].status, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(out[1].status, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(out[2].status, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(out[3].status, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(out[4].status, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(out[5].status, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_OK(out[6].status);  // one bad key never fails its neighbours
  EXPECT_THAT(index_->PutEnd({"never-started"})[0], StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(index_->PutRevoke({"never-started"})[0], StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(IndexTest, FullStoreWithoutCandidatesIsResourceExhausted) {
  Mount("seg-a", 4096);
  ASSERT_OK(index_->PutStart({{"a", 4096}})[0].status);  // pending: not evictable
  EXPECT_THAT(index_->PutStart({{"b", 64}})[0].status, StatusIs(absl::StatusCode::kResourceExhausted));
}

TEST_F(IndexTest, ReplicasGoToDistinctHosts) {
  Mount("a1", 1 << 20, "host-a");
  Mount("a2", 1 << 20, "host-a");
  Mount("b1", 1 << 20, "host-b");
  auto out = index_->PutStart({{"k", 100, 2}});
  ASSERT_OK(out[0].status);
  ASSERT_EQ(out[0].replicas.size(), 2u);
  std::set<std::string> hosts;
  for (auto& r : out[0].replicas) hosts.insert(r.segment == "b1" ? "host-b" : "host-a");
  EXPECT_EQ(hosts.size(), 2u);
  // Three replicas on two hosts: the third shares a host but not a segment.
  auto three = index_->PutStart({{"k3", 100, 3}});
  ASSERT_EQ(three[0].replicas.size(), 3u);
  std::set<std::string> segs;
  for (auto& r : three[0].replicas) segs.insert(r.segment);
  EXPECT_EQ(segs.size(), 3u);
}

TEST_F(IndexTest, PreferredSegmentWins) {
  Mount("big", 100 << 20);
  Mount("local", 1 << 20);
  auto out = index_->PutStart({{"k", 100, 1, "local"}});
  ASSERT_OK(out[0].status);
  EXPECT_EQ(out[0].replicas[0].segment, "local");
  auto other = index_->PutStart({{"k2", 100}});
  EXPECT_EQ(other[0].replicas[0].segment, "big");  // most free space otherwise
}

TEST_F(IndexTest, TimedOutPutsAreReclaimed) {
  Mount("seg-a", 1 << 20);
  ASSERT_OK(index_->PutStart({{"k", 4096}})[0].status);
  EXPECT_GT(registry_->used(), 0u);
  clock_.Advance(options_.put_timeout - absl::Seconds(1));
  index_->Tick();
  EXPECT_GT(registry_->used(), 0u);
  clock_.Advance(absl::Seconds(2));
  index_->Tick();
  EXPECT_THAT(index_->PutEnd({"k"})[0], StatusIs(absl::StatusCode::kNotFound));
  EXPECT_FALSE(Present("k"));
  ASSERT_OK(index_->CheckInvariants());
  // The space waits out the revoke grace: the writer may still be sending.
  EXPECT_GT(registry_->used(), 0u);
  clock_.Advance(options_.revoke_grace);
  index_->Tick();
  EXPECT_EQ(registry_->used(), 0u);
  ASSERT_OK(Put("k", 4096));  // the key is free again
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, PutsInFlightAreCountedPerClient) {
  Mount("seg-a", 1 << 20);
  for (const char* k : {"a", "b", "c"}) ASSERT_OK(index_->PutStart({{k, 100, 1, "", "", false, "", "w1"}})[0].status);
  ASSERT_OK(index_->PutStart({{"d", 100, 1, "", "", false, "", "w2"}})[0].status);
  EXPECT_EQ(index_->PendingOf("w1"), 3u);
  EXPECT_EQ(index_->PendingOf("w2"), 1u);
  ASSERT_OK(index_->PutEnd({"a"})[0]);     // committed
  ASSERT_OK(index_->PutRevoke({"b"})[0]);  // given up
  EXPECT_EQ(index_->PendingOf("w1"), 1u);
  clock_.Advance(options_.put_timeout + absl::Seconds(1));
  index_->Tick();  // "c" and "d" time out
  EXPECT_EQ(index_->PendingOf("w1"), 0u);
  EXPECT_EQ(index_->PendingOf("w2"), 0u);
}

TEST_F(IndexTest, RevokeFreesSpace) {
  Mount("seg-a", 1 << 20);
  ASSERT_OK(index_->PutStart({{"k", 4096}})[0].status);
  ASSERT_OK(index_->PutRevoke({"k"})[0]);
  EXPECT_FALSE(Present("k"));
  ASSERT_OK(Put("k", 4096));  // the key is free at once...
  ASSERT_OK(index_->Remove({"k"}, false)[0]);
  EXPECT_GT(registry_->used(), 0u);  // ...its old extent after the grace
  clock_.Advance(options_.revoke_grace);
  index_->Tick();
  EXPECT_EQ(registry_->used(), 0u);
}

TEST_F(IndexTest, PrefixMatchStopsAtFirstMiss) {
  Mount("seg-a", 1 << 20);
  for (const char* k : {"p0", "p1", "p2", "p4"}) ASSERT_OK(Put(k, 100));
  EXPECT_EQ(index_->PrefixMatch({"p0", "p1", "p2", "p3", "p4"}), 3u);
  EXPECT_EQ(index_->PrefixMatch({"p3", "p0"}), 0u);
  EXPECT_EQ(index_->PrefixMatch({}), 0u);
  EXPECT_EQ(index_->Exists({"p0", "p3", "p4"}), (std::vector<bool>{true, false, true}));
}

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

// Reads a client served from its replica cache, reported later, count as
// reads: the oldest ten become most recent (no lease is taken for them),
// and what was seen is returned; a key gone since is reported not found.
TEST_F(IndexTest, CachedReadsReportedLaterKeepTheirKeysRecent) {
  Mount("seg-a", 100 * 1024);
  for (int i = 0; i < 95; ++i) {
    ASSERT_OK(Put(absl::StrCat("k", i), 1024));
    clock_.Advance(absl::Seconds(1));
  }
  std::vector<std::string> read;
  for (int i = 0; i < 10; ++i) read.push_back(absl::StrCat("k", i));
  read.push_back("never-put");
  std::vector<KeyHit> hits = index_->NoteCachedReads(read);
  ASSERT_EQ(hits.size(), read.size());
  for (int i = 0; i < 10; ++i) {
    EXPECT_TRUE(hits[i].found) << i;
    EXPECT_EQ(hits[i].size, 1024u) << i;
    EXPECT_GE(hits[i].idle_s, 84u) << i;  // put 85 to 94 s before
  }
  EXPECT_FALSE(hits[10].found);
  ASSERT_OK(Put("trigger", 1024));  // 96 % > 95 %: evict down to 90 %
  EXPECT_LE(registry_->used(), 90u * 1024);
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(Present(absl::StrCat("k", i))) << i;
  for (int i = 10; i < 16; ++i) EXPECT_FALSE(Present(absl::StrCat("k", i))) << i;
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

// When leases hold the DRAM the evictor needs, later reads are leased for
// pressure_lease only, until pressure_window passes without pressure.
TEST_F(IndexTest, ReadsUnderMemoryPressureGetTheShortLease) {
  Mount("seg-a", 20 * 1024);  // headroom: no watermark eviction while filling
  for (int i = 0; i < 8; ++i) ASSERT_OK(Put(absl::StrCat("k", i), 1024));
  auto lease = [&](const std::string& key) {
    LookupOut got = index_->GetReplicas({key})[0];
    EXPECT_OK(got.status) << key;
    return got.lease_expiry - clock_.Now();
  };
  for (int i = 0; i < 8; ++i) EXPECT_EQ(lease(absl::StrCat("k", i)), options_.lease_ttl);
  index_->EvictTo(0);  // every object is leased: nothing goes
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(Present(absl::StrCat("k", i)));
  ASSERT_OK(Put("fresh", 1024));
  EXPECT_EQ(lease("fresh"), options_.pressure_lease);
  clock_.Advance(options_.lease_ttl);
  index_->EvictTo(4 * 1024);  // the leases ended: this pass reaches its target
  ASSERT_OK(Put("later", 1024));
  EXPECT_EQ(lease("later"), options_.pressure_lease);  // still inside the window
  clock_.Advance(options_.pressure_window);
  ASSERT_OK(Put("calm", 1024));
  EXPECT_EQ(lease("calm"), options_.lease_ttl);
  EXPECT_OK(index_->CheckInvariants());
}

// Under pressure a read is counted: its reader gives the lease back when
// done, and the object is evictable then, not at the lease's end.
TEST_F(IndexTest, CountedReadsEndTheirLeaseWhenGivenBack) {
  Mount("seg-a", 20 * 1024);
  ASSERT_OK(Put("plain", 1024));
  LookupOut first = index_->GetReplicas({"plain"})[0];
  ASSERT_OK(first.status);
  EXPECT_EQ(first.lease_token, 0u);  // no pressure: an ordinary lease
  index_->EvictTo(0);                // all leased: pressure
  ASSERT_OK(Put("k", 1024));
  LookupOut a = index_->GetReplicas({"k"})[0];
  LookupOut b = index_->GetReplicas({"k"})[0];
  ASSERT_NE(a.lease_token, 0u);
  EXPECT_EQ(b.lease_token, a.lease_token);
  auto give_back = [&](const std::string& key, const LookupOut& r, uint64_t token) {
    return index_->ReleaseLeases({{key, token, absl::ToUnixMillis(r.lease_expiry)}});
  };
  EXPECT_EQ(give_back("k", a, a.lease_token + 1), 0u);  // not this incarnation's
  EXPECT_EQ(give_back("k", a, a.lease_token), 1u);
  index_->EvictTo(0);
  EXPECT_TRUE(Present("k"));  // b still reads it
  EXPECT_EQ(give_back("k", b, b.lease_token), 1u);
  EXPECT_EQ(give_back("k", b, b.lease_token), 0u);  // nothing left to give back
  ASSERT_OK_AND_ASSIGN(ObjectInfo info, index_->Describe("k"));
  EXPECT_EQ(info.lease_expiry, absl::Time());
  // A counted read on top of an ordinary lease does not end that lease.
  LookupOut c = index_->GetReplicas({"plain"})[0];
  ASSERT_NE(c.lease_token, 0u);
  EXPECT_EQ(give_back("plain", c, c.lease_token), 1u);
  index_->EvictTo(0);
  EXPECT_FALSE(Present("k"));
  EXPECT_TRUE(Present("plain"));
  EXPECT_EQ(index_->Stats().leases_released, 3u);
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, LateOrStaleGiveBacksAreIgnored) {
  Mount("seg-a", 20 * 1024);
  ASSERT_OK(Put("held", 1024));
  ASSERT_OK(index_->GetReplicas({"held"})[0].status);
  index_->EvictTo(0);  // pressure
  auto give_back = [&](const std::string& key, const LookupOut& r) {
    return index_->ReleaseLeases({{key, r.lease_token, absl::ToUnixMillis(r.lease_expiry)}});
  };
  // Past its expiry a lease ended by itself; a later reader's count stays.
  ASSERT_OK(Put("late", 1024));
  LookupOut old_read = index_->GetReplicas({"late"})[0];
  ASSERT_NE(old_read.lease_token, 0u);
  clock_.Advance(options_.pressure_lease);
  LookupOut new_read = index_->GetReplicas({"late"})[0];
  EXPECT_EQ(give_back("late", old_read), 0u);
  index_->EvictTo(0);
  EXPECT_TRUE(Present("late"));
  EXPECT_EQ(give_back("late", new_read), 1u);
  // A give-back for a removed and re-put key does not touch the new one.
  LookupOut gone = index_->GetReplicas({"late"})[0];
  ASSERT_OK(index_->Remove({"late"}, /*force=*/true)[0]);
  ASSERT_OK(Put("late", 1024));
  LookupOut fresh = index_->GetReplicas({"late"})[0];
  ASSERT_NE(fresh.lease_token, 0u);
  EXPECT_NE(fresh.lease_token, gone.lease_token);
  EXPECT_EQ(give_back("late", gone), 0u);
  index_->EvictTo(0);
  EXPECT_TRUE(Present("late"));
  // Past 254 readers the count sticks: no token, the lease runs its course.
  uint64_t last = 0;
  for (int i = 0; i < 300; ++i) last = index_->GetReplicas({"late"})[0].lease_token;
  EXPECT_EQ(last, 0u);
  EXPECT_EQ(give_back("late", fresh), 0u);
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

TEST_F(IndexTest, ForcedRemoveOfALeasedObjectKeepsItsBytesUntilTheLeaseEnds) {
  Mount("seg-a", 4096);
  ASSERT_OK(Put("k1", 4096));
  auto leased = index_->GetReplicas({"k1"});
  ASSERT_OK(leased[0].status);
  const uint64_t offset = leased[0].replicas[0].offset;
  ASSERT_OK(index_->Remove({"k1"}, /*force=*/true)[0]);
  EXPECT_FALSE(Present("k1"));
  // The reader's extent is not handed out while the lease lasts...
  EXPECT_THAT(index_->PutStart({{"k2", 4096}})[0].status, StatusIs(absl::StatusCode::kResourceExhausted));
  ASSERT_OK(index_->CheckInvariants());
  // ...and is after it.
  clock_.Advance(options_.lease_ttl + absl::Milliseconds(1));
  index_->Tick();
  auto again = index_->PutStart({{"k2", 4096}});
  ASSERT_OK(again[0].status);
  EXPECT_EQ(again[0].replicas[0].offset, offset);
  ASSERT_OK(index_->CheckInvariants());
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

TEST_F(IndexTest, GroupsAreVisibleAtOnceAndLeaveWhole) {
  Mount("seg-a", 1 << 20);
  auto started = index_->PutStart({{"g-k", 100, 1, "", "page1"}, {"g-v", 100, 1, "", "page1"}});
  ASSERT_OK(started[0].status);
  ASSERT_OK(started[1].status);
  ASSERT_OK(index_->PutEnd({"g-k"})[0]);
  EXPECT_FALSE(Present("g-k"));  // its partner is not committed yet
  ASSERT_OK(index_->PutEnd({"g-v"})[0]);
  EXPECT_TRUE(Present("g-k") && Present("g-v"));
  EXPECT_EQ(index_->Stats().groups, 1u);
  // A group id in use is refused.
  EXPECT_THAT(index_->PutStart({{"other", 100, 1, "", "page1"}})[0].status,
              StatusIs(absl::StatusCode::kAlreadyExists));
  clock_.Advance(options_.lease_ttl);
  // Removing one member removes the group.
  ASSERT_OK(index_->Remove({"g-k"}, false)[0]);
  EXPECT_FALSE(Present("g-v"));
  EXPECT_EQ(registry_->used(), 0u);
  EXPECT_EQ(index_->Stats().groups, 0u);
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, AGroupsMembersShareTheirSegments) {
  for (const char* seg : {"seg-a", "seg-b", "seg-c"}) Mount(seg, 1 << 20);
  // Without the rule, each member would go where the most room is left,
  // which alternates between segments as they fill.
  std::vector<PutItem> items;
  for (int page = 0; page < 6; ++page) {
    for (const char* half : {"k", "v"}) {
      items.push_back({absl::StrCat("p", page, half), 1000, 2, "", absl::StrCat("g", page)});
    }
  }
  std::vector<PutStartOut> started = index_->PutStart(items);
  std::set<std::set<std::string>> homes;
  for (size_t i = 0; i < items.size(); i += 2) {
    ASSERT_OK(started[i].status);
    ASSERT_OK(started[i + 1].status);
    ASSERT_EQ(started[i].replicas.size(), 2u);
    std::set<std::string> k, v;
    for (const ExtentOut& e : started[i].replicas) k.insert(e.segment);
    for (const ExtentOut& e : started[i + 1].replicas) v.insert(e.segment);
    EXPECT_EQ(k, v) << items[i].group;
    homes.insert(k);
  }
  EXPECT_GT(homes.size(), 1u);  // groups still spread over the cluster
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, GroupWithAFailedMemberIsAborted) {
  Mount("seg-a", 1 << 20);
  auto out = index_->PutStart({{"m1", 100, 1, "", "grp"}, {"", 100, 1, "", "grp"}});
  EXPECT_THAT(out[0].status, StatusIs(absl::StatusCode::kAborted));
  EXPECT_THAT(out[1].status, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(registry_->used(), 0u);
  EXPECT_EQ(index_->Stats().groups, 0u);
}

TEST_F(IndexTest, GroupIsEvictedWhole) {
  Mount("seg-a", 20 * 1024);
  ASSERT_OK(index_->PutStart({{"a", 1024, 1, "", "g"}, {"b", 1024, 1, "", "g"}})[0].status);
  ASSERT_OK(index_->PutEnd({"a", "b"})[0]);
  clock_.Advance(absl::Seconds(5));
  index_->GetReplicas({"b"});  // b is recent and leased; a is old
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  for (int i = 0; i < 10; ++i) ASSERT_OK(Put(absl::StrCat("k", i), 1024));
  index_->EvictTo(registry_->used() - 1024);  // evicts "a", the oldest
  EXPECT_FALSE(Present("a"));
  EXPECT_FALSE(Present("b"));  // its group went with it
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, DroppedSegmentTakesItsObjects) {
  uint32_t a = Mount("a", 1 << 20, "ha");
  Mount("b", 1 << 20, "hb");
  ASSERT_OK(Put("two", 100, {.replicas = 2}));
  ASSERT_OK(Put("one", 100, {.preferred_segment = "a"}));
  ASSERT_OK(registry_->Unmount("a").status());
  EXPECT_EQ(index_->DropSegments({a}), 1u);
  EXPECT_FALSE(Present("one"));
  LookupOut two = index_->GetReplicas({"two"})[0];
  ASSERT_OK(two.status);
  ASSERT_EQ(two.replicas.size(), 1u);
  EXPECT_EQ(two.replicas[0].segment, "b");
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, RecoverRebuildsIndexGroupsAndParents) {
  Mount("seg-a", 1 << 20);
  ASSERT_OK(Put("p", 100));
  ASSERT_OK(Put("c", 200, {.parent_key = "p"}));
  ASSERT_OK(index_->PutStart({{"g1", 10, 1, "", "g"}, {"g2", 10, 1, "", "g"}})[0].status);
  ASSERT_OK(index_->PutEnd({"g1", "g2"})[0]);
  ASSERT_OK(index_->PutStart({{"pending", 10}})[0].status);
  uint64_t used_before = registry_->used();

  // A new registry and index over the same store: the segment comes back
  // recovering and its objects are held but not served until it re-mounts.
  std::unique_ptr<ObjectIndex> old_index = std::move(index_);
  std::unique_ptr<SegmentRegistry> old_registry = std::move(registry_);
  registry_ = std::make_unique<SegmentRegistry>();
  registry_->Recover({"seg-a", "seg-a", 1 << 20, "inc", ""}, clock_.Now());
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  ASSERT_OK_AND_ASSIGN(uint64_t restored, index_->Recover());
  EXPECT_EQ(restored, 4u);
  EXPECT_FALSE(Present("p"));
  Mount("seg-a", 1 << 20);  // same incarnation
  EXPECT_TRUE(Present("p") && Present("c") && Present("g1") && Present("g2"));
  EXPECT_FALSE(Present("pending"));
  EXPECT_EQ(index_->Describe("p")->children, 1u);
  EXPECT_LT(registry_->used(), used_before);  // the pending put's space is free again
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(IndexTest, ConcurrentClientsKeepInvariants) {
  IndexOptions o;
  o.lease_ttl = absl::ZeroDuration();
  Build(o);
  Mount("a", 4 << 20, "h1");
  Mount("b", 4 << 20, "h2");
  constexpr int kThreads = 6;
  constexpr int kOps = 4000;
  std::vector<std::thread> threads;
  std::atomic<int> unexpected{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kOps; ++i) {
        // A small shared key space so threads collide on keys and shards.
        std::string key = absl::StrCat("k", (i * 7 + t) % 300);
        std::string parent = absl::StrCat("k", (i * 7 + t) % 300 - 1);
        switch (i % 6) {
          case 0:
          case 1: {
            auto s = index_->PutStart({{key, 1000u + (i % 5) * 4096u, 1 + i % 2, "", "", i % 3 == 0, parent}});
            if (s[0].status.ok()) {
              if (i % 4 == 0) {
                index_->PutRevoke({key});
              } else {
                index_->PutEnd({key});
              }
            } else if (!absl::IsAlreadyExists(s[0].status) && !absl::IsResourceExhausted(s[0].status)) {
              ++unexpected;
            }
            break;
          }
          case 2:
            index_->GetReplicas({key, parent});
            break;
          case 3:
            index_->PrefixMatch({parent, key});
            break;
          case 4:
            index_->Remove({key}, i % 8 == 0);
            break;
          case 5:
            if (t == 0 && i % 60 == 5) index_->EvictTo(registry_->used() / 2);
            if (t == 1 && i % 50 == 5) index_->Tick();
            index_->Exists({key});
            break;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(unexpected.load(), 0);
  EXPECT_OK(index_->CheckInvariants());
  index_->RemoveAll(true);
  clock_.Advance(options_.put_timeout + absl::Seconds(1));
  index_->Tick();
  EXPECT_EQ(registry_->used(), 0u);
  EXPECT_OK(index_->CheckInvariants());
}

// Counts the store writes the index makes, over a MemStore.
class CountingStore final : public IndexStore {
 public:
  absl::Status Write(const std::vector<Mutation>& b) override {
    ++writes;
    return base_->Write(b);
  }
  absl::StatusOr<std::string> Get(const std::string& k) override { return base_->Get(k); }
  absl::Status Scan(const std::string& p,
                    const std::function<bool(absl::string_view, absl::string_view)>& fn) override {
    return base_->Scan(p, fn);
  }
  absl::Status Flush() override { return base_->Flush(); }
  std::atomic<int> writes{0};

 private:
  std::unique_ptr<IndexStore> base_ = NewMemStore();
};

// A PutEnd or Remove of many keys is one store write (one RocksDB
// WriteBatch), not one per key, and what it wrote is what Recover reads.
TEST_F(IndexTest, PutEndAndRemoveOfManyKeysAreOneStoreWrite) {
  auto counting = std::make_unique<CountingStore>();
  CountingStore* store = counting.get();
  index_.reset();
  store_ = std::move(counting);
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  Mount("seg-a", 1 << 20);
  std::vector<PutItem> items;
  std::vector<std::string> keys;
  for (int i = 0; i < 40; ++i) {
    keys.push_back(absl::StrCat("k", i));
    items.push_back({keys.back(), 1024});
  }
  for (const PutStartOut& r : index_->PutStart(items)) ASSERT_OK(r.status);
  keys.push_back("k0");  // the same key twice in one call answers OK twice
  keys.push_back("never-started");
  std::vector<absl::Status> done = index_->PutEnd(keys);
  EXPECT_EQ(store->writes.load(), 1);
  for (int i = 0; i < 41; ++i) EXPECT_OK(done[i]) << i;
  EXPECT_THAT(done[41], StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(index_->Stats().objects, 40u);
  std::vector<absl::Status> removed = index_->Remove({"k1", "k2", "k3", "missing"}, /*force=*/false);
  EXPECT_EQ(store->writes.load(), 2);
  for (int i = 0; i < 3; ++i) EXPECT_OK(removed[i]);
  EXPECT_THAT(removed[3], StatusIs(absl::StatusCode::kNotFound));
  EXPECT_OK(index_->CheckInvariants());
  // A second index over the same records: the batch wrote every object.
  index_.reset();
  registry_ = std::make_unique<SegmentRegistry>();
  registry_->Recover({"seg-a", "seg-a", 1 << 20, "inc", ""}, clock_.Now());
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  absl::StatusOr<uint64_t> restored = index_->Recover();
  ASSERT_OK(restored.status());
  EXPECT_EQ(*restored, 37u);
  EXPECT_OK(index_->CheckInvariants());
}

// A PutEnd waiting for a standby's acknowledgement (semi-sync) holds no
// shard lock: calls on its shard go on meanwhile. A retried PutEnd of the
// same key, and a Remove, are answered only once the standby has them too.
TEST_F(IndexTest, APutEndWaitingForAStandbyHoldsUpNoOtherCall) {
  IndexOptions one_shard;
  one_shard.shards = 1;  // every key on the shard the waiting PutEnd locked
  Build(one_shard);
  ReplicationOptions ro;
  ro.epoch = 1;
  ro.sync_timeout = absl::Seconds(60);  // never degrades within the test
  ReplicationLog log(ro, store_.get());
  store_->SetReplicator(&log);
  Mount("seg-a", 1 << 20);
  // A standby that has everything: from here each write waits for it.
  auto acknowledge = [&] {
    v1::PullRequest req;
    req.set_standby("standby-1");
    req.set_epoch(1);
    req.set_next_seq(log.LastAppended() + 1);
    v1::PullResponse resp;
    log.Pull(req, &resp);
  };
  ASSERT_OK(Put("x", 100));  // not waited for: no standby has caught up yet
  acknowledge();
  ASSERT_EQ(log.State().sync, "semi-sync");
  for (const char* k : {"a", "b"}) ASSERT_OK(index_->PutStart({{k, 100}})[0].status);
  const uint64_t before = log.LastAppended();
  std::atomic<int> answered{0};
  absl::Status first, retried;
  std::thread putter([&] {
    first = index_->PutEnd({"a"})[0];
    ++answered;
  });
  for (int i = 0; i < 500 && log.LastAppended() == before; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(log.LastAppended(), before + 1) << "a's record was not committed";
  std::thread retrier([&] {
    retried = index_->PutEnd({"a"})[0];
    ++answered;
  });
  // The shard's other calls, while both wait: none blocks on them.
  const absl::Time start = absl::Now();
  EXPECT_TRUE(Present("x"));
  EXPECT_OK(index_->PutStart({{"c", 100}})[0].status);
  EXPECT_OK(index_->PutRevoke({"c"})[0]);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(answered.load(), 0) << "a PutEnd was answered before a standby had its record";
  acknowledge();
  putter.join();
  retrier.join();
  EXPECT_OK(first);
  EXPECT_OK(retried);
  // A Remove waits the same way, and is answered once acknowledged.
  std::atomic<bool> removed{false};
  std::thread remover([&] {
    EXPECT_OK(index_->Remove({"a"}, /*force=*/false)[0]);
    removed = true;
  });
  for (int i = 0; i < 500 && log.LastAppended() == before + 1; ++i) absl::SleepFor(absl::Milliseconds(10));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(removed.load());
  acknowledge();
  remover.join();
  EXPECT_TRUE(removed.load());
  EXPECT_FALSE(Present("a"));
  log.Close();
  store_->SetReplicator(nullptr);
  EXPECT_OK(index_->CheckInvariants());
}

// A failed batch write fails every key it carried, and none is committed.
TEST_F(IndexTest, AFailedBatchWriteCommitsNothing) {
  class FailingStore final : public IndexStore {
   public:
    absl::Status Write(const std::vector<Mutation>&) override { return absl::UnavailableError("disk gone"); }
    absl::StatusOr<std::string> Get(const std::string& k) override { return absl::NotFoundError(k); }
    absl::Status Scan(const std::string&,
                      const std::function<bool(absl::string_view, absl::string_view)>&) override {
      return absl::OkStatus();
    }
    absl::Status Flush() override { return absl::OkStatus(); }
  };
  index_.reset();
  store_ = std::make_unique<FailingStore>();
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  Mount("seg-a", 1 << 20);
  ASSERT_OK(index_->PutStart({{"a", 100}})[0].status);
  ASSERT_OK(index_->PutStart({{"b", 100}})[0].status);
  for (const absl::Status& s : index_->PutEnd({"a", "b"})) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable));
  }
  EXPECT_FALSE(Present("a"));
  EXPECT_EQ(index_->Stats().pending, 2u);  // still the writer's to retry or revoke
  EXPECT_OK(index_->CheckInvariants());
}

// A removed object's space is reused only once the deletion of its record
// is durable. When that write fails the record survives in the store, so
// the space must stay allocated: a put reusing it would be overwritten by
// nothing, but after a restart the surviving record would read the new
// put's bytes as its own.
TEST_F(IndexTest, ARemovedObjectsSpaceIsNotReusedUntilItsDeletionIsDurable) {
  class FlakyStore final : public IndexStore {
   public:
    absl::Status Write(const std::vector<Mutation>& m) override {
      if (fail.load()) return absl::UnavailableError("disk gone");
      return base_->Write(m);
    }
    absl::StatusOr<std::string> Get(const std::string& k) override { return base_->Get(k); }
    absl::Status Scan(const std::string& p,
                      const std::function<bool(absl::string_view, absl::string_view)>& fn) override {
      return base_->Scan(p, fn);
    }
    absl::Status Flush() override { return base_->Flush(); }
    std::atomic<bool> fail{false};

   private:
    std::unique_ptr<IndexStore> base_ = NewMemStore();
  };
  auto flaky = std::make_unique<FlakyStore>();
  FlakyStore* store = flaky.get();
  index_.reset();
  store_ = std::move(flaky);
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  Mount("seg-a", 4096);  // room for exactly one object
  ASSERT_OK(Put("a", 4096));
  store->fail.store(true);
  (void)index_->Remove({"a"}, false);
  store->fail.store(false);
  EXPECT_FALSE(Present("a"));
  EXPECT_THAT(index_->PutStart({{"b", 4096}})[0].status, StatusIs(absl::StatusCode::kResourceExhausted))
      << "the space of a whose record is still in the store was handed out again";
  EXPECT_OK(index_->CheckInvariants());
  // With the store writable a removal frees the space for the next put.
  Mount("seg-b", 4096);
  ASSERT_OK(Put("c", 4096));
  EXPECT_OK(index_->Remove({"c"}, false)[0]);
  EXPECT_OK(index_->PutStart({{"d", 4096}})[0].status);
  EXPECT_OK(index_->CheckInvariants());
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
  // Bounded wait for the evictor to restore headroom.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (registry_->used() > 30 * 1024 && absl::Now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
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
  // 300 puts over about 300 ms, each past the high watermark.
  for (int i = 0; i < 300; ++i) {
    (void)index_->PutStart({{"k0", 1024}});  // exists: refused, but still a wake
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
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

// The leased count is kept as leases are taken, renewed, end and go with
// their objects, to the lease wheel's 100 ms.
TEST_F(IndexTest, LeasedCountFollowsLeasesWithoutAWalk) {
  Mount("seg-a", 1 << 20);
  for (const char* k : {"a", "b", "c", "d"}) ASSERT_OK(Put(k, 100));
  EXPECT_EQ(index_->Stats().leased, 0u);
  index_->GetReplicas({"a", "b", "c"});
  EXPECT_EQ(index_->Stats().leased, 3u);
  EXPECT_OK(index_->CheckInvariants());
  clock_.Advance(absl::Seconds(2));
  index_->GetReplicas({"a"});  // renewed: still one lease
  EXPECT_EQ(index_->Stats().leased, 3u);
  EXPECT_OK(index_->CheckInvariants());
  ASSERT_OK(index_->Remove({"b"}, /*force=*/true)[0]);
  EXPECT_EQ(index_->Stats().leased, 2u);
  EXPECT_OK(index_->CheckInvariants());
  clock_.Advance(options_.lease_ttl - absl::Seconds(2) + absl::Milliseconds(200));
  EXPECT_EQ(index_->Stats().leased, 1u);  // c's ended, a's renewal holds
  EXPECT_OK(index_->CheckInvariants());
  clock_.Advance(absl::Seconds(3));
  EXPECT_EQ(index_->Stats().leased, 0u);
  // Many lease wheel turns later, a new lease counts from zero.
  clock_.Advance(absl::Minutes(5));
  index_->GetReplicas({"d"});
  EXPECT_EQ(index_->Stats().leased, 1u);
  EXPECT_OK(index_->CheckInvariants());
}

}  // namespace
}  // namespace tierkv::master

namespace tierkv::master {
namespace {

// Offload on eviction (IndexOptions::offload): a page read since its put
// moves to its daemon's SSD tier instead of leaving, stays present, and a
// read of it is handed a staging extent on that segment.
class OffloadTest : public IndexTest {
 protected:
  void SetUp() override {
    IndexOptions o;
    o.offload = [this](const std::string& tier, const std::vector<TierOrder>& orders, absl::Duration) {
      std::lock_guard<std::mutex> lock(mu_);
      ++calls_;
      std::vector<absl::Status> out;
      for (const TierOrder& t : orders) {
        tiers_.push_back(tier);
        ordered_.push_back(t);
        // The extent is not handed back before the daemon has answered.
        if (registry_->used() < t.length) extent_freed_early_ = true;
        out.push_back(fail_ ? absl::UnavailableError("disk down") : absl::OkStatus());
      }
      return out;
    };
    Build(o);
  }

  void MountWithTier(const std::string& name, uint64_t capacity, uint64_t ssd_capacity) {
    bool restored;
    std::optional<uint32_t> replaced;
    ASSERT_OK(registry_->Mount({name, name, capacity, "inc", "", "127.0.0.1:9", ssd_capacity, 0}, clock_.Now(),
                               &restored, &replaced)
                  .status());
  }

  // 95 pages of 1 KiB on a 100 KiB segment, each read once if `read`,
  // then a put past the high watermark: eviction down to 90 %.
  void FillAndEvict(bool read) {
    for (int i = 0; i < 95; ++i) {
      ASSERT_OK(Put(absl::StrCat("k", i), 1024));
      if (read) {
        ASSERT_OK(index_->GetReplicas({absl::StrCat("k", i)})[0].status);
      }
      clock_.Advance(absl::Seconds(1));
    }
    clock_.Advance(options_.lease_ttl + absl::Seconds(1));
    ASSERT_OK(Put("trigger", 1024));
  }

  std::mutex mu_;
  std::vector<std::string> tiers_;
  std::vector<TierOrder> ordered_;
  bool fail_ = false;
  bool extent_freed_early_ = false;
  size_t calls_ = 0;  // orders sent
};

TEST_F(OffloadTest, ReadPagesMoveToSsdAndStayReadableThroughAStagingExtent) {
  MountWithTier("seg-a", 100 * 1024, 1 << 20);
  FillAndEvict(/*read=*/true);
  EXPECT_LE(registry_->used(), 90u * 1024);
  IndexStats st = index_->Stats();
  ASSERT_GT(st.offloaded, 0u);
  EXPECT_EQ(st.offload_failed, 0u);
  ASSERT_EQ(ordered_.size(), st.offloaded);
  EXPECT_FALSE(extent_freed_early_);
  EXPECT_EQ(tiers_[0], "127.0.0.1:9");
  EXPECT_EQ(ordered_[0].key, "k0");  // the oldest went first
  EXPECT_EQ(ordered_[0].length, 1024u);
  // Every page is still there: the moved ones on SSD.
  for (int i = 0; i < 95; ++i) EXPECT_TRUE(Present(absl::StrCat("k", i))) << i;
  ASSERT_OK_AND_ASSIGN(ObjectInfo info, index_->Describe("k0"));
  ASSERT_EQ(info.replicas.size(), 1u);
  EXPECT_TRUE(info.replicas[0].ssd);
  EXPECT_OK(index_->CheckInvariants());

  // A read of an SSD page: one staging extent on its segment, which stays
  // the page's DRAM copy (each reader fills it again) until evicted.
  const uint64_t used = registry_->used();
  LookupOut got = index_->GetReplicas({"k0"})[0];
  ASSERT_OK(got.status);
  ASSERT_EQ(got.replicas.size(), 1u);
  EXPECT_TRUE(got.replicas[0].stage);
  EXPECT_FALSE(got.replicas[0].ssd);
  EXPECT_EQ(got.replicas[0].segment, "seg-a");
  EXPECT_EQ(got.replicas[0].length, 1024u);
  EXPECT_EQ(registry_->used(), used + 1024);
  EXPECT_EQ(index_->Stats().staged, 1u);
  EXPECT_OK(index_->CheckInvariants());
  LookupOut again = index_->GetReplicas({"k0"})[0];
  ASSERT_OK(again.status);
  ASSERT_EQ(again.replicas.size(), 1u);
  EXPECT_TRUE(again.replicas[0].stage);
  EXPECT_EQ(again.replicas[0].offset, got.replicas[0].offset);
  EXPECT_EQ(index_->Stats().staged, 1u);
  EXPECT_EQ(registry_->used(), used + 1024);
  // A page still in DRAM is read from DRAM, with no staging.
  got = index_->GetReplicas({"k94"})[0];
  ASSERT_OK(got.status);
  EXPECT_FALSE(got.replicas[0].stage);
  // Evicting everything: DRAM pages move to SSD, the staged copy is
  // dropped, and its extent returns after revoke_grace. Every page stays.
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  index_->EvictTo(0);
  clock_.Advance(options_.revoke_grace + absl::Seconds(1));
  index_->Tick();
  EXPECT_EQ(registry_->used(), 0u);
  EXPECT_FALSE(Present("trigger"));  // never read: dropped
  for (int i = 0; i < 95; ++i) EXPECT_TRUE(Present(absl::StrCat("k", i))) << i;
  ASSERT_OK_AND_ASSIGN(info, index_->Describe("k0"));
  ASSERT_EQ(info.replicas.size(), 1u);
  EXPECT_TRUE(info.replicas[0].ssd);
  EXPECT_OK(index_->CheckInvariants());
}

// A staged copy whose readers all gave their leases back can be reached by
// no reader and no stage in flight: its extent returns on eviction, with no
// stage_grace.
TEST_F(OffloadTest, AStagedCopyGivenBackReturnsItsExtentAtEviction) {
  MountWithTier("seg-a", 100 * 1024, 1 << 20);
  FillAndEvict(/*read=*/true);
  ASSERT_OK_AND_ASSIGN(ObjectInfo info, index_->Describe("k0"));
  ASSERT_TRUE(info.replicas[0].ssd);
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  index_->EvictTo(0);
  index_->Tick();
  ASSERT_EQ(registry_->used(), 0u);
  LookupOut a = index_->GetReplicas({"k0"})[0];
  LookupOut b = index_->GetReplicas({"k1"})[0];
  ASSERT_TRUE(a.replicas[0].stage);
  ASSERT_NE(a.lease_token, 0u);  // staged reads are always counted
  ASSERT_NE(b.lease_token, 0u);
  ASSERT_EQ(registry_->used(), 2048u);
  EXPECT_EQ(index_->ReleaseLeases({{"k0", a.lease_token, absl::ToUnixMillis(a.lease_expiry)}}), 1u);
  clock_.Advance(absl::Milliseconds(10));
  index_->EvictTo(0);
  // k0's copy is free at once; k1's reader still holds its copy.
  EXPECT_EQ(registry_->used(), 1024u);
  clock_.Advance(options_.stage_lease);
  index_->EvictTo(0);
  EXPECT_EQ(registry_->used(), 1024u);  // k1's lease ran out unreturned: stage_grace first
  clock_.Advance(options_.stage_grace + absl::Milliseconds(1));
  index_->Tick();
  EXPECT_EQ(registry_->used(), 0u);
  EXPECT_TRUE(Present("k0"));
  EXPECT_TRUE(Present("k1"));
  // A reader whose lease ran out unreturned may still have a stage on the
  // way: a later reader's give-back does not skip stage_grace for it.
  LookupOut x = index_->GetReplicas({"k2"})[0];
  ASSERT_TRUE(x.replicas[0].stage);
  clock_.Advance(options_.stage_lease);
  LookupOut y = index_->GetReplicas({"k2"})[0];
  ASSERT_EQ(y.replicas[0].offset, x.replicas[0].offset);  // the same copy
  EXPECT_EQ(index_->ReleaseLeases({{"k2", y.lease_token, absl::ToUnixMillis(y.lease_expiry)}}), 1u);
  index_->EvictTo(0);
  EXPECT_EQ(registry_->used(), 1024u);
  clock_.Advance(options_.stage_grace + absl::Milliseconds(1));
  index_->Tick();
  EXPECT_EQ(registry_->used(), 0u);
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(OffloadTest, UnreadPagesAndSegmentsWithoutATierAreDropped) {
  MountWithTier("seg-a", 100 * 1024, 1 << 20);
  FillAndEvict(/*read=*/false);
  EXPECT_TRUE(ordered_.empty());
  EXPECT_FALSE(Present("k0"));
  EXPECT_GT(index_->Stats().evictions, 0u);

  Build(options_);
  Mount("seg-b", 100 * 1024);  // no SSD tier
  FillAndEvict(/*read=*/true);
  EXPECT_TRUE(ordered_.empty());
  EXPECT_FALSE(Present("k0"));
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(OffloadTest, AFailedOffloadIsAPlainEviction) {
  MountWithTier("seg-a", 100 * 1024, 1 << 20);
  fail_ = true;
  FillAndEvict(/*read=*/true);
  ASSERT_FALSE(ordered_.empty());
  EXPECT_FALSE(Present("k0"));
  EXPECT_EQ(index_->Stats().offloaded, 0u);
  EXPECT_EQ(index_->Stats().offload_failed, ordered_.size());
  EXPECT_LE(registry_->used(), 90u * 1024);
  EXPECT_OK(index_->CheckInvariants());
}

// A tier that does not answer is sent nothing for a while: its objects
// are evicted as plain evictions, and no pass waits on it again until the
// pause is over.
TEST_F(OffloadTest, ATierThatDoesNotAnswerIsPausedAndTriedAgainAfter) {
  MountWithTier("seg-a", 100 * 1024, 1 << 20);
  fail_ = true;
  FillAndEvict(/*read=*/true);
  ASSERT_EQ(calls_, 1u) << "one order, then the tier is paused";
  const uint64_t failed = index_->Stats().offload_failed;
  EXPECT_EQ(failed, ordered_.size());
  EXPECT_LE(registry_->used(), 90u * 1024);

  // More read pages evicted within the pause: no order, plain evictions.
  auto fill_read = [&](const std::string& prefix) {
    for (int i = 0; i < 40; ++i) {
      ASSERT_OK(Put(absl::StrCat(prefix, i), 1024));
      ASSERT_OK(index_->GetReplicas({absl::StrCat(prefix, i)})[0].status);
      clock_.Advance(absl::Milliseconds(50));
    }
    clock_.Advance(options_.lease_ttl + absl::Seconds(1));
    index_->EvictTo(50 * 1024);
  };
  fill_read("p");
  EXPECT_EQ(calls_, 1u);
  EXPECT_EQ(index_->Stats().offloaded, 0u);

  // Past the pause, with the tier back: orders go out and pages move.
  clock_.Advance(absl::Seconds(11));
  fail_ = false;
  fill_read("q");
  EXPECT_GT(calls_, 1u);
  EXPECT_GT(index_->Stats().offloaded, 0u);
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(OffloadTest, SsdReplicasSurviveAMasterRestart) {
  MountWithTier("seg-a", 100 * 1024, 1 << 20);
  FillAndEvict(/*read=*/true);
  ASSERT_GT(index_->Stats().offloaded, 0u);
  const uint64_t used_before = registry_->used();
  std::unique_ptr<ObjectIndex> old_index = std::move(index_);
  std::unique_ptr<SegmentRegistry> old_registry = std::move(registry_);
  registry_ = std::make_unique<SegmentRegistry>();
  registry_->Recover({"seg-a", "seg-a", 100 * 1024, "inc", ""}, clock_.Now());
  index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
  ASSERT_OK(index_->Recover().status());
  MountWithTier("seg-a", 100 * 1024, 1 << 20);
  EXPECT_TRUE(Present("k0"));
  ASSERT_OK_AND_ASSIGN(ObjectInfo info, index_->Describe("k0"));
  EXPECT_TRUE(info.replicas[0].ssd);
  EXPECT_EQ(registry_->used(), used_before);  // SSD records hold no extent
  EXPECT_OK(index_->CheckInvariants());
}

}  // namespace
}  // namespace tierkv::master

namespace tierkv::master {
namespace {

// Tenants (master/tenants.h): keys in a tenant's namespace, DRAM charged
// to it while its replicas hold DRAM, and its quota and guarantee.
class TenantIndexTest : public IndexTest {
 protected:
  uint64_t Used(const std::string& tenant) { return index_->tenants().UsedBy(tenant); }
  static std::string A(const std::string& key) { return TenantKey("team-a", key); }
  static std::string B(const std::string& key) { return TenantKey("team-b", key); }
};

TEST_F(TenantIndexTest, EqualKeysOfTwoTenantsAreTwoObjects) {
  Mount("seg-a", 1 << 20);
  ASSERT_OK(Put(A("k"), 100));
  ASSERT_OK(Put(B("k"), 200));
  EXPECT_FALSE(Present("k"));  // nor is it the default tenant's
  EXPECT_EQ(index_->GetReplicas({A("k")})[0].size, 100u);
  EXPECT_EQ(index_->GetReplicas({B("k")})[0].size, 200u);
  EXPECT_EQ(Used("team-a"), 100u);
  EXPECT_EQ(Used("team-b"), 200u);
  EXPECT_EQ(Used(""), 0u);
  // A key that holds a NUL cannot spell another tenant's key.
  EXPECT_EQ(TenantKey("", std::string("team-a\0k", 8)), "");
  EXPECT_EQ(TenantKey("team-b", std::string("team-a\0k", 8)), "");
  EXPECT_EQ(TenantOf(A("k")), "team-a");
  EXPECT_EQ(UserKey(A("k")), "k");
  EXPECT_EQ(UserKey("plain"), "plain");
  EXPECT_THAT(index_->PutStart({{"", 10}})[0].status, StatusIs(absl::StatusCode::kInvalidArgument));
  // An index key must name a valid tenant.
  EXPECT_THAT(ValidateIndexKey(std::string("bad/t\0k", 7)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_OK(ValidateIndexKey(A("k")));
  // Removing all of one tenant leaves the other's.
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  const std::string a = "team-a";
  EXPECT_EQ(index_->RemoveAll(false, &a), 1u);
  EXPECT_FALSE(Present(A("k")));
  EXPECT_TRUE(Present(B("k")));
  EXPECT_EQ(Used("team-a"), 0u);
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(TenantIndexTest, ChargeFollowsTheDramReplicasThroughRevokeTimeoutRemoveAndSegmentLoss) {
  const uint32_t a = Mount("seg-a", 1 << 20);
  Mount("seg-b", 1 << 20);
  // Charged at PutStart: bytes x replicas.
  PutItem two;
  two.key = A("two");
  two.size = 1000;
  two.replicas = 2;
  ASSERT_OK(index_->PutStart({two})[0].status);
  EXPECT_EQ(Used("team-a"), 2000u);
  // Refunded on revoke.
  ASSERT_OK(index_->PutRevoke({A("two")})[0]);
  EXPECT_EQ(Used("team-a"), 0u);
  // Refunded when the put times out.
  ASSERT_OK(index_->PutStart({two})[0].status);
  clock_.Advance(options_.put_timeout + absl::Seconds(1));
  index_->Tick();
  EXPECT_EQ(Used("team-a"), 0u);
  EXPECT_FALSE(Present(A("two")));
  // Half released when one of its segments is lost, the rest on removal.
  ASSERT_OK(Put(A("two"), 1000, two));
  EXPECT_EQ(Used("team-a"), 2000u);
  EXPECT_OK(index_->CheckInvariants());
  ASSERT_OK(registry_->Unmount("seg-a").status());
  index_->DropSegments({a});
  EXPECT_EQ(Used("team-a"), 1000u);
  EXPECT_TRUE(Present(A("two")));
  EXPECT_OK(index_->CheckInvariants());
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  ASSERT_OK(index_->Remove({A("two")}, false)[0]);
  EXPECT_EQ(Used("team-a"), 0u);
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(TenantIndexTest, APutOverTheQuotaEvictsTheTenantsOwnOldestThenIsRefusedNamingTheQuota) {
  Mount("seg-a", 1 << 20);
  index_->tenants().SetLimits("team-a", {3000, 0});
  ASSERT_OK(Put(B("other"), 1000));
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(Put(A(absl::StrCat("k", i)), 1000));
    clock_.Advance(absl::Seconds(1));
  }
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  ASSERT_OK(index_->GetReplicas({A("k0")})[0].status);  // k0 is now the most recent
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  // Over by 1000: k1, the tenant's least recently used, makes room.
  ASSERT_OK(Put(A("k3"), 1000));
  EXPECT_FALSE(Present(A("k1")));
  for (const char* k : {"k0", "k2", "k3"}) EXPECT_TRUE(Present(A(k))) << k;
  EXPECT_TRUE(Present(B("other")));  // never another tenant's
  EXPECT_EQ(Used("team-a"), 3000u);
  EXPECT_OK(index_->CheckInvariants());

  // A key the tenant already holds is refused without evicting anything.
  EXPECT_THAT(index_->PutStart({{A("k3"), 1000}})[0].status, StatusIs(absl::StatusCode::kAlreadyExists));
  for (const char* k : {"k0", "k2", "k3"}) EXPECT_TRUE(Present(A(k))) << k;
  // Every object of the tenant leased: nothing to evict, refused whole.
  ASSERT_OK(index_->GetReplicas({A("k0"), A("k2"), A("k3")})[0].status);
  PutStartOut refused = index_->PutStart({{A("k4"), 1000}})[0];
  EXPECT_THAT(refused.status, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(refused.status.message().find("tenant team-a is over its quota of 3000 bytes"), std::string::npos)
      << refused.status;
  EXPECT_FALSE(Present(A("k4")));
  // A put larger than the whole quota evicts nothing.
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  EXPECT_THAT(index_->PutStart({{A("huge"), 4000}})[0].status, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(Present(A("k0")));
  std::vector<TenantUsage> usage = index_->tenants().Snapshot();
  ASSERT_EQ(usage.size(), 2u);
  EXPECT_EQ(usage[0].tenant, "team-a");
  EXPECT_EQ(usage[0].puts_rejected, 2u);
  EXPECT_EQ(usage[0].used_bytes, 3000u);
  EXPECT_EQ(usage[1].tenant, "team-b");
  EXPECT_EQ(usage[1].used_bytes, 1000u);
  EXPECT_OK(index_->CheckInvariants());
  // The quota lifted: the put goes through.
  index_->tenants().SetLimits("team-a", {});
  EXPECT_OK(Put(A("huge"), 4000));
  EXPECT_EQ(Used("team-a"), 7000u);
}

TEST_F(TenantIndexTest, AnotherTenantsPressureNeverEvictsBelowTheGuaranteedBytes) {
  Mount("seg-a", 100 * 1024);
  index_->tenants().SetLimits("team-a", {0, 40 * 1024});
  // team-a's pages are the oldest: plain LRU would take them first.
  for (int i = 0; i < 40; ++i) ASSERT_OK(Put(A(absl::StrCat("a", i)), 1024));
  clock_.Advance(absl::Seconds(1));
  for (int i = 0; i < 55; ++i) {
    ASSERT_OK(Put(B(absl::StrCat("b", i)), 1024));
    clock_.Advance(absl::Seconds(1));
  }
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  ASSERT_OK(Put(B("trigger"), 1024));  // past the high watermark
  EXPECT_LE(registry_->used(), 90u * 1024);
  for (int i = 0; i < 40; ++i) EXPECT_TRUE(Present(A(absl::StrCat("a", i)))) << i;
  EXPECT_EQ(Used("team-a"), 40u * 1024);
  EXPECT_LT(Used("team-b"), 56u * 1024);
  EXPECT_GT(index_->Stats().evictions, 0u);
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(OffloadTest, APutOverTheQuotaMovesTheTenantsOldestReadPagesToSsd) {
  MountWithTier("seg-a", 1 << 20, 1 << 20);
  index_->tenants().SetLimits("team-a", {4 * 1024, 0});
  for (int i = 0; i < 4; ++i) {
    const std::string key = TenantKey("team-a", absl::StrCat("k", i));
    ASSERT_OK(Put(key, 1024));
    ASSERT_OK(index_->GetReplicas({key})[0].status);  // read: the tier admits it
    clock_.Advance(absl::Seconds(1));
  }
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  ASSERT_OK(Put(TenantKey("team-a", "k4"), 1024));
  ASSERT_EQ(ordered_.size(), 1u);
  EXPECT_EQ(ordered_[0].key, TenantKey("team-a", "k0"));
  // Still there, on SSD, and no longer charged.
  EXPECT_TRUE(Present(TenantKey("team-a", "k0")));
  ASSERT_OK_AND_ASSIGN(ObjectInfo info, index_->Describe(TenantKey("team-a", "k0")));
  ASSERT_EQ(info.replicas.size(), 1u);
  EXPECT_TRUE(info.replicas[0].ssd);
  EXPECT_EQ(index_->tenants().UsedBy("team-a"), 4u * 1024);
  EXPECT_OK(index_->CheckInvariants());
}

TEST_F(OffloadTest, AMoveToSsdReleasesTheTenantsCharge) {
  MountWithTier("seg-a", 100 * 1024, 1 << 20);
  for (int i = 0; i < 95; ++i) {
    const std::string key = TenantKey("team-a", absl::StrCat("k", i));
    ASSERT_OK(Put(key, 1024));
    ASSERT_OK(index_->GetReplicas({key})[0].status);
    clock_.Advance(absl::Seconds(1));
  }
  EXPECT_EQ(index_->tenants().UsedBy("team-a"), 95u * 1024);
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  ASSERT_OK(Put(TenantKey("team-a", "trigger"), 1024));
  const uint64_t moved = index_->Stats().offloaded;
  ASSERT_GT(moved, 0u);
  EXPECT_EQ(ordered_[0].key, TenantKey("team-a", "k0"));  // the daemon's record keeps the namespace
  EXPECT_EQ(index_->tenants().UsedBy("team-a"), (96 - moved) * 1024);
  // A staged copy for a read is not charged.
  ASSERT_OK(index_->GetReplicas({TenantKey("team-a", "k0")})[0].status);
  EXPECT_EQ(index_->tenants().UsedBy("team-a"), (96 - moved) * 1024);
  EXPECT_OK(index_->CheckInvariants());
}

}  // namespace
}  // namespace tierkv::master

namespace tierkv::master {
namespace {

// Threads of two tenants put, read and remove under a quota that keeps
// evicting: every charge ends where the objects left say it must.
TEST_F(TenantIndexTest, ConcurrentTenantsKeepTheirChargesExact) {
  Mount("seg-a", 4 << 20);
  Mount("seg-b", 4 << 20);
  index_->tenants().SetLimits("team-a", {256 << 10, 0});
  index_->tenants().SetLimits("team-b", {0, 64 << 10});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([this, t] {
      const std::string tenant = t % 2 == 0 ? "team-a" : "team-b";
      for (int i = 0; i < 300; ++i) {
        const std::string key = TenantKey(tenant, absl::StrCat("t", t, "-", i));
        PutItem item;
        item.key = key;
        item.size = 4096;
        item.replicas = 1 + i % 2;
        if (index_->PutStart({item})[0].status.ok()) {
          if (i % 7 == 0) {
            index_->PutRevoke({key});
          } else {
            index_->PutEnd({key});
          }
        }
        index_->GetReplicas({key});
        if (i % 5 == 0) index_->Remove({key}, /*force=*/true);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LE(Used("team-a"), 256u << 10);
  EXPECT_GT(Used("team-b"), 0u);
  EXPECT_OK(index_->CheckInvariants());
}

}  // namespace
}  // namespace tierkv::master
