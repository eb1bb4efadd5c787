// The peer store tierkv-bench compares against: a redis-server this
// process starts on a free loopback port, driven through hiredis with the
// same workload as the store cases (threads, value size, keys per call;
// a batch is one pipeline of that depth).
//
//   absl::StatusOr<std::unique_ptr<RedisPeer>> peer = RedisPeer::Start(1 << 30);
//   if (peer.ok()) RegisterRedisCases(peer->get(), value, batch, threads, "redis/b16");
//
// The server is stopped (SIGTERM, then SIGKILL) when the RedisPeer is
// destroyed. Not thread-safe itself; each benchmark thread opens its own
// connection.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace tierkv::bench {

class RedisPeer {
 public:
  // Starts redis-server (found on PATH) with no persistence and LRU
  // eviction above `max_memory`, on 127.0.0.1 and a free port, and waits
  // until it answers PING. NOT_FOUND when redis-server is not installed;
  // UNAVAILABLE when it does not come up.
  static absl::StatusOr<std::unique_ptr<RedisPeer>> Start(uint64_t max_memory);
  ~RedisPeer();

  int port() const { return port_; }
  // "redis-server 7.0.11", as it reports itself.
  const std::string& version() const { return version_; }

 private:
  RedisPeer() = default;
  pid_t pid_ = -1;
  int port_ = 0;
  std::string version_;
};

// Registers "<prefix>/put" (SET of fresh keys) and "<prefix>/get" (GET of
// keys preloaded per thread, each reply's size checked), `batch` commands
// per pipeline, on `threads` threads; each publishes bytes, items and
// p50/p99 per call like the store cases. Preloads the get keys first;
// UNAVAILABLE when that fails.
absl::Status RegisterRedisCases(const RedisPeer& peer, uint64_t value, int batch, int threads,
                                const std::string& prefix);

}  // namespace tierkv::bench
