// HttpServer's life cycle: a server stopped right after it was started (a
// SIGTERM at start-up) stops; a started one answers until stopped. Over
// TLS: requests on a kept-alive connection, bodies larger than a TLS
// record, client certificates, and peers that fail the handshake.
#include "base/http_server.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/auth.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"
#include "tests/support/tls_certs.h"
#include "tests/support/wait.h"

namespace tierkv {
namespace {

// Endpoints come from peers (a daemon's tier, etcd): each is checked
// before httplib parses it, whose port parser throws past INT_MAX.
TEST(HttpEndpointTest, SoundEndpointsBecomeUrlsAndTheRestAreRefusedWithTheReason) {
  for (const auto& [in, want] : std::vector<std::pair<std::string, std::string>>{
           {"10.0.0.7:8900", "http://10.0.0.7:8900"},
           {"http://node-3.rack_2.example:1", "http://node-3.rack_2.example:1"},
           {"https://[fd00::1]:65535/", "https://[fd00::1]:65535"},
       }) {
    absl::StatusOr<std::string> url = auth::HttpEndpointUrl(in);
    ASSERT_TRUE(url.ok()) << in << ": " << url.status();
    EXPECT_EQ(*url, want);
  }
  for (const auto& [in, why] : std::vector<std::pair<std::string, std::string>>{
           {"h:99999999999", "the port must be a number from 1 to 65535"},
           {"h:0", "the port must be a number from 1 to 65535"},
           {"h:65536", "the port must be a number from 1 to 65535"},
           {"h:+80", "the port must be a number from 1 to 65535"},
           {"h", "needs host:port"},
           {":80", "the host is empty"},
           {"ftp://h:21", "the scheme must be http:// or https://"},
           {"a b:80", "the host must be a name or an address"},
           {"h/../x:80", "the host must be a name or an address"},
           {"[zz]:80", "a bracketed host must be an IPv6 address"},
           {std::string(600, 'a') + ":80", "over 512 bytes"},
       }) {
    absl::StatusOr<std::string> url = auth::HttpEndpointUrl(in);
    EXPECT_EQ(url.status().code(), absl::StatusCode::kInvalidArgument) << in;
    EXPECT_NE(url.status().message().find(why), absl::string_view::npos) << in << ": " << url.status();
    EXPECT_EQ(auth::NewHttpClient(in, {}, absl::Seconds(1)).status().code(), absl::StatusCode::kInvalidArgument) << in;
  }
}

TEST(HttpServerTest, StopRightAfterStartReturnsAndAStartedServerAnswers) {
  // Start without waiting, so Stop often meets a loop that is not running
  // yet: httplib's stop() alone would be lost and the join would hang.
  for (int i = 0; i < 50; ++i) {
    HttpServer server;
    ASSERT_GT(server.Bind("127.0.0.1", 0), 0);
    server.Start(absl::ZeroDuration());
    server.Stop();
    server.Stop();  // idempotent
  }
  HttpServer server;
  server.Get("/ping", [](const httplib::Request&, httplib::Response& res) { res.set_content("pong", "text/plain"); });
  const int port = server.Bind("127.0.0.1", 0);
  ASSERT_GT(port, 0);
  server.Start();
  httplib::Client client("127.0.0.1", port);
  auto res = client.Get("/ping");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->body, "pong");
  server.Stop();
  EXPECT_FALSE(client.Get("/ping"));
}

class HttpServerTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("tierkv-http-tls");
    absl::StatusOr<testing::TestCerts> certs = testing::MakeTestCerts(dir_);
    ASSERT_TRUE(certs.ok()) << certs.status();
    certs_ = *certs;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A server with `tls` answering /echo with the body it was sent, /big
  // with 1 MiB, and /whoami with the verified certificate's names.
  std::unique_ptr<HttpServer> Serve(auth::TlsFiles tls) {
    auto server = std::make_unique<HttpServer>(HttpServer::Options{.threads = 2, .tls = std::move(tls)});
    EXPECT_TRUE(server->tls_status().ok()) << server->tls_status();
    server->Post("/echo", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content(req.body, "application/octet-stream");
    });
    server->Get("/big", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(std::string(1 << 20, 'b'), "application/octet-stream");
    });
    server->Get("/whoami", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content(absl::StrJoin(auth::VerifiedPeerNames(req), ","), "text/plain");
    });
    port_ = server->Bind("127.0.0.1", 0);
    EXPECT_GT(port_, 0);
    server->Start();
    return server;
  }
  std::unique_ptr<httplib::Client> Dial(const auth::TlsFiles& tls, bool https = true) {
    return *auth::NewHttpClient(absl::StrCat(https ? "https" : "http", "://127.0.0.1:", port_), tls,
                                absl::Seconds(5));
  }

  std::string dir_;
  testing::TestCerts certs_;
  int port_ = 0;
};

TEST_F(HttpServerTlsTest, ServesKeptAliveRequestsAndLargeBodiesOverTls) {
  auto server = Serve({"", certs_.server_cert, certs_.server_key});
  ASSERT_TRUE(server->tls());
  auto client = Dial({certs_.ca, "", ""});
  client->set_keep_alive(true);
  // Bodies around and past a TLS record (16 KiB) and the read buffer.
  for (size_t size : {size_t{0}, size_t{1}, size_t{4095}, size_t{16384}, size_t{16385}, size_t{300000}}) {
    std::string body(size, '\0');
    for (size_t i = 0; i < size; ++i) body[i] = static_cast<char>(i * 131 + size);
    httplib::Result res = client->Post("/echo", body, "application/octet-stream");
    ASSERT_TRUE(res) << size << ": " << httplib::to_string(res.error());
    EXPECT_EQ(res->status, 200);
    EXPECT_TRUE(res->body == body) << size;
  }
  httplib::Result big = client->Get("/big");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->body.size(), size_t{1} << 20);
  EXPECT_EQ(server->open_connections(), 1u);  // all of it on one connection
  // Without a CA asked of clients, none is verified.
  httplib::Result who = client->Get("/whoami");
  ASSERT_TRUE(who);
  EXPECT_EQ(who->body, "");
  EXPECT_EQ(server->tls_handshake_failures(), 0u);

  // Plain HTTP and a client that does not trust the server: no answer, and
  // the server serves on.
  EXPECT_FALSE(Dial({}, /*https=*/false)->Get("/big"));
  EXPECT_OK(testing::WaitFor("the server to count the failed handshake", absl::Seconds(5),
                              [&] { return server->tls_handshake_failures() > 0; }));
  EXPECT_EQ(server->tls_handshake_failures(), 1u);
  // (httplib's client checks the server's certificate after the handshake,
  // so to the server this one is a connection that closes.)
  EXPECT_FALSE(Dial({certs_.other_ca, "", ""})->Get("/big"));
  httplib::Result again = Dial({certs_.ca, "", ""})->Post("/echo", "still here", "text/plain");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->body, "still here");
}

TEST_F(HttpServerTlsTest, ClientCertificatesAreVerifiedAgainstTheCa) {
  auto server = Serve({certs_.ca, certs_.server_cert, certs_.server_key});
  // A certificate the CA signs: its SAN, then its common name.
  httplib::Result who = Dial({certs_.ca, certs_.client_cert, certs_.client_key})->Get("/whoami");
  ASSERT_TRUE(who) << httplib::to_string(who.error());
  EXPECT_EQ(who->body, "decode-1.tierkv,decode-1");
  // None: served, with no names (the routes decide).
  who = Dial({certs_.ca, "", ""})->Get("/whoami");
  ASSERT_TRUE(who);
  EXPECT_EQ(who->body, "");
  // Another CA's: the handshake fails.
  EXPECT_FALSE(Dial({certs_.ca, certs_.rogue_cert, certs_.rogue_key})->Get("/whoami"));
  // The server's alert reaches the client before the server counts it.
  EXPECT_OK(testing::WaitFor("the server to count the failed handshake", absl::Seconds(5),
                              [&] { return server->tls_handshake_failures() > 0; }));
  EXPECT_EQ(server->tls_handshake_failures(), 1u);
}

// Renewed files replace the context for new connections; a renewal that
// does not load leaves the one in use.
TEST_F(HttpServerTlsTest, RenewedCertificatesAreTakenUpAndBrokenOnesIgnored) {
  const std::string cert = dir_ + "/live.pem", key = dir_ + "/live.key";
  auto copy = [](const std::string& from, const std::string& to) {
    std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing);
  };
  copy(certs_.server_cert, cert);
  copy(certs_.server_key, key);
  // Each change gets a modification time of its own, a second past the
  // last (the context compares sizes and times; two copies within one
  // tick of the file system's clock would look alike).
  std::filesystem::file_time_type stamp = std::filesystem::last_write_time(cert);
  auto restamp = [&](std::initializer_list<std::string> paths) {
    stamp += std::chrono::seconds(1);
    for (const std::string& p : paths) std::filesystem::last_write_time(p, stamp);
  };
  auto renew = [&](const std::string& from_cert, const std::string& from_key) {
    copy(from_cert, cert);
    copy(from_key, key);
    restamp({cert, key});
  };
  absl::StatusOr<std::unique_ptr<auth::ServerTlsContext>> tls =
      auth::ServerTlsContext::Create({"", cert, key}, "test", nullptr, absl::ZeroDuration());
  ASSERT_TRUE(tls.ok()) << tls.status();
  std::shared_ptr<ssl_ctx_st> first = (*tls)->Current();
  EXPECT_EQ((*tls)->Current(), first);  // unchanged files: the same context
  renew(certs_.client_cert, certs_.client_key);
  std::shared_ptr<ssl_ctx_st> renewed = (*tls)->Current();
  EXPECT_NE(renewed, first);
  std::ofstream(cert) << "not a certificate\n";
  restamp({cert});
  EXPECT_EQ((*tls)->Current(), renewed);
  // With an hour between checks, a renewal waits for the hour, or for
  // RecheckAll (SIGHUP).
  renew(certs_.server_cert, certs_.server_key);
  absl::StatusOr<std::unique_ptr<auth::ServerTlsContext>> hourly =
      auth::ServerTlsContext::Create({"", cert, key}, "test", nullptr, absl::Hours(1));
  ASSERT_TRUE(hourly.ok()) << hourly.status();
  std::shared_ptr<ssl_ctx_st> before = (*hourly)->Current();
  renew(certs_.client_cert, certs_.client_key);
  EXPECT_EQ((*hourly)->Current(), before);
  auth::ServerTlsContext::RecheckAll();
  EXPECT_NE((*hourly)->Current(), before);
}

TEST_F(HttpServerTlsTest, FilesThatDoNotLoadAreReportedAndNothingIsServedInTheClear) {
  HttpServer server(HttpServer::Options{.tls = {"", certs_.server_cert, certs_.client_key}});
  EXPECT_FALSE(server.tls_status().ok());
  EXPECT_NE(server.tls_status().message().find("is not the key of"), std::string::npos) << server.tls_status();
  server.Get("/x", [](const httplib::Request&, httplib::Response& res) { res.set_content("x", "text/plain"); });
  port_ = server.Bind("127.0.0.1", 0);
  ASSERT_GT(port_, 0);
  server.Start();
  EXPECT_FALSE(Dial({}, /*https=*/false)->Get("/x"));
}

}  // namespace
}  // namespace tierkv
