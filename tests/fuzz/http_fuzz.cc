// The master's HTTP face as raw bytes: request line, headers, chunked
// bodies, every route (metadata, /v1 queries, /metrics). Whatever arrives,
// the answer is a well-formed HTTP response or nothing (a dropped
// connection), and never a 5xx from a handler.
#include <cstdint>
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
  if (!out.empty()) {
    FUZZ_CHECK(out.rfind("HTTP/1.1 ", 0) == 0);
    FUZZ_CHECK(out.find("HTTP/1.1 500") == std::string::npos);
  }
  return 0;
}
