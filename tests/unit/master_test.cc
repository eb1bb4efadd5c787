#include "master/master.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "master/rpc_handlers.h"
#include "tests/support/process.h"
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

// Put ids (the trailer's, client/internal/trailer_arena.h) are kept with
// the objects, and a restarted master hands out none its predecessor did.
TEST_F(MasterTest, RestartKeepsObjectsOfSegmentsThatComeBack) {
  absl::flat_hash_map<std::string, uint64_t> put_ids;
  {
    auto m = NewMaster();
    ASSERT_OK(m->Mount({Seg("a"), Seg("b")})[0]);
    for (int i = 0; i < 50; ++i) ASSERT_OK(Put(*m, absl::StrCat("k", i)));
    for (int i = 0; i < 50; ++i) {
      ASSERT_OK_AND_ASSIGN(ObjectInfo info, m->index().Describe(absl::StrCat("k", i)));
      EXPECT_NE(info.put_id, 0u);
      put_ids[absl::StrCat("k", i)] = info.put_id;
    }
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
      EXPECT_EQ(r.put_id, put_ids[absl::StrCat("k", i)]);
    }
  }
  absl::flat_hash_set<uint64_t> distinct;
  for (const auto& [key, id] : put_ids) distinct.insert(id);
  EXPECT_EQ(distinct.size(), put_ids.size());
  ASSERT_OK(Put(*m, "after"));
  ASSERT_OK_AND_ASSIGN(ObjectInfo after, m->index().Describe("after"));
  EXPECT_FALSE(distinct.contains(after.put_id));
  EXPECT_NE(after.put_id, 0u);
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

// SSD replicas across a daemon restart: a segment whose daemon names its
// tier (ssd_id) keeps its SSD replicas through a new incarnation, a
// stop to restart and missed heartbeats, for the grace; the daemon's
// listing confirms them and drops what the tier lacks.
class MasterSsdTest : public MasterTest {
 protected:
  std::unique_ptr<Master> NewSsdMaster() {
    MasterOptions o;
    o.segment_ttl = absl::Seconds(10);
    o.ssd_grace = absl::Minutes(5);
    o.index.offload = [this](const std::string&, const std::vector<TierOrder>& orders, absl::Duration) {
      offloads_ += orders.size();
      return std::vector<absl::Status>(orders.size(), absl::OkStatus());
    };
    auto m = Master::Create(o, std::make_unique<SharedStore>(store_.get()), &clock_);
    EXPECT_TRUE(m.ok()) << m.status();
    return std::move(*m);
  }
  static SegmentSpec Tiered(const std::string& inc, const std::string& ssd_id = "tier-1") {
    SegmentSpec s{"a", "host-a", 64 * 1024, inc, "tcp://a", "127.0.0.1:9", 1 << 20, 0};
    s.ssd_id = ssd_id;
    return s;
  }
  static SsdRecords Listing(const std::string& inc, uint64_t listing,
                            std::vector<std::pair<std::string, uint64_t>> present, bool complete = true) {
    SsdRecords r;
    r.segment = "a";
    r.incarnation = inc;
    r.listing = listing;
    r.present = std::move(present);
    r.complete = complete;
    return r;
  }
  // k0..k9 (1 KiB each, read once) offloaded to segment a's SSD tier.
  void OffloadTen(Master& m, const std::string& inc) {
    offloads_ = 0;
    ASSERT_OK(m.Mount({Tiered(inc)})[0]);
    ASSERT_OK(m.SyncSsd(Listing(inc, 1, {})).status());  // an empty tier: offloads may start
    for (int i = 0; i < 10; ++i) {
      std::string k = absl::StrCat("k", i);
      auto s = m.index().PutStart({{k, 1024}});
      ASSERT_OK(s[0].status);
      ASSERT_OK(m.index().PutEnd({k})[0]);
      ASSERT_OK(m.index().GetReplicas({k})[0].status);
    }
    clock_.Advance(absl::Seconds(6));  // past the read leases
    m.index().EvictTo(0);
    ASSERT_EQ(offloads_, 10u);
    ASSERT_EQ(m.registry().used(), 0u);
  }
  bool Held(Master& m, const std::string& key) { return m.index().Describe(key).ok(); }
  std::vector<std::pair<std::string, uint64_t>> AllTen() {
    std::vector<std::pair<std::string, uint64_t>> out;
    for (int i = 0; i < 10; ++i) out.emplace_back(absl::StrCat("k", i), 1024);
    return out;
  }

  size_t offloads_ = 0;
};

TEST_F(MasterSsdTest, ANewIncarnationWithTheSameTierKeepsItsSsdReplicasAsItsListingSays) {
  auto m = NewSsdMaster();
  OffloadTen(*m, "i1");
  // The daemon restarts: a new incarnation naming the same tier.
  ASSERT_OK(m->Mount({Tiered("i2")})[0]);
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(Present(*m, absl::StrCat("k", i))) << i;
  uint32_t id = *m->registry().IdOf("a");
  EXPECT_FALSE(m->registry().TierFor(id, 1).has_value());  // no offloads before the listing
  // A listing from an old incarnation is refused.
  EXPECT_THAT(m->SyncSsd(Listing("i1", 7, AllTen())).status(), StatusIs(absl::StatusCode::kFailedPrecondition));

  // The listing, in two batches: k0..k7 as they were, k8 with another
  // size, k9 missing, and a record the index never had.
  const std::vector<std::pair<std::string, uint64_t>> all = AllTen();
  std::vector<std::pair<std::string, uint64_t>> first(all.begin(), all.begin() + 4);
  ASSERT_OK_AND_ASSIGN(SsdRecordsResult r1, m->SyncSsd(Listing("i2", 2, first, /*complete=*/false)));
  EXPECT_EQ(r1.confirmed, 4u);
  EXPECT_TRUE(r1.unknown.empty());
  std::vector<std::pair<std::string, uint64_t>> rest = {{"k4", 1024}, {"k5", 1024}, {"k6", 1024},
                                                        {"k7", 1024}, {"k8", 999},  {"stray", 1024}};
  ASSERT_OK_AND_ASSIGN(SsdRecordsResult r2, m->SyncSsd(Listing("i2", 2, rest)));
  EXPECT_EQ(r2.confirmed, 4u);
  EXPECT_EQ(r2.dropped, 2u);  // k8 (its size), k9 (not listed)
  std::sort(r2.unknown.begin(), r2.unknown.end());
  EXPECT_EQ(r2.unknown, (std::vector<std::string>{"k8", "stray"}));
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(Present(*m, absl::StrCat("k", i))) << i;
  EXPECT_FALSE(Held(*m, "k8"));
  EXPECT_FALSE(Held(*m, "k9"));
  EXPECT_TRUE(m->registry().TierFor(id, 1).has_value());
  // The last batch sent again (its answer lost) changes nothing.
  ASSERT_OK_AND_ASSIGN(SsdRecordsResult again, m->SyncSsd(Listing("i2", 2, rest)));
  EXPECT_EQ(again.dropped, 0u);
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(Present(*m, absl::StrCat("k", i))) << i;
  // A read stages the record into the new segment's DRAM.
  LookupOut got = m->index().GetReplicas({"k0"})[0];
  ASSERT_OK(got.status);
  ASSERT_EQ(got.replicas.size(), 1u);
  EXPECT_TRUE(got.replicas[0].stage);
  EXPECT_EQ(got.replicas[0].segment_id, id);

  // Records the tier drops later are reported, and leave the index.
  SsdRecords gone = Listing("i2", 0, {}, false);
  gone.gone = {"k0", "k1", "nope"};
  ASSERT_OK_AND_ASSIGN(SsdRecordsResult r3, m->SyncSsd(gone));
  EXPECT_EQ(r3.dropped, 2u);
  EXPECT_FALSE(Held(*m, "k0"));  // its staged copy went with it
  EXPECT_FALSE(Held(*m, "k1"));
  clock_.Advance(absl::Seconds(10));
  m->Tick();  // the staged copy's extent comes back after the grace
  EXPECT_EQ(m->registry().used(), 0u);
  EXPECT_OK(m->index().CheckInvariants());
}

TEST_F(MasterSsdTest, AnotherTierOrNoneDropsTheReplicas) {
  auto m = NewSsdMaster();
  OffloadTen(*m, "i1");
  ASSERT_OK(m->Mount({Tiered("i2", "tier-2")})[0]);  // the disk was replaced
  EXPECT_EQ(m->index().Stats().objects, 0u);
  OffloadTen(*m, "i3");
  ASSERT_OK(m->Mount({Tiered("i4", "")})[0]);  // the tier failed to open
  EXPECT_EQ(m->index().Stats().objects, 0u);
  EXPECT_OK(m->index().CheckInvariants());
}

TEST_F(MasterSsdTest, StoppedOrSilentDaemonsKeepTheirSsdReplicasForTheGrace) {
  auto m = NewSsdMaster();
  OffloadTen(*m, "i1");
  // A DRAM object besides: it leaves with the process.
  ASSERT_OK(m->index().PutStart({{"dram", 1024}})[0].status);
  ASSERT_OK(m->index().PutEnd({"dram"})[0]);

  // A graceful stop to restart: held, not served.
  ASSERT_OK(m->Unmount({"a"}, /*keep_ssd=*/true)[0]);
  EXPECT_FALSE(Held(*m, "dram"));
  EXPECT_TRUE(Held(*m, "k0"));
  EXPECT_FALSE(Present(*m, "k0"));
  EXPECT_THAT(m->index().GetReplicas({"k0"})[0].status, StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(m->registry().capacity(), 0u);  // a dormant segment lends nothing
  ASSERT_EQ(m->registry().Snapshot().size(), 1u);
  EXPECT_STREQ(m->registry().Snapshot()[0].state(), "dormant");
  // A put of a held key replaces what the absent daemon holds.
  ASSERT_OK(m->Mount({SegmentSpec{"b", "host-b", 64 * 1024, "j1", "tcp://b"}})[0]);
  ASSERT_OK(m->index().PutStart({{"k9", 2048}})[0].status);
  ASSERT_OK(m->index().PutEnd({"k9"})[0]);
  ASSERT_OK(m->Mount({Tiered("i2")})[0]);
  ASSERT_OK(m->SyncSsd(Listing("i2", 1, AllTen())).status());
  for (int i = 0; i < 9; ++i) EXPECT_TRUE(Present(*m, absl::StrCat("k", i))) << i;
  ASSERT_OK_AND_ASSIGN(ObjectInfo k9, m->index().Describe("k9"));
  EXPECT_EQ(k9.size, 2048u);
  EXPECT_EQ(k9.replicas[0].segment, "b");

  // Heartbeats stop: past the TTL the segment turns dormant, its SSD
  // replicas held; a restart within the grace takes them back.
  for (int i = 0; i < 3; ++i) {
    clock_.Advance(absl::Seconds(6));
    (void)m->Heartbeat({SegmentSpec{"b", "host-b", 64 * 1024, "j1", "tcp://b"}}, "");
    m->Tick();
  }
  EXPECT_TRUE(Held(*m, "k0"));
  EXPECT_FALSE(Present(*m, "k0"));
  EXPECT_EQ(m->Heartbeat({Tiered("i2")}, "").remount, std::vector<std::string>{"a"});
  ASSERT_OK(m->Mount({Tiered("i3")})[0]);
  EXPECT_TRUE(Present(*m, "k0"));

  // Past the grace they leave.
  for (int i = 0; i < 60; ++i) {
    clock_.Advance(absl::Seconds(6));
    (void)m->Heartbeat({SegmentSpec{"b", "host-b", 64 * 1024, "j1", "tcp://b"}}, "");
    m->Tick();
  }
  EXPECT_FALSE(Held(*m, "k0"));
  EXPECT_FALSE(m->registry().IdOf("a").has_value());
  EXPECT_TRUE(Present(*m, "k9"));
  EXPECT_OK(m->index().CheckInvariants());
}

TEST_F(MasterSsdTest, SsdReplicasOfADaemonThatRestartedWhileTheMasterWasDownComeBack) {
  {
    auto m = NewSsdMaster();
    OffloadTen(*m, "i1");
  }
  auto m = NewSsdMaster();  // the segment is back as RECOVERING, with its tier's id
  ASSERT_OK(m->Mount({Tiered("i2")})[0]);
  ASSERT_OK(m->SyncSsd(Listing("i2", 1, AllTen())).status());
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(Present(*m, absl::StrCat("k", i))) << i;
  EXPECT_OK(m->index().CheckInvariants());
}

// A daemon's tier address is dialled by the master's evictor and by
// readers: one no HTTP client can take (a port past INT_MAX made the
// parser throw) is refused at each door and never installed.
TEST_F(MasterSsdTest, ATierAddressNoClientCanDialIsRefusedAndNeverInstalled) {
  auto m = NewMaster();
  SegmentSpec bad = Tiered("i1");
  bad.tier_http = "127.0.0.1:99999999999";
  absl::Status refused = m->Mount({bad})[0];
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("segment a: its SSD tier's HTTP endpoint"));
  EXPECT_TRUE(m->registry().Snapshot().empty());

  ASSERT_OK(m->Mount({Tiered("i1")})[0]);
  EXPECT_TRUE(m->Heartbeat({bad}, "").remount.empty());  // alive, its old address kept
  ASSERT_EQ(m->registry().Snapshot().size(), 1u);
  EXPECT_EQ(m->registry().Snapshot()[0].spec.tier_http, "127.0.0.1:9");
  SsdRecords listing = Listing("i1", 1, {});
  listing.tier_http = "https://bad host:80";
  EXPECT_THAT(m->SyncSsd(listing).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(m->registry().Snapshot()[0].spec.tier_http, "127.0.0.1:9");
  listing.tier_http = "";
  EXPECT_OK(m->SyncSsd(listing).status());
  // No other segment takes a's tier address (offloads there are signed with
  // a's key), at its mount or by a heartbeat.
  SegmentSpec other = Tiered("j1");
  other.name = "b";
  EXPECT_THAT(m->Mount({other})[0], StatusIs(absl::StatusCode::kPermissionDenied));
  other.tier_http = "127.0.0.1:10";
  ASSERT_OK(m->Mount({other})[0]);
  other.tier_http = "127.0.0.1:9";
  EXPECT_TRUE(m->Heartbeat({other}, "").remount.empty());
  for (const SegmentSnapshot& seg : m->registry().Snapshot()) {
    EXPECT_EQ(seg.spec.tier_http, seg.spec.name == "a" ? "127.0.0.1:9" : "127.0.0.1:10");
  }
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

// Keys "<prefix>/<i>" for i in [from, to).
std::vector<std::string> PageKeys(const std::string& prefix, int from, int to) {
  std::vector<std::string> keys;
  for (int i = from; i < to; ++i) keys.push_back(absl::StrCat(prefix, "/", i));
  return keys;
}

// `found` leading hits of `size` bytes each, idle `idle_s`.
std::vector<KeyHit> Hits(size_t found, uint64_t size = 0, uint32_t idle_s = 0) {
  return std::vector<KeyHit>(found, KeyHit{true, size, idle_s});
}

QueryStatsOptions Options(absl::Duration window, size_t max_clients) {
  QueryStatsOptions o;
  o.window = window;
  o.max_clients = max_clients;
  o.sketch_bytes = 1 << 16;
  return o;
}

TEST(QueryStatsTest, CountsPerClientWithASlidingWindowAndABoundedClientSet) {
  QueryStats q(nullptr, Options(absl::Seconds(10), /*max_clients=*/2));
  absl::Time t = absl::FromUnixSeconds(1000);
  q.Record("a", QueryStats::kPrefix, PageKeys("a", 0, 10), Hits(4), t);
  q.Record("b", QueryStats::kPrefix, PageKeys("b", 0, 5), Hits(5), t + absl::Seconds(6));
  q.Record("c", QueryStats::kPrefix, PageKeys("c", 0, 3), Hits(0), t + absl::Seconds(6));  // past the cap: "other"
  std::vector<QueryStats::Row> rows = q.Snapshot(t + absl::Seconds(6)).clients;
  ASSERT_EQ(rows.size(), 4u);  // all, a, b, other
  EXPECT_EQ(rows[0].name, "all");
  EXPECT_EQ(rows[0].total[QueryStats::kPrefix].asked, 18u);
  EXPECT_EQ(rows[0].total[QueryStats::kPrefix].found, 9u);
  EXPECT_EQ(rows[3].name, "other");
  // Ten seconds after a's lookups they have left the window, not the total.
  rows = q.Snapshot(t + absl::Seconds(11)).clients;
  EXPECT_EQ(rows[1].name, "a");
  EXPECT_EQ(rows[1].total[QueryStats::kPrefix].asked, 10u);
  EXPECT_EQ(rows[1].window[QueryStats::kPrefix].asked, 0u);
  EXPECT_EQ(rows[2].window[QueryStats::kPrefix].found, 5u);
  EXPECT_EQ(rows[0].window[QueryStats::kPrefix].asked, 8u);
}

TEST(KeySketchTest, NoFalseNegativesAndFalsePositivesNearTheBound) {
  // 64 KiB = 524288 bits; 54613 keys is bits/9.6: about 1 % false positives.
  KeySketch sketch(64 << 10);
  const int n = 54613;
  for (int i = 0; i < n; ++i) sketch.Add(absl::StrCat("stored/", i));
  for (int i = 0; i < n; ++i) ASSERT_TRUE(sketch.MayContain(absl::StrCat("stored/", i))) << i;
  int fp = 0;
  const int probes = 200000;
  for (int i = 0; i < probes; ++i) fp += sketch.MayContain(absl::StrCat("never/", i));
  const double measured = static_cast<double>(fp) / probes;
  EXPECT_NEAR(sketch.FalsePositiveRate(), 0.01, 0.003);
  // The measured rate is the predicted one, within sampling noise and the
  // double hashing's small excess.
  EXPECT_NEAR(measured, sketch.FalsePositiveRate(), 0.003) << fp << " of " << probes;
  EXPECT_LT(measured, 0.015);
}

TEST(KeySketchTest, EmptyReadsAbsent) {
  KeySketch sketch(1);  // rounds up to one word
  EXPECT_EQ(sketch.bits(), 64u);
  EXPECT_FALSE(sketch.MayContain("x"));
  EXPECT_EQ(sketch.FalsePositiveRate(), 0.0);
}

// "Possible" is what was ever stored: for GetReplicas/Exists per key, for
// PrefixMatch the leading run; a hit is always possible; bytes are the
// found objects' sizes.
TEST(QueryStatsTest, PossibleCountsPagesEverStoredAndBytesFound) {
  QueryStats q(nullptr, Options(absl::Minutes(5), 16));
  absl::Time t = absl::FromUnixSeconds(1000);
  q.NoteStored(PageKeys("m", 0, 6));  // m/0..m/5 were stored once
  // PrefixMatch over m/0..m/9: 3 matched (the rest evicted, say), 6 possible.
  q.Record("w", QueryStats::kPrefix, PageKeys("m", 0, 10), Hits(3, 100), t);
  // A run broken by a never-stored key: m/6 never stored, so m/7.. cannot count.
  std::vector<std::string> broken = {"m/0", "m/6", "m/1"};
  q.Record("w", QueryStats::kPrefix, broken, Hits(1, 100), t);
  // GetReplicas per key: m/4 (stored, now gone), x/1 (never), m/0 (hit).
  std::vector<KeyHit> get(3);
  get[2] = {true, 4096, 7};
  q.Record("w", QueryStats::kGet, {"m/4", "x/1", "m/0"}, get, t);
  // A hit the sketch never saw (recovered after a restart) is still possible.
  q.Record("w", QueryStats::kExists, {"old/1"}, Hits(1, 10), t);
  QueryStats::View v = q.Snapshot(t);
  const QueryStats::Row& w = v.clients[1];
  EXPECT_EQ(w.total[QueryStats::kPrefix].asked, 13u);
  EXPECT_EQ(w.total[QueryStats::kPrefix].found, 4u);
  EXPECT_EQ(w.total[QueryStats::kPrefix].possible, 7u);
  EXPECT_EQ(w.total[QueryStats::kPrefix].bytes_found, 400u);
  EXPECT_EQ(w.total[QueryStats::kGet].asked, 3u);
  EXPECT_EQ(w.total[QueryStats::kGet].found, 1u);
  EXPECT_EQ(w.total[QueryStats::kGet].possible, 2u);
  EXPECT_EQ(w.total[QueryStats::kGet].bytes_found, 4096u);
  EXPECT_EQ(w.total[QueryStats::kExists].possible, 1u);
  EXPECT_EQ(w.window[QueryStats::kPrefix].possible, 7u);
  EXPECT_EQ(v.clients[0].total[QueryStats::kGet].possible, 2u);
  EXPECT_TRUE(v.prefixes.empty());  // no separator configured
}

TEST(QueryStatsTest, HistogramsOfMatchedPagesAndReuseDistance) {
  QueryStats q(nullptr, Options(absl::Minutes(5), 16));
  absl::Time t = absl::FromUnixSeconds(1000);
  q.Record("w", QueryStats::kPrefix, PageKeys("m", 0, 8), Hits(0), t);
  q.Record("w", QueryStats::kPrefix, PageKeys("m", 0, 8), Hits(3, 1, 2), t);
  q.Record("w", QueryStats::kPrefix, PageKeys("m", 0, 8), Hits(8, 1, 100), t);
  std::vector<KeyHit> get(2);
  get[1] = {true, 1, 4000};
  q.Record("w", QueryStats::kGet, PageKeys("m", 0, 2), get, t);
  QueryStats::View v = q.Snapshot(t);
  const QueryStats::Histo& pages = v.prefix_match_pages;
  ASSERT_EQ(pages.counts.size(), pages.bounds.size() + 1);
  EXPECT_EQ(pages.count, 3u);
  EXPECT_EQ(pages.sum, 11.0);
  // le 0, 1, 2, 4, 8, ...: 0 pages, 3 pages (le 4), 8 pages (le 8).
  EXPECT_EQ(pages.bounds[0], 0.0);
  EXPECT_EQ(pages.counts[0], 1u);
  EXPECT_EQ(pages.bounds[3], 4.0);
  EXPECT_EQ(pages.counts[3], 1u);
  EXPECT_EQ(pages.counts[4], 1u);
  const QueryStats::Histo& reuse = v.reuse_seconds[QueryStats::kPrefix];
  EXPECT_EQ(reuse.count, 11u);  // one per hit
  EXPECT_EQ(reuse.sum, 3 * 2.0 + 8 * 100.0);
  const QueryStats::Histo& get_reuse = v.reuse_seconds[QueryStats::kGet];
  EXPECT_EQ(get_reuse.count, 1u);  // misses carry no reuse distance
  // 4000 s: above 3600, within 14400.
  auto it = std::find(get_reuse.bounds.begin(), get_reuse.bounds.end(), 14400.0);
  ASSERT_NE(it, get_reuse.bounds.end());
  EXPECT_EQ(get_reuse.counts[it - get_reuse.bounds.begin()], 1u);
}

TEST(QueryStatsTest, PerKeyPrefixRowsWithTheirOwnBoundAndABoundedPrefixSet) {
  QueryStatsOptions o = Options(absl::Minutes(5), 16);
  o.key_prefix_separator = "@";
  o.max_prefixes = 3;
  QueryStats q(nullptr, o);
  EXPECT_EQ(q.PrefixOf("llama3@abc@1"), "llama3");
  EXPECT_EQ(q.PrefixOf("nosep"), "-");
  absl::Time t = absl::FromUnixSeconds(1000);
  q.NoteStored({"llama3@0", "llama3@1", "llama3@2", "qwen@0"});
  // One call over two models: counted to each prefix, key by key.
  std::vector<KeyHit> hits(5);
  hits[0] = {true, 10, 0};
  hits[3] = {true, 20, 0};
  q.Record("w", QueryStats::kGet, {"llama3@0", "llama3@1", "llama3@9", "qwen@0", "qwen@1"}, hits, t);
  q.Record("w", QueryStats::kPrefix, {"llama3@0", "llama3@1", "llama3@2", "llama3@3"}, Hits(1, 10), t);
  q.Record("w", QueryStats::kGet, {"a@1"}, {KeyHit{}}, t);
  q.Record("w", QueryStats::kGet, {"b@1", "c@1"}, {KeyHit{}, KeyHit{}}, t);  // past the cap: "other"
  QueryStats::View v = q.Snapshot(t);
  ASSERT_EQ(v.prefixes.size(), 4u);  // a, llama3, qwen, other (by name)
  std::map<std::string, QueryStats::Row> by;
  for (const auto& r : v.prefixes) by[r.name] = r;
  ASSERT_TRUE(by.count("llama3") && by.count("qwen") && by.count("other") && by.count("a"));
  EXPECT_EQ(by["llama3"].total[QueryStats::kGet].asked, 3u);
  EXPECT_EQ(by["llama3"].total[QueryStats::kGet].found, 1u);
  EXPECT_EQ(by["llama3"].total[QueryStats::kGet].possible, 2u);
  EXPECT_EQ(by["llama3"].total[QueryStats::kGet].bytes_found, 10u);
  EXPECT_EQ(by["qwen"].total[QueryStats::kGet].asked, 2u);
  EXPECT_EQ(by["qwen"].total[QueryStats::kGet].found, 1u);
  EXPECT_EQ(by["qwen"].total[QueryStats::kGet].possible, 1u);
  EXPECT_EQ(by["llama3"].total[QueryStats::kPrefix].asked, 4u);
  EXPECT_EQ(by["llama3"].total[QueryStats::kPrefix].found, 1u);
  EXPECT_EQ(by["llama3"].total[QueryStats::kPrefix].possible, 3u);
  EXPECT_EQ(by["other"].total[QueryStats::kGet].asked, 2u);
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

// Segment ownership in process: the owner is the mounting identity, kept
// across a restart; a foreign mount, unmount (keeping SSD or not),
// heartbeat or SSD listing changes nothing; an unowned segment is
// claimed by the first named identity to mount it.
TEST_F(MasterTest, ASegmentIsChangedOnlyByItsOwnerOrAnAdmin) {
  const SegmentActor a{"node-a", false}, b{"node-b", false}, admin{"ops", true};
  {
    auto m = NewMaster();
    ASSERT_OK(m->Mount({Seg("s")}, a)[0]);
    ASSERT_OK(Put(*m, "k"));
    EXPECT_THAT(m->Mount({Seg("s", "i2")}, b)[0], StatusIs(absl::StatusCode::kPermissionDenied));
    EXPECT_THAT(m->Unmount({"s"}, /*keep_ssd=*/true, b)[0], StatusIs(absl::StatusCode::kPermissionDenied));
    EXPECT_THAT(m->Unmount({"s"}, false, b)[0], StatusIs(absl::StatusCode::kPermissionDenied));
    EXPECT_EQ(m->Heartbeat({Seg("s")}, "", b).remount, std::vector<std::string>{"s"});
    EXPECT_TRUE(m->Heartbeat({Seg("s")}, "", a).remount.empty());
    SsdRecords wipe;
    wipe.segment = "s";
    wipe.incarnation = "i1";
    wipe.gone = {"k"};
    EXPECT_THAT(m->SyncSsd(wipe, b).status(), StatusIs(absl::StatusCode::kPermissionDenied));
    EXPECT_TRUE(Present(*m, "k"));
  }
  auto m = NewMaster();
  EXPECT_THAT(m->Mount({Seg("s")}, b)[0], StatusIs(absl::StatusCode::kPermissionDenied));
  ASSERT_OK(m->Mount({Seg("s")}, admin)[0]);  // keeps the owner
  EXPECT_TRUE(Present(*m, "k"));
  EXPECT_EQ(m->registry().OwnerOf(*m->registry().IdOf("s")), "node-a");
  ASSERT_OK(m->Mount({Seg("s")}, a)[0]);
  ASSERT_OK(m->Unmount({"s"}, false, a)[0]);
  SegmentSpec free = Seg("free");
  free.data_key = std::string(32, 'd');
  ASSERT_OK(m->Mount({free})[0]);  // unauthenticated: no owner
  EXPECT_EQ(m->registry().OwnerOf(*m->registry().IdOf("free")), "");
  // Only its own daemon (its data key) claims an unowned segment.
  EXPECT_THAT(m->Mount({Seg("free")}, b)[0], StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(m->Unmount({"free"}, false, b)[0], StatusIs(absl::StatusCode::kPermissionDenied));
  ASSERT_OK(m->Mount({free}, b)[0]);
  EXPECT_EQ(m->registry().OwnerOf(*m->registry().IdOf("free")), "node-b");
  EXPECT_THAT(m->Unmount({"free"}, false, a)[0], StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_OK(m->index().CheckInvariants());
}

// Writers that arrive while a RocksDB write is in flight share the next
// one (group commit); each returns once its own mutations are applied, and
// all of them are there when the database is opened again.
TEST(RocksDbStoreTest, ConcurrentWritesAreGroupCommittedAndReadBackAfterReopening) {
  const std::string dir = testing::MakeTempDir("tierkv-group-commit");
  constexpr int kThreads = 8, kWrites = 300;
  // Whether two writers' calls meet in one batch depends on scheduling: on
  // a loaded machine one round may run them all apart. Rounds (each on
  // keys of its own) go on until some did, at most kRounds.
  constexpr int kRounds = 20;
  int rounds = 0;
  {
    absl::StatusOr<std::unique_ptr<IndexStore>> store = OpenRocksDbStore(dir);
    ASSERT_OK(store.status());
    WriteCounts counts;
    while (rounds < kRounds && (rounds == 0 || counts.batches == counts.writes)) {
      const int round = rounds++;
      std::vector<std::thread> threads;
      std::atomic<int> failed{0};
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
          for (int i = 0; i < kWrites; ++i) {
            const std::string prefix = absl::StrCat("o/r", round, "-t", t, "-");
            std::vector<Mutation> batch{{absl::StrCat(prefix, i), absl::StrCat(i), false}};
            // Every third write also deletes the previous key: a batch stays in order.
            if (i % 3 == 2) batch.push_back({absl::StrCat(prefix, i - 1), "", true});
            if (!(*store)->Write(batch).ok()) failed.fetch_add(1);
            // Written before Write returned: readable at once.
            if (!(*store)->Get(absl::StrCat(prefix, i)).ok()) failed.fetch_add(1);
          }
        });
      }
      for (std::thread& th : threads) th.join();
      EXPECT_EQ(failed.load(), 0);
      counts = (*store)->Counts();
      EXPECT_EQ(counts.writes, static_cast<uint64_t>(rounds * kThreads * kWrites));
    }
    EXPECT_LT(counts.batches, counts.writes) << "no two writes shared a batch in " << rounds << " rounds";
    EXPECT_GT(counts.batches, 0u);
  }
  absl::StatusOr<std::unique_ptr<IndexStore>> reopened = OpenRocksDbStore(dir);
  ASSERT_OK(reopened.status());
  int present = 0;
  ASSERT_OK((*reopened)->Scan("o/", [&](absl::string_view, absl::string_view) {
    ++present;
    return true;
  }));
  EXPECT_EQ(present, rounds * kThreads * (kWrites - kWrites / 3));
  reopened->reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tierkv::master

namespace tierkv::master {
namespace {

TEST_F(MasterTest, TenantLimitsAndChargesSurviveARestart) {
  {
    auto m = NewMaster();
    ASSERT_OK(m->Mount({Seg("a")})[0]);
    ASSERT_OK(m->SetTenantLimits("team-a", {8000, 2000}));
    ASSERT_OK(m->SetTenantLimits(kDefaultTenantName, {1 << 20, 0}));
    EXPECT_THAT(m->SetTenantLimits("team-b", {1000, 2000}), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(m->SetTenantLimits("no/slash", {1000, 0}), StatusIs(absl::StatusCode::kInvalidArgument));
    ASSERT_OK(Put(*m, TenantKey("team-a", "k1")));
    ASSERT_OK(Put(*m, TenantKey("team-a", "k2")));
    ASSERT_OK(Put(*m, "plain"));
  }
  auto m = NewMaster();
  std::vector<TenantUsage> t = m->Tenants();
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].tenant, "");
  EXPECT_EQ(t[0].limits.quota_bytes, 1u << 20);
  EXPECT_EQ(t[0].used_bytes, 1000u);
  EXPECT_EQ(t[1].tenant, "team-a");
  EXPECT_EQ(t[1].limits.quota_bytes, 8000u);
  EXPECT_EQ(t[1].limits.guaranteed_bytes, 2000u);
  EXPECT_EQ(t[1].used_bytes, 2000u);
  // Cleared limits stay cleared.
  ASSERT_OK(m->SetTenantLimits("team-a", {}));
  m.reset();
  m = NewMaster();
  EXPECT_EQ(m->index().tenants().Limits("team-a").quota_bytes, 0u);
  EXPECT_OK(m->index().CheckInvariants());
}

// The RPC handlers take every key a caller names in its tenant's
// namespace, and answer in the caller's terms.
TEST_F(MasterTest, RpcHandlersKeepEachTenantInItsNamespace) {
  auto m = NewMaster();
  ASSERT_OK(m->Mount({Seg("a")})[0]);
  auto put = [&](const std::string& tenant, const std::string& key, uint64_t size) {
    v1::PutStartRequest req;
    auto* item = req.add_items();
    item->set_key(key);
    item->set_size(size);
    v1::PutStartResponse resp;
    rpc::PutStart(m.get(), req, "c", tenant, &resp);
    if (resp.results(0).has_status()) {
      return absl::Status(static_cast<absl::StatusCode>(resp.results(0).status().code()),
                          resp.results(0).status().message());
    }
    v1::KeysRequest end;
    end.add_keys(key);
    v1::KeysResponse done;
    rpc::PutEnd(m.get(), end, tenant, &done);
    return absl::Status(static_cast<absl::StatusCode>(done.status(0).code()), done.status(0).message());
  };
  auto size_of = [&](const std::string& tenant, const std::string& key) -> uint64_t {
    v1::KeysRequest req;
    req.add_keys(key);
    v1::GetReplicasResponse resp;
    rpc::GetReplicas(m.get(), req, tenant, &resp);
    return resp.sizes(0);
  };
  ASSERT_OK(put("team-a", "k", 100));
  ASSERT_OK(put("team-b", "k", 200));
  ASSERT_OK(put("", "k", 300));
  EXPECT_EQ(size_of("team-a", "k"), 100u);
  EXPECT_EQ(size_of("team-b", "k"), 200u);
  EXPECT_EQ(size_of("", "k"), 300u);
  // A NUL in a key is refused at the door: it would spell another tenant's key.
  absl::Status nul = put("", std::string("team-a\0k", 8), 10);
  EXPECT_THAT(nul, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(nul.message().find("NUL"), std::string::npos) << nul;
  EXPECT_EQ(size_of("", std::string("team-a\0k", 8)), 0u);
  {
    v1::KeysRequest req;
    req.add_keys(std::string("team-a\0k", 8));
    v1::ExistsResponse resp;
    rpc::Exists(m.get(), req, "", &resp);
    EXPECT_FALSE(resp.present(0));
  }
  // Errors name the key as the caller does.
  absl::Status again = put("team-a", "k", 100);
  EXPECT_THAT(again, StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_EQ(again.message(), "k: exists");
  // A remove reaches only the caller's own object.
  clock_.Advance(absl::Seconds(30));
  v1::RemoveRequest rm;
  rm.add_keys("k");
  v1::KeysResponse removed;
  rpc::Remove(m.get(), rm, "team-b", &removed);
  EXPECT_EQ(removed.status(0).code(), 0);
  EXPECT_EQ(size_of("team-b", "k"), 0u);
  EXPECT_EQ(size_of("team-a", "k"), 100u);
  // An admin in a tenant removes that tenant's objects only.
  v1::RemoveAllRequest everything;
  everything.set_force(true);  // the reads above hold leases
  v1::RemoveAllResponse all;
  rpc::RemoveAll(m.get(), everything, "team-a", &all);
  EXPECT_EQ(all.removed(), 1u);
  EXPECT_EQ(size_of("", "k"), 300u);
  EXPECT_OK(m->index().CheckInvariants());
}

}  // namespace
}  // namespace tierkv::master
