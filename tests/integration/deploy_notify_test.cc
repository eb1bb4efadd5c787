// Readiness as systemd sees it (Type=notify): the test plays the service
// manager, with its own AF_UNIX datagram socket named in NOTIFY_SOCKET for
// real tierkv-master and tierkv-store children on loopback.
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"

namespace tierkv {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::WaitFor;

// The service manager's end of the notify protocol.
class NotifySocket {
 public:
  NotifySocket() {
    dir_ = testing::MakeTempDir("notify");
    path_ = dir_ + "/notify.sock";
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path_.c_str());
    bound_ = fd_ >= 0 && ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~NotifySocket() {
    if (fd_ >= 0) ::close(fd_);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  bool bound() const { return bound_; }
  const std::string& path() const { return path_; }

  // The next datagram's lines, or empty after `timeout`.
  std::vector<std::string> Next(absl::Duration timeout) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) != 1) return {};
    char buf[4096];
    ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n <= 0) return {};
    return absl::StrSplit(std::string(buf, n), '\n', absl::SkipEmpty());
  }
  // Datagrams until one carries `line` (every line read goes to `seen`);
  // false if none does within `timeout`.
  bool WaitFor(const std::string& line, absl::Duration timeout, std::vector<std::string>* seen) {
    absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      std::vector<std::string> lines = Next(deadline - absl::Now());
      seen->insert(seen->end(), lines.begin(), lines.end());
      if (std::find(lines.begin(), lines.end(), line) != lines.end()) return true;
    }
    return false;
  }

 private:
  std::string dir_, path_;
  int fd_ = -1;
  bool bound_ = false;
};

std::pair<int, std::string> Get(int port, const std::string& path) {
  httplib::Client http("127.0.0.1", port);
  http.set_read_timeout(std::chrono::seconds(5));
  auto res = http.Get(path);
  return res ? std::pair<int, std::string>{res->status, res->body} : std::pair<int, std::string>{0, ""};
}

// Live at the master under `name`.
bool SegmentLive(int master_http, const std::string& name) {
  auto [status, body] = Get(master_http, "/v1/segments");
  if (status != 200) return false;
  nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
  if (!j.is_array()) return false;
  for (const auto& s : j) {
    if (s.value("name", "") == name && s.value("state", "") == "live") return true;
  }
  return false;
}

// A counter's value in a Prometheus text body (0 when absent).
double MetricValue(const std::string& body, const std::string& name) {
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (absl::StartsWith(line, name + " ")) return std::stod(std::string(line.substr(name.size() + 1)));
  }
  return 0;
}

std::string Joined(const std::vector<std::string>& lines) { return absl::StrJoin(lines, " | "); }

// The daemon starts against a master that is not up yet: it listens and
// answers /health, but READY=1 must wait until the master lists its
// segment live; SIGTERM reports STOPPING=1 before it unmounts.
TEST(DeployNotifyTest, StoreReadyOnlyAfterItsSegmentIsMountedAndStoppingOnSigterm) {
  NotifySocket notify;
  ASSERT_TRUE(notify.bound()) << notify.path();
  // Two free ports for the master, found by binding and releasing.
  int rpc = 0, http = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto probe, ChildProcess::Start(BinaryPath("tierkv-master"), {"--rpc-port=0", "--http-port=0"}));
    rpc = probe->port("rpc");
    http = probe->port("http");
    probe->Kill(SIGKILL);
    probe->Wait();
  }
  ASSERT_OK_AND_ASSIGN(
      auto daemon,
      ChildProcess::Start(BinaryPath("tierkv-store"),
                          {absl::StrCat("--master=127.0.0.1:", rpc), absl::StrCat("--metadata=http://127.0.0.1:", http),
                           "--segment-size=32mib", "--port=0", "--http-port=0", "--heartbeat-interval=50ms",
                           "--name=notified"},
                          {{"NOTIFY_SOCKET", notify.path()}}));
  int store_http = daemon->port("http");
  EXPECT_EQ(Get(store_http, "/health").first, 200);
  // Until the daemon has tried the absent master a few times.
  ASSERT_OK(WaitFor("three failed heartbeats to the absent master", absl::Seconds(15), [&] {
    return MetricValue(Get(store_http, "/metrics").second, "tierkv_store_heartbeat_failures_total") >= 3;
  })) << daemon->Stderr();
  EXPECT_EQ(Get(store_http, "/ready").first, 503);
  std::vector<std::string> early = notify.Next(absl::ZeroDuration());
  EXPECT_TRUE(early.empty()) << "notified before any mount: " << Joined(early);

  ASSERT_OK_AND_ASSIGN(auto master, ChildProcess::Start(BinaryPath("tierkv-master"),
                                                        {absl::StrCat("--rpc-port=", rpc),
                                                         absl::StrCat("--http-port=", http)}));
  std::vector<std::string> seen;
  ASSERT_TRUE(notify.WaitFor("READY=1", absl::Seconds(15), &seen)) << Joined(seen) << "\n" << daemon->Stderr();
  // Asked only after READY=1 arrived: the mount must already be visible.
  EXPECT_TRUE(SegmentLive(http, "notified")) << Get(http, "/v1/segments").second;
  EXPECT_EQ(Get(store_http, "/ready").first, 200);
  EXPECT_TRUE(std::find(seen.begin(), seen.end(), "STATUS=segment notified mounted") != seen.end()) << Joined(seen);

  daemon->Kill(SIGTERM);
  seen.clear();
  EXPECT_TRUE(notify.WaitFor("STOPPING=1", absl::Seconds(15), &seen)) << Joined(seen);
  EXPECT_EQ(daemon->Wait(), 0) << daemon->Stderr();
  EXPECT_FALSE(SegmentLive(http, "notified"));  // unmounted on the way out
}

TEST(DeployNotifyTest, MasterReadyOnceItServesAndStoppingOnSigterm) {
  NotifySocket notify;
  ASSERT_TRUE(notify.bound()) << notify.path();
  ASSERT_OK_AND_ASSIGN(auto master, ChildProcess::Start(BinaryPath("tierkv-master"), {"--rpc-port=0", "--http-port=0"},
                                                        {{"NOTIFY_SOCKET", notify.path()}}));
  std::vector<std::string> seen;
  ASSERT_TRUE(notify.WaitFor("READY=1", absl::Seconds(15), &seen)) << Joined(seen) << master->Stderr();
  EXPECT_EQ(Get(master->port("http"), "/health").first, 200);
  EXPECT_TRUE(std::find(seen.begin(), seen.end(),
                        absl::StrCat("STATUS=serving rpc=", master->port("rpc"), " http=", master->port("http"))) !=
              seen.end())
      << Joined(seen);
  master->Kill(SIGTERM);
  seen.clear();
  EXPECT_TRUE(notify.WaitFor("STOPPING=1", absl::Seconds(15), &seen)) << Joined(seen);
  EXPECT_EQ(master->Wait(), 0) << master->Stderr();
}

// Without NOTIFY_SOCKET (not under systemd) the daemons run as before.
TEST(DeployNotifyTest, NoNotifySocketIsANoOp) {
  ASSERT_OK_AND_ASSIGN(auto master, ChildProcess::Start(BinaryPath("tierkv-master"), {"--rpc-port=0", "--http-port=0"}));
  ASSERT_OK_AND_ASSIGN(
      auto daemon,
      ChildProcess::Start(BinaryPath("tierkv-store"),
                          {absl::StrCat("--master=127.0.0.1:", master->port("rpc")),
                           absl::StrCat("--metadata=http://127.0.0.1:", master->port("http")), "--segment-size=32mib",
                           "--port=0", "--http-port=0", "--heartbeat-interval=50ms", "--name=plain"}));
  EXPECT_OK(WaitFor("segment plain live at the master", absl::Seconds(15),
                    [&] { return SegmentLive(master->port("http"), "plain"); }))
      << daemon->Stderr();
  daemon->Kill(SIGTERM);
  EXPECT_EQ(daemon->Wait(), 0) << daemon->Stderr();
  master->Kill(SIGTERM);
  EXPECT_EQ(master->Wait(), 0) << master->Stderr();
}

}  // namespace
}  // namespace tierkv
