// The master under --auth token, against the real binary: every door asks
// for a token (gRPC, the direct lane, HTTP), SIGHUP swaps the tokens, an
// open master on a routable address must be asked for, and data grants
// come from a segment's key. The fixture is master_fixture.h.
#include "tests/integration/master_fixture.h"

#include <signal.h>

#include <fstream>

#include "base/auth.h"

namespace tierkv::integration {
namespace {

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
  EXPECT_OK(WaitFor("the new token to be accepted after SIGHUP", absl::Seconds(5),
                    [&] { return stub_->Stats(TokenCtx(kNew).get(), sreq, &sresp).ok(); }));
  std::ofstream(tokens) << "not a token file\n";
  master_->Kill(SIGHUP);
  EXPECT_OK(WaitFor("the master to log that it keeps the tokens in use", absl::Seconds(5),
                    [&] { return master_->Stderr().find("keeping the tokens in use") != std::string::npos; }));
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

// A segment belongs to the identity that mounted it. Another daemon
// identity (the role every memory-lending client holds) cannot mount over
// it, whatever incarnation or host it names, unmount it, keep it alive or
// list its SSD records; the owner outlives a master killed while the
// daemon is away, and an admin may change any segment without taking it.
TEST_F(MasterProcessTest, ASegmentChangesOnlyByTheIdentityThatMountedIt) {
  const std::string tokens = data_dir_ + "/tokens";
  std::filesystem::create_directories(data_dir_);
  std::ofstream(tokens) << TokenLines();
  const std::vector<std::string> flags{"--auth=token", "--token-file=" + tokens, "--segment-ttl=30s"};
  StartMaster(flags);
  auto mount = [&](const std::string& token, const std::string& incarnation, const std::string& host = "") {
    v1::MountSegmentRequest req = MountRequest("seg-a", incarnation);
    if (!host.empty()) req.mutable_segments(0)->set_host(host);
    v1::MountSegmentResponse resp;
    grpc::Status s = stub_->MountSegment(TokenCtx(token).get(), req, &resp);
    return s.ok() ? absl::Status(static_cast<absl::StatusCode>(resp.status(0).code()), resp.status(0).message())
                  : AsStatus(s);
  };
  auto unmount = [&](const std::string& token) {
    v1::UnmountSegmentRequest req;
    req.add_names("seg-a");
    v1::UnmountSegmentResponse resp;
    grpc::Status s = stub_->UnmountSegment(TokenCtx(token).get(), req, &resp);
    return s.ok() ? absl::Status(static_cast<absl::StatusCode>(resp.status(0).code()), resp.status(0).message())
                  : AsStatus(s);
  };
  auto owner = [&] {
    http_->set_bearer_token_auth(kAdminToken);
    auto r = http_->Get("/v1/segments/seg-a");
    return r && r->status == 200 ? json::parse(r->body).value("owner", "?") : std::string("(none)");
  };
  ASSERT_OK(mount(kDaemonA, "inc-1"));
  EXPECT_EQ(owner(), "decode-a");

  absl::Status s = mount(kDaemonB, "inc-2");  // a "restart" of it, on its host
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  EXPECT_NE(s.message().find("segment seg-a belongs to 'decode-a', not to 'decode-b'"), std::string::npos) << s;
  EXPECT_TRUE(absl::IsPermissionDenied(mount(kDaemonB, "inc-1")));  // its incarnation, read off /v1/segments
  EXPECT_TRUE(absl::IsPermissionDenied(mount(kDaemonB, "inc-3", "host-b")));
  EXPECT_TRUE(absl::IsPermissionDenied(unmount(kDaemonB)));
  v1::HeartbeatRequest beat;
  *beat.add_segments() = MountRequest("seg-a").segments(0);
  v1::HeartbeatResponse bresp;
  ASSERT_OK(AsStatus(stub_->Heartbeat(TokenCtx(kDaemonB).get(), beat, &bresp)));
  EXPECT_EQ(bresp.remount_size(), 1);  // not its segment to keep alive
  ASSERT_OK(AsStatus(stub_->Heartbeat(TokenCtx(kDaemonA).get(), beat, &bresp)));
  EXPECT_EQ(bresp.remount_size(), 0);
  v1::SsdRecordsRequest wipe;
  wipe.set_segment("seg-a");
  wipe.set_incarnation("inc-1");
  wipe.add_gone("anything");
  v1::SsdRecordsResponse wresp;
  ASSERT_OK(AsStatus(stub_->SyncSsdRecords(TokenCtx(kDaemonB).get(), wipe, &wresp)));
  EXPECT_EQ(wresp.status().code(), static_cast<int>(absl::StatusCode::kPermissionDenied)) << wresp.status().message();
  EXPECT_EQ(owner(), "decode-a");

  // Killed while the daemon is away: the recovered segment is still its.
  master_->Kill(SIGKILL);
  master_->Wait();
  StartMaster(flags);
  EXPECT_TRUE(absl::IsPermissionDenied(mount(kDaemonB, "inc-1")));
  EXPECT_TRUE(absl::IsPermissionDenied(unmount(kDaemonB)));
  ASSERT_OK(mount(kDaemonA, "inc-1"));
  // An admin re-mounts and unmounts it without becoming its owner.
  ASSERT_OK(mount(kAdminToken, "inc-1"));
  EXPECT_EQ(owner(), "decode-a");
  ASSERT_OK(unmount(kAdminToken));
  // Gone, the name is free for the next daemon.
  ASSERT_OK(mount(kDaemonB, "inc-9"));
  EXPECT_EQ(owner(), "decode-b");
  EXPECT_TRUE(absl::IsPermissionDenied(unmount(kDaemonA)));
  ASSERT_OK(unmount(kDaemonB));
  ASSERT_TRUE(master_->Running());
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
  // An open master's callers have no tenant, as its segments' owners: the
  // grant lets them map the memory too.
  EXPECT_EQ(resp.grants(0).session_key(), auth::MapSessionKey(key, resp.grants(0).grant()));
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
}  // namespace tierkv::integration
