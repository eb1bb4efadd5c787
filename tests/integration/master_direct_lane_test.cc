// The master's direct lane on its RPC port, against the real binary: it
// shares the port with gRPC, answers hostile frames with a status, caps
// its connections, closes idle ones, and a lost reply is retried only
// where that is safe. The fixture is master_fixture.h.
#include "tests/integration/master_fixture.h"

namespace tierkv::integration {
namespace {

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
  EXPECT_OK(WaitFor("the master to count the closed direct connection", absl::Seconds(5),
                    [&] { return Metrics()["tierkv_master_direct_connections"] == 0; }));
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
    ASSERT_OK(WaitFor("the master to close the idle direct connection", absl::Seconds(5),
                      [&] { return Metrics()["tierkv_master_direct_connections"] == 0; }))
        << "round " << round;
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

}  // namespace
}  // namespace tierkv::integration
