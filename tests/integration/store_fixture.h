// The fixture of the store integration tests (store_integration_test.cc,
// store_cache_test.cc, store_stats_test.cc, store_auth_test.cc): one
// master and store daemons as real processes on loopback (TestCluster),
// the client library in the test process.
#pragma once

#include <signal.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/net/socket.h"
#include "client/client.h"
#include "nlohmann/json.hpp"
#include "tests/support/cluster.h"
#include "tests/support/status_matchers.h"
#include "tests/support/values.h"
#include "tests/support/wait.h"
#include "transport/descriptor.h"
#include "transport/tcp/wire.h"

namespace tierkv::integration {

using testing::ChildProcess;
using testing::StatusIs;
using testing::TestCluster;
using testing::WaitFor;

// Deterministic contents from the key, so any reader can check them.
inline std::string ValueFor(const std::string& key, size_t size) { return testing::Payload(key, size); }

// Mostly small KV pages, some large: 4 KiB .. 8 MiB.
inline size_t SizeFor(int i) {
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

}  // namespace tierkv::integration
