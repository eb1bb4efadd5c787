#include <fstream>
#include <map>

#include <filesystem>

#include "absl/time/clock.h"
#include "base/auth.h"
#include "config/flags.h"
#include "config/master_config.h"
#include "config/store_config.h"
#include "config/units.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"

namespace tierkv {
namespace {

using ::tierkv::testing::StatusIs;

TEST(UnitsTest, SizesInEveryUnit) {
  EXPECT_EQ(*ParseSize("512mb"), 512'000'000u);
  EXPECT_EQ(*ParseSize("180gb"), 180'000'000'000u);
  EXPECT_EQ(*ParseSize("1.5tb"), 1'500'000'000'000u);
  EXPECT_EQ(*ParseSize("4gib"), 4ull << 30);
  EXPECT_EQ(*ParseSize("4GiB"), 4ull << 30);
  EXPECT_EQ(*ParseSize("64k"), 64u << 10);
  EXPECT_EQ(*ParseSize("1048576"), 1u << 20);
  EXPECT_EQ(*ParseSize(" 2 MiB "), 2u << 20);
  EXPECT_EQ(*ParseSize("0"), 0u);
}

TEST(UnitsTest, BadSizesAreRefused) {
  for (const char* bad : {"", "mb", "-1gb", "1e9", "12xb", "1.2.3gb", "nan", "inf", "99999999tb",
                          "0x10"}) {
    EXPECT_THAT(ParseSize(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
}

TEST(UnitsTest, Durations) {
  EXPECT_EQ(*ParseDuration("500ms"), absl::Milliseconds(500));
  EXPECT_EQ(*ParseDuration("10s"), absl::Seconds(10));
  EXPECT_EQ(*ParseDuration("1.5m"), absl::Seconds(90));
  EXPECT_EQ(*ParseDuration("2h"), absl::Hours(2));
  EXPECT_EQ(*ParseDuration("250us"), absl::Microseconds(250));
  for (const char* bad : {"", "10", "5 parsecs", "-1s", "s"}) {
    EXPECT_THAT(ParseDuration(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
}

TEST(UnitsTest, FormatSize) {
  EXPECT_EQ(FormatSize(512), "512 B");
  EXPECT_EQ(FormatSize(3ull << 30), "3.0 GiB");
}

struct TestConfig {
  int64_t port = 0;
  uint64_t size = 0;
  absl::Duration ttl;
  bool verbose = false;
  std::string name;
  double ratio = 0;
};

const FlagTable<TestConfig>& Table() {
  using C = TestConfig;
  static auto* t = new FlagTable<C>(
      "test-bin", "a test binary",
      {IntFlag<C>("port", &C::port, "50051", 0, 65535, "port"),
       SizeFlag<C>("segment-size", &C::size, "1gb", 1, 1e15, "size"),
       DurationFlag<C>("ttl", &C::ttl, "10s", 0.001, 3600, "ttl"),
       BoolFlag<C>("verbose", &C::verbose, "false", "talk more"),
       StringFlag<C>("name", &C::name, "x", "name"),
       DoubleFlag<C>("ratio", &C::ratio, "0.5", 0, 1, "ratio")},
      [](const C& c) {
        return c.name == "forbidden" ? absl::InvalidArgumentError("--name: forbidden")
                                     : absl::OkStatus();
      });
  return *t;
}

absl::StatusOr<TestConfig> Parse(std::vector<const char*> args,
                                 std::map<std::string, std::string> env = {},
                                 std::vector<std::string>* positional = nullptr) {
  args.insert(args.begin(), "test-bin");
  static std::map<std::string, std::string> keep;  // outlives the lambda's c_str()
  keep = env;
  auto stable = [](const char* name) -> const char* {
    auto it = keep.find(name);
    return it == keep.end() ? nullptr : it->second.c_str();
  };
  return Table().Parse(static_cast<int>(args.size()), args.data(), positional, stable);
}

TEST(FlagsTest, DefaultsApply) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->port, 50051);
  EXPECT_EQ(c->size, 1'000'000'000u);
  EXPECT_EQ(c->ttl, absl::Seconds(10));
  EXPECT_FALSE(c->verbose);
  EXPECT_EQ(c->ratio, 0.5);
}

TEST(FlagsTest, CommandLineFormsAndPrecedence) {
  auto c = Parse({"--port=1", "--segment-size", "180gb", "--verbose", "--ttl=500ms"},
                 {{"TIERKV_PORT", "2"}, {"TIERKV_NAME", "from-env"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->port, 1);  // the command line beats the environment
  EXPECT_EQ(c->size, 180'000'000'000u);
  EXPECT_TRUE(c->verbose);
  EXPECT_EQ(c->ttl, absl::Milliseconds(500));
  EXPECT_EQ(c->name, "from-env");
  auto off = Parse({"--no-verbose"}, {{"TIERKV_VERBOSE", "true"}});
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->verbose);
}

TEST(FlagsTest, BadValuesNameTheFlag) {
  auto out_of_range = Parse({"--port=70000"});
  EXPECT_THAT(out_of_range, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(out_of_range.status().message().find("--port"), absl::string_view::npos);
  auto bad_env = Parse({}, {{"TIERKV_SEGMENT_SIZE", "lots"}});
  EXPECT_THAT(bad_env, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(bad_env.status().message().find("TIERKV_SEGMENT_SIZE"), absl::string_view::npos);
  EXPECT_THAT(Parse({"--unknown=1"}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Parse({"--port"}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Parse({"--verbose=maybe"}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Parse({"--ratio=1.5"}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Parse({"--ttl=10"}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Parse({"--name=forbidden"}), StatusIs(absl::StatusCode::kInvalidArgument));
  // Every error is one line.
  EXPECT_EQ(out_of_range.status().message().find('\n'), absl::string_view::npos);
}

TEST(FlagsTest, ConfigFileSitsBelowEnvAndCommandLine) {
  std::string path = ::testing::TempDir() + "/flags-test.conf";
  {
    std::ofstream f(path);
    f << "# as --print-config writes it\nport = 7\nname = from-file  # trailing comment\n\n"
         "segment-size = 2gb\nttl = 3s\n";
  }
  std::string arg = "--config=" + path;
  auto c = Parse({arg.c_str(), "--ttl=1s"}, {{"TIERKV_NAME", "from-env"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->port, 7);
  EXPECT_EQ(c->size, 2'000'000'000u);
  EXPECT_EQ(c->name, "from-env");
  EXPECT_EQ(c->ttl, absl::Seconds(1));
  auto via_env = Parse({}, {{"TIERKV_CONFIG", path}});
  ASSERT_TRUE(via_env.ok()) << via_env.status();
  EXPECT_EQ(via_env->port, 7);

  EXPECT_THAT(Parse({"--config=/nonexistent/x.conf"}), StatusIs(absl::StatusCode::kInvalidArgument));
  {
    std::ofstream f(path);
    f << "port = 7\nno equals sign here\n";
  }
  auto bad = Parse({arg.c_str()});
  EXPECT_THAT(bad, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(bad.status().message().find("line 2"), absl::string_view::npos) << bad.status();
  {
    std::ofstream f(path);
    f << "colour = blue\n";
  }
  EXPECT_THAT(Parse({arg.c_str()}), StatusIs(absl::StatusCode::kInvalidArgument));
  {
    std::ofstream f(path);
    f << "port = 99999\n";
  }
  auto range = Parse({arg.c_str()});
  EXPECT_NE(range.status().message().find(path), absl::string_view::npos) << range.status();
}

TEST(FlagsTest, PositionalArgs) {
  std::vector<std::string> pos;
  auto c = Parse({"get", "--port=3", "key1"}, {}, &pos);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(pos, (std::vector<std::string>{"get", "key1"}));
  EXPECT_THAT(Parse({"stray"}), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(FlagsTest, HelpAndDumpCoverEveryFlag) {
  std::string help = Table().Help();
  auto c = Parse({"--port=7"});
  std::string dump = Table().Dump(*c);
  for (const FlagSpec& s : Table().specs()) {
    EXPECT_NE(help.find("--" + s.name), std::string::npos) << s.name;
    EXPECT_NE(help.find(FlagEnvName(s.name)), std::string::npos) << s.name;
    EXPECT_NE(dump.find(s.name + " = "), std::string::npos) << s.name;
  }
  EXPECT_NE(dump.find("port = 7"), std::string::npos);
  EXPECT_EQ(FlagEnvName("segment-size"), "TIERKV_SEGMENT_SIZE");
}

TEST(FlagsTest, MasterTableDefaultsAndRules) {
  const char* argv[] = {"tierkv-master"};
  auto c = MasterFlags().Parse(1, argv, nullptr, [](const char*) -> const char* { return nullptr; });
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rpc_port, 50051);
  EXPECT_EQ(c->http_port, 8080);
  EXPECT_EQ(c->listen, "127.0.0.1");
  EXPECT_EQ(c->segment_ttl, absl::Seconds(10));
  const char* bad[] = {"tierkv-master", "--low-watermark=0.99", "--high-watermark=0.9"};
  EXPECT_THAT(MasterFlags().Parse(3, bad, nullptr, [](const char*) -> const char* { return nullptr; }),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(c->eviction_policy, "chain");
  auto env = [](const char* name) -> const char* {
    return std::string(name) == "TIERKV_EVICTION_POLICY" ? "lru" : nullptr;
  };
  EXPECT_EQ(MasterFlags().Parse(1, argv, nullptr, env)->eviction_policy, "lru");
  const char* unknown[] = {"tierkv-master", "--eviction-policy=lfu"};
  auto refused = MasterFlags().Parse(2, unknown, nullptr, [](const char*) -> const char* { return nullptr; });
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("expected one of chain, prefix, lru"));
  const char* format[] = {"tierkv-master", "--kv-events-format=json"};
  refused = MasterFlags().Parse(2, format, nullptr, [](const char*) -> const char* { return nullptr; });
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("expected one of array, map"));
}

TEST(FlagsTest, StoreTransferServerLimits) {
  const char* argv[] = {"tierkv-store"};
  auto none = [](const char*) -> const char* { return nullptr; };
  auto c = StoreFlags().Parse(1, argv, nullptr, none);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_connections, 16384);
  EXPECT_EQ(c->io_threads, 4);
  EXPECT_EQ(c->idle_timeout, absl::Minutes(10));
  EXPECT_EQ(c->frame_timeout, absl::Seconds(5));
  EXPECT_EQ(c->handshake_timeout, absl::Seconds(10));
  const char* set[] = {"tierkv-store", "--max-connections=50000", "--idle-timeout=30s", "--frame-timeout=2s"};
  auto env = [](const char* name) -> const char* {
    const std::string n(name);
    return n == "TIERKV_IO_THREADS" ? "8" : n == "TIERKV_HANDSHAKE_TIMEOUT" ? "3s" : nullptr;
  };
  c = StoreFlags().Parse(4, set, nullptr, env);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_connections, 50000);
  EXPECT_EQ(c->io_threads, 8);
  EXPECT_EQ(c->idle_timeout, absl::Seconds(30));
  EXPECT_EQ(c->frame_timeout, absl::Seconds(2));
  EXPECT_EQ(c->handshake_timeout, absl::Seconds(3));
  const char* bad[] = {"tierkv-store", "--io-threads=0"};
  EXPECT_THAT(StoreFlags().Parse(2, bad, nullptr, none), StatusIs(absl::StatusCode::kInvalidArgument));
  const char* no_deadline[] = {"tierkv-store", "--frame-timeout=0s"};
  EXPECT_THAT(StoreFlags().Parse(2, no_deadline, nullptr, none), StatusIs(absl::StatusCode::kInvalidArgument));
}

// What --print-config prints reads back as a --config file, zero durations
// (a spin turned off) included.
template <class C>
void ExpectDumpReadsBack(const FlagTable<C>& table, std::vector<const char*> argv) {
  auto none = [](const char*) -> const char* { return nullptr; };
  absl::StatusOr<C> first = table.Parse(static_cast<int>(argv.size()), argv.data(), nullptr, none);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string dump = table.Dump(*first);
  const std::string path = ::testing::TempDir() + "/dump-reads-back.conf";
  std::ofstream(path) << dump;
  const std::string arg = "--config=" + path;
  const char* again[] = {argv[0], arg.c_str()};
  absl::StatusOr<C> second = table.Parse(2, again, nullptr, none);
  ASSERT_TRUE(second.ok()) << second.status() << "\n" << dump;
  EXPECT_EQ(table.Dump(*second), dump);
}

TEST(FlagsTest, PrintedConfigurationsReadBack) {
  ExpectDumpReadsBack(MasterFlags(), {"tierkv-master", "--segment-ttl=90s", "--ssd-grace=1500ms"});
  ExpectDumpReadsBack(MasterFlags(), {"tierkv-master", "--direct-spin=0s", "--direct-spinners=3"});
  ExpectDumpReadsBack(StoreFlags(), {"tierkv-store"});
}

// --- auth: token tables, roles, binds --------------------------------------

constexpr char kTokens[] =
    "# token                          name      roles\n"
    "daemon-token-0123456789         decode-0  daemon\n"
    "\n"
    "client-token-0123456789         sglang-0  client\n"
    "admin-token-01234567890         ops       admin,client\t\n"
    "old-token-0123456789abc         old       client    expires=2020-01-01T00:00:00Z\n";

TEST(AuthTest, TokenTableFindsNamesRolesAndExpiry) {
  ASSERT_OK_AND_ASSIGN(auth::TokenTable t, auth::TokenTable::Parse(kTokens));
  EXPECT_EQ(t.size(), 4u);
  const absl::Time now = absl::Now();
  ASSERT_OK_AND_ASSIGN(auth::Identity d, t.Find("daemon-token-0123456789", now));
  EXPECT_EQ(d.name, "decode-0");
  EXPECT_EQ(d.roles, auth::kDaemon);
  ASSERT_OK_AND_ASSIGN(auth::Identity a, t.Find("admin-token-01234567890", now));
  EXPECT_EQ(a.roles, auth::kAdmin | auth::kClient);
  EXPECT_THAT(t.Find("client-token-012345678", now), StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(t.Find("", now), StatusIs(absl::StatusCode::kUnauthenticated));
  absl::StatusOr<auth::Identity> old = t.Find("old-token-0123456789abc", now);
  EXPECT_THAT(old, StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_NE(old.status().message().find("'old' expired at 2020-01-01"), std::string::npos) << old.status();
  // Before its expiry the same token is accepted.
  EXPECT_OK(t.Find("old-token-0123456789abc", absl::FromUnixSeconds(1500000000)).status());
}

TEST(AuthTest, MalformedTokenFilesNameTheLine) {
  const std::pair<const char*, const char*> bad[] = {
      {"short-token daemon-0 daemon\n", "line 1: a token must be at least 16"},
      {"# c\nlong-enough-token-000 d-0\n", "line 2: expected"},
      {"long-enough-token-000 d-0 daemon,root\n", "unknown role 'root'"},
      {"long-enough-token-000 d-0 ,\n", "no role given"},
      {"long-enough-token-000 d-0 daemon\nlong-enough-token-000 d-1 client\n", "line 2: the same token is listed twice"},
      {"long-enough-token-000 d-0 daemon expires=tomorrow\n", "is not expires=<RFC 3339 time>"},
      {"long-enough-token-000 d-0 daemon when=2027-01-01T00:00:00Z\n", "is not expires="},
      {"long-enough-token-000 d-0 daemon expires=2027-01-01T00:00:00Z extra\n", "'extra' is not expires="},
      {"long-enough-token-000 d-0 client tenant=a tenant=b\n", "or repeats one"},
      {"long-enough-token-000 d-0 client tenant=a/b\n", "only letters, digits"},
      {"long-enough-token-000 d-0 client tenant=\n", "1 to 64 characters"},
      {"long-enough-token-000 d-0 client tenant=default\n", "callers without a tenant"},
      {"long-enough-token-000 d-0 client tenant=a expires=2027-01-01T00:00:00Z x\n", "expected"},
  };
  for (const auto& [text, why] : bad) {
    absl::StatusOr<auth::TokenTable> t = auth::TokenTable::Parse(text);
    EXPECT_THAT(t, StatusIs(absl::StatusCode::kInvalidArgument)) << text;
    EXPECT_NE(t.status().message().find(why), std::string::npos) << t.status() << " for " << text;
  }
  EXPECT_EQ(auth::TokenTable::Parse("# nothing but comments\n\n")->size(), 0u);
}

TEST(AuthTest, TenantComesFromTheTokenLineInEitherOrder) {
  ASSERT_OK_AND_ASSIGN(auth::TokenTable t,
                       auth::TokenTable::Parse("tenant-a-token-0123456 vllm-a client tenant=team-a\n"
                                               "tenant-b-token-0123456 vllm-b client tenant=team.b "
                                               "expires=2999-01-01T00:00:00Z\n"
                                               "plain-token-0123456789 sglang client\n"));
  const absl::Time now = absl::FromUnixSeconds(1800000000);
  EXPECT_EQ(t.Find("tenant-a-token-0123456", now)->tenant, "team-a");
  ASSERT_OK_AND_ASSIGN(auth::Identity b, t.Find("tenant-b-token-0123456", now));
  EXPECT_EQ(b.tenant, "team.b");
  EXPECT_EQ(b.expires, absl::FromUnixSeconds(32472144000));
  EXPECT_EQ(t.Find("plain-token-0123456789", now)->tenant, "");
}

TEST(AuthTest, RolesParseAndPrint) {
  EXPECT_EQ(*auth::ParseRoles("daemon,client"), auth::kDaemon | auth::kClient);
  EXPECT_EQ(auth::RoleNames(auth::kAdmin | auth::kDaemon), "daemon,admin");
  EXPECT_THAT(auth::ParseRoles(""), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(auth::ParseRoles("Client"), StatusIs(absl::StatusCode::kInvalidArgument));
}

class AuthFileTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::MakeTempDir("tierkv-auth"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  std::string dir_;
};

TEST_F(AuthFileTest, AuthorizeChecksRolesAndReloadKeepsTheOldTableOnABadEdit) {
  const std::string path = Write("tokens", kTokens);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<auth::Authenticator> a, auth::Authenticator::Create("token", path));
  EXPECT_TRUE(a->enabled());
  ASSERT_OK_AND_ASSIGN(auth::Identity c, a->Authorize("client-token-0123456789", auth::kClient, "PutStart"));
  EXPECT_EQ(c.name, "sglang-0");
  absl::StatusOr<auth::Identity> no = a->Authorize("", auth::kClient, "PutStart");
  EXPECT_THAT(no, StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_NE(no.status().message().find("PutStart: no token"), std::string::npos) << no.status();
  absl::StatusOr<auth::Identity> denied = a->Authorize("client-token-0123456789", auth::kDaemon, "MountSegment");
  EXPECT_THAT(denied, StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_NE(denied.status().message().find("MountSegment: 'sglang-0' has role client, needs daemon,admin"),
            std::string::npos)
      << denied.status();
  // Admin passes every role check.
  EXPECT_OK(a->Authorize("admin-token-01234567890", auth::kDaemon, "MountSegment").status());

  // A bad edit is refused and the tokens in use stay.
  Write("tokens", "broken\n");
  EXPECT_THAT(a->Reload(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_OK(a->Authorize("client-token-0123456789", auth::kClient, "PutStart").status());
  Write("tokens", "# nobody\n");
  EXPECT_THAT(a->Reload(), StatusIs(absl::StatusCode::kInvalidArgument));
  // A good one replaces them.
  Write("tokens", "new-client-token-000000 vllm-1 client\n");
  ASSERT_OK(a->Reload());
  EXPECT_THAT(a->Authorize("client-token-0123456789", auth::kClient, "PutStart"),
              StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_EQ(a->Authorize("new-client-token-000000", auth::kClient, "PutStart")->name, "vllm-1");

  EXPECT_THAT(auth::Authenticator::Create("token", ""), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(auth::Authenticator::Create("token", dir_ + "/absent"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(auth::Authenticator::Create("kerberos", path), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<auth::Authenticator> off, auth::Authenticator::Create("none", ""));
  EXPECT_FALSE(off->enabled());
  EXPECT_EQ(off->Authorize("", auth::kAdmin, "RemoveAll")->roles, auth::kAnyRole);
}

TEST_F(AuthFileTest, ACallersTokenFileGivesItsFirstWord) {
  EXPECT_EQ(*auth::ReadTokenFile(""), "");
  EXPECT_EQ(*auth::ReadTokenFile(Write("t", "\n# mine\n  abcdef0123456789abcdef  trailing words\nsecond\n")),
            "abcdef0123456789abcdef");
  EXPECT_THAT(auth::ReadTokenFile(Write("empty", "# none\n")), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(auth::ReadTokenFile(dir_ + "/absent"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(AuthTest, BearerHeadersAndLoopbackBinds) {
  EXPECT_EQ(auth::BearerToken("Bearer abc"), "abc");
  EXPECT_EQ(auth::BearerToken("bearer   abc  "), "abc");
  EXPECT_EQ(auth::BearerToken("Basic abc"), "");
  EXPECT_EQ(auth::BearerToken("Bearer"), "");
  for (const char* host : {"127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"}) {
    EXPECT_TRUE(auth::IsLoopback(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "", "::", "10.1.2.3", "128.0.0.1", "node-7"}) {
    EXPECT_FALSE(auth::IsLoopback(host)) << host;
  }
  EXPECT_OK(auth::CheckBind("none", "127.0.0.1", false, "tierkv-master"));
  EXPECT_OK(auth::CheckBind("token", "0.0.0.0", false, "tierkv-master"));
  absl::Status open = auth::CheckBind("none", "0.0.0.0", false, "tierkv-master");
  EXPECT_THAT(open, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_NE(open.message().find("--insecure-allow-remote"), std::string::npos) << open;
  EXPECT_OK(auth::CheckBind("none", "0.0.0.0", true, "tierkv-master"));
}

TEST(FlagsTest, MasterAuthFlagsAreChecked) {
  auto none = [](const char*) -> const char* { return nullptr; };
  const char* token_without_file[] = {"tierkv-master", "--auth=token"};
  absl::StatusOr<MasterConfig> c = MasterFlags().Parse(2, token_without_file, nullptr, none);
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(c.status().message()), ::testing::HasSubstr("--auth token needs --token-file"));
  // Standbys of masters running --auth token need a token to replicate.
  const char* ha_without_token[] = {"tierkv-master", "--auth=token", "--token-file=/dev/null", "--etcd=127.0.0.1:2379",
                                    "--data-dir=/tmp/x", "--advertise=127.0.0.1:5", "--rpc-port=5"};
  c = MasterFlags().Parse(7, ha_without_token, nullptr, none);
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(c.status().message()), ::testing::HasSubstr("needs --ha-token-file"));
  // A standby of masters serving TLS verifies its leader with --tls-ca.
  const char* ha_tls_without_ca[] = {"tierkv-master", "--tls-cert=/c.pem", "--tls-key=/k.pem", "--etcd=127.0.0.1:2379",
                                     "--data-dir=/tmp/x", "--advertise=127.0.0.1:5", "--rpc-port=5"};
  c = MasterFlags().Parse(7, ha_tls_without_ca, nullptr, none);
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(c.status().message()), ::testing::HasSubstr("--etcd with --tls-cert needs --tls-ca"));
  const char* unknown[] = {"tierkv-master", "--auth=kerberos"};
  EXPECT_THAT(MasterFlags().Parse(2, unknown, nullptr, none), StatusIs(absl::StatusCode::kInvalidArgument));
  const char* argv[] = {"tierkv-master"};
  c = MasterFlags().Parse(1, argv, nullptr, none);
  ASSERT_OK(c.status());
  EXPECT_EQ(c->auth, "none");
  EXPECT_TRUE(c->open_health);
  EXPECT_FALSE(c->open_metrics);
}

}  // namespace
}  // namespace tierkv
