// Starts the real tierkv-master binary on loopback ports and drives it over
// gRPC, its direct lane and HTTP. This file: the index, segments and their
// liveness, persistence across SIGKILL, request threads, HTTP and metrics.
// The direct lane: master_direct_lane_test.cc; --auth token and grants:
// master_auth_test.cc; the fixture: master_fixture.h.
#include "tests/integration/master_fixture.h"

#include <signal.h>

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "tests/support/promtool.h"

namespace tierkv::integration {
namespace {

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
  EXPECT_OK(WaitFor("the silent segment's object to leave the index", absl::Seconds(3), [&] {
    EXPECT_TRUE(Heartbeat("alive").empty());
    return !Get("on-silent").hit;
  }));
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
  absl::Notification stop;
  std::atomic<int> remounts{0}, failures{0};
  std::thread beats([&] {
    // A heartbeat every 200 ms, as a daemon's, for at most 20 s; the wait
    // between them ends at once on stop.
    for (int i = 0; i < 100; ++i) {
      v1::HeartbeatRequest req;
      v1::Segment* seg = req.add_segments();
      seg->set_name("seg-a");
      seg->set_incarnation("inc-1");
      v1::HeartbeatResponse resp;
      if (!daemon->Heartbeat(Ctx().get(), req, &resp).ok()) failures.fetch_add(1);
      remounts.fetch_add(resp.remount_size());
      if (stop.WaitForNotificationWithTimeout(absl::Milliseconds(200))) break;
    }
  });
  Put("slow", 4096);  // PutEnd sleeps 2.5 s, longer than the TTL
  stop.Notify();
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
  // PutEnd is counted on arrival, in flight from then on, before its handler stalls.
  EXPECT_OK(WaitFor("the PutEnd to reach the master", absl::Seconds(10),
                    [&] { return Metrics()["tierkv_master_rpc_total{method=\"PutEnd\"}"] >= 1; }));
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

}  // namespace
}  // namespace tierkv::integration
