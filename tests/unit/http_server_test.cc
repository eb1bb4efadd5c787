// HttpServer's life cycle: a server stopped right after it was started (a
// SIGTERM at start-up) stops; a started one answers until stopped.
#include "config/base/http_server.h"

#include <gtest/gtest.h>

namespace tierkv {
namespace {

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

}  // namespace
}  // namespace tierkv
