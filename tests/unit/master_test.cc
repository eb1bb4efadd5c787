#include "master/master.h"

#include "absl/strings/str_cat.h"
#include "tests/support/status_matchers.h"

namespace tierkv::master {
namespace {

using ::tierkv::testing::StatusIs;

// Lets two Master instances share one store, as a restart does.
class SharedStore final : public IndexStore {
 public:
  explicit SharedStore(IndexStore* base) : base_(base) {}
  absl::Status Write(const std::vector<Mutation>& b) override { return base_->Write(b); }
  absl::StatusOr<std::string> Get(const std::string& k) override { return base_->Get(k); }
  absl::Status Scan(const std::string& p,
                    const std::function<bool(absl::string_view, absl::string_view)>& fn) override {
    return base_->Scan(p, fn);
  }
  absl::Status Flush() override { return base_->Flush(); }

 private:
  IndexStore* base_;
};

class MasterTest : public ::testing::Test {
 protected:
  std::unique_ptr<Master> NewMaster() {
    MasterOptions o;
    o.segment_ttl = absl::Seconds(10);
    auto m = Master::Create(o, std::make_unique<SharedStore>(store_.get()), &clock_);
    EXPECT_TRUE(m.ok()) << m.status();
    return std::move(*m);
  }
  SegmentSpec Seg(const std::string& name, const std::string& inc = "i1") {
    return {name, "host-" + name, 1 << 20, inc, "tcp://" + name};
  }
  bool Present(Master& m, const std::string& key) { return m.index().Exists({key})[0]; }
  absl::Status Put(Master& m, const std::string& key) {
    auto s = m.index().PutStart({{key, 1000}});
    if (!s[0].status.ok()) return s[0].status;
    return m.index().PutEnd({key})[0];
  }

  ManualClock clock_;
  std::unique_ptr<IndexStore> store_ = NewMemStore();
};

TEST_F(MasterTest, SegmentThatStopsHeartbeatingIsDroppedWithItsObjects) {
  auto m = NewMaster();
  ASSERT_OK(m->Mount({Seg("a")})[0]);
  ASSERT_OK(m->Mount({Seg("b")})[0]);
  ASSERT_OK(Put(*m, "k1"));
  std::string seg = m->index().GetReplicas({"k1"})[0].replicas[0].segment;
  std::string other = seg == "a" ? "b" : "a";
  for (int i = 0; i < 3; ++i) {
    clock_.Advance(absl::Seconds(6));
    // Only the other segment heartbeats.
    EXPECT_TRUE(m->Heartbeat({Seg(other)}, "").remount.empty());
    m->Tick();
  }
  EXPECT_FALSE(Present(*m, "k1"));
  EXPECT_EQ(m->registry().Snapshot().size(), 1u);
  // The silent daemon is told to mount again, and doing so works.
  HeartbeatResult hb = m->Heartbeat({Seg(seg)}, "");
  ASSERT_EQ(hb.remount, std::vector<std::string>{seg});
  ASSERT_OK(m->Mount({Seg(seg)})[0]);
  EXPECT_FALSE(Present(*m, "k1"));  // nothing comes back as a stale hit
  EXPECT_OK(m->index().CheckInvariants());
}

TEST_F(MasterTest, RestartKeepsObjectsOfSegmentsThatComeBack) {
  {
    auto m = NewMaster();
    ASSERT_OK(m->Mount({Seg("a"), Seg("b")})[0]);
    for (int i = 0; i < 50; ++i) ASSERT_OK(Put(*m, absl::StrCat("k", i)));
    ASSERT_OK(m->PutMetadata("desc/a", "segment-a-descriptor"));
  }
  auto m = NewMaster();
  // Recovering segments serve nothing until they re-mount.
  EXPECT_FALSE(Present(*m, "k0"));
  EXPECT_EQ(m->Heartbeat({Seg("a")}, "").remount, std::vector<std::string>{"a"});
  ASSERT_OK(m->Mount({Seg("a")})[0]);                 // same incarnation: restored
  ASSERT_OK(m->Mount({Seg("b", "restarted")})[0]);    // new incarnation: its objects are gone
  int present = 0;
  for (int i = 0; i < 50; ++i) present += Present(*m, absl::StrCat("k", i));
  EXPECT_GT(present, 0);
  EXPECT_LT(present, 50);
  for (int i = 0; i < 50; ++i) {
    auto r = m->index().GetReplicas({absl::StrCat("k", i)})[0];
    if (r.status.ok()) {
      EXPECT_EQ(r.replicas[0].segment, "a");
    }
  }
  EXPECT_EQ(*m->GetMetadata("desc/a"), "segment-a-descriptor");
  EXPECT_OK(m->index().CheckInvariants());
}

TEST_F(MasterTest, RecoveringSegmentThatNeverReturnsIsDropped) {
  {
    auto m = NewMaster();
    ASSERT_OK(m->Mount({Seg("a")})[0]);
    ASSERT_OK(Put(*m, "k"));
  }
  auto m = NewMaster();
  clock_.Advance(absl::Seconds(11));
  m->Tick();
  EXPECT_TRUE(m->registry().Snapshot().empty());
  EXPECT_EQ(m->index().Stats().objects, 0u);
  // And a third start finds nothing stale.
  auto again = NewMaster();
  EXPECT_TRUE(again->registry().Snapshot().empty());
  EXPECT_EQ(again->index().Stats().objects, 0u);
}

TEST_F(MasterTest, MetadataKeyspace) {
  auto m = NewMaster();
  EXPECT_THAT(m->GetMetadata("x"), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(m->PutMetadata("x", std::string("\0bin\xff", 5)));
  EXPECT_EQ(*m->GetMetadata("x"), std::string("\0bin\xff", 5));
  ASSERT_OK(m->DeleteMetadata("x"));
  EXPECT_THAT(m->DeleteMetadata("x"), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(MasterTest, MountValidation) {
  auto m = NewMaster();
  EXPECT_THAT(m->Mount({{"", "h", 1 << 20, "i", ""}})[0], StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(m->Mount({{"z", "h", 0, "i", ""}})[0], StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(m->Unmount({"nope"})[0], StatusIs(absl::StatusCode::kNotFound));
}

TEST(QueryStatsTest, CountsPerClientWithASlidingWindowAndABoundedClientSet) {
  QueryStats q(nullptr, absl::Seconds(10), /*max_clients=*/2);
  absl::Time t = absl::FromUnixSeconds(1000);
  q.Record("a", QueryStats::kPrefix, 10, 4, t);
  q.Record("b", QueryStats::kPrefix, 5, 5, t + absl::Seconds(6));
  q.Record("c", QueryStats::kPrefix, 3, 0, t + absl::Seconds(6));  // past the cap: "other"
  std::vector<QueryStats::Row> rows = q.Snapshot(t + absl::Seconds(6));
  ASSERT_EQ(rows.size(), 4u);  // all, a, b, other
  EXPECT_EQ(rows[0].client, "all");
  EXPECT_EQ(rows[0].total[QueryStats::kPrefix].asked, 18u);
  EXPECT_EQ(rows[0].total[QueryStats::kPrefix].found, 9u);
  EXPECT_EQ(rows[3].client, "other");
  // Ten seconds after a's lookups they have left the window, not the total.
  rows = q.Snapshot(t + absl::Seconds(11));
  EXPECT_EQ(rows[1].client, "a");
  EXPECT_EQ(rows[1].total[QueryStats::kPrefix].asked, 10u);
  EXPECT_EQ(rows[1].window[QueryStats::kPrefix].asked, 0u);
  EXPECT_EQ(rows[2].window[QueryStats::kPrefix].found, 5u);
  EXPECT_EQ(rows[0].window[QueryStats::kPrefix].asked, 8u);
}

// Two daemons on different nodes that picked one name (both advertised
// 0.0.0.0:8800, say) must not replace each other; a restart on the same
// host does, and so does another host once the first has gone silent.
TEST_F(MasterTest, NameHeldByALiveDaemonOfAnotherHostIsRefused) {
  auto m = NewMaster();
  ASSERT_OK(m->Mount({{"0.0.0.0:8800", "node1", 1 << 20, "i1", ""}})[0]);
  ASSERT_OK(Put(*m, "k1"));
  EXPECT_THAT(m->Mount({{"0.0.0.0:8800", "node2", 1 << 20, "i2", ""}})[0],
              StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_TRUE(Present(*m, "k1"));  // the first daemon's objects stay
  // The same host with a new incarnation is a restart: it replaces.
  ASSERT_OK(m->Mount({{"0.0.0.0:8800", "node1", 1 << 20, "i3", ""}})[0]);
  EXPECT_FALSE(Present(*m, "k1"));
  // Silent past the TTL, the name is free for another host.
  clock_.Advance(absl::Seconds(11));
  EXPECT_OK(m->Mount({{"0.0.0.0:8800", "node2", 1 << 20, "i4", ""}})[0]);
  EXPECT_EQ(m->registry().Snapshot().size(), 1u);
  EXPECT_EQ(m->registry().Snapshot()[0].spec.host, "node2");
}

}  // namespace
}  // namespace tierkv::master
