// The master's HTTP face as raw bytes: request line, headers, chunked
// bodies, every route (metadata, /v1 queries, /metrics). Whatever arrives,
// the answer is a well-formed HTTP response or nothing (a dropped
// connection), and never a 5xx from a handler. Every input goes to two
// servers: one without auth, and one running --auth token with a client
// in a tenant and an admin (the seeds carry their tokens), so the checks
// of credentials and the tenant-scoped routes see hostile bytes too.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <unistd.h>

#include "base/auth.h"
#include "base/http_server.h"
#include "master/http_service.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/master_fixture.h"

namespace {

// The responses `server` writes for `input`, checked as below.
void ServeAndCheck(tierkv::HttpServer* server, std::string_view input) {
  std::string out = server->ServeBytes(input);
  // Walk the responses by their Content-Length: a body is the client's
  // bytes (a stored metadata value may itself read "HTTP/1.1 500"), so
  // only status lines are judged.
  // A HEAD response announces a length it does not send; where the walk
  // lands off a status line it stops (only the first must start there).
  for (size_t pos = 0; pos < out.size();) {
    if (out.compare(pos, 9, "HTTP/1.1 ") != 0) {
      FUZZ_CHECK(pos > 0);
      break;
    }
    FUZZ_CHECK(out.compare(pos + 9, 3, "500") != 0);
    size_t end = out.find("\r\n\r\n", pos);
    FUZZ_CHECK(end != std::string::npos);
    std::string_view head(out.data() + pos, end - pos);
    size_t cl = head.find("\r\nContent-Length: ");
    if (cl == std::string_view::npos) break;  // nothing to delimit the body by
    size_t length = std::strtoull(head.data() + cl + 18, nullptr, 10);
    pos = end + 4 + length;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static tierkv::ManualClock clock;
  static tierkv::master::Master* m = tierkv::fuzz::NewFuzzMaster(&clock).release();
  static tierkv::HttpServer* plain = [] {
    auto* s = new tierkv::HttpServer(tierkv::HttpServer::Options{.threads = 1});
    tierkv::master::InstallHttpRoutes(s, m, {.max_body = 1 << 16, .max_key_bytes = 256});
    return s;
  }();
  static tierkv::HttpServer* authed = [] {
    char path[] = "/tmp/tierkv-http-fuzz-tokens.XXXXXX";
    const int fd = ::mkstemp(path);
    if (fd < 0) std::abort();
    const std::string tokens =
        "fuzz-client-token-0000 fz-client client tenant=fz\n"
        "fuzz-admin-token-00000 fz-admin admin\n"
        "fuzz-daemon-token-0000 fz-daemon daemon\n";
    if (::write(fd, tokens.data(), tokens.size()) != static_cast<ssize_t>(tokens.size())) std::abort();
    ::close(fd);
    auto a = tierkv::auth::Authenticator::Create("token", path);
    ::unlink(path);
    if (!a.ok()) std::abort();
    auto* s = new tierkv::HttpServer(tierkv::HttpServer::Options{.threads = 1});
    tierkv::master::InstallHttpRoutes(s, m, {.max_body = 1 << 16, .max_key_bytes = 256, .auth = a->release()});
    return s;
  }();
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  ServeAndCheck(plain, input);
  ServeAndCheck(authed, input);
  return 0;
}
