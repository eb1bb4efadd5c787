// Leases on reads: cached reads reported later, the short lease under
// memory pressure, counted reads given back, a forced remove of a leased
// object, and the leased count.
#include "tests/unit/object_index_fixture.h"

#include "absl/strings/str_cat.h"

namespace tierkv::master {
namespace {

using ::tierkv::testing::StatusIs;

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
  EXPECT_NE(b.lease_token, a.lease_token);  // one token per read
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

// A reader holding a valid token for one read cannot end another's lease:
// its token gives back once, and no token is made from it by changing its
// read number, its tag, its expiry or its key.
TEST_F(IndexTest, ATokenGivesBackOnlyItsOwnReadOnce) {
  Mount("seg-a", 20 * 1024);
  ASSERT_OK(Put("held", 1024));
  ASSERT_OK(index_->GetReplicas({"held"})[0].status);
  index_->EvictTo(0);  // pressure: every read is counted
  ASSERT_OK(Put("k", 1024));
  ASSERT_OK(Put("other", 1024));
  LookupOut mine = index_->GetReplicas({"k"})[0];
  LookupOut victim = index_->GetReplicas({"k"})[0];
  LookupOut elsewhere = index_->GetReplicas({"other"})[0];
  ASSERT_NE(mine.lease_token, 0u);
  ASSERT_NE(victim.lease_token, 0u);
  const int64_t expiry = absl::ToUnixMillis(mine.lease_expiry);
  auto give_back = [&](const std::string& key, uint64_t token, int64_t expiry_ms) {
    return index_->ReleaseLeases({{key, token, expiry_ms}});
  };
  EXPECT_EQ(give_back("k", mine.lease_token, expiry), 1u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(give_back("k", mine.lease_token, expiry), 0u) << i;
  for (int bit = 0; bit < 64; ++bit) {
    EXPECT_EQ(give_back("k", mine.lease_token ^ (uint64_t{1} << bit), expiry), 0u) << bit;
    EXPECT_EQ(give_back("k", victim.lease_token ^ (uint64_t{1} << bit), expiry), 0u) << bit;
    // The read number and the expiry each have their own bits in the tag:
    // no change to one is made up by the same change to the other.
    if (bit < 63) EXPECT_EQ(give_back("k", mine.lease_token ^ (uint64_t{1} << bit), expiry ^ (int64_t{1} << bit)), 0u) << bit;
  }
  EXPECT_EQ(give_back("k", victim.lease_token, expiry + 1), 0u);   // its expiry is part of it
  EXPECT_EQ(give_back("k", elsewhere.lease_token, expiry), 0u);    // another key's read
  EXPECT_EQ(give_back("other", victim.lease_token, expiry), 0u);
  index_->EvictTo(0);
  EXPECT_TRUE(Present("k"));  // the victim's lease holds
  EXPECT_EQ(give_back("k", victim.lease_token, absl::ToUnixMillis(victim.lease_expiry)), 1u);
  index_->EvictTo(0);
  EXPECT_FALSE(Present("k"));
  EXPECT_EQ(index_->Stats().leases_released, 2u);
  // Past their leases, given-back tokens are forgotten and stay refused.
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  EXPECT_EQ(give_back("other", elsewhere.lease_token, absl::ToUnixMillis(elsewhere.lease_expiry)), 0u);
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

// On a segment whose daemon checks extent grants, a reader holds a grant
// to read its extent until its lease ends: a counted read given back early
// keeps its lease there, and a remove does not hand the extent to another
// put before the lease's end (base/extent_grant.h). Elsewhere the same
// give-back and remove free it at once.
TEST_F(IndexTest, AGivenBackReadUnderGrantsKeepsItsExtentToTheLeasesEnd) {
  // Half full with one object, so no tick evicts it; a put of the whole
  // segment finds room only once that object's extent is free.
  bool restored;
  std::optional<uint32_t> replaced;
  SegmentSpec spec{"seg-a", "seg-a", 8192, "inc", ""};
  spec.data_key = std::string(32, 'k');
  ASSERT_OK(registry_->Mount(spec, clock_.Now(), &restored, &replaced).status());
  auto whole = [&](const std::string& key) { return index_->PutStart({{key, 8192}})[0].status; };
  auto read_give_back_remove = [&](const std::string& key) {
    ASSERT_OK(Put(key, 4096));
    LookupOut read = index_->GetReplicas({key}, false, /*counted=*/true)[0];
    ASSERT_OK(read.status);
    ASSERT_NE(read.lease_token, 0u);
    EXPECT_EQ(index_->ReleaseLeases({{key, read.lease_token, absl::ToUnixMillis(read.lease_expiry)}}), 1u);
    ASSERT_OK(index_->Remove({key}, /*force=*/true)[0]);
    index_->Tick();
  };
  read_give_back_remove("k1");
  EXPECT_THAT(whole("w1"), StatusIs(absl::StatusCode::kResourceExhausted));
  clock_.Advance(options_.lease_ttl + absl::Milliseconds(200));
  index_->Tick();
  ASSERT_OK(whole("w1"));
  ASSERT_OK(index_->CheckInvariants());

  Build(options_);
  Mount("seg-b", 8192);
  read_give_back_remove("k2");
  ASSERT_OK(whole("w2"));
  ASSERT_OK(index_->CheckInvariants());
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
