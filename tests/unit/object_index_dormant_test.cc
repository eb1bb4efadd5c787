// A put over an object whose only copy waits on an absent daemon (the
// master restarted, or failed over, and the daemon has not re-mounted):
// the put replaces the object only once it commits. One that fails, is
// revoked, times out, finds no place, or outlives its master leaves the
// object as it was, in the index and in the store, and readable once the
// daemon re-mounts. Until then the key reads as absent (Exists,
// PrefixMatch), which is what invites such puts.
#include "absl/strings/str_cat.h"
#include "proto/master.pb.h"
#include "tests/unit/object_index_fixture.h"

namespace tierkv::master {
namespace {

using ::tierkv::testing::StatusIs;

constexpr uint64_t kCapacity = 64 * 1024;
constexpr uint64_t kOldSize = 1000;
constexpr uint64_t kNewSize = 2000;

class IndexDormantTest : public IndexTest {
 protected:
  // "k" on segment a, then a master restart: a comes back RECOVERING (its
  // daemon is away), b's daemon re-mounts at once.
  void SetUp() override {
    IndexTest::SetUp();
    Mount("a", kCapacity);
    ASSERT_OK(Put("k", kOldSize));
    LookupOut old = index_->GetReplicas({"k"})[0];
    ASSERT_OK(old.status);
    old_put_id_ = old.put_id;
    old_offset_ = old.replicas.at(0).offset;
    clock_.Advance(options_.lease_ttl + absl::Seconds(1));  // its read lease is over
    Restart();
    Mount("b", kCapacity);
    ASSERT_FALSE(Present("k")) << "a's daemon is away";
  }

  // A new registry and index over the same store, as a restarted (or newly
  // promoted) master has: both segments recovering until re-mounted.
  void Restart() {
    index_.reset();
    registry_ = std::make_unique<SegmentRegistry>();
    registry_->Recover({"a", "a", kCapacity, "inc", ""}, clock_.Now());
    registry_->Recover({"b", "b", kCapacity, "inc", ""}, clock_.Now());
    index_ = std::make_unique<ObjectIndex>(options_, registry_.get(), store_.get(), &clock_);
    ASSERT_OK(index_->Recover().status());
  }

  // The segment the store's record of "k" names ("" without a record).
  std::string RecordedSegment() {
    absl::StatusOr<std::string> value = store_->Get("o/k");
    v1::ObjectRecord rec;
    if (!value.ok() || !rec.ParseFromString(*value) || rec.replicas_size() == 0) return "";
    return rec.replicas(0).segment();
  }

  // a's daemon re-mounts; "k" reads back as it was before the put over it.
  void ExpectTheOldObjectBack() {
    Mount("a", kCapacity);
    LookupOut got = index_->GetReplicas({"k"})[0];
    ASSERT_OK(got.status) << "the object was lost to a put that never committed";
    EXPECT_EQ(got.size, kOldSize);
    EXPECT_EQ(got.put_id, old_put_id_);
    ASSERT_EQ(got.replicas.size(), 1u);
    EXPECT_EQ(got.replicas[0].segment, "a");
    EXPECT_EQ(got.replicas[0].offset, old_offset_);
    EXPECT_OK(index_->CheckInvariants());
  }

  uint64_t old_put_id_ = 0;
  uint64_t old_offset_ = 0;
};

TEST_F(IndexDormantTest, ARevokedPutLeavesTheObject) {
  std::vector<PutStartOut> started = index_->PutStart({{"k", kNewSize}});
  ASSERT_OK(started[0].status);
  ASSERT_EQ(started[0].replicas.size(), 1u);
  EXPECT_EQ(started[0].replicas[0].segment, "b");
  EXPECT_EQ(RecordedSegment(), "a") << "the object's record was erased before the new value was committed";
  EXPECT_OK(index_->CheckInvariants());
  ASSERT_OK(index_->PutRevoke({"k"})[0]);
  EXPECT_EQ(RecordedSegment(), "a");
  EXPECT_OK(index_->CheckInvariants());
  ExpectTheOldObjectBack();
}

TEST_F(IndexDormantTest, APutThatTimesOutLeavesTheObject) {
  ASSERT_OK(index_->PutStart({{"k", kNewSize}})[0].status);
  clock_.Advance(options_.put_timeout + absl::Seconds(1));
  // A new put reclaims the timed-out one and sets the object aside again.
  ASSERT_OK(index_->PutStart({{"k", kNewSize}})[0].status);
  EXPECT_OK(index_->CheckInvariants());
  clock_.Advance(options_.put_timeout + absl::Seconds(1));
  index_->Tick();  // reclaims that one too
  EXPECT_EQ(index_->Stats().pending, 0u);
  EXPECT_EQ(RecordedSegment(), "a");
  EXPECT_OK(index_->CheckInvariants());
  ExpectTheOldObjectBack();
}

TEST_F(IndexDormantTest, APutThatFindsNoPlaceLeavesTheObject) {
  Restart();  // b's daemon is away too: no segment is live
  EXPECT_THAT(index_->PutStart({{"k", kNewSize}})[0].status, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(RecordedSegment(), "a") << "a put with no place for its value erased the object";
  ExpectTheOldObjectBack();
}

TEST_F(IndexDormantTest, AMasterRestartDuringThePutBringsTheObjectBack) {
  ASSERT_OK(index_->PutStart({{"k", kNewSize}})[0].status);
  Restart();
  ExpectTheOldObjectBack();
}

TEST_F(IndexDormantTest, ACommittedPutReplacesTheObjectAndFreesItsExtent) {
  ASSERT_OK(index_->PutStart({{"k", kNewSize}})[0].status);
  ASSERT_OK(index_->PutEnd({"k"})[0]);
  EXPECT_EQ(RecordedSegment(), "b");
  EXPECT_EQ(index_->Stats().objects, 1u);
  EXPECT_OK(index_->CheckInvariants());
  Mount("a", kCapacity);
  LookupOut got = index_->GetReplicas({"k"})[0];
  ASSERT_OK(got.status);
  EXPECT_EQ(got.size, kNewSize);
  EXPECT_NE(got.put_id, old_put_id_);
  ASSERT_EQ(got.replicas.size(), 1u);
  EXPECT_EQ(got.replicas[0].segment, "b");
  const uint32_t a = *registry_->IdOf("a");
  EXPECT_EQ(registry_->UsedById()[a], 0u) << "the replaced object's extent stayed allocated";
  EXPECT_OK(index_->CheckInvariants());
}

// The decision this suite documents: a key that cannot be read now is
// absent to Exists and PrefixMatch, and the put that answer invites is
// the safe one above.
TEST_F(IndexDormantTest, ExistsAndPrefixMatchReportTheObjectOnlyOnceItsDaemonIsBack) {
  ASSERT_OK(Put("j", 100));  // on b
  EXPECT_FALSE(Present("k"));
  EXPECT_EQ(index_->PrefixMatch({"k", "j"}), 0u);
  ExpectTheOldObjectBack();
  EXPECT_TRUE(Present("k"));
  EXPECT_EQ(index_->PrefixMatch({"k", "j"}), 2u);
}

TEST_F(IndexDormantTest, AForcedRemoveOfThePutRemovesTheObjectItSetAside) {
  ASSERT_OK(index_->PutStart({{"k", kNewSize}})[0].status);
  EXPECT_THAT(index_->Remove({"k"}, /*force=*/false)[0], StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK(index_->Remove({"k"}, /*force=*/true)[0]);
  EXPECT_EQ(RecordedSegment(), "");
  EXPECT_OK(index_->CheckInvariants());
  Mount("a", kCapacity);
  EXPECT_FALSE(Present("k"));
  EXPECT_EQ(index_->Stats().objects, 0u);
  EXPECT_OK(index_->CheckInvariants());
}

// A member of a group put over, the put revoked: the group comes back
// whole. (Committed, the put would end the group, as removing a member does.)
TEST_F(IndexDormantTest, ARevokedPutOverAGroupMemberLeavesTheGroupWhole) {
  Restart();
  Mount("a", kCapacity);
  ASSERT_OK(index_->PutStart({{"g1", 10, 1, "", "g"}, {"g2", 10, 1, "", "g"}})[0].status);
  ASSERT_OK(index_->PutEnd({"g1", "g2"})[0]);
  Restart();
  Mount("b", kCapacity);
  ASSERT_OK(index_->PutStart({{"g1", 20}})[0].status);
  ASSERT_OK(index_->PutRevoke({"g1"})[0]);
  EXPECT_OK(index_->CheckInvariants());
  Mount("a", kCapacity);
  EXPECT_TRUE(Present("g1") && Present("g2"));
  EXPECT_EQ(index_->Describe("g1")->size, 10u);
  EXPECT_OK(index_->CheckInvariants());
}

}  // namespace
}  // namespace tierkv::master
