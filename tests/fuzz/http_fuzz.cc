// The master's HTTP face as raw bytes: request line, headers, chunked
// bodies, every route (metadata, /v1 queries, /metrics). Whatever arrives,
// the answer is a well-formed HTTP response or nothing (a dropped
// connection), and never a 5xx from a handler.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "config/base/http_server.h"
#include "master/http_service.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/master_fixture.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static tierkv::ManualClock clock;
  static tierkv::master::Master* m = tierkv::fuzz::NewFuzzMaster(&clock).release();
  static tierkv::HttpServer* server = [] {
    auto* s = new tierkv::HttpServer(tierkv::HttpServer::Options{.threads = 1});
    tierkv::master::InstallHttpRoutes(s, m, {.max_body = 1 << 16, .max_key_bytes = 256});
    return s;
  }();
  std::string out = server->ServeBytes(std::string_view(reinterpret_cast<const char*>(data), size));
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
  return 0;
}
