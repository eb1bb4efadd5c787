#include "base/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tierkv {
namespace {

LogLevel InitialLevel() {
  const char* env = std::getenv("TIERKV_LOG_LEVEL");
  if (env == nullptr) return LogLevel::kInfo;
  if (std::strcmp(env, "debug") == 0) return LogLevel::kDebug;
  if (std::strcmp(env, "warning") == 0) return LogLevel::kWarning;
  if (std::strcmp(env, "error") == 0) return LogLevel::kError;
  return LogLevel::kInfo;
}

std::atomic<int>& Threshold() {
  static std::atomic<int> level{static_cast<int>(InitialLevel())};
  return level;
}

}  // namespace

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= Threshold().load(); }
void SetLogLevel(LogLevel level) { Threshold().store(static_cast<int>(level)); }

LogMessage::LogMessage(LogLevel level, const char* file, int line) : level_(level) {
  static constexpr const char* kNames[] = {"D", "I", "W", "E"};
  const char* base = std::strrchr(file, '/');
  stream_ << absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()) << ' '
          << kNames[static_cast<int>(level_)] << ' ' << (base ? base + 1 : file) << ':' << line
          << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  std::string s = stream_.str();
  // One write per line keeps lines from different threads whole.
  ssize_t unused = ::write(STDERR_FILENO, s.data(), s.size());
  (void)unused;
}

}  // namespace tierkv
