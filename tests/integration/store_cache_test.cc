// The client's replica cache and read leases against real processes: a
// read under memory pressure gives its lease back, the cache holds one only
// for its hold, counts its hits at the master, and serves only while the
// master answers. The fixture is store_fixture.h.
#include "tests/integration/store_fixture.h"

namespace tierkv::integration {
namespace {

// While DRAM is evicted, a read is counted: the client gives its lease
// back on its next call to the master, so the object is free to go then
// rather than at the lease's end. (Without the replica cache; the next
// test has it.)
TEST_F(StoreClusterTest, ReadsUnderPressureGiveTheirLeasesBackOnTheNextCall) {
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "32mib"}));
  client::ClientOptions o;
  o.master = cluster_.master_address();
  o.metadata = cluster_.metadata_url();
  o.replica_cache = 0;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> client, client::Client::Create(o));
  for (int i = 0; i < 40; ++i) {
    ASSERT_OK(client->Put(absl::StrCat("fill-", i), ValueFor(absl::StrCat("fill-", i), 1 << 20))) << i;
  }
  ASSERT_GT(Stats()["evictions"].get<int>(), 0);
  auto lease_of = [&](const std::string& key) {
    absl::StatusOr<std::string> body = cluster_.HttpGet("/v1/objects/" + key);
    EXPECT_OK(body.status());
    return body.ok() ? nlohmann::json::parse(*body)["lease_expiry_unix_ms"] : nlohmann::json();
  };
  for (int round = 0; round < 2; ++round) {  // the second read is not served from a cached location
    absl::StatusOr<std::string> got = client->Get("fill-39");
    ASSERT_OK(got.status());
    EXPECT_EQ(*got, ValueFor("fill-39", 1 << 20));
    EXPECT_FALSE(lease_of("fill-39").is_null()) << "read, not yet given back";
    ASSERT_OK(client->BatchExists({"fill-0"}).status());  // carries the give-back
    EXPECT_TRUE(lease_of("fill-39").is_null());
  }
  absl::StatusOr<std::string> metrics = cluster_.HttpGet("/metrics");
  ASSERT_OK(metrics.status());
  EXPECT_THAT(*metrics, ::testing::HasSubstr("tierkv_master_leases_released_total 2\n"));
  EXPECT_OK(client->Remove("fill-39"));  // no lease left to refuse it
}

// The same with the replica cache on: a counted read is remembered for
// the hold (ClientOptions::replica_cache_hold) and keeps its lease that
// long, so a repeated get inside it asks nothing of the master; after it,
// the next get gives the lease back, and the object is free to go.
TEST_F(StoreClusterTest, ACachedReadUnderPressureHoldsItsLeaseForTheHoldOnly) {
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "32mib"}));
  client::ClientOptions o;
  o.master = cluster_.master_address();
  o.metadata = cluster_.metadata_url();
  o.replica_cache = 64;
  o.replica_cache_hold = absl::Milliseconds(500);
  o.replica_cache_fresh = absl::Seconds(10);  // the hold is what this test bounds
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> client, client::Client::Create(o));
  for (int i = 0; i < 40; ++i) {
    ASSERT_OK(client->Put(absl::StrCat("fill-", i), ValueFor(absl::StrCat("fill-", i), 1 << 20))) << i;
  }
  ASSERT_GT(Stats()["evictions"].get<int>(), 0);
  auto lease_of = [&](const std::string& key) {
    absl::StatusOr<std::string> body = cluster_.HttpGet("/v1/objects/" + key);
    EXPECT_OK(body.status());
    return body.ok() ? nlohmann::json::parse(*body)["lease_expiry_unix_ms"] : nlohmann::json();
  };
  const std::string lookups = "tierkv_master_rpc_total{method=\"GetReplicas\"}";
  // A page still in DRAM besides fill-39, for the lookup after the hold:
  // puts within one clock tick are evicted round-robin across shards, so
  // which of the newest survived varies.
  std::string other;
  for (int i = 38; i >= 0 && other.empty(); --i) {
    const std::string key = absl::StrCat("fill-", i);
    ASSERT_OK_AND_ASSIGN(std::vector<bool> present, client->BatchExists({key}));
    if (present[0]) other = key;
  }
  ASSERT_FALSE(other.empty());
  const absl::Time first = absl::Now();
  ASSERT_OK_AND_ASSIGN(std::string got, client->Get("fill-39"));
  EXPECT_EQ(got, ValueFor("fill-39", 1 << 20));
  const double asked = Metric(lookups);
  ASSERT_GT(asked, 0);
  ASSERT_OK(client->BatchExists({"fill-0"}).status());  // a call that would carry a give-back
  EXPECT_FALSE(lease_of("fill-39").is_null()) << "held by the cache";
  ASSERT_OK_AND_ASSIGN(got, client->Get("fill-39"));
  EXPECT_EQ(got, ValueFor("fill-39", 1 << 20));
  if (absl::Now() - first < absl::Milliseconds(400)) {
    EXPECT_EQ(Metric(lookups), asked) << "the second get, inside the hold, asked the master";
  }
  const double released = Metric("tierkv_master_leases_released_total");
  // Cannot be a wait: the hold is a timer inside the client, seen only by the next call, which is the one under test.
  absl::SleepFor(absl::Milliseconds(600) - (absl::Now() - first));
  ASSERT_OK_AND_ASSIGN(got, client->Get(other));  // the hold is over: its give-back goes with this lookup
  EXPECT_EQ(Metric(lookups), asked + 1);
  EXPECT_TRUE(lease_of("fill-39").is_null());
  EXPECT_EQ(Metric("tierkv_master_leases_released_total"), released + 1);
  ASSERT_OK_AND_ASSIGN(got, client->Get("fill-39"));  // asked again, and found
  EXPECT_EQ(Metric(lookups), asked + 2);
  EXPECT_EQ(got, ValueFor("fill-39", 1 << 20));
}

// Gets served from the replica cache ask the master nothing, yet its hit
// rates count every one: the client reports them on its next call.
TEST_F(StoreClusterTest, GetsServedFromTheReplicaCacheCountInTheMastersHitRates) {
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "32mib"}));
  client::ClientOptions o;
  o.master = cluster_.master_address();
  o.metadata = cluster_.metadata_url();
  o.client_id = "cache-reader";
  ASSERT_GT(o.replica_cache, 0u) << "on by default";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> client, client::Client::Create(o));
  ASSERT_OK(client->Put("k", ValueFor("k", 65536)));
  const std::string lookups = "tierkv_master_rpc_total{method=\"GetReplicas\"}";
  const double before = std::max(0.0, Metric(lookups));
  constexpr int kGets = 8;
  const absl::Time first = absl::Now();
  for (int i = 0; i < kGets; ++i) ASSERT_EQ(*client->Get("k"), ValueFor("k", 65536)) << i;
  const absl::Duration took = absl::Now() - first;
  const double asked = Metric(lookups) - before;
  if (took < o.replica_cache_fresh) EXPECT_EQ(asked, 1) << "gets inside the window asked the master";
  // The next call carries the cached reads (an Exists: counted apart).
  ASSERT_OK(client->BatchExists({"other"}).status());
  const nlohmann::json stats = Stats();
  nlohmann::json row;
  for (const nlohmann::json& r : stats["queries"]["clients"]) {
    if (r.value("client", "") == "cache-reader") row = r;
  }
  ASSERT_FALSE(row.is_null()) << stats.dump();
  EXPECT_EQ(row["get"]["pages_asked"], kGets) << row.dump();
  EXPECT_EQ(row["get"]["pages_found"], kGets) << row.dump();
  EXPECT_GE(row["get"]["bytes_found"].get<uint64_t>(), uint64_t{kGets} * 65536) << row.dump();
  std::printf("%d gets: %.0f asked the master, all %d counted in its hit rates\n", kGets, asked, kGets);
}

// The replica cache as it is by default: a repeated get inside the lease
// asks nothing of the master, but only while the master keeps answering
// this client (ClientOptions::replica_cache_fresh), and an answer that
// names a new membership (a segment left) forgets every entry, so a
// dropped store is not read through the cache for the rest of the lease.
TEST_F(StoreClusterTest, TheReplicaCacheServesOnlyWhileTheMasterAnswersAndForgetsDroppedStores) {
  // The TTL outlasts the master's pause below, so its daemons stay.
  ASSERT_OK(cluster_.Start({.daemons = 2, .segment_size = "32mib", .segment_ttl = "2s"}));
  client::ClientOptions o;
  o.master = cluster_.master_address();
  o.metadata = cluster_.metadata_url();
  o.transports = {"shm", "tcp"};
  o.rpc_timeout = absl::Milliseconds(300);
  o.transfer_timeout = absl::Seconds(2);
  ASSERT_GT(o.replica_cache, 0u) << "on by default";
  const absl::Duration fresh = o.replica_cache_fresh;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> client, client::Client::Create(o));
  client::PutOptions on1;
  on1.preferred_segment = "daemon-1";
  ASSERT_OK(client->Put("k", ValueFor("k", 65536), on1));
  const std::string lookups = "tierkv_master_rpc_total{method=\"GetReplicas\"}";

  // Inside the window: the second get is read where the first found it.
  const absl::Time heard = absl::Now();
  EXPECT_EQ(*client->Get("k"), ValueFor("k", 65536));
  const double asked = Metric(lookups);
  EXPECT_EQ(*client->Get("k"), ValueFor("k", 65536));
  if (absl::Now() - heard < fresh) {
    EXPECT_EQ(Metric(lookups), asked) << "a get inside the window asked the master";
  }

  // The master goes silent: past the window, no get succeeds from the
  // cache. Gets begun inside it may; the first that fails asked the master.
  cluster_.master().Kill(SIGSTOP);
  const absl::Time stopped = absl::Now();
  absl::Time t0, last_served = absl::InfinitePast();
  EXPECT_OK(WaitFor("a get of k to fail with the master stopped", fresh + absl::Seconds(10), [&] {
    t0 = absl::Now();
    if (!client->Get("k").ok()) return true;
    last_served = t0;
    return false;
  }));
  EXPECT_LT(last_served, stopped + fresh + absl::Milliseconds(20)) << "read from the cache with the master stopped";
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  cluster_.master().Kill(SIGCONT);
  EXPECT_EQ(*client->Get("k"), ValueFor("k", 65536));

  // daemon-1 is paused past its TTL and dropped. A client kept fresh by
  // other lookups would otherwise read its memory through the cache (shm
  // needs no answer from the daemon) until k's lease ends, seconds later.
  EXPECT_EQ(*client->Get("k"), ValueFor("k", 65536));
  cluster_.daemon(1).Kill(SIGSTOP);
  ASSERT_OK(cluster_.WaitForLiveSegments(1));
  const absl::Time dropped = absl::Now();
  absl::StatusOr<std::string> got;
  EXPECT_OK(WaitFor("k to stop being served once its store was dropped", absl::Seconds(5), [&] {
    EXPECT_THAT(client->Get("absent").status(), StatusIs(absl::StatusCode::kNotFound));  // an answer, renewing the window
    got = client->Get("k");
    return !got.ok();
  }));
  EXPECT_THAT(got.status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_LT(absl::Now() - dropped, absl::Seconds(1)) << "served through the cache after its store was dropped";
  // (k's lease, granted just before the pause, had seconds left.)
  cluster_.daemon(1).Kill(SIGCONT);
}

}  // namespace
}  // namespace tierkv::integration
