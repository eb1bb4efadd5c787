// Sizes, durations, config files, command lines and HTTP endpoints:
// everything an operator types. Each parser must answer a value or an
// error, never crash, and a value it accepts must survive printing and
// parsing again.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "base/auth.h"
#include "config/flags.h"
#include "config/master_config.h"
#include "config/units.h"
#include "httplib.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  if (absl::StatusOr<uint64_t> v = tierkv::ParseSize(text); v.ok()) {
    absl::StatusOr<uint64_t> again = tierkv::ParseSize(std::to_string(*v));
    FUZZ_CHECK(again.ok() && *again == *v);
  }
  if (absl::StatusOr<absl::Duration> d = tierkv::ParseDuration(text); d.ok()) {
    FUZZ_CHECK(*d >= absl::ZeroDuration());
  }
  (void)tierkv::ParseConfigText(text);
  // An HTTP endpoint (what --metadata, a daemon's tier and etcd give): one
  // accepted is a URL accepted again as itself, and a client is made of
  // it without throwing.
  if (absl::StatusOr<std::string> url = tierkv::auth::HttpEndpointUrl(text); url.ok()) {
    absl::StatusOr<std::string> again = tierkv::auth::HttpEndpointUrl(*url);
    FUZZ_CHECK(again.ok() && *again == *url);
    FUZZ_CHECK(tierkv::auth::NewHttpClient(*url, {}, absl::Seconds(1)).ok());
  }
  // The same bytes as a command line: NUL or newline separates arguments.
  std::vector<std::string> args = absl::StrSplit(text, absl::ByAnyChar(std::string("\n\0", 2)));
  std::vector<const char*> argv = {"tierkv-master"};
  for (const std::string& a : args) {
    if (a.rfind("--config", 0) == 0) return 0;  // no reading files named by the fuzzer
    argv.push_back(a.c_str());
  }
  std::vector<std::string> positional;
  auto no_env = [](const char*) -> const char* { return nullptr; };
  (void)tierkv::MasterFlags().Parse(static_cast<int>(argv.size()), argv.data(), &positional, no_env);
  return 0;
}
