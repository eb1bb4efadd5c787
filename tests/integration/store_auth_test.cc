// Store daemons and clients under authentication: data grants on the
// daemons' and a lender's ports (--auth token), tenants and their quotas,
// and the master's ports over mutual TLS. The fixture is store_fixture.h.
#include "tests/integration/store_fixture.h"

#include <filesystem>
#include <fstream>
#include <set>

#include "absl/strings/match.h"
#include "base/auth.h"
#include "tests/support/tls_certs.h"
#include "transport/tcp/connection.h"

namespace tierkv::integration {
namespace {

// A client lending its own memory in a cluster with tokens: its port, like
// a daemon's, moves bytes only for a connection the master granted.
TEST_F(StoreClusterTest, ALentSegmentAdmitsOnlyConnectionsWithAGrant) {
  const std::string dir = testing::MakeTempDir("tierkv-lend-auth");
  std::ofstream(dir + "/tokens") << "daemon-token-0000000000 decode daemon\n"
                                    "lender-token-0000000000 lender daemon,client\n"
                                    "client-token-0000000000 worker client\n";
  std::ofstream(dir + "/daemon.token") << "daemon-token-0000000000\n";
  ASSERT_OK(cluster_.Start({.daemons = 1,
                            .segment_size = "32mib",
                            .master_flags = {"--auth=token", "--token-file=" + dir + "/tokens"},
                            .daemon_flags = {"--auth=token", "--token-file=" + dir + "/daemon.token"},
                            .token = "client-token-0000000000"}));
  client::ClientOptions lo;
  lo.master = cluster_.master_address();
  lo.metadata = cluster_.metadata_url();
  lo.transports = {"tcp"};
  lo.token = "lender-token-0000000000";
  lo.lend_size = 16 << 20;
  lo.lend_name = "lent-0";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> lender, client::Client::Create(lo));
  ASSERT_OK(cluster_.WaitForLiveSegments(2));
  auto reader = Client({"tcp"});
  ASSERT_NE(reader, nullptr);
  client::PutOptions there;
  there.preferred_segment = "lent-0";
  for (int i = 0; i < 10; ++i) {
    const std::string key = absl::StrCat("page-", i);
    ASSERT_OK(reader->Put(key, ValueFor(key, 4096 + i), there));
    absl::StatusOr<std::string> v = reader->Get(key);
    ASSERT_OK(v.status()) << key;
    EXPECT_TRUE(*v == ValueFor(key, 4096 + i)) << key;
  }
  absl::StatusOr<std::string> placed = cluster_.HttpGet("/v1/objects/page-0");
  ASSERT_OK(placed.status());
  EXPECT_THAT(*placed, ::testing::HasSubstr("\"segment\":\"lent-0\"")) << "the value went elsewhere";
  absl::StatusOr<std::string> body = cluster_.HttpGet("/metadata?key=" + transport::DescriptorKey("lent-0"));
  ASSERT_OK(body.status());
  transport::SegmentDescriptor d = *transport::SegmentDescriptor::FromJson(*body);
  EXPECT_TRUE(d.auth);
  ExpectRawReadRefused(d);
  std::filesystem::remove_all(dir);
}

// Daemons running --auth token: a client with a master token gets data
// grants and moves bytes (tcp, shm), through a daemon's restart; a raw
// frame without a grant, and a real grant for one daemon's segment shown
// to another, are refused by the daemons themselves.
TEST_F(StoreClusterTest, DaemonsWithAuthTokenServeOnlyConnectionsWithAGrant) {
  const std::string dir = testing::MakeTempDir("tierkv-data-auth");
  std::ofstream(dir + "/tokens") << "daemon-token-0000000000 decode daemon\nclient-token-0000000000 worker client\n";
  std::ofstream(dir + "/daemon.token") << "daemon-token-0000000000\n";
  ASSERT_OK(cluster_.Start({.daemons = 2,
                            .segment_size = "64mib",
                            .master_flags = {"--auth=token", "--token-file=" + dir + "/tokens"},
                            .daemon_flags = {"--auth=token", "--token-file=" + dir + "/daemon.token"},
                            .token = "client-token-0000000000"}));
  auto tcp = Client({"tcp"});
  auto any = Client();
  ASSERT_NE(tcp, nullptr);
  ASSERT_NE(any, nullptr);
  client::PutOptions two;
  two.replicas = 2;
  for (int i = 0; i < 20; ++i) {
    const std::string key = absl::StrCat("granted-", i);
    ASSERT_OK(tcp->Put(key, ValueFor(key, 8192 + i), two));
  }
  for (int i = 0; i < 20; ++i) {
    const std::string key = absl::StrCat("granted-", i);
    absl::StatusOr<std::string> v = any->Get(key);
    ASSERT_OK(v.status()) << key;
    EXPECT_TRUE(*v == ValueFor(key, 8192 + i)) << key;
  }

  // The descriptors say so; a raw READ without a grant is refused and closed.
  auto desc_of = [&](const std::string& seg) {
    absl::StatusOr<std::string> d = cluster_.HttpGet("/metadata?key=" + transport::DescriptorKey(seg));
    EXPECT_TRUE(d.ok()) << d.status();
    return *transport::SegmentDescriptor::FromJson(d.ok() ? *d : "{}");
  };
  transport::SegmentDescriptor d0 = desc_of("daemon-0"), d1 = desc_of("daemon-1");
  EXPECT_TRUE(d0.auth);
  ExpectRawReadRefused(d0);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  // The master's grant for daemon-0, shown to daemon-1 for its segment.
  ASSERT_OK_AND_ASSIGN(v1::DataGrant g0, tcp->master().GrantData("daemon-0"));
  ASSERT_EQ(g0.grant().size(), auth::kGrantBytes);
  {
    ASSERT_OK_AND_ASSIGN(net::Fd fd, net::Dial(d1.transports["tcp"], deadline));
    transport::tcp::Connection c(std::move(fd), d1.transports["tcp"]);
    absl::Status st = c.Authenticate(d1.segment_index, d1.segment_id, {g0.grant(), g0.session_key()}, deadline);
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kUnauthenticated));
    EXPECT_NE(st.message().find("does not match this segment's key"), std::string::npos) << st;
  }
  {
    // The same grant on its own segment is admitted.
    ASSERT_OK_AND_ASSIGN(net::Fd fd, net::Dial(d0.transports["tcp"], deadline));
    transport::tcp::Connection c(std::move(fd), d0.transports["tcp"]);
    EXPECT_OK(c.Authenticate(d0.segment_index, d0.segment_id, {g0.grant(), g0.session_key()}, deadline));
  }
  // No master token, no grant.
  client::MasterClientOptions anonymous;
  anonymous.rpc_timeout = absl::Seconds(3);
  ASSERT_OK_AND_ASSIGN(auto nobody, client::MasterClient::Create(cluster_.master_address(), anonymous));
  EXPECT_THAT(nobody->GrantData("daemon-0").status(), StatusIs(absl::StatusCode::kUnauthenticated));

  // daemon-0 restarts with a new key: the long-lived clients renew their grants.
  cluster_.daemon(0).Kill(SIGKILL);
  cluster_.daemon(0).Wait();
  ASSERT_OK(cluster_.StartDaemon(0));
  ASSERT_OK(cluster_.WaitForLiveSegments(2));
  client::PutOptions there;
  there.preferred_segment = "daemon-0";
  absl::Status put;
  ASSERT_OK(WaitFor("a put on the restarted daemon-0 (its grant renewed)", absl::Seconds(5), [&] {
    put = tcp->Put("after-restart", ValueFor("after-restart", 4096), there);
    return put.ok();
  })) << put;
  absl::StatusOr<std::string> back = any->Get("after-restart");
  ASSERT_OK(back.status());
  EXPECT_TRUE(*back == ValueFor("after-restart", 4096));
  EXPECT_TRUE(cluster_.daemon(1).Running());
  std::filesystem::remove_all(dir);
}

// Tenants with real processes: two tenants' equal keys are two objects,
// neither sees or removes the other's, an admin sets quotas with
// tierkvctl, a put over quota first evicts the tenant's own oldest pages
// and is then refused naming the tenant and the quota, and the quota
// outlives a master restart.
TEST_F(StoreClusterTest, TenantsAreIsolatedAndQuotasRefuseVisibly) {
  const std::string dir = testing::MakeTempDir("tierkv-tenants");
  std::ofstream(dir + "/tokens") << "daemon-token-0000000000 decode daemon\n"
                                    "tenant-a-token-00000000 vllm-a client tenant=team-a\n"
                                    "tenant-b-token-00000000 vllm-b client tenant=team-b\n"
                                    "plain-token-00000000000 sglang client\n"
                                    "admin-token-00000000000 ops admin\n";
  std::ofstream(dir + "/daemon.token") << "daemon-token-0000000000\n";
  std::ofstream(dir + "/admin.token") << "admin-token-00000000000\n";
  std::ofstream(dir + "/a.token") << "tenant-a-token-00000000\n";
  ASSERT_OK(cluster_.Start({.daemons = 1,
                            .segment_size = "64mib",
                            .segment_ttl = "5s",
                            .persist = true,
                            .master_flags = {"--auth=token", "--token-file=" + dir + "/tokens",
                                             "--query-stats-key-prefix-separator=/"},
                            .daemon_flags = {"--token-file=" + dir + "/daemon.token"},
                            .token = "plain-token-00000000000"}));
  auto a = Client({}, "tenant-a-token-00000000");
  auto b = Client({}, "tenant-b-token-00000000");
  auto plain = Client();
  ASSERT_TRUE(a && b && plain);

  // The same key, three objects.
  ASSERT_OK(a->Put("shared", "from a"));
  ASSERT_OK(b->Put("shared", "from b"));
  EXPECT_EQ(*a->Get("shared"), "from a");
  EXPECT_EQ(*b->Get("shared"), "from b");
  EXPECT_THAT(plain->Get("shared"), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(a->Put("a-only", "x"));
  EXPECT_EQ(*b->PrefixMatch({"a-only"}), 0u);
  EXPECT_EQ(*a->PrefixMatch({"a-only"}), 1u);
  EXPECT_THAT(b->Remove("a-only", /*force=*/true), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(b->Remove("shared", /*force=*/true));
  EXPECT_EQ(*a->Get("shared"), "from a");
  // /v1/objects looks in the caller's own tenant too.
  EXPECT_TRUE(cluster_.HttpGet("/v1/objects/a-only", 0, "tenant-a-token-00000000").ok());
  EXPECT_FALSE(cluster_.HttpGet("/v1/objects/a-only", 0, "tenant-b-token-00000000").ok());
  // So do the query statistics: a tenant sees its own clients and key
  // prefixes, by the names it uses; a caller outside any tenant sees
  // every tenant's, each with its tenant.
  EXPECT_EQ(*a->PrefixMatch({"model-a/p0"}), 0u);
  EXPECT_EQ(*b->PrefixMatch({"model-b/p0"}), 0u);
  auto query_rows = [&](const std::string& token, const char* rows) {
    absl::StatusOr<std::string> body = cluster_.HttpGet("/v1/stats", 0, token);
    EXPECT_TRUE(body.ok()) << body.status();
    nlohmann::json j = nlohmann::json::parse(body.ok() ? *body : "{}", nullptr, false);
    return j.is_object() && j.contains("queries") ? j["queries"][rows] : nlohmann::json::array();
  };
  auto prefixes = [&](const std::string& token) {
    std::set<std::string> out;
    for (const auto& r : query_rows(token, "prefixes")) {
      out.insert(r.value("tenant", "") + ":" + r["key_prefix"].get<std::string>());
    }
    return out;
  };
  EXPECT_EQ(prefixes("tenant-a-token-00000000"), std::set<std::string>{":model-a"});
  EXPECT_EQ(prefixes("tenant-b-token-00000000"), std::set<std::string>{":model-b"});
  const std::set<std::string> every = prefixes("plain-token-00000000000");
  EXPECT_TRUE(every.count("team-a:model-a") == 1 && every.count("team-b:model-b") == 1) << ::testing::PrintToString(every);
  for (const auto& r : query_rows("tenant-a-token-00000000", "clients")) EXPECT_FALSE(r.contains("tenant")) << r;
  size_t tenant_clients = 0;
  for (const auto& r : query_rows("plain-token-00000000000", "clients")) tenant_clients += r.contains("tenant");
  EXPECT_GE(tenant_clients, 2u);
  absl::StatusOr<std::string> labelled = cluster_.HttpGet("/metrics", 0, "admin-token-00000000000");
  ASSERT_OK(labelled.status());
  EXPECT_THAT(*labelled, ::testing::HasSubstr("prefix=\"model-a\",tenant=\"team-a\""));
  EXPECT_EQ(labelled->find('\0'), std::string::npos);

  std::vector<std::string> base{"--master=" + cluster_.master_address(),
                                absl::StrCat("--http=127.0.0.1:", cluster_.http_port())};
  auto ctl = [&](const std::string& token_file, std::vector<std::string> args) {
    std::string cmd = testing::BinaryPath("tierkvctl") + " '--token-file=" + token_file + "'";
    for (const std::string& x : base) cmd += " '" + x + "'";
    for (const std::string& x : args) cmd += " '" + x + "'";
    cmd += " > " + dir + "/out 2>&1";
    int rc = std::system(cmd.c_str());
    std::ifstream in(dir + "/out");
    return std::make_pair(WEXITSTATUS(rc), std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
  };
  // Only an admin sets limits.
  auto denied = ctl(dir + "/a.token", {"tenants", "set", "team-a", "1GiB"});
  EXPECT_EQ(denied.first, 1);
  EXPECT_NE(denied.second.find("HTTP 403"), std::string::npos) << denied.second;
  auto set = ctl(dir + "/admin.token", {"tenants", "set", "team-a", "256KiB", "64KiB"});
  ASSERT_EQ(set.first, 0) << set.second;
  EXPECT_NE(set.second.find("tenant team-a: quota 256.0 KiB"), std::string::npos) << set.second;
  EXPECT_EQ(ctl(dir + "/admin.token", {"tenants", "set", "team-a", "1KiB", "2KiB"}).first, 1);  // guarantee > quota

  // 64 KiB pages (and their 8-byte trailers): three fit the quota; each
  // later one evicts team-a's oldest page.
  ASSERT_OK(a->Remove("shared", /*force=*/true));
  ASSERT_OK(a->Remove("a-only", /*force=*/true));
  // Each page its own access tick (1/64 s of the master's clock, which its
  // lookups carry), so they are evicted oldest first.
  auto master_ms = [&] {
    absl::StatusOr<v1::GetReplicasResponse> r = a->master().GetReplicas({"clock"});
    return r.ok() ? r->now_unix_ms() : int64_t{0};
  };
  std::vector<std::string> pages;
  for (int i = 0; i < 6; ++i) {
    pages.push_back(absl::StrCat("page-", i));
    ASSERT_OK(a->Put(pages.back(), ValueFor(pages.back(), 64 << 10))) << i;
    const int64_t put_ms = master_ms();
    ASSERT_GT(put_ms, 0);
    ASSERT_OK(WaitFor("the master's clock to pass the page's access tick", absl::Seconds(5),
                      [&] { return master_ms() >= put_ms + 16; }));
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(*a->PrefixMatch({pages[i]}), 0u) << i;  // evicted for team-a's own puts
  for (int i = 3; i < 6; ++i) EXPECT_EQ(*a->PrefixMatch({pages[i]}), 1u) << i;
  absl::StatusOr<std::string> newest = a->Get("page-5");
  ASSERT_OK(newest.status());
  EXPECT_TRUE(*newest == ValueFor("page-5", 64 << 10));
  // Larger than the whole quota: refused, saying whose quota.
  absl::Status over = a->Put("too-big", ValueFor("too-big", 300 << 10));
  EXPECT_THAT(over, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(over.message().find("tenant team-a is over its quota of 262144 bytes"), std::string::npos) << over;
  // Another tenant is not held to it.
  ASSERT_OK(b->Put("too-big", ValueFor("too-big", 300 << 10)));

  // The figures: the admin sees every tenant, a tenant only itself.
  auto listed = ctl(dir + "/admin.token", {"--json", "tenants"});
  ASSERT_EQ(listed.first, 0) << listed.second;
  nlohmann::json t = nlohmann::json::parse(listed.second);
  ASSERT_EQ(t.size(), 2u) << t.dump();
  EXPECT_EQ(t[0]["tenant"], "team-a");
  EXPECT_EQ(t[0]["quota_bytes"], 256 << 10);
  EXPECT_EQ(t[0]["used_bytes"], 3 * client::StoredSize(64 << 10));
  EXPECT_EQ(t[0]["puts_rejected"], 1);
  EXPECT_EQ(t[0]["quota_evicted_bytes"], 3 * client::StoredSize(64 << 10));
  EXPECT_EQ(t[1]["tenant"], "team-b");
  auto own = ctl(dir + "/a.token", {"--json", "tenants"});
  ASSERT_EQ(own.first, 0) << own.second;
  EXPECT_EQ(nlohmann::json::parse(own.second).size(), 1u);
  EXPECT_NE(ctl(dir + "/admin.token", {"tenants"}).second.find("team-a"), std::string::npos);
  absl::StatusOr<std::string> metrics = cluster_.HttpGet("/metrics");
  ASSERT_OK(metrics.status());
  EXPECT_NE(metrics->find("tierkv_tenant_puts_rejected_total{tenant=\"team-a\"} 1"), std::string::npos);
  EXPECT_NE(metrics->find("tierkv_tenant_quota_bytes{tenant=\"team-a\"} 262144"), std::string::npos);

  // The quota outlives a master restart; team-a's pages read back.
  cluster_.master().Kill(SIGKILL);
  cluster_.master().Wait();
  ASSERT_OK(cluster_.StartMaster());
  ASSERT_OK(cluster_.WaitForLiveSegments(1));
  absl::StatusOr<std::string> after = cluster_.HttpGet("/v1/tenants/team-a", 0, "admin-token-00000000000");
  ASSERT_OK(after.status());
  nlohmann::json ta = nlohmann::json::parse(*after);
  EXPECT_EQ(ta["quota_bytes"], 256 << 10);
  EXPECT_EQ(ta["guaranteed_bytes"], 64 << 10);
  EXPECT_EQ(ta["used_bytes"], 3 * client::StoredSize(64 << 10));
  absl::StatusOr<std::string> kept = a->Get("page-5");
  ASSERT_OK(kept.status());
  EXPECT_TRUE(*kept == ValueFor("page-5", 64 << 10));
  EXPECT_THAT(a->Put("too-big", ValueFor("too-big", 300 << 10)), StatusIs(absl::StatusCode::kResourceExhausted));
  ASSERT_OK(ctl(dir + "/admin.token", {"tenants", "clear", "team-a"}).first == 0 ? absl::OkStatus()
                                                                                 : absl::InternalError("clear"));
  EXPECT_OK(a->Put("too-big", ValueFor("too-big", 300 << 10)));
  std::filesystem::remove_all(dir);
}

// The master's gRPC port over mutual TLS, with certificates made by the
// openssl command: a daemon and a client holding certificates the
// master's CA signs mount, put and get (tokens on top); a caller without
// TLS, without a certificate, with one another CA signed, or trusting
// another CA is refused, and the master stays up. A key that does not
// match its certificate stops the master at start, saying so.
TEST_F(StoreClusterTest, MutualTlsAdmitsOnlyCertificatesTheMastersCaSigns) {
  const std::string dir = testing::MakeTempDir("tierkv-tls");
  absl::StatusOr<testing::TestCerts> certs = testing::MakeTestCerts(dir);
  ASSERT_OK(certs.status());
  std::ofstream(dir + "/tokens") << "daemon-token-0000000000 decode daemon\nclient-token-0000000000 worker client\n";
  std::ofstream(dir + "/daemon.token") << "daemon-token-0000000000\n";
  const auth::TlsFiles client_tls{certs->ca, certs->client_cert, certs->client_key};
  ASSERT_OK(cluster_.Start({.daemons = 1,
                            .segment_size = "64mib",
                            .master_flags = {"--auth=token", "--token-file=" + dir + "/tokens",
                                             "--tls-cert=" + certs->server_cert, "--tls-key=" + certs->server_key,
                                             "--tls-ca=" + certs->ca},
                            .daemon_flags = {"--token-file=" + dir + "/daemon.token", "--tls-ca=" + certs->ca,
                                             "--tls-cert=" + certs->client_cert, "--tls-key=" + certs->client_key},
                            .token = "client-token-0000000000",
                            .tls = client_tls}));
  auto client = Client({"tcp"});
  ASSERT_NE(client, nullptr);
  for (int i = 0; i < 20; ++i) {
    const std::string key = absl::StrCat("tls-", i);
    ASSERT_OK(client->Put(key, ValueFor(key, 4096 + i)));
  }
  for (int i = 0; i < 20; ++i) {
    const std::string key = absl::StrCat("tls-", i);
    absl::StatusOr<std::string> v = client->Get(key);
    ASSERT_OK(v.status()) << key;
    EXPECT_TRUE(*v == ValueFor(key, 4096 + i)) << key;
  }

  // Each wrong caller: refused (no answer over a TLS handshake that fails).
  auto stats_with = [&](auth::TlsFiles tls) {
    client::MasterClientOptions o;
    o.rpc_timeout = absl::Seconds(2);
    o.token = "client-token-0000000000";
    o.tls = std::move(tls);
    absl::StatusOr<std::unique_ptr<client::MasterClient>> m = client::MasterClient::Create(cluster_.master_address(), o);
    if (!m.ok()) return m.status();
    return (*m)->Stats().status();
  };
  EXPECT_OK(stats_with(client_tls));
  auto refused = [](const absl::Status& s) {
    return absl::IsDeadlineExceeded(s) && absl::StrContains(s.message(), "no connection before the deadline");
  };
  EXPECT_PRED1(refused, stats_with({}));                                                     // plain
  EXPECT_PRED1(refused, stats_with({certs->ca, "", ""}));                                    // no certificate
  EXPECT_PRED1(refused, stats_with({certs->ca, certs->rogue_cert, certs->rogue_key}));       // another CA's
  EXPECT_PRED1(refused, stats_with({certs->other_ca, certs->client_cert, certs->client_key}));  // master not trusted
  EXPECT_THAT(stats_with({certs->ca, certs->client_cert, certs->server_key}),                 // a key not its own
              StatusIs(absl::StatusCode::kInvalidArgument));
  // Plain bytes on the port (a direct-lane ping) get no answer a client could use.
  {
    const absl::Time deadline = absl::Now() + absl::Seconds(3);
    ASSERT_OK_AND_ASSIGN(net::Fd fd,
                         net::Dial(absl::StrCat("127.0.0.1:", cluster_.rpc_port()), deadline));
    const std::string junk(64, '\x01');
    (void)net::WriteFull(fd.get(), junk.data(), junk.size(), deadline);
    char reply[64];
    absl::Status read = net::ReadFull(fd.get(), reply, sizeof reply, deadline);
    EXPECT_FALSE(read.ok());
  }
  EXPECT_TRUE(cluster_.master().Running());
  EXPECT_OK(client->Put("still-served", "yes"));

  // A key that is not the certificate's: the master does not start.
  absl::StatusOr<std::unique_ptr<testing::ChildProcess>> bad = testing::ChildProcess::Start(
      testing::BinaryPath("tierkv-master"),
      {"--rpc-port=0", "--http-port=0", "--tls-cert=" + certs->server_cert, "--tls-key=" + certs->client_key},
      {}, absl::Seconds(10));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("is not the key of"), std::string::npos) << bad.status();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tierkv::integration
