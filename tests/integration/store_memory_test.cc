// What tierkv-store promises about its memory, checked on the real
// binary: a segment the host cannot back stops the daemon at start; with
// --prefault every page is in RAM before the daemon says it is listening;
// --mlock locks the segment or names the limit that refused it; a NUMA
// node the host lacks is refused, and the descriptor names the node the
// memory is on.
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tests/support/process.h"
#include "tests/support/sanitizers.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"
#include "transport/numa.h"

namespace tierkv {
namespace {

using ::testing::HasSubstr;
using testing::ChildProcess;

// A daemon that needs no master to start: mounting retries in the
// background while these tests look at its memory.
std::vector<std::string> DaemonArgs(const std::string& size, std::vector<std::string> extra = {}) {
  std::vector<std::string> args{"--master=127.0.0.1:1", "--metadata=http://127.0.0.1:1",
                                "--segment-size=" + size, "--port=0", "--http-port=0",
                                "--heartbeat-interval=1s", "--name=memory-test"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// A field of /proc/<pid>/status in bytes ("RssShmem", "VmLck").
uint64_t StatusBytes(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) != 0) continue;
    std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t kb = 0;
    if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kb)) return kb * 1024;
  }
  return 0;
}

// The daemon's start failure: its exit code and stderr, as ChildProcess
// reports them.
std::string StartFailure(const std::string& binary, const std::vector<std::string>& args) {
  auto d = ChildProcess::Start(binary, args);
  EXPECT_FALSE(d.ok()) << "the daemon started: " << args.back();
  return d.ok() ? "" : std::string(d.status().message());
}

TEST(StoreMemoryTest, ASegmentTheHostCannotBackStopsTheDaemonAtStart) {
  std::string why = StartFailure(testing::BinaryPath("tierkv-store"), DaemonArgs("1tb"));
  EXPECT_THAT(why, HasSubstr("(code 2)"));
  EXPECT_THAT(why, HasSubstr("--segment-size 931.3 GiB"));  // 1 TB
  EXPECT_THAT(why, HasSubstr("cannot be backed by RAM"));
}

TEST(StoreMemoryTest, PrefaultPutsEveryPageInRamBeforeListening) {
  const uint64_t size = 256ull << 20;
  auto lazy = ChildProcess::Start(testing::BinaryPath("tierkv-store"), DaemonArgs("256mib"));
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  EXPECT_LT(StatusBytes((*lazy)->pid(), "RssShmem"), size / 4);  // the default stays lazy

  auto d = ChildProcess::Start(testing::BinaryPath("tierkv-store"),
                               DaemonArgs("256mib", {"--prefault", "--prefault-threads=2"}));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_GE(StatusBytes((*d)->pid(), "RssShmem"), size);
  (*d)->Kill(SIGTERM);
  EXPECT_EQ((*d)->Wait(), 0) << (*d)->Stderr();
}

TEST(StoreMemoryTest, MlockLocksTheSegmentOrNamesTheLimit) {
  // Sanitizer runtimes replace mlock with a no-op that succeeds, so
  // nothing is locked there.
  if (testing::kSanitized) GTEST_SKIP() << "this build's sanitizer runtime turns mlock into a no-op";
  const uint64_t size = 64ull << 20;
  auto d = ChildProcess::Start(testing::BinaryPath("tierkv-store"), DaemonArgs("64mib", {"--mlock"}));
  if (d.ok()) {
    EXPECT_GE(StatusBytes((*d)->pid(), "VmLck"), size);
    EXPECT_GE(StatusBytes((*d)->pid(), "RssShmem"), size);
  } else {
    EXPECT_THAT(std::string(d.status().message()), HasSubstr("(code 2)"));
    EXPECT_THAT(std::string(d.status().message()), HasSubstr("RLIMIT_MEMLOCK"));
  }
  // The refusal, made certain: a 1 MiB lock limit and no CAP_IPC_LOCK.
  if (access("/usr/bin/prlimit", X_OK) != 0 || access("/usr/bin/setpriv", X_OK) != 0) {
    GTEST_SKIP() << "prlimit or setpriv missing: the refused mlock is not exercised";
  }
  std::vector<std::string> args{"--memlock=1048576:1048576", "/usr/bin/setpriv", "--inh-caps=-ipc_lock",
                                "--bounding-set=-ipc_lock", testing::BinaryPath("tierkv-store")};
  for (const std::string& a : DaemonArgs("64mib", {"--mlock"})) args.push_back(a);
  std::string why = StartFailure("/usr/bin/prlimit", args);
  if (why.find("setpriv:") != std::string::npos) GTEST_SKIP() << "cannot drop CAP_IPC_LOCK here: " << why;
  EXPECT_THAT(why, HasSubstr("(code 2)"));
  EXPECT_THAT(why, HasSubstr("--mlock: mlock of 64.0 MiB failed"));
  EXPECT_THAT(why, HasSubstr("RLIMIT_MEMLOCK is 1.0 MiB"));
}

TEST(StoreMemoryTest, ANumaNodeTheHostLacksIsRefused) {
  std::string why = StartFailure(testing::BinaryPath("tierkv-store"), DaemonArgs("64mib", {"--numa-node=99"}));
  EXPECT_THAT(why, HasSubstr("(code 2)"));
  EXPECT_THAT(why, HasSubstr("--numa-node 99: no such NUMA node 99 on this host"));
}

// Where the segment's pages are bound and live, from /proc/<pid>/numa_maps
// ("7f.. bind:1 file=/memfd:tierkv-segment\040(deleted) ... N1=16384").
std::string NumaMapsOfSegment(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/numa_maps"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("memfd:tierkv-segment") != std::string::npos) return line;
  }
  return "";
}

class DescriptorLocationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = ChildProcess::Start(testing::BinaryPath("tierkv-master"), {"--rpc-port=0", "--http-port=0"});
    ASSERT_TRUE(m.ok()) << m.status();
    master_ = std::move(*m);
  }

  // Starts a daemon and returns its descriptor's buffer location once the
  // descriptor is published.
  std::string Location(std::vector<std::string> extra, std::unique_ptr<ChildProcess>* daemon) {
    std::vector<std::string> args{absl::StrCat("--master=127.0.0.1:", master_->port("rpc")),
                                  absl::StrCat("--metadata=http://127.0.0.1:", master_->port("http")),
                                  "--segment-size=32mib", "--port=0", "--http-port=0", "--name=located"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto d = ChildProcess::Start(testing::BinaryPath("tierkv-store"), args);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return "";
    *daemon = std::move(*d);
    httplib::Client http("127.0.0.1", master_->port("http"));
    http.set_read_timeout(std::chrono::seconds(5));
    std::string location;
    absl::Status published = testing::WaitFor("the daemon's descriptor to be published", absl::Seconds(10), [&] {
      auto res = http.Get("/metadata?key=tierkv/segments/located");
      if (!res || res->status != 200) return false;
      nlohmann::json j = nlohmann::json::parse(res->body, nullptr, false);
      if (!j.is_object() || !j["buffers"].is_array() || j["buffers"].empty()) return false;
      location = j["buffers"][0].value("location", "");
      return true;
    });
    EXPECT_OK(published) << (*daemon)->Stderr();
    return location;
  }

  std::unique_ptr<ChildProcess> master_;
};

TEST_F(DescriptorLocationTest, TheDescriptorNamesTheNodeTheMemoryIsOn) {
  ASSERT_OK_AND_ASSIGN(transport::NumaTopology topo, transport::NumaTopology::Load());
  std::unique_ptr<ChildProcess> d;
  // Unbound: a node that exists here.
  std::string unbound = Location({}, &d);
  bool known = false;
  for (int node : topo.nodes()) known |= unbound == absl::StrCat("cpu:", node);
  EXPECT_TRUE(known) << unbound;
  d.reset();
  // Bound (and prefaulted, so numa_maps shows where the pages are): the
  // last node, which on a two-node host is not node 0.
  int node = topo.nodes().back();
  EXPECT_EQ(Location({absl::StrCat("--numa-node=", node), "--prefault"}, &d), absl::StrCat("cpu:", node));
  ASSERT_TRUE(d);
  std::string maps = NumaMapsOfSegment(d->pid());
  if (maps.empty()) GTEST_SKIP() << "no /proc/<pid>/numa_maps (kernel without NUMA)";
  EXPECT_THAT(maps, HasSubstr(absl::StrCat("bind:", node)));
  EXPECT_THAT(maps, HasSubstr(absl::StrCat("N", node, "=")));
  if (topo.nodes().size() < 2) {
    std::printf("one NUMA node here: a segment bound away from node 0 is not exercised\n");
  }
}

}  // namespace
}  // namespace tierkv
