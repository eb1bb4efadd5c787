// High availability against a real etcd (docs/ha.md): masters of one
// cluster elect a leader, standbys copy its store, and a standby takes over
// when the leader is lost, with every acknowledged put still readable.
// Daemons and clients are given every master and follow the leader. Each
// test records what it measured (failover time, the epochs and the
// moments each master last and first answered) in its output. Skips,
// saying why, where etcd is not installed (scripts/install-deps.sh
// installs Debian's etcd-server).
//
// This file: replication under --auth token and mTLS, and what a standby
// answers on its ports. Failover under load and stalled or deposed
// leaders: ha_failover_test.cc; etcd's part: ha_etcd_test.cc; the
// fixture: ha_fixture.h.
#include "tests/integration/ha_fixture.h"
#include "proto/direct_frame.h"
#include "tests/support/tls_certs.h"

namespace tierkv::integration {
namespace {

// Under --auth token, replication reads every tenant's index and a reader
// counts as a standby: a standby presents its --ha-token-file token (admin
// role) and catches up; a client's token, or none, gets nothing from the
// leader, over gRPC or the direct lane's stream.
TEST_F(HaTest, ReplicationUnderAuthTakesAnAdminToken) {
  const std::string admin = "ha-standby-token-0123456789", client = "ha-client-token-0123456789";
  {
    std::ofstream(dir_ + "/tokens") << admin << " standby admin\n" << client << " app client\n";
    std::ofstream(dir_ + "/ha.token") << admin << "\n";
  }
  http_token_ = admin;
  StartEtcd();
  const std::vector<std::string> flags = {"--auth=token", "--token-file=" + dir_ + "/tokens",
                                          "--ha-token-file=" + dir_ + "/ha.token"};
  StartMaster(0, flags);
  StartMaster(1, flags);
  const int leader = WaitForLeader();
  ASSERT_GE(leader, 0) << Logs();
  ASSERT_OK(WaitForSynced(leader, 1)) << "the standby did not catch up with its token\n" << Logs();
  const std::string at = absl::StrCat(hosts_[leader], ":", rpc_[leader]);
  // Its copy streams (the token opens the direct lane), as without --auth.
  const int standby = 1 - leader;
  StartDaemon({"--master=" + MasterList(), "--metadata=" + MetadataList(), "--token-file=" + dir_ + "/ha.token"});
  ASSERT_OK(WaitForLiveSegments(leader, 1)) << Logs();
  std::unique_ptr<client::Client> writer = NewClientWithToken(admin);
  ASSERT_NE(writer, nullptr);
  // Puts until the standby has a batch by the stream.
  int i = 0;
  absl::Status put;
  EXPECT_OK(WaitFor("the standby to stream a batch", absl::Seconds(10), [&] {
    put = writer->Put(absl::StrCat("k", i++), "v");
    if (!put.ok()) return true;  // asserted below
    absl::StatusOr<json> sh = Ha(standby);
    return sh.ok() && (*sh)["copy"].value("streamed_batches", 0) > 0;
  })) << "the standby pulled instead of streaming\n" << Logs();
  ASSERT_OK(put);

  auto stub = v1::MasterHa::NewStub(grpc::CreateChannel(at, grpc::InsecureChannelCredentials()));
  auto pull = [&](const std::string& token) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    v1::PullRequest req;
    req.set_standby("intruder");
    req.set_next_seq(1);
    v1::PullResponse resp;
    return stub->Pull(&ctx, req, &resp).error_code();
  };
  EXPECT_EQ(pull(""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(pull(client), grpc::StatusCode::PERMISSION_DENIED);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.AddMetadata("authorization", "Bearer " + client);
    v1::SnapshotRequest req;
    req.set_standby("intruder");
    v1::SnapshotResponse resp;
    EXPECT_EQ(stub->Snapshot(&ctx, req, &resp).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }

  // The direct lane: a client's token is admitted, its stream is not.
  ASSERT_OK_AND_ASSIGN(net::Fd fd, net::Dial(at, absl::Now() + absl::Seconds(5)));
  auto call = [&](direct::DirectMethod method, const google::protobuf::Message& m) -> absl::StatusOr<uint32_t> {
    std::string out(direct::kHeaderSize, '\0');
    direct::EncodeCall({method, static_cast<uint32_t>(m.ByteSizeLong())}, out.data());
    m.AppendToString(&out);
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    RETURN_IF_ERROR(net::WriteFull(fd.get(), out.data(), out.size(), deadline));
    char h[direct::kHeaderSize];
    RETURN_IF_ERROR(net::ReadFull(fd.get(), h, sizeof h, deadline));
    ASSIGN_OR_RETURN(direct::ReplyHeader r, direct::DecodeReply(h, 1 << 20));
    std::string rest(r.message_length + r.length, '\0');
    RETURN_IF_ERROR(net::ReadFull(fd.get(), rest.data(), rest.size(), deadline));
    return r.code;
  };
  v1::DirectHello hello;
  hello.set_token(client);
  ASSERT_OK_AND_ASSIGN(uint32_t code, call(direct::DirectMethod::kPing, hello));
  EXPECT_EQ(code, 0u);
  v1::PullRequest stream;
  stream.set_standby("intruder");
  stream.set_next_seq(1);
  ASSERT_OK_AND_ASSIGN(code, call(direct::DirectMethod::kReplicate, stream));
  EXPECT_EQ(code, static_cast<uint32_t>(absl::StatusCode::kPermissionDenied));

  // No intruder counts among the standbys.
  ASSERT_OK_AND_ASSIGN(json h, Ha(leader));
  for (const json& s : h["standbys"]) EXPECT_NE(s.value("name", ""), "intruder") << h.dump();
}

// Under --auth mtls the masters' ports speak only TLS, so there is no
// direct lane to stream on: a standby pulls over gRPC, presenting its own
// certificate (admin role), catches up, and takes over with the whole
// index when the leader is killed.
TEST_F(HaTest, MastersUnderMutualTlsReplicateAndFailOver) {
  absl::StatusOr<testing::TestCerts> certs = testing::MakeTestCerts(dir_);
  if (!certs.ok()) GTEST_SKIP() << "no test certificates: " << certs.status();
  // The masters are their server certificate (CN tierkv-master); the
  // daemon and the client the client one.
  std::ofstream(dir_ + "/identities") << "cert:tierkv-master masters admin\n"
                                      << "cert:decode-1.tierkv decode-1 admin\n";
  http_tls_ = {certs->ca, certs->client_cert, certs->client_key};
  const std::vector<std::string> flags = {"--auth=mtls", "--token-file=" + dir_ + "/identities",
                                          "--tls-cert=" + certs->server_cert, "--tls-key=" + certs->server_key,
                                          "--tls-ca=" + certs->ca};
  StartEtcd();
  StartMaster(0, flags);
  StartMaster(1, flags);
  const int leader = WaitForLeader();
  ASSERT_GE(leader, 0) << Logs();
  ASSERT_OK(WaitForSynced(leader, 1)) << "the standby did not catch up over TLS\n" << Logs();
  // The standby answers on its ports under TLS too: /v1/ha over HTTPS, and
  // on its RPC port a refusal naming the leader, which a client given only
  // the standby follows.
  const int standby = 1 - leader;
  const std::string leader_address = absl::StrCat(hosts_[leader], ":", rpc_[leader]);
  const std::string standby_address = absl::StrCat(hosts_[standby], ":", rpc_[standby]);
  {
    ASSERT_OK_AND_ASSIGN(json sh, Ha(standby));
    EXPECT_EQ(sh["role"], "standby") << sh.dump();
    EXPECT_EQ(sh["leader"], leader_address) << sh.dump();
    client::MasterClientOptions o;
    o.tls = http_tls_;
    ASSERT_OK_AND_ASSIGN(auto mc, client::MasterClient::Create(standby_address, o));
    EXPECT_OK(mc->Exists({"any"}).status());
    EXPECT_EQ(mc->masters(), (std::vector<std::string>{standby_address, leader_address}));
  }
  StartDaemon({"--master=" + MasterList(), "--metadata=" + MetadataList(), "--tls-ca=" + certs->ca,
               "--tls-cert=" + certs->client_cert, "--tls-key=" + certs->client_key});
  ASSERT_OK(WaitForLiveSegments(leader, 1)) << Logs();
  std::unique_ptr<client::Client> c = NewClient();
  ASSERT_NE(c, nullptr);
  std::vector<std::string> keys;
  for (int i = 0; i < 50; ++i) {
    keys.push_back(absl::StrCat("tls-", i));
    ASSERT_OK(c->Put(keys.back(), Payload(keys.back(), kValueBytes))) << Logs();
  }
  ASSERT_OK(WaitForSynced(leader, 1)) << Logs();
  ASSERT_OK_AND_ASSIGN(json h, Ha(leader));
  EXPECT_EQ(h["standbys"].size(), 1u) << h.dump();

  masters_[leader]->Kill(SIGKILL);
  ASSERT_EQ(WaitForLeader(absl::Seconds(20), leader), standby) << Logs();
  ASSERT_OK(WaitForLiveSegments(standby, 1)) << Logs();
  ExpectAllReadable(c.get(), keys);
}

// A standby answers on the ports it takes over when elected: /v1/ha says
// what it is and whom it follows; every call on its RPC port, direct or
// over gRPC, is refused naming the leader, which a client then calls (one
// address of any master is enough). Elected, it serves on the same
// listener: a client given only its address is served after the kill.
TEST_F(HaTest, AStandbyNamesTheLeaderAndKeepsItsPortWhenElected) {
  const int leader = StartGroup();
  ASSERT_GE(leader, 0);
  const int standby = 1 - leader;
  const std::string leader_address = absl::StrCat(hosts_[leader], ":", rpc_[leader]);
  const std::string standby_address = absl::StrCat(hosts_[standby], ":", rpc_[standby]);
  absl::StatusOr<json> ha;
  ASSERT_OK(WaitFor("the standby's copy to be complete", absl::Seconds(10), [&] {
    ha = Ha(standby);
    return ha.ok() && (*ha)["copy"].value("complete", false);
  })) << (ha.ok() ? ha->dump() : ha.status().ToString());
  EXPECT_EQ((*ha)["role"], "standby");
  EXPECT_EQ((*ha)["leader"], leader_address);
  EXPECT_EQ((*ha)["self"], standby_address);
  {
    // Its other HTTP paths are the leader's: 503, which metadata clients
    // take as "try the next", naming the leader.
    httplib::Client http(hosts_[standby], http_[standby]);
    httplib::Result segments = http.Get("/v1/segments");
    ASSERT_TRUE(segments);
    EXPECT_EQ(segments->status, 503);
    EXPECT_THAT(segments->body, ::testing::HasSubstr("the leader is " + leader_address));
  }
  // Probes: /health is 200 on the master that serves only (a Service
  // gated on it reaches the leader); liveness is 200 on either role.
  for (int i : {leader, standby}) {
    httplib::Client http(hosts_[i], http_[i]);
    const std::string role = i == leader ? "leader" : "standby";
    httplib::Result health = http.Get("/health");
    ASSERT_TRUE(health) << role;
    EXPECT_EQ(health->status, i == leader ? 200 : 503) << role;
    for (const char* probe : {"/healthz", "/livez"}) {
      httplib::Result live = http.Get(probe);
      ASSERT_TRUE(live) << role << " " << probe;
      EXPECT_EQ(live->status, 200) << role << " " << probe;
      EXPECT_EQ(live->body, "ok\n") << role << " " << probe;
    }
  }

  // Its RPC port: a call refused naming the leader, over gRPC and direct.
  {
    auto stub = v1::Master::NewStub(grpc::CreateChannel(standby_address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::StatsRequest req;
    v1::StatsResponse resp;
    const grpc::Status refused = stub->Stats(&ctx, req, &resp);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
    EXPECT_THAT(refused.error_message(), ::testing::HasSubstr(kNotLeader));
    EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("the leader is " + leader_address));

    ASSERT_OK_AND_ASSIGN(net::Fd fd, net::Dial(standby_address, absl::Now() + absl::Seconds(5)));
    char h[direct::kHeaderSize];
    direct::EncodeCall({direct::DirectMethod::kPing, 0}, h);
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    ASSERT_OK(net::WriteFull(fd.get(), h, sizeof h, deadline));
    ASSERT_OK(net::ReadFull(fd.get(), h, sizeof h, deadline));
    ASSERT_OK_AND_ASSIGN(direct::ReplyHeader reply, direct::DecodeReply(h, 1 << 20));
    EXPECT_EQ(reply.code, static_cast<uint8_t>(absl::StatusCode::kUnavailable));
    std::string message(reply.message_length, '\0');
    ASSERT_OK(net::ReadFull(fd.get(), message.data(), message.size(), deadline));
    EXPECT_THAT(message, ::testing::HasSubstr("the leader is " + leader_address));
  }
  // A client given only the standby learns the leader from it, either lane.
  for (bool direct : {true, false}) {
    client::MasterClientOptions o;
    o.direct = direct;
    ASSERT_OK_AND_ASSIGN(auto mc, client::MasterClient::Create(standby_address, o));
    EXPECT_OK(mc->Exists({"any"}).status()) << (direct ? "direct" : "gRPC");
    EXPECT_EQ(mc->masters(), (std::vector<std::string>{standby_address, leader_address}));
  }
  {
    // The standby listed first: the leader serves, and at once.
    client::MasterClientOptions o;
    ASSERT_OK_AND_ASSIGN(auto mc, client::MasterClient::Create(standby_address + "," + leader_address, o));
    const absl::Time start = absl::Now();
    ASSERT_OK(mc->Exists({"any"}).status());
    EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  }

  // A client given only the standby's address: served by the leader it
  // names, and, once the leader is killed, by the standby elected on the
  // same port.
  client::ClientOptions o;
  o.master = standby_address;
  o.metadata = MetadataList();
  ASSERT_OK_AND_ASSIGN(auto c, client::Client::Create(o));
  ASSERT_OK(c->Put("before", Payload("before", kValueBytes)));
  masters_[leader]->Kill(SIGKILL);
  absl::Status put = absl::UnknownError("not tried");
  ASSERT_OK(WaitFor("a put served by the standby elected on its port", absl::Seconds(20), [&] {
    put = c->Put("after", Payload("after", kValueBytes));
    return put.ok();
  })) << put << "\n" << Logs();
  for (const char* k : {"before", "after"}) {
    ASSERT_OK_AND_ASSIGN(std::string got, c->Get(k));
    EXPECT_EQ(got, Payload(k, kValueBytes));
  }
  ASSERT_OK_AND_ASSIGN(json now, Ha(standby));
  EXPECT_EQ(now["role"], "leader");
}

}  // namespace
}  // namespace tierkv::integration
