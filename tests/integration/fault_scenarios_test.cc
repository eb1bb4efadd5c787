// The failure scenarios tierkv promises to survive (docs/faults.md), each
// against real processes: a master and store daemons on loopback (or in a
// network namespace), clients in this process or in worker processes.
// Scenario 8 (crafted transport frames) lives in tests/unit/tcp_frames_test.cc.
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/crc32c.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "proto/master.grpc.pb.h"
#include "tests/support/cluster.h"
#include "tests/support/fault_proxy.h"
#include "tests/support/netns.h"
#include "tests/support/sanitizers.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"
#include "transport/engine.h"
#include "transport/metadata.h"

namespace tierkv {
namespace {

using testing::ChildProcess;
using testing::StatusIs;
using testing::TestCluster;
using testing::WaitFor;

// Contents derived from the key (and a generation), so any reader can check them.
std::string ValueFor(const std::string& key, size_t size, int generation = 0) {
  std::string v(size, '\0');
  std::mt19937_64 rng(Crc32c(key.data(), key.size()) + generation);
  for (size_t i = 0; i < size; i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<size_t>(8, size - i));
  }
  return v;
}

// A field of /proc/<pid>/status in KiB (VmRSS, VmHWM).
int64_t ProcStatusKb(pid_t pid, const std::string& field) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      int64_t kb = 0;
      std::string digits;
      for (char c : line) {
        if (std::isdigit(static_cast<unsigned char>(c))) digits += c;
      }
      return absl::SimpleAtoi(digits, &kb) ? kb : -1;
    }
  }
  return -1;
}

// A unary call with raw request bytes (no message object built here).
grpc::Status RawCall(const std::string& address, const std::string& method, const std::string& bytes) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  auto call = stub.PrepareUnaryCall(&ctx, method, request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

size_t OpenFds(pid_t pid) {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"))) {
    (void)e;
    ++n;
  }
  return n;
}

using testing::kSanitized;

class FaultScenarioTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (HasFailure()) std::cerr << cluster_.Logs();
  }
  std::unique_ptr<client::Client> Client(std::vector<std::string> transports = {},
                                         absl::Duration transfer_timeout = absl::Seconds(10)) {
    client::ClientOptions o;
    o.master = cluster_.master_address();
    o.metadata = cluster_.metadata_url();
    o.transports = std::move(transports);
    o.transfer_timeout = transfer_timeout;
    auto c = client::Client::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  nlohmann::json Stats() {
    auto body = cluster_.HttpGet("/v1/stats");
    EXPECT_TRUE(body.ok()) << body.status();
    return nlohmann::json::parse(body.ok() ? *body : "{}");
  }
  nlohmann::json Segment(const std::string& name) {
    auto body = cluster_.HttpGet("/v1/segments/" + name);
    return body.ok() ? nlohmann::json::parse(*body) : nlohmann::json();
  }
  TestCluster cluster_;
};

// 1. Several processes put, get and remove checksummed values on a few hot
// keys at once: every get that succeeds verifies; the rest are NOT_FOUND or
// errors, never someone else's bytes.
TEST_F(FaultScenarioTest, Scenario01_ConcurrentProcessesOnHotKeysOnlyEverReadVerifiedValues) {
  ASSERT_OK(cluster_.Start({.daemons = 3, .segment_size = "64mib"}));
  constexpr int kWorkers = 4;
  std::vector<FILE*> workers;
  for (int w = 0; w < kWorkers; ++w) {
    std::string cmd = absl::StrCat(testing::BinaryPath("../tests/tierkv-test-worker"), " ",
                                   cluster_.master_address(), " ", cluster_.metadata_url(), " ", w,
                                   " 6 400 ", 1000 + w);
    workers.push_back(::popen(cmd.c_str(), "r"));
    ASSERT_NE(workers.back(), nullptr);
  }
  int gets = 0, puts = 0;
  for (FILE* f : workers) {
    char line[512] = {};
    std::string out;
    while (std::fgets(line, sizeof(line), f) != nullptr) out += line;
    int rc = ::pclose(f);
    EXPECT_EQ(rc, 0) << out;
    nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << out;
    EXPECT_EQ(j["corrupt"], 0);
    gets += j["gets"].get<int>();
    puts += j["puts"].get<int>();
  }
  // The load really raced: values were written and read back many times.
  EXPECT_GT(puts, 50);
  EXPECT_GT(gets, 50);
}

// 2. A writer killed between PutStart and PutEnd (at either failpoint): the
// key is never readable, its space returns after the put timeout, and a
// later put of the same key succeeds.
TEST_F(FaultScenarioTest, Scenario02_WriterKilledMidPutLeavesNothingAndItsSpaceReturns) {
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "64mib", .put_timeout = "1s",
                            .master_flags = {"--revoke-grace=1s"}}));
  auto client = Client();
  for (const char* failpoint : {"client.put.after_start", "client.put.before_end"}) {
    SCOPED_TRACE(failpoint);
    std::string key = absl::StrCat("victim-", failpoint);
    std::string file = testing::MakeTempDir("tierkv-put") + "/value";
    std::string value = ValueFor(key, 3 << 20);
    std::ofstream(file, std::ios::binary) << value;
    uint64_t used_before = Stats()["used_bytes"];
    auto writer = ChildProcess::Start(
        testing::BinaryPath("tierkvctl"),
        {"--master=" + cluster_.master_address(), absl::StrCat("--http=127.0.0.1:", cluster_.http_port()), "put",
         key, file},
        {{"TIERKV_FAILPOINTS", absl::StrCat(failpoint, "=abort")}}, absl::Seconds(20));
    ASSERT_FALSE(writer.ok());  // it dies before printing anything
    EXPECT_NE(writer.status().message().find("code 134"), std::string::npos) << writer.status();
    EXPECT_THAT(client->Get(key), StatusIs(absl::StatusCode::kNotFound));
    EXPECT_GT(Stats()["used_bytes"].get<uint64_t>(), used_before);  // held until the timeout
    // Reclaimed after the put timeout (1 s), reusable after the revoke grace.
    EXPECT_OK(WaitFor("the killed writer's put to be reclaimed", absl::Seconds(10),
                      [&] { return Stats()["pending"] == 0; }));
    EXPECT_OK(WaitFor("its space to return", absl::Seconds(10),
                      [&] { return Stats()["used_bytes"].get<uint64_t>() == used_before; }));
    EXPECT_THAT(client->Get(key), StatusIs(absl::StatusCode::kNotFound));
    ASSERT_OK(client->Put(key, value));
    EXPECT_EQ(*client->Get(key), value);
  }
}

// 3. A daemon killed with SIGKILL: its objects leave the index within the
// TTL plus one check period; reads answer NOT_FOUND or come from another
// replica.
TEST_F(FaultScenarioTest, Scenario03_KilledDaemonsObjectsLeaveWithinTtlAndReplicasServe) {
  ASSERT_OK(cluster_.Start({.daemons = 3, .segment_size = "64mib", .segment_ttl = "1s"}));
  auto client = Client({"tcp"});
  client::PutOptions on_victim, two;
  on_victim.preferred_segment = "daemon-1";
  two.replicas = 2;
  for (int i = 0; i < 40; ++i) {
    ASSERT_OK(client->Put(absl::StrCat("one-", i), ValueFor(absl::StrCat("one-", i), 8192), on_victim));
    ASSERT_OK(client->Put(absl::StrCat("two-", i), ValueFor(absl::StrCat("two-", i), 8192), two));
  }
  // The last heartbeat the master saw bounds when the segment may go.
  const int64_t last_heartbeat_ms = Segment("daemon-1")["last_heartbeat_unix_ms"].get<int64_t>();
  cluster_.daemon(1).Kill(SIGKILL);
  cluster_.daemon(1).Wait();
  ASSERT_OK(WaitFor("one-0 to leave the index", absl::Seconds(10), [&] {
    auto present = client->Exists("one-0");
    return present.ok() && !*present;
  }));
  const int64_t gone_ms = absl::ToUnixMillis(absl::Now());
  // TTL 1 s + one 100 ms check period; 300 ms more for this process's polling and scheduling.
  EXPECT_LE(gone_ms - last_heartbeat_ms, 1000 + 100 + 300);
  for (int i = 0; i < 40; ++i) {
    EXPECT_THAT(client->Get(absl::StrCat("one-", i)), StatusIs(absl::StatusCode::kNotFound));
    auto v = client->Get(absl::StrCat("two-", i));
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(*v, ValueFor(absl::StrCat("two-", i), 8192));
  }
}

// 4. A daemon paused (SIGSTOP) past its TTL, then resumed: the master tells
// it to mount again, and nothing it held before comes back as a hit.
TEST_F(FaultScenarioTest, Scenario04_PausedDaemonRemountsWithoutStaleHits) {
  ASSERT_OK(cluster_.Start({.daemons = 2, .segment_size = "64mib", .segment_ttl = "1s"}));
  auto client = Client({"tcp"});
  client::PutOptions on_paused;
  on_paused.preferred_segment = "daemon-0";
  for (int i = 0; i < 20; ++i) ASSERT_OK(client->Put(absl::StrCat("old-", i), ValueFor(absl::StrCat("old-", i), 4096), on_paused));
  cluster_.daemon(0).Kill(SIGSTOP);
  ASSERT_OK(cluster_.WaitForLiveSegments(1));
  for (int i = 0; i < 20; ++i) EXPECT_THAT(client->Get(absl::StrCat("old-", i)), StatusIs(absl::StatusCode::kNotFound));
  cluster_.daemon(0).Kill(SIGCONT);
  ASSERT_OK(cluster_.WaitForLiveSegments(2));
  EXPECT_OK(WaitFor("the resumed daemon to log that it mounts again", absl::Seconds(5),
                    [&] { return cluster_.daemon(0).Stderr().find("again") != std::string::npos; }));
  // Its memory still holds the old bytes, but the index does not point at them.
  for (int i = 0; i < 20; ++i) EXPECT_THAT(client->Get(absl::StrCat("old-", i)), StatusIs(absl::StatusCode::kNotFound));
  // And it serves new puts.
  ASSERT_OK(client->Put("after-resume", ValueFor("after-resume", 4096), on_paused));
  EXPECT_EQ(*client->Get("after-resume"), ValueFor("after-resume", 4096));
}

// 5. A reader holds a lease while the object is removed and the store
// fills: the bytes survive until the lease ends. After it ends, a read of
// the key errors cleanly, and reading the stale extent is caught by the
// checksum.
TEST_F(FaultScenarioTest, Scenario05_LeaseKeepsRemovedBytesUntilItEnds) {
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "8mib", .master_flags = {"--lease-ttl=2s"}}));
  auto client = Client({"tcp"});
  const std::string value = ValueFor("leased", 1 << 20);
  ASSERT_OK(client->Put("leased", value));
  auto replicas = client->master().GetReplicas({"leased"});  // takes the lease
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  ASSERT_EQ(replicas->replica_counts(0), 1u);
  const std::string segment = replicas->segments(replicas->replica_segments(0));
  const uint64_t offset = replicas->replica_offsets(0);
  const uint64_t stored = client::StoredSize(value.size());
  auto read_extent = [&] {
    std::string buf(stored, '\0');
    auto st = client->engine().Transfer({{transport::Op::kRead, buf.data(), segment, offset, stored}});
    EXPECT_OK(st[0]);
    return buf;
  };
  const std::string before = read_extent();
  ASSERT_OK(client->Remove("leased", /*force=*/true));
  EXPECT_THAT(client->Get("leased"), StatusIs(absl::StatusCode::kNotFound));
  // Fill the store: eviction and allocation must step around the leased extent.
  for (int i = 0; i < 40; ++i) {
    absl::Status s = client->Put(absl::StrCat("fill-", i), ValueFor(absl::StrCat("fill-", i), 512 << 10));
    ASSERT_TRUE(s.ok() || absl::IsResourceExhausted(s)) << s;
  }
  EXPECT_EQ(read_extent(), before);
  EXPECT_EQ(before.substr(0, value.size()), value);
  // After the lease (2 s) the space is reused: filling goes on until
  // another object lives in the extent; the key stays gone.
  int next_fill = 40;
  absl::Status fill;
  std::string after;
  EXPECT_OK(WaitFor("the leased extent to be reused once its lease ended", absl::Seconds(20), [&] {
    for (const int end = next_fill + 10; next_fill < end; ++next_fill) {
      fill = client->Put(absl::StrCat("fill-", next_fill), ValueFor(absl::StrCat("fill-", next_fill), 512 << 10));
      if (!fill.ok() && !absl::IsResourceExhausted(fill)) return true;  // fails below
    }
    after = read_extent();
    return after != before;
  }));
  ASSERT_TRUE(fill.ok() || absl::IsResourceExhausted(fill)) << fill;
  EXPECT_THAT(client->Get("leased"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_NE(after, before);  // another object lives there now...
  // ...and its trailer does not vouch for the old value's bytes.
  uint32_t crc = Crc32c(after.data(), value.size());
  uint32_t stored_crc;
  std::memcpy(&stored_crc, after.data() + value.size(), sizeof(stored_crc));
  EXPECT_NE(crc, stored_crc);
}

// 6. A daemon in its own network namespace is cut off from the master by an
// nftables drop rule, then healed: its objects leave after the TTL (clean
// NOT_FOUND, no hang); after healing it mounts again and serves, with no
// stale hits.
TEST_F(FaultScenarioTest, Scenario06_PartitionedDaemonIsDroppedAndRejoinsClean) {
  auto host = testing::TestHost::Create(1);
  if (!host.ok()) GTEST_SKIP() << "no network namespaces here: " << host.status().message();
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "64mib", .segment_ttl = "1s",
                            .master_flags = {"--listen=0.0.0.0", "--insecure-allow-remote"}}));
  const std::string master = absl::StrCat((*host)->gateway(), ":", cluster_.rpc_port());
  auto remote = ChildProcess::Start(
      "/usr/sbin/ip",
      (*host)->Exec(testing::BinaryPath("tierkv-store"),
                    {"--master=" + master, absl::StrCat("--metadata=http://", (*host)->gateway(), ":", cluster_.http_port()),
                     "--listen=" + (*host)->address(), "--segment-size=64mib", "--port=0", "--http-port=0",
                     "--heartbeat-interval=200ms", "--name=remote", "--insecure-allow-remote"}));
  ASSERT_TRUE(remote.ok()) << remote.status();
  ASSERT_OK(cluster_.WaitForLiveSegments(2));
  auto client = Client({"tcp"}, absl::Seconds(2));
  client::PutOptions there;
  there.preferred_segment = "remote";
  for (int i = 0; i < 10; ++i) ASSERT_OK(client->Put(absl::StrCat("far-", i), ValueFor(absl::StrCat("far-", i), 65536), there));
  EXPECT_EQ(*client->Get("far-3"), ValueFor("far-3", 65536));

  ASSERT_OK((*host)->Cut());
  ASSERT_OK(cluster_.WaitForLiveSegments(1));
  absl::Time start = absl::Now();
  for (int i = 0; i < 10; ++i) EXPECT_THAT(client->Get(absl::StrCat("far-", i)), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));  // answered by the index, nothing waits on the cut host
  ASSERT_OK(client->Put("near", ValueFor("near", 4096)));  // the rest of the cluster works

  ASSERT_OK((*host)->Heal());
  ASSERT_OK(cluster_.WaitForLiveSegments(2));
  for (int i = 0; i < 10; ++i) EXPECT_THAT(client->Get(absl::StrCat("far-", i)), StatusIs(absl::StatusCode::kNotFound));
  client->engine().ForgetPeers();
  ASSERT_OK(client->Put("far-new", ValueFor("far-new", 65536), there));
  EXPECT_EQ(*client->Get("far-new"), ValueFor("far-new", 65536));
  (*remote)->Kill(SIGTERM);
  EXPECT_EQ((*remote)->Wait(), 0);
}

// 7. Puts and gets through a proxy that stalls, truncates and resets the
// data connections: each fails within its deadline, a failed put is
// revoked, nothing partial reads back as success; file descriptors (and,
// outside sanitizer builds, memory) stay flat over 1,000 runs.
TEST_F(FaultScenarioTest, Scenario07_TransfersThroughAFaultyNetworkFailCleanly) {
  // The daemon listens on 127.0.0.1 but advertises 127.0.0.2, where the
  // proxy sits on the same port: every data byte crosses the proxy.
  ASSERT_OK(cluster_.Start({.daemons = 0}));
  auto daemon = ChildProcess::Start(
      testing::BinaryPath("tierkv-store"),
      {"--master=" + cluster_.master_address(), "--metadata=" + cluster_.metadata_url(), "--segment-size=64mib",
       "--listen=127.0.0.1", "--host=127.0.0.2", "--port=0", "--http-port=0", "--heartbeat-interval=200ms",
       "--name=proxied", "--transport=tcp"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const int port = (*daemon)->port("port");
  auto proxy = testing::FaultProxy::Start("127.0.0.2", port, absl::StrCat("127.0.0.1:", port));
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  ASSERT_OK(cluster_.WaitForLiveSegments(1));
  const absl::Duration kDeadline = absl::Milliseconds(300);
  auto client = Client({"tcp"}, kDeadline);

  using Mode = testing::FaultProxy::Mode;
  const testing::FaultProxy::Fault faults[] = {
      {Mode::kPass}, {Mode::kStall}, {Mode::kTruncate, {}, 5000}, {Mode::kReset, {}, 5000},
      {Mode::kDelay, absl::Milliseconds(1)}};
  const int kRuns = 1000;
  size_t fds_warm = 0, daemon_fds_warm = 0;
  int64_t rss_warm = 0, daemon_rss_warm = 0;
  int ok_puts = 0, failed_puts = 0;
  absl::Duration slowest_failure;
  for (int run = 0; run < kRuns; ++run) {
    const auto& fault = faults[run % 5];
    (*proxy)->Set(fault);
    std::string key = absl::StrCat("p-", run);
    std::string value = ValueFor(key, 16 << 10);
    absl::Time start = absl::Now();
    absl::Status put = client->Put(key, value);
    absl::Duration took = absl::Now() - start;
    (*proxy)->Set({Mode::kPass});
    if (put.ok()) {
      ++ok_puts;
      auto v = client->Get(key);
      ASSERT_TRUE(v.ok()) << key << ": " << v.status();
      ASSERT_EQ(*v, value);
    } else {
      ++failed_puts;
      slowest_failure = std::max(slowest_failure, took);
      // The engine's deadline, plus the master round trips around it.
      ASSERT_LT(took, kDeadline + absl::Seconds(1)) << key << ": " << put;
      auto v = client->Get(key);
      ASSERT_THAT(v, StatusIs(absl::StatusCode::kNotFound)) << key << " after " << put;
    }
    if (run == 99) {
      fds_warm = OpenFds(::getpid());
      daemon_fds_warm = OpenFds((*daemon)->pid());
      rss_warm = ProcStatusKb(::getpid(), "VmRSS");
      daemon_rss_warm = ProcStatusKb((*daemon)->pid(), "VmRSS");
    }
  }
  EXPECT_EQ(Stats()["pending"], 0);  // every failed put was revoked
  EXPECT_GE(ok_puts, kRuns / 5);     // the clean runs
  EXPECT_GE(failed_puts, kRuns / 5);  // the stalls at least
  // Flat: what run 100 held, give or take the pools' own slack.
  EXPECT_LE(OpenFds(::getpid()), fds_warm + 16);
  EXPECT_LE(OpenFds((*daemon)->pid()), daemon_fds_warm + 16);
  if (!kSanitized) {  // sanitizers hold freed memory in quarantine on purpose
    EXPECT_LE(ProcStatusKb(::getpid(), "VmRSS"), rss_warm + 64 * 1024);
    EXPECT_LE(ProcStatusKb((*daemon)->pid(), "VmRSS"), daemon_rss_warm + 64 * 1024);
  }
  std::cout << "scenario 7: " << ok_puts << " puts ok, " << failed_puts << " failed cleanly, slowest failure "
            << absl::FormatDuration(slowest_failure) << ", proxy saw " << (*proxy)->accepted() << " connections\n";
}

// 9. Oversized and malformed RPCs: a 64 MiB message, a 1 MiB key, 10^7 batch
// entries. Each is refused (RESOURCE_EXHAUSTED or INVALID_ARGUMENT), the
// master's memory stays bounded, and another client keeps working.
TEST_F(FaultScenarioTest, Scenario09_OversizedRpcsAreRefusedAndOthersCarryOn) {
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "64mib"}));
  auto client = Client();
  ASSERT_OK(client->Put("steady", ValueFor("steady", 4096)));
  absl::Notification stop;
  std::atomic<int> steady_ok{0}, steady_bad{0};
  std::thread steady([&] {
    // A get every 5 ms until stopped (the wait ends at once on stop).
    do {
      auto v = client->Get("steady");
      (v.ok() && *v == ValueFor("steady", 4096) ? steady_ok : steady_bad).fetch_add(1);
    } while (!stop.WaitForNotificationWithTimeout(absl::Milliseconds(5)));
  });
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  auto stub = v1::Master::NewStub(
      grpc::CreateCustomChannel(cluster_.master_address(), grpc::InsecureChannelCredentials(), args));
  auto call_put_start = [&](const v1::PutStartRequest& req, v1::PutStartResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub->PutStart(&ctx, req, resp);
  };
  const int64_t hwm_before = ProcStatusKb(cluster_.master().pid(), "VmHWM");

  v1::PutStartRequest huge;
  huge.add_items()->set_key(std::string(64 << 20, 'k'));
  v1::PutStartResponse resp;
  grpc::Status st = call_put_start(huge, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();

  v1::PutStartRequest long_key;
  auto* item = long_key.add_items();
  item->set_key(std::string(1 << 20, 'k'));
  item->set_size(100);
  resp.Clear();
  st = call_put_start(long_key, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resp.results_size(), 1);
  EXPECT_EQ(resp.results(0).status().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));

  // 10^7 one-byte keys, encoded straight to wire bytes (30 MB) rather than
  // built as 10^7 strings here.
  std::string wire;
  wire.reserve(30'000'000);
  for (int i = 0; i < 10'000'000; ++i) wire.append("\x0a\x01k", 3);
  EXPECT_EQ(RawCall(cluster_.master_address(), "/tierkv.v1.Master/GetReplicas", wire).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  v1::KeysRequest many;
  v1::GetReplicasResponse got;
  // Under the message cap but over the batch cap: refused whole, by count.
  for (int i = 0; i < 100'000; ++i) many.add_keys(absl::StrCat("k", i));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    st = stub->GetReplicas(&ctx, many, &got);
  }
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();

  const int64_t hwm_after = ProcStatusKb(cluster_.master().pid(), "VmHWM");
  stop.Notify();
  steady.join();
  EXPECT_GT(steady_ok.load(), 0);
  EXPECT_EQ(steady_bad.load(), 0);
  // Bounded by the 16 MiB message cap, not by what was sent (64 MiB, 10^7 keys).
  EXPECT_LT(hwm_after - hwm_before, 256 * 1024) << "master peak RSS grew by " << (hwm_after - hwm_before) << " KiB";
  std::cout << "scenario 9: master peak RSS grew by " << (hwm_after - hwm_before) / 1024 << " MiB\n";
  EXPECT_TRUE(cluster_.master().Running());
}

// 10. HTTP abuse: a 100 MB body, malformed JSON, 5,000 idle connections,
// `../` in keys. Each is refused, the connection cap holds, and the
// server stays responsive throughout.
TEST_F(FaultScenarioTest, Scenario10_HttpAbuseIsRefusedAndTheServerStaysResponsive) {
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_max < 6000) GTEST_SKIP() << "open-file hard limit " << lim.rlim_max << " is below 6000";
  lim.rlim_cur = lim.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &lim);
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "64mib",
                            .master_flags = {"--http-max-connections=4096", "--max-http-body=16mib"}}));
  httplib::Client http("127.0.0.1", cluster_.http_port());
  http.set_read_timeout(std::chrono::seconds(5));

  // A 100 MB body is refused from its Content-Length, before it is read.
  std::string big(100'000'000, 'x');
  auto r = http.Put("/metadata?key=big", big, "application/octet-stream");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 413);

  // Malformed JSON where a descriptor belongs: stored opaque (the metadata
  // protocol), refused with a clear error by the engine that reads it.
  r = http.Put("/metadata?key=" + transport::DescriptorKey("bogus"), "{\"name\": [1, 2", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  auto metadata = transport::NewHttpMetadata(cluster_.metadata_url());
  ASSERT_TRUE(metadata.ok());
  auto engine = transport::TransferEngine::Create(
      {.metadata = std::shared_ptr<transport::MetadataClient>(std::move(*metadata)), .transports = {"tcp"}});
  ASSERT_TRUE(engine.ok());
  std::string buf(16, '\0');
  auto st = (*engine)->Transfer({{transport::Op::kRead, buf.data(), "bogus", 0, 16}}, absl::Seconds(2));
  EXPECT_FALSE(st[0].ok());
  EXPECT_NE(st[0].message().find("descriptor"), std::string::npos) << st[0];

  // `../` in keys is a key like any other: no file is ever named by one.
  for (const char* path : {"/v1/objects/..%2F..%2Fetc%2Fpasswd", "/v1/objects/../../etc/passwd",
                           "/metadata?key=../../etc/passwd", "/v1/segments/..%2F.."}) {
    r = http.Get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_TRUE(r->status == 404 || r->status == 400) << path << ": " << r->status;
    EXPECT_EQ(r->body.find("root:"), std::string::npos);
  }

  // 5,000 idle connections: they hold no worker, so requests keep being
  // served; those past the cap are answered 503 and closed.
  std::vector<int> idle;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(cluster_.http_port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int i = 0; i < 5000; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0) << "socket " << i << ": " << std::strerror(errno);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ::close(fd);
      continue;
    }
    idle.push_back(fd);
  }
  absl::Time start = absl::Now();
  httplib::Client fresh("127.0.0.1", cluster_.http_port());
  fresh.set_read_timeout(std::chrono::seconds(5));
  bool served = false;
  // The newest connections may meet the cap; the server frees idle ones
  // only at its idle timeout, so a request either succeeds or gets 503.
  for (int attempt = 0; attempt < 20 && !served; ++attempt) {
    auto h = fresh.Get("/v1/stats");
    if (h && h->status == 200) served = true;
    if (h && h->status != 200) {
      EXPECT_EQ(h->status, 503);
    }
    if (!served) {  // make room: close some idle ones, as clients do
      for (int k = 0; k < 200 && !idle.empty(); ++k) {
        ::close(idle.back());
        idle.pop_back();
      }
    }
  }
  EXPECT_TRUE(served);
  std::cout << "scenario 10: a request served " << absl::FormatDuration(absl::Now() - start)
            << " after opening " << idle.size() << " idle connections\n";
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // The cap held: the master never had more than 4096 open.
  auto metrics = cluster_.HttpGet("/v1/stats");
  EXPECT_TRUE(metrics.ok());
  EXPECT_LE(OpenFds(cluster_.master().pid()), 4096u + 256u);
  for (int fd : idle) ::close(fd);
  // The client library works as before.
  auto client = Client();
  ASSERT_OK(client->Put("after-abuse", "v"));
  EXPECT_EQ(*client->Get("after-abuse"), "v");
}

// 11. One client floods PutStart without ever calling PutEnd: the
// per-client cap stops it; other clients keep putting; eviction keeps
// running; once its puts time out, the flooder may put again.
TEST_F(FaultScenarioTest, Scenario11_PutStartFloodIsCappedPerClient) {
  ASSERT_OK(cluster_.Start({.daemons = 1, .segment_size = "32mib", .put_timeout = "2s",
                            .master_flags = {"--max-pending-per-client=1000"}}));
  auto flooder = client::MasterClient::Create(cluster_.master_address());
  ASSERT_TRUE(flooder.ok());
  int accepted = 0;
  absl::Status refused;
  for (int batch = 0; batch < 50 && refused.ok(); ++batch) {
    v1::PutStartRequest req;
    req.set_client_id("flooder");
    for (int i = 0; i < 100; ++i) {
      auto* item = req.add_items();
      item->set_key(absl::StrCat("flood-", batch, "-", i));
      item->set_size(1024);
    }
    auto resp = (*flooder)->PutStart(req);
    ASSERT_TRUE(resp.ok()) << resp.status();
    for (const auto& r : resp->results()) {
      absl::Status s = client::FromItem(r.status());
      if (s.ok()) {
        ++accepted;
      } else {
        refused = s;
      }
    }
  }
  EXPECT_EQ(accepted, 1000);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(refused.message().find("flooder"), std::string::npos) << refused;

  // Another client fills the store past capacity: its puts succeed and
  // eviction runs (the flooder's pending puts are not candidates).
  auto client = Client();
  for (int i = 0; i < 120; ++i) {
    std::string key = absl::StrCat("fair-", i);
    ASSERT_OK(client->Put(key, ValueFor(key, 512 << 10))) << key;
  }
  EXPECT_GT(Stats()["evictions"].get<uint64_t>(), 0u);
  EXPECT_EQ(*client->Get("fair-119"), ValueFor("fair-119", 512 << 10));

  // After the put timeout the flooder's puts are reclaimed and it may put again.
  EXPECT_OK(WaitFor("the flooder's puts to time out", absl::Seconds(10), [&] { return Stats()["pending"] == 0; }));
  v1::PutStartRequest again;
  again.set_client_id("flooder");
  auto* item = again.add_items();
  item->set_key("flood-again");
  item->set_size(1024);
  auto resp = (*flooder)->PutStart(again);
  ASSERT_TRUE(resp.ok());
  EXPECT_OK(client::FromItem(resp->results(0).status()));
}

// 12. The master is SIGKILLed at random moments under load, 50 times in a
// row: it always restarts (its start-up checks its invariants: every
// replica on a known segment, the allocators agree with the objects), and
// every put it acknowledged reads back with a valid checksum. The loop
// makes at most 40,000 puts of at most 12 KiB, which the two segments hold
// below their eviction watermark: no acknowledged put may be missing.
TEST_F(FaultScenarioTest, Scenario12_MasterKilledFiftyTimesUnderLoadRecoversConsistent) {
  ASSERT_OK(cluster_.Start({.daemons = 2, .segment_size = "512mib", .segment_ttl = "5s", .persist = true}));
  std::atomic<bool> stop{false}, loader_done{false};
  std::atomic<int> next{0}, acked_count{0};
  std::vector<int> acked;  // owned by the loader until it is joined
  std::thread loader([&] {
    client::ClientOptions o;
    o.master = cluster_.master_address();
    o.metadata = cluster_.metadata_url();
    o.rpc_timeout = absl::Milliseconds(500);
    auto c = client::Client::Create(o);
    if (c.ok()) {
      while (!stop.load() && next.load() < 40000) {
        int i = next.fetch_add(1);
        std::string key = absl::StrCat("m-", i);
        if ((*c)->Put(key, ValueFor(key, 4096 + i % 8192)).ok()) {
          acked.push_back(i);
          acked_count.fetch_add(1);
        }
      }
    }
    loader_done.store(true);
  });
  absl::Cleanup join_loader = [&] {  // also when an assertion below returns early
    stop.store(true);
    if (loader.joinable()) loader.join();
  };
  // Each master is killed after the loader has begun a random number of
  // puts (1 to 100) since it started, acknowledged or not: the kills fall
  // at random moments of the load, recovery and re-mounts included.
  std::mt19937 rng(12);
  for (int round = 0; round < 50; ++round) {
    const int from = next.load(), puts = 1 + static_cast<int>(rng() % 100);
    ASSERT_OK(WaitFor(absl::StrCat(puts, " puts begun in round ", round), absl::Seconds(30),
                      [&] { return next.load() >= from + puts || loader_done.load(); }));
    cluster_.master().Kill(SIGKILL);
    cluster_.master().Wait();
    absl::Status started = cluster_.StartMaster();
    ASSERT_OK(started) << "round " << round;
  }
  const int acked_before_last = acked_count.load();
  ASSERT_OK(WaitFor("a put acknowledged by the last master", absl::Seconds(30),
                    [&] { return acked_count.load() > acked_before_last || loader_done.load(); }));
  std::move(join_loader).Invoke();
  ASSERT_OK(cluster_.WaitForLiveSegments(2));
  EXPECT_GT(acked.size(), 50u);
  nlohmann::json stats = Stats();
  ASSERT_EQ(stats.value("evictions", 0), 0) << stats.dump();
  auto client = Client();
  size_t verified = 0;
  for (int i : acked) {
    std::string key = absl::StrCat("m-", i);
    auto v = client->Get(key);
    ASSERT_TRUE(v.ok()) << key << " was acknowledged but reads " << v.status();
    ASSERT_EQ(*v, ValueFor(key, 4096 + i % 8192)) << key;
    ++verified;
  }
  EXPECT_EQ(verified, acked.size());
  std::cout << "scenario 12: " << acked.size() << " puts acknowledged across 50 kills, all " << verified
            << " read back verified\n";
}

}  // namespace
}  // namespace tierkv
