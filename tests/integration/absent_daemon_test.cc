// A put over an object whose daemon is absent after a master restart
// (stopped, so it has not re-mounted): the object is replaced only once
// the new value is committed. A writer that dies before its commit leaves
// the object, which reads back once its daemon returns; a committed put
// replaces it. A read meanwhile is UNAVAILABLE, never a miss, and waits
// for the daemon's return within its call timeout. Real master and daemons
// (store_fixture.h); the writer is tierkvctl, killed by a failpoint
// between its data and its commit.
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <thread>

#include "tests/integration/store_fixture.h"

namespace tierkv::integration {
namespace {

class AbsentDaemonTest : public StoreClusterTest {
 protected:
  // Two daemons, "k" on daemon 0, then daemon 0 stopped and the master
  // restarted: daemon 0's segment is back RECOVERING and stays so, while
  // daemon 1 re-mounts. The TTL outlasts the test's absence, so the
  // recovering segment is never given up.
  void SetUp() override {
    ASSERT_OK(cluster_.Start({.daemons = 2, .segment_size = "64mib", .segment_ttl = "20s", .put_timeout = "1s",
                              .persist = true, .master_flags = {"--revoke-grace=1s"}}));
    client::PutOptions on_daemon_0;
    on_daemon_0.preferred_segment = "daemon-0";
    auto c = Client();
    ASSERT_NE(c, nullptr);
    ASSERT_OK(c->Put("k", old_value_, on_daemon_0));
    cluster_.daemon(0).Kill(SIGSTOP);
    stopped_ = true;
    cluster_.master().Kill(SIGKILL);
    (void)cluster_.master().Wait();
    ASSERT_OK(cluster_.StartMaster());
    ASSERT_OK(cluster_.WaitForLiveSegments(1));
    ASSERT_EQ(SegmentState("daemon-0"), "recovering");
  }
  void TearDown() override {
    if (stopped_) cluster_.daemon(0).Kill(SIGCONT);  // a stopped child would not die of the cluster's SIGTERM
    StoreClusterTest::TearDown();
  }

  std::string SegmentState(const std::string& name) {
    absl::StatusOr<std::string> body = cluster_.HttpGet("/v1/segments");
    nlohmann::json j = nlohmann::json::parse(body.ok() ? *body : "[]", nullptr, false);
    if (!j.is_array()) return "";
    for (const auto& s : j) {
      if (s.value("name", "") == name) return s.value("state", "");
    }
    return "";
  }

  // tierkvctl puts "k" = new_value_ (`failpoints`: its TIERKV_FAILPOINTS);
  // its exit status, 128 + the signal for one killed (by a failpoint).
  int CtlPut(const std::string& failpoints = "") {
    const std::string dir = testing::MakeTempDir("tierkv-absent");
    std::ofstream(dir + "/value", std::ios::binary) << new_value_;
    const std::string cmd =
        absl::StrCat("TIERKV_FAILPOINTS='", failpoints, "' ", testing::BinaryPath("tierkvctl"),
                     " --master=", cluster_.master_address(), " --http=127.0.0.1:", cluster_.http_port(), " put k ",
                     dir, "/value >", dir, "/out 2>&1");
    const int rc = std::system(cmd.c_str());
    // The shell reports a killed child as 128 + its signal, or execs it and is killed itself.
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : WIFSIGNALED(rc) ? 128 + WTERMSIG(rc) : -1;
  }

  void DaemonZeroBack() {
    cluster_.daemon(0).Kill(SIGCONT);
    ASSERT_OK(cluster_.WaitForLiveSegments(2));
  }

  const std::string old_value_ = ValueFor("k-old", 200 << 10);
  const std::string new_value_ = ValueFor("k-new", 300 << 10);
  bool stopped_ = false;
};

TEST_F(AbsentDaemonTest, AWriterDyingBeforeItsCommitLeavesTheObjectForItsDaemonsReturn) {
  auto c = Client();
  ASSERT_NE(c, nullptr);
  ASSERT_OK_AND_ASSIGN(bool present, c->Exists("k"));
  EXPECT_FALSE(present) << "its daemon is away: nothing can read it now";
  ASSERT_EQ(CtlPut("client.put.before_end=abort"), 128 + SIGABRT) << "the writer was to die before its commit";
  ASSERT_OK(WaitFor("the dead writer's put to be reclaimed", absl::Seconds(10), [&] {
    return Stats().value("pending", uint64_t{1}) == 0;
  }));
  DaemonZeroBack();
  absl::StatusOr<std::string> back = c->Get("k");
  ASSERT_OK(back.status()) << "an acknowledged object was lost to a put that never committed";
  EXPECT_TRUE(*back == old_value_) << "k read back other bytes than its acknowledged value";
}

TEST_F(AbsentDaemonTest, ACommittedPutReplacesTheObject) {
  ASSERT_EQ(CtlPut(), 0);
  DaemonZeroBack();
  auto c = Client();
  ASSERT_NE(c, nullptr);
  absl::StatusOr<std::string> now = c->Get("k");
  ASSERT_OK(now.status());
  EXPECT_TRUE(*now == new_value_) << "k did not read back its latest acknowledged value";
}

TEST_F(AbsentDaemonTest, AReadWhileItsDaemonIsAwayWaitsForItsReturnAndNeverMisses) {
  auto c = Client();
  ASSERT_NE(c, nullptr);
  // Away for longer than the call: UNAVAILABLE (asked again until the
  // call timeout), not NOT_FOUND, which would send a reader to recompute.
  const absl::Time start = absl::Now();
  EXPECT_THAT(c->Get("k").status(), testing::StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  // Back during the call: the read waits for the re-mount and gets the value.
  std::thread back([&] {
    absl::SleepFor(absl::Milliseconds(300));
    cluster_.daemon(0).Kill(SIGCONT);
  });
  absl::StatusOr<std::string> got = c->Get("k");
  back.join();
  stopped_ = false;
  ASSERT_OK(got.status()) << "an acknowledged object read as lost while its daemon re-mounted";
  EXPECT_TRUE(*got == old_value_);
}

}  // namespace
}  // namespace tierkv::integration
