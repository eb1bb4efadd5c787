// Starts the real tierkv-master binary on loopback ports and drives it over
// gRPC, its direct lane and HTTP.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "httplib.h"
#include "client/master_client.h"
#include "base/auth.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "proto/direct_frame.h"
#include "proto/master.grpc.pb.h"
#include "tests/support/process.h"
#include "tests/support/promtool.h"
#include "tests/support/status_matchers.h"
#include "base/net/socket.h"

namespace tierkv {
namespace {

using testing::ChildProcess;
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

TEST_F(MasterProcessTest, MountPutGetRemove) {
  StartMaster();
  Mount("seg-a");
  Put("key-1", 123456);
  Found got = Get("key-1");
  ASSERT_TRUE(got.hit);
  EXPECT_EQ(got.size, 123456u);
  ASSERT_EQ(got.replicas.size(), 1u);
  EXPECT_EQ(got.replicas[0].first, "seg-a");
  EXPECT_GT(got.lease_expiry_unix_ms, 0);

  v1::KeysRequest keys;
  keys.add_keys("key-1");
  keys.add_keys("missing");
  v1::ExistsResponse ex;
  ASSERT_TRUE(stub_->Exists(Ctx().get(), keys, &ex).ok());
  EXPECT_TRUE(ex.present(0));
  EXPECT_FALSE(ex.present(1));
  v1::PrefixMatchResponse pm;
  ASSERT_TRUE(stub_->PrefixMatch(Ctx().get(), keys, &pm).ok());
  EXPECT_EQ(pm.matched(), 1u);

  // The object as operators see it.
  auto obj = http_->Get("/v1/objects/key-1");
  ASSERT_TRUE(obj);
  ASSERT_EQ(obj->status, 200);
  json j = json::parse(obj->body);
  EXPECT_EQ(j["size"], 123456);
  EXPECT_EQ(j["state"], "complete");
  EXPECT_EQ(j["replicas"][0]["segment"], "seg-a");

  v1::RemoveRequest rm;
  rm.add_keys("key-1");
  rm.set_force(true);  // it is leased by the Get above
  v1::KeysResponse rm_resp;
  ASSERT_TRUE(stub_->Remove(Ctx().get(), rm, &rm_resp).ok());
  EXPECT_EQ(rm_resp.status(0).code(), 0);
  EXPECT_FALSE(Get("key-1").hit);
  EXPECT_EQ(http_->Get("/v1/objects/key-1")->status, 404);
}

TEST_F(MasterProcessTest, OversizedBatchIsRefusedWhole) {
  StartMaster({"--max-batch=100"});
  v1::KeysRequest req;
  for (int i = 0; i < 101; ++i) req.add_keys(absl::StrCat("k", i));
  v1::GetReplicasResponse resp;
  grpc::Status s = stub_->GetReplicas(Ctx().get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // The master is still serving.
  Mount("seg-a");
}

TEST_F(MasterProcessTest, SegmentWhoseHeartbeatsStopIsDropped) {
  StartMaster();
  Mount("alive");
  Mount("silent");
  Put("on-silent", 1000, "silent");
  Put("on-alive", 1000, "alive");
  // Heartbeat only "alive", for three TTLs at most.
  bool dropped = false;
  for (int i = 0; i < 30 && !dropped; ++i) {
    EXPECT_TRUE(Heartbeat("alive").empty());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    dropped = !Get("on-silent").hit;
  }
  EXPECT_TRUE(dropped);
  EXPECT_TRUE(Get("on-alive").hit);
  EXPECT_EQ(Heartbeat("silent"), std::vector<std::string>{"silent"});
  auto seg = http_->Get("/v1/segments/silent");
  ASSERT_TRUE(seg);
  EXPECT_EQ(seg->status, 404);
  EXPECT_EQ(json::parse(http_->Get("/v1/segments")->body).size(), 1u);
}

TEST_F(MasterProcessTest, SigkillAndRestartKeepsTheIndex) {
  StartMaster({"--segment-ttl=30s"});
  Mount("seg-a");
  for (int i = 0; i < 100; ++i) Put(absl::StrCat("k", i), 4096 + i);
  ASSERT_EQ(http_->Put("/metadata?key=tierkv/seg-a", "descriptor", "application/json")->status, 200);
  master_->Kill(SIGKILL);
  master_->Wait();
  StartMaster({"--segment-ttl=30s"});
  // Before the daemon re-mounts the objects are held but not served, and
  // the master is not ready.
  EXPECT_FALSE(Get("k0").hit);
  auto ready = http_->Get("/ready");
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->status, 503);
  EXPECT_EQ(ready->body, "no segment mounted: 1 recovered from persistence, awaiting re-mount\n");
  EXPECT_EQ(Heartbeat("seg-a"), std::vector<std::string>{"seg-a"});
  Mount("seg-a");
  EXPECT_EQ(http_->Get("/ready")->status, 200);
  for (int i = 0; i < 100; ++i) {
    Found r = Get(absl::StrCat("k", i));
    ASSERT_TRUE(r.hit) << i;
    EXPECT_EQ(r.size, 4096u + i);
  }
  auto md = http_->Get("/metadata?key=tierkv/seg-a");
  ASSERT_TRUE(md) << httplib::to_string(md.error());
  EXPECT_EQ(md->body, "descriptor");
}

// Concurrent batched PutEnds and Removes are group-committed; every one
// that was acknowledged is in the index after a SIGKILL and a restart, and
// no removed key comes back.
TEST_F(MasterProcessTest, GroupCommittedPutEndsAndRemovesSurviveSigkill) {
  StartMaster({"--segment-ttl=30s"});
  Mount("seg-a");
  constexpr int kThreads = 4, kRounds = 5, kBatch = 20;
  auto key = [](int t, int r, int i) { return absl::StrCat("g", t, "-", r, "-", i); };
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        v1::PutStartRequest start;
        v1::KeysRequest end;
        v1::RemoveRequest remove;
        for (int i = 0; i < kBatch; ++i) {
          auto* item = start.add_items();
          item->set_key(key(t, r, i));
          item->set_size(4096);
          end.add_keys(key(t, r, i));
          if (i % 4 == 0) remove.add_keys(key(t, r, i));
        }
        v1::PutStartResponse started;
        v1::KeysResponse ended, removed;
        if (!stub_->PutStart(Ctx().get(), start, &started).ok() ||
            !stub_->PutEnd(Ctx().get(), end, &ended).ok() ||
            !stub_->Remove(Ctx().get(), remove, &removed).ok()) {
          failed.fetch_add(1);
          continue;
        }
        for (const auto& s : ended.status()) failed.fetch_add(s.code() != 0);
        for (const auto& s : removed.status()) failed.fetch_add(s.code() != 0);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  ASSERT_EQ(failed.load(), 0);
  master_->Kill(SIGKILL);
  master_->Wait();
  StartMaster({"--segment-ttl=30s"});
  Mount("seg-a");
  for (int t = 0; t < kThreads; ++t) {
    for (int r = 0; r < kRounds; ++r) {
      for (int i = 0; i < kBatch; ++i) {
        EXPECT_EQ(Get(key(t, r, i)).hit, i % 4 != 0) << key(t, r, i);
      }
    }
  }
}

// A long request (here a PutEnd stalled before it reaches the index) must
// not hold up a daemon's heartbeats: with one request thread they used to
// queue behind it, the segment outlived its TTL, and the master dropped it
// with every object on it.
TEST_F(MasterProcessTest, AStalledRequestDoesNotDelayHeartbeats) {
  StartMaster({"--segment-ttl=1s", "--rpc-threads=1"}, {{"TIERKV_FAILPOINTS", "master.rpc.put_end=sleep:2500"}});
  Mount("seg-a");
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", master_->port("rpc")),
                                     grpc::InsecureChannelCredentials());
  auto daemon = v1::Master::NewStub(channel);  // a daemon has its own connection
  std::atomic<bool> stop{false};
  std::atomic<int> remounts{0}, failures{0};
  std::thread beats([&] {
    for (int i = 0; i < 100 && !stop.load(); ++i) {  // at most 20 s
      v1::HeartbeatRequest req;
      v1::Segment* seg = req.add_segments();
      seg->set_name("seg-a");
      seg->set_incarnation("inc-1");
      v1::HeartbeatResponse resp;
      if (!daemon->Heartbeat(Ctx().get(), req, &resp).ok()) failures.fetch_add(1);
      remounts.fetch_add(resp.remount_size());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  Put("slow", 4096);  // PutEnd sleeps 2.5 s, longer than the TTL
  stop.store(true);
  beats.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(remounts.load(), 0) << "the segment expired while PutEnd was stalled";
  EXPECT_TRUE(Get("slow").hit);
}

// SIGTERM while a handler runs longer than the server's 2 s shutdown grace:
// the master waits for it instead of shutting its queues under it (which
// gRPC answers with an abort), and exits 0.
TEST_F(MasterProcessTest, SigtermDuringALongRequestExitsCleanly) {
  StartMaster({"--segment-ttl=30s"}, {{"TIERKV_FAILPOINTS", "master.rpc.put_end=sleep:3500"}});
  Mount("seg-a");
  v1::PutStartRequest start;
  auto* item = start.add_items();
  item->set_key("long");
  item->set_size(4096);
  v1::PutStartResponse started;
  ASSERT_TRUE(stub_->PutStart(Ctx().get(), start, &started).ok());
  std::thread put([&] {
    v1::KeysRequest end;
    end.add_keys("long");
    v1::KeysResponse done;
    (void)stub_->PutEnd(Ctx().get(), end, &done);  // cancelled by the shutdown, or answered
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let PutEnd reach its handler
  master_->Kill(SIGTERM);
  EXPECT_EQ(master_->Wait(), 0);
  put.join();
}

// With several RPC threads (each its own completion queue) concurrent
// clients are all served, and the master shuts down cleanly (SIGTERM).
TEST_F(MasterProcessTest, SeveralRpcThreadsServeConcurrentClients) {
  StartMaster({"--rpc-threads=3"});
  Mount("seg-a");
  std::atomic<int> misses{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        const std::string key = absl::StrCat("c", t, "-", i);
        Put(key, 4096);
        if (!Get(key).hit) misses.fetch_add(1);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(misses.load(), 0);
  master_->Kill(SIGTERM);
  EXPECT_EQ(master_->Wait(), 0);
}

TEST_F(MasterProcessTest, MetadataEndpointRoundTrip) {
  StartMaster();
  std::string value("\x01\x02 binary \xff", 12);
  auto put = http_->Put("/metadata?key=mooncake/ram/node1", value, "application/octet-stream");
  ASSERT_TRUE(put);
  EXPECT_EQ(put->status, 200);
  auto get = http_->Get("/metadata?key=mooncake/ram/node1");
  EXPECT_EQ(get->status, 200);
  EXPECT_EQ(get->body, value);
  EXPECT_EQ(http_->Delete("/metadata?key=mooncake/ram/node1")->status, 200);
  EXPECT_EQ(http_->Get("/metadata?key=mooncake/ram/node1")->status, 404);
  EXPECT_EQ(http_->Delete("/metadata?key=mooncake/ram/node1")->status, 404);
  // Malformed and unknown requests.
  auto no_key = http_->Get("/metadata");
  EXPECT_EQ(no_key->status, 400);
  EXPECT_TRUE(json::parse(no_key->body).contains("error"));
  auto unknown = http_->Get("/no/such/path");
  EXPECT_EQ(unknown->status, 404);
  EXPECT_TRUE(json::parse(unknown->body).contains("error"));
  EXPECT_EQ(http_->Get("/health")->status, 200);
  EXPECT_EQ(http_->Get("/healthz")->status, 200);
  EXPECT_EQ(http_->Get("/livez")->status, 200);
  // Live, but not ready: no segment to put anything in.
  auto ready = http_->Get("/ready");
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->status, 503);
  EXPECT_EQ(ready->body, "no segment mounted\n");
  Mount("seg-r");
  EXPECT_EQ(http_->Get("/ready")->status, 200);
}

// A daemon's SSD tier address that no HTTP client can take (the parser
// httplib uses throws on a port past INT_MAX) is refused with the reason,
// over the wire, and the master serves on.
TEST_F(MasterProcessTest, ASegmentWhoseTierAddressCannotBeDialledIsRefusedAndTheMasterServesOn) {
  StartMaster();
  v1::MountSegmentRequest req = MountRequest("seg-bad-tier");
  req.mutable_segments(0)->set_tier_http("127.0.0.1:99999999999");
  req.mutable_segments(0)->set_ssd_capacity(1 << 30);
  v1::MountSegmentResponse resp;
  ASSERT_TRUE(stub_->MountSegment(Ctx().get(), req, &resp).ok());
  ASSERT_EQ(resp.status_size(), 1);
  EXPECT_EQ(resp.status(0).code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(resp.status(0).message(), ::testing::HasSubstr("the port must be a number from 1 to 65535"));
  EXPECT_EQ(http_->Get("/health")->status, 200);
  Mount("seg-good");  // the next daemon mounts as ever
}

TEST_F(MasterProcessTest, OversizedHttpBodyIs413) {
  StartMaster({"--max-http-body=64kib"});
  auto r = http_->Put("/metadata?key=big", std::string(1 << 20, 'x'), "application/octet-stream");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_EQ(http_->Get("/health")->status, 200);
}

// Parses the exposition text: every sample line is `name{labels} value`
// with a HELP and TYPE line for its family before it.
TEST_F(MasterProcessTest, MetricsAreValidPrometheusText) {
  StartMaster();
  Mount("seg-a");
  Put("k", 1000);
  Get("k");
  auto res = http_->Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_NE(res->get_header_value("Content-Type").find("version=0.0.4"), std::string::npos);
  std::string text;
  std::map<std::string, double> values = Metrics(&text);
  EXPECT_EQ(values["tierkv_master_objects{state=\"complete\"}"], 1);
  EXPECT_EQ(values["tierkv_master_rpc_total{method=\"PutStart\"}"], 1);
  EXPECT_EQ(values["tierkv_master_rpc_total{method=\"GetReplicas\"}"], 1);
  EXPECT_EQ(values["tierkv_segment_capacity_bytes{host=\"host-seg-a\",segment=\"seg-a\"}"], 64 << 20);
  EXPECT_GE(values["tierkv_segment_used_bytes{host=\"host-seg-a\",segment=\"seg-a\"}"], 1000);

  // Prometheus's own checker must agree.
  EXPECT_TRUE(testing::PromtoolAccepts(text));
}

TEST_F(MasterProcessTest, BadFlagExitsWithStatus2) {
  auto m = ChildProcess::Start(testing::BinaryPath("tierkv-master"), {"--segment-ttl=forever"});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("--segment-ttl"), std::string::npos);
  EXPECT_NE(m.status().message().find("code 2"), std::string::npos);
}

TEST_F(MasterProcessTest, SigtermExitsCleanly) {
  StartMaster();
  master_->Kill(SIGTERM);
  EXPECT_EQ(master_->Wait(), 0);
}


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

std::unique_ptr<client::MasterClient> NewMasterClient(int port, bool direct = true) {
  client::MasterClientOptions o;
  o.direct = direct;
  o.rpc_timeout = absl::Seconds(3);
  auto c = client::MasterClient::Create(absl::StrCat("127.0.0.1:", port), o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// One port serves both: a client on the direct lane and one on gRPC see
// each other's puts, and the per-method metrics count both.
TEST_F(MasterProcessTest, DirectAndGrpcClientsShareTheRpcPort) {
  StartMaster();
  Mount("seg-a");
  auto fast = NewMasterClient(master_->port("rpc"));
  auto slow = NewMasterClient(master_->port("rpc"), /*direct=*/false);
  v1::PutStartRequest req;
  req.add_items()->set_key("via-direct");
  req.mutable_items(0)->set_size(4096);
  ASSERT_OK(fast->PutStart(req).status());
  ASSERT_OK(fast->PutEnd({"via-direct"}).status());
  EXPECT_TRUE(Get("via-direct").hit);  // the fixture's gRPC stub
  auto present = slow->Exists({"via-direct", "absent"});
  ASSERT_OK(present.status());
  EXPECT_EQ(*present, (std::vector<bool>{true, false}));
  Put("via-grpc", 8192);
  auto found = fast->GetReplicas({"via-grpc"});
  ASSERT_OK(found.status());
  EXPECT_EQ(found->sizes(0), 8192u);
  auto stats = fast->Stats();
  ASSERT_OK(stats.status());
  EXPECT_EQ(stats->http_port(), static_cast<uint32_t>(master_->port("http")));

  std::map<std::string, double> m = Metrics();
  EXPECT_EQ(m["tierkv_master_direct_connections"], 1);  // `fast` keeps its connection
  EXPECT_EQ(m["tierkv_master_rpc_total{method=\"PutStart\"}"], 2);
  EXPECT_EQ(m["tierkv_master_rpc_total{method=\"GetReplicas\"}"], 2);
  EXPECT_EQ(m["tierkv_master_rpc_total{method=\"Exists\"}"], 1);
  EXPECT_EQ(m["tierkv_master_direct_refused_total"], 0);
  fast.reset();
  for (int i = 0; i < 100 && Metrics()["tierkv_master_direct_connections"] != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(Metrics()["tierkv_master_direct_connections"], 0);
}

// Frames no client sends: each gets a status that says what is wrong, the
// connection closes only where the frame's end cannot be found, and the
// master keeps serving.
TEST_F(MasterProcessTest, HostileDirectFramesGetAStatusAndTheMasterStaysUp) {
  StartMaster({"--max-message-size=64kib", "--max-batch=4"});
  Mount("seg-a");
  {
    // A request that does not parse: INVALID_ARGUMENT, the connection stays.
    RawDirect raw(master_->port("rpc"));
    raw.Call(direct::DirectMethod::kGetReplicas, std::string("\xff\xff\xff\xff\x0f", 5));
    absl::Status s = raw.Reply();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_NE(s.message().find("GetReplicas: the request does not parse"), std::string::npos) << s;
    raw.Call(direct::DirectMethod::kPing, "");
    EXPECT_OK(raw.Reply());
    // More keys than --max-batch: refused whole, as over gRPC.
    v1::KeysRequest many;
    for (int i = 0; i < 5; ++i) many.add_keys(absl::StrCat("k", i));
    raw.Call(direct::DirectMethod::kExists, many.SerializeAsString());
    s = raw.Reply();
    EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
    EXPECT_NE(s.message().find("5 items exceeds the batch limit of 4"), std::string::npos) << s;
    // A good frame after them is answered.
    v1::KeysRequest one;
    one.add_keys("absent");
    raw.Call(direct::DirectMethod::kExists, one.SerializeAsString());
    std::string body;
    ASSERT_OK(raw.Reply(&body));
    v1::ExistsResponse present;
    ASSERT_TRUE(present.ParseFromString(body));
    ASSERT_EQ(present.present_size(), 1);
    EXPECT_FALSE(present.present(0));
  }
  {
    // Longer than --max-message-size: refused from its header, and the
    // reply reaches the client although part of the body was sent.
    RawDirect raw(master_->port("rpc"));
    std::string frame(direct::kHeaderSize, '\0');
    direct::EncodeCall({direct::DirectMethod::kPutStart, 1u << 20}, frame.data());
    raw.Send(frame + std::string(64 << 10, 'b'));
    absl::Status s = raw.Reply();
    EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
    EXPECT_NE(s.message().find("exceeds the master's limit of 65536"), std::string::npos) << s;
    EXPECT_TRUE(raw.ClosedByMaster());
  }
  {
    // An unknown method after a good first call.
    RawDirect raw(master_->port("rpc"));
    raw.Call(direct::DirectMethod::kPing, "");
    EXPECT_OK(raw.Reply());
    std::string frame(direct::kHeaderSize, '\0');
    direct::EncodeCall({direct::DirectMethod::kPing, 0}, frame.data());
    frame[4] = 77;
    raw.Send(frame);
    absl::Status s = raw.Reply();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_NE(s.message().find("unknown direct method 77"), std::string::npos) << s;
    EXPECT_TRUE(raw.ClosedByMaster());
  }
  {
    // A frame cut short, then the connection dropped.
    RawDirect raw(master_->port("rpc"));
    std::string frame(direct::kHeaderSize, '\0');
    direct::EncodeCall({direct::DirectMethod::kGetReplicas, 100}, frame.data());
    raw.Send(frame + "abc");
    raw.HalfClose();
    EXPECT_TRUE(raw.ClosedByMaster());
  }
  {
    // Bytes that are neither direct nor HTTP/2 go to gRPC, which drops them.
    RawDirect raw(master_->port("rpc"));
    raw.Send(std::string(64, 'x'));
    EXPECT_TRUE(raw.ClosedByMaster());
  }
  auto c = NewMasterClient(master_->port("rpc"));
  auto present = c->Exists({"k"});
  ASSERT_OK(present.status());
  EXPECT_FALSE((*present)[0]);
  Put("still-serving", 4096);
  EXPECT_TRUE(Get("still-serving").hit);
  std::map<std::string, double> m = Metrics();
  EXPECT_EQ(m["tierkv_master_direct_refused_total"], 2);  // the two frames whose end was lost
  EXPECT_EQ(m["tierkv_master_rpc_errors_total{method=\"GetReplicas\"}"], 1);
  EXPECT_EQ(m["tierkv_master_rpc_errors_total{method=\"Exists\"}"], 1);
}

// Past --direct-max-connections a client is told so on its first call and
// uses gRPC; daemons' gRPC connections never count against the cap.
TEST_F(MasterProcessTest, DirectConnectionsPastTheCapUseGrpc) {
  StartMaster({"--direct-max-connections=1"});
  RawDirect holder(master_->port("rpc"));
  holder.Call(direct::DirectMethod::kPing, "");
  ASSERT_OK(holder.Reply());
  RawDirect over(master_->port("rpc"));
  over.Call(direct::DirectMethod::kPing, "");
  absl::Status s = over.Reply();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("at its cap of 1 connections"), std::string::npos) << s;
  Mount("seg-a");  // gRPC, past the cap
  auto c = NewMasterClient(master_->port("rpc"));
  v1::PutStartRequest req;
  req.add_items()->set_key("k");
  req.mutable_items(0)->set_size(4096);
  ASSERT_OK(c->PutStart(req).status());  // over gRPC
  ASSERT_OK(c->PutEnd({"k"}).status());
  EXPECT_TRUE(Get("k").hit);
  std::map<std::string, double> m = Metrics();
  EXPECT_EQ(m["tierkv_master_direct_connections"], 1);
  EXPECT_EQ(m["tierkv_master_direct_refused_total"], 2);  // `over` and the client's own try
}

// The master closes direct connections idle past --direct-idle-timeout; a
// client's next call redials instead of failing, puts included.
TEST_F(MasterProcessTest, ADirectClientOutlivesTheIdleTimeout) {
  StartMaster({"--direct-idle-timeout=200ms"});
  Mount("seg-a");
  auto c = NewMasterClient(master_->port("rpc"));
  for (int round = 0; round < 3; ++round) {
    v1::PutStartRequest req;
    const std::string key = absl::StrCat("idle-", round);
    req.add_items()->set_key(key);
    req.mutable_items(0)->set_size(4096);
    ASSERT_OK(c->PutStart(req).status()) << round;
    ASSERT_OK(c->PutEnd({key}).status()) << round;
    for (int i = 0; i < 100 && Metrics()["tierkv_master_direct_connections"] != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ASSERT_EQ(Metrics()["tierkv_master_direct_connections"], 0) << "round " << round;
  }
  EXPECT_EQ(Metrics()["tierkv_master_rpc_total{method=\"PutStart\"}"], 3);  // none failed, none resent
}

// A reply lost after the master ran the call: lookups are retried, a put
// is not (the master may hold its space), and neither hangs.
TEST_F(MasterProcessTest, ALostDirectReplyRetriesLookupsButNotPuts) {
  StartMaster({}, {{"TIERKV_FAILPOINTS", "master.direct.drop_reply=error"}});
  Mount("seg-a");
  auto c = NewMasterClient(master_->port("rpc"));
  v1::PutStartRequest req;
  req.add_items()->set_key("k");
  req.mutable_items(0)->set_size(4096);
  absl::Time start = absl::Now();
  absl::StatusOr<v1::PutStartResponse> put = c->PutStart(req);
  EXPECT_TRUE(absl::IsUnavailable(put.status())) << put.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));  // not retried, nothing waited for
  EXPECT_EQ(Metrics()["tierkv_master_rpc_total{method=\"PutStart\"}"], 1);
  start = absl::Now();
  absl::StatusOr<std::vector<bool>> present = c->Exists({"k"});
  EXPECT_TRUE(absl::IsUnavailable(present.status())) << present.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));  // retried within its 3 s budget
  EXPECT_GT(Metrics()["tierkv_master_rpc_total{method=\"Exists\"}"], 1);
  EXPECT_TRUE(Get("absent").hit == false);  // gRPC still answers
}

// --- --auth token ------------------------------------------------------------

constexpr char kDaemonA[] = "daemon-a-token-000000000";
constexpr char kDaemonB[] = "daemon-b-token-000000000";
constexpr char kClientToken[] = "client-token-00000000000";
constexpr char kAdminToken[] = "admin-token-000000000000";
constexpr char kExpired[] = "expired-token-0000000000";

std::string TokenLines() {
  return absl::StrCat("# token name roles [expires]\n", kDaemonA, " decode-a daemon\n", kDaemonB,
                      " decode-b daemon\n", kClientToken, " sglang-0 client\n", kAdminToken, " ops admin\n",
                      kExpired, " old client expires=2020-01-01T00:00:00Z\n");
}

std::unique_ptr<grpc::ClientContext> TokenCtx(const std::string& token) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  return ctx;
}

absl::Status AsStatus(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// Every door of the master asks for a token: gRPC per call and by role,
// the direct lane on a connection's first frame, HTTP per request. Each
// refusal says why, a descriptor stays its daemon's across a restart,
// SIGHUP swaps the tokens (a broken file keeps the old ones), and the
// master serves on through all of it.
TEST_F(MasterProcessTest, TokenAuthGuardsGrpcTheDirectLaneAndHttp) {
  const std::string tokens = data_dir_ + "/tokens";
  std::filesystem::create_directories(data_dir_);
  std::ofstream(tokens) << TokenLines();
  const std::vector<std::string> flags{"--auth=token", "--token-file=" + tokens};
  StartMaster(flags);

  // gRPC: no token, an expired one, a role short of the method's.
  v1::StatsRequest sreq;
  v1::StatsResponse sresp;
  absl::Status s = AsStatus(stub_->Stats(TokenCtx("").get(), sreq, &sresp));
  EXPECT_TRUE(absl::IsUnauthenticated(s)) << s;
  EXPECT_NE(s.message().find("Stats: no token"), std::string::npos) << s;
  s = AsStatus(stub_->Stats(TokenCtx(kExpired).get(), sreq, &sresp));
  EXPECT_TRUE(absl::IsUnauthenticated(s)) << s;
  EXPECT_NE(s.message().find("'old' expired at 2020-01-01"), std::string::npos) << s;
  s = AsStatus(stub_->Stats(TokenCtx("not-a-token-of-ours-00").get(), sreq, &sresp));
  EXPECT_TRUE(absl::IsUnauthenticated(s)) << s;
  v1::MountSegmentRequest mount = MountRequest("seg-a");
  v1::MountSegmentResponse mresp;
  s = AsStatus(stub_->MountSegment(TokenCtx(kClientToken).get(), mount, &mresp));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  EXPECT_NE(s.message().find("'sglang-0' has role client, needs daemon,admin"), std::string::npos) << s;
  ASSERT_OK(AsStatus(stub_->MountSegment(TokenCtx(kDaemonA).get(), mount, &mresp)));
  ASSERT_EQ(mresp.status(0).code(), 0) << mresp.status(0).message();
  v1::RemoveAllRequest all;
  v1::RemoveAllResponse aresp;
  EXPECT_TRUE(absl::IsPermissionDenied(AsStatus(stub_->RemoveAll(TokenCtx(kClientToken).get(), all, &aresp))));
  EXPECT_TRUE(absl::IsPermissionDenied(AsStatus(stub_->RemoveAll(TokenCtx(kDaemonA).get(), all, &aresp))));
  EXPECT_OK(AsStatus(stub_->RemoveAll(TokenCtx(kAdminToken).get(), all, &aresp)));

  // The direct lane: a ping without a token, a first call that is no ping,
  // a token without the client role: each answered and closed.
  {
    RawDirect raw(master_->port("rpc"));
    raw.Call(direct::DirectMethod::kPing, "");
    s = raw.Reply();
    EXPECT_TRUE(absl::IsUnauthenticated(s)) << s;
    EXPECT_NE(s.message().find("direct lane: no token"), std::string::npos) << s;
    EXPECT_TRUE(raw.ClosedByMaster());
  }
  {
    RawDirect raw(master_->port("rpc"));
    v1::KeysRequest one;
    one.add_keys("k");
    raw.Call(direct::DirectMethod::kExists, one.SerializeAsString());
    s = raw.Reply();
    EXPECT_TRUE(absl::IsUnauthenticated(s)) << s;
    EXPECT_NE(s.message().find("first call must be a ping with a token"), std::string::npos) << s;
    EXPECT_TRUE(raw.ClosedByMaster());
  }
  {
    RawDirect raw(master_->port("rpc"));
    v1::DirectHello hello;
    hello.set_token(kDaemonA);
    raw.Call(direct::DirectMethod::kPing, hello.SerializeAsString());
    s = raw.Reply();
    EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
    EXPECT_TRUE(raw.ClosedByMaster());
  }
  {
    RawDirect raw(master_->port("rpc"));
    raw.Call(direct::DirectMethod::kPing, std::string("\xff\xff", 2));
    s = raw.Reply();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_TRUE(raw.ClosedByMaster());
  }
  {
    // Admitted once; later calls on the connection need nothing more.
    RawDirect raw(master_->port("rpc"));
    v1::DirectHello hello;
    hello.set_token(kClientToken);
    raw.Call(direct::DirectMethod::kPing, hello.SerializeAsString());
    ASSERT_OK(raw.Reply());
    v1::KeysRequest one;
    one.add_keys("absent");
    raw.Call(direct::DirectMethod::kExists, one.SerializeAsString());
    std::string body;
    ASSERT_OK(raw.Reply(&body));
  }
  // MasterClient: with its token on the lane; without one, refused with
  // the master's reason (the lane refuses it, and so does gRPC).
  client::MasterClientOptions with;
  with.token = kClientToken;
  with.rpc_timeout = absl::Seconds(3);
  ASSERT_OK_AND_ASSIGN(auto good, client::MasterClient::Create(absl::StrCat("127.0.0.1:", master_->port("rpc")), with));
  v1::PutStartRequest put;
  put.add_items()->set_key("by-client");
  put.mutable_items(0)->set_size(4096);
  ASSERT_OK_AND_ASSIGN(v1::PutStartResponse started, good->PutStart(put));
  ASSERT_EQ(started.results(0).status().code(), 0) << started.results(0).status().message();
  ASSERT_OK(good->PutEnd({"by-client"}).status());
  auto anonymous = NewMasterClient(master_->port("rpc"));
  absl::StatusOr<std::vector<bool>> present = anonymous->Exists({"by-client"});
  EXPECT_TRUE(absl::IsUnauthenticated(present.status())) << present.status();

  // HTTP: the probes open, the rest by token and role.
  for (const char* probe : {"/health", "/healthz", "/livez"}) EXPECT_EQ(http_->Get(probe)->status, 200) << probe;
  auto refused = http_->Get("/v1/stats");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 401);
  EXPECT_EQ(refused->get_header_value("WWW-Authenticate"), "Bearer");
  EXPECT_NE(json::parse(refused->body)["error"].get<std::string>().find("no token"), std::string::npos);
  EXPECT_EQ(http_->Get("/metrics")->status, 401);
  auto as = [&](const char* token) {
    auto c = std::make_unique<httplib::Client>("127.0.0.1", master_->port("http"));
    c->set_read_timeout(std::chrono::seconds(5));
    c->set_bearer_token_auth(token);
    return c;
  };
  EXPECT_EQ(as(kClientToken)->Get("/v1/stats")->status, 200);
  EXPECT_EQ(as(kExpired)->Get("/v1/stats")->status, 401);
  // Descriptors: only daemons write them, and each only its own.
  const std::string key = "/metadata?key=tierkv/desc/seg-a";
  auto by_client = as(kClientToken)->Put(key, "redirect", "application/octet-stream");
  EXPECT_EQ(by_client->status, 403);
  EXPECT_EQ(as(kDaemonA)->Put(key, "descriptor-a", "application/octet-stream")->status, 200);
  auto hijack = as(kDaemonB)->Put(key, "descriptor-b", "application/octet-stream");
  EXPECT_EQ(hijack->status, 403);
  EXPECT_NE(hijack->body.find("belongs to 'decode-a', not to 'decode-b'"), std::string::npos) << hijack->body;
  EXPECT_EQ(as(kDaemonB)->Delete(key)->status, 403);
  EXPECT_EQ(as(kClientToken)->Get(key)->body, "descriptor-a");

  // The owner is persisted with the descriptor: a restarted master keeps it.
  master_->Kill(SIGTERM);
  ASSERT_EQ(master_->Wait(), 0);
  StartMaster(flags);
  EXPECT_EQ(as(kDaemonB)->Put(key, "descriptor-b", "application/octet-stream")->status, 403);
  EXPECT_EQ(as(kDaemonA)->Put(key, "descriptor-a2", "application/octet-stream")->status, 200);
  EXPECT_EQ(as(kAdminToken)->Get(key)->body, "descriptor-a2");
  EXPECT_EQ(as(kDaemonA)->Delete(key)->status, 200);
  // Deleted, the key is free for the next daemon.
  EXPECT_EQ(as(kDaemonB)->Put(key, "descriptor-b", "application/octet-stream")->status, 200);

  // SIGHUP: a new token is accepted once the file is re-read; a broken
  // file keeps the tokens in use.
  constexpr char kNew[] = "new-client-token-0000000";
  std::ofstream(tokens) << TokenLines() << kNew << " vllm-1 client\n";
  master_->Kill(SIGHUP);
  bool accepted = false;
  for (int i = 0; i < 100 && !accepted; ++i) {
    accepted = stub_->Stats(TokenCtx(kNew).get(), sreq, &sresp).ok();
    if (!accepted) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(accepted);
  std::ofstream(tokens) << "not a token file\n";
  master_->Kill(SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_TRUE(master_->Running());
  EXPECT_OK(AsStatus(stub_->Stats(TokenCtx(kNew).get(), sreq, &sresp)));
  EXPECT_NE(master_->Stderr().find("keeping the tokens in use"), std::string::npos);

  // Refusals are counted: the method's errors, the lane's refused connections.
  EXPECT_TRUE(absl::IsUnauthenticated(AsStatus(stub_->Stats(TokenCtx("").get(), sreq, &sresp))));
  {
    RawDirect raw(master_->port("rpc"));
    raw.Call(direct::DirectMethod::kPing, "");
    EXPECT_TRUE(absl::IsUnauthenticated(raw.Reply()));
  }
  http_->set_bearer_token_auth(kAdminToken);
  std::map<std::string, double> m = Metrics();
  EXPECT_GE(m["tierkv_master_rpc_errors_total{method=\"Stats\"}"], 1);
  EXPECT_EQ(m["tierkv_master_direct_refused_total"], 1);  // since the restart
}

// --auth none on a routable address is refused unless asked for.
TEST_F(MasterProcessTest, AnOpenMasterOnAWildcardBindNeedsInsecureAllowRemote) {
  auto refused = ChildProcess::Start(testing::BinaryPath("tierkv-master"),
                                     {"--listen=0.0.0.0", "--rpc-port=0", "--http-port=0"});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("without authentication"), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("--insecure-allow-remote"), std::string::npos) << refused.status();
  StartMaster({"--listen=0.0.0.0", "--insecure-allow-remote"});
  EXPECT_NE(master_->Stderr().find("without authentication (--insecure-allow-remote)"), std::string::npos);
  EXPECT_EQ(http_->Get("/health")->status, 200);
}

// Grants from a master that checks no tokens protect nothing: a daemon
// that needs them is warned about at its mount; grants carry its key's
// session key and none for a daemon without one.
TEST_F(MasterProcessTest, GrantsComeFromTheSegmentsKeyAndAnOpenMasterSaysItGivesThemToAnyone) {
  StartMaster();
  v1::MountSegmentRequest mount;
  for (const char* name : {"keyed", "open"}) {
    v1::Segment* seg = mount.add_segments();
    seg->set_name(name);
    seg->set_host("host-" + std::string(name));
    seg->set_capacity(64 << 20);
    seg->set_incarnation("inc-1");
  }
  const std::string key(auth::kDataKeyBytes, 'k');
  mount.mutable_segments(0)->set_data_key(key);
  v1::MountSegmentResponse mresp;
  ASSERT_TRUE(stub_->MountSegment(Ctx().get(), mount, &mresp).ok());
  v1::GrantDataRequest req;
  for (const char* name : {"keyed", "open", "absent"}) req.add_segments(name);
  v1::GrantDataResponse resp;
  ASSERT_TRUE(stub_->GrantData(Ctx().get(), req, &resp).ok());
  ASSERT_EQ(resp.grants_size(), 3);
  EXPECT_EQ(resp.grants(0).status().code(), 0);
  EXPECT_EQ(resp.grants(0).session_key(), auth::GrantSessionKey(key, resp.grants(0).grant()));
  EXPECT_GT(auth::GrantExpiry(resp.grants(0).grant()), absl::Now() + absl::Minutes(9));
  EXPECT_TRUE(resp.grants(1).grant().empty());
  EXPECT_EQ(resp.grants(2).status().code(), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_NE(master_->Stderr().find("segment keyed needs data grants, but this master runs --auth none"),
            std::string::npos);
  EXPECT_EQ(master_->Stderr().find("segment open needs data grants"), std::string::npos);
  // The key never leaves the master: not in /v1/segments, not in Stats.
  auto segs = http_->Get("/v1/segments");
  ASSERT_TRUE(segs);
  EXPECT_EQ(segs->body.find(key), std::string::npos);
  v1::StatsResponse stats;
  ASSERT_TRUE(stub_->Stats(Ctx().get(), v1::StatsRequest(), &stats).ok());
  ASSERT_EQ(stats.segment_info_size(), 2);
  EXPECT_TRUE(stats.segment_info(0).segment().data_key().empty());
  EXPECT_TRUE(stats.segment_info(1).segment().data_key().empty());
}

}  // namespace
}  // namespace tierkv
