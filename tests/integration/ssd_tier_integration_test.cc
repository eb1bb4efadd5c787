// tierkv-store with --ssd-dir as a real process: the tier's file on a
// temporary directory, found again by a restarted daemon, and a tier that
// fails (a failpoint in the scan) leaving the DRAM segment serving.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "base/auth.h"
#include "httplib.h"
#include "base/io/file_io.h"
#include "transport/descriptor.h"
#include "store/ssd_tier.h"
#include "tests/support/cluster.h"
#include "tests/support/status_matchers.h"
#include "tests/support/tls_certs.h"
#include "tests/support/values.h"
#include "tests/support/wait.h"

namespace tierkv {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::TestCluster;
using testing::WaitFor;

constexpr uint64_t kRegion = 1 << 20;
constexpr uint64_t kSize = 32 << 20;

// The value of an unlabelled metric in a /metrics body; -1 when absent.
double Metric(const std::string& body, const std::string& name) {
  size_t at = body.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(body.substr(at + name.size() + 2));
}

class SsdDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (absl::Status u = io::UringAvailable(); !u.ok()) GTEST_SKIP() << u.message();
    // Short leases, no grace and a quick tick: a staging extent an SSD
    // hit takes is back within a fraction of a second.
    ASSERT_OK(cluster_.Start(
        {.daemons = 0, .master_flags = {"--lease-ttl=200ms", "--revoke-grace=0s", "--check-interval=50ms"}}));
    dir_ = testing::MakeTempDir("tierkv-ssd");
  }
  void TearDown() override {
    if (HasFailure()) {
      std::cerr << cluster_.Logs();
      if (daemon_) std::cerr << daemon_->Stderr();
    }
    client_.reset();
    daemon_.reset();
    std::filesystem::remove_all(dir_);
  }

  std::vector<std::string> DaemonArgs(const std::string& dir, uint64_t region, const std::string& segment_size) {
    std::vector<std::string> args{"--master=" + cluster_.master_address(), "--metadata=" + cluster_.metadata_url(),
                                  "--segment-size=" + segment_size,
                                  "--port=0", "--http-port=0", "--heartbeat-interval=200ms", "--name=ssd-daemon",
                                  "--ssd-dir=" + dir, absl::StrCat("--ssd-size=", kSize),
                                  absl::StrCat("--ssd-region-size=", region)};
    args.insert(args.end(), extra_daemon_args_.begin(), extra_daemon_args_.end());
    return args;
  }

  absl::Status StartDaemon(const std::string& dir, const std::map<std::string, std::string>& env = {},
                           uint64_t region = kRegion, const std::string& segment_size = "64mib") {
    daemon_.reset();
    auto d = ChildProcess::Start(BinaryPath("tierkv-store"), DaemonArgs(dir, region, segment_size), env);
    if (!d.ok()) return d.status();
    daemon_ = std::move(*d);
    return cluster_.WaitForLiveSegments(1);
  }

  // The daemon says its tier is down (`why` in /health) and a client's put
  // and get go through its DRAM.
  void ExpectTierDownAndDramServing(const std::string& why) {
    const std::string health = Get("/health");
    EXPECT_THAT(health, ::testing::HasSubstr("ssd: failed: "));
    EXPECT_THAT(health, ::testing::HasSubstr(why));
    EXPECT_EQ(Metric(Get("/metrics"), "tierkv_store_ssd_failed"), 1);
    auto client = cluster_.NewClient();
    ASSERT_OK(client.status());
    std::string v = testing::Payload("k", 50000);
    ASSERT_OK((*client)->Put("k", v));
    absl::StatusOr<std::string> out = (*client)->Get("k");
    ASSERT_OK(out.status());
    EXPECT_EQ(*out, v);
  }

  // Reads every key through client_: each is its value, byte-identical, or
  // NOT_FOUND. Returns how many were served.
  int ReadBack(const std::vector<std::string>& keys, const std::vector<std::string>& values) {
    int served = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      absl::StatusOr<std::string> v = client_->Get(keys[i]);
      // A page the index still holds can miss while DRAM is full of copies
      // staged for earlier reads under their lease: read it again once
      // those end (a slow build, e.g. TSan, meets this more often).
      absl::StatusOr<bool> held = absl::IsNotFound(v.status()) ? client_->Exists(keys[i]) : false;
      if (held.ok() && *held) v = GetOnceStaged(keys[i]);
      if (v.ok()) {
        EXPECT_EQ(*v, values[i]) << keys[i];
        ++served;
      } else {
        EXPECT_TRUE(absl::IsNotFound(v.status())) << keys[i] << ": " << v.status();
      }
    }
    return served;
  }

  // Ready: mounted, and its SSD records listed to the master.
  absl::Status WaitUntilReady() {
    return WaitFor("the daemon to be ready", absl::Seconds(10),
                   [&] { return cluster_.HttpGet("/ready", daemon_->port("http")).ok(); });
  }

  // client_'s get of `key`, read again while it misses: DRAM can be full
  // of copies staged for reads still under their 200 ms lease (reads here
  // are faster than that), and the page stages again once those end.
  absl::StatusOr<std::string> GetOnceStaged(const std::string& key) {
    absl::StatusOr<std::string> got = client_->Get(key);
    (void)WaitFor(key + " to stage again once staging leases end", absl::Seconds(5), [&] {
      if (!absl::IsNotFound(got.status())) return true;
      got = client_->Get(key);
      return !absl::IsNotFound(got.status());
    });
    return got;
  }

  std::string Get(const std::string& path) {
    absl::StatusOr<std::string> body = cluster_.HttpGet(path, daemon_->port("http"));
    EXPECT_OK(body.status());
    return body.ok() ? *body : "";
  }

  // Writes `n` records into dir's tier file as a daemon would have left
  // them, then tears the header of one more (a crash in its write).
  void LeaveRecords(int n) {
    auto file = io::OpenUringFile({.path = dir_ + "/tierkv-ssd.dat", .size = kSize});
    ASSERT_OK(file.status());
    auto tier = store::SsdTier::Open(std::move(*file), {.region_size = kRegion});
    ASSERT_OK(tier.status());
    std::vector<std::string> values;
    for (int i = 0; i <= n; ++i) values.push_back(testing::Payload(absl::StrCat("page-", i), 100000));
    std::vector<store::SsdWrite> w;
    for (int i = 0; i <= n; ++i) w.push_back({absl::StrCat("page-", i), values[i].data(), values[i].size()});
    for (const absl::Status& s : (*tier)->WriteBatch(w)) ASSERT_OK(s);
    tier->reset();
    // Records take 100 KiB each, so a region holds ten; with n = 20 the
    // last record opens region 2. Overwrite its header's CRC.
    ASSERT_EQ(n, 20);
    int fd = open((dir_ + "/tierkv-ssd.dat").c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    uint32_t junk = 0xdeadbeef;
    ASSERT_EQ(pwrite(fd, &junk, 4, static_cast<off_t>(2 * kRegion) + 48), 4);
    close(fd);
  }

  // Starts a daemon with 16 MiB of DRAM and a client (client_), and puts
  // 384 pages of 64 KiB, each found once by a lookup: read once, so
  // eviction keeps it on SSD (the admission rule). A page may be evicted
  // before its lookup when the evictor runs behind the puts (the tier's
  // writes slowed by `env`, or a loaded machine): eviction is
  // second-chance LRU, so a pass that finds every older page read since
  // the last pass reaches the page just put, which is unread and so
  // dropped, by design. Such pages leave *keys (they are misses, and
  // nothing reads them back); without `env` they must stay few.
  void StartAndFill(std::vector<std::string>* keys, std::vector<std::string>* values,
                    const std::map<std::string, std::string>& env = {}) {
    ASSERT_OK(StartDaemon(dir_, env, kRegion, "16mib"));
    auto client = cluster_.NewClient(client_transports_);
    ASSERT_OK(client.status());
    client_ = std::move(*client);
    // Ready only once its records are listed to the master, with the
    // tier's size: from then on an eviction moves to SSD, never drops.
    ASSERT_OK(WaitUntilReady());
    absl::StatusOr<std::string> segs = cluster_.HttpGet("/v1/segments");
    ASSERT_OK(segs.status());
    EXPECT_NE(segs->find(absl::StrCat("\"ssd_capacity\":", kSize)), std::string::npos) << *segs;
    constexpr int kPages = 384;
    for (int i = 0; i < kPages; ++i) {
      const std::string key = absl::StrCat("page-", i);
      std::string value = testing::Payload(key, (64 << 10) - 8);
      ASSERT_OK(client_->Put(key, value)) << i;
      ASSERT_OK_AND_ASSIGN(size_t matched, client_->PrefixMatch({key}));
      if (matched == 0) {
        ++missed_;
        continue;
      }
      keys->push_back(key);
      values->push_back(std::move(value));
    }
    if (missed_ > 0) std::printf("%d of %d pages were evicted before their first lookup\n", missed_, kPages);
    if (env.empty()) {
      ASSERT_LE(missed_, kPages / 16);
    }
  }

  TestCluster cluster_;
  std::vector<std::string> extra_daemon_args_;
  std::vector<std::string> client_transports_;  // StartAndFill's client; empty: auto
  int missed_ = 0;  // pages StartAndFill's lookup missed
  std::string dir_;
  std::unique_ptr<ChildProcess> daemon_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(SsdDaemonTest, ReportsItsTierInHealthAndMetrics) {
  ASSERT_OK(StartDaemon(dir_));
  std::string health = Get("/health");
  EXPECT_THAT(health, ::testing::HasSubstr("ssd: ok 0 records"));
  std::string m = Get("/metrics");
  EXPECT_EQ(Metric(m, "tierkv_store_ssd_capacity_bytes"), static_cast<double>(kSize));
  EXPECT_EQ(Metric(m, "tierkv_store_ssd_failed"), 0);
  EXPECT_EQ(Metric(m, "tierkv_store_ssd_direct_io"), health.find("buffered I/O") == std::string::npos ? 1 : 0);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/tierkv-ssd.dat"));
}

// Records the master holds no replica for (here written behind its back)
// are found by the scan, torn ones skipped, and then erased after the
// daemon's listing: nobody could name them, and their space is the tier's.
TEST_F(SsdDaemonTest, RestartedDaemonFindsItsRecordsAndSkipsATornOne) {
  LeaveRecords(20);
  ASSERT_OK(StartDaemon(dir_));
  std::string m = Get("/metrics");
  EXPECT_EQ(Metric(m, "tierkv_store_ssd_recovered_records"), 20);
  EXPECT_EQ(Metric(m, "tierkv_store_ssd_torn_records"), 1);
  std::string health;
  EXPECT_OK(WaitFor("the unnamed records to be erased", absl::Seconds(5), [&] {
    health = Get("/health");
    return health.find("ssd: ok 0 records") != std::string::npos;
  }));
  EXPECT_THAT(health, ::testing::HasSubstr("ssd: ok 0 records"));
  EXPECT_THAT(daemon_->Stderr(), ::testing::HasSubstr("0 kept, 20 erased"));
  // A rolling restart: SIGTERM, start again on the same directory, even
  // with another --ssd-region-size (the file keeps the one it was made
  // with). The erased records stay erased.
  daemon_->Kill(SIGTERM);
  EXPECT_EQ(daemon_->Wait(), 0);
  ASSERT_OK(cluster_.WaitForLiveSegments(0));
  ASSERT_OK(StartDaemon(dir_, {}, 4 * kRegion));
  m = Get("/metrics");
  EXPECT_EQ(Metric(m, "tierkv_store_ssd_recovered_records"), 0);
  EXPECT_THAT(daemon_->Stderr(), ::testing::HasSubstr("--ssd-region-size 4194304 ignored"));
}

TEST_F(SsdDaemonTest, AFailedTierLeavesDramServing) {
  ASSERT_OK(StartDaemon(dir_, {{"TIERKV_FAILPOINTS", "store.ssd.scan=error"}}));
  ExpectTierDownAndDramServing("");
}

// A file system that refuses O_DIRECT (tmpfs before Linux 6.6), as the
// store.ssd.direct failpoint makes any directory answer.
TEST_F(SsdDaemonTest, WithoutDirectIoFallsBackToBufferedIoAndSaysSo) {
  LeaveRecords(20);
  ASSERT_OK(StartDaemon(dir_, {{"TIERKV_FAILPOINTS", "store.ssd.direct=error"}}));
  EXPECT_EQ(Metric(Get("/metrics"), "tierkv_store_ssd_recovered_records"), 20);
  EXPECT_THAT(Get("/health"), ::testing::HasSubstr("buffered I/O"));
  EXPECT_EQ(Metric(Get("/metrics"), "tierkv_store_ssd_direct_io"), 0);
  EXPECT_THAT(daemon_->Stderr(), ::testing::HasSubstr("O_DIRECT is not supported"));
}

TEST_F(SsdDaemonTest, SsdDirWithoutSizeIsRefused) {
  auto d = ChildProcess::Start(BinaryPath("tierkv-store"),
                               {"--master=" + cluster_.master_address(), "--port=0", "--http-port=0",
                                "--ssd-dir=" + dir_});
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(std::string(d.status().message()), ::testing::HasSubstr("--ssd-size"));
}

// A daemon restarted with its --ssd-dir, after kill -9 and after a
// graceful stop: the master keeps the SSD replicas of its tier (same
// ssd_id) through the new incarnation, the daemon's listing confirms them,
// and every page that was on SSD reads back byte-identical; the pages
// only in DRAM are gone with the process and read as misses, never as
// other bytes.
TEST_F(SsdDaemonTest, ARestartedDaemonServesItsSsdPagesAgain) {
  std::vector<std::string> keys, values;
  ASSERT_NO_FATAL_FAILURE(StartAndFill(&keys, &values));
  // Until the evictor is done moving pages: the record count, sampled
  // 200 ms apart, has stopped changing.
  double records = -1;
  absl::Time sampled = absl::InfinitePast();
  ASSERT_OK(WaitFor("the SSD record count to settle", absl::Seconds(30), [&] {
    if (absl::Now() - sampled < absl::Milliseconds(200)) return false;
    const double now = Metric(Get("/metrics"), "tierkv_store_ssd_records");
    sampled = absl::Now();
    const bool settled = now > 0 && now == records;
    records = now;
    return settled;
  }));
  ASSERT_GT(records, 100);
  const std::string confirmed = "tierkv_master_ssd_records_total{outcome=\"confirmed\"}";
  auto restart_and_read = [&](int sig, double confirmed_before) {
    daemon_->Kill(sig);
    daemon_->Wait();
    ASSERT_OK(StartDaemon(dir_, {}, kRegion, "16mib"));
    // The listing is in once the master has confirmed every record.
    double got = 0;
    absl::Status fetched;
    EXPECT_OK(WaitFor("the master to confirm every record", absl::Seconds(10), [&] {
      absl::StatusOr<std::string> m = cluster_.HttpGet("/metrics");
      fetched = m.status();
      if (!m.ok()) return true;  // asserted below
      got = Metric(*m, confirmed);
      return got >= confirmed_before + records;
    })) << "signal " << sig;
    ASSERT_OK(fetched);
    ASSERT_EQ(got, confirmed_before + records) << "signal " << sig;
    EXPECT_EQ(ReadBack(keys, values), static_cast<int>(records)) << "signal " << sig;
  };
  restart_and_read(SIGKILL, 0);
  restart_and_read(SIGTERM, records);
}

// kill -9 while offload orders are out: every write of the tier stalls
// 300 ms, and the daemon dies just after its first records land, while
// the evictor's next orders are out (about 20 pages' orders failed with
// it in the runs this was written with). Restarted on the same --ssd-dir, it
// serves every record that was written, byte-identical; the pages whose
// order died with it are misses, never other bytes.
TEST_F(SsdDaemonTest, KilledMidOffloadServesWhatWasWrittenAndNothingElse) {
  std::vector<std::string> keys, values;
  ASSERT_NO_FATAL_FAILURE(StartAndFill(&keys, &values, {{"TIERKV_FAILPOINTS", "store.ssd.write=sleep:300"}}));
  double written = 0;
  EXPECT_OK(WaitFor("the first records to land", absl::Seconds(10), [&] {
    written = Metric(Get("/metrics"), "tierkv_store_ssd_records");
    return written > 0;
  }));
  ASSERT_GT(written, 0);
  daemon_->Kill(SIGKILL);
  daemon_->Wait();
  ASSERT_OK(StartDaemon(dir_, {}, kRegion, "16mib"));
  ASSERT_OK(WaitUntilReady());
  const double recovered = Metric(Get("/metrics"), "tierkv_store_ssd_recovered_records");
  EXPECT_GE(recovered, written);  // what was written before the kill survived it
  const int served = ReadBack(keys, values);
  // DRAM went with the process: what is served came from the SSD records.
  EXPECT_GE(served, static_cast<int>(written));
  EXPECT_LE(served, static_cast<int>(recovered));
}

// A file system without room for the tier's file (a 4 MiB tmpfs, mounted
// in a mount namespace of the daemon's own, for a 32 MiB tier): the tier
// is down from the start and says why; the daemon is ready and serves
// its DRAM.
TEST_F(SsdDaemonTest, ADiskWithoutRoomForTheTierLeavesDramServing) {
  const std::string probe = absl::StrCat("/usr/bin/unshare -m /bin/sh -c 'mount -t tmpfs -o size=4m tmpfs ", dir_,
                                         " && umount ", dir_, "' >/dev/null 2>&1");
  if (std::system(probe.c_str()) != 0) GTEST_SKIP() << "cannot mount a tmpfs in a mount namespace here (needs CAP_SYS_ADMIN)";
  std::string cmd = absl::StrCat("mount -t tmpfs -o size=4m tmpfs ", dir_, " && exec ", BinaryPath("tierkv-store"));
  for (const std::string& a : DaemonArgs(dir_, kRegion, "64mib")) absl::StrAppend(&cmd, " '", a, "'");
  auto d = ChildProcess::Start("/usr/bin/unshare", {"-m", "/bin/sh", "-c", cmd});
  ASSERT_OK(d.status());
  daemon_ = std::move(*d);
  ASSERT_OK(cluster_.WaitForLiveSegments(1));
  ASSERT_OK(WaitUntilReady());
  ExpectTierDownAndDramServing("no room for");
}

}  // namespace
}  // namespace tierkv

namespace tierkv {
namespace {

// Offload on eviction end to end: a daemon whose DRAM holds about half of
// what is put keeps the rest on its SSD tier (each page was read once,
// the admission rule), and every page reads back byte-identical, those on
// SSD through a staging extent and the usual trailer check.
TEST_F(SsdDaemonTest, PagesEvictedFromDramAreServedFromSsd) {
  std::vector<std::string> keys, values;
  ASSERT_NO_FATAL_FAILURE(StartAndFill(&keys, &values));
  const int kPages = static_cast<int>(keys.size());
  std::string metrics = Get("/metrics");
  EXPECT_GT(Metric(metrics, "tierkv_store_ssd_records"), 100);
  absl::StatusOr<std::string> master_metrics = cluster_.HttpGet("/metrics");
  ASSERT_OK(master_metrics.status());
  EXPECT_THAT(*master_metrics, ::testing::HasSubstr("tierkv_master_ssd_moves_total{kind=\"offloaded\"}"));
  EXPECT_THAT(*master_metrics, ::testing::HasSubstr("tierkv_segment_ssd_used_bytes{"));
  for (int i = 0; i < kPages; ++i) {
    absl::StatusOr<std::string> got = GetOnceStaged(keys[i]);
    ASSERT_OK(got.status()) << keys[i];
    ASSERT_EQ(*got, values[i]) << keys[i];
  }
  EXPECT_GT(Metric(Get("/metrics"), "tierkv_store_ssd_bytes_total{direction=\"read\"}"), 0);
}

// The same cluster with --auth token everywhere: the master signs its
// offload orders with its own key and clients their stage orders with
// grants for the daemon's segment, each item with the master's leave for
// that object, so every page still reads back from SSD; an order that is
// unsigned, signed with another key, altered or stale is refused 401, an
// offload signed by a grant holder too, and a stage item without the
// master's leave for its key, extent and lease is refused and moves
// nothing.
class SsdDaemonAuthTest : public SsdDaemonTest {
 protected:
  void SetUp() override {
    if (absl::Status u = io::UringAvailable(); !u.ok()) GTEST_SKIP() << u.message();
    dir_ = testing::MakeTempDir("tierkv-ssd");
    std::ofstream(dir_ + "/tokens") << "ssd-daemon-token-000000 ssd daemon\nssd-client-token-000000 reader client\n";
    std::ofstream(dir_ + "/daemon.token") << "ssd-daemon-token-000000\n";
    ASSERT_OK(cluster_.Start({.daemons = 0,
                              .master_flags = {"--lease-ttl=200ms", "--revoke-grace=0s", "--check-interval=50ms",
                                               "--auth=token", "--token-file=" + dir_ + "/tokens"},
                              .token = "ssd-client-token-000000"}));
    extra_daemon_args_ = {"--auth=token", "--token-file=" + dir_ + "/daemon.token"};
  }
  int Post(const std::string& path, const std::string& body, const httplib::Headers& headers,
           v1::TierMoveResponse* answer = nullptr) {
    httplib::Client cli("127.0.0.1", daemon_->port("http"));
    cli.set_read_timeout(std::chrono::seconds(5));
    auto res = cli.Post(path, headers, body, "application/x-protobuf");
    if (res && answer != nullptr) EXPECT_TRUE(answer->ParseFromString(res->body));
    return res ? res->status : -1;
  }
};

TEST_F(SsdDaemonAuthTest, SignedTierOrdersMovePagesAndOthersAreRefused) {
  std::vector<std::string> keys, values;
  ASSERT_NO_FATAL_FAILURE(StartAndFill(&keys, &values));
  EXPECT_GT(Metric(Get("/metrics"), "tierkv_store_ssd_records"), 100);  // the master's signed offloads landed
  // Every page reads back, staged with the master's leave for each.
  for (size_t i = 0; i < keys.size(); ++i) {
    absl::StatusOr<std::string> got = GetOnceStaged(keys[i]);
    ASSERT_OK(got.status()) << keys[i];
    ASSERT_EQ(*got, values[i]) << keys[i];
  }
  EXPECT_GT(Metric(Get("/metrics"), "tierkv_store_ssd_bytes_total{direction=\"read\"}"), 0);

  v1::TierMoveRequest order;
  v1::TierMoveItem* item = order.add_items();
  item->set_key(keys[0]);
  item->set_offset(0);
  item->set_length(64 << 10);
  const std::string body = order.SerializeAsString();
  ASSERT_OK_AND_ASSIGN(v1::DataGrant g, client_->master().GrantData("ssd-daemon"));
  ASSERT_FALSE(g.grant().empty());
  auto signed_by = [&](const std::string& session_key, const std::string& signed_body, absl::Time at,
                       const std::string& path = "/tier/stage") {
    httplib::Headers h;
    for (auto& [name, value] : auth::SignTierRequest(g.grant(), session_key, path, signed_body, at)) {
      h.emplace(name, value);
    }
    return h;
  };
  EXPECT_EQ(Post("/tier/stage", body, {}), 401);
  EXPECT_EQ(Post("/tier/offload", body, {}), 401);
  EXPECT_EQ(Post("/tier/stage", body, signed_by(std::string(32, 'x'), body, absl::Now())), 401);
  EXPECT_EQ(Post("/tier/stage", body, signed_by(g.session_key(), "another body", absl::Now())), 401);
  EXPECT_EQ(Post("/tier/stage", body, signed_by(g.session_key(), body, absl::Now() - absl::Minutes(5))), 401);
  // A stage signed for /tier/stage does not pass as an offload, and no
  // grant holder can sign an offload (which erases and writes records by
  // name): only the master's key can.
  EXPECT_EQ(Post("/tier/offload", body, signed_by(g.session_key(), body, absl::Now())), 401);
  EXPECT_EQ(Post("/tier/offload", body, signed_by(g.session_key(), body, absl::Now(), "/tier/offload")), 401);

  // A grant for the segment is not leave to stage an object: an item needs
  // the master's proof for its key, extent and lease. Take a real one
  // from a GetReplicas answer that stages a page on SSD...
  v1::GetReplicasResponse staged;
  size_t hit = 0;
  ASSERT_OK(WaitFor("a lookup that stages a page", absl::Seconds(5), [&] {
    for (hit = keys.size(); hit-- > 0;) {
      absl::StatusOr<v1::GetReplicasResponse> r = client_->master().GetReplicas({keys[hit]});
      if (r.ok() && r->stage_proofs_size() > 0 && !r->stage_proofs(0).empty()) {
        staged = *r;
        return true;
      }
    }
    return false;
  }));
  const size_t other = hit == 0 ? 1 : 0;
  auto stage = [&](const std::string& key, uint64_t offset, const std::string& proof, int64_t expiry) {
    v1::TierMoveRequest o;
    v1::TierMoveItem* it = o.add_items();
    it->set_key(key);
    it->set_offset(offset);
    it->set_length(staged.sizes(0));
    it->set_proof(proof);
    it->set_expiry_unix_ms(expiry);
    const std::string b = o.SerializeAsString();
    v1::TierMoveResponse answer;
    EXPECT_EQ(Post("/tier/stage", b, signed_by(g.session_key(), b, absl::Now()), &answer), 200);
    return answer.status_size() == 1 ? absl::Status(static_cast<absl::StatusCode>(answer.status(0).code()),
                                                    answer.status(0).message())
                                     : absl::InternalError("no item status");
  };
  const std::string& proof = staged.stage_proofs(0);
  const uint64_t offset = staged.replica_offsets(0);
  const int64_t expiry = staged.lease_expiry_unix_ms(0);
  EXPECT_OK(stage(keys[hit], offset, proof, expiry));  // what the reader itself sends
  // ...and it moves to no other key, extent or expiry, nor is one made up.
  EXPECT_TRUE(absl::IsPermissionDenied(stage(keys[hit], offset, "", expiry)));
  EXPECT_TRUE(absl::IsPermissionDenied(stage(keys[hit], offset, std::string(16, 'x'), expiry)));
  EXPECT_TRUE(absl::IsPermissionDenied(stage(keys[other], offset, proof, expiry)));
  EXPECT_TRUE(absl::IsPermissionDenied(stage(keys[hit], offset + 4096, proof, expiry)));
  EXPECT_TRUE(absl::IsPermissionDenied(stage(keys[hit], offset, proof, expiry + 60'000)));
  v1::TierMoveResponse answer;  // the order with no leave at all: nothing staged
  EXPECT_EQ(Post("/tier/stage", body, signed_by(g.session_key(), body, absl::Now()), &answer), 200);
  ASSERT_EQ(answer.status_size(), 1);
  EXPECT_EQ(answer.status(0).code(), static_cast<int>(absl::StatusCode::kPermissionDenied)) << answer.status(0).message();
  EXPECT_TRUE(daemon_->Running());
}

// Every port over TLS, every caller named by its certificate (--auth mtls):
// the master's gRPC and HTTP, the daemon's HTTP tier (the master's
// offloads and the clients' stages go over HTTPS), metadata included, and
// the daemon's transfer port (--data-tls).
class SsdDaemonTlsTest : public SsdDaemonTest {
 protected:
  void SetUp() override {
    if (absl::Status u = io::UringAvailable(); !u.ok()) GTEST_SKIP() << u.message();
    dir_ = testing::MakeTempDir("tierkv-ssd");
    std::filesystem::create_directories(dir_ + "/certs");
    absl::StatusOr<testing::TestCerts> certs = testing::MakeTestCerts(dir_ + "/certs");
    ASSERT_OK(certs.status());
    certs_ = *certs;
    // The daemon serves its HTTP with the certificate for 127.0.0.1
    // (SAN "localhost"); the reader is decode-1.tierkv.
    WriteIdentities(true);
    ASSERT_OK(cluster_.Start({.daemons = 0,
                              .master_flags = {"--lease-ttl=200ms", "--revoke-grace=0s", "--check-interval=50ms",
                                               "--auth=mtls", "--token-file=" + dir_ + "/identities",
                                               "--tls-cert=" + certs_.server_cert, "--tls-key=" + certs_.server_key,
                                               "--tls-ca=" + certs_.ca},
                              .tls = {certs_.ca, certs_.client_cert, certs_.client_key}}));
    extra_daemon_args_ = {"--auth=mtls", "--tls-ca=" + certs_.ca, "--tls-cert=" + certs_.server_cert,
                          "--tls-key=" + certs_.server_key, "--data-tls"};
    client_transports_ = {"tcp"};  // the bytes over the TLS port, not shm
  }
  void WriteIdentities(bool with_reader) {
    std::ofstream out(dir_ + "/identities");
    out << "cert:localhost ssd daemon\n";
    if (with_reader) out << "cert:decode-1.tierkv reader client\n";
  }
  // The status of `method` `path` on the master's HTTP port, over `url`'s
  // scheme with `tls`; -1 when no HTTP answer came.
  int MasterHttp(const std::string& method, const std::string& url, const auth::TlsFiles& tls,
                 const std::string& path, std::string* body = nullptr) {
    absl::StatusOr<std::unique_ptr<httplib::Client>> made = auth::NewHttpClient(url, tls, absl::Seconds(3));
    if (!made.ok()) return -1;
    std::unique_ptr<httplib::Client>& cli = *made;
    httplib::Result res = method == "GET" ? cli->Get(path) : cli->Put(path, "x", "application/octet-stream");
    if (!res) return -1;
    if (body != nullptr) *body = res->body;
    return res->status;
  }

  testing::TestCerts certs_;
};

TEST_F(SsdDaemonTlsTest, EveryPortServesTlsAndCallersAreTheirCertificates) {
  std::vector<std::string> keys, values;
  ASSERT_NO_FATAL_FAILURE(StartAndFill(&keys, &values));
  // The master's offloads reached the daemon's HTTPS tier, and reads stage
  // pages back through it.
  EXPECT_GT(Metric(Get("/metrics"), "tierkv_store_ssd_records"), 100);
  for (size_t i = 0; i < keys.size(); ++i) {
    absl::StatusOr<std::string> got = GetOnceStaged(keys[i]);
    ASSERT_OK(got.status()) << keys[i];
    ASSERT_EQ(*got, values[i]) << keys[i];
  }
  EXPECT_GT(Metric(Get("/metrics"), "tierkv_store_ssd_bytes_total{direction=\"read\"}"), 0);

  // The master's HTTP port: TLS only; a certificate for everything but the
  // probes; the caller's roles are its certificate's line.
  const std::string https = cluster_.metadata_url();
  ASSERT_TRUE(absl::StartsWith(https, "https://")) << https;
  const std::string plain = absl::StrCat("http://127.0.0.1:", cluster_.http_port());
  const auth::TlsFiles reader{certs_.ca, certs_.client_cert, certs_.client_key};
  std::string body;
  EXPECT_EQ(MasterHttp("GET", https, reader, "/v1/stats", &body), 200);
  EXPECT_EQ(MasterHttp("GET", plain, {}, "/health"), -1);
  EXPECT_EQ(MasterHttp("GET", https, {certs_.ca, "", ""}, "/health"), 200);
  EXPECT_EQ(MasterHttp("GET", https, {certs_.ca, "", ""}, "/v1/stats", &body), 401);
  EXPECT_THAT(body, ::testing::HasSubstr("no client certificate"));
  EXPECT_EQ(MasterHttp("GET", https, {certs_.ca, certs_.rogue_cert, certs_.rogue_key}, "/v1/stats"), -1);
  EXPECT_EQ(MasterHttp("GET", https, {certs_.other_ca, certs_.client_cert, certs_.client_key}, "/health"), -1);
  EXPECT_EQ(MasterHttp("PUT", https, reader, "/metadata?key=ssd-daemon", &body), 403);
  EXPECT_THAT(body, ::testing::HasSubstr("'reader' has role client"));
  // The pages above moved over the TLS transfer port the daemon advertises.
  EXPECT_EQ(MasterHttp("GET", https, reader,
                       "/metadata?key=" + httplib::detail::encode_query_param(transport::DescriptorKey("ssd-daemon")),
                       &body),
            200);
  EXPECT_THAT(body, ::testing::HasSubstr("\"tcp\":\"tls://127.0.0.1:"));
  // The daemon's HTTP port is TLS too; a tier order without a grant is
  // refused there as before.
  const std::string daemon_https = absl::StrCat("https://127.0.0.1:", daemon_->port("http"));
  EXPECT_EQ(MasterHttp("GET", absl::StrCat("http://127.0.0.1:", daemon_->port("http")), {}, "/health"), -1);
  {
    ASSERT_OK_AND_ASSIGN(auto cli, auth::NewHttpClient(daemon_https, {certs_.ca, "", ""}, absl::Seconds(3)));
    httplib::Result res = cli->Post("/tier/stage", "", "application/x-protobuf");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 401);
  }

  // A certificate the CA signs but no line names: refused, naming it.
  WriteIdentities(false);
  cluster_.master().Kill(SIGHUP);
  client::MasterClientOptions mo;
  mo.rpc_timeout = absl::Seconds(3);
  mo.tls = reader;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::MasterClient> m,
                       client::MasterClient::Create(cluster_.master_address(), mo));
  absl::Status refused;
  // The reload is asynchronous.
  EXPECT_OK(WaitFor("the reloaded identities to refuse the reader", absl::Seconds(5), [&] {
    refused = m->Stats().status();
    return !refused.ok();
  }));
  EXPECT_THAT(refused, testing::StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("decode-1.tierkv"));
  EXPECT_EQ(MasterHttp("GET", https, reader, "/v1/stats"), 401);
  EXPECT_TRUE(cluster_.master().Running());
  EXPECT_TRUE(daemon_->Running());
}

}  // namespace
}  // namespace tierkv
