#include "base/failpoint.h"

#include <unistd.h>

#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "base/log.h"

namespace tierkv {
namespace {

const std::map<std::string, std::string>& Table() {
  static const auto* table = [] {
    auto* t = new std::map<std::string, std::string>();
    const char* env = std::getenv("TIERKV_FAILPOINTS");
    if (env == nullptr) return t;
    for (absl::string_view item : absl::StrSplit(env, ',', absl::SkipWhitespace())) {
      std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
      (*t)[kv.first] = kv.second;
    }
    return t;
  }();
  return *table;
}

}  // namespace

bool FailpointsActive() {
  static const bool active = !Table().empty();
  return active;
}

bool FailpointHit(const char* name) {
  auto it = Table().find(name);
  if (it == Table().end()) return false;
  const std::string& action = it->second;
  if (action == "abort") {
    TKV_LOG(ERROR) << "failpoint " << name << ": aborting";
    std::abort();
  }
  if (action.rfind("sleep:", 0) == 0) {
    int ms = 0;
    if (absl::SimpleAtoi(action.substr(6), &ms)) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return false;
  }
  return action == "error";
}

}  // namespace tierkv
