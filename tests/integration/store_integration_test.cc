// One master and three store daemons as real processes on loopback; the
// client library in the test process.
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/tierkv.h"
#include "base/auth.h"
#include "base/crc32c.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tests/support/cluster.h"
#include "tests/support/promtool.h"
#include "tests/support/status_matchers.h"
#include "tests/support/tls_certs.h"
#include "tests/support/values.h"
#include "transport/descriptor.h"
#include "transport/tcp/connection.h"
#include "base/net/socket.h"
#include "transport/tcp/wire.h"

namespace tierkv {
namespace {

using testing::ChildProcess;
using testing::StatusIs;
using testing::TestCluster;

// Deterministic contents from the key, so any reader can check them.
std::string ValueFor(const std::string& key, size_t size) { return testing::Payload(key, size); }

// Mostly small KV pages, some large: 4 KiB .. 8 MiB.
size_t SizeFor(int i) {
  std::mt19937 rng(i);
  int bucket = rng() % 100;
  if (bucket < 90) return 4096 + rng() % (60 << 10);
  if (bucket < 99) return (64 << 10) + rng() % (960 << 10);
  return (1 << 20) + rng() % (7 << 20);
}

class StoreClusterTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (HasFailure()) std::cerr << cluster_.Logs();
  }
  // The master's sample of `name` on /metrics (-1: none).
  double Metric(const std::string& name) {
    absl::StatusOr<std::string> m = cluster_.HttpGet("/metrics");
    EXPECT_OK(m.status());
    const size_t at = m.ok() ? m->find("\n" + name + " ") : std::string::npos;  // not its # HELP line
    return at == std::string::npos ? -1.0 : std::strtod(m->c_str() + at + name.size() + 2, nullptr);
  }
  std::unique_ptr<client::Client> Client(std::vector<std::string> transports = {}, const std::string& token = "") {
    auto c = cluster_.NewClient(std::move(transports), token);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  // A raw READ on segment `d`'s tcp port from a connection without a data
  // grant: refused UNAUTHENTICATED saying a grant is needed, then closed.
  void ExpectRawReadRefused(const transport::SegmentDescriptor& d) {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    ASSERT_OK_AND_ASSIGN(net::Fd fd, net::Dial(d.transports.at("tcp"), deadline));
    transport::tcp::RequestHeader h;
    h.op = transport::tcp::WireOp::kRead;
    h.segment = d.segment_index;
    h.segment_id = d.segment_id;
    h.id = 1;
    h.length = 4096;
    uint8_t head[transport::tcp::kRequestSize];
    transport::tcp::EncodeRequest(h, head);
    ASSERT_OK(net::WriteFull(fd.get(), head, sizeof head, deadline));
    uint8_t reply[transport::tcp::kReplySize];
    ASSERT_OK(net::ReadFull(fd.get(), reply, sizeof reply, deadline));
    ASSERT_OK_AND_ASSIGN(transport::tcp::ReplyHeader r, transport::tcp::DecodeReply(reply, sizeof reply));
    EXPECT_EQ(r.status, transport::tcp::WireStatus::kUnauthenticated);
    std::string why(r.length, '\0');
    ASSERT_OK(net::ReadFull(fd.get(), why.data(), why.size(), deadline));
    EXPECT_NE(why.find("needs a data grant"), std::string::npos) << why;
    char more;
    EXPECT_FALSE(net::ReadFull(fd.get(), &more, 1, deadline).ok());
  }
  nlohmann::json Stats() {
    auto body = cluster_.HttpGet("/v1/stats");
    EXPECT_TRUE(body.ok());
    return nlohmann::json::parse(body.ok() ? *body : "{}");
  }
  TestCluster cluster_;
};

TEST_F(StoreClusterTest, TenThousandMixedObjectsFromSeveralThreads) {
  ASSERT_OK(cluster_.Start({.daemons = 3, .segment_size = "1gib"}));
  auto client = Client();
  constexpr int kThreads = 4, kPerThread = 2500, kBatch = 50;
  std::atomic<int> put_errors{0}, get_errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int base = 0; base < kPerThread; base += kBatch) {
        std::vector<std::string> keys, values;
        for (int i = base; i < base + kBatch; ++i) {
          int id = t * kPerThread + i;
          keys.push_back(absl::StrCat("obj-", id));
          values.push_back(ValueFor(keys.back(), SizeFor(id)));
        }
        std::vector<client::PutItem> items;
        for (size_t k = 0; k < keys.size(); ++k) items.push_back({keys[k], values[k]});
        for (const absl::Status& s : client->BatchPut(items)) {
          if (!s.ok()) {
            ++put_errors;
            ADD_FAILURE() << s;
          }
        }
        auto got = client->BatchGet(keys);
        for (size_t k = 0; k < keys.size(); ++k) {
          if (!got[k].ok() || *got[k] != values[k]) {
            ++get_errors;
            ADD_FAILURE() << keys[k] << ": " << (got[k].ok() ? "wrong bytes" : got[k].status().ToString());
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(put_errors.load(), 0);
  EXPECT_EQ(get_errors.load(), 0);
  EXPECT_EQ(Stats()["objects"], kThreads * kPerThread);
  // A second client over tcp only reads a sample back too.
  auto tcp = Client({"tcp"});
  for (int id = 0; id < kThreads * kPerThread; id += 37) {
    std::string key = absl::StrCat("obj-", id);
    auto v = tcp->Get(key);
    ASSERT_TRUE(v.ok()) << key << ": " << v.status();
    ASSERT_EQ(*v, ValueFor(key, SizeFor(id))) << key;
  }
  EXPECT_EQ(tcp->engine().Describe("daemon-0").transport, "tcp");
  EXPECT_EQ(client->engine().Describe("daemon-0").transport, "shm");
}

TEST_F(StoreClusterTest, SecondReplicaServesAfterADaemonIsKilled) {
  ASSERT_OK(cluster_.Start({.daemons = 3, .segment_size = "256mib"}));
  // tcp only: a killed daemon's memory is then really out of reach.
  auto client = Client({"tcp"});
  client::PutOptions two;
  two.replicas = 2;
  for (int i = 0; i < 200; ++i) {
    std::string key = absl::StrCat("r2-", i);
    ASSERT_OK(client->Put(key, ValueFor(key, 20000 + i), two));
    std::string single = absl::StrCat("r1-", i);
    client::PutOptions spread;
    spread.preferred_segment = absl::StrCat("daemon-", i % 3);
    ASSERT_OK(client->Put(single, ValueFor(single, 20000 + i), spread));
  }
  cluster_.daemon(0).Kill(SIGKILL);
  cluster_.daemon(0).Wait();
  // Before the TTL passes the master still lists daemon-0's replicas; the
  // client falls over to the other replica.
  for (int i = 0; i < 200; ++i) {
    std::string key = absl::StrCat("r2-", i);
    auto v = client->Get(key);
    ASSERT_TRUE(v.ok()) << key << ": " << v.status();
    ASSERT_EQ(*v, ValueFor(key, 20000 + i));
  }
  // Single-replica objects on the dead daemon: an error, never wrong bytes;
  // once the TTL passes, NOT_FOUND.
  ASSERT_OK(cluster_.WaitForLiveSegments(2));
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  int lost = 0;
  for (int i = 0; i < 200; ++i) {
    std::string key = absl::StrCat("r1-", i);
    auto v = client->Get(key);
    if (v.ok()) {
      ASSERT_EQ(*v, ValueFor(key, 20000 + i));
    } else {
      // The drop may still be in flight: wait for NOT_FOUND.
      while (!absl::IsNotFound(v.status()) && absl::Now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        v = client->Get(key);
      }
      EXPECT_THAT(v, StatusIs(absl::StatusCode::kNotFound)) << key;
      ++lost;
    }
  }
  EXPECT_EQ(lost, 67);  // the ones placed on daemon-0
  for (int i = 0; i < 200; ++i) {
    auto v = client->Get(absl::StrCat("r2-", i));
    ASSERT_TRUE(v.ok()) << v.status();
  }
}

TEST_F(StoreClusterTest, FillingPastCapacityEvicts) {
  ASSERT_OK(cluster_.Start({.daemons = 2, .segment_size = "32mib"}));
  auto client = Client();
  std::string value(1 << 20, 'v');
  for (int i = 0; i < 150; ++i) {
    ASSERT_OK(client->Put(absl::StrCat("fill-", i), ValueFor(absl::StrCat("fill-", i), 1 << 20))) << i;
  }
  nlohmann::json st = Stats();
  EXPECT_GT(st["evictions"].get<int>(), 80);
  EXPECT_LE(st["used_bytes"].get<uint64_t>(), st["capacity_bytes"].get<uint64_t>());
  EXPECT_THAT(client->Get("fill-0"), StatusIs(absl::StatusCode::kNotFound));
  auto last = client->Get("fill-149");
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(*last, ValueFor("fill-149", 1 << 20));
}

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

  // The master goes silent: past the window, no get succeeds from the cache.
  cluster_.master().Kill(SIGSTOP);
  absl::SleepFor(fresh + absl::Milliseconds(20));
  const absl::Time t0 = absl::Now();
  EXPECT_FALSE(client->Get("k").ok()) << "read from the cache with the master stopped";
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
  for (int i = 0; i < 500; ++i) {
    EXPECT_THAT(client->Get("absent").status(), StatusIs(absl::StatusCode::kNotFound));  // an answer, renewing the window
    got = client->Get("k");
    if (!got.ok()) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_THAT(got.status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_LT(absl::Now() - dropped, absl::Seconds(1)) << "served through the cache after its store was dropped";
  // (k's lease, granted just before the pause, had seconds left.)
  cluster_.daemon(1).Kill(SIGCONT);
}

TEST_F(StoreClusterTest, PrefixMatchAndGroups) {
  ASSERT_OK(cluster_.Start({.daemons = 2, .segment_size = "64mib"}));
  auto client = Client();
  std::vector<std::string> chain;
  std::vector<client::PutItem> items;
  std::vector<std::string> values;
  for (int i = 0; i < 8; ++i) chain.push_back(absl::StrCat("page-", i));
  for (int i = 0; i < 8; ++i) values.push_back(ValueFor(chain[i], 4096));
  for (int i = 0; i < 8; ++i) items.push_back({chain[i], values[i], "", i > 0 ? chain[i - 1] : ""});
  for (const auto& s : client->BatchPut(items)) ASSERT_OK(s);
  EXPECT_EQ(*client->PrefixMatch(chain), 8u);
  ASSERT_OK(client->Remove("page-5", true));
  EXPECT_EQ(*client->PrefixMatch(chain), 5u);
  auto key = cluster_.HttpGet("/v1/objects/page-3");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(nlohmann::json::parse(*key)["cached_children"], 1);

  // A page of two tensor-parallel ranks is one group: all or nothing.
  std::string k0 = ValueFor("tp0", 8192), k1 = ValueFor("tp1", 8192);
  for (const auto& s : client->BatchPut({{"tp-0", k0, "page-x"}, {"tp-1", k1, "page-x"}})) ASSERT_OK(s);
  EXPECT_EQ(*client->BatchExists({"tp-0", "tp-1"}), (std::vector<bool>{true, true}));
  ASSERT_OK(client->Remove("tp-1", true));
  EXPECT_EQ(*client->BatchExists({"tp-0", "tp-1"}), (std::vector<bool>{false, false}));
  EXPECT_THAT(client->Get("tp-0"), StatusIs(absl::StatusCode::kNotFound));
}

// The master counts what each client asks, whatever its engine: pages
// asked and found by prefix lookups (cumulative and windowed), in
// /v1/stats, /metrics and tierkvctl stats.
TEST_F(StoreClusterTest, PrefixLookupsAreCountedPerClient) {
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "64mib"}));
  client::ClientOptions o;
  o.master = cluster_.master_address();
  o.metadata = cluster_.metadata_url();
  o.client_id = "engine-a";
  auto c = client::Client::Create(o);
  ASSERT_OK(c);
  std::vector<std::string> chain = {"q-0", "q-1", "q-2", "q-3"};
  for (const char* k : {"q-0", "q-1", "q-3"}) ASSERT_OK((*c)->Put(k, ValueFor(k, 1024)));
  EXPECT_EQ(*(*c)->PrefixMatch(chain), 2u);  // a hole at q-2
  EXPECT_EQ(*(*c)->PrefixMatch({"q-0"}), 1u);
  EXPECT_EQ(*(*c)->BatchExists(chain), (std::vector<bool>{true, true, false, true}));
  nlohmann::json q = Stats()["queries"];
  ASSERT_TRUE(q.is_object()) << Stats().dump();
  nlohmann::json row;
  for (const auto& r : q["clients"]) {
    if (r["client"] == "engine-a") row = r;
  }
  ASSERT_TRUE(row.is_object()) << q.dump();
  EXPECT_EQ(row["prefix"]["pages_asked"], 5);
  EXPECT_EQ(row["prefix"]["pages_found"], 3);
  EXPECT_DOUBLE_EQ(row["prefix"]["hit_rate"].get<double>(), 0.6);
  EXPECT_EQ(row["prefix"]["window_pages_asked"], 5);
  EXPECT_EQ(row["exists"]["pages_asked"], 4);
  EXPECT_EQ(row["exists"]["pages_found"], 3);
  EXPECT_EQ(q["clients"][0]["client"], "all");
  absl::StatusOr<std::string> metrics = cluster_.HttpGet("/metrics");
  ASSERT_OK(metrics);
  EXPECT_THAT(*metrics, ::testing::HasSubstr(R"(tierkv_master_query_pages_asked_total{call="prefix",client="engine-a"} 5)"));
  EXPECT_THAT(*metrics, ::testing::HasSubstr(R"(tierkv_master_query_pages_found_total{call="prefix",client="engine-a"} 3)"));
  EXPECT_TRUE(testing::PromtoolAccepts(*metrics));
  std::string cmd = testing::BinaryPath("tierkvctl") + " --http=127.0.0.1:" + std::to_string(cluster_.http_port()) + " stats";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  EXPECT_EQ(::pclose(p), 0) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("engine-a"));
  EXPECT_THAT(out, ::testing::HasSubstr("60.0%"));
}

std::string RunCtl(const std::string& args) {
  std::string cmd = testing::BinaryPath("tierkvctl") + " " + args;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return "popen failed";
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int rc = ::pclose(p);
  if (rc != 0) out += absl::StrCat("\n[exit ", rc, "]");
  return out;
}

// The hit rate against its bound: pages found, and pages "possible" (ever
// stored, whether since removed or evicted), per client and per key
// prefix, with bytes found and the matched-length histogram, exactly as
// asked, in /v1/stats, /metrics, tierkvctl stats and tierkvctl top.
TEST_F(StoreClusterTest, HitRatesAreShownAgainstTheBoundOfEverStoredPages) {
  ASSERT_OK(cluster_.Start({.daemons = 1,
                            .segment_size = "4mib",
                            .master_flags = {"--query-stats-key-prefix-separator=@", "--hit-bound-sketch-bytes=1mib"}}));
  client::ClientOptions o;
  o.master = cluster_.master_address();
  o.metadata = cluster_.metadata_url();
  o.client_id = "engine-h";
  auto c = client::Client::Create(o);
  ASSERT_OK(c);
  client::Client& cli = **c;

  // A chain of 8 pages of one model; page 5 removed; 2 never stored.
  constexpr size_t kPage = 64 << 10;
  std::vector<std::string> chain;
  for (int i = 0; i < 10; ++i) chain.push_back(absl::StrCat("llama3@p-", i));
  std::vector<std::string> values;
  std::vector<client::PutItem> items;
  for (int i = 0; i < 8; ++i) values.push_back(ValueFor(chain[i], kPage));
  for (int i = 0; i < 8; ++i) items.push_back({chain[i], values[i], "", i > 0 ? chain[i - 1] : ""});
  for (const auto& st : cli.BatchPut(items)) ASSERT_OK(st);
  ASSERT_OK(cli.Remove("llama3@p-5", true));
  ASSERT_EQ(*cli.master().PrefixMatch(chain), 5u);  // asked 10, found 5, possible 8

  // Another model's pages overflow the segment: the oldest are evicted.
  constexpr size_t kBig = 256 << 10;
  constexpr int kBigPages = 40;
  std::vector<std::string> big;
  for (int i = 0; i < kBigPages; ++i) {
    big.push_back(absl::StrCat("qwen@e-", i));
    ASSERT_OK(cli.Put(big.back(), ValueFor(big.back(), kBig)));
  }
  big.push_back("qwen@never");
  absl::StatusOr<v1::GetReplicasResponse> got = cli.master().GetReplicas(big);
  ASSERT_OK(got.status());
  uint64_t present = 0;
  for (uint32_t n : got->replica_counts()) present += n > 0;
  ASSERT_GT(present, 0u);
  ASSERT_LT(present, static_cast<uint64_t>(kBigPages)) << "nothing was evicted";
  nlohmann::json st = Stats();
  EXPECT_GT(st["evictions"].get<uint64_t>(), 0u);

  nlohmann::json q = st["queries"];
  nlohmann::json row, llama, qwen;
  for (const auto& r : q["clients"]) {
    if (r["client"] == "engine-h") row = r;
  }
  for (const auto& r : q["prefixes"]) {
    if (r["key_prefix"] == "llama3") llama = r;
    if (r["key_prefix"] == "qwen") qwen = r;
  }
  ASSERT_TRUE(row.is_object() && llama.is_object() && qwen.is_object()) << q.dump();
  EXPECT_EQ(row["prefix"]["pages_asked"], 10);
  EXPECT_EQ(row["prefix"]["pages_found"], 5);
  EXPECT_EQ(row["prefix"]["pages_possible"], 8);
  EXPECT_EQ(row["prefix"]["bytes_found"], 5 * client::StoredSize(kPage));
  EXPECT_DOUBLE_EQ(row["prefix"]["possible_rate"].get<double>(), 0.8);
  EXPECT_EQ(row["prefix"]["window_pages_possible"], 8);
  EXPECT_EQ(row["get"]["pages_asked"], kBigPages + 1);
  EXPECT_EQ(row["get"]["pages_found"], present);
  EXPECT_EQ(row["get"]["pages_possible"], kBigPages);  // evicted pages count: once stored
  EXPECT_EQ(row["get"]["bytes_found"], present * client::StoredSize(kBig));
  EXPECT_EQ(llama["prefix"]["pages_possible"], 8);
  EXPECT_EQ(llama["get"]["pages_asked"], 0);
  EXPECT_EQ(qwen["get"]["pages_found"], present);
  EXPECT_EQ(qwen["get"]["pages_possible"], kBigPages);
  EXPECT_EQ(q["prefix_match_pages"]["count"], 1);
  EXPECT_EQ(q["prefix_match_pages"]["sum"], 5.0);
  EXPECT_EQ(q["reuse_seconds"]["get"]["count"], present);
  EXPECT_LT(q["sketch_false_positive_rate"].get<double>(), 1e-6);

  absl::StatusOr<std::string> metrics = cluster_.HttpGet("/metrics");
  ASSERT_OK(metrics);
  for (const std::string& line :
       {std::string(R"(tierkv_master_query_pages_possible_total{call="prefix",client="engine-h"} 8)"),
        absl::StrCat(R"(tierkv_master_query_pages_possible_total{call="get",client="engine-h"} )", kBigPages),
        absl::StrCat(R"(tierkv_master_query_pages_found_total{call="get",client="engine-h"} )", present),
        absl::StrCat(R"(tierkv_master_query_bytes_found_total{call="prefix",client="engine-h"} )",
                     5 * client::StoredSize(kPage)),
        std::string(R"(tierkv_master_query_prefix_pages_possible_total{call="prefix",prefix="llama3"} 8)"),
        absl::StrCat(R"(tierkv_master_query_prefix_pages_asked_total{call="get",prefix="qwen"} )", kBigPages + 1),
        std::string("tierkv_master_prefix_match_pages_count 1")}) {
    EXPECT_THAT(*metrics, ::testing::HasSubstr(line));
  }

  const std::string http = absl::StrCat("--http=127.0.0.1:", cluster_.http_port());
  std::string out = RunCtl(http + " stats");
  EXPECT_THAT(out, ::testing::HasSubstr("hit rate 50.0 % of a possible 80.0 % (5 of 10 pages, 8 possible")) << out;
  out = RunCtl(http + " --iterations=2 --interval=100ms top");
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(out, "tierkvctl top")).size(), 3u) << out;  // two frames
  const std::string expect_prefix = absl::StrFormat("%-32s %-7s %10d %10d %10d %6.1f%% %6.1f%%", "client engine-h",
                                                    "prefix", 10, 5, 8, 50.0, 80.0);
  const std::string expect_get =
      absl::StrFormat("%-32s %-7s %10d %10d %10d", "prefix qwen", "get", kBigPages + 1, present, kBigPages);
  EXPECT_THAT(out, ::testing::HasSubstr(expect_prefix)) << out;
  EXPECT_THAT(out, ::testing::HasSubstr(expect_get)) << out;
  // The first frame has no rate yet; the second has one.
  EXPECT_THAT(out, ::testing::HasSubstr("evictions/s -")) << out;
  EXPECT_THAT(out, ::testing::ContainsRegex("evictions/s [0-9]+\\.[0-9]")) << out;
}

// RemoveAll empties the cluster but for objects under a read lease, which
// stay until force; clients told only the master find the metadata server.
TEST_F(StoreClusterTest, RemoveAllObeysLeasesAndMetadataIsDiscovered) {
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "64mib"}));
  auto discovered = client::DiscoverMetadata(cluster_.master_address());
  ASSERT_OK(discovered.status());
  EXPECT_EQ(*discovered, cluster_.metadata_url());
  auto client = Client();
  std::vector<client::PutItem> items;
  std::vector<std::string> keys;
  for (int i = 0; i < 20; ++i) keys.push_back(absl::StrCat("all-", i));
  std::string value = ValueFor("all", 4096);
  for (const auto& k : keys) items.push_back({k, value});
  for (const auto& s : client->BatchPut(items)) ASSERT_OK(s);
  ASSERT_OK(client->Get("all-0").status());  // leases all-0
  absl::StatusOr<uint64_t> removed = client->RemoveAll();
  ASSERT_OK(removed.status());
  EXPECT_EQ(*removed, 19u);
  EXPECT_EQ(*client->PrefixMatch(keys), 1u);
  removed = client->RemoveAll(/*force=*/true);
  ASSERT_OK(removed.status());
  EXPECT_EQ(*removed, 1u);
  EXPECT_EQ(*client->BatchExists(keys), std::vector<bool>(20, false));
  EXPECT_EQ(Stats()["objects"], 0);
}

TEST_F(StoreClusterTest, BinaryKeysAreKeysLikeAnyOther) {
  // Page hashes as raw bytes, not UTF-8: one of them must not fail a batch.
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "64mib"}));
  auto client = Client();
  const std::string binary("\xff\xfe\x80page\x01", 8);
  std::vector<client::PutItem> items{{binary, "bin", "", ""}, {"plain", "txt", "", binary}};
  for (const absl::Status& s : client->BatchPut(items)) ASSERT_OK(s);
  auto got = client->BatchGet(std::vector<std::string>{"plain", binary, "absent"});
  ASSERT_TRUE(got[0].ok() && got[1].ok()) << got[0].status() << " " << got[1].status();
  EXPECT_EQ(*got[0], "txt");
  EXPECT_EQ(*got[1], "bin");
  EXPECT_THAT(got[2], StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(*client->PrefixMatch({binary, "plain", "absent"}), 2u);
  // A NUL byte is the one thing a key may not hold: refused alone.
  auto with_nul = client->BatchPut({{std::string("a\0b", 3), "x", "", ""}, {"fine", "y", "", ""}});
  EXPECT_THAT(with_nul[0], StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_OK(with_nul[1]);
}

TEST_F(StoreClusterTest, ReadinessFollowsTheMountAndSigtermUnmounts) {
  // The daemon starts first, against a master that is not up yet.
  int bound = 0;
  {
    // Two free ports for the master, found by binding and releasing.
    auto a = ChildProcess::Start(testing::BinaryPath("tierkv-master"), {"--rpc-port=0", "--http-port=0"});
    ASSERT_TRUE(a.ok());
    bound = (*a)->port("rpc");
    int http = (*a)->port("http");
    (*a)->Kill(SIGKILL);
    (*a)->Wait();
    auto d = ChildProcess::Start(
        testing::BinaryPath("tierkv-store"),
        {absl::StrCat("--master=127.0.0.1:", bound), absl::StrCat("--metadata=http://127.0.0.1:", http),
         "--segment-size=64mib", "--port=0", "--http-port=0", "--heartbeat-interval=100ms", "--name=late"});
    ASSERT_TRUE(d.ok()) << d.status();
    int ready_port = (*d)->port("http");
    EXPECT_THAT(cluster_.HttpGet("/ready", ready_port), StatusIs(absl::StatusCode::kUnknown));  // 503
    EXPECT_TRUE(cluster_.HttpGet("/health", ready_port).ok());
    auto m = ChildProcess::Start(testing::BinaryPath("tierkv-master"),
                                 {absl::StrCat("--rpc-port=", bound), absl::StrCat("--http-port=", http)});
    ASSERT_TRUE(m.ok()) << m.status();
    absl::Time deadline = absl::Now() + absl::Seconds(15);
    while (!cluster_.HttpGet("/ready", ready_port).ok() && absl::Now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_TRUE(cluster_.HttpGet("/ready", ready_port).ok()) << (*d)->Stderr();
    auto segs = cluster_.HttpGet("/v1/segments", http);
    ASSERT_TRUE(segs.ok());
    EXPECT_EQ(nlohmann::json::parse(*segs).size(), 1u);
    auto metrics = cluster_.HttpGet("/metrics", ready_port);
    ASSERT_TRUE(metrics.ok());
    EXPECT_NE(metrics->find("tierkv_store_mounted 1"), std::string::npos);
    EXPECT_TRUE(testing::PromtoolAccepts(*metrics));
    (*d)->Kill(SIGTERM);
    EXPECT_EQ((*d)->Wait(), 0);
    segs = cluster_.HttpGet("/v1/segments", http);
    ASSERT_TRUE(segs.ok());
    EXPECT_EQ(nlohmann::json::parse(*segs).size(), 0u);  // unmounted on the way out
  }
}

// The master is ready only while it has somewhere to put data: not before
// the first daemon mounts, and not after the last one leaves, whether it
// unmounts (SIGTERM) or is lost (SIGKILL, then the segment TTL).
TEST_F(StoreClusterTest, MasterReadyWhileASegmentIsMounted) {
  ASSERT_OK(cluster_.Start({.daemons = 0}));
  auto ready = [&]() -> std::pair<int, std::string> {
    httplib::Client http("127.0.0.1", cluster_.http_port());
    http.set_read_timeout(std::chrono::seconds(5));
    auto res = http.Get("/ready");
    return res ? std::pair<int, std::string>{res->status, res->body} : std::pair<int, std::string>{0, ""};
  };
  auto wait_for = [&](int status) {
    absl::Time deadline = absl::Now() + absl::Seconds(15);
    while (ready().first != status && absl::Now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return ready();
  };
  EXPECT_EQ(ready(), (std::pair<int, std::string>{503, "no segment mounted\n"}));
  EXPECT_TRUE(cluster_.HttpGet("/health").ok());  // live all along
  std::vector<std::string> args{"--master=" + cluster_.master_address(), "--metadata=" + cluster_.metadata_url(),
                                "--segment-size=32mib", "--port=0", "--http-port=0",
                                "--heartbeat-interval=100ms"};
  for (int sig : {SIGTERM, SIGKILL}) {
    std::vector<std::string> named = args;
    named.push_back(absl::StrCat("--name=ready-", sig));
    auto d = ChildProcess::Start(testing::BinaryPath("tierkv-store"), named);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(wait_for(200), (std::pair<int, std::string>{200, "ready\n"})) << (*d)->Stderr();
    (*d)->Kill(sig);
    (*d)->Wait();
    EXPECT_EQ(wait_for(503), (std::pair<int, std::string>{503, "no segment mounted\n"})) << sig;
  }
}

TEST_F(StoreClusterTest, MasterRestartDaemonsRemountAndObjectsReadBack) {
  ASSERT_OK(cluster_.Start({.daemons = 3, .segment_size = "128mib", .segment_ttl = "5s", .persist = true}));
  auto client = Client();
  for (int i = 0; i < 100; ++i) {
    std::string key = absl::StrCat("keep-", i);
    ASSERT_OK(client->Put(key, ValueFor(key, 10000 + i)));
  }
  cluster_.master().Kill(SIGKILL);
  cluster_.master().Wait();
  ASSERT_OK(cluster_.StartMaster());
  ASSERT_OK(cluster_.WaitForLiveSegments(3));
  for (int i = 0; i < 100; ++i) {
    std::string key = absl::StrCat("keep-", i);
    auto v = client->Get(key);
    ASSERT_TRUE(v.ok()) << key << ": " << v.status();
    EXPECT_EQ(*v, ValueFor(key, 10000 + i));
  }
  ASSERT_OK(client->Put("after-restart", "fresh"));
  EXPECT_EQ(*client->Get("after-restart"), "fresh");
}

TEST_F(StoreClusterTest, MasterRestartWithoutPersistenceRepublishesDescriptors) {
  ASSERT_OK(cluster_.Start({.daemons = 2, .segment_size = "64mib"}));
  cluster_.master().Kill(SIGKILL);
  cluster_.master().Wait();
  ASSERT_OK(cluster_.StartMaster());
  ASSERT_OK(cluster_.WaitForLiveSegments(2));
  auto client = Client({"tcp"});
  ASSERT_OK(client->Put("k", "v"));
  EXPECT_EQ(*client->Get("k"), "v");
}

TEST_F(StoreClusterTest, CApiRoundTrip) {
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "64mib"}));
  char* err = nullptr;
  tierkv_client* c = tierkv_client_create(cluster_.master_address().c_str(), cluster_.metadata_url().c_str(), 0, &err);
  ASSERT_NE(c, nullptr) << err;
  EXPECT_EQ(tierkv_put(c, "c-key", "hello", 5, 1, &err), TIERKV_OK);
  char buf[16];
  size_t size = 0;
  EXPECT_EQ(tierkv_get(c, "c-key", buf, sizeof buf, &size, &err), TIERKV_OK);
  EXPECT_EQ(std::string(buf, size), "hello");
  EXPECT_EQ(tierkv_get(c, "c-key", buf, 2, &size, &err), TIERKV_INVALID_ARGUMENT);
  ASSERT_NE(err, nullptr);
  tierkv_free_string(err);
  err = nullptr;
  EXPECT_EQ(tierkv_put(c, "c-key", "again", 5, 1, nullptr), TIERKV_ALREADY_EXISTS);
  int present = 0;
  EXPECT_EQ(tierkv_exists(c, "c-key", &present, nullptr), TIERKV_OK);
  EXPECT_EQ(present, 1);
  const char* keys[] = {"c-key", "missing"};
  size_t matched = 9;
  EXPECT_EQ(tierkv_prefix_match(c, keys, 2, &matched, nullptr), TIERKV_OK);
  EXPECT_EQ(matched, 1u);
  char b0[8], b1[8];
  void* bufs[] = {b0, b1};
  size_t caps[] = {8, 8}, sizes[2];
  int codes[2];
  EXPECT_EQ(tierkv_batch_get(c, keys, 2, bufs, caps, sizes, codes, nullptr), TIERKV_OK);
  EXPECT_EQ(codes[0], TIERKV_OK);
  EXPECT_EQ(codes[1], TIERKV_NOT_FOUND);
  EXPECT_EQ(tierkv_remove(c, "c-key", 1, nullptr), TIERKV_OK);
  EXPECT_EQ(tierkv_get(c, "c-key", buf, sizeof buf, &size, nullptr), TIERKV_NOT_FOUND);
  tierkv_client_destroy(c);
  EXPECT_EQ(tierkv_client_create(nullptr, nullptr, 0, nullptr), nullptr);
}

TEST_F(StoreClusterTest, CtlCommands) {
  ASSERT_OK(cluster_.Start({.daemons = 2, .segment_size = "64mib"}));
  std::string dir = testing::MakeTempDir("tierkv-ctl");
  {
    std::ofstream(dir + "/in", std::ios::binary) << "ctl value bytes";
  }
  std::vector<std::string> base{"--master=" + cluster_.master_address(),
                                absl::StrCat("--http=127.0.0.1:", cluster_.http_port())};
  auto run = [&](std::vector<std::string> args) {
    std::vector<std::string> all = base;
    all.insert(all.end(), args.begin(), args.end());
    std::string cmd = testing::BinaryPath("tierkvctl");
    for (auto& a : all) cmd += " '" + a + "'";
    cmd += " > " + dir + "/out 2>&1";
    int rc = std::system(cmd.c_str());
    std::ifstream in(dir + "/out");
    std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return std::make_pair(WEXITSTATUS(rc), out);
  };
  EXPECT_EQ(run({"put", "ctl-key", dir + "/in"}).first, 0);
  EXPECT_EQ(run({"get", "ctl-key", dir + "/got"}).first, 0);
  std::ifstream got(dir + "/got");
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(got)), std::istreambuf_iterator<char>()), "ctl value bytes");
  auto segs = run({"--json", "segments"});
  EXPECT_EQ(segs.first, 0);
  EXPECT_EQ(nlohmann::json::parse(segs.second).size(), 2u);
  EXPECT_NE(run({"segments"}).second.find("daemon-1"), std::string::npos);
  auto key = run({"--json", "key", "ctl-key"});
  EXPECT_EQ(nlohmann::json::parse(key.second)["size"], client::StoredSize(15));
  EXPECT_NE(run({"stats"}).second.find("objects"), std::string::npos);
  auto doctor = run({"--json", "doctor"});
  ASSERT_EQ(doctor.first, 0) << doctor.second;
  nlohmann::json d = nlohmann::json::parse(doctor.second);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0]["transport"], "shm");
  EXPECT_TRUE(d[0]["probe_ok"].get<bool>());
  EXPECT_GT(d[0]["bandwidth_GBps"].get<double>(), 0);
  auto doctor_tcp = run({"--json", "--transport=tcp", "doctor"});
  EXPECT_EQ(nlohmann::json::parse(doctor_tcp.second)[0]["transport"], "tcp");
  EXPECT_EQ(run({"rm", "ctl-key"}).first, 1);  // leased by the get just now
  EXPECT_EQ(run({"--force", "rm", "ctl-key"}).first, 0);
  EXPECT_EQ(run({"get", "ctl-key", dir + "/got"}).first, 1);
  EXPECT_EQ(run({"frobnicate"}).first, 2);
}

// Daemons running --auth token: a client with a master token gets data
// grants and moves bytes (tcp, shm), through a daemon's restart; a raw
// frame without a grant, and a real grant for one daemon's segment shown
// to another, are refused by the daemons themselves.
// A client lending its own memory in a cluster with tokens: its port, like
// a daemon's, moves bytes only for a connection the master granted.
TEST_F(StoreClusterTest, ALentSegmentAdmitsOnlyConnectionsWithAGrant) {
  const std::string dir = testing::MakeTempDir("tierkv-lend-auth");
  std::ofstream(dir + "/tokens") << "daemon-token-0000000000 decode daemon\n"
                                    "lender-token-0000000000 lender daemon,client\n"
                                    "client-token-0000000000 worker client\n";
  std::ofstream(dir + "/daemon.token") << "daemon-token-0000000000\n";
  ASSERT_OK(cluster_.Start({.daemons = 1,
                            .segment_size = "32mib",
                            .master_flags = {"--auth=token", "--token-file=" + dir + "/tokens"},
                            .daemon_flags = {"--auth=token", "--token-file=" + dir + "/daemon.token"},
                            .token = "client-token-0000000000"}));
  client::ClientOptions lo;
  lo.master = cluster_.master_address();
  lo.metadata = cluster_.metadata_url();
  lo.transports = {"tcp"};
  lo.token = "lender-token-0000000000";
  lo.lend_size = 16 << 20;
  lo.lend_name = "lent-0";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> lender, client::Client::Create(lo));
  ASSERT_OK(cluster_.WaitForLiveSegments(2));
  auto reader = Client({"tcp"});
  ASSERT_NE(reader, nullptr);
  client::PutOptions there;
  there.preferred_segment = "lent-0";
  for (int i = 0; i < 10; ++i) {
    const std::string key = absl::StrCat("page-", i);
    ASSERT_OK(reader->Put(key, ValueFor(key, 4096 + i), there));
    absl::StatusOr<std::string> v = reader->Get(key);
    ASSERT_OK(v.status()) << key;
    EXPECT_TRUE(*v == ValueFor(key, 4096 + i)) << key;
  }
  absl::StatusOr<std::string> placed = cluster_.HttpGet("/v1/objects/page-0");
  ASSERT_OK(placed.status());
  EXPECT_THAT(*placed, ::testing::HasSubstr("\"segment\":\"lent-0\"")) << "the value went elsewhere";
  absl::StatusOr<std::string> body = cluster_.HttpGet("/metadata?key=" + transport::DescriptorKey("lent-0"));
  ASSERT_OK(body.status());
  transport::SegmentDescriptor d = *transport::SegmentDescriptor::FromJson(*body);
  EXPECT_TRUE(d.auth);
  ExpectRawReadRefused(d);
  std::filesystem::remove_all(dir);
}

TEST_F(StoreClusterTest, DaemonsWithAuthTokenServeOnlyConnectionsWithAGrant) {
  const std::string dir = testing::MakeTempDir("tierkv-data-auth");
  std::ofstream(dir + "/tokens") << "daemon-token-0000000000 decode daemon\nclient-token-0000000000 worker client\n";
  std::ofstream(dir + "/daemon.token") << "daemon-token-0000000000\n";
  ASSERT_OK(cluster_.Start({.daemons = 2,
                            .segment_size = "64mib",
                            .master_flags = {"--auth=token", "--token-file=" + dir + "/tokens"},
                            .daemon_flags = {"--auth=token", "--token-file=" + dir + "/daemon.token"},
                            .token = "client-token-0000000000"}));
  auto tcp = Client({"tcp"});
  auto any = Client();
  ASSERT_NE(tcp, nullptr);
  ASSERT_NE(any, nullptr);
  client::PutOptions two;
  two.replicas = 2;
  for (int i = 0; i < 20; ++i) {
    const std::string key = absl::StrCat("granted-", i);
    ASSERT_OK(tcp->Put(key, ValueFor(key, 8192 + i), two));
  }
  for (int i = 0; i < 20; ++i) {
    const std::string key = absl::StrCat("granted-", i);
    absl::StatusOr<std::string> v = any->Get(key);
    ASSERT_OK(v.status()) << key;
    EXPECT_TRUE(*v == ValueFor(key, 8192 + i)) << key;
  }

  // The descriptors say so; a raw READ without a grant is refused and closed.
  auto desc_of = [&](const std::string& seg) {
    absl::StatusOr<std::string> d = cluster_.HttpGet("/metadata?key=" + transport::DescriptorKey(seg));
    EXPECT_TRUE(d.ok()) << d.status();
    return *transport::SegmentDescriptor::FromJson(d.ok() ? *d : "{}");
  };
  transport::SegmentDescriptor d0 = desc_of("daemon-0"), d1 = desc_of("daemon-1");
  EXPECT_TRUE(d0.auth);
  ExpectRawReadRefused(d0);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  // The master's grant for daemon-0, shown to daemon-1 for its segment.
  ASSERT_OK_AND_ASSIGN(v1::DataGrant g0, tcp->master().GrantData("daemon-0"));
  ASSERT_EQ(g0.grant().size(), auth::kGrantBytes);
  {
    ASSERT_OK_AND_ASSIGN(net::Fd fd, net::Dial(d1.transports["tcp"], deadline));
    transport::tcp::Connection c(std::move(fd), d1.transports["tcp"]);
    absl::Status st = c.Authenticate(d1.segment_index, d1.segment_id, {g0.grant(), g0.session_key()}, deadline);
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kUnauthenticated));
    EXPECT_NE(st.message().find("does not match this segment's key"), std::string::npos) << st;
  }
  {
    // The same grant on its own segment is admitted.
    ASSERT_OK_AND_ASSIGN(net::Fd fd, net::Dial(d0.transports["tcp"], deadline));
    transport::tcp::Connection c(std::move(fd), d0.transports["tcp"]);
    EXPECT_OK(c.Authenticate(d0.segment_index, d0.segment_id, {g0.grant(), g0.session_key()}, deadline));
  }
  // No master token, no grant.
  client::MasterClientOptions anonymous;
  anonymous.rpc_timeout = absl::Seconds(3);
  ASSERT_OK_AND_ASSIGN(auto nobody, client::MasterClient::Create(cluster_.master_address(), anonymous));
  EXPECT_THAT(nobody->GrantData("daemon-0").status(), StatusIs(absl::StatusCode::kUnauthenticated));

  // daemon-0 restarts with a new key: the long-lived clients renew their grants.
  cluster_.daemon(0).Kill(SIGKILL);
  cluster_.daemon(0).Wait();
  ASSERT_OK(cluster_.StartDaemon(0));
  ASSERT_OK(cluster_.WaitForLiveSegments(2));
  client::PutOptions there;
  there.preferred_segment = "daemon-0";
  absl::Status put;
  for (int attempt = 0; attempt < 20; ++attempt) {
    put = tcp->Put("after-restart", ValueFor("after-restart", 4096), there);
    if (put.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_OK(put);
  absl::StatusOr<std::string> back = any->Get("after-restart");
  ASSERT_OK(back.status());
  EXPECT_TRUE(*back == ValueFor("after-restart", 4096));
  EXPECT_TRUE(cluster_.daemon(1).Running());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tierkv

namespace tierkv {
namespace {

// Tenants with real processes: two tenants' equal keys are two objects,
// neither sees or removes the other's, an admin sets quotas with
// tierkvctl, a put over quota first evicts the tenant's own oldest pages
// and is then refused naming the tenant and the quota, and the quota
// outlives a master restart.
TEST_F(StoreClusterTest, TenantsAreIsolatedAndQuotasRefuseVisibly) {
  const std::string dir = testing::MakeTempDir("tierkv-tenants");
  std::ofstream(dir + "/tokens") << "daemon-token-0000000000 decode daemon\n"
                                    "tenant-a-token-00000000 vllm-a client tenant=team-a\n"
                                    "tenant-b-token-00000000 vllm-b client tenant=team-b\n"
                                    "plain-token-00000000000 sglang client\n"
                                    "admin-token-00000000000 ops admin\n";
  std::ofstream(dir + "/daemon.token") << "daemon-token-0000000000\n";
  std::ofstream(dir + "/admin.token") << "admin-token-00000000000\n";
  std::ofstream(dir + "/a.token") << "tenant-a-token-00000000\n";
  ASSERT_OK(cluster_.Start({.daemons = 1,
                            .segment_size = "64mib",
                            .segment_ttl = "5s",
                            .persist = true,
                            .master_flags = {"--auth=token", "--token-file=" + dir + "/tokens",
                                             "--query-stats-key-prefix-separator=/"},
                            .daemon_flags = {"--token-file=" + dir + "/daemon.token"},
                            .token = "plain-token-00000000000"}));
  auto a = Client({}, "tenant-a-token-00000000");
  auto b = Client({}, "tenant-b-token-00000000");
  auto plain = Client();
  ASSERT_TRUE(a && b && plain);

  // The same key, three objects.
  ASSERT_OK(a->Put("shared", "from a"));
  ASSERT_OK(b->Put("shared", "from b"));
  EXPECT_EQ(*a->Get("shared"), "from a");
  EXPECT_EQ(*b->Get("shared"), "from b");
  EXPECT_THAT(plain->Get("shared"), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(a->Put("a-only", "x"));
  EXPECT_EQ(*b->PrefixMatch({"a-only"}), 0u);
  EXPECT_EQ(*a->PrefixMatch({"a-only"}), 1u);
  EXPECT_THAT(b->Remove("a-only", /*force=*/true), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(b->Remove("shared", /*force=*/true));
  EXPECT_EQ(*a->Get("shared"), "from a");
  // /v1/objects looks in the caller's own tenant too.
  EXPECT_TRUE(cluster_.HttpGet("/v1/objects/a-only", 0, "tenant-a-token-00000000").ok());
  EXPECT_FALSE(cluster_.HttpGet("/v1/objects/a-only", 0, "tenant-b-token-00000000").ok());
  // So do the query statistics: a tenant sees its own clients and key
  // prefixes, by the names it uses; a caller outside any tenant sees
  // every tenant's, each with its tenant.
  EXPECT_EQ(*a->PrefixMatch({"model-a/p0"}), 0u);
  EXPECT_EQ(*b->PrefixMatch({"model-b/p0"}), 0u);
  auto query_rows = [&](const std::string& token, const char* rows) {
    absl::StatusOr<std::string> body = cluster_.HttpGet("/v1/stats", 0, token);
    EXPECT_TRUE(body.ok()) << body.status();
    nlohmann::json j = nlohmann::json::parse(body.ok() ? *body : "{}", nullptr, false);
    return j.is_object() && j.contains("queries") ? j["queries"][rows] : nlohmann::json::array();
  };
  auto prefixes = [&](const std::string& token) {
    std::set<std::string> out;
    for (const auto& r : query_rows(token, "prefixes")) {
      out.insert(r.value("tenant", "") + ":" + r["key_prefix"].get<std::string>());
    }
    return out;
  };
  EXPECT_EQ(prefixes("tenant-a-token-00000000"), std::set<std::string>{":model-a"});
  EXPECT_EQ(prefixes("tenant-b-token-00000000"), std::set<std::string>{":model-b"});
  const std::set<std::string> every = prefixes("plain-token-00000000000");
  EXPECT_TRUE(every.count("team-a:model-a") == 1 && every.count("team-b:model-b") == 1) << ::testing::PrintToString(every);
  for (const auto& r : query_rows("tenant-a-token-00000000", "clients")) EXPECT_FALSE(r.contains("tenant")) << r;
  size_t tenant_clients = 0;
  for (const auto& r : query_rows("plain-token-00000000000", "clients")) tenant_clients += r.contains("tenant");
  EXPECT_GE(tenant_clients, 2u);
  absl::StatusOr<std::string> labelled = cluster_.HttpGet("/metrics", 0, "admin-token-00000000000");
  ASSERT_OK(labelled.status());
  EXPECT_THAT(*labelled, ::testing::HasSubstr("prefix=\"model-a\",tenant=\"team-a\""));
  EXPECT_EQ(labelled->find('\0'), std::string::npos);

  std::vector<std::string> base{"--master=" + cluster_.master_address(),
                                absl::StrCat("--http=127.0.0.1:", cluster_.http_port())};
  auto ctl = [&](const std::string& token_file, std::vector<std::string> args) {
    std::string cmd = testing::BinaryPath("tierkvctl") + " '--token-file=" + token_file + "'";
    for (const std::string& x : base) cmd += " '" + x + "'";
    for (const std::string& x : args) cmd += " '" + x + "'";
    cmd += " > " + dir + "/out 2>&1";
    int rc = std::system(cmd.c_str());
    std::ifstream in(dir + "/out");
    return std::make_pair(WEXITSTATUS(rc), std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
  };
  // Only an admin sets limits.
  auto denied = ctl(dir + "/a.token", {"tenants", "set", "team-a", "1GiB"});
  EXPECT_EQ(denied.first, 1);
  EXPECT_NE(denied.second.find("HTTP 403"), std::string::npos) << denied.second;
  auto set = ctl(dir + "/admin.token", {"tenants", "set", "team-a", "256KiB", "64KiB"});
  ASSERT_EQ(set.first, 0) << set.second;
  EXPECT_NE(set.second.find("tenant team-a: quota 256.0 KiB"), std::string::npos) << set.second;
  EXPECT_EQ(ctl(dir + "/admin.token", {"tenants", "set", "team-a", "1KiB", "2KiB"}).first, 1);  // guarantee > quota

  // 64 KiB pages (and their 8-byte trailers): three fit the quota; each
  // later one evicts team-a's oldest page.
  ASSERT_OK(a->Remove("shared", /*force=*/true));
  ASSERT_OK(a->Remove("a-only", /*force=*/true));
  std::vector<std::string> pages;
  for (int i = 0; i < 6; ++i) {
    pages.push_back(absl::StrCat("page-", i));
    ASSERT_OK(a->Put(pages.back(), ValueFor(pages.back(), 64 << 10))) << i;
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // distinct access ticks
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(*a->PrefixMatch({pages[i]}), 0u) << i;  // evicted for team-a's own puts
  for (int i = 3; i < 6; ++i) EXPECT_EQ(*a->PrefixMatch({pages[i]}), 1u) << i;
  absl::StatusOr<std::string> newest = a->Get("page-5");
  ASSERT_OK(newest.status());
  EXPECT_TRUE(*newest == ValueFor("page-5", 64 << 10));
  // Larger than the whole quota: refused, saying whose quota.
  absl::Status over = a->Put("too-big", ValueFor("too-big", 300 << 10));
  EXPECT_THAT(over, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(over.message().find("tenant team-a is over its quota of 262144 bytes"), std::string::npos) << over;
  // Another tenant is not held to it.
  ASSERT_OK(b->Put("too-big", ValueFor("too-big", 300 << 10)));

  // The figures: the admin sees every tenant, a tenant only itself.
  auto listed = ctl(dir + "/admin.token", {"--json", "tenants"});
  ASSERT_EQ(listed.first, 0) << listed.second;
  nlohmann::json t = nlohmann::json::parse(listed.second);
  ASSERT_EQ(t.size(), 2u) << t.dump();
  EXPECT_EQ(t[0]["tenant"], "team-a");
  EXPECT_EQ(t[0]["quota_bytes"], 256 << 10);
  EXPECT_EQ(t[0]["used_bytes"], 3 * client::StoredSize(64 << 10));
  EXPECT_EQ(t[0]["puts_rejected"], 1);
  EXPECT_EQ(t[0]["quota_evicted_bytes"], 3 * client::StoredSize(64 << 10));
  EXPECT_EQ(t[1]["tenant"], "team-b");
  auto own = ctl(dir + "/a.token", {"--json", "tenants"});
  ASSERT_EQ(own.first, 0) << own.second;
  EXPECT_EQ(nlohmann::json::parse(own.second).size(), 1u);
  EXPECT_NE(ctl(dir + "/admin.token", {"tenants"}).second.find("team-a"), std::string::npos);
  absl::StatusOr<std::string> metrics = cluster_.HttpGet("/metrics");
  ASSERT_OK(metrics.status());
  EXPECT_NE(metrics->find("tierkv_tenant_puts_rejected_total{tenant=\"team-a\"} 1"), std::string::npos);
  EXPECT_NE(metrics->find("tierkv_tenant_quota_bytes{tenant=\"team-a\"} 262144"), std::string::npos);

  // The quota outlives a master restart; team-a's pages read back.
  cluster_.master().Kill(SIGKILL);
  cluster_.master().Wait();
  ASSERT_OK(cluster_.StartMaster());
  ASSERT_OK(cluster_.WaitForLiveSegments(1));
  absl::StatusOr<std::string> after = cluster_.HttpGet("/v1/tenants/team-a", 0, "admin-token-00000000000");
  ASSERT_OK(after.status());
  nlohmann::json ta = nlohmann::json::parse(*after);
  EXPECT_EQ(ta["quota_bytes"], 256 << 10);
  EXPECT_EQ(ta["guaranteed_bytes"], 64 << 10);
  EXPECT_EQ(ta["used_bytes"], 3 * client::StoredSize(64 << 10));
  absl::StatusOr<std::string> kept = a->Get("page-5");
  ASSERT_OK(kept.status());
  EXPECT_TRUE(*kept == ValueFor("page-5", 64 << 10));
  EXPECT_THAT(a->Put("too-big", ValueFor("too-big", 300 << 10)), StatusIs(absl::StatusCode::kResourceExhausted));
  ASSERT_OK(ctl(dir + "/admin.token", {"tenants", "clear", "team-a"}).first == 0 ? absl::OkStatus()
                                                                                 : absl::InternalError("clear"));
  EXPECT_OK(a->Put("too-big", ValueFor("too-big", 300 << 10)));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tierkv

namespace tierkv {
namespace {

// The master's gRPC port over mutual TLS, with certificates made by the
// openssl command: a daemon and a client holding certificates the
// master's CA signs mount, put and get (tokens on top); a caller without
// TLS, without a certificate, with one another CA signed, or trusting
// another CA is refused, and the master stays up. A key that does not
// match its certificate stops the master at start, saying so.
TEST_F(StoreClusterTest, MutualTlsAdmitsOnlyCertificatesTheMastersCaSigns) {
  const std::string dir = testing::MakeTempDir("tierkv-tls");
  absl::StatusOr<testing::TestCerts> certs = testing::MakeTestCerts(dir);
  ASSERT_OK(certs.status());
  std::ofstream(dir + "/tokens") << "daemon-token-0000000000 decode daemon\nclient-token-0000000000 worker client\n";
  std::ofstream(dir + "/daemon.token") << "daemon-token-0000000000\n";
  const auth::TlsFiles client_tls{certs->ca, certs->client_cert, certs->client_key};
  ASSERT_OK(cluster_.Start({.daemons = 1,
                            .segment_size = "64mib",
                            .master_flags = {"--auth=token", "--token-file=" + dir + "/tokens",
                                             "--tls-cert=" + certs->server_cert, "--tls-key=" + certs->server_key,
                                             "--tls-ca=" + certs->ca},
                            .daemon_flags = {"--token-file=" + dir + "/daemon.token", "--tls-ca=" + certs->ca,
                                             "--tls-cert=" + certs->client_cert, "--tls-key=" + certs->client_key},
                            .token = "client-token-0000000000",
                            .tls = client_tls}));
  auto client = Client({"tcp"});
  ASSERT_NE(client, nullptr);
  for (int i = 0; i < 20; ++i) {
    const std::string key = absl::StrCat("tls-", i);
    ASSERT_OK(client->Put(key, ValueFor(key, 4096 + i)));
  }
  for (int i = 0; i < 20; ++i) {
    const std::string key = absl::StrCat("tls-", i);
    absl::StatusOr<std::string> v = client->Get(key);
    ASSERT_OK(v.status()) << key;
    EXPECT_TRUE(*v == ValueFor(key, 4096 + i)) << key;
  }

  // Each wrong caller: refused (no answer over a TLS handshake that fails).
  auto stats_with = [&](auth::TlsFiles tls) {
    client::MasterClientOptions o;
    o.rpc_timeout = absl::Seconds(2);
    o.token = "client-token-0000000000";
    o.tls = std::move(tls);
    absl::StatusOr<std::unique_ptr<client::MasterClient>> m = client::MasterClient::Create(cluster_.master_address(), o);
    if (!m.ok()) return m.status();
    return (*m)->Stats().status();
  };
  EXPECT_OK(stats_with(client_tls));
  auto refused = [](const absl::Status& s) {
    return absl::IsDeadlineExceeded(s) && absl::StrContains(s.message(), "no connection before the deadline");
  };
  EXPECT_PRED1(refused, stats_with({}));                                                     // plain
  EXPECT_PRED1(refused, stats_with({certs->ca, "", ""}));                                    // no certificate
  EXPECT_PRED1(refused, stats_with({certs->ca, certs->rogue_cert, certs->rogue_key}));       // another CA's
  EXPECT_PRED1(refused, stats_with({certs->other_ca, certs->client_cert, certs->client_key}));  // master not trusted
  EXPECT_THAT(stats_with({certs->ca, certs->client_cert, certs->server_key}),                 // a key not its own
              StatusIs(absl::StatusCode::kInvalidArgument));
  // Plain bytes on the port (a direct-lane ping) get no answer a client could use.
  {
    const absl::Time deadline = absl::Now() + absl::Seconds(3);
    ASSERT_OK_AND_ASSIGN(net::Fd fd,
                         net::Dial(absl::StrCat("127.0.0.1:", cluster_.rpc_port()), deadline));
    const std::string junk(64, '\x01');
    (void)net::WriteFull(fd.get(), junk.data(), junk.size(), deadline);
    char reply[64];
    absl::Status read = net::ReadFull(fd.get(), reply, sizeof reply, deadline);
    EXPECT_FALSE(read.ok());
  }
  EXPECT_TRUE(cluster_.master().Running());
  EXPECT_OK(client->Put("still-served", "yes"));

  // A key that is not the certificate's: the master does not start.
  absl::StatusOr<std::unique_ptr<testing::ChildProcess>> bad = testing::ChildProcess::Start(
      testing::BinaryPath("tierkv-master"),
      {"--rpc-port=0", "--http-port=0", "--tls-cert=" + certs->server_cert, "--tls-key=" + certs->client_key},
      {}, absl::Seconds(10));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("is not the key of"), std::string::npos) << bad.status();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tierkv
