// Minimal leveled logging to stderr, one line per message.
//
//   TKV_LOG(WARNING) << "segment " << name << " missed heartbeats";
//
// Lines carry a UTC timestamp, the level and the source location. The level
// threshold comes from TIERKV_LOG_LEVEL (debug, info, warning, error);
// default info. Thread-safe: each line is written with one write(2).
#pragma once

#include <sstream>
#include <string_view>

namespace tierkv {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

bool LogEnabled(LogLevel level);
void SetLogLevel(LogLevel level);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

// Turns the stream expression into void so both ternary arms match; `&`
// binds looser than `<<`, so the whole message is built first.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace tierkv

#define TKV_LOG_LEVEL_DEBUG ::tierkv::LogLevel::kDebug
#define TKV_LOG_LEVEL_INFO ::tierkv::LogLevel::kInfo
#define TKV_LOG_LEVEL_WARNING ::tierkv::LogLevel::kWarning
#define TKV_LOG_LEVEL_ERROR ::tierkv::LogLevel::kError

// The ternary (not an if) keeps `if (x) TKV_LOG(INFO) << ...; else ...` sound.
#define TKV_LOG(level)                                                     \
  !::tierkv::LogEnabled(TKV_LOG_LEVEL_##level)                             \
      ? (void)0                                                            \
      : ::tierkv::LogVoidify() &                                           \
            ::tierkv::LogMessage(TKV_LOG_LEVEL_##level, __FILE__, __LINE__).stream()
