// tierkv-master's configuration: the one table that defines its flags.
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "config/flags.h"

namespace tierkv {

struct MasterConfig {
  std::string listen;
  int64_t rpc_port = 0;
  int64_t http_port = 0;
  std::string data_dir;
  absl::Duration segment_ttl;
  absl::Duration put_timeout;
  absl::Duration revoke_grace;
  absl::Duration lease_ttl;
  absl::Duration check_interval;
  double high_watermark = 0;
  double low_watermark = 0;
  std::string eviction_policy;  // lru | prefix | chain
  int64_t shards = 0;
  int64_t max_key_bytes = 0;
  int64_t max_batch = 0;
  int64_t max_pending_per_client = 0;
  uint64_t max_message_size = 0;
  uint64_t max_http_body = 0;
  int64_t http_threads = 0;
  int64_t http_max_connections = 0;
  absl::Duration http_idle_timeout;
};

const FlagTable<MasterConfig>& MasterFlags();

// The names --eviction-policy takes (master::ParseEvictionPolicy maps them).
bool ValidEvictionPolicy(const std::string& name);

}  // namespace tierkv
