// A hostile tenant with valid credentials against real processes: a master
// and a daemon under --auth token, tenant a's clients putting and reading,
// and tenant b's credential, which has the daemon role every
// memory-lending client holds, trying to reach a's data through the
// segment-control calls; and a second client of tenant a trying to end
// its neighbour's read leases with its own token. Each attempt is refused
// or ignored, a's bytes read back identical, and every process stays up.
// On the data path b holds a data grant for the daemon's segment (as any
// client does) and aims raw tcp frames at a's extents, at their true
// offsets, with no extent grant, with its own, and with its own altered.
// The fixture is store_fixture.h.
#include "tests/integration/store_fixture.h"

#include <filesystem>
#include <fstream>
#include <set>

#include "absl/strings/str_join.h"
#include "grpcpp/grpcpp.h"
#include "proto/master.grpc.pb.h"

namespace tierkv::integration {
namespace {

constexpr char kTokens[] =
    "daemon-token-0000000000 decode-0 daemon\n"
    "tenant-a-token-00000000 app-a client tenant=a\n"
    "tenant-a-other-00000000 app-a2 client tenant=a\n"
    "tenant-b-token-00000000 app-b daemon,client tenant=b\n"
    "admin-token-00000000000 ops admin\n";

absl::Status AsStatus(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::Status StatusOf(const v1::ItemStatus& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.code()), s.message());
}

class TenantWallsTest : public StoreClusterTest {
 protected:
  void StartCluster(std::vector<std::string> master_flags = {}) {
    dir_ = testing::MakeTempDir("tierkv-walls");
    master_flags.push_back("--auth=token");
    master_flags.push_back("--token-file=" + dir_ + "/tokens");
    std::ofstream(dir_ + "/tokens") << kTokens;
    std::ofstream(dir_ + "/daemon.token") << "daemon-token-0000000000\n";
    ASSERT_OK(cluster_.Start({.daemons = 1,
                              .segment_size = "64mib",
                              .segment_ttl = "30s",
                              .persist = true,
                              .master_flags = master_flags,
                              .daemon_flags = {"--auth=token", "--token-file=" + dir_ + "/daemon.token"},
                              .token = "tenant-a-token-00000000"}));
    stub_ = v1::Master::NewStub(grpc::CreateChannel(cluster_.master_address(), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    StoreClusterTest::TearDown();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  static std::unique_ptr<grpc::ClientContext> As(const std::string& token) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    ctx->AddMetadata("authorization", "Bearer " + token);
    return ctx;
  }
  // The daemon's segment as /v1/segments shows it to anyone with a token.
  nlohmann::json Segment() {
    absl::StatusOr<std::string> body = cluster_.HttpGet("/v1/segments", 0, "tenant-b-token-00000000");
    EXPECT_TRUE(body.ok()) << body.status();
    nlohmann::json all = nlohmann::json::parse(body.ok() ? *body : "[]", nullptr, false);
    return all.is_array() && all.size() == 1 ? all[0] : nlohmann::json::object();
  }
  // The lease /v1/objects shows for tenant a's `key` (0: none).
  int64_t LeaseOf(const std::string& key) {
    absl::StatusOr<std::string> body = cluster_.HttpGet("/v1/objects/" + key, 0, "tenant-a-token-00000000");
    EXPECT_TRUE(body.ok()) << body.status();
    nlohmann::json j = nlohmann::json::parse(body.ok() ? *body : "{}", nullptr, false);
    return j.is_object() && j.contains("lease_expiry_unix_ms") && j["lease_expiry_unix_ms"].is_number()
               ? j["lease_expiry_unix_ms"].get<int64_t>()
               : 0;
  }

  std::string dir_;
  std::unique_ptr<v1::Master::Stub> stub_;
};

// Segment control by another identity (#4 of the walls): unmount, take
// over with the victim's own host string (a new incarnation or its own),
// wipe its SSD records, keep it alive. Tenant a's objects stay readable,
// byte for byte, through all of it and through a master restart.
TEST_F(TenantWallsTest, AnotherIdentityCannotUnmountTakeOverOrWipeASegment) {
  StartCluster();
  auto a = Client({"tcp"});
  ASSERT_TRUE(a);
  std::vector<std::string> keys;
  for (int i = 0; i < 20; ++i) {
    keys.push_back(absl::StrCat("page-", i));
    ASSERT_OK(a->Put(keys.back(), ValueFor(keys.back(), 100'000)));
  }
  const nlohmann::json seg = Segment();
  ASSERT_TRUE(seg.contains("name")) << seg.dump();
  EXPECT_EQ(seg["owner"], "decode-0");
  const std::string name = seg["name"], host = seg["host"], incarnation = seg["incarnation"];
  const std::string b = "tenant-b-token-00000000";

  auto attacks = [&] {
    v1::UnmountSegmentRequest unmount;
    unmount.add_names(name);
    v1::UnmountSegmentResponse uresp;
    ASSERT_OK(AsStatus(stub_->UnmountSegment(As(b).get(), unmount, &uresp)));
    EXPECT_TRUE(absl::IsPermissionDenied(StatusOf(uresp.status(0)))) << uresp.status(0).message();
    unmount.set_keep_ssd(true);
    ASSERT_OK(AsStatus(stub_->UnmountSegment(As(b).get(), unmount, &uresp)));
    EXPECT_TRUE(absl::IsPermissionDenied(StatusOf(uresp.status(0)))) << uresp.status(0).message();
    for (const std::string& inc : {std::string("taken-over"), incarnation}) {
      v1::MountSegmentRequest mount;
      v1::Segment* s = mount.add_segments();
      s->set_name(name);
      s->set_host(host);
      s->set_capacity(seg["capacity"].get<uint64_t>());
      s->set_incarnation(inc);
      s->set_endpoint("tcp://127.0.0.1:9");  // the attacker's own port
      v1::MountSegmentResponse mresp;
      ASSERT_OK(AsStatus(stub_->MountSegment(As(b).get(), mount, &mresp)));
      absl::Status st = StatusOf(mresp.status(0));
      EXPECT_TRUE(absl::IsPermissionDenied(st)) << st;
      EXPECT_NE(st.message().find("belongs to 'decode-0', not to 'app-b'"), std::string::npos) << st;
      v1::HeartbeatRequest beat;
      *beat.add_segments() = *s;
      v1::HeartbeatResponse bresp;
      ASSERT_OK(AsStatus(stub_->Heartbeat(As(b).get(), beat, &bresp)));
      EXPECT_EQ(bresp.remount_size(), 1);
    }
    v1::SsdRecordsRequest wipe;
    wipe.set_segment(name);
    wipe.set_incarnation(incarnation);
    wipe.set_complete(true);  // "my tier holds nothing": every SSD copy dropped
    v1::SsdRecordsResponse wresp;
    ASSERT_OK(AsStatus(stub_->SyncSsdRecords(As(b).get(), wipe, &wresp)));
    EXPECT_TRUE(absl::IsPermissionDenied(StatusOf(wresp.status()))) << wresp.status().message();
  };
  attacks();
  auto all_intact = [&] {
    for (const std::string& k : keys) {
      absl::StatusOr<std::string> v = a->Get(k);
      ASSERT_OK(v.status()) << k;
      EXPECT_TRUE(*v == ValueFor(k, 100'000)) << k;
    }
  };
  all_intact();
  EXPECT_EQ(Segment()["incarnation"], incarnation);
  EXPECT_EQ(Segment()["endpoint"], seg["endpoint"]);

  // The owner is persisted: killed and restarted, the master still refuses
  // b while the segment waits for its daemon, which re-mounts as its own.
  cluster_.master().Kill(SIGKILL);
  cluster_.master().Wait();
  ASSERT_OK(cluster_.StartMaster());
  stub_ = v1::Master::NewStub(grpc::CreateChannel(cluster_.master_address(), grpc::InsecureChannelCredentials()));
  attacks();
  ASSERT_OK(cluster_.WaitForLiveSegments(1));
  attacks();
  all_intact();
  EXPECT_EQ(Segment()["owner"], "decode-0");
  EXPECT_TRUE(cluster_.master().Running());
  EXPECT_TRUE(cluster_.daemon(0).Running());
}

// Lease give-backs (#6 of the walls): a second client of the same tenant
// takes its own counted read of the pages a read session holds and sends
// its token back again and again. The session's leases hold, its ranges
// read the right bytes, and they end at their expiry (a daemon that checks
// extent grants keeps a given-back lease to its end: the reader's grant
// lasts as long).
TEST_F(TenantWallsTest, AReadersTokenEndsNoOtherReadersLease) {
  StartCluster();
  auto a = Client({"tcp"});
  ASSERT_TRUE(a);
  const std::vector<std::string> keys{"p0", "p1", "p2"};
  for (const std::string& k : keys) ASSERT_OK(a->Put(k, ValueFor(k, 64 << 10)));
  std::unique_ptr<client::ReadSession> session = a->StartReadSession(keys);
  ASSERT_TRUE(session);
  for (const std::string& k : keys) ASSERT_GT(LeaseOf(k), 0) << k;

  v1::KeysRequest take;
  for (const std::string& k : keys) take.add_keys(k);
  take.set_counted(true);
  take.set_client_id("neighbour");
  v1::GetReplicasResponse mine;
  ASSERT_OK(AsStatus(stub_->GetReplicas(As("tenant-a-other-00000000").get(), take, &mine)));
  ASSERT_EQ(mine.lease_tokens_size(), static_cast<int>(keys.size()));
  v1::KeysRequest flood;
  flood.set_client_id("neighbour");
  for (int round = 0; round < 8; ++round) {
    for (size_t i = 0; i < keys.size(); ++i) {
      flood.add_released_keys(keys[i]);
      flood.add_released_tokens(mine.lease_tokens(static_cast<int>(i)));
      flood.add_released_expiry_unix_ms(mine.lease_expiry_unix_ms(static_cast<int>(i)));
    }
  }
  v1::ExistsResponse eresp;
  ASSERT_OK(AsStatus(stub_->Exists(As("tenant-a-other-00000000").get(), flood, &eresp)));
  ASSERT_OK(AsStatus(stub_->Exists(As("tenant-a-other-00000000").get(), flood, &eresp)));
  for (const std::string& k : keys) EXPECT_GT(LeaseOf(k), 0) << k << ": the session's lease was ended by another";

  std::vector<std::string> out(keys.size(), std::string(4096, '\0'));
  std::vector<client::RangeRead> reads;
  for (size_t i = 0; i < keys.size(); ++i) reads.push_back({i, 1000, absl::MakeSpan(out[i])});
  std::vector<absl::Status> got = a->ReadRanges(*session, reads);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_OK(got[i]) << keys[i];
    EXPECT_EQ(out[i], ValueFor(keys[i], 64 << 10).substr(1000, 4096)) << keys[i];
  }
  // The daemon checks extent grants, and each reader's grant lasts to its
  // lease's expiry: given back, the leases still run to it, then end.
  a->EndReadSession(*session);
  for (const std::string& k : keys) EXPECT_GT(LeaseOf(k), 0) << k;
  for (const std::string& k : keys) {
    EXPECT_OK(WaitFor("the leases of " + k + " to run out", absl::Seconds(15),
                      [&] { return LeaseOf(k) <= absl::ToUnixMillis(absl::Now()); }));
  }
  EXPECT_TRUE(cluster_.master().Running());
}

// Per-client limits (#5 of the walls) are a tenant's own: tenant b
// borrowing tenant a's client id fills only its own count; rotating ids
// meets the tenant's cap, for puts in flight and for read-session
// reservations; and a flood of client ids and key prefixes pushes only
// b's rows of the query statistics into b's "other".
TEST_F(TenantWallsTest, ClientIdsAreCountedWithinTheirTenant) {
  StartCluster({"--max-pending-per-client=4", "--max-pending-per-tenant=10", "--query-stats-key-prefix-separator=/",
                "--query-stats-max-prefixes=4", "--max-reservations-per-client=2", "--max-reservations-per-tenant=3"});
  const std::string b = "tenant-b-token-00000000";
  auto put_start = [&](const std::string& token, const std::string& client, const std::string& key) {
    v1::PutStartRequest req;
    req.set_client_id(client);
    v1::PutStartItem* it = req.add_items();
    it->set_key(key);
    it->set_size(4096);
    it->set_replicas(1);
    v1::PutStartResponse resp;
    grpc::Status s = stub_->PutStart(As(token).get(), req, &resp);
    return s.ok() ? StatusOf(resp.results(0).status()) : AsStatus(s);
  };
  // Read-session reservations: rotating ids stop at the tenant's cap, and
  // a's clients keep their own.
  auto a = Client({"tcp"});
  auto b_client = Client({"tcp"}, b);
  ASSERT_TRUE(a && b_client);
  for (const char* k : {"s0", "s1", "s2", "s3"}) {
    ASSERT_OK(b_client->Put(k, ValueFor(k, 4096)));
    ASSERT_OK(a->Put(k, ValueFor(k, 4096)));
  }
  auto reserve = [&](const std::string& token, const std::string& client, std::vector<std::string> keys) {
    v1::KeysRequest req;
    for (const std::string& k : keys) req.add_keys(k);
    req.set_counted(true);
    req.set_client_id(client);
    v1::GetReplicasResponse resp;
    EXPECT_OK(AsStatus(stub_->GetReplicas(As(token).get(), req, &resp)));
    return resp.refused_size();
  };
  EXPECT_EQ(reserve(b, "id-0", {"s0", "s1"}), 0);
  EXPECT_EQ(reserve(b, "id-1", {"s2", "s3"}), 1);  // the tenant's third, not its fourth
  EXPECT_EQ(reserve(b, "id-2", {"s0"}), 1);
  EXPECT_EQ(reserve("tenant-a-token-00000000", "id-0", {"s0", "s1"}), 0);
  absl::StatusOr<std::string> stats = cluster_.HttpGet("/v1/stats", 0, "admin-token-00000000000");
  ASSERT_OK(stats.status());
  EXPECT_EQ(nlohmann::json::parse(*stats)["reservations"]["cap_per_tenant"], 3);

  // b holds app-a's whole per-client allowance under app-a's name...
  for (int i = 0; i < 4; ++i) ASSERT_OK(put_start(b, "app-a", absl::StrCat("b-held-", i)));
  absl::Status s = put_start(b, "app-a", "b-held-4");
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  // ...and a's client of that name is untouched by it.
  for (int i = 0; i < 4; ++i) ASSERT_OK(put_start("tenant-a-token-00000000", "app-a", absl::StrCat("a-", i)));
  // Rotating ids: b's count across ids stops at its tenant's cap.
  for (int i = 0; i < 6; ++i) ASSERT_OK(put_start(b, absl::StrCat("rotating-", i), absl::StrCat("r-", i)));
  s = put_start(b, "rotating-6", "r-6");
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("tenant b has 10 puts in flight"), std::string::npos) << s;
  // An id with a NUL in it is still b's.
  EXPECT_TRUE(absl::IsResourceExhausted(put_start(b, std::string("x\0y", 3), "r-nul")));
  ASSERT_OK(a->Put("model-a/page", ValueFor("model-a/page", 4096)));

  // A flood of ids and prefixes from b, then a's first lookups.
  for (int i = 0; i < 1100; ++i) {
    v1::KeysRequest q;
    q.set_client_id(absl::StrCat("flood-", i));
    q.add_keys(absl::StrCat("prefix-", i % 50, "/page"));
    v1::PrefixMatchResponse r;
    ASSERT_OK(AsStatus(stub_->PrefixMatch(As(b).get(), q, &r))) << i;
  }
  v1::KeysRequest mine;
  mine.set_client_id("app-a-reader");
  mine.add_keys("model-a/page");
  v1::PrefixMatchResponse found;
  ASSERT_OK(AsStatus(stub_->PrefixMatch(As("tenant-a-token-00000000").get(), mine, &found)));
  EXPECT_EQ(found.matched(), 1u);
  absl::StatusOr<std::string> body = cluster_.HttpGet("/v1/stats", 0, "tenant-a-token-00000000");
  ASSERT_OK(body.status());
  nlohmann::json q = nlohmann::json::parse(*body)["queries"];
  std::set<std::string> clients, prefixes;
  for (const auto& r : q["clients"]) clients.insert(r["client"].get<std::string>());
  for (const auto& r : q["prefixes"]) prefixes.insert(r["key_prefix"].get<std::string>());
  EXPECT_TRUE(clients.count("app-a-reader")) << q["clients"].dump();
  EXPECT_TRUE(prefixes.count("model-a")) << q["prefixes"].dump();
  EXPECT_FALSE(clients.count("other")) << "tenant a's rows were pushed out by b's flood";
  // b's own overflow is b's.
  body = cluster_.HttpGet("/v1/stats", 0, b);
  ASSERT_OK(body.status());
  size_t b_rows = 0;
  bool b_other = false;
  const nlohmann::json b_view = nlohmann::json::parse(*body);
  for (const auto& r : b_view["queries"]["clients"]) {
    ++b_rows;
    b_other |= r["client"] == "other";
  }
  EXPECT_TRUE(b_other) << b_rows << " rows";
  EXPECT_LE(b_rows, 1026u);  // "all", 1024 named, "other"

  EXPECT_TRUE(cluster_.master().Running());
}

TEST_F(TenantWallsTest, AGrantForTheSegmentReachesOnlyTheExtentsTheMasterGave) {
  StartCluster();
  auto a = Client({"shm", "tcp"});
  auto b = Client({"shm", "tcp"}, "tenant-b-token-00000000");
  ASSERT_TRUE(a && b);
  std::vector<std::string> keys;
  for (int i = 0; i < 4; ++i) {
    keys.push_back(absl::StrCat("secret-", i));
    ASSERT_OK(a->Put(keys.back(), ValueFor(keys.back(), 65536)));
  }
  ASSERT_OK(b->Put("mine", std::string(65536, 'b')));
  // Where a's values sit (a's own lookup: b is given the true offsets, the
  // worst case), and b's own extent with the grants the master gave b.
  v1::KeysRequest req;
  for (const std::string& k : keys) req.add_keys(k);
  v1::GetReplicasResponse theirs, own;
  ASSERT_OK(AsStatus(stub_->GetReplicas(As("tenant-a-token-00000000").get(), req, &theirs)));
  v1::KeysRequest mine;
  mine.add_keys("mine");
  ASSERT_OK(AsStatus(stub_->GetReplicas(As("tenant-b-token-00000000").get(), mine, &own)));
  ASSERT_EQ(theirs.replica_offsets_size(), 4);
  ASSERT_EQ(own.replica_grants().size(), 48u);  // one replica's
  const std::string segment = theirs.segments(0);
  v1::PutStartRequest start;
  v1::PutStartItem* item = start.add_items();
  item->set_key("mine-2");
  item->set_size(65536 + 16);
  start.set_put_ids(true);
  v1::PutStartResponse started;
  ASSERT_OK(AsStatus(stub_->PutStart(As("tenant-b-token-00000000").get(), start, &started)));
  ASSERT_EQ(started.results(0).replicas_size(), 1);
  const std::string write_grant = started.results(0).replicas(0).grant();
  ASSERT_EQ(write_grant.size(), 48u);

  std::vector<char> buf(65536);
  transport::TransferEngine& engine = b->engine();
  for (int i = 0; i < 4; ++i) {
    const uint64_t at = theirs.replica_offsets(i);
    std::string altered = own.replica_grants();
    for (int k = 0; k < 8; ++k) altered[k] = static_cast<char>(at >> (8 * k));  // offset := a's
    for (absl::string_view grant : {absl::string_view(), absl::string_view(own.replica_grants()),
                                    absl::string_view(altered), absl::string_view(write_grant)}) {
      transport::Request read{transport::Op::kRead, buf.data(), segment, at, buf.size()};
      read.grant = grant;
      transport::Request write{transport::Op::kWrite, buf.data(), segment, at, buf.size()};
      write.grant = grant;
      std::fill(buf.begin(), buf.end(), 'X');
      for (const absl::Status& st : engine.Transfer({read, write}, absl::Seconds(5))) {
        EXPECT_TRUE(absl::IsPermissionDenied(st)) << st;
      }
      EXPECT_EQ(std::count(buf.begin(), buf.end(), 'X'), static_cast<long>(buf.size()));  // nothing read
    }
  }
  // Neither tenant maps the operator's segment: shm would reach every
  // extent of it. Both move their bytes over tcp, frame by frame.
  for (client::Client* c : {a.get(), b.get()}) {
    transport::PeerInfo info = c->engine().Describe(segment);
    EXPECT_EQ(info.transport, "tcp") << absl::StrJoin(info.fallbacks, "; ");
  }
  for (const std::string& k : keys) {
    absl::StatusOr<std::string> got = a->Get(k);
    ASSERT_OK(got.status());
    EXPECT_EQ(*got, ValueFor(k, 65536)) << k;
  }
  EXPECT_EQ(*b->Get("mine"), std::string(65536, 'b'));
  EXPECT_TRUE(cluster_.master().Running());
  EXPECT_TRUE(cluster_.daemon(0).Running());
}

}  // namespace
}  // namespace tierkv::integration
