// The fixture of the master's integration tests
// (master_integration_test.cc, master_direct_lane_test.cc,
// master_auth_test.cc): the real tierkv-master binary on loopback ports,
// driven over gRPC, its direct lane and HTTP.
#pragma once

#include <grpcpp/grpcpp.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/net/socket.h"
#include "base/status.h"
#include "client/master_client.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "proto/direct_frame.h"
#include "proto/master.grpc.pb.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait.h"

namespace tierkv::integration {

using testing::ChildProcess;
using testing::WaitFor;
using json = nlohmann::json;

class MasterProcessTest : public ::testing::Test {
 protected:
  void SetUp() override { data_dir_ = testing::MakeTempDir("tierkv-master-data"); }
  void TearDown() override {
    if (HasFailure() && master_) std::cerr << "master stderr:\n" << master_->Stderr();
    master_.reset();
    std::filesystem::remove_all(data_dir_);
  }

  void StartMaster(std::vector<std::string> extra = {}, std::map<std::string, std::string> env = {}) {
    std::vector<std::string> args{"--rpc-port=0", "--http-port=0", "--data-dir=" + data_dir_,
                                  "--segment-ttl=1s", "--check-interval=100ms"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto m = ChildProcess::Start(testing::BinaryPath("tierkv-master"), args, env);
    ASSERT_TRUE(m.ok()) << m.status();
    master_ = std::move(*m);
    ASSERT_GT(master_->port("rpc"), 0);
    ASSERT_GT(master_->port("http"), 0);
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", master_->port("rpc")),
                                       grpc::InsecureChannelCredentials());
    stub_ = v1::Master::NewStub(channel);
    http_ = std::make_unique<httplib::Client>("127.0.0.1", master_->port("http"));
    http_->set_read_timeout(std::chrono::seconds(5));
  }

  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return ctx;
  }

  // One 64 MiB segment `name` on host-<name>.
  static v1::MountSegmentRequest MountRequest(const std::string& name, const std::string& incarnation = "inc-1") {
    v1::MountSegmentRequest req;
    v1::Segment* s = req.add_segments();
    s->set_name(name);
    s->set_host("host-" + name);
    s->set_capacity(64 << 20);
    s->set_incarnation(incarnation);
    return req;
  }

  void Mount(const std::string& name, const std::string& incarnation = "inc-1") {
    v1::MountSegmentRequest req = MountRequest(name, incarnation);
    v1::MountSegmentResponse resp;
    ASSERT_TRUE(stub_->MountSegment(Ctx().get(), req, &resp).ok());
    ASSERT_EQ(resp.status(0).code(), 0) << resp.status(0).message();
  }

  std::vector<std::string> Heartbeat(const std::string& name, const std::string& inc = "inc-1") {
    v1::HeartbeatRequest req;
    v1::Segment* s = req.add_segments();
    s->set_name(name);
    s->set_incarnation(inc);
    v1::HeartbeatResponse resp;
    EXPECT_TRUE(stub_->Heartbeat(Ctx().get(), req, &resp).ok());
    return {resp.remount().begin(), resp.remount().end()};
  }

  void Put(const std::string& key, uint64_t size, const std::string& preferred = "") {
    v1::PutStartRequest req;
    auto* item = req.add_items();
    item->set_key(key);
    item->set_size(size);
    item->set_preferred_segment(preferred);
    v1::PutStartResponse resp;
    ASSERT_TRUE(stub_->PutStart(Ctx().get(), req, &resp).ok());
    ASSERT_EQ(resp.results(0).status().code(), 0) << resp.results(0).status().message();
    v1::KeysRequest end;
    end.add_keys(key);
    v1::KeysResponse done;
    ASSERT_TRUE(stub_->PutEnd(Ctx().get(), end, &done).ok());
    ASSERT_EQ(done.status(0).code(), 0) << done.status(0).message();
  }

  struct Found {
    bool hit = false;
    uint64_t size = 0;
    int64_t lease_expiry_unix_ms = 0;
    std::vector<std::pair<std::string, uint64_t>> replicas;  // segment, offset
  };
  Found Get(const std::string& key) {
    v1::KeysRequest req;
    req.add_keys(key);
    v1::GetReplicasResponse resp;
    EXPECT_TRUE(stub_->GetReplicas(Ctx().get(), req, &resp).ok());
    Found f;
    if (resp.sizes_size() != 1 || resp.sizes(0) == 0) return f;
    f.hit = true;
    f.size = resp.sizes(0);
    f.lease_expiry_unix_ms = resp.lease_expiry_unix_ms(0);
    for (uint32_t i = 0; i < resp.replica_counts(0); ++i) {
      f.replicas.emplace_back(resp.segments(resp.replica_segments(i)), resp.replica_offsets(i));
    }
    return f;
  }

  // /metrics as sample -> value ("name{labels}" as exposed); fails the
  // test on a line that is not a sample or a family without a TYPE line.
  std::map<std::string, double> Metrics(std::string* text_out = nullptr) {
    std::map<std::string, double> values;
    auto res = http_->Get("/metrics");
    EXPECT_TRUE(res);
    if (!res) return values;
    EXPECT_EQ(res->status, 200);
    const std::string& text = res->body;
    std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (-?[0-9.e+-]+|\+Inf|NaN)$)");
    std::set<std::string> typed;
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      std::string l(line);
      if (l.rfind("# TYPE ", 0) == 0) {
        typed.insert(std::string(absl::StrSplit(l.substr(7), ' ').begin()->data(),
                                 l.substr(7).find(' ')));
        continue;
      }
      if (l.rfind("# HELP ", 0) == 0) continue;
      std::smatch m;
      EXPECT_TRUE(std::regex_match(l, m, sample)) << "bad sample line: " << l;
      if (m.empty()) continue;
      std::string family = m[1];
      for (const char* suffix : {"_bucket", "_sum", "_count"}) {
        if (!typed.contains(family) && family.size() > strlen(suffix) &&
            family.compare(family.size() - strlen(suffix), strlen(suffix), suffix) == 0) {
          family = family.substr(0, family.size() - strlen(suffix));
        }
      }
      EXPECT_TRUE(typed.contains(family)) << "no TYPE line before " << l;
      values[std::string(m[1]) + std::string(m[2].matched ? m[2].str() : "")] = std::stod(m[3]);
    }
    if (text_out != nullptr) *text_out = text;
    return values;
  }

  std::string data_dir_;
  std::unique_ptr<ChildProcess> master_;
  std::unique_ptr<v1::Master::Stub> stub_;
  std::unique_ptr<httplib::Client> http_;
};

// A raw connection to the master's RPC port, for frames no client sends.
class RawDirect {
 public:
  explicit RawDirect(int port) {
    auto fd = net::Dial(absl::StrCat("127.0.0.1:", port), absl::Now() + absl::Seconds(5));
    EXPECT_TRUE(fd.ok()) << fd.status();
    if (fd.ok()) fd_ = std::move(*fd);
  }
  void Send(const std::string& bytes) {
    ASSERT_OK(net::WriteFull(fd_.get(), bytes.data(), bytes.size(), absl::Now() + absl::Seconds(5)));
  }
  void Call(direct::DirectMethod m, const std::string& body) {
    std::string frame(direct::kHeaderSize, '\0');
    direct::EncodeCall({m, static_cast<uint32_t>(body.size())}, frame.data());
    Send(frame + body);
  }
  // The reply's status (its message included), or the read's error.
  absl::Status Reply(std::string* body = nullptr) {
    char h[direct::kHeaderSize];
    RETURN_IF_ERROR(net::ReadFull(fd_.get(), h, sizeof h, absl::Now() + absl::Seconds(5)));
    ASSIGN_OR_RETURN(direct::ReplyHeader reply, direct::DecodeReply(h, 64 << 20));
    std::string message(reply.message_length, '\0'), payload(reply.length, '\0');
    RETURN_IF_ERROR(net::ReadFull(fd_.get(), message.data(), message.size(), absl::Now() + absl::Seconds(5)));
    RETURN_IF_ERROR(net::ReadFull(fd_.get(), payload.data(), payload.size(), absl::Now() + absl::Seconds(5)));
    if (body != nullptr) *body = payload;
    return reply.code == 0 ? absl::OkStatus() : absl::Status(static_cast<absl::StatusCode>(reply.code), message);
  }
  void HalfClose() { ::shutdown(fd_.get(), SHUT_WR); }
  // True once the master has closed its end (EOF within 5 s; what it
  // sends before, such as gRPC's GOAWAY, is skipped).
  bool ClosedByMaster() {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    for (;;) {
      char c;
      absl::Status s = net::ReadFull(fd_.get(), &c, 1, deadline);
      if (!s.ok()) return absl::IsUnavailable(s);
    }
  }

 private:
  net::Fd fd_;
};

inline std::unique_ptr<client::MasterClient> NewMasterClient(int port, bool direct = true) {
  client::MasterClientOptions o;
  o.direct = direct;
  o.rpc_timeout = absl::Seconds(3);
  auto c = client::MasterClient::Create(absl::StrCat("127.0.0.1:", port), o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

}  // namespace tierkv::integration
