// The HTTP metadata client over real loopback servers: a list of masters
// is tried in turn past an unreachable one and one answering 503 (not the
// leader), and a client whose masters were discovered finds them again
// when every URL it knows fails, at most once a second.
#include "transport/metadata.h"

#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/http_server.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"

namespace tierkv::transport {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::tierkv::testing::StatusIs;
using ::tierkv::testing::WaitFor;

class HttpMetadataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A standby: every metadata call is refused as by a master that is not the leader.
    standby_.Get("/metadata", [](const httplib::Request&, httplib::Response& res) {
      res.status = 503;
      res.set_content("not the leader", "text/plain");
    });
    standby_port_ = standby_.Bind("127.0.0.1", 0);
    ASSERT_GT(standby_port_, 0);
    standby_.Start();
    leader_.Get("/metadata", [](const httplib::Request& req, httplib::Response& res) {
      if (req.get_param_value("key") != "k") {
        res.status = 404;
        return;
      }
      res.set_content("v", "application/octet-stream");
    });
    leader_.Put("/metadata", [](const httplib::Request&, httplib::Response& res) { res.status = 200; });
    leader_port_ = leader_.Bind("127.0.0.1", 0);
    ASSERT_GT(leader_port_, 0);
    leader_.Start();
    // A port nothing listens on any more: connections are refused.
    HttpServer gone;
    dead_port_ = gone.Bind("127.0.0.1", 0);
    ASSERT_GT(dead_port_, 0);
    gone.Start();
    gone.Stop();
  }
  void TearDown() override {
    leader_.Stop();
    standby_.Stop();
  }
  static std::string Url(int port) { return absl::StrCat("http://127.0.0.1:", port); }

  HttpServer standby_;
  HttpServer leader_;
  int standby_port_ = 0;
  int leader_port_ = 0;
  int dead_port_ = 0;
};

TEST_F(HttpMetadataTest, AListIsTriedPastDeadAndStandbyMastersToTheLeader) {
  ASSERT_OK_AND_ASSIGN(auto m, NewHttpMetadata(absl::StrCat(Url(dead_port_), ",", Url(standby_port_), ",",
                                                            Url(leader_port_), "/"),
                                               absl::Seconds(2)));
  ASSERT_OK_AND_ASSIGN(std::string v, m->Get("k"));
  EXPECT_EQ(v, "v");
  EXPECT_THAT(m->Get("other").status(), StatusIs(absl::StatusCode::kNotFound));
  // Only the dead and the standby: UNAVAILABLE, naming the last answer.
  ASSERT_OK_AND_ASSIGN(auto none, NewHttpMetadata(absl::StrCat(Url(dead_port_), ",", Url(standby_port_))));
  absl::StatusOr<std::string> r = none->Get("k");
  EXPECT_THAT(r.status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("503"));
  EXPECT_THAT(NewHttpMetadata("127.0.0.1:80").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(NewHttpMetadata("http://127.0.0.1").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(NewHttpMetadata(" , ").status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(HttpMetadataTest, DiscoveredUrlsAreFoundAgainWhenAllFailAtMostOnceASecond) {
  std::atomic<int> asked{0};
  std::string found = absl::StrCat(Url(standby_port_), ",", Url(leader_port_));
  ASSERT_OK_AND_ASSIGN(auto m, NewHttpMetadata(Url(dead_port_), absl::Seconds(2), "", {},
                                               [&]() -> absl::StatusOr<std::string> {
                                                 ++asked;
                                                 return found;
                                               }));
  // The only master known is gone; the list found again holds the leader.
  ASSERT_OK_AND_ASSIGN(std::string v, m->Get("k"));
  EXPECT_EQ(v, "v");
  EXPECT_EQ(asked.load(), 1);
  // The new list stays: no more asking while the leader answers.
  ASSERT_OK(m->Put("k", "v"));
  EXPECT_THAT(m->Get("other").status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(asked.load(), 1);
}

TEST_F(HttpMetadataTest, AFailingRefreshIsReportedAndNotRepeatedWithinASecond) {
  std::atomic<int> asked{0};
  bool broken = true;
  ASSERT_OK_AND_ASSIGN(auto m, NewHttpMetadata(Url(dead_port_), absl::Seconds(2), "", {},
                                               [&]() -> absl::StatusOr<std::string> {
                                                 ++asked;
                                                 if (broken) return absl::UnavailableError("etcd unreachable");
                                                 return std::string("no-scheme:1");
                                               }));
  const absl::Time start = absl::Now();  // no later than the refresh that fails
  absl::Status s = m->Get("k").status();
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(std::string(s.message()), HasSubstr("finding the masters again: etcd unreachable"));
  EXPECT_EQ(asked.load(), 1);
  // Right after: the dead URL is tried, the masters are not asked again.
  s = m->Get("k").status();
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(std::string(s.message()), Not(HasSubstr("finding the masters again")));
  EXPECT_EQ(asked.load(), 1);
  // A second later they are; an answer that is no URL list is reported as such.
  broken = false;
  EXPECT_OK(WaitFor("the masters to be asked again", absl::Seconds(5), [&] {
    s = m->Delete("k");
    return asked.load() > 1;
  }));
  EXPECT_GE(absl::Now() - start, absl::Seconds(1)) << "asked again within a second";
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(std::string(s.message()), HasSubstr("must start with http://"));
  EXPECT_EQ(asked.load(), 2);
}

}  // namespace
}  // namespace tierkv::transport
