// The object index offloading evicted pages to SSD tiers: staging extents,
// unread pages, failed and unanswering tiers, a restart, and tenants'
// pages moved there.
#include "tests/unit/object_index_fixture.h"

#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"

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

  void MountWithTier(const std::string& name, uint64_t capacity, uint64_t ssd_capacity,
                     const std::string& data_key = "") {
    bool restored;
    std::optional<uint32_t> replaced;
    SegmentSpec spec{name, name, capacity, "inc", "", "127.0.0.1:9", ssd_capacity, 0};
    spec.data_key = data_key;
    ASSERT_OK(registry_->Mount(spec, clock_.Now(), &restored, &replaced).status());
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

// On a daemon with data grants a reader holds the master's leave to stage
// into its extent until its lease ends: a give-back ends its count, but
// the extent is not handed to another put before the lease's end.
TEST_F(OffloadTest, AStagedCopyUnderGrantsKeepsItsExtentToTheLeasesEnd) {
  MountWithTier("seg-a", 100 * 1024, 1 << 20, std::string(32, 'k'));
  FillAndEvict(/*read=*/true);
  clock_.Advance(options_.lease_ttl + absl::Seconds(1));
  index_->EvictTo(0);
  index_->Tick();
  ASSERT_EQ(registry_->used(), 0u);
  LookupOut a = index_->GetReplicas({"k0"})[0];
  ASSERT_TRUE(a.replicas[0].stage);
  ASSERT_NE(a.lease_token, 0u);
  EXPECT_EQ(index_->ReleaseLeases({{"k0", a.lease_token, absl::ToUnixMillis(a.lease_expiry)}}), 1u);
  clock_.Advance(absl::Milliseconds(10));
  index_->EvictTo(0);
  EXPECT_EQ(registry_->used(), 1024u);  // held: the reader's leave lasts to the lease's end
  clock_.Advance(options_.stage_lease);
  index_->EvictTo(0);
  clock_.Advance(options_.stage_grace + absl::Milliseconds(1));
  index_->Tick();
  EXPECT_EQ(registry_->used(), 0u);
  EXPECT_TRUE(Present("k0"));
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
