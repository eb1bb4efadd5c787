// One master and three store daemons as real processes on loopback; the
// client library in the test process. This file: objects, replicas,
// eviction, groups, readiness, master restarts, the C API and tierkvctl.
// The replica cache and leases: store_cache_test.cc; query statistics:
// store_stats_test.cc; authentication, tenants and TLS:
// store_auth_test.cc; the fixture: store_fixture.h.
#include "tests/integration/store_fixture.h"

#include <atomic>
#include <fstream>
#include <thread>

#include "client/tierkv.h"
#include "httplib.h"
#include "tests/support/promtool.h"

namespace tierkv::integration {
namespace {

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
      EXPECT_OK(WaitFor(absl::StrCat(key, " to read NOT_FOUND"), deadline - absl::Now(), [&] {
        if (absl::IsNotFound(v.status())) return true;
        v = client->Get(key);
        return absl::IsNotFound(v.status());
      }));
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
    ASSERT_OK(WaitFor("the daemon to be ready", absl::Seconds(15),
                      [&] { return cluster_.HttpGet("/ready", ready_port).ok(); }))
        << (*d)->Stderr();
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
    EXPECT_OK(WaitFor(absl::StrCat("the master's /ready to answer ", status), absl::Seconds(15),
                      [&] { return ready().first == status; }));
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

}  // namespace
}  // namespace tierkv::integration
