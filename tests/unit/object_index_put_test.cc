// The object index's put path: a replica list, puts, reads and removes,
// bad requests, where replicas go, timed-out and revoked puts, prefix
// matches, groups, and a dropped segment.
#include "tests/unit/object_index_fixture.h"

#include "absl/strings/str_cat.h"

namespace tierkv::master {
namespace {

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

}  // namespace
}  // namespace tierkv::master
