// A cluster spread over hosts, as operators run one: network namespaces
// on one bridge stand in for machines (each with its own address and
// hostname). A master in the test's own namespace; two decode nodes, each
// running two daemons bound to 0.0.0.0 on the same ports (8800, 8801) with
// no --host; clients on a third host. The master runs --auth token, as
// a routable bind must: daemons, clients and tierkvctl present tokens.
// Needs root (skips saying why elsewhere).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "tests/support/cluster.h"
#include "tests/support/netns.h"
#include "tests/support/status_matchers.h"
#include "tests/support/values.h"
#include "tests/support/wait.h"
#include "transport/descriptor.h"

namespace tierkv {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::SessionValue;
using testing::TestCluster;
using testing::TestHost;
using testing::TestNetwork;
using testing::WaitFor;
using json = nlohmann::json;

std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs `binary args...` on `host` to completion: its exit code and stdout.
std::pair<int, std::string> RunOn(const TestHost& host, const std::string& binary,
                                  const std::vector<std::string>& args) {
  std::vector<std::string> argv = host.Exec(binary, args);
  std::string cmd = "/usr/sbin/ip";
  for (const std::string& a : argv) absl::StrAppend(&cmd, " ", ShellQuote(a));
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, ""};
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  int rc = ::pclose(p);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

class MultiHostTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (!HasFailure()) return;
    std::cerr << cluster_.Logs();
    for (auto& [name, d] : daemons_) {
      if (d) std::cerr << "--- daemon " << name << "\n" << d->Stderr();
    }
  }

  // Starts the daemon on port 8800 + k of node `node`: bound to 0.0.0.0,
  // no --host, no --name.
  absl::Status StartDaemon(int node, int k) {
    auto d = ChildProcess::Start(
        "/usr/sbin/ip",
        net_->host(node).Exec(BinaryPath("tierkv-store"),
                              {"--master=" + master_, "--metadata=" + metadata_, "--listen=0.0.0.0",
                               "--token-file=" + daemon_token_, "--auth=token",
                               absl::StrCat("--port=", 8800 + k), absl::StrCat("--http-port=", 9800 + k),
                               "--segment-size=64mib", "--heartbeat-interval=200ms"}));
    if (!d.ok()) return d.status();
    daemons_[Name(node, k)] = std::move(*d);
    return absl::OkStatus();
  }
  std::string Name(int node, int k) { return absl::StrCat(net_->host(node).address(), ":", 8800 + k); }
  ChildProcess& Daemon(int node, int k) { return *daemons_[Name(node, k)]; }

  json Get(const std::string& path) {
    absl::StatusOr<std::string> body = cluster_.HttpGet(path);
    return body.ok() ? json::parse(*body, nullptr, false) : json();
  }
  std::map<std::string, json> Segments() {
    std::map<std::string, json> out;
    json all = Get("/v1/segments");
    if (all.is_array()) {
      for (const json& s : all) out[s.value("name", "")] = s;
    }
    return out;
  }
  // The host (node) of each replica of `key`.
  std::vector<std::string> ReplicaHosts(const std::string& key) {
    std::vector<std::string> hosts;
    json o = Get("/v1/objects/" + key);
    std::map<std::string, json> segs = Segments();
    if (!o.is_object() || !o.contains("replicas")) return hosts;
    for (const json& r : o["replicas"]) hosts.push_back(segs[r.value("segment", "")].value("host", "?"));
    return hosts;
  }
  std::vector<std::string> CtlFlags() {
    return {"--master=" + master_, "--http=" + absl::StrCat(net_->gateway(), ":", cluster_.http_port()),
            "--transport=tcp", "--timeout=5s", "--token-file=" + client_token_};
  }
  // Writes the master's token table and each side's own token under `dir`;
  // the master flags that use them.
  std::vector<std::string> AuthFlags(const std::string& dir) {
    std::filesystem::create_directories(dir);
    daemon_token_ = dir + "/daemon.token";
    client_token_ = dir + "/client.token";
    std::ofstream(daemon_token_) << kDaemonToken << "\n";
    std::ofstream(client_token_) << kClientToken << "\n";
    std::ofstream(dir + "/tokens") << kDaemonToken << " decode-nodes daemon\n"
                                   << kClientToken << " workers client\n";
    return {"--listen=0.0.0.0", "--auth=token", "--token-file=" + dir + "/tokens"};
  }
  static constexpr char kDaemonToken[] = "9c1e0b7d2a4f4e6b8d3c5a7f9e1b3d5f";
  static constexpr char kClientToken[] = "4f2a8c6e0b1d3f5a7c9e1b3d5f7a9c0e";
  std::string daemon_token_, client_token_;

  TestCluster cluster_;
  std::unique_ptr<TestNetwork> net_;
  std::string master_, metadata_;
  std::map<std::string, std::unique_ptr<ChildProcess>> daemons_;
};

TEST_F(MultiHostTest, WildcardDaemonsOnTwoNodesServeAClientHostThroughARestartAndANodeLoss) {
  absl::StatusOr<std::unique_ptr<TestNetwork>> net = TestNetwork::Create(3);
  if (!net.ok()) GTEST_SKIP() << "no network namespaces here: " << net.status().message();
  net_ = std::move(*net);
  const std::string dir = testing::MakeTempDir("tierkv-multihost");
  ASSERT_OK(cluster_.Start(
      {.daemons = 0, .segment_ttl = "2s", .master_flags = AuthFlags(dir + "/auth"), .token = kClientToken}));
  master_ = absl::StrCat(net_->gateway(), ":", cluster_.rpc_port());
  metadata_ = absl::StrCat("http://", net_->gateway(), ":", cluster_.http_port());
  const TestHost& client_host = net_->host(2);
  {
    // Without a token, the client host is refused with the reason.
    std::vector<std::string> args = CtlFlags();
    args.pop_back();
    args.push_back("segments");
    auto [rc, out] = RunOn(client_host, BinaryPath("tierkvctl"), args);
    EXPECT_NE(rc, 0) << out;
  }
  for (int node : {0, 1}) {
    for (int k : {0, 1}) ASSERT_OK(StartDaemon(node, k)) << Name(node, k);
  }
  ASSERT_OK(cluster_.WaitForLiveSegments(4));

  // Each daemon is named and advertised by its node's address, never
  // 0.0.0.0; each node is its own host for replica placement.
  std::map<std::string, json> segs = Segments();
  ASSERT_EQ(segs.size(), 4u);
  for (int node : {0, 1}) {
    for (int k : {0, 1}) {
      ASSERT_TRUE(segs.contains(Name(node, k))) << json(Get("/v1/segments")).dump();
      EXPECT_EQ(segs[Name(node, k)]["host"], net_->host(node).name());
      absl::StatusOr<std::string> d =
          cluster_.HttpGet("/metadata?key=" + transport::DescriptorKey(Name(node, k)));
      ASSERT_OK(d);
      absl::StatusOr<transport::SegmentDescriptor> desc = transport::SegmentDescriptor::FromJson(*d);
      ASSERT_OK(desc);
      EXPECT_EQ(desc->transports["tcp"], Name(node, k));
      EXPECT_EQ(desc->control, Name(node, k));
    }
  }

  // A long-lived client on the client host while a daemon restarts on
  // the same port: it keeps working, and what it writes afterwards is in
  // the new daemon's memory (read back by another client on another host),
  // not in the dead one's.
  const std::string session = dir + "/session";
  std::filesystem::create_directories(session);
  std::vector<std::string> wargv =
      client_host.Exec("/usr/bin/env", {"TIERKV_TOKEN_FILE=" + client_token_, BinaryPath("../tests/tierkv-test-worker"),
                                        "session", master_, metadata_, session, "40", "1"});
  std::string wcmd = "/usr/sbin/ip";
  for (const std::string& a : wargv) absl::StrAppend(&wcmd, " ", ShellQuote(a));
  FILE* worker = ::popen(wcmd.c_str(), "r");
  ASSERT_NE(worker, nullptr);
  EXPECT_OK(WaitFor("the session worker's phase 1 report", absl::Seconds(60),
                    [&] { return ::access((session + "/phase1").c_str(), F_OK) == 0; }));
  std::ifstream p1f(session + "/phase1");
  json p1 = json::parse(p1f, nullptr, false);
  ASSERT_TRUE(p1.is_object()) << "the session worker did not finish phase 1";
  EXPECT_EQ(p1["acked"], 40);
  EXPECT_EQ(p1["verified"], 40);

  const std::string restarted = Name(0, 0);
  const std::string old_incarnation = Segments()[restarted].value("incarnation", "");
  Daemon(0, 0).Kill(SIGKILL);
  Daemon(0, 0).Wait();
  ASSERT_OK(StartDaemon(0, 0));
  EXPECT_OK(WaitFor(absl::StrCat(restarted, " live again in a new incarnation"), absl::Seconds(20), [&] {
    json seg = Segments()[restarted];
    return seg.value("incarnation", "") != old_incarnation && seg.value("state", "") == "live";
  }));
  ASSERT_NE(Segments()[restarted].value("incarnation", ""), old_incarnation);
  std::ofstream(session + "/go") << "go\n";
  std::string out;
  char line[4096];
  while (std::fgets(line, sizeof line, worker) != nullptr) out += line;
  int rc = ::pclose(worker);
  json r = json::parse(out, nullptr, false);
  ASSERT_TRUE(r.is_object()) << out;
  EXPECT_EQ(WEXITSTATUS(rc), 0) << out;
  EXPECT_EQ(r["wrong"], 0);
  EXPECT_EQ(r["p2_acked"], 40) << out;
  EXPECT_EQ(r["p2_verified"], 40) << out;
  // Phase-1 keys read back or are gone with the restarted daemon's memory.
  EXPECT_EQ(r["s1_errors"], 0) << out;
  EXPECT_GT(r["s1_missing"].get<int>(), 0) << out;
  EXPECT_GT(r["s1_verified"].get<int>(), 0) << out;
  {
    absl::StatusOr<std::unique_ptr<client::Client>> other = cluster_.NewClient();
    ASSERT_OK(other);
    for (int i = 0; i < 40; ++i) {
      const std::string key = absl::StrCat("s2-", i);
      absl::StatusOr<std::string> v = (*other)->Get(key);
      ASSERT_OK(v) << key;
      EXPECT_TRUE(*v == SessionValue(key)) << key;
    }
  }

  // Puts and gets from the client host, two replicas on distinct nodes.
  for (int i = 0; i < 8; ++i) {
    const std::string key = absl::StrCat("r-", i);
    std::ofstream(dir + "/" + key) << SessionValue(key);
    std::vector<std::string> args = CtlFlags();
    args.insert(args.end(), {"--replicas=2", "put", key, dir + "/" + key});
    auto [rc, out] = RunOn(client_host, BinaryPath("tierkvctl"), args);
    ASSERT_EQ(rc, 0) << out;
    std::vector<std::string> hosts = ReplicaHosts(key);
    ASSERT_EQ(hosts.size(), 2u) << key;
    EXPECT_NE(hosts[0], hosts[1]) << key << " has both replicas on " << hosts[0];
  }
  auto read_on_client_host = [&](const std::string& key) {
    std::vector<std::string> args = CtlFlags();
    args.insert(args.end(), {"get", key, "-"});
    return RunOn(client_host, BinaryPath("tierkvctl"), args);
  };
  for (int i = 0; i < 8; ++i) {
    auto [rc, out] = read_on_client_host(absl::StrCat("r-", i));
    ASSERT_EQ(rc, 0) << out;
    EXPECT_TRUE(out == SessionValue(absl::StrCat("r-", i))) << "r-" << i << ": " << out.size() << " bytes";
  }

  // Node 1 dies whole: every two-replica object still reads from the
  // client host, before and after the master drops the node's segments.
  Daemon(1, 0).Kill(SIGKILL);
  Daemon(1, 1).Kill(SIGKILL);
  Daemon(1, 0).Wait();
  Daemon(1, 1).Wait();
  for (int i = 0; i < 8; ++i) {
    auto [rc2, v] = read_on_client_host(absl::StrCat("r-", i));
    ASSERT_EQ(rc2, 0) << v;
    EXPECT_TRUE(v == SessionValue(absl::StrCat("r-", i))) << "r-" << i;
  }
  ASSERT_OK(cluster_.WaitForLiveSegments(2));
  for (int i = 0; i < 8; ++i) {
    auto [rc2, v] = read_on_client_host(absl::StrCat("r-", i));
    ASSERT_EQ(rc2, 0) << v;
    EXPECT_TRUE(v == SessionValue(absl::StrCat("r-", i))) << "r-" << i;
    EXPECT_EQ(ReplicaHosts(absl::StrCat("r-", i)).size(), 1u);
  }
  std::filesystem::remove_all(dir);
}

// A daemon bound to 0.0.0.0 on a host whose only interface is loopback has
// nothing to advertise: it refuses to start with one line saying so.
TEST_F(MultiHostTest, WildcardDaemonWithNothingRoutableRefusesToStart) {
  absl::StatusOr<std::unique_ptr<TestNetwork>> net = TestNetwork::Create(0);
  if (!net.ok()) GTEST_SKIP() << "no network namespaces here: " << net.status().message();
  ASSERT_OK(cluster_.Start({.daemons = 0}));
  // A namespace with loopback only.
  const std::string ns = absl::StrCat("tkv", ::getpid() % 100000, "lo");
  ASSERT_OK(testing::RunCommand("ip netns add " + ns));
  ASSERT_OK(testing::RunCommand("ip netns exec " + ns + " ip link set lo up"));
  auto d = ChildProcess::Start("/usr/sbin/ip", {"netns", "exec", ns, BinaryPath("tierkv-store"),
                                                "--master=127.0.0.1:1", "--metadata=http://127.0.0.1:1",
                                                "--listen=0.0.0.0", "--port=0", "--http-port=0",
                                                "--segment-size=16mib", "--insecure-allow-remote"});
  (void)testing::RunCommand("ip netns del " + ns);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("--host"), std::string::npos) << d.status();
}

}  // namespace
}  // namespace tierkv
