// Tenants in the object index: keys in a tenant's namespace, DRAM charged
// while replicas hold it, quotas and guarantees.
#include "tests/unit/object_index_fixture.h"

#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tierkv::master {
namespace {

using ::tierkv::testing::StatusIs;

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
