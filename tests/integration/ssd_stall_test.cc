// A daemon whose SSD tier stalls (its writes hang 20 s, as a hung disk's
// do) while its DRAM keeps serving: the master's order to that tier holds
// only the evictor's pass, so puts into a full store, which need eviction
// to make room, go on at full rate.
#include <cstdio>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/io/file_io.h"
#include "client/client.h"
#include "tests/support/cluster.h"
#include "tests/support/status_matchers.h"
#include "tests/support/values.h"
#include "tests/support/wait.h"

namespace tierkv {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::TestCluster;

class SsdStallTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (absl::Status u = io::UringAvailable(); !u.ok()) GTEST_SKIP() << u.message();
    // An offload timeout longer than the stall: the order is answered
    // (late), never timed out, so the tier is not paused and every pass
    // that waited on it would wait the whole 20 s.
    ASSERT_OK(cluster_.Start({.daemons = 0,
                              .master_flags = {"--lease-ttl=20ms", "--revoke-grace=0s", "--check-interval=50ms",
                                               "--ssd-offload-timeout=60s"}}));
    dir_ = testing::MakeTempDir("tierkv-ssd-stall");
  }
  void TearDown() override {
    if (HasFailure()) {
      std::cerr << cluster_.Logs();
      if (daemon_) std::cerr << daemon_->Stderr();
    }
    client_.reset();
    daemon_.reset();  // before the master: the order out ends with it
    std::filesystem::remove_all(dir_);
  }

  TestCluster cluster_;
  std::string dir_;
  std::unique_ptr<ChildProcess> daemon_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(SsdStallTest, PutsIntoAFullStoreDoNotWaitForAStalledTier) {
  auto d = ChildProcess::Start(
      BinaryPath("tierkv-store"),
      {"--master=" + cluster_.master_address(), "--metadata=" + cluster_.metadata_url(), "--segment-size=16mib",
       "--port=0", "--http-port=0", "--heartbeat-interval=200ms", "--name=ssd-daemon", "--ssd-dir=" + dir_,
       absl::StrCat("--ssd-size=", 32 << 20), absl::StrCat("--ssd-region-size=", 1 << 20)},
      {{"TIERKV_FAILPOINTS", "store.ssd.write=sleep:20000"}});
  ASSERT_OK(d.status());
  daemon_ = std::move(*d);
  ASSERT_OK(cluster_.WaitForLiveSegments(1));
  ASSERT_OK(testing::WaitFor("the daemon to be ready", absl::Seconds(10),
                             [&] { return cluster_.HttpGet("/ready", daemon_->port("http")).ok(); }));
  auto client = cluster_.NewClient();
  ASSERT_OK(client.status());
  client_ = std::move(*client);

  // 512 pages of 64 KiB, each found once (so the tier admits it), into a
  // 16 MiB segment: past 95 % the evictor orders the oldest to the stalled
  // tier, and from about the 256th page on every put needs eviction to
  // make room. Before, each such put waited on the evictor's order.
  constexpr int kPages = 512;
  const absl::Time start = absl::Now();
  int served = 0;
  for (int i = 0; i < kPages; ++i) {
    const std::string key = absl::StrCat("page-", i);
    const std::string value = testing::Payload(key, (64 << 10) - 8);
    ASSERT_OK(client_->Put(key, value)) << i;
    ASSERT_OK_AND_ASSIGN(size_t matched, client_->PrefixMatch({key}));
    absl::StatusOr<std::string> got = client_->Get(key);
    if (got.ok()) {
      ASSERT_EQ(*got, value) << key;
      ++served;
    }
    ASSERT_LT(absl::Now() - start, absl::Seconds(15)) << "put " << i << " waited on the stalled tier";
    (void)matched;
  }
  const absl::Duration took = absl::Now() - start;
  std::printf("%d puts and reads into a full store with the SSD tier stalled: %s (%d read back)\n", kPages,
              absl::FormatDuration(took).c_str(), served);
  EXPECT_GT(served, kPages / 2);
}

}  // namespace
}  // namespace tierkv
